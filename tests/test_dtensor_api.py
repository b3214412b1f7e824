"""DTensor's public API: construction, factories, randomness, a hand-sharded MLP, bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import Partial, Replicate, Shard
from dtensor.comm import count_collectives
from dtensor.dtensor import DTensor, distribute_tensor


def counts(log):
    return {k: n for k, (n, _) in log.summary().items()}


class MLP(dtensor.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = dtensor.nn.Linear(6, 16, bias=True)
        self.fc2 = dtensor.nn.Linear(16, 5, bias=True)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def train(model, xs, ys, wrap):
    opt = dtensor.optim.SGD(model.parameters(), lr=0.1)
    losses, logs = [], []
    for x, y in zip(xs, ys):
        xin = dtensor.Tensor(x, requires_grad=True)  # as if it came from an earlier layer
        with count_collectives() as fwd:
            out = model(wrap(xin))
            loss = ((out - wrap(dtensor.Tensor(y))) ** 2).mean()
        with count_collectives() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        logs.append((counts(fwd), counts(bwd)))
    return losses, logs


@pytest.mark.ranks(4)
def test_hand_sharded_mlp_matches_one_process(rank):
    """fc1 column-sharded (Shard(0) weight), fc2 row-sharded (Shard(1) weight) on (4,): the
    Megatron MLP, with one all_reduce forward (fc2's partial sums) and one backward (the input
    gradient), falling out of the sharding rules."""
    mesh = dtensor.init_device_mesh("cpu", (4,))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 6)).astype(np.float32) for _ in range(3)]
    ys = [rng.standard_normal((8, 5)).astype(np.float32) for _ in range(3)]
    dtensor.manual_seed(1)
    ref = MLP()
    dtensor.manual_seed(1)
    model = MLP()

    def shard(name, placement):
        mod = getattr(model, name)
        for pname, p in list(mod._parameters.items()):
            pl = placement(pname)
            mod._parameters[pname] = dtensor.nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                                            [pl]))
    shard("fc1", lambda n: Shard(0))                                  # weight rows, bias
    shard("fc2", lambda n: Shard(1) if n == "weight" else Replicate())

    ref_losses, _ = train(ref, xs, ys, lambda x: x)
    losses, logs = train(model, xs, ys,
                         lambda x: DTensor.from_local(x, mesh, [Replicate()]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        np.testing.assert_allclose(q.full_tensor().numpy(), p.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=n)
    for fwd, bwd in logs:
        assert fwd == {"all_reduce": 1}, fwd
        assert bwd == {"all_reduce": 1}, bwd


@pytest.mark.ranks(4)
def test_random_is_sharding_invariant(rank):
    for shape in [(4,), (2, 2)]:
        mesh = dtensor.init_device_mesh("cpu", shape)
        for pl in ([Shard(0)], [Shard(1)], [Replicate()]) if len(shape) == 1 else (
                [Shard(0), Shard(1)], [Shard(1), Shard(1)], [Replicate(), Shard(0)]):
            for fn in (dtensor.rand, dtensor.randn):
                dtensor.manual_seed(42)
                full = fn(7, 5).numpy()
                dtensor.manual_seed(42)
                d = fn(7, 5, device_mesh=mesh, placements=pl)
                np.testing.assert_array_equal(d.full_tensor().numpy(), full)
        # Dropout on a sharded activation drops exactly the elements one process drops.
        x = np.arange(6 * 10, dtype=np.float32).reshape(6, 10) + 1
        dtensor.manual_seed(3)
        ref = F.dropout(dtensor.Tensor(x), 0.3).numpy()
        dtensor.manual_seed(3)
        pl = [Shard(1)] * len(shape) if len(shape) == 1 else [Shard(0), Shard(1)]
        got = F.dropout(distribute_tensor(x, mesh, pl), 0.3)
        np.testing.assert_array_equal(got.full_tensor().numpy(), ref)


@pytest.mark.ranks(4)
def test_factories_allocate_only_the_local_block(rank):
    mesh = dtensor.init_device_mesh("cpu", (4,))
    z = dtensor.zeros(10, 3, device_mesh=mesh, placements=[Shard(0)])
    assert z.shape == (10, 3) and z.to_local().shape == ((3, 3) if rank < 3 else (1, 3))
    o = dtensor.ones(2, 8, dtype="float64", device_mesh=mesh, placements=[Shard(1)])
    assert o.to_local().shape == (2, 2) and o.dtype == np.float64
    f = dtensor.full((5,), 7.0, device_mesh=mesh, placements=[Replicate()])
    np.testing.assert_array_equal(f.full_tensor().numpy(), np.full(5, 7.0, np.float32))


@pytest.mark.ranks(2)
def test_from_local_to_local_and_uneven_shapes(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    local = np.full((3 if rank == 0 else 2, 4), float(rank))
    d = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 4), run_check=True)
    assert d.shape == (5, 4) and d.to_local().shape == local.shape
    np.testing.assert_array_equal(d.full_tensor().numpy()[:, 0], [0, 0, 0, 1, 1])
    even = DTensor.from_local(np.ones((2, 4)), mesh, [Shard(1)])  # no shape: assumed even
    assert even.shape == (2, 8)
    # Gradients flow through from_local / to_local.
    t = dtensor.Tensor(np.ones((2, 3)), requires_grad=True)
    (DTensor.from_local(t, mesh, [Shard(0)]) * 3).to_local().sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), np.full((2, 3), 3.0))


@pytest.mark.ranks(2)
def test_implicit_replication_and_visualize(rank, capsys):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    d = distribute_tensor(np.arange(6.0).reshape(2, 3), mesh, [Shard(1)])
    with pytest.raises(TypeError, match=r"mixes a plain Tensor \(shape \(3,\)\).*implicit_"):
        d + dtensor.ones(3, dtype="float64")
    with dtensor.implicit_replication():
        np.testing.assert_array_equal((d + dtensor.ones(3, dtype="float64")).full_tensor()
                                      .numpy(), np.arange(6.0).reshape(2, 3) + 1)
    text = dtensor.visualize_sharding(d)
    assert "[0:2, 0:2] -> ranks [0]" in text and "[0:2, 2:3] -> ranks [1]" in text
    assert ("ranks [0]" in capsys.readouterr().out) == (rank == 0)


@pytest.mark.ranks(2)
def test_bad_input_is_clear_and_raised_on_every_rank(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    x = np.ones((4, 3))
    with pytest.raises(ValueError, match=r"2 placements \[S\(0\), R\] for a 1-d mesh"):
        distribute_tensor(x, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"S\(2\) is out of range for a tensor of shape \(4, 3\)"):
        distribute_tensor(x, mesh, [Shard(2)])
    d = distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"from P\(sum\) to P\(max\).*not allowed"):
        d.redistribute(mesh, [Partial()]).redistribute(mesh, [Partial("max")])
    with pytest.raises(TypeError, match="Shard"):
        distribute_tensor(x, mesh, ["S0"])
    # from_local with blocks that disagree across ranks: caught on every rank with run_check.
    local = np.ones((2 + rank, 3))
    with pytest.raises(ValueError, match=r"rank 1: local \(3, 3\).*expected \(2, 3\)"):
        DTensor.from_local(local, mesh, [Shard(0)], shape=(4, 3), run_check=True)
    with pytest.raises(TypeError, match="no single numpy array"):
        d.numpy()


@pytest.mark.ranks(2)
def test_flattening_views_keep_shards_or_say_why(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    a = np.arange(4 * 6 * 3.0).reshape(4, 6, 3)  # (B, T, C)
    b0 = distribute_tensor(a, mesh, [Shard(0)])
    with count_collectives() as log:
        flat = b0.reshape(24, 3)
    assert log.count() == 0 and flat.placements == (Shard(0),)
    np.testing.assert_array_equal(flat.full_tensor().numpy(), a.reshape(24, 3))
    t1 = distribute_tensor(a, mesh, [Shard(1)])
    with pytest.raises(ValueError, match=r"cannot keep tensor dim 1 sharded.*Redistribute first"):
        t1.reshape(24, 3)  # rows of a T-shard are not a contiguous block of B*T
    heads = distribute_tensor(a, mesh, [Shard(2)]).reshape(4, 6, 3, 1)  # a split, no data moved
    assert heads.placements == (Shard(2),)


@pytest.mark.ranks(2)
def test_distribute_module_and_debug_log(rank, capsys, monkeypatch):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    dtensor.manual_seed(0)
    lin = dtensor.nn.Linear(4, 6)

    def partition(name, module, mesh):
        if isinstance(module, dtensor.nn.Linear):
            module.weight = dtensor.nn.Parameter(distribute_tensor(module.weight.detach(), mesh,
                                                                   [Shard(0)]))
    dtensor.distribute_module(lin, mesh, partition,
                              input_fn=lambda m, args, mesh: tuple(
                                  DTensor.from_local(a, mesh, [Replicate()]) for a in args))
    assert lin.weight.placements == (Shard(0),) and lin.bias.placements == (Replicate(),)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    monkeypatch.setenv("DTENSOR_DEBUG", "1")
    out = lin(dtensor.ones(2, 4))
    out.full_tensor()
    printed = capsys.readouterr().out
    assert ("redistribute (2, 6) float32: [S(1)] -> [R]" in printed) == (rank == 0), printed


@pytest.mark.ranks(2, timeout=120)
def test_ranks_that_pass_different_metadata_fail_together(rank):
    """Every collective entry point that takes user metadata raises the same error on every
    rank, naming the ranks and their values, instead of hanging or computing garbage."""
    import time

    from dtensor.comm import get_world
    mesh = dtensor.init_device_mesh("cpu", (2,))
    mesh2 = dtensor.init_device_mesh("cpu", (1, 2))
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    d = distribute_tensor(x, mesh, [Shard(0)])
    one = rank == 1
    cases = [  # (name, call, exception type, regex)
        ("distribute shape", lambda: distribute_tensor(np.ones((4, 6 + rank)), mesh, [Shard(0)]),
         ValueError, r"distribute_tensor: .*shape: \(4, 6\) on ranks \[0\], \(4, 7\) on ranks "
                     r"\[1\]"),
        ("distribute dtype", lambda: distribute_tensor(x.astype("float64" if one else "float32"),
                                                       mesh, [Shard(0)]),
         ValueError, r"dtype: float32 on ranks \[0\], float64 on ranks \[1\]"),
        ("distribute placements", lambda: distribute_tensor(x, mesh, [Shard(rank)]),
         ValueError, r"placements: \[S\(0\)\] on ranks \[0\], \[S\(1\)\] on ranks \[1\]"),
        ("distribute 2-d placements", lambda: distribute_tensor(
            x, mesh2, [Replicate(), Shard(0) if one else Replicate()]), ValueError,
         r"placements: \[R, R\] on ranks \[0\], \[R, S\(0\)\] on ranks \[1\]"),
        ("distribute src", lambda: distribute_tensor(x, mesh, [Shard(0)], src_data_rank=rank),
         ValueError, r"src_data_rank: 0 on ranks \[0\], 1 on ranks \[1\]"),
        ("distribute bad on one rank", lambda: distribute_tensor(x, mesh, [Shard(5 * rank)]),
         ValueError, r"distribute_tensor failed on rank 1: S\(5\) is out of range"),
        ("from_local shape", lambda: DTensor.from_local(np.ones((2, 3)), mesh, [Shard(0)],
                                                         shape=(4, 3) if one else (3, 3)),
         ValueError, r"from_local: .*shape: \(3, 3\) on ranks \[0\], \(4, 3\) on ranks \[1\]"),
        ("from_local placements", lambda: DTensor.from_local(
            np.ones((2, 2)), mesh, [Shard(rank)], shape=(4, 2) if rank == 0 else (2, 4)),
         ValueError, r"placements: \[S\(0\)\] on ranks \[0\], \[S\(1\)\] on ranks \[1\]"),
        ("from_local dtype", lambda: DTensor.from_local(
            np.ones((2, 3), "float64" if one else "float32"), mesh, [Shard(0)], shape=(4, 3)),
         ValueError, r"dtype: float32 on ranks \[0\], float64 on ranks \[1\]"),
        ("from_local no shape placements", lambda: DTensor.from_local(
            np.ones((2, 2)), mesh, [Replicate() if one else Shard(0)]),
         ValueError, r"placements: \[S\(0\)\] on ranks \[0\], \[R\] on ranks \[1\]"),
        ("from_local no shape dtype", lambda: DTensor.from_local(
            np.ones((2, 3), "float64" if one else "float32"), mesh, [Shard(0)]),
         ValueError, r"dtype: float32 on ranks \[0\], float64 on ranks \[1\]"),
        ("from_local uneven without shape", lambda: DTensor.from_local(
            np.ones((2 + rank, 3)), mesh, [Shard(0)]),
         ValueError, r"block: \(2, 3\) on ranks \[0\], \(3, 3\) on ranks \[1\].*Pass "
                     r"shape="),
        ("randn seeds", lambda: (dtensor.manual_seed(rank), dtensor.randn(
            4, 2, device_mesh=mesh, placements=[Replicate()])),
         ValueError, r"dtensor\.randn: .*rng_state: \{'seed': 0, 'stream': 0\} on ranks \[0\], "
                     r"\{'seed': 1, 'stream': 0\} on ranks \[1\].*manual_seed"),
        ("redistribute placements", lambda: d.redistribute(mesh, [Shard(rank)]),
         ValueError, r"redistribute: .*placements: \[S\(0\)\] on ranks \[0\], \[S\(1\)\] on "
                     r"ranks \[1\]"),
        ("redistribute bad on one rank", lambda: d.redistribute(
            mesh, [Shard(5) if one else Replicate()]),
         ValueError, r"redistribute failed on rank 1: S\(5\) is out of range"),
        ("mesh type", lambda: distribute_tensor(x, "tp", [Shard(0)]), TypeError,
         r"device_mesh must be a DeviceMesh.*got str 'tp'"),
    ]
    comm = get_world()
    for name, call, exc, pattern in cases:
        t = time.perf_counter()
        with pytest.raises(exc, match=pattern) as info:
            call()
        assert time.perf_counter() - t < 1.0, name
        theirs = comm._c.allgather((type(info.value).__name__, str(info.value)))
        assert theirs[0] == theirs[1], (name, theirs)
    # and agreeing ranks still work, with the right values
    np.testing.assert_array_equal(d.redistribute(mesh, [Replicate()]).to_local().numpy(), x)
    np.testing.assert_array_equal(distribute_tensor(x, mesh2, [Replicate(), Shard(1)])
                                  .full_tensor().numpy(), x)


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bool"])
def test_sharded_max_matches_numpy_with_nan_and_bool(rank, dtype):
    """A NaN on one shard makes the max NaN on every rank (MPI_MAX alone drops it), with the
    same bits; bools reduce too (MPICH has no MAX for them)."""
    from dtensor.comm import get_world
    mesh = dtensor.init_device_mesh("cpu", (2,))
    x = np.arange(24, dtype=np.float64).reshape(4, 6) % 7 - 3
    x[0, 1] = x[3, 4] = np.nan
    x = x > 0 if dtype == "bool" else x.astype(dtype)
    for placements in ([Shard(0)], [Shard(1)]):
        d = distribute_tensor(x, mesh, placements)
        for axis in (None, 0, 1):
            got = d.max(axis).full_tensor().numpy()
            np.testing.assert_array_equal(got, np.max(x, axis=axis))
            bits = get_world()._c.allgather(np.ascontiguousarray(got).tobytes())
            assert bits[0] == bits[1]


@pytest.mark.ranks(2, timeout=120)
def test_an_optimizer_built_differently_on_one_rank_fails_on_every_rank(rank):
    """A replicated parameter stepped with another lr on one rank would diverge silently."""
    from dtensor.comm import get_world
    mesh = dtensor.init_device_mesh("cpu", (2,))
    p = dtensor.nn.Parameter(distribute_tensor(np.ones((4, 2), np.float32), mesh,
                                               [Replicate()]))
    for make, pattern in [
        (lambda: dtensor.optim.SGD([p], lr=0.1 * (rank + 1)),
         r"SGD: .*hyperparameters: \[\{'lr': 0\.1, .*\}\] on ranks \[0\], \[\{'lr': 0\.2"),
        (lambda: dtensor.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.99 if rank else 0.999)),
         r"AdamW: .*'betas': \(0\.9, 0\.999\).* on ranks \[0\]"),
    ]:
        with pytest.raises(ValueError, match=pattern) as info:
            make()
        theirs = get_world()._c.allgather(str(info.value))
        assert theirs[0] == theirs[1]
    opt = dtensor.optim.SGD([p], lr=0.1)  # the same on both ranks: fine
    p.grad = distribute_tensor(np.ones((4, 2), np.float32), mesh, [Replicate()])
    opt.step()
    np.testing.assert_allclose(p.full_tensor().numpy(), 0.9)


@pytest.mark.ranks(2, timeout=120)
def test_a_bad_index_in_one_ranks_rows_raises_on_every_rank(rank):
    """Sharded ids or targets: the bad value lies in rank 1's block only, yet both ranks raise
    the same IndexError (rank 0 would otherwise wait in the next collective)."""
    from dtensor.comm import get_world
    from dtensor.nn import GPT, GPTConfig
    from dtensor.parallel import parallelize
    mesh = dtensor.init_device_mesh("cpu", (2,))
    dp = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ids = np.array([[0, 3], [2, -1]])  # -1 lands in rank 1's row
    tgt = np.array([1, 0, 9, 4])       # 9 lands in rank 1's rows
    logits = np.zeros((4, 5), np.float32)
    cfg = GPTConfig(vocab_size=10, n_layer=1, n_embd=8, n_head=2, mlp_hidden=16, block_size=4)
    model = parallelize(GPT(cfg), dp)
    good = np.zeros((2, 4), np.int64)
    bad = good.copy()
    bad[1, 2] = 10
    cases = [
        ("vocab-parallel lookup", lambda: F.embedding(
            distribute_tensor(ids, mesh, [Shard(0)]),
            distribute_tensor(np.ones((10, 4), np.float32), mesh, [Shard(0)])),
         r"embedding failed on rank 1: embedding: index -1 is out of range for 10 rows"),
        ("replicated-weight lookup", lambda: F.embedding(
            distribute_tensor(ids, mesh, [Shard(0)]),
            distribute_tensor(np.ones((10, 4), np.float32), mesh, [dtensor.Replicate()])),
         r"embedding failed on rank 1: embedding: index -1"),
        ("sharded cross_entropy", lambda: F.cross_entropy(
            distribute_tensor(logits, mesh, [Shard(0)]), distribute_tensor(tgt, mesh, [Shard(0)])),
         r"cross_entropy failed on rank 1: cross_entropy: target 9 is out of range for 5"),
        ("data-parallel GPT ids", lambda: model(bad, good),
         r"embedding failed on rank 1: embedding: index 10 is out of range for 10 rows"),
        ("data-parallel GPT targets", lambda: model(good, bad),
         r"cross_entropy failed on rank 1: cross_entropy: target 10 is out of range"),
    ]
    for name, call, pattern in cases:
        with pytest.raises(IndexError, match=pattern) as info:
            call()
        theirs = get_world()._c.allgather(str(info.value))
        assert theirs[0] == theirs[1], name
    model(good, good)  # and good ids still run


@pytest.mark.ranks(4, timeout=120)
def test_agreement_on_a_sub_mesh_is_within_its_groups(rank):
    """The tp groups of a (dp, tp) mesh hold different ranks and may hold different data:
    each group agrees within itself, and a mismatch inside one group is still caught."""
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    x = np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * (rank // 2)
    d = distribute_tensor(x, tp, [Shard(0)], src_data_rank=None)
    np.testing.assert_array_equal(d.redistribute(tp, [Replicate()]).to_local().numpy(), x)
    dtensor.manual_seed(rank // 2)  # one seed per dp group: fine within each tp group
    dtensor.randn(4, 2, device_mesh=tp, placements=[Replicate()])
    first = rank - rank % 2  # the group's global ranks name the culprits
    with pytest.raises(ValueError, match=rf"placements: \[S\(0\)\] on ranks \[{first}\], "
                                         rf"\[S\(1\)\] on ranks \[{first + 1}\]"):
        d.redistribute(tp, [Shard(rank % 2)])


@pytest.mark.ranks(2, timeout=120)
def test_an_optimizer_groups_own_keys_are_not_compared(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    p = dtensor.nn.Parameter(distribute_tensor(np.ones((2, 2), np.float32), mesh, [Replicate()]))
    dtensor.optim.SGD([{"params": [p], "hook": lambda g: g}], lr=0.1)  # reprs differ by rank
