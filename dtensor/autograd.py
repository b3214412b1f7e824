"""Reverse-mode autograd: one engine for every interpretation.

``apply`` records ``(op, inputs, params)`` on the output; ``backward`` walks those records in
reverse topological order and calls each op's ``vjp``. The vjp rules are written with ops, so the
backward of a DTensor program is a DTensor program and the backward of a traced program is traced.
"""
from __future__ import annotations

from dtensor._flag import Flag

__all__ = ["no_grad", "enable_grad", "is_grad_enabled", "backward", "grad"]


_state = Flag(True)  # whether ops record for autograd, per thread


class Node:
    """How a tensor was made: the op, its inputs (kept alive for the vjp) and its params."""

    __slots__ = ("op", "inputs", "params")

    def __init__(self, op, inputs, params):
        self.op = op
        self.inputs = inputs
        self.params = params

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
    with no_grad():
        for t in _topo_order(root):
            g = grads.pop(id(t), None)
            if g is None:
                continue
            if id(t) in wanted_ids:
                found[id(t)] = g
            node = t._node
            if node is None:
                if accumulate_into_leaves:
                    g = g._as_grad_of(t)
                    t.grad = g._owned(taken) if t.grad is None else t.grad + g
                continue
            inputs = node.inputs
            gins = node.op.vjp(g, t, *inputs, **node.params)
            for x, gx in zip(inputs, gins):
                if gx is None or not getattr(x, "requires_grad", False):
                    continue
                if callable(gx):
                    gx = gx()
                if gx.dtype != x.dtype:
                    # As in PyTorch: a gradient has its input's dtype. Type promotion (a float32
                    # weight times a float64 tensor) must not hand float64 gradients back.
                    gx = gx.astype(x.dtype)
                prev = grads.get(id(x))
                grads[id(x)] = gx if prev is None else prev + gx
            if not retain_graph:
                node.inputs = None
    return found


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
