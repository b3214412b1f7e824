"""dtensor.nn.hf: Hugging Face safetensors checkpoints on a small model of our own (an Embedding,
two Linears, HF-style names through a name map), loaded in one process and on 2 and 4 ranks in
every layout; the reference is numpy slicing of the arrays the test wrote; spies count what each
rank reads; saves from sharded layouts reload bit-equal; and the error table."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import dtensor
from dtensor.nn import Embedding, Linear, Module, Parameter
from dtensor.nn.hf import HFCheckpointError, NameMap, load_safetensors, save_safetensors

# Shapes chosen so 2 and 4 ranks give uneven and empty shards (7 over 4: 2, 2, 2, 1; 5 over 4:
# 2, 2, 1, 0).
SHAPES = {"model.embed_tokens.weight": (10, 6), "model.layers.0.self_attn.q_proj.weight": (7, 6),
          "model.layers.0.self_attn.q_proj.bias": (7,), "lm_head.weight": (5, 7)}
NAME_MAP = {"model.embed_tokens.weight": "emb.weight",
            "model.layers.0.self_attn.q_proj.weight": "proj.weight",
            "model.layers.0.self_attn.q_proj.bias": "proj.bias",
            "lm_head.weight": "head.weight",
            "model.layers.0.self_attn.rotary_emb.inv_freq": None}
PATHS = {v: k for k, v in NAME_MAP.items() if v is not None}


class Tiny(Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.emb = Embedding(10, 6)
        self.proj = Linear(6, 7)
        self.head = Linear(7, 5, bias=False)
        if tied:  # a head over the embedding's rows: (10, 6), one Parameter under two paths
            self.head = Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight


def weights(seed=0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    out["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.arange(3, dtype=dtype)
    return out


def write_raw(path: Path, tensors: dict[str, tuple[str, tuple, bytes]], metadata=None) -> None:
    """A safetensors file written by hand from the format's spec (8-byte little-endian header
    length, JSON header, row-major bytes): the dtypes numpy's writer cannot make (BF16, F8)."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def to_bf16(a: np.ndarray) -> tuple[np.ndarray, bytes]:
    """(the float32 values a bfloat16 holds, its bytes): the high half of each float32."""
    hi = (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return (hi.astype(np.uint32) << 16).view(np.float32), hi.tobytes()


def write_bf16(folder: Path, seed=0) -> dict[str, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    exact, tensors = {}, {}
    for k, a in weights(seed).items():
        exact[k], raw = to_bf16(a)
        tensors[k] = ("BF16", a.shape, raw)
    write_raw(folder / "model.safetensors", tensors, {"format": "pt"})
    return exact


def chunk(size: int, n: int, i: int) -> slice:
    c = -(-size // n)  # torch.chunk: ceil-sized chunks, short or empty ones at the end
    return slice(min(size, i * c), min(size, (i + 1) * c))


def expected_block(full: np.ndarray, placements, mesh_shape, coord) -> np.ndarray:
    idx = [slice(0, s) for s in full.shape]
    for m, p in enumerate(placements):
        if isinstance(p, dtensor.Shard):
            s = idx[p.dim]
            sub = chunk(s.stop - s.start, mesh_shape[m], coord[m])
            idx[p.dim] = slice(s.start + sub.start, s.start + sub.stop)
        elif isinstance(p, dtensor.StridedShard):  # this rank's chunk of every part, in order
            part = full.shape[p.dim] // p.parts
            sub = chunk(part, mesh_shape[m], coord[m])
            idx[p.dim] = [i * part + j for i in range(p.parts) for j in range(sub.start, sub.stop)]
    return full[np.ix_(*[np.arange(full.shape[d])[i] for d, i in enumerate(idx)])]


def expected_reads(full: np.ndarray, placements, mesh_shape, coord) -> int:
    """Slices a load reads for this block: one per rectangle (a strided dim has one per part),
    none for an empty block."""
    if not expected_block(full, placements, mesh_shape, coord).size:
        return 0
    return int(np.prod([p.parts for p in placements if isinstance(p, dtensor.StridedShard)]))


def distribute(model: Module, mesh, layouts: dict) -> None:
    """Lay each parameter out as ``layouts[path]`` (tied paths stay one Parameter)."""
    done = {}
    for mname, m in model.named_modules():
        for pname, p in list(m._parameters.items()):
            path = f"{mname}.{pname}" if mname else pname
            if id(p) not in done:
                done[id(p)] = Parameter(dtensor.distribute_tensor(p.detach(), mesh,
                                                                  layouts[path]))
            m._parameters[pname] = done[id(p)]


def local(p) -> np.ndarray:
    return p.to_local().numpy() if hasattr(p, "_spec") else p.numpy()


def whole(p) -> np.ndarray:
    return p.full_tensor().numpy() if hasattr(p, "_spec") else p.numpy()


S0, S1, R = dtensor.Shard(0), dtensor.Shard(1), dtensor.Replicate()
LAYOUTS_1D = {  # every parameter in a different layout at once
    "rows": {"emb.weight": [S0], "proj.weight": [S0], "proj.bias": [S0], "head.weight": [S0]},
    "strided": {"emb.weight": [dtensor.StridedShard(0, 2)], "proj.weight": [S0],
                "proj.bias": [R], "head.weight": [R]},  # 2 parts of 5 rows: 2, 2, 1, 0 each
    "cols": {"emb.weight": [S1], "proj.weight": [S1], "proj.bias": [R], "head.weight": [S1]},
    "mixed": {"emb.weight": [R], "proj.weight": [S0], "proj.bias": [S0], "head.weight": [S1]},
}
LAYOUTS_2D = {
    "S0,S1": {"emb.weight": [S0, S1], "proj.weight": [S0, S1], "proj.bias": [S0, R],
              "head.weight": [S1, S0]},
    "S0,S0": {"emb.weight": [S0, S0], "proj.weight": [S0, S0], "proj.bias": [S0, S0],
              "head.weight": [R, S1]},
}


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_one_process_load_converts_dtype(tmp_path, dtype):
    w = weights(dtype=dtype)
    save_file(w, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = Tiny()
    params = dict(model.named_parameters())
    assert load_safetensors(model, tmp_path, NAME_MAP) == ([], [])
    for path, p in model.named_parameters():
        assert p is params[path]  # in place: optimizers and tied paths keep their object
        assert p.dtype == np.float32
        np.testing.assert_array_equal(p.numpy(), w[PATHS[path]].astype(np.float32))


def test_bf16_one_process(tmp_path):
    exact = write_bf16(tmp_path)
    model = Tiny()
    load_safetensors(model, tmp_path, NAME_MAP)
    for path, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), exact[PATHS[path]])


def test_bf16_scalar_and_chunked_rows(tmp_path, monkeypatch):
    """A 0-d bf16 tensor, and a matrix read a few rows per chunk (the chunk size made tiny)."""
    import dtensor.nn.hf as hf
    monkeypatch.setattr(hf, "_CHUNK", 3 * 6 * 2)  # three rows of 6 bf16 values
    m = Module()
    m.w = Parameter(np.zeros((10, 6), np.float32))
    m.s = Parameter(np.zeros((), np.float32))
    w, w_raw = to_bf16(np.random.default_rng(1).standard_normal((10, 6)))
    s, s_raw = to_bf16(np.array(-2.75))
    write_raw(tmp_path / "model.safetensors", {"w": ("BF16", (10, 6), w_raw),
                                               "s": ("BF16", (), s_raw)})
    load_safetensors(m, tmp_path)
    np.testing.assert_array_equal(m.w.numpy(), w)
    assert m.s.numpy() == s == -2.75


def test_placeholder_parameters_get_their_block(tmp_path):
    """A read-only zero-stride parameter (what dtensor.nn.init.empty_parameters makes) is given
    an array of its own, the same Parameter object."""
    w = weights()
    save_file(w, str(tmp_path / "model.safetensors"))
    model = Tiny()
    for p in model.parameters():
        p.data = np.broadcast_to(np.zeros((), p.dtype), p.shape)
    before = list(model.parameters())
    load_safetensors(model, tmp_path, NAME_MAP)
    for (path, p), q in zip(model.named_parameters(), before):
        assert p is q and p.data.flags.writeable
        np.testing.assert_array_equal(p.numpy(), w[PATHS[path]])


@pytest.mark.parametrize("held", ["embed only", "both names"])
def test_tied_parameter_read_once_saved_once(tmp_path, held):
    w = weights()
    del w["lm_head.weight"]
    if held == "both names":  # HF writes both for some models; the first one read wins
        w["lm_head.weight"] = w["model.embed_tokens.weight"] + 1
    save_file(w, str(tmp_path / "model.safetensors"))
    model = Tiny(tied=True)
    assert load_safetensors(model, tmp_path, NAME_MAP) == ([], [])
    assert model.head.weight is model.emb.weight
    np.testing.assert_array_equal(model.emb.weight.numpy(), w["model.embed_tokens.weight"])
    save_safetensors(model, tmp_path / "out", NAME_MAP)
    with safe_open(tmp_path / "out" / "model.safetensors", framework="np") as f:
        assert sorted(f.keys()) == ["model.embed_tokens.weight",
                                    "model.layers.0.self_attn.q_proj.bias",
                                    "model.layers.0.self_attn.q_proj.weight"]
        assert f.metadata() == {"format": "pt"}


def test_save_reload_sharded_index(tmp_path):
    model = Tiny()
    names = save_safetensors(model, tmp_path, NAME_MAP, max_shard_size=200,
                             metadata={"producer": "test"}, config={"model_type": "tiny"})
    # 240 + 168 + 28 + 140 bytes in module order, greedy at 200: [emb] [proj.weight, bias] [head]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["config.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 240 + 168 + 28 + 140
    assert index["weight_map"] == {
        "model.embed_tokens.weight": names[0], "model.layers.0.self_attn.q_proj.weight": names[1],
        "model.layers.0.self_attn.q_proj.bias": names[1], "lm_head.weight": names[2]}
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "tiny"}
    with safe_open(tmp_path / names[2], framework="np") as f:
        assert f.metadata() == {"format": "pt", "producer": "test"}
    fresh = Tiny()
    load_safetensors(fresh, tmp_path, NAME_MAP)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    # A one-file save over it removes the index (a load would prefer it) and the old shards.
    save_safetensors(model, tmp_path, NAME_MAP)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("size,limit", [("1KB", 1000), ("2KiB", 2048), ("0.5MB", 500_000),
                                        (300, 300)])
def test_max_shard_size_spellings(size, limit):
    from dtensor.nn.hf import _size_arg
    assert _size_arg(size) == limit


def test_glob_folder_and_strict_false(tmp_path):
    """No model.safetensors and no index: every *.safetensors; strict=False skips and reports."""
    w = weights()
    save_file({k: w[k] for k in list(w)[:2]}, str(tmp_path / "a.safetensors"))
    save_file({"extra.weight": np.ones(2, np.float32)}, str(tmp_path / "b.safetensors"))
    model = Tiny()
    head = model.head.weight.numpy().copy()
    missing, unexpected = load_safetensors(model, tmp_path, NAME_MAP, strict=False)
    assert sorted(missing) == ["head.weight", "proj.bias"] and unexpected == ["extra.weight"]
    np.testing.assert_array_equal(model.emb.weight.numpy(), w["model.embed_tokens.weight"])
    np.testing.assert_array_equal(model.head.weight.numpy(), head)


def test_name_map_forms_agree(tmp_path):
    """A dict, a callable and a NameMap load the same values; identity when None."""
    w = weights()
    save_file(w, str(tmp_path / "model.safetensors"))
    fn = NAME_MAP.get
    for nm in (NAME_MAP, fn, NameMap(fn, {v: k for k, v in NAME_MAP.items()}.get)):
        model = Tiny()
        load_safetensors(model, tmp_path, nm)
        np.testing.assert_array_equal(model.proj.weight.numpy(),
                                      w["model.layers.0.self_attn.q_proj.weight"])
    model = Tiny()
    save_safetensors(model, tmp_path / "own")
    fresh = Tiny()
    load_safetensors(fresh, tmp_path / "own")
    np.testing.assert_array_equal(fresh.head.weight.numpy(), model.head.weight.numpy())


# ----------------------------------------------------------------------------- errors

def _error_cases(tmp: Path):
    """[(case, call, exception type, substrings of the message)]."""
    w = weights()
    good = tmp / "good"
    good.mkdir()
    save_file(w, str(good / "model.safetensors"))

    def folder(name, tensors):
        d = tmp / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        return d

    unknown = folder("unknown", {**w, "model.layers.0.mlp.up_proj.weight": np.ones(2, "f4")})
    missing = folder("missing", {k: v for k, v in w.items() if k != "lm_head.weight"})
    shape = folder("shape", {**w, "lm_head.weight": np.ones((7, 5), "f4")})
    (tmp / "empty").mkdir()
    idx = tmp / "index"
    idx.mkdir()
    save_file({k: w[k] for k in list(w)[:2]}, str(idx / "model-00001-of-00002.safetensors"))
    (idx / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in list(w)[:2]},
        **{k: "model-00002-of-00002.safetensors" for k in list(w)[2:]}}}))
    wrong = tmp / "wrongfile"
    wrong.mkdir()
    save_file({k: w[k] for k in list(w)[:2]}, str(wrong / "a.safetensors"))
    save_file({k: w[k] for k in list(w)[2:]}, str(wrong / "b.safetensors"))
    (wrong / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: "a.safetensors" for k in w}}))
    bad_index = tmp / "badindex"
    bad_index.mkdir()
    (bad_index / "model.safetensors.index.json").write_text("{\"weight_map\": [1]}")
    dup = tmp / "dup"
    dup.mkdir()
    save_file(w, str(dup / "a.safetensors"))
    save_file({"lm_head.weight": w["lm_head.weight"]}, str(dup / "b.safetensors"))
    f8 = tmp / "f8"
    f8.mkdir()
    write_raw(f8 / "model.safetensors", {k: (("F8_E4M3", v.shape, bytes(v.size)) if
                                              k == "lm_head.weight" else ("F32", v.shape,
                                                                          v.tobytes()))
                                         for k, v in w.items()})

    def load(d, nm=NAME_MAP, **kw):
        return lambda: load_safetensors(Tiny(), d, nm, **kw)

    def save(nm, model=None, **kw):
        return lambda: save_safetensors(model or Tiny(), tmp / "out", nm, **kw)

    swapped = {**NAME_MAP, "model.embed_tokens.weight": "head.weight",
               "lm_head.weight": "emb.weight"}
    return [
        ("unknown key", load(unknown), HFCheckpointError,
         ["'model.layers.0.mlp.up_proj.weight'", "name_map", "strict=False", "closest"]),
        ("missing key", load(missing), HFCheckpointError,
         ["'head.weight'", "checkpoint name 'lm_head.weight'", "strict=False"]),
        ("missing, callable map", load(missing, NAME_MAP.get), HFCheckpointError,
         ["'head.weight'", "no tensor"]),
        ("wrong shape", load(shape), HFCheckpointError,
         ["'lm_head.weight'", "(7, 5)", "(5, 7)", "config"]),
        ("shape even with strict=False", load(shape, strict=False), HFCheckpointError,
         ["(7, 5)"]),
        ("swapped names: shapes", load(good, swapped), HFCheckpointError,
         ["'lm_head.weight'", "(10, 6)", "(5, 7)"]),
        ("no folder", load(tmp / "nope"), FileNotFoundError, ["nope", "model.safetensors"]),
        ("no files", load(tmp / "empty"), FileNotFoundError, ["empty", "*.safetensors"]),
        ("index names a missing file", load(idx), FileNotFoundError,
         ["model-00002-of-00002.safetensors", "'lm_head.weight'", "shard"]),
        ("index puts a name in the wrong file", load(wrong), HFCheckpointError,
         ["'a.safetensors'", "different saves"]),
        ("index without a weight_map", load(bad_index), HFCheckpointError, ["weight_map"]),
        ("a name in two files", load(dup), HFCheckpointError,
         ["'lm_head.weight'", "a.safetensors", "b.safetensors"]),
        ("F8 has no numpy reader", load(f8), HFCheckpointError, ["F8_E4M3", "'lm_head.weight'"]),
        ("name map of the wrong type", load(good, ["emb.weight"]), TypeError, ["list"]),
        ("name map giving a non-str", load(good, lambda n: 3), TypeError, ["3", "str or None"]),
        ("strict not a bool", load(good, strict="yes"), TypeError, ["strict"]),
        ("save: callable alone", save(NAME_MAP.get), TypeError, ["NameMap", "dict"]),
        ("save: two parameters one name", save(NameMap(lambda n: "emb.weight", lambda p: "x")),
         HFCheckpointError, ["'proj.weight' as 'x'", "'emb.weight'", "agree"]),
        ("save: directions disagree", save(NameMap(lambda n: None, lambda p: "m." + p)),
         HFCheckpointError, ["'m.emb.weight'", "agree"]),
        ("save: no name", save(NameMap(lambda n: n, lambda p: None)), HFCheckpointError,
         ["emb.weight", "no checkpoint name"]),
        ("save: bad shard size", save(None, max_shard_size="5 parsecs"), TypeError,
         ["5 parsecs", "5GB"]),
        ("save: zero shard size", save(None, max_shard_size=0), ValueError, ["positive"]),
        ("save: metadata not str", save(None, metadata={"a": 1}), TypeError, ["metadata"]),
        ("save: config not JSON", save(None, config={"a": object()}), TypeError, ["config"]),
    ]


def test_error_table(tmp_path):
    cases = _error_cases(tmp_path)
    for case, call, kind, parts in cases:
        with pytest.raises(kind) as info:
            call()
        for part in parts:
            assert part in str(info.value), (case, part, str(info.value))


def test_failed_load_changes_nothing(tmp_path):
    w = weights()
    w["lm_head.weight"] = np.ones((7, 5), np.float32)  # read last; checked before any read
    save_file(w, str(tmp_path / "model.safetensors"))
    model = Tiny()
    before = [p.numpy().copy() for p in model.parameters()]
    with pytest.raises(HFCheckpointError):
        load_safetensors(model, tmp_path, NAME_MAP)
    for a, p in zip(before, model.parameters()):
        np.testing.assert_array_equal(a, p.numpy())


# ----------------------------------------------------------------------------- ranks

class _Spy:
    """safe_open whose slices record what each rank asked for and the bytes they returned."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, *a, **kw):
        spy = self

        class Handle:
            def __init__(self):
                self.h = spy.real(*a, **kw)

            def __enter__(self):
                self.h.__enter__()
                return self

            def __exit__(self, *exc):
                return self.h.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_slice(self, name):
                sl = self.h.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def get_dtype(self):
                        return sl.get_dtype()

                    def __getitem__(self, key):
                        out = sl[key]
                        spy.log.append((name, key, out.nbytes))
                        return out
                return Slice()
        return Handle()


def _spy_on_reads(monkeypatch) -> list:
    """Installs the spy on this rank; returns its log. (safe_open is looked up here, not as a
    global of this module: a rank gets the test's functions by value, not the Rust class.)"""
    import safetensors
    log = []
    monkeypatch.setattr(safetensors, "safe_open", _Spy(safetensors.safe_open, log))
    return log


def _check_layout(folder: Path, layouts: dict, mesh, w, log, itemsize: int = 4,
                  one_slice: bool = True) -> None:
    log.clear()
    model = Tiny()
    distribute(model, mesh, layouts)
    load_safetensors(model, folder, NAME_MAP)
    coord = mesh.get_coordinate()
    want_bytes = want_reads = 0
    for path, p in model.named_parameters():
        want = expected_block(w[PATHS[path]], layouts[path], mesh.shape, coord)
        np.testing.assert_array_equal(local(p), want, err_msg=f"{path} {layouts[path]}")
        np.testing.assert_array_equal(whole(p), w[PATHS[path]])
        want_bytes += want.size * itemsize  # in the checkpoint's dtype
        want_reads += expected_reads(w[PATHS[path]], layouts[path], mesh.shape, coord)
    # Each rank read exactly its blocks (an empty block reads nothing), in one slice per
    # rectangle unless the chunks were made smaller than a tensor.
    assert sum(n for _, _, n in log) == want_bytes
    assert not one_slice or len(log) == want_reads, log


@pytest.mark.ranks(4, timeout=120)
def test_layouts_on_four_ranks(tmp_path, rank, monkeypatch):
    w = weights(seed=4)
    if rank == 0:
        save_file(w, str(tmp_path / "model.safetensors"))
    dtensor.distributed.barrier()
    log = _spy_on_reads(monkeypatch)
    mesh = dtensor.init_device_mesh("cpu", (4,))
    for layouts in LAYOUTS_1D.values():
        _check_layout(tmp_path, layouts, mesh, w, log)
    mesh2 = dtensor.init_device_mesh("cpu", (2, 2))
    for layouts in LAYOUTS_2D.values():
        _check_layout(tmp_path, layouts, mesh2, w, log)


@pytest.mark.ranks(2, timeout=120)
def test_layouts_on_two_ranks_f16_checkpoint_small_chunks(tmp_path, rank, monkeypatch):
    """Chunks of 2 rows of 7 f16 values: every tensor is read in several slices of rows."""
    import dtensor.nn.hf as hf
    monkeypatch.setattr(hf, "_CHUNK", 2 * 7 * 2)
    w = weights(seed=2, dtype=np.float16)
    if rank == 0:
        save_file(w, str(tmp_path / "model.safetensors"))
    dtensor.distributed.barrier()
    log = _spy_on_reads(monkeypatch)
    mesh = dtensor.init_device_mesh("cpu", (2,))
    for layouts in LAYOUTS_1D.values():
        _check_layout(tmp_path, layouts, mesh, {k: v.astype(np.float32) for k, v in w.items()},
                      log, itemsize=2, one_slice=False)
        assert max(key[0].stop - key[0].start for _, key, _ in log if len(key) == 2) <= 2, log


@pytest.mark.ranks(2, timeout=120)
def test_bf16_reads_only_the_rows_of_the_block(tmp_path, rank, monkeypatch):
    """Shard(0) reads this rank's rows, Shard(1) every row (then cuts its columns): counted in
    bytes at the file's read()."""
    import builtins

    import dtensor.nn.hf as hf
    if rank == 0:
        write_bf16(tmp_path, seed=3)
    dtensor.distributed.barrier()
    exact = {k: to_bf16(a)[0] for k, a in weights(seed=3).items()}
    header = 8 + struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])[0]
    mesh = dtensor.init_device_mesh("cpu", (2,))
    for layouts in LAYOUTS_1D.values():
        reads = []

        def counting_open(*a, **kw):
            f = builtins.open(*a, **kw)
            real = f.read

            def read(n=-1):
                out = real(n)
                reads.append(len(out))
                return out
            f.read = read
            return f
        monkeypatch.setattr(hf, "open", counting_open, raising=False)
        model = Tiny()
        distribute(model, mesh, layouts)
        load_safetensors(model, tmp_path, NAME_MAP)
        monkeypatch.undo()
        want = 0
        for path, p in model.named_parameters():
            full = exact[PATHS[path]]
            block = expected_block(full, layouts[path], mesh.shape, [rank])
            np.testing.assert_array_equal(local(p), block)
            rows = block.shape[0] if block.size else 0
            want += 2 * rows * (full[0].size if full.ndim > 1 else 1)
        assert sum(reads) == header + want, (layouts, reads)


@pytest.mark.ranks(4, timeout=120)
def test_save_from_sharded_layouts_reloads_bit_equal(tmp_path, rank):
    from dtensor.distributed import barrier
    mesh = dtensor.init_device_mesh("cpu", (4,))
    mesh2 = dtensor.init_device_mesh("cpu", (2, 2))
    cases = [(mesh, LAYOUTS_1D["mixed"], None), (mesh2, LAYOUTS_2D["S0,S1"], 300)]
    for i, (m, layouts, limit) in enumerate(cases):
        dtensor.manual_seed(i)
        model = Tiny()
        distribute(model, m, layouts)
        names = save_safetensors(model, tmp_path / str(i), NAME_MAP, max_shard_size=limit)
        barrier()
        assert (limit is None) == (names == ["model.safetensors"])
        fresh = Tiny()  # plain Tensors: the whole values
        load_safetensors(fresh, tmp_path / str(i), NAME_MAP)
        for (path, a), b in zip(model.named_parameters(), fresh.parameters()):
            assert whole(a).tobytes() == b.numpy().tobytes(), path
        # and back onto another layout: each rank's block of the saved values
        other = Tiny()
        distribute(other, mesh, LAYOUTS_1D["cols"])
        load_safetensors(other, tmp_path / str(i), NAME_MAP)
        for (path, a), b in zip(other.named_parameters(), fresh.parameters()):
            np.testing.assert_array_equal(local(a), expected_block(
                b.numpy(), LAYOUTS_1D["cols"][path], (4,), [rank]))


@pytest.mark.ranks(2, timeout=120)
def test_error_on_ranks_is_raised_on_every_rank(tmp_path, rank):
    """A shard missing on one rank's view of the folder fails the load on both, together."""
    w = weights()
    d = tmp_path / f"r{rank}"
    d.mkdir()
    if rank == 0:
        save_file(w, str(d / "model.safetensors"))
    mesh = dtensor.init_device_mesh("cpu", (2,))
    model = Tiny()
    distribute(model, mesh, LAYOUTS_1D["rows"])
    with pytest.raises(FileNotFoundError, match="rank 1"):
        load_safetensors(model, tmp_path / f"r{rank}", NAME_MAP)


@pytest.mark.ranks(2, timeout=120)
def test_empty_parameters_laid_out_then_loaded(tmp_path, rank):
    """A model built under dtensor.nn.init.empty_parameters, laid out, then loaded: each rank
    ends with its blocks of the checkpoint, in the parameters' own objects."""
    from dtensor.nn import init
    w = weights(seed=5)
    if rank == 0:
        save_file(w, str(tmp_path / "model.safetensors"))
    dtensor.distributed.barrier()
    with init.empty_parameters():
        model = Tiny()
    mesh = dtensor.init_device_mesh("cpu", (2,))
    distribute(model, mesh, LAYOUTS_1D["mixed"])
    before = list(model.parameters())
    load_safetensors(model, tmp_path, NAME_MAP)
    for (path, p), q in zip(model.named_parameters(), before):
        assert p is q and not init.is_placeholder(p)
        np.testing.assert_array_equal(local(p), expected_block(
            w[PATHS[path]], LAYOUTS_1D["mixed"][path], (2,), [rank]))


def test_saved_files_get_the_users_umask_like_config_json(tmp_path):
    # safetensors creates its files 0600: weights others may not read beside a readable config
    save_safetensors(Tiny(), tmp_path, NAME_MAP, config={"model_type": "tiny"})
    mode = (tmp_path / "config.json").stat().st_mode & 0o777
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == mode
