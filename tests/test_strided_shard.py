"""StridedShard(d, k): each of k equal parts of dim d split over the mesh dim (a fused
[q | k | v] projection's layout). Its transitions, the ops that keep it, slicing a part out,
gradients, randomness, checkpoints and bad input, against plain numpy and the one-process run.
"""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import Partial, Replicate, Shard, StridedShard
from dtensor.comm import count_collectives
from dtensor.dtensor import DTensor, distribute_tensor


def mesh1d(n):
    return dtensor.init_device_mesh("cpu", (n,))


def held(size: int, parts: int, n: int, r: int) -> np.ndarray:
    """The global indices rank r of n holds, written out from the definition: torch.chunk of
    every part, parts in order."""
    part, c = size // parts, -(-(size // parts) // n)
    return np.array([p * part + i for p in range(parts)
                     for i in range(min(part, r * c), min(part, (r + 1) * c))], dtype=int)


def counts(log):
    return {k: n for k, (n, _) in log.summary().items()}


# ----------------------------------------------------------------------------- transitions

X = np.arange(12 * 5, dtype=np.float64).reshape(12, 5) * 0.25 - 3
SS3, SS2 = StridedShard(0, 3), StridedShard(0, 2)  # over 3 ranks: parts of 4 -> 2, 1, 1
CASES = [  # (src, dst, forward collectives)
    (Replicate(), SS3, {}),
    (SS3, Replicate(), {"all_gather": 1}),
    (SS3, Shard(0), {"all_gather": 1}),
    (SS3, Shard(1), {"all_gather": 1}),
    (Shard(0), SS3, {"all_gather": 1}),
    (SS3, SS2, {"all_gather": 1}),
    (Partial(), SS3, {"all_reduce": 1}),
    (Replicate(), StridedShard(1, 1), {}),  # one part: Shard(1)'s blocks
]


@pytest.mark.ranks(3, timeout=120)
def test_transitions_values_counts_and_gradients(rank):
    mesh = mesh1d(3)
    G = np.cos(np.arange(X.size)).reshape(X.shape)
    for src, dst, fwd in CASES:
        if src == Partial():
            x = DTensor.from_local(X * (rank + 1) / 6, mesh, [Partial()], shape=X.shape)
        else:
            x = distribute_tensor(X, mesh, [src])
        x.requires_grad = True
        with count_collectives() as log:
            y = x.redistribute(mesh, [dst])
        assert counts(log) == fwd, (src, dst, counts(log))
        assert y.placements == (dst,)
        if isinstance(dst, StridedShard):
            idx = held(X.shape[dst.dim], dst.parts, 3, rank)
            np.testing.assert_array_equal(y.to_local().numpy(), np.take(X, idx, axis=dst.dim))
        np.testing.assert_allclose(y.full_tensor().numpy(), X, rtol=1e-15)
        y.backward(distribute_tensor(G, mesh, [dst]))
        np.testing.assert_allclose(x.grad.full_tensor().numpy(), G, rtol=1e-15)


@pytest.mark.ranks(2, timeout=120)
def test_local_blocks_from_local_and_the_picture(rank):
    mesh = mesh1d(2)
    x = distribute_tensor(np.arange(12.0), mesh, [StridedShard(0, 3)])
    np.testing.assert_array_equal(x.to_local().numpy(), np.arange(12.0)[held(12, 3, 2, rank)])
    y = DTensor.from_local(x.to_local(), mesh, [StridedShard(0, 3)])  # the global shape inferred
    assert y.shape == (12,)
    np.testing.assert_array_equal(y.full_tensor().numpy(), np.arange(12.0))
    text = dtensor.visualize_sharding(x)
    assert "[0:2+4:6+8:10] -> ranks [0]" in text and "[2:4+6:8+10:12] -> ranks [1]" in text


# ----------------------------------------------------------------------------- ops

def _fused(x, w, b, C):
    """A fused projection read in three parts, each through different ops."""
    y = F.linear(x, w, b)
    q, k, v = y.split(C, dim=-1)
    z = (q * 2 + k.exp() - v * q).relu()
    scores = q.transpose(0, 1) @ k.transpose(0, 1).transpose(-1, -2)  # heads over batch
    return (z ** 2).sum() + scores.mean() + y.sum(dim=(0, 1)).max()


def _leaves(vals, mesh=None, layouts=None):
    out = []
    for i, a in enumerate(vals):
        t = dtensor.tensor(a) if mesh is None else distribute_tensor(a, mesh, [layouts[i]])
        t.requires_grad = True
        out.append(t)
    return out


def _check_fused(n, C):
    """Forward and gradients equal the one-process run; slicing the parts out moves nothing."""
    rng = np.random.default_rng(3)
    B, T, Cin = 2, 3, 5
    vals = [rng.standard_normal(s) for s in [(B, T, Cin), (3 * C, Cin), (3 * C,)]]
    one = _leaves(vals)
    want = _fused(*one, C)
    want.backward()
    xs = _leaves(vals, mesh1d(n), [Replicate(), StridedShard(0, 3), StridedShard(0, 3)])
    with count_collectives() as log:
        y = F.linear(*xs)
        q = y.split(C, dim=-1)[0]
    assert counts(log) == {} and q.placements == (Shard(2),) and y.placements == (
        StridedShard(2, 3),)
    got = _fused(*xs, C)
    got.backward()
    np.testing.assert_allclose(got.full_tensor().numpy(), want.numpy(), rtol=1e-12)
    for a, b in zip(one, xs):
        np.testing.assert_allclose(b.grad.full_tensor().numpy(), a.grad.numpy(), rtol=1e-12,
                                   atol=1e-12)
    assert xs[1].grad.placements == (StridedShard(0, 3),)  # the gradient keeps the layout
    assert xs[2].grad.placements == (StridedShard(0, 3),)


@pytest.mark.ranks(2, timeout=120)
def test_fused_projection_read_in_parts_on_two_ranks(rank):
    _check_fused(2, 8)
    _check_fused(2, 5)  # 5 features per part: 3 and 2


@pytest.mark.ranks(4, timeout=120)
def test_fused_projection_read_in_parts_on_four_ranks(rank):
    _check_fused(4, 8)
    _check_fused(4, 6)  # 6 per part over 4: 2, 2, 2, 0


@pytest.mark.ranks(2, timeout=120)
def test_random_draws_do_not_depend_on_the_layout(rank):
    mesh = mesh1d(2)
    dtensor.manual_seed(5)
    whole = dtensor.randn(6, 4, device_mesh=mesh, placements=[Replicate()]).full_tensor()
    dtensor.manual_seed(5)
    split = dtensor.randn(6, 4, device_mesh=mesh, placements=[StridedShard(0, 3)])
    np.testing.assert_array_equal(split.full_tensor().numpy(), whole.numpy())
    np.testing.assert_array_equal(split.to_local().numpy(), whole.numpy()[held(6, 3, 2, rank)])


@pytest.mark.ranks(3, timeout=120)
def test_checkpoint_saves_parts_and_loads_into_any_layout(tmp_path, rank):
    path = tmp_path / "ck"
    mesh = mesh1d(3)
    W = np.arange(24.0 * 2).reshape(24, 2)
    dtensor.checkpoint.save({"w": distribute_tensor(W, mesh, [StridedShard(0, 3)])}, path)
    for layout in (Shard(0), Replicate(), StridedShard(0, 2), StridedShard(0, 3)):
        st = {"w": distribute_tensor(np.zeros_like(W), mesh, [layout])}
        dtensor.checkpoint.load(st, path)
        np.testing.assert_array_equal(st["w"].full_tensor().numpy(), W)
    dtensor.checkpoint.save({"w": distribute_tensor(W, mesh, [Shard(1)])}, path)
    st = {"w": distribute_tensor(np.zeros_like(W), mesh, [StridedShard(0, 4)])}
    dtensor.checkpoint.load(st, path)
    np.testing.assert_array_equal(st["w"].to_local().numpy(), W[held(24, 4, 3, rank)])


# ----------------------------------------------------------------------------- bad input

BAD = [  # (placements, shape, error, words)
    ([StridedShard(0, 4)], (6, 2), ValueError, r"size 6 into 4 equal parts.*does not divide"),
    ([StridedShard(2, 3)], (6, 2), ValueError, r"out of range for a tensor of shape \(6, 2\)"),
    ([StridedShard(0, 3), Shard(0)], (6, 2), NotImplementedError,
     r"shares tensor dim 0 with S\(0\).*Shard another tensor dim"),
]


@pytest.mark.ranks(2, timeout=120)
def test_bad_layouts_raise_on_every_rank(rank):
    import re
    mesh, mesh2 = mesh1d(2), dtensor.init_device_mesh("cpu", (2, 1))
    for placements, shape, err, words in BAD:
        m = mesh if len(placements) == 1 else mesh2
        with pytest.raises(err) as e:
            distribute_tensor(np.zeros(shape), m, placements)
        assert re.search(words, str(e.value)), str(e.value)
    for parts, err in ((0, ValueError), (1.5, TypeError), ("3", TypeError)):
        with pytest.raises(err, match=r"StridedShard\(dim, parts\): parts"):
            StridedShard(0, parts)


# ----------------------------------------------------------------------------- compiled

def _nano_steps(backend, steps=3):
    """Losses and whole parameters of a planned nanoGPT-layout model (c_attn split part by
    part) after SGD steps with momentum, eager (backend None) or compiled. Not Adam: the key
    bias's gradient is zero up to rounding (softmax ignores a shift shared by a row), and Adam
    scales that noise up to whole learning-rate steps."""
    import planner_models as zoo
    from dtensor.parallel import parallelize
    dtensor.manual_seed(0)
    model = zoo.Nano()
    rng = np.random.default_rng(1)
    batches = [zoo.Nano.batch(rng) for _ in range(steps)]
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize(model, mesh, example_inputs=batches[0])
    assert model.transformer.h[0].attn.c_attn.weight.placements == (StridedShard(0, 3),)
    opt = dtensor.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = step if backend is None else dtensor.compile(step, backend=backend)
    losses = [run(*b).item() for b in batches]
    return losses, {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("backend", ["numpy", "triton"])
@pytest.mark.ranks(2, timeout=300)
def test_compiled_step_with_strided_parameters_matches_eager(backend, rank):
    want, want_params = _nano_steps(None)
    got, got_params = _nano_steps(backend)
    # the compiler may fuse and reorder float32 sums (DESIGN 8): a few ulp per step, the
    # parameters' changes (0.1 x gradients of order 1) a few ulp of 0.1 each
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k in want_params:
        np.testing.assert_allclose(got_params[k], want_params[k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)


# ----------------------------------------------------------------------------- with FSDP

class _Fused(dtensor.nn.Module):
    """A fused projection read in three parts, with biases, then a row-parallel one."""

    def __init__(self):
        super().__init__()
        self.qkv = dtensor.nn.Linear(6, 12)
        self.out = dtensor.nn.Linear(4, 6)

    def forward(self, x, y):
        q, k, v = self.qkv(x).split(4, dim=-1)
        return ((self.out(q * F.gelu(k) + v) - y) ** 2).mean()


def _fused_steps(mesh=None):
    from dtensor.parallel import (ColwiseParallel, RowwiseParallel, fully_shard,
                                  parallelize_module)
    dtensor.manual_seed(0)
    model = _Fused()
    if mesh is not None:
        parallelize_module(model, mesh["tp"], {
            "qkv": ColwiseParallel(parts=3, use_local_output=False), "out": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        # "dp" splits the weight's other dim; the strided bias stays whole over "dp"
        assert model.qkv.weight.placements == (StridedShard(0, 3), Shard(1))
        assert model.qkv.bias.placements == (StridedShard(0, 3), Replicate())
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(2)
    losses = []
    for _ in range(3):
        loss = model(rng.standard_normal((8, 6)).astype(np.float32),
                     rng.standard_normal((8, 6)).astype(np.float32))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.full_tensor().numpy() if hasattr(v, "full_tensor") else v.numpy()
                    for k, v in model.state_dict().items()}


@pytest.mark.ranks(4, timeout=300)
def test_fully_sharded_strided_layer_trains_as_one_process(rank):
    want, want_params = _fused_steps()
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    got, got_params = _fused_steps(mesh)
    # float32 sums in another order (the dp mean, the row-parallel partial sums): a few ulp
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k in want_params:
        np.testing.assert_allclose(got_params[k], want_params[k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
