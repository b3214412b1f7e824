"""The Triton backend (kernels on numpy arrays, so always under Triton's interpreter; a device
path needs device arrays): every kernel of compile/kernels.py (fused pointwise groups, row
groups, the row-wise ops, random draws) becomes an ``@triton.jit`` kernel rendered from its
expression over 2-D tiles of rows, and the AdamW group update and index_add have kernels of
their own; matmuls, shape ops, gathers and collectives stay numpy calls.

The interpreter (``TRITON_INTERPRET=1``, set here if triton is not imported yet) runs them on
numpy arrays through compile/triton_adapter.py: slow (30-100x numpy), for verification. Kernel
sources go to content-hashed files (DTENSOR_DEBUG=3 prints each with the node it covers).
"""
from __future__ import annotations

import os
import sys

import numpy as np
from dtensor.compile import kernels
from dtensor.compile.numpy_backend import import_source
from dtensor.compile.triton_adapter import as_triton_arg

from dtensor.graph import Graph, Node
from dtensor.ops import expr as X

__all__ = ["lower_graph", "ensure_triton"]

_TL_TYPES = {"float32": "tl.float32", "float64": "tl.float64", "float16": "tl.float16",
             "int64": "tl.int64", "int32": "tl.int32", "bool": "tl.int1", "uint32": "tl.uint32"}

PRELUDE = '''import triton
import triton.language as tl


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
def pow(x, y):  # numpy's power: an integer exponent below 32 by squaring (exact signs, no
    # exp-log error growing with |y log x|); otherwise exp(y log |x|), NaN for a negative base
    whole = tl.floor(y) == y
    n = tl.abs(y)
    acc = x * 0.0 + 1.0
    b = x
    for _ in tl.static_range(5):
        half = tl.floor(n * 0.5)
        acc = tl.where(n - 2.0 * half == 1.0, acc * b, acc)
        b = b * b
        n = half
    acc = tl.where(y < 0, 1.0 / acc, acc)
    r = tl.where(x < 0, float("nan"), tl.exp(y * tl.log(tl.abs(x))))
    return tl.where(whole & (tl.abs(y) < 32.0), acc, r)
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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _literal(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return repr(int(v))
    v = float(v)
    return repr(v) if np.isfinite(v) else f"float('{v}')"  # inf, -inf, nan


# How Triton spells each primitive of dtensor/ops/expr.py ({T}: a cast's type, {a}: a draw's
# key); a row reduction sees only the tile's live columns (``mask``).
_SPELL = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})",
          "div": "({0} / {1})", "neg": "(-{0})", "not": "(~{0})", "lt": "({0} < {1})",
          "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
          "eq": "({0} == {1})", "ne": "({0} != {1})", "where": "tl.where({0}, {1}, {2})",
          "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
          "abs": "tl.abs({0})", "exp": "tl.exp({0})", "log": "tl.log({0})",
          "sqrt": "tl.sqrt({0})", "tanh": "tanh({0})", "sin": "tl.sin({0})",
          "cos": "tl.cos({0})", "pow": "pow({0}, {1})", "cast": "({0}).to({T})",
          "rand": "tl.rand({a}, {0})", "randn": "tl.randn({a}, {0})",
          "rowsum": "tl.sum(tl.where(mask, {0}, 0.0), axis=1)[:, None]",
          "rowmax": "tl.max(tl.where(mask, {0}, -float('inf')), axis=1)[:, None]",
          "col": "cols", "row": "rows"}


class _Kernel(kernels.Kernel):
    """A kernel as one @triton.jit function over (BLOCK_R, BLOCK_C) tiles: whole rows when it
    reduces along them (a reduction is tl.sum / tl.max along axis 1, its (BLOCK_R, 1) result
    broadcasting back), otherwise tiles of any columns."""

    def __init__(self, node: Node, found):
        super().__init__(node, found)
        whole = self.causal or any(e.prim in X.REDUCTIONS for e in self.nodes)
        self.block_c = _pow2(self.C) if whole else min(_pow2(self.C), 1 << 14)
        self.block_r = max(1, min(_pow2(self.R), (1 << 14) // self.block_c))
        C = self.C
        lines = [f"# {self.label}", "@triton.jit",
                 "def kernel(" + "".join(f"in{k}, " for k in range(len(self.inputs)))
                 + "out, R, " + "".join(f"{k}, " for k in self.keys)
                 + "BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):",
                 "    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]",
                 "    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]",
                 "    rmask = rows < R",
                 f"    mask = rmask & (cols < {C})"
                 + (f" & (cols <= rows % {self.L})" if self.causal else "")]
        names = {}
        for e in self.nodes:
            i, args = self.index[id(e)], [names[id(a)] for a in e.args]
            if e.prim == "in":
                lay = self.inputs[e.attr]
                off = "".join(f" + ((rows // {i_}) % {n}) * {st}" for i_, n, st in lay.terms)
                if self.row_valued[id(e)]:
                    expr = f"tl.load(in{e.attr} + (rows * 0{off}), mask=rmask)"
                else:
                    expr = (f"tl.load(in{e.attr} + (rows * 0{off} + cols * {lay.col_stride}),"
                            " mask=mask)")
            elif e.prim in ("const", "cols"):
                names[id(e)] = _literal(self.literal(e.attr) if e.prim == "const" else C)
                continue
            else:
                T = _TL_TYPES[np.dtype(e.attr).name] if e.prim == "cast" else None
                expr = _SPELL[e.prim].format(*args, T=T, a=e.attr)
            lines.append(f"    t{i} = {expr}")
            names[id(e)] = f"t{i}"
        res = names[id(self.root)]
        if self.causal:
            res = f"tl.where(mask, {res}, 0.0)"
        if self.dtype != np.dtype(bool):
            res = f"({res}).to({_TL_TYPES[self.dtype.name]})"
        where = f"rows * {C} + cols" if self.out_cols == C else "rows + cols * 0"
        lines.append(f"    tl.store(out + ({where}), tl.broadcast_to({res}, (BLOCK_R, BLOCK_C)),"
                     f" mask=rmask & (cols < {self.out_cols}))")
        self.source = PRELUDE + "\n\n" + "\n".join(lines) + "\n"
        self.mod, self.path = _load(self.source)

    def launch(self, arrays, out, keys):
        grid = (-(-self.R // self.block_r), -(-self.out_cols // self.block_c))
        with np.errstate(all="ignore"):  # masked-off lanes may compute inf - inf
            self.mod.kernel[grid](*[as_triton_arg(a) for a in arrays], as_triton_arg(out),
                                  self.R, *[keys[k] for k in self.keys],
                                  BLOCK_R=self.block_r, BLOCK_C=self.block_c)


INDEX_ADD = '''
@triton.jit
def kernel(g_ptr, idx_ptr, out_ptr, N, OFF, ROWS, C, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = tl.load(idx_ptr + i + cols * 0) - OFF  # a vector: the interpreter masks no scalar
    keep = (cols < C) & (r >= 0) & (r < ROWS)
    g = tl.load(g_ptr + i * C + cols, mask=cols < C, other=0.0)
    tl.atomic_add(out_ptr + r * C + cols, g, mask=keep)
'''


# Attention for one head and BLOCK_M query rows a program (the forward), or one head a program
# walking its query blocks (the backward, whose dk and dv gather over every query): the scores
# of BLOCK_M rows live in the program's tile, never a whole (L, L) matrix in memory, and the
# backward recomputes them. Keys are one tile (BLOCK_S >= L).
ATTENTION = '''
@triton.jit
def probs(qs, k, rows, L, CAUSAL: tl.constexpr, BLOCK_S: tl.constexpr):
    keys = tl.arange(0, BLOCK_S)[None, :]
    live = (keys < L) & (rows < L)
    if CAUSAL:
        live = live & (keys <= rows)
    s = tl.where(live, tl.dot(qs, tl.trans(k)), -float("inf"))
    p = tl.where(live, tl.exp(s - tl.max(s, axis=1)[:, None]), 0.0)
    return tl.where(live, p / tl.sum(p, axis=1)[:, None], 0.0)


@triton.jit
def forward(q_ptr, k_ptr, v_ptr, out_ptr, L, scale, E: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    base = tl.program_id(0) * L * E
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    ks = tl.arange(0, BLOCK_S)[:, None]
    es = tl.arange(0, BLOCK_E)[None, :]
    kmask = (ks < L) & (es < E)
    qs = tl.load(q_ptr + base + rows * E + es, mask=(rows < L) & (es < E), other=0.0) * scale
    k = tl.load(k_ptr + base + ks * E + es, mask=kmask, other=0.0)
    v = tl.load(v_ptr + base + ks * E + es, mask=kmask, other=0.0)
    p = probs(qs, k, rows, L, CAUSAL, BLOCK_S)
    tl.store(out_ptr + base + rows * E + es, tl.dot(p, v), mask=(rows < L) & (es < E))


@triton.jit
def backward(g_ptr, q_ptr, k_ptr, v_ptr, out_ptr, H, L, scale, E: tl.constexpr,
             CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
             BLOCK_E: tl.constexpr):
    base = tl.program_id(0) * L * E
    ks = tl.arange(0, BLOCK_S)[:, None]
    es = tl.arange(0, BLOCK_E)[None, :]
    kmask = (ks < L) & (es < E)
    k = tl.load(k_ptr + base + ks * E + es, mask=kmask, other=0.0)
    v = tl.load(v_ptr + base + ks * E + es, mask=kmask, other=0.0)
    dk = tl.zeros((BLOCK_S, BLOCK_E), tl.float32)
    dv = tl.zeros((BLOCK_S, BLOCK_E), tl.float32)
    for start in range(0, L, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)[:, None]
        rmask = (rows < L) & (es < E)
        qs = tl.load(q_ptr + base + rows * E + es, mask=rmask, other=0.0) * scale
        g = tl.load(g_ptr + base + rows * E + es, mask=rmask, other=0.0)
        p = probs(qs, k, rows, L, CAUSAL, BLOCK_S)
        dp = tl.dot(g, tl.trans(v))
        ds = p * (dp - tl.sum(p * dp, axis=1)[:, None])
        tl.store(out_ptr + base + rows * E + es, tl.dot(ds, k) * scale, mask=rmask)
        dk += tl.dot(tl.trans(ds), qs)
        dv += tl.dot(tl.trans(p), g)
    tl.store(out_ptr + H * L * E + base + ks * E + es, dk, mask=kmask)
    tl.store(out_ptr + 2 * H * L * E + base + ks * E + es, dv, mask=kmask)
'''


class _Attention(kernels.Attention):
    """attention and its backward: ATTENTION's programs."""

    def __init__(self, n: Node):
        super().__init__(n)
        self.block_s, self.block_e = _pow2(self.L), _pow2(self.E)
        self.block_m = max(1, min(self.block_s, (1 << 14) // self.block_s))
        self.source = PRELUDE + ATTENTION
        self.mod, self.path = _load(self.source)

    def __call__(self, *inputs, out=None):
        args = [as_triton_arg(np.ascontiguousarray(a)) for a in inputs]
        out = self.alloc(out)
        blocks = dict(E=self.E, CAUSAL=self.causal, BLOCK_M=self.block_m, BLOCK_S=self.block_s,
                      BLOCK_E=self.block_e)
        if self.H and self.L and self.E:
            with np.errstate(all="ignore"):  # rows past L compute 0 / 0, never stored
                if self.backward:
                    self.mod.backward[(self.H,)](*args, as_triton_arg(out), self.H, self.L,
                                                 self.scale, **blocks)
                else:
                    self.mod.forward[(self.H, -(-self.L // self.block_m))](
                        *args, as_triton_arg(out), self.L, self.scale, **blocks)
        return out


class _IndexAdd(kernels.IndexAdd):
    """index_add by atomic adds: row i of g into row idx[i] - off (in order of i under the
    interpreter)."""

    def __init__(self, n: Node):
        super().__init__(n)
        self.block_c = min(_pow2(self.C), 1 << 12)
        self.source = PRELUDE + INDEX_ADD
        self.mod, self.path = _load(self.source)

    def __call__(self, g, idx, like, out=None):
        (g, flat), out = self.rows_of(g, idx), self.alloc(out)
        out[...] = 0
        if flat.size and self.C:
            self.mod.kernel[(flat.size, -(-self.C // self.block_c))](
                as_triton_arg(g), as_triton_arg(flat), as_triton_arg(out), flat.size, self.off,
                self.rows, self.C, BLOCK_C=self.block_c)
        return out


# One launch for the AdamW update of every parameter (as PyTorch's fused AdamW and apex's
# multi_tensor_apply): each program takes a chunk of one parameter, found through tables of the
# parameters' addresses, sizes, offsets in the (3, total) result and update constants; the
# arithmetic is the adamw_step op's expression.
def _adamw_group_source() -> str:
    leaves = ["p", "g", "m", "v"] + [f"k{j}" for j in range(7)]
    lines, (po, mo, vo) = kernels.adamw_body(
        lambda e, args: leaves[e.attr] if e.prim == "in" else _literal(e.attr)
        if e.prim == "const" else _SPELL[e.prim].format(*args))
    return "\n".join([
        "@triton.jit",
        "def kernel(tab, size_tab, offset_tab, k_tab, chunk_tensor,",
        "           chunk_start, out_ptr, TOTAL, BLOCK: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    t = tl.load(chunk_tensor + pid)",
        "    offs = tl.load(chunk_start + pid) + tl.arange(0, BLOCK)",
        "    mask = offs < tl.load(size_tab + t)",
        *[f"    {x} = tl.load(tl.load(tab + 4 * t + {k}).to(tl.pointer_type(tl.float32)) + offs,"
          " mask=mask)" for k, x in enumerate("pgmv")],
        *[f"    k{j} = tl.load(k_tab + 7 * t + {j})" for j in range(7)],
        *[f"    {name} = {text}" for name, text in lines],
        "    o = tl.load(offset_tab + t) + offs",
        f"    tl.store(out_ptr + o, {po}, mask=mask)",
        f"    tl.store(out_ptr + TOTAL + o, {mo}, mask=mask)",
        f"    tl.store(out_ptr + 2 * TOTAL + o, {vo}, mask=mask)", ""])


class _AdamWGroup(kernels.Named):
    """adamw_group (compile/passes/fusion.py): float32 parameters, one kernel launch."""

    def __init__(self, sizes):
        self.sizes = tuple(sizes)
        self.total = sum(self.sizes)
        self.block = min(1 << 14, max(16, _pow2(max(self.sizes))))  # elements a program
        chunks = [(t, s) for t, n in enumerate(self.sizes) for s in range(0, n, self.block)]
        self.chunk_tensor = np.array([t for t, _ in chunks], np.int64)
        self.chunk_start = np.array([s for _, s in chunks], np.int64)
        self.size_tab = np.array(self.sizes, np.int64)
        self.offset_tab = np.cumsum((0,) + self.sizes[:-1]).astype(np.int64)
        self.source = PRELUDE + _adamw_group_source()
        self.mod, self.path = _load(self.source)

    def bind(self, params: dict) -> dict:
        return {k: v for k, v in params.items() if k != "sizes"}

    def __call__(self, *arrays, each=(), out=None, in_place=False, **hp):
        from dtensor.compile.numpy_backend import adamw_table, update_target
        arrays = [np.ascontiguousarray(a) for a in arrays]  # kept alive through the launch
        tab = np.array([kernels.address(a) for a in arrays], np.int64)  # p, g, m, v of each
        hp_tab = adamw_table(hp, len(self.sizes), np.float32)
        out = update_target(arrays, self.sizes, in_place, tab) if out is None else out
        if len(self.chunk_tensor):
            self.mod.kernel[(len(self.chunk_tensor),)](
                as_triton_arg(tab), as_triton_arg(self.size_tab),
                as_triton_arg(self.offset_tab), as_triton_arg(hp_tab),
                as_triton_arg(self.chunk_tensor), as_triton_arg(self.chunk_start),
                as_triton_arg(out), self.total, BLOCK=self.block)
        return out


def _kernel_for(n: Node):
    """A Triton kernel for node ``n``, or None (the node stays a numpy call)."""
    arrays = [a for a in n.inputs if isinstance(a, (Node, np.ndarray))]
    if n.name == "adamw_group":
        ok = n.dtype == np.float32 and all(a.dtype == np.float32 for a in arrays)
        return _AdamWGroup(n.params["sizes"]) if ok else None
    if n.name in ("attention", "attention_backward") and n.kind == "op":
        ok = n.dtype == np.float32 and all(a.dtype == n.dtype for a in arrays)
        return _Attention(n) if ok else None
    if n.name == "index_add":
        ok = n.dtype.kind == "f" and arrays[1].dtype.kind in "iu"
        return _IndexAdd(n) if ok else None
    found = kernels.members(n)
    return _Kernel(n, found) if found is not None else None


def lower_graph(graph: Graph) -> list:
    """Kernels for the nodes a Triton kernel can run; each such node becomes kind "triton".
    Returns [(node, kernel)]."""
    ensure_triton()
    found = [(n, k) for n in graph.nodes if (k := _kernel_for(n)) is not None]
    for n, _ in found:
        n.kind = "triton"
    return found
