"""fully_shard (FSDP2) and bucketed replicate (DDP) on any module: a dtensor.nn GPT (with
Megatron's plan for the tensor-parallel layouts) and a model written here with other names and
its blocks in a ModuleList (fully_shard per block, then the root), against one process over
three AdamW steps; the collectives each step issues on the data-parallel groups; checkpoints
across layouts; and a table of bad inputs."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import DTensor, Replicate, Shard
from dtensor.comm import count_collectives
from dtensor.nn import GPT, GPTConfig, Linear, Module, ModuleList, Parameter
from dtensor.redistribute import local_shape_and_offset
from dtensor.parallel import (ColwiseParallel, RowwiseParallel, fully_shard, gpt_plan,
                              parallelize_module, replicate)

CFG = dict(vocab_size=48, n_layer=2, n_embd=16, n_head=4, mlp_hidden=32, block_size=8,
           bias=True)


class Mixer(Module):
    """A residual block with a learned per-feature gain (a parameter no plan touches)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = Linear(width, hidden)
        self.down = Linear(hidden, width)
        self.gain = Parameter(dtensor.ones(width))

    def forward(self, h):
        return h + self.down(F.gelu(self.up(h))) * self.gain


class Ranker(Module):
    """Not a Transformer. Sizes that no dp degree here divides: 10 features over 4 ranks are
    3, 3, 3, 1 rows, the 5 classes 2, 2, 1, 0 (an empty shard)."""

    def __init__(self):
        super().__init__()
        self.inp = Linear(6, 10)
        self.stages = ModuleList([Mixer(10, 14) for _ in range(3)])
        self.out = Linear(10, 5)

    def forward(self, feats, labels):
        h = self.inp(feats)
        for stage in self.stages:
            h = stage(h)
        scores = self.out(h)
        return scores, F.cross_entropy(scores, labels)


RANKER_PLAN = {"stages.*.up": ColwiseParallel(), "stages.*.down": RowwiseParallel()}


def _model(kind):
    dtensor.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**CFG)), gpt_plan(sequence_parallel=False, loss_parallel=False)
    return Ranker(), RANKER_PLAN


def _blocks(model):
    return model.blocks if isinstance(model, GPT) else model.stages


def _batch(kind, rng, rows=8):
    if kind == "gpt":
        return (rng.integers(0, CFG["vocab_size"], (rows, CFG["block_size"])),
                rng.integers(0, CFG["vocab_size"], (rows, CFG["block_size"])))
    return rng.standard_normal((rows, 6)).astype(np.float32), rng.integers(0, 5, rows)


def _whole(t):
    return t.full_tensor().numpy() if isinstance(t, DTensor) else t.numpy()


BUCKET_MB = 1000 / 2 ** 20  # small: several buckets for both models, with and without tp


def _build(kind, layout, reshard=True):
    """The model laid out as ``layout`` ("dp2", "dp4", "dp2xtp2", with "ddp" for replicate),
    and the data-parallel mesh (None for one process)."""
    model, plan = _model(kind)
    if layout is None:
        return model, None
    dp = int(layout.split("dp")[-1][0])
    if "tp" in layout:
        mesh = dtensor.init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = dtensor.init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    if layout.startswith("ddp"):
        return replicate(model, mesh=dp_mesh, bucket_cap_mb=BUCKET_MB), dp_mesh
    for block in _blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return model, dp_mesh


def _train(kind, layout=None, steps=3, logs=None):
    """Losses and final whole weights of ``steps`` AdamW steps on the same global batches;
    ``logs`` collects each step's (forward, backward) collective logs."""
    model, dp_mesh = _build(kind, layout)
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x, y = _batch(kind, rng)
        with count_collectives() as fwd, dtensor.implicit_replication():
            out, loss = model(x, y)  # (the GPT's position ids are a plain arange)
        with count_collectives() as bwd:
            loss.backward()
        if logs is not None:
            logs.append((fwd, bwd))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: _whole(v) for k, v in model.state_dict().items()}, model, dp_mesh


def _on(log, group, kind):
    """(count, bytes) of ``kind`` collectives on the ranks ``group``."""
    events = [e for e in log.events if e.kind == kind and e.group == group]
    return len(events), sum(e.bytes for e in events)


def _buckets(model, cap_bytes):
    """DDP's bucketing, restated: parameters in reverse order, a new bucket when the next one
    would pass the cap (per rank: a tensor-parallel parameter counts its local block)."""
    sizes = []
    for p in reversed(list(model.parameters())):
        n = (p.to_local() if isinstance(p, DTensor) else p).numpy().nbytes
        if not sizes or (sizes[-1] and sizes[-1] + n > cap_bytes):
            sizes.append(0)
        sizes[-1] += n
    return sorted(sizes)


def _gathered_bytes(p) -> int:
    """Bytes of ``p`` whole over "dp" on this rank: what one gather makes and one
    reduce-scatter takes (its block on the rank's "tp" group under tensor parallelism)."""
    if not isinstance(p, DTensor):
        return p.numpy().nbytes
    mesh = p.device_mesh
    whole = tuple(p.placements[:-1]) + (Replicate(),)  # "dp" is the innermost storage dim
    shape, _ = local_shape_and_offset(p.shape, whole, mesh.shape, mesh.get_coordinate())
    return int(np.prod(shape)) * p.dtype.itemsize


def _check_traffic(layout, model, dp_mesh, logs):
    """Each step's collectives on this rank's data-parallel group."""
    group = tuple(int(r) for r in dp_mesh.mesh.reshape(-1))
    params = list(model.parameters())
    for fwd, bwd in logs:
        if layout.startswith("ddp"):  # nothing forward; one all-reduce per bucket backward
            assert [e for e in fwd.events if e.group == group] == []
            got = sorted(e.bytes for e in bwd.events if e.group == group)
            assert {e.kind for e in bwd.events if e.group == group} == {"all_reduce"}
            assert got == _buckets(model, BUCKET_MB * 2 ** 20) and len(got) >= 3, got
            continue
        nbytes = [_gathered_bytes(p) for p in params]
        blocks = {id(p) for b in _blocks(model) for p in b.parameters()}
        in_blocks = sum(n for p, n in zip(params, nbytes) if id(p) in blocks)
        # one gather per parameter forward, one reduce-scatter per parameter backward
        assert _on(fwd, group, "all_gather") == (len(params), sum(nbytes))
        assert _on(bwd, group, "reduce_scatter") == (len(params), sum(nbytes))
        # the blocks' parameters were freed after their forward and are gathered again; the
        # root keeps its own (as FSDP2's root does)
        assert _on(bwd, group, "all_gather") == (len(blocks), in_blocks)
        assert _on(fwd, group, "reduce_scatter") == (0, 0)
        assert _on(fwd, group, "all_reduce") == _on(bwd, group, "all_reduce") == (0, 0)


def _check_matches_one_process(kind, layout):
    want_losses, want_params, _, _ = _train(kind)
    logs = []
    losses, params, model, dp_mesh = _train(kind, layout, logs=logs)
    # float32 sums in another order: a few ulps of the loss
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6, err_msg=layout)
    assert params.keys() == want_params.keys()
    # The weights after three AdamW steps: an element whose gradient is as small as its
    # float32 rounding noise (q and k at init: near-uniform attention) moves by up to lr a step
    # on the sign of that noise, which the summation order decides (tests/test_parallel.py's
    # adam_drift_bound); here such elements moved up to 7e-6 (GPT, dp2 x tp2). So: every
    # element within 1e-5 of one process, and 1e-5 in relative L2 (measured: 2e-6 GPT, 2e-8
    # Ranker).
    diff = {k: np.abs(params[k] - want_params[k]) for k in params}
    worst = max(float(d.max()) for d in diff.values())
    rel = np.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in diff.values()) / sum(
        float((want_params[k].astype(np.float64) ** 2).sum()) for k in params))
    assert rel <= 1e-5 and worst <= 1e-5, (layout, rel, worst)
    if not layout.startswith("ddp"):
        # the parameters, so the optimizer state, are sharded over "dp" (the innermost dim)
        assert all(p.placements[-1] == Shard(0) for p in model.parameters())
    _check_traffic(layout, model, dp_mesh, logs)


@pytest.mark.parametrize("kind", ["gpt", "ranker"])
@pytest.mark.parametrize("layout", ["dp2", "ddp2"])
@pytest.mark.ranks(2, timeout=240)
def test_two_ranks_train_as_one_process(kind, layout, rank):
    _check_matches_one_process(kind, layout)


@pytest.mark.parametrize("kind", ["gpt", "ranker"])
@pytest.mark.parametrize("layout", ["dp4", "dp2xtp2", "ddp2xtp2"])
@pytest.mark.ranks(4, timeout=300)
def test_four_ranks_train_as_one_process(kind, layout, rank):
    _check_matches_one_process(kind, layout)


def _state(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def _step(model, opt, batch):
    _, loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.ranks(4, timeout=240)
def test_checkpoint_saved_fully_sharded_loads_in_other_layouts(tmp_path, rank):
    # Saved under dp2 x tp2 fully_shard (parameters and AdamW moments on the (tp, dp) dims),
    # loaded under dp4 fully_shard, dp2 x tp2 replicate and one process: the same values
    # bit for bit, and the next step's loss and weights as the run that saved.
    rng = np.random.default_rng(3)
    batches = [_batch("ranker", rng) for _ in range(3)]
    model, _ = _build("ranker", "dp2xtp2")
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches[:2]:
        _step(model, opt, b)
    dtensor.checkpoint.save(_state(model, opt, 2), str(tmp_path))
    saved = {k: _whole(v) for k, v in model.state_dict().items()}
    moments = {i: _whole(s["exp_avg_sq"]) for i, s in opt.state_dict()["state"].items()}
    want_loss = _step(model, opt, batches[2])
    want = {k: _whole(v) for k, v in model.state_dict().items()}
    for layout in ("dp4", "ddp2xtp2", None):
        other, _ = _build("ranker", layout)
        other_opt = dtensor.optim.AdamW(other.parameters(), lr=1e-2)
        st = _state(other, other_opt, 0)
        dtensor.checkpoint.load(st, str(tmp_path))
        other_opt.load_state_dict(st["optim"])
        assert st["step"] == 2
        for k, v in other.state_dict().items():
            np.testing.assert_array_equal(_whole(v), saved[k], err_msg=f"{layout} {k}")
        for i, s in other_opt.state_dict()["state"].items():
            np.testing.assert_array_equal(_whole(s["exp_avg_sq"]), moments[i])
        np.testing.assert_allclose(_step(other, other_opt, batches[2]), want_loss, rtol=2e-6)
        for k, v in other.state_dict().items():
            np.testing.assert_allclose(_whole(v), want[k], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{layout} {k}")


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.ranks(2, timeout=120)
def test_reshard_after_forward_frees_and_gathers_again(reshard, rank):
    # A block's gathered parameters are dropped after its forward (their arrays are zero-size
    # broadcasts until the backward gathers them again); reshard_after_forward=False keeps
    # them, and the backward then gathers nothing. The gradients are the same either way.
    model, mesh = _build("ranker", "dp2", reshard=reshard)
    seen = []  # the weight each block's up-projection computes with (swapped in by then)
    for block in model.stages:
        block.up.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    x, y = _batch("ranker", np.random.default_rng(0))
    _, loss = model(x, y)
    assert len(seen) == 3
    for w in seen:
        assert not isinstance(w, DTensor) and w.shape == (14, 10)
        assert (w.numpy().strides == (0, 0)) == reshard
    with count_collectives() as bwd:
        loss.backward()
    gathers = bwd.count("all_gather")
    assert gathers == (15 if reshard else 0)  # 3 blocks x 5 parameters
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    dtensor.manual_seed(0)
    ref = Ranker()
    _, ref_loss = ref(dtensor.tensor(x), dtensor.tensor(y))
    ref_loss.backward()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=n)


def _bad_cases(mesh, world):
    """(name, call, error type, message pattern): each call is refused on every rank."""
    dp = mesh["dp"]

    def sharded_over_dp():
        model = Ranker()
        parallelize_module(model, dp, RANKER_PLAN)
        fully_shard(model, mesh=dp)

    def on_another_mesh():
        model = Ranker()
        parallelize_module(model, world, RANKER_PLAN)
        fully_shard(model, mesh=dp)

    def twice(second):
        model = fully_shard(Ranker(), mesh=dp)
        second(model)

    def odd_batch():
        model = fully_shard(Ranker(), mesh=dp)
        model(*_batch("ranker", np.random.default_rng(0), rows=3))

    return [
        ("2-D mesh", lambda: fully_shard(Ranker(), mesh=mesh), ValueError,
         r"fully_shard takes a 1-D data-parallel mesh, got \(dp=2, tp=2\); pass mesh\['dp'\]"),
        ("2-D mesh replicate", lambda: replicate(Ranker(), mesh=mesh), ValueError,
         r"replicate takes a 1-D data-parallel mesh"),
        ("parameter sharded over dp", sharded_over_dp, ValueError,
         r"parameter 'stages.0.up.weight' is a DTensor on .*already laid out over the "
         r"data-parallel mesh.*parallelize_module\(model, mesh\['tp'\], plan\)"),
        ("parameter on an unrelated mesh", on_another_mesh, ValueError,
         r"'stages.0.up.weight'.*not slices of one mesh"),
        ("fully_shard twice", lambda: twice(lambda m: fully_shard(m, mesh=dp)), ValueError,
         r"fully_shard: Ranker is already under fully_shard\(mesh=.*\); apply data "
         r"parallelism to a module once"),
        ("replicate after fully_shard", lambda: twice(lambda m: replicate(m, mesh=dp)),
         ValueError, r"replicate: Ranker is already under fully_shard"),
        ("reshard flag", lambda: fully_shard(Ranker(), mesh=dp, reshard_after_forward="yes"),
         TypeError, r"reshard_after_forward"),
        ("not a module", lambda: fully_shard(object(), mesh=dp), TypeError,
         r"fully_shard: the model must be a dtensor.nn.Module"),
        ("not a mesh", lambda: fully_shard(Ranker(), mesh="dp"), TypeError,
         r"fully_shard: the mesh must be a DeviceMesh"),
        ("replicate without a mesh", lambda: replicate(Ranker()), TypeError,
         r"replicate needs the data-parallel mesh: replicate\(model, mesh=mesh\['dp'\]\)"),
        ("replicate with two meshes", lambda: replicate(Ranker(), dp, mesh=mesh["tp"]),
         ValueError, r"got both mesh=.* and device_mesh=.*; pass one of them"),
        ("negative bucket cap", lambda: replicate(Ranker(), mesh=dp, bucket_cap_mb=-1),
         ValueError, r"bucket_cap_mb"),
        ("odd batch", odd_batch, ValueError,
         r"fully_shard: argument 0 of shape \(3, 6\) has batch size 3.*multiple of 2"),
    ]


@pytest.mark.ranks(4, timeout=180)
def test_bad_inputs_are_refused_on_every_rank(rank):
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = dtensor.init_device_mesh("cpu", (4,))
    for name, call, error, pattern in _bad_cases(mesh, world):
        with pytest.raises(error, match=pattern):
            call()


@pytest.mark.ranks(4, timeout=120)
def test_a_mesh_of_one_rank_is_a_no_op_and_uneven_rows_shard_exactly(rank):
    # mesh["dp"] of (1, 4) holds one rank: fully_shard and replicate leave the model as it is
    mesh = dtensor.init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    for wrap in (fully_shard, replicate):
        model = Ranker()
        before = list(model.parameters())
        assert wrap(model, mesh=mesh["dp"]) is model
        assert [id(p) for p in model.parameters()] == [id(p) for p in before]
        out, loss = model(*_batch("ranker", np.random.default_rng(0)))
        assert not isinstance(out, DTensor) and not isinstance(loss, DTensor)
    # Shard(0) is torch.chunk-exact: out.weight's 5 rows over 4 ranks are 2, 2, 1, 0 and the
    # gain's 10 are 3, 3, 3, 1, nothing padded
    dp = dtensor.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = fully_shard(Ranker(), mesh=dp)
    assert model.out.weight.to_local().shape == ([2, 2, 1, 0][rank], 10)
    assert model.stages[0].gain.to_local().shape == ([3, 3, 3, 1][rank],)


@pytest.mark.ranks(2, timeout=240)
def test_a_compiled_fully_sharded_step_gives_the_eager_numbers(rank):
    # The gathers and reduce-scatters are redistributes, so the tracer records them as
    # collectives (under the tracer nothing is freed: the compiled graph plans its memory).
    def run(compiled):
        model, _ = _build("ranker", "dp2")
        opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        if compiled:
            step = dtensor.compile(step)
        rng = np.random.default_rng(1)
        losses = [step(*_batch("ranker", rng)).item() for _ in range(3)]
        return losses, {k: _whole(v) for k, v in model.state_dict().items()}

    want_losses, want = run(False)
    losses, params = run(True)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
