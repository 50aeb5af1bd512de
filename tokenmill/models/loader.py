"""Build a model on its device and fill it from safetensors files or with random weights."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.group import TPGroup
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.sharding import TensorSource, copy_shard, tp_dim
from tokenmill.models.registry import model_class

logger = logging.getLogger(__name__)

# Checkpoint tensors are read and copied into the parameters on this many threads: a read
# (page faults on the mapped file, a copy) and a host-to-device copy leave the GIL, so several
# run at once, and a checkpoint comes off the disk in parallel reads.
LOAD_THREADS = 8
# Checkpoint tensors that are derived at run time, not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in a hub checkpoint, e.g. `model.layers.0.mlp.experts.7.up_proj.weight`.
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)\.weight$")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    cfg: ModelConfig,
    device: torch.device,
    load_format: str,
    seed: int,
    tp: TPGroup | None = None,
) -> nn.Module:
    """Instantiate `cfg`'s architecture on `device` in `cfg.dtype` and load its weights; under
    tensor parallelism (`tp` of several ranks) this rank's share, from `cfg.shard(tp.size)`,
    reading only its slices of the checkpoint."""
    tp = tp or TPGroup.single()
    local = cfg.shard(tp.size)
    with _default_dtype(cfg.dtype), device:
        model = model_class(cfg)(local, tp)
    if load_format == "dummy":
        _init_dummy(model, seed)
    elif load_format == "auto":
        _load_safetensors(model, Path(cfg.path), cfg.tie_word_embeddings, tp)
    else:
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    return model.eval()


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights: norms at 1, everything else normal(0, 0.02), reproducible from `seed`.

    Drawn on the model's device (fast for billions of parameters), so values differ by device
    (and, for a sharded weight, by tensor-parallel rank; replicated ones agree).
    """
    gen: torch.Generator | None = None
    for name, param in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def _open_safetensors(path: Path) -> Any:
    """`safe_open` of one checkpoint file; `ValueError` naming it if it is not a safetensors
    file (corrupt or truncated), not safetensors' own error."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those listed by the index, or all `*.safetensors`."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted({str(name) for name in weight_map.values()})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"cannot read {index}: needs a JSON weight_map ({e!r})") from None
        files = [root / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"checkpoint index lists missing files: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {str(root)!r} "
            "(use load_format='dummy' for random weights)"
        )
    return files


class CheckpointTensor:
    """One tensor of an open safetensors file; `read` loads only the entries asked for."""

    def __init__(self, view: Any) -> None:
        self._view = view  # safetensors' slice object
        self.shape: tuple[int, ...] = tuple(view.get_shape())

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if not self.shape:
            return self._view[...]
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._view[index]


def _load_safetensors(model: nn.Module, root: Path, tied: bool, tp: TPGroup) -> None:
    """Copy every checkpoint tensor into its parameter (or its slice of one), `LOAD_THREADS`
    tensors at a time; a weight the model has and the checkpoint lacks is a ValueError."""
    params = dict(model.named_parameters(remove_duplicate=False))
    stacked: dict[str, tuple[str, str]] = model.stacked_params
    experts: dict[str, str] = getattr(model, "expert_params", {})
    prefixes: dict[str, str] = getattr(model, "checkpoint_prefixes", {})

    ignored: list[str] = []  # checkpoint tensors of no parameter (list.append: thread-safe)

    def load(name: str, tensor: TensorSource) -> set[str]:
        """Copy one checkpoint tensor; the parameter entries it filled."""
        name = _renamed(name, prefixes)
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            return set()
        target, shard = _expert_target(name, experts) or (name, None)
        if shard is None:
            for fragment, (ours, shard_id) in stacked.items():
                if fragment in name:
                    target, shard = name.replace(fragment, ours), shard_id
                    break
        if target not in params:
            ignored.append(name)
            return set()
        param = params[target]
        module = model.get_submodule(target.rsplit(".", 1)[0])
        if shard is not None:
            module.weight_loader(param, tensor, shard)
            return {f"{target}:{shard}"}
        _copy_param(module, param, tensor, tp, f"checkpoint tensor {name}")
        return _entries(module, target, shards=None)

    loaded: set[str] = set()
    with contextlib.ExitStack() as files:
        tensors = [
            (name, CheckpointTensor(f.get_slice(name)))
            for path in checkpoint_files(root)
            for f in [files.enter_context(_open_safetensors(path))]
            for name in f.keys()  # noqa: SIM118 - safe_open is not a mapping
        ]
        # Each tensor goes to parameter entries of its own: the copies need no lock.
        with ThreadPoolExecutor(LOAD_THREADS) as pool:
            for entries in pool.map(lambda item: load(*item), tensors):
                loaded |= entries
    if ignored:
        logger.warning(
            "ignoring %d checkpoint tensors with no parameter in the model: %s%s",
            len(ignored), ", ".join(sorted(ignored)[:8]), ", ..." if len(ignored) > 8 else "",
        )  # fmt: skip
    expected = _expected_entries(model, params, stacked, tied)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {str(root)!r} is missing weights: {', '.join(missing[:8])}")


def _renamed(name: str, prefixes: dict[str, str]) -> str:
    """A checkpoint name with its prefix replaced by ours (e.g. a vision-language model's
    `model.language_model.` by `model.`)."""
    for theirs, ours in prefixes.items():
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


def _copy_param(
    module: nn.Module, param: nn.Parameter, tensor: TensorSource, tp: TPGroup, what: str
) -> None:
    """Copy a whole checkpoint tensor (this rank's slice of it, if `param` is sharded)."""
    if isinstance(module, FusedMoE):
        module.load_stacked(param, tensor)
        return
    dim = tp_dim(param)
    if dim is None:
        if tensor.shape != tuple(param.shape):
            raise ValueError(f"{what} has shape {tensor.shape}, model expects {tuple(param.shape)}")
        param.data.copy_(tensor.read())
        return
    copy_shard(param.data, tensor, dim, tp, what)


def _expert_target(name: str, expert_params: dict[str, str]) -> tuple[str, str] | None:
    """The stacked parameter and shard of one expert's projection (`...experts.3.up_proj.weight`
    → `(...experts.gate_up_proj, "up:3")`), or None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in expert_params:
        return None
    kind = expert_params[match["proj"]]
    stacked = "down_proj" if kind == "down" else "gate_up_proj"
    return f"{match['experts']}.{stacked}", f"{kind}:{match['index']}"


def _entries(module: nn.Module, name: str, shards: list[str] | None) -> set[str]:
    """The entries a complete copy of parameter `name` stands for: one per expert shard of a
    `FusedMoE` weight (a checkpoint may hold them one by one or already stacked), else
    `name:shard` for each of `shards`, else `name`."""
    if isinstance(module, FusedMoE):
        shards = module.checkpoint_shards(name.rsplit(".", 1)[1])
    return {f"{name}:{shard}" for shard in shards} if shards else {name}


def _expected_entries(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    stacked: dict[str, tuple[str, str]],
    tied: bool,
) -> set[str]:
    """Every `param` or `param:shard` a complete checkpoint provides."""
    merged: dict[str, list[str]] = {}
    for ours, shard in stacked.values():
        merged.setdefault(ours, []).append(shard)
    expected = set()
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        fragment = next((m for m in merged if m in name), None)
        module = model.get_submodule(name.rsplit(".", 1)[0])
        expected.update(_entries(module, name, merged[fragment] if fragment else None))
    return expected
