"""dtensor.checkpoint never loses or exposes data: a save removes only what it wrote; a load
reads nothing outside its checkpoint, checks the metadata whole and each member's size and header
before reading data; collective saves and loads that cannot complete fail on every rank."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

import dtensor
from dtensor.checkpoint import CheckpointError

W = np.arange(12, dtype=np.float32).reshape(4, 3)  # saved as member a0 of rank0.npz
B = np.array([5.0, 6.0], np.float32)               # a1


def state(scale=0.0, step=0):
    return {"w": dtensor.tensor(W * scale), "b": dtensor.tensor(B * scale), "step": step}


def values(st):
    return st["w"].numpy(), st["b"].numpy(), st["step"]


def saved(root, scale=1.0, step=1):
    dtensor.checkpoint.save(state(scale, step), root)
    return Path(root)


def edit_meta(root, fn):
    path = Path(root) / "v1" / "metadata.json"
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def snapshot(top):
    """{relative path: what it is}: every entry under ``top``, symlinks not followed."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, top)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", Path(p).read_bytes())
    return out


# ----------------------------------------------------------------------------- look-alikes

def _folder(p, outside):
    p.mkdir()
    (p / "notes.txt").write_text(f"the user's {p.name}")


def _file(p, outside):
    p.write_text(f"the user's file {p.name}")


def _marked(p, outside, marker="dtensor-checkpoint"):
    _folder(p, outside)
    (p / ".dtensor-checkpoint").write_text(marker)


def _link_to_user_data(p, outside):
    target = outside / f"data_{p.name}"
    _marked(target, outside)  # even holding our marker: never deleted through a symlink
    p.symlink_to(target, target_is_directory=True)


def _marker_is_a_folder(p, outside):
    _folder(p, outside)
    (p / ".dtensor-checkpoint").mkdir()


def _marker_is_a_symlink(p, outside):
    _folder(p, outside)
    (outside / "real_marker").write_text("dtensor-checkpoint")
    (p / ".dtensor-checkpoint").symlink_to(outside / "real_marker")


LOOKALIKES = [  # (name in the checkpoint folder, how the user made it)
    ("videos", _folder),
    ("venv", _folder),
    ("vocab_data", _folder),
    ("v2_notes", _folder),
    ("v3", _file),                                       # our name, but a file
    ("v4", _link_to_user_data),                          # our name, a symlink
    ("v5.partial", _folder),                             # our name, no marker
    ("v01", _marked),                                    # marker, name not exactly ours
    ("v1.bak", _marked),
    ("v2.partial.old", _marked),
    ("LATEST.bak", _file),
    ("LATEST.new", _file),
    ("v6", _marker_is_a_folder),
    ("v7.partial", _marker_is_a_symlink),
    ("v8", lambda p, o: _marked(p, o, marker="something else")),
    ("v9.partial", _file),
]


def test_saves_remove_nothing_but_their_own_versions(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    for name, make in LOOKALIKES:
        make(root / name, outside)
    before, before_outside = snapshot(root), snapshot(outside)
    # Versions go past every name a version could take (v9.partial): none is reused.
    written = [dtensor.checkpoint.save(state(1.0 + i, step=i), root) for i in range(3)]
    assert written == ["v10", "v11", "v12"]
    after = snapshot(root)
    for name, _ in LOOKALIKES:
        mine = {k: v for k, v in before.items() if k == name or k.startswith(name + "/")}
        assert {k: after.get(k) for k in mine} == mine, name
    assert snapshot(outside) == before_outside
    assert sorted(set(os.listdir(root)) - {n for n, _ in LOOKALIKES}) == ["LATEST", "v12"]
    st = state()
    dtensor.checkpoint.load(st, root)
    np.testing.assert_array_equal(st["w"].numpy(), W * 3.0)


def test_a_crashed_saves_own_partial_folder_is_removed(tmp_path):
    saved(tmp_path)
    (tmp_path / "v2.partial").mkdir()  # what a save killed mid-way leaves: marker first
    (tmp_path / "v2.partial" / ".dtensor-checkpoint").write_text("dtensor-checkpoint")
    (tmp_path / "v2.partial" / "rank0.npz").write_bytes(b"half")
    assert dtensor.checkpoint.save(state(2.0), tmp_path) == "v3"
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v3"]


def _link_latest(root, outside):
    (outside / "mine").write_text("v1")  # even holding a version's name
    (root / "LATEST").symlink_to(outside / "mine")


FOREIGN_LATEST = [  # (name, make(root, outside), what the error says of it)
    ("another tool's", lambda r, o: (r / "LATEST").write_text("global_step500\n"),
     r"LATEST holds b'global_step500\\n', not the name of a version folder"),
    ("empty", lambda r, o: (r / "LATEST").write_text(""), r"LATEST holds b''"),
    ("a symlink", _link_latest, r"LATEST is a symlink"),
    ("a folder", lambda r, o: (r / "LATEST").mkdir(), r"LATEST is not a regular file"),
]


@pytest.mark.parametrize("make,pattern", [c[1:] for c in FOREIGN_LATEST],
                         ids=[c[0] for c in FOREIGN_LATEST])
def test_a_save_never_replaces_a_latest_it_did_not_write(tmp_path, make, pattern):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    make(root, outside)
    before, before_outside = snapshot(root), snapshot(outside)
    with pytest.raises(CheckpointError, match=r"checkpoint\.save: .*" + pattern + r".* A save "
                       r"never replaces a LATEST it did not write: save to another folder\."):
        dtensor.checkpoint.save(state(1.0), root)
    assert snapshot(root) == before and snapshot(outside) == before_outside


def _user_checkpoint(folder):
    saved(folder / "mine", scale=3.0, step=3)


USER_DATA_IN_VERSIONS = [  # (name, folder of ours, what the user puts in it)
    ("notes in an old version", "v1", lambda f: (f / "NOTES.txt").write_text("run notes")),
    ("a checkpoint in an old version", "v1", _user_checkpoint),
    ("a folder named like a shard", "v1", lambda f: (f / "rank0.npz").rename(f / "x") or
     (f / "rank0.npz").mkdir()),
    ("notes in a crashed save's folder", "v2.partial",
     lambda f: (f / "NOTES.txt").write_text("run notes")),
]


@pytest.mark.parametrize("folder,put", [c[1:] for c in USER_DATA_IN_VERSIONS],
                         ids=[c[0] for c in USER_DATA_IN_VERSIONS])
def test_a_save_removes_only_the_files_a_save_wrote(tmp_path, folder, put):
    saved(tmp_path)
    f = tmp_path / folder
    if folder.endswith(".partial"):  # what a save killed mid-way leaves: marker first
        f.mkdir()
        (f / ".dtensor-checkpoint").write_text("dtensor-checkpoint")
        (f / "rank0.npz").write_bytes(b"half")
    ours = set(os.listdir(f)) - {".dtensor-checkpoint"}
    put(f)
    users = {k: v for k, v in snapshot(f).items() if k.split("/")[0] not in ours}
    dtensor.checkpoint.save(state(2.0, 2), tmp_path)
    dtensor.checkpoint.save(state(4.0, 4), tmp_path)  # and the next save leaves them too
    left = snapshot(f)
    assert {k: left.get(k) for k in users} == users
    assert set(left) - set(users) == {".dtensor-checkpoint"} - set(users)  # ours went
    if (f / "mine").exists():
        st = state()
        dtensor.checkpoint.load(st, f / "mine")
        assert st["step"] == 3


@pytest.mark.parametrize("env,several", [
    ({}, False), ({"WORLD_SIZE": "2"}, True), ({"PMI_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, True), ({"PMI_SIZE": "1"}, False),
    ({"WORLD_SIZE": "two"}, False),
], ids=["none", "WORLD_SIZE", "MPICH PMI_SIZE", "Open MPI", "PMI_SIZE 1", "garbage"])
def test_a_launchers_world_size_makes_save_collective(monkeypatch, env, several):
    from dtensor.distributed import _LAUNCHER_SIZES, _several_ranks
    for name in _LAUNCHER_SIZES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _several_ranks() is several


def test_save_onto_a_file_names_the_path(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"the user's file")
    with pytest.raises(NotADirectoryError, match=re.escape(str(path)) + " exists and is not a"):
        dtensor.checkpoint.save(state(1.0), path)
    assert path.read_bytes() == b"the user's file"


# ----------------------------------------------------------------------------- path attacks

def _latest(text):
    def attack(root, decoy):
        (root / "LATEST").write_text(text if isinstance(text, str) else text(decoy))
    return attack


def _replace_with(rel, how):
    """Replace ``root/rel`` by a FIFO, a folder, or a symlink to the decoy's ``rel``."""
    def attack(root, decoy):
        p = root / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        if how == "fifo":
            os.mkfifo(p)
        elif how == "folder":
            p.mkdir()
        else:
            p.symlink_to(decoy / rel)
            if rel == "v1/rank0.npz":  # and the checksums the decoy's, so it would load
                _take_decoy_crcs(root, decoy)
    return attack


def _take_decoy_crcs(root, decoy):
    theirs = json.loads((decoy / "v1" / "metadata.json").read_text())

    def fn(meta):
        for k, t in meta["tensors"].items():
            for b, d in zip(t["blocks"], theirs["tensors"][k]["blocks"]):
                b["crc32"] = d["crc32"]
    edit_meta(root, fn)


def _shard_name(name):
    def attack(root, decoy):
        _take_decoy_crcs(root, decoy)

        def fn(meta):
            meta["tensors"]["w"]["blocks"][0]["file"] = (name if isinstance(name, str)
                                                         else name(decoy))
        edit_meta(root, fn)
    return attack


def _entry(name):
    return lambda root, decoy: edit_meta(
        root, lambda m: m["tensors"]["w"]["blocks"][0].__setitem__("entry", name))


PATH_ATTACKS = [  # (name, attack(root, decoy), what the error names)
    ("LATEST ../..", _latest("../.."), r"LATEST holds b'\.\./\.\.', not the name of a version"),
    ("LATEST into the decoy", _latest("../decoy/v1"), r"LATEST holds b'\.\./decoy/v1'"),
    ("LATEST absolute", _latest(lambda d: str(d / "v1")), r"LATEST holds b'/.*/decoy/v1'"),
    ("LATEST /etc", _latest("/etc"), r"LATEST holds b'/etc'"),
    ("LATEST ../x", _latest("../x"), r"LATEST holds b'\.\./x'"),
    ("LATEST v1 + junk", _latest("v1" + " " * 300 + "x"), r"LATEST holds b'v1 "),
    ("LATEST a FIFO", _replace_with("LATEST", "fifo"), r"LATEST is not a regular file"),
    ("LATEST a symlink", _replace_with("LATEST", "link"), r"LATEST is a symlink"),
    ("version a symlink", _replace_with("v1", "link"),
     r"v1 \(named by LATEST\) is not a folder of this checkpoint but a symlink"),
    ("metadata a symlink", _replace_with("v1/metadata.json", "link"),
     r"v1/metadata\.json is a symlink"),
    ("metadata a FIFO", _replace_with("v1/metadata.json", "fifo"),
     r"v1/metadata\.json is not a regular file"),
    ("file ../..", _shard_name("../../decoy/v1/rank0.npz"),
     r"\['blocks'\]\[0\]\['file'\] is '\.\./\.\./decoy/v1/rank0\.npz', not 'rank<r>\.npz'"),
    ("file absolute", _shard_name(lambda d: str(d / "v1" / "rank0.npz")),
     r"\['blocks'\]\[0\]\['file'\] is '/.*/decoy/v1/rank0\.npz'"),
    ("file of no rank", _shard_name("rank1.npz"),
     r"\['file'\] is 'rank1\.npz', not 'rank<r>\.npz' for a rank r of the 1 that saved"),
    ("file rank01", _shard_name("rank01.npz"), r"\['file'\] is 'rank01\.npz'"),
    ("shard a FIFO", _replace_with("v1/rank0.npz", "fifo"),
     r"rank0\.npz, the 'file' of block 0 of 'w', is not a regular file"),
    ("shard a folder", _replace_with("v1/rank0.npz", "folder"),
     r"rank0\.npz, the 'file' of block 0 of 'w', is not a regular file"),
    ("shard a symlink out", _replace_with("v1/rank0.npz", "link"),
     r"rank0\.npz, the 'file' of block 0 of 'w', is a symlink"),
    ("entry ../a0", _entry("../a0"), r"\['blocks'\]\[0\]\['entry'\] is '\.\./a0', not 'a<n>'"),
    ("entry a0.npy", _entry("a0.npy"), r"\['entry'\] is 'a0\.npy'"),
]


@pytest.mark.timeout(60)  # a FIFO that blocked the load would hang here
@pytest.mark.parametrize("attack,pattern", [c[1:] for c in PATH_ATTACKS],
                         ids=[c[0] for c in PATH_ATTACKS])
def test_paths_from_the_checkpoint_never_lead_outside_it(tmp_path, attack, pattern):
    root, decoy = saved(tmp_path / "ckpt"), saved(tmp_path / "decoy", scale=100.0, step=99)
    st = state()
    dtensor.checkpoint.load(st, root)  # the checkpoint is good before the attack
    np.testing.assert_array_equal(st["w"].numpy(), W)
    attack(root, decoy)
    st = state()
    with pytest.raises(CheckpointError, match=pattern):
        dtensor.checkpoint.load(st, root)
    w, b, step = values(st)  # nothing was loaded, the decoy's values least of all
    assert not w.any() and not b.any() and step == 0


# ----------------------------------------------------------------------------- metadata

def _set(*path_and_value):
    *path, value = path_and_value

    def fn(meta):
        d = meta
        for k in path[:-1]:
            d = d[k]
        if value is _DELETE:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return fn


_DELETE = object()
WB = ("tensors", "w", "blocks")


def _blocks(*boxes):
    """w saved as these (offsets, shape) blocks, all pointing at the real member, by as many
    ranks (a rank writes at most one block of a tensor)."""
    def fn(meta):
        b0 = meta["tensors"]["w"]["blocks"][0]
        meta["world_size"] = max(len(boxes), 1)
        meta["tensors"]["w"]["blocks"] = [dict(b0, offsets=list(o), shape=list(s))
                                          for o, s in boxes]
    return fn


def _foreign(meta):
    meta.clear()
    meta["x"] = 0


META_ATTACKS = [  # (name, edit of metadata.json, what the error names)
    ("overlap, same volume", _blocks(((0, 0), (2, 3)), ((1, 0), (2, 3))),
     r"tensors\['w'\]\['blocks'\] 0 and 1 overlap \(offsets \[0, 0\] and \[1, 0\]"),
    ("overlap, extra block", _blocks(((0, 0), (4, 3)), ((0, 0), (2, 3))),
     r"tensors\['w'\]\['blocks'\] hold 18 elements but the shape \[4, 3\] has 12"),
    ("gap", _blocks(((0, 0), (3, 3))), r"hold 9 elements but the shape \[4, 3\] has 12"),
    ("no blocks", _set(*WB, []), r"tensors\['w'\]\['blocks'\] hold 0 elements"),
    ("block past the shape", _blocks(((2, 0), (4, 3))),
     r"\['blocks'\]\[0\] \(offsets \[2, 0\], shape \[4, 3\]\) reaches past the global shape"),
    ("shape a string", _set("tensors", "w", "shape", "4,3"),
     r"tensors\['w'\]\['shape'\] is '4,3', not a list"),
    ("negative shape", _set("tensors", "w", "shape", [-4, 3]),
     r"tensors\['w'\]\['shape'\] is \[-4, 3\], not integers in \[0, 2\*\*62\)"),
    ("huge shape", _set("tensors", "w", "shape", [2**70, 3]), r"\['shape'\] is \[1180591"),
    ("bool offsets", _set(*WB, 0, "offsets", [False, False]),
     r"\['blocks'\]\[0\]\['offsets'\] is \[False, False\], not 2 integers"),
    ("float offsets", _set(*WB, 0, "offsets", [0.0, 0]), r"\['offsets'\] is \[0\.0, 0\]"),
    ("negative offset", _set(*WB, 0, "offsets", [-1, 0]), r"\['offsets'\] is \[-1, 0\]"),
    ("extra ndim", _set(*WB, 0, "offsets", [0, 0, 0]),
     r"\['offsets'\] is \[0, 0, 0\], not 2 integers"),
    ("block shape short", _set(*WB, 0, "shape", [12]), r"\['blocks'\]\[0\]\['shape'\] is \[12\]"),
    ("missing tensors", _set("tensors", _DELETE), r"the metadata has no 'tensors' key"),
    ("missing values", _set("values", _DELETE), r"the metadata has no 'values' key"),
    ("missing blocks", _set("tensors", "w", "blocks", _DELETE),
     r"tensors\['w'\] has no 'blocks' key"),
    ("missing dtype", _set("tensors", "w", "dtype", _DELETE), r"tensors\['w'\] has no 'dtype'"),
    ("missing crc", _set(*WB, 0, "crc32", _DELETE), r"\['blocks'\]\[0\] has no 'crc32' key"),
    ("object dtype", _set("tensors", "w", "dtype", "|O"),
     r"tensors\['w'\]\['dtype'\] is '\|O', not a numeric dtype"),
    ("string dtype", _set("tensors", "w", "dtype", "<U5"), r"\['dtype'\] is '<U5'"),
    ("crc a string", _set(*WB, 0, "crc32", "0x1234"), r"\['crc32'\] is '0x1234', not an integer"),
    ("crc too big", _set(*WB, 0, "crc32", 2**40), r"\['crc32'\] is 1099511627776, not a CRC-32"),
    ("world_size a bool", _set("world_size", True), r"\['world_size'\] is True, not an integer"),
    ("tensors a list", _set("tensors", [1, 2]), r"\['tensors'\] is \[1, 2\], not a JSON object"),
    ("tensor a list", _set("tensors", "w", [1, 2]),
     r"tensors\['w'\] is \[1, 2\], not a JSON object"),
    ("block a string", _set(*WB, 0, "x"), r"tensors\['w'\]\['blocks'\]\[0\] is 'x'"),
    ("placements numbers", _set("tensors", "w", "placements", [0]),
     r"\['placements'\] is \[0\], not a list of names"),
    ("mesh shape zero", _set("tensors", "w", "mesh_shape", [0]), r"\['mesh_shape'\] is \[0\]"),
    ("version a bool", _set("version", True), r"has format version True"),
    ("key a tensor and a value", _set("values", "w", [1, 2]),
     r"tensors\['w'\] is also in values: a key is a tensor or a JSON value, not both"),
    ("more blocks than ranks", _set(*WB, [{}] * 2),
     r"tensors\['w'\]\['blocks'\] has 2 blocks, more than the 1 each of the 1 ranks"),
    ("world_size zero", _set("world_size", 0), r"\['world_size'\] is 0, not a number of ranks"),
    ("world_size huge", _set("world_size", 10**30), r"\['world_size'\] is 10{30}, not a"),
    ("not our format", _foreign, r"has format None, not 'dtensor-checkpoint'"),
]


@pytest.mark.parametrize("edit,pattern", [c[1:] for c in META_ATTACKS],
                         ids=[c[0] for c in META_ATTACKS])
def test_metadata_is_checked_whole_before_any_block_is_read(tmp_path, edit, pattern):
    root = saved(tmp_path)
    edit_meta(root, edit)
    (root / "v1" / "rank0.npz").unlink()  # so reading any block first would say "missing"
    st = state()
    with pytest.raises(CheckpointError, match=pattern):
        dtensor.checkpoint.load(st, root)
    assert not values(st)[0].any()


@pytest.mark.parametrize("text,pattern", [
    (b"[" * 100_000, r"metadata\.json is not valid JSON"),
    (b"\xff\xfe{", r"metadata\.json is not valid JSON"),
    (b"[1, 2]", r"the metadata is a list, not a JSON object"),
])
def test_metadata_that_is_not_a_json_object(tmp_path, text, pattern):
    root = saved(tmp_path)
    (root / "v1" / "metadata.json").write_bytes(text)
    with pytest.raises(CheckpointError, match=pattern):
        dtensor.checkpoint.load(state(), root)


@pytest.mark.parametrize("old,new,key", [
    ('"values": {', '"values": {"step": 7, ', "step"),
    ('{"format"', '{"world_size": 1, "format"', "world_size"),
    ('"crc32": ', '"crc32": 0, "crc32": ', "crc32"),
], ids=["in values", "top level", "in a block"])
def test_a_key_twice_in_one_json_object_is_refused(tmp_path, old, new, key):
    root = saved(tmp_path)  # json keeps the last of two equal keys: which one is meant?
    path = root / "v1" / "metadata.json"
    path.write_text(path.read_text().replace(old, new, 1))
    st = state()
    with pytest.raises(CheckpointError, match=rf"metadata\.json: the key '{key}' appears twice "
                                              r"in one JSON object"):
        dtensor.checkpoint.load(st, root)
    assert values(st)[2] == 0


def test_metadata_past_the_size_cap_is_not_read(tmp_path):
    root = saved(tmp_path)
    path = root / "v1" / "metadata.json"
    with open(path, "r+b") as f:
        f.truncate(300 << 20)  # sparse: 300 MB to stat, nothing to write
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"metadata\.json is 314572800 bytes, more "
                                                  r"than the 268435456 a checkpoint's metadata"):
            dtensor.checkpoint.load(state(), root)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def _grid(rows, cols, n_rows, n_cols):
    """``rows`` x ``cols`` equal blocks of a [n_rows, n_cols] tensor, row-major."""
    h, w = n_rows // rows, n_cols // cols
    return [((i * h, j * w), (h, w)) for i in range(rows) for j in range(cols)]


def _brick(n):
    """Two rows of a [2, 2n] tensor cut at even columns in row 0 and odd ones in row 1."""
    return ([((0, 2 * j), (1, 2)) for j in range(n)]
            + [((1, 0), (1, 1))] + [((1, 2 * j + 1), (1, 2)) for j in range(n - 1)]
            + [((1, 2 * n - 1), (1, 1))])


TILINGS = [  # (name, global shape, (offsets, shape) blocks, error or None: a valid tiling)
    ("60k rows", (60_000, 1), _grid(60_000, 1, 60_000, 1), None),
    ("60k, 245x245 grid", (245, 245 * 4), _grid(245, 245, 245, 245 * 4), None),
    ("60k, last overlaps the first", (60_000, 1),
     _grid(60_000, 1, 60_000, 1)[:-1] + [((0, 0), (1, 1))],
     r"\['blocks'\] 0 and 59999 overlap \(offsets \[0, 0\] and \[0, 0\]"),
    ("60k, overlap mid-way", (60_000, 1),
     _grid(60_000, 1, 60_000, 1)[:30_000] + [((29_999, 0), (2, 1))]
     + _grid(60_000, 1, 60_000, 1)[30_002:],
     r"\['blocks'\] 29999 and 30000 overlap"),
    ("bricks", (2, 200), _brick(100), None),
    ("bricks past the grid cap", (2, 60_000), _brick(30_000),
     r"cut the shape \[2, 60000\] into 120000 pieces, more than the 100000 a save's mesh "
     r"sharding makes: the block layout is too fragmented"),
]


@pytest.mark.parametrize("shape,boxes,pattern", [c[1:] for c in TILINGS],
                         ids=[c[0] for c in TILINGS])
def test_the_tiling_check_is_linear_in_the_blocks(tmp_path, monkeypatch, shape, boxes, pattern):
    import dtensor._checkpoint_meta as meta_mod
    monkeypatch.setattr(meta_mod, "_GRID_MAX", 100_000)  # so a fragmented layout stays small
    root = saved(tmp_path)

    def fn(meta):
        meta["tensors"]["w"]["shape"] = list(shape)
        _blocks(*boxes)(meta)  # and a world_size of as many ranks
    edit_meta(root, fn)
    (root / "v1" / "rank0.npz").unlink()  # a valid tiling then fails at its first block
    t = time.perf_counter()
    with pytest.raises(CheckpointError,
                       match=pattern or r"rank0\.npz is missing \(block 0 of 'w'\)"):
        dtensor.checkpoint.load({**state(), "w": dtensor.tensor(np.zeros(shape, np.float32))},
                                root)
    # Linear: the tiling takes ~50 ms of it, the per-field checks and JSON ~15 us a block (a
    # pairwise check took 73 s). Only a forged world_size gets this far: blocks <= ranks.
    assert time.perf_counter() - t < 5.0


# ----------------------------------------------------------------------------- kinds of values

def _move_w_to_values(meta):
    meta["values"]["w"] = 5
    del meta["tensors"]["w"]


KINDS = [  # (name, edit, the state's step, step after the load or the error)
    ("a value for a tensor", _move_w_to_values, 0,
     r"'w' is a tensor in the state but int 5 in the checkpoint"),
    ("a dict for an int", _set("values", "step", {"x": [[1]]}), 0,
     r"'step' is int 0 in the state but dict \{'x': \[\[1\]\]\} in the checkpoint"),
    ("NaN for an int", _set("values", "step", float("nan")), 0,
     r"'step' is int 0 in the state but float nan"),
    ("a string for an int", _set("values", "step", "1"), 0, r"'step' is int 0 .* but str '1'"),
    ("null for an int", _set("values", "step", None), 0, r"'step' is int 0 .* but NoneType"),
    ("a bool for an int", _set("values", "step", True), 0, r"'step' is int 0 .* but bool True"),
    ("an int for a bool", _set("values", "step", 1), False, r"'step' is bool False .* but int"),
    ("a number for a string", _set("values", "step", 3), "a", r"'step' is str 'a' .* but int 3"),
    ("an int for a float", _set("values", "step", 1), 0.5, 1),
    ("a float for an int", _set("values", "step", 2.5), 0, 2.5),
    ("NaN for a float", _set("values", "step", float("nan")), 0.5, "nan"),
    ("anything for None", _set("values", "step", {"x": [1]}), None, {"x": [1]}),
]


@pytest.mark.parametrize("edit,before,after", [c[1:] for c in KINDS], ids=[c[0] for c in KINDS])
def test_a_saved_value_loads_only_into_its_own_kind(tmp_path, edit, before, after):
    root = saved(tmp_path)
    edit_meta(root, edit)
    st = {**state(), "step": before}
    if isinstance(after, str) and after != "nan":
        with pytest.raises(CheckpointError, match=after):
            dtensor.checkpoint.load(st, root)
        assert not st["w"].numpy().any() and st["step"] is before
    else:
        dtensor.checkpoint.load(st, root)
        assert st["step"] == after or after == "nan" and st["step"] != st["step"]
        np.testing.assert_array_equal(st["w"].numpy(), W)


COLLIDING = [  # (name, state, what the error names)
    ("dotted key and nesting", lambda: {"a.b": dtensor.tensor(B), "a": {"b": dtensor.tensor(W)}},
     r"state\['a.b'\] and state\['a'\]\['b'\] are both saved as 'a.b'"),
    ("int and str key", lambda: {1: dtensor.tensor(B), "1": 5},
     r"state\[1\] and state\['1'\] are both saved as '1'"),
    ("list index", lambda: {"a": [dtensor.tensor(B)], "a.0": 1},
     r"state\['a'\]\[0\] and state\['a.0'\] are both saved as 'a.0'"),
]


@pytest.mark.parametrize("make,pattern", [c[1:] for c in COLLIDING],
                         ids=[c[0] for c in COLLIDING])
def test_keys_that_flatten_alike_are_refused(tmp_path, make, pattern):
    with pytest.raises(CheckpointError, match=pattern + r"; one would be lost"):
        dtensor.checkpoint.save(make(), tmp_path / "new")
    assert not (tmp_path / "new").exists()
    root = saved(tmp_path / "old")
    with pytest.raises(CheckpointError, match=pattern):
        dtensor.checkpoint.load(make(), root)


# ----------------------------------------------------------------------------- planted members

def _plant(root, shape, dtype, data: bytes | int, compress=False):
    """Rewrite rank0.npz with member a0.npy holding an .npy header for ``shape`` ``dtype`` and
    then ``data`` (bytes, or that many zero bytes streamed); a1.npy stays as saved."""
    path = root / "v1" / "rank0.npz"
    with zipfile.ZipFile(path) as z:
        a1 = z.read("a1.npy")
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method, compresslevel=1 if compress else None) as z:
        with z.open("a0.npy", "w", force_zip64=True) as m:
            np.lib.format.write_array_header_1_0(
                m, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape})
            if isinstance(data, bytes):
                m.write(data)
            else:
                chunk = bytes(1 << 20)
                for _ in range(data >> 20):
                    m.write(chunk)
        z.writestr("a1.npy", a1)
    return path


BOMB = 128 << 20  # inflated bytes of the planted member (a 6.7 MB one took 1.5 GB of RSS)

PLANTED = [  # (name, plant arguments, what the error names)
    ("deflate bomb", ((BOMB // 4,), "<f4", BOMB, True),
     rf"block 0 of 'w'\): member 'a0\.npy' inflates to {BOMB + 128} bytes, but the block of "
     r"shape \[4, 3\] float32 takes 48 plus a header"),
    ("stored, oversized", ((4, 3), "<f4", 1 << 20, False),
     r"member 'a0\.npy' inflates to 1048704 bytes"),
    ("header shape huge", ((100_000, 100_000), "<f4", bytes(48), False),
     r"the \.npy header says shape \[100000, 100000\] float32, the metadata \[4, 3\] float32"),
    ("header dtype", ((2, 3), "<f8", bytes(48), False),
     r"header says shape \[2, 3\] float64, the metadata \[4, 3\] float32"),
    ("header object", ((4, 3), "|O", bytes(48), False), r"header says shape \[4, 3\] object"),
    ("trailing data", ((4, 3), "<f4", bytes(48 + 1000), False),
     r"the member holds 1048 bytes of data, the block needs 48"),
    ("short data", ((4, 3), "<f4", bytes(40), False),
     r"the member holds 40 bytes of data, the block needs 48"),
]


def _central_entry(root, field_offset, value):
    """Set a 2-byte field of a0.npy's central directory entry in rank0.npz."""
    path = root / "v1" / "rank0.npz"
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while data[at + 46:at + 52] != b"a0.npy":
        at = data.find(b"PK\x01\x02", at + 1)
    data[at + field_offset:at + field_offset + 2] = value.to_bytes(2, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("field,value,pattern", [
    (8, 1, r"rank0\.npz cannot be read for 'w': .*RuntimeError: File .*a0\.npy.* is encrypted"),
    (10, 99, r"rank0\.npz cannot be read for 'w': .*NotImplementedError: .*compression"),
], ids=["encrypted", "unknown compression"])
def test_a_member_zipfile_cannot_open_is_a_checkpoint_error(tmp_path, field, value, pattern):
    root = saved(tmp_path)
    _central_entry(root, field, value)
    with pytest.raises(CheckpointError, match=pattern):
        dtensor.checkpoint.load(state(), root)


@pytest.mark.parametrize("args,pattern", [c[1:] for c in PLANTED], ids=[c[0] for c in PLANTED])
def test_a_planted_member_fails_before_its_data_is_read(tmp_path, args, pattern):
    root = saved(tmp_path)
    _plant(root, *args)
    st = state()
    tracemalloc.start()
    t = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=pattern):
            dtensor.checkpoint.load(st, root)
        took = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 1.0 and peak < 4 << 20, (took, peak)  # the bomb is never inflated
    assert not values(st)[0].any()


# ----------------------------------------------------------------------------- on 2 ranks

def _dstate(placements="S", scale=0.0, step=0, shape=(4, 3), dtype=None):
    from dtensor.dtensor import distribute_tensor
    from dtensor.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w = np.arange(np.prod(shape), dtype=dtype or np.float32).reshape(shape) * scale
    p = [dtensor.Shard(0)] if placements == "S" else [dtensor.Replicate()]
    return {"w": distribute_tensor(dtensor.tensor(w), mesh, p),
            "b": distribute_tensor(dtensor.tensor(B * scale), mesh, [dtensor.Replicate()]),
            "step": step}


def _dvalues(st):
    return st["w"].full_tensor().numpy(), st["b"].full_tensor().numpy(), st["step"]


def _same_everywhere(comm, error):
    got = comm._c.allgather((type(error).__name__, str(error)))
    assert got[0] == got[1], got


@pytest.mark.ranks(2, timeout=120)
def test_save_onto_a_file_fails_on_every_rank(comm, rank, tmp_path):
    path = tmp_path / "model.bin"
    if rank == 0:
        path.write_bytes(b"the user's file")
    comm.barrier()
    # Every rank finds the file itself: each raises its own (identical) error.
    with pytest.raises(NotADirectoryError, match=r"^(checkpoint\.save failed on rank 0: )?"
                       r"checkpoint\.save: " + re.escape(str(path)) + " exists and is not a") as e:
        dtensor.checkpoint.save(_dstate(scale=1.0), path)
    _same_everywhere(comm, e.value)
    assert path.read_bytes() == b"the user's file"


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("call", ["save", "load"])
def test_a_call_on_rank_0_only_times_out_there_instead_of_hanging(comm, rank, tmp_path, call):
    root = tmp_path / "ckpt"
    st = _dstate(scale=1.0)
    if call == "load":
        dtensor.checkpoint.save(st, root)
    fresh = _dstate()  # init_device_mesh and distribute_tensor are collective themselves
    gave_up = tmp_path / "rank0_gave_up"
    if rank == 0:
        with _env("DTENSOR_COLLECTIVE_TIMEOUT", "0.5"):
            t = time.perf_counter()
            with pytest.raises(TimeoutError, match=rf"checkpoint\.{call} is collective: every "
                               r"rank of the group \[0, 1\] must call it, and rank 0 waited "
                               r"0\.5 s"):
                getattr(dtensor.checkpoint, call)(fresh, root)
            assert time.perf_counter() - t < 5
        gave_up.touch()
    else:
        while not gave_up.exists():
            time.sleep(0.01)
        comm._allgather_digest("late", np.zeros(1, np.int64))  # completes rank 0's request
    comm.barrier()
    if call == "save":
        assert not root.exists()  # rank 0 wrote nothing
    else:
        assert sorted(os.listdir(root)) == ["LATEST", "v1"] and not _dvalues(fresh)[0].any()


@pytest.mark.ranks(2, timeout=120)
def test_ranks_that_pass_different_arguments_fail_together(comm, rank, tmp_path):
    root = tmp_path / "ckpt"
    # (name, each rank's (state, path), what the error names). distribute_tensor is collective
    # and checks its own arguments, so every rank builds both ranks' tensors.
    cases = [
        ("path", [(_dstate(), tmp_path / f"ck{r}") for r in (0, 1)],
         r"path: \S*/ck0 on ranks \[0\], \S*/ck1 on ranks \[1\]"),
        ("keys", [(_dstate(), root), ({**_dstate(), "extra": 1}, root)],
         r"values: \['step'\] on ranks \[0\], \['step', 'extra'\] on ranks \[1\]"),
        ("shape", [(_dstate(), root), (_dstate(shape=(6, 3)), root)],
         r"tensors: .*'shape': \[4, 3\].* on ranks \[0\], .*'shape': \[6, 3\].* on ranks "
         r"\[1\]"),
        ("dtype", [(_dstate(), root), (_dstate(dtype=np.float64), root)],
         r"tensors: .*'<f4'.* on ranks \[0\], .*'<f8'.* on ranks \[1\]"),
        ("placements", [(_dstate(), root), (_dstate(placements="R"), root)],
         r"tensors: .*\['S\(0\)'\].* on ranks \[0\], .*\['R'\].* on ranks \[1\]"),
    ]
    for name, per_rank, pattern in cases:
        st, path = per_rank[rank]
        for call in ("save", "load"):
            with pytest.raises(ValueError, match=rf"checkpoint\.{call}: ranks passed different "
                               rf"arguments \({pattern}\)\.") as info:
                getattr(dtensor.checkpoint, call)(st, path)
            _same_everywhere(comm, info.value)
    comm.barrier()
    assert not root.exists() and not (tmp_path / "ck0").exists()


@pytest.mark.ranks(2, timeout=120)
def test_a_load_that_fails_on_one_rank_fails_on_both_and_changes_nothing(comm, rank, tmp_path):
    dtensor.checkpoint.save(_dstate(scale=1.0, step=1), tmp_path)
    if rank == 0:  # rank 1 alone reads rank1.npz (rows 2-3 of w)
        shard = tmp_path / "v1" / "rank1.npz"
        with zipfile.ZipFile(shard) as z:
            at = shard.read_bytes().find(z.read("a0.npy")[128:])
        data = bytearray(shard.read_bytes())
        data[at] ^= 0xFF
        shard.write_bytes(bytes(data))
    comm.barrier()
    st = _dstate()
    with pytest.raises(CheckpointError, match=r"checkpoint\.load failed on rank 1: .*rank1\.npz "
                                              r"cannot be read for 'w': checksum mismatch") as e:
        dtensor.checkpoint.load(st, tmp_path)
    _same_everywhere(comm, e.value)
    w, b, step = _dvalues(st)
    assert not w.any() and not b.any() and step == 0


@contextlib.contextmanager
def _patched(target, name, when, error):
    real = getattr(target, name)

    def fake(*args, **kwargs):
        if when(*args):
            raise error
        return real(*args, **kwargs)
    setattr(target, name, fake)
    try:
        yield
    finally:
        setattr(target, name, real)


def _fd_is(suffix):
    return lambda fd: os.readlink(f"/proc/self/fd/{fd}").endswith(suffix)


def _no_space():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _denied():
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES))


DISK_FAILURES = [  # (name, failing rank, (target, function, when, error), type, path named)
    ("shard, disk full", 1, (np, "savez", lambda *a: True, _no_space), OSError,
     r"v2\.partial/rank1\.npz"),
    ("shard, denied", 0, (np, "savez", lambda *a: True, _denied), PermissionError,
     r"v2\.partial/rank0\.npz"),
    ("partial folder, denied", 0, (os, "mkdir", lambda p, *a: str(p).endswith(".partial"),
                                   _denied), PermissionError, r"v2\.partial'"),
    ("marker, disk full", 0, (os, "fsync", _fd_is(".dtensor-checkpoint"), _no_space), OSError,
     r"v2\.partial'"),
    ("metadata, disk full", 0, (os, "fsync", _fd_is("metadata.json"), _no_space), OSError,
     r"v2\.partial/metadata\.json"),
    ("rename, denied", 0, (os, "rename", lambda *a: True, _denied), PermissionError, r"v2'"),
    ("LATEST, disk full", 0, (os, "fsync", _fd_is("LATEST.new"), _no_space), OSError,
     r"LATEST'"),
    ("LATEST replace, denied", 0, (os, "replace", lambda *a: True, _denied), PermissionError,
     r"LATEST'"),
]


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("failing,patch,kind,named", [c[1:] for c in DISK_FAILURES],
                         ids=[c[0] for c in DISK_FAILURES])
def test_a_save_that_fails_midway_keeps_the_previous_checkpoint(comm, rank, tmp_path, failing,
                                                                patch, kind, named):
    dtensor.checkpoint.save(_dstate(scale=1.0, step=1), tmp_path)
    target, name, when, error = patch
    newer = _dstate(scale=2.0, step=2)
    with pytest.raises(OSError) as info:
        with (_patched(target, name, when, error()) if rank == failing
              else contextlib.nullcontext()):
            dtensor.checkpoint.save(newer, tmp_path)
    assert type(info.value) is kind
    assert re.search(rf"checkpoint\.save failed on rank {failing}: \[Errno \d+\] .*/"
                     + named, str(info.value)), info.value
    _same_everywhere(comm, info.value)
    comm.barrier()
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v1"]  # no partial, no uncommitted v2
    st = _dstate()
    dtensor.checkpoint.load(st, tmp_path)
    w, b, step = _dvalues(st)
    np.testing.assert_array_equal(w, W)
    assert step == 1


@pytest.mark.ranks(2, timeout=120)
def test_a_plain_tensor_save_under_bare_mpiexec_is_collective(comm, rank, tmp_path, monkeypatch):
    from dtensor.distributed import _LAUNCHER_SIZES
    for name in _LAUNCHER_SIZES:  # what `mpiexec -n 2 python ...` with no launcher env sees
        monkeypatch.delenv(name, raising=False)
    for i in range(3):  # racing ranks deleted each other's versions
        st = {"w": dtensor.tensor(np.full(4, 10 * i + rank, np.float32)), "step": i}
        assert dtensor.checkpoint.save(st, tmp_path) == f"v{i + 1}"
    comm.barrier()
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v3"]
    st = {"w": dtensor.tensor(np.zeros(4, np.float32)), "step": 0}
    dtensor.checkpoint.load(st, tmp_path)
    np.testing.assert_array_equal(st["w"].numpy(), np.full(4, 20.0))  # rank 0's
    assert st["step"] == 2


LOCAL_FAILURES = [  # (call, helper failing on rank 1 between collectives, error)
    ("save", "_crc", MemoryError("no memory for the checksum")),
    ("save", "_my_blocks", RuntimeError("the local block failed")),
    ("save", "_jsonable", TypeError("a value that is not JSON")),
    ("load", "_crc", MemoryError("no memory for the checksum")),
    ("load", "_target_pieces", RuntimeError("the local block failed")),
]


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("call,helper,error", LOCAL_FAILURES,
                         ids=[f"{c} {h}" for c, h, _ in LOCAL_FAILURES])
def test_a_local_failure_between_collectives_reaches_every_rank_at_once(
        comm, rank, tmp_path, monkeypatch, call, helper, error):
    dtensor.checkpoint.save(_dstate(scale=1.0, step=1), tmp_path)
    st = _dstate(scale=2.0, step=2) if call == "save" else _dstate()
    if rank == 1:
        def fail(*args, **kwargs):
            raise error
        monkeypatch.setattr(dtensor.checkpoint, helper, fail)
    t = time.perf_counter()
    with pytest.raises(type(error), match=rf"checkpoint\.{call} failed on rank 1: ") as info:
        getattr(dtensor.checkpoint, call)(st, tmp_path)
    assert time.perf_counter() - t < 5  # not DTENSOR_COLLECTIVE_TIMEOUT (120 s)
    _same_everywhere(comm, info.value)
    comm.barrier()
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v1"]
    if call == "load":
        assert not _dvalues(st)[0].any() and st["step"] == 0
