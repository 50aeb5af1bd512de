"""GrammarCompiler: compiles structured-output grammars on a background thread, each spec once."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import build_grammar
from tokenmill.tokenization.tokenizer import has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Turns constraints into xgrammar `CompiledGrammar`s for one tokenizer, off the caller thread.

    `submit` returns at once with a future, shared by every request with the same (kind, spec):
    the engine's scheduler thread never waits for a compile; a request whose grammar is not
    ready waits outside the batch. xgrammar compiles in C++ without holding the GIL, so the
    scheduler keeps stepping meanwhile. The tokenizer is loaded by the first compile.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        if not has_tokenizer(tokenizer_path):
            raise ValueError(
                f"structured_outputs needs the model's tokenizer; none in {tokenizer_path}"
            )
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None  # used on the background thread only
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `params`, done at once when it was compiled before."""
        key = (params.kind, params.spec)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._executor.submit(self._compile, *key)
        self._cache[key] = future
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=_threads())
        start = time.perf_counter()
        compiled = self._compiler.compile_grammar(build_grammar(kind, spec))
        seconds = time.perf_counter() - start
        self.num_compiled += 1
        self.compile_seconds += seconds
        logger.debug("compiled a %s grammar in %.1f ms", kind, seconds * 1e3)
        if not can_start(compiled):
            raise ValueError(
                f"structured_outputs.{kind} matches no text this model's tokenizer can produce "
                "(its first token allows nothing, not even the end)"
            )
        return compiled

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        tokenizer = load_tokenizer(self.tokenizer_path)
        assert tokenizer is not None  # checked on construction
        size = max(tokenizer.get_vocab().values()) + 1  # added tokens may leave gaps: not len()
        vocab_size = grammar_vocab_size(size, self.vocab_size, self.stop_token_ids)
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )

    def shutdown(self) -> None:
        """Stop the background thread (pending compiles are cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def can_start(compiled: xgr.CompiledGrammar) -> bool:
    """Whether a generation under `compiled` has a first token (the end counts: a grammar of
    the empty string allows the stop token). A grammar that allows none, e.g. `root ::= root`
    or a regex of characters no token holds, passes every syntax check and would fail the
    request at its first sampled token."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def grammar_vocab_size(tokenizer_size: int, model_vocab_size: int, stop_ids: Sequence[int]) -> int:
    """The token ids a grammar covers: the tokenizer's and the stop tokens, not the padding of
    the model's embedding past them (the sampler forbids those on constrained rows).

    xgrammar treats every id past the tokenizer as a special token and scans that list on each
    accepted token and clears it in each mask: a tokenizer of 8,192 tokens under a model of
    151,936 cost ~90 µs per accept and ~450 µs per mask row on the host.
    """
    return min(model_vocab_size, max(tokenizer_size, max(stop_ids, default=-1) + 1))


def _threads() -> int:
    """xgrammar's own compile threads: half the cores, at most 8 (the engine needs the rest)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))
