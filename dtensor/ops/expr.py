"""The kernel description: an op's pointwise or row-wise math as one expression over a small set
of scalar primitives plus row reductions, which every backend renders from its own table of
spellings (compile/kernels.py: numpy, C, Triton).

An op's ``lower`` is ``lower(*inputs, **params) -> E``: the inputs arrive as ``E`` leaves and the
result is built with Python operators and the functions below. The expression is about one
element ``(row, col)`` of a kernel over rows of the last dim: a row reduction (``rowsum``,
``rowmax``) gives one value per row, which broadcasts back along the row, so softmax is
``e = exp(x - rowmax(x)); e / rowsum(e)``. ``causal(value)`` limits a whole kernel to the
columns ``col <= row % L`` of each trailing (L, C) matrix (zeros elsewhere), as FlashAttention's
causal bound does; ``rand(offset, key)`` draws counter-based uniforms (dtensor/random.py).

A constant may be a {itemsize: value} table, resolved for the kernel's float type (a cut-off
that depends on it).
"""
from __future__ import annotations

import numpy as np

# Computed element by element (every renderer's table spells them); the leaves, the row
# reductions and causal's column limit are the kernel's own structure.
PRIMS = ("neg", "not", "abs", "exp", "log", "sqrt", "tanh", "sin", "cos", "add", "sub", "mul",
         "div", "pow", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne", "where", "cast",
         "rand", "randn")
LEAVES = ("in", "const", "col", "row", "cols")
REDUCTIONS = ("rowsum", "rowmax")


class E:
    """One node of a kernel expression: a primitive, its argument nodes and an attribute (an
    input's index, a constant's value, a cast's dtype, a draw's key name)."""

    __slots__ = ("prim", "args", "attr")
    __hash__ = object.__hash__  # nodes are compared by identity: == is not overloaded

    def __init__(self, prim: str, args=(), attr=None):
        self.prim, self.args, self.attr = prim, tuple(lift(a) for a in args), attr

    def __repr__(self) -> str:
        inner = ", ".join(map(repr, self.args)) + (f"; {self.attr!r}" if self.attr is not None
                                                   else "")
        return f"{self.prim}({inner})"

    def __add__(self, o): return E("add", (self, o))
    def __radd__(self, o): return E("add", (o, self))
    def __sub__(self, o): return E("sub", (self, o))
    def __rsub__(self, o): return E("sub", (o, self))
    def __mul__(self, o): return E("mul", (self, o))
    def __rmul__(self, o): return E("mul", (o, self))
    def __truediv__(self, o): return E("div", (self, o))
    def __rtruediv__(self, o): return E("div", (o, self))
    def __neg__(self): return E("neg", (self,))
    def __invert__(self): return E("not", (self,))
    def __lt__(self, o): return E("lt", (self, o))
    def __le__(self, o): return E("le", (self, o))
    def __gt__(self, o): return E("gt", (self, o))
    def __ge__(self, o): return E("ge", (self, o))


def lift(v) -> E:
    return v if isinstance(v, E) else E("const", (), v)


def _fn(prim):
    return lambda *args: E(prim, args)


neg, abs, exp, log, sqrt, tanh, sin, cos = map(_fn, ("neg", "abs", "exp", "log", "sqrt",
                                                     "tanh", "sin", "cos"))
pow, maximum, minimum, eq, ne = map(_fn, ("pow", "maximum", "minimum", "eq", "ne"))
where, rowsum, rowmax = _fn("where"), _fn("rowsum"), _fn("rowmax")
col, row, cols = E("col"), E("row"), E("cols")


def cast(x, dtype) -> E:
    return E("cast", (x,), np.dtype(dtype))


def causal(x) -> E:
    """``x`` on the columns j <= i of each trailing (L, C) matrix of the kernel, 0 elsewhere; the
    kernel's reductions see only those columns."""
    return E("causal", (x,))


def rand(offset, key: str, normal: bool = False) -> E:
    return E("randn" if normal else "rand", (offset,), key)


def polynomial(t, coeffs) -> E:
    """c0 t^n + ... + cn by Horner's rule (coefficients from the highest power)."""
    acc = lift(coeffs[0])
    for c in coeffs[1:]:
        acc = acc * t + c
    return acc


def topo(roots) -> list:
    """Every node reachable from ``roots``, each once, arguments before users."""
    order, seen = [], set()

    def visit(e):
        stack = [(e, False)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
            elif id(n) not in seen:
                seen.add(id(n))
                stack.append((n, True))
                stack.extend((a, False) for a in reversed(n.args))
    for r in roots:
        visit(r)
    return order


def shared(root: E) -> E:
    """``root`` with equal subexpressions made one node (hash-consing, arguments first), so a
    kernel computes each once: a lower that spells rowmax(x) twice would otherwise make its
    kernel run two reductions over the row. Equal: same primitive, same attribute, of the same
    type and written the same (0.0 and -0.0 apart; numpy 1's float32 0.1 and 0.1 too), and the
    same argument nodes."""
    def spelled(a):
        if isinstance(a, dict):  # a constant's {itemsize: value} table
            return tuple((k, spelled(v)) for k, v in sorted(a.items()))
        return type(a), repr(a)

    canon, memo = {}, {}
    for e in topo([root]):
        args = tuple(memo[id(a)] for a in e.args)
        key = (e.prim, spelled(e.attr), tuple(map(id, args)))
        if key not in canon:
            canon[key] = e if args == e.args else E(e.prim, args, e.attr)
        memo[id(e)] = canon[key]
    return memo[id(root)]
