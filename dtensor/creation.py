"""The public factories: a plain tensor, or with ``device_mesh=`` and ``placements=`` a DTensor.

They sit above both tensor.py and dtensor.py, so the tensor layer never reaches up for the
DTensor versions (``dtensor.zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])``, as torch's
``distributed.tensor.zeros``).
"""
from __future__ import annotations

import functools

from dtensor.tensor import full, ones, rand, randn, zeros

__all__ = ["zeros", "ones", "full", "rand", "randn"]


def _factory(plain):
    name = plain.__name__

    @functools.wraps(plain)
    def make(*args, device_mesh=None, placements=None, **kwargs):
        if device_mesh is None and placements is None:
            return plain(*args, **kwargs)
        if device_mesh is None or placements is None:
            raise ValueError(f"{name}: pass both device_mesh= and placements= for a DTensor "
                             f"(got device_mesh={device_mesh!r}, placements={placements!r}).")
        # loaded on first use, as dtensor's other distributed names: plain users never need it
        from dtensor import dtensor as dt
        return getattr(dt, name)(*args, device_mesh=device_mesh, placements=placements,
                                 **kwargs)

    make.__doc__ = (f"{plain.__doc__ or f'dtensor.{name}.'}\n\n    With ``device_mesh=`` and "
                    f"``placements=``, a DTensor: each rank allocates only its block, and "
                    f"random values equal the one-process ones.")
    return make


zeros, ones, full, rand, randn = map(_factory, (zeros, ones, full, rand, randn))
