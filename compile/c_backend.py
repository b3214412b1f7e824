"""The C backend: the CPU counterpart of the Triton backend, as TorchInductor's C++ backend is
the CPU counterpart of its Triton one.

Every kernel of compile/kernels.py (fused pointwise groups, row groups, the row-wise ops:
softmax, layer-norm, cross-entropy and their backwards, random draws) is rendered as a C
function from its expression. index_add, attention and the AdamW group's loops (its arithmetic
is the adamw_step op's expression) are written by hand in compile/c_typed.c, over a type T,
included once per floating type after the helpers of compile/c_prelude.c. One graph's functions
follow those in one C file, compiled once by compile/native.py (the system C compiler, ``$CC``
else ``cc``) into a shared library named by the hash of its source and flags, and called
through ctypes. A kernel streams each row once per level of its row reductions: the
temporaries numpy materialises between ufuncs stay in registers, reductions run in 8 lanes,
and the loops are SIMD-vectorised (``-O3 -march=native``; exp is a polynomial the compiler can
vectorise, since libm's is a scalar call). ctypes releases the GIL, so a large kernel's rows
are split over the threads of :func:`num_threads` and run in parallel.

Results match numpy's to float rounding, not bit for bit: the same formulas in the same order
(``-ffp-contract=off``: no fused multiply-adds numpy would not do), but exp, log and the
reductions' summation order differ in the last bits. The attention kernels' products are the
exception: their register tiles multiply-add with one rounding where the CPU has FMA, as BLAS's
GEMMs in the math path do. Matmuls, collectives, gathers and anything not listed stay numpy
calls.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from dtensor.compile import kernels, native
from dtensor.compile.native import CompilerNotFound, build, cuts, num_threads, parallel

from dtensor.graph import Graph, Node
from dtensor.ops import expr as X

__all__ = ["lower_graph", "num_threads", "CompilerNotFound"]

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.bool_): "uint8_t", np.dtype(np.int64): "int64_t"}
_SUFFIX = {"float": "f32", "double": "f64"}


def _source(name: str) -> str:
    return (Path(__file__).parent / name).read_text()


def _typed(ctype: str) -> str:
    """compile/c_typed.c for ``ctype``: its type, name suffix and AdamW update defined first."""
    leaves = ["p[i]", "g[i]", "m[i]", "v[i]"] + [f"k[{j}]" for j in range(7)]
    lines, (po, mo, vo) = kernels.adamw_body(
        lambda e, args: leaves[e.attr] if e.prim == "in" else _spell(e, args, ctype))
    body = [f"{ctype} {name} = {expr};" for name, expr in lines]
    body += [f"mo[i] = {mo};", f"vo[i] = {vo};", f"po[i] = {po};"]
    return (f"#define T {ctype}\n#define DT_S {_SUFFIX[ctype]}\n#define DT_ADAMW_BODY \\\n    "
            + " \\\n    ".join(body) + "\n" + _source("c_typed.c")
            + "#undef T\n#undef DT_S\n#undef DT_ADAMW_BODY\n")


# ----------------------------------------------------------------------------- kernels

_P, _I, _U = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64


_ptr = kernels.address


def _c_literal(v, single: bool) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return f"{int(v)}" if v >= 0 else f"({int(v)})"
    v = float(v)
    if not np.isfinite(v):
        return "NAN" if np.isnan(v) else ("INFINITY" if v > 0 else "(-INFINITY)")
    text = repr(v) + ("f" if single else "")
    return f"({text})" if v < 0 else text


# How C spells each primitive of dtensor/ops/expr.py: {f} is the float functions' suffix, {s}
# the type's name suffix, {T} the type. Arguments are always a name or a literal.
_SPELL = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
          "neg": "-{0}", "not": "!{0}", "lt": "{0} < {1}", "le": "{0} <= {1}",
          "gt": "{0} > {1}", "ge": "{0} >= {1}", "eq": "{0} == {1}", "ne": "{0} != {1}",
          "where": "{0} ? {1} : {2}", "maximum": "{0} != {0} || {0} > {1} ? {0} : {1}",
          "minimum": "{0} != {0} || {0} < {1} ? {0} : {1}", "abs": "fabs{f}({0})",
          "exp": "dt_exp_{s}({0})", "log": "log{f}({0})", "sqrt": "sqrt{f}({0})",
          "tanh": "tanh{f}({0})", "sin": "sin{f}({0})", "cos": "cos{f}({0})",
          "pow": "pow{f}({0}, {1})", "cast": "({T})({0})", "rand": "dt_rand({a}, {0})",
          "randn": "dt_randn({a}, {0})"}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_TRANSCENDENTAL = ("exp", "log", "tanh", "sin", "cos", "pow", "rand", "randn")


def _spell(e, args, ctype: str) -> str:
    if e.prim == "const":
        return _c_literal(e.attr, ctype == "float")
    fmt = {"f": "f" if ctype == "float" else "", "s": _SUFFIX[ctype], "T": ctype}
    if e.prim == "exp" and _sign(e.args[0]) < 0:  # no upper clamp (dt_exp_upto_f32)
        return f"(dt_exp_upto_{fmt['s']}({args[0]}, INFINITY))"
    return "(" + _SPELL[e.prim].format(*args, a=e.attr, **fmt) + ")"


def _sign(e) -> int:
    """-1: ``e`` is never above 0, 1: never below 0 (a NaN aside), 0: unknown. GELU's
    exp(-x^2 / 2) and softmax's exp(x - rowmax(x)) then skip exp's upper clamp."""
    a = e.args
    if e.prim == "const":
        vals = e.attr.values() if isinstance(e.attr, dict) else [e.attr]
        if all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
               for v in vals):
            return 1 if all(v >= 0 for v in vals) else -1 if all(v <= 0 for v in vals) else 0
        return 0
    if e.prim in ("abs", "exp", "sqrt") or (e.prim == "mul" and a[0] is a[1]):
        return 1
    if e.prim == "neg":
        return -_sign(a[0])
    if e.prim == "mul":
        return _sign(a[0]) * _sign(a[1])
    if e.prim == "sub" and a[1].prim == "rowmax" and a[1].args[0] is a[0]:
        return -1
    return 0


def _supported(k: kernels.Kernel) -> bool:
    """Kernels of one float type in which a boolean (an input or a comparison's result) is only
    a where() condition or not()'s argument and an integer input only a comparison's argument:
    C computes on ints where numpy has bool arithmetic (True + True is True) and its own
    promotions (int64 with float32 is float64), so anything else stays numpy."""
    if k.dtype not in (np.float32, np.float64) or any(
            lay.dtype not in (k.dtype, np.bool_, np.int64) for lay in k.inputs):
        return False
    boolean = {id(e) for e in k.nodes if e.prim in _COMPARE + ("not",) or (
        e.prim == "in" and k.inputs[e.attr].dtype == np.bool_)}
    integer = {id(e) for e in k.nodes if e.prim == "in" and k.inputs[e.attr].dtype == np.int64}
    for e in k.nodes:
        for pos, a in enumerate(e.args):
            if id(a) in boolean and not (e.prim == "where" and pos == 0 or e.prim == "not"):
                return False
            if id(a) in integer and e.prim not in _COMPARE:
                return False
        if e.prim == "cast" and e.attr not in (np.float32, np.float64):
            return False
    return True


class _Kernel(kernels.Kernel):
    """A kernel rendered as a C function over rows r0..r1: one streaming pass over a row per
    level of its reductions (8-lane accumulators), then the pass that stores the row."""

    def __init__(self, node: Node, found, name: str):
        super().__init__(node, found)
        self.name = name
        T = _CTYPE[self.dtype]
        self.names: dict = {}
        single = T == "float"
        for e in self.nodes:  # leaves every pass reads by the same name
            if e.prim in ("const", "cols", "row", "col"):
                self.names[id(e)] = (
                    _c_literal(self.literal(e.attr), single) if e.prim == "const" else
                    str(self.C) if e.prim == "cols" else "r" if e.prim == "row" else "cc")
        # An element-wise kernel may run in place (its result over an input: the memory
        # plan's _dying_input): no restrict, and ivdep instead, so that its loop still
        # vectorises without a runtime overlap check (element c is read before it is written).
        inplace = kernels.elementwise(node)
        restrict = "" if inplace else "restrict "
        ins = [f"const {_CTYPE[lay.dtype]} *{restrict}in{k}"
               for k, lay in enumerate(self.inputs)]
        keys = "".join(f", uint64_t {key}" for key in self.keys)
        C, L = self.C, self.L
        # an exp a column: bound by arithmetic, built for the widest vectors (c_prelude.c)
        wide = any(e.prim == "exp" for e in self.nodes)
        lines = [f"/* {self.label} */",
                 f"{'DT_WIDE ' * wide}void {name}({', '.join(ins + [f'{T} *{restrict}out'])}, "
                 f"int64_t r0, int64_t r1{keys}) {{", "    for (int64_t r = r0; r < r1; r++) {"]
        for k, lay in enumerate(self.inputs):
            off = " + ".join(f"((r / {i}) % {n}) * {st}" for i, n, st in lay.terms) or "0"
            lines.append(f"        const {_CTYPE[lay.dtype]} *p{k} = in{k} + ({off});")
        n = f"r % {L} + 1 < {C} ? r % {L} + 1 : {C}" if self.causal else C  # causal: j <= i
        lines += [f"        {T} *o = out + r * {self.out_cols};",
                  f"        const int64_t n = {n};"]
        top = self.level[id(self.root)]
        kept = None
        for level in range(top + 1):
            for e in self.nodes:  # this level's row values: once a row
                if (self.row_valued[id(e)] and id(e) not in self.names
                        and self.level[id(e)] == level and e.prim not in X.REDUCTIONS):
                    lines.append(f"        __auto_type v{self.index[id(e)]} = {self._expr(e)};")
                    self.names[id(e)] = f"v{self.index[id(e)]}"
            reductions = [e for e in self.nodes if e.prim in X.REDUCTIONS
                          and self.level[id(e)] == level + 1]
            if reductions:
                kept = self._kept(reductions) if level == top - 1 else None
                lines += self._reduce(reductions, T, kept)
        if kept is not None:  # the last pass reads it back instead of computing it again
            self.names[id(kept)] = "o[cc]"
        root = self.names.get(id(self.root))
        if root is not None:
            lines.append(f"        for (int64_t c = 0; c < {self.out_cols}; c++) "
                         f"o[c] = ({T})({root});")
        else:
            lines += ["#pragma GCC ivdep"] * inplace + [
                "        for (int64_t c = 0; c < n; c++) {", "            const int64_t cc = c;"]
            lines += self._body([self.root], "            ")
            lines += [f"            o[c] = ({T})(t{self.index[id(self.root)]});", "        }"]
            if self.causal:
                lines.append(f"        for (int64_t c = n; c < {C}; c++) o[c] = 0;")
        self.source = "\n".join(lines + ["    }", "}", ""])
        self.argtypes = [_P] * (len(self.inputs) + 1) + [_I, _I] + [_U] * len(self.keys)
        # the row ranges, fixed with the graph, so that a call goes straight to the function
        self.ranges = cuts(self.R, self.R * self.C * (len(self.inputs) + 1))

    def _expr(self, e) -> str:
        args = [self._name(a) for a in e.args]
        if e.prim == "in":
            return f"p{e.attr}[0]" if self.row_valued[id(e)] else (
                f"p{e.attr}[cc * {self.inputs[e.attr].col_stride}]")
        return _spell(e, args, _CTYPE[self.dtype])

    def _name(self, e) -> str:
        return self.names.get(id(e)) or f"t{self.index[id(e)]}"

    def _body(self, targets, pad) -> list:
        return [f"{pad}__auto_type t{self.index[id(e)]} = {self._expr(e)};"
                for e in self.needed(targets, self.names) if id(e) not in self.names]

    def _kept(self, reductions):
        """The value the last reduction pass stores in the output row for the final pass, or
        None: the costliest column value both passes compute that holds a transcendental
        (softmax's exp(x - max), which the final pass divides by the sum). It is a value of
        the kernel's type, so reading it back gives the bits computing it again would, without
        a second exp a column (benchmarks/kernels.py, the row softmax)."""
        if self.out_cols != self.C or self.root.prim in X.REDUCTIONS:
            return None
        later = {id(e) for e in self.needed([self.root])}
        best, cost = None, 0
        for e in self.needed([e.args[0] for e in reductions]):
            tree = X.topo([e])
            prims = {d.prim for d in tree}
            if (id(e) in later and e.prim not in _COMPARE + ("not",)  # a value of type T
                    and prims & set(_TRANSCENDENTAL) and "cast" not in prims
                    and len(tree) > cost):
                best, cost = e, len(tree)
        return best

    def _reduce(self, reductions, T, kept=None) -> list:
        """One pass over the row for ``reductions``: 16 columns a step (a sum's 8 lanes of
        each half into its own vector accumulator, added at the end: two chains of
        latencies, not one, as a 2048-column row's sum was bound by), then the tail, in
        order; ``kept`` also goes to the output row."""
        def fold(e, acc, x):  # acc takes x in, as e's reduction does
            return (f"{acc} = {acc} + {x};" if e.prim == "rowsum" else
                    f"{acc} = {x} > {acc} ? {x} : {acc};")

        out = [f"        {T} v{self.index[id(e)]};" for e in reductions] + ["        {"]
        steps, ends = [], []  # per reduction: its vector step, and its lanes folded into v
        for e in reductions:
            i = self.index[id(e)]
            init = "{" + ", ".join(["0" if e.prim == "rowsum" else "-INFINITY"] * 8) + "}"
            out.append(f"        {T} s{i}[16];")
            if e.prim == "rowsum":
                out.append(f"        {T}_8 a{i} = {init}, b{i} = {init};")
                steps.append(f"            {{ {T}_8 t, u; memcpy(&t, s{i}, sizeof t); "
                             f"memcpy(&u, s{i} + 8, sizeof u); a{i} = a{i} + t; "
                             f"b{i} = b{i} + u; }}")
                ends += [f"        a{i} = a{i} + b{i};",
                         f"        v{i} = ((a{i}[0] + a{i}[1]) + (a{i}[2] + a{i}[3])) + "
                         f"((a{i}[4] + a{i}[5]) + (a{i}[6] + a{i}[7]));"]
            else:
                # a max's lanes as a plain array: its lane-by-lane fold into a vector type is
                # left scalar (GCC 12: "unsupported use"), as an array it is one vector
                # compare and blend (benchmarks/kernels.py, the row softmax)
                out.append(f"        {T} a{i}[8] = {init};")
                steps.append(f"            for (int l = 0; l < 16; l++) "
                             f"{fold(e, f'a{i}[l % 8]', f's{i}[l]')}")
                ends += [f"        v{i} = a{i}[0];",
                         f"        for (int l = 1; l < 8; l++) {fold(e, f'v{i}', f'a{i}[l]')}"]
        args = [e.args[0] for e in reductions]
        out += ["        int64_t c = 0;", "        for (; c + 16 <= n; c += 16) {",
                "            for (int l = 0; l < 16; l++) {",
                "                const int64_t cc = c + l;"]
        keep = [] if kept is None else [f"o[cc] = {self._name(kept)};"]
        out += self._body(args, " " * 16)
        out += [f"                s{self.index[id(e)]}[l] = {self._name(e.args[0])};"
                for e in reductions] + ["                " + k for k in keep]
        out += ["            }"] + steps + ["        }"] + ends
        out += ["        for (; c < n; c++) {", "            const int64_t cc = c;"]
        out += self._body(args, " " * 12) + ["            " + k for k in keep]
        out += [f"            {fold(e, f'v{self.index[id(e)]}', self._name(e.args[0]))}"
                for e in reductions]
        out += ["        }", "        }"]
        for e in reductions:
            self.names[id(e)] = f"v{self.index[id(e)]}"
        return out

    def launch(self, arrays, out, keys):
        head = [_ptr(a) for a in arrays]
        head.append(_ptr(out))
        tail = [keys[k] for k in self.keys] if self.keys else ()
        if len(self.ranges) == 1:
            self.fn(*head, 0, self.R, *tail)
        else:
            parallel(self.fn, [(*head, *r, *tail) for r in self.ranges])


class _IndexAdd(kernels.IndexAdd):
    """index_add, threads splitting the columns."""

    def __init__(self, n: Node):
        super().__init__(n)
        self.name = f"index_add_{_SUFFIX[_CTYPE[self.dtype]]}"
        self.argtypes = [_P] * 3 + [_I] * 6

    def __call__(self, g, idx, like, out=None):
        (g, flat), out = self.rows_of(g, idx), self.alloc(out)
        split = flat.size * self.C >= native.SPLIT_ELEMENTS
        n = min(num_threads(), -(-self.C // 8)) if split else 1
        cols = [self.C * k // n // 8 * 8 for k in range(n)] + [self.C]  # whole vectors
        head = (_ptr(g), _ptr(flat), _ptr(out), flat.size, self.off, self.rows, self.C)
        parallel(self.fn, [head + (a, b) for a, b in zip(cols[:-1], cols[1:])])
        return out


class _Attention(kernels.Attention):
    """attention and its backward, heads split over threads: a query row's scores are a row of
    the stack, never an (L, L) matrix. The kernel reads its inputs where they lie (each head's
    offset and the row stride), and its results go out token-major, as PyTorch's CPU flash
    kernel does: a (..., heads, L, E) result is a view of (..., L, heads, E) memory, so the
    model's usual transpose back to (B, T, heads, E) and reshape to (B, T, C) copy nothing."""

    def __init__(self, n: Node):
        super().__init__(n)
        self.name = f"{n.name}_{_SUFFIX[_CTYPE[self.dtype]]}"
        real = ctypes.c_float if self.dtype == np.float32 else ctypes.c_double
        self.argtypes = [_P] * (8 if self.backward else 7) + [_I] * 5 + [real, ctypes.c_int]
        self._tables: dict = {}  # (shape, strides) of the inputs and out -> (off, rs)
        self._rooms: list = []  # each thread's scratch, kept from call to call

    @staticmethod
    def _rows(a: np.ndarray) -> bool:
        """Whether the kernel reads ``a`` where it lies: contiguous rows, whole-element steps."""
        return a.strides[-1] == a.itemsize and not any(s % a.itemsize for s in a.strides)

    @staticmethod
    def _layout(a: np.ndarray):
        """(offset of each (L, E) block, row stride) in elements, of an array with _rows."""
        item, steps = a.itemsize, a.strides
        off = np.zeros((), np.int64)
        for n, s in zip(a.shape[:-2], steps[:-2]):
            off = np.add.outer(off, np.arange(n, dtype=np.int64) * (s // item))
        return off.ravel(), steps[-2] // item

    def _table(self, arrays, out):
        """Every head's offset for each tensor (inputs, then out or dq, dk, dv: those from out's
        start, one pointer for the three) and each tensor's row stride, once per layout."""
        key = tuple((a.shape, a.strides) for a in (*arrays, out))
        if key not in self._tables:
            layouts = [self._layout(a) for a in arrays]
            for part in (out[0], out[1], out[2]) if self.backward else (out,):
                o, r = self._layout(part)
                layouts.append((o + (_ptr(part) - _ptr(out)) // out.itemsize, r))
            self._tables[key] = (np.concatenate([o for o, _ in layouts]),
                                 np.array([r for _, r in layouts], np.int64))
        return self._tables[key]

    def _scratch(self, threads: int) -> list:
        """Each thread's scratch, starting on a cache line (a vector never straddles two),
        sized by the library's attention_scratch."""
        if len(self._rooms) < threads:
            size = getattr(self.lib, f"attention_scratch_{_SUFFIX[_CTYPE[self.dtype]]}")
            size.argtypes, size.restype = [_I] * 3, _I
            n = size(self.L, self.E, int(self.backward)) + 64 // self.dtype.itemsize
            self._rooms += [np.empty(n, self.dtype) for _ in range(threads - len(self._rooms))]
        return [_ptr(a) + (-_ptr(a) % 64) for a in self._rooms[:threads]]

    def __call__(self, *inputs, out=None):
        out = self.alloc(out)
        if out.ndim >= 3 + self.backward and out.flags.c_contiguous:
            lead, (heads, L, E) = out.shape[:-3], out.shape[-3:]  # (..., L, heads, E) memory
            out = out.reshape(*lead, L, heads, E).swapaxes(-2, -3)
        if not (self.H and self.L and self.E):
            return out
        arrays = [a if self._rows(a) else np.ascontiguousarray(a) for a in inputs]
        off, rs = self._table(arrays, out)
        head = tuple(_ptr(a) for a in arrays) + (_ptr(out), _ptr(off), _ptr(rs))
        tail = (self.H, self.L, self.E, self.scale, int(self.causal))
        heads = cuts(self.H, self.H * self.L * self.L * self.E)  # (L^2 E a head)
        parallel(self.fn, [head + (room,) + r + tail
                           for room, r in zip(self._scratch(len(heads)), heads)])
        return out


class _AdamWGroup(kernels.Named):
    """adamw_group (compile/passes/fusion.py): every parameter's update in one call, the
    parameters split over threads by size."""

    def __init__(self, sizes, dtype):
        self.sizes = np.array(sizes, np.int64)
        self.total = int(self.sizes.sum())
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.dtype = np.dtype(dtype)
        self.name = f"adamw_group_{_SUFFIX[_CTYPE[self.dtype]]}"
        self.argtypes = [_P] * 5 + [_I] * 3
        n = num_threads() if self.total >= native.SPLIT_ELEMENTS else 1
        cum = np.cumsum(self.sizes)  # cut where the running size passes k / n of the total
        cuts = [0] + [int(np.searchsorted(cum, self.total * k / n)) + 1 for k in range(1, n)]
        cuts = sorted(set(min(c, len(self.sizes)) for c in cuts + [len(self.sizes)]))
        self.ranges = list(zip(cuts[:-1], cuts[1:]))

    def bind(self, params: dict) -> dict:
        return {k: v for k, v in params.items() if k != "sizes"}

    def __call__(self, *arrays, each=(), out=None, in_place=False, **hp):
        from dtensor.compile.numpy_backend import adamw_table, update_target
        arrays = [np.ascontiguousarray(a) for a in arrays]  # kept alive through the call
        tab = np.array([_ptr(a) for a in arrays], np.int64)
        hps = adamw_table(hp, len(self.sizes), np.float64)
        out = update_target(arrays, self.sizes, in_place, tab) if out is None else out
        head = (_ptr(tab), _ptr(self.sizes), _ptr(self.offsets), _ptr(hps), _ptr(out),
                self.total)
        parallel(self.fn, [head + r for r in self.ranges])
        return out


def _kernel_for(n: Node, name: str):
    """A C kernel for node ``n``, or None."""
    arrays = [a for a in n.inputs if isinstance(a, (Node, np.ndarray))]
    if n.dtype not in (np.float32, np.float64):
        return None
    if n.name in ("attention", "attention_backward") and n.kind == "op":
        ok = all(a.dtype == n.dtype for a in arrays) and len(arrays) == len(n.inputs)
        return _Attention(n) if ok else None
    if n.name == "adamw_group":
        ok = all(a.dtype == n.dtype for a in arrays)
        return _AdamWGroup(n.params["sizes"], n.dtype) if ok else None
    if n.name == "index_add":
        ok = arrays[0].dtype == n.dtype and arrays[1].dtype.kind in "iu"
        return _IndexAdd(n) if ok else None
    found = kernels.members(n)
    kernel = _Kernel(n, found, name) if found is not None else None
    return kernel if kernel is not None and _supported(kernel) else None


def lower_graph(graph: Graph) -> list:
    """Kernels for the nodes a C kernel can run, all of the graph's built as one library; each
    such node becomes kind "c". Returns [(node, kernel)]."""
    found = [(n, k) for n in graph.nodes if (k := _kernel_for(n, f"k{n.id}")) is not None]
    if not found:
        return []
    lib = build(PRELUDE + "\n" + "".join(k.source for _, k in found))
    for n, kernel in found:
        kernel.fn = getattr(lib, kernel.name)
        kernel.fn.argtypes = kernel.argtypes
        kernel.fn.restype = None
        kernel.lib = lib  # keeps the library loaded as long as the kernel lives
        n.kind = "c"
    return found


PRELUDE = _source("c_prelude.c") + _typed("float") + _typed("double")
