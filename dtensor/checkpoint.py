"""Sharded checkpoints: every rank writes only its own blocks; any layout loads them.

    dtensor.checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    dtensor.checkpoint.load(state, path)        # fills state's tensors in place, any mesh

Layout of ``path`` (a folder, which may hold the user's own files too):

    LATEST                  name of the newest complete checkpoint ("v3")
    v3/.dtensor-checkpoint  our marker, the first file a save writes (content: FORMAT)
    v3/metadata.json        format, version, and per tensor: global shape, dtype, placements,
                            mesh shape and each saved block (file, entry, offsets, shape, CRC-32)
    v3/rank0.npz ...        the blocks each rank owns (plain .npy arrays: never pickle)

A block is written once: by the ranks at coordinate 0 of every mesh dim its tensor is not
sharded over. A save writes ``v4.partial/``, then rank 0 writes metadata.json, renames the
folder to ``v4`` and only then points LATEST at it (an atomic replace), so a crash at any point
leaves the previous checkpoint loadable and a partial one is never read. A save that fails
(a full disk, a bad path) fails on every rank and removes its partial folder.

What a save removes: only in folders named exactly ``vN`` or ``vN.partial`` that hold our
marker (and never through a symlink), only the files a save writes there (by name), then the
folder if nothing else is left: a user's file or folder put inside a version keeps it. A save
refuses a folder whose LATEST it did not write (another tool's, or a symlink). Every other entry
of ``path`` is the user's.

What a load trusts: nothing on disk. LATEST must name a ``vN``; the version folder and every
file in it are opened without following symlinks and must be regular files (a FIFO would
block); shard names come from a validated rank; the metadata (at most 256 MiB) is validated
whole (no duplicate JSON keys, types, blocks tiling each tensor exactly once) before any block
is read; a block's .npy header and size are checked against the metadata before its data is
read. Loading never runs code from the checkpoint (no pickle). Non-tensor values (an
optimizer's step count, the data order's RNG state) go to metadata.json as JSON, and load into
a state value of their own kind only. A hard link in the folder is a file of the folder and is
read (refusing them would break ``cp -al`` snapshots): the folder's owner decides what it holds.

Both are collective when the state holds DTensors (save also whenever the job has several
ranks): every rank must pass the same keys, shapes, dtypes, placements and path, and an error
on one rank is raised on all of them, at once (every step of a rank's own work between two
collectives is shared). The metadata's schema and tiling checks live in
dtensor._checkpoint_meta.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import zipfile
import zlib
from pathlib import Path

import numpy as np

from dtensor._checkpoint_meta import FORMAT, SHARD, VERSION, CheckpointError, read_meta
from dtensor.distributed import _several_ranks  # one place decides whether a job has peers
from dtensor.tensor import TensorMethods

__all__ = ["save", "load", "CheckpointError", "FORMAT", "VERSION"]

_MARKER = ".dtensor-checkpoint"
_VERSION = re.compile(r"v[1-9][0-9]*")
_FOLDER = re.compile(r"v([1-9][0-9]{0,17})(\.partial)?")
# The files a save writes in a version folder besides rank<r>.npz: all a removal may delete.
_OURS = frozenset({_MARKER, "metadata.json", "LATEST.new"})
# An .npy header is padded to 64 bytes and holds one dict of dtype, order and shape.
_NPY_HEADER_MAX = 4096


# ----------------------------------------------------------------------------- helpers

def _flatten(tree) -> tuple[dict, CheckpointError | None]:
    """({dotted key: (parent container, key, value)} for every leaf of nested dicts/lists, the
    error of two leaves whose keys flatten alike ({"a.b": x} and {"a": {"b": y}}) or None).
    The error is returned, not raised, for a collective caller to share with its peers."""
    if not isinstance(tree, (dict, list)):
        raise TypeError(f"checkpoint state must be nested dicts/lists, got {type(tree).__name__}")
    out: dict = {}
    spelled: dict[str, str] = {}
    clash = None

    def walk(node, prefix, path):
        nonlocal clash
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            key, where = f"{prefix}{k}", f"{path}[{k!r}]"
            if isinstance(v, (dict, list)) and not _is_tensor(v):
                walk(v, key + ".", where)
            elif key in out:
                clash = clash or CheckpointError(
                    f"checkpoint: state{spelled[key]} and state{where} are both saved as "
                    f"{key!r}; one would be lost. Rename one of them.")
            else:
                out[key], spelled[key] = (node, k, v), where
    walk(tree, "", "")
    return out, clash


def _is_tensor(v) -> bool:
    return isinstance(v, TensorMethods)


def _is_dtensor(v) -> bool:
    return isinstance(v, TensorMethods) and v.is_distributed


def _has_dtensors(flat) -> bool:
    return any(_is_dtensor(v) for _, _, v in flat.values())


def _world(flat):
    """(rank, size, comm): the job's world if there is one, else a world of one without MPI."""
    if _has_dtensors(flat) or _several_ranks():
        from dtensor.comm import get_world
        w = get_world()
        return w.rank, w.size, w
    return 0, 1, None


def _agree(comm, what: str, fix: str, error, **fields) -> None:
    """``comm.check_same``: every rank passed the same ``fields`` and none has an ``error``, or
    all raise; in a world of one without MPI, just ``error`` if any."""
    if comm is not None:
        comm.check_same(what, fix, error=error, **fields)
    elif error is not None:
        raise error


def _together(comm, what: str):
    """``comm.fail_together(what)``, or a plain block in a world of one without MPI."""
    return comm.fail_together(what) if comm is not None else contextlib.nullcontext()


def _describe(flat) -> tuple[dict, list]:
    """What every rank must pass alike: each tensor's shape, dtype, placements and mesh shape,
    and the keys of the other values."""
    tensors, values = {}, []
    for key, (_, _, v) in flat.items():
        if not _is_tensor(v):
            values.append(key)
            continue
        tensors[key] = {
            "shape": [int(n) for n in v.shape], "dtype": np.dtype(v.dtype).str,
            "placements": [repr(p) for p in v.placements] if _is_dtensor(v) else [],
            "mesh_shape": list(v.device_mesh.shape) if _is_dtensor(v) else []}
    return tensors, values


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _naming(path: Path):
    """OSErrors raised while writing ``path`` name it (write()'s ENOSPC carries no file name)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror or str(e), str(path)) from e


def _jsonable(value, key):
    try:
        json.dumps(value)
    except TypeError:
        raise TypeError(f"checkpoint: {key!r} is a {type(value).__name__}, neither a tensor nor "
                        f"a JSON value (number, string, bool, None, list, dict).") from None
    return value


def _open_regular(name, what: str, dir_fd: int | None = None):
    """A binary file object for ``name`` (relative to ``dir_fd`` if given) that is a regular
    file: a symlink (which could lead outside the checkpoint) or a FIFO (which would block) is a
    CheckpointError naming ``what``. FileNotFoundError is left to the caller."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise CheckpointError(f"{what} {why}; a checkpoint's files are regular files inside "
                              f"its folder.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{what} is not a regular file (a FIFO, device or folder); a "
                              f"checkpoint's files are regular files inside its folder.")
    return os.fdopen(fd, "rb")


def _is_ours(folder: str) -> bool:
    """Whether ``folder`` holds our marker: the proof that a save made it."""
    try:
        with _open_regular(os.path.join(folder, _MARKER), _MARKER) as f:
            return f.read(len(FORMAT) + 1) == FORMAT.encode()
    except (OSError, CheckpointError):
        return False


def _remove_ours(folder) -> None:
    """Remove what a save wrote in version folder ``folder``: its files by their names (never a
    folder, never through a symlink), then the folder if nothing else is left. Anything else,
    a user's notes or a checkpoint of their own, keeps the folder and our marker with it."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        for e in os.scandir(fd):
            if (e.name != _MARKER and (e.name in _OURS or SHARD.fullmatch(e.name))
                    and not e.is_dir(follow_symlinks=False)):
                with contextlib.suppress(OSError):
                    os.unlink(e.name, dir_fd=fd)
        # The marker goes last: a removal cut short leaves a folder a later save still knows.
        if os.listdir(fd) == [_MARKER]:
            os.unlink(_MARKER, dir_fd=fd)
            os.rmdir(folder)
    except OSError:
        pass  # what could not be removed stays; it is never read (LATEST does not name it)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- save

def _unpartial(flat, tensors) -> dict:
    """{key: tensor to write}: a DTensor with Partial placements is reduced first (a collective:
    every rank has the same placements, checked)."""
    from dtensor.placements import Partial, Replicate
    out = {}
    for key in tensors:
        t = flat[key][2]
        if _is_dtensor(t) and any(isinstance(p, Partial) for p in t.placements):
            t = t.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                           for p in t.placements])
        out[key] = t
    return out


def _my_blocks(t, rank):
    """([(array, offsets)], writer?) of this rank's block of tensor ``t`` (not Partial): a
    plain tensor is written by rank 0, a DTensor's block by the ranks at coordinate 0 of every
    mesh dim it is not sharded over, counting the dims of the whole mesh its mesh was sliced
    from (a tensor-parallel parameter on mesh["tp"] has a copy on every "dp" row). A strided
    shard's block is written as one rectangle per part."""
    if not _is_dtensor(t):
        return [(np.asarray(t.numpy()), (0,) * t.ndim)], rank == 0
    from dtensor.placements import Replicate
    coord = t.device_mesh.get_coordinate()
    root, dims = t.device_mesh._root
    outside = root.get_coordinate()
    writer = (all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate))
              and all(outside[d] == 0 for d in range(root.ndim) if d not in dims))
    local = t._loc()
    return [(local[sl], off) for sl, off, _ in t._spec.local_pieces()], writer


def save(state_dict, path) -> str:
    """Write ``state_dict`` (nested dicts of tensors, DTensors and JSON values) under ``path``.

    Collective when the state holds DTensors or the job has several ranks (a launcher's
    WORLD_SIZE, PMI_SIZE or OMPI_COMM_WORLD_SIZE, or MPI already started): every rank calls it
    with the same state layout and path, and a plain tensor is written from rank 0. Returns the
    version folder written ("v3"). Raises on every rank if it fails on any (NotADirectoryError
    for a ``path`` that is a file, the OSError of a full disk naming the file, CheckpointError
    for a LATEST that is not ours or two keys that flatten alike); the previous checkpoint
    stays loadable.
    """
    flat, error = _flatten(state_dict)
    rank, size, comm = _world(flat)
    root = Path(path)
    tensors, value_keys = _describe(flat)
    values = {}
    try:
        values = {k: _jsonable(flat[k][2], k) for k in value_keys}
    except TypeError as e:
        error = error or e
    _agree(comm, "checkpoint.save", "Call save on every rank with the same state and path.",
           error, path=str(root.absolute()), tensors=tensors, values=value_keys)
    made: list[Path] = []  # rank 0: the folder this call created, removed if the save fails
    try:
        with _together(comm, "checkpoint.save"):
            if root.exists() and not root.is_dir():
                raise NotADirectoryError(f"checkpoint.save: {root} exists and is not a folder; "
                                         f"pass the path of a folder (created if missing).")
            version = _new_version(root, made) if rank == 0 else None
        if comm is not None:
            version = comm._c.bcast(version, root=0)  # metadata only
        to_write = _unpartial(flat, tensors)
        # Between collectives every step of a rank's own work is shared: a rank that fails
        # must not leave the others waiting in the next collective.
        with _together(comm, "checkpoint.save"):
            blocks = _write_blocks(to_write, root / f"{version}.partial", rank)
        all_blocks = comm._c.gather(blocks, root=0) if comm is not None else [blocks]
        with _together(comm, "checkpoint.save"):
            if rank == 0:
                _commit(root, version, tensors, values, size, all_blocks, made)
    except BaseException:
        for folder in made:
            _remove_ours(folder)
        raise
    return version


def _new_version(root: Path, made: list[Path]) -> str:
    """Rank 0: a fresh ``vN.partial`` folder under ``root``, our marker its first file."""
    with _naming(root):
        root.mkdir(parents=True, exist_ok=True)
    try:
        _latest(root)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint.save: {e} A save never replaces a LATEST it did not "
                              f"write: save to another folder.") from None
    # One past every name a version could take, ours or not: a save that died after its rename
    # but before LATEST left a complete vN that LATEST does not name, and a user's own "v7" is
    # neither reused nor overwritten.
    taken = [int(m.group(1)) for m in map(_FOLDER.fullmatch, os.listdir(root)) if m]
    version = f"v{max(taken, default=0) + 1}"
    tmp = root / f"{version}.partial"
    with _naming(tmp):
        tmp.mkdir()
        made.append(tmp)
        _fsync_write(tmp / _MARKER, FORMAT)
    return version


def _write_blocks(to_write: dict, tmp: Path, rank: int) -> list[dict]:
    """Write this rank's blocks to ``tmp/rank{rank}.npz``; their metadata. No collectives."""
    arrays, blocks = {}, []
    for key, t in to_write.items():
        pieces, writer = _my_blocks(t, rank)
        for local, off in pieces if writer else ():
            if not local.size:
                continue
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(local)
            blocks.append({"key": key, "file": f"rank{rank}.npz", "entry": name,
                           "offsets": [int(o) for o in off],
                           "shape": [int(n) for n in local.shape], "crc32": _crc(local)})
    path = tmp / f"rank{rank}.npz"
    with _naming(path):
        if arrays:
            with open(path, "xb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
    return blocks


def _commit(root: Path, version: str, tensors, values, size, all_blocks, made) -> None:
    """Rank 0: metadata.json, the rename, LATEST (the commit point), then old versions go."""
    by_key: dict[str, list] = {}
    for b in (b for rb in all_blocks for b in rb):
        by_key.setdefault(b["key"], []).append({k: v for k, v in b.items() if k != "key"})
    meta = {"format": FORMAT, "version": VERSION, "world_size": size,
            "tensors": {k: {**t, "blocks": by_key.get(k, [])} for k, t in tensors.items()},
            "values": values}
    tmp, final = made[0], root / version
    with _naming(tmp / "metadata.json"):
        _fsync_write(tmp / "metadata.json", json.dumps(meta))
    with _naming(final):
        os.rename(tmp, final)
    made[0] = final
    # LATEST's new text is written inside our own folder, so no user file is ever clobbered.
    with _naming(root / "LATEST"):
        _fsync_write(final / "LATEST.new", version)
        os.replace(final / "LATEST.new", root / "LATEST")  # the commit point
    made.clear()
    for entry in os.scandir(root):
        if (_FOLDER.fullmatch(entry.name) and entry.name != version
                and entry.is_dir(follow_symlinks=False) and _is_ours(entry.path)):
            _remove_ours(entry.path)


# ----------------------------------------------------------------------------- load

class _Checkpoint:
    """The newest complete checkpoint under ``root``, open for reading: LATEST read and checked,
    the version folder opened (not through a symlink), the metadata validated whole. Every file
    is opened relative to the folder's descriptor, by a name we validated."""

    def __init__(self, root: Path):
        self.zips: dict[str, zipfile.ZipFile] = {}
        self.folder = root / _read_latest(root)
        try:
            self.fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CheckpointError(f"{self.folder} is missing: LATEST names it but the folder "
                                  f"is gone.") from None
        except OSError as e:
            raise CheckpointError(f"{self.folder} (named by LATEST) is not a folder of this "
                                  f"checkpoint but a symlink or a file ({e.strerror}).") from None
        try:
            self.meta = self._json()
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for z in self.zips.values():
            z.fp.close()
        os.close(self.fd)

    def _json(self):
        path = self.folder / "metadata.json"
        try:
            f = _open_regular("metadata.json", str(path), self.fd)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: LATEST names {self.folder.name!r} but "
                                  f"that checkpoint is incomplete.") from None
        with f:
            return read_meta(f, path)

    def block(self, key: str, i: int, b: dict, dtype: np.dtype) -> np.ndarray:
        """Block ``i`` of ``key``, its .npy header and size checked before its data is read."""
        path = self.folder / b["file"]
        where = f"{path} (block {i} of {key!r})"
        member = b["entry"] + ".npy"
        nbytes = math.prod(b["shape"]) * dtype.itemsize
        try:
            zf = self.zips.get(b["file"])
            if zf is None:
                f = _open_regular(b["file"], f"{path}, the 'file' of block {i} of {key!r},",
                                  self.fd)
                try:
                    zf = self.zips[b["file"]] = zipfile.ZipFile(f)
                except BaseException:
                    f.close()
                    raise
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise CheckpointError(f"{where}: the file has no member {member!r} (the "
                                      f"'entry' of the block).") from None
            if info.file_size > nbytes + _NPY_HEADER_MAX:
                raise CheckpointError(f"{where}: member {member!r} inflates to "
                                      f"{info.file_size} bytes, but the block of shape "
                                      f"{b['shape']} {dtype} takes {nbytes} plus a header; it "
                                      f"is not the block the metadata describes.")
            with zf.open(info) as m:
                a = _read_npy(m, info.file_size, b["shape"], dtype, nbytes, where)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (block {i} of {key!r}).") from None
        except CheckpointError:
            raise
        # (RuntimeError: an encrypted member; NotImplementedError: an unknown compression)
        except (zipfile.BadZipFile, zlib.error, ValueError, EOFError, OSError, RuntimeError) as e:
            what = ("checksum mismatch (the zip member's CRC-32)" if "CRC" in str(e)
                    else "the file is truncated or corrupt")
            raise CheckpointError(f"{path} cannot be read for {key!r}: {what} "
                                  f"({type(e).__name__}: {e}).") from None
        crc = _crc(a)
        if crc != b["crc32"]:
            raise CheckpointError(f"checksum mismatch in {path} for {key!r}: stored "
                                  f"{b['crc32']:#010x}, computed {crc:#010x}; the file is "
                                  f"corrupt.")
        return a


def _read_npy(m, size: int, shape: list, dtype: np.dtype, nbytes: int, where: str):
    """The array of an open .npy member, read only once its header matches the metadata and
    exactly ``nbytes`` of data follow (never more is read)."""
    version = np.lib.format.read_magic(m)
    if version not in ((1, 0), (2, 0)):
        raise CheckpointError(f"{where}: .npy format version {version} is not one save writes.")
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    got_shape, fortran, got_dtype = read(m, max_header_size=_NPY_HEADER_MAX)
    if list(got_shape) != list(shape) or got_dtype != dtype:
        raise CheckpointError(f"{where}: the .npy header says shape {list(got_shape)} "
                              f"{got_dtype}, the metadata {list(shape)} {dtype}.")
    if size - m.tell() != nbytes:
        raise CheckpointError(f"{where}: the member holds {size - m.tell()} bytes of data, the "
                              f"block needs {nbytes}; the file is truncated or corrupt.")
    data = m.read(nbytes)
    if len(data) != nbytes:
        raise CheckpointError(f"{where}: the member ends after {len(data)} of {nbytes} bytes; "
                              f"the file is truncated or corrupt.")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")


def _latest(root: Path) -> str | None:
    """The version LATEST names, or None if there is no LATEST; a LATEST that is not a regular
    file holding a version's name (another tool's, or a symlink) is a CheckpointError."""
    path = root / "LATEST"
    try:
        with _open_regular(path, str(path)) as f:
            raw = f.read(257)
    except FileNotFoundError:
        return None
    text = raw.decode("ascii", errors="replace").strip()
    if len(raw) > 256 or not _VERSION.fullmatch(text):
        raise CheckpointError(f"{path} holds {raw!r}, not the name of a version folder "
                              f"like 'v3'; the file is corrupt or not a checkpoint's.")
    return text


def _read_latest(root: Path) -> str:
    name = _latest(root)
    if name is None:
        raise CheckpointError(f"no complete checkpoint at {root}: {root / 'LATEST'} is missing "
                              f"(a save that did not finish leaves only *.partial folders).")
    return name


def _target_pieces(t):
    """(local shape, [(local slices, global offsets, shape)]) of the block ``t`` holds here."""
    from dtensor.dtensor import held_pieces
    return held_pieces(t)


def load(state_dict, path, *, strict: bool = True) -> None:
    """Fill ``state_dict``'s tensors (in place, whatever their mesh and placements) and values
    from the newest complete checkpoint under ``path``.

    Collective when the state holds DTensors: every rank passes the same state layout and path,
    and if reading fails on any rank it raises on all. (A job where some ranks pass DTensors and
    others plain tensors is caught only by DTENSOR_COLLECTIVE_TIMEOUT on the DTensor ranks: the
    plain ones load alone.) Nothing in the state changes unless the whole load succeeds.

    Raises CheckpointError for a missing, incomplete, corrupt (checksum), truncated, malformed
    or wrong-version checkpoint, for a path in it that leads anywhere but its own regular files,
    for keys or shapes that do not match (``strict=False`` skips keys missing on either side),
    and for a saved value of another kind than the state's (a JSON value for a tensor, a string
    or a dict for a number; None in the state takes any value).
    """
    root = Path(path)
    flat, error = _flatten(state_dict)
    # Ranks holding DTensors read different blocks; one whose read fails must not leave the
    # others running on. A state of plain tensors is read whole by each caller on its own.
    comm = _world(flat)[2] if _has_dtensors(flat) else None
    tensors, value_keys = _describe(flat)
    _agree(comm, "checkpoint.load", "Call load on every rank with the same state and path.",
           error, path=str(root.absolute()), strict=strict, tensors=tensors, values=value_keys)
    with _together(comm, "checkpoint.load"):
        with _Checkpoint(root) as ck:
            values, arrays = _read(flat, ck, strict)
    for key, value in values.items():
        parent, k, _ = flat[key]
        parent[k] = value
    for key, a in arrays.items():
        v = flat[key][2]
        if _is_dtensor(v):
            v._set_local(a)
        else:
            v.data = a


def _kind(v) -> str | None:
    """The kind a state value keeps across a load: bool, number or string (None: any)."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return "string" if isinstance(v, str) else None


def _value(key: str, now, saved):
    """``saved``, the checkpoint's JSON value for ``key``, if it may replace ``now``: a tensor is
    never replaced by a JSON value, nor a bool, number or string by another kind (an int step by
    a dict, or by NaN); an int and a float are both numbers (a learning rate given as 1)."""
    kind = _kind(now)
    if _is_tensor(now):
        why = "a tensor in the state"
    elif kind is not None and (_kind(saved) != kind or isinstance(now, int) and not isinstance(
            now, bool) and isinstance(saved, float) and not math.isfinite(saved)):
        why = f"{type(now).__name__} {now!r} in the state"
    else:
        return saved
    text = repr(saved)
    text = text if len(text) <= 60 else text[:57] + "..."
    raise CheckpointError(f"{key!r} is {why} but {type(saved).__name__} {text} in the "
                          f"checkpoint. A saved value loads only into a state value of its own "
                          f"kind: load into a state built like the one saved.")


def _read(flat, ck: _Checkpoint, strict: bool) -> tuple[dict, dict]:
    """({key: value}, {key: this rank's block}) for every key of the state the checkpoint has."""
    meta, folder = ck.meta, ck.folder
    saved = set(meta["tensors"]) | set(meta["values"])
    missing = sorted(k for k in flat if k not in saved)
    unexpected = sorted(k for k in saved if k not in flat)
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {folder} does not match the state: missing keys "
                              f"{missing[:10]}, unexpected keys {unexpected[:10]}. Build the "
                              f"same model and optimizer, or pass strict=False.")
    values, arrays = {}, {}
    for key, (_, _, v) in flat.items():
        if key in meta["values"]:
            values[key] = _value(key, v, meta["values"][key])
            continue
        info = meta["tensors"].get(key)
        if info is None:
            continue
        if not _is_tensor(v):
            raise CheckpointError(f"{key!r} is a tensor in the checkpoint but "
                                  f"{type(v).__name__} in the state.")
        dtype = np.dtype(info["dtype"])
        if list(v.shape) != info["shape"] or np.dtype(v.dtype) != dtype:
            raise CheckpointError(f"{key!r}: checkpoint has shape {tuple(info['shape'])} "
                                  f"{dtype}, the state {tuple(v.shape)} {np.dtype(v.dtype)}.")
        local_shape, pieces = _target_pieces(v)
        # The blocks tile the global shape exactly (checked), so they fill all of ``out``.
        out = np.empty(local_shape, dtype)
        for where, off, shape in pieces:
            for i, b in enumerate(info["blocks"]):
                lo = [max(o, bo) for o, bo in zip(off, b["offsets"])]
                hi = [min(o + n, bo + bn) for o, n, bo, bn in zip(off, shape, b["offsets"],
                                                                   b["shape"])]
                if any(h <= lo_ for lo_, h in zip(lo, hi)):
                    continue
                block = ck.block(key, i, b, dtype)
                dst = tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, off))
                src = tuple(slice(a - bo, c - bo) for a, c, bo in zip(lo, hi, b["offsets"]))
                out[where][dst] = block[src]
        arrays[key] = out
    return values, arrays
