"""A built-in draft/target model pair: two small byte-level Llama models trained by the project on the Python
standard library's own source files (nothing is downloaded); the committed weights live in ``PAIR_DIR``.

``python -m specsampler.generate.modelpair --out DIR`` trains them again, deterministically, in a few minutes
on two CPU cores. The models' sizes and training: docs/design.md, "Speculative generation". transformers is
an optional dependency: it is imported inside the functions that need it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import Tensor

PAIR_DIR = Path(__file__).parent / "pair"
TRAIN_COMMAND = "python -m specsampler.generate.modelpair --out src/specsampler/generate/pair"

# Model shapes (LlamaConfig keyword arguments). Byte vocabulary, tied embeddings, RoPE.
# Sizes and steps were chosen so that both models train in about 6 minutes on 2 CPU cores.
TARGET_SHAPE = dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)
DRAFT_SHAPE = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=344)
CONTEXT = 256  # bytes per training window; the models' max_position_embeddings
TARGET_STEPS, DRAFT_STEPS = 1200, 1200

# Folders of the standard library left out of the corpus: tests, vendored and installed code, demos.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
                       "ensurepip", "__pycache__", "pydoc_data", "tkinter", "unittest"})


class ByteTokenizer:
    """Text <-> token ids, one token per utf-8 byte (id = byte value, 0..255)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The utf-8 bytes of ``text`` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """The text of the byte ids ``ids`` (list of ints or an integer tensor); bad utf-8 becomes U+FFFD."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return bytes(ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Loading


def load_pair(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
              pair_dir: str | Path = PAIR_DIR):
    """The committed (target, draft, tokenizer), models in eval mode on ``device`` in ``dtype``.

    Both models are ``transformers.LlamaForCausalLM`` over the byte vocabulary (256 ids): given
    ``input_ids [B, T]`` (int64) they return ``logits [B, T, 256]``; they accept
    ``position_ids``, ``past_key_values`` (``DynamicCache``) and 4-D attention masks. They
    were trained on 256-byte windows (``config.max_position_embeddings``).

    Raises:
        FileNotFoundError: the weights are missing (the message names the file and the command
            that trains them).
    """
    from transformers import AutoModelForCausalLM

    pair_dir = Path(pair_dir)
    models = []
    for name in ("target", "draft"):
        for file in ("config.json", "model.safetensors"):
            path = pair_dir / name / file
            if not path.is_file():
                raise FileNotFoundError(f"model pair weights missing: {path} does not exist; train them with "
                                        f"`{TRAIN_COMMAND}` (or `python -m specsampler.generate.modelpair --out "
                                        f"{pair_dir}`)")
        model = AutoModelForCausalLM.from_pretrained(pair_dir / name, dtype=dtype)
        models.append(model.to(device).eval())
    return models[0], models[1], ByteTokenizer()


# ---------------------------------------------------------------------------------------------
# Corpus


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files of the standard library (or of ``root``), sorted, outside ``SKIP_DIRS``."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if p.is_file())
    return sorted(p for p in files if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def load_corpus(files: list[Path]) -> Tensor:
    """The files' bytes concatenated in order, each followed by a blank line: uint8 ``[num_bytes]``."""
    data = b"".join(p.read_bytes() + b"\n\n" for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_corpus(data: Tensor, holdout: float = 0.02) -> tuple[Tensor, Tensor]:
    """(train, validation): the validation part is the last ``holdout`` fraction of ``data``."""
    n = int(len(data) * (1 - holdout))
    return data[:n], data[n:]


def random_windows(data: Tensor, batch_size: int, context: int, gen: torch.Generator) -> Tensor:
    """``batch_size`` windows of ``context + 1`` bytes at random offsets: int64 ``[batch_size, context + 1]``."""
    starts = torch.randint(0, len(data) - context, (batch_size,), generator=gen)
    return data[starts[:, None] + torch.arange(context + 1)].long()


def fixed_windows(data: Tensor, context: int, max_windows: int) -> Tensor:
    """Up to ``max_windows`` non-overlapping windows of ``context + 1`` bytes from the start of ``data``."""
    n = min(max_windows, (len(data) - 1) // context)
    return torch.stack([data[i * context: i * context + context + 1] for i in range(n)]).long()


# ---------------------------------------------------------------------------------------------
# Models and training


def make_model(shape: dict, context: int, seed: int):
    """A freshly initialised byte-level ``LlamaForCausalLM`` of ``shape`` (LlamaConfig kwargs), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, max_position_embeddings=context, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def next_byte_loss(model, windows: Tensor) -> Tensor:
    """Mean cross-entropy (nats, float32 scalar) of predicting ``windows[:, 1:]`` from ``windows[:, :-1]``."""
    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def validation_loss(model, windows: Tensor, batch_size: int = 16) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` over ``windows [W, context + 1]``."""
    model.eval()
    losses = [next_byte_loss(model, w) * len(w) for w in windows.split(batch_size)]
    model.train()
    return float(sum(losses) / len(windows))


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% of ``peak`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_model(model, train: Tensor, *, steps: int, batch_size: int, context: int, lr: float, seed: int,
                name: str = "model", log_every: int = 25) -> float:
    """Train ``model`` on random windows of ``train`` (uint8 bytes) for ``steps`` AdamW steps.

    Prints a progress line every ``log_every`` steps (step, smoothed loss, learning rate, elapsed
    seconds). Returns the wall time in seconds.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, lr)
    warmup = max(1, steps // 20)
    model.train()
    start, smooth = time.perf_counter(), None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        loss = next_byte_loss(model, random_windows(train, batch_size, context, gen))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"{name}: step {step + 1:5d}/{steps}  loss {smooth:.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)
    model.eval()
    return time.perf_counter() - start


def train_pair(out_dir: str | Path, *, seed: int = 0, target_steps: int = TARGET_STEPS, draft_steps: int = DRAFT_STEPS,
               batch_size: int = 8, context: int = CONTEXT, target_lr: float = 1e-3, draft_lr: float = 2e-3,
               target_shape: dict = TARGET_SHAPE, draft_shape: dict = DRAFT_SHAPE, val_windows: int = 256,
               corpus_root: str | Path | None = None, threads: int = 2, log_every: int = 25) -> dict:
    """Train the target, then the draft, and save them as ``out_dir/target/`` and ``out_dir/draft/``.

    Deterministic for a given seed, corpus, thread count and torch build: fixed seeds, a seeded
    generator for the windows, ``torch.use_deterministic_algorithms(True)`` and
    ``torch.set_num_threads(threads)`` (both restored on return). Both models train on random
    windows of ``context`` bytes (``batch_size`` per step) from the first 98% of the corpus; the
    last 2% gives the validation losses. Writes safetensors weights (float32) with their
    ``config.json``, and ``out_dir/training.json`` with the run's facts, which it also returns.
    """
    out_dir = Path(out_dir)
    files = corpus_files(corpus_root)
    data = load_corpus(files)
    train, val = split_corpus(data)
    val = fixed_windows(val, context, val_windows)
    print(f"corpus: {len(files)} files, {len(data)} bytes ({len(train)} train, {len(val)} validation windows "
          f"of {context})", flush=True)
    old_threads, old_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        start = time.perf_counter()
        report = {"seed": seed, "context": context, "batch_size": batch_size,
                  "corpus": {"files": len(files), "bytes": len(data), "holdout": 0.02},
                  "python": platform.python_version(), "torch": torch.__version__, "threads": threads}
        jobs = (("target", target_shape, target_steps, target_lr, seed),
                ("draft", draft_shape, draft_steps, draft_lr, seed + 1))
        for name, shape, steps, lr, model_seed in jobs:
            model = make_model(shape, context, model_seed)
            seconds = train_model(model, train, steps=steps, batch_size=batch_size, context=context, lr=lr,
                                  seed=model_seed, name=name, log_every=log_every)
            loss = validation_loss(model, val)
            print(f"{name}: validation loss {loss:.4f} nats/byte", flush=True)
            model.save_pretrained(out_dir / name)
            report[name] = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()),
                            "steps": steps, "lr": lr, "seed": model_seed, "train_seconds": round(seconds, 1),
                            "validation_loss": round(loss, 4)}
        report["wall_seconds"] = round(time.perf_counter() - start, 1)
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic)
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    """``python -m specsampler.generate.modelpair --out DIR [--seed N]``: train the pair into DIR."""
    parser = argparse.ArgumentParser(prog="python -m specsampler.generate.modelpair",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PAIR_DIR, help=f"output folder (default: {PAIR_DIR})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    parser.add_argument("--draft-steps", type=int, default=DRAFT_STEPS)
    args = parser.parse_args(argv)
    report = train_pair(args.out, seed=args.seed, target_steps=args.target_steps, draft_steps=args.draft_steps)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
