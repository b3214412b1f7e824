"""The C backend's own numerics and mechanics: its exp against float64 numpy over the whole float
range, GELU / softmax / layer-norm / cross-entropy in float32 and float64 against eager, the
row split over threads, the library cache, and the errors. (Every kernel kind against eager and
the numpy backend, and the GPT step: tests/test_backends.py.)"""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor.compile import c_backend, native
from dtensor.ops import nn as nnops


def compiled(f, *arrays, backend="c"):
    """f through dtensor.compile(backend) on Tensors of ``arrays``; the outputs as numpy and
    the graph's nodes run as C."""
    global last
    run = dtensor.compile(f, backend=backend)
    outs = run(*[dtensor.Tensor(a) for a in arrays])
    last = run.last
    return [o.numpy() for o in outs], [n for n in run.last.graph.nodes if n.kind == "c"]


last = None  # the last compiled graph (its kernels by node id)


def ops_of(node) -> list:
    """The ops a kernel's node runs: a fused group's, or its own."""
    return [op[0] for op in node.params["ops"]] if "ops" in node.params else [node.name]


def ops_in(kernels) -> set:
    """The ops C kernels run, alone or in fused groups."""
    return {op for k in kernels for op in ops_of(k)}


def test_exp_is_within_two_ulp_over_the_float_range():
    x = np.concatenate([np.linspace(-110, 100, 200_003, dtype=np.float32),
                        np.float32([0, -0.0, 1e-30, -1e-30, 88.7, 88.72, 89, -87.9, -88,
                                    np.inf, -np.inf, np.nan])])
    (got,), kernels = compiled(lambda t: (t.exp(),), x)
    assert kernels
    want = np.exp(x.astype(np.float64))
    normal = (want > np.finfo(np.float32).tiny) & (want < np.finfo(np.float32).max)
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() < 2.5e-7, x[normal][np.argmax(rel)]
    assert np.all(got[want >= np.finfo(np.float32).max] == np.inf)
    # below the normal range numpy's subnormals, to within the smallest one
    sub = (want <= np.finfo(np.float32).tiny) & ~np.isnan(x)
    assert np.all(np.abs(got[sub] - want[sub]) <= 2.0 ** -149), x[sub][np.argmax(
        np.abs(got[sub] - want[sub]))]
    assert np.isnan(got[-1]) and got[-3] == np.inf and got[-2] == 0


def test_a_kernel_computes_an_expression_spelled_twice_once(monkeypatch):
    """Equal subexpressions are one node of a kernel (expr.shared): a lower spelling
    rowmax(x) twice runs one max reduction over the row; constants of another sign or type,
    and draws of other keys, stay apart. The result is unchanged."""
    from dtensor.ops import expr as K
    x = K.E("in", (), 0)
    one = K.shared(K.rowmax(x) + K.rowmax(x) + K.lift(0.0) * K.lift(-0.0)
                   + K.lift(1) * K.lift(1.0) + K.lift(np.float32(0.1)) * K.lift(0.1)
                   + K.lift({4: 0.5, 8: 0.25}) * K.lift({8: 0.25, 4: 0.5})
                   + K.rand(x, "key0") - K.rand(x, "key1"))
    prims = [e.prim for e in K.topo([one])]
    assert prims.count("rowmax") == 1 and prims.count("rand") == 2
    assert prims.count("const") == 7  # all but the second, equal, table
    ce = nnops.softmax_cross_entropy  # its lower as first written: the max spelled twice
    monkeypatch.setattr(ce, "lower", lambda x, t: K.log(K.rowsum(K.exp(x - K.rowmax(x))))
                        + K.rowmax(x) - K.rowsum(K.where(K.eq(K.col, t), x, 0.0)))
    xs = 30 * np.random.default_rng(0).standard_normal((5, 37)).astype(np.float32)
    t = np.random.default_rng(1).integers(0, 37, 5)
    (got,), ks = compiled(lambda a: (ce(a, dtensor.Tensor(t)),), xs)
    source = "".join(last.kernels[k.id].source for k in ks)
    assert source.count("= {-INFINITY") == 1, source  # one max reduction's lanes
    np.testing.assert_allclose(got, ce.impl(xs, t), rtol=1e-6)


def _sign_cases():
    from dtensor.ops import expr as K
    x, y = K.E("in", (), 0), K.E("in", (), 1)
    return [  # (expression, sign: -1 never above 0, 1 never below, 0 unknown)
        (x * x * -0.5, -1), (x * x, 1), (K.abs(x), 1), (-K.abs(x), -1), (K.exp(x), 1),
        (-K.exp(x), -1), (x - K.rowmax(x), -1), (x - K.rowmax(y), 0), (x, 0),
        (x * -0.5, 0), (x * y, 0), (K.lift({4: -1.0, 8: -2.0}) * K.abs(x), -1),
        (K.lift({4: -1.0, 8: 2.0}) * K.abs(x), 0), (K.lift(True) * x, 0),
    ]


@pytest.mark.parametrize("case", range(len(_sign_cases())))
def test_the_sign_of_an_exp_argument(case):
    """What _sign knows (exp's upper clamp is dropped only where its argument cannot be
    positive), and what it must not claim."""
    e, want = _sign_cases()[case]
    assert c_backend._sign(e) == want


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_exp_without_its_upper_clamp_changes_no_bit(dtype, monkeypatch):
    """GELU, its gradient and softmax, whose exps take no positive argument, render
    dt_exp_upto (no upper clamp): the same bits as with the clamp, over the tails, infinities
    and NaN."""
    x = np.concatenate([np.linspace(-1e4, 1e4, 4000), np.linspace(-12, 12, 4003),
                        [np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(dtype).reshape(-1, 8)
    g = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)

    def f(x, g):
        x.requires_grad = True
        y = F.gelu(x)
        return (y, dtensor.autograd.grad((y * g).sum(), [x])[0],
                F.softmax(x, -1))

    with np.errstate(all="ignore"):
        got, _ = compiled(f, x, g)
        sources = "".join(k.source for k in last.kernels.values())
        assert sources.count("dt_exp_upto_") >= 3, sources  # each of the three
        monkeypatch.setattr(c_backend, "_sign", lambda e: 0)
        want, _ = compiled(f, x, g)
    assert "dt_exp_upto_" not in "".join(k.source for k in last.kernels.values())
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)



# atol: a float rounding of values of order 1 inside the formula (Phi near x = -2.3 is ~0.01)
@pytest.mark.parametrize("dtype,rtol,atol", [(np.float32, 2e-6, 1e-7), (np.float64, 1e-12, 1e-15)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_its_gradient(dtype, rtol, atol, approximate):
    x = np.concatenate([np.linspace(-9, 9, 4001), [0.0, 1e-9, -1e-9, 1e-5]]).astype(dtype)
    g = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)

    def f(t):
        t.requires_grad = True
        y = F.gelu(t, approximate=approximate)
        (gx,) = dtensor.autograd.grad((y * dtensor.Tensor(g)).sum(), [t])
        return y, gx

    got, kernels = compiled(f, x)
    want = [o.numpy() for o in f(dtensor.Tensor(x))]
    assert {"gelu", "gelu_backward"} <= {n.name for n in kernels}
    if approximate == "tanh":  # 1 + tanh u and 1 - tanh^2 u cancel for u << 0: an ulp of 1,
        atol = 50 * np.finfo(dtype).eps  # times |x| du |g| (up to ~50 here)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 8, 5), (4, 1, 1)])
def test_row_ops_in_both_float_types(dtype, rtol, shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    t = rng.integers(0, shape[-1], shape[:-1])

    def f(a):
        a.requires_grad = True
        s = nnops.softmax(a, causal=True)
        n = nnops.normalize(a, eps=1e-5)
        ls = nnops.log_softmax(a)
        ce = F.cross_entropy(a.reshape(-1, shape[-1]), t.reshape(-1))
        total = (s * s).sum() + (n * n * n).sum() + (ls * s).sum() + ce
        return (s, n, ls, ce) + dtensor.autograd.grad(total, [a])

    got, kernels = compiled(f, x)
    want = [o.numpy() for o in f(dtensor.Tensor(x))]
    assert {"softmax", "softmax_backward", "normalize", "normalize_backward", "log_softmax",
            "log_softmax_backward", "softmax_cross_entropy",
            "softmax_cross_entropy_backward"} <= ops_in(kernels)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 8, 37), (4, 3, 300)])
def test_a_value_kept_in_the_output_row_gives_the_bits_of_computing_it_again(
        dtype, shape, monkeypatch):
    """A row kernel whose last reduction pass and final pass both need a transcendental value
    (softmax's exp, causal or not; cross-entropy's backward) keeps it in the output row: the
    same bits as the kernels that compute it twice, which the eager tests above check."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    t = rng.integers(0, shape[-1], shape[:-1])

    def f(a):
        a.requires_grad = True
        ce = F.cross_entropy(a.reshape(-1, shape[-1]), t.reshape(-1))
        return (nnops.softmax(a, causal=True), F.softmax(a, -1)) + dtensor.autograd.grad(
            ce, [a])

    kept, kernels = compiled(f, x)
    sources = [last.kernels[n.id].source for n in kernels]
    assert sum("o[cc] = " in s for s in sources) == 3, sources  # three kernels keep a value
    monkeypatch.setattr(c_backend._Kernel, "_kept", lambda self, reductions: None)
    again, _ = compiled(f, x)
    for a, b in zip(kept, again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_layer_norm_backward_takes_the_weight_in_its_kernel(dtype, rtol):
    """LayerNorm's input gradient needs the output's gradient times the weight: the product
    joins the normalize backward's row group, so one kernel forms it row by row instead of a
    multiply kernel writing it out first. Values and all three gradients as eager."""
    rng = np.random.default_rng(9)
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in ((4, 6, 40), (40,), (40,)))
    g = rng.standard_normal((4, 6, 40)).astype(dtype)

    def f(a, wt, bt):
        for t in (a, wt, bt):
            t.requires_grad = True
        y = F.layer_norm(a, (40,), wt, bt)
        return (y,) + dtensor.autograd.grad((y * dtensor.Tensor(g)).sum(), [a, wt, bt])

    got, kernels = compiled(f, x, w, b)
    want = [o.numpy() for o in f(*[dtensor.Tensor(a) for a in (x, w, b)])]
    backward = [k for k in kernels if "normalize_backward" in ops_of(k)]
    assert len(backward) == 1 and ops_of(backward[0]) == ["mul", "normalize_backward"]
    assert backward[0].name == "fused_rows" and len(backward[0].inputs) == 3  # g, w, x
    for a, c in zip(got, want):
        np.testing.assert_allclose(a, c, rtol=rtol, atol=rtol)


def test_threads_split_rows_without_changing_a_bit(monkeypatch):
    """A kernel's rows (or an embedding gradient's columns) split over 1, 2 or 3 threads
    (ranges of unequal length): the same bits, since every row (column) is computed alone."""
    monkeypatch.setattr(native, "SPLIT_ELEMENTS", 1 << 14)  # every kernel here splits
    rng = np.random.default_rng(2)
    x = rng.standard_normal((600, 700)).astype(np.float32)
    w, ln_w = (rng.standard_normal(s).astype(np.float32) for s in ((300, 700), (700,)))
    t, idx = rng.integers(0, 700, 600), rng.integers(0, 300, (600, 5))

    def f(a, emb, lw):
        for p in (a, emb, lw):
            p.requires_grad = True
        h = a + F.embedding(dtensor.Tensor(idx), emb).sum(axis=1)
        loss = F.cross_entropy(F.gelu(F.layer_norm(h, (700,), lw)), t)
        return (loss,) + dtensor.autograd.grad(loss, [a, emb, lw])

    outs = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("DTENSOR_NUM_THREADS", threads)
        assert native.num_threads() == int(threads)
        got, kernels = compiled(f, x, w, ln_w)
        assert {"index_add", "normalize_backward"} <= ops_in(kernels)
        outs.append(got)
    for other in outs[1:]:
        for a, b in zip(other, outs[0]):
            np.testing.assert_array_equal(a, b)


def eager_and_c(f, *arrays):
    got, _ = compiled(f, *arrays)
    want = [o.numpy() for o in f(*[dtensor.Tensor(a) for a in arrays])]
    return got, want


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_comparisons_inside_a_group_keep_numpy_semantics(dtype):
    """A comparison's result is bool in numpy (True + True is True, True / 2 is 0.5) and int
    in C: such groups must not compute on it in C."""
    a = np.linspace(-2, 2, 40).astype(dtype).reshape(4, 10)
    got, want = eager_and_c(lambda t: (t * ((t > 0) / 2), t * ((t > 0) + (t > -0.5)),
                                       dtensor.where(t > 0, t, t * 0.5).exp()), a)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_a_reduced_scalar_input():
    a = np.random.default_rng(5).standard_normal((6, 7)).astype(np.float32)
    got, want = eager_and_c(lambda t: ((t - t.sum() / 42.0).exp(), t * t.max()), a)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_cross_entropy_with_targets_of_more_than_one_dim():
    rng = np.random.default_rng(6)
    x, t = rng.standard_normal((2, 5, 3)).astype(np.float32), rng.integers(0, 3, (2, 5))

    def f(a):
        a.requires_grad = True
        loss = F.cross_entropy(a.reshape(-1, 3), t.reshape(-1)) + nnops.softmax_cross_entropy(
            a, t).sum()
        return (loss,) + dtensor.autograd.grad(loss, [a])

    got, want = eager_and_c(f, x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sizes", [(3, 17, 130, 1000), (5, 1000, 203)],
                         ids=["rows-misaligned", "rows-aligned"])
def test_adamw_group_equals_numpy_bit_for_bit(dtype, sizes):
    """The AdamW kernel streams its results where the three output rows line up on 32 bytes
    (total parameters a multiple of the vector) and stores them plainly elsewhere: unaligned
    heads, vector bodies and tails give numpy's bits either way."""
    rng = np.random.default_rng(7)

    def run(backend):
        dtensor.manual_seed(0)
        ps = [dtensor.nn.Parameter(rng.standard_normal(n).astype(dtype)) for n in sizes]
        opt = dtensor.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)

        def step():
            loss = sum((p * p * (i + 1.0)).sum() for i, p in enumerate(ps))
            loss.backward()
            opt.step()
            opt.zero_grad()

        f = dtensor.compile(step, backend=backend)
        for _ in range(3):
            f()
        kinds = {n.name: n.kind for n in f.last.graph.nodes}
        return [p.numpy() for p in ps] + [opt.state[p][k].numpy() for p in ps
                                          for k in ("exp_avg", "exp_avg_sq")], kinds

    rng_state = rng.bit_generator.state
    want, _ = run("numpy")
    rng.bit_generator.state = rng_state
    got, kinds = run("c")
    assert kinds["adamw_group"] == "c"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_embedding_gradient_sums_repeated_rows_as_numpy(dtype):
    """index_add in C: rows of repeated indices summed (in order of occurrence; numpy's
    reduceat associates them pairwise, so to float rounding), rows no index names zero; an index
    outside [0, rows), a negative one included, is the lookup's IndexError."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((50, 24)).astype(dtype)
    idx = np.concatenate([rng.integers(0, 50, (40, 30)).reshape(-1)[:1199], [49]]).reshape(40, 30)
    g = rng.standard_normal((40, 30, 24)).astype(dtype)

    def f(t):
        t.requires_grad = True
        (gw,) = dtensor.autograd.grad((F.embedding(dtensor.Tensor(idx), t)
                                       * dtensor.Tensor(g)).sum(), [t])
        return (gw,)

    (got,), kernels = compiled(f, w)
    (want,) = [o.numpy() for o in f(dtensor.Tensor(w))]
    assert "index_add" in {k.name for k in kernels}
    rtol, atol = (1e-6, 1e-5) if dtype == np.float32 else (1e-14, 1e-13)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    by_row = np.zeros_like(want)  # the definition, row by row
    for i, r in enumerate(idx.reshape(-1)):
        by_row[r] += g.reshape(-1, 24)[i]
    np.testing.assert_allclose(want, by_row, rtol=rtol, atol=atol)
    assert not np.any(want[np.setdiff1d(np.arange(50), idx)])
    kernel = last.kernels[next(k.id for k in kernels if k.name == "index_add")]
    for bad in (50, -1):
        with pytest.raises(IndexError, match=rf"index {bad} is out of range for 50 rows"):
            kernel(g, np.where(idx == idx[0, 0], bad, idx), w)


def test_kernels_split_from_several_threads_at_once(monkeypatch):
    """Two threads splitting kernels over the same pool each wait for their own row ranges."""
    import threading
    import time
    monkeypatch.setenv("DTENSOR_NUM_THREADS", "2")
    done, early = {}, []

    def part(caller, lo, hi):
        time.sleep(0.01 if lo else 0.0)  # the worker's range finishes last
        done.setdefault(caller, []).append(lo)

    def call(caller):
        native.parallel(part, [(caller, 0, 1), (caller, 1, 2)])
        if sorted(done[caller]) != [0, 1]:  # both ranges must have run before the return
            early.append(caller)  # (an assert here would only print, on its own thread)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not early and len(done) == 8, early


def test_ranks_building_one_library_at_once(monkeypatch, tmp_path):
    import concurrent.futures
    monkeypatch.setenv("DTENSOR_COMPILE_CACHE", str(tmp_path))
    source = c_backend.PRELUDE + "".join(f"int f{k}(void) {{ return {k}; }}\n"
                                         for k in range(2000))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        libs = list(pool.map(lambda _: native.build(source), range(6)))
    assert all(lib.f1999() == 1999 for lib in libs)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".c", ".sha256", ".so"]


def test_cross_entropy_target_out_of_range_is_an_index_error():
    x = np.zeros((4, 6), np.float32)
    run = dtensor.compile(lambda a, t: (F.cross_entropy(a, t),), backend="c")
    run(dtensor.Tensor(x), np.array([0, 1, 2, 5]))
    with pytest.raises(IndexError, match="target 6 is out of range for 6 classes"):
        run(dtensor.Tensor(x), np.array([0, 1, 2, 6]))


def test_library_is_built_once_and_loaded_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DTENSOR_COMPILE_CACHE", str(tmp_path))
    source = c_backend.PRELUDE + "int dt_answer(void) { return 42; }\n"
    assert native.build(source).dt_answer() == 42
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt"))
    assert native.build(source).dt_answer() == 42
    assert len(list(tmp_path.glob("dtc_c_*.so"))) == 1


def test_compiler_errors_are_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("DTENSOR_COMPILE_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed on .*dtc_c_.*\\.c"):
        native.build("this is not C;\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.CompilerNotFound, match="no-such-cc.*set \\$CC"):
        native.build("int y;\n")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.CompilerNotFound, match="backend='numpy'"):
        native.build("int x;\n")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'numpy'.*'c'.*'triton'"):
        dtensor.compile(lambda x: x, backend="cuda")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.ranks(2, timeout=300))])
def test_standard_workload_five_steps_as_eager_to_float_rounding(tp):
    """The standard GPT step, 5 AdamW steps, backend="c" against eager: the losses to 1e-6; the
    parameters to float rounding. AdamW divides each gradient element by its own running RMS, so
    an element whose gradient is all rounding noise moves by ~lr either way: a few elements of
    a million differ by up to ~1e-5, each tensor as a whole by < 3e-5 relative (the numpy
    backend, which calls eager's own kernels, is bit-identical: tests/test_compile.py)."""
    from test_compile import STANDARD, train
    eager = train(STANDARD, 5, backend=None, tp=tp)
    ours = train(STANDARD, 5, backend="c", tp=tp)
    np.testing.assert_allclose(ours[0], eager[0], rtol=1e-6)
    far = total = 0
    for k, want in eager[1].items():
        got = ours[1][k]
        assert np.linalg.norm(got - want) <= 3e-5 * np.linalg.norm(want), k
        far += int(np.sum(np.abs(got - want) > 1e-6))
        total += want.size
    assert far <= 1e-4 * total, (far, total)
    assert ours[2].summary() == eager[2].summary()  # the same collectives


def test_a_kernel_argument_address_is_numpys_for_every_kind_of_array():
    """_ptr takes the buffer protocol's fast path where it can and numpy's address otherwise:
    both give the first byte of the array as numpy sees it."""
    readonly = np.zeros(4)
    readonly.flags.writeable = False
    cases = [np.zeros((4, 5), np.float32), np.zeros((4, 5))[1:], np.zeros((4, 5))[:, 1:],
             np.broadcast_to(np.zeros(5), (3, 5)), np.zeros((0, 3)), np.array(3.0),
             np.arange(6), readonly, np.zeros((6, 4)).T]
    for a in cases:
        assert c_backend._ptr(a) == a.ctypes.data, (a.shape, a.strides, a.flags.writeable)


@pytest.mark.parametrize("keepdims", [True, False])
@pytest.mark.parametrize("shape", [(3, 1), (2, 15), (4, 16), (3, 17), (2, 33), (2, 3, 300),
                                   (1, 2048)])
def test_a_last_dim_sum_alone_is_a_row_kernel_within_its_rounding_bound(shape, keepdims):
    """A sum over the last dim with nothing to fuse runs as a C row kernel (16 columns a step
    into two 8-lane accumulators, then the tail): against float64 within the bound of a
    float32 sum of n terms, n eps sum |x|, for every row length around the step (an inf and
    a NaN row as numpy's); a max stays numpy's (the kernel's row max would skip a NaN)."""
    from dtensor.ops import structural as st
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(np.float32)
    x.reshape(-1, shape[-1])[0, -1] = np.nan
    if x.reshape(-1, shape[-1]).shape[0] > 2:
        x.reshape(-1, shape[-1])[2, 0] = np.inf
    axis = (len(shape) - 1,)
    (got, top), kernels = compiled(lambda a: (st.sum(a, axis=axis, keepdims=keepdims),
                                              st.max(a, axis=axis, keepdims=keepdims)), x)
    assert ops_in(kernels) == {"sum"}, ops_in(kernels)
    want = x.astype(np.float64).sum(axis=-1, keepdims=keepdims)
    bound = shape[-1] * np.finfo(np.float32).eps * np.abs(x).astype(np.float64).sum(
        axis=-1, keepdims=keepdims)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite].astype(np.float32))
    assert (np.abs(got[finite] - want[finite]) <= bound[finite]).all()
    np.testing.assert_array_equal(top, x.max(axis=-1, keepdims=keepdims))
