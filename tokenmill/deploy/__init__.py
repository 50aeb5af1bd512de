"""Replicas on Ray Serve (`pip install 'tokenmill[ray]'`): many tokenmill servers behind one
OpenAI-compatible endpoint, a prefix-cache-aware router, and autoscaling on queue depth.

`tokenmill serve --replicas N` uses it; so can your own Ray Serve application::

    from ray import serve
    from tokenmill.config import EngineArgs
    from tokenmill.deploy import DeployOptions, build_app

    app = build_app(EngineArgs(model="/models/qwen3"), deploy=DeployOptions(
        min_replicas=1, max_replicas=4, replica_num_gpus=1))
    serve.run(app, name="tokenmill", route_prefix="/")

`build_app` returns the application (an ingress deployment bound to the replica deployment);
`DeployOptions` (Ray-free) holds replica counts, autoscaling and router settings; the routing
policy is `tokenmill.deploy.routing` and its Ray router `tokenmill.deploy.router`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.deploy.options import DeployOptions

if TYPE_CHECKING:
    from ray.serve import Application

__all__ = ["DeployOptions", "build_app"]


def build_app(*args: Any, **kwargs: Any) -> Application:
    """`tokenmill.deploy.app.build_app` (imported on use: Ray is an optional dependency)."""
    try:
        from tokenmill.deploy.app import build_app as build
    except ImportError as exc:
        raise ImportError(f"replicas need Ray Serve ({exc}): pip install 'tokenmill[ray]'") from exc
    return build(*args, **kwargs)
