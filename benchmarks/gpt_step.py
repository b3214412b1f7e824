"""One training step of the standard GPT (or Llama) workload: eager or compiled, one process or
parallelized.

Prints one JSON line (rank 0): median/min/max step seconds over --steps steps after --warmup,
tokens/s, achieved GFLOP/s (27.41 GFLOP per step for the standard workload, counted as in the
issue), peak RSS, and numpy's own float32 matmul GFLOP/s measured in the same run with the same
threads, between the steps, so the result reads as a ratio (``ratio_to_matmul``: the median over
steps of the step's GFLOP/s over the faster of the two reference GEMMs around it, which errs low
when the machine's speed jitters; ``ratio_of_medians``: the median step's GFLOP/s over the
median reference; under dtlaunch every rank times the reference at once and the rates are
summed: the machine's GEMM rate). Under
dtlaunch the model goes through dtensor.parallel.parallelize on a (dp, tp) mesh, and the line
also gives the collectives per step (count and bytes by kind, from the debug counter) next to
Megatron-LM's figures for the same layout (``megatron_bytes``, ``megatron_counts``,
``bytes_ratio``). ``--bias`` gives the GPT's Linear and LayerNorm layers biases (GPT-2's
own layout). ``--model llama`` runs the same step on a Llama of the same width (SwiGLU
hidden 688, ``--kv-heads`` key/value heads, RMSNorm, rotary positions). With --compile
the step runs through dtensor.compile (``--backend``: numpy, c or triton; ``compile_s``:
tracing, passes, codegen and the C compiler's run if its library was not cached, summed over
its graphs), and an eager twin of the model steps after each compiled step: ``speedup_vs_eager``
is the median over steps of eager / compiled time.

The GEMM floor: every matmul of this rank's step (shapes and transposed operands, recorded
from an eager step, or read off the compiled graph under --no-twin), run by numpy alone between
the steps, at the same moment on every rank; ``gemm_floor_s`` is the slowest rank's, and
``ratio_to_gemm_floor`` the median over steps of the step's time over the faster of the floors
timed just before and after it (1.0: nothing but the GEMMs). The model's size comes from flags,
so cost can be read as the model grows; ``peak_rss_mb`` under ``--compile --no-twin`` is the
compiled step's alone, to set beside an eager run's.

    python benchmarks/gpt_step.py                                  # standard workload
    python benchmarks/gpt_step.py --compile [--backend c]
    dtlaunch --nproc 1 benchmarks/gpt_step.py --compile --backend c  # as fast as plain python
    dtlaunch --nproc 2 benchmarks/gpt_step.py --tp 2
    dtlaunch --nproc 4 benchmarks/gpt_step.py --tp 2 --dp 2 --sp [--fsdp]
    dtlaunch --nproc 2 benchmarks/gpt_step.py --model llama --tp 2 [--compile]
    dtlaunch --nproc 2 benchmarks/gpt_step.py --tp 2 --compile --backend c --n-layer 12 \
        --n-embd 768 --n-head 12 --vocab 8192 --seq 256 --batch 4   # GPT-2 small's shape
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import numpy as np

import dtensor


def step_flops(model, batch: int, seq: int) -> float:
    """6 x non-embedding params x tokens + 12 x n_layer x C x T x tokens (attention), C the
    attention width (heads x head size). For the standard GPT: 27.41 GFLOP."""
    c = model.config
    layers, _, width = _dims(c)
    tokens = batch * seq
    return 6.0 * model.num_params(non_embedding=True) * tokens + 12.0 * layers * width * seq * \
        tokens


def numpy_matmul_gflops(reps: int = 5) -> float:
    """numpy float32 GEMM at the workload's largest shape: (1024 x 256) @ (256 x 4096)."""
    a = np.random.default_rng(0).standard_normal((1024, 256), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((256, 4096), dtype=np.float32)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        times.append((time.perf_counter() - t) / 10)
    return 2 * 1024 * 256 * 4096 / statistics.median(times) / 1e9


def _gemm_operand(shape, transposed: bool) -> np.ndarray:
    """A float32 operand of ``shape``, a transposed view (as x @ w.mT reads w) if so."""
    rng = np.random.default_rng(0)
    if not transposed or len(shape) < 2:
        return rng.standard_normal(shape, dtype=np.float32)
    return rng.standard_normal(shape[:-2] + shape[::-1][:2], dtype=np.float32).swapaxes(-1, -2)


def record_gemms(step) -> list:
    """(x shape, x transposed, y shape, y transposed) of every matmul one eager ``step()`` runs
    on this rank (its blocks' shapes under DTensor)."""
    op = dtensor.ops.OPS["matmul"]
    impl, seen = op.impl, []

    def transposed(a):
        return a.ndim >= 2 and a.strides[-2] < a.strides[-1]

    def recording(x, y, **kw):
        seen.append((x.shape, transposed(x), y.shape, transposed(y)))
        return impl(x, y, **kw)

    op.impl = recording
    try:
        step()
    finally:
        op.impl = impl
    return seen


def graph_gemms(compiled) -> list:
    """The same list read off the compiled step's steady-state graph (a matmul input that is a
    permute of its last two dims is a transposed view)."""
    out = []
    if compiled._cache:
        entry = list(compiled._cache.values())[-1]  # the first step's graph also makes state
        for n in entry.graph.nodes:
                if n.name != "matmul":
                    continue
                ops = []
                for a in n.inputs[:2]:
                    perm = a.params.get("axes") if getattr(a, "name", "") == "permute" else None
                    flip = perm is not None and tuple(perm[-2:]) == (len(perm) - 1,
                                                                     len(perm) - 2)
                    ops += [tuple(a.shape), flip]
                out.append(tuple(ops))
    return out


def gemm_floor(gemms: list, reps: int = 3) -> float:
    """Seconds numpy takes for exactly these GEMMs, with this process's threads (the median of
    ``reps``); every rank runs its own at the same moment, as in the step."""
    made: dict = {}  # one operand per distinct shape and transpose: the floor's own memory
    # stays small beside the step's (a GPT-2-small step has ~300 GEMMs of ~15 shapes)

    def operand(shape, transposed):
        if (shape, transposed) not in made:
            made[shape, transposed] = _gemm_operand(shape, transposed)
        return made[shape, transposed]

    pairs = [(operand(xs, xt), operand(ys, yt)) for xs, xt, ys, yt in gemms]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for x, y in pairs:
            x @ y
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def megatron_traffic(n_layer: int, width: int, sp_grads: tuple[int, int], batch: int, seq: int,
                     tp: int, dp: int, sp: bool, fsdp: bool, param_bytes: int):
    """Megatron-LM's collectives per rank per step for this layout: (bytes, counts) by kind, in
    the debug counter's convention (all_reduce and reduce_scatter: input bytes; all_gather:
    gathered bytes), one collective per tensor (no bucketing).

    ``sp_grads``: (elements, tensors) of the replicated parameters whose gradients come from
    sequence shards under sequence parallelism (norm weights and biases, a position embedding),
    each all-reduced; ``param_bytes``: this rank's parameter bytes when whole over "dp" (its "tp"
    shards); ``width``: the residual stream's.
    """
    L, C, item = n_layer, width, 4
    act = batch // dp * seq * C * item  # one (B/dp, T, C) activation
    tok = batch // dp * seq * item  # one number per token
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    n = dict.fromkeys(out, 0)
    if tp > 1:
        if sp:  # per block 2 all-gathers + 2 reduce-scatters forward and backward, plus the
            # embedding (reduce-scatter / all-gather) and lm_head (all-gather / reduce-scatter)
            out["all_gather"] += 2 * (2 * L + 1) * act
            out["reduce_scatter"] += 2 * (2 * L + 1) * act
            n["all_gather"] += 2 * (2 * L + 1)
            n["reduce_scatter"] += 2 * (2 * L + 1)
            out["all_reduce"] += sp_grads[0] * item
            n["all_reduce"] += sp_grads[1]
        else:  # per block 2 all-reduces forward + 2 backward; embedding forward; lm_head backward
            out["all_reduce"] += (4 * L + 2) * act
            n["all_reduce"] += 4 * L + 2
        out["all_reduce"] += 3 * tok  # vocab-parallel cross-entropy: max, sum-exp, target logit
        n["all_reduce"] += 3
    if dp > 1:
        if fsdp:  # gather every parameter forward, reduce-scatter its gradient
            out["all_gather"] += param_bytes
            out["reduce_scatter"] += param_bytes
        else:  # all-reduce every gradient
            out["all_reduce"] += param_bytes
        out["all_reduce"] += 2 * item  # the token count of the mean, the loss for logging
    return out, n


def _model(args):
    """The workload's config: the standard GPT (by default), or a Llama of the same width and
    depth (SwiGLU hidden 8/3 of the width, rounded up to 16: 688 at 256)."""
    C = args.n_embd
    if args.model == "gpt":
        return dtensor.nn.GPT, dtensor.nn.GPTConfig(
            vocab_size=args.vocab, n_layer=args.n_layer, n_embd=C, n_head=args.n_head,
            mlp_hidden=4 * C, block_size=args.seq, bias=args.bias, dropout=0.0)
    return dtensor.nn.Llama, dtensor.nn.LlamaConfig(
        vocab_size=args.vocab, dim=C, n_layers=args.n_layer, n_heads=args.n_head,
        n_kv_heads=args.kv_heads, hidden_dim=-(-8 * C // 3 // 16) * 16, max_seq_len=args.seq)


def _dims(cfg) -> tuple[int, int, int]:
    """(layers, residual stream width, attention width) of a GPT or Llama config."""
    if isinstance(cfg, dtensor.nn.GPTConfig):
        return cfg.n_layer, cfg.n_embd, cfg.n_embd
    return cfg.n_layers, cfg.dim, cfg.n_heads * cfg.head_dim


def _sp_grads(cfg, seq: int) -> tuple[int, int]:
    """(elements, tensors) of the replicated parameters trained from sequence shards: norms
    (LayerNorm weight and bias, RMSNorm weight) and GPT's position embedding."""
    layers, width, _ = _dims(cfg)
    norms = 2 * layers + 1
    if isinstance(cfg, dtensor.nn.GPTConfig):
        return norms * 2 * width + seq * width, 2 * norms + 1
    return norms * width, norms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=("gpt", "llama"))
    ap.add_argument("--kv-heads", type=int, default=4, help="Llama's key/value heads")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256, help="width (GPT's MLP is 4x)")
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--bias", action="store_true", help="GPT's Linear and LayerNorm biases")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    ap.add_argument("--fsdp", action="store_true", help="shard parameters over dp (with --dp)")
    ap.add_argument("--compile", action="store_true", help="run the step through dtensor.compile")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "c", "triton"),
                    help="dtensor.compile's code generator (with --compile)")
    ap.add_argument("--no-twin", action="store_true",
                    help="compiled: no eager twin, so peak_rss_mb is the compiled step's alone")
    args = ap.parse_args()

    Model, cfg = _model(args)
    world = args.tp * args.dp
    mesh, rank = None, 0
    if world > 1:
        mesh = dtensor.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
        rank = mesh.get_rank()

    def build():
        """A model (seed 0, parallelized on the mesh), its optimizer and its train step."""
        dtensor.manual_seed(0)
        model = Model(cfg)
        if world > 1:
            from dtensor.parallel import parallelize
            parallelize(model, mesh, sequence_parallel=args.sp, fsdp=args.fsdp)
        opt = dtensor.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.01)

        def train_step(x, y):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return model, train_step

    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
    targets = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
    model, train_step = build()
    flops = step_flops(Model(cfg), args.batch, args.seq)  # counted on a whole model
    run = dtensor.compile(train_step, backend=args.backend) if args.compile else train_step
    # Compiled: an eager twin (same seed, same layout) steps between the compiled steps, so
    # the speedup is a ratio of neighbouring steps, drift on this machine hitting both alike.
    twin = build()[1] if args.compile and not args.no_twin else None

    def step() -> float:
        return run(idx, targets).item()

    # The GEMM floor: this rank's step's own GEMMs (shapes and transposes), run by numpy alone.
    gemms, floor_from = [], "eager step"
    for i in range(args.warmup):
        if i == 0 and not args.compile:
            gemms = record_gemms(step)
        else:
            step()
        if twin:
            if i == 0:
                gemms = record_gemms(lambda: twin(idx, targets).item())
            else:
                twin(idx, targets).item()
    if not gemms:
        gemms, floor_from = graph_gemms(run), "compiled graph"
    from dtensor.comm import count_collectives
    def together() -> None:
        """Every rank starts what is timed next at the same moment: else a rank that finished
        the last thing first counts, in its first collective, the time the others took to
        finish theirs (the twin's optimizer step, say)."""
        if world > 1:
            from dtensor.comm import get_world
            get_world().barrier()

    # The machine's speed drifts (shared, noisy): the reference GEMM is timed between the steps,
    # and each step is compared with the faster of the references just before and after it.
    def reference() -> float:
        together()
        return numpy_matmul_gflops(reps=1)

    def floor() -> float:
        together()
        return gemm_floor(gemms, reps=1)

    times, logs, refs, eager, floors = [], [], [reference()], [], [floor()]
    for _ in range(args.steps):
        together()
        t = time.perf_counter()
        with count_collectives() as log:
            step()
        times.append(time.perf_counter() - t)
        logs.append(log.summary())
        refs.append(reference())
        floors.append(floor())
        if twin:
            together()
            t = time.perf_counter()
            twin(idx, targets).item()
            eager.append(time.perf_counter() - t)
    if world > 1:  # the machine's GEMM rate: the sum over the ranks
        from dtensor.comm import get_world
        refs = get_world().all_reduce(np.array(refs)).tolist()
        # the floor of a step all ranks run in lockstep: the slowest rank's GEMMs
        mine = np.zeros((world, len(floors)))
        mine[get_world().rank] = floors
        floors = get_world().all_reduce(mine).max(axis=0).tolist()
    # each step over the faster of the floors timed just before and after it: errs high
    floor_ratio = statistics.median(t / min(floors[i], floors[i + 1])
                                    for i, t in enumerate(times))
    matmul = statistics.median(refs)
    med = statistics.median(times)
    gflops = flops / med / 1e9
    ratio = statistics.median(flops / t / 1e9 / max(refs[i], refs[i + 1])
                              for i, t in enumerate(times))
    record = {
        "bench": "gpt_step", "model": args.model, "mode": "compiled" if args.compile else "eager",
        "backend": args.backend if args.compile else None, "ranks": world,
        "tp": args.tp, "dp": args.dp, "sp": args.sp, "fsdp": args.fsdp,
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        # set by dtensor at import unless the user set it (dtensor/_threads.py)
        "blas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT", "default"),
        "step_s_median": round(med, 4), "step_s_min": round(min(times), 4),
        "step_s_max": round(max(times), 4), "steps": args.steps,
        "tokens_per_s": round(args.batch * args.seq / med, 1),
        "gflop_per_step": round(flops / 1e9, 2), "gflops": round(gflops, 1),
        "numpy_matmul_gflops": round(matmul, 1), "numpy_matmul_gflops_max": round(max(refs), 1),
        "ratio_to_matmul": round(ratio, 3), "ratio_of_medians": round(gflops / matmul, 3),
        "gemm_floor_s": round(statistics.median(floors), 4), "gemms_per_step": len(gemms),
        "gemm_floor_from": floor_from, "ratio_to_gemm_floor": round(floor_ratio, 3),
        # tracing + passes + codegen, summed over the graphs (the first step creates the
        # optimizer state, so it has a graph of its own)
        "compile_s": round(sum(e.compile_s for e in run._cache.values()), 3)
        if args.compile else None,
        "eager_step_s_median": round(statistics.median(eager), 4) if twin else None,
        "speedup_vs_eager": round(statistics.median(e / c for e, c in zip(eager, times)), 3)
        if twin else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "python": sys.version.split()[0], "numpy": np.__version__,
    }
    if world > 1:
        per_step = logs[-1]
        if any(log != per_step for log in logs):
            raise RuntimeError(f"collectives differ between steps: {logs}")
        # Parameter bytes of this rank when whole over "dp": each parameter's "tp" shard.
        from dtensor.redistribute import local_shape_and_offset
        whole_dp = sum(4 * math.prod(local_shape_and_offset(
            p.shape, (dtensor.Replicate(), p.placements[1]), mesh.shape,
            mesh.get_coordinate())[0]) for p in model.parameters())
        layers, width, _ = _dims(cfg)
        expect, counts = megatron_traffic(
            layers, width, _sp_grads(cfg, args.seq), args.batch, args.seq, args.tp, args.dp,
            args.sp, args.fsdp, whole_dp)
        got = {k: per_step.get(k, (0, 0))[1] for k in expect}
        record["collectives"] = {k: {"count": n, "bytes": b} for k, (n, b) in per_step.items()}
        record["megatron_bytes"] = expect
        record["megatron_counts"] = counts
        record["bytes_ratio"] = round(sum(got.values()) / max(1, sum(expect.values())), 4)
        record["bytes_ratio_by_kind"] = {k: round(got[k] / expect[k], 4) if expect[k] else
                                         (None if not got[k] else float("inf")) for k in expect}
    if rank == 0:
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
