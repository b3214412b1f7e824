"""A tensor-parallel plan found from what a model computes, not from its names.

``plan(model, mesh, example_inputs)`` traces the forward once at the example's shapes (with
dtensor.compile's tracer, in this process, no communication) and reads Megatron's building
blocks off the graph:

* **chains**: Linear layers whose outputs, split by columns, stay split through everything up
  to the Linear layers that consume them (pointwise ops, activations and gated products, head
  reshapes and transposes, rotary embeddings, attention, GQA groups). The first ones are
  column-parallel, the last row-parallel, and nothing in between communicates. A chain is grown
  by sharding-rule propagation (``dtensor.sharding.propagate``, the rules the DTensor
  interpreter runs): seed one Linear's output as ``Shard(-1)``, follow it; where an op would cut
  another Linear's output (attention's keys against its queries), that Linear joins the column
  side, or, if it cannot (key/value heads that do not split evenly), stays whole and is sliced
  locally; where an op would need the split data gathered, the chain is refused. A Linear
  whose output is sliced into k equal parts (a fused [q | k | v] projection) is seeded again as
  ``StridedShard(-1, k)``: each part is split, so slicing one out moves nothing.
* **vocabulary tables**: an Embedding indexed by the model's input is vocab-parallel. One
  indexed by positions the model computes itself stays replicated (as Megatron keeps
  position tables).
* **the head**: a Linear whose split output reaches only the loss (or the model's output) is
  column-parallel with the vocab-parallel cross-entropy (``loss_parallel``); without it, its
  output is gathered.
* **the stream** between chains: replicated, or sequence-parallel (``Shard(1)``) under
  ``sequence_parallel=True``.

Each chain input gets one conversion point (the smallest module that takes it as an argument,
else the module that produced it), so its consumers share one gradient reduction, as in the
hand-written plans. The result is a plan of parallel styles applied by ``parallelize_module``'s
machinery; every collective is then inserted by the sharding rules, and the single-process run
stays the reference. Anything the planner cannot split stays replicated and the explanation
says why.

Prices are bytes per rank per step in ``dtensor.comm.count_collectives``'s convention
(all-reduce and reduce-scatter: input bytes, all-gather: gathered bytes), one collective per
tensor; tests compare them with the collectives a real run issues.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from dtensor import random
from dtensor.mesh import DeviceMesh
from dtensor.nn.layers import Embedding, Linear
from dtensor.nn.module import Module
from dtensor.parallel.style import ParallelStyle
from dtensor.placements import Partial, Replicate, Shard, StridedShard
from dtensor.tensor import Tensor, TensorMethods
from dtensor.tracer import Traced, Tracer

__all__ = ["plan", "Plan"]

R = Replicate()
# Ops a value passes through unchanged in content (the head's logits may be reshaped on the way
# to the loss or the model's output).
_RESHAPES = ("reshape", "permute", "squeeze", "expand_dims", "contiguous", "cast")


# ----------------------------------------------------------------------------- tracing

@dataclass(eq=False)
class _Call:
    """One call of a module during the traced forward."""

    path: str
    module: Module
    args: list  # graph node (or None) per positional argument
    out: object  # graph node, or None (a tuple or a non-tensor)
    start: int  # nodes created during the call have ids in [start, end)
    end: int = -1


def _node(x):
    data = getattr(x, "data", x)
    return data.node if type(data) is Traced else None


def _leaves(result) -> list:
    """The tensors in a forward's result (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(result, TensorMethods):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _leaves(r)]
    if isinstance(result, dict):
        return [t for r in result.values() for t in _leaves(r)]
    return []


def _trace(model: Module, example_inputs):
    """(graph, calls, output nodes) of one forward of ``model`` under the tracer, with each
    module call recorded and each parameter an input labelled by its path. The parameters and
    the random stream are as they were after."""
    calls: list[_Call] = []
    stack: list[_Call] = []
    tracer = Tracer()

    def pre(mod, args, path):
        call = _Call(path, mod, [_node(a) for a in args], None, tracer.graph._next)
        stack.append(call)
        calls.append(call)

    def post(mod, args, out):
        call = stack.pop()
        call.out, call.end = _node(out), tracer.graph._next

    def traced(i, a):
        if isinstance(a, (Tensor, np.ndarray)):
            arr = a.data if isinstance(a, Tensor) else a
            out = Tensor._wrap(tracer.input(f"arg{i}", arr))
            out.requires_grad = isinstance(a, Tensor) and a.requires_grad
            return out
        return a

    modules = list(model.named_modules())
    for path, m in modules:
        # first pre-hook and last post-hook: the call as the module's own forward sees it
        m._forward_pre_hooks = {-1: lambda mod, args, _p=path: pre(mod, args, _p),
                                **m._forward_pre_hooks}
        m._forward_hooks[-1] = post
    saved = [(p, p.data) for _, p in model.named_parameters()]
    rng = random.get_rng_state()
    args, kwargs = example_inputs
    try:
        with tracer:
            for (path, _), (p, arr) in zip(model.named_parameters(), saved):
                p.data = tracer.input(path, arr)
            result = model(*[traced(i, a) for i, a in enumerate(args)],
                           **{k: traced(k, v) for k, v in kwargs.items()})
    finally:
        for p, arr in saved:
            p.data = arr
        for _, m in modules:
            m._forward_pre_hooks.pop(-1, None)
            m._forward_hooks.pop(-1, None)
        random.set_rng_state(rng)
    outputs = [n for n in map(_node, _leaves(result)) if n is not None]
    return tracer.graph, calls, outputs


# ----------------------------------------------------------------------------- the walk

class _Break(Exception):
    """A chain that cannot stay split: why, in words."""


class _Parts(_Break):
    """A split value sliced into ``parts`` equal parts along its split dim."""

    def __init__(self, value, parts: int, why: str):
        super().__init__(why)
        self.value, self.parts = value, parts


_MESH1 = {}


def _mesh1(n: int):
    """What ``propagate`` reads of a mesh: one dim of ``n`` ranks."""
    return _MESH1.setdefault(n, SimpleNamespace(ndim=1, shape=(n,)))


class _Graph:
    """The traced forward with what the planner asks of it."""

    def __init__(self, graph, calls, outputs):
        from dtensor.ops.registry import OPS
        self.graph, self.calls, self.outputs = graph, calls, set(id(n) for n in outputs)
        self.ops = OPS
        self.index = {n.id: i for i, n in enumerate(graph.nodes)}
        self.users = graph.users()
        self.linears = [c for c in calls if isinstance(c.module, Linear)]
        self.tables = [c for c in calls if isinstance(c.module, Embedding)]
        # nodes inside a Linear or Embedding call: the layer's own ops (the style handles them)
        self.inside: dict[int, _Call] = {}
        for c in self.linears + self.tables:
            for i in range(c.start, c.end):
                self.inside[i] = c
        self.cache: dict = {}
        # graph inputs that are parameters (labelled by path), not the batch or gradients
        paths = {name for c in calls[:1] for name, _ in c.module.named_parameters()}
        self.params = {n.id: n for n in graph.inputs if n.name in paths}
        self.last_use = {k: max(self.index[u.id] for u in us) for k, us in self.users.items()}
        self.made_by = {}  # node id -> the Linear call whose output it is
        for c in self.linears:
            if c.out is not None:
                self.made_by[c.out.id] = c

    def walk(self, cols: set, tp: int, parts: dict | None = None):
        """Propagate Shard(-1) from the outputs of the Linear modules ``cols`` (StridedShard(-1,
        k) from those ``parts`` maps to k).

        Returns (rows, heads, sliced, place): the Linear modules that take the split value as
        their input (row-parallel), the kinds of head exits reached ("loss", "output"), the
        values an op cut locally from whole ones, and each split value's placement. Raises
        _Break with the reason."""
        place: dict[int, object] = {}
        seeds = [c for c in self.linears if id(c.module) in cols]
        for c in seeds:
            if c.out is None:
                raise _Break(f"{c.path} returns no single tensor")
            k = (parts or {}).get(id(c.module), 1)
            if c.module.out_features // k < tp:
                raise _Break(f"{c.path} has {c.module.out_features // k} output features"
                             f"{' per part' if k > 1 else ''}, fewer than the {tp} ranks")
            last = len(c.out.shape) - 1
            place[c.out.id] = StridedShard(last, k) if k > 1 else Shard(last)
        rows, heads, sliced = {}, set(), []
        start = min(self.index.get(c.out.id, 0) for c in seeds)
        # the walk ends past the last use of a split value
        horizon = max(self.last_use.get(c.out.id, -1) for c in seeds)
        for node in self.graph.nodes[start:]:
            if self.index[node.id] > horizon:
                break
            call = self.inside.get(node.id)
            if call is not None:
                if node.id == call.start and call.args and call.args[0] is not None:
                    p = place.get(call.args[0].id, R)
                    if p != R:
                        x = call.args[0]
                        if isinstance(call.module, Linear) and p == Shard(len(x.shape) - 1) \
                                and id(call.module) not in cols \
                                and call.module.in_features >= tp:
                            rows[id(call.module)] = call.module
                        else:
                            raise _Break(f"{call.path} ({type(call.module).__name__}) takes the "
                                         f"split value laid out {p}")
                continue
            ins = [place.get(a.id, R) if hasattr(a, "id") else None for a in node.inputs]
            if all(p is None or p == R for p in ins):
                continue
            if node.kind != "op":
                raise _Break(f"%{node.id} {node.name}")
            if node.name == "softmax_cross_entropy":
                if ins[0] == Shard(len(node.inputs[0].shape) - 1):
                    heads.add("loss")  # vocab-parallel under loss_parallel
                    continue
                raise _Break(f"the loss reads the split logits laid out {ins[0]}")
            st = self.propagate(node, ins, tp)
            for a, cur, need in zip(node.inputs, ins, st.inputs):
                if need is None or cur is None or need[0] == cur:
                    continue
                if cur != R:
                    k = _parts(node, cur)
                    if k:
                        raise _Parts(a, k, f"its output is cut into {k} parts along the split "
                                           f"features and read part by part")
                    raise _Break(self._pieces_message(a, cur) or
                                 f"{node.name} needs the split value {cur} moved to {need[0]}")
                if isinstance(need[0], Shard):
                    sliced.append(a)
            out = st.out[0]
            if out != R:
                place[node.id] = out
                horizon = max(horizon, self.last_use.get(node.id, -1))
                if id(node) in self.outputs:
                    if out != Shard(len(node.shape) - 1):
                        raise _Break(f"the model returns the split value laid out {out}")
                    heads.add("output")
            if isinstance(out, Partial):
                raise _Break(f"{node.name} sums over the split features")
        heads |= {"output" for c in seeds if id(c.out) in self.outputs}
        return rows, heads, sliced, place

    def _pieces_message(self, value, cur) -> str | None:
        """Why a value sliced into pieces along its split dim cannot be split piece by piece
        (a fused [q | k | v] with narrower k and v), or None."""
        if not isinstance(cur, (Shard, StridedShard)):
            return None
        cuts = []
        for u in self.users.get(value.id, []):
            key = [k for k in u.params["key"] if k is not None] if u.name == "getitem" else []
            if len(key) > cur.dim and isinstance(key[cur.dim], tuple):
                cuts.append(key[cur.dim])
        widths = tuple(stop - start for start, stop, _ in sorted(cuts))
        if len(set(widths)) < 2:
            return None
        return (f"its output is sliced along the split features into pieces of unequal widths "
                f"{widths}; a strided shard splits equal parts only")

    def propagate(self, node, ins, tp: int):
        """The sharding rule's strategy for ``node`` with inputs laid out ``ins`` on one mesh
        dim of ``tp`` ranks (cached: a model's layers repeat the same ops at the same shapes),
        or _Break."""
        from dtensor.ops.registry import Aval
        from dtensor.sharding import propagate
        avals = [Aval(a.shape, a.dtype) if hasattr(a, "id") else a for a in node.inputs]
        try:
            key = (node.name, tuple(avals), tuple(sorted(node.params.items())), tuple(ins), tp)
            hash(key)
        except TypeError:
            key = None
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            try:
                hit = propagate(self.ops[node.name], avals, node.params,
                                [None if p is None else (p,) for p in ins],
                                Aval(node.shape, node.dtype), _mesh1(tp))
            except (ValueError, NotImplementedError) as e:  # the rule's own words, short
                hit = _Break(str(e).splitlines()[0].split(": ")[0].split(". ")[0])
            if key is not None:
                self.cache[key] = hit
        if isinstance(hit, _Break):
            raise hit
        return hit

    def sources(self, node) -> set:
        """The Linear calls whose outputs ``node`` is computed from, through ops only."""
        out, todo, seen = set(), [node], set()
        while todo:
            n = todo.pop()
            if not hasattr(n, "id") or n.id in seen:
                continue
            seen.add(n.id)
            if n.id in self.made_by:
                out.add(self.made_by[n.id])
                continue
            if n.kind == "op" and n.id not in self.inside:
                todo.extend(n.inputs)
        return out


def _parts(node, cur) -> int:
    """k when ``node`` slices one of k equal parts out of a value split along ``cur``'s dim (a
    fused projection's ``.split(C, dim=-1)`` into q, k and v), else 0."""
    from dtensor.sharding import part_of
    if node.name != "getitem" or not isinstance(cur, Shard):
        return 0
    key = [k for k in node.params["key"] if k is not None]
    return part_of(key[cur.dim], node.inputs[0].shape[cur.dim]) if cur.dim < len(key) else 0


# ----------------------------------------------------------------------------- the plan

@dataclass
class _Chain:
    cols: list  # Linear calls' modules, column-parallel
    rows: list
    shared: list  # Linear modules left whole, their outputs sliced locally
    head: str | None = None  # "loss", "output" or "gathered"
    region: set = field(default_factory=set)  # ids of the nodes that carry the split
    why: dict = field(default_factory=dict)  # id of a shared module -> why it stays whole
    parts: dict = field(default_factory=dict)  # id of a column Linear read in k parts -> k


@dataclass
class Plan:
    """A found plan: styles per module path, the reasons, and the collectives they cause.

    ``print(plan)`` explains it; ``plan.apply(model)`` parallelizes ``model`` with it (the
    model it was found for, or another built the same way)."""

    mesh: DeviceMesh
    tp: int | None
    dp: int | None
    styles: dict
    sequence_parallel: bool
    loss_parallel: bool
    fsdp: bool
    rows: list = field(default_factory=list)  # (path, placements text, why)
    collectives: list = field(default_factory=list)  # (where, phase, kind, count, bytes)
    reference: dict | None = None  # kind -> (count, bytes) of the hand plan, if one exists
    reference_name: str = ""
    memory: dict = field(default_factory=dict)
    batch: str = ""
    seconds: float = 0.0

    def totals(self) -> dict:
        """kind -> (count, bytes) per rank per step."""
        return _totals(self.collectives)

    def explain(self) -> str:
        """The explanation ``print(plan)`` shows."""
        return str(self)

    def apply(self, model: Module) -> Module:
        from dtensor.parallel.api import _parallelize
        return _parallelize(model, self.mesh, self.styles, self.dp, self.tp,
                            sequence_parallel=self.sequence_parallel,
                            loss_parallel=self.loss_parallel, fsdp=self.fsdp, explained=self)

    def __str__(self) -> str:
        lines = [f"plan for mesh {self.mesh._dims_text()}: tensor parallel over "
                 f"{self._dim_name(self.tp)}"
                 f"{', sequence parallel' if self.sequence_parallel else ''}"
                 f"{', loss parallel' if self.loss_parallel else ''}; data dim "
                 f"{self._dim_name(self.dp)}"
                 f"{' (fsdp)' if self.fsdp and self.dp is not None else ''}"
                 f"; priced on {self.batch}, found in {self.seconds * 1e3:.0f} ms"]
        width = max([len(p) for p, _, _ in self.rows] + [10])
        for path, where, why in self.rows:
            lines.append(f"  {path:{width}s}  {where:28s} {why}")
        lines.append("collectives per rank per step (count, bytes):")
        shown: dict = {}  # the data dim's, one line per kind: one collective per parameter
        for where, phase, kind, count, nbytes in self.collectives:
            if where.startswith("dp: "):
                where = f"data parallel over {self._dim_name(self.dp)}: parameters"
            c, b = shown.get((where, phase, kind), (0, 0))
            shown[(where, phase, kind)] = (c + count, b + count * nbytes)
        w2 = max([len(w) for w, _, _ in shown] + [10])
        for (where, phase, kind), (count, nbytes) in shown.items():
            lines.append(f"  {where:{w2}s}  {phase:8s} {kind:15s} {count:4d} {nbytes:>12,d} B")
        lines.append("  total: " + _totals_text(self.totals()))
        if self.reference is not None:
            lines.append(f"  {self.reference_name}: " + _totals_text(self.reference))
            ours = sum(b for _, b in self.totals().values())
            ref = sum(b for _, b in self.reference.values())
            lines.append(f"  bytes vs the hand plan: {ours / ref if ref else 1.0:.2f}")
        if self.memory:
            lines.append("memory per rank: " + ", ".join(f"{k} {v:,d} B"
                                                         for k, v in self.memory.items()))
        return "\n".join(lines)

    def _dim_name(self, d) -> str:
        if d is None:
            return "none"
        names = self.mesh.mesh_dim_names
        return f"'{names[d]}' ({self.mesh.size(d)})" if names else f"dim {d} ({self.mesh.size(d)})"


def _totals(collectives) -> dict:
    out: dict = {}
    for _, _, kind, count, nbytes in collectives:
        c, b = out.get(kind, (0, 0))
        out[kind] = (c + count, b + count * nbytes)
    return dict(sorted(out.items()))


def _totals_text(t: dict) -> str:
    if not t:
        return "no collectives"
    return ", ".join(f"{k} {c} ({b:,d} B)" for k, (c, b) in t.items()) + \
        f"; {sum(b for _, b in t.values()):,d} B"


def _nbytes(node) -> int:
    return int(np.prod(node.shape)) * node.dtype.itemsize


def _owner_path(g: _Graph, module) -> str:
    for c in g.calls:
        if c.module is module:
            return c.path
    return "?"


class _Finder:
    """Megatron's building blocks on one traced graph."""

    def __init__(self, g: _Graph, tp: int, loss_parallel: bool):
        self.g, self.tp, self.loss_parallel = g, tp, loss_parallel
        self.chains: list[_Chain] = []
        self.refused: dict[int, str] = {}  # Linear module id -> why it stays whole
        self.taken: set = set()

    def find(self):
        g = self.g
        for c in g.linears:
            key = id(c.module)
            if key in self.taken or key in self.refused:
                continue
            chain = self._grow(c)
            if chain is not None:
                self.chains.append(chain)
                self.taken |= {id(m) for m in chain.cols + chain.rows + chain.shared}
        return self

    def _grow(self, seed: _Call):
        """The chain seeded at ``seed`` (its column side grown to a fixpoint), or None."""
        cols, whole, why, parts = {id(seed.module): seed.module}, {}, {}, {}
        try:
            while True:
                rows, heads, sliced, place = self._walk(set(cols), parts)
                grow = {id(c.module): c.module for a in sliced for c in self.g.sources(a)}
                grow = {k: m for k, m in grow.items() if k not in cols and k not in whole}
                if not grow:
                    break
                for k, m in grow.items():  # one at a time: each must keep the chain valid
                    try:
                        trial = dict(parts)
                        self._walk(set(cols) | {k}, trial)
                        cols[k] = m
                        parts = trial
                    except _Break as e:
                        whole[k] = m
                        why[k] = str(e)
        except _Break as e:
            if len(cols) == 1 and self._head_gathered(seed):
                return _Chain([seed.module], [], [], "gathered")
            self.refused[id(seed.module)] = str(e)
            return None
        if set(rows) & self.taken or set(cols) & self.taken or set(whole) & self.taken:
            self.refused[id(seed.module)] = "it meets a chain planned already"
            return None
        if not rows and not heads:
            self.refused[id(seed.module)] = "its split output reaches no row-parallel Linear"
            return None
        if heads and rows:
            self.refused[id(seed.module)] = "its split output reaches both a Linear and the loss"
            return None
        head = None
        if heads:
            if len(cols) > 1:
                self.refused[id(seed.module)] = ("its split output meets other Linears' on the "
                                                 "way to the loss")
                return None
            head = "loss" if "loss" in heads else "output"
            if not self.loss_parallel:
                return _Chain([seed.module], [], [], "gathered")
        return _Chain(list(cols.values()), list(rows.values()), list(whole.values()), head,
                      set(place), why, parts)

    def _walk(self, cols: set, parts: dict):
        """The walk from ``cols``; a Linear whose output is read in k parts is split part by
        part (``parts`` records it) and the walk tried again."""
        while True:
            try:
                return self.g.walk(cols, self.tp, parts)
            except _Parts as e:
                src = [c for c in self.g.sources(e.value) if id(c.module) in cols]
                if len(src) != 1 or id(src[0].module) in parts:
                    raise
                parts[id(src[0].module)] = e.parts

    def _head_gathered(self, seed: _Call) -> bool:
        """Whether ``seed``'s output reaches only the loss or the model's output, through
        reshapes: the head a column split serves with one gather of its output."""
        todo, g = [seed.out], self.g
        while todo:
            n = todo.pop()
            if id(n) in g.outputs:
                continue
            users = g.users.get(n.id, [])
            if not users:
                return False
            for u in users:
                if u.name == "softmax_cross_entropy" or id(u) in g.outputs:
                    continue
                if u.name not in _RESHAPES:
                    return False
                todo.append(u)
        return True


def _token_table(g: _Graph, call: _Call) -> bool:
    """An Embedding indexed by (a reshape of) a model input: a vocabulary table."""
    n = call.args[0] if call.args else None
    while n is not None and hasattr(n, "id"):
        if n.kind == "input":
            return True
        if n.kind != "op" or n.name not in _RESHAPES:
            return False
        n = n.inputs[0]
    return False


# ----------------------------------------------------------------------------- plan()

def _example(model: Module, example_inputs):
    """(args, kwargs, text) of the batch to plan on; without one, a guess from the first
    layer: token ids for an Embedding, features for a Linear."""
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            args, kwargs = (), dict(example_inputs)
        elif isinstance(example_inputs, (tuple, list)):
            args, kwargs = tuple(example_inputs), {}
        else:
            args, kwargs = (example_inputs,), {}
        shapes = [tuple(np.shape(getattr(a, "data", a))) for a in list(args) + list(kwargs.values())
                  if hasattr(a, "shape")]
        return args, kwargs, f"inputs {', '.join(map(str, shapes))}"
    return None, {}, "a guessed batch"


def _guesses(model: Module):
    """Batches to try when none is given: token ids (for a model that starts with an
    Embedding) or features (a Linear), 2 rows of 8, 4, 2 or 1 positions, as many arguments as
    the forward requires (ids and their targets, say)."""
    import inspect
    first = next((m for _, m in model.named_modules() if isinstance(m, (Embedding, Linear))), None)
    if first is None:
        raise TypeError(f"{type(model).__name__} has no Linear or Embedding layer to plan; "
                        f"parallelize it with replicate() or fully_shard() instead.")
    try:
        need = [q for q in inspect.signature(model.forward).parameters.values()
                if q.default is q.empty and q.kind in (q.POSITIONAL_ONLY,
                                                       q.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        need = [None]
    for t in (8, 4, 2, 1):
        x = (np.zeros((2, t), np.int64) if isinstance(first, Embedding) else
             np.zeros((2, t, first.in_features), first.weight.dtype))
        yield (x,) * max(1, len(need))


def _find_tp_dp(mesh: DeviceMesh):
    from dtensor.parallel.api import _tp_dim
    names = mesh.mesh_dim_names or ()
    if mesh.ndim > 2:
        _tp_dim(mesh, None)  # raises with the fix
    if mesh.ndim == 2 and not {"dp", "tp"} <= set(names):
        raise ValueError(f"parallelize on a 2-D mesh needs dims named 'dp' and 'tp', got "
                         f"{mesh._dims_text()}; use init_device_mesh('cpu', (dp, tp), "
                         f"mesh_dim_names=('dp', 'tp')).")
    dp = mesh._dim("dp") if "dp" in names else None
    tp = None if (mesh.ndim == 1 and dp == 0) else _tp_dim(mesh, None)
    return tp, dp


def plan(model: Module, mesh: DeviceMesh, example_inputs=None, *,
         sequence_parallel: bool = False, loss_parallel: bool = True, fsdp: bool | None = None,
         max_bytes_per_rank: int | None = None) -> Plan:
    """Find a tensor- (and data-) parallel plan for ``model`` on ``mesh`` from its traced
    forward; ``print(plan)`` explains it and ``plan.apply(model)`` applies it.

    Args:
        example_inputs: the forward's arguments (a tuple, a dict of keywords, or one array), the
            global batch; the plan's prices are for this batch. Without it the planner guesses
            a small batch from the first layer.
        sequence_parallel: the residual stream between chains is Shard(1) (sequence shards).
        loss_parallel: the head is column-parallel and cross-entropy runs on vocabulary shards.
        fsdp: on a mesh with a "dp" dim, shard parameters over it (True), keep them whole
            (False), or (None) decide by ``max_bytes_per_rank``: parameters, gradients and two
            Adam moments per rank must fit.
    """
    from dtensor.validate import as_bool
    t0 = time.perf_counter()
    sequence_parallel = as_bool(sequence_parallel, "plan: sequence_parallel")
    loss_parallel = as_bool(loss_parallel, "plan: loss_parallel")
    if fsdp is not None:
        fsdp = as_bool(fsdp, "plan: fsdp")
    tp, dp = _find_tp_dp(mesh)
    if fsdp and dp is None:
        raise ValueError(f"fsdp=True shards parameters over a 'dp' mesh dim, and mesh "
                         f"{mesh._dims_text()} has none; name one 'dp'.")
    args, kwargs, batch = _example(model, example_inputs)
    if args is not None:
        g = _Graph(*_trace(model, (args, kwargs)))
    else:
        error = None
        for args in _guesses(model):
            try:
                g = _Graph(*_trace(model, (args, kwargs)))
                break
            except Exception as e:  # noqa: BLE001 - the next guess, or the error below
                error = error or e
        else:
            raise TypeError(
                f"plan: {type(model).__name__}.forward failed on a guessed batch "
                f"{tuple(args[0].shape)} (and on shorter ones): {type(error).__name__}: "
                f"{str(error).rstrip('.')}. Pass example_inputs=, the arguments of one forward "
                f"(the global batch), e.g. parallelize(model, mesh, example_inputs=(x, y))."
            ) from error
        batch = (f"a guessed batch {', '.join(str(tuple(a.shape)) for a in args)} (pass "
                 f"example_inputs= to price your own)")
    n = mesh.size(tp) if tp is not None else 1
    ndp = mesh.size(dp) if dp is not None else 1
    layout = _Layout(g, n, sequence_parallel, loss_parallel)
    if tp is not None:
        layout.find()
    layout.styles()
    out = Plan(mesh, tp, dp, layout.style, sequence_parallel, loss_parallel, bool(fsdp),
               batch=batch)
    out.rows = layout.rows()
    per_rank = {False: layout.param_bytes_per_rank(1), True: layout.param_bytes_per_rank(ndp)}
    if fsdp is None:
        fsdp = False
        if max_bytes_per_rank is not None and dp is not None:
            fsdp = 4 * per_rank[False] > max_bytes_per_rank
    if max_bytes_per_rank is not None:
        need = 4 * per_rank[bool(fsdp)]
        if need > max_bytes_per_rank:
            raise ValueError(
                f"plan: parameters, gradients and two Adam moments need {need:,d} B per rank "
                f"with this layout{' and fsdp' if fsdp else ''}, over max_bytes_per_rank="
                f"{max_bytes_per_rank:,d}. Use more ranks (a larger 'tp' or 'dp' with fsdp), or "
                f"raise the budget.")
    out.fsdp = bool(fsdp)
    if tp is not None and n > 1:
        out.collectives = layout.price(ndp, out.fsdp)
    if dp is not None and ndp > 1:
        out.collectives += layout.price_dp(ndp, out.fsdp)
    out.memory = {"parameters": per_rank[out.fsdp],
                  "with gradients and Adam moments": 4 * per_rank[out.fsdp]}
    if tp is not None and n > 1:
        ref = _reference(model, n, sequence_parallel, loss_parallel)
        if ref is not None:
            name, styles = ref
            other = _Layout(g, n, sequence_parallel, loss_parallel)
            other.from_styles(model, styles)
            other.styles()
            out.reference = _totals(other.price(ndp, out.fsdp) + (
                other.price_dp(ndp, out.fsdp) if dp is not None and ndp > 1 else []))
            out.reference_name = name
    out.seconds = time.perf_counter() - t0
    return out


def _reference(model: Module, n: int, sp: bool, lp: bool):
    """The hand-written Megatron plan for this model, if it has one: its own ``tp_plan`` (as
    Hugging Face models carry one), ``llama_tp_plan`` for a dtensor.nn.Llama, or ``gpt_plan``
    for dtensor.nn.GPT-shaped models."""
    from dtensor.nn.llama import Llama
    from dtensor.parallel.api import _plan_hits, gpt_plan, llama_tp_plan
    own = getattr(model, "tp_plan", None)
    try:
        if callable(own):
            name, styles = f"{type(model).__name__}.tp_plan", own(n, sequence_parallel=sp,
                                                                  loss_parallel=lp)
        elif isinstance(model, Llama):
            name, styles = "llama_tp_plan", llama_tp_plan(model, n, sequence_parallel=sp,
                                                          loss_parallel=lp)
        else:
            name, styles = "Megatron's plan (gpt_plan)", gpt_plan(sp, lp)
        _plan_hits(model, styles)  # every key names a module of this model
    except (ValueError, TypeError):
        return None
    return name, styles


# ----------------------------------------------------------------------------- layout

class _Both(ParallelStyle):
    """Two styles on one module (a conversion of its input and one of its output)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def apply(self, module, mesh, tp, path):
        self.first.apply(module, mesh, tp, path)
        return self.second.apply(module, mesh, tp, path)

    def __repr__(self) -> str:
        return f"{self.first!r} + {self.second!r}"


_ROLE_TEXT = {
    "col": "Linear weight Shard(0) (output features)",
    "row": "Linear weight Shard(1) (input features)",
    "head": "Linear weight Shard(0), logits Shard(-1)",
    "gathered": "Linear weight Shard(0), logits gathered",
    "vocab": "Embedding weight Shard(0) (vocab rows)",
}


class _Layout:
    """Roles of the layers (from the finder, or read off a hand-written plan), the conversion
    points, the styles that implement them, and their price."""

    def __init__(self, g: _Graph, n: int, sp: bool, lp: bool):
        self.g, self.n, self.sp, self.lp = g, n, sp, lp
        self.role: dict[int, tuple] = {}  # module id -> (module, role, why)
        self.chains: list[_Chain] = []
        self.refused: dict[int, str] = {}
        self.style: dict = {}
        # (value, its consumers, "input" / "output" / None, the module converting it, the
        # output a whole module hands back to the sequence-sharded stream or None)
        self.bounds: list = []
        self.stream = Shard(1) if sp else R
        self.deferred: list = []  # (module call, row calls, parameters whose grads are partial)
        self.partial: set = set()  # ids of the values that stay partial sums inside them
        self.seq: set = set()  # ids of the stream's sequence shards (set by styles())
        self.parts: dict[int, int] = {}  # column Linear read in k parts (StridedShard) -> k

    # -- roles
    def find(self):
        f = _Finder(self.g, self.n, self.lp).find()
        self.chains, self.refused = f.chains, f.refused
        for k, ch in enumerate(self.chains):
            paths = lambda ms: ", ".join(_owner_path(self.g, m) for m in ms)  # noqa: E731
            if ch.head:
                why = {"loss": "the head: its logits go to the loss on vocabulary shards "
                               "(loss_parallel)",
                       "output": "the head: its logits leave the model as vocabulary shards "
                                 "(compute the loss under loss_parallel())",
                       "gathered": "the head: its logits are gathered"}[ch.head]
                self.role[id(ch.cols[0])] = (ch.cols[0], "head" if ch.head != "gathered"
                                             else "gathered", why)
                continue
            self.parts.update(ch.parts)
            for m in ch.cols:
                each = (f"; its output is read in {ch.parts[id(m)]} parts, each split"
                        if id(m) in ch.parts else "")
                self.role[id(m)] = (m, "col", f"chain {k}: column side, split up to "
                                              f"{paths(ch.rows)}{each}")
            for m in ch.rows:
                self.role[id(m)] = (m, "row", f"chain {k}: row side, after {paths(ch.cols)}")
            for m in ch.shared:
                self.role[id(m)] = (m, "shared", f"chain {k}: whole ({ch.why[id(m)]}); its "
                                                 f"output is cut locally where the chain "
                                                 f"meets it")
        for c in self.g.tables:
            if id(c.module) in self.role:
                continue
            if not _token_table(self.g, c):
                self.refused[id(c.module)] = ("indexed by positions the model computes: a small "
                                              "table Megatron keeps whole")
            elif c.module.num_embeddings < self.n:
                self.refused[id(c.module)] = f"fewer rows than the {self.n} ranks"
            else:
                self.role[id(c.module)] = (c.module, "vocab", "vocabulary table indexed by the "
                                                              "model's input: vocab-parallel")
        self._untie_tables()
        self._defer()

    def _defer(self):
        """Row-parallel outputs that a module only adds up (experts weighted by their gates,
        attention and MLP of a parallel block) stay partial sums up to the module's output and
        are reduced once there, not once each."""
        g = self.g
        rows = [c for c in g.linears if self.role.get(id(c.module), (None, None))[1] == "row"]
        seq = self._sequence_sharded()
        calls = []
        for m in g.calls:
            if not m.path or isinstance(m.module, (Linear, Embedding)) or m.out is None:
                continue
            inner = [r for r in rows if m.start <= r.start and r.end <= m.end]
            if len(inner) >= 2:
                calls.append((m, inner))
        calls.sort(key=lambda mr: (-len(mr[1]), mr[0].path.count(".")))
        done: set = set()
        for m, inner in calls:
            if any(id(r) in done for r in inner):
                continue
            found = self._partial_walk(m, inner, seq)
            if found is not None:
                self.deferred.append((m, inner, found[1]))
                self.partial |= found[0]
                done |= {id(r) for r in inner}

    def _partial_walk(self, m: _Call, inner: list, seq: set):
        """(partial value ids, parameters whose gradients become partial) if the row outputs
        ``inner`` reach ``m``'s output as partial sums through linear ops only, else None."""
        g, P = self.g, Partial()
        place = {r.out.id: P for r in inner}
        tainted = []
        for node in g.graph.nodes[g.index[min(r.out.id for r in inner)]:]:
            if node.id >= m.end:
                break
            if node.id in g.inside:
                call = g.inside[node.id]
                if node.id == call.start and any(hasattr(a, "id") and a.id in place
                                                 for a in call.args):
                    return None  # a layer reads the partial sum
                continue
            ins = [None if not hasattr(a, "id") else place.get(a.id, self.stream if a.id in seq
                                                                else R) for a in node.inputs]
            if not any(isinstance(p, Partial) for p in ins):
                continue
            if node.kind != "op":
                return None
            try:
                st = g.propagate(node, ins, self.n)
            except _Break:
                return None
            if not isinstance(st.out[0], Partial):
                return None
            for a, cur, need in zip(node.inputs, ins, st.inputs):
                if need is None or cur is None:
                    continue
                if isinstance(cur, Partial) and need[0] != cur:
                    return None
                if not isinstance(cur, Partial) and not isinstance(need[0], Partial):
                    tainted.append(a)  # multiplies a partial sum: its gradient is one too
            place[node.id] = st.out[0]
        if m.out.id not in place:
            return None
        end = next((i for i, n in enumerate(g.graph.nodes) if n.id >= m.end), len(g.graph.nodes))
        if any(g.last_use.get(k, -1) >= end for k in place if k != m.out.id):
            return None  # a partial sum used after the module
        if m.out.id in g.outputs:
            return None
        return set(place), self._params_behind(tainted, m)

    def _params_behind(self, values: list, m: _Call) -> list:
        """Where the partial gradients of ``values`` are reduced: going back inside ``m``'s
        call through linear ops, the first nonlinear op's output (its backward needs the
        gradient whole), or a parameter (reduced when stored)."""
        out, todo, seen = [], list(values), set()
        while todo:
            n = todo.pop()
            if not hasattr(n, "id") or n.id in seen:
                continue
            seen.add(n.id)
            if n.kind == "input":
                if n.id in self.g.params:
                    out.append(n)
                continue
            if n.id < m.start:
                continue
            if self.g.ops[n.name].linearity == "none":
                out.append(n)
                continue
            todo.extend(n.inputs)
        return out

    def _untie_tables(self):
        """A weight tied between a vocab-parallel table and a layer laid out otherwise keeps
        both whole (a tied weight has one layout)."""
        owners: dict[int, list] = {}
        for c in self.g.calls:
            for p in c.module._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(c.module)
        shard0 = ("vocab", "head", "gathered", "col")
        for mods in owners.values():
            roles = {self.role.get(id(m), (None, None))[1] for m in mods}
            if len(set(id(m) for m in mods)) > 1 and "vocab" in roles and not roles <= set(shard0):
                for m in mods:
                    if self.role.get(id(m), (None, None))[1] == "vocab":
                        del self.role[id(m)]
                        self.refused[id(m)] = "its weight is tied to a layer kept whole"

    def from_styles(self, model: Module, styles: dict):
        """Roles read off a hand-written plan (to price it the same way)."""
        from dtensor.parallel.api import _plan_hits
        from dtensor.parallel.style import ColwiseParallel, RowwiseParallel
        for style, _, m in _plan_hits(model, styles):
            if isinstance(style, ColwiseParallel) and isinstance(m, Linear):
                head = style.input_layouts is not None or style.output_layouts is not None
                if head:
                    role = "gathered" if style.output_layouts == R else "head"
                else:
                    role = "col"
                    if style.parts > 1:
                        self.parts[id(m)] = style.parts
                self.role[id(m)] = (m, role, "")
            elif isinstance(style, RowwiseParallel):
                self.role[id(m)] = (m, "vocab" if isinstance(m, Embedding) else "row", "")
        cols = {k for k, (_, r, _) in self.role.items() if r == "col"}
        try:  # where the plan's split values go, and the whole layers an op cuts locally
            _, _, sliced, region = (self.g.walk(cols, self.n, self.parts) if cols else
                                    ({}, (), [], {}))
        except _Break:
            sliced, region = [], {}
        self.chains = [_Chain([], [], [], region=set(region))]
        for a in sliced:
            for c in self.g.sources(a):
                if id(c.module) not in self.role:
                    self.role[id(c.module)] = (c.module, "shared", "")

    # -- conversion points and styles
    def _consumers(self) -> dict:
        """Value id -> (value, [Linear calls that need it whole]): the inputs of the column
        side of chains and, under sequence parallelism, the sequence shards a Linear left
        whole reads (its (B, T, C) -> (B * T, C) reshape cannot keep a sequence split)."""
        out: dict = {}
        for c in self.g.linears:
            role = self.role.get(id(c.module), (None, None))[1]
            if not c.args or c.args[0] is None:
                continue
            if role in ("col", "head", "gathered") or (role is None
                                                        and c.args[0].id in self.seq):
                out.setdefault(c.args[0].id, (c.args[0], []))[1].append(c)
        return out

    def _boundary(self, value, consumers):
        """Where one chain input is converted: the smallest module (not the root, not one of
        the consumers) that takes it as a positional argument and holds every consumer, else the
        module that returned it, else (None) each consumer converts its own input."""
        best = None
        for c in self.g.calls:
            if not c.path or any(c.module is k.module for k in consumers):
                continue
            if isinstance(c.module, (Linear, Embedding)) and id(c.module) in self.role:
                continue
            if any(a is value for a in c.args) and all(
                    k.path.startswith(c.path + ".") for k in consumers):
                if best is None or len(c.path) > len(best[1].path):
                    best = ("input", c)
        if best is not None:
            return best
        for c in reversed(self.g.calls):  # the innermost module that returned it
            if c.path and c.out is value and id(c.module) not in self.role:
                return ("output", c)
        return (None, None)

    def _region(self) -> set:
        """Ids of the values the chains carry split."""
        return set().union(*(ch.region for ch in self.chains))

    def _sequence_sharded(self) -> set:
        """Under sequence parallelism, the ids of the values that are sequence shards: what the
        row-parallel layers and vocabulary tables return, and what ops outside the chains
        compute from it. (A model's own float input stays replicated until such a value joins
        it.)"""
        if not self.sp:
            return set()
        g, out, region = self.g, set(), self._region()
        for c in g.linears + g.tables:
            if self.role.get(id(c.module), (None, None))[1] in ("row", "vocab") \
                    and c.out is not None and c.out.id not in self.partial:
                out.add(c.out.id)
        out |= {call.out.id for call, _, _ in self.deferred}
        for node in g.graph.nodes:
            if node.id in g.inside or node.id in region or node.id in out \
                    or node.id in self.partial:
                continue
            if any(hasattr(a, "id") and a.id in out for a in node.inputs) \
                    and len(node.shape) >= 2:
                out.add(node.id)
        return out

    def styles(self):
        from dtensor.parallel.style import (ColwiseParallel, PrepareModuleInput,
                                            PrepareModuleOutput, RowwiseParallel,
                                            SequenceParallel)
        st, stream = {}, self.stream
        converted = set()
        # the roles and partial sums are final here: the stream's shards, for every later use
        self.seq = seq = self._sequence_sharded()

        def rejoin(call, value, style):
            """A module left whole on sequence shards: its input is gathered, and its output
            rejoins the stream through a conversion whose backward gathers the gradient (an
            op that cut it silently would hand its (B, T, C) -> (B * T, C) reshape a split
            gradient)."""
            if value.id not in seq or call.out is None or call.out.shape != value.shape:
                return style, None
            back = PrepareModuleOutput(output_layouts=(R,), desired_output_layouts=(stream,),
                                       use_local_output=False)
            return _Both(style, back), call.out

        for value, consumers in self._consumers().values():
            kind, call = self._boundary(value, consumers)
            whole = all(id(k.module) not in self.role for k in consumers)
            back = None
            if kind == "input":
                i = next(k for k, a in enumerate(call.args) if a is value)
                src = tuple(stream if k == i else None for k in range(i + 1))
                dst = tuple(R if k == i else None for k in range(i + 1))
                st[call.path] = PrepareModuleInput(input_layouts=src, desired_input_layouts=dst)
                if whole:
                    st[call.path], back = rejoin(call, value, st[call.path])
            elif kind == "output":
                st[call.path] = PrepareModuleOutput(output_layouts=(stream,),
                                                    desired_output_layouts=(R,),
                                                    use_local_output=False)
            else:
                converted |= {id(k.module) for k in consumers}
                for k in consumers:  # a whole Linear converts its own input
                    if id(k.module) not in self.role:
                        st[k.path], back = rejoin(k, value, PrepareModuleInput(
                            input_layouts=(stream,), desired_input_layouts=(R,)))
            self.bounds.append((value, consumers, kind, call, back))
        deferred = {id(r.module) for _, rows, _ in self.deferred for r in rows}
        for call, _, _ in self.deferred:
            back = PrepareModuleOutput(output_layouts=(Partial(),),
                                       desired_output_layouts=(stream,), use_local_output=False)
            st[call.path] = _Both(st[call.path], back) if call.path in st else back
        for _, (m, role, _) in self.role.items():
            if role == "col":
                style = ColwiseParallel(use_local_output=False, parts=self.parts.get(id(m), 1))
            elif role in ("head", "gathered"):
                style = ColwiseParallel(input_layouts=stream,
                                        output_layouts=Shard(-1) if role == "head" else R,
                                        use_local_output=False)
            elif role == "row":
                style = RowwiseParallel(output_layouts=Partial() if id(m) in deferred
                                        else stream, use_local_output=False)
            elif role == "vocab":
                style = RowwiseParallel(input_layouts=R, output_layouts=stream,
                                        use_local_output=False)
            else:  # "shared": whole
                continue
            if id(m) in converted:
                # its own conversion point, so its input's gradient (a partial sum) is
                # reduced here and not carried back through the stream
                style = _Both(PrepareModuleInput(input_layouts=(stream,),
                                                 desired_input_layouts=(R,)), style)
            st[_owner_path(self.g, m)] = style
        if self.sp:
            for c in self.g.calls:
                if (c.path and c.path not in st and not c.module._modules and c.args
                        and c.args[0] is not None and c.out is not None
                        and c.args[0].id in seq and c.out.shape == c.args[0].shape
                        and id(c.module) not in self.role):
                    st[c.path] = SequenceParallel()
        self.style = dict(sorted(st.items(), key=lambda kv: self._order(kv[0])))
        return self.style

    def _order(self, path: str):
        for i, c in enumerate(self.g.calls):
            if c.path == path:
                return i
        return len(self.g.calls)

    # -- prices
    def price(self, ndp: int, fsdp: bool = False) -> list:
        """(where, phase, kind, count, bytes) per rank per step for the "tp" dim."""
        g, out = self.g, []
        shards = {id(p): self._dp_piece(m, name, p, ndp) if fsdp else p.data.nbytes
                  for _, m, name, p in self._param_table()}
        by_name = {path: p for path, _, _, p in self._param_table()}
        act = lambda node: _nbytes(node) // ndp  # noqa: E731  (one dp rank's rows)

        def add(where, phase, kind, nbytes):
            out.append((where, phase, kind, 1, int(nbytes)))

        seq = self.seq
        for value, consumers, kind, call, back in self.bounds:
            if back is not None:
                add((call.path if call is not None else consumers[0].path) + " (output)",
                    "backward", "all_gather", act(back))
            where = (call.path + (" (input)" if kind == "input" else " (output)")
                     if call is not None else consumers[0].path)
            times = 1 if call is not None else len(consumers)
            # a gradient from split consumers is a partial sum; from whole ones it is whole
            split = any(id(k.module) in self.role for k in consumers)
            for _ in range(times):
                if value.id in seq:
                    add(where, "forward", "all_gather", act(value))
                    if split:
                        add(where, "backward", "reduce_scatter", act(value))
                elif split:
                    add(where, "backward", "all_reduce", act(value))
        deferred = {id(r) for _, rows, _ in self.deferred for r in rows}
        for call, rows, params in self.deferred:
            where = f"{call.path} (output)"
            if self.sp:
                add(where, "forward", "reduce_scatter", act(call.out))
                add(where, "backward", "all_gather", act(call.out))
            else:
                add(where, "forward", "all_reduce", act(call.out))
            for p in params:
                if p.kind == "input":  # reduced over "tp" after its reduce-scatter over "dp"
                    add(f"{p.name} grad", "backward", "all_reduce",
                        shards[id(by_name[p.name])] if p.name in by_name else _nbytes(p))
                else:
                    add(f"{call.path}: %{p.id} {p.name} grad", "backward", "all_reduce",
                        _nbytes(p) // ndp)
        for c in g.linears + g.tables:
            role = self.role.get(id(c.module), (None, None))[1]
            if id(c) in deferred:
                continue
            if role in ("row", "vocab"):
                if self.sp:
                    add(c.path, "forward", "reduce_scatter", act(c.out))
                    add(c.path, "backward", "all_gather", act(c.out))
                else:
                    add(c.path, "forward", "all_reduce", act(c.out))
            elif role == "gathered":
                add(c.path, "forward", "all_gather", act(c.out))
            elif role == "head":
                for n in g.graph.nodes:
                    if n.name == "softmax_cross_entropy" and c in g.sources(n.inputs[0]):
                        for what in ("max", "sum of exp", "target logit"):
                            add(f"{c.path} (loss: {what})", "forward", "all_reduce", act(n))
        seen = set()
        for m, role, _ in self.role.values():
            if role == "shared" and id(m) not in seen:
                seen.add(id(m))
                for name, p in m.named_parameters():
                    add(f"{_owner_path(g, m)}.{name} grad", "backward", "all_reduce",
                        p.data.nbytes)
        for name in self._partial_grads():
            p = by_name[name]
            out.append((f"{name} grad", "backward", "all_reduce",
                        self._gathers(p) if fsdp else 1, shards[id(p)]))
        return out

    def _gathers(self, p) -> int:
        """How many times FSDP gathers ``p`` (and reduces its gradient) per step: once per call
        of the module holding it, once for a parameter tied between modules (the model
        gathers it)."""
        owners = {id(c.module) for c in self.g.calls if any(
            q is p for q in c.module._parameters.values())}
        if len(owners) != 1:
            return 1
        return sum(1 for c in self.g.calls if id(c.module) in owners)

    def _partial_grads(self) -> list:
        """Paths of the whole parameters that meet split data (a norm on sequence shards, a
        per-head norm inside a chain): their gradients are partial sums, all-reduced when
        stored."""
        g = self.g
        params = dict(g.params)
        planned = set()
        for m, role, _ in self.role.values():
            if role != "shared":
                planned |= {id(p) for p in m.parameters()}
        by_node = {path: p for path, _, _, p in self._param_table() if id(p) not in planned}
        for c in g.tables:  # a whole table's rows stand for its weight
            if id(c.module) not in self.role and c.out is not None and c.module.weight is not None:
                name = next((k for k, p in by_node.items() if p is c.module.weight), None)
                if name is not None:
                    params[c.out.id] = SimpleNamespace(name=name)
        region, seq = self._region(), self.seq
        hit = []
        for node in g.graph.nodes:
            if node.id in g.inside:
                continue
            acts = [a for a in node.inputs if hasattr(a, "id") and a.id not in params]
            ps = [a for a in node.inputs if hasattr(a, "id") and a.id in params]
            if not ps or not acts:
                continue
            split = any(a.id in region or a.id in seq for a in acts)
            if split:
                hit += [params[p.id].name for p in ps if params[p.id].name in by_node]
        return list(dict.fromkeys(hit))

    def _rank_bytes(self, m, name, p) -> int:
        role = self.role.get(id(m), (None, None))[1]
        split = role in ("col", "head", "gathered", "vocab") or (role == "row" and name == "weight")
        return -(-p.data.nbytes // self.n) if split else p.data.nbytes

    def _param_table(self):
        """(path, module, name, parameter) once per parameter."""
        out, seen = [], set()
        root = self.g.calls[0].module
        for prefix, m in root.named_modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{prefix}.{name}".lstrip("."), m, name, p))
        return out

    def _dp_piece(self, m, name, p, ndp: int) -> int:
        """Bytes of rank 0's piece of a parameter FSDP shards over "dp" (its "tp" shard cut
        on the dim parallelize's FSDP cuts), or of the whole "tp" shard if it stays whole."""
        b = self._rank_bytes(m, name, p)
        role = self.role.get(id(m), (None, None))[1]
        split0 = role in ("col", "head", "gathered", "vocab")
        if p.ndim == 1 and split0:
            return b
        d = 1 if split0 and p.ndim > 1 else 0
        shape = list(p.shape)
        if split0:
            shape[0] = -(-shape[0] // self.n)
        elif role == "row" and name == "weight":
            shape[1] = -(-shape[1] // self.n)
        shape[d] = -(-shape[d] // ndp)
        return int(np.prod(shape)) * p.data.dtype.itemsize

    def param_bytes_per_rank(self, ndp: int = 1) -> int:
        """Parameter bytes rank 0 holds: its "tp" shards, cut again over ``ndp`` "dp" ranks
        by FSDP when ``ndp`` > 1."""
        if ndp > 1:
            return sum(self._dp_piece(m, n, p, ndp) for _, m, n, p in self._param_table())
        return sum(self._rank_bytes(m, n, p) for _, m, n, p in self._param_table())

    def price_dp(self, ndp: int, fsdp: bool) -> list:
        """Data parallel over "dp": every gradient all-reduced, or with FSDP every parameter
        gathered forward and its gradient reduce-scattered; the mean loss's sum and count."""
        out = []
        for path, m, name, p in self._param_table():
            b = self._rank_bytes(m, name, p)
            tp_vector = p.ndim == 1 and self._rank_bytes(m, name, p) < p.data.nbytes
            if fsdp and not tp_vector:  # (a column-parallel bias stays whole over "dp")
                k = self._gathers(p)
                out.append((f"dp: {path}", "forward", "all_gather", k, b))
                out.append((f"dp: {path}", "backward", "reduce_scatter", k, b))
            else:
                out.append((f"dp: {path} grad", "backward", "all_reduce", 1, b))
        if any(n.name == "softmax_cross_entropy" for n in self.g.graph.nodes):
            out.append(("loss mean over the batch rows", "forward", "all_reduce", 1, 4))
        return out

    # -- the explanation
    def rows(self) -> list:
        out = []
        bounds = {id(c.module): (kind, v) for v, _, kind, c, _ in self.bounds if c is not None}
        for c in self.g.calls:
            if not c.path or any(c.path == r[0] for r in out):
                continue
            m = c.module
            if id(m) in self.role:
                _, role, why = self.role[id(m)]
                text = _ROLE_TEXT.get(role, "Linear weight whole")
                if id(m) in self.parts:
                    text = (f"Linear weight StridedShard(0, {self.parts[id(m)]}) (each part's "
                            f"output features)")
                out.append((c.path, text, why))
            elif any(call.module is m for call, _, _ in self.deferred):
                rows = next(r for call, r, _ in self.deferred if call.module is m)
                first = (f"input {self.stream!r} -> Replicate; " if bounds.get(
                    id(m), (None,))[0] == "input" else "")
                out.append((c.path, f"{first}output Partial -> {self.stream!r}",
                            f"adds up {len(rows)} row-parallel outputs "
                            f"({', '.join(r.path for r in rows)}): one reduction, not "
                            f"{len(rows)}. Whole chains on different ranks (expert "
                            f"parallel) would move the same bytes (this reduction and the "
                            f"input's); each chain is split, which keeps the ranks' work "
                            f"equal whatever the weights"))
            elif id(m) in bounds:
                kind, v = bounds[id(m)]
                s = self.style.get(c.path)
                where = (f"{kind} {self.stream!r} -> Replicate" if s is not None else "")
                whole = " (its parameters replicated)" if any(
                    p is not None for p in m._parameters.values()) else ""
                out.append((c.path, where, f"one conversion of a chain input {v.shape}, "
                                           f"shared by its consumers{whole}"))
            elif c.path in self.style:
                out.append((c.path, "sequence shards Shard(1)", "between chains (SP)"))
            elif m._parameters and any(p is not None for p in m._parameters.values()):
                why = self.refused.get(id(m), "not a Linear or an Embedding" if not isinstance(
                    m, (Linear, Embedding)) else "not reached")
                out.append((c.path, "replicated", why))
        return out
