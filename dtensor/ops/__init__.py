"""The op registry. ``OPS`` maps a name to its ``Op``; see registry.py for the block shape."""
from dtensor.ops.registry import OPS, Aval, Op, apply, defop, register_interpreter
from dtensor.ops import nn, pointwise, structural  # noqa: F401  (registers the primitives)

__all__ = ["OPS", "Aval", "Op", "apply", "defop", "register_interpreter"]
