"""Tensor methods PyTorch users type without thinking (pow, type_as, contiguous, softmax(dim),
unflatten, repeat, float, view, masked_fill, expand, and the methods of issue 19's ops: cos, sin,
rsqrt, sigmoid, abs, clamp, argmax, cumsum, tril, triu, repeat_interleave, outer), against
numpy, with gradients against finite differences, and on DTensors against the one-process
result."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 6, 3))

# (label, method call, numpy reference)
CASES = [
    ("pow", lambda t: t.pow(3), lambda a: a ** 3),
    ("type_as", lambda t: t.type_as(dtensor.zeros(1, dtype=np.float32)),
     lambda a: a.astype(np.float32)),
    ("contiguous", lambda t: t.permute(2, 0, 1).contiguous(), lambda a: a.transpose(2, 0, 1)),
    ("softmax dim 1", lambda t: t.softmax(1),
     lambda a: np.exp(a - a.max(1, keepdims=True)) / np.exp(a - a.max(1, keepdims=True))
     .sum(1, keepdims=True)),
    ("unflatten", lambda t: t.unflatten(1, (3, -1)), lambda a: a.reshape(2, 3, 2, 3)),
    ("unflatten last", lambda t: t.unflatten(-1, (3, 1)), lambda a: a.reshape(2, 6, 3, 1)),
    ("repeat", lambda t: t.repeat(2, 1, 3), lambda a: np.tile(a, (2, 1, 3))),
    ("repeat new dims", lambda t: t.repeat(2, 1, 2, 1), lambda a: np.tile(a, (2, 1, 2, 1))),
    ("float", lambda t: t.float(), lambda a: a.astype(np.float32)),
    ("view", lambda t: t.view(2, 3, -1), lambda a: a.reshape(2, 3, 6)),
    ("masked_fill", lambda t: t.masked_fill(t > 0.5, -2.0), lambda a: np.where(a > 0.5, -2.0, a)),
    ("expand", lambda t: t[:, :1].expand(-1, 4, -1), lambda a: np.repeat(a[:, :1], 4, 1)),
    ("cos", lambda t: t.cos(), np.cos),
    ("sin", lambda t: t.sin(), np.sin),
    ("rsqrt", lambda t: (t * t + 0.5).rsqrt(), lambda a: (a * a + 0.5) ** -0.5),
    ("sigmoid", lambda t: t.sigmoid(), lambda a: 1 / (1 + np.exp(-a))),
    ("abs", lambda t: t.abs(), np.abs),
    ("clamp", lambda t: t.clamp(-0.5, 0.5), lambda a: np.clip(a, -0.5, 0.5)),
    ("clamp_min", lambda t: t.clamp_min(0.1), lambda a: np.maximum(a, 0.1)),
    ("clamp_max", lambda t: t.clamp_max(0.1), lambda a: np.minimum(a, 0.1)),
    ("argmax", lambda t: t.argmax(1), lambda a: np.argmax(a, 1)),
    ("argmax dim 0 keepdim", lambda t: t.argmax(0, keepdim=True),
     lambda a: np.argmax(a, 0, keepdims=True)),
    ("cumsum", lambda t: t.cumsum(1), lambda a: np.cumsum(a, 1)),
    ("cumsum dim 0", lambda t: t.cumsum(0), lambda a: np.cumsum(a, 0)),
    ("tril", lambda t: t.tril(), np.tril),
    ("triu", lambda t: t.triu(-1), lambda a: np.triu(a, -1)),
    ("repeat_interleave", lambda t: t.repeat_interleave(2, 1), lambda a: np.repeat(a, 2, 1)),
    ("repeat_interleave dim 0", lambda t: t.repeat_interleave(3, dim=0),
     lambda a: np.repeat(a, 3, 0)),
    ("outer", lambda t: t[0, :, 0].outer(t[1, :, 1]), lambda a: np.outer(a[0, :, 0], a[1, :, 1])),
]


@pytest.mark.parametrize("label,call,ref", CASES, ids=[c[0] for c in CASES])
def test_method_values_and_gradients(label, call, ref):
    t = dtensor.tensor(X, requires_grad=True)
    out = call(t)
    want = ref(X)
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6 if want.dtype == np.float32 else 1e-12)
    if out.dtype != np.float64:
        return
    w = RNG.standard_normal(want.shape)
    (out * dtensor.tensor(w)).sum().backward()
    eps, grad = 1e-6, np.empty_like(X)
    for i in np.ndindex(X.shape):
        d = np.zeros_like(X)
        d[i] = eps
        grad[i] = ((ref(X + d) * w).sum() - (ref(X - d) * w).sum()) / (2 * eps)
    np.testing.assert_allclose(t.grad.numpy(), grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("call,pattern", [
    (lambda t: t.unflatten(1, (4, -1)), r"sizes \(4, -1\) do not split dim 1 of size 6"),
    (lambda t: t.unflatten(1, (2, 2)), r"product must be 6"),
    (lambda t: t.unflatten(1, (-1, -1)), r"at most one"),
    (lambda t: t.repeat(2, 2), r"2 sizes \(2, 2\) for a 3-d tensor"),
    (lambda t: t.unflatten(3, (1,)), r"dim"),
])
def test_bad_arguments_say_what_is_wrong(call, pattern):
    with pytest.raises((ValueError, IndexError), match=pattern):
        call(dtensor.tensor(X))


@pytest.mark.ranks(2, timeout=120)
def test_methods_on_dtensors_equal_one_process(rank):
    from dtensor import Shard, distribute_tensor
    mesh = dtensor.init_device_mesh("cpu", (2,))
    for label, call, ref in CASES:
        d = distribute_tensor(dtensor.tensor(X), mesh, [Shard(0)])
        if label == "repeat":
            # tiles of the sharded dim interleave the ranks' rows: the reshape that merges them
            # cannot keep the shard, and says how to proceed (as any such reshape does)
            with pytest.raises(ValueError, match="cannot keep tensor dim 1 sharded.*Redistribute"):
                call(d)
            continue
        np.testing.assert_allclose(call(d).full_tensor().numpy(), ref(X), rtol=1e-6,
                                   err_msg=label)
