"""The examples run and check themselves: under dtlaunch they reach the one-process numbers,
exit 0 and print a sample; flags that cannot run together exit 2 with the fix."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
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


# --model llama: the small GPT's sizes (n_head 4, so 2 key/value heads by default).
LLAMA = [*SMALL, "--model", "llama", "--log-every", "1"]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """One process, writing the trained model as a Hugging Face folder at the end."""
    folder = tmp_path_factory.mktemp("llama") / "trained"
    return (*run([*TRAIN, *LLAMA, "--save-pretrained", str(folder)]), folder)


def test_llama_one_process_trains_samples_and_saves_a_folder(llama_run):
    rc, out, folder = llama_run
    assert_trained_and_sampled(rc, out)
    assert re.search(r"^model: Llama, \d[\d,]* parameters", out, re.M), out
    assert f"saved {folder} (--init-from reads it)" in out
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert len(losses(out)) == 6


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--nproc", "2"], ["--nproc", "4", "--sp"],
                                    ["--nproc", "2", "--dp", "2", "--fsdp"],
                                    ["--nproc", "4", "--tp", "4"],
                                    ["--nproc", "1", "--compile"]],
                         ids=["tp2", "dp2xtp2-sp", "dp2-fsdp", "tp4-shared-kv", "compiled"])
def test_llama_parallel_training_matches_one_process(llama_run, layout):
    """Llama trains to its one-process losses in each layout; a compiled run traces its step
    twice (before and after AdamW's state exists): the lr schedule recompiles nothing."""
    nproc, flags = layout[:2], layout[2:]
    rc, par = run([*DTLAUNCH, *nproc, "examples/train.py", *LLAMA, *flags])
    assert_trained_and_sampled(rc, par)
    ref, got = losses(llama_run[1]), losses(par)
    assert ref and len(ref) == len(got), (llama_run[1][-2000:], par[-2000:])
    assert got == pytest.approx(ref, rel=1e-5), (ref, got)
    if "--compile" in flags:
        assert re.search(r"final: .*, 2 compiled graphs$", par, re.M), par[-2000:]


def load_train_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("train_example",
                                                  os.path.join(ROOT, "examples", "train.py"))
    train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, train)  # dataclasses look their module up
    spec.loader.exec_module(train)  # no dtensor import: that waits for main()
    return train


@pytest.mark.timeout(300)
def test_save_pretrained_then_init_from_round_trips_on_2_ranks(llama_run, tmp_path, monkeypatch):
    """A tp=2 run starts from the one-process run's folder: its first loss is the loss the
    saved weights give the first batch here, in one process (an independent load), and with
    lr 0 it saves the very tensors it loaded (read as slices, written from shards)."""
    from safetensors.numpy import load_file

    from dtensor.nn import Llama

    saved = llama_run[2]
    again = tmp_path / "again"
    rc, out = run([*DTLAUNCH, "--nproc", "2", "examples/train.py", *SMALL, "--model", "llama",
                   "--init-from", str(saved), "--steps", "2", "--log-every", "1", "--lr", "0",
                   "--min-lr", "0", "--save-pretrained", str(again)])
    assert_trained_and_sampled(rc, out)
    assert f"parameters; from {saved}" in out
    first = load_file(saved / "model.safetensors")
    second = load_file(again / "model.safetensors")
    assert sorted(first) == sorted(second)
    for name in first:
        np.testing.assert_array_equal(second[name], first[name], err_msg=name)

    train = load_train_module(monkeypatch)
    cfg = train.TrainConfig()
    data = train.CharData(train.stdlib_docstrings(200_000), cfg.seed)
    x, y = data.batch("train", cfg.batch_size, cfg.block_size)
    loss = Llama.from_pretrained(saved)(x, y)[1].item()
    assert losses(out)[0] == pytest.approx(loss, abs=1e-4), (loss, out[-2000:])


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
    (1, ["--init-from", "examples"], r"^--init-from: for dtensor\.nn\.Llama, and this run trains "
                                     r"--model gpt: add --model llama$"),
    (1, ["--kv-heads", "2", "--save-pretrained", "out"], r"^--save-pretrained, --kv-heads: for "
                                                         r"dtensor\.nn\.Llama, .* add --model "
                                                         r"llama$"),
    (1, ["--model", "llama", "--init-from", "/no/such/dir"], r"--init-from /no/such/dir: no such "
                                                             r"folder; pass a Hugging Face Llama "
                                                             r"folder"),
    (1, ["--model", "llama", "--init-from", "examples"], r"--init-from examples: no Llama "
                                                         r"config\.json there \(FileNotFound"),
    (1, ["--model", "llama", "--dropout", "0.1"], r"--dropout 0\.1: dtensor\.nn\.Llama has no "
                                                  r"dropout; drop --dropout or use --model gpt$"),
    (1, ["--model", "llama", "--n-embd", "20"], r"--n-embd 20 gives heads of 5 channels, .* "
                                                r"multiple of 8$"),
    (1, ["--model", "llama", "--kv-heads", "3"], r"--kv-heads 3 does not divide --n-head 4 .* "
                                                 r"use one of \[1, 2, 4\]$"),
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


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    """Hugging Face folders: a 2-layer Llama over a 50-token vocabulary (the corpus has more
    characters), and one whose config.json asks for a gelu MLP."""
    from dtensor.nn import Llama, LlamaConfig
    root = tmp_path_factory.mktemp("folders")
    Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=64)).save_pretrained(root / "v50")
    (root / "gelu").mkdir()
    config = json.loads((root / "v50" / "config.json").read_text())
    (root / "gelu" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    return root


# (flags after --model llama --init-from FOLDER, what the message must say)
BAD_FOLDERS = [
    ("v50", ["--n-layer", "3", "--n-head", "2"],
     r"--init-from \S+v50 holds a model with 2 layers \(--n-layer 3\), 4 heads \(--n-head 2\): "
     r"drop the flag \(the folder's config\.json sizes the model\)$"),
    ("v50", ["--kv-heads", "4"], r"holds a model with 2 key/value heads \(--kv-heads 4\)"),
    ("v50", ["--block-size", "65"], r"--block-size 65 is longer than the context of --init-from "
                                    r"\S+v50 \(max_position_embeddings 64\): use --block-size 64 "
                                    r"or less$"),
    ("gelu", [], r"no Llama config\.json there \(ValueError: config\.json: hidden_act='gelu' is "
                 r"not supported"),
    ("v50", ["--corpus-chars", "20000"],  # found once the corpus is read
     r"--init-from \S+v50 holds a vocabulary of 50 tokens, and the corpus's \(--corpus-chars "
     r"20000\) has \d+ characters: start from a folder that --save-pretrained wrote"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("folder,flags,message", BAD_FOLDERS,
                         ids=[f"{d}-{'_'.join(f)}" for d, f, _ in BAD_FOLDERS])
def test_init_from_folders_that_cannot_run_exit_2_with_the_fix(llama_folders, folder, flags,
                                                                 message):
    rc, out = run([*TRAIN, "--model", "llama", "--init-from", str(llama_folders / folder),
                   *flags], timeout=60)
    assert rc == 2, out
    errors = re.findall(r"^examples/train\.py: error: (.*)$", out, re.M)
    assert len(errors) == 1 and re.search(message, errors[0]), out
    assert "step" not in out  # nothing trained


def test_help_gives_each_flag_its_meaning_default_and_choices(monkeypatch):
    rc, out = run([*TRAIN, "--help"], timeout=30)
    assert rc == 0, out
    train = load_train_module(monkeypatch)
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
