"""The planner (dtensor/parallel/planner.py) on models it has never seen: every architecture
trains as one process in several layouts with no plan given, the collectives a step issues are
the ones the plan's explanation prices, the layers land where Megatron would put them (or stay
replicated, with the reason), and on GPT and Llama the plan's bytes equal the hand-written
plan's."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import planner_models as zoo
from dtensor.comm import count_collectives
from dtensor.nn import GPT, GPTConfig, Llama, LlamaConfig
from dtensor.parallel import plan

GPT_CFG = dict(vocab_size=24, n_layer=2, n_embd=16, n_head=4, mlp_hidden=40, block_size=8,
               bias=False, dropout=0.0)
LLAMA_CFG = dict(vocab_size=24, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=28,
                 max_seq_len=8)


class _Loss(dtensor.nn.Module):
    """GPT and Llama return (logits, loss): the zoo's models return the loss."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids, targets):
        return self.inner(ids, targets)[1]


MODELS = dict(zoo.MODELS,
              gpt=lambda: _Loss(GPT(GPTConfig(**GPT_CFG))),
              llama=lambda: _Loss(Llama(LlamaConfig(**LLAMA_CFG))))


def _batches(name, n=3, B=4):
    rng = np.random.default_rng(7)
    if name == "stack":
        return [zoo.Stack.batch(rng, B) for _ in range(n)]
    return [zoo.Encoder.batch(rng, B) for _ in range(n)]


def _train(name, mesh=None, sp=False, fsdp=None):
    """Losses of 3 AdamW steps, the found plan and the collectives of the first step's
    forward and backward."""
    dtensor.manual_seed(0)
    model = MODELS[name]()
    batches = _batches(name)
    found = None
    if mesh is not None:
        found = plan(model, mesh, batches[0], sequence_parallel=sp, fsdp=fsdp)
        found.apply(model)
        if mesh.get_rank() == 0:  # the plan's memory figure is rank 0's parameter bytes
            held = {id(p): p._loc().nbytes for p in model.parameters()}
            assert sum(held.values()) == found.memory["parameters"], (name, found.memory)
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)
    losses, log = [], None
    for i, batch in enumerate(batches):
        if i == 0:
            with count_collectives() as log:
                loss = model(*batch)
                loss.backward()
        else:
            loss = model(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, found, log


LAYOUTS = {  # name: (ranks, mesh shape, dim names, sequence_parallel, fsdp)
    "tp2": (2, (2,), ("tp",), False, False),
    "tp2-sp": (2, (2,), ("tp",), True, False),
    "tp4": (4, (4,), ("tp",), False, False),
    "dp2xtp2": (4, (2, 2), ("dp", "tp"), False, False),
    "dp2xtp2-sp-fsdp": (4, (2, 2), ("dp", "tp"), True, True),
}
ARCHS = sorted(MODELS)


def _check_layout(name, layout):
    ranks, shape, names, sp, fsdp = LAYOUTS[layout]
    want, _, _ = _train(name)
    mesh = dtensor.init_device_mesh("cpu", shape, mesh_dim_names=names)
    losses, found, log = _train(name, mesh, sp, fsdp)
    # The layouts change only the order of float32 sums (partial products reduced across
    # ranks, the loss's mean over dp rows): the largest relative gap over every model and
    # layout here was 1.5e-7 (2.5 ulp), with 1 or 2 BLAS threads. 1e-5 is the bar,
    # with room for other CPUs' GEMM blocking.
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert log.summary() == found.totals(), f"{name} {layout}:\n{found}\n{log.summary()}"
    return found


# What an expert plans at tp 2: (column-parallel, row-parallel, vocab-parallel tables, heads,
# Linears left whole, modules that reduce their row-parallel outputs' partial sums once)
EXPECTED = {
    "gpt": (8, 4, 1, 1, 0, 0),                # q, k, v, fc1 | proj, fc2 per layer
    "llama": (10, 4, 1, 1, 0, 0),             # q, k, v, gate, up | o, down
    "stack": (3, 3, 0, 0, 1, 0),              # widen | narrow; the 1-wide readout stays whole
    "encoder": (8, 4, 1, 1, 0, 0),            # query, key, value, intermediate | dense, output
    "fused": (4, 4, 1, 1, 0, 0),              # qkv (heads-major), up | out, down
    "fused_qkv_major": (4, 4, 1, 1, 0, 0),    # qkv split by .split(C): each part split
    "parallel": (8, 4, 1, 1, 0, 2),           # one reduction per parallel block
    "mixture": (6, 6, 1, 1, 2, 2),            # every expert's pair; routers whole; one
    "shared": (4, 2, 1, 1, 0, 0),             # reduction per mixture; one layer, 3 calls
    "nano": (4, 4, 1, 1, 0, 0),               # c_attn (q|k|v-major), c_fc | c_proj, c_proj
}


def _roles(found, model) -> tuple:
    from dtensor.nn import Embedding, Linear
    from dtensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel
    from dtensor.placements import Partial
    styles = {k: getattr(v, "second", v) for k, v in found.styles.items()}
    col = row = vocab = head = whole = 0
    for path, m in model.named_modules():
        s = styles.get(path)
        if isinstance(m, Linear):
            if isinstance(s, ColwiseParallel):
                head += s.output_layouts is not None
                col += s.output_layouts is None
            elif isinstance(s, RowwiseParallel):
                row += 1
            else:
                whole += 1
        elif isinstance(m, Embedding):
            vocab += isinstance(s, RowwiseParallel)
    once = sum(isinstance(s, PrepareModuleOutput) and s.output_layouts == (Partial(),)
               for s in styles.values())
    return col, row, vocab, head, whole, once


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.ranks(2, timeout=300)
def test_two_ranks_train_as_one_process(name, rank):
    found = _check_layout(name, "tp2")
    dtensor.manual_seed(0)
    assert _roles(found, MODELS[name]()) == EXPECTED[name], str(found)
    _check_layout(name, "tp2-sp")


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.ranks(4, timeout=300)
def test_four_ranks_train_as_one_process(name, rank):
    for layout in ("tp4", "dp2xtp2", "dp2xtp2-sp-fsdp"):
        _check_layout(name, layout)


# ----------------------------------------------------------------------------- vs Megatron

def _step_collectives(make, mesh, layout):
    """Collectives of one forward and backward of a GPT or Llama laid out by ``layout(model)``,
    and the loss."""
    dtensor.manual_seed(0)
    model = make()
    ids, targets = _batches("gpt", 1)[0]
    layout(model, (ids, targets))
    with count_collectives() as log:
        _, loss = model(ids, targets)
        loss.backward()
    return log.summary(), loss.item()


def _hand_plan(model, mesh, sp, lp=True):
    """The hand-written Megatron plan: gpt_plan, or llama_tp_plan for a Llama."""
    from dtensor.parallel import gpt_plan, llama_tp_plan
    from dtensor.parallel.api import _parallelize
    n = mesh.size(mesh.ndim - 1)
    styles = (llama_tp_plan(model, n, sequence_parallel=sp, loss_parallel=lp)
              if isinstance(model, dtensor.nn.Llama) else gpt_plan(sp, lp))
    dp = 0 if mesh.ndim == 2 else None
    return _parallelize(model, mesh, styles, dp, mesh.ndim - 1, sequence_parallel=sp,
                        loss_parallel=lp, fsdp=False)


MEGATRON = {"gpt": lambda: GPT(GPTConfig(**GPT_CFG)), "llama": lambda: Llama(LlamaConfig(
    **LLAMA_CFG))}


def _check_megatron(name, shape, names, loss_parallel=(True,)):
    mesh = dtensor.init_device_mesh("cpu", shape, mesh_dim_names=names)
    for sp, lp in [(sp, lp) for sp in (False, True) for lp in loss_parallel]:
        found = {}

        def planned(model, batch):
            found["plan"] = plan(model, mesh, batch, sequence_parallel=sp, loss_parallel=lp)
            found["plan"].apply(model)

        ours, loss = _step_collectives(MEGATRON[name], mesh, planned)
        hand, hand_loss = _step_collectives(MEGATRON[name], mesh,
                                            lambda m, b: _hand_plan(m, mesh, sp, lp))
        assert ours == hand, (name, shape, sp, ours, hand)
        assert loss == hand_loss
        p = found["plan"]
        assert p.reference == p.totals() == ours, (p, ours)
        assert "bytes vs the hand plan: 1.00" in str(p)


@pytest.mark.parametrize("name", sorted(MEGATRON))
@pytest.mark.ranks(2, timeout=300)
def test_bytes_equal_megatrons_plan_at_tp2(name, rank):
    _check_megatron(name, (2,), ("tp",), loss_parallel=(True, False))


@pytest.mark.parametrize("name", sorted(MEGATRON))
@pytest.mark.ranks(4, timeout=300)
def test_bytes_equal_megatrons_plan_at_tp4_and_dp2_tp2(name, rank):
    _check_megatron(name, (4,), ("tp",))
    _check_megatron(name, (2, 2), ("dp", "tp"))


# ----------------------------------------------------------------------------- fallbacks

def _why(found, path):
    return next(why for p, where, why in found.rows if p == path), next(
        where for p, where, why in found.rows if p == path)


FALLBACKS = [  # model, module left whole, the reason the explanation gives
    (lambda: _Loss(GPT(GPTConfig(**dict(GPT_CFG, n_head=3, n_embd=15)))), "inner.blocks.0.attn.q",
     r"reshape \(4, 8, 15\) -> \(4, 8, 3, 5\) cannot keep tensor dim 2 sharded"),
    (lambda: zoo.Fused(False, kv_heads=2), "body.0.mix.qkv",
     r"sliced along the split features into pieces of unequal widths \(16, 8, 8\)"),
    (MODELS["stack"], "readout", r"1 output features, fewer than the 2 ranks"),
    (MODELS["encoder"], "positions", r"indexed by positions the model computes"),
    (MODELS["mixture"], "moes.0.router", r"softmax needs the split value"),
]


@pytest.mark.ranks(2, timeout=300)
def test_what_cannot_split_stays_replicated_and_the_explanation_says_why(rank):
    import re
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for make, path, reason in FALLBACKS:
        dtensor.manual_seed(0)
        model = make()
        batch = _batches("stack" if isinstance(model, zoo.Stack) else "gpt")[0]
        found = plan(model, mesh, batch)
        why, where = _why(found, path)
        assert where == "replicated" and re.search(reason, why), (path, where, why)
        assert path not in found.styles
    # and training goes on as one process (GPT whose 3 heads do not split over 2 ranks; and
    # with dropout, whose masks planning must not shift: its trace draws no key)
    MODELS["gpt_3_heads"] = FALLBACKS[0][0]
    MODELS["gpt_dropout"] = lambda: _Loss(GPT(GPTConfig(**dict(GPT_CFG, dropout=0.2))))
    try:
        _check_layout("gpt_3_heads", "tp2")
        _check_layout("gpt_dropout", "tp2-sp")
    finally:
        del MODELS["gpt_3_heads"], MODELS["gpt_dropout"]


# ----------------------------------------------------------------------------- explain

@pytest.mark.ranks(2, timeout=300)
def test_explanation_lists_layouts_reasons_collectives_and_the_hand_plan(rank, capsys,
                                                                        monkeypatch):
    from dtensor.parallel import parallelize
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids, targets = _batches("gpt", 1)[0]
    dtensor.manual_seed(0)
    found = plan(GPT(GPTConfig(**GPT_CFG)), mesh, (ids, targets), sequence_parallel=True)
    text = str(found)
    lines = text.splitlines()
    assert lines[0].startswith("plan for mesh (tp=2): tensor parallel over 'tp' (2), sequence "
                               "parallel, loss parallel")
    row = next(x for x in lines if x.split()[:1] == ["blocks.1.mlp.fc1"])
    assert "Shard(0)" in row and "chain 3: column side, split up to blocks.1.mlp.fc2" in row
    assert any(x.split()[:1] == ["blocks.0.attn"] and "input S(1) -> Replicate" in x
               for x in lines)
    assert any(x.split()[:1] == ["wpe"] and "replicated" in x for x in lines)
    fwd = next(x for x in lines if x.strip().startswith("blocks.0.attn.proj ") and "forward" in x)
    assert fwd.split()[2:] == ["reduce_scatter", "1", "2,048", "B"]  # (4, 8, 16) float32
    total = found.totals()
    assert f"all_gather {total['all_gather'][0]} ({total['all_gather'][1]:,d} B)" in text
    assert "Megatron's plan (gpt_plan):" in text and "bytes vs the hand plan: 1.00" in text
    # DTENSOR_DEBUG=1: parallelize prints the same explanation on rank 0
    monkeypatch.setenv("DTENSOR_DEBUG", "1")
    capsys.readouterr()
    dtensor.manual_seed(0)
    parallelize(GPT(GPTConfig(**GPT_CFG)), mesh, sequence_parallel=True,
                example_inputs=(ids, targets))
    out = capsys.readouterr().out
    if rank == 0:
        assert "\n".join(lines[1:]) in out
    else:
        assert "plan for mesh" not in out


@pytest.mark.ranks(2, timeout=300)
def test_keyword_inputs_and_a_guessed_batch_plan_alike(rank):
    from dtensor.parallel import parallelize
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids, labels = _batches("encoder", 1)[0]
    by_kw = plan(MODELS["encoder"](), mesh, {"ids": ids, "labels": labels})
    guessed = plan(MODELS["encoder"](), mesh)
    assert repr(by_kw.styles) == repr(guessed.styles)
    assert "guessed batch (2, 8)" in str(guessed)
    dtensor.manual_seed(0)
    whole = MODELS["encoder"]()
    want = whole(ids=ids, labels=labels).item()
    dtensor.manual_seed(0)
    model = parallelize(MODELS["encoder"](), mesh)
    assert abs(model(ids=ids, labels=labels).item() - want) <= 1e-5 * abs(want)


# ----------------------------------------------------------------------------- data dim

@pytest.mark.ranks(4, timeout=300)
def test_fsdp_is_chosen_by_flag_or_by_the_memory_budget(rank):
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batch = _batches("gpt", 1)[0]
    make = MODELS["llama"]
    replicated = plan(make(), mesh, batch)
    need = replicated.memory["with gradients and Adam moments"]
    assert not replicated.fsdp and not plan(make(), mesh, batch, max_bytes_per_rank=need).fsdp
    tight = plan(make(), mesh, batch, max_bytes_per_rank=need - 1)
    assert tight.fsdp and tight.memory["with gradients and Adam moments"] <= need // 2 + 64
    assert plan(make(), mesh, batch, fsdp=True).fsdp
    assert not plan(make(), mesh, batch, fsdp=False, max_bytes_per_rank=need).fsdp
    with pytest.raises(ValueError, match=r"need [\d,]+ B per rank with this layout and fsdp, "
                                         r"over max_bytes_per_rank=100\b.*more ranks"):
        plan(make(), mesh, batch, max_bytes_per_rank=100)
    # the FSDP layout found this way trains as one process
    _check_layout("llama", "dp2xtp2-sp-fsdp")


@pytest.mark.ranks(2, timeout=300)
def test_a_data_parallel_mesh_plans_no_tensor_parallelism(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    batch = _batches("encoder", 1)[0]
    found = plan(MODELS["encoder"](), mesh, batch)
    assert found.tp is None and found.styles == {}
    assert set(found.totals()) == {"all_reduce"}  # the gradients, and the loss's mean
    want, _, _ = _train("encoder")
    losses, _, log = _train("encoder", mesh)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert log.summary() == found.totals()
