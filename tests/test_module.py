"""Tests of dtensor.nn.Module and the standard layers, against PyTorch's documented semantics.

Numerical checks compare to plain-numpy formulas written here, never to the package itself.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import dtensor
from dtensor import nn

rng = np.random.default_rng(20240607)


def arr(*shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def T(a):
    return dtensor.Tensor(np.asarray(a))


# ---------------------------------------------------------------- helper modules
class Leaf(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.w = nn.Parameter(np.zeros((n,), np.float64))
        self.register_buffer("count", dtensor.zeros(1, dtype="int64"))

    def forward(self, x):
        return x * self.w


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.inner = nn.Sequential(nn.Linear(3, 3), nn.GELU())
        self.fc2 = nn.Linear(3, 2)
        self.scale = nn.Parameter(np.ones((1,), np.float32))
        self.note = "not registered"  # plain attribute

    def forward(self, x):
        return self.fc2(self.inner(self.drop(self.act(self.fc1(x))))) * self.scale


# ---------------------------------------------------------------- registration and traversal
def test_attribute_assignment_registers_parameters_and_modules():
    net = Net()
    assert list(net._modules) == ["fc1", "act", "drop", "inner", "fc2"]
    assert list(net._parameters) == ["scale"]
    assert net.note == "not registered"
    assert "note" not in net._parameters and "note" not in net._modules
    assert net.fc1 is net._modules["fc1"]
    assert isinstance(net.fc1.weight, nn.Parameter) and net.fc1.weight.requires_grad
    with pytest.raises(AttributeError, match="nonexistent"):
        net.nonexistent  # noqa: B018
    # A plain value cannot replace a parameter (PyTorch's rule); deleting it first can.
    with pytest.raises(TypeError, match=r"cannot assign float as parameter 'scale'"):
        net.scale = 3.0
    del net.scale
    net.scale = 3.0
    assert "scale" not in dict(net.named_parameters()) and net.scale == 3.0


def test_named_parameters_dotted_names_and_order():
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["scale", "fc1.weight", "fc1.bias", "inner.0.weight", "inner.0.bias",
                     "fc2.weight", "fc2.bias"]
    assert [n for n, _ in net.named_parameters(prefix="model")][:2] == ["model.scale",
                                                                      "model.fc1.weight"]
    assert [n for n, _ in net.named_parameters(recurse=False)] == ["scale"]
    params = list(net.parameters())
    assert len(params) == 7
    assert params[1] is net.fc1.weight and params[-1] is net.fc2.bias
    assert all(isinstance(p, nn.Parameter) for p in params)


def test_shared_parameter_is_listed_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

    m = Tied()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["a.weight", "a.bias", "b.bias"]
    assert len(list(m.parameters())) == 3
    assert m.b.weight is m.a.weight


def test_named_modules_and_children():
    net = Net()
    named = list(net.named_modules())
    assert [n for n, _ in named] == ["", "fc1", "act", "drop", "inner", "inner.0", "inner.1",
                                    "fc2"]
    assert named[0][1] is net and dict(named)["inner.0"] is net.inner[0]
    kids = list(net.children())
    assert kids == [net.fc1, net.act, net.drop, net.inner, net.fc2]
    assert [n for n, _ in net.named_children()] == ["fc1", "act", "drop", "inner", "fc2"]

    # A module shared under two names is listed once, under its first name.
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.x = nn.Linear(2, 2)
            self.y = self.x

    assert [n for n, _ in Shared().named_modules()] == ["", "x"]


def test_register_buffer_in_state_dict_not_in_parameters():
    m = Leaf()
    assert "count" in m.state_dict()
    assert "count" not in dict(m.named_parameters())
    assert m.count is m.state_dict()["count"]

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.leaf = Leaf()

    o = Outer()
    assert set(o.state_dict()) == {"leaf.w", "leaf.count"}
    assert [n for n, _ in o.named_buffers()] == ["leaf.count"]


def test_reassigning_a_buffer_keeps_it_registered():
    """PyTorch: assigning a Tensor to a registered buffer's name updates the buffer."""
    m = Leaf()
    m.count = dtensor.ones(1, dtype="int64")
    assert "count" in m.state_dict(), (
        "BUG (dtensor/nn/module.py Module.__setattr__): assigning a tensor to a registered "
        "buffer name pops it from _buffers, so it vanishes from state_dict()")
    np.testing.assert_array_equal(m.state_dict()["count"].numpy(), [1])


def test_assign_before_super_init_raises_clear_error():
    class Bad(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(2, 2)
            super().__init__()

    with pytest.raises(AttributeError) as ei:
        Bad()
    msg = str(ei.value)
    assert "fc" in msg and "__init__" in msg


# ---------------------------------------------------------------- state_dict
def test_state_dict_round_trip_copies_values_keeps_objects():
    dtensor.manual_seed(1)
    a, b = Net(), Net()
    a.scale.copy_(np.array([2.5], np.float32))
    sd = a.state_dict()
    assert list(sd) == [n for n, _ in a.named_parameters()]
    before = {k: v for k, v in b.state_dict().items()}
    assert not np.allclose(sd["fc1.weight"].numpy(), before["fc1.weight"].numpy())
    out = b.load_state_dict(sd)
    assert tuple(map(list, out)) == ([], [])
    after = b.state_dict()
    for k in sd:
        assert after[k] is before[k], f"{k}: load_state_dict replaced the tensor object"
        np.testing.assert_array_equal(after[k].numpy(), sd[k].numpy())
        assert after[k].dtype == sd[k].dtype
    x = arr(5, 4).astype(np.float32)
    a.eval(), b.eval()
    np.testing.assert_array_equal(a(T(x)).numpy(), b(T(x)).numpy())


def test_load_state_dict_copies_rather_than_aliases():
    """PyTorch copies the values in (param.copy_(src)); later edits of the source must not leak."""
    m = nn.Linear(3, 2, dtype="float64")
    src_w, src_b = arr(2, 3), arr(2)
    keep_w = src_w.copy()
    m.load_state_dict({"weight": T(src_w), "bias": T(src_b)})
    src_w[...] = 123.0  # the caller reuses its buffer
    np.testing.assert_array_equal(
        m.weight.numpy(), keep_w,
        err_msg="BUG (dtensor/tensor.py Tensor.copy_): copy_ stores the source array itself "
                "(astype(copy=False)), so load_state_dict aliases the checkpoint's memory")


def test_load_state_dict_missing_and_unexpected_keys():
    m = Net()
    sd = dict(m.state_dict())
    del sd["fc2.bias"], sd["inner.0.weight"]
    with pytest.raises(KeyError) as ei:
        m.load_state_dict(sd)
    msg = str(ei.value)
    assert "fc2.bias" in msg and "inner.0.weight" in msg

    sd = dict(m.state_dict())
    sd["extra.thing"] = dtensor.zeros(2)
    with pytest.raises(KeyError) as ei:
        m.load_state_dict(sd)
    assert "extra.thing" in str(ei.value)


def test_load_state_dict_shape_mismatch():
    m = nn.Linear(3, 2)
    sd = {"weight": dtensor.zeros(5, 3), "bias": dtensor.zeros(2)}
    with pytest.raises(ValueError) as ei:
        m.load_state_dict(sd)
    msg = str(ei.value)
    assert "weight" in msg and "(5, 3)" in msg and "(2, 3)" in msg
    with pytest.raises(ValueError):
        m.load_state_dict(sd, strict=False)


def test_load_state_dict_non_strict_returns_missing_unexpected_and_loads_rest():
    m = nn.Linear(3, 2, dtype="float64")
    w = arr(2, 3)
    old_bias = m.bias.numpy().copy()
    missing, unexpected = m.load_state_dict({"weight": T(w), "junk": T(arr(4))}, strict=False)
    assert list(missing) == ["bias"] and list(unexpected) == ["junk"]
    np.testing.assert_array_equal(m.weight.numpy(), w)
    np.testing.assert_array_equal(m.bias.numpy(), old_bias)


# ---------------------------------------------------------------- modes, hooks, apply
def test_train_eval_propagate_and_dropout_identity_in_eval():
    net = Net()
    assert all(m.training for m in net.modules())
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    x = arr(64, 3).astype(np.float32)
    y = net.drop(T(x)).numpy()
    np.testing.assert_array_equal(y, x)
    assert net.train() is net
    assert all(m.training for m in net.modules())
    net.train(False)
    assert [m.training for m in net.modules()] == [False] * 8


def test_dropout_in_training_zeroes_and_rescales():
    dtensor.manual_seed(3)
    d = nn.Dropout(0.25)
    x = np.abs(arr(200, 50)) + 1.0
    y = d(T(x)).numpy()
    zero = y == 0
    np.testing.assert_allclose(y[~zero], x[~zero] / 0.75, rtol=1e-12)
    assert abs(zero.mean() - 0.25) < 0.02
    np.testing.assert_array_equal(nn.Dropout(1.0)(T(x)).numpy(), np.zeros_like(x))
    np.testing.assert_array_equal(nn.Dropout(0.0)(T(x)).numpy(), x)


def test_forward_pre_hook_replaces_args_and_forward_hook_replaces_output():
    m = Leaf()
    m.w.copy_(np.array([1.0, 2.0, 3.0]))
    x = np.array([1.0, 1.0, 1.0])
    seen = []

    def pre(mod, args):
        seen.append(("pre", mod, len(args)))
        return (args[0] * 10.0,)

    def post(mod, args, out):
        seen.append(("post", mod, args[0].numpy().copy()))
        return out + 1.0

    h1 = m.register_forward_pre_hook(pre)
    h2 = m.register_forward_hook(post)
    np.testing.assert_array_equal(m(T(x)).numpy(), [11.0, 21.0, 31.0])
    assert seen[0] == ("pre", m, 1)
    assert seen[1][0] == "post" and seen[1][1] is m
    np.testing.assert_array_equal(seen[1][2], [10.0, 10.0, 10.0])  # post sees replaced args

    # A hook returning None leaves things alone; a bare (non-tuple) return is the single arg.
    h1.remove()
    np.testing.assert_array_equal(m(T(x)).numpy(), [2.0, 3.0, 4.0])
    h2.remove()
    np.testing.assert_array_equal(m(T(x)).numpy(), [1.0, 2.0, 3.0])
    h3 = m.register_forward_pre_hook(lambda mod, args: args[0] * 2.0)
    h4 = m.register_forward_hook(lambda mod, args, out: None)
    np.testing.assert_array_equal(m(T(x)).numpy(), [2.0, 4.0, 6.0])
    h3.remove(), h4.remove()
    h3.remove()  # removing twice is harmless
    np.testing.assert_array_equal(m(T(x)).numpy(), [1.0, 2.0, 3.0])


def test_apply_visits_every_module_children_first():
    net = Net()
    visited = []
    assert net.apply(visited.append) is net
    assert len(visited) == 8
    assert {id(m) for m in visited} == {id(m) for _, m in net.named_modules()}
    assert visited[-1] is net  # PyTorch: children first, then self
    assert visited.index(net.inner[0]) < visited.index(net.inner)

    def init(m):
        if isinstance(m, nn.Linear):
            m.weight.fill_(0.5)

    net.apply(init)
    for lin in (net.fc1, net.inner[0], net.fc2):
        assert np.all(lin.weight.numpy() == 0.5)


def test_modulelist_and_sequential():
    dtensor.manual_seed(5)
    layers = [nn.Linear(4, 5, dtype="float64"), nn.ReLU(), nn.Linear(5, 2, dtype="float64")]
    ml = nn.ModuleList(layers[:2])
    ml.append(layers[2])
    assert len(ml) == 3 and list(ml) == layers and ml[-1] is layers[2]
    assert [n for n, _ in ml.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]

    seq = nn.Sequential(*layers)
    x = arr(6, 4)
    W1, b1 = layers[0].weight.numpy(), layers[0].bias.numpy()
    W2, b2 = layers[2].weight.numpy(), layers[2].bias.numpy()
    ref = np.maximum(x @ W1.T + b1, 0.0) @ W2.T + b2
    np.testing.assert_allclose(seq(T(x)).numpy(), ref, rtol=1e-12, atol=1e-14)
    assert [n for n, _ in seq.named_modules()] == ["", "0", "1", "2"]


def test_sequential_takes_modules_as_varargs():
    """PyTorch: nn.Sequential(*modules)."""
    a, b = nn.Linear(2, 3), nn.ReLU()
    assert list(nn.Sequential(a, b)) == [a, b]


# ---------------------------------------------------------------- layers vs numpy
def test_linear_forward_matches_numpy():
    dtensor.manual_seed(7)
    lin = nn.Linear(5, 3, dtype="float64")
    W, b = lin.weight.numpy(), lin.bias.numpy()
    assert W.shape == (3, 5) and b.shape == (3,)
    x = arr(2, 4, 5)
    np.testing.assert_allclose(lin(T(x)).numpy(), x @ W.T + b, rtol=1e-12, atol=1e-14)
    lin32 = nn.Linear(5, 3)
    assert lin32.weight.dtype == np.float32
    x32 = x.astype(np.float32)
    ref = x32.astype(np.float64) @ lin32.weight.numpy().T.astype(np.float64) + lin32.bias.numpy()
    np.testing.assert_allclose(lin32(T(x32)).numpy(), ref, rtol=1e-5, atol=1e-6)


def test_linear_init_bound():
    dtensor.manual_seed(11)
    lin = nn.Linear(64, 128)
    bound = 1.0 / math.sqrt(64)
    w, b = lin.weight.numpy(), lin.bias.numpy()
    assert np.all(np.abs(w) <= bound) and np.all(np.abs(b) <= bound)
    # Uniform over the whole range, not a narrower one.
    assert w.max() > 0.95 * bound and w.min() < -0.95 * bound
    assert abs(w.mean()) < 0.01 and abs(w.std() - bound / math.sqrt(3)) < 0.01


def test_linear_without_bias():
    dtensor.manual_seed(12)
    lin = nn.Linear(4, 2, bias=False, dtype="float64")
    assert lin.bias is None
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    assert list(lin.state_dict()) == ["weight"]
    x = arr(3, 4)
    np.testing.assert_allclose(lin(T(x)).numpy(), x @ lin.weight.numpy().T, rtol=1e-12)


def test_linear_wrong_feature_count():
    lin = nn.Linear(13, 2)
    with pytest.raises(ValueError) as ei:
        lin(dtensor.zeros(4, 7))
    msg = str(ei.value)
    assert re.search(r"\b7\b", msg) and re.search(r"\b13\b", msg), msg


def test_embedding_matches_numpy_indexing():
    dtensor.manual_seed(13)
    emb = nn.Embedding(10, 4)
    W = emb.weight.numpy()
    assert W.shape == (10, 4)
    idx = np.array([[0, 9, 3], [3, 3, 1]], np.int64)
    np.testing.assert_array_equal(emb(T(idx)).numpy(), W[idx])
    big = nn.Embedding(1000, 16).weight.numpy()  # N(0, 1) init, as PyTorch
    assert abs(big.mean()) < 0.03 and abs(big.std() - 1.0) < 0.03


def _np_layer_norm(x, w, b, eps, nd):
    ax = tuple(range(x.ndim - nd, x.ndim))
    mu = x.mean(ax, keepdims=True)
    var = ((x - mu) ** 2).mean(ax, keepdims=True)  # biased
    return (x - mu) / np.sqrt(var + eps) * w + b


def test_layer_norm_matches_numpy():
    ln = nn.LayerNorm(4, dtype="float64")
    assert ln.eps == 1e-5
    w, b = arr(4), arr(4)
    ln.weight.copy_(w)
    ln.bias.copy_(b)
    # Small spread so eps matters, and n=4 so biased vs unbiased variance differ by 4/3.
    x = arr(3, 5, 4, scale=3e-3) + 2.0
    np.testing.assert_allclose(ln(T(x)).numpy(), _np_layer_norm(x, w, b, 1e-5, 1),
                               rtol=1e-10, atol=1e-12)
    ln2 = nn.LayerNorm((2, 3), eps=1e-3, elementwise_affine=False, dtype="float64")
    assert ln2.weight is None and ln2.bias is None and list(ln2.parameters()) == []
    x = arr(4, 2, 3, scale=0.05)
    np.testing.assert_allclose(ln2(T(x)).numpy(), _np_layer_norm(x, 1.0, 0.0, 1e-3, 2),
                               rtol=1e-10, atol=1e-12)


def test_rms_norm_matches_numpy():
    rn = nn.RMSNorm(6, eps=1e-4, dtype="float64")
    w = arr(6)
    rn.weight.copy_(w)
    x = arr(3, 6, scale=0.02)
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-4) * w
    np.testing.assert_allclose(rn(T(x)).numpy(), ref, rtol=1e-10, atol=1e-12)
    # eps=None means finfo(dtype).eps, as torch.nn.RMSNorm; tiny inputs make it visible.
    rn0 = nn.RMSNorm(6, dtype="float64")
    x = arr(3, 6, scale=1e-8)
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(np.float64).eps)
    np.testing.assert_allclose(rn0(T(x)).numpy(), ref, rtol=1e-10)


def test_gelu_matches_numpy():
    x = np.linspace(-6, 6, 241)
    tanh_ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(nn.GELU("tanh")(T(x)).numpy(), tanh_ref, rtol=1e-12,
                               atol=1e-14)
    erf = np.vectorize(math.erf)
    exact_ref = 0.5 * x * (1 + erf(x / math.sqrt(2)))
    # The exact form uses a documented polynomial erf (|error in erf| < 1.5e-7, see
    # dtensor/ops/nn.py), so x * Phi(x) is within |x| * 0.75e-7 of the truth.
    np.testing.assert_allclose(nn.GELU()(T(x)).numpy(), exact_ref, rtol=0, atol=5e-7)
    # The two forms genuinely differ, so the first check is not passing by accident.
    assert np.abs(tanh_ref - exact_ref).max() > 1e-4
    with pytest.raises(ValueError, match="sigmoid"):
        nn.GELU("sigmoid")


# ---------------------------------------------------------------- errors and grads
def test_invalid_dtype_raises_type_error_naming_it():
    with pytest.raises(TypeError, match="floot32"):
        dtensor.zeros(2, dtype="floot32")
    with pytest.raises(TypeError, match="floot32"):
        nn.Linear(2, 2, dtype="floot32")


def test_dropout_invalid_probability():
    with pytest.raises(ValueError, match="1.5"):
        nn.Dropout(p=1.5)
    with pytest.raises(ValueError):
        nn.Dropout(p=-0.1)


def test_zero_grad_sets_grads_to_none():
    dtensor.manual_seed(17)
    net = Net()
    x = T(arr(4, 4).astype(np.float32))
    net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_zero_grad_set_to_none_false_zeroes():
    """PyTorch: zero_grad(set_to_none=False) leaves zero-filled gradients, not None."""
    lin = nn.Linear(3, 2)
    lin(dtensor.ones(1, 3)).sum().backward()
    lin.zero_grad(set_to_none=False)
    for name, p in lin.named_parameters():
        assert p.grad is not None, (
            f"BUG (dtensor/nn/module.py Module.zero_grad): set_to_none=False is ignored, "
            f"{name}.grad became None instead of zeros")
        np.testing.assert_array_equal(p.grad.numpy(), np.zeros(p.shape))


def test_sizes_accept_numpy_integers():
    """Sizes read from arrays or configs (numpy ints) are ints to every check, and stored as
    Python ints; floats, bools and strings are refused (tests/test_bad_input.py)."""
    from dtensor.nn import GPTConfig, LayerNorm, Linear
    cfg = GPTConfig(n_layer=np.int64(2), n_head=np.int32(2), n_embd=np.int64(8),
                    vocab_size=np.uint8(10), block_size=np.int16(4))
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.mlp_hidden) == (2, 2, 8, 32)
    assert all(type(v) is int for v in (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size))
    lin = Linear(np.int64(3), np.int32(2))
    assert lin.weight.shape == (2, 3) and type(lin.in_features) is int
    assert LayerNorm(np.int64(4)).normalized_shape == (4,)
    assert LayerNorm([np.int64(2), 3]).normalized_shape == (2, 3)
