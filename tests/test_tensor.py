"""Tensor semantics and the autograd engine, against numpy and hand-derived gradients."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
from dtensor import Tensor

rng = np.random.default_rng(7)


def test_operators_match_numpy():
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4,))
    x, y = Tensor(a), Tensor(b)
    for got, want in [(x + y, a + b), (x - y, a - b), (x * y, a * b),
                      (x / (y * y + 1), a / (b * b + 1)),
                      (-x, -a), (2.0 - x, 2.0 - a), (3.0 / (x * x + 1), 3.0 / (a * a + 1)),
                      (x.abs() ** 1.5, np.abs(a) ** 1.5),
                      (x @ x.T, a @ a.T), (x.T @ x, a.T @ a), (x @ y, a @ b),
                      (x > 0, a > 0), (x <= y, a <= b), (x == x, a == a), (x != y, a != b)]:
        np.testing.assert_allclose(got.numpy(), want)


def test_ndarray_on_the_left_defers_to_tensor():
    a = rng.standard_normal(3)
    out = a + Tensor(a)
    assert isinstance(out, Tensor)
    np.testing.assert_allclose(out.numpy(), 2 * a)


def test_reductions_shapes_and_dim_alias():
    a = rng.standard_normal((2, 3, 4))
    x = Tensor(a)
    np.testing.assert_allclose(x.sum().numpy(), a.sum())
    np.testing.assert_allclose(x.sum(1).numpy(), a.sum(1))
    np.testing.assert_allclose(x.sum(dim=-1, keepdim=True).numpy(), a.sum(-1, keepdims=True))
    np.testing.assert_allclose(x.mean((0, 2)).numpy(), a.mean((0, 2)))
    np.testing.assert_allclose(x.max(axis=1, keepdims=True).numpy(), a.max(1, keepdims=True))
    np.testing.assert_allclose(x.var(-1).numpy(), a.var(-1, ddof=1))
    np.testing.assert_allclose(x.var(-1, correction=0).numpy(), a.var(-1))


def test_shape_ops():
    a = rng.standard_normal((2, 3, 4))
    x = Tensor(a)
    assert x.reshape(6, -1).shape == (6, 4)
    assert x.view(-1).shape == (24,)
    np.testing.assert_array_equal(x.permute(2, 0, 1).numpy(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(x.transpose(0, 2).numpy(), a.swapaxes(0, 2))
    np.testing.assert_array_equal(x.mT.numpy(), a.swapaxes(-1, -2))
    np.testing.assert_array_equal(x[1, :, ::2].numpy(), a[1, :, ::2])
    np.testing.assert_array_equal(x[..., -1].numpy(), a[..., -1])
    np.testing.assert_array_equal(x[None, 0].numpy(), a[None, 0])
    np.testing.assert_array_equal(x[:, 1:3].numpy(), a[:, 1:3])
    np.testing.assert_array_equal(Tensor(a[:, :1, :]).expand(-1, 5, -1).numpy(),
                                  np.broadcast_to(a[:, :1, :], (2, 5, 4)))
    assert x.unsqueeze(1).shape == (2, 1, 3, 4) and x.unsqueeze(-1).shape == (2, 3, 4, 1)
    assert x.unsqueeze(0).squeeze(0).shape == (2, 3, 4)
    assert x.flatten(1).shape == (2, 12)
    parts = x.split(2, dim=2)
    assert [p.shape for p in parts] == [(2, 3, 2), (2, 3, 2)]
    parts = x.split([1, 3], dim=-1)
    np.testing.assert_array_equal(parts[1].numpy(), a[..., 1:])
    chunks = Tensor(np.arange(5.0)).chunk(4)  # torch.chunk: ceil(5/4) = 2 -> 2, 2, 1
    assert [c.shape[0] for c in chunks] == [2, 2, 1]
    np.testing.assert_array_equal(dtensor.cat([x, x], dim=1).numpy(), np.concatenate([a, a], 1))
    np.testing.assert_array_equal(x.masked_fill(x > 0, 0.0).numpy(), np.where(a > 0, 0.0, a))
    assert x.astype("float32").dtype == np.float32 and x.float().dtype == np.float32


def test_backward_accumulates_and_broadcasts():
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4,))
    x, y = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
    (x * y + y).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.broadcast_to(b, (3, 4)))
    np.testing.assert_allclose(y.grad.numpy(), a.sum(0) + 3)
    (x * 2).sum().backward()  # accumulates into .grad, as PyTorch
    np.testing.assert_allclose(x.grad.numpy(), np.broadcast_to(b, (3, 4)) + 2)


def test_shared_subexpression_gradient():
    # z = x*x used twice: dz/dx flows through both uses.
    a = rng.standard_normal(5)
    x = Tensor(a, requires_grad=True)
    z = x * x
    (z * z + z).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * a ** 3 + 2 * a)


def test_leaf_gradients_own_their_memory():
    # A Linear's weight gradient arrives as a view of a GEMM result: it is kept without a copy
    # (C-ordered, the weight's order), but two leaves never share one gradient buffer, so an
    # in-place update of one (clip_grad_norm_) cannot change the other.
    x = Tensor(rng.standard_normal((5, 3)))
    w = Tensor(rng.standard_normal((4, 3)), requires_grad=True)
    g = rng.standard_normal((5, 4))
    (x @ w.mT).backward(Tensor(g))
    np.testing.assert_allclose(w.grad.numpy(), g.T @ x.numpy())
    assert w.grad.numpy().flags.c_contiguous
    a = Tensor(rng.standard_normal((2, 6)), requires_grad=True)
    b = Tensor(rng.standard_normal((6, 2)), requires_grad=True)
    c = Tensor(rng.standard_normal((3, 4)), requires_grad=True)
    (a + b.mT + c.reshape((2, 6))).sum().backward()
    grads = [t.grad.numpy() for t in (a, b, c)]
    for i in range(3):
        for j in range(i):
            assert not np.shares_memory(grads[i], grads[j])
    for t in grads:
        np.testing.assert_array_equal(t, 1.0)


def test_gradient_through_a_batched_transpose():
    # q @ k^T over (B, H, T, D): k's gradient is computed as (g^T q), in k's own order; a
    # broadcast batch dim (w shared by the stack) takes the summed x^T g instead.
    q, k = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 4))
    g = rng.standard_normal((2, 3, 5, 5))
    qt, kt = Tensor(q, requires_grad=True), Tensor(k, requires_grad=True)
    (qt @ kt.mT).backward(Tensor(g))
    np.testing.assert_allclose(kt.grad.numpy(), np.swapaxes(g, -1, -2) @ q)
    np.testing.assert_allclose(qt.grad.numpy(), g @ k)
    w = Tensor(rng.standard_normal((6, 4)), requires_grad=True)
    (qt @ w.mT).backward(Tensor(np.ones((2, 3, 5, 6))))
    np.testing.assert_allclose(w.grad.numpy(), np.ones((6, 30)) @ q.reshape(30, 4))
    # The gradient reaching k (through k^T's transpose) is in k's own row order, so the
    # reshape to its projection's (rows, features) does not transpose it.
    from dtensor.ops.structural import _matmul_dy
    assert _matmul_dy(Tensor(g), qt, kt.mT).mT.numpy().flags.c_contiguous


def test_embedding_gradient_sums_repeated_and_single_rows():
    # Rows whose index occurs once are copied, repeated ones summed: against np.add.at.
    num = 9
    idx = np.array([[3, 8, 3, 0], [8, 5, 3, 2], [0, 4, 4, 7]])
    w = Tensor(rng.standard_normal((num, 6)), requires_grad=True)
    g = rng.standard_normal((3, 4, 6))
    dtensor.nn.functional.embedding(idx, w).backward(Tensor(g))
    want = np.zeros((num, 6))
    np.add.at(want, idx.reshape(-1), g.reshape(-1, 6))
    np.testing.assert_allclose(w.grad.numpy(), want)


def test_backward_with_gradient_and_errors():
    x = Tensor(rng.standard_normal((2, 3)), requires_grad=True)
    y = x * 3
    with pytest.raises(RuntimeError, match=r"scalar output.*\(2, 3\)"):
        y.backward()
    g = rng.standard_normal((2, 3))
    y.backward(Tensor(g))
    np.testing.assert_allclose(x.grad.numpy(), 3 * g)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3\)"):
        (x * 3).backward(Tensor(np.ones(3)))
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(2)).sum().backward()


def test_second_backward_needs_retain_graph():
    x = Tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * np.ones(3))
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()


def test_no_grad_detach_and_grad_function():
    x = Tensor(np.ones(3), requires_grad=True)
    with dtensor.no_grad():
        y = x * 2
    assert not y.requires_grad and y._node is None
    d = (x * 2).detach()
    assert not d.requires_grad
    z = (x * x).sum()
    (gx,) = dtensor.autograd.grad(z, [x])
    np.testing.assert_allclose(gx.numpy(), 2 * np.ones(3))
    assert x.grad is None  # autograd.grad does not touch .grad


def test_non_float_requires_grad_is_rejected():
    with pytest.raises(TypeError, match="int64"):
        Tensor(np.arange(3), requires_grad=True)


def test_defaults_and_dtypes():
    assert dtensor.tensor([1.0, 2.0]).dtype == np.float32
    assert dtensor.tensor(np.ones(2)).dtype == np.float64
    assert dtensor.tensor([1, 2]).dtype == np.int64
    assert dtensor.zeros(2, 3).dtype == np.float32
    assert dtensor.ones((2, 3), dtype="float64").dtype == np.float64
    assert (dtensor.ones(2) * 2.0).dtype == np.float32  # weak Python scalars keep float32
    with pytest.raises(TypeError, match="floot32"):
        dtensor.zeros(2, dtype="floot32")
    with pytest.raises(TypeError, match="complex128"):
        dtensor.tensor(np.ones(2, np.complex128))


def test_shape_errors_name_the_values():
    with pytest.raises(ValueError, match=r"\(2, 3\) @ \(4, 5\).*3 != 4"):
        dtensor.ones(2, 3) @ dtensor.ones(4, 5)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4,\)"):
        dtensor.ones(2, 3) + dtensor.ones(4)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 4\)"):
        dtensor.ones(2, 3).reshape(4, 4)
    with pytest.raises(IndexError, match="out of bounds.*size 2"):
        dtensor.ones(2, 3)[5]
    with pytest.raises(IndexError, match="axis 3"):
        dtensor.ones(2, 3).sum(3)
    with pytest.raises(ValueError, match=r"must match except"):
        dtensor.cat([dtensor.ones(2, 3), dtensor.ones(3, 2)])


def test_rng_is_counter_based():
    dtensor.manual_seed(5)
    a = dtensor.rand(4, 6).numpy()
    b = dtensor.randn(3).numpy()
    dtensor.manual_seed(5)
    np.testing.assert_array_equal(dtensor.rand(4, 6).numpy(), a)
    np.testing.assert_array_equal(dtensor.randn(3).numpy(), b)
    assert 0.0 <= a.min() and a.max() < 1.0
    assert not np.array_equal(dtensor.rand(4, 6).numpy(), a)  # next call, next stream
