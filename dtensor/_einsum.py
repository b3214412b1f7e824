"""``dtensor.einsum``: Einstein summation as a composite of permute, reshape, mul, sum and matmul.

Operands are contracted left to right, two at a time. In each pair a subscript is a batch dim
(in both, still needed), a contracted dim (in both, needed by nothing later) or a free dim (in
one only). Subscripts that only one operand has and nothing needs are summed first. Then:
no contracted dim -> a broadcasting ``mul`` (``i,j->ij``); no free dim -> ``mul`` and ``sum``
(``...d,...d->...``); otherwise one batched ``matmul`` with the free and contracted dims
grouped as (batch, L, K) @ (batch, K, R) (``bhqd,bhkd->bhqk``). Being a composite, it gets its
gradient, its DTensor placements and its compiled form from those ops.

Subscripts are letters and at most one ``...`` per operand (batch dims broadcast from the
right, as numpy's); an output without ``->`` is numpy's implicit one. A subscript repeated
within one operand (a diagonal or trace, ``ii->i``) is not supported.
"""
from __future__ import annotations

import math
import string

__all__ = ["einsum"]

_LETTERS = frozenset(string.ascii_letters)


def _error(subscripts: str, why: str) -> ValueError:
    return ValueError(f"einsum {subscripts!r}: {why}")


def _split_term(term: str, subscripts: str, what: str) -> tuple[str, str, bool]:
    """(letters before '...', letters after it, whether it has one)."""
    if term.count("...") > 1:
        raise _error(subscripts, f"{what} {term!r} has more than one '...'.")
    head, dots, tail = term.partition("...")
    bad = sorted(set(head + tail) - _LETTERS)
    if bad:
        raise _error(subscripts, f"{what} {term!r} has {bad}: subscripts are letters a-z, A-Z "
                                 f"and one '...' per operand.")
    return head, tail, bool(dots)


def _parse(subscripts: str, shapes) -> tuple[list[list[str]], list[str]]:
    """Each operand's subscripts and the output's, as lists of names; '...' dims become names
    that no letter can be, aligned from the right."""
    text = subscripts.replace(" ", "")
    lhs, arrow, rhs = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise _error(subscripts, f"{len(terms)} operand subscripts for {len(shapes)} operands; "
                                 f"give one comma-separated term per operand.")
    parsed = [_split_term(t, subscripts, f"operand {k}") for k, t in enumerate(terms)]
    extra = []
    for k, ((head, tail, dots), shape) in enumerate(zip(parsed, shapes)):
        n = len(shape) - len(head) - len(tail)
        if n < 0 or (n and not dots):
            raise _error(subscripts, f"operand {k} has shape {tuple(shape)} ({len(shape)} dims) "
                                     f"but its subscripts {terms[k]!r} name "
                                     f"{len(head) + len(tail)}; give one letter per dim, or "
                                     f"'...' for leading ones.")
        extra.append(n)
    n_dots = max(extra)
    dots_names = [chr(0x100 + i) for i in range(n_dots)]
    ins = [list(head) + dots_names[n_dots - n:] + list(tail)
           for (head, tail, _), n in zip(parsed, extra)]
    for k, names in enumerate(ins):
        twice = sorted({c for c in names if names.count(c) > 1})
        if twice:
            raise NotImplementedError(
                f"einsum {subscripts!r}: subscript {twice[0]!r} appears twice in operand {k} "
                f"({terms[k]!r}), a diagonal or trace; dtensor.einsum supports contractions, "
                f"batch dims, outer products, sums and transposes, not that. Multiply by an "
                f"identity mask (dtensor.tensor(np.eye(n))) and sum instead.")
    if arrow:
        head, tail, dots = _split_term(rhs, subscripts, "output")
        if n_dots and not dots:
            raise _error(subscripts, f"the operands have {n_dots} '...' dims but the output "
                                     f"{rhs!r} has no '...' to put them in.")
        out = list(head) + (dots_names if dots else []) + list(tail)
        seen = {c for names in ins for c in names}
        for c in out:
            if out.count(c) > 1:
                raise _error(subscripts, f"output subscript {c!r} appears more than once.")
            if c not in seen:
                raise _error(subscripts, f"output subscript {c!r} names no operand's dim.")
    else:  # numpy's implicit output: '...' then the letters seen once, in alphabetical order
        letters = [c for names in ins for c in names if c in _LETTERS]
        out = dots_names + sorted(c for c in set(letters) if letters.count(c) == 1)
    return ins, out


def _sizes(subscripts: str, ins, shapes) -> dict:
    """The size of every subscript: equal wherever it appears ('...' dims may be 1 and
    broadcast, as numpy's)."""
    sizes: dict = {}
    for k, (names, shape) in enumerate(zip(ins, shapes)):
        for c, n in zip(names, shape):
            m = sizes.setdefault(c, n)
            if m == n:
                continue
            if c not in _LETTERS and 1 in (m, n):
                sizes[c] = max(m, n)
                continue
            what = f"subscript {c!r}" if c in _LETTERS else "a '...' dim"
            raise _error(subscripts, f"{what} has size {m} in one operand and {n} in operand "
                                     f"{k} (shapes {[tuple(s) for s in shapes]}); sizes of a "
                                     f"subscript must agree.")
    return sizes


def _arrange(x, names: list, order: list):
    """``x`` (dims named ``names``) permuted to ``order``."""
    return x.permute(tuple(names.index(c) for c in order))


def _sum_out(x, names: list, drop) -> tuple:
    axes = tuple(i for i, c in enumerate(names) if c in drop)
    if not axes:
        return x, names
    return x.sum(axis=axes), [c for c in names if c not in drop]


def _contract(a, an, b, bn, keep: list, sizes: dict):
    """a (dims ``an``) with b (dims ``bn``), keeping the subscripts in ``keep``; returns the
    result and its dims' names."""
    a, an = _sum_out(a, an, set(an) - set(bn) - set(keep))
    b, bn = _sum_out(b, bn, set(bn) - set(an) - set(keep))
    order = [c for c in keep if c in an or c in bn]
    batch = [c for c in order if c in an and c in bn]
    left = [c for c in order if c in an and c not in bn]
    right = [c for c in order if c in bn and c not in an]
    contracted = [c for c in an if c in bn and c not in keep]
    if not contracted:  # outer product over the free dims: a broadcasting multiply
        a = _arrange(a, an, batch + left).reshape(
            tuple(a.shape[an.index(c)] for c in batch + left) + (1,) * len(right))
        b = _arrange(b, bn, batch + right).reshape(
            tuple(b.shape[bn.index(c)] for c in batch) + (1,) * len(left)
            + tuple(b.shape[bn.index(c)] for c in right))
        return a * b, batch + left + right
    if not left and not right:  # a dot product per batch entry
        prod = _arrange(a, an, batch + contracted) * _arrange(b, bn, batch + contracted)
        return prod.sum(axis=tuple(range(len(batch), len(batch) + len(contracted)))), batch

    def dims(x, names, group):
        return tuple(x.shape[names.index(c)] for c in group)

    # (batch..., L, K) @ (batch..., K, R); a size-1 batch dim broadcasts in matmul.
    a = _arrange(a, an, batch + left + contracted)
    a = a.reshape(dims(a, batch + left + contracted, batch)
                  + (math.prod(sizes[c] for c in left), math.prod(sizes[c] for c in contracted)))
    b = _arrange(b, bn, batch + contracted + right)
    b = b.reshape(dims(b, batch + contracted + right, batch)
                  + (math.prod(sizes[c] for c in contracted), math.prod(sizes[c] for c in right)))
    out = a @ b
    return out.reshape(tuple(out.shape[:len(batch)]) + tuple(sizes[c] for c in left + right)), \
        batch + left + right


def einsum(subscripts: str, *operands):
    """Einstein summation over ``operands``, as torch.einsum / numpy.einsum.

    Args:
        subscripts: one comma-separated term per operand, letters and at most one ``...``
            each, then optionally ``->`` and the output's (numpy's implicit output without).
        operands: tensors (Tensor, DTensor, numpy arrays), or one list of them.

    Returns:
        The contraction, composed of permute, reshape, mul, sum and matmul, so it has
        gradients and runs on DTensors and under dtensor.compile.

    Example::

        q, k = dtensor.randn(2, 4, 8, 16), dtensor.randn(2, 4, 8, 16)
        scores = dtensor.einsum("bhqd,bhkd->bhqk", q, k)  # (2, 4, 8, 8)
    """
    from dtensor.tensor import TensorMethods, as_tensor
    if not isinstance(subscripts, str):
        raise TypeError(f"einsum: subscripts must be a string such as 'ij,jk->ik', got "
                        f"{subscripts!r} (a {type(subscripts).__name__}).")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError(f"einsum {subscripts!r}: no operands given.")
    xs = [x if isinstance(x, TensorMethods) else as_tensor(x) for x in operands]
    shapes = [tuple(x.shape) for x in xs]
    ins, out = _parse(subscripts, shapes)
    sizes = _sizes(subscripts, ins, shapes)
    x, names = xs[0], ins[0]
    for k in range(1, len(xs)):
        later = {c for n in ins[k + 1:] for c in n}
        keep = out + sorted(later - set(out))
        x, names = _contract(x, names, xs[k], ins[k], keep, sizes)
    x, names = _sum_out(x, names, set(names) - set(out))
    return _arrange(x, names, out)
