"""``dtensor.compile(fn)``: trace once per input signature, run generated code after.

``fn`` is a Module (its forward) or a function such as a whole train step; the modules and
optimizers it reaches through its closure and globals are found and their parameters, gradients
and optimizer state become graph inputs and outputs, updated in place after each call exactly as
eager updates them. The pipeline (DTENSOR_DEBUG=2 prints the graph after each step, =3 the
generated code, on rank 0):

    trace (dtensor/tracer.py) -> dce -> cse -> fold_scatter_adds -> fold_product_sums
    -> [merge_matmuls] -> bucket_all_reduces -> fuse_pointwise -> fuse_adamw
    -> [C or Triton kernels for fused groups and row-wise ops] -> plan_memory -> numpy codegen

Example:
    >>> @dtensor.compile
    ... def train_step(x, y):
    ...     _, loss = model(x, y)
    ...     loss.backward(); opt.step(); opt.zero_grad()
    ...     return loss
    >>> train_step(x, y).item()
"""
from __future__ import annotations

import contextlib
import importlib
import os
import time
import warnings

import numpy as np

from dtensor import debug, observe
from dtensor.compile import guards, numpy_backend, passes
from dtensor.tensor import Tensor, TensorMethods
from dtensor.tracer import Traced, Tracer, TracingError

__all__ = ["compile", "Compiled", "TracingError", "RecompileWarning"]

# (name, pass, whether it runs only where kernels are generated: the numpy backend runs
# eager's own kernels and GEMMs, bit for bit)
PASSES = (("shard_broadcasts", passes.shard_broadcasts, False), ("dce", passes.dce, False),
          ("cse", passes.cse, False), ("fold_scatter_adds", passes.fold_scatter_adds, False),
          ("fold_product_sums", passes.fold_product_sums, False),
          ("merge_matmuls", passes.merge_matmuls, True),
          ("bucket_all_reduces", passes.bucket_all_reduces, False),
          ("fuse_pointwise", passes.fuse_pointwise, False),
          ("fuse_adamw", passes.fuse_adamw, False), ("plan_memory", passes.plan_memory, False))
RECOMPILE_LIMIT = 8  # warn on every compile past this many of one function (as torch._dynamo)
BACKENDS = ("numpy", "c", "triton")


def _debug_level() -> int:
    try:
        return int(os.environ.get("DTENSOR_DEBUG", "0") or 0)
    except ValueError:
        return 0


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


# ----------------------------------------------------------------------------- what fn touches

def _reachable(fn) -> list:
    """Objects fn names through its closure, its globals and (for a bound method) its self,
    and the attributes of those objects (``self.model``, ``trainer.opt``)."""
    from dtensor.nn.module import Module
    from dtensor.optim import Optimizer
    if isinstance(fn, Module):
        return [fn]
    objs = []
    if getattr(fn, "__self__", None) is not None:
        objs.append(fn.__self__)
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):
            objs.append(cell.cell_contents)
    if code is not None:
        g = fn.__globals__
        objs += [g[n] for n in code.co_names if n in g]
    for o in list(objs):
        if not isinstance(o, (Module, Optimizer, type)) and hasattr(o, "__dict__"):
            objs += [v for v in vars(o).values() if isinstance(v, (Module, Optimizer))]
    return objs


class _Env:
    """The modules, optimizers and parameters a call reaches, in a fixed order."""

    def __init__(self, fn):
        from dtensor.nn.module import Module
        from dtensor.optim import Optimizer
        objs = _reachable(fn)
        self.modules = [o for o in objs if isinstance(o, Module)]
        self.optimizers = [o for o in objs if isinstance(o, Optimizer)]
        params, seen = [], set()
        for m in self.modules:
            for _, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        self.params = params


def _is_dtensor(t) -> bool:
    return isinstance(t, TensorMethods) and t.is_distributed


def _data(t):
    return t._loc() if _is_dtensor(t) else t.data


def _set_data(t, arr) -> None:
    if _is_dtensor(t):
        t._set_local(arr)
    else:
        t.data = arr


def _sig(x):
    """What about a value makes a different graph. (Dtypes as themselves: str(dtype) took 2.6
    us, and a standard step's key reads ~140 of them on every call.)"""
    if _is_dtensor(x):
        s = x._spec
        return ("dtensor", s.shape, s.dtype, s.placements, s.mesh, x.requires_grad)
    if hasattr(x, "data") and isinstance(getattr(x, "data"), np.ndarray):
        return ("tensor", x.data.shape, x.data.dtype, x.requires_grad)
    if isinstance(x, np.ndarray):
        return ("array", x.shape, x.dtype)
    try:
        hash(x)
        return ("value", x)
    except TypeError:  # a container: its contents are guarded (guards.py)
        return ("object", type(x).__name__)


def _key(env: _Env, args, kwargs):
    state = []
    for opt in env.optimizers:
        for group in opt.param_groups:
            hyper = tuple(sorted((k, v) for k, v in group.items()
                                 if k != "params" and k not in opt.dynamic_hyperparameters))
            state.append(("group", hyper))
            for p in group["params"]:
                st = opt.state.get(p, {})
                state.append(tuple(sorted((k, _sig(v) if hasattr(v, "shape") else "py")
                                          for k, v in st.items())))
    return (("args", tuple(_sig(a) for a in args)),
            ("kwargs", tuple(sorted((k, _sig(v)) for k, v in kwargs.items()))),
            ("params", tuple(_sig(p) for p in env.params)),
            ("grads", tuple(None if p.grad is None else _sig(p.grad) for p in env.params)),
            ("training", tuple(m.training for m in env.modules)),
            ("optimizer", tuple(state)))


def _diff(old, new) -> str:
    for (name, a), (_, b) in zip(old, new):
        if a != b:
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return f"{name}[{i}] changed from {x} to {y}"
            return f"{name} changed"
    return "unknown"


# ----------------------------------------------------------------------------- tracing

class _Writeback:
    """Where an output goes after a call: a parameter, a gradient, an optimizer state entry,
    or the function's result."""

    def __init__(self, kind, target, key=None, like=None):
        self.kind, self.target, self.key, self.like = kind, target, key, like


def _rebuild(like, arr):
    """A tensor of ``like``'s kind (and DTensor spec) around ``arr``."""
    if _is_dtensor(like):
        from dtensor.dtensor import DTensor
        return DTensor._make(arr, like._spec)
    from dtensor.tensor import Tensor
    return Tensor._wrap(arr)


def _flatten(result, leaves):
    """``result`` with its tensors replaced by indices into ``leaves``."""
    if isinstance(result, TensorMethods):
        leaves.append(result)
        return ("leaf", len(leaves) - 1)
    if isinstance(result, (tuple, list)):
        return (type(result), [_flatten(r, leaves) for r in result])
    if isinstance(result, dict):
        return (dict, {k: _flatten(v, leaves) for k, v in result.items()})
    return ("const", result)


def _unflatten(tree, values):
    tag, body = tree
    if tag == "leaf":
        return values[body]
    if tag == "const":
        return body
    if tag is dict:
        return {k: _unflatten(v, values) for k, v in body.items()}
    return tag(_unflatten(v, values) for v in body)


class _Entry:
    """One compiled graph: its generated code and how to feed and unpack it."""

    def __init__(self, graph, run, path, tables, feeds, writebacks, tree, compile_s, key, reads,
                 kernels):
        self.graph, self.run_fn, self.path, self.tables = graph, run, path, tables
        self.kernels = kernels  # node id -> the backend's kernel
        self.feeds, self.writebacks, self.tree = feeds, writebacks, tree
        self.compile_s = compile_s
        self.key, self.reads = key, reads  # reads: guards.explain's leaves, for messages
        self.buffers = None

    def __call__(self, args, kwargs):
        inputs = [feed(args, kwargs) for feed in self.feeds]
        slots = [make() for make in self.graph.slots]
        if self.buffers is None:  # the memory plan's arena, allocated on the first call
            self.buffers = passes.memory.arena_buffers(self.graph)
        profile = observe.SPANS  # with a profile open, a span for each node
        calls = self.tables["F"] if profile is None else profile.table(self)
        outs = self.run_fn(inputs, slots, calls, self.tables["K"], self.buffers)
        values = []
        for wb, arr in zip(self.writebacks, outs):
            if wb.kind == "result":
                values.append(_rebuild(wb.like, arr) if wb.like is not None else arr)
            elif wb.kind == "param":
                _set_data(wb.target, arr)
            elif wb.kind == "grad":  # None: zero_grad() ran inside
                wb.target.grad = None if arr is None else _rebuild(wb.like, arr)
            elif wb.kind == "state":
                opt, p = wb.target
                opt.state.setdefault(p, {})[wb.key] = _rebuild(wb.like, arr)
        return _unflatten(self.tree, values)


def _trace(fn, env: _Env, args, kwargs, kernels: bool):
    """Run ``fn`` once on traced data; returns (graph, feeds, one write-back per graph output,
    result tree). ``kernels``: the backend renders fused ops as kernels (Tracer)."""
    from dtensor import random
    from dtensor.dtensor import DTensor

    tracer = Tracer(kernels)
    restore_data = []  # (tensor, original array)
    feeds = []

    def traced_input(label, t, feed):
        arr = _data(t)
        tr = tracer.input(label, arr)
        restore_data.append((t, arr))
        _set_data(t, tr)
        feeds.append(feed)
        return tr

    saved_state = {id(opt): (opt, {p: (s, dict(s)) for p, s in opt.state.items()})
                   for opt in env.optimizers}
    saved_grads = [(p, p.grad) for p in env.params]
    saved_stream = random.get_rng_state()

    def trace_arg(a, where):
        if isinstance(a, DTensor):
            tr = Traced(tracer.input(where, a._loc()).node)
            feeds.append(lambda args, kwargs, _w=where: _get(args, kwargs, _w)._loc())
            out = DTensor._make(tr, a._spec)
            out.requires_grad = a.requires_grad
            return out
        if isinstance(a, Tensor) or isinstance(a, np.ndarray):
            arr = a.data if isinstance(a, Tensor) else a
            tr = tracer.input(where, arr)
            feeds.append(lambda args, kwargs, _w=where: _arr(_get(args, kwargs, _w)))
            out = Tensor._wrap(tr)
            out.requires_grad = isinstance(a, Tensor) and a.requires_grad
            return out
        return a

    # module paths on, so each collective of the graph keeps its module (dtensor.debug)
    with tracer, _patched_slots(tracer), debug.tracking():
        try:
            for i, p in enumerate(env.params):
                traced_input(f"param{i}", p, lambda a, k, _p=p: _data(_p))
                if p.grad is not None:
                    traced_input(f"grad{i}", p.grad, lambda a, k, _p=p: _data(_p.grad))
            for opt in env.optimizers:
                for p, st in opt.state.items():
                    for k, v in st.items():
                        if isinstance(v, TensorMethods):
                            traced_input(f"{type(opt).__name__}.{k}", v,
                                         lambda a, kw, _o=opt, _p=p, _k=k: _data(_o.state[_p][_k]))
            targs = [trace_arg(a, ("arg", i)) for i, a in enumerate(args)]
            tkwargs = {k: trace_arg(v, ("kwarg", k)) for k, v in kwargs.items()}
            result = fn(*targs, **tkwargs)
            leaves = []
            tree = _flatten(result, leaves)
            outputs, writebacks = [], []

            def out(value, wb):
                if type(value) is Traced:
                    outputs.append(value.node)
                else:
                    outputs.append(value)
                writebacks.append(wb)

            for leaf in leaves:
                d = _data(leaf)
                out(d, _Writeback("result", None, like=leaf))
            for p in env.params:
                d = _data(p)
                if type(d) is Traced and d.node.kind != "input":
                    out(d, _Writeback("param", p))
            for p in env.params:
                out(None if p.grad is None else _data(p.grad),
                    _Writeback("grad", p, like=p.grad))
            for opt in env.optimizers:
                for p, st in opt.state.items():
                    for k, v in st.items():
                        if isinstance(v, TensorMethods):
                            out(_data(v), _Writeback("state", (opt, p), key=k, like=v))
        finally:
            for t, arr in restore_data:
                _set_data(t, arr)
            for opt, states in saved_state.values():
                opt.state.clear()
                for p, (inner, contents) in states.items():
                    inner.clear()
                    inner.update(contents)
                    opt.state[p] = inner
            for p, g in saved_grads:
                p.grad = g
            random.set_rng_state(saved_stream)
    graph = tracer.graph
    graph.outputs = outputs
    return graph, feeds, writebacks, tree


def _get(args, kwargs, where):
    kind, k = where
    return args[k] if kind == "arg" else kwargs[k]


def _arr(a):
    return a.data if hasattr(a, "data") and isinstance(a.data, np.ndarray) else np.asarray(a)


@contextlib.contextmanager
def _patched_slots(tracer: Tracer):
    """Random keys and optimizer scalars become slots, recomputed on every call."""
    from dtensor import random
    from dtensor.optim import optimizers

    real_next_key = random.next_key

    def next_key():
        real_next_key()  # advance as eager would (restored after tracing)
        return tracer.slot("key", real_next_key)

    def scalars(make):
        values = make()  # the step count advances at trace time too (restored after)
        i = tracer.slot("scalars", make).index
        from dtensor.graph import Slot
        return {k: Slot(i, k) for k in values}

    random.next_key = next_key
    prev = optimizers.set_scalar_hook(scalars)
    try:
        yield
    finally:
        random.next_key = real_next_key
        optimizers.set_scalar_hook(prev)


# ----------------------------------------------------------------------------- compile

class RecompileWarning(UserWarning):
    """A compiled function compiled more than ``RECOMPILE_LIMIT`` times."""


class Compiled:
    """A compiled function: call it as the original. ``.graphs`` holds the compiled graphs,
    ``.compiles`` how many times it traced, ``.last`` the entry that ran last.

    A graph is looked up by the input signature (shapes, dtypes, placements, mesh) and by the
    fingerprint of every other Python value the trace baked in (compile/guards.py): a changed
    global, closure cell, module attribute or argument container recompiles."""

    def __init__(self, fn, backend: str = "numpy"):
        self.fn, self.backend = fn, backend
        self._cache: dict = {}
        self.compiles = 0
        self.last = None
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    @property
    def graphs(self):
        return [e.graph for e in self._cache.values()]

    def __call__(self, *args, **kwargs):
        profile = observe.SPANS
        if profile is None:
            return self._call(args, kwargs)
        with profile.span(f"compiled {self.__name__}", "compiled"):  # lookup, feeds, graph
            return self._call(args, kwargs)

    def _call(self, args, kwargs):
        env = _Env(self.fn)
        for opt in env.optimizers:  # what eager step() checks (a scheduler's lr) on every call
            opt._check_step()
        params = frozenset(map(id, env.params))
        key = (_key(env, args, kwargs), guards.fingerprint(self.fn, args, kwargs, params))
        entry = self._cache.get(key)
        if entry is None:
            reads = guards.explain(self.fn, args, kwargs, params)
            if self.compiles >= RECOMPILE_LIMIT:
                warnings.warn(f"dtensor.compile: {self.__name__!r} compiled "
                              f"{self.compiles + 1} times (more than RECOMPILE_LIMIT = "
                              f"{RECOMPILE_LIMIT}); this time because "
                              f"{self._why(key, reads)}. A value that changes on every call "
                              f"recompiles on every call: pad changing shapes to fixed ones, and "
                              f"pass a changing number as a tensor argument.",
                              RecompileWarning, stacklevel=2)
            entry = self._compile(env, args, kwargs, key, reads)
            self._cache[key] = entry
        if self.last is not None and self.last is not entry:
            self.last.buffers = None  # another graph runs now; reallocated if it runs again
        self.last = entry
        return entry(args, kwargs)

    def _why(self, key, reads) -> str:
        last = self.last
        if last.key[0] != key[0]:
            return _diff(last.key[0], key[0])
        return guards.first_change(last.reads, reads)

    def _compile(self, env, args, kwargs, key, reads) -> _Entry:
        t0 = time.perf_counter()
        fn = self.fn
        graph, feeds, writebacks, tree = _trace(fn, env, args, kwargs,
                                                 self.backend != "numpy")
        params = frozenset(map(id, env.params))
        if guards.fingerprint(fn, args, kwargs, params) != key[1]:
            change = guards.first_change(reads, guards.explain(fn, args, kwargs, params))
            raise TracingError(
                f"dtensor.compile: {self.__name__!r} changes a value it reads while it runs: "
                f"{change}. A compiled function replays only its tensor work, so that change "
                f"would happen once, at trace time. Keep such state outside the compiled "
                f"function, or return it.")
        debug = _debug_level() >= 2 and _rank0()
        if debug:
            print(f"[dtensor.compile] {self.__name__}: traced\n{graph}", flush=True)
        kernels, generated = {}, self.backend != "numpy"
        for name, p, generated_only in PASSES:
            if generated_only and not generated:
                continue
            if name == "plan_memory" and generated:
                lower = importlib.import_module(f"dtensor.compile.{self.backend}_backend")
                for node, k in lower.lower_graph(graph):
                    kernels[node.id] = k
                    if _debug_level() >= 3 and _rank0():
                        print(f"[dtensor.compile] {self.backend} kernel for %{node.id} "
                              f"{node.name}\n{k.source}", flush=True)
            # a row-wise op joins row groups only where kernels are generated, likewise
            graph = p(graph, row_ops=generated) if name == "fuse_pointwise" else p(graph)
            if debug:
                print(f"[dtensor.compile] after {name}\n{graph}", flush=True)
        source, tables = numpy_backend.generate(graph, self.__name__, kernels)
        run, path = numpy_backend.load(source)
        if _debug_level() >= 3 and _rank0():
            print(f"[dtensor.compile] generated {path}\n{source}", flush=True)
        self.compiles += 1
        return _Entry(graph, run, path, tables, feeds, writebacks, tree,
                      time.perf_counter() - t0, key, reads, kernels)


def compile(fn=None, *, backend: str = "numpy"):
    """Compile a Module or a function (a whole train step included); see the module docstring.

    Usable as ``dtensor.compile(fn)`` or as a decorator ``@dtensor.compile``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"dtensor.compile: unknown backend {backend!r}; choose 'numpy' (the "
                         f"default: generated Python over numpy kernels), 'c' (generated C, "
                         f"built with the system C compiler) or 'triton' (generated Triton "
                         f"kernels; on CPU under the Triton interpreter, for verification).")
    if fn is None:
        return lambda f: Compiled(f, backend)
    if not callable(fn):
        raise TypeError(f"dtensor.compile takes a function or a Module, got "
                        f"{type(fn).__name__}.")
    return Compiled(fn, backend)

