"""What the engine reports about a request when it finishes, for metrics and traces."""

from __future__ import annotations

import msgspec


class RequestMetrics(msgspec.Struct):
    """Engine-side timestamps (wall clock, seconds) and counts of one finished request."""

    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    num_preemptions: int
    prompt_token_ids: list[int]

    @property
    def queue_seconds(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def prefill_seconds(self) -> float | None:
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.scheduled_time

    @property
    def decode_seconds(self) -> float | None:
        return None if self.first_token_time is None else self.finish_time - self.first_token_time
