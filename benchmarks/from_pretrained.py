"""Peak memory of ``Llama.from_pretrained``: one process against tensor parallel on 4 ranks.

Writes a Hugging Face folder (config.json + model.safetensors, --size-mb of float32 weights, a
Llama shape), then loads it in a fresh process (``python this --load``) and under ``dtlaunch
--nproc 4`` (``dtensor.parallel.from_pretrained(Llama, folder, mesh)``: each rank reads only
its blocks of the sharded weights and the whole replicated ones, the norms). Each loading rank
reports its peak RSS (ru_maxrss) minus its RSS once everything is imported and the mesh exists,
and the bytes its parameters hold. The checkpoint is written by a process of its own: Linux
keeps ru_maxrss across exec, so a loader started by the writer would inherit the writer's peak.
Prints one JSON line per run:

    {"bench": "from_pretrained", "ranks": n, "peak_mb": ..., "ratio_to_one_process": ...,
     "params_mb": ..., "load_s": ...}

(peak_mb and params_mb of the tensor-parallel run: the largest rank's.) Issue 19's bar: at tp=4
the per-rank peak is under 0.35x the one-process one.

    python benchmarks/from_pretrained.py                 # ~400 MB checkpoint, 1 and 4 ranks
    python benchmarks/from_pretrained.py --size-mb 100 --nproc 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def config(size_mb: float):
    """A Llama shape of about ``size_mb`` MB of float32: width 1024, 16k vocabulary, untied
    head, as many layers as fit (each ~51 MB: attention 4 x 1024^2, SwiGLU 3 x 1024 x 2816)."""
    from dtensor.nn import LlamaConfig
    dim, vocab, hidden = 1024, 16000, 2816
    per_layer = (4 * dim * dim + 3 * dim * hidden) * 4
    layers = max(1, round((size_mb * 1e6 - 2 * vocab * dim * 4) / per_layer))
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=16,
                       hidden_dim=hidden)


def write(folder: str, size_mb: float) -> None:
    """The checkpoint, from random normal weights."""
    import numpy as np

    from dtensor.nn import Llama, init
    with init.empty_parameters():
        model = Llama(config(size_mb))
    rng = np.random.default_rng(0)
    for p in model.parameters():
        p.data = (rng.standard_normal(p.shape, np.float32) * 0.02).astype(np.float32)
    model.save_pretrained(folder)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def load(folder: str, out: str) -> None:
    """One loading rank: the measure, written to ``out``/rank<r>.json."""
    import dtensor
    import dtensor.parallel  # imported before the baseline: the load alone is measured
    from dtensor.distributed import get_rank, get_world_size
    from dtensor.nn import Llama
    world = get_world_size()
    mesh = dtensor.init_device_mesh("cpu", (world,)) if world > 1 else None
    base = rss_kib()
    if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 1.5 * base:
        raise RuntimeError("this process inherited a larger peak RSS than it holds (a parent's "
                           "across exec): its peak would not measure the load; run it from a "
                           "small process.")
    t0 = time.perf_counter()
    model = (Llama.from_pretrained(folder) if mesh is None else
             dtensor.parallel.from_pretrained(Llama, folder, mesh))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    held = sum((p.to_local() if p.is_distributed else p).data.nbytes for p in model.parameters())
    rank = get_rank()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "peak_mb": peak / 1024, "params_mb": held / 2**20, "load_s": seconds}))


def run(folder: Path, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        me = [os.path.abspath(__file__), "--load", str(folder), "--out", out]
        cmd = ([sys.executable, *me] if nproc == 1 else
               [sys.executable, "-m", "dtensor.launcher", "--nproc", str(nproc), *me])
        subprocess.run(cmd, check=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=400, help="checkpoint size (default 400)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks of the tensor-parallel load "
                    "(default 4)")
    ap.add_argument("--write", help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write:
        write(args.write, args.size_mb)
        return
    if args.load:
        load(args.load, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "llama")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--write", str(folder),
                        "--size-mb", str(args.size_mb)], check=True)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
        one = run(folder, 1)[0]
        ranks = run(folder, args.nproc)
    worst = max(ranks, key=lambda r: r["peak_mb"])
    for n, r in ((1, one), (args.nproc, worst)):
        print(json.dumps({"bench": "from_pretrained", "ranks": n, "checkpoint_mb": round(size, 1),
                          "peak_mb": round(r["peak_mb"], 1),
                          "ratio_to_one_process": round(r["peak_mb"] / one["peak_mb"], 3),
                          "params_mb": round(r["params_mb"], 1),
                          "load_s": round(max(q["load_s"] for q in (ranks if n > 1 else [one])),
                                          2)}), flush=True)


if __name__ == "__main__":
    main()
