"""DeviceMesh: an n-d array of ranks with named dims, PyTorch's names and semantics.

Ranks are laid out row-major: ``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))``
puts ranks 0-3 in row dp=0 and 4-7 in row dp=1, so a "tp" group is four consecutive ranks.
Each mesh dim gets one communicator, made once (MPI ``Split``) when the mesh is built; slicing a
mesh by name reuses them.
"""
from __future__ import annotations

import socket
import warnings
from typing import Sequence

import numpy as np

from dtensor.comm import Comm, get_world
from dtensor.validate import as_int, as_shape

__all__ = ["DeviceMesh", "init_device_mesh"]

_NAMES_EXAMPLE = "mesh_dim_names=('dp', 'tp')"


def _check_device(device_type: str) -> None:
    if not isinstance(device_type, str) or device_type != "cpu":
        raise ValueError(f"device_type {device_type!r} is not supported yet: dtensor runs on "
                         f"'cpu' ranks over MPI. Use init_device_mesh('cpu', ...).")


def _check_names(names, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"mesh_dim_names must be a tuple with one name per mesh dim, got the "
                        f"string {names!r}; write mesh_dim_names=({names!r},) for a 1-d mesh "
                        f"or {_NAMES_EXAMPLE}.")
    if not isinstance(names, (tuple, list)):
        raise TypeError(f"mesh_dim_names must be a tuple of strings, one per mesh dim, got "
                        f"{names!r}; e.g. {_NAMES_EXAMPLE}.")
    names = tuple(names)
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise TypeError(f"mesh_dim_names {names!r} must all be strings, got {odd[0]!r} (type "
                        f"{type(odd[0]).__name__}); e.g. {_NAMES_EXAMPLE}.")
    if "" in names:
        raise ValueError(f"mesh_dim_names {names!r} holds an empty name; give every dim a "
                         f"non-empty name, e.g. {_NAMES_EXAMPLE}.")
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {ndim}-d mesh; "
                         f"give one name per mesh dim.")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"mesh_dim_names {names} repeats {dup}; each dim needs its own name.")
    return names


def _check_mesh(device_type, mesh, names, world_size: int) -> np.ndarray:
    """The user's mesh as an int64 array of ranks, each rank of the job exactly once."""
    _check_device(device_type)
    try:
        arr = np.asarray(getattr(mesh, "tolist", lambda: mesh)())
    except ValueError:  # ragged nesting
        raise ValueError(f"DeviceMesh: the mesh {mesh!r} is ragged; give a rectangular array "
                         f"of ranks, e.g. [[0, 1], [2, 3]].") from None
    if arr.ndim == 0 or arr.size == 0:
        raise ValueError(f"a DeviceMesh needs at least one dim and one rank, got {mesh!r}.")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"DeviceMesh: the mesh must hold integer ranks, got {mesh!r} (numpy "
                        f"dtype {arr.dtype}); e.g. [[0, 1], [2, 3]].")
    arr = arr.astype(np.int64)
    _check_names(names, arr.ndim)
    if sorted(arr.reshape(-1).tolist()) != list(range(world_size)):
        raise ValueError(
            f"DeviceMesh {arr.tolist()} must hold each of the {world_size} ranks of this "
            f"job exactly once (ranks 0..{world_size - 1}); launch with dtlaunch "
            f"--nproc {arr.size} or use a mesh of {world_size} ranks.")
    return arr


class DeviceMesh:
    """An n-d array of global ranks; ``mesh_dim_names`` name its dims.

    Args:
        device_type: "cpu" (the MPI backend).
        mesh: array-like of global ranks; it must hold every rank of the job exactly once.
        mesh_dim_names: optional names, one per dim.

    Example (8 ranks):
        >>> mesh = DeviceMesh("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].get_local_rank(), mesh.size("dp")
    """

    def __init__(self, device_type: str, mesh, *, mesh_dim_names: Sequence[str] | None = None,
                 _comms: tuple[Comm, ...] | None = None):
        world = get_world()
        if _comms is None:
            # Every rank must build the same mesh before the Split below, or ranks hang in it:
            # one agreement on the arguments, and a local error raised on every rank.
            error = None
            try:
                arr = _check_mesh(device_type, mesh, mesh_dim_names, world.size)
            except (TypeError, ValueError) as e:
                error = e
            world.check_same("DeviceMesh", "Build the mesh with the same arguments on every "
                             "rank.", error=error, device_type=device_type,
                             mesh=getattr(mesh, "tolist", lambda: mesh)(),
                             mesh_dim_names=mesh_dim_names)
        else:  # a sub-mesh of a checked one
            arr = np.asarray(mesh)
        self.device_type = device_type
        self.mesh = arr
        self.mesh_dim_names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        self._rank = world.rank
        if _comms is None:
            _comms = tuple(world.subgroup(self._partition(d)) for d in range(arr.ndim))
        self._comms = _comms
        # Specs hash and compare meshes on every DTensor op: compute the identity once.
        self._ident = (device_type, arr.shape, tuple(arr.reshape(-1).tolist()),
                       self.mesh_dim_names)
        self._hash = hash(self._ident)
        where = np.argwhere(arr == self._rank)
        self._coord = [int(c) for c in where[0]] if len(where) else None
        # The mesh this one was sliced from and the dims it keeps (itself and all of its dims
        # for a mesh built whole): FSDP over mesh["dp"] finds a parameter on mesh["tp"] a
        # sibling, and stores it on the parent over both dims.
        self._root: tuple[DeviceMesh, tuple[int, ...]] = (self, tuple(range(arr.ndim)))

    def check_same(self, what: str, fix: str = "", *, error: BaseException | None = None,
                   **fields) -> None:
        """Collective over this mesh's ranks: :meth:`Comm.check_same` (the same error on every
        rank unless all passed equal ``fields`` and none raised ``error``). A sub-mesh has no
        communicator of its own: agreement along each of its dims is agreement over it."""
        world = get_world()
        if self.mesh.size == world.size:
            world.check_same(what, fix, error=error, **fields)
            return
        for comm in self._comms:
            comm.check_same(what, fix, error=error, **fields)

    def _partition(self, dim: int) -> list[list[int]]:
        """The groups of mesh dim ``dim``: ranks that agree on every other coordinate."""
        moved = np.moveaxis(self.mesh, dim, -1)
        return moved.reshape(-1, moved.shape[-1]).tolist()

    # -- structure
    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def _dim(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"this mesh has {self.ndim} dims {self._dims_text()}; say which "
                                 f"one (mesh_dim=0..{self.ndim - 1} or a name).")
            return 0
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dim named {mesh_dim!r}; its dims are "
                               f"{self._dims_text()}.")
            return self.mesh_dim_names.index(mesh_dim)
        mesh_dim = as_int(mesh_dim, "mesh dim", fix=f"Give a dim index or name of the mesh "
                          f"{self._dims_text()}.")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-d mesh "
                             f"{self._dims_text()}.")
        return int(mesh_dim) % self.ndim

    def _dims_text(self) -> str:
        names = self.mesh_dim_names or tuple(str(i) for i in range(self.ndim))
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, self.shape)) + ")"

    def hosts(self) -> np.ndarray:
        """The host of each rank of the mesh, laid out as ``self.mesh`` (host names)."""
        names = rank_hosts()
        return np.array([names[r] for r in self.mesh.reshape(-1)]).reshape(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        return self.mesh.size if mesh_dim is None else self.mesh.shape[self._dim(mesh_dim)]

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every mesh dim (None if it is not in the mesh)."""
        return None if self._coord is None else list(self._coord)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        return self._coord[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> Comm:
        """The communicator of this rank's group along ``mesh_dim``."""
        return self._comms[self._dim(mesh_dim)]

    def __getitem__(self, names: str | Sequence[str]) -> "DeviceMesh":
        """The sub-mesh over the named dims (in the given order) that contains this rank."""
        if isinstance(names, str):
            names = (names,)
        elif not (isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)):
            raise TypeError(f"a mesh is sliced by dim names, e.g. mesh['tp'] or mesh[('dp', "
                            f"'tp')], got {names!r}; its dims are {self._dims_text()}.")
        else:
            names = tuple(names)
        dims = [self._dim(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"mesh dims {names} name the same dim twice.")
        return self._sub(dims)

    def _sub(self, dims: Sequence[int]) -> "DeviceMesh":
        """The sub-mesh over mesh dims ``dims`` (in that order) that contains this rank."""
        # Fix every other dim at this rank's coordinate, keep the named ones in order.
        index = tuple(slice(None) if d in dims else self._coord[d] for d in range(self.ndim))
        kept = [d for d in range(self.ndim) if d in dims]
        sub = np.transpose(self.mesh[index], [kept.index(d) for d in dims])
        names = tuple(self.mesh_dim_names[d] for d in dims) if self.mesh_dim_names else None
        out = DeviceMesh(self.device_type, sub, mesh_dim_names=names,
                         _comms=tuple(self._comms[d] for d in dims))
        root, kept_dims = self._root
        out._root = (root, tuple(kept_dims[d] for d in dims))
        return out

    # -- value semantics (specs compare meshes)
    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._ident == other._ident)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh of the job's ranks in row-major order, as torch's ``init_device_mesh``.

    Example (under ``dtlaunch --nproc 8``):
        >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    """
    world = get_world()
    error, shape = None, ()
    try:
        _check_device(device_type)
        shape = as_shape(mesh_shape, "mesh_shape", positive=True,
                         fix="e.g. (2, 4) for 2 x 4 ranks.")
        if not shape:
            raise ValueError("mesh_shape () has no dims; e.g. (2, 4) for 2 x 4 ranks.")
        _check_names(mesh_dim_names, len(shape))
        if int(np.prod(shape)) != world.size:
            raise ValueError(f"mesh_shape {shape} holds {int(np.prod(shape))} ranks but this job "
                             f"has {world.size}; launch with dtlaunch --nproc "
                             f"{int(np.prod(shape))}, or pick a shape whose product is "
                             f"{world.size}.")
    except (TypeError, ValueError) as e:
        error = e
    world.check_same("init_device_mesh", "Build the mesh with the same arguments on every rank.",
                     error=error, device_type=device_type, mesh_shape=mesh_shape,
                     mesh_dim_names=mesh_dim_names)
    # Host-major: each host's ranks together, so the last (innermost) dim's groups, tensor
    # parallelism's, stay inside one host when its size allows; on one host: 0, 1, 2, ...
    hosts = rank_hosts()
    first = {h: i for i, h in reversed(list(enumerate(hosts)))}
    order = sorted(range(world.size), key=lambda r: (first[hosts[r]], r))
    mesh = np.array(order).reshape(shape)
    _warn_if_split(mesh, hosts, mesh_dim_names)
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)


_HOSTS: list | None = None


def rank_hosts() -> list[str]:
    """Every rank's host name, by global rank (one allgather, on first use)."""
    global _HOSTS
    if _HOSTS is None:
        world = get_world()
        name = socket.gethostname()
        _HOSTS = [name] if world.size == 1 else list(world._c.allgather(name))
    return _HOSTS


def _warn_if_split(mesh: np.ndarray, hosts: list[str], names) -> None:
    """Warn when a group of the innermost dim spans hosts, naming a size that would not."""
    if mesh.ndim < 2 or len(set(hosts)) < 2:
        return
    groups = mesh.reshape(-1, mesh.shape[-1])
    split = [g.tolist() for g in groups if len({hosts[r] for r in g}) > 1]
    if not split:
        return
    per_host = min(hosts.count(h) for h in set(hosts))
    fits = [k for k in range(per_host, 0, -1) if per_host % k == 0 and mesh.size % k == 0]
    dim = repr(names[-1]) if names else f"dim {mesh.ndim - 1}"
    warnings.warn(
        f"init_device_mesh: the groups of mesh {dim} (size {mesh.shape[-1]}) span hosts, e.g. "
        f"ranks {split[0]} on {sorted({hosts[r] for r in split[0]})}: its collectives (tensor "
        f"parallelism's, if that dim is 'tp') cross the network on every layer. With "
        f"{per_host} ranks on the smallest host, a last dim of size {fits[0]} keeps each group "
        f"inside one host, e.g. mesh_shape {(mesh.size // fits[0], fits[0])}.", stacklevel=3)
