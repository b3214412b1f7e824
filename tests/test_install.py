"""What a non-editable install ships: every package folder of the source tree, and nothing that
setuptools would leave behind.

pyproject.toml lists its packages by hand (setuptools' discovery cannot follow the package-dir
mapping compile/ -> dtensor.compile, launcher/ -> dtensor.launcher), so a new subpackage that is
not added there works in a clone and in an editable install and is missing from a wheel (that is
how `pip install .` once lost dtensor.compile.passes). CI also builds the wheel, installs it into a
fresh venv and imports every module (.ci/run); this test catches the drift in the suite.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")

ROOT = Path(__file__).resolve().parent.parent


def _setuptools_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _source_packages() -> dict[str, Path]:
    """{dotted package name: folder} for every folder holding an __init__.py, under the names
    package-dir gives them."""
    mapped = _setuptools_config()["package-dir"]
    roots = {"dtensor": ROOT / "dtensor", **{name: ROOT / d for name, d in mapped.items()}}
    found = {}
    for name, top in roots.items():
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = Path(folder).relative_to(top).parts
                found[".".join((name, *rel))] = Path(folder)
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(_setuptools_config()["packages"])
    found = _source_packages()
    missing = sorted(set(found) - listed)
    assert not missing, (f"package folders {[str(found[m].relative_to(ROOT)) for m in missing]} "
                         f"are not installed by `pip install .`: add {missing} to "
                         "[tool.setuptools] packages in pyproject.toml")
    stale = sorted(listed - set(found))
    assert not stale, (f"pyproject.toml lists packages {stale} that have no folder with an "
                       "__init__.py; remove them from [tool.setuptools] packages")


def test_package_folders_hold_only_python_modules_and_declared_data():
    # A wheel carries the .py files of listed packages and the files their package-data
    # patterns match, so a template, C source or data file read at run time that no pattern
    # declares would be missing after `pip install .`.
    declared = _setuptools_config().get("package-data", {})
    others = sorted(str(path.relative_to(ROOT)) for name, folder in _source_packages().items()
                    for path in folder.iterdir()
                    if path.is_file() and path.suffix not in (".py", ".pyc")
                    and not any(fnmatch.fnmatch(path.name, pat) for pat in declared.get(name, ())))
    assert not others, (f"{others} would not be installed by `pip install .`: declare them as "
                        "[tool.setuptools.package-data] in pyproject.toml")
