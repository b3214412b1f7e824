"""Pointwise primitives: one ``defop`` block each.

Binary ops broadcast like numpy; their vjps sum the gradient back to each input's shape
(``unbroadcast``). Python scalars are accepted as weak-typed constants (NumPy 2 rules: a
float32 tensor plus 2.0 stays float32) and get no gradient.
"""
from __future__ import annotations

import math

import numpy as np

from dtensor.ops import expr as K
from dtensor.ops.registry import Aval, defop



def _aval_of(x):
    if isinstance(x, (int, float, bool)):
        return x
    return np.empty((0,), x.dtype)


def pointwise_abstract(*xs, **_):
    shapes = [x.shape for x in xs if not isinstance(x, (int, float, bool))]
    dtype = np.result_type(*[_aval_of(x) for x in xs])
    return Aval(np.broadcast_shapes(*shapes), dtype)


def compare_abstract(*xs, **_):
    return Aval(pointwise_abstract(*xs).shape, np.dtype(bool))


def unbroadcast(g, shape):
    """Sum ``g`` down to ``shape``: the vjp of numpy broadcasting."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        i + lead for i, n in enumerate(shape) if n == 1 and g.shape[i + lead] != 1)
    g = g.sum(axis=axes, keepdims=True) if axes else g
    return g.reshape(shape)


def _shape(x):
    return () if isinstance(x, (int, float, bool)) else x.shape


def _log(x):
    return math.log(x) if isinstance(x, (int, float)) else log(x)


def _binary(name, impl, vjp, linearity, lower, **meta):
    return defop(name, impl=impl, abstract=pointwise_abstract, vjp=vjp, linearity=linearity,
                 shard="pointwise", lower=lower, **meta)


def _unary(name, impl, vjp, lower, linearity="none", **meta):
    return defop(name, impl=impl, abstract=pointwise_abstract, vjp=vjp, linearity=linearity,
                 shard="pointwise", lower=lower, **meta)


add = _binary(
    "add", np.add,
    lambda g, out, x, y: (lambda: unbroadcast(g, _shape(x)), lambda: unbroadcast(g, _shape(y))),
    "all", lambda x, y: x + y)

sub = _binary(
    "sub", np.subtract,
    lambda g, out, x, y: (lambda: unbroadcast(g, _shape(x)), lambda: -unbroadcast(g, _shape(y))),
    "all", lambda x, y: x - y)

mul = _binary(
    "mul", np.multiply,
    lambda g, out, x, y: (lambda: unbroadcast(g * y, _shape(x)),
                          lambda: unbroadcast(g * x, _shape(y))),
    "one", lambda x, y: x * y)

# d(x/y)/dy = -x/y^2 = -out/y
div = _binary(
    "div", np.true_divide,
    lambda g, out, x, y: (lambda: unbroadcast(g / y, _shape(x)),
                          lambda: unbroadcast(-g * out / y, _shape(y))),
    (0,), lambda x, y: x / y)

# d(x^y)/dx = y x^(y-1); d(x^y)/dy = x^y log x (only defined for x > 0)
pow = _binary(
    "pow", np.power,
    lambda g, out, x, y: (lambda: unbroadcast(g * y * x ** (y - 1), _shape(x)),
                          lambda: unbroadcast(g * out * _log(x), _shape(y))),
    "none", K.pow, domain="positive")


def _maximum_vjp(g, out, x, y):
    # Ties split the gradient evenly, so the rule is symmetric (as torch.maximum does).
    def gx():
        return unbroadcast(g * ((x > y).astype(g.dtype) + (x == y).astype(g.dtype) * 0.5),
                           _shape(x))

    def gy():
        return unbroadcast(g * ((y > x).astype(g.dtype) + (x == y).astype(g.dtype) * 0.5),
                           _shape(y))
    return gx, gy


maximum = _binary("maximum", np.maximum, _maximum_vjp, "none", K.maximum)

neg = _unary("neg", np.negative, lambda g, out, x: (-g,), K.neg, linearity="all")
exp = _unary("exp", np.exp, lambda g, out, x: (g * out,), K.exp)
log = _unary("log", np.log, lambda g, out, x: (g / x,), K.log, domain="positive")
sqrt = _unary("sqrt", np.sqrt, lambda g, out, x: (g * 0.5 / out,), K.sqrt,
              domain="positive")
tanh = _unary("tanh", np.tanh, lambda g, out, x: (g * (1.0 - out * out),), K.tanh)
# Comparisons produce booleans and have no gradient.
eq = defop("eq", impl=np.equal, abstract=compare_abstract, shard="pointwise", lower=K.eq)
ne = defop("ne", impl=np.not_equal, abstract=compare_abstract, shard="pointwise",
           lower=K.ne)
lt = defop("lt", impl=np.less, abstract=compare_abstract, shard="pointwise",
           lower=lambda x, y: x < y)
le = defop("le", impl=np.less_equal, abstract=compare_abstract, shard="pointwise",
           lower=lambda x, y: x <= y)
gt = defop("gt", impl=np.greater, abstract=compare_abstract, shard="pointwise",
           lower=lambda x, y: x > y)
ge = defop("ge", impl=np.greater_equal, abstract=compare_abstract, shard="pointwise",
           lower=lambda x, y: x >= y)
logical_not = defop("logical_not", impl=np.logical_not, abstract=compare_abstract,
                    shard="pointwise", lower=lambda x: ~x)


def _where_abstract(c, x, y):
    xy = pointwise_abstract(x, y)
    return Aval(np.broadcast_shapes(_shape(c), xy.shape), xy.dtype)


def _where_impl(c, x, y):
    out = np.where(c, x, y)
    # np.where promotes a weak Python scalar branch to float64; keep the tensor's dtype.
    dt = np.result_type(*[_aval_of(v) for v in (x, y)])
    return out if out.dtype == dt else out.astype(dt)


where = defop(
    "where", impl=_where_impl, abstract=_where_abstract,
    vjp=lambda g, out, c, x, y: (None, lambda: unbroadcast(where(c, g, 0.0), _shape(x)),
                                 lambda: unbroadcast(where(c, 0.0, g), _shape(y))),
    linearity="all", shard="pointwise", lower=K.where, nondiff=(0,))


cast = defop(
    "cast", impl=lambda x, dtype: x.astype(dtype),
    abstract=lambda x, dtype: Aval(x.shape, np.dtype(dtype)),
    vjp=lambda g, out, x, dtype: (cast(g, dtype=x.dtype),),
    linearity="all", shard="pointwise", lower=K.cast)


# ---------------------------------------------------------------- Llama-style models' pointwise

cos = _unary("cos", np.cos, lambda g, out, x: (-(g * sin(x)),), K.cos)
sin = _unary("sin", np.sin, lambda g, out, x: (g * cos(x),), K.sin)


def _rsqrt_impl(x):
    with np.errstate(divide="ignore"):  # rsqrt(0) is inf, as torch's, without a warning
        return 1.0 / np.sqrt(x)


# d x^(-1/2) / dx = -x^(-3/2) / 2 = -out^3 / 2
rsqrt = _unary("rsqrt", _rsqrt_impl,
               lambda g, out, x: (g * (-0.5) * (out * out * out),), lambda x: 1.0 / K.sqrt(x),
               domain="positive")


def _sigmoid_impl(x):
    # exp(-|x|) never overflows, and e / (1 + e) keeps the relative precision of tiny results
    # for x << 0 (1 - 1 / (1 + e) would cancel). Its kernel expression is the same form.
    e = np.exp(-np.abs(x))
    s = 1.0 / (1.0 + e)
    return np.where(x < 0, e * s, s)


def _sigmoid_lower(x):
    e = K.exp(-K.abs(x))
    s = 1.0 / (1.0 + e)
    return K.where(x < 0, e * s, s)


sigmoid = _unary("sigmoid", _sigmoid_impl, lambda g, out, x: (g * (out * (1.0 - out)),),
                 _sigmoid_lower)
# The subgradient sign(x), 0 at 0 (as torch.abs).
abs = _unary("abs", np.abs, lambda g, out, x: (where(x > 0, g, 0.0) - where(x < 0, g, 0.0),),
             K.abs)


def _clamp_vjp(g, out, x, lo, hi):
    # out = min(max(x, lo), hi): each element's gradient goes to exactly one of x, lo, hi. With
    # lo > hi every element is hi (as torch.clamp). Ties go to x, as torch's.
    def gx():
        return where(x < lo, 0.0, where(x > hi, 0.0, g))

    def glo():
        return unbroadcast(where(x < lo, where(lo <= hi, g, 0.0), 0.0), _shape(lo))

    def ghi():
        return unbroadcast(where(x > hi, g, where(lo > hi, g, 0.0)), _shape(hi))
    return gx, glo, ghi


# clamp(x, lo, hi): the Tensor method passes the dtype's extreme value for a missing bound, so
# clamp(min=0) of an int tensor stays int.
clamp = defop(
    "clamp", impl=lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
    abstract=pointwise_abstract, vjp=_clamp_vjp, linearity="none", shard="pointwise",
    lower=lambda x, lo, hi: K.minimum(K.maximum(x, lo), hi))
