"""Generated kernels: how many Triton kernels per Transformer block, and how fast each kind runs
on the numpy, C and Triton backends.

    python benchmarks/kernels.py

Prints JSON lines:
- ``block_kernels``: kernels of one standard-workload Block (forward, and forward + backward)
  compiled with backend="triton": Triton kernels by kind, and extern numpy calls (matmuls, shape
  ops, gathers).
- ``kernel``: per kernel kind (pointwise chain, row softmax, layer-norm core, GELU) on a large
  input, seconds per call and the bandwidth it reaches (bytes read + written / time) on the
  numpy, C and Triton backends. On CPU the Triton kernels run under Triton's interpreter, so
  their figure is a verification run's speed; the >= 80% of device bandwidth target applies on
  a GPU only.
"""
from __future__ import annotations

import collections
import json
import statistics
import time

import numpy as np

import dtensor
import dtensor.nn.functional as F
from dtensor.nn import Block, GPTConfig
from dtensor.ops import nn as nnops


def block_kernels() -> dict:
    cfg = GPTConfig(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                    block_size=128, bias=False, dropout=0.1)
    dtensor.manual_seed(0)
    block = Block(cfg)
    x = np.random.default_rng(0).standard_normal((8, 128, 256)).astype(np.float32)
    out = {}
    fwd = dtensor.compile(block, backend="triton")
    with dtensor.no_grad():
        fwd(dtensor.Tensor(x))

    def fwd_bwd(t):
        y = block(t)
        (y * y).sum().backward()
        return y

    both = dtensor.compile(fwd_bwd, backend="triton")
    both(dtensor.Tensor(x, requires_grad=True))
    for name, c in (("forward", fwd), ("forward_backward", both)):
        nodes = c.last.graph.nodes
        out[name] = {
            "triton": dict(collections.Counter(n.name for n in nodes if n.kind == "triton")),
            "triton_total": sum(1 for n in nodes if n.kind == "triton"),
            "extern_matmul": sum(1 for n in nodes if n.name == "matmul"),
            "extern_other": sum(1 for n in nodes if n.kind != "triton" and n.name != "matmul"),
        }
    return out


def _time(fn, reps=15) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def kernels() -> list[dict]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 1024)).astype(np.float32)
    y = rng.standard_normal((1024, 1024)).astype(np.float32)
    cases = {
        "pointwise_chain": (lambda a, b: ((a * b + 1.0).exp() * 0.5,), (x, y), 3),
        "row_softmax": (lambda a: (nnops.softmax(a, causal=False),), (x,), 2),
        "layer_norm_core": (lambda a: (nnops.normalize(a, eps=1e-5),), (x,), 2),
        "gelu": (lambda a: (F.gelu(a),), (x,), 2),
    }
    rows = []
    for name, (f, args, passes) in cases.items():
        nbytes = passes * x.nbytes
        rec = {"bench": "kernel", "kind": name, "elements": x.size}
        for backend in ("numpy", "c", "triton"):
            c = dtensor.compile(f, backend=backend)
            ts = [dtensor.Tensor(a) for a in args]
            s = _time(lambda: c(*ts))
            rec[f"{backend}_s"] = round(s, 5)
            rec[f"{backend}_GBps"] = round(nbytes / s / 1e9, 3)
        rec["triton_mode"] = "interpreter (CPU)"
        rows.append(rec)
    return rows


def main() -> None:
    print(json.dumps({"bench": "block_kernels", **block_kernels()}), flush=True)
    for rec in kernels():
        print(json.dumps(rec), flush=True)
    print(json.dumps({"bench": "device_bandwidth", "skipped": True,
                      "reason": "no GPU runtime here: Triton runs under its CPU interpreter, so "
                                "the >= 80% of device bandwidth bar cannot be measured"}))


if __name__ == "__main__":
    main()
