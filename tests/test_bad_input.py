"""Bad input across the public API: each call raises the documented exception type with a
message holding the offending values, within 1 s, on every rank, and no rank hangs.

The table runs on 2 MPI ranks (every case on both); launcher flags run as dtlaunch commands.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest


def _cases(tmp: str):
    """[(name, call, exception type, regex the message must match)], built on this rank."""
    import dtensor
    import dtensor.nn.functional as F
    from dtensor import Partial, Replicate, Shard
    from dtensor.checkpoint import CheckpointError
    from dtensor.compile import TracingError
    from dtensor.dtensor import DTensor, distribute_tensor
    from dtensor.mesh import DeviceMesh, init_device_mesh
    from dtensor.nn import GPT, GPTConfig, Linear
    from dtensor.parallel import (ColwiseParallel, PrepareModuleInput, parallelize,
                                  parallelize_module)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    x = dtensor.randn(4, 6)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    small = dict(vocab_size=50, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8)

    def gpt(**kw):
        return GPT(GPTConfig(**{**small, **kw}))

    def compiled(fn, *args):
        return lambda: dtensor.compile(fn)(*args)

    def branchy(t):
        if t.sum() > 0:
            return t
        return -t

    import shutil
    shared = Path(tmp) / "ck"
    dtensor.checkpoint.save({"model": Linear(3, 2).state_dict()}, shared)  # collective
    ck = Path(tmp) / f"ck_rank{mesh.get_rank()}"  # each rank damages its own copy
    shutil.copytree(shared, ck)
    meta_path = ck / "v1" / "metadata.json"

    def corrupt_then_load(kind):
        def run():
            shard = ck / "v1" / "rank0.npz"
            good, meta = shard.read_bytes(), meta_path.read_text()
            try:
                if kind == "byte":  # flip one byte of the first array's data
                    with np.load(shard) as z:
                        at = good.find(z["a0"].tobytes())
                    data = bytearray(good)
                    data[at] ^= 0xFF
                    shard.write_bytes(bytes(data))
                elif kind == "truncate":
                    shard.write_bytes(good[: len(good) // 3])
                elif kind == "version":
                    m = json.loads(meta)
                    m["version"] = 7
                    meta_path.write_text(json.dumps(m))
                dtensor.checkpoint.load({"model": Linear(3, 2).state_dict()}, ck)
            finally:
                shard.write_bytes(good)
                meta_path.write_text(meta)
        return run

    return [
        # -- meshes
        ("mesh device", lambda: init_device_mesh("cuda", (2,)), ValueError, r"'cuda'"),
        ("mesh size", lambda: init_device_mesh("cpu", (3,)), ValueError,
         r"\(3,\) holds 3 ranks but this job has 2"),
        ("mesh zero dim", lambda: init_device_mesh("cpu", (0, 2)), ValueError, r"\(0, 2\)"),
        ("mesh names count", lambda: init_device_mesh("cpu", (2,), mesh_dim_names=("a", "b")),
         ValueError, r"\('a', 'b'\) has 2 names for a 1-d mesh"),
        ("mesh names repeat", lambda: init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "a")),
         ValueError, r"repeats \['a'\]"),
        ("mesh bad name", lambda: mesh2["pp"], KeyError, r"no dim named 'pp'.*dp=1, tp=2"),
        ("mesh dim range", lambda: mesh2.size(5), IndexError, r"mesh dim 5 is out of range"),
        ("mesh ranks twice", lambda: DeviceMesh("cpu", [0, 0]), ValueError,
         r"\[0, 0\] must hold each of the 2 ranks"),
        # -- placements and construction
        ("partial op", lambda: Partial("prod"), ValueError, r"'prod'"),
        ("placements count", lambda: distribute_tensor(x, mesh, [Shard(0), Shard(1)]),
         ValueError, r"got 2 placements \[S\(0\), S\(1\)\] for a 1-d mesh"),
        ("shard dim range", lambda: distribute_tensor(x, mesh, [Shard(3)]), ValueError,
         r"S\(3\) is out of range for a tensor of shape \(4, 6\)"),
        ("placement type", lambda: distribute_tensor(x, mesh, ["S0"]), TypeError, r"'S0'"),
        ("redistribute to partial", lambda: dx.redistribute(placements=[Partial()]), ValueError,
         r"redistribute to P\(sum\) \(mesh dim 0\) is not allowed"),
        ("redistribute other mesh", lambda: dx.redistribute(mesh2, [Replicate(), Replicate()]),
         NotImplementedError, r"another mesh"),
        ("from_local shape", lambda: DTensor.from_local(np.ones((3, 2)), mesh, [Shard(0)],
                                                         shape=(9, 2)),
         ValueError, r"block has shape \(3, 2\) but \[S\(0\)\] of global shape \(9, 2\)"),
        ("from_local run_check", lambda: DTensor.from_local(
            np.ones((2 + mesh.get_rank(), 2)), mesh, [Shard(0)], run_check=True),
         ValueError, r"inconsistent blocks: rank 1: local \(3, 2\)"),
        ("dtensor numpy", lambda: dx.numpy(), TypeError, r"\.full_tensor\(\)\.numpy\(\)"),
        ("mixed meshes", lambda: dx + distribute_tensor(x, mesh2, [Shard(0), Replicate()]),
         ValueError, r"different meshes"),
        ("plain with dtensor", lambda: dx + x, TypeError,
         r"plain Tensor \(shape \(4, 6\)\).*implicit_replication"),
        ("dtensor matmul shapes", lambda: dx @ dx, ValueError, r"\(4, 6\) @ \(4, 6\)"),
        ("sharded reshape", lambda: distribute_tensor(dtensor.randn(3, 4), mesh,
                                                      [Shard(0)]).reshape(12),
         ValueError, r"reshape \(3, 4\) -> \(12,\) cannot keep tensor dim 0 sharded"),
        # -- core
        ("tensor dtype", lambda: dtensor.Tensor(np.array(["a"])), TypeError, r"<U1"),
        ("backward non-scalar", lambda: dtensor.ones(2, requires_grad=True).exp().backward(),
         RuntimeError, r"got shape \(2,\)"),
        ("load_state_dict keys", lambda: Linear(2, 2).load_state_dict({"w": np.ones(2)}),
         KeyError, r"unexpected keys \['w'\]"),
        ("optimizer lr", lambda: dtensor.optim.AdamW(Linear(2, 2).parameters(), lr=-1.0),
         ValueError, r"invalid lr: -1\.0"),
        ("cross_entropy targets", lambda: F.cross_entropy(dtensor.randn(3, 4),
                                                          np.ones(3, np.float32)),
         TypeError, r"got dtype float32"),
        ("all_reduce op", lambda: dtensor.comm.get_world().all_reduce(np.ones(2), op="prod"),
         ValueError, r"unknown reduce op 'prod'"),
        # -- parallel plans
        ("plan key", lambda: parallelize_module(gpt(), mesh, {"blocks.*.mlp.fc3":
                                                              ColwiseParallel()}),
         ValueError, r"plan key 'blocks\.\*\.mlp\.fc3' matches no submodule"),
        ("plan style type", lambda: parallelize_module(gpt(), mesh, {"lm_head": "colwise"}),
         TypeError, r"'colwise' is not a ParallelStyle"),
        ("style on norm", lambda: parallelize_module(gpt(), mesh, {"ln_f": ColwiseParallel()}),
         TypeError, r"'ln_f', a LayerNorm"),
        ("prepare input lengths", lambda: PrepareModuleInput(
            input_layouts=(Shard(1), Replicate()), desired_input_layouts=(Replicate(),)),
         ValueError, r"\(S\(1\), R\).*\(R,\)"),
        ("parallelize heads", lambda: parallelize(gpt(n_head=3, n_embd=15), mesh), ValueError,
         r"tp=2 does not divide n_head=3"),
        ("parallelize 3-D", lambda: parallelize(gpt(), init_device_mesh(
            "cpu", (1, 1, 2), mesh_dim_names=("dp", "tp", "pp"))), ValueError,
         r"got a 3-D mesh \(dp=1, tp=1, pp=2\)"),
        ("parallelize names", lambda: parallelize(gpt(), init_device_mesh("cpu", (1, 2))),
         ValueError, r"needs dims named 'dp' and 'tp', got \(0=1, 1=2\)"),
        ("parallelize fsdp", lambda: parallelize(gpt(), mesh, fsdp=True), ValueError,
         r"mesh \(tp=2\) has none"),
        ("parallelize model", lambda: parallelize(Linear(2, 2), mesh), TypeError,
         r"Linear is not one"),
        # -- compile
        ("compile branch", compiled(branchy, dtensor.ones(2)), TracingError,
         r"bool\(tensor\).*test_bad_input\.py:\d+: if t\.sum\(\) > 0"),
        ("compile item", compiled(lambda t: t.sum().item(), dtensor.ones(2)), TracingError,
         r"\.item\(\)"),
        ("compile numpy", compiled(lambda t: np.asarray(t.numpy()) + 1, dtensor.ones(2)),
         TracingError, r"converting a tensor to numpy"),
        ("compile backend", lambda: dtensor.compile(branchy, backend="xla"), ValueError,
         r"unknown backend 'xla'"),
        ("compile non-callable", lambda: dtensor.compile(42), TypeError, r"got int"),
        # -- checkpoints
        ("checkpoint missing", lambda: dtensor.checkpoint.load({}, Path(tmp) / "none"),
         CheckpointError, r"no complete checkpoint at .*none"),
        ("checkpoint corrupt", corrupt_then_load("byte"), CheckpointError,
         r"rank0\.npz.*checksum mismatch"),
        ("checkpoint truncated", corrupt_then_load("truncate"), CheckpointError,
         r"rank0\.npz.*truncated or corrupt"),
        ("checkpoint version", corrupt_then_load("version"), CheckpointError,
         r"format version 7"),
        ("checkpoint shape", lambda: dtensor.checkpoint.load(
            {"model": Linear(4, 2).state_dict()}, ck), CheckpointError,
         r"'model\.weight': checkpoint has shape \(2, 3\) float32, the state \(2, 4\)"),
        ("checkpoint keys", lambda: dtensor.checkpoint.load({"net": Linear(3, 2).state_dict()},
                                                            ck),
         CheckpointError, r"missing keys \['net\.bias', 'net\.weight'\]"),
        ("checkpoint value", lambda: dtensor.checkpoint.save({"x": object()}, Path(tmp) / "o"),
         TypeError, r"'x' is a object"),
    ]


@pytest.mark.ranks(2, timeout=120)
def test_every_bad_call_raises_a_clear_error_quickly_on_every_rank(tmp_path, rank):
    cases = _cases(str(tmp_path))
    assert len(cases) >= 45
    assert len({name for name, *_ in cases}) == len(cases)
    slow = []
    for name, call, exc, pattern in cases:
        t = time.perf_counter()
        try:
            with pytest.raises(exc, match=pattern) as info:
                call()
        except BaseException as e:
            raise AssertionError(f"case {name!r}: {e}") from None
        took = time.perf_counter() - t
        if took > 1.0:
            slow.append((name, round(took, 3)))
        assert type(info.value) is exc or isinstance(info.value, exc), (name, info.value)
    assert not slow, slow


DTLAUNCH = [sys.executable, "-m", "dtensor.launcher"]


SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "tp_mlp.py")


@pytest.mark.parametrize("args,pattern", [
    (["--nproc", "0", SCRIPT], r"--nproc.*0"),
    (["--nproc", "2", "--timeout", "-3", SCRIPT], r"-3"),
    (["--nproc", "2", "does_not_exist.py"], r"does_not_exist\.py"),
    (["--nproc", "2", "--hostfile", "/no/such/hostfile", SCRIPT], r"/no/such/hostfile"),
])
def test_launcher_flags(args, pattern):
    """Usage errors exit 2 with the offending value, before any rank starts."""
    t = time.perf_counter()
    out = subprocess.run([*DTLAUNCH, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert re.search(pattern, out.stderr + out.stdout), out.stderr
    assert time.perf_counter() - t < 5  # a Python start-up, no MPI job
