"""Per-op dispatch overhead: microseconds for a small op (8x8 add), with and without autograd,
for Tensor and for DTensor on a sharding-cache hit.

Prints one JSON line. numpy's own 8x8 add is measured in the same run, so the overhead reads
as the difference.

    python benchmarks/dispatch.py
"""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

import dtensor


def per_call_us(fn, n: int = 20000, repeats: int = 7) -> float:
    for _ in range(1000):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    a = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    x, y = dtensor.Tensor(a), dtensor.Tensor(a)
    xg, yg = dtensor.Tensor(a, requires_grad=True), dtensor.Tensor(a, requires_grad=True)
    numpy_us = per_call_us(lambda: a + a)
    no_grad_us = per_call_us(lambda: x + y)
    grad_us = per_call_us(lambda: xg + yg)
    with dtensor.no_grad():
        under_no_grad_us = per_call_us(lambda: xg + yg)
    # DTensor dispatch on a sharding-cache hit: a world-of-one mesh has the same code path as
    # N ranks (spec lookup, strategy cache, local impl) minus the collectives, which the rules
    # do not need for Shard + Shard.
    mesh = dtensor.init_device_mesh("cpu", (1,))
    dx = dtensor.distribute_tensor(x, mesh, [dtensor.Shard(0)])
    dy = dtensor.distribute_tensor(y, mesh, [dtensor.Shard(0)])
    dxg = dtensor.distribute_tensor(xg, mesh, [dtensor.Shard(0)])
    dyg = dtensor.distribute_tensor(yg, mesh, [dtensor.Shard(0)])
    dtensor_us = per_call_us(lambda: dx + dy)
    dtensor_grad_us = per_call_us(lambda: dxg + dyg)
    print(json.dumps({
        "bench": "dispatch", "op": "add 8x8 float32",
        "numpy_us": round(numpy_us, 2),
        "tensor_us": round(no_grad_us, 2),
        "tensor_autograd_us": round(grad_us, 2),
        "requires_grad_under_no_grad_us": round(under_no_grad_us, 2),
        "dtensor_us": round(dtensor_us, 2),
        "dtensor_autograd_us": round(dtensor_grad_us, 2),
    }))


if __name__ == "__main__":
    main()
