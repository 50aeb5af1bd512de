"""Frozen configuration for the engine: model, KV cache, scheduler, runner, and the whole engine."""

from __future__ import annotations

import json
import logging
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_type_hints

from tokenmill.intake import ContextLimits
from tokenmill.models.registry import MODEL_REGISTRY
from tokenmill.sampling_params import MAX_SEED, SamplingDefaults
from tokenmill.tuning_cache import default_tuning_cache_dir

if TYPE_CHECKING:
    import torch

    from tokenmill.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)

# The architectures (config.json `architectures`) the model registry implements.
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
_MOE_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3VLMoeForConditionalGeneration",
)
# Vision-language models: the language model's fields are config.json's `text_config`.
_VISION_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_VISION_ARCHITECTURES)
# Where `attention_bias` also gives o_proj a bias (transformers' modeling code; Qwen2's q/k/v
# bias comes without one, Mistral has none).
_O_PROJ_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# Names of torch dtypes (`torch.<name>`); torch itself is imported where a dtype is made, so that
# `tokenmill serve` parses its command line and starts the engine core before importing it.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

# Default of `--tuning-threads`: a cold start compiles ~45 GEMV candidates (~0.4 s each).
TUNING_THREADS = 8

# The embedded default model (README: "The embedded demo model") and its draft model.
ASSETS_DIR = Path(__file__).parent / "assets"
DEMO_MODEL_DIR = ASSETS_DIR / "demo-llama-16m"
DEMO_DRAFT_DIR = ASSETS_DIR / "demo-llama-2m-draft"


def cpu_has_bf16_instructions() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); without, torch converts
    every bf16 matmul on the fly (measured ~7x slower prefill than float32 on an AVX2 CPU)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("float32", "bfloat16", "float16") to a torch dtype."""
    import torch

    if isinstance(name, torch.dtype):
        if str(name).removeprefix("torch.") not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {name}")
        return name
    return getattr(torch, dtype_name(name))


def dtype_name(name: str) -> str:
    """The torch dtype a dtype name ("float32", "half", ...) means, by its name; `ValueError`
    for a name that is none of them. Checked without torch."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default", "linear" or "llama3"."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        """Read rope settings from a config.json dict (transformers 4 and 5 layouts)."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, "
                "llama3)"
            )
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts feed-forward of a sparse decoder (Qwen3-MoE's and Qwen2-MoE's
    config.json fields).

    Layer `i` is sparse when `i not in mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`;
    the others keep a dense MLP of the model's `intermediate_size`. A sparse layer may also have
    a shared expert (a dense MLP every token passes, scaled by a sigmoid gate; Qwen2-MoE) of
    `shared_expert_intermediate_size` (0: none).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.top_k}"
            )
        if self.intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                "shared_expert_intermediate_size must be >= 0, got "
                f"{self.shared_expert_intermediate_size}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) routes its tokens to experts."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> MoeConfig:
        """Read the expert settings of a config.json dict (transformers 5 writes the expert
        count as `num_local_experts`, the hub's checkpoints as `num_experts`)."""
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise ValueError("a mixture-of-experts config.json needs num_experts")
        return MoeConfig(
            num_experts=int(experts),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )


@dataclass(frozen=True)
class VisionConfig:
    """The vision encoder of a Qwen3-VL checkpoint (config.json's `vision_config`) and the
    token ids its images use in the prompt.

    An image becomes a grid of `patch_size` x `patch_size` patches (`temporal_patch_size`
    frames deep); `spatial_merge_size`^2 neighbouring patches merge into one language-model
    token. Blocks `deepstack_visual_indexes` also feed their merged features to the first
    language-model layers. `mrope_section` splits the rotary frequencies between the
    temporal, height and width positions (interleaved).
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    mrope_section: tuple[int, int, int]

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token."""
        return self.spatial_merge_size**2

    @staticmethod
    def from_hf(cfg: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
        """Read `vision_config` and the image token ids of a Qwen3-VL config.json dict (the
        mrope sections from `text`, the language model's part)."""
        vision = cfg["vision_config"]
        rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
        section = tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20)))
        if len(section) != 3:
            raise ValueError(f"mrope_section must have 3 entries, got {list(section)}")
        hidden = int(vision["hidden_size"])
        return VisionConfig(
            depth=int(vision["depth"]),
            hidden_size=hidden,
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            in_channels=int(vision.get("in_channels", 3)),
            patch_size=int(vision["patch_size"]),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            out_hidden_size=int(vision["out_hidden_size"]),
            num_position_embeddings=int(vision["num_position_embeddings"]),
            deepstack_visual_indexes=tuple(int(i) for i in vision["deepstack_visual_indexes"]),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            image_token_id=int(cfg["image_token_id"]),
            vision_start_token_id=int(cfg["vision_start_token_id"]),
            mrope_section=section,  # type: ignore[arg-type]
        )


def read_checkpoint_config(root: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The architecture, config.json and the language model's fields of checkpoint `root`
    (a vision-language model's are its `text_config`, with the ids and the dtype that may sit
    at the top level); `ValueError` if it has none, or none tokenmill runs."""
    if not root.is_dir():
        raise ValueError(f"model directory {str(root)!r} does not exist")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model directory {str(root)!r} has no config.json")
    try:
        top = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {cfg_file}: {exc}") from None
    if not isinstance(top, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object, got {type(top).__name__}")
    archs = top.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs!r} in {cfg_file}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    cfg = {**top, **top.get("text_config", {})} if arch in _VISION_ARCHITECTURES else top
    for key in _REQUIRED_POSITIVE:
        _check_config_int(cfg, key, cfg_file, required=key in _REQUIRED_KEYS)
    if "rms_norm_eps" in cfg and not _positive_number(cfg["rms_norm_eps"]):
        raise ValueError(
            f"{cfg_file}: rms_norm_eps must be a number > 0, got {cfg['rms_norm_eps']!r}"
        )
    return arch, top, cfg


# config.json fields every checkpoint needs; with the optional ones, each an integer >= 1.
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"
)  # fmt: skip
_REQUIRED_POSITIVE = (*_REQUIRED_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_config_int(cfg: dict[str, Any], key: str, cfg_file: Path, required: bool) -> None:
    """`ValueError` naming config.json's `key` if it is missing or null (and `required`) or
    not an integer >= 1."""
    value = cfg.get(key)
    if value is None:
        if required:
            raise ValueError(f"{cfg_file} has no {key}")
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{cfg_file}: {key} must be an integer >= 1, got {value!r}")


def _positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder, read from a Hugging Face config.json;
    `moe` is set for mixture-of-experts models (None: every layer has a dense MLP)."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None
    o_proj_bias: bool = False  # Llama and Qwen3 give the output projection a bias too
    vision: VisionConfig | None = None  # vision-language models: the image encoder

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "auto") -> ModelConfig:
        """Load and validate `config.json` from a checkpoint directory."""
        root = Path(path)
        arch, top, cfg = read_checkpoint_config(root)
        vision = arch in _VISION_ARCHITECTURES
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if dtype == "auto":
            dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        window = cfg.get("sliding_window")
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        if qwen2 and not cfg.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            path=str(root),
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", qwen2))),
            o_proj_bias=arch in _O_PROJ_BIAS_ARCHITECTURES and bool(cfg.get("attention_bias")),
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            sliding_window=int(window) if window else None,
            dtype=parse_dtype(dtype),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            moe=MoeConfig.from_hf(cfg) if arch in _MOE_ARCHITECTURES else None,
            vision=VisionConfig.from_hf(top, cfg) if vision else None,
        )

    def shard(self, tp: int) -> ModelConfig:
        """One tensor-parallel rank's share of the model (`tp` ranks): its attention heads
        (at least one key/value head: fewer than `tp` are replicated) and its slice of every
        feed-forward's intermediate size; the vocabulary stays whole (it is split by the
        embedding itself). `check_tensor_parallel` says which `tp` divide the model."""
        if tp == 1:
            return self
        check_tensor_parallel(self, tp)
        moe = self.moe
        if moe is not None:
            moe = replace(
                moe,
                intermediate_size=moe.intermediate_size // tp,
                shared_expert_intermediate_size=moe.shared_expert_intermediate_size // tp,
            )
        return replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=max(1, self.num_kv_heads // tp),
            intermediate_size=self.intermediate_size // tp,
            moe=moe,
        )


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Raise `ValueError` naming `tensor_parallel_size` unless `tp` ranks can split `model`:
    the attention heads, the key/value heads (or `tp` a multiple of them) and every
    feed-forward size must divide evenly."""
    sizes = {
        "num_attention_heads": model.num_heads,
        "intermediate_size": model.intermediate_size,
    }
    if model.moe is not None:
        sizes["moe_intermediate_size"] = model.moe.intermediate_size
        if model.moe.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = model.moe.shared_expert_intermediate_size
    kv = model.num_kv_heads
    uneven = [f"{name}={n}" for name, n in sizes.items() if n % tp]
    if kv % tp and tp % kv:
        uneven.append(f"num_key_value_heads={kv} (nor is it a divisor of {tp})")
    if tp < 1 or uneven:
        raise ValueError(
            f"tensor_parallel_size={tp} must be >= 1 and divide the model's "
            + (", ".join(uneven) if uneven else "sizes")
        )


# generation_config.json keys that are sampling defaults, and the SamplingParams field of each
# (vLLM's list; `do_sample` is ignored, as vLLM does).
_GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_sampling_defaults(
    generation_config: str,
    model_dir: str,
    override: str | Mapping[str, Any] | None = None,
    log: bool = True,
) -> SamplingDefaults:
    """The sampling defaults `--generation-config` names: `auto`, the checkpoint's
    `generation_config.json` (none if it has none); `vllm`, none; else a directory holding a
    `generation_config.json`. `override` (`--override-generation-config`, vLLM's: JSON text or a
    dict with the file's keys) sets values over those. `log`: say which apply, and whence."""
    from_file: dict[str, Any] = {}
    path = None
    if generation_config != "vllm":
        folder = Path(model_dir if generation_config == "auto" else generation_config)
        path = folder / "generation_config.json"
        if path.is_file():
            from_file = _generation_defaults(_read_generation_config(path), None)
        elif generation_config != "auto":
            raise ValueError(
                "generation_config must be auto, vllm or a directory holding "
                f"generation_config.json, got {generation_config!r} (no {path})"
            )
    name = "override_generation_config"
    from_override = _generation_defaults(parse_generation_override(override), name)
    try:
        defaults = SamplingDefaults(**{**from_file, **from_override})
    except ValueError as exc:  # its message starts with the field
        field_name = str(exc).split(" ", 1)[0]
        where = name if field_name in from_override else f"generation_config: {path}"
        raise ValueError(f"{where}: {exc}") from None
    if log and defaults.given():
        sources = [str(path)] * bool(from_file) + ["--override-generation-config"] * bool(
            from_override
        )
        logger.info(
            "sampling defaults for requests that do not set them (from %s): %s "
            "(--generation-config vllm ignores the model's)",
            " and ".join(sources),
            defaults.given(),
        )
    return defaults


def _read_generation_config(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return values


def parse_generation_override(override: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    """`--override-generation-config`'s JSON object (or the dict given), `{}` for None."""
    if override is None:
        return {}
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"override_generation_config must be a JSON object, got {override!r}: {exc}"
            ) from None
    if not isinstance(override, Mapping) or not all(isinstance(k, str) for k in override):
        raise ValueError(
            f"override_generation_config must be a JSON object (string keys), got {override!r}"
        )
    return override


def _generation_defaults(values: Mapping[str, Any], strict: str | None) -> dict[str, Any]:
    """The sampling defaults among generation_config.json-style `values`, as SamplingParams
    fields; with `strict` (the option's name) a key that is none of them is an error."""
    if strict is not None:
        unknown = sorted(set(values) - set(_GENERATION_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"{strict} has unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(_GENERATION_CONFIG_KEYS)}"
            )
    return {field: values[key] for key, field in _GENERATION_CONFIG_KEYS.items() if key in values}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: page size and pool size (explicit pages or a memory budget), prefix
    caching, and the host tier under it (`host_kv_cache_bytes`, 0: none)."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    host_kv_cache_bytes: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_pages or kv_cache_memory_bytes, not both")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}")
        if self.host_kv_cache_bytes and not self.enable_prefix_caching:
            raise ValueError(
                "host_kv_cache_bytes needs enable_prefix_caching: the host tier keeps the "
                "prefixes the radix tree evicts"
            )


SCHEDULING_POLICIES = ("fcfs", "cache-aware", "priority")
# When CUDA graphs are captured: all before the engine is ready, or one at a time between its
# steps after it (a step of a size with no graph yet runs eagerly).
CUDA_GRAPH_CAPTURES = ("startup", "background")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and the admission policy."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    policy: str = "fcfs"
    cache_aware_max_wait: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:  # a token in, one out
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.cache_aware_max_wait >= 0:
            raise ValueError(
                f"cache_aware_max_wait must be >= 0 seconds, got {self.cache_aware_max_wait}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}"
            )


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs: attention kernels, CUDA graphs, overlap, GPU memory for the KV cache."""

    attention_backend: str = "torch"
    enforce_eager: bool = False
    cuda_graph_max_bs: int = 256
    cuda_graph_max_prefill_tokens: int = 512
    overlap_scheduling: bool = True
    cuda_graph_capture: str = "startup"  # CUDA_GRAPH_CAPTURES
    gpu_memory_utilization: float = 0.9
    tuning_cache_dir: str = ""  # where start-up tuning decisions are kept ("": nowhere)
    tuning_threads: int = 1  # threads compiling the tuning's candidate kernels side by side
    shipped_tuning: bool = True  # start from the GEMV choices shipped for this GPU
    encoder_cache_tokens: int = 16384  # image tokens of vision-encoder outputs kept
    # Batch-invariant kernels: a request's logits do not depend on the rest of its batch.
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be >= 0, got {self.encoder_cache_tokens}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_capture not in CUDA_GRAPH_CAPTURES:
            raise ValueError(
                f"cuda_graph_capture must be one of {', '.join(CUDA_GRAPH_CAPTURES)}, "
                f"got {self.cuda_graph_capture!r}"
            )
        if self.tuning_threads < 1:
            raise ValueError(f"tuning_threads must be >= 1, got {self.tuning_threads}")
        if self.cuda_graph_max_prefill_tokens < 0:
            raise ValueError(
                "cuda_graph_max_prefill_tokens must be >= 0, got "
                f"{self.cuda_graph_max_prefill_tokens}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.deterministic and self.attention_backend == "flashinfer":
            raise ValueError(
                "deterministic needs attention_backend torch or triton (flashinfer's kernels "
                "split the KV by batch size), got 'flashinfer'"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices one model spans: `tensor_parallel_size` ranks, each a process with a
    shard of every weight (rank 0 is the engine core's own)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be: how many, how many bytes each (encoded), and how
    many pixels each (decoded, before resizing)."""

    max_images_per_prompt: int = 8
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for name in ("max_images_per_prompt", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServedModel:
    """What the api server and its tokenizer workers need of the engine's configuration: the
    model's folder, vocabulary, context and vision encoder, the sampling defaults and the image
    limits. `EngineArgs.create_served_model` resolves it without torch (seconds of those
    processes' start-up); `EngineConfig.served_model` is the same, from a resolved configuration.
    """

    path: str
    vocab_size: int
    max_model_len: int
    vision: VisionConfig | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    images: ImageLimits = field(default_factory=ImageLimits)
    priority_scheduling: bool = False  # a request may set `priority`

    @property
    def context_limits(self) -> ContextLimits:
        """What a request must fit (vocabulary, context), its default max_tokens, and whether
        it may set a priority."""
        return ContextLimits(
            self.vocab_size,
            self.max_model_len,
            self.sampling_defaults.max_tokens,
            self.priority_scheduling,
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, resolved: model, cache, scheduler, runner, device."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    device: str = "cpu"
    seed: int = 0
    load_format: str = "auto"
    tokenizer: str | None = None  # directory, if not the model's (structured outputs read it)
    speculative: SpeculativeConfig | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    images: ImageLimits = field(default_factory=ImageLimits)

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the engine accepts."""
        return self.scheduler.max_model_len or self.model.max_position_embeddings

    @property
    def served_model(self) -> ServedModel:
        """What the api server and the tokenizer workers need of this configuration."""
        return ServedModel(
            path=self.model.path,
            vocab_size=self.model.vocab_size,
            max_model_len=self.max_model_len,
            vision=self.model.vision,
            sampling_defaults=self.sampling_defaults,
            images=self.images,
            priority_scheduling=self.scheduler.policy == "priority",
        )

    @property
    def context_limits(self) -> ContextLimits:
        """What a request must fit (vocabulary, context), and its default max_tokens."""
        return self.served_model.context_limits


def check_device(device: str, devices: int = 1) -> str:
    """`device` if the engine can run there: "cpu", or "cuda"/"cuda:N" with the `devices` GPUs
    from N on visible (tensor parallelism's ranks use N, N + 1, ...); else `ValueError` naming
    the field (not torch's error in the middle of loading)."""
    import torch

    kind, colon, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        first = int(index or 0)
        if first + devices > count:
            needs = f"cuda:{first}"
            if devices > 1:
                needs += f"..cuda:{first + devices - 1} (tensor_parallel_size={devices})"
            visible = f"{count} CUDA device(s) are" if count else "no CUDA device is"
            raise ValueError(f"device is {device!r}: the engine needs {needs}, but {visible} "
                             f"visible{'' if count else '; use cpu'}")  # fmt: skip
    return device


def _default(value: int | None, default: int) -> int:
    return default if value is None else value


def option(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that is also a command-line option: `help` is its flag's help text,
    `extra` (e.g. `choices`) goes to `argparse` (see `entrypoints.cli.add_options`); a
    `dataclasses.MISSING` default makes the field, and its flag, required."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    """The user-facing engine options, flat: the offline `LLM(...)` keywords and the CLI flags.

    Each field's `help` is what `tokenmill --help` prints. `create_engine_config` resolves them into
    the frozen `EngineConfig` the engine runs with.
    """

    model: str = option(
        "", "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)."
    )
    tokenizer: str | None = option(None, "Tokenizer directory, if not the model directory.")
    dtype: str = option(
        "auto",
        "Weights and activations: auto (config.json's torch_dtype; float32 on a CPU without bf16 "
        "instructions, where half precision is slower), float32, bfloat16, float16.",
    )
    device: str | None = option(
        None, "Device to run on: cpu, cuda, cuda:N (default: cuda if present)."
    )
    load_format: str = option(
        "auto",
        "auto: read *.safetensors; dummy: random weights from config.json alone (benchmarks).",
        choices=("auto", "dummy"),
    )
    seed: int = option(0, "Seed for weights (dummy) and for sampling requests that give no seed.")
    max_model_len: int | None = option(
        None, "Longest prompt + output in tokens (default: max_position_embeddings)."
    )
    max_num_seqs: int | None = option(
        None, "Most sequences in one batch.", default_help="256 on a GPU, 64 on the CPU"
    )
    max_num_batched_tokens: int | None = option(
        None,
        "Token budget of one step; long prompts are prefilled in chunks of at most this.",
        default_help="8192 on a GPU, 2048 on the CPU",
    )
    page_size: int = option(16, "Tokens per KV-cache page.")
    num_pages: int | None = option(
        None, "KV-cache pages to allocate (default: from memory budget)."
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "KV-cache memory budget in bytes (default: enough for max_num_seqs full sequences, "
        "at most 2 GiB on the CPU).",
    )
    enable_prefix_caching: bool = option(
        True, "Reuse the KV of shared prompt prefixes (radix tree)."
    )
    host_kv_cache_bytes: int = option(
        0,
        "Host-memory tier under the prefix cache, in bytes (pinned on CUDA): prefixes evicted "
        "from the device KV cache are written there and loaded back on a hit instead of "
        "recomputed (a draft model's KV moves with them); 0: off.",
    )
    scheduling_policy: str = option(
        "fcfs",
        "Waiting-queue order: fcfs, cache-aware (longest cached prefix first, bounded by age), "
        "or priority (each request's `priority`, lower first, then arrival; the lowest is "
        "preempted first).",
        choices=SCHEDULING_POLICIES,
    )
    cache_aware_max_wait: float = option(
        2.0,
        "cache-aware policy: seconds a request may wait before it is admitted in arrival order, "
        "whatever its cached prefix.",
    )
    attention_backend: str | None = option(
        None,
        "Attention implementation: torch (reference, any device), triton (default on CUDA) or "
        "flashinfer (CUDA, needs the flashinfer package and --enforce-eager).",
        choices=ATTENTION_BACKENDS,
        default_help="triton on CUDA, torch on the CPU",
    )
    enforce_eager: bool = option(False, "Never use CUDA graphs (they speed up decode steps).")
    cuda_graph_max_bs: int = option(
        256, "Largest decode batch run from a CUDA graph (capped by max_num_seqs)."
    )
    cuda_graph_max_prefill_tokens: int = option(
        512,
        "Longest one-sequence prefill (new tokens) run from a CUDA graph, padded to a ladder "
        "of lengths (cuts a short prompt's time to first token where launching the kernels "
        "one by one takes longer than running them); 0: none.",
    )
    cuda_graph_capture: str | None = option(
        None,
        "When the CUDA graphs are captured: startup (all of them before the engine is ready) "
        "or background (the engine is ready first; then one graph at a time between steps, "
        "a batch size whose graph is not captured yet running eagerly: a start-up seconds "
        "shorter, each capture pausing the steps ~0.1 s). Default: background for `tokenmill "
        "serve` on one device without speculation, startup otherwise.",
        choices=CUDA_GRAPH_CAPTURES,
    )
    overlap_scheduling: bool = option(
        True, "Prepare step N+1 on the host while the GPU runs step N (hides host overhead)."
    )
    gpu_memory_utilization: float = option(
        0.9,
        "Fraction of the GPU memory free after loading the weights that the KV cache takes "
        "(when neither num_pages nor kv_cache_memory_bytes is given).",
    )
    speculative_config: str | Mapping[str, Any] | None = option(
        None,
        "Speculative decoding, as JSON (vLLM's shape): "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2} or {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 4}. "adaptive": true (the default) lets each step draft '
        "0..num_speculative_tokens tokens per request, from its measured acceptance and the "
        "measured cost of the step, so speculation turns itself off where it would slow the "
        'batch (large batches); "adaptive": false always drafts num_speculative_tokens.',
    )
    tensor_parallel_size: int = option(
        1,
        "Devices (ranks) one model is split across: attention heads, feed-forward and "
        "vocabulary sharded, one process per rank (NCCL on CUDA, gloo on the CPU). Must "
        "divide the attention heads and feed-forward sizes.",
        alias="-tp",
    )
    generation_config: str = option(
        "auto",
        "Default sampling settings of requests that do not set them: auto reads the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as max_tokens), vllm ignores it (tokenmill's defaults), or a directory "
        "holding a generation_config.json.",
    )
    override_generation_config: str | Mapping[str, Any] | None = option(
        None,
        "Sampling defaults set over --generation-config's, as JSON with generation_config.json's "
        'keys (vLLM\'s): e.g. {"temperature": 0.6, "max_new_tokens": 512}.',
    )
    max_images_per_prompt: int = option(
        8, "Vision-language models: most images in one request (more: a 400 error)."
    )
    max_image_bytes: int = option(
        20 << 20, "Vision-language models: largest image in a request, in bytes as sent."
    )
    max_image_pixels: int = option(
        4096 * 4096,
        "Vision-language models: most pixels of one image (width x height, before the image "
        "processor resizes it); a larger image is a 400 error, not decoded.",
    )
    encoder_cache_tokens: int = option(
        16384,
        "Vision-language models: image tokens of vision-encoder outputs kept on the device by "
        "image content, so that a repeated image (or a later chunk of one) is not encoded "
        "again; least recently used first out.",
    )
    deterministic: bool = option(
        False,
        "Batch-invariant mode: every reduction (matmuls, attention, norms, sampling) runs in "
        "one fixed order, so a greedy or seeded request gets the same tokens and logprobs "
        "whatever else is in its batch, however its prompt was chunked and whether its prefix "
        "was cached; slower (no split-K GEMV, no split-KV decode attention).",
    )
    tuning_cache_dir: str | None = option(
        None,
        "Folder where start-up tuning decisions (the GEMV kernel per weight shape) are kept, "
        "one file per GPU, driver, CUDA, torch and triton version, dtype and shape: a later start "
        "reads them instead of measuring again; an empty string keeps none.",
        default_help="$XDG_CACHE_HOME/tokenmill/tuning, else ~/.cache/tokenmill/tuning",
    )
    tuning_threads: int = option(
        TUNING_THREADS,
        "Threads that compile and check the start-up GEMV tuning's candidate kernels side by "
        "side, when the tuning cache does not hold a shape (Triton's compiler leaves Python's "
        "lock for most of its work); 1 compiles them one by one.",
        default_help=f"{TUNING_THREADS}, or the CPUs if fewer",
    )
    shipped_tuning: bool = option(
        True,
        "Where the tuning cache lacks a weight shape, take the GEMV choices tokenmill ships for "
        "this GPU (tokenmill/assets/gemv_defaults), once each chosen kernel is built and checked "
        "against cuBLAS here, instead of building and timing every candidate; "
        "--no-shipped-tuning measures every such shape.",
    )

    def create_served_model(self) -> ServedModel:
        """What the api server and its tokenizer workers need of `create_engine_config`'s
        result (its `served_model`), resolved without importing torch; checks the options it
        reads (and the dtype's name) as `create_engine_config` does, which checks the rest."""
        self._check_types()
        if not self.model:
            raise ValueError("model must be a checkpoint directory, got ''")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if isinstance(self.dtype, str) and self.dtype != "auto":  # (a torch.dtype is checked later)
            dtype_name(self.dtype)
        if self.max_model_len is not None and self.max_model_len < 2:  # a token in, one out
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        root = Path(self.model)
        arch, top, cfg = read_checkpoint_config(root)
        self._check_tokenizer_dir()
        vision = arch in _VISION_ARCHITECTURES
        positions = int(cfg.get("max_position_embeddings", 4096))
        if self.max_model_len is not None and self.max_model_len > positions:
            # The rotary tables (and the model's training) end there: a longer sequence would
            # fail in the middle of a step, not here.
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({positions}), "
                f"got {self.max_model_len}"
            )
        return ServedModel(
            path=str(root),
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=self.max_model_len or positions,
            vision=VisionConfig.from_hf(top, cfg) if vision else None,
            sampling_defaults=load_sampling_defaults(
                self.generation_config, self.model, self.override_generation_config
            ),
            images=ImageLimits(
                self.max_images_per_prompt, self.max_image_bytes, self.max_image_pixels
            ),
            priority_scheduling=self.scheduling_policy == "priority",
        )

    def _check_tokenizer_dir(self) -> None:
        """A `tokenizer` directory given must hold tokenizer files: a mistyped path would
        otherwise serve the model without a tokenizer (text prompts refused one by one)."""
        from tokenmill.tokenization.tokenizer import has_tokenizer

        if self.tokenizer is not None and not has_tokenizer(self.tokenizer):
            raise ValueError(
                f"tokenizer must be a directory holding tokenizer files (tokenizer.json, "
                f"tokenizer_config.json or tokenizer.model), got {self.tokenizer!r}"
            )

    def _check_types(self) -> None:
        """Each int, float, bool and str option has its type (a float an int too), an int
        one fits 64 bits: `ValueError` naming the field, not a `TypeError` (or a float page
        size) deep in start-up. `dtype` may be a `torch.dtype`, checked by `parse_dtype`."""
        hints = get_type_hints(EngineArgs)
        for f in fields(self):
            value = getattr(self, f.name)
            hint = hints[f.name]
            optional = isinstance(hint, types.UnionType) and type(None) in get_args(hint)
            if (optional and value is None) or f.name == "dtype":
                continue
            kinds = set(get_args(hint)) - {type(None)} if optional else {hint}
            if kinds == {bool}:
                ok = isinstance(value, bool)
            elif kinds == {int}:
                ok = isinstance(value, int) and not isinstance(value, bool)
                ok = ok and -(2**63) <= value < 2**63
            elif kinds == {float}:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            elif kinds == {str}:  # a directory may be a Path
                ok = isinstance(value, str | os.PathLike)
            else:
                continue
            if not ok:
                (kind,) = kinds
                name = {bool: "True or False", int: "an integer", float: "a number"}
                raise ValueError(
                    f"{f.name} must be {name.get(kind, 'a string')}, got {value!r}"
                    + (" (past 64 bits)" if type(value) is int and kind is int else "")
                )

    def for_server(self) -> EngineArgs:
        """These options as `tokenmill serve`'s engine core runs them: CUDA graphs captured
        in the background (ready seconds sooner) unless `cuda_graph_capture` is given or
        speculation or several devices need them captured at start-up."""
        if (
            self.cuda_graph_capture is not None
            or self.speculative_config is not None
            or self.tensor_parallel_size != 1
        ):
            return self
        return replace(self, cuda_graph_capture="background")

    def create_engine_config(self) -> EngineConfig:
        """Validate the options and resolve defaults into an `EngineConfig`."""
        served = self.create_served_model()
        if not 0 <= self.seed <= MAX_SEED:  # a request's own seed has the same range
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        import torch

        # `is None`, not falsiness: an empty string is refused, not taken for "auto".
        auto_device = "cuda" if torch.cuda.is_available() else "cpu"
        device = check_device(
            self.device if self.device is not None else auto_device,
            max(1, self.tensor_parallel_size),
        )
        # A GPU's step is cheap next to its host time only when it is large: the batch and
        # chunk sizes vLLM and SGLang default to on data-centre GPUs; a CPU's steps are slow.
        gpu = device.startswith("cuda")
        runner = RunnerConfig(
            attention_backend=self.attention_backend
            if self.attention_backend is not None
            else ("triton" if device.startswith("cuda") else "torch"),
            enforce_eager=self.enforce_eager,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            cuda_graph_max_prefill_tokens=self.cuda_graph_max_prefill_tokens,
            cuda_graph_capture=self.cuda_graph_capture
            if self.cuda_graph_capture is not None
            else "startup",
            overlap_scheduling=self.overlap_scheduling,
            gpu_memory_utilization=self.gpu_memory_utilization,
            deterministic=self.deterministic,
            tuning_cache_dir=default_tuning_cache_dir()
            if self.tuning_cache_dir is None
            else self.tuning_cache_dir,
            tuning_threads=min(self.tuning_threads, os.cpu_count() or 1),
            shipped_tuning=self.shipped_tuning,
            encoder_cache_tokens=self.encoder_cache_tokens,
        )
        model = ModelConfig.from_pretrained(self.model, self.dtype)
        half = model.dtype != torch.float32
        if self.dtype == "auto" and device == "cpu" and half and not cpu_has_bf16_instructions():
            name = str(model.dtype).removeprefix("torch.")
            logger.info(
                "dtype auto on a CPU without bf16 instructions: float32, not the checkpoint's "
                "%s (prefill ~7x faster; --dtype %s keeps it)", name, name,
            )  # fmt: skip
            model = replace(model, dtype=torch.float32)
        from tokenmill.spec.config import SpeculativeConfig  # spec.config imports this module

        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None:
            speculative.check(model, self.max_model_len or model.max_position_embeddings)
            if model.vision is not None and speculative.method == "draft_model":
                raise ValueError(
                    "speculative_config: a draft model cannot draft for a vision-language model "
                    "(it reads no images); use method ngram"
                )
        parallel = ParallelConfig(self.tensor_parallel_size)
        self._check_parallel(parallel, model)
        if runner.cuda_graph_capture == "background" and (
            speculative is not None or parallel.tensor_parallel_size > 1
        ):
            raise ValueError(
                "cuda_graph_capture background needs one device and no speculative_config "
                "(verify, draft and tensor-parallel graphs are captured at start-up)"
            )
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                page_size=self.page_size,
                num_pages=self.num_pages,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                host_kv_cache_bytes=self.host_kv_cache_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=_default(self.max_num_seqs, 256 if gpu else 64),
                max_num_batched_tokens=_default(self.max_num_batched_tokens, 8192 if gpu else 2048),
                max_model_len=self.max_model_len,
                policy=self.scheduling_policy,
                cache_aware_max_wait=self.cache_aware_max_wait,
            ),
            runner=runner,
            device=device,
            seed=self.seed,
            load_format=self.load_format,
            tokenizer=self.tokenizer,
            speculative=speculative,
            sampling_defaults=served.sampling_defaults,
            parallel=parallel,
            images=served.images,
        )

    def _check_parallel(self, parallel: ParallelConfig, model: ModelConfig) -> None:
        """Refuse a tensor-parallel size the model or the other options do not allow (a
        `ValueError` naming `tensor_parallel_size`; `check_device` checks the devices)."""
        tp = parallel.tensor_parallel_size
        if tp == 1:
            return
        check_tensor_parallel(model, tp)
        unsupported = {
            "host_kv_cache_bytes": bool(self.host_kv_cache_bytes),
            # An all-reduce's summation order depends on the message size (NCCL's algorithm
            # and protocol choice, gloo's chunking), so on the batch.
            "deterministic": self.deterministic,
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not work with {name} yet; use one of them"
                )
