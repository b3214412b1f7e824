"""Train a character-level GPT on English text that every Python install carries: the standard
library's own docstrings, gathered deterministically (sorted files, parsed with ast, never
imported).

    python examples/train.py                        # one process; loss ~4.6 -> ~2.1
    dtlaunch --nproc 8 examples/train.py            # 2-D mesh: dp=4 x tp=2, the same loss curve
    dtlaunch --nproc 4 examples/train.py --tp 2 --dp 2 --sp --fsdp
    python examples/train.py --compile              # the whole step through dtensor.compile
    python examples/train.py --compile --backend c  # ... with generated C kernels
    python examples/train.py --save-every 100       # sharded checkpoints in checkpoints/train
    dtlaunch --nproc 4 examples/train.py --resume checkpoints/train   # continue, any layout
    python examples/train.py --steps 100 --n-layer 2
    python examples/train.py --help

Under dtlaunch the model goes through dtensor.parallel.parallelize on a ("dp", "tp") mesh:
Megatron tensor parallelism over "tp" (optionally sequence parallel, --sp), data parallelism
over "dp" (parameters replicated, or sharded with --fsdp). Every rank draws the same global
batch; each "dp" rank computes on its rows. By default tp is 2 (when the ranks and heads allow)
and dp takes the rest.

Every flag maps to a field of TrainConfig; the model is dtensor.nn.GPT.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import dtensor
from dtensor.nn import GPT, GPTConfig


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 16
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    corpus_chars: int = 2_000_000
    eval_every: int = 100
    seed: int = 1337
    sample_chars: int = 300
    tp: int = 0  # 0: 2 if the ranks and heads allow, else 1
    dp: int = 0  # 0: the ranks tp leaves
    sp: bool = False
    fsdp: bool = False
    compile: bool = False  # run the whole train step through dtensor.compile
    backend: str = "numpy"  # dtensor.compile's code generator: numpy, c or triton
    log_every: int = 10
    save_every: int = 0  # > 0: a sharded checkpoint every this many steps
    save_dir: str = "checkpoints/train"
    resume: str = ""  # a checkpoint folder to continue from (any --nproc / layout)
    stop_after: int = 0  # > 0: stop after this many steps (as if interrupted), schedule intact


# ----------------------------------------------------------------------------- data

def stdlib_docstrings(max_chars: int) -> str:
    """Module, class and function docstrings of the standard library, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo"}
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc.strip() + "\n\n")
                    total += len(parts[-1])
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    # Printable ASCII plus newline keeps the vocabulary small (~96 symbols).
    return "".join(c if (" " <= c <= "~" or c == "\n") else " " for c in text)


class CharData:
    def __init__(self, text: str, seed: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = np.array([self.stoi[c] for c in text], dtype=np.int64)
        split = int(0.95 * len(data))
        self.train, self.val = data[:split], data[split:]
        self.rng = np.random.default_rng(seed)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch_size: int, block_size: int):
        data = self.train if split == "train" else self.val
        starts = self.rng.integers(0, len(data) - block_size - 1, batch_size)
        x = np.stack([data[s:s + block_size] for s in starts])  # (B, T)
        y = np.stack([data[s + 1:s + block_size + 1] for s in starts])  # (B, T)
        return x, y

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# ----------------------------------------------------------------------------- training

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def progress(step: int, total: int, width: int = 20) -> str:
    done = int(width * step / total)
    return "[" + "#" * done + "-" * (width - done) + f"] {100 * step / total:5.1f}%"


def evaluate(model, data: CharData, cfg: TrainConfig, batches: int = 4) -> float:
    model.eval()
    with dtensor.no_grad():
        losses = [model(*data.batch("val", cfg.batch_size, cfg.block_size))[1].item()
                  for _ in range(batches)]
    model.train()
    return float(np.mean(losses))


def mesh_shape(cfg: TrainConfig, world: int) -> tuple[int, int]:
    """(dp, tp) for ``world`` ranks, filling in the flags left at 0."""
    if cfg.tp:
        tp = cfg.tp
    elif cfg.dp:
        tp = world // cfg.dp
    else:
        tp = 2 if world % 2 == 0 and cfg.n_head % 2 == 0 else 1
    dp = cfg.dp or world // tp
    if dp * tp != world:
        raise ValueError(f"--dp {dp} x --tp {tp} = {dp * tp} ranks, but this job has {world}; "
                         f"launch with dtlaunch --nproc {dp * tp} or change the flags.")
    if cfg.batch_size % dp:
        raise ValueError(f"--batch-size {cfg.batch_size} must divide over dp={dp} ranks.")
    return dp, tp


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, type=type(f.default), default=f.default)
    cfg = TrainConfig(**vars(ap.parse_args(argv)))

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    print_ = print if rank == 0 else (lambda *a, **k: None)
    dp, tp = mesh_shape(cfg, world)
    dtensor.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    data = CharData(stdlib_docstrings(cfg.corpus_chars), cfg.seed)
    print_(f"corpus: {len(data.train) + len(data.val):,} chars of Python stdlib docstrings, "
          f"vocab {data.vocab_size} ({time.perf_counter() - t0:.1f}s)")

    model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=data.vocab_size,
                          n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                          dropout=cfg.dropout))
    if world > 1:
        from dtensor.parallel import parallelize
        mesh = dtensor.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh, sequence_parallel=cfg.sp, fsdp=cfg.fsdp)
        print_(f"mesh: dp={dp} x tp={tp}{' sequence-parallel' if cfg.sp else ''}"
               f"{' fsdp' if cfg.fsdp else ''}")
    print_(f"model: {model.num_params(non_embedding=False):,} parameters; "
          f"initial loss should be near ln({data.vocab_size}) = {math.log(data.vocab_size):.2f}")
    opt = dtensor.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def train_step(x, y):
        _, loss = model(x, y)
        loss.backward()
        dtensor.optim.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        return loss

    step_fn = dtensor.compile(train_step, backend=cfg.backend) if cfg.compile else train_step
    def state() -> dict:
        """Everything a resumed run needs to continue exactly: weights, optimizer, the
        counter-based RNG and the data order's RNG, the step."""
        return {"model": model.state_dict(), "optim": opt.state_dict(),
                "rng": dtensor.random.get_rng_state(),
                "data_rng": data.rng.bit_generator.state, "step": 0}

    start = 0
    if cfg.resume:
        st = state()
        dtensor.checkpoint.load(st, cfg.resume)
        opt.load_state_dict(st["optim"])
        dtensor.random.set_rng_state(st["rng"])
        data.rng.bit_generator.state = st["data_rng"]
        start = st["step"]
        print_(f"resumed from {cfg.resume} at step {start}")

    tokens = cfg.batch_size * cfg.block_size
    t_last, last_logged, loss_val = time.perf_counter(), start - 1, float("nan")
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss_val = step_fn(*data.batch("train", cfg.batch_size, cfg.block_size)).item()
        if not math.isfinite(loss_val):
            # Every rank holds the same (replicated) loss, so all of them stop here together.
            raise SystemExit(
                f"step {step}: loss is {loss_val}; training diverged, stopping. The learning "
                f"rate (--lr {cfg.lr:g}, {lr_at(step, cfg):.2e} at this step) is likely too "
                f"high: lower it, lengthen --warmup, or check --grad-clip and the data.")
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            now = time.perf_counter()
            n = step - last_logged  # steps since the last line (eval and saves included)
            print_(f"step {step:5d} {progress(step + 1, cfg.steps)}  loss {loss_val:.4f}  "
                  f"lr {lr_at(step, cfg):.2e}  {n * tokens / (now - t_last):8.0f} tok/s",
                  flush=True)
            t_last, last_logged = now, step
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            val = evaluate(model, data, cfg)
            print_(f"step {step:5d} val loss {val:.4f}", flush=True)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            st = state()
            st["step"] = step + 1
            dtensor.checkpoint.save(st, cfg.save_dir)
            print_(f"step {step:5d} saved {cfg.save_dir}", flush=True)
        if cfg.stop_after and step + 1 >= cfg.stop_after:
            print_(f"stopping after step {step} (--stop-after)")
            return float("nan")

    val = evaluate(model, data, cfg)
    print_(f"final: train loss {loss_val:.4f}, val loss {val:.4f}, "
          f"{time.perf_counter() - t0:.0f}s total")
    # One copy of the prompt per "dp" rank (the batch is split over "dp"); print the first.
    prompt = np.array([[data.stoi[c] for c in "Return the "]] * dp)
    model.eval()
    out = model.generate(prompt, cfg.sample_chars, temperature=0.8, top_k=20)
    print_("sample:\n" + data.decode(out[0].tolist()))
    return val


if __name__ == "__main__":
    val = main()
    sys.exit(0 if val < 2.5 or math.isnan(val) else 1)
