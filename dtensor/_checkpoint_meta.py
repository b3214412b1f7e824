"""What a checkpoint's metadata.json may say, for dtensor.checkpoint.

The boundary: dtensor.checkpoint does the files, the ranks and the tensors; this module turns the
bytes of metadata.json into a dict it may trust (size capped, JSON without duplicate keys, every
field of the right type, each tensor's blocks tiling it exactly once) or a CheckpointError naming
the field. Nothing here touches the disk beyond the file object it is given.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re

import numpy as np

FORMAT = "dtensor-checkpoint"
VERSION = 1

SHARD = re.compile(r"rank(0|[1-9][0-9]*)\.npz")
_ENTRY = re.compile(r"a[0-9]+")
_PARTS = re.compile(r"S\([0-9]+\)/([1-9][0-9]{0,5})")  # a StridedShard's name
_DTYPES = frozenset(np.dtype(t).str for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128"))
# Parsing JSON takes a few times the file's size in memory; a save writes ~200 bytes a block.
META_MAX = 256 << 20
# Cells of the grid the blocks' own edges cut a tensor into (see _check_tiling). A save's blocks
# come from a mesh sharding, a grid of at most world_size cells; more is a forged file.
_GRID_MAX = 10_000_000


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt, or not matching."""


CheckpointError.__module__ = "dtensor.checkpoint"  # where users import it from


def read_meta(f, where) -> dict:
    """The metadata in open binary file ``f`` (``where`` names it), validated whole."""
    size = os.fstat(f.fileno()).st_size
    if size > META_MAX:
        raise CheckpointError(f"{where} is {size} bytes, more than the {META_MAX} a checkpoint's "
                              f"metadata may take; the file is corrupt or not a checkpoint's.")
    text = f.read(size + 1)  # (read(n) takes n bytes of memory up front)
    if len(text) > size:
        raise CheckpointError(f"{where} grew while being read; a checkpoint is read once its "
                              f"save has finished.")
    try:
        meta = json.loads(text, object_pairs_hook=_unique)
    except _DuplicateKey as e:
        raise CheckpointError(f"{where}: the key {e.args[0]!r} appears twice in one JSON "
                              f"object; the file is corrupt or was not written by "
                              f"dtensor.checkpoint.save.") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}); the file is "
                              f"corrupt.") from None
    return check_meta(meta, where)


class _DuplicateKey(Exception):
    pass


def _unique(pairs) -> dict:
    """A JSON object whose keys are all different: json's default keeps the last of two."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


_KINDS = {int: "an integer", str: "a string", list: "a list", dict: "a JSON object"}


def check_meta(meta, where) -> dict:
    """``meta`` validated whole: a field of the wrong type, a name that is not ours, a key that
    is both a tensor and a value, or blocks that do not tile their tensor exactly once is a
    CheckpointError naming the field."""
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
    if not 1 <= world < 2**31:
        raise bad("the metadata['world_size']", f"is {world}, not a number of ranks")
    values = get(meta, "values", "the metadata", dict)
    for key, t in get(meta, "tensors", "the metadata", dict).items():
        field = f"tensors[{key!r}]"
        if key in values:
            raise bad(field, "is also in values: a key is a tensor or a JSON value, not both")
        if not isinstance(t, dict):
            raise bad(field, f"is {t!r}, not a JSON object")
        if get(t, "dtype", field, str) not in _DTYPES:
            raise bad(f"{field}['dtype']", f"is {t['dtype']!r}, not a numeric dtype")
        shape = ints(t, "shape", field)
        names = get(t, "placements", field, list)
        if any(not isinstance(p, str) for p in names):
            raise bad(f"{field}['placements']", f"is {t['placements']!r}, not a list of names")
        ints(t, "mesh_shape", field, low=1)
        blocks = get(t, "blocks", field, list)
        # each rank writes one block of a tensor, one per part of a strided shard ("S(0)/3")
        per_rank = math.prod(int(m.group(1)) for m in map(_PARTS.fullmatch, names) if m)
        if len(blocks) > world * per_rank:
            raise bad(f"{field}['blocks']", f"has {len(blocks)} blocks, more than the "
                                            f"{per_rank} each of the {world} ranks that saved "
                                            f"writes")
        for i, b in enumerate(blocks):
            bf = f"{field}['blocks'][{i}]"
            if not isinstance(b, dict):
                raise bad(bf, f"is {b!r}, not a JSON object")
            m = SHARD.fullmatch(get(b, "file", bf, str))
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
    """The blocks (each inside the shape, checked) cover it exactly once: equal volume and no
    two overlap, so no gap is left either. An overlap would otherwise leave part of a load
    uninitialised.

    Without a loop over the blocks: their edges cut each dim at a few points, and each cell of
    the grid these cuts make lies wholly inside or outside every block. Each block adds +-1 at
    the 2**ndim corners of its box of cells, and running sums along every dim turn that into the
    number of blocks covering each cell; a cell covered twice is an overlap. A grid past
    _GRID_MAX cells (a save's mesh sharding makes at most world_size) is refused."""
    volume, need = sum(math.prod(b["shape"]) for b in blocks), math.prod(shape)
    if volume != need:
        raise bad(f"{field}['blocks']", f"hold {volume} elements but the shape {shape} has "
                                        f"{need}: they overlap or leave a gap")
    if not shape or need == 0:  # one 0-d block of volume 1, or nothing to cover
        return
    lo = np.array([b["offsets"] for b in blocks], np.int64).reshape(len(blocks), len(shape))
    hi = lo + np.array([b["shape"] for b in blocks], np.int64).reshape(lo.shape)
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(len(shape))]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > _GRID_MAX:
        raise bad(f"{field}['blocks']", f"cut the shape {shape} into {math.prod(grid)} pieces, "
                                        f"more than the {_GRID_MAX} a save's mesh sharding "
                                        f"makes: the block layout is too fragmented")
    first = np.stack([np.searchsorted(c, lo[:, d]) for d, c in enumerate(cuts)], axis=1)
    last = np.stack([np.searchsorted(c, hi[:, d]) for d, c in enumerate(cuts)], axis=1)
    live = np.all(last > first, axis=1)  # an empty block covers no cell
    count = np.zeros([g + 1 for g in grid], np.int32)
    for corner in itertools.product((False, True), repeat=len(shape)):
        at = tuple(np.where(up, last[live, d], first[live, d]) for d, up in enumerate(corner))
        np.add.at(count, at, -1 if sum(corner) % 2 else 1)
    for d in range(len(shape)):
        np.cumsum(count, axis=d, out=count)
    twice = np.flatnonzero(count[tuple(slice(0, g) for g in grid)] > 1)
    if twice.size:
        cell = np.unravel_index(twice[0], grid)
        i, j = np.flatnonzero(np.all((first <= cell) & (cell < last), axis=1))[:2].tolist()
        raise bad(f"{field}['blocks']", f"{i} and {j} overlap (offsets {lo[i].tolist()} "
                                        f"and {lo[j].tolist()}, shapes {blocks[i]['shape']} "
                                        f"and {blocks[j]['shape']})")
