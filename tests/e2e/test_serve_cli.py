"""`tokenmill serve`'s command line: flags generated from ServerOptions, vLLM's spellings, and
failures that come before the model loads."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import build_parser, main, options_from
from tokenmill.entrypoints.server_options import API_KEY_ENV, ServerOptions
from tokenmill.observability.metrics import ServerMetrics


def test_every_server_option_is_a_serve_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(ServerOptions):
        assert "--" + f.name.replace("_", "-") in text, f.name
        assert f.metadata["help"].split("(")[0].split()[0] in text
    for flag in (
        "--model",
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        "--log-level",
    ):
        assert flag in text
    assert "default: $TOKENMILL_API_KEY" in text.replace("\n", " ")


def test_serve_flags_parse_into_server_options() -> None:
    ns = build_parser().parse_args(
        [
            "serve", "--model", "/ckpt/qwen3-0.6b/", "--port", "9000", "--disable-log-requests",
            "--disable-uvicorn-access-log", "--allowed-origins", '["http://a", "http://b"]',
            "--max-waiting-requests", "32", "--root-path", "/llm", "--log-level", "DEBUG",
        ]
    )  # fmt: skip
    options = options_from(ns, ServerOptions)
    assert options.port == 9000 and options.max_waiting_requests == 32
    assert not options.log_requests and not options.uvicorn_access_log
    assert options.allowed_origins == ("http://a", "http://b")
    assert options.root_path == "/llm" and ns.log_level == "DEBUG"
    assert options.model_name(ns.model) == "qwen3-0.6b"  # the folder's name, not its path
    comma = build_parser().parse_args(["serve", "--allowed-origins", "http://a, http://b"])
    assert options_from(comma, ServerOptions).allowed_origins == ("http://a", "http://b")
    assert build_parser().parse_args(["serve"]).log_level == "INFO"


def test_server_options_refuse_bad_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    for bad, fragment in (
        ({"ssl_certfile": str(cert)}, "ssl_keyfile and ssl_certfile"),
        ({"ssl_certfile": str(cert), "ssl_keyfile": str(tmp_path / "no")}, "does not exist"),
        ({"ssl_certfile": str(cert), "ssl_keyfile": str(cert)}, "ssl_certfile, ssl_keyfile: "),
        ({"max_n": 0}, "max_n must be >= 1"),
        ({"max_n": 4097}, "max_n must be <= 4096"),
        ({"num_tokenizer_workers": 257}, "num_tokenizer_workers must be <= 256"),
        ({"port": 70000}, "port must be in"),
        ({"root_path": "llm"}, "root_path must start with"),
    ):
        with pytest.raises(ValueError, match=fragment):
            ServerOptions(**bad)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerOptions().resolved_api_key == "from-env"
    assert ServerOptions(api_key="flag").resolved_api_key == "flag"
    assert ServerOptions(served_model_name="x").model_name("/a/b") == "x"


def test_a_trace_file_that_can_not_be_opened_is_refused_naming_it(tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "no-folder" / "trace.jsonl"):
        with pytest.raises(ValueError, match=f"trace_file: cannot open {str(path)!r}"):
            ServerMetrics("m", trace_file=str(path), log_requests=False)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_port_in_use_fails_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model does not even exist: the port is checked first.
        started = time.monotonic()
        result = _serve("--model", str(tmp_path / "no-model"), "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 120


def test_positional_and_flag_model_must_agree(tmp_path: Path) -> None:
    result = _serve(str(tmp_path / "a"), "--model", str(tmp_path / "b"), "--port", "0")
    assert result.returncode == 2 and "two models given" in result.stderr
