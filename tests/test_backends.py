"""dtensor.compile's kernel generators: every fused-group kind as a generated Triton kernel (run
under the Triton interpreter on CPU) or C function (built with the system C compiler) equals the
numpy backend and eager; the GPT train step too."""
from __future__ import annotations

import numpy as np
import pytest
from test_compile import SMALL, train

import dtensor
import dtensor.nn.functional as F
from dtensor.nn import Block, GPTConfig
from dtensor.ops import nn as nnops



def arr(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


BACKENDS = ["triton", "c"]


def three_ways(f, *args, backend, rtol=1e-5, atol=1e-6, exact=False):
    """f eager, through the numpy backend and through ``backend``: all equal (``exact``: bit
    for bit)."""
    def fresh():
        return [dtensor.Tensor(a, requires_grad=a.dtype.kind == "f") if isinstance(a, np.ndarray)
                else a for a in args]

    dtensor.manual_seed(7)
    want = f(*fresh())
    outs = []
    for name in ("numpy", backend):
        dtensor.manual_seed(7)
        compiled = dtensor.compile(f, backend=name)
        outs.append(compiled(*fresh()))
    kernels = [n for n in compiled.last.graph.nodes if n.kind == backend]
    assert kernels, f"no {backend} kernel was generated"
    for got in outs:
        for a, b in zip(got, want):
            if exact:
                np.testing.assert_array_equal(a.numpy(), b.numpy())
            else:
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=rtol, atol=atol)
    return kernels


def ops_of(node) -> list:
    """The ops a kernel's node runs: a fused group's, or its own."""
    return [op[0] for op in node.params["ops"]] if "ops" in node.params else [node.name]


def ops_in(kernels) -> set:
    """The ops the kernels run, alone or in fused groups (a row-wise op joins a row group)."""
    return {op for k in kernels for op in ops_of(k)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_pointwise_chain_is_one_kernel_with_a_broadcast_input(backend):
    def f(x, y, b):
        return (((x * y + b).exp() - 1.0) * 0.5,)

    kernels = three_ways(f, arr(6, 5), arr(6, 5, seed=1), arr(5, seed=2), backend=backend)
    assert [k.name for k in kernels] == ["fused"]
    assert ops_of(kernels[0]) == ["mul", "add", "exp", "sub", "mul"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_row_softmax_forward_and_backward(causal, backend):
    w = arr(2, 3, 8, 8, seed=4)

    def f(x):
        y = nnops.softmax(x, causal=causal)
        (gx,) = dtensor.autograd.grad((y * w).sum(), [x])
        return y, gx

    kernels = three_ways(f, arr(2, 3, 8, 8), backend=backend)
    assert {"softmax", "softmax_backward"} <= ops_in(kernels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_forward_and_backward(backend):
    w, b = arr(24, seed=1), arr(24, seed=2)

    def f(x):
        y = F.layer_norm(x, (24,), dtensor.Tensor(w), dtensor.Tensor(b))
        (gx,) = dtensor.autograd.grad((y * y).sum(), [x])
        return y, gx

    kernels = three_ways(f, arr(5, 7, 24), rtol=1e-4, atol=1e-5, backend=backend)
    assert {"normalize", "normalize_backward"} <= ops_in(kernels)


def test_rms_norm_row_groups():
    """RMSNorm's square, row sum, scale, sqrt (and its backward's row reduction) run as row
    kernels: pointwise ops and a last-dim reduction in one kernel."""
    w = arr(24, seed=1)

    def f(x):
        y = F.rms_norm(x, (24,), dtensor.Tensor(w), 1e-6)
        (gx,) = dtensor.autograd.grad((y * y).sum(), [x])
        return y, gx

    kernels = three_ways(f, arr(5, 7, 24), backend="triton")  # C: numpy row groups
    rows = [k for k in kernels if k.name == "fused_rows"]
    assert len(rows) == 2 and "mul sum div add sqrt" in " ".join(ops_of(rows[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_forward_and_backward(backend):
    t = np.random.default_rng(3).integers(0, 40, 12)

    def f(x):
        loss = F.cross_entropy(x, t)
        (gx,) = dtensor.autograd.grad(loss, [x])
        return loss, gx

    kernels = three_ways(f, arr(12, 40), backend=backend)
    assert {"softmax_cross_entropy", "softmax_cross_entropy_backward"} <= ops_in(kernels)


def test_dropout_draws_the_same_bits():
    def f(x):
        return (F.dropout(x, 0.3),)

    kernels = three_ways(f, arr(33, 17), exact=True, backend="triton")  # C: numpy draws
    # The draw happens inside the kernel that uses it: the mask is never stored.
    assert [k.name for k in kernels] == ["fused"] and "rand ge" in " ".join(ops_of(kernels[0]))


def two_gpt_steps(backend, tp=1):
    """Two AdamW steps of a small GPT (dropout on), eager (backend None) or compiled; returns
    losses, whole parameters, generated kernel kinds and the last step's collectives."""
    losses, params, log, run = train(SMALL, 2, backend=backend, tp=tp, dropout=0.1, batch=4)
    kinds = set() if backend is None else {n.name for n in run.last.graph.nodes
                                           if n.kind == backend}
    return losses, list(params.values()), kinds, log.summary()


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_update_and_a_gpt_step(backend):
    """Two AdamW steps of a small GPT (dropout on): generated kernels = numpy backend = eager,
    float32."""
    eager, numpy_, ours = two_gpt_steps(None), two_gpt_steps("numpy"), two_gpt_steps(backend)
    # adamw_group: one kernel launch updates every parameter
    assert {"adamw_group", "fused", "normalize", "softmax", "softmax_cross_entropy",
            "gelu"} <= ours[2] and "adamw_step" not in ours[2]
    for other in (numpy_, ours):
        np.testing.assert_allclose(other[0], eager[0], rtol=1e-6)
        for a, b in zip(other[1], eager[1]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_block_forward_kernel_count():
    """Pointwise ops between two matmuls always end up in one kernel: no Triton pointwise
    kernel feeds another one directly. The count per block forward is printed."""
    from dtensor.compile.passes.fusion import pointwise_op

    dtensor.manual_seed(0)
    block = Block(GPTConfig(**SMALL, dropout=0.1))
    compiled = dtensor.compile(block, backend="triton")
    with dtensor.no_grad():
        compiled(dtensor.Tensor(arr(2, 16, 32)))
    graph = compiled.last.graph
    triton_nodes = [n for n in graph.nodes if n.kind == "triton"]
    pointwise = {n.id for n in triton_nodes if n.name == "fused" or pointwise_op(n) is not None}
    users = graph.users()
    for n in graph.nodes:
        if n.id in pointwise:
            for a in n.inputs:
                if getattr(a, "id", None) in pointwise and len(users[a.id]) == 1 \
                        and a.shape == n.shape:
                    pytest.fail(f"%{a.id} and %{n.id} are both pointwise kernels:\n{graph}")
    print(f"kernels per block forward: {len(triton_nodes)} triton + "
          f"{sum(1 for n in graph.nodes if n.name == 'matmul')} matmul (extern)")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.ranks(2, timeout=300))
                                     for b in BACKENDS])
def test_tensor_parallel_step_with_generated_kernels(backend, rank):
    """A small GPT at tp=2, two steps: as eager, with the same collectives (count and bytes)
    per step."""
    eager, ours = two_gpt_steps(None, tp=2), two_gpt_steps(backend, tp=2)
    assert {"softmax", "gelu", "fused"} <= ours[2]
    np.testing.assert_allclose(ours[0], eager[0], rtol=1e-6)
    for a, b in zip(ours[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    assert ours[3] == eager[3] and eager[3]["all_reduce"][0] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_constants_in_kernels(backend):
    def f(x):
        return (dtensor.where(x > 0, x * 2.0, float("-inf")).exp(),)

    # Triton's interpreter calls numpy's exp; C has its own (to 2 ulp)
    three_ways(f, arr(7, 9), exact=backend == "triton", rtol=3e-7, atol=0, backend=backend)


def test_float16_gelu():
    x = arr(64).astype(np.float16)
    np.testing.assert_allclose(F.gelu(dtensor.Tensor(x)).numpy().astype(np.float32),
                               F.gelu(dtensor.Tensor(x.astype(np.float32))).numpy(),
                               rtol=2e-3, atol=2e-3)
