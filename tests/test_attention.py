"""The attention op (``sdpa_kernel("flash")``, and the default "auto" where a kernel runs it):
on a GPT and a Llama (grouped-query heads), in one process and at tensor-parallel 2, eager and
compiled on every backend, the loss and the gradients are those of the "math" path (matmul,
softmax, matmul) run in one process. Its own values against numpy are in tests/test_ops.py, its
kernels' accuracy in test_kernel_groups.py."""
from __future__ import annotations

import numpy as np
import pytest
from test_compile import full

import dtensor
import dtensor.nn.functional as F
from dtensor.comm import count_collectives
from dtensor.compile.native import cuts
from dtensor.nn import GPT, GPTConfig, Llama, LlamaConfig

GPT_CFG = dict(vocab_size=64, n_layer=2, n_embd=32, n_head=4, mlp_hidden=64, block_size=16)
LLAMA_CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
                 max_seq_len=16)


def _model(arch):
    dtensor.manual_seed(0)
    return GPT(GPTConfig(**GPT_CFG)) if arch == "gpt" else Llama(LlamaConfig(**LLAMA_CFG))


def _loss(model, x, y):
    out = model(x, y)
    if isinstance(out, tuple):
        return out[1]
    logits = out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _run(arch, kernel, backend=None, tp=1):
    """Loss and whole gradients of one step of a model on fixed tokens, the step function and
    the collectives the step issued (the compiled run's, not its trace's)."""
    from dtensor.parallel import parallelize

    model = _model(arch)
    if tp > 1:
        parallelize(model, dtensor.init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
    params = dict(model.named_parameters())

    def step(x, y):
        loss = _loss(model, x, y)
        return (loss,) + tuple(dtensor.autograd.grad(loss, list(params.values())))

    rng = np.random.default_rng(3)
    x, y = (rng.integers(0, 64, (2, 16)) for _ in "xy")
    with F.sdpa_kernel(kernel):
        run = step if backend is None else dtensor.compile(step, backend=backend)
        if backend is not None:
            run(x, y)  # the trace
        with count_collectives() as log:
            outs = run(x, y)
    return float(full(outs[0])), [full(g) for g in outs[1:]], run, log


@pytest.mark.parametrize("backend", [None, "numpy", "c", "triton"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_flash_equals_math_in_one_process(arch, backend):
    want_loss, want_grads, *_ = _run(arch, "math")
    loss, grads, run, _ = _run(arch, "flash", backend)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    if backend in ("c", "triton"):
        names = [n.name for n in run.last.graph.nodes if n.kind == backend]
        assert {"attention", "attention_backward"} <= set(names), names


@pytest.mark.parametrize("backend", [None, "numpy", "c", "triton"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_auto_is_the_attention_op_where_a_kernel_runs_it(arch, backend, monkeypatch):
    """sdpa_kernel's default ("auto"): the attention op in a function traced for the C or
    Triton backend, the math path in eager and on the numpy backend; the loss and gradients
    are the math path's."""
    calls = []
    op = F.nnops.attention
    monkeypatch.setattr(F.nnops, "attention", lambda *a, **k: calls.append(1) or op(*a, **k))
    want_loss, want_grads, *_ = _run(arch, "math")
    loss, grads, run, _ = _run(arch, "auto", backend)
    assert bool(calls) == (backend in ("c", "triton")), (backend, len(calls))
    if backend in ("c", "triton"):
        names = [n.name for n in run.last.graph.nodes if n.kind == backend]
        assert {"attention", "attention_backward"} <= set(names), names
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.ranks(2, timeout=300)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_flash_at_tensor_parallel_2(arch, rank):
    """Heads sharded over 2 ranks: the op's rule keeps them sharded, so the step issues exactly
    the math path's collectives (none for attention), eager and compiled C, with the one-process
    math path's loss and gradients."""
    want_loss, want_grads, *_ = _run(arch, "math")
    for backend in (None, "c"):
        *_, math_log = _run(arch, "math", backend, tp=2)
        loss, grads, _, log = _run(arch, "flash", backend, tp=2)
        assert log.summary() == math_log.summary() and log.count("all_reduce") > 0, (
            log.summary(), math_log.summary())
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for g, w in zip(grads, want_grads):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="kernel must be 'auto', 'math' or 'flash', got 'fast'"):
        with F.sdpa_kernel("fast"):
            pass


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_c_kernel_split_over_threads_equals_one_thread(dtype, monkeypatch):
    """A large enough attention splits its heads over threads, each with its own scratch: the
    forward and the gradients are those of one thread, bit for bit (a head is computed by the
    same code either way), and eager's to rounding."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((2, 6, 67, 20)).astype(dtype) for _ in range(4))

    def step(q, k, v):
        for t in (q, k, v):
            t.requires_grad = True
        with F.sdpa_kernel("flash"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (y,) + tuple(dtensor.autograd.grad((y * dtensor.Tensor(g)).sum(), [q, k, v]))

    runs = {}
    for threads in ("1", "2"):  # 2 x 6 heads of 67^2 x 20: past the kernels' split threshold
        monkeypatch.setenv("DTENSOR_NUM_THREADS", threads)
        assert len(cuts(12, 12 * 67 * 67 * 20)) == int(threads)  # heads split this many ways
        run = dtensor.compile(step, backend="c")
        runs[threads] = [t.numpy() for t in run(*map(dtensor.Tensor, (q, k, v)))]
        assert {"attention", "attention_backward"} <= {
            n.name for n in run.last.graph.nodes if n.kind == "c"}
    want = [t.numpy() for t in step(*map(dtensor.Tensor, (q, k, v)))]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for one, two, w in zip(runs["1"], runs["2"], want):
        np.testing.assert_array_equal(two, one)
        np.testing.assert_allclose(one, w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 67, 20), (2, 3, 16, 32), (1, 1, 5, 8)])
def test_c_kernel_rows_of_large_scores_equal_the_math_path(causal, shape):
    """The C kernels exponentiate a block's rows side by side, each past its last key at -inf:
    with rows whose scores reach ~1e3 (all but the max underflow to 0, the exp's clamp), rows
    and blocks of every length, the forward and the gradients are eager's math path's to
    float32 rounding."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    q[..., :3, :] *= 300

    def step(q, k, v, kernel):
        for t in (q, k, v):
            t.requires_grad = True
        with F.sdpa_kernel(kernel):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return (y,) + tuple(dtensor.autograd.grad((y * dtensor.Tensor(g)).sum(), [q, k, v]))

    run = dtensor.compile(lambda q, k, v: step(q, k, v, "flash"), backend="c")
    got = [t.numpy() for t in run(*map(dtensor.Tensor, (q, k, v)))]
    assert {"attention", "attention_backward"} <= {
        n.name for n in run.last.graph.nodes if n.kind == "c"}
    want = [t.numpy() for t in step(*map(dtensor.Tensor, (q, k, v)), "math")]
    # A score near 300 carries a few ulp(300) ~ 1e-4 of rounding in either path's sum of E
    # products; exp turns that into ~1e-4 relative in p and all that follows: 10x margin.
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-3, atol=1e-5 * np.abs(w).max())
