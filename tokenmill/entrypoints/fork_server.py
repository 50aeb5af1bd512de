"""The fork server the api server starts its tokenizer and detokenizer workers from.

Its first start imports the workers' modules: transformers' tokenizer classes and tokenizers,
without torch (1.3 s on a laptop; 7-11 s on the machines measured while it was AutoTokenizer's
module, which imports torch). `tokenmill serve` starts it first thing (after the engine core,
`early_start`), so that those imports run beside the api server's own instead of after them: on
the H200 they took 11 s after the server's, and ended 6 s after the engine core was ready, in a
23 s warm start of qwen3-0.6b (the engine's first stats reach the server through the
detokenizer, forked from here). This module imports nothing heavy, so that starting it costs
nothing.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from collections.abc import Iterable

from tokenmill.tokenization.tokenizer_class import CLASS_MODULES

# What every worker started from the fork server needs: its module and the tokenizer classes
# `load_tokenizer` calls directly (a checkpoint it cannot, AutoTokenizer's: torch and all, is
# imported by each worker when it loads its tokenizer).
WORKER_MODULES = (
    "tokenmill.tokenization.detokenizer_worker",
    "tokenmill.tokenization.tokenizer_worker",
    *CLASS_MODULES.values(),
)


def start_fork_server(modules: Iterable[str] = ()) -> None:
    """Start the fork server with `WORKER_MODULES` and `modules` imported, unless it runs
    already (then `modules` are imported by each worker after it forks). Returns at once: the
    imports happen in the fork server, and the first fork waits for them."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(sorted({*WORKER_MODULES, *modules}))
    multiprocessing.forkserver.ensure_running()
