"""The examples run and check themselves: under dtlaunch they reach the one-process numbers."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTLAUNCH = [sys.executable, "-m", "dtensor.launcher"]
SMALL = ["--steps", "6", "--eval-every", "0", "--sample-chars", "5", "--corpus-chars", "200000",
         "--n-layer", "2", "--n-embd", "64"]


def run(cmd, timeout=240):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def losses(text):
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)  lr", text)]


@pytest.fixture(scope="module")
def one_process_run():
    return run([sys.executable, "examples/train.py", *SMALL])[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--nproc", "2"], ["--nproc", "4", "--sp", "--fsdp"],
                                    ["--nproc", "1", "--compile"], ["--nproc", "2", "--compile"]],
                         ids=["tp2", "dp2xtp2-sp-fsdp", "compiled", "tp2-compiled"])
def test_parallel_training_matches_one_process(one_process_run, layout):
    nproc, flags = layout[:2], layout[2:]
    _, par = run([*DTLAUNCH, *nproc, "examples/train.py", *SMALL, *flags])
    ref, got = losses(one_process_run), losses(par)
    assert ref and len(ref) == len(got), (one_process_run[-2000:], par[-2000:])
    assert got == pytest.approx(ref, rel=1e-5), (ref, got)


@pytest.mark.timeout(120)
def test_tensor_parallel_mlp_example():
    rc, out = run([*DTLAUNCH, "--nproc", "4", "examples/tp_mlp.py"])
    assert rc == 0, out[-3000:]
    assert "max |parameter difference|" in out
