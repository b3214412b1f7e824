"""``dtlaunch`` and ``spawn``: start N MPI ranks of a script or a function.

    dtlaunch --nproc 4 train.py              # the console script (also python -m dtensor.launcher)
    dtlaunch --nproc_per_node 4 -m pkg.train # torchrun's spellings work too

    >>> from dtensor.launcher import spawn
    >>> spawn(lambda: int(os.environ["RANK"]), 2)  # doctest: +SKIP
    [0, 1]

Layout: ``bootstrap.py`` runs inside each rank (environment, MPI start-up, failure reports, the
pool's worker loop); ``job.py`` starts and ends one mpiexec job; ``pool.py`` keeps ranks alive
between function calls (``RankPool``, ``spawn``); ``cli.py`` is ``dtlaunch``.
benchmarks/oversubscription.py measures MPICH's waiting with more ranks than cores.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtensor.launcher.bootstrap import apply_rank_env
    from dtensor.launcher.cli import main
    from dtensor.launcher.job import find_mpiexec
    from dtensor.launcher.pool import RankDiedError, RankError, RankPool, RankTimeoutError, spawn

# Imported on first use: `python -m dtensor.launcher.bootstrap` must find bootstrap not yet
# imported by its own package (runpy warns otherwise).
_EXPORTS = {"main": "cli", "spawn": "pool", "RankPool": "pool", "RankError": "pool",
            "RankTimeoutError": "pool", "RankDiedError": "pool", "find_mpiexec": "job",
            "apply_rank_env": "bootstrap"}
__all__ = [
    "RankDiedError",
    "RankError",
    "RankPool",
    "RankTimeoutError",
    "apply_rank_env",
    "find_mpiexec",
    "main",
    "spawn",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtensor.launcher' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dtensor.launcher.{_EXPORTS[name]}"), name)
