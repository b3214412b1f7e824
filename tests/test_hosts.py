"""Jobs over several hosts, on simulated hosts (dtensor.testing.hosts: network namespaces on
this machine, each with its own address and hostname, reached by hydra as over ssh).

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dtensor.testing.hosts import Unavailable, simulated_hosts

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
DTLAUNCH = [sys.executable, "-m", "dtensor.launcher"]


@pytest.fixture(scope="module")
def hosts():
    try:
        with simulated_hosts(2, slots=2) as made:
            yield made
    except Unavailable as e:
        pytest.skip(f"no simulated hosts here: {e}")


def launch(args, hosts=None, timeout=240):
    cmd = [*DTLAUNCH, *(hosts.dtlaunch_args() if hosts else []), *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(hosts.env if hosts else {})})
    return out.returncode, out.stdout + out.stderr


def script(tmp_path: Path, source: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


@pytest.mark.parametrize("count", [["--nproc", "4"], ["--nnodes", "2", "--nproc_per_node", "2"]],
                         ids=["nproc", "torchrun-nnodes"])
def test_each_host_has_its_local_ranks_threads_and_output_prefix(hosts, tmp_path, count):
    rc, out = launch([*count, script(tmp_path, """
        import os, socket
        from dtensor.comm import get_world
        get_world().barrier()
        print("ENV", os.environ["RANK"], os.environ["LOCAL_RANK"],
              os.environ["LOCAL_WORLD_SIZE"], socket.gethostname(),
              os.environ["OMP_NUM_THREADS"], flush=True)
    """)], hosts)
    assert rc == 0, out
    seen = {int(m[0]): m for m in re.findall(
        r"\[rank(\d)@([\d.]+)\] ENV (\d) (\d) (\d) (\S+) (\d+)", out)}
    assert sorted(seen) == [0, 1, 2, 3], out
    cores = len(os.sched_getaffinity(0))
    for rank, (_, addr, env_rank, local, local_size, name, threads) in seen.items():
        host = rank // 2  # two ranks a host, host-major
        assert addr == hosts.addresses[host] and name == hosts.names[host], out
        assert (int(env_rank), int(local), int(local_size)) == (rank, rank % 2, 2), out
        assert int(threads) == max(1, cores // 2), out  # the host's cores over its ranks


def test_the_mesh_knows_its_hosts_and_keeps_tp_inside_one(hosts, tmp_path):
    rc, out = launch(["--nproc", "4", script(tmp_path, """
        import warnings
        import dtensor
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            wide = dtensor.init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
        if mesh.get_rank() == 0:
            print("HOSTS", mesh.hosts().tolist(), flush=True)
            print("WARN", [str(w.message) for w in caught], flush=True)
    """)], hosts)
    assert rc == 0, out
    grid = eval(re.search(r"HOSTS (.*)", out)[1])
    assert grid == [[hosts.names[0]] * 2, [hosts.names[1]] * 2], out  # each tp row: one host
    warned = re.search(r"WARN (.*)", out)[1]
    assert warned.count("span hosts") == 1 and "mesh_shape (2, 2)" in warned, out


SMALL = ["--steps", "6", "--eval-every", "0", "--sample-chars", "0", "--corpus-chars", "200000",
         "--n-layer", "2", "--n-embd", "64", "--log-every", "1"]


def losses(text):
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)  lr", text)]


def test_two_hosts_dp2_tp2_train_to_the_one_host_losses(hosts):
    layout = ["--nproc", "4", "examples/train.py", *SMALL, "--dp", "2", "--tp", "2"]
    rc, one = launch(layout)
    assert rc == 0, one[-3000:]
    rc, two = launch(layout, hosts)
    assert rc == 0, two[-3000:]
    assert losses(one) and losses(two) == pytest.approx(losses(one), rel=1e-5, abs=0), (one, two)
    assert f"[rank0@{hosts.addresses[0]}] mesh: dp=2 x tp=2" in two, two[-2000:]


def slurm_env(hosts) -> dict:
    """A faked Slurm allocation of the simulated hosts, two tasks each."""
    prefix = hosts.addresses[0].rsplit(".", 1)[0]
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"{prefix}.[1-2]",
            "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4"}


def test_a_slurm_allocation_runs_train_py_with_no_host_arguments(hosts):
    reach = ["--launcher", "ssh", "--launcher-exec", hosts.launcher_exec, "--iface", hosts.iface]
    cmd = [*DTLAUNCH, *reach, "examples/train.py", *SMALL[:1], "20", *SMALL[2:]]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, **hosts.env, **slurm_env(hosts)})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert (f"running in a Slurm allocation: 2 host(s), {hosts.addresses[0]}:2, "
            f"{hosts.addresses[1]}:2; 4 rank(s)") in text, text[-3000:]
    assert f"[rank0@{hosts.addresses[0]}] mesh: dp=2 x tp=2" in text, text[-3000:]
    assert len(losses(text)) == 20, text[-3000:]
    too_many = subprocess.run([*cmd[:len(DTLAUNCH)], "--nproc", "5", *cmd[len(DTLAUNCH):]],
                              cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, **slurm_env(hosts)})
    assert too_many.returncode == 2 and "--nproc 5 but the Slurm allocation holds 4 ranks" in \
        too_many.stderr, too_many.stderr


@pytest.mark.parametrize("env, hosts_slots", [
    ({"SLURM_JOB_NODELIST": "node[01-03,7],gpu5", "SLURM_TASKS_PER_NODE": "2(x3),1,4"},
     [("node01", 2), ("node02", 2), ("node03", 2), ("node7", 1), ("gpu5", 4)]),
    ({"SLURM_NODELIST": "a[1-2]", "SLURM_NTASKS_PER_NODE": "3"}, [("a1", 3), ("a2", 3)]),
    ({"SLURM_JOB_NODELIST": "solo"}, [("solo", 1)]),
    ({"PBS_NODEFILE": "{nodefile}"}, [("n1", 2), ("n2", 1)]),
    ({}, None),
])
def test_allocations_read_from_the_scheduler_environment(tmp_path, env, hosts_slots):
    from dtensor.launcher.allocation import from_env
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\n")
    found = from_env({k: v.format(nodefile=nodefile) for k, v in env.items()})
    assert (None if found is None else list(found.hosts)) == hosts_slots


def link_bytes(hosts) -> int:
    """Bytes both ways over every simulated host's link so far."""
    total = 0
    for veth in hosts._veths:
        for way in ("rx_bytes", "tx_bytes"):
            total += int(Path(f"/sys/class/net/{veth}/statistics/{way}").read_text())
    return total


def test_tp_collectives_stay_inside_hosts_and_only_dp_crosses_the_link(hosts, tmp_path):
    job = script(tmp_path, """
        import sys
        import numpy as np
        import dtensor
        from dtensor.debug import CommDebugMode
        mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        group = mesh.get_group(sys.argv[1])
        x = np.ones(1 << 20, np.float32)  # 4 MB
        with CommDebugMode() as log:
            for _ in range(10):
                group.all_reduce(x)
        hosts = mesh.hosts()
        if mesh.get_rank() == 0:
            print("GROUPS", sorted({tuple(e.group) for e in log.events}), flush=True)
        print("SPANS", sys.argv[1], len({str(hosts.reshape(-1)[r]) for r in group.ranks}),
              flush=True)
    """)
    crossed = {}
    for dim in ("tp", "dp"):
        before = link_bytes(hosts)
        rc, out = launch(["--nproc", "4", job, dim], hosts)
        assert rc == 0, out
        crossed[dim] = link_bytes(hosts) - before
        spans = set(re.findall(rf"SPANS {dim} (\d)", out))
        assert spans == {"1" if dim == "tp" else "2"}, out  # a tp group: one host
    # ten 4 MB all-reduces between the hosts move at least 40 MB over the links (each link
    # counted once per direction); tp's stay inside their hosts: only start-up traffic crosses
    assert crossed["dp"] > 40e6, crossed
    assert crossed["tp"] < 4e6, crossed


def test_a_host_whose_link_goes_down_ends_the_job_naming_it(tmp_path):
    """Its own hosts: the link comes down in the middle, and the fixture's must stay up."""
    import threading
    import time
    try:
        made = simulated_hosts(2, slots=2)
        hosts = made.__enter__()
    except Unavailable as e:
        pytest.skip(f"no simulated hosts here: {e}")
    try:
        cmd = [*DTLAUNCH, *hosts.dtlaunch_args(), "--nproc", "4", "examples/train.py",
               *SMALL[:1], "100000", *SMALL[2:], "--dp", "2", "--tp", "2"]
        log = tmp_path / "out.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **hosts.env})
            deadline = time.monotonic() + 120
            while "step     1 " not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)  # training runs over both hosts
            assert proc.poll() is None, log.read_text()
            threading.Timer(0, hosts.link, (1, False)).start()
            down = time.monotonic()
            status = proc.wait(timeout=60)
            took = time.monotonic() - down
        text = log.read_text()
        assert status != 0 and took < 30, (status, took, text[-2000:])
        assert f"job failed: lost host {hosts.addresses[1]} (ranks 2, 3)" in text, text[-2000:]
        left = [p for p in os.listdir("/proc") if p.isdigit() and "examples/train.py" in
                Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                and hosts.launcher_exec not in Path(f"/proc/{p}/cmdline").read_bytes().decode(
                    errors="replace") and int(p) != os.getpid()]
        assert not left, f"processes of the job survived it: {left}"
    finally:
        made.__exit__(None, None, None)


def test_a_host_that_never_answered_is_never_taken_for_lost():
    """A firewall that drops packets to closed ports looks like a dead link: only a host seen
    answering before can be lost."""
    import time

    from dtensor.launcher.hang import HostProbe

    class Probe(HostProbe):
        up = {"a": True, "b": False}  # b: behind such a firewall

        def _knock(self, host):
            return self.up[host]

    probe = Probe(["a", "b"], every=0.05)
    try:
        time.sleep(0.3)
        assert set(probe.answered) == {"a"} and probe.lost(0.2) == {}
        Probe.up["a"] = False  # a's link goes down
        time.sleep(0.5)
        assert set(probe.lost(0.2)) == {"a"}
    finally:
        probe.close()


def test_a_failing_rank_is_named_with_its_host(hosts, tmp_path):
    rc, out = launch(["--nproc", "4", script(tmp_path, """
        from dtensor.comm import get_world
        w = get_world()
        w.barrier()
        if w.rank == 3:
            raise ValueError("bad shard")
        w.barrier()
    """)], hosts)
    last = out.rstrip().splitlines()[-1]
    assert rc != 0 and f"rank 3 raised ValueError on host {hosts.names[1]}" in last, out[-2000:]


def test_a_checkpoint_saved_across_hosts_resumes_on_one_host(hosts, tmp_path):
    save = ["--save-every", "6", "--save-dir", str(tmp_path / "ckpt")]
    layout = ["--nproc", "4", "examples/train.py", *SMALL, "--dp", "2", "--tp", "2"]
    rc, first = launch([*layout, *save], hosts)  # six steps on two hosts, saved at the end
    assert rc == 0, first[-3000:]
    longer = [a if a != "6" else "9" for a in layout]
    rc, resumed = launch([*longer, "--resume", str(tmp_path / "ckpt")])  # three more, one host
    assert rc == 0, resumed[-3000:]
    rc, straight = launch(longer)  # nine in one go, one host
    assert rc == 0, straight[-3000:]
    assert losses(resumed) and losses(resumed) == losses(straight)[-len(losses(resumed)):], (
        losses(resumed), losses(straight))
