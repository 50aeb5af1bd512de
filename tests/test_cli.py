"""The `tokenmill` command line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.server import wait_until
from tokenmill import LLM, SamplingParams
from tokenmill.config import DEMO_MODEL_DIR, EngineArgs
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


def _chat_process(model: Path, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill", "chat", "--model", str(model), "--device", "cpu"]
    return subprocess.Popen(
        [*cmd, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_chat_keeps_the_conversation_and_ends_at_end_of_input(llama_dir: Path) -> None:
    proc = _chat_process(llama_dir, "--system", "Be brief.", "--max-tokens", "6")
    out, err = proc.communicate(b"Hi\nHow are you?\n", timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err
    # A prompt before each turn; the reply follows it, streamed; end of input quits.
    first, second, end = out.decode().removeprefix("> ").split("\n> ")
    assert end == "\n" and first and second
    # The second reply answers the whole conversation, the first reply included.
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "How are you?"},
    ]
    llm = LLM(str(llama_dir), device="cpu")
    expected = llm.chat(history, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert second == expected[0].outputs[0].text


def test_ctrl_c_stops_a_reply_then_quits_at_the_prompt(llama_dir: Path) -> None:
    proc = _chat_process(llama_dir, "--max-tokens", "900", "--ignore-eos")
    out = bytearray()

    def read() -> None:
        while chunk := proc.stdout.read1(1024):
            out.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert wait_until(lambda: out.startswith(b"> "), timeout=60)
        proc.stdin.write(b"Hi\n")
        proc.stdin.flush()
        assert wait_until(lambda: len(out) > 8)  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        assert wait_until(lambda: out.endswith(b" [interrupted]\n> "))
        proc.send_signal(signal.SIGINT)  # at the prompt: quit
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=5)
    assert b"Traceback" not in proc.stderr.read()


def test_sampling_flags_not_given_take_the_models_generation_config(
    llama_dir: Path, tmp_path: Path, capsys
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    args = ["--model", str(llama_dir), "--generation-config", str(tmp_path), "Hi", "--ignore-eos"]
    assert main(["generate", *args]) == 0
    assert "(length, 3 tokens)" in capsys.readouterr().out
    assert main(["generate", *args, "--max-tokens", "2"]) == 0  # a flag given wins
    assert "(length, 2 tokens)" in capsys.readouterr().out


def test_the_command_lines_default_max_tokens_fits_the_context(llama_dir: Path, capsys) -> None:
    """Without --max-tokens or a model default, 64 at most the room left (a prompt that left
    less failed on a max_tokens of 64 the user never gave); an override's value wins."""
    args = ["--model", str(llama_dir), "--ignore-eos", "--max-model-len", "24", "Hi"]
    assert main(["generate", *args]) == 0
    generated = int(re.search(r"\(length, (\d+) tokens\)", capsys.readouterr().out)[1])
    assert 0 < generated < 24
    assert main(["generate", "--model", str(llama_dir), "--ignore-eos", "Hi"]) == 0
    assert "(length, 64 tokens)" in capsys.readouterr().out
    override = ["--override-generation-config", '{"max_new_tokens": 4}']
    assert main(["generate", "--model", str(llama_dir), "--ignore-eos", "Hi", *override]) == 0
    assert "(length, 4 tokens)" in capsys.readouterr().out


def test_bad_option_is_an_error_message_not_a_traceback(llama_dir: Path, capsys) -> None:
    code = main(["generate", "--model", str(llama_dir), "x", "--temperature", "-1"])
    assert code == 2
    assert "temperature must be in [0, 1e+06], got -1.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-requests", "-3"], "num_sessions (--num-requests) must be >= 1, got -3"),
        (["--vocab-size", "0"], "vocab_size must be > 10, got 0"),
        (["--request-rate", "-1"], "request_rate must be > 0, got -1.0"),
        (["--request-rate", "nan"], "request_rate must be > 0, got nan"),
        (["--sweep-rates=1,-2"], "request_rate must be > 0, got -2.0"),
        (["--sweep-rates", "1,x"], "--sweep-rates takes numbers, got 'x'"),
        (["--slo", "ttft:abc"], "--slo takes numbers, got 'abc'"),
        (["--max-concurrency", "0"], "max_concurrency must be >= 1, got 0"),
        (["--timeout", "0"], "timeout must be > 0 seconds, got 0.0"),
        (["--output-len", "0"], "output_len must be >= 1, got 0"),
    ],
)
def test_bad_bench_serve_option_is_an_error_message(flags: list[str], message: str, capsys) -> None:
    # A dead address: each is refused before any request (a traceback, a silent empty run, or
    # float()'s message naming no flag before).
    argv = ["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:1", "--vocab-size"]
    assert main([*argv, "100", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_serve_without_a_server_says_so(capsys) -> None:
    assert main(["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:1"]) == 2
    assert "--base-url http://127.0.0.1:1: cannot read /v1/models" in capsys.readouterr().err


def test_bad_engine_arg_value_names_the_option(capsys) -> None:
    argv = ["bench", "offline", "--config", "c", "--engine-arg", "max_num_seqs=many"]
    assert main(argv) == 2
    assert "--engine-arg max_num_seqs takes int values, got 'many'" in capsys.readouterr().err


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
    kinds = report["tokenmill"]["steps_by_kind"]  # all prompts at once: one prefill, decodes
    assert kinds["prefill"]["steps"] == 1 and kinds["decode"]["steps"] > 0
    assert kinds["mixed"]["steps"] == 0
    assert kinds["prefill"]["host_ms"] > 0 and kinds["decode"]["host_ms"] > 0
    ours = report["tokenmill"]  # the run's host time: within its wall time, counted once
    assert 0 < ours["host_ms_per_step"] * ours["engine_steps"] <= 1e3 * ours["elapsed_s"]
    assert "transformers" not in report
    out = capsys.readouterr().out
    assert "B1 llama" in out and "B2 llama" in out and "transformers not run" in out
    assert "steps: prefill-only 1 (" in out and "decode-only" in out
    assert "of device / host time each" in out


def test_bench_offline_b6_and_data_count_their_tokens_and_flops(
    llama_dir: Path, tmp_path: Path, capsys
) -> None:
    """B6: prompts of --input-len tokens, one output each; data: the serving benchmark's data
    workload (the same token ids as `bench serve --workload data`), with the FLOPs they did."""
    from tokenmill.bench.roofline import ModelCost
    from tokenmill.bench.workloads import WorkloadSpec, build_workload
    from tokenmill.config import ModelConfig

    b6, data = tmp_path / "b6.json", tmp_path / "data.json"
    common = ["--config", str(llama_dir), "--device", "cpu", "--dtype", "float32"]
    assert main(["bench", "offline", *common, "--workload", "b6", "--input-len", "24",
                 "--num-requests", "3", "--output", str(b6)]) == 0  # fmt: skip
    assert main(["bench", "offline", *common, "--workload", "data", "--num-requests", "4",
                 "--length-scale", "0.01", "--output", str(data)]) == 0  # fmt: skip
    cfg = ModelConfig.from_pretrained(llama_dir, "float32")
    cost = ModelCost.of(cfg, 4)
    result = json.loads(b6.read_text())["tokenmill"]
    assert (result["requests"], result["input_len"]) == (3, 24)
    assert result["prompt_tok_s"] * result["elapsed_s"] == pytest.approx(3 * 24)
    assert result["flops"] == pytest.approx(cost.sequence_flops(np.full(3, 24), np.ones(3)))
    turns = [s.turns[0] for s in build_workload(WorkloadSpec(
        "data", num_sessions=4, vocab_size=cfg.vocab_size, length_scale=0.01
    ))]  # fmt: skip
    prompts = np.array([len(t.new_tokens) for t in turns])
    outputs = np.array([t.max_tokens for t in turns])
    result = json.loads(data.read_text())["tokenmill"]
    assert result["total_tok_s"] * result["elapsed_s"] == pytest.approx(
        prompts.sum() + outputs.sum()
    )
    assert result["flops"] == pytest.approx(cost.sequence_flops(prompts, outputs))
    out = capsys.readouterr().out
    assert "B6 llama: 3 x 24-token prompts" in out and "data llama: LLM.generate 4 requests" in out


def test_bench_roofline_prints_the_floor(capsys) -> None:
    config = Path(__file__).parent / "data" / "llama-3.1-8b"
    assert main(["bench", "roofline", "--config", str(config), "--workload", "b1"]) == 0
    out = capsys.readouterr().out
    # 15.0 GB of bf16 weights per step at 4.27 TB/s: ~3.5 ms, ~283 tok/s.
    assert "B1 floor: 3.5" in out and "283 tok/s" in out
    # B6 at 2,048 tokens: BENCHMARKS.md saw 39.9 k tok/s = 73% of the matmul rate, ~54.7 k.
    b6 = ["--workload", "b6", "--input-len", "2048"]
    assert main(["bench", "roofline", "--config", str(config), *b6]) == 0
    assert "= 54773 prompt tok/s" in capsys.readouterr().out


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


@pytest.mark.parametrize("command", ["offline", "roofline"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-len", "10", "--max-len", "5"], "1 <= min_len <= max_len, got 10 and 5"),
        (["--min-len", "0"], "1 <= min_len <= max_len, got 0 and 1024"),
        (["--output-len", "0"], "output_len must be >= 1, got 0"),
    ],
)
def test_bad_bench_lengths_name_the_options(
    command: str, flags: list[str], message: str, capsys
) -> None:
    """Refused before anything loads (numpy's "low >= high" named nothing before)."""
    assert main(["bench", command, "--config", "c", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seed", "-1"], "seed must be >= 0, got -1"),  # numpy's message named nothing
        (["--output-len", "1"], "output_len must be >= 2 for b1 (it times decoding), got 1"),
        (["--input-len", str(2**40)], "input_len must be <= 1048576"),
        (["--workload", "b2", "--num-requests", "10000000"], "num_requests x max_len"),
        (["--workload", "data", "--length-scale", "1e9"], "x length_scale must be at most"),
        (["--workload", "b4", "--acceptance-rates", "x"], "acceptance_rates must be comma-"),
        (["--workload", "b4", "--acceptance-rates", "2"], "acceptance_rates must be numbers in"),
        (["--workload", "b4", "--batch-sizes", "0"], "batch_sizes must be integers >= 1"),
        (["--workload", "b4", "--adaptive-batch-sizes", "7"], "must be some of batch_sizes"),
        (["--workload", "b4", "--num-speculative-tokens", "0"], "num_speculative_tokens must"),
        (["--workload", "b2", "--peer-requests", "-1"], "peer_requests must be >= 1, got -1"),
        (["--engine-arg", "enforce_eager=maybe"], "enforce_eager takes bool values, got 'maybe'"),
        (["--engine-arg", "model=/x"], "(not model: that is --config), got 'model=/x'"),
        (["--output", "/no/such/dir/report.json"], "--output '/no/such/dir/report.json': not a"),
    ],
)
def test_bad_bench_offline_option_is_an_error_message(
    flags: list[str], message: str, capsys
) -> None:
    """Refused by name before the model loads: each was a traceback (numpy's out-of-memory,
    a ZeroDivisionError, a RuntimeError, a TypeError from LLM), a run of minutes, a silently
    False option, or an `open` error after the whole run."""
    assert main(["bench", "offline", "--config", str(DEMO_MODEL_DIR), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seed", "-1"], "seed must be >= 0, got -1"),
        (["--num-requests", "1000000000"], "x prompt tokens per session must be at most"),
        (["--input-len", "10000000000"], "x length_scale must be at most 1048576 tokens"),
        (["--slo", "ttft:-5"], "--slo ttft must be a number of ms > 0, got '-5'"),
        (["--slo", "itl:nan"], "--slo itl must be a number of ms > 0, got 'nan'"),
        (["--sweep-rates", ""], "--sweep-rates takes numbers, got ''"),
        (["--output", "/no/such/dir/r.json"], "--output '/no/such/dir/r.json': not a file"),
    ],
)
def test_bad_bench_serve_sizes_and_paths_are_refused_before_the_run(
    flags: list[str], message: str, capsys
) -> None:
    """An unbounded workload was numpy's out-of-memory traceback or minutes of drawing ids; a
    bad SLO or an empty --sweep-rates ran silently; an unwritable --output failed after it."""
    argv = ["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:1", "--vocab-size"]
    assert main([*argv, "100", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_roofline_takes_no_b4_options(capsys) -> None:
    """It has no B4 floor: `--workload b4` printed B2's, and B4's flags were ignored."""
    argv = ["bench", "roofline", "--config", str(DEMO_MODEL_DIR)]
    assert main([*argv, "--workload", "b4"]) == 2
    assert "bench roofline has no b4 floor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--num-speculative-tokens", "2"])


def test_an_empty_api_key_is_refused_not_an_open_server(capsys) -> None:
    """`--api-key "$KEY"` with KEY unset served every route without a key (an empty key meant
    none), silently; it is refused before the model loads."""
    assert main(["serve", "--api-key", "", "--model", str(DEMO_MODEL_DIR)]) == 2
    assert "api_key must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--retry-after-s", "100000"], "retry_after_s in \\[0, 3600\\]"),
        # a file where the traces go: found out only at /stop_profile before
        (["--enable-profiling", "--profile-dir", __file__], "profile_dir .* is not a directory"),
    ],
)
def test_serve_options_a_server_would_trip_on_later_are_refused_at_once(
    capsys, flags: list[str], message: str
) -> None:
    assert main(["serve", *flags, "--model", str(DEMO_MODEL_DIR)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_an_option_the_engine_core_refuses_ends_serve_with_its_reason_in_one_line() -> None:
    """What only the engine core finds (a host KV tier smaller than a page, found as it sizes
    its caches) ends `serve` with exit code 1 and the reason as one log line, not a traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", "0",
         "--host-kv-cache-bytes", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1
    assert "engine core exits: host_kv_cache_bytes=1 is less than one KV page" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "command", [["generate"], ["serve"], ["bench", "offline"], ["bench", "serve"]]
)
def test_help_gives_each_option_one_default_that_means_something(command: list[str]) -> None:
    """Options whose help said their default printed a second "(default: None)" after it
    (`--device`: "default: cuda if present). (default: None)"), and `bench serve`'s
    --base-url, --workload, --num-requests, --max-concurrency, --duration showed none."""
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", *command, "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    flat = " ".join(out.split())
    assert not re.search(r"\(default: [^()]*(\([^()]*\))?[^()]*\)\. \(default: None\)", flat)
    if command == ["bench", "serve"]:
        for default in ("http://127.0.0.1:8000", "random", "16", "no cap", "run them all"):
            assert f"(default: {default})" in flat
