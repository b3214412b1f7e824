"""Every redistribute transition, forward and backward, with exact collective counts."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import dtensor
from dtensor import Partial, Replicate, Shard
from dtensor.comm import count_collectives
from dtensor.dtensor import DTensor, distribute_tensor

X = np.arange(5 * 3, dtype=np.float64).reshape(5, 3) * 0.5 - 2  # 5 rows over 4 ranks: 2,2,1,0


def mesh1d(n):
    return dtensor.init_device_mesh("cpu", (n,))


def partial_of(a, mesh):
    """A Partial(sum) DTensor of ``a`` split unevenly across the mesh."""
    n, c = mesh.size(), mesh.get_coordinate()[0]
    local = a * (c + 1) / (n * (n + 1) / 2)
    return DTensor.from_local(local, mesh, [Partial()], shape=a.shape)


# (src, dst, forward collectives, grad placement, backward collectives)
CASES = [
    (Shard(0), Replicate(), {"all_gather": 1}, Replicate(), {}),
    (Shard(0), Replicate(), {"all_gather": 1}, Partial(), {"reduce_scatter": 1}),
    (Shard(0), Shard(1), {"all_to_all": 1}, Shard(1), {"all_to_all": 1}),
    (Shard(1), Shard(0), {"all_to_all": 1}, Shard(0), {"all_to_all": 1}),
    (Replicate(), Shard(0), {}, Shard(0), {"all_gather": 1}),
    (Replicate(), Shard(1), {}, Shard(1), {"all_gather": 1}),
    (Replicate(), Replicate(), {}, Replicate(), {}),
    (Partial(), Replicate(), {"all_reduce": 1}, Replicate(), {}),
    (Partial(), Shard(0), {"reduce_scatter": 1}, Shard(0), {"all_gather": 1}),
    (Partial(), Shard(1), {"reduce_scatter": 1}, Shard(1), {"all_gather": 1}),
]


def counts(log):
    return {k: n for k, (n, _) in log.summary().items()}


@pytest.mark.ranks(4)
@pytest.mark.parametrize("src,dst,fwd,gp,bwd", CASES, ids=lambda v: repr(v))
def test_transition_values_and_counts(src, dst, fwd, gp, bwd, rank):
    mesh = mesh1d(4)
    x = partial_of(X, mesh) if src == Partial() else distribute_tensor(X, mesh, [src])
    x.requires_grad = True
    with count_collectives() as log:
        y = x.redistribute(mesh, [dst])
    assert counts(log) == fwd
    assert y.placements == (dst,)
    np.testing.assert_allclose(y.full_tensor().numpy(), X)
    G = np.arange(15.0).reshape(5, 3) + 1
    g = partial_of(G, mesh) if gp == Partial() else distribute_tensor(G, mesh, [gp])
    with count_collectives() as log:
        y.backward(g)
    assert counts(log) == bwd
    # The gradient of a redistribute is the upstream gradient, back in the source's layout
    # (a Partial source takes it as it comes).
    np.testing.assert_allclose(x.grad.full_tensor().numpy(), G)
    if src != Partial():
        assert x.grad.placements == (src,)


@pytest.mark.ranks(3)
def test_partial_ops_reduce_with_their_op(rank):
    mesh = mesh1d(3)
    vals = np.array([[1.0, 5.0], [4.0, -2.0], [2.0, 7.0]])
    for op, want in [("max", vals.max(0)), ("min", vals.min(0)), ("avg", vals.mean(0)),
                     ("sum", vals.sum(0))]:
        x = DTensor.from_local(vals[rank], mesh, [Partial(op)])
        np.testing.assert_allclose(x.full_tensor().numpy(), want)


@pytest.mark.ranks(4)
def test_round_trip_every_placement_on_every_mesh(rank):
    for shape in [(4,), (2, 2)]:
        mesh = dtensor.init_device_mesh("cpu", shape)
        opts = [Replicate(), Shard(0), Shard(1), Shard(2)]
        for a in (X, np.arange(2 * 3 * 7.0).reshape(2, 3, 7), np.ones((1, 3, 1))):
            for pl in itertools.product(opts[:a.ndim + 1], repeat=mesh.ndim):
                d = distribute_tensor(a, mesh, list(pl))
                np.testing.assert_array_equal(d.full_tensor().numpy(), a)
                for target in itertools.product(opts[:a.ndim + 1], repeat=mesh.ndim):
                    np.testing.assert_array_equal(
                        d.redistribute(mesh, list(target)).full_tensor().numpy(), a,
                        err_msg=f"{pl} -> {target}")


@pytest.mark.ranks(2)
def test_round_trip_on_two_and_three_rank_meshes(rank):
    mesh = mesh1d(2)
    for pl in [Replicate(), Shard(0), Shard(1)]:
        np.testing.assert_array_equal(distribute_tensor(X, mesh, [pl]).full_tensor().numpy(), X)


@pytest.mark.ranks(3)
def test_round_trip_three_ranks(rank):
    mesh = mesh1d(3)
    for pl in [Replicate(), Shard(0), Shard(1)]:
        d = distribute_tensor(X, mesh, [pl])
        np.testing.assert_array_equal(d.full_tensor().numpy(), X)
        if pl == Shard(0):
            assert d.to_local().shape == ((2, 3) if rank < 2 else (1, 3))


@pytest.mark.ranks(4)
def test_async_redistribute(rank):
    mesh = mesh1d(4)
    d = distribute_tensor(X, mesh, [Shard(0)])
    with count_collectives() as log:
        r = d.redistribute(mesh, [Replicate()], async_op=True)
        np.testing.assert_array_equal(r.to_local().numpy(), X)
    assert log.count("all_gather") == 1


@pytest.mark.ranks(4)
def test_nested_shards_on_a_2d_mesh(rank):
    mesh = dtensor.init_device_mesh("cpu", (2, 2))
    a = np.arange(7 * 6.0).reshape(7, 6)
    d = distribute_tensor(a, mesh, [Shard(0), Shard(0)])  # rows split by dim 0, then dim 1
    sizes = {0: 2, 1: 2, 2: 2, 3: 1}  # 7 -> (4, 3) -> (2, 2), (2, 1)
    assert d.to_local().shape == (sizes[rank], 6)
    for target in ([Replicate(), Shard(0)], [Shard(1), Shard(0)], [Shard(0), Replicate()],
                   [Shard(1), Shard(1)], [Replicate(), Replicate()]):
        np.testing.assert_array_equal(d.redistribute(mesh, target).full_tensor().numpy(), a)


@pytest.mark.ranks(2)
def test_shards_copy_the_replicated_value_except_a_broadcast(rank):
    """Replicate -> Shard gives each rank a copy (a write to the shard leaves the replicated
    array alone); a read-only broadcast along the split dim is sliced as the same broadcast,
    without writing out its repeated elements."""
    from dtensor.dtensor import DTensorSpec
    from dtensor.redistribute import redistribute_local

    mesh = mesh1d(2)
    col = np.arange(4.0).reshape(4, 1)
    for shape, src in [((4, 6), np.arange(24.0).reshape(4, 6)),
                       ((4, 6), np.broadcast_to(col, (4, 6)))]:
        spec = DTensorSpec(mesh, (Replicate(),), shape, src.dtype)
        for dim in (0, 1):
            got = redistribute_local(src, spec, (Shard(dim),))
            want = np.split(np.asarray(src), 2, axis=dim)[rank]
            np.testing.assert_array_equal(got, want)
            assert np.shares_memory(got, src) == (not src.flags.writeable and dim == 1)


# (mesh shape, src, dst, the plan printed on rank 1: one named step per move)
PLANS = [
    ((4,), (Shard(0),), (Replicate(),),
     ["all_gather(mesh_dim=0 axis=0 sizes=[2, 2, 1, 0]) -> [R]"]),
    ((4,), (Partial(),), (Shard(0),),
     ["reduce_scatter(mesh_dim=0 op=sum axis=0 sizes=[2, 2, 1, 0]) -> [S(0)]"]),
    ((4,), (Replicate(),), (Shard(0),), ["shard(mesh_dim=0 axis=0 start=2 stop=4) -> [S(0)]"]),
    ((4,), (Replicate(),), (Partial(),), ["zeros(mesh_dim=0) -> [P(sum)]"]),
    ((4,), (Shard(0),), (Shard(1),),
     ["all_to_all(mesh_dim=0 split_axis=1 concat_axis=0 split_sizes=[1, 1, 1, 0] "
      "concat_sizes=[2, 2, 1, 0]) -> [S(1)]"]),
    # two mesh dims: the inner shard is gathered first, then the partial reduced
    ((2, 2), (Partial(), Shard(0)), (Replicate(), Replicate()),
     ["all_gather(mesh_dim=1 axis=0 sizes=[3, 2]) -> [P(sum),R]",
      "all_reduce(mesh_dim=0 op=sum) -> [R,R]"]),
    ((2, 2), (Shard(0), Shard(0)), (Replicate(), Shard(0)),
     ["all_gather(mesh_dim=1 axis=0 sizes=[2, 1]) -> [S(0),R]",
      "all_gather(mesh_dim=0 axis=0 sizes=[3, 2]) -> [R,R]",
      "shard(mesh_dim=1 axis=0 start=3 stop=5) -> [R,S(0)]"]),
]


@pytest.mark.ranks(4)
@pytest.mark.parametrize("shape,src,dst,expect", PLANS,
                         ids=[f"{p[1]}->{p[2]}" for p in PLANS])
def test_plan_names_each_step(rank, shape, src, dst, expect):
    """A redistribute is a plan of named steps (printed as the compiled graph prints them),
    and running it gives the tensor in the new layout."""
    from dataclasses import replace

    from dtensor.redistribute import plan_redistribute
    mesh = dtensor.init_device_mesh("cpu", shape)
    # X laid out as src: a Partial mesh dim holds X / its size on each rank
    parts = np.prod([n for n, p in zip(shape, src) if isinstance(p, Partial)])
    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in src)
    t = DTensor.from_local(distribute_tensor(X / parts, mesh, whole).to_local().numpy(), mesh,
                           src, shape=X.shape)
    steps = plan_redistribute(t._spec, dst)
    if rank == 1:
        assert [repr(s) for s in steps] == expect
    # running the plan issues exactly its collectives, by kind
    from dtensor.redistribute import COLLECTIVES, redistribute_local
    with count_collectives() as log:
        redistribute_local(t.to_local().numpy(), t._spec, tuple(dst))
    want_counts = {}
    for s in steps:
        if s.kind in COLLECTIVES:
            want_counts[s.kind] = want_counts.get(s.kind, 0) + 1
    assert {k: n for k, (n, _) in log.summary().items()} == want_counts
    out = t.redistribute(mesh, dst)
    want = replace(t._spec, placements=tuple(dst))
    if Partial() not in dst:
        np.testing.assert_allclose(out.full_tensor().numpy(), X, rtol=1e-12)
    assert out._spec == want
