"""Reverse-mode autograd: one engine for every interpretation.

``apply`` records ``(op, inputs, params)`` on the output; ``backward`` walks those records in
reverse topological order and calls each op's ``vjp``. The vjp rules are written with ops, so the
backward of a DTensor program is a DTensor program and the backward of a traced program is traced.
"""
from __future__ import annotations

import threading
import weakref

from dtensor import observe
from dtensor._flag import Flag

__all__ = ["no_grad", "enable_grad", "is_grad_enabled", "backward", "grad", "Deferred",
           "queue_callback", "refill_before_backward"]


_state = Flag(True)  # whether ops record for autograd, per thread


class Deferred:
    """A gradient a vjp hands back before it is computed (data parallelism's bucketed
    all-reduce: a bucket is reduced only once its last gradient has arrived). The engine keeps
    it until the end of the backward, after the callbacks queued during it, then calls
    ``wait()`` for the tensor it stands for; only a leaf may receive one."""

    __slots__ = ("wait",)

    def __init__(self, wait):
        self.wait = wait


def _resolved(g):
    return g.wait() if isinstance(g, Deferred) else g


class _Backward(threading.local):
    callbacks: list | None = None  # the running backward's queue; None outside one


_backward = _Backward()


def queue_callback(fn) -> None:
    """Run ``fn()`` once the running backward has computed every gradient, before it hands
    deferred gradients to their leaves and returns (PyTorch's ``queue_callback``)."""
    if _backward.callbacks is None:
        raise RuntimeError("queue_callback() is for code that runs inside a backward (a vjp); "
                           "no backward is running on this thread.")
    _backward.callbacks.append(fn)


# id(tensor) -> (weak reference, fill): tensors whose data was freed after the forward and
# must be computed again before a vjp reads them (FSDP's reshard after forward).
_refills: dict = {}


def refill_before_backward(t, fill) -> None:
    """Call ``fill()`` before the first vjp that takes ``t`` as an input, once: the caller freed
    ``t``'s data after the forward and ``fill`` restores it (FSDP gathers a parameter again)."""
    key = id(t)
    _refills[key] = (weakref.ref(t, lambda _, k=key: _refills.pop(k, None)), fill)


def _refill(inputs) -> None:
    for x in inputs:
        entry = _refills.get(id(x))
        if entry is not None and entry[0]() is x:
            del _refills[id(x)]
            entry[1]()


class Node:
    """How a tensor was made: the op, its inputs (kept alive for the vjp) and its params."""

    __slots__ = ("op", "inputs", "params", "where")

    def __init__(self, op, inputs, params, where=None):
        self.op = op
        self.inputs = inputs
        self.params = params
        # the module path whose forward made it, kept while a debugging tool listens
        # (dtensor/debug.py): its backward's collectives and spans are that module's
        self.where = where

    def __repr__(self) -> str:
        return f"<Node {self.op.name}>"


def record(op, inputs, params, out) -> None:
    out.requires_grad = True
    out._node = Node(op, inputs, params)


def is_grad_enabled() -> bool:
    return _state.on


def no_grad():
    """Context manager (and decorator) that stops recording, like ``torch.no_grad``."""
    return _state.set(False)


def enable_grad():
    return _state.set(True)


def _topo_order(root) -> list:
    """Tensors reachable from ``root`` through recorded nodes, each after all of its users."""
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        node = t._node
        if node is not None:
            if node.inputs is None:
                raise RuntimeError(
                    f"Trying to backward through the graph a second time (the graph of "
                    f"{node.op.name!r} was freed by the first backward). Pass "
                    f"retain_graph=True to the first backward() if you need to call it twice.")
            for x in node.inputs:
                if getattr(x, "requires_grad", False) and id(x) not in seen:
                    stack.append((x, False))
    order.reverse()
    return order


def _run(root, grad, retain_graph: bool, accumulate_into_leaves: bool, wanted=()):
    grads = {id(root): grad}
    wanted_ids = {id(w) for w in wanted}
    found = {}
    # Gradients already stored in a .grad, and the caller's own: a leaf reached by one of them
    # gets a copy.
    taken: set = {id(grad)}
    outer, _backward.callbacks = _backward.callbacks, []
    late = []  # (leaf, Deferred gradient)
    before = (observe.CAUSE.get("module"), observe.CAUSE.get("phase"),
              observe.CAUSE.get("op"))
    try:
        with no_grad():
            _walk(root, grads, retain_graph, accumulate_into_leaves, wanted_ids, found, taken,
                  late)
            while _backward.callbacks:
                _backward.callbacks.pop(0)()
            for t, g in late:
                _accumulate(t, g.wait(), taken)
    finally:
        _backward.callbacks = outer
        if observe.TRACKING:
            observe.where(*before[:2])
            observe.CAUSE["op"] = before[2]
    return {k: _resolved(g) for k, g in found.items()}


def _accumulate(t, g, taken: set) -> None:
    g = g._as_grad_of(t)
    t.grad = g._owned(taken) if t.grad is None else t.grad + g


def _walk(root, grads, retain_graph, accumulate_into_leaves, wanted_ids, found, taken, late):
    for t in _topo_order(root):
        g = grads.pop(id(t), None)
        if g is None:
            continue
        if id(t) in wanted_ids:
            found[id(t)] = g
        node = t._node
        if observe.TRACKING:  # a parameter's gradient reduction is its module's
            observe.where(node.where if node is not None else observe.OWNERS.get(id(t)),
                          "backward")
            observe.CAUSE["op"] = node.op.name if node is not None else None
        if node is None:
            if accumulate_into_leaves:
                if isinstance(g, Deferred):
                    late.append((t, g))
                else:
                    _accumulate(t, g, taken)
            continue
        inputs = node.inputs
        if _refills:
            _refill(inputs)
        gins = node.op.vjp(_resolved(g), t, *inputs, **node.params)
        for x, gx in zip(inputs, gins):
            if gx is None or not getattr(x, "requires_grad", False):
                continue
            if callable(gx):
                gx = gx()
            if not isinstance(gx, Deferred) and gx.dtype != x.dtype:
                # As in PyTorch: a gradient has its input's dtype. Type promotion (a float32
                # weight times a float64 tensor) must not hand float64 gradients back.
                gx = gx.astype(x.dtype)
            prev = grads.get(id(x))
            if prev is None:
                grads[id(x)] = gx
            elif isinstance(prev, Deferred) or isinstance(gx, Deferred):
                grads[id(x)] = Deferred(lambda a=prev, b=gx: _resolved(a) + _resolved(b))
            else:
                grads[id(x)] = prev + gx
        if not retain_graph:
            node.inputs = None


def _seed_grad(root, gradient):
    if gradient is None:
        if root.shape != ():
            raise RuntimeError(
                f"backward() without a gradient needs a scalar output, got shape "
                f"{tuple(root.shape)}. Reduce it first (loss.sum() / loss.mean()) or pass "
                f"gradient= with shape {tuple(root.shape)}.")
        return root._ones_like()
    if tuple(gradient.shape) != tuple(root.shape):
        raise ValueError(
            f"backward(gradient=...) has shape {tuple(gradient.shape)} but the output has shape "
            f"{tuple(root.shape)}; they must match.")
    return gradient


def backward(root, gradient=None, retain_graph: bool = False) -> None:
    """Accumulate d(root)/d(leaf) into ``leaf.grad`` for every leaf that requires grad."""
    if not root.requires_grad:
        raise RuntimeError(
            "backward() on a tensor that does not require grad: no input of the computation "
            "had requires_grad=True (or it ran under no_grad()).")
    _run(root, _seed_grad(root, gradient), retain_graph, accumulate_into_leaves=True)


def grad(output, inputs, grad_output=None, retain_graph: bool = False):
    """Gradients of ``output`` w.r.t. ``inputs`` (a tuple), without touching ``.grad``."""
    inputs = tuple(inputs)
    found = _run(output, _seed_grad(output, grad_output), retain_graph,
                 accumulate_into_leaves=False, wanted=inputs)
    return tuple(found.get(id(x)) for x in inputs)
