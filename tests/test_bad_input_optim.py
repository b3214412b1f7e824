"""Bad input to the optimizers and clip_grad_norm_: each call raises the documented exception
type, with a message holding the offending value (and the fix), within 1 s.

One table per check in dtensor/optim: hyperparameters (``_check_hyperparameters``), parameters
(``_param_list`` and friends), loaded state (``load_state_dict``), gradients at ``step`` and
``clip_grad_norm_``'s arguments. The hyperparameter table runs through every entry point that
takes hyperparameters (constructor, a param group, add_param_group, load_state_dict, step after
an assignment), so each entry is shown to reach the one check. A 2-rank test runs a subset with
DTensor parameters and checks that every rank raised.
"""
from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest

import dtensor
from dtensor import nn, optim

NAN, INF = float("nan"), float("inf")


def _param(*shape):
    return nn.Parameter(np.zeros(shape or (3,)))


def _with_grad(p, g=None):
    p.grad = dtensor.Tensor(np.ones(p.shape) if g is None else g)
    return p


def _raises(call, exc, pattern):
    """``call()`` raises ``exc`` (exactly) with a message matching ``pattern``, in < 1 s."""
    t = time.perf_counter()
    with pytest.raises(exc, match=pattern) as info:
        call()
    took = time.perf_counter() - t
    assert type(info.value) is exc, (type(info.value), info.value)
    assert took < 1.0, took
    return info.value


# ---------------------------------------------------------------- hyperparameters
# (name, optimizer, bad hyperparameters, exception, regex naming the value)
HYPER = [
    ("lr str", "AdamW", {"lr": "0.1"}, TypeError, r"invalid lr: '0\.1' has type str"),
    ("lr None", "AdamW", {"lr": None}, TypeError, r"invalid lr: None has type NoneType"),
    ("lr bool", "AdamW", {"lr": True}, TypeError, r"invalid lr: True has type bool"),
    ("lr numpy bool", "SGD", {"lr": np.True_}, TypeError, r"invalid lr: \S*True\S* has type"),
    ("lr 0-d array", "AdamW", {"lr": np.array(0.1)}, TypeError,
     r"invalid lr: array\(0\.1\) has type ndarray"),
    ("lr tensor", "AdamW", {"lr": dtensor.Tensor(np.float32(0.1))}, TypeError,
     r"invalid lr: .*0\.1.* has type Tensor"),
    ("lr list", "SGD", {"lr": [0.1]}, TypeError, r"invalid lr: \[0\.1\] has type list"),
    ("lr complex", "SGD", {"lr": 0.1j}, TypeError, r"invalid lr: 0\.1j has type complex"),
    ("lr fraction", "SGD", {"lr": Fraction(1, 10)}, TypeError,
     r"invalid lr: Fraction\(1, 10\) has type Fraction"),
    ("lr negative", "AdamW", {"lr": -1.0}, ValueError,
     r"invalid lr: -1\.0 \(must be a finite number >= 0\); pass e\.g\. lr=0\.001"),
    ("lr negative int", "SGD", {"lr": -1}, ValueError, r"invalid lr: -1 \("),
    ("lr nan", "AdamW", {"lr": NAN}, ValueError, r"invalid lr: nan \("),
    ("lr numpy nan", "SGD", {"lr": np.float32("nan")}, ValueError, r"invalid lr: \S*nan\S* \("),
    ("lr inf", "AdamW", {"lr": INF}, ValueError, r"invalid lr: inf \("),
    ("lr -inf", "SGD", {"lr": -INF}, ValueError, r"invalid lr: -inf \("),
    ("lr huge int", "SGD", {"lr": 10 ** 400}, ValueError, r"invalid lr: 1000000000\d+ \("),
    ("betas one", "AdamW", {"betas": (0.9,)}, ValueError,
     r"invalid betas: \(0\.9,\) has length 1, not 2; pass e\.g\. betas=\(0\.9, 0\.999\)"),
    ("betas three", "AdamW", {"betas": (0.9, 0.99, 0.999)}, ValueError,
     r"invalid betas: \(0\.9, 0\.99, 0\.999\) has length 3"),
    ("betas float", "AdamW", {"betas": 0.9}, TypeError,
     r"invalid betas: 0\.9 has type float, not a pair"),
    ("betas str", "AdamW", {"betas": "ab"}, TypeError, r"invalid betas: 'ab' has type str"),
    ("betas None", "AdamW", {"betas": None}, TypeError, r"invalid betas: None has type"),
    ("betas set", "AdamW", {"betas": {0.9, 0.99}}, TypeError, r"invalid betas: .* has type set"),
    ("beta1 one", "AdamW", {"betas": (1.0, 0.999)}, ValueError,
     r"beta parameter at index 0 \(betas\[0\]\): 1\.0 \(must be in \[0, 1\)\)"),
    ("beta2 one", "AdamW", {"betas": (0.9, 1.0)}, ValueError,
     r"beta parameter at index 1 \(betas\[1\]\): 1\.0 \("),
    ("beta1 negative", "AdamW", {"betas": (-0.1, 0.999)}, ValueError,
     r"index 0 \(betas\[0\]\): -0\.1 \("),
    ("beta2 nan", "AdamW", {"betas": [0.9, NAN]}, ValueError, r"index 1 \(betas\[1\]\): nan \("),
    ("beta1 str", "AdamW", {"betas": ("0.9", 0.999)}, TypeError,
     r"index 0 \(betas\[0\]\): '0\.9' has type str"),
    ("eps negative", "AdamW", {"eps": -1e-8}, ValueError, r"invalid eps: -1e-08 \("),
    ("eps nan", "AdamW", {"eps": NAN}, ValueError, r"invalid eps: nan \("),
    ("eps inf", "AdamW", {"eps": INF}, ValueError, r"invalid eps: inf \("),
    ("eps str", "AdamW", {"eps": "1e-8"}, TypeError, r"invalid eps: '1e-8' has type str"),
    ("adamw weight_decay negative", "AdamW", {"weight_decay": -0.01}, ValueError,
     r"invalid weight_decay: -0\.01 \("),
    ("adamw weight_decay inf", "AdamW", {"weight_decay": INF}, ValueError,
     r"invalid weight_decay: inf \("),
    ("adamw weight_decay bool", "AdamW", {"weight_decay": True}, TypeError,
     r"invalid weight_decay: True has type bool"),
    ("sgd lr negative", "SGD", {"lr": -0.25}, ValueError, r"invalid lr: -0\.25 \("),
    ("sgd weight_decay negative", "SGD", {"weight_decay": -1.0}, ValueError,
     r"invalid weight_decay: -1\.0 \("),
    ("momentum negative", "SGD", {"momentum": -0.5}, ValueError,
     r"invalid momentum: -0\.5 \(must be a finite number >= 0\); pass e\.g\. momentum=0\.9"),
    ("momentum nan", "SGD", {"momentum": NAN}, ValueError, r"invalid momentum: nan \("),
    ("momentum inf", "SGD", {"momentum": INF}, ValueError, r"invalid momentum: inf \("),
    ("momentum str", "SGD", {"momentum": "0.9"}, TypeError,
     r"invalid momentum: '0\.9' has type str"),
    ("dampening above one", "SGD", {"dampening": 1.5}, ValueError,
     r"invalid dampening: 1\.5 \(must be in \[0, 1\]\)"),
    ("dampening negative", "SGD", {"dampening": -0.1}, ValueError,
     r"invalid dampening: -0\.1 \("),
    ("nesterov str", "SGD", {"nesterov": "yes"}, TypeError,
     r"invalid nesterov: 'yes' has type str, not a bool; pass nesterov=True or nesterov=False"),
    ("nesterov int", "SGD", {"nesterov": 1}, TypeError, r"invalid nesterov: 1 has type int"),
    ("nesterov without momentum", "SGD", {"nesterov": True}, ValueError,
     r"Nesterov momentum requires a momentum and zero dampening, got momentum=0\.0, "
     r"dampening=0\.0; set momentum > 0"),
    ("nesterov with dampening", "SGD", {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
     ValueError, r"Nesterov .* got momentum=0\.9, dampening=0\.1"),
]


def _through_constructor(cls, bad):
    cls([_param()], **bad)


def _through_group(cls, bad):
    cls([{"params": [_param()]}, {"params": [_param()], **bad}])


def _through_add_param_group(cls, bad):
    opt = cls([_param()])
    try:
        opt.add_param_group({"params": [_param()], **bad})
    except (TypeError, ValueError):
        assert len(opt.param_groups) == 1  # a rejected group is not added
        raise


def _through_load_state_dict(cls, bad):
    opt = cls([_with_grad(_param())])
    opt.step()
    sd = opt.state_dict()
    before = dict(opt.param_groups[0])
    sd["param_groups"][0].update(bad)
    try:
        opt.load_state_dict(sd)
    except (TypeError, ValueError):
        assert opt.param_groups[0] == before  # nothing taken from a rejected state
        raise


def _through_step(cls, bad):
    p = _with_grad(_param())
    opt = cls([p])
    opt.param_groups[0].update(bad)  # as a scheduler would
    try:
        opt.step()
    except (TypeError, ValueError):
        np.testing.assert_array_equal(p.numpy(), np.zeros(3))  # no update happened
        raise


# entry point -> (call, the message's prefix naming the entry)
ENTRIES = {
    "constructor": (_through_constructor, r"^{cls}: "),
    "param group": (_through_group, r"^{cls}: param_groups\[1\]: "),
    "add_param_group": (_through_add_param_group, r"^{cls}\.add_param_group: param_group: "),
    "load_state_dict": (_through_load_state_dict, r"^{cls}\.load_state_dict: param_groups\[0\]: "),
    "step": (_through_step, r"^{cls}\.step: param_groups\[0\]: "),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("case", HYPER, ids=[c[0] for c in HYPER])
def test_bad_hyperparameter_through_every_entry(case, entry):
    _, cls_name, bad, exc, pattern = case
    call, prefix = ENTRIES[entry]
    cls = getattr(optim, cls_name)
    _raises(lambda: call(cls, bad), exc, prefix.format(cls=cls_name) + ".*" + pattern)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "step"])
def test_edge_values_torch_accepts_pass(entry):
    """The entries take the edge values PyTorch takes (the table's errors are not blanket)."""
    call, _ = ENTRIES[entry]
    call(optim.AdamW, dict(lr=0, betas=[0.0, 0.0], eps=0.0, weight_decay=0))
    call(optim.SGD, dict(lr=np.float32(0.5), momentum=5, dampening=1.0, nesterov=np.False_))


def test_step_takes_assigned_betas_as_a_tuple():
    """A compiled step keys its graphs by the hyperparameters, so they stay hashable."""
    p = _with_grad(_param())
    opt = optim.AdamW([p], betas=[0.5, 0.5])
    assert opt.param_groups[0]["betas"] == (0.5, 0.5)
    opt.param_groups[0]["betas"] = [0.8, 0.9]
    opt.step()
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_step_with_a_hyperparameter_deleted():
    p = _with_grad(_param())
    opt = optim.AdamW([p])
    del opt.param_groups[0]["eps"]
    _raises(opt.step, ValueError, r"AdamW\.step: param_groups\[0\]: missing hyperparameter "
                                  r"'eps'; pass e\.g\. eps=1e-08")


# ---------------------------------------------------------------- parameters
def _consumed():
    gen = nn.Linear(2, 2).parameters()
    list(gen)
    return gen


def _non_leaf():
    return _param() * 2.0


_P, _Q = _param(), _param(2, 3)  # shared by cases that need the same object twice

# (name, params argument (built when the case runs), exception, regex naming the value)
PARAMS = [
    ("single parameter", lambda: _P, TypeError,
     r"params argument given to the optimizer should be an iterable of Tensors or dicts, but "
     r"got a Parameter of shape \(3,\), dtype float64; pass \[param\]"),
    ("int", lambda: 5, TypeError, r"should be an iterable of Tensors or dicts, but got 5 "
                                  r"\(type int\)"),
    ("none", lambda: None, TypeError, r"but got None \(type NoneType\)"),
    ("str", lambda: "weight", TypeError, r"but got 'weight' \(type str\)"),
    ("one dict", lambda: {"params": [_P]}, TypeError,
     r"but got one dict \(keys \['params'\]\); pass a list of groups"),
    ("set", lambda: {_P}, TypeError, r"params is a set, whose order changes"),
    ("empty list", lambda: [], ValueError, r"got an empty parameter list \(\[\]\)"),
    ("empty iterator", lambda: iter([]), ValueError,
     r"got an empty parameter list \(<list_iterator"),
    ("consumed generator", _consumed, ValueError,
     r"got an empty parameter list \(<generator .*used up after one pass"),
    ("listed twice", lambda: [_P, _P], ValueError,
     r"params\[1\] is params\[0\] again \(a Parameter of shape \(3,\), dtype float64\): a "
     r"parameter listed twice is updated twice per step"),
    ("listed twice apart", lambda: [_P, _Q, _P], ValueError, r"params\[2\] is params\[0\] again"),
    ("twice in a group", lambda: [{"params": [_Q, _Q]}], ValueError,
     r"param_groups\[0\]\['params'\]\[1\] is param_groups\[0\]\['params'\]\[0\] again \(a "
     r"Parameter of shape \(2, 3\)"),
    ("in two groups", lambda: [{"params": [_P]}, {"params": [_Q, _P]}], ValueError,
     r"some parameters appear in more than one parameter group: param_groups\[1\]\['params'\]"
     r"\[1\] \(a Parameter of shape \(3,\).*\) is already in param_groups\[0\]"),
    ("tensor and dict", lambda: [_P, {"params": [_Q]}], TypeError,
     r"params\[1\] is a dict but params\[0\] has type Parameter"),
    ("nested list", lambda: [[_P]], TypeError, r"params\[0\] is \[.* \(type list\)"),
    ("ndarray", lambda: [np.ones(3)], TypeError,
     r"params\[0\] is array\(\[1\., 1\., 1\.\]\) \(type ndarray\): optimizer can only optimize "
     r"Tensors"),
    ("int entry", lambda: [5], TypeError, r"params\[0\] is 5 \(type int\)"),
    ("none entry", lambda: [_P, None], TypeError, r"params\[1\] is None \(type NoneType\)"),
    ("no grad", lambda: [dtensor.Tensor(np.ones(3))], ValueError,
     r"params\[0\] \(a Tensor of shape \(3,\), dtype float64\) does not require grad"),
    ("int dtype", lambda: [dtensor.Tensor(np.arange(3))], TypeError,
     r"params\[0\] is a Tensor of shape \(3,\), dtype int64; an optimizer updates "
     r"floating-point tensors"),
    ("non-leaf", lambda: [_non_leaf()], ValueError,
     r"params\[0\] \(a Tensor of shape \(3,\), dtype float64\) is not a leaf"),
    ("group without params", lambda: [{"lr": 0.1}], ValueError,
     r"param_groups\[0\] has no 'params' entry \(keys \['lr'\]\)"),
    ("group params set", lambda: [{"params": {_P}}], TypeError,
     r"param_groups\[0\]\['params'\] is a set: optimizer parameters need to be organized in "
     r"ordered collections"),
    ("group params int", lambda: [{"params": 5}], TypeError,
     r"param_groups\[0\]\['params'\] must be a tensor or an iterable of tensors, got 5"),
    ("group params str", lambda: [{"params": "w"}], TypeError,
     r"param_groups\[0\]\['params'\] must be .* got 'w' \(type str\)"),
    ("group entry int", lambda: [{"params": [_P]}, {"params": [7]}], TypeError,
     r"param_groups\[1\]\['params'\]\[0\] is 7 \(type int\)"),
]


@pytest.mark.parametrize("cls", ["SGD", "AdamW"])
@pytest.mark.parametrize("case", PARAMS, ids=[c[0] for c in PARAMS])
def test_bad_params_to_the_constructor(case, cls):
    _, make, exc, pattern = case
    _raises(lambda: getattr(optim, cls)(make()), exc, rf"^{cls}\b.*" + pattern)


# (name, group for add_param_group on an optimizer already holding _P, exception, regex)
ADD_GROUP = [
    ("not a dict", lambda: [_Q], TypeError,
     r"param_group must be a dict \{'params': \[\.\.\.\], \.\.\.\}, got \[Parameter"),
    ("no params", lambda: {"lr": 0.1}, ValueError,
     r"param_group has no 'params' entry \(keys \['lr'\]\)"),
    ("already present", lambda: {"params": [_Q, _P]}, ValueError,
     r"some parameters appear in more than one parameter group: param_group\['params'\]\[1\] "
     r"\(a Parameter of shape \(3,\).*\) is already in param_groups\[0\]"),
    ("set", lambda: {"params": {_Q}}, TypeError, r"param_group\['params'\] is a set"),
    ("twice", lambda: {"params": [_Q, _Q]}, ValueError,
     r"param_group\['params'\]\[1\] is param_group\['params'\]\[0\] again"),
    ("not a tensor", lambda: {"params": ["w"]}, TypeError,
     r"param_group\['params'\]\[0\] is 'w' \(type str\)"),
    ("empty group, bad lr", lambda: {"params": _consumed(), "lr": -3.0}, ValueError,
     r"param_group: invalid lr: -3\.0"),
]


@pytest.mark.parametrize("case", ADD_GROUP, ids=[c[0] for c in ADD_GROUP])
def test_bad_add_param_group(case):
    _, make, exc, pattern = case
    opt = optim.AdamW([_P])
    _raises(lambda: opt.add_param_group(make()), exc, r"^AdamW\.add_param_group: .*" + pattern)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [_P]


def test_add_param_group_takes_a_single_tensor_and_the_defaults():
    a, b = _with_grad(_param()), _with_grad(_param(), np.full(3, 2.0))
    opt = optim.SGD([a], lr=0.1, momentum=0.5)
    opt.add_param_group({"params": b, "lr": 0.01})
    assert opt.param_groups[1]["params"] == [b] and opt.param_groups[1]["momentum"] == 0.5
    opt.step()
    np.testing.assert_allclose(b.numpy(), np.full(3, -0.02))
    np.testing.assert_allclose(a.numpy(), np.full(3, -0.1))


# ---------------------------------------------------------------- load_state_dict
def _adamw_state():
    """An AdamW over (3,) and (2, 3) parameters after one step, and its state_dict."""
    p, q = _with_grad(_param()), _with_grad(_param(2, 3))
    opt = optim.AdamW([p, q])
    opt.step()
    return opt, opt.state_dict()


def _edit(fn):
    """A case: the state dict after ``fn(sd)`` (fn edits it in place or returns a new one)."""
    def make():
        opt, sd = _adamw_state()
        sd = {"state": {k: dict(v) for k, v in sd["state"].items()},
              "param_groups": [dict(g) for g in sd["param_groups"]]}
        out = fn(sd)
        return opt, sd if out is None else out
    return make


def _pop(d: dict, key) -> None:
    del d[key]


T = dtensor.Tensor

# (name, state dict maker, exception, regex naming the value)
STATE = [
    ("list", _edit(lambda sd: [1, 2]), TypeError,
     r"expected the dict state_dict\(\) returns, got \[1, 2\] \(type list\)"),
    ("none", lambda: (_adamw_state()[0], None), TypeError, r"got None \(type NoneType\)"),
    ("no groups", _edit(lambda sd: {"state": sd["state"]}), ValueError,
     r"the state dict has no \['param_groups'\] \(keys \['state'\]\); pass what state_dict"),
    ("empty", _edit(lambda sd: {}), ValueError, r"has no \['state', 'param_groups'\]"),
    ("groups a dict", _edit(lambda sd: {**sd, "param_groups": {"lr": 1}}), TypeError,
     r"'param_groups' must be a list of dicts, got \{'lr': 1\}"),
    ("group an int", _edit(lambda sd: {**sd, "param_groups": [5]}), TypeError,
     r"'param_groups' must be a list of dicts, got \[5\]"),
    ("state a list", _edit(lambda sd: {**sd, "state": []}), TypeError,
     r"'state' must be a dict \{index: \{name: value\}\}, got \[\] \(type list\)"),
    ("two groups", _edit(lambda sd: {**sd, "param_groups": sd["param_groups"] * 2}),
     ValueError, r"different number of parameter groups: 2, this optimizer 1"),
    ("group size", _edit(lambda sd: sd["param_groups"][0].update(params=[0])), ValueError,
     r"param_groups\[0\]: loaded state dict contains a parameter group that doesn't match the "
     r"size of optimizer's group: 1 parameters, this optimizer's group 2"),
    ("group without params", _edit(lambda sd: _pop(sd["param_groups"][0], "params")), TypeError,
     r"param_groups\[0\]\['params'\] must be a list of int indices, got None"),
    ("str indices", _edit(lambda sd: sd["param_groups"][0].update(params=["a", "b"])),
     TypeError, r"must be a list of int indices, got \['a', 'b'\]"),
    ("bool indices", _edit(lambda sd: sd["param_groups"][0].update(params=[False, True])),
     TypeError, r"got \[False, True\]"),
    ("repeated index", _edit(lambda sd: sd["param_groups"][0].update(params=[0, 0])),
     ValueError, r"param_groups\[0\]\['params'\] lists index 0 twice"),
    ("unknown index", _edit(lambda sd: sd["state"].update({7: {}})), ValueError,
     r"state has an entry for index 7, which no param group lists \(indices \[0, 1\]\)"),
    ("bad key", _edit(lambda sd: sd["state"].update({"x": {}})), ValueError,
     r"state has an entry for index 'x'"),
    ("entry an int", _edit(lambda sd: sd["state"].update({0: 5})), TypeError,
     r"state\[0\] must be a dict \{name: value\}, got 5 \(type int\)"),
    ("missing exp_avg_sq", _edit(lambda sd: _pop(sd["state"][0], "exp_avg_sq")), ValueError,
     r"state\[0\]: AdamW state for a Parameter of shape \(3,\), dtype float64 holds keys "
     r"\['exp_avg', 'step'\], expected \['exp_avg', 'exp_avg_sq', 'step'\] \(or none\)"),
    ("missing step", _edit(lambda sd: _pop(sd["state"][1], "step")), ValueError,
     r"state\[1\]: .* holds keys \['exp_avg', 'exp_avg_sq'\], expected"),
    ("extra key", _edit(lambda sd: sd["state"][0].update(max_exp_avg_sq=T(np.zeros(3)))),
     ValueError, r"holds keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\]"),
    ("exp_avg shape", _edit(lambda sd: sd["state"][0].update(exp_avg=T(np.zeros(4)))),
     ValueError, r"state\[0\]\['exp_avg'\] is a Tensor of shape \(4,\), dtype float64, but its "
                 r"parameter is a Parameter of shape \(3,\)"),
    ("exp_avg transposed", _edit(lambda sd: sd["state"][1].update(exp_avg=T(np.zeros((3, 2))))),
     ValueError, r"state\[1\]\['exp_avg'\] is a Tensor of shape \(3, 2\).* shape \(2, 3\)"),
    ("exp_avg_sq dtype", _edit(lambda sd: sd["state"][0].update(
        exp_avg_sq=T(np.zeros(3, np.float32)))), ValueError,
     r"state\[0\]\['exp_avg_sq'\] is a Tensor of shape \(3,\), dtype float32, but its "
     r"parameter .* dtype float64"),
    ("exp_avg ndarray", _edit(lambda sd: sd["state"][0].update(exp_avg=np.zeros(3))), TypeError,
     r"state\[0\]\['exp_avg'\] must be a tensor like the parameter \(a Parameter of shape "
     r"\(3,\), dtype float64\), got array\(\[0\., 0\., 0\.\]\) \(type ndarray\)"),
    ("exp_avg none", _edit(lambda sd: sd["state"][0].update(exp_avg=None)), TypeError,
     r"\['exp_avg'\] must be a tensor .* got None"),
    ("step negative", _edit(lambda sd: sd["state"][0].update(step=-1)), ValueError,
     r"state\[0\]\['step'\] must be an int >= 0, got -1"),
    ("step float", _edit(lambda sd: sd["state"][0].update(step=1.5)), TypeError,
     r"state\[0\]\['step'\] must be an int >= 0, got 1\.5 \(type float\)"),
    ("step bool", _edit(lambda sd: sd["state"][0].update(step=True)), TypeError,
     r"got True \(type bool\)"),
    ("step str", _edit(lambda sd: sd["state"][0].update(step="3")), TypeError,
     r"got '3' \(type str\)"),
    ("group lr", _edit(lambda sd: sd["param_groups"][0].update(lr="fast")), TypeError,
     r"param_groups\[0\]: invalid lr: 'fast' has type str"),
]


@pytest.mark.parametrize("case", STATE, ids=[c[0] for c in STATE])
def test_bad_load_state_dict(case):
    _, make, exc, pattern = case
    opt, sd = make()
    before = {p: dict(s) for p, s in opt.state.items()}
    groups = [dict(g) for g in opt.param_groups]
    _raises(lambda: opt.load_state_dict(sd), exc, r"^AdamW\.load_state_dict: .*" + pattern)
    assert opt.param_groups == groups and {p: dict(s) for p, s in opt.state.items()} == before


def test_sgd_state_of_the_wrong_shape():
    p = _with_grad(_param())
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0] = {"momentum_buffer": T(np.zeros(5)), "step": 1}
    _raises(lambda: opt.load_state_dict(sd), ValueError,
            r"^SGD\.load_state_dict: state\[0\]\['momentum_buffer'\] is a Tensor of shape \(5,\)")


def test_load_state_dict_takes_json_like_keys_and_lists():
    """String indices and betas as a list (what JSON gives back) load, and training continues
    exactly as without the round trip."""
    opt, sd = _adamw_state()
    ref, ref_sd = _adamw_state()
    sd = {"state": {str(k): v for k, v in sd["state"].items()},
          "param_groups": [{**g, "betas": list(g["betas"])} for g in sd["param_groups"]]}
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    for o in (opt, ref):
        o.step()
    for a, b in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert opt.state[a]["step"] == 2


# ---------------------------------------------------------------- gradients at step
# (name, optimizer, gradient given to the second group's parameter, exception, regex)
GRADS = [
    ("matrix for vector", "SGD", T(np.ones((3, 3))), ValueError,
     r"the gradient of param_groups\[1\]\['params'\]\[0\] has shape \(3, 3\), the parameter "
     r"\(3,\); assign p\.grad a tensor of the parameter's shape"),
    ("broadcastable", "SGD", T(np.ones(1)), ValueError, r"has shape \(1,\), the parameter"),
    ("scalar", "AdamW", T(np.float64(1.0)), ValueError, r"has shape \(\), the parameter \(3,\)"),
    ("list", "AdamW", [1.0, 2.0, 3.0], TypeError,
     r"param_groups\[1\]\['params'\]\[0\] is \[1\.0, 2\.0, 3\.0\] \(type list\), not a tensor"),
]


@pytest.mark.parametrize("case", GRADS, ids=[c[0] for c in GRADS])
def test_bad_gradient_at_step(case):
    _, cls, grad, exc, pattern = case
    a, b = _with_grad(_param()), _param()
    b.grad = grad
    opt = getattr(optim, cls)([{"params": [a]}, {"params": [b]}], lr=0.1)
    _raises(opt.step, exc, rf"^{cls}\.step: .*" + pattern)
    # checked before any update: the first group's parameter did not move either
    np.testing.assert_array_equal(a.numpy(), np.zeros(3))
    assert opt.state == {} or all(not s for s in opt.state.values())


# ---------------------------------------------------------------- clip_grad_norm_
def _clip(parameters=None, *args, **kw):
    if parameters is None:
        parameters = [_with_grad(_param()), _with_grad(_param(2, 3))]
    return lambda: optim.clip_grad_norm_(parameters, *args, **kw)


def _with_value(v):
    g = np.ones(3)
    g[1] = v
    return [_with_grad(_param(), g), _with_grad(_param(2))]


# (name, call, exception, regex naming the value)
CLIP = [
    ("max_norm negative", _clip(None, -1.0), ValueError,
     r"max_norm must be >= 0 \(inf for no clipping\), got -1\.0; pass e\.g\. max_norm=1\.0"),
    ("max_norm nan", _clip(None, NAN), ValueError, r"max_norm must be >= 0 .* got nan"),
    ("max_norm -inf", _clip(None, -INF), ValueError, r"got -inf"),
    ("max_norm str", _clip(None, "1.0"), TypeError,
     r"max_norm must be a number, got '1\.0' \(type str\)"),
    ("max_norm none", _clip(None, None), TypeError, r"max_norm must be a number, got None"),
    ("max_norm bool", _clip(None, True), TypeError, r"got True \(type bool\)"),
    ("max_norm tensor", _clip(None, T(np.float32(1.0))), TypeError, r"\(type Tensor\)"),
    ("norm_type zero", _clip(None, 1.0, 0), ValueError,
     r"norm_type must be > 0 or inf, got 0; pass e\.g\. norm_type=2\.0"),
    ("norm_type negative", _clip(None, 1.0, -2.0), ValueError, r"got -2\.0"),
    ("norm_type nan", _clip(None, 1.0, NAN), ValueError, r"norm_type must be > 0 .* got nan"),
    ("norm_type -inf", _clip(None, 1.0, -INF), ValueError, r"got -inf"),
    ("norm_type name", _clip(None, 1.0, "l2"), ValueError,
     r"norm_type 'l2' is not a p-norm; pass a number > 0 .* or 'inf'"),
    ("norm_type digits", _clip(None, 1.0, "2"), ValueError, r"norm_type '2' is not a p-norm"),
    ("norm_type none", _clip(None, 1.0, None), TypeError,
     r"norm_type must be a number or 'inf', got None"),
    ("norm_type bool", _clip(None, 1.0, True), TypeError, r"got True \(type bool\)"),
    ("error_if_nonfinite str", _clip(None, 1.0, error_if_nonfinite="yes"), TypeError,
     r"error_if_nonfinite must be a bool, got 'yes'"),
    ("parameters none", lambda: optim.clip_grad_norm_(None, 1.0), TypeError,
     r"parameters must be a tensor or an iterable of tensors, got None \(type NoneType\)"),
    ("parameters int", _clip(5, 1.0), TypeError, r"got 5 \(type int\)"),
    ("parameters str", _clip("abc", 1.0), TypeError, r"got 'abc' \(type str\)"),
    ("parameters dict", _clip({"w": 1}, 1.0), TypeError, r"got \{'w': 1\} \(type dict\)"),
    ("empty list", _clip([], 1.0), ValueError, r"got no parameters \(\[\]\)"),
    ("empty iterator", _clip(iter([]), 1.0), ValueError, r"got no parameters \(<list_iterator"),
    ("consumed generator", lambda: optim.clip_grad_norm_(_consumed(), 1.0), ValueError,
     r"got no parameters \(<generator .*used up after one pass"),
    ("listed twice", _clip([_with_grad(_P), _with_grad(_P)], 1.0), ValueError,
     r"parameters\[1\] is parameters\[0\] again \(shape \(3,\)\): its gradient would be "
     r"counted and scaled twice"),
    ("int entry", _clip([5], 1.0), TypeError, r"parameters\[0\] is 5 \(type int\), not a tensor"),
    ("ndarray entry", _clip([np.ones(2)], 1.0), TypeError, r"parameters\[0\] is array\("),
    ("no gradients", _clip([_param(), _param()], 1.0), ValueError,
     r"none of the 2 parameters has a gradient; call backward\(\) first"),
    ("ndarray gradient", _clip([nn.Parameter(np.ones(2))], 1.0), None, None),  # set below
    ("inf gradient", lambda: optim.clip_grad_norm_(_with_value(INF), 1.0,
                                                   error_if_nonfinite=True),
     RuntimeError, r"the total norm of order 2\.0 for gradients from `parameters` is "
                   r"non-finite \(inf\), so it cannot be clipped.*error_if_nonfinite=False"),
    ("nan gradient", lambda: optim.clip_grad_norm_(_with_value(NAN), 1.0, 3.0,
                                                   error_if_nonfinite=True),
     RuntimeError, r"total norm of order 3\.0 .* non-finite \(nan\)"),
    ("inf gradient, max-norm", lambda: optim.clip_grad_norm_(_with_value(-INF), 1.0, "inf",
                                                             error_if_nonfinite=True),
     RuntimeError, r"total norm of order inf .* non-finite \(inf\)"),
]


def _ndarray_gradient():
    p = nn.Parameter(np.ones(2))
    p.grad = np.ones(2)
    optim.clip_grad_norm_([p], 1.0)


CLIP[[c[0] for c in CLIP].index("ndarray gradient")] = (
    "ndarray gradient", _ndarray_gradient, TypeError,
    r"the gradient of parameters\[0\] has type ndarray, not a tensor")


@pytest.mark.parametrize("case", CLIP, ids=[c[0] for c in CLIP])
def test_bad_clip_grad_norm(case):
    _, call, exc, pattern = case
    _raises(call, exc, r"^clip_grad_norm_: .*" + pattern)


def test_case_count():
    """Distinct bad values across the tables (the hyperparameter table runs through five
    entry points on top)."""
    n = len(HYPER) + len(PARAMS) + len(ADD_GROUP) + len(STATE) + len(GRADS) + len(CLIP) + 2
    assert n >= 140, n


# ---------------------------------------------------------------- 2 ranks, DTensor parameters
def _dtensor_cases():
    """[(name, call, exception, regex)] with parameters sharded over a 2-rank mesh."""
    from dtensor import Replicate, Shard
    from dtensor.dtensor import distribute_tensor
    from dtensor.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def dparam(shape=(4, 3)):
        return nn.Parameter(distribute_tensor(dtensor.zeros(*shape, dtype="float64"), mesh,
                                              [Shard(0)]))

    def dgrad(p, value=1.0):
        g = np.ones(p.shape)
        g[0, 0] = value
        p.grad = distribute_tensor(dtensor.Tensor(g), mesh, [Shard(0)])
        return p

    a, b = dgrad(dparam()), dgrad(dparam())

    def loaded(fn):
        def run():
            opt = optim.AdamW([a, b])
            sd = opt.state_dict()
            sd = {"state": {k: dict(v) for k, v in sd["state"].items()},
                  "param_groups": sd["param_groups"]}
            fn(sd)
            opt.load_state_dict(sd)
        return run

    def step_after(**bad):
        def run():
            opt = optim.AdamW([a, b])
            opt.param_groups[0].update(bad)
            opt.step()
        return run

    def wrong_grad():
        c = dparam()
        c.grad = distribute_tensor(dtensor.zeros(2, 3, dtype="float64"), mesh, [Shard(0)])
        optim.SGD([c]).step()

    return [
        ("lr", lambda: optim.AdamW([a], lr=-1.0), ValueError, r"^AdamW: invalid lr: -1\.0"),
        ("betas", lambda: optim.AdamW([a], betas=(0.9,)), ValueError,
         r"invalid betas: \(0\.9,\) has length 1"),
        ("nesterov", lambda: optim.SGD([a], nesterov=True), ValueError, r"Nesterov momentum"),
        ("listed twice", lambda: optim.SGD([a, b, a]), ValueError,
         r"params\[2\] is params\[0\] again \(a DTensor of shape \(4, 3\)"),
        ("two groups", lambda: optim.SGD([{"params": [a]}, {"params": [a]}]), ValueError,
         r"some parameters appear in more than one parameter group"),
        ("single dtensor", lambda: optim.AdamW(a), TypeError,
         r"should be an iterable of Tensors or dicts, but got a DTensor of shape \(4, 3\)"),
        ("add_param_group", lambda: optim.SGD([a]).add_param_group({"params": [b, a]}),
         ValueError, r"param_group\['params'\]\[1\] .* already in param_groups\[0\]"),
        ("step lr", step_after(lr=NAN), ValueError, r"AdamW\.step: param_groups\[0\]: invalid "
                                                    r"lr: nan"),
        ("step grad shape", wrong_grad, ValueError, r"has shape \(2, 3\), the parameter \(4, 3\)"),
        ("state plain tensor", loaded(lambda sd: sd["state"][0].update(
            exp_avg=dtensor.zeros(4, 3, dtype="float64"))), ValueError,
         r"state\[0\]\['exp_avg'\] is a Tensor of shape \(4, 3\), dtype float64, but its "
         r"parameter is a DTensor of shape \(4, 3\), dtype float64, placements \[S\(0\)\]"),
        ("state placements", loaded(lambda sd: sd["state"][1].update(
            exp_avg_sq=distribute_tensor(dtensor.zeros(4, 3, dtype="float64"), mesh,
                                         [Replicate()]))), ValueError,
         r"state\[1\]\['exp_avg_sq'\] is a DTensor .*, placements \[R\], but its parameter .*"
         r"placements \[S\(0\)\]"),
        ("state shape", loaded(lambda sd: sd["state"][0].update(
            exp_avg=distribute_tensor(dtensor.zeros(2, 3, dtype="float64"), mesh,
                                      [Shard(0)]))), ValueError,
         r"is a DTensor of shape \(2, 3\)"),
        ("clip max_norm", lambda: optim.clip_grad_norm_([a, b], -1.0), ValueError,
         r"max_norm must be >= 0 .* got -1\.0"),
        ("clip norm_type", lambda: optim.clip_grad_norm_([a, b], 1.0, 0.0), ValueError,
         r"norm_type must be > 0 or inf, got 0\.0"),
        ("clip twice", lambda: optim.clip_grad_norm_([a, a], 1.0), ValueError,
         r"parameters\[1\] is parameters\[0\] again"),
        # The inf sits in rank 0's shard only; the reduced norm is inf on both ranks.
        ("clip nonfinite", lambda: optim.clip_grad_norm_([dgrad(dparam(), INF)], 1.0,
                                                         error_if_nonfinite=True),
         RuntimeError, r"non-finite \(inf\)"),
    ]


@pytest.mark.ranks(2, timeout=120)
def test_dtensor_parameters_raise_on_every_rank(rank):
    from mpi4py import MPI

    cases = _dtensor_cases()
    assert len({name for name, *_ in cases}) == len(cases)
    raised = []
    for name, call, exc, pattern in cases:
        try:
            _raises(call, exc, pattern)
        except BaseException as e:
            raise AssertionError(f"rank {rank}, case {name!r}: {e}") from None
        raised.append(name)
    everywhere = MPI.COMM_WORLD.allgather(raised)
    assert everywhere == [[c[0] for c in cases]] * 2, everywhere
