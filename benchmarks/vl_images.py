"""Image requests on a Qwen3-VL checkpoint's shapes with dummy weights, and transformers in the
same run: time to first token per 1024x768 image, images per second for a batch of requests,
and the vision encoder's share of the engine's time.

Each request is one distinct random image (no encoder-cache or prefix hits) between the
vision tokens, a short instruction, and `--max-tokens` generated tokens (a placard's length is
~150; the default keeps the run short). The config folder needs `config.json` and
`preprocessor_config.json` (no tokenizer: token ids are built here).

    python benchmarks/vl_images.py --config benchmarks/models/qwen3-vl-30b-a3b --output vl.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine_core import EngineCore
from tokenmill.vision.inputs import ImageInput

# The instruction after the image: a few ordinary token ids (valid in any vocabulary).
INSTRUCTION = [11, 12, 13, 14, 15, 16, 17, 18]


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(llm: LLM, image: Image.Image) -> tuple[list[int], tuple[ImageInput, ...]]:
    vision = llm.config.model.vision
    assert vision is not None and llm.images is not None
    start = vision.vision_start_token_id
    ids = [start, vision.image_token_id, start + 1, *INSTRUCTION]
    return llm.images.expand(ids, [image])


def _run(
    engine: EngineCore, prompts: list[tuple[list[int], tuple]], params: SamplingParams
) -> dict:
    """Submit all prompts, step until done; (wall seconds, TTFT per request)."""
    arrival = {}
    for n, (ids, images) in enumerate(prompts):
        arrival[str(n)] = time.perf_counter()
        engine.add_request(str(n), ids, params, images)
    first: dict[str, float] = {}
    finished = 0
    while finished < len(prompts):
        for out in engine.step():
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = time.perf_counter()
            finished += out.finish_reason is not None
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - min(arrival.values())
    return {"wall_s": wall, "ttft_s": [first[k] - arrival[k] for k in sorted(first)]}


def tokenmill_side(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        args.config, load_format="dummy", max_model_len=args.max_model_len,
        max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_bytes,
    )  # fmt: skip
    engine, cache = llm.engine, llm.engine.runner.encoder_cache
    assert cache is not None
    t0 = time.perf_counter()
    prompts = [_prompt(llm, _image(i, args.width, args.height)) for i in range(args.batch + 9)]
    preprocess_s = (time.perf_counter() - t0) / len(prompts)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _run(engine, prompts[:1], one)  # warm-up
    ttft = [_run(engine, [p], one)["ttft_s"][0] for p in prompts[1:9]]
    encoder_before = cache.encoder_seconds()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = _run(engine, prompts[9:], params)
    encoder_s = cache.encoder_seconds() - encoder_before
    result = {
        "image_tokens": prompts[0][1][0].num_tokens,
        "prompt_tokens": len(prompts[0][0]),
        "preprocess_s_per_image": preprocess_s,
        "ttft_s_median": statistics.median(ttft),
        "ttft_s": ttft,
        "batch": args.batch,
        "images_per_s": args.batch / batch["wall_s"],
        "batch_wall_s": batch["wall_s"],
        "batch_ttft_s_median": statistics.median(batch["ttft_s"]),
        "encoder_s": encoder_s,
        "encoder_share_of_wall": encoder_s / batch["wall_s"],
        "images_encoded": cache.stats.images_encoded,
    }
    if args.profile:
        result["encoder_profile"] = _profile_encoder(llm, prompts[0][1][0])
    del llm, engine, cache
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the peer loads its own copy of the weights next
    return result


def _profile_encoder(llm: LLM, image: ImageInput) -> str:
    """torch.profiler's table of one image's encoder pass, kernels by device time."""
    model, device = llm.engine.runner.model, llm.engine.runner.device
    patches = torch.from_numpy(image.pixel_values).to(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        model.encode_images(patches, [image.grid_thw])  # warm-up
        with torch.profiler.profile(activities=activities) as prof:
            model.encode_images(patches, [image.grid_thw])
            if device.type == "cuda":
                torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)


def transformers_side(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(args.config)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).eval()
    processor = AutoImageProcessor.from_pretrained(args.config)
    start, image_token = config.vision_start_token_id, config.image_token_id

    def inputs(seeds: list[int]) -> dict[str, torch.Tensor]:
        out = processor(
            images=[_image(s, args.width, args.height) for s in seeds], return_tensors="pt"
        )
        n = int(out["image_grid_thw"][0].prod()) // 4
        ids = torch.tensor([[start, *[image_token] * n, start + 1, *INSTRUCTION]] * len(seeds))
        tensors = {
            "input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": (ids == image_token).int(),
        }  # fmt: skip
        return {name: t.cuda() for name, t in tensors.items()}

    def generate(kw: dict[str, torch.Tensor], new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(**kw, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        generate(inputs([0]), 1)
        ttft = [generate(inputs([i]), 1) for i in range(1, 5)]
        peer_batch = min(args.batch, args.peer_batch)
        wall = generate(inputs(list(range(100, 100 + peer_batch))), args.max_tokens)
    return {
        "ttft_s_median": statistics.median(ttft),
        "ttft_s": ttft,
        "batch": peer_batch,
        "images_per_s": peer_batch / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", required=True, help="folder with config.json and preprocessor_config.json"
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--batch", type=int, default=64, help="requests in the throughput run")
    parser.add_argument("--peer-batch", type=int, default=16, help="transformers' batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-bytes", type=int, default=20_000_000_000)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument(
        "--profile", action="store_true", help="print a profile of one image's encoder pass"
    )
    parser.add_argument("--output", default=None, help="JSON report")
    args = parser.parse_args()
    report: dict[str, Any] = {"config": args.config, "image": [args.width, args.height],
                              "tokenmill": tokenmill_side(args)}  # fmt: skip
    ours = report["tokenmill"]
    ttft_ms, prep_ms = ours["ttft_s_median"] * 1e3, ours["preprocess_s_per_image"] * 1e3
    print(
        f"tokenmill: {ours['image_tokens']} tokens/image, TTFT {ttft_ms:.1f} ms per image, "
        f"{ours['images_per_s']:.2f} images/s (batch {args.batch}, {args.max_tokens} tokens "
        f"out), vision encoder {ours['encoder_share_of_wall']:.0%} of the batch's time, "
        f"preprocessing {prep_ms:.1f} ms/image (host)"
    )
    if args.profile:
        print(ours["encoder_profile"])
    if not args.no_peer:
        peer = report["transformers"] = transformers_side(args)
        print(
            f"transformers: TTFT {peer['ttft_s_median'] * 1e3:.1f} ms per image, "
            f"{peer['images_per_s']:.2f} images/s (batch {peer['batch']})"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
