"""Adaptive speculation: how many tokens each request drafts in a step (0: none), chosen from
its measured acceptance and the measured cost of the step's size.

Gain. A request whose drafts the target accepts with probability `a` each (given the ones
before were accepted) emits `E(a, k) = 1 + a + ... + a^k` tokens from a verify of k drafts, and
1 from a plain decode. `a` is read from the request's `AcceptanceEstimate` (tokenmill/batch.py):
its posterior mean plus one standard deviation, optimistic while the request has little record.

Cost. `StepCost` learns the seconds of one engine step as a function of the query tokens its
forward computes (a decode row counts 1, a verify row 1 + k; with CUDA graphs every row of a
verify step counts as its longest row, padding included), from the steps the engine measures,
plain decode steps and verify steps apart (a verify step also carries the host's work). A
size never measured is assumed as cheap as it plausibly could be: above the largest measured
step, no dearer than it (memory-bound); below the smallest, cheaper in proportion to its
tokens (compute-bound). So the policy tries it, and the measurement corrects the table: with
nothing measured every row drafts all it can, and the plain batch is measured next.

Choice (`choose_num_drafts`). For every cap K = 1..k_max each row may draft min(K, what it
can); rows are taken in order of expected tokens gained per drafted token, and the policy keeps
the (K, number of drafting rows) with the most expected tokens per second of the whole step, if
that beats drafting nothing by `MIN_SPEEDUP`. While the step is memory-bound extra query tokens
are nearly free and every row drafts its most; once the plain batch is compute-bound a drafted
token costs what a decode does but yields less than one token, and speculation turns off. With
CUDA graphs (`padded`) a step costs its rows times its longest row: a row drafting fewer saves
nothing there, so every row drafts min(K, what it can), and one drafting row costs them all.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

# A size's price is the lower median of its last this many measurements: a step the host was
# kept from (a garbage collection, another process) must not price its size, even for a few
# steps. A plain step measured 20x too dear once (an exponentially weighted mean moved a
# quarter of the way) made drafting look cheap, and the policy, drafting, never measured a
# plain step again (simulated, `benchmarks/adaptive_replay.py --learn --outliers 0.01`, B4's
# batch 64 at a = 0.6: 331 verify steps of 434, x0.84 of plain decoding).
RECENT_MEASUREMENTS = 5
# While the policy drafts, a plain step is measured only when it declines: a plain price
# measured high early (a slow first step) would keep it drafting for good. The scheduler runs
# one plain step (`Scheduler._plan_drafts`) once the last plain step measured is this many
# measured steps old: at most one step in this many costs what drafting would have gained.
PLAIN_RECHECK_STEPS = 64
# Drafting must promise this many times plain decoding's tokens per second: the costs are
# measured, so noisy, and a near tie is not worth a synchronous step.
MIN_SPEEDUP = 1.1
# Sizes up to this many tokens are measured exactly; above, per quarter octave.
EXACT_SIZES = 16


def token_bucket(num_tokens: int) -> int:
    """The step size `num_tokens` is measured as: itself up to `EXACT_SIZES`, above that the
    nearest of four sizes per doubling (..., 16, 19, 23, 27, 32, 38, ...)."""
    if num_tokens <= EXACT_SIZES:
        return num_tokens
    return round(2 ** (round(4 * math.log2(num_tokens)) / 4))


class _SizeTable:
    """Measured seconds per `token_bucket` (the lower median of its last
    `RECENT_MEASUREMENTS` measurements each), with how many steps measured each size."""

    def __init__(self) -> None:
        self.recent: dict[int, deque[float]] = {}
        self.seconds: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.sizes = np.zeros(0)
        self.values = np.zeros(0)

    def observe(self, num_tokens: int, seconds: float) -> None:
        size = token_bucket(num_tokens)
        recent = self.recent.setdefault(size, deque(maxlen=RECENT_MEASUREMENTS))
        recent.append(seconds)
        self.seconds[size] = sorted(recent)[(len(recent) - 1) // 2]
        self.counts[size] = self.counts.get(size, 0) + 1
        sizes = sorted(self.seconds)
        self.sizes = np.array(sizes, dtype=np.float64)
        self.values = np.array([self.seconds[s] for s in sizes])


class StepCost:
    """Seconds of one engine step, as a function of its query tokens, learned from measured
    steps: one table for plain decode steps, one for verify steps (some row drafted).

    The two differ at the same size: a verify step is read before the next step is planned
    (the drafts continue its tokens), so the host's work between steps adds to it, where plain
    steps overlap that work with the device; and a verify's tokens come from fewer rows. One
    table mixing them priced a plain batch of 64 rows at what 16 rows verifying 4 drafts each
    had cost at the end of a run, twice the plain step's own cost (B4, Qwen3-0.6B, batch 64 on
    an H200: adaptive speculation drafted on and ran x0.83 of plain decoding at a = 0.6).

    A kind with nothing measured yet is priced from the other's table. Below its smallest
    measured size a verify is priced between the plain steps measured below that size (no
    cheaper than decoding as many tokens), not in proportion to its tokens. A step is priced
    no dearer than a larger one of its kind measured (a verify: nor than a larger one of the
    plain steps it is priced between), and a plain step no dearer than any larger step:
    computing more tokens does not take less time, and a size measured once while something
    else held the host (the first plain step of 256 rows: 62 ms, where plain decoding ran 14 ms
    a step) would otherwise stand for good once it makes the policy avoid that size
    (llama-3.1-8b, B4 batch 256, a = 0.6: adaptive speculation drafted on, x0.80)."""

    def __init__(self) -> None:
        self._tables = {kind: _SizeTable() for kind in (False, True)}
        self.measured = 0  # steps measured so far, of both kinds
        self._last_plain: int | None = None  # `measured` at the last plain step
        # Each kind's price curve, built on first use after a measurement (None: nothing yet).
        self._curves: dict[bool, _Curve | None] = {}

    def observe(self, num_tokens: int, seconds: float, verify: bool) -> None:
        """Record one measured step of `num_tokens` query tokens (`verify`: a row drafted)."""
        self.measured += 1
        if not verify:
            self._last_plain = self.measured
        self._tables[verify].observe(num_tokens, seconds)
        self._curves.clear()

    def plain_age(self) -> int | None:
        """Steps measured since the last plain step, of any size (None: none yet). Any size:
        with CUDA graphs a plain step is measured at its graph's padded size, not its rows'."""
        return None if self._last_plain is None else self.measured - self._last_plain

    def table(self, verify: bool) -> dict[int, tuple[float, int]]:
        """Each measured size of plain or verify steps: its estimate in seconds and how many
        steps measured it."""
        t = self._tables[verify]
        return {size: (t.seconds[size], t.counts[size]) for size in sorted(t.seconds)}

    def predict(self, num_tokens: np.ndarray, verify: bool) -> np.ndarray:
        """Seconds of plain or verify steps of `num_tokens` (any shape): interpolated between
        measured sizes, optimistic outside them (see the module docstring); 1.0 before any
        measurement."""
        n = np.asarray(num_tokens, dtype=np.float64)
        if verify not in self._curves:
            self._curves[verify] = self._curve(verify)
        curve = self._curves[verify]
        if curve is None:
            return np.ones_like(n)
        sizes, values = curve.sizes, curve.values
        seconds = np.interp(n, sizes, values)
        seconds = np.where(n < sizes[0], values[0] * n / sizes[0], seconds)
        return np.minimum(seconds, curve.caps[np.searchsorted(curve.cap_sizes, n)])

    def _curve(self, verify: bool) -> _Curve | None:
        plain, verifies = self._tables[False], self._tables[True]
        own = verifies if verify else plain
        if not own.seconds:
            own = plain if verify else verifies
        if not own.seconds:
            return None
        sizes, values = own.sizes, own.values
        if own is verifies and plain.seconds:
            below = plain.sizes < sizes[0]
            sizes = np.concatenate([plain.sizes[below], sizes])
            values = np.concatenate([plain.values[below], values])
        # A verify is capped by its own points (the plain ones below its sizes included), a
        # plain step by every step measured.
        larger = [(sizes, values)] if verify else [(t.sizes, t.values) for t in (plain, verifies)]
        cap_sizes = np.concatenate([s for s, _ in larger])
        order = np.argsort(cap_sizes, kind="stable")
        cap_values = np.concatenate([v for _, v in larger])[order]
        # At n tokens: the cheapest step measured at n or more (inf: none that large).
        caps = np.append(np.minimum.accumulate(cap_values[::-1])[::-1], np.inf)
        return _Curve(sizes, values, cap_sizes[order], caps)


@dataclass(frozen=True)
class _Curve:
    """What `StepCost.predict` interpolates (`sizes` -> `values`) and caps it with (`caps[i]`
    for sizes up to `cap_sizes[i]`)."""

    sizes: np.ndarray
    values: np.ndarray
    cap_sizes: np.ndarray
    caps: np.ndarray


def step_seconds(
    device: float, interval: float, synchronous: bool, plain: bool, overlaps: bool
) -> float:
    """What one engine step cost: the `interval` from its launch to the next step's launch
    (its device time `device` and all the host's work between the two, whichever overlapped).

    A plain decode step (`plain`: no drafts) on a device that `overlaps` host and device work
    counts as overlapped even when it ran `synchronous`ly (a row could have drafted, so it was
    read first: the interval is then its device time plus the host's): the slower of the two.
    Once the policy drafts nothing the engine's plain steps do overlap, and that is what
    drafting must beat. Counted synchronous, a plain step carried the host's time on top of its
    device time, and verify steps slower than overlapped plain decoding looked worth it (B4,
    Qwen3-0.6B, batch 64 on an H200: adaptive x0.61 where fixed k ran x0.66).
    """
    if synchronous and plain and overlaps:
        return max(device, interval - device)
    return interval


def expected_tokens(rate: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Tokens a verify of `num_drafts` drafts emits on average, each draft accepted with
    probability `rate` after the ones before it: `1 + a + ... + a^k`."""
    a = np.minimum(np.asarray(rate, dtype=np.float64), 1 - 1e-9)
    return (1 - a ** (np.asarray(num_drafts) + 1)) / (1 - a)


def choose_num_drafts(
    rates: np.ndarray,
    available: np.ndarray,
    pinned: np.ndarray,
    other_tokens: int,
    other_rows: int,
    cost: StepCost,
    padded: bool = False,
) -> np.ndarray:
    """How many tokens each decoding row drafts this step.

    `rates` `[R]`: each row's per-draft acceptance; `available` `[R]`: the most it can draft
    now (0: none); `pinned` `[R]`: rows that draft `available` whatever the batch (a seeded
    sampled request: its tokens must not depend on its batch). `other_tokens` and
    `other_rows`: the query tokens and rows of the step's other rows (prefill chunks, rows
    whose token is still on the device), which emit at most one token each. `padded`: the
    step runs a CUDA graph that computes every row at its longest row's length, so a step
    costs its rows times (1 + its most drafts), and rows drafting fewer save nothing.
    """
    chosen = np.where(pinned, available, 0)
    free = np.flatnonzero(~pinned & (available > 0))
    if not len(free):
        return chosen
    num_rows = len(rates) + other_rows
    base_yield = float(other_rows + len(rates))
    if chosen.any():  # pinned rows' drafts are part of the base step
        base_yield += float((expected_tokens(rates, chosen) - 1).sum())
    base_tokens = other_tokens + len(rates) + int(chosen.sum())
    widest = int(chosen.max())
    if padded:
        base_tokens = num_rows * (1 + widest)
    offers = available[free]
    caps = np.arange(1, int(offers.max()) + 1)[:, None]  # [K, 1]
    drafts = np.minimum(caps, offers[None, :])  # [K, F]
    gain = expected_tokens(rates[free][None, :], drafts) - 1
    order = np.argsort(-gain / drafts, axis=1, kind="stable")  # best gain per token first
    picked = (caps - 1, order)  # [K, F] indices of the rows in that order, per cap
    ordered = drafts[picked]
    if padded:
        tokens = num_rows * (1 + np.maximum(widest, np.maximum.accumulate(ordered, axis=1)))
    else:
        tokens = base_tokens + np.cumsum(ordered, axis=1)
    tokens_per_s = (base_yield + np.cumsum(gain[picked], axis=1)) / cost.predict(tokens, True)
    base_seconds = float(cost.predict(np.array(base_tokens), verify=widest > 0))
    best = int(np.argmax(tokens_per_s))
    cap, last = divmod(best, tokens_per_s.shape[1])
    if tokens_per_s[cap, last] < MIN_SPEEDUP * base_yield / base_seconds:
        return chosen
    rows = order[cap, : last + 1]
    chosen[free[rows]] = drafts[cap, rows]
    return chosen
