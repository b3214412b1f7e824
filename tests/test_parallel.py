"""dtensor.parallel: styles, parallelize_module, parallelize (TP, SP, DP x TP, FSDP) and
loss_parallel, against one process (numbers) and Megatron-LM (collective counts and bytes)."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import Replicate, Shard
from dtensor.placements import Partial
from dtensor.comm import count_collectives
from dtensor.nn import GPT, Block, GPTConfig

STANDARD = dict(vocab_size=4096, n_layer=4, n_embd=256, n_head=8, mlp_hidden=1024,
                block_size=128, bias=False)
SMALL = dict(vocab_size=96, n_layer=2, n_embd=32, n_head=4, mlp_hidden=64, block_size=16,
             bias=False)


def kinds(log):
    return {k: n for k, (n, _) in log.summary().items()}


def full(t):
    return t.full_tensor().numpy() if hasattr(t, "full_tensor") else t.numpy()


def make_mesh(tp: int, dp: int):
    if dp == 1:
        return dtensor.init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    if tp == 1:
        return dtensor.init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    return dtensor.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def train(cfg: dict, steps: int, *, dropout=0.0, tp=1, dp=1, sp=False, fsdp=False, batch=8):
    """Losses, clipped global grad norms and final parameters (whole) of ``steps`` AdamW steps
    on the same global batches; one process when tp = dp = 1."""
    from dtensor.parallel import parallelize

    dtensor.manual_seed(0)
    model = GPT(GPTConfig(**cfg, dropout=dropout))
    if tp * dp > 1:
        parallelize(model, make_mesh(tp, dp), sequence_parallel=sp, fsdp=fsdp)
    opt = dtensor.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    rng = np.random.default_rng(1)
    losses, norms = [], []
    for s in range(steps):
        idx = rng.integers(0, cfg["vocab_size"], (batch, cfg["block_size"]))
        tgt = rng.integers(0, cfg["vocab_size"], (batch, cfg["block_size"]))
        dtensor.manual_seed(100 + s)  # the same dropout stream in every layout
        _, loss = model(idx, tgt)
        loss.backward()
        norms.append(float(full(dtensor.optim.clip_grad_norm_(model.parameters(), 1.0))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: full(v) for k, v in model.state_dict().items()}
    return losses, norms, params


@pytest.fixture(scope="session")
def one_process():
    """The single-process reference runs, computed once here and pickled to the ranks."""
    return {d: train(STANDARD, 5, dropout=d) for d in (0.0, 0.1)}


LAYOUTS = [  # (ranks, tp, dp, sp, fsdp, dropout)
    pytest.param(2, 2, 1, False, False, 0.0, id="tp2", marks=pytest.mark.ranks(2, timeout=300)),
    pytest.param(4, 4, 1, False, False, 0.1, id="tp4-dropout",
                 marks=pytest.mark.ranks(4, timeout=300)),
    pytest.param(2, 2, 1, True, False, 0.0, id="tp2-sp", marks=pytest.mark.ranks(2, timeout=300)),
    pytest.param(4, 2, 2, False, False, 0.0, id="dp2xtp2",
                 marks=pytest.mark.ranks(4, timeout=300)),
    pytest.param(4, 2, 2, True, True, 0.1, id="dp2xtp2-sp-fsdp-dropout",
                 marks=pytest.mark.ranks(4, timeout=300)),
]


def adam_drift_bound(lr: float, steps: int, betas=(0.9, 0.999)) -> float:
    """The most two runs of AdamW can move one element apart in ``steps`` steps, whatever
    their gradients: 2 * lr * sum over steps t of max |m_hat_t| / sqrt(v_hat_t).

    By Cauchy-Schwarz, |sum_i a_i g_i| <= sqrt(sum_i a_i^2 / b_i) * sqrt(sum_i b_i g_i^2), with
    a_i, b_i the bias-corrected EMA weights of m and v; so each step moves an element by at
    most lr * sqrt(sum_i a_i^2 / b_i) (1.0 at t = 1, 1.011 at t = 5), eps and weight decay
    only shrinking it. An element whose gradient is float32 rounding noise can take that step
    with the noise's sign, which differs between summation orders (BLAS threads, shards)."""
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        i = np.arange(1, t + 1)
        a = (1 - b1) * b1 ** (t - i) / (1 - b1 ** t)
        b = (1 - b2) * b2 ** (t - i) / (1 - b2 ** t)
        total += float(np.sqrt((a * a / b).sum()))
    return 2 * lr * total


@pytest.mark.parametrize("ranks,tp,dp,sp,fsdp,dropout", LAYOUTS)
def test_standard_gpt_trains_as_one_process(one_process, ranks, tp, dp, sp, fsdp, dropout):
    """5 AdamW steps of the standard workload (with global-norm clipping): losses to 1e-5
    relative, clipped norms likewise; final parameters (state_dict DTensors, whole) to 1e-5 in
    relative L2, within 1e-5 elementwise for all but 1e-5 of the 5.3M elements, and no element
    beyond adam_drift_bound.

    Why not every element to 1e-5: an element whose gradient is as small as its float32
    rounding noise moves by up to lr a step on the sign of that noise, and summation orders
    differ between layouts (and between 1 and 2 BLAS threads in one process: up to 4e-5 there,
    1.6e-4 seen in a tp=4 run on another CPU). Those elements are few; the relative L2 and the
    count carry the signal, and the elementwise bound is the analysis's, not a measurement."""
    ref_losses, ref_norms, ref_params = one_process[dropout]
    losses, norms, params = train(STANDARD, 5, dropout=dropout, tp=tp, dp=dp, sp=sp, fsdp=fsdp)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert params.keys() == ref_params.keys()
    diff = {k: np.abs(params[k] - ref_params[k]) for k in params}
    size = sum(d.size for d in diff.values())
    beyond = sum(int((d > 1e-5).sum()) for d in diff.values())
    worst = max(float(d.max()) for d in diff.values())
    rel = np.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in diff.values()) / sum(
        float((ref_params[k].astype(np.float64) ** 2).sum()) for k in params))
    bound = adam_drift_bound(3e-4, 5)  # train()'s lr and steps
    assert rel <= 1e-5 and beyond <= 1e-5 * size and worst <= bound, (rel, beyond, worst, bound)


def test_adam_drift_bound_is_reached_by_noise_gradients():
    """The bound is tight: gradients of opposite signs in two runs (small, but well above
    eps) move elements apart by nearly 2 * lr a step, and never beyond the bound."""
    from dtensor.optim import AdamW
    lr, steps = 3e-4, 5
    rng = np.random.default_rng(0)
    finals = []
    for sign in (1.0, -1.0):
        p = dtensor.nn.Parameter(dtensor.zeros(1000))
        opt = AdamW([p], lr=lr, weight_decay=0.0)
        for _ in range(steps):
            p.grad = dtensor.Tensor(sign * np.abs(rng.standard_normal(1000)).astype(np.float32)
                                    * 1e-4)  # >> eps
            opt.step()
        finals.append(p.numpy().copy())
    drift = np.abs(finals[0] - finals[1]).max()
    assert 0.9 * 2 * lr * steps <= drift <= adam_drift_bound(lr, steps)


# ----------------------------------------------------------------------------- golden counts

def _block_plan(sp: bool) -> dict:
    from dtensor.parallel import gpt_plan
    return {k[len("blocks.*."):]: v for k, v in gpt_plan(sp, True).items()
            if k.startswith("blocks.*.")}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.ranks(2)
def test_block_golden_communication(sp, rank):
    """One Transformer block on tp=2: TP is 2 all-reduces of B*T*C forward and 2 backward; SP is
    2 all-gathers + 2 reduce-scatters of B*T*C each way (plus, SP only, the LayerNorm gradients'
    all-reduce when they are stored, as Megatron's sequence-parallel grad all-reduce). Values
    and gradients equal the single-process block."""
    from dtensor.parallel import parallelize_module

    cfg = GPTConfig(**SMALL)
    B, T, C = 4, cfg.block_size, cfg.n_embd
    act = B * T * C * 4
    x = np.random.default_rng(0).standard_normal((B, T, C)).astype(np.float32)
    dtensor.manual_seed(0)
    ref = Block(cfg)
    xr = dtensor.Tensor(x, requires_grad=True)
    yr = ref(xr)
    (yr * yr).sum().backward()

    dtensor.manual_seed(0)
    block = Block(cfg)
    mesh = dtensor.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(block, mesh, _block_plan(sp))
    for _, m in block.named_modules():  # LayerNorms of the non-SP plan: Replicate
        for n, p in list(m._parameters.items()):
            if not isinstance(p, dtensor.DTensor):
                m._parameters[n] = dtensor.nn.Parameter(
                    dtensor.distribute_tensor(p.detach(), mesh, [Replicate()]))
    xd = dtensor.distribute_tensor(x, mesh, [Shard(1) if sp else Replicate()])
    xd.requires_grad = True
    with count_collectives() as fwd:
        y = block(xd)
    loss = (y * y).sum()
    with count_collectives() as bwd:
        loss.backward()

    np.testing.assert_allclose(full(y), yr.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full(xd.grad), xr.grad.numpy(), rtol=1e-4, atol=1e-4)
    for (n, p), (_, q) in zip(block.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(full(p.grad), q.grad.numpy(), rtol=1e-4, atol=1e-4,
                                   err_msg=n)
    if sp:
        assert fwd.summary() == {"all_gather": (2, 2 * act), "reduce_scatter": (2, 2 * act)}
        assert bwd.summary() == {"all_gather": (2, 2 * act), "reduce_scatter": (2, 2 * act),
                                 "all_reduce": (4, 4 * C * 4)}
    else:
        assert fwd.summary() == {"all_reduce": (2, 2 * act)}
        assert bwd.summary() == {"all_reduce": (2, 2 * act)}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.ranks(2)
def test_gpt_step_communication_matches_megatron(sp, rank):
    """The whole GPT step on tp=2: counts and bytes per kind equal Megatron-LM's (the formula
    benchmarks/gpt_step.py prints as megatron_bytes); the optimizer step moves nothing."""
    from dtensor.parallel import parallelize

    cfg = GPTConfig(**SMALL)
    B, T, C, L = 4, cfg.block_size, cfg.n_embd, cfg.n_layer
    act, tok = B * T * C * 4, B * T * 4
    rng = np.random.default_rng(0)
    idx, tgt = (rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(2))
    dtensor.manual_seed(0)
    model = parallelize(GPT(cfg), make_mesh(2, 1), sequence_parallel=sp)
    opt = dtensor.optim.AdamW(model.parameters())
    with count_collectives() as fwd:
        _, loss = model(idx, tgt)
    with count_collectives() as bwd:
        loss.backward()
    with count_collectives() as step:
        opt.step()
    assert step.events == []
    if sp:
        assert fwd.summary() == {"reduce_scatter": (2 * L + 1, (2 * L + 1) * act),
                                 "all_gather": (2 * L + 1, (2 * L + 1) * act),
                                 "all_reduce": (3, 3 * tok)}
        ln = (2 * L + 1) * 2  # LayerNorm weights and biases, and the position embedding
        assert bwd.summary() == {"reduce_scatter": (2 * L + 1, (2 * L + 1) * act),
                                 "all_gather": (2 * L + 1, (2 * L + 1) * act),
                                 "all_reduce": (ln + 1, (ln * C + T * C) * 4)}
    else:
        assert fwd.summary() == {"all_reduce": (2 * L + 1 + 3, (2 * L + 1) * act + 3 * tok)}
        assert bwd.summary() == {"all_reduce": (2 * L + 1, (2 * L + 1) * act)}


# ----------------------------------------------------------------------------- memory

def _local_bytes(model, opt) -> int:
    def nbytes(t):
        return (t.to_local() if hasattr(t, "to_local") else t).numpy().nbytes

    total = sum(nbytes(p) for p in model.parameters())
    for state in opt.state.values():
        total += sum(nbytes(v) for v in state.values() if hasattr(v, "shape"))
    return total


@pytest.mark.parametrize("tp,dp,fsdp", [(4, 1, False), (2, 2, True)], ids=["tp4", "fsdp2x2"])
@pytest.mark.ranks(4, timeout=120)
def test_parameter_and_optimizer_bytes_per_rank(tp, dp, fsdp, rank):
    """Per-rank parameter + AdamW state bytes after a step: <= 0.30 of one process's."""
    from dtensor.parallel import parallelize

    def one_step(model):
        opt = dtensor.optim.AdamW(model.parameters())
        rng = np.random.default_rng(0)
        idx = rng.integers(0, 4096, (8, 32))
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        return _local_bytes(model, opt)

    dtensor.manual_seed(0)
    whole = one_step(GPT(GPTConfig(**STANDARD)))
    dtensor.manual_seed(0)
    model = parallelize(GPT(GPTConfig(**STANDARD)), make_mesh(tp, dp), fsdp=fsdp)
    mine = one_step(model)
    assert mine <= 0.30 * whole, (mine, whole, mine / whole)


# ----------------------------------------------------------------------------- styles

class MLP(dtensor.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = dtensor.nn.Linear(6, 10, bias=True)
        self.fc2 = dtensor.nn.Linear(10, 5, bias=True)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.ranks(4)
def test_pytorch_style_plan_on_plain_tensors(rank):
    """PyTorch's defaults: plain tensors in and out (use_local_output=True), fc1 column- and fc2
    row-parallel with uneven shards (10 hidden over 4 ranks: 3, 3, 2, 2); one all-reduce each
    way, values and gradients as one process."""
    from dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    dtensor.manual_seed(0)
    ref = MLP()
    xr = dtensor.Tensor(x, requires_grad=True)
    (ref(xr) ** 2).sum().backward()
    dtensor.manual_seed(0)
    model = parallelize_module(MLP(), dtensor.init_device_mesh("cpu", (4,)),
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    assert model.fc1.weight.placements == (Shard(0),)
    assert model.fc2.weight.placements == (Shard(1),)
    xd = dtensor.Tensor(x, requires_grad=True)
    with count_collectives() as fwd:
        y = model(xd)
    assert isinstance(y, dtensor.Tensor)  # use_local_output: a plain (replicated) tensor
    with count_collectives() as bwd:
        (y ** 2).sum().backward()
    assert kinds(fwd) == {"all_reduce": 1} and kinds(bwd) == {"all_reduce": 1}
    np.testing.assert_allclose(y.numpy(), ref(dtensor.Tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xd.grad.numpy(), xr.grad.numpy(), rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(full(p.grad), q.grad.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=n)


@pytest.mark.ranks(2)
def test_loss_parallel_is_vocab_parallel(rank):
    """cross_entropy on [Shard(1)] logits inside loss_parallel(): 3 all-reduces of one number
    per token forward, none backward; values (mean, sum, none, ignore_index) and the gradient
    softmax - onehot as plain numpy."""
    from dtensor.parallel import loss_parallel

    rng = np.random.default_rng(0)
    N, V = 6, 11  # 11 classes over 2 ranks: uneven shards 6 + 5
    x = rng.standard_normal((N, V))
    t = rng.integers(0, V, N)
    t[2] = -100
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    nll = np.where(t >= 0, -np.log(p[np.arange(N), np.maximum(t, 0)]), 0.0)
    mesh = dtensor.init_device_mesh("cpu", (2,))
    for reduction, want in (("none", nll), ("sum", nll.sum()), ("mean", nll.sum() / 5)):
        xd = dtensor.distribute_tensor(x, mesh, [Shard(1)])
        xd.requires_grad = True
        with loss_parallel():
            with count_collectives() as fwd:
                loss = F.cross_entropy(xd, t, reduction=reduction)
            with count_collectives() as bwd:
                (loss.sum() if reduction == "none" else loss).backward()
        assert fwd.summary() == {"all_reduce": (3, 3 * N * 8)}, reduction
        assert bwd.events == [], reduction
        np.testing.assert_allclose(full(loss), want, rtol=1e-12)
        onehot = np.zeros_like(p)
        onehot[np.arange(N), np.maximum(t, 0)] = 1.0
        grad = np.where(t[:, None] >= 0, p - onehot, 0.0) / (5 if reduction == "mean" else 1)
        assert xd.grad.placements == (Shard(1),)
        np.testing.assert_allclose(full(xd.grad), grad, rtol=1e-10, atol=1e-12)


# (mesh shape, logits shape, placements, offset, masked): the class dim sharded on one mesh
# dim or on both, beside a sharded or replicated batch; uneven class and row blocks, an
# empty class block (6 classes over 4 ranks: 2, 2, 2, 0), a (B, T, V) layout, logits given
# as partial sums, logits far from 0 (the gradient's precision), and a row whose first block
# is all -inf (a masked vocabulary)
LOSS_CASES = [((4,), (6, 11), [Shard(1)], 0.0, False),
              ((2, 2), (7, 10), [Shard(0), Shard(1)], 0.0, False),
              ((2, 2), (6, 9), [Replicate(), Shard(1)], 0.0, False),
              ((2, 2), (5, 13), [Shard(1), Shard(1)], 0.0, False),
              ((2, 2), (4, 3, 9), [Shard(0), Shard(2)], 0.0, False),
              ((4,), (6, 6), [Shard(1)], 0.0, False),
              ((2, 2), (6, 8), [Partial(), Shard(1)], 0.0, False),
              ((4,), (5, 12), [Shard(1)], 1000.0, False),
              ((4,), (5, 11), [Shard(1)], 0.0, True)]


@pytest.mark.ranks(4, timeout=180)
@pytest.mark.parametrize("backend", [None, "c"])
@pytest.mark.parametrize("case", range(len(LOSS_CASES)))
def test_loss_parallel_cases(rank, case, backend):
    """Vocab-parallel cross-entropy (each rank's sum of exponentials over its classes, a
    Partial(sum)) against float64 numpy on the same float32 logits, eager and compiled, in
    every case of the table: loss and gradient, and the collectives over the class mesh dims
    (three all-reduces of one number a row each, none backward). Compiled, nothing of the
    logits' size is kept from the forward for the backward: every value of their size comes
    after the forward's collectives."""
    from dtensor.parallel import loss_parallel

    mesh_shape, shape, placements, offset, masked = LOSS_CASES[case]
    rng = np.random.default_rng(case)
    x = (rng.standard_normal(shape) * 4 + offset).astype(np.float32).astype(np.float64)
    t = rng.integers(0, shape[-1], shape[:-1])
    t.flat[1] = -100
    if masked:  # rank 0's block of row 0 (3 of 11 classes) at -inf, its target elsewhere
        x[0, :3], t[0] = -np.inf, 5
    m = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(x, np.maximum(t, 0)[..., None], -1)[..., 0]
    valid = t >= 0
    want = np.where(valid, lse - picked, 0.0).sum() / valid.sum()
    onehot = np.zeros_like(x)
    np.put_along_axis(onehot, np.maximum(t, 0)[..., None], 1.0, -1)
    grad = np.where(valid[..., None], np.exp(x - lse[..., None]) - onehot, 0.0) / valid.sum()
    mesh = dtensor.init_device_mesh("cpu", mesh_shape)
    if isinstance(placements[0], Partial):  # x as two partial sums, 1/4 and 3/4 of it
        whole = dtensor.distribute_tensor(x.astype(np.float32), mesh, [Replicate()] +
                                          placements[1:])
        share = 0.25 if mesh.get_coordinate()[0] == 0 else 0.75
        xd = dtensor.DTensor.from_local(whole.to_local().numpy() * np.float32(share), mesh,
                                        placements, shape=shape)
    else:
        xd = dtensor.distribute_tensor(x.astype(np.float32), mesh, placements)

    def step(xd):
        xd.requires_grad = True
        with loss_parallel():
            loss = F.cross_entropy(xd.reshape(-1, shape[-1]), t.reshape(-1))
            (g,) = dtensor.autograd.grad(loss, [xd])
        return loss, g

    run = step if backend is None else dtensor.compile(step, backend=backend)
    with count_collectives() as log:
        loss, g = run(xd)
    # over each class mesh dim, forward and backward together: the max, the sum of
    # exponentials and the target's logit, one number a row, and nothing more
    dims = [d for d, p in enumerate(placements) if p == Shard(len(shape) - 1)]
    groups = {tuple(mesh.get_group(d).ranks) for d in dims}
    on_classes = [e for e in log.events if e.group in groups]
    assert len(on_classes) == 3 * len(dims), log.events
    rows = np.prod(xd.to_local().shape[:-1])
    assert {(e.kind, e.bytes) for e in on_classes} == {("all_reduce", rows * 4)}
    # float32: exp(x - m) and the sums round at a few ulps; the mean of terms of order 10
    np.testing.assert_allclose(full(loss), want, rtol=2e-6)
    np.testing.assert_allclose(full(g), grad, rtol=0, atol=2e-6 * np.abs(grad).max())
    if backend is not None:  # the forward's collectives come first, the backward has none:
        nodes = run.last.graph.nodes  # a value of the logits' size computed before the last
        last = max(i for i, n in enumerate(nodes) if n.kind == "comm")  # one was kept
        big = [i for i, n in enumerate(nodes) if np.prod(n.shape) == xd.to_local().numel()
               and xd.to_local().numel() and n.kind != "comm"  # (partial logits summed)
               and n.name not in ("reshape", "permute")]
        assert not big or min(big) > last, run.last.graph


@pytest.mark.ranks(4, timeout=120)
def test_uneven_mlp_hidden_and_vocab(rank):
    """Exact uneven sharding: hidden 66 and vocab 97 over tp=4 train as one process."""
    cfg = dict(SMALL, mlp_hidden=66, vocab_size=97)
    ref_losses, _, ref_params = train(cfg, 2, batch=4)
    losses, _, params = train(cfg, 2, tp=4, batch=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max(float(np.abs(params[k] - ref_params[k]).max()) for k in params) <= 1e-5


# ----------------------------------------------------------------------------- bad input

@pytest.mark.ranks(2)
def test_bad_input_is_a_clear_error_on_every_rank(rank):
    from dtensor.parallel import ColwiseParallel, parallelize, parallelize_module

    mesh = make_mesh(2, 1)
    cube = dtensor.init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("dp", "tp", "pp"))
    with pytest.raises(ValueError, match=r"1-D mesh or a 2-D \('dp', 'tp'\) mesh; got a 3-D"):
        parallelize(GPT(GPTConfig(**SMALL)), cube)
    with pytest.raises(ValueError, match=r"needs dims named 'dp' and 'tp'"):
        parallelize(GPT(GPTConfig(**SMALL)), dtensor.init_device_mesh("cpu", (1, 2)))
    with pytest.raises(ValueError, match=r"plan key 'blocks\.\*\.attn\.qkv' matches no "
                                         r"submodule of GPT"):
        parallelize_module(GPT(GPTConfig(**SMALL)), mesh,
                           {"blocks.*.attn.qkv": ColwiseParallel()})
    with pytest.raises(TypeError, match=r"ColwiseParallel applies to Linear and Embedding.*"
                                        r"'blocks\.0\.ln1', a LayerNorm"):
        parallelize_module(GPT(GPTConfig(**SMALL)), mesh, {"blocks.0.ln1": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"fsdp=True shards parameters over a 'dp' mesh dim"):
        parallelize(GPT(GPTConfig(**SMALL)), mesh, fsdp=True)


class _TiedPair(dtensor.nn.Module):
    """Two Linears sharing one weight, names of its own."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = dtensor.nn.Linear(8, 8, bias=False), dtensor.nn.Linear(8, 8,
                                                                                   bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return (self.dec(F.gelu(self.enc(x))) ** 2).mean()


@pytest.mark.parametrize("plan, error", [
    ({"enc": "colwise", "dec": "colwise"}, None),     # both Shard(0): stays one parameter
    ({"enc": "colwise"}, None),                       # the unplanned use follows the planned one
    ({"enc": "colwise", "dec": "rowwise"}, r"enc\.weight and dec\.weight are one parameter"),
])
@pytest.mark.ranks(2, timeout=120)
def test_tied_parameters_stay_tied_or_the_plan_is_refused(plan, error, rank):
    from dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {"colwise": lambda: ColwiseParallel(use_local_output=False),
              "rowwise": lambda: RowwiseParallel(use_local_output=False)}
    dtensor.manual_seed(0)
    whole = _TiedPair()
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    want = whole(x)
    want.backward()
    dtensor.manual_seed(0)
    model = _TiedPair()
    mesh = dtensor.init_device_mesh("cpu", (2,))
    built = {k: styles[v]() for k, v in plan.items()}
    if error:
        with pytest.raises(ValueError, match=error):
            parallelize_module(model, mesh, built)
        return
    parallelize_module(model, mesh, built)
    assert model.dec.weight is model.enc.weight
    with dtensor.implicit_replication():
        got = model(x)
    got.backward()
    np.testing.assert_allclose(got.full_tensor().item(), want.item(), rtol=1e-6)
    np.testing.assert_allclose(model.enc.weight.grad.full_tensor().numpy(),
                               whole.enc.weight.grad.numpy(), rtol=1e-5, atol=1e-7)
