"""dtlaunch under torchrun's spellings: --nproc_per_node, --nnodes + --hostfile, -m, --standalone,
no count at all (one rank per usable core), and the errors of counts that disagree.

Jobs are real mpiexec runs; usage errors are decided before mpiexec starts, so those cases call
``main`` in this process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dtensor.launcher import main
from dtensor.launcher.bootstrap import available_cores
from dtensor.launcher.cli import _layout, _parser

pytestmark = pytest.mark.timeout(120)
DTLAUNCH = Path(sys.executable).parent / "dtlaunch"
CORES = available_cores()

# Every rank prints what torchrun's users look at; the Allreduce shows the ranks form one world.
PROBE = """
    import os, sys
    import numpy as np
    from mpi4py import MPI

    total = np.zeros(1)
    MPI.COMM_WORLD.Allreduce(np.ones(1), total)
    print(f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} MPI={total[0]:g} "
          f"NAME={__name__} ARGV0={os.path.basename(sys.argv[0])} ARGS={sys.argv[1:]} "
          f"PATH0={sys.path[0]}")
"""


@pytest.fixture
def job(tmp_path: Path) -> dict[str, Path]:
    """A script, the same code as module ``tools.probe`` on PYTHONPATH (not in the working
    directory, which is ``cwd``), and a one-host hydra hostfile."""
    package = tmp_path / "lib" / "tools"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(textwrap.dedent(PROBE))
    script = tmp_path / "probe_script.py"
    script.write_text(textwrap.dedent(PROBE))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return {"script": script, "lib": tmp_path / "lib", "hostfile": hostfile, "cwd": cwd}


def dtlaunch(job: dict[str, Path], *opts: str) -> tuple[int, str, str]:
    """Run dtlaunch in ``job['cwd']`` with the module's folder on PYTHONPATH; (status, stdout,
    stderr). Output goes to files: a leftover rank holding a pipe would hang the test."""
    out, err = job["cwd"] / "out.txt", job["cwd"] / "err.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(job["lib"]), os.environ.get("PYTHONPATH")]))}
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([str(DTLAUNCH), *opts], stdout=o, stderr=e, cwd=job["cwd"],
                                env=env)
        try:
            status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"dtlaunch {' '.join(opts)} did not end within 60 s:\n{err.read_text()}")
    return status, out.read_text(), err.read_text()


def probe_lines(world: int, args: list[str], argv0: str, path0: Path) -> set[str]:
    return {f"[rank{r}] RANK={r} WORLD_SIZE={world} MPI={world:g} NAME=__main__ ARGV0={argv0} "
            f"ARGS={args} PATH0={path0}" for r in range(world)}


def test_dash_m_runs_a_module_as_main_on_every_rank_with_its_args(job: dict[str, Path]) -> None:
    status, out, err = dtlaunch(job, "--nproc", "2", "-m", "tools.probe", "--lr", "3", "-x")
    # as `python -m tools.probe --lr 3 -x` would: argv[0] the module's file, cwd first on the path
    assert status == 0, err
    assert set(out.splitlines()) == probe_lines(2, ["--lr", "3", "-x"], "probe.py", job["cwd"])


NOTE = "dtlaunch: no --nproc given; using {n} ranks (one per usable core)\n"
IGNORED = ("dtlaunch: ignoring --master_addr, --master_port: MPI's process manager connects the "
           "ranks (for several nodes pass --hostfile and --nnodes, and run dtlaunch once)\n")


@pytest.mark.parametrize("opts, world, note", [
    (["--nproc_per_node", "2"], 2, ""),
    (["--nproc-per-node", "auto", "--standalone"], CORES, ""),
    (["--nnodes", "1", "--nproc_per_node", "2", "--hostfile", "{hostfile}"], 2, ""),
    ([], CORES, NOTE.format(n=CORES)),
    (["-n", "1", "--master_addr", "10.0.0.1", "--master-port", "29500"], 1, IGNORED),
], ids=["nproc_per_node", "auto+standalone", "nnodes+hostfile", "no count", "master_addr"])
def test_torchrun_counts_start_that_many_ranks(job: dict[str, Path], opts: list[str], world: int,
                                              note: str) -> None:
    opts = [o.format(hostfile=job["hostfile"]) for o in opts]
    status, out, err = dtlaunch(job, *opts, str(job["script"]))
    assert status == 0, err
    assert set(out.splitlines()) == probe_lines(world, [], job["script"].name, job["cwd"].parent)
    assert err == note


def _hosts(tmp_path: Path, *names: str) -> str:
    path = tmp_path / f"hosts{len(names)}"
    path.write_text("".join(f"{n}:4\n" for n in names) + "# a comment\n\n")
    return str(path)


@pytest.mark.parametrize("opts, nproc, per_node", [
    (["--nproc_per_node", "3"], 3, None),
    (["--nproc", "4", "--nnodes", "2", "--nproc_per_node", "2", "--hostfile", "2"], 4, 2),
    (["--nnodes", "2", "--nproc_per_node", "3", "--hostfile", "2"], 6, 3),
    (["--nnodes", "2:2", "--nproc", "4", "--hostfile", "3"], 4, 2),
    (["--nproc", "4", "--hostfile", "2"], 4, None),  # hydra's slots place them, as before
    (["--nnodes", "2", "--hostfile", "2"], 2 * CORES, CORES),
])
def test_nnodes_puts_nproc_per_node_ranks_on_each_host(tmp_path: Path, opts: list[str],
                                                       nproc: int, per_node: int | None) -> None:
    # Two real hosts are not available to a test: this checks the size and hydra's -ppn that
    # dtlaunch passes (`--nnodes 2 --nproc_per_node 2` gave ranks 0,1 | 2,3 on two host names).
    hosts = {"2": _hosts(tmp_path, "a", "b"), "3": _hosts(tmp_path, "a", "b", "c")}
    opts = [hosts.get(o, o) if i and opts[i - 1] == "--hostfile" else o
            for i, o in enumerate(opts)]
    size = _layout(_parser().parse_args([*opts, "x.py"]))
    assert (size.nproc, size.per_node) == (nproc, per_node)


@pytest.mark.parametrize("opts, words", [
    (["--nproc", "2", "--nproc_per_node", "4"], ["--nproc 2", "--nproc_per_node 4", "disagree",
                                                 "1 node(s) x 4 = 4"]),
    (["-n", "3", "--nnodes", "1", "--nproc-per-node", "2"], ["--nproc 3", "--nproc_per_node 2"]),
    (["--nproc_per_node", "0"], ["--nproc_per_node must be a positive number, got 0"]),
    (["--nproc_per_node", "many"], ["--nproc_per_node", "got many"]),
    (["--nnodes", "2"], ["--nnodes 2 needs a --hostfile"]),
    (["--nnodes", "2", "--hostfile", "{hostfile}"], ["--nnodes 2", "lists 1 host(s) (localhost)",
                                                     "--nnodes 1"]),
    (["--nnodes", "1:4"], ["--nnodes 1:4", "elastic", "fixed number"]),
    (["--nnodes", "2", "--nproc", "3", "--hostfile", "{hostfile2}"], ["--nproc 3", "evenly",
                                                                      "--nnodes 2"]),
    (["--nproc", "2", "--node_rank", "1"], ["--node_rank 1", "run it once"]),
    (["--nproc", "2", "-m", "no_such_module_here"], ["no module named 'no_such_module_here'",
                                                     "PYTHONPATH"]),
    (["--nproc", "2", "-m", "probe_script.py"], ["-m 'probe_script.py' is not a module name",
                                                 "drop -m"]),
], ids=["nproc vs per_node", "nproc vs nnodes x per_node", "zero", "not a number",
        "nnodes without hostfile", "fewer hosts", "elastic", "uneven", "node_rank", "no module",
        "a path"])
def test_conflicting_or_impossible_counts_are_errors_naming_the_values(
        job: dict[str, Path], capsys: pytest.CaptureFixture[str], opts: list[str],
        words: list[str]) -> None:
    opts = [o.format(hostfile=job["hostfile"], hostfile2=_hosts(job["cwd"], "a", "b"))
            for o in opts]
    script = [] if "-m" in opts else [str(job["script"])]
    assert main([*opts, *script]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtlaunch: error: ") and all(w in err for w in words), err


def test_help_shows_torchrun_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for words in ["--nproc_per_node N|auto, --nproc-per-node N|auto", "--nnodes N",
                  "-m, --module", "--standalone", "--master_addr, --master_port and --rdzv_*",
                  "one per usable core"]:
        assert words in " ".join(out.split()), out
