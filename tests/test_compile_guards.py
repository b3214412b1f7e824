"""Compiled code never runs stale: every Python value a trace baked in (globals, closure cells,
module and object attributes, containers passed in) is guarded; a change recompiles once and the
result equals eager, on two model shapes (the GPT of dtensor.nn and a small MLP of this file's).
Tensor values (parameters updated by the optimizer, its per-step learning rate) never
recompile. A numpy conversion of a traced tensor names the user's line."""
from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import types
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


# Values reached other than as a plain global, attribute or container: class attributes, the
# code of properties and static/class methods, objects without __dict__, containers of other
# types, modules reached as values, globals read by a computed name, a partial subclass.
DYNAMIC = 2.0


def _user_module(name, **attrs):
    """A module of user code (as `import cfg`), here without a file of its own."""
    m = types.ModuleType(name)
    m.__file__ = __file__
    vars(m).update(attrs)
    return m


CFG = _user_module("cfg", SCALE=2.0)
PKG = _user_module("pkg", sub=_user_module("pkg.sub", K=2.0))


def class_attribute_of_a_global_class(model, out, x, mp):
    class C:
        S = 2.0
    mp.setitem(vars(THIS), "C_", C)
    return (lambda x: out(model, x) * C_.S), (x,), lambda: setattr(C, "S", 5.0)  # noqa: F821


def class_attribute_through_an_argument(model, out, x, mp):
    class Obj:
        S = 2.0
    return (lambda x, o: out(model, x) * o.S), (x, Obj()), lambda: setattr(Obj, "S", 7.0)


def class_attribute_of_a_module(model, out, x, mp):
    class Factor(Module):
        FACTOR = 2.0

        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return out(self.body, x) * self.FACTOR
    return Factor(), (x,), lambda: setattr(Factor, "FACTOR", 3.0)


def classmethod_reading_the_class(model, out, x, mp):
    class Cm:
        K = 2.0

        @classmethod
        def f(cls, y):
            return y * cls.K
    return (lambda x: Cm.f(out(model, x))), (x,), lambda: setattr(Cm, "K", 6.0)


def property_reading_a_global(model, out, x, mp):
    class P:
        @property
        def s(self):
            return DYNAMIC
    p = P()
    return (lambda x: out(model, x) * p.s), (x,), lambda: mp.setattr(THIS, "DYNAMIC", 9.0)


def staticmethod_reading_a_global(model, out, x, mp):
    class St:
        @staticmethod
        def f(y):
            return y * DYNAMIC
    return (lambda x: St.f(out(model, x))), (x,), lambda: mp.setattr(THIS, "DYNAMIC", 6.0)


def slots_dataclass_field(model, out, x, mp):
    @dataclasses.dataclass(slots=True)
    class D:
        s: float = 2.0
    d = D()
    return (lambda x: out(model, x) * d.s), (x,), lambda: setattr(d, "s", 3.0)


def slots_attribute(model, out, x, mp):
    class Base:
        __slots__ = ("s",)

    class Sl(Base):
        __slots__ = "t"

        def __init__(self):
            self.s, self.t = 2.0, 1.0
    o = Sl()
    return (lambda x: out(model, x) * o.s + o.t), (x,), lambda: setattr(o, "t", 3.0)


def simple_namespace(model, out, x, mp):
    ns = types.SimpleNamespace(s=2.0)
    return (lambda x: out(model, x) * ns.s), (x,), lambda: setattr(ns, "s", 3.0)


def namedtuple_holding_a_list(model, out, x, mp):
    nt = collections.namedtuple("NT", "a")([2.0])
    return (lambda x: out(model, x) * nt.a[0]), (x,), lambda: nt.a.__setitem__(0, 6.0)


def deque_element(model, out, x, mp):
    dq = collections.deque([2.0])
    return (lambda x: out(model, x) * dq[0]), (x,), lambda: dq.__setitem__(0, 6.0)


def python_module_argument(model, out, x, mp):
    return ((lambda x, cfg: out(model, x) * cfg.SCALE), (x, CFG),
            lambda: mp.setattr(CFG, "SCALE", 3.0))


def submodule_of_a_global_package(model, out, x, mp):
    return (lambda x: out(model, x) * PKG.sub.K), (x,), lambda: mp.setattr(PKG.sub, "K", 5.0)


def python_module_through_an_object(model, out, x, mp):
    holder = types.SimpleNamespace(cfg=CFG)
    return ((lambda x: out(model, x) * holder.cfg.SCALE), (x,),
            lambda: mp.setattr(CFG, "SCALE", 11.0))


def global_read_through_globals(model, out, x, mp):
    return ((lambda x: out(model, x) * globals()["DYNAMIC"]), (x,),
            lambda: mp.setattr(THIS, "DYNAMIC", 3.0))


def global_read_by_a_computed_name(model, out, x, mp):
    return ((lambda x: out(model, x) * getattr(THIS, "DYN" + "AMIC")), (x,),
            lambda: mp.setattr(THIS, "DYNAMIC", 3.0))


def partial_subclass(model, out, x, mp):
    class MyPartial(functools.partial):
        pass
    holder = {"f": MyPartial(lambda y, s: y * s, s=2.0)}
    return ((lambda x: holder["f"](out(model, x))), (x,),
            lambda: holder.__setitem__("f", MyPartial(lambda y, s: y * s, s=3.0)))


def deeply_nested_list(model, out, x, mp):  # ten levels: within MAX_DEPTH
    deep = [[[[[[[[[[2.0]]]]]]]]]]
    inner = deep[0][0][0][0][0][0][0][0][0]
    return ((lambda x: out(model, x) * deep[0][0][0][0][0][0][0][0][0][0]), (x,),
            lambda: inner.__setitem__(0, 5.0))


REACHED = [class_attribute_of_a_global_class, class_attribute_through_an_argument,
           class_attribute_of_a_module, classmethod_reading_the_class, property_reading_a_global,
           staticmethod_reading_a_global, slots_dataclass_field, slots_attribute,
           simple_namespace, namedtuple_holding_a_list, deque_element, python_module_argument,
           submodule_of_a_global_package, python_module_through_an_object,
           global_read_through_globals, global_read_by_a_computed_name, partial_subclass,
           deeply_nested_list]


@pytest.mark.parametrize("case", REACHED, ids=[c.__name__ for c in REACHED])
def test_a_value_reached_any_way_recompiles_when_changed(case, monkeypatch):
    test_a_changed_value_recompiles_once_and_matches_eager(case, "mlp", monkeypatch)


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


# A tracer handed out by .numpy() / .data has shape and dtype only: any numpy-style use of it
# names the line (a comparison fell back to identity: a mask became a constant silently).
TRACER_USES = [
    ("== on .numpy()", lambda t: (t + 1) * (t.numpy() == 0), r"'==' on a tensor's data"),
    ("!= on .data", lambda t: t * (t.data != t.data), r"'!=' on a tensor's data"),
    ("< on .numpy()", lambda t: t * (t.numpy() < 1), r"'<' on a tensor's data"),
    ("number + .numpy()", lambda t: t * (1 + t.numpy()), r"'\+' on a tensor's data"),
    (".numpy() * .numpy()", lambda t: t * (t.numpy() * t.numpy()), r"'\*' on a tensor's data"),
    ("-.data", lambda t: t * -t.data, r"'unary -' on a tensor's data"),
    (".numpy().sum()", lambda t: t * t.numpy().sum(), r"numpy's \.sum on a tensor's data"),
    (".data.copy()", lambda t: t * t.data.copy(), r"numpy's \.copy on a tensor's data"),
    ("np.add(.numpy(), 1)", lambda t: t * np.add(t.numpy(), 1), "a numpy function"),
    ("np.sum(.data)", lambda t: t * np.sum(t.data), "a numpy function"),
    ("iterating .numpy()", lambda t: t * list(t.numpy())[0], "iterating over a tensor's data"),
    ("indexing .numpy()", lambda t: t * t.numpy()[0], "indexing a tensor's data"),
    ("bool(.numpy())", lambda t: t * (2.0 if t[0, 0].numpy() else 1.0), r"bool\(tensor\)"),
]


@pytest.mark.parametrize("name,fn,why", TRACER_USES, ids=[u[0] for u in TRACER_USES])
def test_numpy_use_of_a_traced_tensors_data_names_the_line(name, fn, why):
    x = dtensor.tensor(np.arange(8, dtype=np.float32).reshape(2, 4))
    fn(x)  # eager runs it
    with pytest.raises(dtensor.compile.TracingError,
                       match=why + r".*test_compile_guards\.py:\d+: "):
        dtensor.compile(fn)(x)


def test_shape_reads_of_a_traced_tensors_data_still_work():
    def fn(t):
        d = t.numpy()
        return t * (len(d) + d.shape[1] + d.ndim + d.size) + (d.dtype == np.float32)
    x = dtensor.tensor(np.arange(8, dtype=np.float32).reshape(2, 4))
    np.testing.assert_array_equal(dtensor.compile(fn)(x).numpy(), fn(x).numpy())


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
