"""Tests for dtensor.random: Philox KATs, Triton equivalence, shard invariance."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dtensor.random as dr

REPO = Path(__file__).resolve().parents[1]
F = 0xFFFFFFFF


def _load_adapter():
    """``dtensor.compile.triton_adapter``; by file path until packaging maps it."""
    try:
        from dtensor.compile import triton_adapter
    except ImportError:
        path = REPO / "compile" / "triton_adapter.py"
        spec = importlib.util.spec_from_file_location("_dtensor_triton_adapter", path)
        triton_adapter = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(triton_adapter)
    return triton_adapter


@pytest.fixture
def rng_state(monkeypatch):
    """Let a test reseed freely; the global generator is restored afterwards."""
    monkeypatch.setattr(dr, "_seed", dr._seed)
    monkeypatch.setattr(dr, "_stream", dr._stream)


# ---------------------------------------------------------------------------
# Philox4x32-10 known answers (Random123 kat_vectors).
# ---------------------------------------------------------------------------

KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((F, F, F, F), (F, F), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox4x32_10_kat(ctr, key, expected):
    out = dr.philox4x32(*ctr, *key)
    assert all(o.dtype == np.uint32 for o in out)
    assert tuple(int(o) for o in out) == expected


def test_philox_broadcasts_and_is_elementwise():
    ctrs = np.array([k[0] for k in KAT], dtype=np.uint32)  # (3, 4)
    keys = np.array([k[1] for k in KAT], dtype=np.uint32)  # (3, 2)
    out = np.stack(dr.philox4x32(*ctrs.T, *keys.T), axis=1)
    assert out.tolist() == [list(k[2]) for k in KAT]
    # a scalar key broadcasts against a counter vector
    w = dr.philox4x32(np.array([0, F], np.uint32), 0, 0, 0, 0, 0)
    assert int(w[0][0]) == 0x6627E8D5 and int(w[0][1]) != 0x6627E8D5


def test_seed_and_offset_words():
    """Seed splits into (lo, hi) key words; only >32-bit offsets set counter hi."""
    seed = (0xA4093822 << 32) | 0x299F31D0
    # randint4x counter is (lo32(off), hi32(off), 0, 0) with key (lo32(seed), hi32(seed))
    off = np.array([(5 << 32) | 7], dtype=np.int64)
    got = dr.randint4x(seed, off)
    ref = dr.philox4x32(7, 5, 0, 0, 0x299F31D0, 0xA4093822)
    assert [int(g[0]) for g in got] == [int(r) for r in ref]
    # negative seeds are taken mod 2**64 (triton sign-extends to uint64)
    assert int(dr.randint(-1, off)[0]) == int(dr.philox4x32(7, 5, 0, 0, F, F)[0])
    # 32-bit offsets: hi word is 0 even for negative values; 64-bit: arithmetic shift
    neg32 = np.array([-3], dtype=np.int32)
    neg64 = neg32.astype(np.int64)
    assert int(dr.randint(9, neg32)[0]) == int(dr.philox4x32(F - 2, 0, 0, 0, 9, 0)[0])
    assert int(dr.randint(9, neg64)[0]) == int(dr.philox4x32(F - 2, F, 0, 0, 9, 0)[0])
    with pytest.raises(TypeError):
        dr.rand(0, np.array([1.0]))


def test_uint_to_uniform_float_edges():
    x = np.array([0, 1, 0x7FFFFFFF, 0x80000000, F, 0x40000000], dtype=np.uint32)
    u = dr.uint_to_uniform_float(x)
    assert u.dtype == np.float32
    assert u[0] == 0.0 and u[4] == 0.0  # ~0xffffffff as int32 == 0
    assert u[2] < 1.0 and u[3] < 1.0 and u[2] == u[3]  # largest values stay below 1
    assert u[1] == np.float32(4.6566127342e-10)
    assert u[5] == np.float32(np.float32(2.0**30) * np.float32(4.6566127342e-10))


# ---------------------------------------------------------------------------
# Equivalence with triton.language.random under the CPU interpreter.
# ---------------------------------------------------------------------------

SEEDS = [0, 1, 12345, 2**31 + 5, 2**32 + 7, 0xDEADBEEFCAFEBABE, -5, -(2**40) - 3]

_KERNEL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, importlib.util
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import numpy as np
    import triton
    import triton.language as tl
    try:
        from dtensor.compile.triton_adapter import as_triton_arg
    except ImportError:
        spec = importlib.util.spec_from_file_location("_ta", sys.argv[1])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        as_triton_arg = mod.as_triton_arg

    @triton.jit
    def kern(off_ptr, w0, w1, w2, w3, ri, u_ptr, n_ptr, n_stride, seed, N,
             BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        off = tl.load(off_ptr + i, mask=m, other=0)
        a, b, c, d = tl.randint4x(seed, off)
        tl.store(w0 + i, a, mask=m)
        tl.store(w1 + i, b, mask=m)
        tl.store(w2 + i, c, mask=m)
        tl.store(w3 + i, d, mask=m)
        tl.store(ri + i, tl.randint(seed, off), mask=m)
        tl.store(u_ptr + i, tl.rand(seed, off), mask=m)
        # normals go to a strided view: checks in-place writes through views
        tl.store(n_ptr + i * n_stride, tl.randn(seed, off), mask=m)

    @triton.jit
    def transforms(x_ptr, u1_ptr, u2_ptr, f_ptr, n0_ptr, n1_ptr, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        tl.store(f_ptr + i, tl.random.uint_to_uniform_float(tl.load(x_ptr + i, mask=m)), mask=m)
        n0, n1 = tl.random.pair_uniform_to_normal(tl.load(u1_ptr + i, mask=m),
                                                  tl.load(u2_ptr + i, mask=m))
        tl.store(n0_ptr + i, n0, mask=m)
        tl.store(n1_ptr + i, n1, mask=m)

    cfg = json.load(open(sys.argv[2]))
    results = {}
    for name in ("off64", "off32"):
        offs = np.load(sys.argv[3])[name]
        N = offs.size
        for seed in cfg["seeds"]:
            outs = [np.full(N, 0xAAAAAAAA, np.uint32) for _ in range(5)]
            u = np.full(N, -1.0, np.float32)
            nbuf = np.zeros(2 * N + 1, np.float32)
            nview = nbuf[1::2]
            args = [as_triton_arg(a) for a in (offs, *outs, u, nview)]
            grid = (triton.cdiv(N, cfg["block"]),)
            kern[grid](*args, nview.strides[0] // nview.itemsize, seed, N,
                       BLOCK=cfg["block"])
            key = f"{name}_{seed}"
            for j, o in enumerate(outs):
                results[f"{key}_w{j}"] = o
            results[f"{key}_u"] = u
            results[f"{key}_nbuf"] = nbuf
    t = np.load(sys.argv[3])
    x, u1, u2 = t["x"], t["u1"], t["u2"]
    assert x.size == u1.size == u2.size
    outs = [np.zeros(x.size, np.float32) for _ in range(3)]
    args = [as_triton_arg(a) for a in (x, u1, u2, *outs)]
    transforms[(triton.cdiv(x.size, cfg["block"]),)](*args, x.size, BLOCK=cfg["block"])
    results.update(t_f=outs[0], t_n0=outs[1], t_n1=outs[2])
    np.savez(sys.argv[4], **results)
    """
)


def _offsets() -> dict[str, np.ndarray]:
    rs = np.random.default_rng(0)
    big = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 17, 2**40 + 3, 2**62 + 11,
           2**63 - 1, -1, -(2**35) - 9]
    off64 = np.concatenate(
        [np.arange(1500), np.array(big), rs.integers(0, 2**63 - 1, 500, dtype=np.int64)]
    ).astype(np.int64)
    off32 = np.concatenate(
        [np.arange(700), np.array([2**31 - 1, -1, -(2**31), -12345]),
         rs.integers(-(2**31), 2**31 - 1, 300, dtype=np.int64)]
    ).astype(np.int32)
    # inputs for the bare transforms: edge cases plus random values
    x_edges = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0x80000001, F - 1, F, 0x40000000]
    x = np.concatenate([np.array(x_edges, np.uint32),
                        rs.integers(0, 2**32, 2000, dtype=np.uint32)])
    u1 = np.concatenate([np.array([0.0, 1e-8, 9.9e-8, 1e-7, 1.01e-7, 2e-7, 1e-6, 0.5, 0.99999994]),
                         rs.random(2000)]).astype(np.float32)
    u2 = np.concatenate([np.array([0.0, 0.25, 0.5, 0.75, 0.99999994, 1e-7, 0.125, 0.9, 0.3]),
                         rs.random(2000)]).astype(np.float32)
    return {"off64": off64, "off32": off32, "x": x, "u1": u1, "u2": u2}


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    if importlib.util.find_spec("triton") is None:  # find, not import: importing triton here
        pytest.skip("triton is not installed")  # would fix its mode for the whole session
    d = tmp_path_factory.mktemp("triton_rng")
    (d / "k.py").write_text(_KERNEL_SCRIPT)
    (d / "cfg.json").write_text(json.dumps({"seeds": SEEDS, "block": 1024}))
    offs = _offsets()
    np.savez(d / "offs.npz", **offs)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(d / "k.py"), str(REPO / "compile" / "triton_adapter.py"),
         str(d / "cfg.json"), str(d / "offs.npz"), str(d / "out.npz")],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with np.load(d / "out.npz") as z:
        return offs, {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", ["off64", "off32"])
@pytest.mark.parametrize("seed", SEEDS)
def test_matches_triton(triton_results, name, seed):
    offs_all, res = triton_results
    offs = offs_all[name]
    key = f"{name}_{seed}"
    words = dr.randint4x(seed, offs)
    for j in range(4):
        np.testing.assert_array_equal(res[f"{key}_w{j}"], words[j], err_msg=f"word {j}")
    np.testing.assert_array_equal(res[f"{key}_w4"], dr.randint(seed, offs))
    u = dr.rand(seed, offs)
    assert u.dtype == np.float32
    np.testing.assert_array_equal(res[f"{key}_u"].view(np.uint32), u.view(np.uint32))
    nbuf = res[f"{key}_nbuf"]
    assert not nbuf[0::2].any(), "kernel wrote outside the strided view"
    n = dr.randn(seed, offs)
    assert n.dtype == np.float32
    _assert_normals_match(nbuf[1::2], n)


def _assert_normals_match(got: np.ndarray, want: np.ndarray) -> None:
    """float32 Box-Muller outputs: close everywhere, and bit-equal almost everywhere.

    The tolerance is the portable contract (a GPU's log/cos may differ by an
    ulp).  Under the interpreter tl.randn runs the very same float32 numpy
    ufuncs we do, so they agree bit for bit; float64 intermediates, by
    contrast, change ~40% of the last bits, which the 99% check catches.
    """
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.mean(got.view(np.uint32) == want.view(np.uint32)) >= 0.99


def test_transforms_match_triton(triton_results):
    """uint_to_uniform_float and Box-Muller (with its 1e-7 clamp) on edge inputs."""
    t, res = triton_results
    f = dr.uint_to_uniform_float(t["x"])
    np.testing.assert_array_equal(res["t_f"].view(np.uint32), f.view(np.uint32))
    n0, n1 = dr.pair_uniform_to_normal(t["u1"], t["u2"])
    _assert_normals_match(res["t_n0"], n0)
    _assert_normals_match(res["t_n1"], n1)
    # the clamp: u1 <= 1e-7 all map to the same radius
    r, _ = dr.pair_uniform_to_normal(np.float32([0.0, 1e-8, 1e-7]), np.zeros(3, np.float32))
    assert (r == np.sqrt(np.float32(-2.0) * np.log(np.float32(1e-7)))).all()


def test_adapter_staging_roundtrip_is_zero_copy():
    """Replays what GridExecutor does with an arg, on a strided numpy view."""
    ta = _load_adapter()
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    view = base[1:4, ::-2]
    arg = ta.as_triton_arg(view)
    assert ta.as_triton_arg(arg) is arg
    assert arg.data_ptr() == view.__array_interface__["data"][0]
    assert arg.size() == (3, 4) and arg.stride() == (8, -2)
    storage = arg.untyped_storage()
    host_storage = storage.cpu()
    host = arg.new_empty(0, device="cpu")
    host.set_(host_storage, arg.storage_offset(), arg.size(), arg.stride())
    assert host.data_ptr() == arg.data_ptr()
    host.array[...] = -1.0  # a kernel write
    assert storage.copy_(host.untyped_storage()) is storage  # same memory: no-op
    assert (view == -1.0).all() and (base == -1.0).sum() == 12
    # copy_ between distinct storages really copies the bytes
    src = np.arange(6, dtype=np.int64)
    dst = np.zeros(6, dtype=np.int64)
    ta.as_triton_arg(dst).untyped_storage().copy_(ta.as_triton_arg(src).untyped_storage())
    np.testing.assert_array_equal(dst, src)
    with pytest.raises(TypeError):
        ta.as_triton_arg(np.zeros(3, np.complex64))
    with pytest.raises(TypeError):
        ta.as_triton_arg([1.0, 2.0])


# ---------------------------------------------------------------------------
# Generator state and the sharding contract.
# ---------------------------------------------------------------------------


def _splitmix64_outputs(seed: int, n: int) -> list[int]:
    """Reference SplitMix64 (Vigna), written independently of the module."""
    m, out, x = (1 << 64) - 1, [], seed
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & m
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append(z ^ (z >> 31))
    return out


def dr_key(i: int) -> int:
    """Deterministic keys for the statistical tests, independent of global state."""
    return _splitmix64_outputs(2024, i)[-1]


def test_next_key_formula(rng_state):
    dr.manual_seed(1234567)
    assert dr.initial_seed() == 1234567
    keys = [dr.next_key() for _ in range(5)]
    assert keys == _splitmix64_outputs(1234567, 5)
    assert keys == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                    4593380528125082431, 16408922859458223821]
    dr.manual_seed(0)
    assert dr.next_key() == 0xE220A8397B1DCDAF


def test_manual_seed_resets_stream_and_streams_differ(rng_state):
    dr.manual_seed(7)
    k1, k2 = dr.next_key(), dr.next_key()
    assert k1 != k2 and 0 <= k1 < 2**64 and 0 <= k2 < 2**64
    a = dr.uniform_like_shape(k1, (64, 32))
    b = dr.uniform_like_shape(k2, (64, 32))
    assert np.mean(a == b) < 0.01
    dr.manual_seed(7)
    assert dr.initial_seed() == 7
    assert dr.next_key() == k1
    np.testing.assert_array_equal(dr.uniform_like_shape(k1, (64, 32)), a)  # same seed, same values
    dr.manual_seed(8)
    assert dr.next_key() not in (k1, k2)
    dr.manual_seed(-1)
    assert dr.initial_seed() == 2**64 - 1


@pytest.mark.parametrize("fn", [dr.uniform, dr.normal])
def test_shard_invariance(fn):
    key = 0x0123456789ABCDEF
    shape = (6, 10, 7)
    gidx = np.arange(np.prod(shape), dtype=np.int64).reshape(shape)
    full = fn(key, gidx)
    if fn is dr.uniform:
        np.testing.assert_array_equal(full, dr.uniform_like_shape(key, shape))
    sl = (slice(2, 5), slice(None), slice(3, 7))
    np.testing.assert_array_equal(fn(key, gidx[sl]), full[sl])
    # a 2 x 3 mesh of uneven shards reassembles the global tensor exactly
    rows = np.array_split(np.arange(shape[0]), 2)
    cols = np.array_split(np.arange(shape[1]), 3)
    out = np.empty(shape, np.float32)
    for r in rows:
        for c in cols:
            out[np.ix_(r, c)] = fn(key, gidx[np.ix_(r, c)])
    np.testing.assert_array_equal(out, full)
    # element-wise purity, also for offsets past 2**32 (counter hi word)
    offs = np.array([3, 2**32 + 3, 2**45, 17, 2**32 + 3], np.int64)
    v = fn(key, offs)
    perm = np.array([4, 2, 0, 3, 1])
    np.testing.assert_array_equal(fn(key, offs[perm]), v[perm])
    assert v[0] != v[1] and v[1] == v[4]
    # int32 and int64 global offsets agree; dtype is a cast of the float32 values
    np.testing.assert_array_equal(fn(key, gidx.astype(np.int32)), full)
    np.testing.assert_array_equal(fn(key, gidx, np.float64), full.astype(np.float64))
    assert fn(key, gidx, np.float16).dtype == np.float16
    # offsets are taken as int64 values whatever their dtype (triton itself would
    # drop the high word of a 32-bit offset; global indices are never negative)
    np.testing.assert_array_equal(fn(key, np.array([-1], np.int32)),
                                  fn(key, np.array([-1], np.int64)))


def test_uniform_statistics():
    u = dr.uniform(dr_key(1), np.arange(1_000_000))
    assert u.dtype == np.float32
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 1.5e-3  # sd 2.9e-4
    assert abs(u.var() - 1 / 12) < 4e-4  # sd 7.5e-5
    hist = np.bincount((u * 16).astype(np.int64), minlength=16) / u.size
    assert np.abs(hist - 1 / 16).max() < 2e-3  # sd 2.4e-4 per bin
    # consecutive values uncorrelated
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5e-3


def test_normal_statistics():
    n = dr.normal(dr_key(2), np.arange(1_000_000)).astype(np.float64)
    assert np.isfinite(n).all()
    assert abs(n.mean()) < 5e-3  # sd 1e-3
    assert abs(n.var() - 1.0) < 7e-3  # sd 1.4e-3
    assert abs(np.mean(n**3)) < 2e-2  # sd 3.9e-3
    assert abs(np.mean(n**4) - 3.0) < 5e-2  # sd 9.8e-3
    assert abs(np.mean(np.abs(n) < 1.0) - 0.6826895) < 3e-3
