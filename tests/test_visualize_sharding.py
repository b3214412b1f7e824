"""visualize_sharding's grid, read back from the drawn text and held against each rank's block
found from its local values (the global tensor is np.arange, so a value is its own flat index).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from mpi4py import MPI

import dtensor
from dtensor import Partial, Replicate, Shard, StridedShard
from dtensor.dtensor import distribute_tensor

# (mesh shape, placements, tensor shape), all on 4 ranks
CASES = [
    ((2, 2), [Shard(0), Shard(1)], (4, 6)),
    ((2, 2), [Shard(1), Shard(0)], (4, 6)),
    ((2, 2), [Replicate(), Shard(0)], (4, 6)),
    ((2, 2), [Shard(0), Shard(0)], (4, 6)),  # dim 0 split by both mesh dims
    ((2, 2), [Shard(0), Shard(0)], (5, 3)),  # ... unevenly: 2, 1, 1, 1 rows
    ((2, 2), [Shard(1), Shard(1)], (3, 7)),
    ((2, 2), [Shard(1), Replicate()], (5, 3)),
    ((2, 2), [Partial(), Shard(1)], (4, 6)),
    ((2, 2), [Shard(0), Partial("max")], (5, 3)),
    ((2, 2), [StridedShard(0, 3), Shard(1)], (6, 6)),  # a rank's rows are 3 pieces
    ((4,), [Shard(0)], (5, 3)),  # rank 3 holds nothing
    ((4,), [Shard(1)], (2, 5)),
    ((4,), [Replicate()], (3, 2)),
    ((4,), [StridedShard(1, 2)], (3, 8)),
    ((2, 2), [Shard(0), Shard(0)], (7,)),
    ((2, 2), [Replicate(), Shard(0)], (6,)),
    ((4,), [Partial()], (5,)),
    ((4,), [StridedShard(0, 3)], (12,)),
]


def span(s: str) -> tuple[int, int]:
    a, b = s.split(":")
    return int(a), int(b)


def parse_grid(text: str) -> list:
    """The drawn grid read back: [(row range or None for 1-d, col range, ranks, size, marks)]."""
    lines = text.splitlines()
    top = next(k for k, s in enumerate(lines) if s.lstrip().startswith("+-"))
    margin = lines[top].index("+")
    cols = [span(h) for h in lines[top - 1].split()]
    cells, block = [], []
    for s in lines[top + 1:]:
        if s[margin:].startswith("+"):  # a row of cells ends
            row = "".join(b[:margin] for b in block).strip()
            texts = [b[margin + 1:].split("|")[:-1] for b in block]
            assert all(len(t) == len(cols) for t in texts), text
            for j, col in enumerate(cols):
                ranks, size, *marks = [t[j].strip() for t in texts]
                cells.append((span(row) if row else None, col, ranks, size, marks))
            block = []
        elif s[margin:].startswith("|"):
            block.append(s)
        else:
            break
    assert not block, text
    return cells


def held_by_rank(dt) -> dict:
    """{rank: the global positions its local block holds}, every rank's from its own values."""
    shape = dt.shape
    out = {}
    for r, local in MPI.COMM_WORLD.allgather((dt.device_mesh.get_rank(), dt.to_local().numpy())):
        out[r] = set(zip(*np.unravel_index(local.astype(int).ravel(), shape)))
    return out


def check_grid(text: str, shape: tuple, held: dict, partial: str) -> None:
    cells = parse_grid(text)
    cover = np.zeros(shape, dtype=int)
    for row, col, ranks, size, marks in cells:
        spans = [row, col] if len(shape) == 2 else [col]
        assert (row is None) == (len(shape) == 1)
        cover[tuple(slice(a, b) for a, b in spans)] += 1
        pos = set(itertools.product(*(range(a, b) for a, b in spans)))
        assert size == "x".join(str(b - a) for a, b in spans), (row, col, size)
        holders = sorted(r for r, h in held.items() if pos <= h)
        # a rank holds all of a cell or none of it, and the cell names exactly its holders
        assert all(not pos & h for r, h in held.items() if r not in holders), (row, col)
        assert ranks == ",".join(map(str, holders)), (row, col, ranks, holders)
        assert marks == ([partial] if partial else []), marks
    assert (cover == 1).all(), cover  # the cells tile the tensor once
    empty = sorted(r for r, h in held.items() if not h)
    assert (f"(ranks {empty} hold empty blocks)" in text) == bool(empty)


@pytest.mark.ranks(4, timeout=60)
def test_grid_matches_each_ranks_local_block(rank):
    for mesh_shape, placements, shape in CASES:
        mesh = dtensor.init_device_mesh("cpu", mesh_shape)
        x = np.arange(float(np.prod(shape))).reshape(shape)
        # A partial block's positions are its Replicate twin's (its values are a summand).
        twin = [Replicate() if isinstance(p, Partial) else p for p in placements]
        dt = distribute_tensor(x, mesh, twin)
        drawn = dt.redistribute(mesh, placements) if twin != placements else dt
        text = dtensor.visualize_sharding(drawn)
        partial = ",".join(dict.fromkeys(repr(p) for p in placements if isinstance(p, Partial)))
        try:
            check_grid(text, shape, held_by_rank(dt), partial)
        except AssertionError as e:
            raise AssertionError(f"{mesh_shape} {placements} {shape}:\n{text}") from e


def _grid(text: str) -> str:
    """The drawn grid: the text after the "-> ranks" list."""
    lines = text.splitlines()
    return "\n".join(lines[max(k for k, s in enumerate(lines) if "-> ranks" in s) + 1:])


@pytest.mark.ranks(4, timeout=60)
def test_exact_pictures_on_a_2x2_mesh(rank, capsys):
    mesh = dtensor.init_device_mesh("cpu", (2, 2))
    x = np.arange(24.0).reshape(4, 6)
    text = dtensor.visualize_sharding(distribute_tensor(x, mesh, [Shard(0), Shard(1)]))
    assert _grid(text) == """\
        0:3   3:6
      +-----+-----+
  0:2 |  0  |  1  |
      | 2x3 | 2x3 |
      +-----+-----+
  2:4 |  2  |  3  |
      | 2x3 | 2x3 |
      +-----+-----+"""
    assert (capsys.readouterr().out == text + "\n") == (rank == 0)  # printed on rank 0 only
    rs = distribute_tensor(x, mesh, [Replicate(), Shard(1)])
    assert _grid(dtensor.visualize_sharding(rs)) == """\
        0:3   3:6
      +-----+-----+
  0:4 | 0,2 | 1,3 |
      | 4x3 | 4x3 |
      +-----+-----+"""
    ps = rs.redistribute(mesh, [Partial(), Shard(1)])
    assert _grid(dtensor.visualize_sharding(ps)) == """\
         0:3      3:6
      +--------+--------+
      |  0,2   |  1,3   |
  0:4 |  4x3   |  4x3   |
      | P(sum) | P(sum) |
      +--------+--------+"""
    v = distribute_tensor(np.arange(7.0), mesh, [Shard(0), Shard(0)])
    assert _grid(dtensor.visualize_sharding(v)) == """\
    0:2   2:4   4:6   6:7
  +-----+-----+-----+-----+
  |  0  |  1  |  2  |  3  |
  |  2  |  2  |  2  |  1  |
  +-----+-----+-----+-----+"""


@pytest.mark.ranks(2, timeout=60)
def test_exact_uneven_and_strided_pictures_on_two_ranks(rank):
    mesh = dtensor.init_device_mesh("cpu", (2,))
    text = dtensor.visualize_sharding(distribute_tensor(np.zeros((5, 3)), mesh, [Shard(0)]))
    assert text.splitlines()[1:3] == ["  [0:3, 0:3] -> ranks [0]", "  [3:5, 0:3] -> ranks [1]"]
    assert _grid(text) == """\
        0:3
      +-----+
  0:3 |  0  |
      | 3x3 |
      +-----+
  3:5 |  1  |
      | 2x3 |
      +-----+"""
    # a strided block is drawn piece by piece: rank 0 holds 0:2 and 4:6 of the two parts
    s = distribute_tensor(np.zeros((2, 8)), mesh, [StridedShard(1, 2)])
    assert _grid(dtensor.visualize_sharding(s)) == """\
        0:2   2:4   4:6   6:8
      +-----+-----+-----+-----+
  0:2 |  0  |  1  |  0  |  1  |
      | 2x2 | 2x2 | 2x2 | 2x2 |
      +-----+-----+-----+-----+"""
    empty = dtensor.visualize_sharding(distribute_tensor(np.zeros((0, 3)), mesh, [Shard(0)]))
    assert empty.endswith("  (no grid: the tensor is empty)")
