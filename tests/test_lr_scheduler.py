"""Tests of dtensor.optim.lr_scheduler against torch's documented schedules, written here
independently: the closed forms (as formulas), literal sequences derived by hand, the recursive
("chainable") behaviour when something else changes the lr, state_dict round trips (JSON and a
dtensor.checkpoint), a compiled step that a schedule does not recompile, and bad input.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import dtensor
from dtensor import nn, optim
from dtensor.optim.lr_scheduler import (CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler,
                                        SequentialLR)

LRS = (0.1, 0.03)  # two param groups, so every per-group path runs twice


def _opt(lrs=LRS, cls=optim.SGD):
    return cls([{"params": [nn.Parameter(np.zeros(2))], "lr": lr} for lr in lrs])


def _run(sched, steps):
    """The lrs of every group at epochs 0..steps (the constructor set epoch 0)."""
    out = [sched.get_last_lr()]
    for _ in range(steps):
        sched.step()
        out.append(sched.get_last_lr())
        assert out[-1] == [g["lr"] for g in sched.optimizer.param_groups]
    return np.array(out)


# ---------------------------------------------------------------- closed forms
def cosine(base, e, T, eta_min):
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * e / T)) / 2


def linear(base, e, start, end, n):
    return base * (start + (end - start) * min(e, n) / n)


# (name, build(opt), lr of a group with base lr ``b`` at epoch ``e``)
CLOSED = [
    ("cosine T=7", lambda o: CosineAnnealingLR(o, T_max=7),
     lambda b, e: cosine(b, e, 7, 0.0)),
    ("cosine T=5 eta_min", lambda o: CosineAnnealingLR(o, T_max=5, eta_min=0.004),
     lambda b, e: cosine(b, e, 5, 0.004)),
    ("cosine T=1", lambda o: CosineAnnealingLR(o, T_max=1, eta_min=0.001),
     lambda b, e: cosine(b, e, 1, 0.001)),
    ("linear warmup", lambda o: LinearLR(o, start_factor=0.1, total_iters=6),
     lambda b, e: linear(b, e, 0.1, 1.0, 6)),
    ("linear decay", lambda o: LinearLR(o, start_factor=1.0, end_factor=0.2, total_iters=4),
     lambda b, e: linear(b, e, 1.0, 0.2, 4)),
    ("linear defaults", lambda o: LinearLR(o), lambda b, e: linear(b, e, 1 / 3, 1.0, 5)),
    ("linear to zero", lambda o: LinearLR(o, start_factor=0.5, end_factor=0.0, total_iters=3),
     lambda b, e: linear(b, e, 0.5, 0.0, 3)),
    ("lambda", lambda o: LambdaLR(o, lambda e: 0.9 ** e), lambda b, e: b * 0.9 ** e),
    ("lambda per group", lambda o: LambdaLR(o, [lambda e: 1 / (e + 1), lambda e: e % 3]),
     None),
]


@pytest.mark.parametrize("name, build, want", CLOSED, ids=[c[0] for c in CLOSED])
def test_schedule_matches_its_closed_form(name, build, want):
    """Over three cosine periods (past T_max the cosine climbs back, as torch's does)."""
    got = _run(build(_opt()), 24)
    if want is None:  # one lambda per group
        fns = [lambda e: 1 / (e + 1), lambda e: e % 3]
        ref = np.array([[b * f(e) for b, f in zip(LRS, fns)] for e in range(25)])
    else:
        ref = np.array([[want(b, e) for b in LRS] for e in range(25)])
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-16)


# Literal sequences, each derived by hand from torch's documented formulas (base lr 1.0 or 0.1).
LITERAL = [
    ("cosine T=2", lambda o: CosineAnnealingLR(o, T_max=2), 1.0,
     [1.0, 0.5, 0.0, 0.5, 1.0, 0.5, 0.0]),
    ("cosine T=3 eta_min=0.01", lambda o: CosineAnnealingLR(o, T_max=3, eta_min=0.01), 0.1,
     [0.1, 0.0775, 0.0325, 0.01, 0.0325, 0.0775, 0.1, 0.0775]),
    ("linear 0.25 over 4", lambda o: LinearLR(o, start_factor=0.25, total_iters=4), 0.1,
     [0.025, 0.04375, 0.0625, 0.08125, 0.1, 0.1, 0.1]),
    ("linear 1 -> 0.5 over 2", lambda o: LinearLR(o, 1.0, 0.5, 2), 1.0,
     [1.0, 0.75, 0.5, 0.5, 0.5]),
    ("lambda step", lambda o: LambdaLR(o, lambda e: e // 2), 0.5, [0.0, 0.0, 0.5, 0.5, 1.0]),
    # warmup 0.5 over 2, then cosine T_max=4 from epoch 3 (restarted at its epoch 0)
    ("sequential 2", lambda o: SequentialLR(o, [LinearLR(o, 0.5, total_iters=2),
                                                CosineAnnealingLR(o, T_max=4)], [3]), 0.1,
     [0.05, 0.075, 0.1, 0.1, 0.1 * (2 + math.sqrt(2)) / 4, 0.05, 0.1 * (2 - math.sqrt(2)) / 4,
      0.0, 0.1 * (2 - math.sqrt(2)) / 4]),
    # warmup 0.1 over 2 | a constant 0.5 from epoch 2 | cosine T_max=2, eta_min 0.01 from 4
    ("sequential 3", lambda o: SequentialLR(o, [LinearLR(o, 0.1, total_iters=2),
                                                LambdaLR(o, lambda e: 0.5),
                                                CosineAnnealingLR(o, 2, eta_min=0.01)], [2, 4]),
     1.0, [0.1, 0.55, 0.5, 0.5, 1.0, 0.505, 0.01, 0.505, 1.0]),
]


@pytest.mark.parametrize("name, build, lr, want", LITERAL, ids=[c[0] for c in LITERAL])
def test_schedule_gives_the_hand_derived_sequence(name, build, lr, want):
    got = _run(build(_opt([lr])), len(want) - 1)[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-17)


def test_sequential_child_keeps_its_own_epoch_count():
    """After the milestone the second child counts from 0; the first is left where it was."""
    o = _opt()
    warm, decay = LinearLR(o, 0.5, total_iters=2), CosineAnnealingLR(o, T_max=4)
    seq = SequentialLR(o, [warm, decay], milestones=[3])
    assert (seq.last_epoch, warm.last_epoch, decay.last_epoch) == (0, 0, -1)
    for _ in range(5):
        seq.step()
    assert (seq.last_epoch, warm.last_epoch, decay.last_epoch) == (5, 2, 2)


# ---------------------------------------------------------------- construction
def test_construction_records_initial_lr_and_sets_epoch_zero():
    o = _opt()
    s = LinearLR(o, start_factor=0.5, total_iters=2)
    assert [g["initial_lr"] for g in o.param_groups] == list(LRS)
    assert s.base_lrs == list(LRS) and s.last_epoch == 0
    assert s.get_last_lr() == [g["lr"] for g in o.param_groups] == [lr * 0.5 for lr in LRS]
    # A second scheduler keeps the recorded initial lr (torch's setdefault) and starts from the
    # group's current lr: the cosine's epoch 0 leaves it as it is.
    c = CosineAnnealingLR(o, T_max=3)
    assert c.base_lrs == list(LRS) and c.get_last_lr() == [lr * 0.5 for lr in LRS]


def test_resuming_with_last_epoch_needs_initial_lr_and_keeps_the_lr():
    """last_epoch=k continues after epoch k: the constructor's step leaves a cosine's lr (as
    torch since it stopped re-stepping on resume), and the next steps follow the recursion."""
    o = _opt([0.1])
    o.param_groups[0]["initial_lr"] = 0.1
    o.param_groups[0]["lr"] = cosine(0.1, 4, 10, 0.0)
    s = CosineAnnealingLR(o, T_max=10, last_epoch=3)
    assert s.last_epoch == 4 and s.get_last_lr() == [cosine(0.1, 4, 10, 0.0)]
    got = _run(s, 3)[1:, 0]
    np.testing.assert_allclose(got, [cosine(0.1, e, 10, 0.0) for e in (5, 6, 7)], rtol=1e-13)


# ---------------------------------------------------------------- the recursive form
def test_another_change_to_the_lr_composes_with_cosine_and_linear():
    """Cosine and linear step from the group's current lr (torch's chainable form): halving
    the lr mid-schedule halves every later lr (before the cosine's trough). LambdaLR is a
    closed form: it ignores the change."""
    for build, ref, n in ((lambda o: CosineAnnealingLR(o, T_max=10),
                           lambda e: cosine(0.1, e, 10, 0.0), 9),
                          (lambda o: LinearLR(o, 0.2, total_iters=6),
                           lambda e: linear(0.1, e, 0.2, 1.0, 6), 9)):
        o = _opt([0.1])
        s = build(o)
        for _ in range(3):
            s.step()
        o.param_groups[0]["lr"] *= 0.5
        got = _run(s, n - 3)[1:, 0]
        np.testing.assert_allclose(got, [0.5 * ref(e) for e in range(4, n + 1)], rtol=1e-13)
    o = _opt([0.1])
    s = LambdaLR(o, lambda e: 0.9 ** e)
    s.step()
    o.param_groups[0]["lr"] = 5.0
    s.step()
    assert s.get_last_lr() == [0.1 * 0.9 ** 2]


# ---------------------------------------------------------------- state_dict
def _phases(o):
    return SequentialLR(o, [LinearLR(o, 0.1, total_iters=3), LambdaLR(o, lambda e: 0.7 ** e),
                            CosineAnnealingLR(o, T_max=5, eta_min=0.002)], milestones=[3, 6])


BUILDS = {
    "cosine": (lambda o: CosineAnnealingLR(o, T_max=4, eta_min=0.001),
               {"T_max", "eta_min", "base_lrs", "last_epoch", "_step_count", "_last_lr"}),
    "linear": (lambda o: LinearLR(o, 0.2, 0.9, 5),
               {"start_factor", "end_factor", "total_iters", "base_lrs", "last_epoch",
                "_step_count", "_last_lr"}),
    "lambda": (lambda o: LambdaLR(o, lambda e: 1 / (1 + e)),
               {"lr_lambdas", "base_lrs", "last_epoch", "_step_count", "_last_lr"}),
    "sequential": (_phases, {"_milestones", "last_epoch", "_last_lr", "_schedulers"}),
}


@pytest.mark.parametrize("kind", list(BUILDS))
@pytest.mark.parametrize("at", [0, 2, 5, 7])
def test_state_dict_round_trip_mid_schedule_continues_identically(kind, at):
    """k steps, state_dict() through JSON into a fresh optimizer and scheduler (the optimizer's
    state too, which holds the lrs), 9 more steps: the same lrs, bit for bit."""
    build, keys = BUILDS[kind]
    o = _opt()
    s = build(o)
    straight = _run(s, at + 9)
    o = _opt()
    s = build(o)
    _run(s, at)
    sd = s.state_dict()
    assert set(sd) == keys
    saved = json.loads(json.dumps({"optim": o.state_dict(), "sched": sd}, default=str))
    o2 = _opt(lrs=(0.5, 0.5))
    s2 = build(o2)
    o2.param_groups[0]["lr"], o2.param_groups[1]["lr"] = saved["optim"]["param_groups"][0][
        "lr"], saved["optim"]["param_groups"][1]["lr"]
    s2.load_state_dict(saved["sched"])
    assert s2.state_dict() == sd
    resumed = _run(s2, 9)
    np.testing.assert_array_equal(resumed, straight[at:])


def test_lambda_state_keeps_no_function_but_a_callable_objects_attributes():
    class Decay:
        def __init__(self):
            self.rate = 0.5

        def __call__(self, e):
            return self.rate ** e

    o = _opt()
    obj = Decay()
    s = LambdaLR(o, [lambda e: 1.0, obj])
    obj.rate = 0.8
    assert s.state_dict()["lr_lambdas"] == [None, {"rate": 0.8}]
    fresh = Decay()
    s2 = LambdaLR(_opt(), [lambda e: 1.0, fresh])
    s2.load_state_dict(s.state_dict())
    assert fresh.rate == 0.8 and s2.lr_lambdas[1] is fresh


def test_scheduler_state_saves_in_a_checkpoint_next_to_the_optimizer(tmp_path):
    """dtensor.checkpoint stores the (nested) JSON state beside the optimizer's tensors; a
    fresh optimizer and SequentialLR loaded from it continue the schedule exactly."""
    def fresh():
        o = _opt(cls=optim.Adam)
        return o, _phases(o)

    o, s = fresh()
    straight = _run(s, 10)
    o, s = fresh()
    _run(s, 4)
    dtensor.checkpoint.save({"optim": o.state_dict(), "sched": s.state_dict()}, tmp_path)
    o, s = fresh()
    st = {"optim": o.state_dict(), "sched": s.state_dict()}
    dtensor.checkpoint.load(st, tmp_path)
    o.load_state_dict(st["optim"])
    s.load_state_dict(st["sched"])
    np.testing.assert_array_equal(_run(s, 6), straight[4:])


# ---------------------------------------------------------------- with the optimizers
def test_adam_steps_with_the_scheduled_lr():
    """Each step uses the lr the scheduler set before it: Adam's first step moves by ~lr."""
    p = nn.Parameter(np.zeros(1))
    opt = optim.Adam([p], lr=1.0, eps=1e-12)
    sched = LinearLR(opt, start_factor=0.25, total_iters=3)
    moved = []
    for _ in range(4):
        before = p.numpy().copy()
        p.grad = dtensor.Tensor(np.ones(1))  # a constant gradient: every Adam step is lr
        opt.step()
        sched.step()
        moved.append(float((before - p.numpy())[0]))
    np.testing.assert_allclose(moved, [0.25, 0.5, 0.75, 1.0], rtol=1e-9)


@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW])
def test_a_schedule_does_not_recompile_a_compiled_step(cls):
    """The lr is a runtime scalar of the compiled step: a cosine schedule runs on the first
    two graphs (before and after the optimizer state exists), and matches eager."""
    def setup():
        dtensor.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = cls(model.parameters(), lr=0.05, weight_decay=0.1)
        sched = CosineAnnealingLR(opt, T_max=4, eta_min=0.001)

        def step(x):
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return model, sched, step

    x = dtensor.Tensor(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    eager, compiled = setup(), setup()
    run = dtensor.compile(compiled[2])
    for i in range(7):
        want = eager[2](x).item()
        assert run(x).item() == pytest.approx(want, rel=1e-6)
        for _, sched, _ in (eager, compiled):
            sched.step()
        assert run.compiles == min(i + 1, 2)
    for p, q in zip(eager[0].parameters(), compiled[0].parameters()):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- bad input
class _Holder:
    """Objects the bad-input table refers to, built fresh per case."""

    def __init__(self):
        self.opt = _opt()
        self.other = _opt()


def _resume(h):
    h.opt.param_groups[1].pop("initial_lr", None)
    CosineAnnealingLR(h.opt, T_max=3, last_epoch=4)


def _added_group(h):
    s = LinearLR(h.opt)
    h.opt.add_param_group({"params": [nn.Parameter(np.zeros(1))]})
    s.step()


def _bad_group_lr(h):
    s = CosineAnnealingLR(h.opt, T_max=3)
    h.opt.param_groups[0]["lr"] = "0.1"
    s.step()


def _load(build, edit):
    def call(h):
        s = build(h.opt)
        sd = json.loads(json.dumps(s.state_dict()))
        edit(sd)
        s.load_state_dict(sd)
    return call


def _cos(o):
    return CosineAnnealingLR(o, T_max=3)


def _seq(o):
    return SequentialLR(o, [LinearLR(o), _cos(o)], [2])


# (name, call(holder), exception, regex naming the value and the fix)
BAD = [
    ("not an optimizer", lambda h: _cos("opt"), TypeError,
     r"CosineAnnealingLR: 'opt' \(type str\) is not an Optimizer; pass a dtensor\.optim"),
    ("lambda not an optimizer", lambda h: LambdaLR(None, abs), TypeError,
     r"LambdaLR: None .* is not an Optimizer"),
    ("T_max 0", lambda h: CosineAnnealingLR(h.opt, T_max=0), ValueError,
     r"CosineAnnealingLR: invalid T_max: 0 \(must be an int >= 1\); pass e\.g\. T_max=100\."),
    ("T_max float", lambda h: CosineAnnealingLR(h.opt, T_max=2.5), TypeError,
     r"invalid T_max: 2\.5 has type float, not an int"),
    ("T_max bool", lambda h: CosineAnnealingLR(h.opt, T_max=True), TypeError,
     r"invalid T_max: True has type bool"),
    ("eta_min negative", lambda h: CosineAnnealingLR(h.opt, 3, eta_min=-0.1), ValueError,
     r"invalid eta_min: -0\.1 \(must be a finite number >= 0\); pass e\.g\. eta_min=0\.0"),
    ("eta_min nan", lambda h: CosineAnnealingLR(h.opt, 3, eta_min=math.nan), ValueError,
     r"invalid eta_min: nan"),
    ("start_factor 0", lambda h: LinearLR(h.opt, start_factor=0.0), ValueError,
     r"LinearLR: invalid start_factor: 0\.0 \(must be in \(0, 1\]\); pass e\.g\. "
     r"start_factor=0\.1\."),
    ("start_factor above 1", lambda h: LinearLR(h.opt, start_factor=1.5), ValueError,
     r"invalid start_factor: 1\.5 \(must be in \(0, 1\]\)"),
    ("end_factor negative", lambda h: LinearLR(h.opt, end_factor=-0.5), ValueError,
     r"invalid end_factor: -0\.5 \(must be in \[0, 1\]\)"),
    ("end_factor str", lambda h: LinearLR(h.opt, end_factor="1"), TypeError,
     r"invalid end_factor: '1' has type str"),
    ("total_iters 0", lambda h: LinearLR(h.opt, total_iters=0), ValueError,
     r"invalid total_iters: 0 \(must be an int >= 1\); pass e\.g\. total_iters=5"),
    ("last_epoch -2", lambda h: CosineAnnealingLR(h.opt, 3, last_epoch=-2), ValueError,
     r"invalid last_epoch: -2 \(must be an int >= -1\)"),
    ("last_epoch float", lambda h: LinearLR(h.opt, last_epoch=1.0), TypeError,
     r"invalid last_epoch: 1\.0 has type float"),
    ("resume without initial_lr", _resume, KeyError,
     r"param 'initial_lr' is not specified in param_groups\[0, 1\] when resuming "
     r"\(last_epoch=4\); build the scheduler with last_epoch=-1"),
    ("lr_lambda not callable", lambda h: LambdaLR(h.opt, 0.5), TypeError,
     r"lr_lambda for param_groups\[0\] is 0\.5 \(type float\), not callable"),
    ("lr_lambdas count", lambda h: LambdaLR(h.opt, [abs]), ValueError,
     r"expected 2 lr_lambdas \(one per param group\), got 1"),
    ("lambda returns nan", lambda h: LambdaLR(h.opt, lambda e: math.nan), ValueError,
     r"LambdaLR at epoch 0: lr_lambda returned an invalid factor for param_groups\[0\]: nan"),
    ("lambda returns str", lambda h: LambdaLR(h.opt, lambda e: "1"), TypeError,
     r"lr_lambda returned an invalid factor for param_groups\[0\]: '1' has type str, not a "
     r"real number; return a finite float"),
    ("lambda negative lr", lambda h: LambdaLR(h.opt, lambda e: -1.0), ValueError,
     r"LambdaLR at epoch 0: invalid new lr for param_groups\[0\]: -0\.1 \(must be a finite "
     r"number >= 0\); the schedule's arguments give it: fix them"),
    ("group added since", _added_group, ValueError,
     r"LinearLR: the optimizer has 3 param groups, but the scheduler was built over 2 .*"
     r"build the scheduler after the last add_param_group"),
    ("group lr assigned a str", _bad_group_lr, TypeError,
     r"CosineAnnealingLR: invalid param_groups\[0\]\['lr'\]: '0\.1' has type str"),
    ("sequential empty", lambda h: SequentialLR(h.opt, [], []), ValueError,
     r"schedulers must be a non-empty list of schedulers, got \[\]"),
    ("sequential not a list", lambda h: SequentialLR(h.opt, _cos(h.opt), []), TypeError,
     r"schedulers must be a non-empty list of schedulers, got <.*CosineAnnealingLR"),
    ("sequential child not a scheduler", lambda h: SequentialLR(h.opt, [_cos(h.opt), 3], [2]),
     TypeError, r"schedulers\[1\] is 3 \(type int\), not a scheduler"),
    ("sequential other optimizer",
     lambda h: SequentialLR(h.opt, [_cos(h.opt), _cos(h.other)], [2]), ValueError,
     r"schedulers\[1\] \(CosineAnnealingLR\) was built on another optimizer .*; build every "
     r"scheduler on the same one"),
    ("sequential nested", lambda h: SequentialLR(h.opt, [_cos(h.opt), _seq(h.opt)], [2]),
     TypeError, r"schedulers\[1\] is a SequentialLR"),
    ("sequential same child twice",
     lambda h: (lambda c: SequentialLR(h.opt, [c, c], [2]))(_cos(h.opt)), ValueError,
     r"schedulers\[1\] is schedulers\[0\] again"),
    ("milestones count", lambda h: SequentialLR(h.opt, [_cos(h.opt), LinearLR(h.opt)], []),
     ValueError, r"2 schedulers need 1 milestones .*got 0: \[\]"),
    ("milestones not increasing",
     lambda h: SequentialLR(h.opt, [_cos(h.opt), LinearLR(h.opt), _cos(h.opt)], [5, 5]),
     ValueError, r"milestones must be increasing, got \[5, 5\] \(milestones\[1\] = 5 <= "
                 r"milestones\[0\] = 5\)"),
    ("milestone 0", lambda h: SequentialLR(h.opt, [_cos(h.opt), LinearLR(h.opt)], [0]),
     ValueError, r"invalid milestones\[0\]: 0 \(must be an int >= 1\)"),
    ("milestone float", lambda h: SequentialLR(h.opt, [_cos(h.opt), LinearLR(h.opt)], [2.0]),
     TypeError, r"invalid milestones\[0\]: 2\.0 has type float"),
    ("milestones int", lambda h: SequentialLR(h.opt, [_cos(h.opt), LinearLR(h.opt)], 2),
     TypeError, r"milestones must be a list of ints, got 2"),
    ("load not a dict", lambda h: _cos(h.opt).load_state_dict([1]), TypeError,
     r"CosineAnnealingLR\.load_state_dict: expected the dict state_dict\(\) returns, got \[1\]"),
    ("load missing key", _load(_cos, lambda sd: sd.pop("T_max")), ValueError,
     r"load_state_dict: the state has keys \[.*\], a CosineAnnealingLR \[.*'T_max'"),
    ("load T_max 0", _load(_cos, lambda sd: sd.update(T_max=0)), ValueError,
     r"CosineAnnealingLR\.load_state_dict: invalid T_max: 0"),
    ("load base_lrs length", _load(_cos, lambda sd: sd["base_lrs"].pop()), ValueError,
     r"base_lrs\[\] holds 1 lrs, the optimizer has 2 param groups; load the state_dict\(\) "
     r"of a scheduler built like this one"),
    ("load last_lr nan", _load(_cos, lambda sd: sd["_last_lr"].__setitem__(1, math.nan)),
     ValueError, r"invalid _last_lr\[1\]: nan"),
    ("load last_epoch str", _load(_cos, lambda sd: sd.update(last_epoch="3")), TypeError,
     r"invalid last_epoch: '3' has type str"),
    ("load lambdas", _load(lambda o: LambdaLR(o, abs), lambda sd: sd.update(lr_lambdas=[1])),
     ValueError, r"lr_lambdas must be a list of 2 entries, each None or a dict, got \[1\]"),
    ("load sequential children", _load(_seq, lambda sd: sd["_schedulers"].pop()), ValueError,
     r"_schedulers must be a list of 2 states \(one per scheduler\)"),
    ("load sequential child", _load(_seq, lambda sd: sd["_schedulers"][1].update(T_max=-1)),
     ValueError, r"SequentialLR\.load_state_dict: _schedulers\[1\]: invalid T_max: -1"),
    ("load sequential milestones",
     _load(_seq, lambda sd: sd.update(_milestones=[])), ValueError,
     r"2 schedulers need 1 milestones"),
]


@pytest.mark.parametrize("name, call, exc, pattern", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_a_typed_error_naming_the_value_and_the_fix(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        call(_Holder())
    assert type(info.value) is exc


def test_a_failing_step_or_load_changes_nothing():
    """A lambda that turns bad at epoch 3, and a state with one bad child: the lrs, epochs and
    children stay as they were (every value is checked before any is assigned)."""
    o = _opt()
    s = LambdaLR(o, lambda e: 1.0 if e < 3 else -1.0)
    s.step()
    s.step()
    before = ([g["lr"] for g in o.param_groups], s.state_dict())
    with pytest.raises(ValueError, match="at epoch 3"):
        s.step()
    assert ([g["lr"] for g in o.param_groups], s.state_dict()) == before
    o = _opt()
    seq = _phases(o)
    sd = json.loads(json.dumps(seq.state_dict()))
    seq.step()
    before = json.dumps(seq.state_dict())
    sd["_schedulers"][2]["eta_min"] = -1.0
    with pytest.raises(ValueError, match=r"_schedulers\[2\]: invalid eta_min: -1\.0"):
        seq.load_state_dict(sd)
    assert json.dumps(seq.state_dict()) == before


def test_public_names():
    assert optim.lr_scheduler.__all__ == ["LRScheduler", "LambdaLR", "CosineAnnealingLR",
                                          "LinearLR", "SequentialLR"]
    assert all(issubclass(c, LRScheduler)
               for c in (LambdaLR, CosineAnnealingLR, LinearLR, SequentialLR))


# ---------------------------------------------------------------- several ranks
@pytest.mark.ranks(2, timeout=60)
def test_a_schedule_on_sharded_parameters_matches_one_process(rank):
    """Adam over sharded (uneven) and replicated parameters on 2 ranks, stepped by a warmup +
    cosine SequentialLR, matches the same run on plain tensors; a T_max that differs between
    the ranks raises on both at construction."""
    from dtensor import Replicate, Shard
    from dtensor.dtensor import distribute_tensor
    from dtensor.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rng = np.random.default_rng(3)
    init = [rng.standard_normal(s) for s in ((3, 4), (5,))]
    grads = [[rng.standard_normal(a.shape) for a in init] for _ in range(6)]
    layouts = [[Shard(0)], [Replicate()]]

    def train(params, layout):
        opt = optim.Adam(params, lr=0.05, weight_decay=0.1)
        sched = SequentialLR(opt, [LinearLR(opt, 0.2, total_iters=2),
                                   CosineAnnealingLR(opt, T_max=3, eta_min=0.001)], [2])
        lrs = []
        for gs in grads:
            for p, g, pl in zip(params, gs, layouts):
                p.grad = layout(dtensor.Tensor(g.copy()), pl)
            opt.step()
            sched.step()
            lrs.append(sched.get_last_lr())
        return lrs

    sharded = [nn.Parameter(distribute_tensor(dtensor.Tensor(a.copy()), mesh, pl))
               for a, pl in zip(init, layouts)]
    plain = [nn.Parameter(a.copy()) for a in init]
    assert train(sharded, lambda t, pl: distribute_tensor(t, mesh, pl)) == train(
        plain, lambda t, pl: t)
    for p, q in zip(sharded, plain):
        np.testing.assert_allclose(p.full_tensor().numpy(), q.numpy(), rtol=1e-12, atol=1e-15)

    opt = optim.Adam(sharded, lr=0.05)
    with pytest.raises(ValueError, match=r"CosineAnnealingLR.*Build the scheduler with the same "
                                         r"arguments on every rank"):
        CosineAnnealingLR(opt, T_max=4 + rank)
