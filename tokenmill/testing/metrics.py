"""The api server's /metrics page for engine stats, as a test builds it without a server."""

from __future__ import annotations

import msgspec

from tokenmill.ipc.messages import EngineStats
from tokenmill.ipc.sockets import encode
from tokenmill.observability.metrics import ServerMetrics


def metrics_page(stats: EngineStats, model_name: str = "m") -> str:
    """/metrics of a server for `model_name` whose engine core sent `stats` (encoded and
    decoded, as the IPC carries them)."""
    metrics = ServerMetrics(model_name, trace_file=None, log_requests=False)
    metrics.engine.stats = msgspec.msgpack.decode(encode(stats), type=EngineStats)
    return metrics.render().decode()
