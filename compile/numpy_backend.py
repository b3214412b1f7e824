"""The numpy backend: a graph becomes generated Python, written to a content-hashed file and
imported (so tracebacks show the generated line), one statement per node.

The generated function takes the input arrays, the slot values of this call and returns the
graph's outputs. Each node calls what eager would have called (the op's impl, its DTensor local
kernel, or a redistribute's step), with its params bound once at compile time, so there is no
dispatch, sharding decision, autograd bookkeeping or cache lookup left at run time; what that
is, ``runner`` reads from the node's fields (op, variant, collective, kernel). A value is
dropped (``del``) right after its last use, so memory peaks where eager's would.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import sys
import types

import numpy as np

from dtensor import observe
from dtensor.compile import cache
from dtensor.compile import kernels as kernels_layer
from dtensor.graph import KERNEL_KINDS, Graph, Node, Slot
from dtensor.ops import blockwise
from dtensor.ops.structural import index_key

__all__ = ["generate", "load"]


# The view ops the generated code spells inline: (text before, param -> constant, text after).
_VIEWS = {"reshape": (".reshape(", lambda p: tuple(p["shape"]), ")"),
          "permute": (".transpose(", lambda p: tuple(p["axes"]), ")"),
          "getitem": ("[", lambda p: index_key(p["key"]), "]")}


def runner(n: Node, kernels: dict):
    """What runs node ``n``, read from its fields (the graph holds no callables): the backend
    kernel made for it (``kernels``: node id -> kernel), the collective its step names, a
    compiler op's function, or its op's impl or local kernel on its blocks."""
    from dtensor.compile.passes import collectives, fusion, simplify
    from dtensor.ops.registry import OPS
    from dtensor.redistribute import Step, run_step
    if n.id in kernels:
        return kernels[n.id]
    if n.kind == "comm":
        mesh, dim = n.specs[1].mesh, n.params["mesh_dim"]
        if n.name == "all_reduce_bucket":
            return functools.partial(collectives.bucket_start, group=mesh.get_group(dim))
        args = tuple((k, v) for k, v in n.params.items() if k not in ("mesh_dim", "donate"))
        run = functools.partial(run_step, step=Step(n.name, dim, args, n.specs[1].placements),
                                mesh=mesh, donate=n.params.get("donate", False))
        return _caused(run, n.cause) if n.cause else run
    if n.name in ("fused", "fused_rows"):
        return GroupKernel(n, kernels_layer.members(n))
    compiler_ops = {"adamw_group": adamw_group, "adamw_part": fusion.adamw_part,
                    "bucket_part": collectives.bucket_part, "wait": collectives.bucket_wait,
                    "add_at": simplify.add_at, "sum_of_products": simplify.sum_of_products}
    if n.name in compiler_ops:
        return compiler_ops[n.name]
    op = OPS[n.name]
    if n.variant == "impl":
        return op.impl
    return functools.partial(op.local, in_blocks=n.blocks[0], out_block=n.blocks[1])


def _caused(run, cause: dict):
    """``run`` reporting the cause its collective was traced under (module, op, placements)
    to the flight recorder and the debugging tools (dtensor/observe.py)."""
    def caused(*args, **kwargs):
        saved = dict(observe.CAUSE)
        observe.CAUSE.update(cause)
        try:
            return run(*args, **kwargs)
        finally:
            observe.CAUSE.clear()
            observe.CAUSE.update(saved)
    return caused


def generate(graph: Graph, name: str, kernels: dict) -> tuple[str, dict]:
    """Source of ``def run(I, S, F, K, B)`` and the tables it reads: F (callables), K (params
    and constants), B (the memory plan's buffers). I: input arrays in graph.inputs order; S:
    this call's slot values; ``kernels``: the backend's kernels by node id."""
    tables: dict = {"F": [], "K": []}

    def const(value) -> str:
        tables["K"].append(value)
        return f"K[{len(tables['K']) - 1}]"

    last_use: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.inputs:
            if isinstance(a, Node):
                last_use[a.id] = i
    outputs = {o.id for o in graph.outputs if isinstance(o, Node)}

    def ref(a) -> str:
        if isinstance(a, Node):
            return f"v{a.id}"
        return const(a)

    lines = [f"# dtensor.compile: {name} ({len(graph.nodes)} nodes, numpy backend)",
             "def run(I, S, F, K, B):"]
    if graph.inputs:
        lines.append("    " + "".join(f"v{n.id}, " for n in graph.inputs) + "= I")
    for i, n in enumerate(graph.nodes):
        tables["F"].append(runner(n, kernels))
        if n.id in kernels:
            params = kernels[n.id].bind(n.params)
        elif n.name in ("fused", "fused_rows"):  # its params describe it; it takes its keys
            params = {k: v for k, v in n.params.items() if isinstance(v, Slot)}
        else:
            params = n.params
        fixed = {k: v for k, v in params.items() if not isinstance(v, Slot)}
        slots = {k: v for k, v in params.items() if isinstance(v, Slot)}
        args = [ref(a) for a in n.inputs]
        if fixed and n.kind in ("op", *KERNEL_KINDS):
            args.append(f"**{const(fixed)}")
        args += [f"{k}=S[{v.index}]" + (f"[{v.name!r}]" if v.name != "key" else "")
                 for k, v in slots.items()]
        if n.buffer is not None:
            args.append(f"out=B[{n.buffer}]")
        view = _VIEWS.get(n.name) if n.kind == "op" and n.variant == "impl" else None
        if view is not None and n.id not in kernels and not slots and n.buffer is None:
            # a view, spelled as numpy's method: cheaper than through the impl's keywords,
            # and a step holds hundreds (the profiler's table skips these calls)
            call = f"{ref(n.inputs[0])}{view[0]}{const(view[1](fixed))}{view[2]}"
        else:
            call = f"F[{len(tables['F']) - 1}]({', '.join(args)})"
        lines.append(f"    v{n.id} = {call}  # {n.name} {n.shape} {n.dtype}")
        dead = [a.id for a in n.inputs if isinstance(a, Node) and last_use.get(a.id) == i
                and a.id not in outputs]
        if dead:
            lines.append("    del " + ", ".join(f"v{d}" for d in sorted(set(dead))))
    lines.append("    return (" + "".join(f"{ref(o)}, " for o in graph.outputs) + ")")
    return "\n".join(lines) + "\n", tables


def import_source(source: str, prefix: str):
    """Write generated source to the compile cache under its hash and import it; returns
    (module, path). Tracebacks through it show the generated lines.

    A file already there is used only if it holds exactly ``source``; a truncated or foreign
    one is rewritten. The module runs the source checked here, compiled from memory: importing
    the file would read it again and could take a stale ``__pycache__`` entry instead."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"dtensor_{prefix}_{digest}"
    path = os.path.join(cache.cache_dir(), f"{prefix}_{digest}.py")
    if cache.read_or_none(path) != source.encode():
        cache.write_atomic(path, source.encode())
    mod = sys.modules.get(mod_name)
    if mod is None:
        mod = sys.modules[mod_name] = types.ModuleType(mod_name)  # as import: in, then run
        mod.__file__ = path
        try:
            exec(compile(source, path, "exec"), mod.__dict__)
        except BaseException:
            del sys.modules[mod_name]
            raise
    return mod, path


def load(source: str):
    """The generated graph function ``run`` and its file."""
    mod, path = import_source(source, "dtc")
    return mod.run, path


def adamw_group(*arrays, sizes, each=(), out=None, in_place=False, **hp):
    """The AdamW update of several parameters (inputs p, g, m, v of each in turn) into one
    (3, total) array: parameter j's new value, m and v are columns offset_j: offset_j + size_j.
    Hyperparameters named in ``each`` come per parameter, as ``name_j``. ``in_place``: into
    the array p, m and v are views of, if they are (update_target)."""
    from dtensor.ops.nn import adamw_update
    if out is None:
        out = update_target(arrays, sizes, in_place)
    shared = {k: v for k, v in hp.items() if k in ADAMW_HYPERPARAMETERS}
    offset = 0
    for j, size in enumerate(sizes):
        own = {k: hp[f"{k}_{j}"] for k in each}
        adamw_update(*arrays[4 * j:4 * j + 4], out=out[:, offset:offset + size], **shared, **own)
        offset += size
    return out


adamw_group.accepts_out = True


def update_target(arrays, sizes, in_place: bool, addresses=None) -> np.ndarray:
    """Where an adamw_group writes: the (3, total) array its parameters and moments are views
    of at their own columns (the last step's result, when the memory plan allows it in place:
    each element is read before it is written, at the same place), else a new one.
    ``addresses``: the arrays' first bytes (kernels.address), when the caller has them."""
    total, dtype = sum(sizes), arrays[0].dtype
    if in_place and arrays:
        base = arrays[0]
        while base.base is not None:
            base = base.base
        if isinstance(base, np.ndarray) and base.shape == (3, total) and base.dtype == dtype:
            pmv = [arrays[4 * j + r] for j in range(len(sizes)) for r in (0, 2, 3)]
            starts = np.cumsum((0,) + tuple(sizes[:-1]))
            want = (starts[:, None] + np.arange(3) * total) * dtype.itemsize
            if (all(a.flags.c_contiguous and a.dtype == dtype for a in pmv)
                    and [a.size for a in pmv] == [n for n in sizes for _ in range(3)]
                    and np.array_equal(
                        [kernels_layer.address(a) for a in pmv] if addresses is None
                        else np.reshape(addresses, (-1, 4))[:, [0, 2, 3]].ravel(),
                        kernels_layer.address(base) + want.ravel())):
                return base
    return np.empty((3, total), dtype)


def adamw_table(hp: dict, count: int, dtype) -> np.ndarray:
    """(count, 7) constants (dtensor.ops.nn.adamw_constants) of an adamw_group's parameters,
    from hyperparameters shared (as given) or per parameter (named in ``each``: ``name_j``).
    Python numbers: computed for all parameters at once, over float64 arrays of the
    per-parameter ones (the same operations); numpy scalars, whose arithmetic is their own
    type's: each parameter's call, as eager makes it."""
    from dtensor.ops.nn import adamw_constants
    shared = {k: hp[k] for k in ADAMW_HYPERPARAMETERS if k in hp}
    each = {k: [hp[f"{k}_{j}"] for j in range(count)] for k in ADAMW_HYPERPARAMETERS
            if k not in hp}
    if all(type(v) in (float, int) for v in [*shared.values(), *itertools.chain(*each.values())]):
        table = np.empty((count, 7), np.float64)
        table[...] = np.stack(np.broadcast_arrays(*adamw_constants(
            **shared, **{k: np.array(v, np.float64) for k, v in each.items()})), axis=-1)
    else:
        table = np.array([adamw_constants(**shared, **{k: v[j] for k, v in each.items()})
                          for j in range(count)], np.float64)
    return table.astype(dtype)


ADAMW_HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay", "bc1", "bc2")


_UFUNCS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
           "pow": np.power, "maximum": np.maximum, "minimum": np.minimum, "lt": np.less,
           "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
           "ne": np.not_equal, "neg": np.negative, "not": np.logical_not, "abs": np.abs,
           "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "sin": np.sin,
           "cos": np.cos}


class GroupKernel(kernels_layer.Kernel):
    """A fused group (pointwise ops, row reductions, draws over the same rows) rendered as
    numpy calls over cache-sized blocks of rows: each block goes through every op before the
    next is read, so intermediates stay in cache."""

    def __init__(self, node: Node, found):
        super().__init__(node, found)
        from dtensor import random
        from dtensor.ops import pointwise, structural
        # The ops' own impls where numpy's function differs (where's dtype, float16 sums).
        self.table = {**_UFUNCS, "where": pointwise.where.impl, "rand": random.rand,
                      "randn": random.randn,
                      "rowsum": lambda v: structural.sum.impl(v, axis=1, keepdims=True),
                      "rowmax": lambda v: structural.max.impl(v, axis=1, keepdims=True)}

    def launch(self, arrays, out, keys):
        C, flat = self.C, out.reshape(self.R, self.out_cols)
        views = [np.broadcast_to(a.reshape(shape), self.lead + (
            1 if lay.col_stride == 0 else C,)).reshape(self.R, -1)
            for a, shape, lay in zip(arrays, self.in_shapes, self.inputs)]
        table = self.table

        indexed = self.causal or any(e.prim in ("row", "col") for e in self.nodes)

        def block(lo, hi):
            row, col = (np.arange(lo, hi)[:, None], np.arange(C)[None, :]) if indexed else (0, 0)
            keep = col <= row % self.L if self.causal else None
            v = {}
            for e in self.nodes:
                a = [v[id(x)] for x in e.args]
                p = e.prim
                if p in ("rowsum", "rowmax"):
                    full = np.broadcast_to(a[0], (hi - lo, C))
                    if keep is not None:
                        full = np.where(keep, full, 0 if p == "rowsum" else -np.inf)
                    r = table[p](full)
                elif p in ("rand", "randn"):
                    r = table[p](keys[e.attr], np.broadcast_to(a[0], (hi - lo, C)))
                else:
                    r = (views[e.attr][lo:hi] if p == "in" else self.literal(e.attr)
                         if p == "const" else row if p == "row" else col if p == "col"
                         else C if p == "cols" else np.asarray(a[0]).astype(e.attr)
                         if p == "cast" else table[p](*a))
                v[id(e)] = r
            r = v[id(self.root)]
            flat[lo:hi] = np.where(keep, r, 0) if keep is not None else r

        with np.errstate(all="ignore"):  # as the generated kernels: no warnings
            blockwise.run_rows(block, self.R, C * self.dtype.itemsize)
