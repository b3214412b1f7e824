"""Where this process sits in the job, under torch.distributed's names.

    import dtensor.distributed as dist

    if dist.get_rank() == 0:
        print(f"training on {dist.get_world_size()} ranks")
    dist.barrier()

Scripts ask here instead of reading RANK / WORLD_SIZE. In a plain ``python script.py`` the
answers are rank 0 of a world of 1 and ``barrier()`` returns at once, without starting MPI; under
dtlaunch or mpiexec they come from the MPI world (``dtensor.comm.get_world()``). A ``group`` is a
:class:`~dtensor.comm.Comm`, e.g. ``mesh.get_group("tp")``, as a ProcessGroup is in PyTorch.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtensor.comm import Comm

__all__ = ["barrier", "get_local_rank", "get_rank", "get_world_size", "is_initialized"]

# How launchers tell a process it is one rank of several: dtensor's launcher and torchrun
# (WORLD_SIZE), MPICH's hydra and Intel MPI (PMI_SIZE), Open MPI (OMPI_COMM_WORLD_SIZE).
_LAUNCHER_SIZES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
# This rank's index among the ranks of its host: dtlaunch's and torchrun's, hydra's, Open MPI's.
_LOCAL_RANKS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")


def is_initialized() -> bool:
    """Whether MPI runs in this process: always under dtlaunch (every rank starts it), and in a
    plain process only once something used ``dtensor.comm``.

    Example:
        >>> dtensor.distributed.is_initialized()  # python script.py: MPI never started
        False
    """
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def _several_ranks() -> bool:
    """Whether this process is one rank of a job of several, found without starting MPI: a
    launcher said so, or MPI already runs here with a world of several."""
    for name in _LAUNCHER_SIZES:
        with contextlib.suppress(ValueError):
            if int(os.environ.get(name, "1")) > 1:
                return True
    return is_initialized() and sys.modules["mpi4py.MPI"].COMM_WORLD.Get_size() > 1


def _group(group: Comm | None, what: str) -> Comm | None:
    """``group``, else the MPI world in a job of several ranks, else None (a world of one)."""
    from dtensor.comm import Comm, get_world

    if group is not None:
        if not isinstance(group, Comm):
            raise TypeError(f"{what}(group=...) takes a dtensor.comm.Comm such as "
                            f"mesh.get_group('tp'), or None for every rank; got "
                            f"{type(group).__name__} {group!r}")
        return group
    if not _several_ranks():
        return None
    world = get_world()
    claimed = os.environ.get("WORLD_SIZE", str(world.size))
    if claimed != str(world.size):
        raise RuntimeError(f"WORLD_SIZE={claimed} says this process is one of {claimed} ranks, "
                           f"but MPI sees a world of {world.size}: it was not started by an MPI "
                           f"launcher (torchrun starts none); run it with dtlaunch --nproc "
                           f"{claimed} script.py")
    return world


def get_rank(group: Comm | None = None) -> int:
    """This process's rank in ``group`` (default: every rank of the job), 0 in a plain process.

    Example:
        >>> dtensor.distributed.get_rank()  # under dtlaunch --nproc 4: 0, 1, 2 or 3
        0
    """
    comm = _group(group, "get_rank")
    return 0 if comm is None else comm.rank


def get_world_size(group: Comm | None = None) -> int:
    """The number of ranks in ``group`` (default: the whole job), 1 in a plain process.

    Example:
        >>> dtensor.distributed.get_world_size()  # under dtlaunch --nproc 4: 4
        1
    """
    comm = _group(group, "get_world_size")
    return 1 if comm is None else comm.size


def barrier(group: Comm | None = None) -> None:
    """Wait until every rank of ``group`` (default: the whole job) has called ``barrier``;
    returns at once in a plain process.

    Example:
        >>> if dtensor.distributed.get_rank() == 0:
        ...     prepare_data()  # doctest: +SKIP
        >>> dtensor.distributed.barrier()  # the others wait until rank 0 is done
    """
    comm = _group(group, "barrier")
    if comm is not None:
        comm.barrier()


def get_local_rank() -> int:
    """This rank's index among the ranks of its host (LOCAL_RANK), 0 in a plain process.

    Example:
        >>> dtensor.distributed.get_local_rank()  # dtlaunch --nproc 2 on one host: 0 or 1
        0
    """
    for name in _LOCAL_RANKS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    if _group(None, "get_local_rank") is None:
        return 0
    raise RuntimeError(f"this rank's launcher set none of {', '.join(_LOCAL_RANKS)}; "
                       "launch with dtlaunch, which sets LOCAL_RANK")
