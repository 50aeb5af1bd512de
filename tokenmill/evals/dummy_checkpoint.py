"""Random weights written as a Hugging Face checkpoint directory, for conformance on model shapes
whose real weights are not at hand: the server and the transformers reference then load the very
same numbers (`tokenmill serve DIR` and `tokenmill eval conformance --model DIR`).

Initialised like `--load-format dummy`: norms 1, biases 0, every other tensor normal(0,
`initializer_range`); the tensors are drawn one at a time (on the GPU when there is one) and
written in safetensors shards of at most 4 GB with their index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tokenmill.config import DEMO_MODEL_DIR, parse_dtype
from tokenmill.evals.options import DummyCheckpointArgs

SHARD_BYTES = 4 * 1024**3
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip


def write_dummy_checkpoint(args: DummyCheckpointArgs) -> Path:
    """Write `args.output`: config.json (dtype set), random safetensors, a tokenizer."""
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(args.dtype)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = AutoConfig.from_pretrained(args.config)
    with torch.device("meta"):
        shapes = {
            k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    std = float(getattr(config, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, files = 0, 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if len(shape) == 1:
            tensor.fill_(1.0 if "norm" in name else 0.0)
        else:
            tensor.normal_(0.0, std, generator=gen)
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor.cpu()
        shard_bytes += size
        total += size
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((Path(args.config) / "config.json").read_text())
    cfg["torch_dtype"] = args.dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer = Path(args.tokenizer) if args.tokenizer else DEMO_MODEL_DIR
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out
