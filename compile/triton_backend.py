"""The Triton backend (kernels on numpy arrays, so always under Triton's interpreter; a device
path needs device arrays): fused pointwise groups, row-wise kernels (softmax, log_softmax,
cross-entropy, the layer-norm core, their backwards), the AdamW update and random draws become
``@triton.jit`` kernels generated from the ops' ``lower`` templates; matmuls, shape ops, gathers
and collectives stay numpy calls (extern).

The interpreter (``TRITON_INTERPRET=1``, set here if triton is not imported yet) runs them on
numpy arrays through compile/triton_adapter.py: slow (30-100x numpy), for verification. Kernel
sources go to content-hashed files (DTENSOR_DEBUG=3 prints each with the node it covers).
"""
from __future__ import annotations

import os
import sys

import numpy as np
from dtensor.compile.numpy_backend import import_source

from dtensor.graph import Graph, Node
from dtensor.ops.registry import OPS

__all__ = ["lower_graph", "ensure_triton"]

_TL_TYPES = {"float32": "tl.float32", "float64": "tl.float64", "float16": "tl.float16",
             "int64": "tl.int64", "int32": "tl.int32", "bool": "tl.int1", "uint32": "tl.uint32"}

PRELUDE = '''import triton
import triton.language as tl

# Names used by the ops' ``lower`` templates (dtensor/ops/*.py).


@triton.jit
def exp(x):
    return tl.exp(x)


@triton.jit
def log(x):
    return tl.log(x)


@triton.jit
def sqrt(x):
    return tl.sqrt(x)


@triton.jit
def tanh(x):  # (1 - e) / (1 + e), e = exp(-2|x|); below 0.3, where 1 - e cancels, the series
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    s = 21844.0 / 6081075.0
    s = s * a2 - 1382.0 / 155925.0
    s = s * a2 + 62.0 / 2835.0
    s = s * a2 - 17.0 / 315.0
    s = s * a2 + 2.0 / 15.0
    s = s * a2 - 1.0 / 3.0
    s = (s * a2 + 1.0) * a
    r = tl.where(a < 0.3, s, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def maximum(x, y):
    return tl.maximum(x, y)


@triton.jit
def where(c, x, y):
    return tl.where(c, x, y)


@triton.jit
def pow(x, y):
    return tl.exp(y * tl.log(x))


@triton.jit
def erf(x):
    return tl.math.erf(x)


@triton.jit
def cos(x):
    return tl.cos(x)


@triton.jit
def sin(x):
    return tl.sin(x)


@triton.jit
def abs(x):
    return tl.abs(x)


@triton.jit
def rsqrt(x):
    return 1.0 / tl.sqrt(x)


@triton.jit
def sigmoid(x):  # exp(-|x|) never overflows (dtensor/ops/pointwise.py)
    e = tl.exp(-tl.abs(x))
    s = 1.0 / (1.0 + e)
    return tl.where(x < 0, e * s, s)


@triton.jit
def clamp(x, lo, hi):
    y = tl.where(x < lo, lo, x)
    return tl.where(y > hi, hi, y)


@triton.jit
def gelu_none(x):  # _gelu_erf_block: relu(x) - |x| Q(|x|), no 1 + erf that cancels
    a = tl.minimum(tl.abs(x), 64.0)
    t = 1.0 / (a * 0.2316418882663604 + 1.0)
    q = t * 0.5307027145
    q = (q - 0.7265760135) * t
    q = (q + 0.7107068705) * t
    q = (q - 0.142248368) * t
    q = (q + 0.127414796) * t
    q = q * tl.exp(x * x * -0.5) * a
    return tl.maximum(x, 0.0) - q


@triton.jit
def gelu_tanh(x):  # _gelu_tanh_block: x sigmoid(2 u), from e = exp(-2 |u|)
    u = (x * x * 0.044715 + 1.0) * x * 0.7978845608028654
    e = tl.exp(-2.0 * tl.abs(u))
    r = 1.0 / (e + 1.0)
    return tl.where(u >= 0, r, e * r) * x


@triton.jit
def gelu_none_grad(g, x, y):  # Phi = y / x, its Taylor expansion near 0 (dtensor/ops/nn.py)
    near = tl.abs(x) < 1e-4
    phi = tl.where(near, 0.5 + 0.3989422804014327 * x, y / tl.where(near, 1.0, x))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return g * (phi + x * pdf)


@triton.jit
def gelu_tanh_grad(g, x, y):  # _gelu_tanh_grad_block: s + x s (1 - s) 2 du/dx
    x2 = x * x
    u = (x2 * 0.044715 + 1.0) * x * 0.7978845608028654
    e = tl.exp(-2.0 * tl.abs(u))
    r = 1.0 / (e + 1.0)
    du = (x2 * 0.134145 + 1.0) * 1.5957691216057308 * x * e * r * r
    return (tl.where(u >= 0, r, e * r) + du) * g
'''


def ensure_triton():
    """Import triton for kernels that run on numpy arrays, i.e. under the interpreter.

    The interpreter must be chosen before triton is first imported: triton's own library
    functions (tl.sum, tl.rand, ...) are compiled-mode objects otherwise.
    """
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "dtensor.compile(backend='triton') runs its kernels on numpy arrays under Triton's "
            "interpreter, which must be chosen before triton is imported: set "
            "TRITON_INTERPRET=1 in the environment, or compile before importing triton.")
    import triton
    return triton


def _load(source: str):
    return import_source(source, "dtk")


def _block(n: int) -> int:
    """Elements per program of a 1-D kernel: the next power of two, 16 to 16384."""
    return min(1 << 14, 1 << max(4, (n - 1).bit_length()))


def _tile(cols: int) -> tuple[int, int]:
    """(rows, cols) of a row kernel's tile: whole rows (a power of two >= cols), ~16K elements."""
    block_c = 1 << max(0, (cols - 1).bit_length())
    return max(1, min(1 << 12, (1 << 14) // block_c)), block_c


def _literal(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return repr(int(v))
    v = float(v)
    return repr(v) if np.isfinite(v) else f"float('{v}')"  # inf, -inf, nan


def _expr(op, params, args) -> str:
    """The op's ``lower`` template filled with argument expressions."""
    lower = op.lower
    if op.name == "cast":
        return f"({args[0]}).to({_TL_TYPES[np.dtype(params['dtype']).name]})"
    return lower.format(*args, **{k: v for k, v in params.items()})


def _offset_expr(shape, bshape, strides) -> str:
    """Element offset of a broadcast input for the flat output index ``offs``."""
    if tuple(bshape) == tuple(shape) and list(strides) == list(
            np.cumprod((1,) + tuple(reversed(shape[1:])))[::-1]):
        return "offs"
    terms, inner = [], 1
    for d in reversed(range(len(shape))):
        if strides[d]:
            terms.append(f"((offs // {inner}) % {shape[d]}) * {strides[d]}")
        inner *= shape[d]
    return " + ".join(terms) if terms else "offs * 0"


class _Pointwise:
    """A fused pointwise group (or one pointwise op) as a flat 1-D Triton kernel."""

    accepts_out = True

    def __init__(self, ops, shape, dtype, in_shapes, in_dtypes, label, positions):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.positions = positions  # which call arguments are arrays (the rest: constants)
        self.n = int(np.prod(shape))
        bstrides = []
        for s, dt in zip(in_shapes, in_dtypes):
            view = np.broadcast_to(np.empty(s, dt), shape)
            bstrides.append([st // np.dtype(dt).itemsize for st in view.strides])
        self.keys = [f"key{j}" for j, (name, *_) in enumerate(ops) if name in ("rand", "randn")]
        lines = [f"# {label}", "@triton.jit",
                 "def kernel(" + "".join(f"in{k}, " for k in range(len(in_shapes)))
                 + "out, N, " + "".join(f"{k}, " for k in self.keys) + "BLOCK: tl.constexpr):",
                 "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
                 "    mask = offs < N"]
        for k, (s, st) in enumerate(zip(in_shapes, bstrides)):
            lines.append(f"    a{k} = tl.load(in{k} + ({_offset_expr(shape, s, st)}), mask=mask)")
        for j, (name, op, refs, params) in enumerate(ops):
            args = [f"a{r}" if kind == "in" else f"t{r}" if kind == "op" else _literal(r)
                    for kind, r in refs]
            if name in ("rand", "randn"):  # Philox on (key, flat index): eager's numbers
                expr = (f"tl.{name}(key{j}, offs)"
                        f".to({_TL_TYPES[np.dtype(params['dtype']).name]})")
            else:
                expr = _expr(op, params, args)
            lines.append(f"    t{j} = {expr}")
        out = f"t{len(ops) - 1}"
        if self.dtype != np.dtype(bool):
            out = f"({out}).to({_TL_TYPES[self.dtype.name]})"
        lines.append(f"    tl.store(out + offs, {out}, mask=mask)")
        self.source = PRELUDE + "\n\n" + "\n".join(lines) + "\n"
        self.mod, self.path = _load(self.source)
        self.block = _block(self.n)

    def __call__(self, *inputs, out=None, **keys):
        from dtensor.compile.triton_adapter import as_triton_arg
        out = np.empty(self.shape, self.dtype) if out is None else out
        # Constants are literals in the kernel; arrays are its pointer arguments.
        args = [as_triton_arg(np.ascontiguousarray(inputs[k])) for k in self.positions]
        grid = ((self.n + self.block - 1) // self.block,)
        if self.n:
            with np.errstate(all="ignore"):  # masked-off lanes may compute inf - inf
                self.mod.kernel[grid](*args, as_triton_arg(out), self.n,
                                      *[int(keys[k]) for k in self.keys], BLOCK=self.block)
        return out


class _RowGroup:
    """Pointwise ops and last-dim reductions over the same rows as one 2-D tiled kernel: a
    program holds BLOCK_R whole rows, so a reduction is tl.sum / tl.max along axis 1 and its
    (BLOCK_R, 1) result broadcasts back into the row's later ops (an RMSNorm in one kernel)."""

    accepts_out = True

    def __init__(self, node: Node, in_shapes, in_dtypes):
        ops, self.shape, self.dtype = node.params["ops"], tuple(node.shape), node.dtype
        lead, C = node.params["row_shape"]
        self.R = int(np.prod(lead)) if lead else 1
        self.last = self.shape[-1]
        self.block_r, self.block_c = _tile(C)
        self.views = []  # per input: (column?, row-offset expr, col stride)
        lines = [f"# {node.name} {node.note}", "@triton.jit",
                 "def kernel(" + "".join(f"in{k}, " for k in range(len(in_shapes)))
                 + "out, R, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):",
                 "    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]",
                 "    cols = tl.arange(0, BLOCK_C)[None, :]",
                 "    rmask = rows < R",
                 f"    mask = rmask & (cols < {C})"]
        for k, (shp, dt) in enumerate(zip(in_shapes, in_dtypes)):
            view = np.broadcast_to(np.empty(shp, dt), lead + ((C,) if (
                len(shp) and shp[-1] == C and C != 1) else (1,)))
            st = [v // np.dtype(dt).itemsize for v in view.strides]
            row = _offset_expr(lead, lead, st[:-1]).replace("offs", "rows") if lead else "0"
            column = view.shape[-1] == 1
            off = row if column else f"{row} + cols * {st[-1]}"
            lines.append(f"    a{k} = tl.load(in{k} + ({off}), "
                         f"mask={'rmask' if column else 'mask'})")
        for j, (name, op, refs, params) in enumerate(ops):
            args = [f"a{r}" if kind == "in" else f"t{r}" if kind == "op" else _literal(r)
                    for kind, r in refs]
            if name == "sum":
                expr = f"tl.sum(tl.where(mask, {args[0]}, 0.0), axis=1)[:, None]"
            elif name == "max":
                expr = f"tl.max(tl.where(mask, {args[0]}, -float('inf')), axis=1)[:, None]"
            else:
                expr = _expr(op, params, args)
            lines.append(f"    t{j} = {expr}")
        res = f"(t{len(ops) - 1}).to({_TL_TYPES[self.dtype.name]})"
        if self.last == 1:
            lines.append(f"    tl.store(out + rows + cols * 0, {res} + cols * 0, "
                         f"mask=rmask & (cols < 1))")
        else:
            lines.append(f"    tl.store(out + rows * {self.last} + cols, {res}, mask=mask)")
        self.source = PRELUDE + "\n\n" + "\n".join(lines) + "\n"
        self.mod, self.path = _load(self.source)

    def __call__(self, *inputs, out=None):
        from dtensor.compile.triton_adapter import as_triton_arg
        out = np.empty(self.shape, self.dtype) if out is None else out
        args = [as_triton_arg(np.ascontiguousarray(x)) for x in inputs
                if isinstance(x, np.ndarray)]
        grid = ((self.R + self.block_r - 1) // self.block_r,)
        if self.R:
            with np.errstate(all="ignore"):
                self.mod.kernel[grid](*args, as_triton_arg(out), self.R, BLOCK_R=self.block_r,
                                      BLOCK_C=self.block_c)
        return out


ROWWISE = '''
@triton.jit
def kernel(x_ptr, g_ptr, out_ptr, R, C, L, eps, KIND: tl.constexpr, CAUSAL: tl.constexpr,
           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < R) & (cols < C)
    if CAUSAL:  # row r of each (L, C) matrix sees columns j <= r % L
        mask = mask & (cols <= rows % L)
    idx = rows * C + cols
    if KIND == 0:  # softmax
        x = tl.load(x_ptr + idx, mask=mask, other=-float("inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        e = tl.where(mask, e, 0.0)
        y = e / tl.sum(e, axis=1)[:, None]
    elif KIND == 1:  # log_softmax
        x = tl.load(x_ptr + idx, mask=mask, other=-float("inf"))
        z = x - tl.max(x, axis=1)[:, None]
        e = tl.where(mask, tl.exp(z), 0.0)
        y = z - tl.log(tl.sum(e, axis=1))[:, None]
    elif KIND == 2:  # softmax backward: y (g * y - y sum(g y)), x_ptr holds y
        s = tl.load(x_ptr + idx, mask=mask, other=0.0)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        y = s * (g - tl.sum(g * s, axis=1)[:, None])
    elif KIND == 3:  # log_softmax backward: g - softmax sum(g), x_ptr holds log-probs
        lp = tl.load(x_ptr + idx, mask=mask, other=-float("inf"))
        g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        y = g - tl.exp(lp) * tl.sum(g, axis=1)[:, None]
    elif KIND == 4:  # normalize: (x - mean) / sqrt(var + eps)
        x = tl.load(x_ptr + idx, mask=mask, other=0.0)
        d = tl.where(mask, x - tl.sum(x, axis=1)[:, None] / C, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / C + eps)
        y = d * rstd[:, None]
    else:  # normalize backward: rstd (g - mean(g) - xhat mean(g xhat))
        x = tl.load(x_ptr + idx, mask=mask, other=0.0)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        d = tl.where(mask, x - tl.sum(x, axis=1)[:, None] / C, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / C + eps)
        xhat = d * rstd[:, None]
        y = rstd[:, None] * (g - tl.sum(g, axis=1)[:, None] / C
                             - xhat * (tl.sum(g * xhat, axis=1) / C)[:, None])
    if CAUSAL:
        y = tl.where(mask, y, 0.0)
    tl.store(out_ptr + idx, y, mask=(rows < R) & (cols < C))
'''

_ROW_KIND = {"softmax": 0, "log_softmax": 1, "softmax_backward": 2, "log_softmax_backward": 3,
             "normalize": 4, "normalize_backward": 5}


class _Rowwise:
    """Row-wise ops over the last dim: 2-D tiles of rows, reductions along axis 1."""

    accepts_out = True

    def __init__(self, name, params, shape, dtype):
        self.kind, self.shape, self.dtype = _ROW_KIND[name], tuple(shape), np.dtype(dtype)
        self.causal = bool(params.get("causal", False))
        self.eps = float(params.get("eps", 0.0))
        self.C = shape[-1]
        self.L = shape[-2] if len(shape) > 1 else 1
        self.R = int(np.prod(shape[:-1]))
        self.block_r, self.block_c = _tile(self.C)
        self.source = PRELUDE + ROWWISE
        self.mod, self.path = _load(self.source)

    def __call__(self, *inputs, out=None):
        from dtensor.compile.triton_adapter import as_triton_arg
        inputs = [np.ascontiguousarray(x) for x in inputs]
        out = np.empty(self.shape, self.dtype) if out is None else out
        # Backward kinds take (g, y|x) in the registry's order: gradient first.
        x, g = (inputs[1], inputs[0]) if len(inputs) == 2 else (inputs[0], inputs[0])
        grid = ((self.R + self.block_r - 1) // self.block_r,)
        if self.R and self.C:
            with np.errstate(all="ignore"):
                self.mod.kernel[grid](as_triton_arg(x), as_triton_arg(g), as_triton_arg(out),
                                      self.R, self.C, self.L, self.eps, KIND=self.kind,
                                      CAUSAL=self.causal, BLOCK_R=self.block_r,
                                      BLOCK_C=self.block_c)
        return out


CROSS_ENTROPY = '''
@triton.jit
def kernel(x_ptr, t_ptr, g_ptr, out_ptr, R, C, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_C: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = row[:, None]
    cols = tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < R) & (cols < C)
    x = tl.load(x_ptr + rows * C + cols, mask=mask, other=-float("inf"))
    t = tl.load(t_ptr + row, mask=row < R, other=0)[:, None]
    m = tl.max(x, axis=1)
    e = tl.where(mask, tl.exp(x - m[:, None]), 0.0)
    s = tl.sum(e, axis=1)
    # (A target outside [0, C) matches no column: the numpy kernel raises for it, this one
    # cannot and leaves the target term out.)
    if BACKWARD:  # g (softmax - onehot)
        g = tl.load(g_ptr + row, mask=row < R, other=0.0)[:, None]
        y = g * (e / s[:, None] - tl.where(cols == t, 1.0, 0.0))
        tl.store(out_ptr + rows * C + cols, y, mask=mask)
    else:  # logsumexp - x[target]
        xt = tl.sum(tl.where(cols == t, x, 0.0), axis=1)
        tl.store(out_ptr + row, m + tl.log(s) - xt, mask=row < R)
'''


class _CrossEntropy:
    """softmax_cross_entropy (x, target) and its backward (g, x, target): whole rows per tile."""

    accepts_out = True

    def __init__(self, name, shape, dtype, classes):
        self.backward = name.endswith("_backward")
        self.shape, self.dtype, self.C = tuple(shape), np.dtype(dtype), classes
        self.source = PRELUDE + CROSS_ENTROPY
        self.mod, self.path = _load(self.source)
        self.block_r, self.block_c = _tile(classes)

    def __call__(self, *inputs, out=None):
        from dtensor.compile.triton_adapter import as_triton_arg
        g, x, t = inputs if self.backward else (None, *inputs)
        x = np.ascontiguousarray(x)
        R = x.size // self.C if self.C else 0
        t = np.ascontiguousarray(t, dtype=np.int64).reshape(-1)
        g = (np.ascontiguousarray(np.broadcast_to(g, t.shape), dtype=x.dtype) if self.backward
             else x)  # the forward never reads g_ptr
        out = np.empty(self.shape, self.dtype) if out is None else out
        if R and self.C:
            with np.errstate(all="ignore"):
                self.mod.kernel[((R + self.block_r - 1) // self.block_r,)](
                    as_triton_arg(x), as_triton_arg(t), as_triton_arg(g), as_triton_arg(out), R,
                    self.C, BACKWARD=self.backward, BLOCK_R=self.block_r, BLOCK_C=self.block_c)
        return out


ADAMW = '''
@triton.jit
def kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, N, lr, beta1, beta2, eps, weight_decay, bc1,
           bc2, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = beta1 * tl.load(m_ptr + offs, mask=mask) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask) + (1.0 - beta2) * g * g
    step = (m / bc1) / (tl.sqrt(v / bc2) + eps)
    tl.store(out_ptr + offs, p * (1.0 - lr * weight_decay) - lr * step, mask=mask)
    tl.store(out_ptr + N + offs, m, mask=mask)
    tl.store(out_ptr + 2 * N + offs, v, mask=mask)
'''


class _AdamW:
    accepts_out = True

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.n = int(np.prod(shape[1:]))
        self.mod, self.path = _load(PRELUDE + ADAMW)
        self.source = PRELUDE + ADAMW
        self.block = _block(self.n)

    def __call__(self, p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, bc1, bc2, out=None):
        from dtensor.compile.triton_adapter import as_triton_arg
        out = np.empty(self.shape, self.dtype) if out is None else out
        args = [as_triton_arg(np.ascontiguousarray(a)) for a in (p, g, m, v)]
        grid = ((self.n + self.block - 1) // self.block,)
        if self.n:
            self.mod.kernel[grid](*args, as_triton_arg(out), self.n, lr, beta1, beta2, eps,
                                  weight_decay, bc1, bc2, BLOCK=self.block)
        return out


# One launch for the AdamW update of every parameter (as PyTorch's fused AdamW and apex's
# multi_tensor_apply): each program takes a chunk of one parameter, found through tables of the
# parameters' addresses, sizes, offsets in the (3, total) result and hyperparameters.
ADAMW_GROUP = '''
@triton.jit
def kernel(p_tab, g_tab, m_tab, v_tab, size_tab, offset_tab, hp_tab, chunk_tensor, chunk_start,
           out_ptr, TOTAL, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    offs = tl.load(chunk_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(size_tab + t)
    p_ptr = tl.load(p_tab + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
    lr = tl.load(hp_tab + 7 * t)
    beta1 = tl.load(hp_tab + 7 * t + 1)
    beta2 = tl.load(hp_tab + 7 * t + 2)
    eps = tl.load(hp_tab + 7 * t + 3)
    weight_decay = tl.load(hp_tab + 7 * t + 4)
    bc1 = tl.load(hp_tab + 7 * t + 5)
    bc2 = tl.load(hp_tab + 7 * t + 6)
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = beta1 * tl.load(m_ptr + offs, mask=mask) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask) + (1.0 - beta2) * g * g
    step = (m / bc1) / (tl.sqrt(v / bc2) + eps)
    o = tl.load(offset_tab + t) + offs
    tl.store(out_ptr + o, p * (1.0 - lr * weight_decay) - lr * step, mask=mask)
    tl.store(out_ptr + TOTAL + o, m, mask=mask)
    tl.store(out_ptr + 2 * TOTAL + o, v, mask=mask)
'''


class _AdamWGroup:
    """adamw_group (compile/passes/fusion.py): float32 parameters, one kernel launch."""

    accepts_out = True

    def __init__(self, sizes):
        self.sizes = tuple(sizes)
        self.total = sum(self.sizes)
        self.block = _block(max(self.sizes))
        chunks = [(t, s) for t, n in enumerate(self.sizes) for s in range(0, n, self.block)]
        self.chunk_tensor = np.array([t for t, _ in chunks], np.int64)
        self.chunk_start = np.array([s for _, s in chunks], np.int64)
        self.size_tab = np.array(self.sizes, np.int64)
        self.offset_tab = np.cumsum((0,) + self.sizes[:-1]).astype(np.int64)
        self.source = PRELUDE + ADAMW_GROUP
        self.mod, self.path = _load(self.source)

    def __call__(self, *arrays, each=(), out=None, in_place=False, **hp):
        from dtensor.compile.numpy_backend import adamw_table, update_target
        from dtensor.compile.triton_adapter import as_triton_arg
        arrays = [np.ascontiguousarray(a) for a in arrays]  # kept alive through the launch
        tables = [np.array([a.ctypes.data for a in arrays[k::4]], np.int64) for k in range(4)]
        hp_tab = adamw_table(hp, len(self.sizes), np.float32)
        out = update_target(arrays, self.sizes, in_place) if out is None else out
        if len(self.chunk_tensor):
            self.mod.kernel[(len(self.chunk_tensor),)](
                *[as_triton_arg(t) for t in tables], as_triton_arg(self.size_tab),
                as_triton_arg(self.offset_tab), as_triton_arg(hp_tab),
                as_triton_arg(self.chunk_tensor), as_triton_arg(self.chunk_start),
                as_triton_arg(out), self.total, BLOCK=self.block)
        return out


RANDOM = '''
@triton.jit
def kernel(off_ptr, out_ptr, N, seed, NORMAL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    off = tl.load(off_ptr + i, mask=mask, other=0)
    if NORMAL:
        r = tl.randn(seed, off)
    else:
        r = tl.rand(seed, off)
    tl.store(out_ptr + i, r, mask=mask)
'''


class _Random:
    """rand / randn: Triton's Philox on the same (key, global flat index) as eager."""

    accepts_out = True

    def __init__(self, name, shape, dtype, offsets):
        self.normal, self.shape, self.dtype = name == "randn", tuple(shape), np.dtype(dtype)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        self.mod, self.path = _load(PRELUDE + RANDOM)
        self.source = PRELUDE + RANDOM
        self.n = self.offsets.size
        self.block = _block(self.n)

    def __call__(self, like, *, key, dtype, out=None):
        from dtensor.compile.triton_adapter import as_triton_arg
        r = np.empty(self.n, np.float32)
        if self.n:
            grid = ((self.n + self.block - 1) // self.block,)
            self.mod.kernel[grid](as_triton_arg(self.offsets), as_triton_arg(r), self.n,
                                  int(key), NORMAL=self.normal, BLOCK=self.block)
        if out is None:
            return r.reshape(self.shape).astype(self.dtype, copy=False)
        out[...] = r.reshape(self.shape)
        return out


def _kernel_for(n: Node):
    """A Triton kernel for node ``n`` and the params it is called with, or None (the node
    stays a numpy call)."""
    from dtensor.compile.passes.fusion import as_group, pointwise_op
    arrays = [a for a in n.inputs if isinstance(a, (Node, np.ndarray))]
    if n.name == "fused_rows":
        return _RowGroup(n, [a.shape for a in arrays], [a.dtype for a in arrays]), {}
    if n.name == "fused" or pointwise_op(n) is not None:
        if not n.shape:
            return None
        ops, arrays, positions = as_group(n)
        keys = {k: v for k, v in n.params.items() if k.startswith("key")}
        return _Pointwise(ops, n.shape, n.dtype, [a.shape for a in arrays],
                          [a.dtype for a in arrays], f"{n.name} {n.note}", positions), keys
    if n.dtype is None or n.dtype.kind != "f" or not n.shape:
        return None
    if n.name == "adamw_group" and all(a.dtype == np.float32 for a in arrays):
        return _AdamWGroup(n.params["sizes"]), {k: v for k, v in n.params.items()
                                                 if k != "sizes"}
    if n.name in ("rand", "randn") and n.variant == "local":  # a block: its global offsets
        return (_Random(n.name, n.shape, n.dtype, n.blocks[1].flat_offsets()),
                {k: n.params[k] for k in ("key", "dtype")})
    if n.name not in OPS or n.variant != "impl":
        return None
    if n.name in _ROW_KIND:
        return _Rowwise(n.name, n.params, n.shape, n.dtype), {}
    if n.name in ("softmax_cross_entropy", "softmax_cross_entropy_backward"):
        x = n.inputs[1] if n.name.endswith("_backward") else n.inputs[0]  # (g, x, t) / (x, t)
        return _CrossEntropy(n.name, n.shape, n.dtype, x.shape[-1]), {}
    if n.name == "adamw_step":
        return _AdamW(n.shape, n.dtype), dict(n.params)
    if n.name in ("rand", "randn"):
        return (_Random(n.name, n.shape, n.dtype, np.arange(int(np.prod(n.shape)))),
                {k: n.params[k] for k in ("key", "dtype")})
    return None


def lower_graph(graph: Graph) -> list:
    """Give every node a Triton kernel can run its kernel (``node.fn``, with the params it is
    called with); returns [(node, kernel)]."""
    ensure_triton()
    kernels = []
    for n in graph.nodes:
        found = _kernel_for(n)
        if found is not None:
            n.fn, n.params = found
            n.kind = "triton"
            kernels.append((n, n.fn))
    return kernels
