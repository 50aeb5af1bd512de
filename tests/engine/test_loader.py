"""Checkpoint loading: sharded files, dummy weights, dtypes, clear errors for bad directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.conftest import hf_greedy, hf_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.config import DEMO_MODEL_DIR

PROMPT = list(range(30, 50))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM, prompt: list[int] = PROMPT) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_loads_through_its_index(llama_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _tokens(LLM(str(sharded), device="cpu")) == hf_greedy(llama_dir, PROMPT, 12)


def test_dummy_weights_need_only_config_json(llama_dir: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(llama_dir / "config.json", config_only / "config.json")
    llm = LLM(str(config_only), device="cpu", load_format="dummy")
    assert llm.get_tokenizer() is None
    assert len(_tokens(llm)) == 12
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(config_only), device="cpu")


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture_is_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "gpt2"
    shutil.copytree(llama_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(target))


def test_extra_tensors_are_one_warning(llama_dir: Path, tmp_path: Path, caplog) -> None:
    """Tensors the model has no parameter for (another model's heads, say) are named in one
    warning, and the model loads and generates as without them."""
    target = tmp_path / "extra"
    shutil.copytree(llama_dir, target)
    tensors = load_file(target / "model.safetensors")
    for i in range(10):
        tensors[f"mtp.layers.{i}.weight"] = torch.zeros(2, 2)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with caplog.at_level("WARNING"):
        extra = LLM(str(target), dtype="float32").generate([[3, 4, 5]], greedy, use_tqdm=False)
    warnings = [r.getMessage() for r in caplog.records if "checkpoint tensors" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("ignoring 10 checkpoint tensors")
    assert "mtp.layers.0.weight" in warnings[0] and warnings[0].endswith(", ...")
    plain = LLM(str(llama_dir), dtype="float32").generate([[3, 4, 5]], greedy, use_tqdm=False)
    assert extra[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_missing_weight_is_named(llama_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "partial"
    shutil.copytree(llama_dir, target)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights: model.layers.1.self_attn.qkv_proj"):
        LLM(str(target), device="cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32(llama_dir: Path, dtype: str) -> None:
    llm = LLM(str(llama_dir), device="cpu", dtype=dtype)
    assert llm.engine.runner.kv_cache.k[0].dtype == getattr(torch, dtype)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    reference = hf_logprobs(llama_dir, PROMPT)[-1]
    token = completion.token_ids[0]
    assert token == int(reference.argmax())
    assert completion.logprobs[0][token].logprob == pytest.approx(reference[token].item(), abs=0.1)


def test_bad_engine_options_name_the_field(llama_dir: Path) -> None:
    for kwargs, field in [
        ({"dtype": "int8"}, "dtype"),
        ({"page_size": 0}, "page_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_pages": 0}, "num_pages"),
        ({"scheduling_policy": "random"}, "policy"),
        ({"load_format": "pt"}, "load_format"),
        ({"num_pages": 4, "page_size": 4, "max_model_len": 100}, "max_model_len"),
        # Beyond the rotary tables: the first long prompt would crash a step (IndexError).
        ({"max_model_len": 2048}, "max_model_len must be <= the model's max_position_emb"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(str(llama_dir), device="cpu", **kwargs)


@pytest.mark.parametrize("device", ["tpu", "meta", "cpu:1", "cuda:x", "cuda:99"])
def test_a_device_the_engine_cannot_use_is_named(llama_dir: Path, device: str) -> None:
    """Refused before loading, not torch's error from the middle of it."""
    with pytest.raises(ValueError, match=f"device .*{device!r}"):
        LLM(str(llama_dir), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_named() -> None:
    message = "device is 'cuda': the engine needs cuda:0, but no CUDA device is visible"
    with pytest.raises(ValueError, match=message):
        LLM(str(DEMO_MODEL_DIR), device="cuda")


def _with_config(llama_dir: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(llama_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
        ({"vocab_size": "512"}, "vocab_size must be an integer >= 1, got '512'"),
        ({"vocab_size": None}, "has no vocab_size"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be a number > 0, got -1"),
    ],
)
def test_absurd_config_values_are_named(
    llama_dir: Path, tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    """Not a ZeroDivisionError or KeyError while loading, nor a model that outputs garbage."""
    with pytest.raises(ValueError, match=message):
        LLM(str(_with_config(llama_dir, tmp_path / "bad", **changes)), device="cpu")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("config.json", b"{not json", "cannot read .*config.json"),
        ("config.json", b"[1, 2]", "config.json must hold a JSON object, got list"),
        ("model.safetensors", b"garbage" * 10, "cannot read checkpoint file .*model.safetensors"),
        ("model.safetensors.index.json", b"{}", "cannot read .*index.json: needs a JSON weight_m"),
    ],
)
def test_corrupt_checkpoint_files_are_named(
    llama_dir: Path, tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    target = tmp_path / "corrupt"
    shutil.copytree(llama_dir, target)
    (target / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        LLM(str(target), device="cpu")


def test_a_truncated_checkpoint_file_is_named(llama_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "truncated"
    shutil.copytree(llama_dir, target)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read checkpoint file .*incomplete metadata"):
        LLM(str(target), device="cpu")


def test_inputs_of_the_wrong_type_are_named(llama_dir: Path) -> None:
    """`generate` and `chat` refuse what is not a prompt, a conversation or SamplingParams with
    a `ValueError` saying what they take (these were TypeErrors and AttributeErrors from deep
    inside), before anything is queued."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=256)
    for prompts in (5, None, [5.0], [[1, 2], 3]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate(["a"], "x", use_tqdm=False)
    for messages in ("hi", [["hi"]], [{"role": "user", "content": "hi"}, "x"]):
        with pytest.raises(ValueError, match="messages must be a list of message dicts"):
            llm.chat(messages, use_tqdm=False)
    assert not list(llm.engine.request_ids())
    (out,) = llm.generate((1, 2, 3), SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "option", [{"num_pages": 10**12}, {"kv_cache_memory_bytes": 10**15},
               {"host_kv_cache_bytes": 10**15}],
)  # fmt: skip
def test_a_kv_cache_larger_than_memory_is_named(llama_dir: Path, option: dict) -> None:
    """A pool the machine cannot hold is refused naming the option, before it is allocated
    (it was the allocator's RuntimeError or MemoryError halfway through start-up)."""
    (field,) = option
    with pytest.raises(ValueError, match=f"{field}: a KV cache of .* GiB does not fit"):
        LLM(str(llama_dir), device="cpu", **option)
