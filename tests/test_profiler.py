"""dtensor.profiler on real ranks: one merged Chrome trace, valid against the trace-event format,
holding every rank's spans, and a summary whose parts add up to the step's time."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dtensor
from dtensor import profiler

# The trace-event format (the "X" complete events and "M" metadata events we write): the keys
# each needs and their types.
X_KEYS = {"name": str, "cat": str, "ph": str, "ts": (int, float), "dur": (int, float),
          "pid": int, "tid": int}
M_KEYS = {"name": str, "ph": str, "pid": int, "tid": int, "args": dict}


def check_trace_events(events: list) -> None:
    """Fails unless every event is a well-formed complete ("X") or metadata ("M") event."""
    assert isinstance(events, list) and events
    for e in events:
        keys = X_KEYS if e["ph"] == "X" else M_KEYS
        assert e["ph"] in ("X", "M"), e
        for k, t in keys.items():
            assert isinstance(e.get(k), t), (k, e)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= -1e3, e  # ranks' clocks agree to a barrier
            assert "args" not in e or isinstance(e["args"], dict), e
        json.dumps(e)


def build(model_kind: str, mesh):
    if model_kind == "gpt":
        cfg = dtensor.nn.GPTConfig(vocab_size=256, n_layer=2, n_embd=32, n_head=4,
                                   mlp_hidden=128, block_size=16, bias=False, dropout=0.0)
        model = dtensor.nn.GPT(cfg)
    else:
        cfg = dtensor.nn.LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4,
                                     n_kv_heads=2, hidden_dim=64, max_seq_len=16)
        model = dtensor.nn.Llama(cfg)
    from dtensor.parallel import parallelize
    parallelize(model, mesh, sequence_parallel=model_kind == "gpt")
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.ranks(4, timeout=240)
@pytest.mark.parametrize("model_kind, compiled", [("gpt", False), ("llama", False),
                                                  ("gpt", True)])
def test_a_4_rank_step_gives_one_valid_trace_whose_summary_adds_up(rank, tmp_path_factory,
                                                                   model_kind, compiled):
    from dtensor.comm import get_world
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dtensor.manual_seed(0)
    step = build(model_kind, mesh)
    if compiled:
        step = dtensor.compile(step)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (4, 16)), rng.integers(0, 256, (4, 16))
    step(x, y).item()
    step(x, y).item()
    path = str(tmp_path_factory.getbasetemp() / "trace.json")  # every rank passes one path
    runs = []  # three profiled steps: (the merged events, each rank's own step time)
    for _ in range(3):
        with profiler.profile(path) as p:
            start = time.perf_counter()
            step(x, y).item()
            took = time.perf_counter() - start
        runs.append((p.events, get_world().all_gather(np.array([took]))))
    if rank != 0:
        return
    events = profiler.load(path)  # the last step's trace
    check_trace_events(events)
    assert events == runs[-1][0]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    names = {(e["cat"], e["name"]) for e in spans}
    root = "GPT" if model_kind == "gpt" else "Llama"
    assert ("module", f"{root} (forward)") in names and ("module", f"{root} (backward)") in names
    if compiled:
        assert any(cat == "kernel" for cat, _ in names)
    else:
        assert ("optimizer", "AdamW.step") in names and ("op", "matmul") in names
    collectives = [e for e in spans if e["cat"] == "collective"]
    assert collectives and all({"bytes", "group", "seq", "shape"} <= e["args"].keys()
                               for e in collectives)
    # a wait lies inside its collective
    for w in (e for e in spans if e["cat"] == "wait"):
        assert any(c["pid"] == w["pid"] and c["ts"] == w["ts"] and w["dur"] <= c["dur"] + 1e-3
                   for c in collectives), w
    # per rank: compute + communication + waiting is the step's time, within 5%, in the best of
    # the three steps. Code that no span covers leaves its gap in every step; a rank the OS
    # parks between two spans (4 ranks share 2 cores here) leaves one in a single step.
    misses = {r: [] for r in range(4)}
    for events, took in runs:
        for r, b in profiler.breakdown(events).items():
            parts = b["compute"] + b["communication"] + b["waiting"]
            misses[r].append((abs(parts - took[r] * 1e3) / (took[r] * 1e3), b))
            assert abs(parts + b["other"] - b["profiled"]) < 1e-6 * b["profiled"] + 1e-3
    for r, miss in misses.items():
        assert min(m for m, _ in miss) <= 0.05, (r, miss)
    text = subprocess.run([sys.executable, "-m", "dtensor.profiler", "summary", path],
                          capture_output=True, text=True, check=True).stdout
    assert "top spans" in text and all(f"\n   {r} " in text for r in range(4)), text


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_compiled_nodes_span_carries_its_arrays_bytes_and_the_summary_their_rate(backend):
    """Each compiled node's span holds the bytes of its array inputs (each once) and of its
    result, counted here from the arrays themselves; the summary divides them by the time."""
    x = dtensor.tensor(np.ones((64, 48), np.float32))
    w = dtensor.tensor(np.ones((48, 80), np.float32))

    @dtensor.compile(backend=backend)
    def f(x, w):
        y = x @ w
        return (y * y).sum()

    f(x, w)
    with profiler.profile() as p:
        f(x, w)
    got = {}
    for e in p.events:
        if e["ph"] == "X" and e["cat"] == "kernel":
            got.setdefault(e["name"], []).append(e["args"]["bytes"])
    assert got["matmul"] == [4 * (64 * 48 + 48 * 80 + 64 * 80)], got
    assert all(b > 0 for bs in got.values() for b in bs), got
    kernel_rows = [line for line in profiler.summary(p.events).splitlines()
                   if line.startswith("kernel")]
    assert kernel_rows and all(float(line.split()[-1]) > 0 for line in kernel_rows), kernel_rows


def test_profile_off_leaves_no_hook_and_nesting_is_refused():
    from dtensor import observe
    from dtensor.nn.module import Module
    from dtensor.ops import registry
    from dtensor.optim.optimizers import Optimizer
    plain = (registry.apply, Module.__call__, Optimizer.step)
    with profiler.profile() as p:
        with pytest.raises(RuntimeError, match="already open"):
            profiler.profile().__enter__()
        model = dtensor.nn.Linear(4, 3)
        model(dtensor.randn(2, 4)).sum().backward()
    assert (registry.apply, Module.__call__, Optimizer.step) == plain
    assert observe.SPANS is None and not observe.OBSERVERS
    names = {(e["cat"], e["name"]) for e in p.events if e["ph"] == "X"}
    assert {("module", "Linear (forward)"), ("module", "Linear (backward)"),
            ("op", "matmul"), ("profile", "profile")} <= names


def test_dtlaunch_trace_writes_one_merged_file(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text("import numpy as np\nimport dtensor\nfrom dtensor.comm import get_world\n"
                      "get_world().all_reduce(np.ones(4))\n")
    out = subprocess.run([str(Path(sys.executable).parent / "dtlaunch"), "--nproc", "2",
                          "--trace", str(tmp_path / "tr"), str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = profiler.load(str(tmp_path / "tr" / "trace.json"))
    check_trace_events(events)
    got = {(e["pid"], e["name"]) for e in events if e["ph"] == "X" and e["cat"] == "collective"}
    assert {(0, "all_reduce"), (1, "all_reduce")} <= got
    assert "trace.json" in out.stderr
