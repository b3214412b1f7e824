"""What the ranks' agreement checks (Comm.check_same) cost a parallel training step of the
standard GPT workload: checks per step and the time inside them, as a share of the step in the
same run. The time includes waiting for the last rank to arrive, which the step's next
collective would otherwise absorb, so the share is an upper bound.

    dtlaunch --nproc 2 benchmarks/agreement.py --tp 2
    dtlaunch --nproc 4 benchmarks/agreement.py --tp 2 --dp 2
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import dtensor
from dtensor.comm import Comm, get_world
from dtensor.nn import GPT, GPTConfig
from dtensor.parallel import parallelize

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=2)
p.add_argument("--dp", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

calls, spent = [0], [0.0]
check_same = Comm.check_same


def timed(self, *a, **kw):
    start = time.perf_counter()
    try:
        return check_same(self, *a, **kw)
    finally:
        spent[0] += time.perf_counter() - start
        calls[0] += 1


Comm.check_same = timed
cfg = GPTConfig(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                block_size=128, bias=False)
dtensor.manual_seed(0)
model = GPT(cfg)
if args.dp > 1:
    mesh = dtensor.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
else:
    mesh = dtensor.init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
parallelize(model, mesh)
opt = dtensor.optim.AdamW(model.parameters(), lr=3e-4)
rng = np.random.default_rng(0)
steps, checks = [], []
for s in range(args.steps + 1):
    idx = rng.integers(0, cfg.vocab_size, (8, cfg.block_size))
    tgt = rng.integers(0, cfg.vocab_size, (8, cfg.block_size))
    c0, s0, start = calls[0], spent[0], time.perf_counter()
    _, loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()
    if s:  # the first step fills the caches
        steps.append(time.perf_counter() - start)
        checks.append((calls[0] - c0, spent[0] - s0))
if get_world().rank == 0:
    step, inside = float(np.median(steps)), float(np.median([t for _, t in checks]))
    print(json.dumps({"layout": f"dp{args.dp}xtp{args.tp}", "checks_per_step": checks[-1][0],
                      "median_step_s": round(step, 4),
                      "median_ms_in_checks_per_step": round(1000 * inside, 3),
                      "share_of_step": round(inside / step, 5)}))
