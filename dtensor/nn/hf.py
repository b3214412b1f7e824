"""Hugging Face safetensors checkpoints for any module: each rank reads only its own block.

    load_safetensors(model, "llama-folder", name_map)    # every rank, any layout
    save_safetensors(model, "out-folder", name_map)      # every rank; rank 0 writes

A folder holds ``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names,
or (neither present) every ``*.safetensors`` file in it. A name map says which parameter each
checkpoint tensor is: a dict ``{checkpoint name: parameter path or None}`` (names it does not list
keep their own name; None ignores a tensor, e.g. rotary ``inv_freq`` buffers), a callable
``checkpoint name -> parameter path or None``, or a :class:`NameMap` of both directions (a save
needs ``parameter path -> checkpoint name``: a dict is inverted, a callable alone is not).

A parameter is a Tensor or a DTensor (Shard / Replicate on any mesh): a load reads this rank's
block of each tensor with safetensors' lazy slices (bfloat16, which numpy lacks, through the
file's header offsets, widened by a 16-bit shift, only the rows of the block), converts it to the
parameter's dtype and writes it into the parameter's own array (a placeholder parameter made
under ``dtensor.nn.init.empty_parameters()`` gets its block allocated here). Everything is
checked before any parameter changes. Never torch: safetensors' numpy API only.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["NameMap", "HFCheckpointError", "load_safetensors", "save_safetensors"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Tensors are read this many bytes of whole rows at a time (the block's other dims cut from each
# chunk): a load's transient memory stays this small however large a tensor is, and a column
# block of a large matrix never brings the whole matrix in. Below glibc's 32 MiB mmap threshold
# a freed chunk stays in the heap for the next one; benchmarks/from_pretrained.py: per-rank
# peak at tp=4 is 0.28x the one-process load at 4 MiB, 0.37x at 16 MiB (0.27x at 1 MiB, slower).
_CHUNK = 4 << 20


class HFCheckpointError(ValueError):
    """A safetensors checkpoint that does not fit the module (names, shapes, dtypes, index)."""


@dataclass(frozen=True)
class NameMap:
    """Both directions of a name map: ``to_module(checkpoint name) -> parameter path | None``
    (None: not a parameter, ignored) and ``to_checkpoint(parameter path) -> name | None`` (None:
    not saved under this path; a tied parameter is saved under its first path that has a name).

    Example:
        >>> NameMap(lambda n: n.removeprefix("model."), lambda p: "model." + p)
    """

    to_module: Callable[[str], str | None]
    to_checkpoint: Callable[[str], str | None] | None = None


def _as_name_map(name_map) -> NameMap:
    if name_map is None:
        return NameMap(lambda n: n, lambda p: p)
    if isinstance(name_map, NameMap):
        return name_map
    if isinstance(name_map, Mapping):
        table = dict(name_map)
        for k, v in table.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, str)):
                raise TypeError(f"a name map dict maps checkpoint names (str) to parameter paths "
                                f"(str) or None, got {k!r}: {v!r}.")
        inverse: dict[str, str] = {}
        for k, v in table.items():
            if v is not None:
                inverse.setdefault(v, k)
        return NameMap(lambda n: table.get(n, n),
                       lambda p: inverse.get(p, None if p in table else p))
    if callable(name_map):
        return NameMap(name_map)
    raise TypeError(f"name_map must be a dict, a callable (checkpoint name -> parameter path or "
                    f"None) or a dtensor.nn.hf.NameMap, got {type(name_map).__name__}.")


def _map(fn, name: str, what: str) -> str | None:
    out = fn(name)
    if not (out is None or isinstance(out, str)):
        raise TypeError(f"the name map's {what} gave {out!r} (type {type(out).__name__}) for "
                        f"{name!r}; it must return a str or None.")
    return out


def _parameters(module) -> dict[int, tuple[object, list[str]]]:
    """id -> (parameter, every path it has), in module order: a tied parameter (one object under
    several paths) is one entry, unlike named_parameters, which keeps its first path only."""
    out: dict[int, tuple[object, list[str]]] = {}

    def walk(m, prefix: str, stack: tuple) -> None:
        if id(m) in stack:  # a module inside itself: the paths would never end
            return
        for name, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), (p, []))[1].append(prefix + name)
        for name, sub in m._modules.items():
            if sub is not None:
                walk(sub, f"{prefix}{name}.", stack + (id(m),))

    walk(module, "", ())
    return out


def _near(name: str, pool, n: int = 3) -> str:
    close = difflib.get_close_matches(name, list(pool), n=n, cutoff=0.5)
    return f" (closest: {', '.join(map(repr, close))})" if close else ""


def _some(names, n: int = 5) -> str:
    names = list(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(map(repr, names[:n])) + more


# ----------------------------------------------------------------------------- files

def _files(folder: Path) -> dict[str, _Entry]:
    """Checkpoint tensor name -> the file that holds it (headers only, nothing read yet)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {str(folder)!r}; pass the folder that "
                                f"holds {SINGLE} or {INDEX} (a Hugging Face model folder).")
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index ({e!r}); it needs a "
                                    f"\"weight_map\" of tensor name -> file name.") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise HFCheckpointError(f"{index}: \"weight_map\" must map tensor names to file "
                                    f"names (strings).")
        files = {}
        for f in sorted(set(weight_map.values())):
            if Path(f).name != f or not (folder / f).is_file():
                raise FileNotFoundError(
                    f"{index} names {f!r} (for {_some(k for k, v in weight_map.items() if v == f)})"
                    f", which is not a file in {str(folder)!r}; download every shard the index "
                    f"lists, or remove the stale index.")
            files[f] = folder / f
        where = _headers(files.values())
        for name, f in weight_map.items():
            if name not in where or where[name].path != files[f]:
                raise HFCheckpointError(f"{index} puts {name!r} in {f!r}, which does not hold it"
                                        f"; the index and the shards are from different saves.")
        return {name: where[name] for name in weight_map}
    single = folder / SINGLE
    paths = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no safetensors files in {str(folder)!r} (looked for {SINGLE},"
                                f" {INDEX}, *.safetensors); point at the folder that holds the "
                                f"weights, or convert a .bin checkpoint to safetensors first.")
    return _headers(paths)


@dataclass(frozen=True)
class _Entry:
    path: Path
    shape: tuple[int, ...]
    dtype: str  # the safetensors spelling: F32, BF16 ...


def _headers(paths) -> dict[str, _Entry]:
    from safetensors import safe_open
    where: dict[str, _Entry] = {}
    for p in paths:
        with safe_open(p, framework="np") as f:
            for name in f.keys():
                if name in where:
                    raise HFCheckpointError(f"tensor {name!r} is in both {where[name].path.name!r}"
                                            f" and {p.name!r}; keep one checkpoint per folder.")
                sl = f.get_slice(name)
                where[name] = _Entry(p, tuple(sl.get_shape()), sl.get_dtype())
    return where


def _raw_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, the JSON header): the format is an 8-byte little-endian header
    length, the header, then every tensor's bytes row-major at its data_offsets."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


# Bytes per element of every safetensors dtype numpy holds, plus BF16 (read raw); the F8 kinds
# have no numpy type.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def _slice_rows(entry: _Entry, name: str, rows: slice, rest: tuple) -> np.ndarray:
    from safetensors import safe_open
    # One open per chunk: the file is memory-mapped, and the pages a slice touches stay in this
    # process's RSS while the map is open, so a file held open through all its tensors would
    # peak at its whole size.
    with safe_open(entry.path, framework="np") as f:
        sl = f.get_slice(name)
        return sl[(rows,) + rest] if entry.shape else sl[()].reshape(1)


def _bf16_rows(entry: _Entry, name: str, rows: slice, rest: tuple, header) -> np.ndarray:
    """Rows of a bfloat16 tensor from the file's bytes, widened to float32 (a bfloat16 is a
    float32's high half): safetensors' numpy API refuses BF16, numpy has no such type."""
    start, table = header
    shape = entry.shape or (1,)
    row = 2 * math.prod(shape[1:])
    with open(entry.path, "rb") as f:
        f.seek(start + table[name]["data_offsets"][0] + rows.start * row)
        raw = np.frombuffer(f.read((rows.stop - rows.start) * row), "<u2")
    raw = raw.reshape(-1, *shape[1:])[(slice(None),) + rest]
    return (raw.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- load

def _target(p, shape: tuple[int, ...]) -> np.ndarray:
    """The array the block goes into: the parameter's own, or a new one where that is a
    read-only placeholder (or not a plain contiguous array of its dtype)."""
    local = p._loc() if p.is_distributed else p.data
    if (type(local) is np.ndarray and local.flags.writeable and local.flags.c_contiguous
            and local.shape == shape and local.dtype == np.dtype(p.dtype)):
        return local
    return np.empty(shape, np.dtype(p.dtype))


def _store(p, arr: np.ndarray) -> None:
    if p.is_distributed:
        if p._loc() is not arr:
            p._set_local(arr)
    elif p.data is not arr:
        p.data = arr


def _plan(params, where: dict[str, _Entry], nm: NameMap, strict: bool):
    """(checkpoint name -> parameter for each tensor to read, checkpoint names that match no
    parameter, parameter paths with no tensor), after every check a load makes."""
    by_path = {path: (key, paths.index(path)) for key, (_, paths) in params.items()
               for path in paths}
    chosen: dict[int, tuple[int, str]] = {}
    unexpected = []
    for name in where:
        path = _map(nm.to_module, name, "to_module")
        if path is None:
            continue
        if path not in by_path:
            unexpected.append((name, path))
            continue
        key, order = by_path[path]
        # A tied parameter is read once: from the name of its first path (the embedding of a
        # tied head, as Hugging Face's tie_weights), whatever order the files list them in.
        if key not in chosen or order < chosen[key][0]:
            chosen[key] = (order, name)
    plan = {name: params[key][0] for key, (_, name) in chosen.items()}
    missing = [paths for key, (_, paths) in params.items() if key not in chosen]
    if strict and unexpected:
        lines = [f"{n!r}" + (f" -> {path!r}" if path != n else "") + _near(path, by_path)
                 for n, path in unexpected[:5]]
        raise HFCheckpointError(
            f"{len(unexpected)} checkpoint tensor(s) match no parameter of the module: "
            + "; ".join(lines) + (" ..." if len(unexpected) > 5 else "")
            + ". Map them in name_map (None ignores a tensor, e.g. rotary inv_freq buffers), "
              "or pass strict=False.")
    if strict and missing:
        unread = [n for n in where if n not in plan]
        lines = []
        for paths in missing[:5]:
            want = _map(nm.to_checkpoint, paths[0], "to_checkpoint") if nm.to_checkpoint else None
            lines.append(" / ".join(map(repr, paths))
                         + (f" (checkpoint name {want!r})" if want else "") + _near(
                             want or paths[0], unread))
        raise HFCheckpointError(
            f"{len(missing)} parameter(s) have no tensor in the checkpoint: " + "; ".join(lines)
            + (" ..." if len(missing) > 5 else "") + ". Fix the name map, load the right "
            "checkpoint for this model's config, or pass strict=False.")
    bad = []
    for name, p in plan.items():
        shape, dtype = where[name].shape, where[name].dtype
        if shape != tuple(p.shape):
            bad.append(f"{name!r}: checkpoint shape {shape}, parameter shape {tuple(p.shape)}")
        elif dtype not in _ITEMSIZE:
            bad.append(f"{name!r}: checkpoint dtype {dtype} has no numpy reader (readable: "
                       f"{', '.join(_ITEMSIZE)})")
        elif any(q.is_partial() for q in getattr(p, "placements", ())):
            bad.append(f"{name!r}: the parameter is laid out as {list(p.placements)}, partial "
                       f"sums rather than blocks; redistribute it to Shard / Replicate first")
    if bad:
        raise HFCheckpointError("checkpoint tensors do not fit the module: " + "; ".join(bad)
                                + ". Build the model with the checkpoint's config (or convert "
                                  "the checkpoint's dtype).")
    return plan, [n for n, _ in unexpected], [paths[0] for paths in missing]


def load_safetensors(module, folder, name_map=None, *, strict: bool = True):
    """Fill ``module``'s parameters from a Hugging Face safetensors folder, each rank reading
    only the block its parameters hold.

    Args:
        module: a ``dtensor.nn.Module``; parameters may be Tensors or DTensors (Shard /
            Replicate, any mesh), or placeholders from ``dtensor.nn.init.empty_parameters()``.
        folder: holds ``model.safetensors``, or ``model.safetensors.index.json`` and its shards,
            or any ``*.safetensors`` files.
        name_map: checkpoint name -> parameter path (see the module docstring); None: the
            checkpoint uses the module's own paths.
        strict: raise on checkpoint tensors that match no parameter and on parameters with no
            tensor (with strict=False they are skipped and returned).

    Returns:
        (missing parameter paths, unexpected checkpoint names).

    Raises:
        FileNotFoundError: no folder, no safetensors files, or an index naming an absent file.
        HFCheckpointError: unknown or missing names (strict), a shape or dtype that does not fit.

    Example:
        >>> load_safetensors(model, "tiny-llama", {"lm_head.weight": "head.weight"})
    """
    from dtensor.validate import as_bool
    strict = as_bool(strict, "load_safetensors: strict")
    nm = _as_name_map(name_map)
    params = _parameters(module)
    comm = _world(p for p, _ in params.values())
    # Ranks read their own files: one whose read fails (an absent shard on its node) must not
    # leave the others to hang in the job's next collective.
    with _together(comm, "load_safetensors"):
        where = _files(Path(folder))
        plan, unexpected, missing = _plan(params, where, nm, strict)
        _read(plan, where)
    return missing, unexpected


def _read(plan: dict, where: dict[str, _Entry]) -> None:
    from dtensor.dtensor import held_pieces
    headers: dict[Path, tuple[int, dict]] = {}
    for name, p in plan.items():
        entry = where[name]
        local_shape, pieces = held_pieces(p)
        out = _target(p, local_shape)
        if entry.dtype == "BF16" and entry.path not in headers:
            headers[entry.path] = _raw_header(entry.path)
        step = max(1, _CHUNK // (_ITEMSIZE[entry.dtype] * max(1, math.prod(entry.shape[1:]))))
        for at, offset, shape in pieces:
            # A 0-d tensor is read as one row; an empty block (a trailing uneven shard) not at
            # all: safetensors refuses an empty slice.
            rows, *rest = [slice(o, o + n) for o, n in zip(offset, shape)] or [slice(0, 1)]
            dst = out.reshape(1) if out.ndim == 0 else out[at]
            for r in range(rows.start, rows.stop if dst.size else rows.start, step):
                chunk = slice(r, min(r + step, rows.stop))
                got = (_bf16_rows(entry, name, chunk, tuple(rest), headers[entry.path])
                       if entry.dtype == "BF16" else _slice_rows(entry, name, chunk, tuple(rest)))
                np.copyto(dst[r - rows.start: chunk.stop - rows.start], got, casting="unsafe")
        _store(p, out)


# ----------------------------------------------------------------------------- save

def _world(tensors):
    """The job's world when a collective may run (DTensors, or a job of several ranks), else
    None: a world of one without MPI, as dtensor.checkpoint does."""
    from dtensor.distributed import _several_ranks
    if any(t.is_distributed for t in tensors) or _several_ranks():
        from dtensor.comm import get_world
        return get_world()
    return None


def _together(comm, what: str):
    return comm.fail_together(what) if comm is not None else contextlib.nullcontext()


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size_arg(v) -> int:
    """Hugging Face's max_shard_size: bytes, or a string such as "5GB" (10^9) or "2GiB"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v) if isinstance(v, str) else None
    if m and m.group(2).upper() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        n = int(v)
    else:
        raise TypeError(f"max_shard_size must be a number of bytes or a string such as '5GB' "
                        f"or '500MiB', got {v!r}.")
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {v!r}.")
    return n


def _save_names(params, nm: NameMap) -> list[tuple[str, object]]:
    """(checkpoint name, parameter) per parameter, each tied one once, checked to load back."""
    if nm.to_checkpoint is None:
        raise TypeError("save_safetensors needs parameter path -> checkpoint name: pass a dict "
                        "(it is inverted) or NameMap(to_module, to_checkpoint), not a callable "
                        "alone.")
    out = []
    for key, (p, paths) in params.items():
        names = [(path, _map(nm.to_checkpoint, path, "to_checkpoint")) for path in paths]
        named = [(path, n) for path, n in names if n is not None]
        if not named:
            raise HFCheckpointError(f"the name map gives parameter {' / '.join(paths)} no "
                                    f"checkpoint name; add one for it.")
        path, name = named[0]
        # Two parameters under one name cannot both load back, so this also refuses that.
        back = _map(nm.to_module, name, "to_module")
        if back not in paths:
            raise HFCheckpointError(f"the name map saves {path!r} as {name!r}, which it loads "
                                    f"back as {back!r}: make its two directions agree.")
        out.append((name, p))
    return out


def _shards(entries, limit: int | None) -> list[list[tuple[str, object]]]:
    """Hugging Face's greedy split: a shard closes before the tensor that would exceed the
    limit; a tensor larger than the limit has a shard of its own."""
    if limit is None:
        return [entries]
    shards, size = [[]], 0
    for name, p in entries:
        nbytes = math.prod(p.shape) * np.dtype(p.dtype).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, p))
        size += nbytes
    return shards


def _whole(p) -> np.ndarray:
    return np.ascontiguousarray((p.full_tensor() if p.is_distributed else p).numpy())


def _write(path: Path, arrays: dict, metadata: dict) -> None:
    from safetensors.numpy import save_file
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(arrays, str(tmp), metadata=metadata)
        # safetensors creates its file 0600; a checkpoint gets the mode config.json gets (the
        # user's umask), so whoever may read the folder may read the weights
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def save_safetensors(module, folder, name_map=None, *, metadata: dict | None = None,
                     max_shard_size: int | str | None = None,
                     config: dict | None = None) -> list[str]:
    """Write ``module``'s parameters as a Hugging Face safetensors folder: whole tensors from
    any layout. Collective when parameters are DTensors (every rank calls; rank 0 writes).

    Args:
        folder: created if absent; ``model.safetensors`` (or, with ``max_shard_size``, the
            ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``)
            replaces any earlier save there, file by file (a temp file renamed over it).
        name_map: a dict checkpoint name -> parameter path (inverted here) or a NameMap; None
            keeps the module's own paths. A tied parameter is saved once.
        metadata: extra string pairs for the header; ``{"format": "pt"}`` is always there, as
            Hugging Face writes it.
        max_shard_size: bytes per shard (or "5GB", "500MiB"); None: one file.
        config: written as ``config.json`` (a Hugging Face model folder's configuration).

    Returns:
        The names of the files written.

    Example:
        >>> save_safetensors(model, "out", {"model.embed_tokens.weight": "embed.weight"})
    """
    nm = _as_name_map(name_map)
    meta = {"format": "pt"}
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError(f"metadata must be a dict of str to str (the safetensors header "
                            f"holds strings), got {metadata!r}.")
        meta.update(metadata)
    limit = None if max_shard_size is None else _size_arg(max_shard_size)
    if config is not None:
        try:
            config_text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"config must be a JSON-serialisable dict (config.json), got "
                            f"{config!r}: {e}.") from None
    params = _parameters(module)
    entries = _save_names(params, nm)
    folder = Path(folder)
    comm = _world(p for _, p in entries)
    if comm is not None:  # full_tensor below runs one collective per DTensor, in this order
        comm.check_same("save_safetensors", "Call it on every rank with the same model and "
                        "folder.", folder=str(folder), tensors=[
                            (n, tuple(p.shape), str(p.dtype)) for n, p in entries])
    writer = comm is None or comm.rank == 0
    with _together(comm, "save_safetensors"):
        if writer:
            folder.mkdir(parents=True, exist_ok=True)
    shards = _shards(entries, limit)
    names = [SINGLE] if limit is None else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        arrays = {name: _whole(p) for name, p in shard}
        with _together(comm, "save_safetensors"):
            if writer:
                _write(folder / fname, arrays, meta)
        del arrays
    with _together(comm, "save_safetensors"):
        if writer:
            _finish(folder, names, shards)
            if config is not None:
                _write_text(folder / "config.json", config_text + "\n")
    return names + ([] if config is None else ["config.json"])


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _finish(folder: Path, names: list[str], shards) -> None:
    """The index (for shards), then the files of earlier saves go: a load prefers an index to
    model.safetensors, so a stale one would shadow this save."""
    if len(names) > 1 or names[0] != SINGLE:
        total = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize
                    for shard in shards for _, p in shard)
        weight_map = {n: f for f, shard in zip(names, shards) for n, _ in shard}
        _write_text(folder / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map":
                                                dict(sorted(weight_map.items()))}, indent=2))
    stale = [folder / INDEX] if names == [SINGLE] else [folder / SINGLE]
    stale += [p for p in folder.iterdir() if _SHARD_NAME.fullmatch(p.name) and p.name not in names]
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
