"""dtensor.compile: compiled results equal eager ones (every op, the GPT forward, the whole train
step at 1 rank, TP=2, TP=4 and DPxTP=2x2), the graph holds Megatron's collectives, and bad input
is a clear error."""
from __future__ import annotations

import numpy as np
import pytest
from test_ops import CASES, SAMPLES, _wrap

import dtensor
from dtensor.comm import count_collectives
from dtensor.compile.kernels import address
from dtensor.compile.passes import memory
from dtensor.nn import GPT, Block, GPTConfig
from dtensor import Tensor
from dtensor.ops import OPS, apply
from dtensor.ops import structural as st

SMALL = dict(vocab_size=96, n_layer=2, n_embd=32, n_head=4, mlp_hidden=64, block_size=16,
             bias=False)
STANDARD = dict(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                block_size=128, bias=False)


def full(t):
    return t.full_tensor().numpy() if hasattr(t, "full_tensor") else t.numpy()


# ----------------------------------------------------------------------------- every op

@pytest.mark.parametrize("name,i", CASES)
def test_every_op_compiled_equals_eager(name, i):
    """Value and (for differentiable ops) the vector-Jacobian product, through a compiled
    function, bit for bit as eager: the generated code calls the same kernels."""
    op = OPS[name]
    args, params = SAMPLES[name][i]
    tensors = _wrap(args, op)
    diff = [k for k, a in enumerate(tensors) if getattr(a, "requires_grad", False)]

    def f(*xs):
        out = apply(op, *xs, **params)
        if not diff or op.vjp is None or out.dtype.kind != "f":
            return out, ()
        w = dtensor.Tensor(np.linspace(-1, 1, out.data.size if hasattr(out, "data") else 1)
                           .reshape(out.shape).astype(out.dtype))
        grads = dtensor.autograd.grad((out * w).sum(), [xs[k] for k in diff])
        return out, grads

    dtensor.manual_seed(3)
    want, want_g = f(*_wrap(args, op))
    dtensor.manual_seed(3)
    got, got_g = dtensor.compile(f)(*_wrap(args, op))
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    for a, b in zip(got_g, want_g):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ----------------------------------------------------------------------------- GPT

def test_compiled_forward_of_a_module():
    dtensor.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    idx = np.random.default_rng(0).integers(0, 96, (3, 16))
    compiled = dtensor.compile(model)
    with dtensor.no_grad():
        want, _ = model(idx)
        got, _ = compiled(idx)
        again, _ = compiled(idx[:, :8])  # another shape: a second graph
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(again.numpy(), model(idx[:, :8])[0].numpy())
    assert compiled.compiles == 2


def train(cfg, steps, *, backend, tp=1, dp=1, dropout=0.0, batch=8):
    """Losses and whole parameters after ``steps`` AdamW steps, the last step's collectives and
    the step function; ``backend`` None runs eager, else dtensor.compile with that backend."""
    from dtensor.parallel import parallelize

    dtensor.manual_seed(0)
    model = GPT(GPTConfig(**cfg, dropout=dropout))
    if tp * dp > 1:
        mesh = dtensor.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh)
    opt = dtensor.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)

    def train_step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = train_step if backend is None else dtensor.compile(train_step, backend=backend)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x, y = (rng.integers(0, cfg["vocab_size"], (batch, cfg["block_size"])) for _ in "xy")
        with count_collectives() as log:
            loss = run(x, y)
        losses.append(loss.item())
    return losses, {k: full(v) for k, v in model.state_dict().items()}, log, run


def _assert_same(a, b):
    (la, pa, *_), (lb, pb, *_) = a, b
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_compiled_train_step_one_process_standard_workload():
    """The whole standard-workload step (forward, loss, backward, AdamW, zero_grad), 5 steps,
    dropout on: losses and parameters as eager (1e-6 relative). Two graphs are compiled: the
    first step creates the optimizer state, the later ones update it."""
    eager = train(STANDARD, 5, backend=None, dropout=0.1)
    comp = train(STANDARD, 5, backend="numpy", dropout=0.1)
    _assert_same(comp, eager)
    assert comp[3].compiles == 2
    _assert_one_adamw_update(comp[3])


def _assert_one_adamw_update(run):
    """The AdamW updates of all parameters are one node (one kernel), and nothing else."""
    names = [n.name for n in run.last.graph.nodes]
    parts = names.count("adamw_part")
    assert names.count("adamw_group") == 1 and "adamw_step" not in names, names
    assert parts == len(run.last.graph.nodes[names.index("adamw_group")].params["sizes"]) > 10


def _root(a):
    while a.base is not None:
        a = a.base
    return a


def _adamw_run(backend, read_after=False, steps=4):
    """Parameters after ``steps`` AdamW steps of a small GPT (eager: backend None), the root
    array of lm_head's weight after each step, and the last graph."""
    dtensor.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 8))

    def step():
        _, loss = model(x, x)
        loss.backward()
        old = model.lm_head.weight.detach()  # the value before the update
        opt.step()
        opt.zero_grad()
        return (loss, old * 1.0) if read_after else loss  # read after it

    run = dtensor.compile(step, backend=backend) if backend else step
    roots = []
    for _ in range(steps):
        run()
        roots.append(_root(model.lm_head.weight.data))
    params = {k: p.numpy().copy() for k, p in model.named_parameters()}
    return params, roots, run.last.graph if backend else None


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_adamw_updates_parameters_in_place(backend, monkeypatch):
    """From the second step on, the AdamW group writes the new parameters and moments over the
    last step's (they are views of its result): no fresh copy of every parameter each step,
    and bit for bit what the same kernels give into a new array."""
    params, roots, graph = _adamw_run(backend)
    group = next(n for n in graph.nodes if n.name == "adamw_group")
    assert group.params.get("in_place") is True
    assert roots[1] is roots[2] is roots[3]  # steps 2-4 run the steady graph, in place
    monkeypatch.setattr(memory, "_updates_in_place", lambda *a: False)
    fresh, fresh_roots, _ = _adamw_run(backend)
    assert fresh_roots[2] is not fresh_roots[3]
    for k in params:
        np.testing.assert_array_equal(params[k], fresh[k], err_msg=k)


@pytest.mark.parametrize("nbytes", [64, 200, 4096, 10_000, 150_000, 1 << 20, 3_000_001])
def test_the_memory_plans_arena_starts_on_a_page(nbytes):
    """The arena starts on a page, so each buffer (at a multiple of 64 bytes in it) starts on a
    cache line, whatever address numpy's allocation got (malloc aligns to 16 bytes): arenas
    from the heap and from fresh mappings, after allocations that move the heap along."""
    from types import SimpleNamespace
    for shift in (24, 40, 3000):
        moved = np.empty(shift, np.uint8)  # noqa: F841 (held while the arena is allocated)
        plan = SimpleNamespace(arena_bytes=nbytes, buffers=[((1,), np.float64, 0)] + [
            ((16,), np.float32, k * 64) for k in range(1, min(nbytes // 64, 50))])
        bufs = memory.arena_buffers(plan)
        assert address(bufs[0]) % 4096 == 0, (nbytes, shift, hex(address(bufs[0])))
        assert all(address(b) % 64 == 0 for b in bufs), (nbytes, shift)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_compiled_steps_buffers_start_on_cache_lines(backend):
    dtensor.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    x = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 8))

    def loss_and_grads():
        _, loss = model(x, x)
        loss.backward()
        return loss

    run = dtensor.compile(loss_and_grads, backend=backend)
    run()
    assert len(run.last.buffers) > 10
    assert all(address(b) % 64 == 0 for b in run.last.buffers)


def _views_of(base, sizes, order=None):
    """p, g, m, v of each parameter, p/m/v as views of rows 0-2 of ``base`` at their columns."""
    starts = np.cumsum([0] + list(sizes[:-1]))
    arrays = []
    for j in (order or range(len(sizes))):
        cols = slice(starts[j], starts[j] + sizes[j])
        arrays += [base[0, cols], np.ones(sizes[j], base.dtype), base[1, cols], base[2, cols]]
    return arrays


UPDATE_TARGETS = [  # (what the arrays are, whether the update may write over their base)
    ("views at their own columns", lambda b, s: _views_of(b, s), True),
    ("two parameters swapped", lambda b, s: _views_of(b, s, order=[1, 0, 2]), False),
    ("a strided view at the right place", lambda b, s: [b[0, :2 * s[0]:2] if k == 0 else a
                                                      for k, a in enumerate(_views_of(b, s))],
     False),
    ("a copy, not a view", lambda b, s: [a.copy() if k == 4 else a
                                        for k, a in enumerate(_views_of(b, s))], False),
    ("another dtype", lambda b, s: _views_of(b.astype(np.float64), s), False),
]


@pytest.mark.parametrize("what, make, reuse", UPDATE_TARGETS, ids=[c[0] for c in UPDATE_TARGETS])
def test_adamw_writes_over_its_inputs_only_where_they_are_its_own_columns(what, make, reuse):
    from dtensor.compile.numpy_backend import update_target
    sizes = [6, 4, 10]
    base = np.zeros((3, sum(sizes)), np.float32)
    arrays = make(base, sizes)
    got = update_target(arrays, sizes, in_place=True)
    assert (got is base) == reuse and got.shape == (3, 20)
    from dtensor.compile.kernels import address  # the addresses a kernel's table holds
    got = update_target(arrays, sizes, True, np.array([address(a) for a in arrays]))
    assert (got is base) == reuse
    assert update_target(arrays, sizes, in_place=False) is not base


@pytest.mark.parametrize("real", [float, np.float32, np.float64])
def test_adamw_constants_of_a_group_are_each_parameters_own(real):
    """The group's constants are bit for bit those of each parameter's own call (eager's),
    whether computed at once over arrays (Python numbers) or one by one (numpy scalars, whose
    arithmetic is their own type's)."""
    from dtensor.compile.numpy_backend import adamw_table
    from dtensor.ops.nn import adamw_constants
    rng = np.random.default_rng(0)
    shared = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": real(0.1)}
    each = [{"lr": real(rng.uniform(1e-5, 1e-2)), "bc1": float(rng.uniform(0.1, 1)),
             "bc2": float(rng.uniform(1e-3, 1))} for _ in range(5)]
    hp = {**shared, **{f"{k}_{j}": v for j, own in enumerate(each) for k, v in own.items()}}
    want = np.array([adamw_constants(**shared, **own) for own in each], np.float64)
    for dtype in (np.float64, np.float32):
        np.testing.assert_array_equal(adamw_table(hp, 5, dtype), want.astype(dtype))


def test_adamw_keeps_a_copy_when_a_parameter_is_read_after_its_update():
    """A step that reads a parameter's old value after the update: no update in place, and the
    values (the parameters and what was read) equal eager's."""
    params, roots, graph = _adamw_run("numpy", read_after=True)
    group = next(n for n in graph.nodes if n.name == "adamw_group")
    assert "in_place" not in group.params and roots[2] is not roots[3]
    eager, _, _ = _adamw_run(None, read_after=True)
    for k in params:
        np.testing.assert_allclose(params[k], eager[k], rtol=1e-6, atol=1e-7, err_msg=k)


LAYOUTS = [
    pytest.param(2, 1, id="tp2", marks=pytest.mark.ranks(2, timeout=300)),
    pytest.param(4, 1, id="tp4", marks=pytest.mark.ranks(4, timeout=300)),
    pytest.param(2, 2, id="dp2xtp2", marks=pytest.mark.ranks(4, timeout=300)),
]


@pytest.mark.parametrize("tp,dp", LAYOUTS)
def test_compiled_parallel_train_step(tp, dp, rank):
    """The standard workload parallelized: compiled = eager after 5 steps, and the compiled step
    issues no more collectives (the same bytes; data parallelism's per-parameter gradient
    all-reduces merged into buckets)."""
    eager = train(STANDARD, 5, backend=None, tp=tp, dp=dp)
    comp = train(STANDARD, 5, backend="numpy", tp=tp, dp=dp)
    _assert_same(comp, eager)
    _assert_one_adamw_update(comp[3])
    assert comp[3].compiles == 2  # the parallel styles' hooks and meshes guard as constants
    e, c = eager[2], comp[2]
    assert c.count() <= e.count() and c.bytes() == e.bytes(), (e.summary(), c.summary())
    if dp > 1:
        assert c.count("all_reduce") < e.count("all_reduce")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.ranks(2)
def test_block_graph_holds_megatron_collectives(sp, rank):
    """Golden test on the printed graph of one Transformer block's forward + backward at tp=2:
    TP: an all-reduce after attn.proj and after mlp.fc2 (forward), and one at the attention and
    MLP input boundaries (backward); SP: all-gather at each input boundary and reduce-scatter
    after each row-parallel output, mirrored in the backward."""
    from dtensor.parallel import gpt_plan, parallelize_module
    from dtensor.placements import Replicate, Shard

    cfg = GPTConfig(**SMALL)
    dtensor.manual_seed(0)
    block = Block(cfg)
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {k[len("blocks.*."):]: v for k, v in gpt_plan(sp, True).items()
            if k.startswith("blocks.*.")}
    parallelize_module(block, mesh, plan)
    for _, m in block.named_modules():
        for n, p in list(m._parameters.items()):
            if not isinstance(p, dtensor.DTensor):
                m._parameters[n] = dtensor.nn.Parameter(
                    dtensor.distribute_tensor(p.detach(), mesh, [Replicate()]))
    x = dtensor.distribute_tensor(np.random.default_rng(0).standard_normal(
        (4, 16, 32)).astype(np.float32), mesh, [Shard(1) if sp else Replicate()])
    x.requires_grad = True

    def fwd_bwd(x):
        y = block(x)
        (y * y).sum().backward()
        return y

    compiled = dtensor.compile(fwd_bwd)
    y = compiled(x)
    graph = compiled.last.graph
    text = str(graph)
    # the graph names each collective, with the layout it leaves
    comms = [n for n in graph.nodes if n.kind == "comm"]
    kinds = [n.name for n in comms]
    if sp:
        # ... and the four LayerNorm weight gradients (Partial over sequence shards, stored
        # Replicate) merged into one all-reduce bucket.
        assert kinds == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter",
                         "all_gather", "reduce_scatter", "all_gather", "reduce_scatter",
                         "all_reduce_bucket"], text
        assert comms[0].specs[1].placements == (Replicate(),), text
        assert comms[1].specs[1].placements == (Shard(1),), text
        assert len(comms[-1].inputs) == 4  # gradients
        assert (f"%{comms[0].id} = all_gather %{comms[0].inputs[0].id} mesh_dim=0 axis=1 "
                f"sizes=[8, 8] [S(1)] -> [R] ") in text, text
    else:
        assert kinds == ["all_reduce"] * 4, text
        for n in comms:  # (each reduces its matmul's partial sums in place: donated)
            assert (f"%{n.id} = all_reduce %{n.inputs[0].id} mesh_dim=0 op='sum' donate=True "
                    f"[P(sum)] -> [R] ") in text, text
    # The forward's all-reduces follow the row-parallel matmuls; values match eager.
    dtensor.manual_seed(0)
    np.testing.assert_allclose(full(y), full(block(x)), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- bad input

def test_data_dependent_control_flow_names_the_line():
    def f(x):
        if (x.sum() > 0):  # the offending line
            return x * 2
        return x

    with pytest.raises(dtensor.compile.TracingError,
                       match=r"bool\(tensor\).*test_compile\.py:\d+: if \(x\.sum\(\) > 0\)"):
        dtensor.compile(f)(dtensor.ones(3))
    with pytest.raises(dtensor.compile.TracingError, match=r"\.item\(\).*x\.sum\(\)\.item"):
        dtensor.compile(lambda x: x.sum().item())(dtensor.ones(3))


COUNTER = 0


def test_global_mutation_inside_the_step_is_an_error():
    def step(x):
        global COUNTER
        COUNTER = COUNTER + 1
        return x * 2

    with pytest.raises(dtensor.compile.TracingError,
                       match=r"changes a value it reads while it runs: global 'COUNTER' "
                             r"changed from 0 to 1"):
        dtensor.compile(step)(dtensor.ones(2))


def test_changing_shapes_recompile_with_a_warning_naming_the_cause():
    compiled = dtensor.compile(lambda x: (x * x).sum())
    limit = dtensor.compile.api.RECOMPILE_LIMIT
    for n in range(2, 2 + limit):
        compiled(dtensor.ones(n))
    with pytest.warns(dtensor.compile.RecompileWarning,
                      match=rf"compiled {limit + 1} times \(more than RECOMPILE_LIMIT = {limit}\);"
                            rf" this time because args\[0\] changed from .*\({limit + 1},\).* to "
                            rf".*\({limit + 2},\)"):
        compiled(dtensor.ones(limit + 2))
    assert compiled.compiles == limit + 1
    compiled(dtensor.ones(3))  # seen before: no new compile
    assert compiled.compiles == limit + 1


def test_unknown_backend_and_non_callable():
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'"):
        dtensor.compile(lambda x: x, backend="cuda")
    with pytest.raises(TypeError, match=r"takes a function or a Module, got int"):
        dtensor.compile(3)


@pytest.mark.ranks(2)
def test_redundant_collectives_are_issued_once(rank):
    """Two redistributes of the same value to the same layout are one collective in the
    compiled graph (eager issues both); the values are unchanged."""
    from dtensor.placements import Replicate, Shard

    mesh = dtensor.init_device_mesh("cpu", (2,))
    x = dtensor.distribute_tensor(np.arange(12.0).reshape(6, 2), mesh, [Shard(0)])

    def f(x):
        a = x.redistribute(placements=[Replicate()])
        b = x.redistribute(placements=[Replicate()])
        return a * 2 + b

    with count_collectives() as eager:
        want = f(x)
    compiled = dtensor.compile(f)
    compiled(x)  # compiles
    with count_collectives() as comp:
        got = compiled(x)
    assert eager.count("all_gather") == 2 and comp.count("all_gather") == 1
    np.testing.assert_array_equal(full(got), full(want))


@pytest.mark.ranks(2)
def test_a_sharded_broadcast_moves_nothing_and_dying_partials_reduce_in_place(rank):
    """The gradient of a sum over a sharded dim is a column broadcast to the whole dim, split
    again to meet a sharded value (Replicate -> Shard): the compiled graph reads the column and
    has no redistribute for it. A partial sum whose buffer dies at its all-reduce is reduced
    in place (donated). Values and gradients as eager."""
    from dtensor.placements import Shard

    mesh = dtensor.init_device_mesh("cpu", (2,))
    a = np.random.default_rng(0).standard_normal((6, 8))
    w = np.random.default_rng(1).standard_normal((8, 5))

    class Model(dtensor.nn.Module):
        def __init__(self):
            super().__init__()
            self.x = dtensor.nn.Parameter(dtensor.distribute_tensor(a, mesh, [Shard(1)]))
            self.w = dtensor.nn.Parameter(dtensor.distribute_tensor(w, mesh, [Shard(0)]))

        def forward(self):
            s = self.x.exp().sum(axis=1)  # Partial over the shards of dim 1
            return s.log().sum() + (self.x @ self.w).tanh().sum()  # tanh: all-reduce first

    results, issued = [], []
    for compiled in (False, True):
        model = Model()

        def step():
            loss = model()
            loss.backward()
            return loss

        run = dtensor.compile(step) if compiled else step
        for _ in range(2):  # the compiled function traces on the first call
            model.x.grad = model.w.grad = None
            with count_collectives() as log:
                loss = run()
        results.append((float(full(loss)), full(model.x.grad), full(model.w.grad)))
        issued.append(log.summary())
    (le, gxe, gwe), (lc, gxc, gwc) = results
    # the forward's two all-reduces (the partial row sums, the partial matmul), eager and
    # compiled alike; the split broadcast issues none
    assert issued[0] == issued[1] == {"all_reduce": (2, 8 * (6 + 6 * 5))}, issued
    np.testing.assert_allclose(lc, le, rtol=1e-12)
    np.testing.assert_allclose(gxc, gxe, rtol=1e-12)
    np.testing.assert_allclose(gwc, gwe, rtol=1e-12)
    e, dt = np.exp(a), 1 - np.tanh(a @ w) ** 2
    np.testing.assert_allclose(gxe, e / e.sum(axis=1, keepdims=True) + dt @ w.T, rtol=1e-12)
    np.testing.assert_allclose(gwe, a.T @ dt, rtol=1e-12)
    graph = run.last.graph
    comms = [n for n in graph.nodes if n.kind == "comm"]
    assert not any(n.inputs[0].name == "broadcast_to" for n in comms), str(graph)
    donated = [n.inputs[0].name for n in comms if n.params.get("donate")]
    assert donated == ["matmul"], str(graph)


def test_two_split_broadcasts_meeting_keep_the_shape():
    """Two split broadcasts added together: reading both (rows, 1) sources would shrink the add
    to (rows, 1), so one of them stays a full-shape broadcast_to view."""
    from dataclasses import replace

    from dtensor.graph import Graph
    from dtensor.compile.passes import shard_broadcasts
    from dtensor.dtensor import DTensorSpec
    from dtensor.placements import Replicate, Shard

    mesh = dtensor.init_device_mesh("cpu", (1,))
    spec = DTensorSpec(mesh, (Replicate(),), (4, 6), np.dtype(np.float64))
    g = Graph()
    split = []
    for name in ("a", "b"):
        col = g.new("input", name, shape=(4, 1), dtype=np.float64)
        wide = g.new("op", "broadcast_to", [col], {"shape": (4, 6)}, (4, 6), np.float64)
        split.append(g.new("comm", "shard", [wide],
                           {"mesh_dim": 0, "axis": 1, "start": 0, "stop": 6}, (4, 6),
                           np.float64, specs=((spec,), replace(spec, placements=(Shard(1),)))))
    total = g.new("op", "add", split, {}, (4, 6), np.float64)
    g.outputs = [total]
    shard_broadcasts(g)
    assert not any(n.kind == "comm" for n in g.nodes), str(g)
    assert np.broadcast_shapes(*[a.shape for a in total.inputs]) == (4, 6), str(g)
    assert all(a in g.nodes or a in g.inputs for a in total.inputs), str(g)


def test_model_and_optimizer_found_through_self_attributes():
    """A bound method of a trainer object: its model and optimizer are found as attributes."""
    class Trainer:
        def __init__(self):
            dtensor.manual_seed(0)
            self.model = GPT(GPTConfig(**SMALL))
            self.opt = dtensor.optim.AdamW(self.model.parameters(), lr=1e-2)

        def step(self, x, y):
            _, loss = self.model(x, y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            return loss

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 96, (2, 16)), rng.integers(0, 96, (2, 16))) for _ in range(3)]
    eager, comp = Trainer(), Trainer()
    run = dtensor.compile(comp.step)
    assert [eager.step(*b).item() for b in batches] == [run(*b).item() for b in batches]


def test_updating_a_tensor_the_compiled_function_cannot_see_is_an_error():
    dtensor.manual_seed(0)
    hidden = {"model": GPT(GPTConfig(**SMALL))}
    hidden["opt"] = dtensor.optim.SGD(hidden["model"].parameters(), lr=0.1)

    def helper(x, y):  # reaches the model through a dict the compiler does not search
        _, loss = hidden["model"](x, y)
        loss.backward()
        hidden["opt"].step()
        return loss

    def step(x, y):
        return helper(x, y)

    idx = np.zeros((1, 16), np.int64)
    with pytest.raises(dtensor.compile.TracingError, match=r"not reach as an input is updated"):
        dtensor.compile(step)(idx, idx)
    assert all(isinstance(p.data, np.ndarray) for p in hidden["model"].parameters())


# ----------------------------------------------------------------------------- fold_scatter_adds

def _scatter_inputs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 12)).astype(np.float32)
    x[1, 2], x[2, 5] = -0.0, np.inf
    g = rng.standard_normal((4, 1)).astype(np.float32)
    g[3, 0] = np.nan
    return x, g, np.array([[1], [7], [5], [11]])


FOLD_CASES = {  # name: (function of x, g, idx; whether the pass folds it)
    "a + scatter": (lambda x, g, i: x * 2.0 + st.scatter_add(g, i, x, axis=1), True),
    "scatter + a": (lambda x, g, i: st.scatter_add(g, i, x, axis=1) + (x - 1.0), True),
    "an input + scatter": (lambda x, g, i: x + st.scatter_add(g, i, x, axis=1), True),
    "a read twice": (lambda x, g, i: (lambda a: (a + st.scatter_add(g, i, x, axis=1), a))(
        x * 2.0), False),
    "scatter read twice": (lambda x, g, i: (lambda s: (x * 2.0 + s, s))(
        st.scatter_add(g, i, x, axis=1)), False),
    "indices along dim 0": (lambda x, g, i: x.mT * 2.0 + st.scatter_add(
        g.mT, i.mT, x.mT, axis=0), True),
    "several indices a row": (lambda x, g, i: x * 2.0 + st.scatter_add(
        g * Tensor(np.ones((1, 3), np.float32)), st.cat(i, i, i, axis=1), x, axis=1), False),
}


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("case", list(FOLD_CASES))
def test_an_add_of_a_one_hot_scatter_is_folded_into_the_add(case, backend):
    """``a + scatter_add(g, idx)`` with one index a row and no other reader of either becomes
    ``add_at`` (g added into a where idx points): the eager values (NaN, inf and a -0 in a
    included), the inputs untouched (an input as a is copied, not written over), and the
    cases that must keep the scatter keep it."""
    f, folds = FOLD_CASES[case]
    x, g, i = _scatter_inputs()
    keep = x.copy()
    run = dtensor.compile(lambda *a: f(*a), backend=backend)
    got = run(Tensor(x), Tensor(g), Tensor(i))
    want = f(Tensor(x), Tensor(g), Tensor(i))
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want))):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(x, keep)
    names = [n.name for n in run.last.graph.nodes]
    assert ("add_at" in names) == folds and ("scatter_add" in names) != folds, names


@pytest.mark.ranks(2, timeout=120)
def test_a_folded_vocab_parallel_scatter_adds_nothing_outside_its_block(rank):
    """On a block of the vocabulary (loss_parallel's gradient), the folded add adds g only at
    the indices inside this rank's block, exactly as the scatter_add local kernel: with an
    inf and a NaN in g, the compiled sum is the one-process one."""
    from dtensor.placements import Replicate, Shard
    mesh = dtensor.init_device_mesh("cpu", (2,))
    x, g, i = _scatter_inputs()
    g[1, 0] = np.inf

    def f(x, g, i):
        return x * 2.0 + st.scatter_add(g, i, x, axis=1)

    run = dtensor.compile(f, backend="c")
    args = [dtensor.distribute_tensor(a, mesh, [p])
            for a, p in zip((x, g, i), (Shard(1), Replicate(), Replicate()))]
    got = run(*args)
    assert "add_at" in [n.name for n in run.last.graph.nodes]
    np.testing.assert_array_equal(got.full_tensor().numpy(), f(*map(Tensor, (x, g, i))).numpy())


PRODUCT_SUM_CASES = {  # name: (function of a, b; whether fold_product_sums folds it)
    "over the leading dims, kept": (lambda a, b: st.sum(a * b, axis=(0, 1), keepdims=True), True),
    "over the leading dims": (lambda a, b: st.sum(a * b, axis=(0, 1), keepdims=False), True),
    "2-d": (lambda a, b: st.sum(a.reshape(-1, 9) * b.reshape(-1, 9), axis=(0,),
                                keepdims=False), True),
    "product read twice": (lambda a, b: (lambda p: (st.sum(p, axis=(0, 1), keepdims=True), p))(
        a * b), False),
    "over the last dim": (lambda a, b: st.sum(a * b, axis=(2,), keepdims=True), False),
    "a broadcast operand": (lambda a, b: st.sum(a * b[0, 0], axis=(0, 1), keepdims=True), False),
}


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("case", list(PRODUCT_SUM_CASES))
def test_a_sum_of_a_product_over_the_leading_dims_is_one_pass(case, backend):
    """sum(a * b) over every dim but the last, the product read by nothing else, becomes one
    sum_of_products pass: eager's values within the rounding bound of a float32 sum of n
    products (n eps sum|a b|), and the cases that must keep the product keep it."""
    f, folds = PRODUCT_SUM_CASES[case]
    rng = np.random.default_rng(8)
    a, b = (rng.standard_normal((4, 6, 9)).astype(np.float32) for _ in "ab")
    run = dtensor.compile(f, backend=backend)
    got = run(Tensor(a), Tensor(b))
    want = f(Tensor(a), Tensor(b))
    got, want = (o if isinstance(o, tuple) else (o,) for o in (got, want))
    bound = 24 * np.finfo(np.float32).eps * np.abs(a * b).sum()
    for x, w in zip(got, want):
        np.testing.assert_allclose(x.numpy(), w.numpy(), rtol=0, atol=bound)
    names = [n.name for n in run.last.graph.nodes]
    assert ("sum_of_products" in names) == folds, names


# ----------------------------------------------------------------------------- in place

def _owner(a):
    """The node whose buffer holds ``a``'s elements in ``a``'s order."""
    while getattr(a, "buffer", 1) is None and a.inputs and a.name in ("reshape", "all_reduce"):
        a = a.inputs[0]
    return a


def _in_place_nodes(graph) -> list:
    """(node, input) pairs where the plan put the node's result at the bytes of the buffer
    the input reads (itself, or through reshapes and all-reduces); checks that nothing reads
    that input after the node, through any view of its buffer."""
    at = {n.id: graph.buffers[n.buffer][2] for n in graph.nodes if n.buffer is not None}
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    base = {}  # node id -> the id of the node owning the bytes it reads
    for n in graph.nodes:
        views = n.name in memory.VIEW_OPS or n.kind == "comm"
        src = n.inputs[0] if views and n.inputs else None
        base[n.id] = base.get(src.id, src.id) if hasattr(src, "id") else n.id
    pairs = []
    for n in graph.nodes:
        for a in n.inputs:
            o = _owner(a)
            if n.id in at and at.get(getattr(o, "id", None)) == at[n.id] and o is not n:
                pairs.append((n, o))
                later = [m for m in graph.nodes if order[m.id] > order[n.id] and any(
                    base.get(getattr(x, "id", None)) == o.id for x in m.inputs)]
                assert not later, (n.name, o.name, [m.name for m in later])
    return pairs


def _step_with_plan(arch, backend, monkeypatch, in_place: bool):
    from dtensor.nn import Llama, LlamaConfig
    if not in_place:
        monkeypatch.setattr(memory, "_dying_input", lambda *a: None)
    dtensor.manual_seed(0)
    model = (GPT(GPTConfig(**SMALL)) if arch == "gpt" else Llama(LlamaConfig(
        vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
        max_seq_len=16)))
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(0)

    def step(x, y):
        out = model(x, y)
        loss = out[1] if isinstance(out, tuple) else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = dtensor.compile(step, backend=backend)
    losses = [float(run(*(rng.integers(0, 96, (2, 16)) for _ in "xy")).item())
              for _ in range(3)]
    params = {k: full(p).copy() for k, p in model.named_parameters()}
    monkeypatch.undo()
    return losses, params, run.last.graph


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_element_wise_results_take_a_dying_inputs_bytes(arch, backend, monkeypatch):
    """The plan writes an element-wise result over an input read last there (a residual add
    over its projection, a gradient sum over a GEMM's output): the same losses and parameters,
    bit for bit, as the plan that gives every result bytes of its own."""
    losses, params, graph = _step_with_plan(arch, backend, monkeypatch, in_place=True)
    fresh_losses, fresh, fresh_graph = _step_with_plan(arch, backend, monkeypatch, False)
    assert len(_in_place_nodes(graph)) >= 4, [n.name for n, _ in _in_place_nodes(graph)]
    assert not _in_place_nodes(fresh_graph)
    assert losses == fresh_losses
    for k in params:
        np.testing.assert_array_equal(params[k], fresh[k], err_msg=k)


def _read_later(a, b, c):  # y is read again after y + 1: that sum gets bytes of its own
    y = a @ b
    w = (y + 1.0) @ c
    return (w - 1.0) @ c.T, y.sum()  # w dies in w - 1, which takes its bytes


def _row_of_itself(a, b, c):  # row 0 of y is read by every row: y keeps its bytes
    y = a @ b
    return ((y + y[0:1]) * 2.0) @ c


def _twice(a, b, c):  # the same input twice: element k still reads only element k
    y = a @ b
    return (y * y + 1.0) @ c


def _through_a_transpose(a, b, c):  # y^T is y's bytes in another order: not over y
    y = b @ c
    return (y + y.T) @ b


@pytest.mark.parametrize("backend", ["numpy", "c", "triton"])
@pytest.mark.parametrize("f,owners", [(_read_later, [(6, 5)]), (_row_of_itself, []),
                                      (_twice, [(6, 8)]), (_through_a_transpose, [])])
def test_only_an_input_nothing_else_reads_gives_up_its_bytes(f, owners, backend):
    """An element-wise result goes over an input only where nothing else reads that input's
    bytes, later or in the same node through another view; the results equal eager's."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((6, 5), (5, 8), (8, 5)))
    def results(fn):
        out = fn(*map(Tensor, (a, b, c)))
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]

    want = results(f)
    run = dtensor.compile(f, backend=backend)
    got = results(run)
    for x, w in zip(got, want):
        np.testing.assert_allclose(x, w, rtol=1e-5, atol=1e-4)
    pairs = _in_place_nodes(run.last.graph)
    if backend != "numpy" or f is not _twice:  # numpy: y * y + 1 is a group, not a ufunc
        assert [tuple(o.shape) for _, o in pairs] == owners, pairs
