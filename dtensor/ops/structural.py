"""Reductions, shape ops, matmul, indexing and factories: one ``defop`` block each.

Params are canonical and hashable (axes as sorted tuples of non-negative ints, shapes as
tuples, indices as tuples of ``int | (start, stop, step) | None``) so that DTensor and the
compiler can cache on ``(op, input specs, params)``. Tensor methods canonicalise them.
"""
from __future__ import annotations

import numpy as np

from dtensor import random as _random
from dtensor.ops import expr as K
from dtensor.ops.pointwise import unbroadcast
from dtensor.ops.registry import Aval, defop

# ---------------------------------------------------------------- reductions


def _reduced_shape(shape, axis, keepdims):
    if keepdims:
        return tuple(1 if i in axis else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axis)


def _keepdims_shape(shape, axis):
    return tuple(1 if i in axis else n for i, n in enumerate(shape))


def _sum_vjp(g, out, x, axis, keepdims):
    if not keepdims:
        g = g.reshape(_keepdims_shape(x.shape, axis))
    return (g.broadcast_to(x.shape),)


def accumulate_dtype(dtype) -> np.dtype:
    """The type a reduction of ``dtype`` accumulates in: float32 for narrower floats (as
    PyTorch's), else ``dtype`` itself. float16 holds 3 significant digits and nothing past
    65504: a 256-wide row of spread 16 has a sum of squares past that, and 1000 additions of
    0.1 down a column come to 105.2."""
    dtype = np.dtype(dtype)
    return np.promote_types(dtype, np.float32) if dtype.kind == "f" else dtype


def _sum_impl(x, axis, keepdims):
    acc = accumulate_dtype(x.dtype)
    if acc == x.dtype:
        return np.sum(x, axis=axis, keepdims=keepdims)
    # Rounded once, at the end; a true sum past float16's range is inf, as PyTorch's. Under
    # DTensor the per-rank partial sums are rounded so and all-reduced in float16 (as PyTorch's
    # DTensor over NCCL): p ranks add p - 1 roundings, and mean and var divide in float32
    # first (TensorMethods.mean), so their partials stay in range.
    with np.errstate(over="ignore"):
        return np.sum(x, axis=axis, keepdims=keepdims, dtype=acc).astype(x.dtype)


sum = defop(
    "sum", impl=_sum_impl,
    abstract=lambda x, axis, keepdims: Aval(_reduced_shape(x.shape, axis, keepdims), x.dtype),
    vjp=_sum_vjp, linearity="all", shard="reduce",
    lower=lambda x, axis, keepdims: K.rowsum(x))  # in a kernel: a last-dim, keepdims sum


def _max_vjp(g, out, x, axis, keepdims):
    # Ties share the gradient evenly (torch.amax semantics): d max / dx_i = [x_i == max] / count.
    kshape = _keepdims_shape(x.shape, axis)
    if not keepdims:
        g, out = g.reshape(kshape), out.reshape(kshape)
    mask = (x == out).astype(g.dtype)
    return (mask * (g / mask.sum(axis=axis, keepdims=True)),)


def _max_local(x, axis, keepdims, *, in_blocks, out_block):
    if all(x.shape[a] for a in axis):
        return np.max(x, axis=axis, keepdims=keepdims)
    # An empty trailing shard (5 rows over 4 ranks: 2, 2, 1, 0) contributes max's identity.
    low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    return np.full(out_block.local_shape, low, x.dtype)


max = defop(
    "max", impl=lambda x, axis, keepdims: np.max(x, axis=axis, keepdims=keepdims),
    abstract=lambda x, axis, keepdims: Aval(_reduced_shape(x.shape, axis, keepdims), x.dtype),
    vjp=_max_vjp, linearity="none", shard="reduce", local=_max_local,
    lower=lambda x, axis, keepdims: K.rowmax(x))



def _argmax_abstract(x, axis, keepdims):
    return Aval(_reduced_shape(x.shape, (axis,), keepdims), np.dtype(np.int64))


# The index of the first largest entry along ``axis`` (NaN counts as largest), as torch.argmax.
# Every index reads the whole dim, so its rule keeps that dim whole: a shard of it is gathered
# first (per-rank maxima and offsets would need a reduction no Partial expresses).
argmax = defop(
    "argmax",
    impl=lambda x, axis, keepdims: np.argmax(x, axis=axis, keepdims=keepdims).astype(np.int64),
    abstract=_argmax_abstract, shard="along")


def _cumsum_dtype(dtype) -> np.dtype:
    # Integers and bools sum in the platform integer (as numpy and torch); narrow floats in
    # float32, rounded once per element (as sum's).
    dtype = np.dtype(dtype)
    return np.cumsum(np.zeros(1, dtype)).dtype if dtype.kind in "biu" else dtype


def _cumsum_impl(x, axis, reverse):
    acc = accumulate_dtype(x.dtype) if x.dtype.kind == "f" else _cumsum_dtype(x.dtype)
    if reverse:
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis, dtype=acc).astype(_cumsum_dtype(x.dtype), copy=False)
    return np.flip(out, axis) if reverse else out


# Running sums along ``axis``; ``reverse`` sums from the end (as jax.lax.cumsum), which is the
# vjp: d out_j / d x_i = [i <= j], so x_i's gradient is the sum of g_j over j >= i.
cumsum = defop(
    "cumsum", impl=_cumsum_impl,
    abstract=lambda x, axis, reverse: Aval(tuple(x.shape), _cumsum_dtype(x.dtype)),
    vjp=lambda g, out, x, axis, reverse: (cumsum(g, axis=axis, reverse=not reverse),),
    linearity="all", shard="along")

# ---------------------------------------------------------------- shape ops

def _block_shape(params, ins, out):
    """A shape param names the global result: on a block, the block's own shape."""
    return {**params, "shape": out.local_shape}


reshape = defop(
    "reshape", impl=lambda x, shape: np.reshape(x, shape),
    abstract=lambda x, shape: Aval(shape, x.dtype),
    vjp=lambda g, out, x, shape: (g.reshape(x.shape),),
    linearity="all", shard="reshape", localize=_block_shape)

permute = defop(
    "permute", impl=lambda x, axes: np.transpose(x, axes),
    abstract=lambda x, axes: Aval(tuple(x.shape[a] for a in axes), x.dtype),
    vjp=lambda g, out, x, axes: (g.permute(*np.argsort(axes).tolist()),),
    linearity="all", shard="permute")

broadcast_to = defop(
    "broadcast_to", impl=lambda x, shape: np.broadcast_to(x, shape),
    abstract=lambda x, shape: Aval(shape, x.dtype),
    vjp=lambda g, out, x, shape: (unbroadcast(g, x.shape),),
    linearity="all", shard="broadcast", localize=_block_shape)


def index_key(key):
    """numpy index from the canonical hashable form (slices are unhashable before 3.12)."""
    return tuple(slice(*k) if isinstance(k, tuple) else k for k in key)


getitem = defop(
    "getitem", impl=lambda x, key: x[index_key(key)],
    abstract=lambda x, key: Aval(np.broadcast_to(np.empty((), np.bool_), x.shape)[
        index_key(key)].shape, x.dtype),
    vjp=lambda g, out, x, key: (slice_scatter(g, shape=tuple(x.shape), key=key),),
    linearity="all", shard="getitem",
    localize=lambda params, ins, out: {"key": ins[0].local_key(params["key"])})


def _slice_scatter_impl(g, shape, key):
    out = np.zeros(shape, g.dtype)
    out[index_key(key)] = g
    return out


# The vjp of getitem: ``g`` placed at ``key`` in zeros of ``shape``.
slice_scatter = defop(
    "slice_scatter", impl=_slice_scatter_impl,
    abstract=lambda g, shape, key: Aval(shape, g.dtype),
    vjp=lambda g2, out, g, shape, key: (getitem(g2, key=key),),
    linearity="all", shard="slice_scatter",
    localize=lambda params, ins, out: {"shape": out.local_shape,
                                       "key": out.local_key(params["key"])})


def _cat_abstract(*xs, axis):
    shape = list(xs[0].shape)
    shape[axis] = int(np.sum([x.shape[axis] for x in xs]))
    return Aval(tuple(shape), np.result_type(*[x.dtype for x in xs]))


def _cat_vjp(g, out, *xs, axis):
    grads, start = [], 0
    for x in xs:
        stop = start + x.shape[axis]
        # canonical full slices (0, n, 1): the getitem rule keeps a shard of a full dim
        key = tuple((0, g.shape[d], 1) if d != axis else (start, stop, 1)
                    for d in range(g.ndim))
        grads.append(getitem(g, key=key))
        start = stop
    return tuple(grads)


def _cat_impl(*xs, axis, out=None):
    return np.concatenate(xs, axis=axis, out=out)


_cat_impl.accepts_out = True  # the compiler's memory plan may give it a buffer

cat = defop(
    "cat", impl=_cat_impl, abstract=_cat_abstract,
    vjp=_cat_vjp, linearity="all", shard="cat")

# Each entry of x repeated ``repeats`` times along ``axis`` (torch.repeat_interleave with an
# int): the gradient sums each run of copies.
repeat_interleave = defop(
    "repeat_interleave", impl=lambda x, repeats, axis: np.repeat(x, repeats, axis=axis),
    abstract=lambda x, repeats, axis: Aval(
        tuple(n * repeats if d == axis else n for d, n in enumerate(x.shape)), x.dtype),
    vjp=lambda g, out, x, repeats, axis: (group_sum(g, repeats=repeats, axis=axis),),
    linearity="all", shard="repeat")


def _group_sum_impl(g, repeats, axis):
    s = g.shape
    return g.reshape(s[:axis] + (s[axis] // repeats, repeats) + s[axis + 1:]).sum(axis=axis + 1)


def _group_sum_abstract(g, repeats, axis):
    if g.shape[axis] % repeats:
        raise ValueError(f"group_sum: dim {axis} of size {g.shape[axis]} is not a whole number "
                         f"of groups of {repeats}.")
    return Aval(tuple(n // repeats if d == axis else n for d, n in enumerate(g.shape)), g.dtype)


# repeat_interleave's adjoint: each run of ``repeats`` entries along ``axis`` summed. Its own
# op (not a reshape + sum) so a shard that cuts the runs (grouped-query attention with more
# tensor-parallel ranks than key/value heads) sums what it holds into a Partial, no gathering.
def _group_sum_local(g, repeats, axis, *, in_blocks, out_block):
    off, n = in_blocks[0].rows(axis)
    shape = out_block.local_shape
    if shape[axis] * repeats == n:  # the block's own groups (a sharded result)
        return _group_sum_impl(g, repeats, axis)
    # a Partial result: this block's members summed into the groups they belong to
    out = np.zeros(shape, g.dtype)
    np.add.at(np.moveaxis(out, axis, 0), (off + np.arange(n)) // repeats,
              np.moveaxis(g, axis, 0))
    return out


group_sum = defop(
    "group_sum", impl=_group_sum_impl, abstract=_group_sum_abstract,
    vjp=lambda g, out, x, repeats, axis: (repeat_interleave(g, repeats=repeats, axis=axis),),
    linearity="all", shard="group_sum", local=_group_sum_local)


def _tri_abstract(x, diagonal):
    if len(x.shape) < 2:
        raise ValueError(f"tril/triu: the input must have at least 2 dims (a batch of "
                         f"matrices), got shape {tuple(x.shape)}.")
    return Aval(tuple(x.shape), x.dtype)


# The lower / upper triangle of the last two dims (entries with col - row <= / >= diagonal),
# zeros elsewhere. Masks are their own vjp. A triangle depends on where a block sits in the
# matrix, so the rule keeps the last two dims whole.
tril = defop(
    "tril", impl=lambda x, diagonal: np.tril(x, diagonal), abstract=_tri_abstract,
    vjp=lambda g, out, x, diagonal: (tril(g, diagonal=diagonal),),
    linearity="all", shard="matrix")

triu = defop(
    "triu", impl=lambda x, diagonal: np.triu(x, diagonal), abstract=_tri_abstract,
    vjp=lambda g, out, x, diagonal: (triu(g, diagonal=diagonal),),
    linearity="all", shard="matrix")

# ---------------------------------------------------------------- contraction


def _same_dtype(x, y) -> None:
    # As PyTorch: no silent promotion in a GEMM (a float64 batch would run a float32 model in
    # float64, twice the time, and hand float64 gradients to float32 weights). Checked by the
    # abstract rule (DTensor, tracer) and the impl (eager, which skips the abstract rule).
    if x.dtype != y.dtype:
        raise TypeError(
            f"matmul: operand dtypes differ: {np.dtype(x.dtype)} {tuple(x.shape)} @ "
            f"{np.dtype(y.dtype)} {tuple(y.shape)}. Cast one to the other's dtype first, e.g. "
            f"x.astype(np.{np.dtype(y.dtype)}) for a numpy array, or dtensor.tensor(x, "
            f"dtype=dtensor.{np.dtype(y.dtype)}).")


def _matmul_abstract(x, y):
    if x.shape[-1] != y.shape[-2]:
        raise ValueError(
            f"matmul: inner dimensions differ: {tuple(x.shape)} @ {tuple(y.shape)} "
            f"({x.shape[-1]} != {y.shape[-2]}). The last dim of the left operand must equal "
            f"the second-to-last dim of the right one; transpose one of them (.mT) or reshape.")
    _same_dtype(x, y)
    batch = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    return Aval(batch + (x.shape[-2], y.shape[-1]), np.dtype(x.dtype))


# d(xy)/dx = g y^T, d(xy)/dy = x^T g, each summed over broadcast batch dims.
def _blas_layout(a) -> bool:
    """Whether a's trailing matrix is a tight row- or column-major block (BLAS's lda = a dim)."""
    s, i = a.strides[-2:], a.itemsize
    return (s[1] == i and s[0] == a.shape[-1] * i) or (s[0] == i and s[1] == a.shape[-2] * i)


def _matmul_impl(x, y, out=None):
    _same_dtype(x, y)
    # A stack of matrices that are both loose views (attention's per-head q @ k^T) runs ~2x
    # slower in OpenBLAS than after copying one of them tight (benchmarks/gpt_step.py).
    if x.ndim > 2 and y.ndim > 2 and not (_blas_layout(x) or _blas_layout(y)):
        x = np.ascontiguousarray(x)
    return np.matmul(x, y, out=out)


def _matmul_dy(g, x, y):
    node = getattr(y, "_node", None)
    if (node is not None and node.op.name == "permute" and x.ndim == y.ndim
            and node.params["axes"][-2:] == (y.ndim - 1, y.ndim - 2)
            and tuple(x.shape[:-2]) == tuple(y.shape[:-2])):
        # y is a transpose of the last two dims (a Linear's x @ W^T, attention's q @ k^T):
        # (g^T x)^T has the same sums as x^T g, but the GEMM writes the gradient in the order
        # of the tensor y was transposed from. W's gradient is then stored without a copy
        # (Tensor._owned), and k's reaches its projection as (B, H, T, D) rows: as x^T g it was
        # (B, H, D, T), and its reshape to (B*T, C) was a transposing copy, 4x slower than the
        # head-merging copy of q's and v's. Decided on the autograd graph, so eager, DTensor and
        # the compiler's trace all take the same branch.
        return (g.mT @ x).mT
    return unbroadcast(x.mT @ g, y.shape)


matmul = defop(
    "matmul", impl=_matmul_impl, abstract=_matmul_abstract,
    vjp=lambda g, out, x, y: (lambda: unbroadcast(g @ y.mT, x.shape), lambda: _matmul_dy(g, x, y)),
    linearity="one", shard="matmul")

# ---------------------------------------------------------------- gather / scatter along dim 0

def check_rows(idx, num: int, what: str = "index", unit: str = "rows",
               fix: str = "Fix the indices, or give the weight more rows.",
               ignore_index: int | None = None) -> np.ndarray:
    """``idx`` flattened, once each entry is checked to name one of ``num`` rows (or classes),
    or to equal ``ignore_index``; otherwise an IndexError naming the first bad entry, where it
    is, the valid range and ``fix``.

    A negative entry is an error, as in PyTorch's embedding, index_select and cross_entropy,
    not counted from the end as numpy's take would: a token id of -1 is a bug upstream, not
    the last row. The embedding lookup and its gradient (eager, DTensor and compiled),
    cross-entropy's targets and the vocab-parallel kernels all check here, so
    the error reads the same on every path; the vocab-parallel kernels pass the global row
    count, so every rank checks against the whole vocabulary, not its block.
    """
    flat = np.asarray(idx).reshape(-1)
    if not flat.size or (flat.min() >= 0 and flat.max() < num):
        return flat
    bad = (flat < 0) | (flat >= num)
    if ignore_index is not None:
        bad &= flat != ignore_index
    if not bad.any():
        return flat
    i = int(np.argmax(bad))
    pos = tuple(int(p) for p in np.unravel_index(i, np.shape(idx)))
    count = int(np.count_nonzero(bad))
    others = f"; {count - 1} more of the {flat.size} are too" if count > 1 else ""
    skip = f", or equal ignore_index ({ignore_index})" if ignore_index is not None else ""
    raise IndexError(f"{what} {int(flat[i])} is out of range for {num} {unit} (at position "
                     f"{pos}{others}): each must lie in [0, {num}){skip}; a negative one is "
                     f"an error, not counted from the end. {fix}")


def _index_select_impl(w, idx):
    return np.take(w, check_rows(idx, w.shape[0]).reshape(np.shape(idx)), axis=0)


def in_block(idx, off: int, n: int):
    """A vocab-parallel rank's view of global indices ``idx`` into its block ``off .. off + n``:
    (the index within the block, 0 where it falls outside; whether it falls inside).

    What an index outside the block contributes to the Partial result is exactly zero, set
    with np.where or by zeroing rows, never by multiplying with the mask: the stand-in entry 0
    may hold an inf or NaN (0 x inf is NaN), which the sum over ranks would spread to results
    the single-process op computes finite. (Zeroing rows also writes only the rows outside,
    where a broadcast bool multiply reads and writes them all.)"""
    rel = idx - off
    hit = (rel >= 0) & (rel < n)
    return np.where(hit, rel, 0), hit


def _index_select_local(w, idx, *, in_blocks, out_block):
    off, n = in_blocks[0].rows(0)
    if n == in_blocks[0].shape[0]:
        return _index_select_impl(w, idx)
    if n == 0:  # an empty trailing shard holds none of the rows
        return np.zeros(out_block.local_shape, w.dtype)
    rel, hit = in_block(check_rows(idx, in_blocks[0].shape[0]).reshape(np.shape(idx)), off, n)
    out = np.take(w, rel, axis=0)
    out.reshape(hit.size, -1)[np.flatnonzero(~hit)] = 0
    return out


index_select = defop(
    "index_select", impl=_index_select_impl,
    abstract=lambda w, idx: Aval(tuple(idx.shape) + tuple(w.shape[1:]), w.dtype),
    vjp=lambda g, out, w, idx: (index_add(g, idx, w), None),
    linearity="all", shard="index_select", nondiff=(1,),
    local=_index_select_local)


def index_add_rows(g, idx, num):
    """Rows of ``g`` summed into row ``idx`` of zeros((num, ...))."""
    # Sort the indices and sum runs of equal ones with reduceat: ~10x faster than np.add.at.
    rows = g.reshape((idx.size,) + g.shape[idx.ndim:])  # (-1) is ambiguous when empty
    flat = check_rows(idx, num)
    out = np.zeros((num,) + rows.shape[1:], g.dtype)
    if flat.size == 0:
        return out
    order = np.argsort(flat, kind="stable")
    sorted_idx = flat[order]
    starts = np.flatnonzero(np.r_[True, sorted_idx[1:] != sorted_idx[:-1]])
    counts = np.diff(np.r_[starts, flat.size])
    # np.add.reduceat pays a loop over the columns for each run, so it sums only the indices
    # that repeat; a row whose index occurs once is copied (most of a token embedding's rows;
    # benchmarks/gpt_step.py).
    once = counts == 1
    out[sorted_idx[starts[once]]] = rows[order[starts[once]]]
    if not once.all():
        repeated = np.repeat(~once, counts)
        keys = sorted_idx[repeated]
        runs = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        out[keys[runs]] = np.add.reduceat(rows[order[repeated]], runs, axis=0)
    return out


# The vjp of index_select: rows of ``g`` summed into row ``idx`` of zeros shaped like ``like``
# (the forward's weight). ``like`` is a template: only its shape is read, and under DTensor the
# result takes its layout (a vocab-parallel weight's gradient is summed where its rows live),
# so the template never moves (meta "template").
def _index_add_local(g, idx, like, *, in_blocks, out_block):
    off, n = out_block.rows(0)
    if n == 0:
        return np.zeros(out_block.local_shape, g.dtype)
    # vocab-parallel gradient: only the rows this rank holds
    rel, hit = in_block(check_rows(idx, out_block.shape[0]).reshape(np.shape(idx)), off, n)
    rows = g.reshape((idx.size,) + g.shape[idx.ndim:])[hit.reshape(-1)]
    return index_add_rows(rows, rel[hit], n)


index_add = defop(
    "index_add", impl=lambda g, idx, like: index_add_rows(g, idx, like.shape[0]),
    abstract=lambda g, idx, like: Aval((like.shape[0],) + tuple(g.shape[idx.ndim:]), g.dtype),
    vjp=lambda g2, out, g, idx, like: (index_select(g2, idx), None, None),
    linearity="all", shard="index_add", nondiff=(1, 2),
    local=_index_add_local, template=2)

# ---------------------------------------------------------------- gather / scatter along a dim
# torch.gather semantics: out[..., j] = x[..., idx[..., j]] along ``axis``.


def _gather_abstract(x, idx, axis):
    return Aval(tuple(idx.shape), x.dtype)


def check_along(idx, size: int, axis: int, what: str) -> None:
    """Each of ``idx`` names one of ``size`` entries along ``axis`` (torch.gather's rule: a
    negative index is an error here too)."""
    check_rows(idx, size, f"{what}: index", f"entries along dim {axis}",
               f"Fix the indices (each picks an entry along dim {axis}).")


def _gather_impl(x, idx, axis):
    check_along(idx, x.shape[axis], axis, "gather")
    return np.take_along_axis(x, idx, axis=axis)


def _gather_local(x, idx, axis, *, in_blocks, out_block):
    # Against the global size: under loss_parallel an index no block holds would give 0.
    check_along(idx, in_blocks[0].shape[axis], axis, "gather")
    off, n = in_blocks[0].rows(axis)
    if n == in_blocks[0].shape[axis]:
        return np.take_along_axis(x, idx, axis=axis)
    if n == 0:
        return np.zeros(out_block.local_shape, x.dtype)
    rel, hit = in_block(idx, off, n)
    return np.where(hit, np.take_along_axis(x, rel, axis=axis), 0)


gather = defop(
    "gather", impl=_gather_impl,
    abstract=_gather_abstract,
    vjp=lambda g, out, x, idx, axis: (scatter_add(g, idx, x, axis=axis), None),
    linearity="all", shard="gather", nondiff=(1,), local=_gather_local)


def scatter_add_along(g, idx, axis, size):
    """``g`` summed into position ``idx`` along ``axis`` of zeros (``size`` long there)."""
    shape = list(g.shape)
    shape[axis] = size
    out = np.zeros(shape, g.dtype)
    if idx.shape[axis] == 1:  # one index per row (cross-entropy): no duplicates to accumulate
        np.put_along_axis(out, idx, g, axis=axis)
        return out
    grids = list(np.indices(idx.shape, sparse=True))
    grids[axis] = idx
    np.add.at(out, tuple(grids), g)
    return out


# The vjp of gather: ``g`` summed into position ``idx`` along ``axis`` of zeros shaped like
# ``like`` (the forward's input; a template, as index_add's).
def _scatter_add_impl(g, idx, like, axis):
    check_along(idx, like.shape[axis], axis, "scatter_add")
    return scatter_add_along(g, idx, axis, like.shape[axis])


def _scatter_add_local(g, idx, like, axis, *, in_blocks, out_block):
    off, n = out_block.rows(axis)
    if n == 0:
        return np.zeros(out_block.local_shape, g.dtype)
    rel, hit = in_block(idx, off, n)
    return scatter_add_along(np.where(hit, g, 0), rel, axis, n)


scatter_add = defop(
    "scatter_add", impl=_scatter_add_impl,
    abstract=lambda g, idx, like, axis: Aval(
        tuple(like.shape[axis] if d == axis % len(g.shape) else n
              for d, n in enumerate(g.shape)), g.dtype),
    vjp=lambda g2, out, g, idx, like, axis: (gather(g2, idx, axis=axis), None, None),
    linearity="all", shard="scatter_add", nondiff=(1, 2),
    local=_scatter_add_local, template=2)

# ---------------------------------------------------------------- random factories
# Random values are a pure function of (key, global flat index): see dtensor/random.py. The
# first input is a template whose shape (and, under DTensor, placements) the result takes; it
# carries no data, so eager callers pass a broadcast view. On a block, the draws are those of
# the block's global indices: every layout holds the numbers one process draws.

def _draw_lower(normal: bool):
    """A draw at the element's flat index (the global offsets of a block's elements when the
    kernel is given them), rounded to the dtype."""
    return lambda like, key, dtype, offset=K.row * K.cols + K.col: K.cast(
        K.rand(offset, key, normal), dtype)


rand = defop(
    "rand", impl=lambda like, key, dtype: _random.uniform(key, _flat_offsets(like.shape), dtype),
    abstract=lambda like, key, dtype: Aval(tuple(like.shape), np.dtype(dtype)),
    shard="factory", nondiff=(0,), lower=_draw_lower(False),
    local=lambda like, key, dtype, *, in_blocks, out_block: _random.uniform(
        key, out_block.flat_offsets(), dtype))

randn = defop(
    "randn", impl=lambda like, key, dtype: _random.normal(key, _flat_offsets(like.shape), dtype),
    abstract=lambda like, key, dtype: Aval(tuple(like.shape), np.dtype(dtype)),
    shard="factory", nondiff=(0,), lower=_draw_lower(True),
    local=lambda like, key, dtype, *, in_blocks, out_block: _random.normal(
        key, out_block.flat_offsets(), dtype))


def _flat_offsets(shape):
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)


__all__ = ["sum", "max", "argmax", "cumsum", "reshape", "permute", "broadcast_to", "getitem",
           "slice_scatter", "cat", "repeat_interleave", "group_sum", "tril", "triu", "matmul",
           "index_select", "index_add", "gather", "scatter_add", "rand", "randn"]
