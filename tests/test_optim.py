"""Tests of dtensor.optim (SGD, Adam, AdamW, clip_grad_norm_) against plain-numpy implementations of
PyTorch's documented update rules, written here independently of the package.

Parameters are float64 so the comparisons can be tight.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import dtensor
from dtensor import nn, optim

STEPS = 5
SHAPES = [(3, 4), (4,), (2, 2, 3)]
RTOL = 1e-12


def _make(seed=0):
    """Initial parameter values and a fixed per-step gradient sequence (varied magnitudes)."""
    r = np.random.default_rng(seed)
    init = [r.standard_normal(s) for s in SHAPES]
    grads = [[r.standard_normal(s) * 10.0 ** r.integers(-3, 2, size=s) for s in SHAPES]
             for _ in range(STEPS)]
    return init, grads


def _params(init):
    return [nn.Parameter(a.copy()) for a in init]


def _run(opt_factory, init, grads):
    params = _params(init)
    opt = opt_factory(params)
    history = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = dtensor.Tensor(g.copy())
        opt.step()
        history.append([p.numpy().copy() for p in params])
    for p in params:
        assert p.dtype == np.float64
    return history


# ---------------------------------------------------------------- numpy references
def ref_sgd(init, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    """torch.optim.SGD's documented algorithm (maximize=False)."""
    ps = [a.copy() for a in init]
    bufs = [None] * len(ps)
    history = []
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            d = g.copy()
            if weight_decay != 0:
                d = d + weight_decay * ps[i]
            if momentum != 0:
                if bufs[i] is None:
                    bufs[i] = d.copy()
                else:
                    bufs[i] = momentum * bufs[i] + (1 - dampening) * d
                d = d + momentum * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - lr * d
        history.append([p.copy() for p in ps])
    return history


def ref_adamw(init, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    """torch.optim.AdamW's documented algorithm (amsgrad=False, maximize=False)."""
    b1, b2 = betas
    ps = [a.copy() for a in init]
    m = [np.zeros_like(a) for a in init]
    v = [np.zeros_like(a) for a in init]
    history = []
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            ps[i] = ps[i] - lr * weight_decay * ps[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** t)
            ps[i] = ps[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
        history.append([p.copy() for p in ps])
    return history


def ref_adam(init, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """torch.optim.Adam's documented algorithm (amsgrad=False, maximize=False): the decay is
    L2, added to the gradient before the moments."""
    b1, b2 = betas
    ps = [a.copy() for a in init]
    m = [np.zeros_like(a) for a in init]
    v = [np.zeros_like(a) for a in init]
    history = []
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            if weight_decay != 0:
                g = g + weight_decay * ps[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** t)
            ps[i] = ps[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
        history.append([p.copy() for p in ps])
    return history


def _assert_histories(got, want):
    for step, (g_step, w_step) in enumerate(zip(got, want), start=1):
        for i, (g, w) in enumerate(zip(g_step, w_step)):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-14,
                                       err_msg=f"step {step}, param {i}")


# ---------------------------------------------------------------- SGD
SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "dampening": dict(lr=0.05, momentum=0.8, dampening=0.3),
    "nesterov": dict(lr=0.05, momentum=0.7, nesterov=True),
    "weight_decay": dict(lr=0.1, weight_decay=0.05),
    "everything": dict(lr=0.03, momentum=0.6, weight_decay=0.02, nesterov=True),
    "momentum_decay_damp": dict(lr=0.03, momentum=0.6, weight_decay=0.02, dampening=0.5),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_numpy_reference(case):
    kw = SGD_CASES[case]
    init, grads = _make(1)
    got = _run(lambda ps: optim.SGD(ps, **kw), init, grads)
    want = ref_sgd(init, grads, **kw)
    _assert_histories(got, want)
    # The parameters really moved (the check above is not vacuous).
    assert not np.allclose(got[-1][0], init[0])


def test_sgd_reference_variants_are_distinguishable():
    """Each hyperparameter changes the trajectory, so the cases above each test something."""
    init, grads = _make(1)
    finals = {k: ref_sgd(init, grads, **kw)[-1][0] for k, kw in SGD_CASES.items()}
    keys = list(finals)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not np.allclose(finals[a], finals[b], rtol=1e-6), (a, b)


def test_sgd_momentum_buffer_does_not_alias_grad():
    """torch.optim.SGD clones the first gradient into momentum_buffer, so writing the next
    gradient into p.grad in place (p.grad.copy_) must not change the stored buffer."""
    init, grads = _make(2)
    kw = dict(lr=0.05, momentum=0.9)
    params = _params(init)
    opt = optim.SGD(params, **kw)
    for p, g in zip(params, grads[0]):
        p.grad = dtensor.Tensor(g.copy())
    opt.step()
    for p, g in zip(params, grads[1]):
        p.grad.copy_(g.copy())  # in-place gradient write, as accumulation code does
    opt.step()
    want = ref_sgd(init, grads[:2], **kw)[-1]
    for i, (p, w) in enumerate(zip(params, want)):
        np.testing.assert_allclose(
            p.numpy(), w, rtol=RTOL, atol=1e-14,
            err_msg=f"param {i}: BUG (dtensor/optim/optimizers.py SGD._update): the first "
                    f"momentum_buffer is p.grad itself (buf = g), not a copy")


# ---------------------------------------------------------------- AdamW
ADAMW_CASES = {
    "defaults": dict(lr=1e-3),
    "betas_eps_wd": dict(lr=0.02, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1),
    "no_wd": dict(lr=0.01, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.0),
    "big_wd": dict(lr=0.05, betas=(0.9, 0.99), eps=1e-2, weight_decay=0.5),
}


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_matches_numpy_reference(case):
    kw = ADAMW_CASES[case]
    init, grads = _make(3)
    got = _run(lambda ps: optim.AdamW(ps, **kw), init, grads)
    want = ref_adamw(init, grads, **kw)
    _assert_histories(got, want)
    assert not np.allclose(got[-1][0], init[0])


def test_adamw_weight_decay_is_decoupled():
    """With a zero gradient Adam's step is 0, so only the decoupled decay acts: p *= 1 - lr*wd.
    (Coupled L2 decay would instead feed wd*p through the moments and give a ~lr-sized step.)"""
    p = nn.Parameter(np.array([2.0, -4.0, 0.5]))
    opt = optim.AdamW([p], lr=0.1, weight_decay=0.2)
    for _ in range(3):
        p.grad = dtensor.Tensor(np.zeros(3))
        opt.step()
    np.testing.assert_allclose(p.numpy(), np.array([2.0, -4.0, 0.5]) * (1 - 0.1 * 0.2) ** 3,
                               rtol=RTOL)


def test_adamw_first_step_is_bias_corrected():
    """Step 1 with bias correction moves each entry by lr * g/(|g| + eps') ~ lr * sign(g)."""
    g = np.array([1e-4, -3.0, 250.0])
    p = nn.Parameter(np.zeros(3))
    opt = optim.AdamW([p], lr=0.01, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.0)
    p.grad = dtensor.Tensor(g)
    opt.step()
    np.testing.assert_allclose(p.numpy(), -0.01 * np.sign(g), rtol=1e-6)


# ---------------------------------------------------------------- Adam
ADAM_CASES = {
    "defaults": dict(lr=1e-3),
    "weight_decay": dict(lr=0.02, weight_decay=0.1),
    "betas_eps_wd": dict(lr=0.02, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3),
    "big_wd": dict(lr=0.05, betas=(0.5, 0.99), eps=1e-6, weight_decay=2.0),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_numpy_reference(case):
    kw = ADAM_CASES[case]
    init, grads = _make(3)
    got = _run(lambda ps: optim.Adam(ps, **kw), init, grads)
    _assert_histories(got, ref_adam(init, grads, **kw))
    assert not np.allclose(got[-1][0], init[0])


def test_adam_reference_differs_from_adamw_with_weight_decay():
    """The Adam cases test the L2 placement: with the same weight decay, the decoupled
    (AdamW) trajectory is another one, and with none the two coincide."""
    init, grads = _make(3)
    kw = ADAM_CASES["betas_eps_wd"]
    assert not np.allclose(ref_adam(init, grads, **kw)[-1][0],
                           ref_adamw(init, grads, **kw)[-1][0], rtol=1e-6)
    no_wd = dict(kw, weight_decay=0.0)
    np.testing.assert_allclose(ref_adam(init, grads, **no_wd)[-1][0],
                               ref_adamw(init, grads, **no_wd)[-1][0], rtol=1e-15)


def test_adam_defaults_are_torchs():
    opt = optim.Adam([nn.Parameter(np.zeros(2))])
    group = opt.param_groups[0]
    assert {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_adam_weight_decay_goes_through_the_moments():
    """With a zero loss gradient the L2 term is the whole gradient: the first bias-corrected
    step moves each entry by ~lr against its sign (AdamW would shrink it by lr*wd instead)."""
    start = np.array([2.0, -4.0, 0.5])
    p = nn.Parameter(start.copy())
    opt = optim.Adam([p], lr=0.1, weight_decay=0.2, eps=1e-12)
    p.grad = dtensor.Tensor(np.zeros(3))
    opt.step()
    np.testing.assert_allclose(p.numpy(), start - 0.1 * np.sign(start), rtol=1e-9)


def test_adam_param_groups_with_their_own_weight_decay():
    init, grads = _make(5)
    params = _params(init)
    opt = optim.Adam([{"params": [params[0]], "weight_decay": 0.5}, {"params": params[1:]}],
                     lr=0.01)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = dtensor.Tensor(g.copy())
        opt.step()
    want = (ref_adam(init[:1], [g[:1] for g in grads], lr=0.01, weight_decay=0.5)[-1]
            + ref_adam(init[1:], [g[1:] for g in grads], lr=0.01)[-1])
    for p, w in zip(params, want):
        np.testing.assert_allclose(p.numpy(), w, rtol=RTOL, atol=1e-14)


def test_adam_state_dict_round_trip_continues_identically():
    """2 steps, state_dict() into a fresh Adam over copies of the parameters, 3 more steps on
    both: bit-identical, and equal to 5 straight steps of the reference."""
    init, grads = _make(10)
    kw = dict(lr=0.03, betas=(0.8, 0.9), weight_decay=0.1)
    params = _params(init)
    opt = optim.Adam(params, **kw)

    def step(opt, params, gs):
        for p, g in zip(params, gs):
            p.grad = dtensor.Tensor(g.copy())
        opt.step()
    for gs in grads[:2]:
        step(opt, params, gs)
    twins = _params([p.numpy().copy() for p in params])
    resumed = optim.Adam(twins, lr=0.5)  # the loaded hyperparameters replace these
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["lr"] == 0.03
    assert [resumed.state[p]["step"] for p in twins] == [2] * len(twins)
    for gs in grads[2:]:
        step(opt, params, gs)
        step(resumed, twins, gs)
    want = ref_adam(init, grads, **kw)[-1]
    for p, q, w in zip(params, twins, want):
        np.testing.assert_array_equal(q.numpy(), p.numpy())
        np.testing.assert_allclose(p.numpy(), w, rtol=RTOL, atol=1e-14)


def test_adam_amsgrad_is_refused():
    with pytest.raises(NotImplementedError, match=r"amsgrad=True is not implemented; pass "
                                                  r"amsgrad=False"):
        optim.Adam([nn.Parameter(np.zeros(2))], amsgrad=True)


@pytest.mark.ranks(2, timeout=60)
def test_adam_on_sharded_dtensor_parameters_matches_numpy(rank):
    """Parameters sharded (unevenly: 3 rows over 2 ranks) and replicated over a 2-rank mesh,
    5 steps with L2 decay: the full parameters match the numpy reference on every rank."""
    from dtensor import Replicate, Shard
    from dtensor.dtensor import distribute_tensor
    from dtensor.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    layouts = [[Shard(0)], [Shard(0)], [Replicate()]]
    init, grads = _make(11)
    params = [nn.Parameter(distribute_tensor(dtensor.Tensor(a.copy()), mesh, pl))
              for a, pl in zip(init, layouts)]
    kw = dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2)
    opt = optim.Adam(params, **kw)
    for step_grads in grads:
        for p, g, pl in zip(params, step_grads, layouts):
            p.grad = distribute_tensor(dtensor.Tensor(g.copy()), mesh, pl)
        opt.step()
    for i, (p, w, pl) in enumerate(zip(params, ref_adam(init, grads, **kw)[-1], layouts)):
        assert list(p.placements) == pl
        assert list(opt.state[p]["exp_avg"].placements) == pl
        np.testing.assert_allclose(p.full_tensor().numpy(), w, rtol=RTOL, atol=1e-14,
                                   err_msg=f"rank {rank}, param {i}")


# ---------------------------------------------------------------- param groups, zero_grad
def test_param_groups_with_different_lr():
    init, grads = _make(4)
    params = _params(init)
    opt = optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.5,
                                              "momentum": 0.5}], lr=0.01, momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.5]
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = dtensor.Tensor(g.copy())
        opt.step()
    want_a = ref_sgd(init[:2], [g[:2] for g in grads], lr=0.01, momentum=0.9)[-1]
    want_b = ref_sgd(init[2:], [g[2:] for g in grads], lr=0.5, momentum=0.5)[-1]
    for p, w in zip(params, want_a + want_b):
        np.testing.assert_allclose(p.numpy(), w, rtol=RTOL, atol=1e-14)


def test_adamw_param_groups_with_different_lr():
    init, grads = _make(5)
    params = _params(init)
    opt = optim.AdamW([{"params": [params[0]], "lr": 0.1}, {"params": params[1:]}], lr=0.001,
                      weight_decay=0.05)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = dtensor.Tensor(g.copy())
        opt.step()
    want_a = ref_adamw(init[:1], [g[:1] for g in grads], lr=0.1, weight_decay=0.05)[-1]
    want_b = ref_adamw(init[1:], [g[1:] for g in grads], lr=0.001, weight_decay=0.05)[-1]
    for p, w in zip(params, want_a + want_b):
        np.testing.assert_allclose(p.numpy(), w, rtol=RTOL, atol=1e-14)


def test_param_without_grad_is_skipped():
    init, grads = _make(6)
    params = _params(init)
    opt = optim.AdamW(params, lr=0.1)
    params[0].grad = dtensor.Tensor(grads[0][0])
    opt.step()
    assert not np.allclose(params[0].numpy(), init[0])
    for p, a in zip(params[1:], init[1:]):
        np.testing.assert_array_equal(p.numpy(), a)


def test_optimizer_zero_grad():
    params = _params(_make(7)[0])
    for p in params:
        p.grad = dtensor.Tensor(np.ones(p.shape))
    opt = optim.SGD(params, lr=0.1)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_optimizer_zero_grad_set_to_none_false_zeroes():
    """PyTorch: Optimizer.zero_grad(set_to_none=False) leaves zero-filled gradients."""
    params = _params(_make(7)[0])
    for p in params:
        p.grad = dtensor.Tensor(np.ones(p.shape))
    opt = optim.SGD(params, lr=0.1)
    opt.zero_grad(set_to_none=False)
    for p in params:
        assert p.grad is not None, ("BUG (dtensor/optim/optimizers.py Optimizer.zero_grad): "
                                    "set_to_none=False is ignored, grad became None")
        np.testing.assert_array_equal(p.grad.numpy(), np.zeros(p.shape))


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam, optim.AdamW])
def test_negative_lr_raises(cls):
    p = nn.Parameter(np.zeros(2))
    with pytest.raises(ValueError, match=r"-0\.25"):
        cls([p], lr=-0.25)


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam, optim.AdamW])
def test_empty_parameter_list_raises(cls):
    with pytest.raises(ValueError):
        cls([], lr=0.1)
    with pytest.raises(ValueError):
        cls(iter([]), lr=0.1)


def test_bad_hyperparameters_raise():
    p = nn.Parameter(np.zeros(2))
    with pytest.raises(ValueError):
        optim.SGD([p], lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError):
        optim.SGD([p], lr=0.1, nesterov=True)  # nesterov needs momentum
    with pytest.raises(ValueError):
        optim.AdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError):
        optim.AdamW([p], eps=-1e-8)
    with pytest.raises(ValueError, match=r"invalid weight_decay: -0\.1"):
        optim.Adam([p], weight_decay=-0.1)
    with pytest.raises(ValueError, match=r"beta parameter at index 1"):
        optim.Adam([p], betas=(0.9, 1.5))


# ---------------------------------------------------------------- clip_grad_norm_
def _grads_params(seed, scale=1.0):
    r = np.random.default_rng(seed)
    gs = [r.standard_normal(s) * scale for s in SHAPES]
    ps = _params([np.zeros(s) for s in SHAPES])
    for p, g in zip(ps, gs):
        p.grad = dtensor.Tensor(g.copy())
    return ps, gs


def _np_norm(gs, norm_type):
    flat = np.concatenate([g.ravel() for g in gs])
    if norm_type == math.inf:
        return np.abs(flat).max()
    return (np.abs(flat) ** norm_type).sum() ** (1.0 / norm_type)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_clip_grad_norm_above_max_scales_down(norm_type):
    ps, gs = _grads_params(10)
    total = _np_norm(gs, norm_type)
    max_norm = total / 4.0
    out = optim.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    np.testing.assert_allclose(float(out), total, rtol=RTOL)
    coef = max_norm / (total + 1e-6)  # PyTorch's documented clip coefficient
    for p, g in zip(ps, gs):
        assert p.grad.dtype == np.float64
        np.testing.assert_allclose(p.grad.numpy(), g * coef, rtol=RTOL)
    np.testing.assert_allclose(_np_norm([p.grad.numpy() for p in ps], norm_type), max_norm,
                               rtol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_below_max_leaves_grads(norm_type):
    ps, gs = _grads_params(11)
    total = _np_norm(gs, norm_type)
    out = optim.clip_grad_norm_(ps, total * 1.5, norm_type=norm_type)
    np.testing.assert_allclose(float(out), total, rtol=RTOL)
    for p, g in zip(ps, gs):
        np.testing.assert_array_equal(p.grad.numpy(), g)


def test_clip_grad_norm_accepts_generator_single_tensor_and_skips_gradless():
    ps, gs = _grads_params(12)
    extra = nn.Parameter(np.ones(5))  # no grad: ignored
    total = _np_norm(gs, 2.0)
    out = optim.clip_grad_norm_((p for p in ps + [extra]), 1.0)
    np.testing.assert_allclose(float(out), total, rtol=RTOL)
    assert extra.grad is None
    np.testing.assert_allclose(ps[0].grad.numpy(), gs[0] * (1.0 / (total + 1e-6)), rtol=RTOL)

    p = nn.Parameter(np.zeros(4))
    p.grad = dtensor.Tensor(np.array([3.0, 0.0, -4.0, 0.0]))
    out = optim.clip_grad_norm_(p, 1.0)
    np.testing.assert_allclose(float(out), 5.0, rtol=RTOL)
    np.testing.assert_allclose(p.grad.numpy(), np.array([3.0, 0.0, -4.0, 0.0]) / (5.0 + 1e-6),
                               rtol=RTOL)


def test_nn_utils_clip_grad_norm_is_the_same_function():
    assert nn.utils.clip_grad_norm_ is optim.clip_grad_norm_


def test_clip_grad_norm_without_grads_raises():
    ps = _params([np.zeros(s) for s in SHAPES])
    with pytest.raises(ValueError):
        optim.clip_grad_norm_(ps, 1.0)


def test_clip_grad_norm_generator_is_read_once_like_a_list():
    """torch turns the iterable into a list once: a generator clips exactly as the list does."""
    ps, gs = _grads_params(13)
    qs, _ = _grads_params(13)
    a = optim.clip_grad_norm_(iter(ps), 0.5, norm_type=3.0)
    b = optim.clip_grad_norm_(qs, 0.5, norm_type=3.0)
    assert float(a) == float(b)
    for p, q in zip(ps, qs):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())


def test_clip_grad_norm_inf_string_and_edge_max_norms():
    ps, gs = _grads_params(14)
    qs, _ = _grads_params(14)
    assert float(optim.clip_grad_norm_(ps, 0.1, "inf")) == float(
        optim.clip_grad_norm_(qs, 0.1, math.inf)) == _np_norm(gs, math.inf)
    for p, q in zip(ps, qs):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
    ps, gs = _grads_params(15)
    optim.clip_grad_norm_(ps, math.inf)  # inf: no clipping
    for p, g in zip(ps, gs):
        np.testing.assert_array_equal(p.grad.numpy(), g)
    optim.clip_grad_norm_(ps, 0.0)  # 0: every gradient zeroed
    for p in ps:
        np.testing.assert_array_equal(p.grad.numpy(), np.zeros(p.shape))


def test_clip_grad_norm_nonfinite_total_follows_torch():
    """torch multiplies by clamp(max_norm / (total + 1e-6), max=1): a NaN total makes every
    gradient NaN, an infinite one zeroes the finite entries; error_if_nonfinite raises instead,
    and with a finite total it changes nothing."""
    ps, gs = _grads_params(16)
    ps[1].grad = dtensor.Tensor(np.array([1.0, np.nan, 2.0, 3.0]))
    assert math.isnan(float(optim.clip_grad_norm_(ps, 1.0)))
    assert all(np.isnan(p.grad.numpy()).all() for p in ps)
    ps, gs = _grads_params(17)
    ps[1].grad = dtensor.Tensor(np.array([1.0, np.inf, 2.0, 3.0]))
    with np.errstate(invalid="ignore"):  # the inf entry itself becomes inf * 0 = NaN
        assert float(optim.clip_grad_norm_(ps, 1.0)) == math.inf
    np.testing.assert_array_equal(ps[0].grad.numpy(), np.zeros(SHAPES[0]))
    ps, gs = _grads_params(17)
    ps[1].grad = dtensor.Tensor(np.array([1.0, np.inf, 2.0, 3.0]))
    with pytest.raises(RuntimeError, match=r"non-finite \(inf\)"):
        optim.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(ps[0].grad.numpy(), gs[0])  # raised before scaling
    ps, gs = _grads_params(18)
    qs, _ = _grads_params(18)
    optim.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    optim.clip_grad_norm_(qs, 1.0)
    for p, q in zip(ps, qs):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())


def test_sgd_momentum_set_in_a_group_has_state_to_checkpoint():
    """The state a group's momentum needs exists in state_dict() even when the constructor's
    momentum is 0, so a checkpoint round trip continues exactly."""
    init, grads = _make(8)
    params = _params(init)
    opt = optim.SGD([{"params": params[:1]}, {"params": params[1:], "momentum": 0.9}], lr=0.05)
    assert set(opt.state_dict()["state"][1]) == {"momentum_buffer", "step"}
    assert opt.state_dict()["state"][0] == {}
    for p, g in zip(params, grads[0]):
        p.grad = dtensor.Tensor(g.copy())
    opt.step()
    fresh = _params([p.numpy().copy() for p in params])
    resumed = optim.SGD([{"params": fresh[:1]}, {"params": fresh[1:], "momentum": 0.9}],
                        lr=0.05)
    resumed.load_state_dict(opt.state_dict())
    for o, ps in ((opt, params), (resumed, fresh)):
        for p, g in zip(ps, grads[1]):
            p.grad = dtensor.Tensor(g.copy())
        o.step()
    want = ref_sgd(init[1:], [g[1:] for g in grads[:2]], lr=0.05, momentum=0.9)[-1]
    for p, q, w in zip(params[1:], fresh[1:], want):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
        np.testing.assert_allclose(p.numpy(), w, rtol=RTOL, atol=1e-14)


def test_loaded_state_is_a_copy():
    """load_state_dict copies (torch deep-copies): two optimizers loaded from one state_dict()
    do not share state, and float32 state stays float32."""
    init, grads = _make(9)
    params = _params([a.astype(np.float32) for a in init])
    opt = optim.AdamW(params, lr=0.01)
    for p, g in zip(params, grads[0]):
        p.grad = dtensor.Tensor(g.astype(np.float32))
    opt.step()
    sd = opt.state_dict()
    twin = optim.AdamW(_params([p.numpy().copy() for p in params]), lr=0.01)
    twin.load_state_dict(sd)
    before = [twin.state[p]["exp_avg"].numpy().copy() for p in twin.param_groups[0]["params"]]
    for p, g in zip(params, grads[1]):
        p.grad = dtensor.Tensor(g.astype(np.float32))
    opt.step()
    for p, b in zip(twin.param_groups[0]["params"], before):
        st = twin.state[p]
        assert st["exp_avg"].dtype == np.float32 and st["step"] == 1
        np.testing.assert_array_equal(st["exp_avg"].numpy(), b)


# ---------------------------------------------------------------- end to end
def test_linear_regression_trains_with_sgd():
    dtensor.manual_seed(0)
    r = np.random.default_rng(42)
    X = r.standard_normal((64, 3)).astype(np.float32)
    w_true = np.array([[1.5, -2.0, 0.5]], np.float32)
    y = (X @ w_true.T + 0.3).astype(np.float32)
    model = nn.Linear(3, 1)
    opt = optim.SGD(model.parameters(), lr=0.1)
    xt, yt = dtensor.Tensor(X), dtensor.Tensor(y)

    def np_loss():
        pred = X.astype(np.float64) @ model.weight.numpy().T.astype(np.float64) \
            + model.bias.numpy().astype(np.float64)
        return float(((pred - y) ** 2).mean())

    start = np_loss()
    losses = []
    for _ in range(50):
        opt.zero_grad()
        loss = ((model(xt) - yt) ** 2).mean()
        losses.append(float(loss))
        loss.backward()
        opt.step()
    initial, final = losses[0], np_loss()
    np.testing.assert_allclose(initial, start, rtol=1e-5)  # dtensor's MSE agrees with numpy's
    assert final < initial / 10.0, (initial, final)
    np.testing.assert_allclose(model.weight.numpy(), w_true, atol=0.1)
    np.testing.assert_allclose(model.bias.numpy(), [0.3], atol=0.1)
