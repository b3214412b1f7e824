"""CommDebugMode: the per-module table of a real training step against the debug counter,
Megatron-LM's figures and the eager run, on GPT (dp x tp with sequence parallelism) and Llama,
eager and compiled."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import dtensor
from dtensor import Replicate, Shard, observe
from dtensor.comm import count_collectives
from dtensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpt_step import _sp_grads, megatron_traffic  # noqa: E402

LAYERS, BATCH, SEQ = 2, 4, 16


def gpt(mesh, sp: bool):
    cfg = dtensor.nn.GPTConfig(vocab_size=128, n_layer=LAYERS, n_embd=32, n_head=4,
                               mlp_hidden=128, block_size=SEQ, bias=False, dropout=0.0)
    dtensor.manual_seed(0)
    model = dtensor.nn.GPT(cfg)
    from dtensor.parallel import parallelize
    parallelize(model, mesh, sequence_parallel=sp)
    return model, cfg


def llama(mesh):
    cfg = dtensor.nn.LlamaConfig(vocab_size=128, dim=32, n_layers=LAYERS, n_heads=4,
                                 n_kv_heads=2, hidden_dim=64, max_seq_len=SEQ)
    dtensor.manual_seed(0)
    model = dtensor.nn.Llama(cfg)
    from dtensor.parallel import parallelize
    parallelize(model, mesh)
    return model, cfg


def train_step(model):
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def data(vocab):
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, (BATCH, SEQ)), rng.integers(0, vocab, (BATCH, SEQ))


def observed(step, x, y):
    with CommDebugMode() as mode, count_collectives() as log:
        step(x, y).item()  # the loss for logging, as a training loop reads it
    return mode, log


def block_counts(mode, prefix: str) -> list:
    counts = mode.get_comm_module_counts()
    return [counts[f"{prefix}.{i}"] for i in range(LAYERS)]


def totals(mode) -> dict:
    out: dict = {}
    for e in mode.events:
        n, b = out.get(e.kind, (0, 0))
        out[e.kind] = (n + 1, b + e.bytes)
    return out


@pytest.mark.ranks(4, timeout=240)
def test_gpt_dp2_tp2_sp_table_matches_the_counter_megatron_and_the_compiled_step(rank):
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, cfg = gpt(mesh, sp=True)
    x, y = data(cfg.vocab_size)
    step = train_step(model)
    step(x, y)  # the optimizer's state exists: the step below is a steady one
    mode, log = observed(step, x, y)
    # every collective is in the table, once: the debug counter's figures per kind
    assert totals(mode) == log.summary()
    assert mode.get_total_counts() == log.count()
    assert mode.get_comm_counts() == {k: n for k, (n, _) in log.summary().items()}
    # Megatron-LM's bytes for this layout (benchmarks/gpt_step.py's model of it)
    whole_dp = sum(4 * math.prod(dtensor.redistribute.local_shape_and_offset(
        p.shape, (Replicate(), p.placements[1]), mesh.shape, mesh.get_coordinate())[0])
        for p in model.parameters())
    expect, counts = megatron_traffic(LAYERS, 32, _sp_grads(cfg, SEQ), BATCH, SEQ, 2, 2, True,
                                      False, whole_dp)
    assert {k: b for k, (_, b) in totals(mode).items()} == expect
    # each block: Megatron's sequence-parallel pattern, 2 all-gathers and 2 reduce-scatters
    # each way, one pair in attention and one in the MLP
    for block in block_counts(mode, "GPT.blocks"):
        for phase in ("forward", "backward"):
            assert block[phase]["all_gather"] == 2 and block[phase]["reduce_scatter"] == 2, block
    by_path = mode.get_comm_module_counts()
    for i in range(LAYERS):
        for part in ("attn", "mlp"):
            assert by_path[f"GPT.blocks.{i}.{part}"]["forward"] == {"all_gather": 1,
                                                                   "reduce_scatter": 1}
    text = mode.table()
    assert "    0 (forward)" in text and "      attn (backward)" in text, text
    assert text.splitlines()[-1].startswith(f"{log.count()} collectives"), text

    # compiled: the graph's collectives keep the modules they were traced in
    compiled = dtensor.compile(step)
    compiled(x, y)
    compiled(x, y)
    cmode, clog = observed(compiled, x, y)
    assert totals(cmode) == clog.summary()
    assert {k: b for k, (_, b) in totals(cmode).items()} == expect  # buckets: fewer, same bytes
    for eager, comp in zip(block_counts(mode, "GPT.blocks"), block_counts(cmode, "GPT.blocks")):
        for phase in ("forward", "backward"):
            assert {k: v for k, v in comp[phase].items() if k != "all_reduce"} == \
                {k: v for k, v in eager[phase].items() if k != "all_reduce"}


@pytest.mark.ranks(2, timeout=240)
def test_llama_tp2_two_all_reduces_per_block_each_way(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model, cfg = llama(mesh)
    x, y = data(cfg.vocab_size)
    step = train_step(model)
    step(x, y)
    mode, log = observed(step, x, y)
    assert totals(mode) == log.summary()
    prefix = next(p for p in mode.get_comm_module_counts() if p.endswith(".0")).rsplit(".", 1)[0]
    for block in block_counts(mode, prefix):
        # attention's output projection and the MLP's down projection forward; the gradients
        # of their column-parallel inputs (q/k/v, w1/w3) backward
        assert block["forward"] == {"all_reduce": 2} and block["backward"] == {"all_reduce": 2}


@pytest.mark.ranks(2, timeout=120)
def test_each_event_names_op_rule_placements_and_line_and_the_hooks_come_out(rank):
    from dtensor.nn.module import Module
    mesh = dtensor.init_device_mesh("cpu", (2,))
    a = dtensor.distribute_tensor(np.ones((4, 6), np.float32), mesh, [Shard(0)])
    b = dtensor.distribute_tensor(np.ones((6, 2), np.float32), mesh, [Shard(0)])
    plain = (Module.__call__, dtensor.autograd.record)
    with CommDebugMode() as outer:
        with CommDebugMode() as inner:
            (a @ b).full_tensor()  # matmul's rule gathers b; then the result is gathered
    assert [e.kind for e in outer.events] == [e.kind for e in inner.events] == [
        "all_gather", "all_gather"]
    first, second = outer.events
    assert (first.op, first.rule, first.placements, first.module, first.phase) == (
        "matmul", "matmul", "[S(0)] -> [R]", "Global", "-")
    assert second.op == "redistribute" and second.placements == "[S(0)] -> [R]"
    assert first.site.endswith(f"test_debug.py:{_line('(a @ b).full_tensor()')}")
    assert (Module.__call__, dtensor.autograd.record) == plain
    assert not observe.OBSERVERS and not observe.TRACKING and "op" not in observe.CAUSE


def _line(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text in line and "_line(" not in line)
