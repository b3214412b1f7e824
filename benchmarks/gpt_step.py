"""One training step of the standard GPT workload, eager, single process.

Prints one JSON line: median/min/max step seconds over --steps steps after --warmup, tokens/s,
achieved GFLOP/s (27.41 GFLOP per step for the standard workload, counted as in the issue), peak
RSS, and numpy's own float32 matmul GFLOP/s measured in the same run with the same threads, so
the result reads as a ratio.

    python benchmarks/gpt_step.py                 # standard workload
    python benchmarks/gpt_step.py --steps 20
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np

import dtensor


def step_flops(cfg, batch: int, seq: int) -> float:
    """6 x non-embedding params x tokens + 12 x n_layer x C x T x tokens (attention)."""
    C, L, H, V = cfg.n_embd, cfg.n_layer, cfg.mlp_hidden, cfg.vocab_size
    non_embedding = L * (4 * C * C + 2 * C * H + 4 * C) + 2 * C + V * C
    tokens = batch * seq
    return 6.0 * non_embedding * tokens + 12.0 * L * C * seq * tokens


def numpy_matmul_gflops(reps: int = 5) -> float:
    """numpy float32 GEMM at the workload's largest shape: (1024 x 256) @ (256 x 4096)."""
    a = np.random.default_rng(0).standard_normal((1024, 256), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((256, 4096), dtype=np.float32)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        times.append((time.perf_counter() - t) / 10)
    return 2 * 1024 * 256 * 4096 / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    cfg = dtensor.nn.GPTConfig(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                               block_size=args.seq, bias=False, dropout=0.0)
    dtensor.manual_seed(0)
    model = dtensor.nn.GPT(cfg)
    opt = dtensor.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=0.01)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
    targets = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))

    def step() -> float:
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    matmul_before = numpy_matmul_gflops()
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    matmul_after = numpy_matmul_gflops()
    matmul = max(matmul_before, matmul_after)
    med = statistics.median(times)
    flops = step_flops(cfg, args.batch, args.seq)
    gflops = flops / med / 1e9
    print(json.dumps({
        "bench": "gpt_step", "mode": "eager", "ranks": 1,
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "step_s_median": round(med, 4), "step_s_min": round(min(times), 4),
        "step_s_max": round(max(times), 4), "steps": args.steps,
        "tokens_per_s": round(args.batch * args.seq / med, 1),
        "gflop_per_step": round(flops / 1e9, 2), "gflops": round(gflops, 1),
        "numpy_matmul_gflops": round(matmul, 1),
        "ratio_to_matmul": round(gflops / matmul, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "python": sys.version.split()[0], "numpy": np.__version__,
    }))


if __name__ == "__main__":
    main()
