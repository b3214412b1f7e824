"""The layer check CI runs (.ci/layers.py): this repository passes it, and each kind of upward
or private import planted in a copy of the tree is caught with its file and line."""
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "layers.py"


def _layers():
    spec = importlib.util.spec_from_file_location("ci_layers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_this_tree_has_no_upward_or_private_import():
    assert _layers().check(ROOT) == []


# (file, line planted at its end, what the report must say)
PLANTED = [
    ("dtensor/tensor.py", "from dtensor.dtensor import DTensor",
     "dtensor.tensor (tensor) imports dtensor.dtensor (dtensor)"),
    ("dtensor/ops/structural.py", "def f():\n    from dtensor.nn import functional",
     "dtensor.ops.structural (ops) imports dtensor.nn (nn/optim)"),
    ("dtensor/nn/layers.py", "from dtensor import parallel",
     "dtensor.nn.layers (nn/optim) imports dtensor.parallel (parallel)"),
    ("dtensor/parallel/style.py", "import dtensor.compile.api",
     "dtensor.parallel.style (parallel) imports dtensor.compile.api (compile)"),
    ("dtensor/placements.py", "import importlib\nimportlib.import_module('dtensor.mesh')\n"
     "importlib.import_module('dtensor.redistribute')",
     "dtensor.placements (base) imports dtensor.redistribute (dtensor)"),
    ("compile/passes/fusion.py", "from ..api import compile\nfrom dtensor.launcher import cli",
     "dtensor.compile.passes.fusion (compile) imports dtensor.launcher (launcher)"),
    ("compile/api.py", "from dtensor.dtensor import _local_block",
     "compile/ imports the private name _local_block from dtensor.dtensor"),
    ("compile/c_backend.py", "from dtensor import random\nx = random._stream",
     "compile/ reads the private name dtensor.random._stream"),
    ("compile/graph_extra.py", "import dtensor.ops.nn as nnops\ny = nnops._contig",
     "compile/ reads the private name dtensor.ops.nn._contig"),
]


@pytest.mark.parametrize("path,line,message", PLANTED, ids=[p[2][:40] for p in PLANTED])
def test_a_planted_import_is_reported(tmp_path, path, line, message):
    for folder in ("dtensor", "compile", "launcher"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / path
    before = target.read_text() if target.exists() else ""
    target.write_text(before + "\n" + line + "\n")
    problems = _layers().check(tmp_path)
    assert len(problems) == 1, problems
    assert message in problems[0]
    last = before.count("\n") + 2 + line.count("\n")  # the offence is the plant's last line
    assert problems[0].startswith(f"{path}:{last}: "), problems[0]


def test_a_module_in_no_layer_is_named(tmp_path):
    for folder in ("dtensor", "compile", "launcher"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "dtensor" / "newthing.py").write_text("x = 1\n")
    (tmp_path / "dtensor" / "tensor.py").write_text("from dtensor import newthing\n")
    with pytest.raises(SystemExit, match="dtensor.newthing is in no layer"):
        _layers().check(tmp_path)
