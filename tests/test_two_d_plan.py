"""The 2-D path of parallelize_module: a tensor-parallel plan on mesh["tp"] plus data parallelism
over mesh["dp"] (``replicate``), or both in one call with ``tp_dim=``, gives the one-process
losses and gradients, for a batch given whole or as each dp rank's rows, on two models (a GPT
with Megatron's plan, and an MLP with other names whose styles hand back local tensors)."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import DTensor, Shard
from dtensor.nn import GPT, GPTConfig, Linear, Module
from dtensor.parallel import (ColwiseParallel, RowwiseParallel, gpt_plan, parallelize_module,
                              replicate)

CFG = dict(vocab_size=48, n_layer=2, n_embd=16, n_head=4, mlp_hidden=32, block_size=8,
           bias=True)


class Scorer(Module):
    """Not a Transformer, other names; the default styles return local tensors."""

    def __init__(self):
        super().__init__()
        self.expand = Linear(12, 24)
        self.squeeze = Linear(24, 5)

    def forward(self, feats, labels):
        scores = self.squeeze(F.gelu(self.expand(feats)))
        return scores, F.cross_entropy(scores, labels)


SCORER_PLAN = {"expand": ColwiseParallel(), "squeeze": RowwiseParallel()}


def _model(kind):
    dtensor.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**CFG)), gpt_plan(sequence_parallel=False, loss_parallel=False)
    return Scorer(), SCORER_PLAN


def _batch(kind, rng, rows=8):
    if kind == "gpt":
        return (rng.integers(0, CFG["vocab_size"], (rows, CFG["block_size"])),
                rng.integers(0, CFG["vocab_size"], (rows, CFG["block_size"])))
    return rng.standard_normal((rows, 12)).astype(np.float32), rng.integers(0, 5, rows)


def _whole(t):
    return t.full_tensor().numpy() if isinstance(t, DTensor) else t.numpy()


def _steps(kind, layout=None, form="global", steps=2, compiled=False):
    """Losses and final weights of ``steps`` SGD steps; one process when ``layout`` is None."""
    model, plan = _model(kind)
    if layout is not None:
        mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        if layout == "submeshes":
            parallelize_module(model, mesh["tp"], plan)
            model = replicate(model, mesh["dp"])
        else:
            model = parallelize_module(model, mesh, plan, tp_dim="tp")
    opt = dtensor.optim.SGD(model.parameters(), lr=0.5)
    def step(x, y):
        with dtensor.implicit_replication():  # the GPT's position ids are a plain arange
            out, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return out, loss

    if compiled:
        step = dtensor.compile(step)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x, y = _batch(kind, rng)
        if layout is not None and form == "rows":
            dp = mesh["dp"]
            k, r = len(x) // 2, dp.get_local_rank()
            x, y = (DTensor.from_local(a[r * k:(r + 1) * k], dp, [Shard(0)]) for a in (x, y))
        out, loss = step(x, y)
        losses.append(loss.item())
    return losses, {k: _whole(v) for k, v in model.state_dict().items()}, out


@pytest.mark.parametrize("kind", ["gpt", "scorer"])
@pytest.mark.ranks(4, timeout=240)
def test_tp_plan_plus_data_parallel_equals_one_process(kind, rank):
    want_losses, want_params, want_out = _steps(kind)
    for layout in ("submeshes", "tp_dim"):
        for form in ("global", "rows"):
            losses, params, out = _steps(kind, layout, form)
            # float32 sums in another order: a few ulps of the loss, no more
            np.testing.assert_allclose(losses, want_losses, rtol=2e-6, err_msg=f"{layout} {form}")
            for k in want_params:
                np.testing.assert_allclose(params[k], want_params[k], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{layout} {form} {k}")
            # outputs with a row per input row are the global rows, Shard(0) over dp
            assert out.placements == (Shard(0),) and out.shape == want_out.shape
            np.testing.assert_allclose(out.full_tensor().numpy(), want_out.numpy(), rtol=1e-4,
                                       atol=1e-5)


@pytest.mark.ranks(4, timeout=240)
def test_the_two_d_path_compiles_to_the_eager_numbers(rank):
    # the data-parallel gradient sum is a redistribute, so the tracer records it as a collective
    want_losses, want_params, _ = _steps("scorer", "submeshes", steps=3)
    losses, params, _ = _steps("scorer", "submeshes", steps=3, compiled=True)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for k in want_params:
        np.testing.assert_allclose(params[k], want_params[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.ranks(4, timeout=120)
def test_two_d_mesh_without_tp_dim_is_refused(rank):
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r'(?s)2-D mesh.*mesh\["tp"\].*replicate.*tp_dim="tp"'):
        parallelize_module(Scorer(), mesh, SCORER_PLAN)


@pytest.mark.ranks(2, timeout=120)
def test_replicate_batch_errors_name_the_batch_and_the_fix(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = replicate(Scorer(), mesh)
    rng = np.random.default_rng(0)
    for rows in (3, 1):  # odd, and fewer rows than ranks
        x, y = _batch("scorer", rng, rows)
        with pytest.raises(ValueError, match=rf"shape \({rows}, 12\).*batch size {rows}.*"
                                             rf"multiple of 2"):
            model(x, y)
    with pytest.raises(ValueError, match="replicate takes a 1-D"):
        replicate(Scorer(), dtensor.init_device_mesh("cpu", (1, 2)))


@pytest.mark.ranks(2, timeout=120)
def test_implicit_replication_carries_gradients_to_plain_tensors(rank):
    # A parameter no plan distributed meets DTensors under implicit_replication(): its gradient
    # must arrive whole (it stopped at the temporary Replicate copy before).
    mesh = dtensor.init_device_mesh("cpu", (2,))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 4)), rng.standard_normal(4)
    scale = dtensor.tensor(w, requires_grad=True)
    with dtensor.implicit_replication():
        y = dtensor.distribute_tensor(dtensor.tensor(x), mesh, [Shard(0)]) * scale
    (y ** 2).sum().backward()
    np.testing.assert_allclose(scale.grad.numpy(), (2 * x ** 2 * w).sum(0), rtol=1e-12)


@pytest.mark.parametrize("src", ["R", "S0"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.ranks(3, timeout=120)
def test_redistribute_to_partial_is_the_same_value_and_differentiable(src, op, rank):
    # PyTorch allows Replicate -> Partial; a Shard source is gathered first by the same table.
    from dtensor import Partial, Replicate
    mesh = dtensor.init_device_mesh("cpu", (3,))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    xd = dtensor.distribute_tensor(dtensor.tensor(x, requires_grad=True), mesh,
                                   [Replicate() if src == "R" else Shard(0)])
    y = xd.redistribute(mesh, [Partial(op)])
    assert y.placements == (Partial(op),)
    local = y.to_local().numpy()
    np.testing.assert_array_equal(local, x if op != "sum" or rank == 0 else np.zeros_like(x))
    # avg sums three equal values and divides by three: rounding, 2 ulp at most
    np.testing.assert_allclose(y.full_tensor().numpy(), x, rtol=4.5e-16 if op == "avg" else 0)
    (y.redistribute(mesh, [Replicate()]) * dtensor.distribute_tensor(
        dtensor.tensor(w), mesh, [Replicate()])).sum().backward()
    if op in ("sum", "avg"):  # max/min of equal values: the gradient is each rank's choice
        np.testing.assert_allclose(xd.grad.full_tensor().numpy(), w, rtol=1e-12)
    with pytest.raises(ValueError, match=rf"from P\({op}\) to P\(.*\) .*Replicate\(\)"):
        y.redistribute(mesh, [Partial("max" if op != "max" else "sum")])


@pytest.mark.parametrize("cap_mb,buckets", [(25, [1748]), (600 / 2 ** 20, [596, 1152])],
                         ids=["one-bucket", "two-buckets"])
@pytest.mark.ranks(2, timeout=120)
def test_replicate_sums_gradients_in_buckets_and_moves_nothing_forward(cap_mb, buckets, rank):
    # DDP's traffic: one all-reduce per bucket in the backward (it was one per parameter before
    # bucketing), of the bucket's bytes; the forward only slices the batch (the loss is reduced
    # when it is read). Buckets take the parameters in reverse order up to the cap: Scorer's
    # squeeze.bias, squeeze.weight, expand.bias (20 + 480 + 96 bytes) fit 600 bytes, and
    # expand.weight (1152) goes alone; 25 MiB holds all four.
    from dtensor.comm import count_collectives
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = replicate(Scorer(), mesh=mesh, bucket_cap_mb=cap_mb)
    x, y = _batch("scorer", np.random.default_rng(0))
    with count_collectives() as fwd:
        _, loss = model(x, y)
    with count_collectives() as bwd:
        loss.backward()
    assert fwd.summary() == {}
    # (each starts when its last gradient arrives, in the engine's order, not the buckets')
    assert sorted((e.kind, e.bytes) for e in bwd.events) == [("all_reduce", b) for b in buckets]
    assert sum(buckets) == sum(p.numel() * 4 for p in model.parameters())
