"""--generation-config: the checkpoint's generation_config.json gives the default sampling settings
of requests that leave them unset, offline and through the server; what a request sets wins."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server, wait_until
from tokenmill import LLM, SamplingParams
from tokenmill.config import load_sampling_defaults
from tokenmill.sampling_params import SamplingDefaults

# What a model's authors write (do_sample is ignored, as vLLM ignores it).
GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.0,
    "top_k": 3,
    "repetition_penalty": 1.25,
    "max_new_tokens": 5,
    "eos_token_id": 2,
}
DEFAULTS = SamplingDefaults(temperature=0.0, top_k=3, repetition_penalty=1.25, max_tokens=5)


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama checkpoint with a generation_config.json of its authors' choices."""
    path = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


def test_auto_reads_the_checkpoints_file_and_logs_the_defaults(model_dir: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.config"):
        assert load_sampling_defaults("auto", str(model_dir)) == DEFAULTS
    assert "'top_k': 3" in caplog.text and "--generation-config vllm" in caplog.text


def test_vllm_ignores_the_file_and_a_directory_gives_another(model_dir, tmp_path) -> None:
    assert load_sampling_defaults("vllm", str(model_dir)) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert load_sampling_defaults(str(tmp_path), str(model_dir)) == SamplingDefaults(top_p=0.5)


def test_a_checkpoint_without_sampling_settings_has_no_defaults(llama_dir, tmp_path) -> None:
    assert load_sampling_defaults("auto", str(tmp_path)) == SamplingDefaults()  # no file
    assert load_sampling_defaults("auto", str(llama_dir)) == SamplingDefaults()  # ids only


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "no "), ("{", "cannot read"), (json.dumps({"top_p": 2}), "top_p must be in (0, 1]")],
)
def test_a_bad_generation_config_is_an_error_naming_it(tmp_path, content, fragment) -> None:
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match="generation_config") as info:
        load_sampling_defaults(str(tmp_path), "unused")
    assert fragment in str(info.value)


def test_an_override_sets_values_over_the_models_and_alone_with_vllm(model_dir: Path) -> None:
    """--override-generation-config (vLLM's): JSON text or a dict, merged over the file."""
    merged = load_sampling_defaults("auto", str(model_dir), '{"top_k": 7, "max_new_tokens": 9}')
    assert merged == SamplingDefaults(temperature=0.0, top_k=7, repetition_penalty=1.25,
                                      max_tokens=9)  # fmt: skip
    alone = load_sampling_defaults("vllm", str(model_dir), {"temperature": 0.5})
    assert alone == SamplingDefaults(temperature=0.5)
    llm = LLM(str(model_dir), device="cpu", max_model_len=64,
              override_generation_config={"max_new_tokens": 2})  # fmt: skip
    assert len(llm.generate("Hello world", use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_an_override_mends_a_bad_file_value_and_the_merged_values_are_logged_once(
    tmp_path: Path, caplog
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0, "top_k": 5}))
    with pytest.raises(ValueError, match="^generation_config: .*top_p"):
        load_sampling_defaults(str(tmp_path), "unused")
    with caplog.at_level(logging.INFO, logger="tokenmill.config"):
        mended = load_sampling_defaults(str(tmp_path), "unused", {"top_p": 0.9})
    assert mended == SamplingDefaults(top_p=0.9, top_k=5)
    (line,) = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert "--override-generation-config" in line and "'top_p': 0.9" in line
    with pytest.raises(ValueError, match="^override_generation_config: top_k"):
        load_sampling_defaults(str(tmp_path), "unused", {"top_p": 0.9, "top_k": -5})


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("{", "must be a JSON object"),
        ("[1]", "must be a JSON object"),
        ({1: 2, "top_k": 3}, "string keys"),
        ('{"do_sample": true}', "unknown key(s) 'do_sample'"),
        ('{"top_p": 0}', "top_p must be in (0, 1]"),
    ],
)
def test_a_bad_override_is_an_error_naming_it(model_dir: Path, override, fragment) -> None:
    with pytest.raises(ValueError, match="^override_generation_config") as info:
        load_sampling_defaults("auto", str(model_dir), override)
    assert fragment in str(info.value)


def test_offline_requests_without_params_run_with_the_models_defaults(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", max_model_len=64)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.repetition_penalty) == (0.0, 3, 1.25)
    out = llm.generate("Hello world", use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(temperature=0.0, top_k=3, repetition_penalty=1.25, max_tokens=5)
    same = llm.generate("Hello world", explicit, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == same.token_ids and len(out.token_ids) == 5
    # max_new_tokens is a default within the context: a long prompt gets the room left.
    long_prompt = list(range(10, 71))  # 61 tokens of a 64-token context
    assert len(llm.generate(long_prompt, use_tqdm=False)[0].outputs[0].token_ids) == 3
    # With --generation-config vllm the model's choices are ignored.
    plain = LLM(str(model_dir), device="cpu", max_model_len=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tmp = tmp_path_factory.mktemp("generation-config-server")
    trace = tmp / "trace.jsonl"
    with run_server(model_dir, tmp / "server.log", "--trace-file", str(trace)) as handle:
        handle.trace = trace  # type: ignore[attr-defined]
        yield handle


def _traced_params(server: ServerHandle, response_id: str) -> dict:
    trace: Path = server.trace  # type: ignore[attr-defined]
    assert wait_until(lambda: response_id in trace.read_text())
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    return next(r for r in lines if r["request_id"].startswith(response_id))["sampling_params"]


def test_the_server_applies_the_defaults_a_request_leaves_unset(server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    assert "sampling defaults for requests that do not set them (from" in server.log
    assert "'max_tokens': 5" in server.log
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}]
    )
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello")
    assert chat.usage.completion_tokens == completion.usage.completion_tokens == 5
    for response in (chat, completion):
        params = _traced_params(server, response.id)
        assert (params["temperature"], params["top_k"], params["repetition_penalty"]) == (
            0.0, 3, 1.25,
        )  # fmt: skip
    # What the request sets wins; the rest still comes from the model.
    own = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0.5, seed=1
    )
    assert own.usage.completion_tokens == 2
    params = _traced_params(server, own.id)
    assert (params["temperature"], params["top_k"]) == (0.5, 3)
