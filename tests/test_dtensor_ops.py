"""Every op in the registry on DTensors, for every combination of input placements, equals the
one-process result (values and gradients): see dtensor_conformance.py."""
from __future__ import annotations

import pytest

from dtensor.ops import OPS

# (1, 2): a mesh dim of size 1 holds whole dims, whatever its placement says (dp=1 x tp=2).
MESHES = [((2,), 2), ((3,), 3), ((4,), 4), ((2, 2), 4), ((1, 2), 2)]


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.ranks(n, timeout=300),
                                                id="x".join(map(str, s))) for s, n in MESHES])
def test_op_on_every_placement(shape, name, rank):
    from dtensor import init_device_mesh
    import dtensor_conformance as conformance

    mesh = init_device_mesh("cpu", shape)
    cases, failures = conformance.run_op(
        name, mesh, conformance.MAX_COMBOS_2D if len(shape) > 1 else None)
    assert cases > 0
    assert not failures, f"{len(failures)} of {cases} cases differ:\n" + "\n".join(failures[:10])
