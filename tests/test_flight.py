"""The flight recorder and dtlaunch's hang report: planted hangs and mismatches on real ranks.

Each case plants one bug in a real dtlaunch job with DTENSOR_WATCHDOG_S set to a few seconds,
and checks that the job ends soon after the watchdog fires with exit status 124 and a report
that names the collective (kind, sequence number), the user's source line, and the rank that
never arrived or called something else (its own line, or where it is now).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_launcher import DTLAUNCH, _kill_survivors, assert_no_orphans, dtlaunch

from dtensor.launcher.hang import diagnose

pytestmark = pytest.mark.timeout(120)
WATCHDOG = 3.0
START = 15.0  # dtlaunch, 4 ranks importing dtensor on a loaded 2-core machine: a generous bound


def line_of(source: str, text: str) -> int:
    """The script line holding ``text`` (what the report must name)."""
    return next(i for i, line in enumerate(textwrap.dedent(source).splitlines(), 1)
                if text in line)


PLANTED = [
    pytest.param("""
        import time
        import numpy as np
        from dtensor.comm import get_world

        w = get_world()
        x = np.ones((4, 8), np.float32)
        w.all_reduce(x)
        if w.rank != 1:
            w.all_reduce(x)  # STUCK
        else:
            time.sleep(100)  # WHERE
    """, "all_reduce #2 (4, 8) float32 on ranks [0, 1, 2, 3]", ["rank 1 never arrived"],
        id="skip-then-sleep"),
    pytest.param("""
        import numpy as np
        from dtensor.comm import get_world

        w = get_world()
        w.barrier()
        if w.rank == 2:
            w.all_gather(np.ones((4, 8), np.float32))  # WHERE
        else:
            w.all_reduce(np.ones((4, 8), np.float32))  # STUCK
    """, "all_reduce #2 (4, 8) float32 on ranks [0, 1, 2, 3]",
        ["mismatch: rank 2 called all_gather #2 (4, 8)", "mismatched collective #2"],
        id="different-collective"),
    pytest.param("""
        import time
        import numpy as np
        import dtensor
        from dtensor import Replicate, Shard

        mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = dtensor.distribute_tensor(np.ones((8, 4), np.float32), mesh, [Replicate(), Shard(0)])
        if mesh.get_rank() != 3:
            x.full_tensor()  # STUCK
        else:
            time.sleep(100)  # WHERE
    """, "all_gather #1 (4, 4) float32 on ranks [2, 3]",
        ["placements [R, S(0)] -> [R, R]", "rank 3 never arrived"], id="dtensor-tp-group"),
    pytest.param("""
        import numpy as np
        from dtensor.comm import get_world

        w = get_world()
        w.all_reduce(np.ones(3))
        for step in range(2 if w.rank == 0 else 3):
            w.all_reduce(np.ones(3))  # STUCK
        if w.rank == 0:
            w.barrier()  # WHERE
    """, "all_reduce #4 (3,) float64 on ranks [0, 1, 2, 3]",
        ["mismatch: rank 0 called barrier #4"], id="one-step-short"),
]


@pytest.mark.parametrize("source, stuck, named", PLANTED)
def test_a_planted_hang_ends_soon_after_the_watchdog_naming_call_line_and_rank(
        tmp_path: Path, source: str, stuck: str, named: list[str]) -> None:
    status, out, seconds, script = dtlaunch(tmp_path, source, "--nproc", "4",
                                            env={"DTENSOR_WATCHDOG_S": str(WATCHDOG)})
    last = out.rstrip("\n").splitlines()[-1]
    assert status == 124 and "job failed: hang in" in last, (status, out)
    assert f"waiting in {stuck} at {script}:{line_of(source, '# STUCK')}" in out, out
    where = f"{script}:{line_of(source, '# WHERE')}"
    for text in named:
        assert text in out, (text, out)
    # the other rank is shown where it is: its waiting call, or its stack's frame
    assert where in out or f'File "{script}", line {line_of(source, "# WHERE")}' in out, out
    # the watchdog fires WATCHDOG s into the wait; the job ends within 15 s of that
    after = float(out.split("diagnosed ")[1].split(" s later")[0])
    assert after < 10 and seconds < START + WATCHDOG + 15, (after, seconds, out)
    assert_no_orphans(script)


@pytest.mark.parametrize("call, shapes", [
    ("w.all_gather(np.ones((2 if w.rank == 1 else 3, 4), np.float32))", ("(3, 4)", "(2, 4)")),
    ("w.all_reduce(np.ones(100000 if w.rank == 1 else 1000, np.float32))",
     ("(1000,)", "(100000,)")),
    ("w.reduce_scatter(np.ones((8 if w.rank == 1 else 16, 4), np.float32))",
     ("(16, 4)", "(8, 4)")),
])
def test_a_planted_shape_mismatch_names_every_rank_s_call_and_line(
        tmp_path: Path, call: str, shapes: tuple) -> None:
    """MPI ends these itself (a truncated message), before any watchdog: as a CollectiveError
    on the rank that saw it, or by aborting that rank from inside MPI (MPICH chooses by its
    algorithm for the sizes). Either way the ranks' disk rings tell dtlaunch who called what."""
    source = f"""
        import numpy as np
        from dtensor.comm import get_world

        w = get_world()
        w.barrier()
        {call}  # CALL
    """
    status, out, seconds, script = dtlaunch(tmp_path, source, "--nproc", "4",
                                            env={"DTENSOR_WATCHDOG_S": str(WATCHDOG)})
    site = f"at {script}:{line_of(source, '# CALL')}"
    kind = call.split("(")[0].split(".")[1]
    assert status != 0 and seconds < START + 15, (status, seconds, out)
    assert f"ranks 0, 2, 3 called {kind} #2 {shapes[0]} float32 on ranks [0, 1, 2, 3] " \
        f"{site}" in out, out
    assert f"rank 1 called {kind} #2 {shapes[1]} float32 on ranks [0, 1, 2, 3] {site}" in out, out
    assert "same shape and dtype" in out, out
    assert_no_orphans(script)


@pytest.mark.ranks(2, timeout=60)
def test_an_mpi_error_in_a_collective_is_a_collective_error_naming_the_call(rank) -> None:
    """MPI returns some mismatches (a truncated message) as an error, and aborts on others on
    its own (which ones depends on MPICH's algorithm for the sizes): the ones it returns are
    raised naming the call and the fix."""
    from mpi4py import MPI

    from dtensor.comm import Comm, get_world
    from dtensor.errors import CollectiveError
    comm = get_world()

    def all_gather():  # as a collective method calls it: the site is its caller's line
        return comm._record("all_gather", (2, 4), 32, np.dtype(np.float32))

    entry = all_gather()

    def truncated(*args):
        raise MPI.Exception(MPI.ERR_TRUNCATE)

    with pytest.raises(CollectiveError, match=r"MPI failed all_gather #\d+ \(2, 4\) float32 on "
                       r"ranks \[0, 1\] at .*test_flight.py:\d+: Message truncated -- .*shape "
                       r"mismatch"):
        Comm._blocking(entry, truncated)
    assert entry.end is None  # a failed collective stays unfinished in the ring


def test_sigusr1_to_dtlaunch_dumps_every_rank_and_ends_the_job(tmp_path: Path) -> None:
    source = """
        import time
        import numpy as np
        from dtensor.comm import get_world

        w = get_world()
        w.all_reduce(np.ones(2))
        print("ready", flush=True)
        if w.rank == 0:
            time.sleep(100)  # rank 0 computes for a long time
        w.barrier()
    """
    script = tmp_path / "job_script.py"
    script.write_text(source.replace("\n        ", "\n"))
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(DTLAUNCH), "--nproc", "2", str(script)], stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while log.read_text().count("] ready") < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            proc.send_signal(signal.SIGUSR1)
            status = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                _kill_survivors(script)
    text = log.read_text()
    assert status == 124, text
    assert "SIGUSR1" in text and f"waiting in barrier #2 () uint8 on ranks [0, 1] at " \
        f"{script}:{line_of(source, 'w.barrier()')}" in text, text
    assert "rank 0 never arrived" in text and "time.sleep(100)" in text, text
    assert_no_orphans(script)


def test_outside_dtlaunch_a_rank_prints_its_own_report_and_exits(tmp_path: Path) -> None:
    from dtensor.launcher.job import find_mpiexec
    script = tmp_path / "job_script.py"
    script.write_text("import time\nimport numpy as np\nfrom dtensor.comm import get_world\n"
                      "w = get_world()\nif w.rank == 0:\n    w.all_reduce(np.ones(5))\n"
                      "else:\n    time.sleep(60)\n")
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_LAUNCH")}
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60,
                          env={**env, "DTENSOR_WATCHDOG_S": "2"})
    assert proc.returncode != 0 and time.monotonic() - start < 40, proc
    assert ("rank 0" in proc.stderr and f"waiting in all_reduce #1 (5,) float64 on ranks "
            f"[0, 1] at {script}:6" in proc.stderr), proc.stderr
    assert_no_orphans(script)


def _entry(seq, kind="all_reduce", group=(0, 1, 2), shape=(4,), site="t.py:1", end=None):
    return {"seq": seq, "kind": kind, "group": list(group), "shape": list(shape),
            "dtype": "float32", "bytes": 16, "site": site, "cause": None, "start": seq,
            "end": end}


def _report(rank, waiting, ring, stack="  File t.py, line 9\n"):
    return {"rank": rank, "host": "h", "pid": rank, "why": "watchdog", "time": 0,
            "waiting": waiting, "ring": ring, "stack": stack}


@pytest.mark.parametrize("reports, done, expect", [
    # rank 2 sits at an earlier collective of the group: a different place in the sequence
    ({0: _report(0, _entry(3), [_entry(3)]), 1: _report(1, _entry(3), [_entry(3)]),
      2: _report(2, _entry(2, site="t.py:7"), [_entry(2, site="t.py:7")])}, [],
     ["ranks 0, 1 waiting in all_reduce #3", "rank 2 is at a different place",
      "rank 2 in all_reduce #2 at t.py:7"]),
    # rank 2 waits in another group's collective
    ({0: _report(0, _entry(3, group=(0, 2)), []), 2: _report(2, _entry(5, group=(2, 3)), [])},
     [], ["rank 2 never arrived: it waits in another group's all_reduce #5"]),
    # the same place, another shape
    ({0: _report(0, _entry(3, group=(0, 1)), []),
      1: _report(1, _entry(3, group=(0, 1), shape=(8,), site="t.py:4"), [])}, [],
     ["mismatch: rank 1 called all_reduce #3 (8,)", "mismatched collective #3"]),
    # a rank whose script ended, and one that wrote nothing
    ({0: _report(0, _entry(5), [])}, [1],
     ["rank 1 never arrived: its script had ended", "rank 2 never arrived and wrote no"]),
])
def test_diagnosis_table(reports, done, expect) -> None:
    text = diagnose(reports, done, {2: "  (stack)\n"}, 124)
    for e in expect:
        assert e in text, (e, text)
    assert text.rstrip().splitlines()[-1].endswith("exit status 124"), text


def test_an_unfinished_wait_is_the_only_time_the_watchdog_fires(tmp_path: Path) -> None:
    """Ranks that wait for a computing peer, in a loop of short collectives, are healthy."""
    status, out, _, _ = dtlaunch(tmp_path, """
        import time
        import numpy as np
        from dtensor.comm import get_world

        w = get_world()
        for step in range(12):  # rank 1 waits 0.5 s at each, 6 s in all
            w.all_reduce(np.ones(3))
            time.sleep(0.5 if w.rank == 0 else 0.0)
        print("done")
    """, "--nproc", "2", env={"DTENSOR_WATCHDOG_S": "2"})
    assert status == 0 and out.count("] done") == 2, (status, out)
