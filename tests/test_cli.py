"""The `tokenmill` command line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.cli import main


def test_generate_prints_each_completion(llama_dir: Path, capsys) -> None:
    code = main(["generate", "--model", str(llama_dir), "Hello", "world", "--max-tokens", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "=== 'Hello' (length, 5 tokens)" in out
    assert "=== 'world' (length, 5 tokens)" in out


def test_generate_chat_uses_the_template(llama_dir: Path, capsys) -> None:
    assert main(["generate", "--model", str(llama_dir), "--chat", "Hi", "--max-tokens", "3"]) == 0
    assert "(length, 3 tokens)" in capsys.readouterr().out


def test_chat_keeps_the_conversation(llama_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nHow are you?\n\nnever read\n"))
    code = main(["chat", "--model", str(llama_dir), "--system", "Be brief.", "--max-tokens", "4"])
    assert code == 0
    replies = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("assistant:")
    ]
    assert len(replies) == 2  # the empty line ends the chat


def test_sampling_flags_not_given_take_the_models_generation_config(
    llama_dir: Path, tmp_path: Path, capsys
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    args = ["--model", str(llama_dir), "--generation-config", str(tmp_path), "Hi", "--ignore-eos"]
    assert main(["generate", *args]) == 0
    assert "(length, 3 tokens)" in capsys.readouterr().out
    assert main(["generate", *args, "--max-tokens", "2"]) == 0  # a flag given wins
    assert "(length, 2 tokens)" in capsys.readouterr().out


def test_bad_option_is_an_error_message_not_a_traceback(llama_dir: Path, capsys) -> None:
    code = main(["generate", "--model", str(llama_dir), "x", "--temperature", "-1"])
    assert code == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_help_documents_every_engine_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in EngineArgs.__dataclass_fields__:
        if name != "model":
            assert "--" + name.replace("_", "-") in out


def test_bench_offline_b1_and_b2_on_the_cpu(llama_dir: Path, tmp_path: Path, capsys) -> None:
    b1, b2 = tmp_path / "b1.json", tmp_path / "b2.json"
    common = ["--config", str(llama_dir), "--device", "cpu", "--dtype", "float32"]
    assert main(["bench", "offline", *common, "--workload", "b1", "--input-len", "16",
                 "--output-len", "8", "--output", str(b1)]) == 0  # fmt: skip
    report = json.loads(b1.read_text())
    assert (
        report["tokenmill"]["output_tok_s"] > 0 and report["transformers"]["method"] == "generate"
    )
    b2_args = ["--workload", "b2", "--num-requests", "4", "--min-len", "8", "--max-len", "16"]
    assert main(["bench", "offline", *common, *b2_args, "--no-peer", "--output", str(b2)]) == 0
    report = json.loads(b2.read_text())
    assert report["tokenmill"]["requests"] == 4 and report["tokenmill"]["engine_steps"] > 0
    assert "transformers" not in report
    out = capsys.readouterr().out
    assert "B1 llama" in out and "B2 llama" in out and "transformers not run" in out


def test_bench_roofline_prints_the_floor(capsys) -> None:
    config = Path(__file__).parent / "data" / "llama-3.1-8b"
    assert main(["bench", "roofline", "--config", str(config), "--workload", "b1"]) == 0
    out = capsys.readouterr().out
    # 15.0 GB of bf16 weights per step at 4.27 TB/s: ~3.5 ms, ~283 tok/s.
    assert "B1 floor: 3.5" in out and "283 tok/s" in out


def test_version_answers_without_importing_torch() -> None:
    code = "import sys; from tokenmill.__main__ import main; main(['--version']); " \
        "print('torch' in sys.modules)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["tokenmill", "0.1.0", "False"]


def test_log_level_is_accepted_after_the_subcommand() -> None:
    from tokenmill.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "x", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "generate", "x"]).log_level == "ERROR"
    assert parser.parse_args(["generate", "x"]).log_level == "INFO"
    bench = ["bench", "serve", "--model", "m", "--log-level", "WARNING"]
    assert parser.parse_args(bench).log_level == "WARNING"


def test_bad_sampling_option_fails_before_the_model_loads(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-such-checkpoint"  # loading it would fail with another message
    assert main(["generate", "--model", str(missing), "x", "--max-tokens", "0"]) == 2
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err
