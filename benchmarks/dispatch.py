"""Per-op dispatch overhead: microseconds for a small op (8x8 add), with and without autograd,
for Tensor and for DTensor on a sharding-cache hit; and a compiled train step's per-call lookup
for the standard GPT workload (``compile_guards_us``: fingerprinting the Python values the trace
baked in, compile/guards.py; ``compile_lookup_us``: that plus the input signature, everything a
call does before its graph runs).

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
    for _ in range(min(n, 1000)):
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
    guards_us, lookup_us = compiled_lookup_us()
    print(json.dumps({
        "bench": "dispatch", "op": "add 8x8 float32",
        "numpy_us": round(numpy_us, 2),
        "tensor_us": round(no_grad_us, 2),
        "tensor_autograd_us": round(grad_us, 2),
        "requires_grad_under_no_grad_us": round(under_no_grad_us, 2),
        "dtensor_us": round(dtensor_us, 2),
        "dtensor_autograd_us": round(dtensor_grad_us, 2),
        "compile_guards_us": round(guards_us, 2),
        "compile_lookup_us": round(lookup_us, 2),
    }))


def compiled_lookup_us() -> tuple[float, float]:
    """(guards, whole lookup) microseconds per call of the standard workload's compiled step
    (benchmarks/gpt_step.py's model and AdamW), measured without tracing it."""
    from dtensor.compile import api, guards
    cfg = dtensor.nn.GPTConfig(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                               block_size=128, bias=False)
    model = dtensor.nn.GPT(cfg)
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-3)

    def step(idx, targets):
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    idx = np.zeros((8, 128), np.int64)
    env = api._Env(step)
    params = frozenset(map(id, env.params))
    guards_us = per_call_us(lambda: guards.fingerprint(step, (idx, idx), {}, params), n=500)

    def lookup():
        e = api._Env(step)
        return (api._key(e, (idx, idx), {}),
                guards.fingerprint(step, (idx, idx), {}, frozenset(map(id, e.params))))
    return guards_us, per_call_us(lookup, n=500)


if __name__ == "__main__":
    main()
