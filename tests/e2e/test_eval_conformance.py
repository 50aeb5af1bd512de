"""`tokenmill eval conformance` against real servers: passes on a correct one, and names the fault
precisely on one started with another chat template and another dtype."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import ServerHandle, run_server
from tokenmill.entrypoints.cli import main
from tokenmill.evals.options import THRESHOLDS

FLAGS = ["--max-model-len", "160"]
# ChatML with "role: " instead of "role\n": a plausible template bug.
WRONG_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def correct(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("conformance") / "correct.log"
    with run_server(llama_dir, log, *FLAGS) as handle:
        yield handle


@pytest.fixture(scope="module")
def faulty(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    # The checkpoint is float32: this server runs it in bfloat16, with the wrong template.
    log = tmp_path_factory.mktemp("conformance") / "faulty.log"
    args = [*FLAGS, "--dtype", "bfloat16", "--chat-template", WRONG_TEMPLATE]
    with run_server(llama_dir, log, *args) as handle:
        yield handle


def _conformance(server: ServerHandle, model: Path, tmp: Path, *extra: str) -> tuple[int, dict]:
    out = tmp / "report.json"
    argv = [
        "eval", "conformance", "--base-url", server.base_url, "--model", str(model),
        "--lengths", "16,100", "--max-tokens", "12", "--output", str(out), *extra,
    ]  # fmt: skip
    code = main(argv)
    return code, json.loads(out.read_text())


def test_conformance_passes_on_a_correct_server(
    correct: ServerHandle, llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, report = _conformance(correct, llama_dir, tmp_path, "--plot", str(tmp_path / "a.png"))
    assert code == 0, report["failures"]
    assert report["passed"] and report["server_dtype"] == "float32"
    summary = report["summary"]
    assert summary["top1_agreement"] == 1.0 and summary["max_logprob_error"] < 1e-3
    assert set(report["groups"]) == {"text", "token-ids", "chat", "prefix-hit"}
    assert report["groups"]["prefix-hit"]["cached_prompt_tokens"] > 0  # served from the cache
    assert all(c["match"] for c in report["tokenization"])
    assert len(report["per_position"]["top1_agreement"]) == 12
    assert all(len(s["output_token_ids"]) == 12 for s in report["sequences"])
    assert (tmp_path / "a.png").stat().st_size > 10_000
    assert "PASS" in capsys.readouterr().out


def test_conformance_names_a_wrong_chat_template_and_dtype(
    faulty: ServerHandle, llama_dir: Path, tmp_path: Path
) -> None:
    code, report = _conformance(faulty, llama_dir, tmp_path)
    assert code == 1 and not report["passed"]
    # The template: each chat's first differing token, with ids and text on both sides.
    chats = [c for c in report["tokenization"] if c["kind"] == "chat"]
    assert chats and not any(c["match"] for c in chats)
    difference = chats[0]["first_difference"]
    assert difference["server"][1] == ":" and difference["reference"][1] == "\n"
    assert any("chat template at token" in f for f in report["failures"])
    # Text prompts do not touch the template: they match, and their logprobs show the dtype.
    assert all(c["match"] for c in report["tokenization"] if c["kind"] == "text")
    errors = [report["groups"][g]["max_logprob_error"] for g in ("text", "token-ids", "prefix-hit")]
    assert max(errors) > report["thresholds"]["max_logprob_error"] == 0.01
    assert any(f.startswith("max logprob error") for f in report["failures"])
    # Within the thresholds of the precision it does run in (--server-dtype bfloat16).
    bf16 = THRESHOLDS["bfloat16"]
    for group in ("text", "token-ids", "prefix-hit"):
        stats = report["groups"][group]
        assert stats["top1_agreement"] >= bf16.min_top1, (group, stats)
        assert stats["max_logprob_error"] <= bf16.max_logprob_error, (group, stats)
