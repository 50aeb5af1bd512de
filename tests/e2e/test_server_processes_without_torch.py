"""A real `tokenmill serve`: only the engine core loads torch. The api server, the tokenizer
workers and the detokenizer serve text without it (importing torch is seconds of each one's
start-up, on the path to the first completion)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.e2e.server import MODEL_NAME, run_server


def _loads_torch(pid: int) -> bool:
    """Whether process `pid` has torch's shared library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_only_the_engine_core_loads_torch(llama_dir: Path, tmp_path: Path) -> None:
    with run_server(llama_dir, tmp_path / "log") as server:
        completion = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
        for route, body in [("/v1/completions", completion), ("/v1/chat/completions", chat)]:
            response = httpx.post(server.base_url + route, json={**body, "max_tokens": 4})
            assert response.status_code == 200, response.text
        tokenized = httpx.post(server.base_url + "/tokenize", json={"model": MODEL_NAME, **chat})
        assert tokenized.status_code == 200, tokenized.text
        children = server.child_pids()
        assert _loads_torch(children["engine-core"])  # the check sees torch where it is
        for name in ("detokenizer", "tokenizer-0"):
            assert not _loads_torch(children[name]), name
        assert not _loads_torch(server.proc.pid)
