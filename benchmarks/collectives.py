"""all_reduce / all_gather / reduce_scatter bus bandwidth: dtensor.comm vs raw mpi4py.

All paths are measured in the same job, interleaved, on the same buffers; one JSON
line per (collective, size, ranks) with median times, bus bandwidths and ratios (mpi4py time /
dtensor time, taken within each rep, the median over reps): ``ratio`` for dtensor's default
fresh result array, ``ratio_out`` for ``out=`` a reused buffer, which is what the raw mpi4py
call gets, ``ratio_control`` for the raw call against itself (a second, identical path):
how far apart two equal paths land on this machine, and for all_reduce ``ratio_inplace`` for
``out=x`` (a compiled step's donated partial sums: on the shared-memory path the sum then
reads the operand itself and writes lines it has just read; 1 MB at 2 ranks 0.23 -> 0.15 ms,
4 MB 0.89 -> 0.64 ms against reading the operand's copy in the slot). dtensor's all_reduce
on one node goes through shared memory (dtensor/_shm.py) up to DTENSOR_SHM_BYTES (8 MiB):
there its ratio is that path against MPI's (measured: 4 MB at 2 ranks 2.31 -> 1.07 ms, 2.1x;
at 4 ranks on 2 cores 1.6x); the 64 MB runs go through MPI on both sides.

    python benchmarks/collectives.py             # spawns 2 and 4 ranks itself
    dtlaunch --nproc 4 benchmarks/collectives.py # or one world size under dtlaunch
    python benchmarks/collectives.py --hosts 2   # 2 simulated hosts x 2 ranks (root: network
                                                 # namespaces): within a host vs across the link

With ``--hosts N`` the ranks form an (N, 2) mesh over N simulated hosts (dtensor.testing.hosts,
UCX over TCP so that nothing takes a shared-memory shortcut between them): a 4 MB all_reduce
over each mesh dim, ``link`` "within host" (dim 1) or "across hosts" (dim 0), dtensor next to
raw mpi4py on the same sub-communicator.

Bus bandwidth (nccl-tests' definition) with S the logical buffer size in bytes:
all_reduce S/t * 2(n-1)/n; all_gather and reduce_scatter S/t * (n-1)/n.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

import numpy as np

SIZES_MB = (4, 64)


def run(repeats: int | None = None) -> list[dict]:
    from mpi4py import MPI

    from dtensor.comm import get_world

    comm, raw = get_world(), MPI.COMM_WORLD
    n = comm.size
    rows = []
    for mb in SIZES_MB:
        count = mb * (1 << 20) // 4  # float32 elements of the logical buffer
        count -= count % n
        full = np.ones(count, np.float32)
        part = np.ones(count // n, np.float32)
        out_full, out_part = np.empty_like(full), np.empty_like(part)
        zeros = np.zeros_like(full)  # reduced in place, it stays zeros: the same every call
        reps, iters = repeats or (96 if mb <= 4 else 72), 10 if mb <= 4 else 2
        # (dtensor with a fresh result, dtensor into a reused buffer, raw mpi4py, raw mpi4py
        # again as a control: its ratio to the first is this machine's noise floor)
        cases = {
            "all_reduce": (lambda: comm.all_reduce(full),
                           lambda: comm.all_reduce(full, out=out_full),
                           lambda: raw.Allreduce(full, out_full, op=MPI.SUM), 2 * (n - 1) / n),
            "all_gather": (lambda: comm.all_gather(part),
                           lambda: comm.all_gather(part, out=out_full),
                           lambda: raw.Allgather(part, out_full), (n - 1) / n),
            "reduce_scatter": (lambda: comm.reduce_scatter(full),
                               lambda: comm.reduce_scatter(full, out=out_part),
                               lambda: raw.Reduce_scatter_block(full, out_part, op=MPI.SUM),
                               (n - 1) / n),
        }
        for name, (fresh_fn, out_fn, mpi_fn, factor) in cases.items():
            paths = [fresh_fn, out_fn, mpi_fn, mpi_fn]
            if name == "all_reduce":  # in place (out=x), as a compiled step donates its buffer
                paths.append(lambda: comm.all_reduce(zeros, out=zeros))
            times: list[list[float]] = [[] for _ in paths]
            for f in paths:
                f()  # warm up every path
            # Blocks of calls after a barrier, interleaved, each rep in the next of the
            # orders of the paths: drift hits all paths alike, and each path follows each
            # other about equally often (a fixed order rotated would always run the reused-buffer
            # path right after the fresh one, whose 4 MB result pushed the buffer out of cache).
            orders = list(itertools.permutations(range(len(paths))))
            for rep in range(reps):
                for k in orders[rep % len(orders)]:
                    raw.Barrier()
                    t = time.perf_counter()
                    for _ in range(iters):
                        paths[k]()
                    times[k].append((time.perf_counter() - t) / iters)
            fresh, reused, mpi, control, *inplace = (statistics.median(ts) for ts in times)

            def paired(ts):  # raw / path within each rep: the machine's drift between reps cancels
                return round(statistics.median(m / t for m, t in zip(times[2], ts)), 3)

            nbytes = full.nbytes
            rows.append({
                "bench": "collectives", "op": name, "ranks": n, "size_mb": mb,
                "calls": reps * iters, "dtensor_ms": round(fresh * 1e3, 3),
                "dtensor_out_ms": round(reused * 1e3, 3), "mpi4py_ms": round(mpi * 1e3, 3),
                "dtensor_busbw_gbs": round(nbytes / fresh * factor / 1e9, 3),
                "mpi4py_busbw_gbs": round(nbytes / mpi * factor / 1e9, 3),
                "ratio": paired(times[0]), "ratio_out": paired(times[1]),
                "ratio_control": paired(times[3]),
                "dtensor_inplace_ms": round(inplace[0] * 1e3, 3) if inplace else None,
                "ratio_inplace": paired(times[4]) if inplace else None,
            })
    return rows


def run_links(repeats: int = 30, iters: int = 5) -> list[dict]:
    """A 4 MB all_reduce within each host and across hosts (the (hosts, 2) mesh's dims)."""
    from mpi4py import MPI

    import dtensor
    from dtensor.comm import get_world

    world = get_world()
    mesh = dtensor.init_device_mesh("cpu", (world.size // 2, 2), mesh_dim_names=("host", "local"))
    x, out = np.ones(1 << 20, np.float32), np.empty(1 << 20, np.float32)
    rows = []
    for dim, link in (("local", "within host"), ("host", "across hosts")):
        group = mesh.get_group(dim)
        paths = [lambda: group.all_reduce(x, out=out),
                 lambda: group._c.Allreduce(x, out, op=MPI.SUM)]
        times: list[list[float]] = [[], []]
        for f in paths:
            f()
        for rep in range(repeats):
            for k in (rep % 2, 1 - rep % 2):
                world.barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    paths[k]()
                times[k].append((time.perf_counter() - t) / iters)
        ours, mpi = (statistics.median(ts) for ts in times)
        factor = 2 * (group.size - 1) / group.size
        rows.append({"bench": "collectives", "op": "all_reduce", "link": link,
                     "ranks": group.size, "size_mb": 4, "dtensor_ms": round(ours * 1e3, 3),
                     "mpi4py_ms": round(mpi * 1e3, 3),
                     "dtensor_busbw_gbs": round(x.nbytes / ours * factor / 1e9, 3),
                     "mpi4py_busbw_gbs": round(x.nbytes / mpi * factor / 1e9, 3),
                     "ratio": round(statistics.median(m / t for m, t in zip(*times[::-1])), 3)})
    return rows


def hosts_main(n: int) -> None:
    """Start this benchmark on ``n`` simulated hosts x 2 ranks and print its lines."""
    import subprocess

    from dtensor.testing.hosts import simulated_hosts
    with simulated_hosts(n, slots=2) as hosts:
        out = subprocess.run([sys.executable, "-m", "dtensor.launcher", *hosts.dtlaunch_args(),
                              "--nproc", str(2 * n), "--no-prefix", __file__, "--links"],
                             capture_output=True, text=True, env={**os.environ, **hosts.env})
    sys.stdout.write(out.stdout)
    if out.returncode:
        sys.stderr.write(out.stderr)
        sys.exit(out.returncode)


def main() -> None:
    if "--hosts" in sys.argv:
        return hosts_main(int(sys.argv[sys.argv.index("--hosts") + 1]))
    if "--links" in sys.argv:  # the ranks of hosts_main's job
        rows = run_links()
        if int(os.environ["RANK"]) == 0:
            for row in rows:
                print(json.dumps(row), flush=True)
        return
    if "WORLD_SIZE" in os.environ:  # under dtlaunch: one world size
        rows = run()
        if int(os.environ["RANK"]) == 0:
            for row in rows:
                print(json.dumps(row), flush=True)
        return
    from dtensor.launcher import spawn
    for nproc in (2, 4):
        for row in spawn(run, nproc)[0]:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
