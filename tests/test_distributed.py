"""dtensor.distributed: rank, world size, local rank and barrier, in a plain process (no MPI
started) and on real MPI ranks (against mpi4py's own answers)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import dtensor
import dtensor.distributed as dist

# What launchers set (dtlaunch, torchrun, hydra, Open MPI): none of it in a plain process.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
               "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")

ASK = """
    import sys
    import dtensor
    {before}
    d = dtensor.distributed  # an attribute of the package, as documented
    print(d.get_rank(), d.get_world_size(), d.get_local_rank(), d.is_initialized(), d.barrier())
    print("mpi4py.MPI" in sys.modules)
"""


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env={**clean, **env}, check=False)


@pytest.mark.parametrize("before, env, out", [
    ("", {}, "0 1 0 False None\nFalse\n"),
    ("", {"PMI_SIZE": "1", "WORLD_SIZE": "1"}, "0 1 0 False None\nFalse\n"),  # mpiexec -n 1
    ("", {"WORLD_SIZE": "many"}, "0 1 0 False None\nFalse\n"),  # not a launcher's
    ("dtensor.comm.get_world()", {}, "0 1 0 True None\nTrue\n"),  # MPI started: a world of one
], ids=["plain", "world of one", "garbage WORLD_SIZE", "after comm.get_world"])
def test_a_plain_process_is_rank_0_of_1_without_starting_mpi(before: str, env: dict[str, str],
                                                             out: str) -> None:
    proc = _python(ASK.format(before=before), env)
    assert (proc.returncode, proc.stdout) == (0, out), proc.stderr


def test_world_size_from_a_launcher_without_mpi_is_an_error_saying_how_to_launch() -> None:
    # torchrun's environment: WORLD_SIZE=2, but no MPI launcher, so MPI sees a world of one.
    proc = _python(ASK.format(before=""), {"WORLD_SIZE": "2", "RANK": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("RuntimeError: WORLD_SIZE=2"), proc.stderr
    assert "world of 1" in last and "dtlaunch --nproc 2" in last, last


@pytest.mark.parametrize("call", [dist.get_rank, dist.get_world_size, dist.barrier])
@pytest.mark.parametrize("group", ["tp", 3, object()], ids=["str", "int", "object"])
def test_a_group_that_is_not_a_comm_is_a_type_error(call, group) -> None:
    with pytest.raises(TypeError, match=rf"{call.__name__}\(group=...\) takes a "
                                        r"dtensor.comm.Comm such as mesh.get_group\('tp'\)"):
        call(group)


def _check_on_ranks(rank: int, world_size: int, comm, tmp_path) -> None:
    from mpi4py import MPI

    assert dist is dtensor.distributed
    world = MPI.COMM_WORLD
    assert (dist.get_rank(), dist.get_world_size()) == (world.Get_rank(), world.Get_size())
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size) == (rank, world_size)
    assert dist.is_initialized()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    assert dist.get_local_rank() == node.Get_rank()
    node.Free()

    # barrier orders side effects: without it the others would look before rank 0 wrote
    flag = tmp_path / "written_by_rank_0"
    if rank == 0:
        time.sleep(0.5)
        flag.write_text("done")
    dist.barrier()
    assert flag.read_text() == "done"

    # the same within a group: ranks 1.. wait for their first member, rank 0 is not in it
    sub = comm.subgroup([[0], list(range(1, world_size))])
    assert (dist.get_rank(sub), dist.get_world_size(sub)) == (
        (0, 1) if rank == 0 else (rank - 1, world_size - 1))
    flag = tmp_path / "written_by_rank_1"
    if rank == 1:
        time.sleep(0.5)
        flag.write_text("done")
    dist.barrier(sub)
    if rank > 0:
        assert flag.read_text() == "done"
    dist.barrier()


@pytest.mark.ranks(2, timeout=60)
def test_two_ranks_see_the_mpi_world(rank, world_size, comm, tmp_path) -> None:
    _check_on_ranks(rank, world_size, comm, tmp_path)


@pytest.mark.ranks(3, timeout=60)
def test_three_ranks_see_the_mpi_world(rank, world_size, comm, tmp_path) -> None:
    _check_on_ranks(rank, world_size, comm, tmp_path)
