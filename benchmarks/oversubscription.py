"""How MPICH's waiting behaves with more ranks than cores; the numbers behind OVERSUBSCRIBED_CVARS.

    python benchmarks/oversubscription.py [--nproc 8] [--reps 5]

For each CVAR setting, runs two jobs of ``--nproc`` ranks and prints one JSON line of medians:
- ``loop_s``: 200 x (64x64 matmul + tanh, 16-double Allreduce) on every rank: latency-bound.
- ``straggler_s``: rank 0 computes (~0.4 s alone) while the others wait in a Barrier; and
  ``waiters_cpu_s``, the CPU time the waiting ranks burn meanwhile. This is what makes an
  oversubscribed job unusable: pollers take the cores the working rank needs.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "default": {},
    "throttle": {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"},
    "heavy_yield": {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"},
}


def _rank_side(mode: str) -> None:
    import resource
    import time

    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD

    def cpu() -> float:
        return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])

    world.Barrier()
    t0, c0 = time.perf_counter(), cpu()
    if mode == "loop":
        a, out = np.random.default_rng(world.rank).standard_normal((64, 64)), np.zeros(16)
        for _ in range(200):
            a = np.tanh(a @ a.T * 1e-2)
            world.Allreduce(a[0, :16].copy(), out)
    else:
        if world.rank == 0:
            a = np.random.default_rng(0).standard_normal((160, 160))
            for _ in range(600):
                a = np.tanh(a @ a.T * 1e-2)
        world.Barrier()
    times = world.gather((time.perf_counter() - t0, cpu() - c0))
    if times is not None:  # rank 0
        print(json.dumps({"wall": max(w for w, _ in times),
                          "waiters_cpu": sum(c for _, c in times[1:])}))


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--rank"]:
        return _rank_side(args[1])
    nproc = int(args[args.index("--nproc") + 1]) if "--nproc" in args else 8
    reps = int(args[args.index("--reps") + 1]) if "--reps" in args else 5
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(reps):  # interleaved, so a busy moment hits every setting alike
        for name, cvars in SETTINGS.items():
            env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **cvars}
            row = {}
            for mode in ("loop", "straggler"):
                out = subprocess.run([mpiexec, "-n", str(nproc), sys.executable, __file__,
                                      "--rank", mode], env=env, capture_output=True, text=True,
                                     check=True, timeout=600).stdout
                result = json.loads(out)
                row[f"{mode}_s"] = result["wall"]
                if mode == "straggler":
                    row["waiters_cpu_s"] = result["waiters_cpu"]
            runs[name].append(row)
    for name, rows in runs.items():
        medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
        print(json.dumps({"setting": name, "nproc": nproc, "cores": os.cpu_count(), **medians}))


if __name__ == "__main__":
    main()
