"""The README works as written: its shell commands run on the CPU, its links stay inside the
repository, and its test command is the one CI runs.

Every command of every ```bash block runs, top to bottom, in a folder that looks like the
checkout, with `tokenmill` being this checkout's, unless `NOT_RUN` names it with a reason: a new
command is run, never skipped silently. A `tokenmill serve` command starts a server that the
commands after it use. The only changes made to a command are `SUBSTITUTIONS`' placeholders.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import wait_until

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The set-up block installs what this test runs in; the rest of its command runs.
INSTALL = "pip install torch==2.13.0 -e '.[dev]' && "
# README commands not run here, by their start, and why.
NOT_RUN = {
    "pip install -q torch==2.13.0 -e '.[dev,ray]' && python -m pytest -q -n 2 --dist loadfile": (
        "the whole test suite; CI runs it (.ci/run, checked by test_the_test_command_is_cis)"
    ),
    "tokenmill bench offline --config path/to/qwen3-0.6b": (
        "a 0.6 B model and its transformers peer: minutes on a CPU (tests/test_cli.py runs "
        "bench offline on a tiny model)"
    ),
    "tokenmill bench offline --config path/to/llama-3.1-8b": (
        "an 8 B model (tests/test_cli.py::test_bench_offline_b6_and_data_count_their_tokens_and_"
        "flops runs B6 and data on a tiny model)"
    ),
    "PYTHONPATH=$PWD python benchmarks/startup.py": (
        "two starts of a server per model (tests/e2e/test_startup_bench.py times one start; "
        "scripts/gpu_check.sh startup runs it)"
    ),
    "PYTHONPATH=$PWD python benchmarks/long_prompts.py": (
        "a GPU-sized workload (scripts/gpu_check.sh startup runs it)"
    ),
    "PYTHONPATH=$PWD python benchmarks/prefill_attention.py": (
        "the compiled kernel and SDPA's flash kernel on a CUDA GPU (scripts/gpu_check.sh "
        "prefillattn runs it; tests/kernels checks the kernel's tiles on the CPU)"
    ),
    "PYTHONPATH=$PWD python benchmarks/launch_cost.py": (
        "CUDA launches (scripts/gpu_check.sh launch runs it; tests/kernels/test_launch.py checks "
        "the direct launch's key on the CPU)"
    ),
    "tokenmill bench serve ...": "options elided (...): the command above it runs",
    'tokenmill serve --model DIR --api-key "$KEY"': (
        "a second server on the same port (the api key: tests/reliability/test_http_edge.py)"
    ),
    "tokenmill eval tasks --base-url http://127.0.0.1:8000 tasks.jsonl": (
        "the user's own task file (a placeholder; tests/e2e/test_evals.py scores a known file)"
    ),
    "pip install -e '.[ray]'": "installs Ray; tests/replicas/ run where it is installed",
    "huggingface-cli download Qwen/Qwen3-VL-30B-A3B-Instruct": (
        "a 62 GB download (no network here); the tiny Qwen3-VL above runs the same command"
    ),
    "tokenmill placard gallery/*.jpg --model qwen3-vl-30b-a3b": (
        "a 30 B model on a GPU; tests/multimodal/test_placard.py runs placard on a tiny one"
    ),
    "tokenmill serve --replicas 2": (
        "needs Ray and a minute; tests/replicas/test_replicas.py deploys the same application"
    ),
    "tokenmill serve --min-replicas 1": "GPUs of a Ray cluster (the autoscaling: the next one)",
    "PYTHONPATH=$PWD python benchmarks/replica_spike.py": (
        "minutes of a load spike; its recorded run is docs/bench/replica_spike.*"
    ),
    # Run by other tests already (each command here costs seconds of imports on a CPU):
    "tokenmill generate --help": "tests/test_cli.py::test_help_documents_every_engine_option",
    "tokenmill serve --help": (
        "tests/e2e/test_serve_cli.py::test_every_server_option_is_a_serve_flag"
    ),
    "tokenmill bench roofline --config tests/data/llama-3.1-8b": (
        "tests/test_cli.py::test_bench_roofline_prints_the_floor (the same config, b1)"
    ),
}
COMMAND_TIMEOUT_S = 180


def shell_commands(markdown: str) -> list[str]:
    """The commands of the ```bash blocks, in order: continuation lines joined, comment-only
    and blank lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(re.sub(r" {2,}", " ", command.strip()))
    return commands


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """A folder whose entries link to the checkout's (relative paths resolve as in it, and
    what the commands write stays out of it), and a `bin/tokenmill` of this checkout."""
    root = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    shim = root / ".bin" / "tokenmill"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m tokenmill "$@"\n')
    shim.chmod(0o755)
    return root


def _substitutions(llama_dir: Path, port: int) -> dict[str, str]:
    """Placeholders of the README and what this test puts there."""
    return {r"\bDIR\b": str(llama_dir), r"\b8000\b": str(port), r"\$KEY\b": "test-key"}


@contextlib.contextmanager
def _background(command: str, env: dict[str, str], cwd: Path, port: int) -> Iterator[None]:
    log = (cwd / f"server-{port}.log").open("w")
    proc = subprocess.Popen(
        ["bash", "-c", "exec " + command], cwd=cwd, env=env, stdout=log, stderr=log,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/health"
        healthy = wait_until(lambda: _get(url) == 200 or proc.poll() is not None, timeout=120)
        assert healthy and proc.poll() is None, (cwd / f"server-{port}.log").read_text()
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _get(url: str) -> int | None:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


def test_every_cpu_runnable_readme_command_works(workdir: Path, llama_dir: Path) -> None:
    commands = shell_commands(README.read_text())
    port = _free_port()
    env = {**os.environ, "PATH": f"{workdir / '.bin'}{os.pathsep}{os.environ['PATH']}"}
    ran = []
    with contextlib.ExitStack() as servers:
        for command in commands:
            if any(command.startswith(skipped) for skipped in NOT_RUN):
                continue
            command = command.removeprefix(INSTALL)
            for placeholder, value in _substitutions(llama_dir, port).items():
                command = re.sub(placeholder, value, command)
            if command.startswith("tokenmill serve") and "--help" not in command:
                servers.enter_context(_background(command, env, workdir, port))
            else:
                done = subprocess.run(
                    ["bash", "-c", command], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                )  # fmt: skip
                assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
                assert "Traceback" not in done.stderr, f"{command}\n{done.stderr}"
                if command.startswith("curl"):
                    assert done.stdout.rstrip().endswith("data: [DONE]"), done.stdout
            ran.append(command)
    assert len(ran) >= 6  # the parser found the blocks


def test_every_skipped_command_is_in_the_readme() -> None:
    commands = shell_commands(README.read_text())
    for skipped in NOT_RUN:
        assert any(c.startswith(skipped) for c in commands), f"stale NOT_RUN entry: {skipped}"


def test_the_test_command_is_cis() -> None:
    """The README's test command is the last command of `.ci/run`, as written."""
    readme_test = next(c for c in shell_commands(README.read_text()) if "pytest" in c)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == readme_test


def test_links_stay_inside_the_repository() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert links
    for link in links:
        assert "://" not in link and not link.startswith("/"), link
        target = (ROOT / link.split("#", 1)[0]).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), link
