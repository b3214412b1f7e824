"""Compiled code never runs stale: every Python value a trace baked in (globals, closure cells,
module and object attributes, containers passed in) is guarded; a change recompiles once and the
result equals eager, on two model shapes (the GPT of dtensor.nn and a small MLP of this file's).
Tensor values (parameters updated by the optimizer, its per-step learning rate) never
recompile. A numpy conversion of a traced tensor names the user's line."""
from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor.nn import GPT, GPTConfig, Linear, Module

THIS = sys.modules[__name__]
SCALE = 2.0
SETTINGS = {"gain": 1.5}
TINY = dict(vocab_size=32, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8,
            bias=False)


class Readout(Module):
    def __init__(self):
        super().__init__()
        self.proj = Linear(8, 4)
        self.offset = 0.0  # a plain attribute of a nested submodule

    def forward(self, h):
        return self.proj(h) + self.offset


class Net(Module):
    """The second model shape: other class and attribute names than the GPT's."""

    def __init__(self):
        super().__init__()
        self.up = Linear(8, 16)
        self.down = Linear(16, 8)
        self.readout = Readout()
        self.temperature = 1.0

    def forward(self, x):
        return self.readout(self.down(F.relu(self.up(x))) * self.temperature)


class Scaled(Module):
    """Any model times a plain attribute (``m.scale``)."""

    def __init__(self, body, forward):
        super().__init__()
        self.body, self.run, self.scale = body, forward, 2.0

    def forward(self, x):
        return self.run(self.body, x) * self.scale


class Knobs:
    """A plain object the step reads through a global."""

    def __init__(self):
        self.mult = 2.0


KNOBS = Knobs()


def gpt_out(model, idx):
    return model(idx)[0]


def net_out(model, x):
    return model(x)


def make(kind):
    """(model, its forward, an input) of one of the two shapes."""
    dtensor.manual_seed(0)
    rng = np.random.default_rng(0)
    if kind == "gpt":
        return GPT(GPTConfig(**TINY)), gpt_out, rng.integers(0, 32, (2, 8))
    return Net(), net_out, dtensor.Tensor(rng.standard_normal((3, 8)).astype(np.float32))


# Each case: (model, forward, input, monkeypatch) -> (function to compile, its arguments,
# the change). The function reads the value the change alters.

def global_scalar(model, out, x, mp):
    return (lambda x: out(model, x) * SCALE), (x,), lambda: mp.setattr(THIS, "SCALE", 5.0)


def global_dict(model, out, x, mp):
    return ((lambda x: out(model, x) * SETTINGS["gain"]), (x,),
            lambda: mp.setitem(SETTINGS, "gain", 4.0))


def closure_cell(model, out, x, mp):
    factor = 2.0

    def step(x):
        return out(model, x) * factor

    def change():
        nonlocal factor
        factor = 7.0
    return step, (x,), change


def module_attribute(model, out, x, mp):
    m = Scaled(model, out)
    return m, (x,), lambda: setattr(m, "scale", 10)


def nested_attribute(model, out, x, mp):
    inner = model.ln_f if isinstance(model, GPT) else model.readout
    name, value = ("eps", 0.5) if isinstance(model, GPT) else ("offset", 3.0)
    return (lambda x: out(model, x)), (x,), lambda: setattr(inner, name, value)


def dict_argument(model, out, x, mp):
    opts = {"gain": 2.0, "shift": 0.5}
    return ((lambda x, o: out(model, x) * o["gain"] + o["shift"]), (x, opts),
            lambda: opts.update(shift=-1.0))


def list_argument(model, out, x, mp):
    gains = [1.0, 2.0]
    return ((lambda x, g: out(model, x) * g[0] * g[1]), (x, gains),
            lambda: gains.__setitem__(1, 5.0))


def python_module_attribute(model, out, x, mp):  # as `import config; config.SCALE`
    return (lambda x: out(model, x) * THIS.SCALE), (x,), lambda: mp.setattr(THIS, "SCALE", 3.0)


def object_attribute(model, out, x, mp):
    return ((lambda x: out(model, x) * KNOBS.mult), (x,),
            lambda: mp.setattr(KNOBS, "mult", 6.0))


CASES = [global_scalar, global_dict, closure_cell, module_attribute, nested_attribute,
         dict_argument, list_argument, python_module_attribute, object_attribute]


def values(fn, args):
    return np.array(fn(*args).numpy())


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_a_changed_value_recompiles_once_and_matches_eager(case, kind, monkeypatch):
    model, out, x = make(kind)
    fn, args, change = case(model, out, x, monkeypatch)
    compiled = dtensor.compile(fn)
    before = values(compiled, args)
    np.testing.assert_array_equal(before, values(fn, args))
    values(compiled, args)
    assert compiled.compiles == 1  # nothing changed: no recompile
    change()
    want = values(fn, args)
    assert not np.allclose(want, before)  # the change matters to the result
    np.testing.assert_array_equal(values(compiled, args), want)
    assert compiled.compiles == 2
    values(compiled, args)
    assert compiled.compiles == 2


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_a_learning_rate_schedule_and_parameter_updates_do_not_recompile(kind):
    """AdamW's lr is a runtime scalar: a scheduler changing it every step, and the parameters
    the step updates, run one graph; the parameters match eager's after every step."""
    def setup():
        model, out, x = make(kind)
        opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x):
            loss = (out(model, x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return model, opt, step, x

    eager, compiled = setup(), setup()
    run = dtensor.compile(compiled[2])
    for i in range(5):
        for _, opt, _, _ in (eager, compiled):
            opt.param_groups[0]["lr"] = 1e-2 / (1 + i)  # the scheduler
        want = eager[2](eager[3]).item()
        assert run(compiled[3]).item() == pytest.approx(want, rel=1e-6)
        # Two graphs: the first step's (no optimizer state yet), then the steady state's.
        assert run.compiles == min(i + 1, 2)
    for (name, p), q in zip(eager[0].named_parameters(), compiled[0].parameters()):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_bad_learning_rate_set_between_compiled_steps_raises_as_in_eager():
    model, out, x = make("mlp")
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x):
        loss = (out(model, x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    run = dtensor.compile(step)
    run(x)
    before = [p.numpy().copy() for p in model.parameters()]
    opt.param_groups[0]["lr"] = -0.5
    with pytest.raises(ValueError, match=r"param_groups\[0\]: invalid lr: -0\.5"):
        run(x)
    for p, b in zip(model.parameters(), before):  # nothing ran
        np.testing.assert_array_equal(p.numpy(), b)


def test_toggling_back_reuses_the_first_graph(monkeypatch):
    model, out, x = make("mlp")
    compiled = dtensor.compile(lambda x: out(model, x) * SCALE)
    for scale in (2.0, 3.0, 2.0, 3.0):
        monkeypatch.setattr(THIS, "SCALE", scale)
        compiled(x)
    assert compiled.compiles == 2


def test_past_the_limit_a_recompile_warns_naming_the_value(monkeypatch):
    model, out, x = make("mlp")
    compiled = dtensor.compile(lambda x: out(model, x) * SCALE)
    limit = dtensor.compile.api.RECOMPILE_LIMIT
    for k in range(limit):
        monkeypatch.setattr(THIS, "SCALE", float(k))
        compiled(x)
    monkeypatch.setattr(THIS, "SCALE", 100.0)
    with pytest.warns(dtensor.compile.RecompileWarning,
                      match=rf"compiled {limit + 1} times.*because global 'SCALE' changed "
                            rf"from {float(limit - 1)} to 100\.0"):
        compiled(x)


def test_a_value_the_function_changes_while_traced_is_an_error():
    """A side effect on a value it reads would happen once, at trace time: an error naming it,
    never a graph that silently skips it."""
    class Counting(Net):
        def forward(self, x):
            self.calls = self.calls + 1
            return super().forward(x)

    model, _, x = make("mlp")
    counting = Counting()
    counting.calls = 0
    with pytest.raises(dtensor.compile.TracingError,
                       match=r"changes a value it reads while it runs: Counting\.calls changed "
                             r"from 0 to 1"):
        dtensor.compile(counting)(x)


def test_recompiles_are_silent_below_the_limit(monkeypatch):
    model, out, x = make("mlp")
    compiled = dtensor.compile(lambda x: out(model, x) * SCALE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(dtensor.compile.api.RECOMPILE_LIMIT):
            monkeypatch.setattr(THIS, "SCALE", float(k))
            compiled(x)


def as_array(t):
    return np.asarray((t * 2).data) + 1


def array_copy(t):
    return np.array(t.data, dtype=np.float64)


def as_array_of_the_tensor(t):
    return np.asarray(t * 2)


NUMPY = [pytest.param(as_array, r"np\.asarray\(\(t \* 2\)\.data\) \+ 1", id="asarray"),
         pytest.param(array_copy, r"np\.array\(t\.data, dtype=np\.float64\)", id="array"),
         pytest.param(as_array_of_the_tensor, r"np\.asarray\(t \* 2\)", id="tensor")]


@pytest.mark.parametrize("convert,line", NUMPY)
def test_numpy_conversion_of_a_traced_tensor_names_the_line(convert, line):
    with pytest.raises(dtensor.compile.TracingError,
                       match=r"converting a tensor to numpy.*test_compile_guards\.py:\d+: "
                             r"return " + line):
        dtensor.compile(convert)(dtensor.ones(3))


@pytest.mark.ranks(2, timeout=300)
def test_a_parallelized_model_recompiles_on_every_rank(rank):
    """Tensor-parallel GPT (DTensor parameters, the styles' hooks): a changed global recompiles
    on both ranks, the result matches eager, and the hooks and mesh cause no recompile."""
    from dtensor.parallel import parallelize
    model, out, x = make("gpt")
    parallelize(model, dtensor.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")))

    def step(x):
        return out(model, x) * SCALE

    def full(t):
        return t.full_tensor().numpy() if hasattr(t, "full_tensor") else t.numpy()

    global SCALE  # (this body runs on the ranks: it and step share one copy of the globals)
    compiled = dtensor.compile(step)
    try:
        for SCALE, compiles in ((2.0, 1), (2.0, 1), (5.0, 2)):
            np.testing.assert_allclose(full(compiled(x)), full(step(x)), rtol=1e-6, atol=1e-7)
            assert compiled.compiles == compiles
    finally:
        SCALE = 2.0  # the ranks run later tests too
