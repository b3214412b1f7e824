"""The planner (dtensor.parallel.plan): how long it takes on a 12-layer model, and whether the
plan it finds moves exactly the bytes of Megatron's hand-written plan.

Prints JSON lines on rank 0:

* ``plan_seconds``: median / min / max over --runs plans of a 12-layer GPT, the same GPT with
  nanoGPT's fused attention (``c_attn(x).split(C, dim=2)``: split part by part, StridedShard)
  and a 12-layer Llama (GPT-2 small's widths: 768 wide, 12 heads; the Llama with 4 key/value
  heads), built under
  ``nn.init.empty_parameters()`` (no weights drawn: planning reads shapes only). Each plan
  traces one forward at the batch's shapes and grows every chain.
* ``bytes_vs_megatron``: one forward and backward of a small GPT and Llama (4 layers, 256
  wide) laid out by the found plan and by the hand plan (``gpt_plan``, ``llama_tp_plan``),
  with sequence parallelism off and on: the collectives each issued (the debug counter), their
  ratio, and whether the plan's own price equals what it issued. For the fused GPT the hand
  plan is ``gpt_plan`` on the unfused GPT: the same sizes, so the same bytes are the bar.

    dtlaunch --nproc 2 benchmarks/plan.py
    dtlaunch --nproc 4 benchmarks/plan.py            # tp 4
    dtlaunch --nproc 4 benchmarks/plan.py --dp 2     # dp 2 x tp 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import dtensor
import dtensor.distributed
from dtensor.comm import count_collectives
import dtensor.nn.functional as F
from dtensor.nn import GPT, GPTConfig, Linear, Llama, LlamaConfig, Module, init
from dtensor.parallel import gpt_plan, llama_tp_plan, plan
from dtensor.parallel.api import _parallelize


def _mesh(dp: int):
    n = dtensor.distributed.get_world_size()
    if dp > 1:
        return dtensor.init_device_mesh("cpu", (dp, n // dp), mesh_dim_names=("dp", "tp"))
    return dtensor.init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))


class _FusedAttention(Module):
    """nanoGPT's attention: one Linear makes [q | k | v], read by ``.split(C, dim=2)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def _fused(model: GPT) -> GPT:
    for block in model.blocks:
        block.attn = _FusedAttention(model.config)
    return model


def _big(kind: str):
    if kind in ("gpt", "gpt_fused_qkv"):
        model = GPT(GPTConfig(vocab_size=50304, n_layer=12, n_embd=768, n_head=12,
                              block_size=1024, bias=False, dropout=0.0))
        return _fused(model) if kind == "gpt_fused_qkv" else model
    return Llama(LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                             hidden_dim=2048, max_seq_len=1024))


def _small(kind: str):
    if kind in ("gpt", "gpt_fused_qkv"):
        model = GPT(GPTConfig(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                              block_size=128, bias=False, dropout=0.0))
        return _fused(model) if kind == "gpt_fused_qkv" else model
    return Llama(LlamaConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                             hidden_dim=688, max_seq_len=128))


def _step(model, batch):
    with count_collectives() as log:
        _, loss = model(*batch)
        loss.backward()
    return log.summary()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    mesh = _mesh(args.dp)
    rank0 = mesh.get_rank() == 0
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4096, (args.batch, args.seq))
    batch = (ids, ids)
    layout = mesh._dims_text()
    for kind in ("gpt", "gpt_fused_qkv", "llama"):
        with init.empty_parameters():
            model = _big(kind)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            found = plan(model, mesh, batch, sequence_parallel=True)
            times.append(time.perf_counter() - t0)
        if rank0:
            print(json.dumps({"bench": "plan_seconds", "model": kind, "layers": 12,
                              "width": 768, "mesh": layout, "median_s": statistics.median(times),
                              "min_s": min(times), "max_s": max(times), "runs": args.runs,
                              "modules_planned": len(found.styles)}), flush=True)
    for kind in ("gpt", "gpt_fused_qkv", "llama"):
        for sp in (False, True):
            dtensor.manual_seed(0)
            model = _small(kind)
            found = plan(model, mesh, batch, sequence_parallel=sp)
            ours = _step(found.apply(model), batch)
            dtensor.manual_seed(0)
            model = _small("gpt" if kind == "gpt_fused_qkv" else kind)
            n = mesh.size(mesh.ndim - 1)
            styles = (llama_tp_plan(model, n, sequence_parallel=sp, loss_parallel=True)
                      if kind == "llama" else gpt_plan(sp, True))
            hand = _step(_parallelize(model, mesh, styles, 0 if mesh.ndim == 2 else None,
                                      mesh.ndim - 1, sequence_parallel=sp, loss_parallel=True,
                                      fsdp=False), batch)
            b_ours = sum(b for _, b in ours.values())
            b_hand = sum(b for _, b in hand.values())
            if rank0:
                print(json.dumps({"bench": "bytes_vs_megatron", "model": kind, "mesh": layout,
                                  "sequence_parallel": sp, "planner": ours, "megatron": hand,
                                  "bytes_ratio": round(b_ours / b_hand, 6),
                                  "price_equals_measured": found.totals() == ours}),
                      flush=True)


if __name__ == "__main__":
    main()
