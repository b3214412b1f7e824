"""README.md's code runs as written: every ```python block, and every file a ```bash block names.

A block runs alone, as a reader pastes it: in a fresh interpreter with the temporary folder as its
working directory (a checkpoint lands there). A block whose first line is
``# under dtlaunch --nproc N`` runs on N real MPI ranks under the rank plugin, in a fresh
namespace on each. Either way the code is compiled under the name README.md with its README line
numbers, so a failure's traceback points at the README line that broke.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
UNDER_DTLAUNCH = re.compile(r"# under dtlaunch --nproc (\d+)$")
BLOCK_TIMEOUT = 180  # seconds; the compile block traces and generates a GPT step on a busy VM


def _blocks(language: str) -> list[tuple[int, str]]:
    """[(README line of the block's first code line, code)] for each ```language block."""
    blocks, lines = [], README.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == f"```{language}":
            start = number + 1
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(lines[start - 1:number - 1]) + "\n"))
            start = None
    assert start is None, f"README.md: the ```{language} block at line {start - 1} is not closed"
    return blocks


def _nproc(code: str) -> int | None:
    first = code.splitlines()[0] if code.strip() else ""
    if not first.startswith("# under dtlaunch"):
        return None
    match = UNDER_DTLAUNCH.match(first)
    assert match, (f"README.md: {first!r} is not a rank marker; write it as "
                   "'# under dtlaunch --nproc N'")
    return int(match[1])


def _compiled(line: int, code: str):
    # Blank lines in front give the code its README line numbers in tracebacks.
    return compile("\n" * (line - 1) + code, str(README), "exec")


def _params(multi_rank: bool) -> list:
    params = []
    for line, code in _blocks("python"):
        nproc = _nproc(code)
        if (nproc is not None) != multi_rank:
            continue
        marks = [pytest.mark.ranks(nproc, timeout=BLOCK_TIMEOUT)] if multi_rank else []
        params.append(pytest.param(line, code, id=f"README.md:{line}", marks=marks))
    return params


def test_readme_has_both_kinds_of_python_block():
    # Guards the parametrizations below against a parser that silently finds nothing.
    assert _params(multi_rank=False) and _params(multi_rank=True)


@pytest.mark.parametrize("line, code", _params(multi_rank=False))
def test_python_block_runs_in_one_process(line, code, tmp_path):
    # Compiled under README's own name and line numbers: the traceback quotes README's lines.
    runner = ("import sys, pathlib\n"
              "block, readme, first = sys.argv[1:]\n"
              "source = '\\n' * (int(first) - 1) + pathlib.Path(block).read_text()\n"
              "exec(compile(source, readme, 'exec'), {'__name__': '__main__'})\n")
    block = tmp_path / "block.py"
    block.write_text(code)
    try:
        done = subprocess.run([sys.executable, "-W", "error", "-c", runner, str(block),
                               str(README), str(line)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md line {line}: the python block ran past {BLOCK_TIMEOUT} s",
                    pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"README.md line {line}: the python block failed (exit {done.returncode}):"
                    f"\n{done.stderr}", pytrace=False)


@pytest.mark.parametrize("line, code", _params(multi_rank=True))
def test_python_block_runs_on_ranks(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        exec(_compiled(line, code), {"__name__": "__main__"})
    except Exception as exc:
        raise AssertionError(f"README.md line {line}: the python block failed on this rank: "
                             f"{type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("line, code", [pytest.param(*b, id=f"README.md:{b[0]}")
                                        for b in _blocks("bash")])
def test_bash_block_names_existing_files(line, code):
    missing = [(line + i, path) for i, text in enumerate(code.splitlines())
               for path in re.findall(r"(?<![\w/.-])([\w./-]+\.py)\b", text.split("#")[0])
               if not (ROOT / path).is_file()]
    assert not missing, (f"README.md names files that do not exist (line, path): {missing}; "
                         "fix the command or the path")
