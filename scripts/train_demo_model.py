"""Train tokenmill's embedded demo models: a ~16 M Llama and a ~2 M draft sharing its tokenizer.

Two steps, reproducible from Debian's archive and this file alone:

    # 1. on any Debian machine with network access to the archive (seconds):
    python scripts/train_demo_model.py corpus --out data/demo-corpus
    # 2. on a GPU machine (a few minutes on an H200; the corpus directory travels with the tree):
    python scripts/train_demo_model.py train --corpus data/demo-corpus --out tokenmill/assets

The corpus is the documentation of Python 3.11 (the reStructuredText sources Debian ships in
`python3.11-doc`, PSF License Agreement) and of Django 3.2 (the text of the HTML pages in
`python-django-doc`, BSD-3-Clause): ~15 MB of edited English prose, under licences that allow
distributing derived works with their notice (kept in each checkpoint's README.md). Every 20th
document of each package (sorted by path) is held out. Without a GPU, `train` runs on the CPU
(bf16 autocast); pass smaller `--batch-size` and step counts there (README: the shipped run).

`train` writes two Hugging Face checkpoint directories (bf16 safetensors, byte-level BPE tokenizer,
ChatML chat template) plus `report.json`: held-out perplexity of both models, the draft's greedy
agreement with the big model, sample outputs and the training settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

PYTHON_DOCS = "python3.11-doc"
PYTHON_SOURCES = "usr/share/doc/python3.11/html/_sources"
DJANGO_DOCS = "python-django-doc"
DJANGO_HTML = "usr/share/doc/python-django-doc/html"
HELD_OUT_EVERY = 20
VOCAB_SIZE = 8192
SEQ_LEN = 512
BIG_NAME = DEMO_MODEL_DIR.name
DRAFT_NAME = DEMO_DRAFT_DIR.name
SAMPLE_PROMPTS = [
    "The list type",
    "To open a file for reading,",
    "A dictionary is",
    "The following example shows how to",
]

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`.])\1{2,}\s*$")


@dataclass(frozen=True)
class ModelShape:
    """The Llama hyper-parameters of one demo model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


BIG = ModelShape(384, 1024, 8, 6, 2)
DRAFT = ModelShape(128, 384, 4, 4, 2)


# ----------------------------------------------------------------------------- corpus


def clean_rst(text: str) -> str:
    """Strip the reST markup that is not prose: heading underlines and role wrappers."""
    lines = [line for line in text.splitlines() if not _UNDERLINE.match(line)]
    text = _ROLE.sub(r"\1", "\n".join(lines))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


class _HtmlText(HTMLParser):
    """The text of a Sphinx HTML page's `div.section` elements, one line per block element."""

    _BLOCKS = frozenset({"p", "pre", "li", "dt", "dd", "tr", "div", "h1", "h2", "h3", "h4", "br"})

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # open <div> elements since the first section, 0 outside one
        self.skip = 0  # open <script>/<style>/headerlink anchors
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div" and (self.depth or "section" in classes):
            self.depth += 1
        if tag in ("script", "style") or (tag == "a" and "headerlink" in classes):
            self.skip += 1
        if self.depth and tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self.depth:
            self.depth -= 1
        if tag in ("script", "style", "a") and self.skip:
            self.skip -= 1

    def handle_data(self, data: str) -> None:
        if self.depth and not self.skip:
            self.parts.append(data)


def html_text(page: str) -> str:
    """Readable text of one Sphinx HTML page (empty for index and search pages)."""
    parser = _HtmlText()
    parser.feed(page)
    text = re.sub(r"[ \t]*\n[ \t]*\n\s*", "\n\n", "".join(parser.parts))
    return text.strip() + "\n" if text.strip() else ""


def _package_docs(tmp: Path, package: str) -> tuple[str, list[str]]:
    """Download and unpack one Debian package; its documents as text, sorted by path."""
    subprocess.run(["apt-get", "download", package], cwd=tmp, check=True)
    deb = next(tmp.glob(f"{package}_*.deb"))
    root = tmp / package
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    if package == PYTHON_DOCS:
        files = sorted((root / PYTHON_SOURCES).rglob("*.rst.txt"))
        return deb.name, [clean_rst(f.read_text(encoding="utf-8")) for f in files]
    files = sorted((root / DJANGO_HTML).rglob("*.html"))
    docs = [html_text(f.read_text(encoding="utf-8")) for f in files]
    return deb.name, [d for d in docs if len(d) > 200]


def build_corpus(out: Path) -> None:
    """Download the documentation packages from Debian, extract their text, split documents
    (every HELD_OUT_EVERY-th of each package, by path) into train and held-out."""
    out.mkdir(parents=True, exist_ok=True)
    train, held, packages = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for package in (PYTHON_DOCS, DJANGO_DOCS):
            name, docs = _package_docs(Path(tmp), package)
            packages[name] = len(docs)
            held += [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == 0]
            train += [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY != 0]
    (out / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in train))
    (out / "heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in held))
    source = {"packages": packages, "held_out_every": HELD_OUT_EVERY}
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2))
    print(f"{len(train)} training and {len(held)} held-out documents from {packages}")


def read_docs(path: Path) -> list[str]:
    """The documents of one corpus split."""
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# ----------------------------------------------------------------------------- training


def token_stream(tokenizer: Any, docs: list[str]) -> torch.Tensor:
    """All documents as one id stream, each followed by EOS."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def make_model(shape: ModelShape, tokenizer: Any) -> Any:
    """A randomly initialised `LlamaForCausalLM` of `shape` with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(shape),
    )
    return LlamaForCausalLM(config)


def heldout_windows(stream: torch.Tensor, max_windows: int = 100_000) -> torch.Tensor:
    """Non-overlapping SEQ_LEN + 1 windows of the held-out stream (the last partial one dropped)."""
    n = min(max_windows, (len(stream) - 1) // SEQ_LEN)
    return torch.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])


@torch.no_grad()
def mean_loss(model: Any, windows: torch.Tensor, device: str, batch: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over every position of `windows`."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch].to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=w[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser and schedule settings of one model's training."""

    batch_size: int
    steps: int
    lr: float
    eval_every: int
    warmup: int = 100
    weight_decay: float = 0.1


@dataclass(frozen=True)
class RunSettings:
    """Both models' settings; the defaults are the H200 run's (CPU runs take smaller batches).

    During training the held-out loss is measured on the first `eval_windows` windows (to pick
    the best step); the reported perplexity covers the whole held-out split.
    """

    big_steps: int = 2000
    draft_steps: int = 3000
    batch_size: int = 32
    big_lr: float = 2e-3
    draft_lr: float = 3e-3
    eval_every: int = 100
    eval_windows: int = 256


def train_model(
    model: Any, train: torch.Tensor, windows: torch.Tensor, s: TrainSettings, device: str
) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay on random windows (bf16 autocast); keeps the weights
    of the step with the best loss on `windows`."""
    model.to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay, fused=False
    )
    gen = torch.Generator().manual_seed(0)
    best = (math.inf, 0, {k: v.detach().clone() for k, v in model.state_dict().items()})
    history = []
    start = time.perf_counter()
    for step in range(1, s.steps + 1):
        frac = min(1.0, step / s.warmup)
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / s.steps))
        for group in opt.param_groups:
            group["lr"] = s.lr * frac * decay
        starts = torch.randint(0, len(train) - SEQ_LEN - 1, (s.batch_size,), generator=gen)
        batch = torch.stack([train[i : i + SEQ_LEN + 1] for i in starts.tolist()]).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % s.eval_every == 0 or step == s.steps:
            held = mean_loss(model, windows, device)
            elapsed = time.perf_counter() - start
            history.append({"step": step, "train_loss": loss.item(), "heldout_loss": held})
            print(f"step {step}: train {loss.item():.3f} held-out {held:.3f} ({elapsed:.0f} s)")
            if held < best[0]:
                best = (held, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    return {
        "settings": asdict(s),
        "best_step": best[1],
        "train_seconds": time.perf_counter() - start,
        "history": history,
    }


@torch.no_grad()
def draft_agreement(big: Any, draft: Any, prompts: torch.Tensor, new: int, device: str) -> float:
    """Fraction of the big model's greedy continuation positions where the draft's argmax agrees.

    Both models see the same prefix (the prompt plus the big model's own tokens so far), as a
    speculative decoder's draft would when all its earlier guesses were accepted.
    """
    big.eval()
    draft.eval()
    seqs = big.generate(prompts.to(device), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    plen = prompts.shape[1]
    target = seqs[:, plen:]
    guess = draft(input_ids=seqs[:, :-1]).logits[:, plen - 1 :].argmax(-1)
    return (guess == target).float().mean().item()


def save_checkpoint(model: Any, tokenizer: Any, out: Path, card: str) -> None:
    """bf16 safetensors + tokenizer + chat template + a model card with the corpus licence
    (from a copy: `model` stays where it is, in float32)."""
    saved = copy.deepcopy(model).to("cpu", dtype=torch.bfloat16)
    saved.generation_config.do_sample = False
    saved.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(card)


def model_card(name: str, params: int, report: dict[str, Any], source: dict[str, Any]) -> str:
    """The checkpoint's README: what it is, what it was trained on and under which licence."""
    packages = [f"`{p}`" for p in source["packages"]]
    return (
        f"# {name}\n\n"
        f"A {params / 1e6:.1f} M parameter Llama-architecture model trained by tokenmill's "
        "`scripts/train_demo_model.py`, shipped as tokenmill's embedded default model.\n\n"
        "Training text: the documentation of Python 3.11 (reStructuredText sources) and of "
        f"Django 3.2 (text of the HTML pages), from Debian's packages {', '.join(packages)}; "
        f"every {source['held_out_every']}th document of each is held out.\n"
        f"Held-out perplexity: {report['heldout_perplexity']:.2f}.\n\n"
        "This model is a work derived from those documents. The Python documentation is "
        "Copyright (c) 2001-2023 Python Software Foundation, All Rights Reserved, distributed "
        "under the PSF License Agreement (https://docs.python.org/3/license.html). The Django "
        "documentation is Copyright (c) Django Software Foundation and individual contributors, "
        "distributed under the BSD 3-Clause License.\n"
    )


@torch.no_grad()
def samples(model: Any, tokenizer: Any, device: str) -> list[dict[str, str]]:
    """Greedy continuations of SAMPLE_PROMPTS, for the report."""
    model.eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        gen = model.generate(ids, max_new_tokens=48, do_sample=False)
        out.append({"prompt": prompt, "greedy": tokenizer.decode(gen[0, ids.shape[1] :])})
    return out


def train_all(corpus: Path, out: Path, run: RunSettings) -> None:
    """Tokenizer, big model, draft model, evaluation, checkpoints and report."""
    from tokenmill.testing.checkpoints import build_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, held_docs = read_docs(corpus / "train.jsonl"), read_docs(corpus / "heldout.jsonl")
    source = json.loads((corpus / "SOURCE.json").read_text())
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(VOCAB_SIZE, train_docs)
    train, held = token_stream(tokenizer, train_docs), token_stream(tokenizer, held_docs)
    windows = heldout_windows(held)
    print(f"tokenizer in {time.perf_counter() - t0:.0f} s: {len(train)} train tokens, {len(held)}")
    report: dict[str, Any] = {
        "corpus": source,
        "vocab_size": len(tokenizer),
        "train_tokens": len(train),
        "heldout_tokens_evaluated": windows[:, 1:].numel(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "settings": asdict(run),
    }
    models = {}
    for name, shape, settings in (
        (BIG_NAME, BIG, TrainSettings(run.batch_size, run.big_steps, run.big_lr, run.eval_every)),
        (
            DRAFT_NAME,
            DRAFT,
            TrainSettings(run.batch_size, run.draft_steps, run.draft_lr, run.eval_every),
        ),
    ):
        torch.manual_seed(0)
        model = make_model(shape, tokenizer)
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {params / 1e6:.2f} M parameters")
        result = train_model(model, train, windows[: run.eval_windows], settings, device)
        loss = mean_loss(model, windows, device)
        result.update(
            parameters=params, shape=asdict(shape), heldout_loss=loss,
            heldout_perplexity=math.exp(loss),
        )  # fmt: skip
        report[name] = result
        models[name] = model
        # Saved as soon as trained, so a run cut short keeps what it finished.
        save_checkpoint(model, tokenizer, out / name, model_card(name, params, result, source))
        (out / "report.json").write_text(json.dumps(report, indent=2))
    big, draft = models[BIG_NAME], models[DRAFT_NAME]
    prompts = windows[:32, :64]
    report["draft_greedy_agreement"] = draft_agreement(big, draft, prompts, 64, device)
    report["samples"] = samples(big, tokenizer, device)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    summary = {k: v for k, v in report.items() if k not in (BIG_NAME, DRAFT_NAME)}
    print(json.dumps(summary, indent=2))
    for name in models:
        print(name, "held-out perplexity", round(report[name]["heldout_perplexity"], 2))


def main() -> None:
    """`corpus` or `train`; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="Build the corpus from Debian's documentation packages.")
    c.add_argument("--out", type=Path, required=True, help="Where to write the corpus.")
    t = sub.add_parser("train", help="Train tokenizer, model and draft; write checkpoints.")
    t.add_argument("--corpus", type=Path, required=True, help="A corpus `corpus` built.")
    t.add_argument("--out", type=Path, required=True, help="Where to write the checkpoints.")
    defaults = RunSettings()
    for field, value in asdict(defaults).items():
        flag = "--" + field.replace("_", "-")
        t.add_argument(flag, type=type(value), default=value, help=f"(default: {value})")
    ns = parser.parse_args()
    if ns.cmd == "corpus":
        build_corpus(ns.out)
    else:
        run = RunSettings(**{f: getattr(ns, f) for f in asdict(defaults)})
        train_all(ns.corpus, ns.out, run)


if __name__ == "__main__":
    main()
