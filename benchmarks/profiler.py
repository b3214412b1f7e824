"""What dtensor.profiler costs a standard training step while it records.

The standard GPT workload (benchmarks/gpt_step.py's: 4 layers x 256, vocab 4096, batch 8 x
128), eager or compiled, in one process or parallelized under dtlaunch. Steps alternate in
pairs, one plain and one inside ``profile()`` (the merge and the file at the profile's exit are
not counted: they run once, after the work). Prints one JSON line (rank 0): median step
seconds both ways and ``overhead``, the median over pairs of on / off - 1.

    python benchmarks/profiler.py [--compile --backend c]
    dtlaunch --nproc 2 benchmarks/profiler.py --tp 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import dtensor
from dtensor import profiler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "c"))
    args = ap.parse_args()
    cfg = dtensor.nn.GPTConfig(vocab_size=4096, n_layer=4, n_embd=256, n_head=8,
                               mlp_hidden=1024, block_size=128, bias=False, dropout=0.0)
    dtensor.manual_seed(0)
    model = dtensor.nn.GPT(cfg)
    rank = 0
    if args.tp > 1:
        from dtensor.parallel import parallelize
        mesh = dtensor.init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
        parallelize(model, mesh)
        rank = mesh.get_rank()
    opt = dtensor.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)

    def train_step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = dtensor.compile(train_step, backend=args.backend) if args.compile else train_step
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 4096, (8, 128)), rng.integers(0, 4096, (8, 128))
    for _ in range(3):
        step(x, y).item()

    def timed() -> float:
        t = time.perf_counter()
        step(x, y).item()
        return time.perf_counter() - t

    off, on = [], []
    for i in range(args.pairs):
        plain = timed()
        with profiler.profile():
            traced = timed()
        off.append(plain)
        on.append(traced)
    if rank == 0:
        print(json.dumps({
            "bench": "profiler", "mode": "compiled" if args.compile else "eager",
            "backend": args.backend if args.compile else None, "tp": args.tp,
            "pairs": args.pairs, "step_s_off": round(statistics.median(off), 4),
            "step_s_on": round(statistics.median(on), 4),
            "overhead": round(statistics.median(b / a for a, b in zip(off, on)) - 1, 4)}))


if __name__ == "__main__":
    main()
