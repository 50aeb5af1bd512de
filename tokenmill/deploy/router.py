"""The Ray Serve request routers of tokenmill replicas (`RequestRouterConfig`'s classes).

`PrefixAwareRouter` wraps the policy of `routing.RouterState` (longest routed prefix, session
affinity, bounded imbalance); `RoundRobinRouter` is the baseline it is measured against. Both
run inside the process that holds the deployment handle (the ingress), and read the
`RoutedRequest` the ingress passes as the call's first argument.
"""

from __future__ import annotations

import itertools

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tokenmill.deploy.routing import RoutedRequest, RouterState


def _routed(pending: PendingRequest | None) -> RoutedRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], RoutedRequest):
        return None
    return pending.args[0]


class PrefixAwareRouter(RequestRouter):
    """Longest cached prefix first, a session's turns to one replica, within `max_imbalance`
    requests in flight of the least loaded replica (see `routing.py`)."""

    def initialize_state(self, max_imbalance: int = 8) -> None:
        self.policy = RouterState(max_imbalance=max_imbalance)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        ranks = self.policy.rank(list(by_id), _routed(pending_request))
        return [[by_id[r] for r in rank] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.policy.routed(_routed(pending_request), request_id, replica_id.to_full_id_str())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.to_full_id_str() for r in self._replica_id_set}
        super().update_replicas(replicas)
        after = {r.to_full_id_str() for r in self._replica_id_set}
        for gone in before - after:
            self.policy.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.to_full_id_str())


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (the baseline); a retry skips failed ones."""

    def initialize_state(self, max_imbalance: int = 8) -> None:
        self._turn = itertools.count()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        routed = _routed(pending_request)
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.to_full_id_str())
        if routed is not None and routed.avoid:
            others = [r for r in ordered if r.replica_id.to_full_id_str() not in routed.avoid]
            ordered = others or ordered
        if not ordered:
            return []
        first = next(self._turn) % len(ordered)
        return [[r] for r in ordered[first:] + ordered[:first]]
