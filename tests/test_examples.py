"""The examples run and check themselves: under dtlaunch they reach the one-process numbers,
exit 0 and print a sample; flags that cannot run together exit 2 with the fix."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTLAUNCH = [sys.executable, "-m", "dtensor.launcher"]
TRAIN = [sys.executable, "examples/train.py"]
SMALL = ["--steps", "6", "--eval-every", "0", "--sample-chars", "5", "--corpus-chars", "200000",
         "--n-layer", "2", "--n-embd", "64"]


def run(cmd, timeout=240, env=None):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
    return out.returncode, out.stdout + out.stderr


def losses(text):
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)  lr", text)]


def assert_trained_and_sampled(rc, out):
    """Exit 0, and the sample (the prompt, then generated characters) printed."""
    assert rc == 0, out[-3000:]
    assert re.search(r"^(\[rank0\] )?sample:\n(\[rank0\] )?Return the ", out, re.M), out[-3000:]


@pytest.fixture(scope="module")
def one_process_run():
    # A generous --expect-val-loss: the self-check passes and says what it compared.
    return run([*TRAIN, *SMALL, "--expect-val-loss", "10"])


def test_one_process_trains_exits_0_and_samples(one_process_run):
    rc, out = one_process_run
    assert_trained_and_sampled(rc, out)
    assert re.search(r"check: final val loss \d+\.\d+ < --expect-val-loss 10: passed", out), out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--nproc", "2"], ["--nproc", "4", "--sp", "--fsdp"],
                                    ["--nproc", "1", "--compile"], ["--nproc", "2", "--compile"]],
                         ids=["tp2", "dp2xtp2-sp-fsdp", "compiled", "tp2-compiled"])
def test_parallel_training_matches_one_process(one_process_run, layout):
    """Each layout trains to the one-process losses, exits 0 and samples (dp=1 x tp=2 samples a
    batch of one sequence: its rows dim is sharded over a mesh dim of size 1)."""
    nproc, flags = layout[:2], layout[2:]
    rc, par = run([*DTLAUNCH, *nproc, "examples/train.py", *SMALL, *flags])
    assert_trained_and_sampled(rc, par)
    ref, got = losses(one_process_run[1]), losses(par)
    assert ref and len(ref) == len(got), (one_process_run[1][-2000:], par[-2000:])
    assert got == pytest.approx(ref, rel=1e-5), (ref, got)


def test_a_failed_self_check_exits_1_and_says_what_it_compared():
    rc, out = run([*TRAIN, "--steps", "1", "--eval-every", "0", "--sample-chars", "0",
                   "--corpus-chars", "20000", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                   "--batch-size", "2", "--block-size", "8", "--expect-val-loss", "0.5"],
                  timeout=120)
    assert rc == 1, out[-2000:]
    assert re.search(r"check: final val loss \d+\.\d+ >= --expect-val-loss 0\.5: FAILED", out), out


# (ranks, flags, what the message must say: the flag, and the fix with the right --nproc)
BAD_FLAGS = [
    (1, ["--sp"], r"--sp splits .* tp=1: run `dtlaunch --nproc 2 examples/train\.py --sp`$"),
    (1, ["--dp", "2", "--sp"], r"--sp splits .* dp=2 x tp=1: run `dtlaunch --nproc 4 "
                               r"examples/train\.py --dp 2 --sp`$"),
    (2, ["--tp", "1", "--sp"], r"--sp splits .* dp=2 x tp=1: run `dtlaunch --nproc 4 "
                               r"examples/train\.py --tp 2 --sp`$"),
    (1, ["--fsdp"], r"--fsdp shards .* dp=1 x tp=1: run "
                    r"`dtlaunch --nproc 2 examples/train\.py --dp 2 --fsdp`$"),
    (1, ["--fsdp", "--tp", "2"], r"--fsdp .* dp=1 x tp=2: run `dtlaunch --nproc 4 "
                                 r"examples/train\.py --tp 2 --dp 2 --fsdp`$"),
    (2, ["--fsdp"], r"--fsdp .* dp=1 x tp=2: run `dtlaunch --nproc 4 examples/train\.py --dp 2 "
                    r"--fsdp`$"),
    (1, ["--backend", "c"], r"--backend c .* eager: add --compile$"),
    (1, ["--backend", "triton", "--steps", "5"], r"--backend triton .* add --compile$"),
    (1, ["--tp", "2"], r"dp=1 x tp=2 takes 2 ranks, and this job has 1: run "
                       r"`dtlaunch --nproc 2 examples/train\.py --tp 2`$"),
    (1, ["--tp", "2", "--dp", "2"], r"takes 4 ranks.* `dtlaunch --nproc 4 examples/train\.py "
                                    r"--tp 2 --dp 2`$"),
    (1, ["--dp", "2"], r"dp=2 x tp=1 takes 2 ranks.* `dtlaunch --nproc 2 examples/train\.py "
                       r"--dp 2`$"),
    (2, ["--dp", "4"], r"dp=4 x tp=1 takes 4 ranks, and this job has 2: run `dtlaunch --nproc 4 "
                       r"examples/train\.py --dp 4`, or pick --dp and --tp whose product is 2$"),
    (1, ["--tp", "3"], r"--n-head 4 does not split over tp=3 ranks .* use --tp 2 or an --n-head "
                       r"that is a multiple of 3$"),
    (1, ["--n-embd", "30"], r"--n-embd 30 does not split into --n-head 4 .* multiple of 4$"),
    (1, ["--dp", "2", "--batch-size", "7"], r"--batch-size 7 does not split over dp=2 .* "
                                            r"--batch-size 6$"),
    (1, ["--sp", "--tp", "4", "--block-size", "6"], r"--sp over tp=4 .* sequence of 6 .*"
                                                    r"use another --block-size or --tp"),
    (1, ["--steps", "0"], r"--steps 0: must be at least 1$"),
    (1, ["--lr", "-1"], r"--lr -1\.0: must be at least 0$"),
    (1, ["--dropout", "1"], r"--dropout 1 drops everything: use a probability below 1$"),
    (1, ["--expect-val-loss", "2", "--stop-after", "3"], r"--expect-val-loss .* --stop-after 3 "
                                                          r"stops before: drop one of them$"),
    (1, ["--resume", "/no/such/ckpt"], r"--resume /no/such/ckpt: no such folder"),
    (1, ["--corpus-chars", "100"], r"--corpus-chars 100 .* use --corpus-chars 1320 or more$"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks,flags,message", BAD_FLAGS,
                         ids=[f"{r}-{'_'.join(f)}" for r, f, _ in BAD_FLAGS])
def test_flags_that_cannot_run_exit_2_with_the_fix(ranks, flags, message):
    """Checked before the corpus is read or the model built: a start-up, no training. Under
    dtlaunch every rank says it and the job ends with the same status 2."""
    launch = TRAIN if ranks == 1 else [*DTLAUNCH, "--nproc", str(ranks), "examples/train.py"]
    t = time.perf_counter()
    rc, out = run([*launch, *flags], timeout=60)
    assert rc == 2, out
    errors = re.findall(r"^(?:\[rank\d\] )?examples/train\.py: error: (.*)$", out, re.M)
    assert errors and all(re.search(message, e) for e in errors), out
    if ranks == 1:
        assert len(out.strip().splitlines()) == 2, out  # usage and the error: nothing else ran
    assert time.perf_counter() - t < 10 * ranks


def test_help_gives_each_flag_its_meaning_default_and_choices(monkeypatch):
    rc, out = run([*TRAIN, "--help"], timeout=30)
    assert rc == 0, out
    spec = importlib.util.spec_from_file_location("train_example",
                                                  os.path.join(ROOT, "examples", "train.py"))
    train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, train)  # dataclasses look their module up
    spec.loader.exec_module(train)  # no dtensor import: that waits for main()
    assert train.__doc__.strip() in out  # the whole description, not its first line
    # One entry per flag: from its line to the next flag's, whitespace collapsed.
    entries = {m.group(1): " ".join(m.group(0).split())
               for m in re.finditer(r"^  (--[\w-]+).*?(?=^  -|\Z)", out, re.M | re.S)}
    for f in dataclasses.fields(train.TrainConfig):
        entry = entries.get("--" + f.name.replace("_", "-"))
        assert entry, (f.name, out)
        meaning = f.metadata["help"].replace("%%", "%")
        assert entry.endswith(f"{meaning} (default: {f.default})"), entry
    assert "--backend {numpy,c,triton}" in out


@pytest.mark.timeout(120)
def test_tensor_parallel_mlp_example():
    rc, out = run([*DTLAUNCH, "--nproc", "4", "examples/tp_mlp.py"])
    assert rc == 0, out[-3000:]
    assert "max |parameter difference|" in out
