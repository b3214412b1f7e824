"""dtlaunch and spawn against real mpiexec jobs: output, environment, failures, timeouts, orphans.

Each script lives in its own tmp_path, so "no process's command line holds the script's path"
is the test for orphans. Output goes to a file, not a pipe: a leftover rank holding a pipe open
would make the test itself hang instead of fail.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from dtensor.launcher import (RankDiedError, RankError, RankPool, RankTimeoutError,
                              apply_rank_env, spawn)
from dtensor.launcher.bootstrap import available_cores, in_mpi_call
from dtensor.launcher.job import pid_alive

pytestmark = pytest.mark.timeout(120)
DTLAUNCH = Path(sys.executable).parent / "dtlaunch"


def dtlaunch(tmp_path: Path, source: str, *opts: str, env: dict[str, str] | None = None,
             limit: float = 60) -> tuple[int, str, float, Path]:
    """Run ``dtlaunch *opts script`` on ``source``; return (status, output, seconds, script)."""
    script = tmp_path / "job_script.py"
    script.write_text(textwrap.dedent(source))
    log = tmp_path / "dtlaunch.log"
    cmd = [str(DTLAUNCH), *opts, str(script)]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        try:
            status = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            _kill_survivors(script)
            pytest.fail(f"dtlaunch {' '.join(opts)} did not end within {limit} s:\n"
                        f"{log.read_text()}")
    return status, log.read_text(), time.monotonic() - start, script


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _kill_survivors(script: Path) -> None:
    for pid in _processes_mentioning(str(script)):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def assert_no_orphans(script: Path, within: float = 3) -> None:
    deadline = time.monotonic() + within  # ranks killed by hydra take a moment to be reaped
    while (left := _processes_mentioning(str(script))) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill_survivors(script)
    assert not left, f"processes of the job survived it: {left}"


ALLREDUCE = """
    import os, sys
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    total = np.zeros(1)
    world.Allreduce(np.array([float(world.rank)]), total)
    print(f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} "
          f"LOCAL_RANK={os.environ['LOCAL_RANK']} "
          f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']} "
          f"SUM={total[0]:g} ARGS={sys.argv[1:]}")
"""


def test_four_ranks_print_their_env_with_a_rank_prefix(tmp_path: Path) -> None:
    status, out, _, _ = dtlaunch(tmp_path, ALLREDUCE, "--nproc", "4")
    assert status == 0, out
    for r in range(4):
        assert (f"[rank{r}] RANK={r} WORLD_SIZE=4 LOCAL_RANK={r} LOCAL_WORLD_SIZE=4 SUM=6 "
                "ARGS=[]") in out.splitlines(), out


def test_no_prefix_and_script_args_via_python_m(tmp_path: Path) -> None:
    script = tmp_path / "job_script.py"
    script.write_text(textwrap.dedent(ALLREDUCE))
    proc = subprocess.run([sys.executable, "-m", "dtensor.launcher", "--nproc", "2", "--no-prefix",
                           str(script), "--lr", "3"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == [f"RANK={r} WORLD_SIZE=2 LOCAL_RANK={r} LOCAL_WORLD_SIZE=2 SUM=1 "
                     "ARGS=['--lr', '3']" for r in range(2)], proc.stdout


def test_a_raising_rank_ends_the_job_and_its_traceback_is_printed_once_last(tmp_path: Path) -> None:
    status, out, seconds, script = dtlaunch(tmp_path, """
        import time
        from mpi4py import MPI

        def fail_on_rank_two():
            if MPI.COMM_WORLD.rank == 2:
                time.sleep(0.2)
                raise ValueError("rank two is broken")
            MPI.COMM_WORLD.Barrier()   # the others wait here for rank 2 forever

        fail_on_rank_two()
    """, "--nproc", "4")
    assert status != 0 and seconds < 15, (status, seconds, out)
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count('raise ValueError("rank two is broken")') == 1, out
    tail = out[out.index("Traceback (most recent call last)"):].splitlines()
    assert "ValueError: rank two is broken" in tail and "fail_on_rank_two" in "\n".join(tail)
    assert "rank 2" in tail[-1] and "ValueError" in tail[-1], tail[-1]
    assert_no_orphans(script)


def test_a_killed_rank_ends_the_job_without_orphans(tmp_path: Path) -> None:
    status, out, seconds, script = dtlaunch(tmp_path, """
        import os, time
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 1:
            time.sleep(0.2)
            os.kill(os.getpid(), 9)
        MPI.COMM_WORLD.Barrier()
    """, "--nproc", "3")
    assert status != 0 and seconds < 15, (status, seconds, out)
    assert out.splitlines()[-1].startswith("dtlaunch: job failed"), out
    assert_no_orphans(script)


def test_timeout_prints_every_rank_stack_and_exits_124(tmp_path: Path) -> None:
    status, out, seconds, script = dtlaunch(tmp_path, """
        import numpy as np
        from mpi4py import MPI

        def wait_for_a_message_never_sent():
            if MPI.COMM_WORLD.rank == 0:
                MPI.COMM_WORLD.Recv(np.zeros(1), source=1)
            MPI.COMM_WORLD.Barrier()

        wait_for_a_message_never_sent()
    """, "--nproc", "3", "--timeout", "3")
    assert status == 124 and seconds < 10, (status, seconds, out)
    sections = out.split("--- rank ")[1:]
    assert [s.split(" ", 1)[0] for s in sections] == ["0", "1", "2"], out
    for section in sections:
        assert "wait_for_a_message_never_sent" in section, out
    assert "MPI.COMM_WORLD.Recv(np.zeros(1), source=1)" in sections[0]  # source lines too
    assert_no_orphans(script)


def test_killing_dtlaunch_hard_ends_its_job(tmp_path: Path) -> None:
    script = tmp_path / "job_script.py"
    script.write_text("from mpi4py import MPI\nif MPI.COMM_WORLD.rank == 0:\n"
                      "    MPI.COMM_WORLD.recv(source=1)\nMPI.COMM_WORLD.Barrier()\n")
    launcher = subprocess.Popen([str(DTLAUNCH), "--nproc", "2", str(script)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while len(_processes_mentioning(str(script))) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)  # dtlaunch's mpiexec and both ranks are up
    launcher.kill()  # SIGKILL: dtlaunch cannot clean up; the ranks must notice by themselves
    launcher.wait()
    assert_no_orphans(script, within=8)


# A rank that finishes its script while its peers wait for it in a collective.
LEFT_EARLY = [
    pytest.param(2, """
        import sys
        import numpy as np
        from dtensor.comm import get_world

        world = get_world()
        if world.rank == 1:
            sys.exit(0)
        world.all_reduce(np.ones(3))
    """, "rank 1 called sys.exit(0)", "rank 1 finished (called sys.exit(0)) while rank 0 waited",
        "world.all_reduce(np.ones(3))", id="sys.exit(0)-during-all_reduce"),
    pytest.param(2, """
        from dtensor.comm import get_world

        world = get_world()
        if world.rank == 0:
            world.barrier()
    """, "rank 1 returned", "rank 1 finished (returned) while rank 0 waited",
        "world.barrier()", id="return-during-barrier"),
    pytest.param(3, """
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank != 2:
            MPI.COMM_WORLD.recv(source=2)
    """, "rank 2 returned", "rank 2 finished (returned) while ranks 0, 1 waited",
        "MPI.COMM_WORLD.recv(source=2)", id="mpi4py-recv-from-a-rank-that-returned"),
]


@pytest.mark.parametrize("nproc, source, first_words, last_words, call", LEFT_EARLY)
def test_a_rank_that_finishes_while_others_wait_in_mpi_ends_the_job(
        tmp_path: Path, nproc: int, source: str, first_words: str, last_words: str,
        call: str) -> None:
    status, out, seconds, script = dtlaunch(tmp_path, source, "--nproc", str(nproc),
                                            env={"DTENSOR_EXIT_GRACE": "1"})
    assert status == 1 and seconds < 30, (status, seconds, out)
    assert first_words in out and "still ran" in out, out
    assert out.count(f"    {call}") == nproc - 1, out  # every waiting rank's stack, with source
    assert last_words in out.splitlines()[-1], out
    assert_no_orphans(script)


@pytest.mark.parametrize("source", [
    pytest.param("""
        import time
        import numpy as np
        from dtensor.comm import get_world

        world = get_world()
        world.all_reduce(np.ones(3))
        if world.rank == 0:
            time.sleep(3)  # e.g. writing a checkpoint while the others have finished
            print("rank 0 done")
    """, id="sleep"),
    pytest.param("""
        import threading
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 0:
            threading.Event().wait(3)  # blocked, but not in MPI
            print("rank 0 done")
    """, id="event-wait"),
])
def test_a_rank_finishing_seconds_after_the_others_is_a_healthy_job(tmp_path: Path,
                                                                     source: str) -> None:
    status, out, _, _ = dtlaunch(tmp_path, source, "--nproc", "2",
                                 env={"DTENSOR_EXIT_GRACE": "0.5"})
    assert status == 0 and "[rank0] rank 0 done" in out, (status, out)


@pytest.mark.parametrize("file, line, waits", [
    ("/x/dtensor/comm.py", "req = call(x, out, op=mpi_op)", True),  # any line of dtensor's comm
    ("/x/dtensor/tensor.py", "req = call(x, out, op=mpi_op)", False),
    ("a.py", "req = (self._c.Iallgather if async_op else self._c.Allgather)(x, out)", True),
]
    + [("a.py", line, waits) for line, waits in [
    ("self._c.Allreduce(send, out, op=mpi_op)", True),
    ("MPI.COMM_WORLD.Barrier()", True),
    ("data = comm.recv(source=1)", True),
    ("MPI.Request.Waitall(reqs)", True),
    ("self._req.Wait()", True),
    ("comm.bcast(obj, root=0)", True),
    ("proc.wait(timeout=3)", False),  # common lower-case names outside MPI are not waits
    ("np.add.reduce(x, axis=0)", False),
    ("message = conn.recv_bytes()", False),
    ("results = asyncio.gather(*tasks)", False),
    ("time.sleep(1)", False),
]])
def test_which_source_lines_count_as_waiting_in_mpi(file: str, line: str, waits: bool) -> None:
    assert in_mpi_call(file, line) == waits


# Every rank alive, each waiting in a collective the others never join.
DEADLOCKS = [
    pytest.param("""
        import dtensor
        from dtensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        d = distribute_tensor(dtensor.arange(8.0), mesh, [Shard(0)])
        if mesh.get_coordinate()[0] == 0:
            d.full_tensor()  # all_gather
        else:
            d.sum().full_tensor()  # all_reduce
    """, ["d.full_tensor()", "d.sum().full_tensor()"], id="all_gather-vs-all_reduce"),
    pytest.param("""
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            MPI.COMM_WORLD.Barrier()
        else:
            MPI.COMM_WORLD.bcast("x", root=0)
    """, ["MPI.COMM_WORLD.Barrier()", 'MPI.COMM_WORLD.bcast("x", root=0)'],
        id="barrier-vs-bcast"),
    pytest.param("""
        import numpy as np
        from dtensor.comm import get_world

        world = get_world()
        for step in range(3):  # a loop of matched collectives first: progress, not a hang
            world.all_reduce(np.ones(3))
        if world.rank == 0:
            world.recv(np.zeros(1), src=1)
        world.barrier()
    """, ["world.recv(np.zeros(1), src=1)", "world.barrier()"], id="recv-vs-barrier"),
]


@pytest.mark.parametrize("source, calls", DEADLOCKS)
def test_ranks_deadlocked_in_mismatched_collectives_end_the_job_naming_each_call(
        tmp_path: Path, source: str, calls: list[str]) -> None:
    status, out, seconds, script = dtlaunch(tmp_path, source, "--nproc", "2",
                                            env={"DTENSOR_HANG_TIMEOUT": "3"})
    assert status == 1 and seconds < 20, (status, seconds, out)
    assert "different or mismatched collectives" in out and "same order" in out, out
    last = out.splitlines()[-1]
    assert "job failed: deadlock" in last, out
    for rank, call in enumerate(calls):
        assert f"rank {rank} in {script}:" in last and f": {call}" in last, (call, last)
    assert_no_orphans(script)


@pytest.mark.parametrize("source", [
    pytest.param("""
        import time
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            end = time.monotonic() + 6
            while time.monotonic() < end:  # computing while rank 1 waits
                sum(range(1000))
        MPI.COMM_WORLD.Barrier()
        print("done")
    """, id="one-rank-computes-6s"),
    pytest.param("""
        import time
        import numpy as np
        from dtensor.comm import get_world

        world = get_world()
        if world.rank == 1:
            time.sleep(5)
        world.all_reduce(np.ones(3))
        print("done")
    """, id="one-rank-sleeps-5s"),
    pytest.param("""
        import time
        import numpy as np
        from mpi4py import MPI

        end, out = time.monotonic() + 6, np.zeros(1)
        flag = np.zeros(1)
        while not flag[0]:  # every rank inside this one Allreduce line nearly all the time
            MPI.COMM_WORLD.Allreduce(np.array([float(time.monotonic() > end)]), flag)
        print("done")
    """, id="collectives-only-loop-6s"),
])
def test_healthy_jobs_are_never_taken_for_deadlocked(tmp_path: Path, source: str) -> None:
    status, out, _, _ = dtlaunch(tmp_path, source, "--nproc", "2",
                                 env={"DTENSOR_HANG_TIMEOUT": "3"})
    assert status == 0 and out.count("] done") == 2, (status, out)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text()
                                       .rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except OSError:
            continue
    return found


BOTH_WAIT = """
    import numpy as np
    from dtensor.comm import get_world

    world = get_world()
    print("ready")
    if world.rank == 0:
        world.all_reduce(np.ones(3))
    world.barrier()
"""


@pytest.mark.parametrize("stop_ranks, ranks_told", [
    (False, True),  # the ranks see their parent die, exit and say so
    (True, False),  # they cannot (stopped): dtlaunch sees mpiexec's child die
])
def test_killing_hydras_proxy_ends_the_job_naming_it(tmp_path: Path, stop_ranks: bool,
                                                      ranks_told: bool) -> None:
    script = tmp_path / "job_script.py"
    script.write_text(textwrap.dedent(BOTH_WAIT))
    log = tmp_path / "dtlaunch.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen([str(DTLAUNCH), "--nproc", "2", str(script)], stdout=out,
                                    stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while log.read_text().count("] ready") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        (mpiexec,) = _children(launcher.pid)
        (proxy,) = _children(mpiexec)
        assert Path(f"/proc/{proxy}/comm").read_text().strip() == "hydra_pmi_proxy"
        ranks = _children(proxy)
        assert len(ranks) == 2, log.read_text()
        time.sleep(0.5)  # both ranks inside their collective
        for pid in ranks if stop_ranks else []:
            os.kill(pid, signal.SIGSTOP)
        os.kill(proxy, signal.SIGKILL)
        killed = time.monotonic()
        status = launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _kill_survivors(script)
    out = log.read_text()
    assert status != 0 and time.monotonic() - killed < 15, (status, out)
    last = out.splitlines()[-1]
    assert f"hydra_pmi_proxy (pid {proxy}" in last and "died" in last, out
    assert ("parent of ranks 0, 1" in last) == ranks_told, out
    deadline = time.monotonic() + 3
    while any(map(pid_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(pid_alive, ranks)), (ranks, out)


def test_pool_reports_its_ranks_dying_with_their_proxy() -> None:
    def wait_forever() -> None:
        from mpi4py import MPI

        MPI.COMM_WORLD.recv(source=MPI.ANY_SOURCE)

    with RankPool(2, capture=True) as pool:
        ranks = pool.run(os.getpid)
        proxy = int(Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        killer = threading.Timer(1.0, os.kill, (proxy, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RankDiedError) as info:
            pool.run(wait_forever, timeout=60)
        killer.join()
        assert time.monotonic() - start < 15
        assert f"hydra_pmi_proxy (pid {proxy}) had died" in str(info.value), str(info.value)
        assert not any(map(pid_alive, ranks))
        assert pool.run(lambda: int(os.environ["RANK"])) == [0, 1]  # a new job


def test_pool_ends_a_run_whose_ranks_wait_for_one_that_returned() -> None:
    def barrier_on_rank_zero_only(seconds: float) -> int:
        import time

        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            time.sleep(seconds)  # computing, not waiting: never taken for stuck
            MPI.COMM_WORLD.Barrier()
        return MPI.COMM_WORLD.rank

    def sleep_on_rank_zero(seconds: float) -> int:
        rank = int(os.environ["RANK"])
        time.sleep(seconds if rank == 0 else 0)
        return rank

    with RankPool(2, capture=True, grace=1.0) as pool:
        assert pool.run(sleep_on_rank_zero, 3.0, timeout=60) == [0, 1]
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(barrier_on_rank_zero_only, 3.0, timeout=60)
        assert 3 <= time.monotonic() - start < 15
        assert "rank 1 of 2 returned while rank 0 still ran" in str(info.value), str(info.value)
        assert info.value.rank == 1
        assert "MPI.COMM_WORLD.Barrier()" in info.value.stacks[0]
        assert not pool.alive
        assert pool.run(lambda: int(os.environ["RANK"])) == [0, 1]  # a new job


def test_eight_ranks_on_few_cores_complete(tmp_path: Path) -> None:
    status, out, seconds, _ = dtlaunch(tmp_path, """
        import os
        import numpy as np
        from mpi4py import MPI

        a, out = np.eye(32), np.zeros(8)
        for _ in range(200):
            a = np.tanh(a @ a.T * 0.5)
            MPI.COMM_WORLD.Allreduce(a[0, :8].copy(), out)
        print("heavy_yield", os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD"))
    """, "--nproc", "8")
    assert status == 0 and seconds < 45, (status, seconds, out)
    expected = "1" if available_cores() < 8 else "None"
    assert out.count(f"heavy_yield {expected}") == 8, out


def test_thread_counts_per_rank_unless_set(tmp_path: Path) -> None:
    status, out, _, _ = dtlaunch(tmp_path, """
        import os
        print(*(os.environ.get(v) for v in
                ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")))
    """, "--nproc", "4", env={"OPENBLAS_NUM_THREADS": "3"})
    assert status == 0, out
    per_rank = str(max(1, available_cores() // 4))  # 2 cores, 4 ranks -> 1
    assert out.count(f"{per_rank} 3 {per_rank}") == 4, out


def test_rank_env_policy() -> None:
    added = apply_rank_env({}, local_ranks=4, cores=2)
    assert added["OMP_NUM_THREADS"] == added["MKL_NUM_THREADS"] == "1"
    assert added["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"  # 4 ranks > 2 cores
    env = {"OMP_NUM_THREADS": "7"}
    added = apply_rank_env(env, local_ranks=2, cores=16)
    assert env["OMP_NUM_THREADS"] == "7" and added == {"OPENBLAS_NUM_THREADS": "8",
                                                       "MKL_NUM_THREADS": "8",
                                                       "OPENBLAS_THREAD_TIMEOUT": "20"}
    assert "OPENBLAS_THREAD_TIMEOUT" not in apply_rank_env({}, local_ranks=2, cores=2)


@pytest.mark.parametrize("opts, env, words", [
    (["--nproc", "0", "x.py"], {}, ["--nproc", "got 0"]),
    (["--nproc", "2", "does_not_exist.py"], {}, ["does_not_exist.py", "does not exist"]),
    (["--nproc", "2", "--mpiexec", "/no/such/mpiexec", __file__], {}, ["/no/such/mpiexec"]),
    (["--nproc", "2", __file__], {"DTENSOR_EXIT_GRACE": "soon"}, ["DTENSOR_EXIT_GRACE='soon'"]),
    (["--nproc", "2", __file__], {"DTENSOR_EXIT_GRACE": "-1"}, ["DTENSOR_EXIT_GRACE='-1'", "inf"]),
    (["--nproc", "2", __file__], {"DTENSOR_HANG_TIMEOUT": "1m"},
     ["DTENSOR_HANG_TIMEOUT='1m'", "default 30", "inf"]),
])
def test_usage_errors_say_what_and_how_to_fix(opts: list[str], env: dict[str, str],
                                              words: list[str]) -> None:
    proc = subprocess.run([str(DTLAUNCH), *opts], capture_output=True, text=True, timeout=30,
                          check=False, env={**os.environ, **env})
    assert proc.returncode == 2 and all(w in proc.stderr for w in words), proc.stderr


def test_spawn_runs_lambdas_and_closures() -> None:
    assert spawn(lambda: int(os.environ["RANK"]) * 10, 3) == [0, 10, 20]
    offset = 5

    def allreduce_plus_offset(scale: int) -> float:
        import numpy as np
        from mpi4py import MPI

        total = np.zeros(1)
        MPI.COMM_WORLD.Allreduce(np.array([float(MPI.COMM_WORLD.rank * scale)]), total)
        return float(total[0]) + offset

    assert spawn(allreduce_plus_offset, 2, 3, timeout=30) == [8.0, 8.0]


def test_spawn_raises_rank_error_naming_the_rank() -> None:
    def fail_on_rank_one() -> int:
        rank = int(os.environ["RANK"])
        if rank == 1:
            raise KeyError("missing on rank one")
        return rank

    with pytest.raises(RankError) as info:
        spawn(fail_on_rank_one, 2, timeout=30)
    assert info.value.rank == 1
    assert "rank 1 of 2 raised KeyError" in str(info.value)
    assert "fail_on_rank_one" in info.value.traceback
    assert 'raise KeyError("missing on rank one")' in str(info.value)


def test_pool_is_reused_and_replaced_after_a_timeout() -> None:
    def stuck_unless_rank_zero() -> None:
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            MPI.COMM_WORLD.recv(source=1)

    with RankPool(2, capture=True) as pool:
        first = pool.run(os.getpid)
        assert pool.run(os.getpid) == first  # same processes: the pool was reused
        with pytest.raises(RankTimeoutError) as info:
            pool.run(stuck_unless_rank_zero, timeout=2)
        assert set(info.value.stacks) == {0, 1}
        assert "stuck_unless_rank_zero" in info.value.stacks[0]
        assert not pool.alive
        assert pool.run(lambda: int(os.environ["RANK"])) == [0, 1]  # a new job
        assert pool.run(os.getpid) != first
