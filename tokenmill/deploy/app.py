"""The Ray Serve application: an `Ingress` in front of `TokenmillReplica`s, and `run`, which
starts (or joins) Ray, deploys it, and serves until SIGINT/SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import threading
from collections.abc import Mapping
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from tokenmill.config import EngineArgs
from tokenmill.deploy.directory import NAMESPACE, directory
from tokenmill.deploy.ingress import Ingress
from tokenmill.deploy.options import DeployOptions
from tokenmill.deploy.replica import TokenmillReplica
from tokenmill.entrypoints.api_server import bind_socket
from tokenmill.entrypoints.server_options import ServerOptions

logger = logging.getLogger("tokenmill.deploy")

ROUTER_CLASSES = {
    "prefix": "tokenmill.deploy.router.PrefixAwareRouter",
    "round-robin": "tokenmill.deploy.router.RoundRobinRouter",
}
STARTUP_TIMEOUT_S = 900.0
# A draining replica finishes its in-flight requests for up to this long before it is killed.
DRAIN_TIMEOUT_S = 600.0


def server_argv(engine: EngineArgs, options: ServerOptions) -> list[str]:
    """`tokenmill serve` arguments that reproduce `engine` and `options` (but the address,
    which each replica picks)."""
    argv = [engine.model]
    for obj, skip in ((engine, {"model"}), (options, {"host", "port"})):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in skip or value == f.default or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, tuple):
                argv += [flag, json.dumps(list(value))]
            elif isinstance(value, Mapping):  # e.g. speculative_config: its JSON
                argv += [flag, json.dumps(dict(value))]
            else:
                argv += [flag, str(value)]
    return argv


def build_app(
    engine: EngineArgs,
    options: ServerOptions | None = None,
    deploy: DeployOptions | None = None,
    name: str = "tokenmill",
) -> serve.Application:
    """The Ray Serve application of `engine` served with `options` over `deploy`'s replicas;
    deploy it with `serve.run(app, name=name)` (`name` must match)."""
    options = options or ServerOptions()
    deploy = deploy or DeployOptions(replicas=1)
    scaling: dict[str, Any] = {"num_replicas": deploy.initial_replicas}
    if deploy.autoscaling:
        scaling = {
            "autoscaling_config": {
                "min_replicas": deploy.min_replicas,
                "max_replicas": deploy.max_replicas,
                "initial_replicas": deploy.initial_replicas,
                "target_ongoing_requests": deploy.target_ongoing_requests,
                "upscale_delay_s": deploy.upscale_delay_s,
                "downscale_delay_s": deploy.downscale_delay_s,
                "metrics_interval_s": 1.0,
                "look_back_period_s": 5.0,
            }
        }
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASSES[deploy.router],
        request_router_kwargs={"max_imbalance": deploy.max_imbalance},
    )
    replica = serve.deployment(TokenmillReplica, name="TokenmillReplica").options(
        **scaling,
        max_ongoing_requests=deploy.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": deploy.replica_num_cpus,
            "num_gpus": deploy.replica_num_gpus,
        },
        request_router_config=router,
        graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0,
        # A replica that fails to start fails the same way again: say so soon.
        max_constructor_retry_count=2,
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0}
    )
    replicas = replica.bind(server_argv(engine, options), name, STARTUP_TIMEOUT_S)
    return ingress.bind(replicas, name, options.max_request_body_bytes)


def deploy_app(
    engine: EngineArgs,
    options: ServerOptions,
    deploy: DeployOptions,
    name: str = "tokenmill",
) -> None:
    """Start Ray Serve's HTTP proxy on `options`' address and deploy the application (Ray must
    be initialised); returns once every replica is healthy."""
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_app(engine, options, deploy, name), name=name, route_prefix="/")


def shutdown_app(name: str = "tokenmill") -> None:
    """Delete the application (replicas drain first) and its replica directory."""
    serve.delete(name)
    ray.kill(directory(name))


def run(engine: EngineArgs, options: ServerOptions, deploy: DeployOptions) -> int:
    """`tokenmill serve --replicas N`: serve until SIGINT/SIGTERM; returns an exit code. What
    cannot work (an address that cannot be listened on, a Ray cluster that cannot be joined,
    replicas that do not fit in a local Ray instance) is a `ValueError` naming the option."""
    bind_socket(options.host, options.port).close()  # Ray Serve's proxy binds it later
    _init_ray(deploy.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if deploy.ray_address is None:
            deploy.check_fits(ray.cluster_resources())
        deploy_app(engine, options, deploy)
        logger.info(
            "tokenmill serving %r on http://%s:%d through Ray Serve",
            engine.model,
            options.host,
            options.port,
        )
        stop.wait()
        logger.info("shutting down: draining the replicas")
        shutdown_app()
    finally:
        if deploy.ray_address is None:
            serve.shutdown()
        ray.shutdown()
    return 0


def _init_ray(address: str | None) -> None:
    """Start a local Ray instance (`address` None) or join the cluster at `address`."""
    try:
        ray.init(address=address, namespace=NAMESPACE)
    except (ConnectionError, ValueError) as exc:
        if address is None:
            raise
        raise ValueError(f"ray_address {address!r}: {exc}") from None
