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

What a save removes: only folders named exactly ``vN`` or ``vN.partial`` that hold our marker
(and never through a symlink); every other entry of ``path`` is the user's.

What a load trusts: nothing on disk. LATEST must name a ``vN``; the version folder and every
file in it are opened without following symlinks and must be regular files (a FIFO would
block); shard names come from a validated rank; the metadata is validated whole (types, blocks
tiling each tensor exactly) before any block is read; a block's .npy header and size are checked
against the metadata before its data is read. Loading never runs code from the checkpoint
(no pickle). Non-tensor values (an optimizer's step count, the data order's RNG state) go to
metadata.json as JSON.

Both are collective when the state holds DTensors (save also whenever the job has several
ranks): every rank must pass the same keys, shapes, dtypes, placements and path, and an error
on one rank is raised on all of them.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import stat
import zipfile
import zlib
from pathlib import Path

import numpy as np

__all__ = ["save", "load", "CheckpointError", "FORMAT", "VERSION"]

FORMAT = "dtensor-checkpoint"
VERSION = 1

_MARKER = ".dtensor-checkpoint"
_VERSION = re.compile(r"v[1-9][0-9]*")
_FOLDER = re.compile(r"v([1-9][0-9]*)(\.partial)?")
_SHARD = re.compile(r"rank(0|[1-9][0-9]*)\.npz")
_ENTRY = re.compile(r"a[0-9]+")
_DTYPES = frozenset(np.dtype(t).str for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128"))
# An .npy header is padded to 64 bytes and holds one dict of dtype, order and shape.
_NPY_HEADER_MAX = 4096


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt, or not matching."""


# ----------------------------------------------------------------------------- helpers

def _flatten(tree, prefix="", out=None):
    """{dotted key: (parent container, key, value)} for every leaf of nested dicts/lists."""
    out = {} if out is None else out
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        raise TypeError(f"checkpoint state must be nested dicts/lists, got {type(tree).__name__}")
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)) and not _is_tensor(v):
            _flatten(v, key + ".", out)
        else:
            out[key] = (tree, k, v)
    return out


def _is_tensor(v) -> bool:
    from dtensor.tensor import TensorMethods
    return isinstance(v, TensorMethods)


def _is_dtensor(v) -> bool:
    return hasattr(v, "_spec")


def _has_dtensors(flat) -> bool:
    return any(_is_dtensor(v) for _, _, v in flat.values())


def _world(flat):
    """(rank, size, comm): the job's world if there is one, else a world of one without MPI."""
    if _has_dtensors(flat) or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from dtensor.comm import get_world
        w = get_world()
        return w.rank, w.size, w
    return 0, 1, None


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


# ----------------------------------------------------------------------------- save

def _my_block(t, rank):
    """(array, offsets, writer?) of this rank's block of tensor ``t``."""
    if not _is_dtensor(t):
        return np.asarray(t.numpy()), (0,) * t.ndim, rank == 0
    from dtensor.placements import Partial, Shard
    if any(isinstance(p, Partial) for p in t.placements):
        from dtensor.placements import Replicate
        t = t.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                       for p in t.placements])
    shape, off = t._spec.local_shape_and_offset()
    coord = t.device_mesh.get_coordinate()
    writer = all(c == 0 for c, p in zip(coord, t.placements) if not isinstance(p, Shard))
    return t._loc(), off, writer


def save(state_dict, path) -> str:
    """Write ``state_dict`` (nested dicts of tensors, DTensors and JSON values) under ``path``.

    Collective when the state holds DTensors or the job has several ranks: every rank calls it
    with the same state layout and path. Returns the version folder written ("v3"). Raises on
    every rank if it fails on any (NotADirectoryError for a ``path`` that is a file, the
    OSError of a full disk naming the file); the previous checkpoint stays loadable.
    """
    flat = _flatten(state_dict)
    rank, size, comm = _world(flat)
    root = Path(path)
    tensors, value_keys = _describe(flat)
    if comm is not None:
        comm.check_same("checkpoint.save", "Call save on every rank with the same state and "
                        "path.", path=str(root.absolute()), tensors=tensors, values=value_keys)
    made: list[Path] = []  # rank 0: the folder this call created, removed if the save fails
    try:
        with _together(comm, "checkpoint.save"):
            values = {k: _jsonable(flat[k][2], k) for k in value_keys}
            if root.exists() and not root.is_dir():
                raise NotADirectoryError(f"checkpoint.save: {root} exists and is not a folder; "
                                         f"pass the path of a folder (created if missing).")
            version = _new_version(root, made) if rank == 0 else None
        if comm is not None:
            version = comm._c.bcast(version, root=0)  # metadata only
        blocks = _write_blocks(flat, tensors, root / f"{version}.partial", rank, comm)
        all_blocks = comm._c.gather(blocks, root=0) if comm is not None else [blocks]
        with _together(comm, "checkpoint.save"):
            if rank == 0:
                _commit(root, version, tensors, values, size, all_blocks, made)
    except BaseException:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return version


def _new_version(root: Path, made: list[Path]) -> str:
    """Rank 0: a fresh ``vN.partial`` folder under ``root``, our marker its first file."""
    with _naming(root):
        root.mkdir(parents=True, exist_ok=True)
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


def _write_blocks(flat, tensors, tmp: Path, rank: int, comm) -> list[dict]:
    """Write this rank's blocks to ``tmp/rank{rank}.npz``; their metadata."""
    arrays, blocks = {}, []
    for key in tensors:
        local, off, writer = _my_block(flat[key][2], rank)  # may redistribute: collective
        if writer and local.size:
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(local)
            blocks.append({"key": key, "file": f"rank{rank}.npz", "entry": name,
                           "offsets": [int(o) for o in off],
                           "shape": [int(n) for n in local.shape], "crc32": _crc(local)})
    path = tmp / f"rank{rank}.npz"
    with _together(comm, "checkpoint.save"), _naming(path):
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
            shutil.rmtree(entry.path, ignore_errors=True)


# ----------------------------------------------------------------------------- metadata

_KINDS = {int: "an integer", str: "a string", list: "a list", dict: "a JSON object"}


def _check_meta(meta, where: Path) -> dict:
    """``meta`` validated whole: a field of the wrong type, a name that is not ours, or blocks
    that do not tile their tensor exactly once is a CheckpointError naming the field."""
    def bad(field, why):
        return CheckpointError(f"{where}: {field} {why}; the file is corrupt or was not written "
                               f"by dtensor.checkpoint.save.")

    def get(d, key, field, kind):
        if key not in d:
            raise bad(field, f"has no {key!r} key")
        if not isinstance(d[key], kind) or isinstance(d[key], bool):
            raise bad(f"{field}[{key!r}]", f"is {d[key]!r}, not {_KINDS[kind]}")
        return d[key]

    def ints(d, key, field, n=None, low=0):
        v = get(d, key, field, list)
        if (n is not None and len(v) != n) or any(type(x) is not int or not low <= x < 2**62
                                                  for x in v):
            count = "" if n is None else f"{n} "
            raise bad(f"{field}[{key!r}]", f"is {v!r}, not {count}integers in [{low}, 2**62)")
        return v

    if not isinstance(meta, dict):
        raise bad("the metadata", f"is a {type(meta).__name__}, not a JSON object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} has format {meta.get('format')!r}, not {FORMAT!r}: not "
                              f"a dtensor checkpoint.")
    if meta.get("version") != VERSION or type(meta["version"]) is not int:
        raise CheckpointError(f"{where} has format version {meta.get('version')!r}; this "
                              f"dtensor reads version {VERSION}. Load it with the dtensor "
                              f"release that wrote it.")
    world = get(meta, "world_size", "the metadata", int)
    get(meta, "values", "the metadata", dict)
    for key, t in get(meta, "tensors", "the metadata", dict).items():
        field = f"tensors[{key!r}]"
        if not isinstance(t, dict):
            raise bad(field, f"is {t!r}, not a JSON object")
        if get(t, "dtype", field, str) not in _DTYPES:
            raise bad(f"{field}['dtype']", f"is {t['dtype']!r}, not a numeric dtype")
        shape = ints(t, "shape", field)
        if any(not isinstance(p, str) for p in get(t, "placements", field, list)):
            raise bad(f"{field}['placements']", f"is {t['placements']!r}, not a list of names")
        ints(t, "mesh_shape", field, low=1)
        blocks = get(t, "blocks", field, list)
        for i, b in enumerate(blocks):
            bf = f"{field}['blocks'][{i}]"
            if not isinstance(b, dict):
                raise bad(bf, f"is {b!r}, not a JSON object")
            m = _SHARD.fullmatch(get(b, "file", bf, str))
            if m is None or int(m.group(1)) >= world:
                raise bad(f"{bf}['file']", f"is {b['file']!r}, not 'rank<r>.npz' for a rank r "
                                           f"of the {world} that saved")
            if not _ENTRY.fullmatch(get(b, "entry", bf, str)):
                raise bad(f"{bf}['entry']", f"is {b['entry']!r}, not 'a<n>'")
            off, n = ints(b, "offsets", bf, len(shape)), ints(b, "shape", bf, len(shape))
            if any(o + k > s for o, k, s in zip(off, n, shape)):
                raise bad(bf, f"(offsets {off}, shape {n}) reaches past the global shape {shape}")
            crc = get(b, "crc32", bf, int)
            if not 0 <= crc < 2**32:
                raise bad(f"{bf}['crc32']", f"is {crc!r}, not a CRC-32")
        _check_tiling(field, shape, blocks, bad)
    return meta


def _check_tiling(field, shape, blocks, bad) -> None:
    """The blocks cover the global shape exactly once: equal volume and no two overlap (then no
    gap is left either). An overlap would otherwise leave part of a load uninitialised."""
    volume, need = sum(math.prod(b["shape"]) for b in blocks), math.prod(shape)
    if volume != need:
        raise bad(f"{field}['blocks']", f"hold {volume} elements but the shape {shape} has "
                                        f"{need}: they overlap or leave a gap")
    lo = np.array([b["offsets"] for b in blocks], np.int64).reshape(len(blocks), len(shape))
    hi = lo + np.array([b["shape"] for b in blocks], np.int64).reshape(lo.shape)
    for i in range(len(blocks) - 1):
        hit = np.flatnonzero(np.all((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i]), axis=1))
        if hit.size:
            j = i + 1 + int(hit[0])
            raise bad(f"{field}['blocks']", f"{i} and {j} overlap (offsets {lo[i].tolist()} "
                                            f"and {lo[j].tolist()}, shapes {blocks[i]['shape']} "
                                            f"and {blocks[j]['shape']})")


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
            self.meta = _check_meta(self._json(), self.folder / "metadata.json")
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
            text = f.read()
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); the file is "
                                  f"corrupt.") from None

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


def _read_latest(root: Path) -> str:
    path = root / "LATEST"
    try:
        with _open_regular(path, str(path)) as f:
            raw = f.read(257)
    except FileNotFoundError:
        raise CheckpointError(f"no complete checkpoint at {root}: {path} is missing (a save "
                              f"that did not finish leaves only *.partial folders).") from None
    text = raw.decode("ascii", errors="replace").strip()
    if len(raw) > 256 or not _VERSION.fullmatch(text):
        raise CheckpointError(f"{path} holds {raw!r}, not the name of a version folder "
                              f"like 'v3'; the file is corrupt or not a checkpoint's.")
    return text


def _target_block(t):
    if _is_dtensor(t):
        shape, off = t._spec.local_shape_and_offset()
        return tuple(shape), tuple(off)
    return tuple(t.shape), (0,) * t.ndim


def load(state_dict, path, *, strict: bool = True) -> None:
    """Fill ``state_dict``'s tensors (in place, whatever their mesh and placements) and values
    from the newest complete checkpoint under ``path``.

    Collective when the state holds DTensors: every rank passes the same state layout and path,
    and if reading fails on any rank it raises on all. Nothing in the state changes unless the
    whole load succeeds.

    Raises CheckpointError for a missing, incomplete, corrupt (checksum), truncated, malformed
    or wrong-version checkpoint, for a path in it that leads anywhere but its own regular files,
    and for keys or shapes that do not match (``strict=False`` skips keys missing on either
    side).
    """
    root = Path(path)
    flat = _flatten(state_dict)
    # Ranks holding DTensors read different blocks; one whose read fails must not leave the
    # others running on. A state of plain tensors is read whole by each caller on its own.
    comm = _world(flat)[2] if _has_dtensors(flat) else None
    if comm is not None:
        tensors, value_keys = _describe(flat)
        comm.check_same("checkpoint.load", "Call load on every rank with the same state and "
                        "path.", path=str(root.absolute()), strict=strict, tensors=tensors,
                        values=value_keys)
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
            values[key] = meta["values"][key]
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
        shape, off = _target_block(v)
        # The blocks tile the global shape exactly (checked), so they fill all of ``out``.
        out = np.empty(shape, dtype)
        for i, b in enumerate(info["blocks"]):
            lo = [max(o, bo) for o, bo in zip(off, b["offsets"])]
            hi = [min(o + n, bo + bn) for o, n, bo, bn in zip(off, shape, b["offsets"],
                                                               b["shape"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            block = ck.block(key, i, b, dtype)
            dst = tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, off))
            src = tuple(slice(a - bo, c - bo) for a, c, bo in zip(lo, hi, b["offsets"]))
            out[dst] = block[src]
        arrays[key] = out
    return values, arrays
