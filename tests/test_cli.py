"""The `tokenmill` command line."""

from __future__ import annotations

import io
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
