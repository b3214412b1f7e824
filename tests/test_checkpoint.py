"""dtensor.checkpoint: sharded save, resharding load, atomic commit, corruption and kill tests,
and a training run resumed on another number of ranks."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dtensor
from dtensor.checkpoint import CheckpointError
from dtensor.nn import GPT, GPTConfig

CFG = dict(vocab_size=97, n_layer=2, n_embd=32, n_head=4, mlp_hidden=66, block_size=16)
ROOT = Path(__file__).resolve().parent.parent


def full(t):
    return t.full_tensor().numpy() if hasattr(t, "full_tensor") else t.numpy()


def build(tp=1, dp=1, fsdp=False):
    from dtensor.parallel import parallelize
    dtensor.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    if tp * dp > 1:
        names = ("dp", "tp")
        mesh = dtensor.init_device_mesh("cpu", (dp, tp), mesh_dim_names=names)
        parallelize(model, mesh, fsdp=fsdp)
    return model, dtensor.optim.AdamW(model.parameters(), lr=1e-2)


def state(model, opt, step=0):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def trained_and_saved(path, tp):
    """Two AdamW steps at ``tp``, then a save; returns the whole values saved."""
    model, opt = build(tp=tp)
    rng = np.random.default_rng(0)
    for _ in range(2):
        _, loss = model(rng.integers(0, 97, (4, 16)), rng.integers(0, 97, (4, 16)))
        loss.backward()
        opt.step()
        opt.zero_grad()
    dtensor.checkpoint.save(state(model, opt, step=2), path)
    return ({k: full(v) for k, v in model.state_dict().items()},
            {i: full(s["exp_avg_sq"]) for i, s in opt.state_dict()["state"].items()})


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """A checkpoint written by a 2-rank TP=2 job, and its whole values."""
    from dtensor.launcher import spawn
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    results = spawn(trained_and_saved, 2, path, 2, timeout=120)
    return path, results[0]


def check_loaded(path, expect, **layout):
    model, opt = build(**layout)
    st = state(model, opt)
    dtensor.checkpoint.load(st, path)
    opt.load_state_dict(st["optim"])
    params, moments = expect
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(full(v), params[k], err_msg=k)
    for i, s in opt.state_dict()["state"].items():
        np.testing.assert_array_equal(full(s["exp_avg_sq"]), moments[i])
        assert s["step"] == 2
    assert st["step"] == 2


def test_saved_layout_on_disk(tp2_checkpoint):
    path, _ = tp2_checkpoint
    root = Path(path)
    assert (root / "LATEST").read_text() == "v1"
    meta = json.loads((root / "v1" / "metadata.json").read_text())
    assert meta["format"] == "dtensor-checkpoint" and meta["version"] == 1
    q = meta["tensors"]["model.blocks.0.attn.q.weight"]
    assert q["placements"] == ["R", "S(0)"] and q["shape"] == [32, 32]
    assert [b["offsets"] for b in q["blocks"]] == [[0, 0], [16, 0]]  # one block per tp rank
    wpe = meta["tensors"]["model.wpe.weight"]
    assert len(wpe["blocks"]) == 1  # replicated: written once
    assert sorted(p.name for p in (root / "v1").iterdir()) == [".dtensor-checkpoint",
                                                               "metadata.json", "rank0.npz",
                                                               "rank1.npz"]
    assert (root / "v1" / ".dtensor-checkpoint").read_text() == "dtensor-checkpoint"


def test_load_in_one_process_is_bit_exact(tp2_checkpoint):
    check_loaded(*tp2_checkpoint)


@pytest.mark.parametrize("layout", [dict(tp=4), dict(tp=2, dp=2), dict(tp=2, dp=2, fsdp=True),
                                    dict(tp=1, dp=4)], ids=["tp4", "dp2xtp2", "fsdp", "dp4"])
@pytest.mark.ranks(4, timeout=120)
def test_load_at_another_layout_is_bit_exact(tp2_checkpoint, layout, rank):
    check_loaded(*tp2_checkpoint, **layout)


def test_a_second_save_replaces_the_first_atomically(tmp_path):
    model, opt = build()
    dtensor.checkpoint.save(state(model, opt, step=1), tmp_path)
    (tmp_path / "v7.partial").mkdir()  # a crashed save's leftovers: never read, cleaned up
    (tmp_path / "v7.partial" / ".dtensor-checkpoint").write_text("dtensor-checkpoint")
    st = state(*build())
    dtensor.checkpoint.load(st, tmp_path)
    assert st["step"] == 1
    assert dtensor.checkpoint.save(state(model, opt, step=2), tmp_path) == "v8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "v8"]
    st = state(*build())
    dtensor.checkpoint.load(st, tmp_path)
    assert st["step"] == 2


KILLED_MID_SAVE = """
    import os, numpy as np, dtensor
    from dtensor.nn import GPT, GPTConfig
    from dtensor.parallel import parallelize
    dtensor.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=2, n_embd=32, n_head=4, mlp_hidden=66,
                          block_size=16))
    parallelize(model, dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    opt = dtensor.optim.AdamW(model.parameters())
    st = {{"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}}
    dtensor.checkpoint.save(st, {path!r})
    real = np.savez
    def dying(*a, **k):  # rank 1 dies after writing half of its second save
        real(*a, **k)
        if int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), 9)
    np.savez = dying
    st["step"] = 2
    dtensor.checkpoint.save(st, {path!r})
"""


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    from test_launcher import assert_no_orphans, dtlaunch
    path = str(tmp_path / "ckpt")
    status, out, seconds, script = dtlaunch(tmp_path, KILLED_MID_SAVE.format(path=path),
                                            "--nproc", "2")
    assert status != 0 and seconds < 15, (status, seconds, out)
    assert "dtlaunch: job failed" in out and "rank" in out, out
    assert_no_orphans(script)
    assert (Path(path) / "LATEST").read_text() == "v1"
    assert (Path(path) / "v2.partial").exists()
    st = state(*build())
    dtensor.checkpoint.load(st, path)  # verifies every block's checksum
    assert st["step"] == 1


def _saved(tmp_path):
    model, opt = build()
    dtensor.checkpoint.save(state(model, opt, step=3), tmp_path)
    return tmp_path / "v1"


def test_a_corrupt_byte_names_the_file_and_the_checksum(tmp_path):
    folder = _saved(tmp_path)
    shard = folder / "rank0.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(shard)) + r".*checksum mismatch"):
        dtensor.checkpoint.load(state(*build()), tmp_path)


def test_our_own_checksum_catches_a_consistent_but_wrong_block(tmp_path):
    folder = _saved(tmp_path)
    meta = json.loads((folder / "metadata.json").read_text())
    meta["tensors"]["model.wte.weight"]["blocks"][0]["crc32"] ^= 1
    (folder / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*rank0\.npz for "
                                              r"'model\.wte\.weight': stored 0x"):
        dtensor.checkpoint.load(state(*build()), tmp_path)


def test_a_truncated_shard_is_reported(tmp_path):
    shard = _saved(tmp_path) / "rank0.npz"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with pytest.raises(CheckpointError, match=re.escape(str(shard)) + r".*truncated or corrupt"):
        dtensor.checkpoint.load(state(*build()), tmp_path)


def test_wrong_version_missing_and_mismatched(tmp_path):
    folder = _saved(tmp_path)
    meta = json.loads((folder / "metadata.json").read_text())
    with pytest.raises(CheckpointError, match=r"no complete checkpoint at .*LATEST is missing"):
        dtensor.checkpoint.load(state(*build()), tmp_path / "nowhere")
    with pytest.raises(CheckpointError,
                       match=r"missing keys \['model\.blocks\.2\.attn\.k\.weight'"):
        m = GPT(GPTConfig(**dict(CFG, n_layer=3)))
        dtensor.checkpoint.load({"model": m.state_dict(), "optim": build()[1].state_dict(),
                                 "step": 0}, tmp_path)
    with pytest.raises(CheckpointError, match=r"'model\.wte\.weight': checkpoint has shape "
                                              r"\(97, 32\) float32, the state \(98, 32\)"):
        m = GPT(GPTConfig(**dict(CFG, vocab_size=98)))
        dtensor.checkpoint.load({"model": m.state_dict(), "optim": build()[1].state_dict(),
                                 "step": 0}, tmp_path, strict=False)
    meta["version"] = 99
    (folder / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"format version 99; this dtensor reads version 1"):
        dtensor.checkpoint.load(state(*build()), tmp_path)


def test_loading_never_unpickles(tmp_path):
    """A shard holding a pickled object (that would write a file when unpickled) is refused."""
    folder = _saved(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(folder / "rank0.npz", "wb") as f:
        np.savez(f, a0=np.array([Payload()], dtype=object))
    with pytest.raises(CheckpointError, match=r"rank0\.npz .*the \.npy header says shape \[1\] "
                                              r"object, the metadata \[97, 32\] float32"):
        dtensor.checkpoint.load(state(*build()), tmp_path)
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_resume_on_another_world_size_gives_the_same_losses(tmp_path):
    """6 steps straight (one process) vs 3 steps on 2 ranks + resume for 3 on 4 ranks."""
    small = ["--eval-every", "0", "--sample-chars", "5", "--corpus-chars", "200000",
             "--n-layer", "2", "--n-embd", "64", "--log-every", "1", "--warmup", "10"]
    launcher = [sys.executable, "-m", "dtensor.launcher"]

    def run(cmd):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr
        return {int(s): float(v) for s, v in
                re.findall(r"step +(\d+) \S+ +\S+ +loss (\d+\.\d+)", out.stdout)}

    straight = run([sys.executable, "examples/train.py", *small, "--steps", "6"])
    ckpt = str(tmp_path / "ckpt")
    first = run([*launcher, "--nproc", "2", "examples/train.py", *small, "--steps", "6",
                 "--save-every", "3", "--save-dir", ckpt, "--stop-after", "3"])
    second = run([*launcher, "--nproc", "4", "examples/train.py", *small, "--steps", "6",
                  "--resume", ckpt, "--sp"])
    assert sorted(first) == [0, 1, 2] and sorted(second) == [3, 4, 5]
    resumed = {**first, **second}
    assert [resumed[s] for s in range(6)] == pytest.approx([straight[s] for s in range(6)],
                                                           rel=1e-5)


KILLED_MID_STEP = """
    import os, numpy as np, dtensor
    from dtensor.nn import GPT, GPTConfig
    from dtensor.parallel import parallelize
    dtensor.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=2, n_embd=32, n_head=4, mlp_hidden=66,
                          block_size=16))
    parallelize(model, dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    rng = np.random.default_rng(0)
    _, loss = model(rng.integers(0, 97, (4, 16)), rng.integers(0, 97, (4, 16)))
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), 9)  # dies between forward and backward
    loss.backward()  # rank 0 waits in the backward's all-reduce for a rank that is gone
"""


def test_a_rank_killed_mid_step_ends_the_job(tmp_path):
    from test_launcher import assert_no_orphans, dtlaunch
    status, out, seconds, script = dtlaunch(tmp_path, KILLED_MID_STEP, "--nproc", "2")
    assert status != 0 and seconds < 15, (status, seconds, out)
    assert out.splitlines()[-1].startswith("dtlaunch: job failed"), out
    assert_no_orphans(script)


def test_sgd_momentum_state_loads_into_a_fresh_optimizer(tmp_path):
    """3 SGD steps (momentum, dampening) straight = 2 steps, save, a fresh model and optimizer
    loaded, 1 more step: the momentum buffer and its first-step rule survive the round trip."""
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 97, (2, 16)), rng.integers(0, 97, (2, 16))) for _ in range(3)]

    def fresh():
        dtensor.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        return model, dtensor.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                        dampening=0.1)

    def step(model, opt, batch):
        _, loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = fresh()
    straight = [step(model, opt, b) for b in batches]
    model, opt = fresh()
    first = [step(model, opt, b) for b in batches[:2]]
    dtensor.checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path)
    model, opt = fresh()
    st = {"model": model.state_dict(), "optim": opt.state_dict()}
    dtensor.checkpoint.load(st, tmp_path)
    opt.load_state_dict(st["optim"])
    assert first + [step(model, opt, batches[2])] == straight


def test_a_version_left_by_a_dead_save_is_not_reused(tmp_path):
    model, opt = build()
    dtensor.checkpoint.save(state(model, opt, step=1), tmp_path)
    (tmp_path / "v2").mkdir()  # renamed, but LATEST was never updated
    (tmp_path / "v2" / "metadata.json").write_text("{}")
    assert dtensor.checkpoint.save(state(model, opt, step=2), tmp_path) == "v3"
    st = state(*build())
    dtensor.checkpoint.load(st, tmp_path)
    assert st["step"] == 2


@pytest.mark.parametrize("wrap", ["replicate", "tp_dim"])
@pytest.mark.ranks(4, timeout=180)
def test_a_tensor_parallel_model_on_sub_meshes_saves_and_loads(wrap, rank, tmp_path):
    # parameters live on mesh["tp"]; every "dp" row holds a copy, and only row 0 writes it
    from dtensor.parallel import gpt_plan, parallelize_module, replicate

    def laid_out(seed):
        dtensor.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
        mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = gpt_plan(sequence_parallel=False, loss_parallel=False)
        if wrap == "replicate":
            return replicate(parallelize_module(model, mesh["tp"], plan), mesh=mesh["dp"])
        return parallelize_module(model, mesh, plan, tp_dim="tp")

    saved = laid_out(0)
    dtensor.checkpoint.save({"model": saved.state_dict()}, tmp_path / "run")
    loaded = laid_out(1)
    st = {"model": loaded.state_dict()}
    dtensor.checkpoint.load(st, tmp_path / "run")
    for k, v in saved.state_dict().items():
        np.testing.assert_array_equal(full(st["model"][k]), full(v), err_msg=k)
