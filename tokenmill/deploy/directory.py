"""The replica directory: a small named Ray actor where replicas list their servers' addresses,
so that the ingress can gather every replica's /metrics (labelled by replica)."""

from __future__ import annotations

import ray

NAMESPACE = "tokenmill"


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    """replica id -> its server's base URL."""

    def __init__(self) -> None:
        self.servers: dict[str, str] = {}

    def register(self, replica_id: str, url: str) -> None:
        self.servers[replica_id] = url

    def unregister(self, replica_id: str) -> None:
        self.servers.pop(replica_id, None)

    def list(self) -> dict[str, str]:
        return dict(self.servers)


def directory(app_name: str) -> ray.actor.ActorHandle:
    """The directory of application `app_name` (created by the first caller)."""
    return ReplicaDirectory.options(
        name=f"directory:{app_name}", namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
