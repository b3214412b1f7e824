"""Testing support: the multi-rank pytest plugin (``dtensor.testing.plugin``, loaded by pytest
through the ``pytest11`` entry point) — ``@pytest.mark.ranks(N)`` runs a test body on N MPI ranks.
"""
