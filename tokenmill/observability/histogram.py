"""A bucketed histogram that crosses process boundaries as a msgspec struct."""

from __future__ import annotations

import bisect

import msgspec

# Upper bounds (seconds) for step-level timings, from 100 µs to 5 s.
STEP_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram(msgspec.Struct):
    """Cumulative counts per upper bound (`counts[i]` for values <= `bounds[i]`, last is +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @staticmethod
    def new(bounds: tuple[float, ...]) -> Histogram:
        return Histogram(bounds=bounds, counts=[0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)
