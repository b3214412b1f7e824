"""The public factories: a plain tensor, or with ``device_mesh=`` and ``placements=`` a DTensor.

They sit above both tensor.py and dtensor.py, so the tensor layer never reaches up for the
DTensor versions (``dtensor.zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])``, as torch's
``distributed.tensor.zeros``).
"""
from __future__ import annotations

import functools
import importlib

__all__ = ["zeros", "ones", "full", "rand", "randn"]


def _factory(name: str):
    plain = getattr(importlib.import_module("dtensor.tensor"), name)

    @functools.wraps(plain)
    def make(*args, device_mesh=None, placements=None, **kwargs):
        if device_mesh is None and placements is None:
            return plain(*args, **kwargs)
        if device_mesh is None or placements is None:
            raise ValueError(f"{name}: pass both device_mesh= and placements= for a DTensor "
                             f"(got device_mesh={device_mesh!r}, placements={placements!r}).")
        # loaded on first use, as dtensor's other distributed names: plain users never need it
        distributed = getattr(importlib.import_module("dtensor.dtensor"), name)
        return distributed(*args, device_mesh=device_mesh, placements=placements, **kwargs)

    make.__doc__ = (f"{plain.__doc__ or f'dtensor.{name}.'}\n\n    With ``device_mesh=`` and "
                    f"``placements=``, a DTensor: each rank allocates only its block, and "
                    f"random values equal the one-process ones.")
    return make


zeros, ones, full, rand, randn = map(_factory, __all__)
