"""Causal self-attention, forward and backward, as "math" (matmul, causal softmax, matmul: numpy
BLAS and, compiled, the C softmax kernels) and as "flash" (the attention op: one C kernel each
way that never writes the (L, L) scores whole, the backward recomputing them), eager and compiled
with backend="c", in one process.

    python benchmarks/attention.py [--threads 1] [--runs 7] [--cold]

Prints one JSON line per shape (batch, heads, L, E): the median seconds of each path over
--runs calls after two warm-up calls, and flash / math for eager and for compiled C, measured
in the same run. Shapes: this repository's standard workload at tensor-parallel 2 (8 x 4 heads
x 128 x 32), GPT-2 small's at tensor-parallel 2 (4 x 6 x 256 x 64), and one long sequence
(1 x 2 x 1024 x 64). ``--cold`` writes over 64 MiB before each call, so that its inputs come
from memory, as a training step's do (the projections that made them were two or more GEMMs
earlier).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SHAPES = [(8, 4, 128, 32), (4, 6, 256, 64), (1, 2, 1024, 64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each call")
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "DTENSOR_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np

    import dtensor
    import dtensor.nn.functional as F

    flush = np.zeros(64 << 20, np.uint8) if args.cold else None

    for B, H, L, E in SHAPES:
        rng = np.random.default_rng(0)
        q, k, v, g = (rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(4))
        result = {"shape": [B, H, L, E]}
        for kernel in ("math", "flash"):
            def step(q, k, v, kernel=kernel):
                for t in (q, k, v):
                    t.requires_grad = True
                with F.sdpa_kernel(kernel):
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return (y,) + tuple(dtensor.autograd.grad((y * dtensor.Tensor(g)).sum(),
                                                          [q, k, v]))

            for mode, fn in (("eager", step), ("c", dtensor.compile(step, backend="c"))):
                times = []
                for i in range(args.runs + 2):
                    inputs = [dtensor.Tensor(a) for a in (q, k, v)]
                    if flush is not None:
                        flush += 1
                    t0 = time.perf_counter()
                    fn(*inputs)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                result[f"{mode}_{kernel}_s"] = round(statistics.median(times), 5)
        for mode in ("eager", "c"):
            result[f"{mode}_flash_over_math"] = round(
                result[f"{mode}_flash_s"] / result[f"{mode}_math_s"], 3)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
