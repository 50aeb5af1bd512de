"""Per-request grammar state and the batch's token bitmask, filled on the host."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr


class RequestGrammar:
    """Where one request stands in its grammar: it has accepted every output token so far.

    A preempted request keeps its tokens, so its matcher stays valid across the recompute.
    Speculative decoding rolls back the tokens of rejected drafts with `rollback`. Every
    change of the matcher's state goes through this class, which keeps whether the grammar
    has terminated (only a stop token ends it) so the engine's step asks xgrammar once per
    row, not three times.
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self._stop_ids = frozenset(self.matcher.stop_token_ids)
        self._vocab_size: int = compiled.tokenizer_info.vocab_size
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        accepted = self.matcher.accept_token(token_id)
        self._after_accept(token_id, accepted)
        return accepted

    def _after_accept(self, token_id: int, accepted: bool) -> None:
        """Only an accepted stop token can end the grammar: ask xgrammar then, not per token."""
        if accepted and token_id in self._stop_ids:
            self._terminated = self.matcher.is_terminated()

    @staticmethod
    def accept_batch(grammars: Sequence[RequestGrammar], token_ids: Sequence[int]) -> list[bool]:
        """`accept_token` of one token per grammar, in one call into xgrammar (a decode step's
        rows: the per-call overhead was a third of the host time of a 256-row step)."""
        matchers = [g.matcher for g in grammars]
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, list(token_ids))
        for grammar, token, ok in zip(grammars, token_ids, accepted, strict=True):
            grammar._after_accept(token, ok)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._terminated = self.matcher.is_terminated()

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (drafts) the grammar accepts in a row from here, short of
        a stop token that would end it: the position after a drafted stop token is sampled
        unconstrained, and under ignore_eos or min_tokens it would be kept. The state is
        left as it was."""
        accepted = 0
        for token in token_ids:
            if not self.accept_token(token):
                break
            accepted += 1
            if self._terminated:
                self.rollback(accepted)
                return accepted - 1
        self.rollback(accepted)
        return accepted

    @property
    def vocab_size(self) -> int:
        """The token ids the grammar covers (its bitmask's width is this / 32, rounded up)."""
        return self._vocab_size

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self._terminated


class BitmaskFiller:
    """Fills the next-token bitmask of a batch's sampling rows on the host.

    Row i allows token t iff bit t % 32 of word t // 32 is set; rows without a grammar allow
    everything. The mask covers the grammars' vocabulary (`vocab_size`: the tokenizer's, which
    may be smaller than the model's); the sampler forbids the ids past it on constrained rows.
    Two (pinned, for a GPU) buffers are used in turn, so filling one never overwrites a copy
    to the device that is still queued; they grow to the largest batch.
    """

    def __init__(self, vocab_size: int, pin: bool) -> None:
        self.vocab_size = vocab_size
        self.pin = pin
        self._buffers = [self._allocate(0) for _ in range(2)]
        self._turn = 0
        self._batch = xgr.BatchGrammarMatcher()
        # The rows of the last `fill` that come after a drafted stop token that ended their
        # grammar (they emit no token).
        self.ended: list[int] = []

    def _allocate(self, rows: int) -> torch.Tensor:
        shape = xgr.get_bitmask_shape(rows, self.vocab_size)
        return torch.empty(shape, dtype=torch.int32, pin_memory=self.pin and rows > 0)

    def fill(
        self,
        grammars: Sequence[RequestGrammar | None],
        banned: dict[int, list[int]] | None = None,
        ahead: Sequence[Sequence[int]] = (),
    ) -> torch.Tensor | None:
        """The bitmask of rows `grammars` (None: unconstrained), or None if none is constrained.

        `ahead[i]` (speculative decoding): the draft tokens row i comes after, so its mask is
        the grammar's once it has accepted them (the grammars are rolled back after); a row
        whose drafts the grammar refuses, or that comes after the grammar's end, cannot be
        reached and allows everything; the latter are listed in `ended` (a draft model's drafts
        are not cut short of a stop token, as `valid_prefix` cuts prompt lookup's: the stop
        token may be accepted, and a position after it must emit nothing). `banned` (row →
        token ids, e.g. EOS before min_tokens) clears those tokens from a constrained row,
        unless nothing else would be left: the grammar decides then.
        """
        self.ended = []
        if not any(g is not None and not g.is_terminated for g in grammars):
            return None
        self._turn ^= 1
        if len(self._buffers[self._turn]) < len(grammars):
            self._buffers[self._turn] = self._allocate(max(len(grammars), 64))
        bitmask = self._buffers[self._turn][: len(grammars)]
        depth = [len(ahead[i]) if ahead else 0 for i in range(len(grammars))]
        accepted: dict[int, int] = {}  # id(grammar) → drafts it has accepted for this fill
        refused: set[int] = set()  # grammars that refused a draft: deeper rows are unreachable
        # id(grammar) → how many drafts it had accepted when one of them (a stop token) ended it
        ended_at: dict[int, int] = {}
        filled: list[int] = []
        for level in sorted(set(depth)):
            rows = []
            for i, grammar in enumerate(grammars):
                if grammar is None or depth[i] != level or id(grammar) in refused:
                    continue
                done = accepted.get(id(grammar), 0)
                for token in ahead[i][done:level] if ahead else ():
                    if grammar.is_terminated or not grammar.accept_token(token):
                        refused.add(id(grammar))
                        break
                    done += 1
                    if grammar.is_terminated:
                        ended_at.setdefault(id(grammar), done)
                accepted[id(grammar)] = done
                if id(grammar) not in refused and not grammar.is_terminated:
                    rows.append(i)
            if rows:
                matchers = [grammars[i].matcher for i in rows]  # type: ignore[union-attr]
                self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
                filled += rows
        if len(filled) < len(grammars):
            # Unconstrained and unreachable rows allow every token; filled rows were written
            # whole, so only the others are set (no memset of the batch's mask).
            others = np.ones(len(grammars), dtype=bool)
            others[filled] = False
            bitmask[torch.from_numpy(others)] = -1
        self.ended = [
            i
            for i, g in enumerate(grammars)
            if g is not None and id(g) in ended_at and depth[i] >= ended_at[id(g)]
        ]
        for grammar in {id(g): g for g in grammars if g is not None}.values():
            grammar.rollback(accepted.get(id(grammar), 0))
        for row, ids in (banned or {}).items():
            ids = [t for t in ids if t < self.vocab_size]  # the others are past the mask: banned
            if ids:
                _clear_unless_empty(bitmask.numpy()[row], ids)
        return bitmask


def _clear_unless_empty(words: np.ndarray, token_ids: list[int]) -> None:
    ids = np.asarray(token_ids, dtype=np.int64)
    view = words.view(np.uint32)
    cleared = view.copy()
    np.bitwise_and.at(cleared, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
    if cleared.any():
        view[:] = cleared
