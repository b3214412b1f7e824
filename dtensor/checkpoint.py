"""Sharded checkpoints: every rank writes only its own blocks; any layout loads them.

    dtensor.checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    dtensor.checkpoint.load(state, path)        # fills state's tensors in place, any mesh

Layout of ``path`` (a folder):

    LATEST                  name of the newest complete checkpoint ("v3")
    v3/metadata.json        format, version, and per tensor: global shape, dtype, placements,
                            mesh shape and each saved block (file, offsets, shape, CRC-32)
    v3/rank0.npz ...        the blocks each rank owns (plain .npy arrays: never pickle)

A block is written once: by the ranks at coordinate 0 of every mesh dim its tensor is not
sharded over. A save writes ``v4.partial/``, then rank 0 writes metadata.json, renames the
folder to ``v4`` and only then points LATEST at it (an atomic replace), so a crash at any point
leaves the previous checkpoint loadable and a partial one is never read. Loading reads the
blocks that overlap each rank's current block, checking every block's checksum; it never runs
code from the checkpoint (``allow_pickle=False`` everywhere). Non-tensor values (an optimizer's
step count, the data order's RNG state) go to metadata.json as JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np

__all__ = ["save", "load", "CheckpointError", "FORMAT", "VERSION"]

FORMAT = "dtensor-checkpoint"
VERSION = 1


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


def _world(flat):
    """(rank, size, comm): the job's world if there is one, else a world of one without MPI."""
    if any(_is_dtensor(v) for _, _, v in flat.values()) or int(os.environ.get("WORLD_SIZE",
                                                                                "1")) > 1:
        from dtensor.comm import get_world
        w = get_world()
        return w.rank, w.size, w
    return 0, 1, None


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _jsonable(value, key):
    try:
        json.dumps(value)
    except TypeError:
        raise TypeError(f"checkpoint: {key!r} is a {type(value).__name__}, neither a tensor nor "
                        f"a JSON value (number, string, bool, None, list, dict).") from None
    return value


def _latest(root: Path) -> str | None:
    try:
        return (root / "LATEST").read_text().strip() or None
    except FileNotFoundError:
        return None


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

    Collective when the state holds DTensors: every rank of the job calls it. Returns the
    version folder written ("v3").
    """
    flat = _flatten(state_dict)
    rank, size, comm = _world(flat)
    root = Path(path)
    # One past every version on disk: a save that died after its rename but before LATEST
    # left a complete vN that LATEST does not name; it is never reused.
    taken = [int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit()]
    version = f"v{max(taken, default=0) + 1}"
    if comm is not None:
        version = comm._c.bcast(version, root=0)  # metadata only
    tmp = root / f"{version}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        tmp.mkdir()
    if comm is not None:
        comm.barrier()
    arrays, blocks, tensors, scalars = {}, [], {}, {}
    for key, (_, _, v) in flat.items():
        if not _is_tensor(v):
            scalars[key] = _jsonable(v, key)
            continue
        local, off, writer = _my_block(v, rank)
        tensors[key] = {
            "shape": list(v.shape), "dtype": np.dtype(v.dtype).str,
            "placements": [repr(p) for p in v.placements] if _is_dtensor(v) else [],
            "mesh_shape": list(v.device_mesh.shape) if _is_dtensor(v) else []}
        if writer and local.size:
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(local)
            blocks.append({"key": key, "file": f"rank{rank}.npz", "entry": name,
                           "offsets": [int(o) for o in off],
                           "shape": [int(n) for n in local.shape], "crc32": _crc(local)})
    if arrays:
        with open(tmp / f"rank{rank}.npz", "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
    all_blocks = comm._c.gather(blocks, root=0) if comm is not None else [blocks]
    if rank == 0:
        for b in (b for rb in all_blocks for b in rb):
            tensors[b["key"]].setdefault("blocks", []).append(
                {k: b[k] for k in ("file", "entry", "offsets", "shape", "crc32")})
        meta = {"format": FORMAT, "version": VERSION, "world_size": size,
                "tensors": tensors, "values": scalars}
        _fsync_write(tmp / "metadata.json", json.dumps(meta))
        os.replace(tmp, root / version)
        _fsync_write(root / "LATEST.tmp", version)
        os.replace(root / "LATEST.tmp", root / "LATEST")  # the commit point
        for old in root.glob("v*"):
            if old.name != version:
                shutil.rmtree(old, ignore_errors=True)
    if comm is not None:
        comm.barrier()
    return version


# ----------------------------------------------------------------------------- load

def _read_meta(root: Path) -> tuple[Path, dict]:
    version = _latest(root)
    if version is None:
        raise CheckpointError(f"no complete checkpoint at {root}: {root / 'LATEST'} is missing "
                              f"(a save that did not finish leaves only *.partial folders).")
    folder = root / version
    try:
        meta = json.loads((folder / "metadata.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder / 'metadata.json'} is missing: LATEST names "
                              f"{version!r} but that checkpoint is incomplete.") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder / 'metadata.json'} is not valid JSON ({e}); the file "
                              f"is corrupt.") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder / 'metadata.json'} has format {meta.get('format')!r}, "
                              f"not {FORMAT!r}: not a dtensor checkpoint.")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{folder / 'metadata.json'} has format version "
                              f"{meta.get('version')!r}; this dtensor reads version {VERSION}. "
                              f"Load it with the dtensor release that wrote it.")
    return folder, meta


class _Files:
    """Open .npz files, read lazily; no pickle."""

    def __init__(self, folder: Path):
        self.folder, self.open, self.handles = folder, {}, []

    def close(self) -> None:
        for h in self.handles:
            h.close()

    def block(self, b, key) -> np.ndarray:
        path = self.folder / b["file"]
        try:
            f = self.open.get(path)
            if f is None:
                handle = open(path, "rb")
                self.handles.append(handle)
                f = self.open[path] = np.load(handle, allow_pickle=False)
            a = f[b["entry"]]
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (block of {key!r}).") from None
        except Exception as e:  # a truncated or corrupt zip / npy
            what = ("checksum mismatch (the zip member's CRC-32)" if "CRC" in str(e)
                    else "the file is truncated or corrupt")
            raise CheckpointError(f"{path} cannot be read for {key!r}: {what} "
                                  f"({type(e).__name__}: {e}).") from None
        if list(a.shape) != b["shape"]:
            raise CheckpointError(f"{path}: block of {key!r} has shape {list(a.shape)}, metadata "
                                  f"says {b['shape']}.")
        crc = _crc(a)
        if crc != b["crc32"]:
            raise CheckpointError(f"checksum mismatch in {path} for {key!r}: stored "
                                  f"{b['crc32']:#010x}, computed {crc:#010x}; the file is "
                                  f"corrupt.")
        return a


def _target_block(t):
    if _is_dtensor(t):
        shape, off = t._spec.local_shape_and_offset()
        return tuple(shape), tuple(off)
    return tuple(t.shape), (0,) * t.ndim


def load(state_dict, path, *, strict: bool = True) -> None:
    """Fill ``state_dict``'s tensors (in place, whatever their mesh and placements) and values
    from the newest complete checkpoint under ``path``.

    Raises CheckpointError for a missing, incomplete, corrupt (checksum), truncated or
    wrong-version checkpoint, and for keys or shapes that do not match (``strict=False``
    skips keys missing on either side).
    """
    root = Path(path)
    folder, meta = _read_meta(root)
    flat = _flatten(state_dict)
    saved = set(meta["tensors"]) | set(meta["values"])
    missing = sorted(k for k in flat if k not in saved)
    unexpected = sorted(k for k in saved if k not in flat)
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {folder} does not match the state: missing keys "
                              f"{missing[:10]}, unexpected keys {unexpected[:10]}. Build the "
                              f"same model and optimizer, or pass strict=False.")
    files = _Files(folder)
    try:
        _fill(flat, meta, files)
    finally:
        files.close()


def _fill(flat, meta, files) -> None:
    for key, (parent, k, v) in flat.items():
        if key in meta["values"]:
            parent[k] = meta["values"][key]
            continue
        info = meta["tensors"].get(key)
        if info is None:
            continue
        if not _is_tensor(v):
            raise CheckpointError(f"{key!r} is a tensor in the checkpoint but "
                                  f"{type(v).__name__} in the state.")
        if list(v.shape) != info["shape"] or np.dtype(v.dtype).str != info["dtype"]:
            raise CheckpointError(f"{key!r}: checkpoint has shape {tuple(info['shape'])} "
                                  f"{np.dtype(info['dtype'])}, the state "
                                  f"{tuple(v.shape)} {np.dtype(v.dtype)}.")
        shape, off = _target_block(v)
        out = np.empty(shape, np.dtype(info["dtype"]))
        covered = 0
        for b in info.get("blocks", []):
            lo = [max(o, bo) for o, bo in zip(off, b["offsets"])]
            hi = [min(o + n, bo + bn) for o, n, bo, bn in zip(off, shape, b["offsets"],
                                                               b["shape"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)) and len(shape):
                continue
            block = files.block(b, key)
            dst = tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, off))
            src = tuple(slice(a - bo, c - bo) for a, c, bo in zip(lo, hi, b["offsets"]))
            out[dst] = block[src]
            covered += int(np.prod([c - a for a, c in zip(lo, hi)]))
        if covered != out.size:
            raise CheckpointError(f"{key!r}: the checkpoint's blocks cover {covered} of the "
                                  f"{out.size} elements this rank needs; it is incomplete.")
        if _is_dtensor(v):
            v._set_local(out)
        else:
            v.data = out
