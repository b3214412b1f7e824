"""How long a bad call takes to raise on every rank: every case of tests/test_bad_input.py,
each between barriers, timed until the last rank raised.

Prints one JSON line: the number of cases, by table, any case that did not raise as expected,
the five slowest (ms) and the median.

    mpiexec -n 2 python benchmarks/bad_input.py      # or: dtlaunch --nproc 2 ...
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_bad_input as cases  # noqa: E402

comm = MPI.COMM_WORLD
tmp = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)
tables = {"api": cases._api_cases(tmp), "tables": cases._table_cases(),
          "unclear": cases._unclear_cases(), "agreement": cases._agreement_cases(),
          "flags": cases._flag_cases(), "silent": cases._silent_cases(),
          "operands": cases._operand_cases(), "plans": cases._plan_cases()}
took, missed = {}, []
for table, rows in tables.items():
    for name, call, exc, _ in rows:
        comm.Barrier()
        start = time.perf_counter()
        try:
            call()
            raised = False
        except exc:
            raised = True
        except Exception:  # noqa: BLE001 - the wrong type counts as not raised
            raised = False
        took[name] = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if not comm.allreduce(int(raised), op=MPI.MIN):
            missed.append(name)
if comm.rank == 0:
    slowest = sorted(took.items(), key=lambda kv: -kv[1])[:5]
    print(json.dumps({"ranks": comm.size, "cases": len(took),
                      "by_table": {t: len(r) for t, r in tables.items()},
                      "not_raised_as_expected": missed,
                      "slowest_ms": [[n, round(1000 * t, 2)] for n, t in slowest],
                      "median_ms": round(1000 * float(np.median(list(took.values()))), 3)}))
