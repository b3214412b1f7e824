"""What dtensor.profiler costs a standard training step while it records.

The standard GPT workload (benchmarks/gpt_step.py's: 4 layers x 256, vocab 4096, batch 8 x
128), eager or compiled, in one process or parallelized under dtlaunch. Steps alternate in
pairs, one plain and one inside ``profile()`` (the merge and the file at the profile's exit are
not counted: they run once, after the work). Prints one JSON line (rank 0): median step
seconds both ways and ``overhead``, the median over pairs of on / off - 1.

    python benchmarks/profiler.py [--compile --backend c]
    dtlaunch --nproc 2 benchmarks/profiler.py --tp 2
    dtlaunch --nproc 2 benchmarks/profiler.py --tp 2 --compile --backend c --kinds

``--kinds`` (compiled) adds a line per node kind of the graph: rank 0's milliseconds, calls
and megabytes (the nodes' arrays, read and written) a step, their GB/s, and this machine's
copy rate (``copy_gbs``, every rank copying 64 MB at once): a kind near that rate is bound by
memory, one far below it (a GEMM) by arithmetic. A kind that touches part of an array (a
view such as adamw_part, a gather) counts all of it, so its rate can pass the copy rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import dtensor
from dtensor import profiler


def copy_gbs(group) -> float:
    """This rank's copy rate (GB/s read and written) of 64 MB, every rank of ``group``
    copying at the same moment, as a step's ranks do: the median of 5."""
    a = np.ones(16 << 20, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    rates = []
    for _ in range(5):
        if group is not None:
            group.barrier()
        t = time.perf_counter()
        np.copyto(b, a)
        rates.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return round(statistics.median(rates), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "c"))
    ap.add_argument("--kinds", action="store_true",
                    help="also a line per compiled node kind: rank 0's time, bytes and GB/s a "
                         "step, beside this machine's copy rate measured in the same run")
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

    off, on, kinds = [], [], {}
    for i in range(args.pairs):
        plain = timed()
        with profiler.profile() as p:
            traced = timed()
        off.append(plain)
        on.append(traced)
        if args.kinds and rank == 0:  # rank 0 holds every rank's events; pid 0 are its own
            mine = profiler.totals([e for e in p.events if e.get("pid") == 0])
            for (cat, name), got in mine.items():
                if cat == "kernel":
                    kinds[name] = tuple(map(sum, zip(kinds.get(name, (0, 0.0, 0)), got)))
    copy = copy_gbs(mesh.get_group(0) if args.tp > 1 else None) if args.kinds else None
    if rank == 0 and args.kinds:
        for name, (n, us, nbytes) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            print(json.dumps({
                "bench": "profiler_kind", "kind": name, "calls_per_step": n / args.pairs,
                "ms_per_step": round(us / 1e3 / args.pairs, 3),
                "mb_per_step": round(nbytes / 1e6 / args.pairs, 2),
                "gbs": round(nbytes / us / 1e3, 2) if nbytes else None,
                "copy_gbs": copy}))
    if rank == 0:
        print(json.dumps({
            "bench": "profiler", "mode": "compiled" if args.compile else "eager",
            "backend": args.backend if args.compile else None, "tp": args.tp,
            "pairs": args.pairs, "step_s_off": round(statistics.median(off), 4),
            "step_s_on": round(statistics.median(on), 4),
            "overhead": round(statistics.median(b / a for a, b in zip(off, on)) - 1, 4)}))


if __name__ == "__main__":
    main()
