"""merge_matmuls (compile/passes/matmuls.py): Linear layers that read the same input become one
GEMM, and so do their input and weight gradients, on the C and Triton backends; the numpy
backend keeps eager's GEMMs. Each model trains two AdamW steps compiled against eager (losses
and parameters to float32 rounding: the merged input gradient sums the same terms in another
order), and the number of GEMMs its step runs is the numpy backend's less what merging saves:
a group of k siblings runs one GEMM instead of k, forward, for the input gradient and for the
weight gradients. Models: a GPT (q, k, v), the same with biases (added once, side by side),
one written for this test with other names (three towers whose outputs are multiplied), the
same with a skip connection (the input's gradient then has a fourth term, so the backward
stays as it was), one whose second weight is computed after the first GEMM (it stays out, and
so does the backward, whose sum has its term), one whose third projection runs after the
first two are read (it stays out), and a Llama, whose q, k (rotary) and gate/up
(SwiGLU) are read by element-wise kernels, which would copy the strided blocks first: nothing
merges there.
"""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor.comm import count_collectives
from dtensor.nn import GPT, GPTConfig, Linear, Llama, LlamaConfig, Module

BACKENDS = ["c", "triton"]
WIDTH, SEQ, BATCH = 32, 16, 4


class Towers(Module):
    """Three projections of h = stem(x) (query_tower, key_tower, value_tower) combined by
    matmuls (h has a gradient, as every layer's input but the first)."""

    def __init__(self, skip: bool = False, late: bool = False, apart: bool = False):
        super().__init__()
        self.stem = Linear(WIDTH, WIDTH)
        self.query_tower = Linear(WIDTH, WIDTH, bias=False)
        self.key_tower = Linear(WIDTH, WIDTH, bias=False)
        self.value_tower = Linear(WIDTH, WIDTH, bias=False)
        self.skip, self.late, self.apart = skip, late, apart

    def forward(self, x, y):
        h = self.stem(x)
        a = self.query_tower(h)
        # late: the weight is computed after a's GEMM, so b's does not merge
        b = F.linear(h, self.key_tower.weight * 0.5) if self.late else self.key_tower(h)
        c = None if self.apart else self.value_tower(h)
        scores = a @ b.transpose(-1, -2) * (1.0 / WIDTH)
        # apart: c's GEMM runs after a and b are read, so it stays out of their GEMM
        out = scores @ (self.value_tower(h) if c is None else c)
        if self.skip:
            out = out + h  # h's gradient: three GEMMs' terms and this one
        with dtensor.implicit_replication():  # y is a plain tensor; out a DTensor under tp
            return None, ((out - y) * (out - y)).mean()


def gpt(bias: bool = False):
    return GPT(GPTConfig(vocab_size=96, n_layer=2, n_embd=WIDTH, n_head=4, mlp_hidden=64,
                         block_size=SEQ, bias=bias, dropout=0.0))


def llama():
    return Llama(LlamaConfig(vocab_size=96, dim=WIDTH, n_layers=2, n_heads=4, n_kv_heads=2,
                             hidden_dim=96, max_seq_len=SEQ))


# model: (constructor, token inputs?, GEMMs saved a step: (forward, backward) per group)
MODELS = {
    "gpt": (gpt, True, 2 * (2 + 4)),  # per layer: q, k, v forward 3 -> 1; dx and dW 3 -> 1 each
    "gpt_bias": (lambda: gpt(bias=True), True, 2 * (2 + 4)),  # the biases added once, merged
    "towers": (Towers, False, 2 + 4),
    "towers_skip": (lambda: Towers(skip=True), False, 2),
    # q and v merge (2 -> 1) forward; h's gradient sums k's term too: that backward stays
    "towers_late": (lambda: Towers(late=True), False, 1),
    # q and k merge (2 -> 1), forward and backward (autograd adds their terms first)
    "towers_apart": (lambda: Towers(apart=True), False, 3),
    "llama": (llama, True, 0),
}


def _data(tokens: bool, step: int):
    rng = np.random.default_rng(step)
    if tokens:
        return tuple(rng.integers(0, 96, (BATCH, SEQ)) for _ in "xy")
    return tuple(dtensor.Tensor(rng.standard_normal((BATCH, SEQ, WIDTH)).astype(np.float32))
                 for _ in "xy")


def _run(name: str, backend, tp: int = 1, dp: int = 1, sp: bool = False):
    """Losses and whole parameters after two AdamW steps, the step (None: eager) and the last
    step's collectives (count and bytes by kind)."""
    make, tokens, _ = MODELS[name]
    dtensor.manual_seed(0)
    model = make()
    if tp * dp > 1:
        from dtensor.parallel import ColwiseParallel, parallelize, parallelize_module
        mesh = dtensor.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if isinstance(model, Towers):  # each tower's features sharded, kept as DTensors
            parallelize_module(model, mesh["tp"], {
                f"{t}_tower": ColwiseParallel(use_local_output=False)
                for t in ("query", "key", "value")})
        else:
            parallelize(model, mesh, sequence_parallel=sp)
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    def train_step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = train_step if backend is None else dtensor.compile(train_step, backend=backend)
    losses = []
    for step in range(2):
        with count_collectives() as log:
            losses.append(run(*_data(tokens, step)).item())
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).numpy()
              for k, v in model.state_dict().items()}
    return losses, params, None if backend is None else run, log.summary()


def _gemms(run) -> int:
    """The step's matrix GEMMs (attention's batched ones are its own kernel on C and Triton)."""
    return sum(1 for n in run.last.graph.nodes if n.name == "matmul" and len(n.shape) == 2)


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for k in want[1]:
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-4, atol=2e-5, err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_siblings_merge_and_train_as_eager(name, backend):
    eager, reference, merged = _run(name, None), _run(name, "numpy"), _run(name, backend)
    _assert_close(merged, eager)
    np.testing.assert_array_equal(reference[0], eager[0])  # numpy backend: eager's GEMMs
    saved = MODELS[name][2]
    assert _gemms(merged[2]) == _gemms(reference[2]) - saved, merged[2].last.graph
    cats = [n for n in merged[2].last.graph.nodes if n.name == "cat"
            and all(a.kind == "input" for a in n.inputs)]  # the weights side by side
    assert bool(cats) == (saved > 0)


# GEMMs saved at tp=2: the GPT's as in one process (its plan sums x's gradient terms, then
# all-reduces once); the towers' forward only: each tower's Partial input gradient is
# all-reduced before the sum (as eager's DTensor does), so the sum's terms are not GEMMs.
@pytest.mark.parametrize("name,saved", [("gpt", MODELS["gpt"][2]),
                                        ("gpt_bias", MODELS["gpt_bias"][2]), ("towers", 2)])
@pytest.mark.ranks(2, timeout=300)
def test_tensor_parallel_siblings_merge(name, saved, rank):
    """At tp=2 (the projections column-sharded) the local GEMMs merge, and training matches
    the one-process eager run."""
    eager, merged = _run(name, None, tp=1), _run(name, "c", tp=2)
    _assert_close(merged, eager)
    reference = _run(name, "numpy", tp=2)
    assert _gemms(merged[2]) == _gemms(reference[2]) - saved
    assert merged[3] == reference[3] and merged[3]["all_reduce"][0] > 0  # the same collectives


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.ranks(4, timeout=300)
def test_gpt_two_d_layouts_merge(sp, rank):
    """2-D data x tensor parallel (2 x 2), with sequence parallel too (the projections then
    read the all-gathered stream): the GPT's GEMMs merge as in one process, and training
    matches the one-process eager run."""
    eager, merged = _run("gpt", None), _run("gpt", "c", tp=2, dp=2, sp=sp)
    _assert_close(merged, eager)
    reference = _run("gpt", "numpy", tp=2, dp=2, sp=sp)
    assert _gemms(merged[2]) == _gemms(reference[2]) - MODELS["gpt"][2]
    assert merged[3] == reference[3]  # the same collectives, count and bytes by kind


class Pair(Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Linear(8, 6, bias=False), Linear(8, 4, bias=False)


def _fed_in(m, x, ga, gb):
    """The siblings' output gradients arrive as inputs (a pipeline stage's backward)."""
    a, b = m.a(x), m.b(x)
    a.backward(ga)
    b.backward(gb)
    return a, b, x.grad, m.a.weight.grad, m.b.weight.grad


def _broadcast_sum(m, x, ga, gb):
    """x's two gradient terms summed by an add that broadcasts, not as x's gradient."""
    a, b = m.a(x), m.b(x)
    a.backward(ga * 2.0)
    g1, x.grad = x.grad, None
    b.backward(gb * 3.0)
    return a, b, g1.reshape(5, 1, 8) + x.grad.reshape(1, 5, 8)


@pytest.mark.parametrize("step", [_fed_in, _broadcast_sum])
def test_backward_shapes_it_leaves_alone(step):
    """Gradient graphs the backward merge must not take (a gradient that is a graph input; a
    sum whose add broadcasts): they compile, forward merged, and equal eager."""
    rng = np.random.default_rng(0)
    xs, ga, gb = (rng.standard_normal(s).astype(np.float32) for s in ((5, 8), (5, 6), (5, 4)))
    outs = []
    for backend in (None, "c"):
        dtensor.manual_seed(0)
        m = Pair()
        x = dtensor.Tensor(xs.copy(), requires_grad=True)
        fn = (lambda x, ga, gb: step(m, x, ga, gb))
        run = fn if backend is None else dtensor.compile(fn, backend=backend)
        outs.append([t.numpy() for t in run(x, dtensor.Tensor(ga), dtensor.Tensor(gb))])
    assert sum(n.name == "cat" for n in run.last.graph.nodes) == 1  # the weights, forward
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
