"""DeviceMesh on real MPI ranks: layout, slicing, coordinates and sub-group collectives."""
from __future__ import annotations

import numpy as np
import pytest

from dtensor.comm import count_collectives
from dtensor.mesh import DeviceMesh, init_device_mesh


@pytest.mark.ranks(4)
def test_1d_mesh(rank):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    assert mesh.ndim == 1 and mesh.shape == (4,) and mesh.size() == 4
    assert mesh.get_rank() == rank and mesh.get_coordinate() == [rank]
    assert mesh.get_local_rank() == rank and mesh.get_local_rank("tp") == rank
    with count_collectives() as log:
        got = mesh.get_group().all_reduce(np.array([rank]))
    assert got[0] == 6 and log.events[0].group == (0, 1, 2, 3)
    assert repr(mesh) == "DeviceMesh('cpu', [0, 1, 2, 3], mesh_dim_names=('tp',))"


def check_2d(rank, dp, tp):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    i, j = divmod(rank, tp)  # row-major
    assert mesh.get_coordinate() == [i, j]
    assert mesh.size("dp") == dp and mesh.size(1) == tp and mesh.size() == dp * tp
    assert mesh.get_local_rank("dp") == i and mesh.get_local_rank("tp") == j
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    assert tp_mesh.mesh.tolist() == [i * tp + k for k in range(tp)]
    assert dp_mesh.mesh.tolist() == [k * tp + j for k in range(dp)]
    assert tp_mesh.get_local_rank() == j and dp_mesh.get_coordinate() == [i]
    # Sub-group collectives reach exactly the ranks of the row / column.
    with count_collectives() as log:
        row = tp_mesh.get_group().all_gather(np.array([rank]))
        col = mesh.get_group("dp").all_gather(np.array([rank]))
    assert row.tolist() == [i * tp + k for k in range(tp)]
    assert col.tolist() == [k * tp + j for k in range(dp)]
    assert [e.group for e in log.events] == [tuple(row.tolist()), tuple(col.tolist())]
    # Slicing both dims (reordered) gives the transposed mesh; its groups are reused, not split.
    both = mesh["tp", "dp"]
    assert both.mesh.tolist() == mesh.mesh.T.tolist() and both.mesh_dim_names == ("tp", "dp")
    assert both.get_group("tp") is mesh.get_group("tp")
    assert mesh["dp", "tp"] == mesh


@pytest.mark.ranks(4)
def test_2x2_mesh(rank):
    check_2d(rank, 2, 2)


@pytest.mark.ranks(8, timeout=120)
def test_2x4_mesh_oversubscribed(rank):
    check_2d(rank, 2, 4)


@pytest.mark.ranks(4)
def test_explicit_rank_array_and_errors(rank):
    mesh = DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("a", "b"))
    assert mesh.get_coordinate() == [[3, 2, 1, 0].index(rank) // 2, [3, 2, 1, 0].index(rank) % 2]
    assert sorted(mesh["b"].mesh.tolist()) == sorted(mesh.mesh[mesh.get_coordinate()[0]].tolist())
    with pytest.raises(ValueError, match=r"\(2, 4\) holds 8 ranks but this job has 4"):
        init_device_mesh("cpu", (2, 4))
    with pytest.raises(ValueError, match=r"repeats \['tp'\]"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "tp"))
    with pytest.raises(ValueError, match="one name per mesh dim"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
    with pytest.raises(KeyError, match=r"no dim named 'pp'.*\(a=2, b=2\)"):
        mesh["pp"]
    with pytest.raises(IndexError, match="mesh dim 2 is out of range"):
        mesh.size(2)
    with pytest.raises(ValueError, match="say which one"):
        mesh.get_local_rank()
    with pytest.raises(ValueError, match="'cuda' is not supported yet"):
        init_device_mesh("cuda", (4,))
    with pytest.raises(ValueError, match="exactly once"):
        DeviceMesh("cpu", [0, 1, 1, 2])


def test_world_of_one_without_mpiexec():
    mesh = init_device_mesh("cpu", (1,))
    assert mesh.get_coordinate() == [0]
    np.testing.assert_array_equal(mesh.get_group().all_reduce(np.arange(3.0)), np.arange(3.0))


@pytest.mark.ranks(4)
def test_check_same_over_a_sub_mesh(rank):
    """A sub-mesh agrees over its own ranks only: other groups may pass other values."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    tp.check_same("same within a tp group", value=rank // 2)  # groups {0, 1} and {2, 3}
    with pytest.raises(ValueError, match=r"value: 0 on ranks \[0\], 1 on ranks \[1\]|"
                                         r"value: 2 on ranks \[2\], 3 on ranks \[3\]"):
        tp.check_same("differs within a tp group", value=rank)
    mesh.check_same("the whole mesh", value=0)
    with pytest.raises(ValueError, match=r"the whole mesh: ranks passed different"):
        mesh.check_same("the whole mesh", value=rank % 2)


@pytest.mark.ranks(2)
def test_mesh_arguments_agree_before_the_split(rank):
    """Ranks that build different meshes raise on every rank instead of hanging in Split."""
    with pytest.raises(ValueError, match=r"DeviceMesh: ranks passed different arguments "
                                         r"\(mesh: \[0, 1\] on ranks \[0\], \[1, 0\] on "
                                         r"ranks \[1\]\)"):
        DeviceMesh("cpu", [0, 1] if rank == 0 else [1, 0])
    with pytest.raises(TypeError, match=r"failed on rank 0: .*got the string 'tp'"):
        init_device_mesh("cpu", (2,), mesh_dim_names="tp" if rank == 0 else ("tp",))
    assert init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]).mesh_dim_names == ("tp",)
