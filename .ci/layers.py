"""Fail on any import that goes up dtensor's layers, and on compile/ reaching private names.

The layers, bottom to top (a module may import its own layer and those below it):

    0 base        placements, mesh, comm (and its flight recorder), distributed, random, and the
                  helpers they share
    1 ops         ops/, autograd
    2 tensor      tensor, einsum
    3 dtensor     dtensor, redistribute, sharding, the tracer and its graph, creation
    4 nn/optim    nn/, optim/, debug (CommDebugMode), profiler
    5 parallel    parallel/, checkpoint
    6 compile     compile/ (dtensor.compile)
    7 launcher    launcher/ (dtensor.launcher), testing/ (its pytest plugin starts ranks)

``dtensor/__init__.py`` is the package's face and may import anything. Every import counts:
at module top, inside functions, and ``importlib.import_module("dtensor....")`` with a literal
name. compile/ may not import a name starting with "_" from a module outside compile/, nor
read one as an attribute of such a module (``random._seed``).

    python .ci/layers.py [ROOT]     # exits 1 and lists each offending line
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = [
    ("base", ["placements", "mesh", "comm", "_shm", "flight", "observe", "random", "distributed",
              "validate", "errors", "_flag", "_threads", "_checkpoint_meta"]),
    ("ops", ["ops", "autograd"]),
    ("tensor", ["tensor", "_einsum"]),
    ("dtensor", ["dtensor", "redistribute", "sharding", "tracer", "graph", "creation"]),
    ("nn/optim", ["nn", "optim", "debug", "profiler"]),
    ("parallel", ["parallel", "checkpoint"]),
    ("compile", ["compile"]),
    ("launcher", ["launcher", "testing"]),
]
LEVEL = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
# Source folders of the subpackages that live beside dtensor/ in the repository.
SOURCES = {"dtensor": "dtensor", "dtensor.compile": "compile", "dtensor.launcher": "launcher"}


def module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    for package, folder in sorted(SOURCES.items(), key=lambda kv: -len(kv[1])):
        if rel.parts[0] == folder:
            parts = package.split(".") + list(rel.parts[1:])
            break
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(module: str) -> int | None:
    """The layer of a dtensor module (None: the package itself, or not ours)."""
    parts = module.split(".")
    if parts[0] != "dtensor" or len(parts) < 2:
        return None
    if parts[1] not in LEVEL:
        raise SystemExit(f"layers.py: {module} is in no layer; add dtensor.{parts[1]} to LAYERS.")
    return LEVEL[parts[1]]


def imports(tree: ast.AST, module: str, is_package: bool):
    """(line, imported module, imported name or None, the name it is bound to) for every
    import in ``tree``."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None, a.asname or a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                yield node.lineno, base, a.name, a.asname or a.name
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id",
              None)) == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value, None, None


def target(base: str, name: str | None) -> str:
    """The module an import reaches: ``from dtensor import nn`` reaches dtensor.nn."""
    if name is not None and base == "dtensor" and name in LEVEL:
        return f"dtensor.{name}"
    return base


def private_reads(tree: ast.AST, outside: dict) -> list:
    """(line, text) of ``alias._name`` where alias names a dtensor module outside compile/."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in outside):
            out.append((node.lineno, f"{outside[node.value.id]}.{node.attr}"))
    return out


def check(root: Path) -> list[str]:
    problems = []
    files = [p for folder in SOURCES.values() for p in sorted((root / folder).rglob("*.py"))]
    modules = {module_of(p, root) for p in files}
    for path in files:
        module = module_of(path, root)
        mine = layer(module)
        tree = ast.parse(path.read_text(), str(path))
        in_compile = module.startswith("dtensor.compile")
        aliases = {}
        for line, base, name, bound in imports(tree, module, path.name == "__init__.py"):
            reached = target(base, name)
            theirs = layer(reached)
            where = f"{path.relative_to(root)}:{line}"
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{where}: {module} ({LAYERS[mine][0]}) imports {reached} "
                                f"({LAYERS[theirs][0]}), a layer above it")
            outside = theirs is not None and not reached.startswith("dtensor.compile")
            if in_compile and outside and name and name.startswith("_") and name != "*":
                problems.append(f"{where}: compile/ imports the private name {name} from "
                                f"{reached}")
            # names bound to a module outside compile/: ``import dtensor.ops.nn as nnops``,
            # ``from dtensor import random`` (``import dtensor.x`` binds dtensor itself)
            bound_module = reached if name is None else f"{base}.{name}"
            if (in_compile and outside and bound and bound != "dtensor"
                    and bound_module in modules):
                aliases[bound] = bound_module
        if in_compile:
            for line, text in private_reads(tree, aliases):
                problems.append(f"{path.relative_to(root)}:{line}: compile/ reads the private "
                                f"name {text}")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    problems = check(root)
    for p in problems:
        print(p)
    print(f"layers: {len(problems)} upward or private import(s)" if problems else
          "layers: no upward import, compile/ reads no private dtensor name")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
