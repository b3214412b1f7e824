"""Bad input across the public API: each call raises the documented exception type with a
message holding the offending values, within 1 s, on every rank, and no rank hangs.

The cases come in tables by class. Each validation helper (dtensor/validate.py: as_int, as_dim,
as_shape, as_real; placements; meshes) has a table of wrong values crossed with the public entry
points that must call it, so an entry point that skips its check fails here. Then the API table:
one case per documented error. Every case runs on 2 MPI ranks, and the ranks compare their
failures at the end, so a case that raised on one rank only fails the test naming the rank.
Launcher flags run as dtlaunch commands.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest


def _api_cases(tmp: str):
    """[(name, call, exception type, regex the message must match)], built on this rank."""
    import dtensor
    import dtensor.nn.functional as F
    from dtensor import Partial, Replicate, Shard
    from dtensor.checkpoint import CheckpointError
    from dtensor.compile import TracingError
    from dtensor.dtensor import DTensor, distribute_tensor
    from dtensor.mesh import DeviceMesh, init_device_mesh
    from dtensor.nn import GPT, GPTConfig, Linear
    from dtensor.parallel import (ColwiseParallel, PrepareModuleInput, parallelize,
                                  parallelize_module)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    x = dtensor.randn(4, 6)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    small = dict(vocab_size=50, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8)

    def gpt(**kw):
        return GPT(GPTConfig(**{**small, **kw}))

    class _Counted(dtensor.nn.Module):
        """A forward no guessed batch runs: its second argument is a Python int."""

        def __init__(self):
            super().__init__()
            self.emb = dtensor.nn.Embedding(10, 4)

        def forward(self, ids, steps):
            return self.emb(ids) * steps.bit_length()

    def compiled(fn, *args):
        return lambda: dtensor.compile(fn)(*args)

    def branchy(t):
        if t.sum() > 0:
            return t
        return -t

    import shutil
    shared = Path(tmp) / "ck"
    dtensor.checkpoint.save({"model": Linear(3, 2).state_dict()}, shared)  # collective
    ck = Path(tmp) / f"ck_rank{mesh.get_rank()}"  # each rank damages its own copy
    shutil.copytree(shared, ck)
    meta_path = ck / "v1" / "metadata.json"

    def corrupt_then_load(kind):
        def run():
            shard = ck / "v1" / "rank0.npz"
            good, meta = shard.read_bytes(), meta_path.read_text()
            try:
                if kind == "byte":  # flip one byte of the first array's data
                    with np.load(shard) as z:
                        at = good.find(z["a0"].tobytes())
                    data = bytearray(good)
                    data[at] ^= 0xFF
                    shard.write_bytes(bytes(data))
                elif kind == "truncate":
                    shard.write_bytes(good[: len(good) // 3])
                elif kind == "version":
                    m = json.loads(meta)
                    m["version"] = 7
                    meta_path.write_text(json.dumps(m))
                dtensor.checkpoint.load({"model": Linear(3, 2).state_dict()}, ck)
            finally:
                shard.write_bytes(good)
                meta_path.write_text(meta)
        return run

    return [
        # -- meshes
        ("mesh device", lambda: init_device_mesh("cuda", (2,)), ValueError, r"'cuda'"),
        ("mesh size", lambda: init_device_mesh("cpu", (3,)), ValueError,
         r"\(3,\) holds 3 ranks but this job has 2"),
        ("mesh zero dim", lambda: init_device_mesh("cpu", (0, 2)), ValueError, r"\(0, 2\)"),
        ("mesh names count", lambda: init_device_mesh("cpu", (2,), mesh_dim_names=("a", "b")),
         ValueError, r"\('a', 'b'\) has 2 names for a 1-d mesh"),
        ("mesh names repeat", lambda: init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "a")),
         ValueError, r"repeats \['a'\]"),
        ("mesh bad name", lambda: mesh2["pp"], KeyError, r"no dim named 'pp'.*dp=1, tp=2"),
        ("mesh dim range", lambda: mesh2.size(5), IndexError, r"mesh dim 5 is out of range"),
        ("mesh ranks twice", lambda: DeviceMesh("cpu", [0, 0]), ValueError,
         r"\[0, 0\] must hold each of the 2 ranks"),
        # -- placements and construction
        ("partial op", lambda: Partial("prod"), ValueError, r"'prod'"),
        ("placements count", lambda: distribute_tensor(x, mesh, [Shard(0), Shard(1)]),
         ValueError, r"got 2 placements \[S\(0\), S\(1\)\] for a 1-d mesh"),
        ("shard dim range", lambda: distribute_tensor(x, mesh, [Shard(3)]), ValueError,
         r"S\(3\) is out of range for a tensor of shape \(4, 6\)"),
        ("placement type", lambda: distribute_tensor(x, mesh, ["S0"]), TypeError, r"'S0'"),
        ("redistribute partial to partial", lambda: dx.redistribute(placements=[Partial()])
         .redistribute(placements=[Partial("max")]), ValueError,
         r"from P\(sum\) to P\(max\) \(mesh dim 0\) is not allowed: reduce first"),
        ("single placement", lambda: distribute_tensor(x, mesh, Shard(0)), TypeError,
         r"single placement S\(0\) for the 1-d mesh .* Pass \[Shard\(0\)\]"),
        ("redistribute other mesh", lambda: dx.redistribute(mesh2, [Replicate(), Replicate()]),
         NotImplementedError, r"another mesh"),
        ("from_local shape", lambda: DTensor.from_local(np.ones((3, 2)), mesh, [Shard(0)],
                                                         shape=(9, 2)),
         ValueError, r"block has shape \(3, 2\) but \[S\(0\)\] of global shape \(9, 2\)"),
        ("from_local run_check", lambda: DTensor.from_local(
            np.ones((2 + mesh.get_rank(), 2)), mesh, [Shard(0)], run_check=True),
         ValueError, r"block: \(2, 2\) on ranks \[0\], \(3, 2\) on ranks \[1\].*shape="),
        ("dtensor numpy", lambda: dx.numpy(), TypeError, r"\.full_tensor\(\)\.numpy\(\)"),
        ("mixed meshes", lambda: dx + distribute_tensor(x, mesh2, [Shard(0), Replicate()]),
         ValueError, r"different meshes"),
        ("plain with dtensor", lambda: dx + x, TypeError,
         r"plain Tensor \(shape \(4, 6\)\).*implicit_replication"),
        ("dtensor matmul shapes", lambda: dx @ dx, ValueError, r"\(4, 6\) @ \(4, 6\)"),
        ("sharded reshape", lambda: distribute_tensor(dtensor.randn(3, 4), mesh,
                                                      [Shard(0)]).reshape(12),
         ValueError, r"reshape \(3, 4\) -> \(12,\) cannot keep tensor dim 0 sharded"),
        # -- core
        ("tensor dtype", lambda: dtensor.Tensor(np.array(["a"])), TypeError, r"<U1"),
        ("backward non-scalar", lambda: dtensor.ones(2, requires_grad=True).exp().backward(),
         RuntimeError, r"got shape \(2,\)"),
        ("load_state_dict keys", lambda: Linear(2, 2).load_state_dict({"w": np.ones(2)}),
         KeyError, r"unexpected keys \['w'\]"),
        ("optimizer lr", lambda: dtensor.optim.AdamW(Linear(2, 2).parameters(), lr=-1.0),
         ValueError, r"invalid lr: -1\.0"),
        ("cross_entropy targets", lambda: F.cross_entropy(dtensor.randn(3, 4),
                                                          np.ones(3, np.float32)),
         TypeError, r"got dtype float32"),
        ("all_reduce op", lambda: dtensor.comm.get_world().all_reduce(np.ones(2), op="prod"),
         ValueError, r"unknown reduce op 'prod'"),
        # -- parallel plans
        ("plan key", lambda: parallelize_module(gpt(), mesh, {"blocks.*.mlp.fc3":
                                                              ColwiseParallel()}),
         ValueError, r"plan key 'blocks\.\*\.mlp\.fc3' matches no submodule"),
        ("plan style type", lambda: parallelize_module(gpt(), mesh, {"lm_head": "colwise"}),
         TypeError, r"'colwise' is not a ParallelStyle"),
        ("style on norm", lambda: parallelize_module(gpt(), mesh, {"ln_f": ColwiseParallel()}),
         TypeError, r"'ln_f', a LayerNorm"),
        ("prepare input lengths", lambda: PrepareModuleInput(
            input_layouts=(Shard(1), Replicate()), desired_input_layouts=(Replicate(),)),
         ValueError, r"\(S\(1\), R\).*\(R,\)"),
        ("parallelize guess", lambda: parallelize(_Counted(), mesh), TypeError,
         r"_Counted\.forward failed on a guessed batch \(2, 1\) \(and on shorter ones\): "
         r"AttributeError: .*bit_length.*\. Pass example_inputs="),
        ("plan budget", lambda: parallelize(gpt(), mesh, max_bytes_per_rank=10,
                                            example_inputs=np.zeros((2, 4), np.int64)),
         ValueError, r"need [\d,]+ B per rank with this layout, over max_bytes_per_rank=10\."),
        ("parallelize 3-D", lambda: parallelize(gpt(), init_device_mesh(
            "cpu", (1, 1, 2), mesh_dim_names=("dp", "tp", "pp"))), ValueError,
         r"got a 3-D mesh \(dp=1, tp=1, pp=2\)"),
        ("parallelize names", lambda: parallelize(gpt(), init_device_mesh("cpu", (1, 2))),
         ValueError, r"needs dims named 'dp' and 'tp', got \(0=1, 1=2\)"),
        ("parallelize fsdp", lambda: parallelize(gpt(), mesh, fsdp=True), ValueError,
         r"mesh \(tp=2\) has none"),
        ("parallelize no layers", lambda: parallelize(dtensor.nn.LayerNorm(4), mesh), TypeError,
         r"LayerNorm has no Linear or Embedding layer to plan.*replicate\(\) or fully_shard"),
        # -- compile
        ("compile branch", compiled(branchy, dtensor.ones(2)), TracingError,
         r"bool\(tensor\).*test_bad_input\.py:\d+: if t\.sum\(\) > 0"),
        ("compile item", compiled(lambda t: t.sum().item(), dtensor.ones(2)), TracingError,
         r"\.item\(\)"),
        ("compile numpy", compiled(lambda t: np.asarray(t.numpy()) + 1, dtensor.ones(2)),
         TracingError, r"converting a tensor to numpy"),
        ("compile backend", lambda: dtensor.compile(branchy, backend="xla"), ValueError,
         r"unknown backend 'xla'"),
        ("compile non-callable", lambda: dtensor.compile(42), TypeError, r"got int"),
        # -- checkpoints
        ("checkpoint missing", lambda: dtensor.checkpoint.load({}, Path(tmp) / "none"),
         CheckpointError, r"no complete checkpoint at .*none"),
        ("checkpoint corrupt", corrupt_then_load("byte"), CheckpointError,
         r"rank0\.npz.*checksum mismatch"),
        ("checkpoint truncated", corrupt_then_load("truncate"), CheckpointError,
         r"rank0\.npz.*truncated or corrupt"),
        ("checkpoint version", corrupt_then_load("version"), CheckpointError,
         r"format version 7"),
        ("checkpoint shape", lambda: dtensor.checkpoint.load(
            {"model": Linear(4, 2).state_dict()}, ck), CheckpointError,
         r"'model\.weight': checkpoint has shape \(2, 3\) float32, the state \(2, 4\)"),
        ("checkpoint keys", lambda: dtensor.checkpoint.load({"net": Linear(3, 2).state_dict()},
                                                            ck),
         CheckpointError, r"missing keys \['net\.bias', 'net\.weight'\]"),
        ("checkpoint value", lambda: dtensor.checkpoint.save({"x": object()}, Path(tmp) / "o"),
         TypeError, r"'x' is a object"),
    ]


# ----------------------------------------------------------------------------- tables by class

# Not integers: as_int must refuse each (a whole float too: PyTorch does, and Shard(2.0) or a
# shape (2.0, 3) would otherwise get through half-checked).
NOT_INTS = [1.5, 2.0, "2", True, None, np.float32(1.0), [1]]
# Out of range for x of shape (2, 3, 4) (unsqueeze's range is one wider: -4..3).
BAD_DIMS = [5, -5]
# Not shapes: (value, exception, regex).
BAD_SHAPES = [
    ((2.5, 3), TypeError, r"entry 0 is 2\.5 \(a float\)"),
    ((2, -2), ValueError, r"\(2, -2\) has -2"),
    (("a",), TypeError, r"entry 0 is 'a'"),
    ((2, (3,)), TypeError, r"entry 1 is \(3,\)"),
    ((True, 2), TypeError, r"entry 0 is True"),
]
# Sizes that must be positive.
NOT_POSITIVE = [0, -3]
# Probabilities and other bounded reals: (value, exception, regex).
BAD_PROBS = [("0.5", TypeError, r"'0\.5' \(a str\)"), (1.5, ValueError, r"\[0, 1\], got 1\.5"),
             (-0.1, ValueError, r"got -0\.1"), (float("nan"), ValueError, r"got nan")]
# Not placements, where a style takes one.
NOT_LAYOUTS = ["R", [0], 5]


def _table_cases():
    """Each helper's table: wrong values x the entry points that must call the helper."""
    import dtensor
    import dtensor.nn as nn
    import dtensor.nn.functional as F
    from dtensor import Partial, Replicate, Shard
    from dtensor.mesh import DeviceMesh, init_device_mesh
    from dtensor.nn import GPT, GPTConfig, Embedding, LayerNorm, Linear
    from dtensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                  RowwiseParallel, SequenceParallel)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = dtensor.randn(2, 3, 4)
    mods = nn.ModuleList([Linear(2, 2)])
    small = dict(vocab_size=50, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8)
    g = GPT(GPTConfig(**small))
    ids = np.ones((1, 2), np.int64)
    cases = []

    # as_int: (entry point, call with the value, values it legitimately accepts)
    int_entries = [
        ("Shard", lambda v: Shard(v), ()),
        ("mesh.size", lambda v: mesh.size(v), (None, "2")),  # all ranks; a dim name
        ("Tensor.size", lambda v: x.size(v), (None,)),
        ("unsqueeze", lambda v: x.unsqueeze(v), ()),
        ("squeeze", lambda v: x.squeeze(v), (None,)),
        ("transpose", lambda v: x.transpose(0, v), ()),
        ("permute", lambda v: x.permute(0, 1, v), ()),
        ("flatten", lambda v: x.flatten(v), ()),
        ("split", lambda v: x.split(v), ([1],)),  # a list of sizes
        ("chunk", lambda v: x.chunk(v), ()),
        ("cat", lambda v: dtensor.cat([x, x], v), ()),
        ("sum", lambda v: x.sum(v), (None, [1])),  # all dims; a list of dims
        ("Linear", lambda v: Linear(v, 2), ()),
        ("Embedding", lambda v: Embedding(3, v), ()),
        ("GPTConfig", lambda v: GPTConfig(**{**small, "n_layer": v}), ()),
        ("ModuleList[]", lambda v: mods[v], ()),
        ("generate", lambda v: g.generate(ids, v), ()),
        ("manual_seed", lambda v: dtensor.manual_seed(v), ()),
        ("SequenceParallel", lambda v: SequenceParallel(sequence_dim=v), ()),
    ]
    for entry, call, accepted in int_entries:
        for v in NOT_INTS:
            if any(v is a or (type(v) is type(a) and v == a) for a in accepted):
                continue
            cases.append((f"int: {entry}({v!r})", lambda c=call, v=v: c(v), TypeError,
                          rf"must be an integer, got {_value_regex(v)}"))

    # as_dim: out-of-range dims name the dim and the shape
    dim_entries = [
        ("unsqueeze", lambda d: x.unsqueeze(d), "dim"),
        ("squeeze", lambda d: x.squeeze(d), "dim"),
        ("transpose", lambda d: x.transpose(0, d), "dim1"),
        ("permute", lambda d: x.permute(0, 1, d), "dim"),
        ("flatten", lambda d: x.flatten(d), "start_dim"),
        ("flatten end", lambda d: x.flatten(0, d), "end_dim"),
        ("size", lambda d: x.size(d), "dim"),
        ("split", lambda d: x.split(1, d), "dim"),
        ("chunk", lambda d: x.chunk(2, d), "dim"),
        ("cat", lambda d: dtensor.cat([x, x], d), "dim"),
        ("softmax", lambda d: F.softmax(x, d), "dim"),
        ("log_softmax", lambda d: F.log_softmax(x, d), "dim"),
    ]
    for entry, call, what in dim_entries:
        for d in BAD_DIMS:
            cases.append((f"dim: {entry}({d})", lambda c=call, d=d: c(d), IndexError,
                          rf"{what} {d} is out of range for a tensor of shape \(2, 3, 4\)"))
    cases += [(f"dim: sum({d})", lambda d=d: x.sum(d), IndexError,
               rf"axis {d} is out of range for a 3-d tensor") for d in BAD_DIMS]
    cases.append(("dim: mesh.size(3)", lambda: mesh.size(3), IndexError,
                  r"mesh dim 3 is out of range for a 1-d mesh"))

    # as_shape: factories, reshapes, DTensor factories, norms and meshes take checked shapes
    shape_entries = [
        ("zeros", lambda s: dtensor.zeros(*s)),
        ("ones", lambda s: dtensor.ones(s)),
        ("rand", lambda s: dtensor.rand(*s)),
        ("randn", lambda s: dtensor.randn(s)),
        ("full", lambda s: dtensor.full(s, 1.0)),
        ("reshape", lambda s: x.reshape(*s)),
        ("broadcast_to", lambda s: x.broadcast_to(s)),
        ("DTensor zeros", lambda s: dtensor.zeros(*s, device_mesh=mesh,
                                                   placements=[Replicate()])),
        ("LayerNorm", lambda s: LayerNorm(s)),
        ("layer_norm", lambda s: F.layer_norm(x, s)),
    ]
    for entry, call in shape_entries:
        for shape, exc, pattern in BAD_SHAPES:
            cases.append((f"shape: {entry}{shape!r}", lambda c=call, s=shape: c(s), exc, pattern))
    for shape, exc, pattern in BAD_SHAPES[:3]:
        cases.append((f"shape: init_device_mesh{shape!r}",
                      lambda s=shape: init_device_mesh("cpu", s), exc, pattern))
    cases += [
        ("shape: zeros(None)", lambda: dtensor.zeros(None), TypeError, r"entry 0 is None"),
        ("shape: init_device_mesh(2)", lambda: init_device_mesh("cpu", 2), TypeError,
         r"mesh_shape must be a sequence of integers such as \(2, 3\), got 2"),
        ("shape: init_device_mesh((2, 0))", lambda: init_device_mesh("cpu", (2, 0)),
         ValueError, r"\(2, 0\) has 0: it takes positive sizes"),
        ("shape: expand(-1 lead)", lambda: x.expand(-1, 2, 3, 4), ValueError,
         r"expand: sizes \(-1, 2, 3, 4\).*-1 \(keep the size\) only for dims it has"),
        ("shape: expand(short)", lambda: x.expand(4), ValueError, r"at least its 3 dims"),
    ]

    # positive sizes
    pos_entries = [
        *[(f"GPTConfig {k}", lambda v, k=k: GPTConfig(**{**small, k: v}), f"GPTConfig: {k}")
          for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "mlp_hidden")],
        ("split", lambda v: x.split(v), "split: split_size"),
        ("chunk", lambda v: x.chunk(v), "chunk: chunks"),
        ("generate top_k", lambda v: g.generate(ids, 1, top_k=v), "generate: top_k"),
    ]
    for entry, call, what in pos_entries:
        for v in NOT_POSITIVE:
            cases.append((f"positive: {entry}={v}", lambda c=call, v=v: c(v), ValueError,
                          rf"{what} must be positive, got {v}"))
    nonneg_entries = [
        ("Linear in", lambda v: Linear(v, 2), "Linear: in_features"),
        ("Linear out", lambda v: Linear(2, v), "Linear: out_features"),
        ("Embedding rows", lambda v: Embedding(v, 2), "Embedding: num_embeddings"),
        ("Embedding dim", lambda v: Embedding(2, v), "Embedding: embedding_dim"),
        ("LayerNorm", lambda v: LayerNorm(v), "LayerNorm: normalized_shape"),
        ("RMSNorm", lambda v: nn.RMSNorm(v), "RMSNorm: normalized_shape"),
        ("generate max_new_tokens", lambda v: g.generate(ids, v), "generate: max_new_tokens"),
        ("split sizes", lambda v: x.split([3, v]), "split: sizes"),
    ]
    for entry, call, what in nonneg_entries:
        cases.append((f"non-negative: {entry}=-3", lambda c=call: c(-3), ValueError,
                      rf"{what}.*-3"))

    # as_real: probabilities and epsilons
    real_entries = [
        ("Dropout", lambda v: nn.Dropout(v), "Dropout probability"),
        ("dropout", lambda v: F.dropout(x, v), "dropout probability"),
        ("GPTConfig dropout", lambda v: GPTConfig(**{**small, "dropout": v}),
         "GPTConfig: dropout"),
    ]
    for entry, call, what in real_entries:
        for v, exc, pattern in BAD_PROBS:
            cases.append((f"real: {entry}({v!r})", lambda c=call, v=v: c(v), exc,
                          rf"{what} must .*{pattern}"))
    for entry, call in [("LayerNorm eps", lambda v: LayerNorm(3, eps=v)),
                        ("GPTConfig ln_eps", lambda v: GPTConfig(**{**small, "ln_eps": v})),
                        ("generate temperature", lambda v: g.generate(ids, 1, temperature=v)),
                        ("arange step", lambda v: dtensor.arange(0, 3, v))]:
        cases.append((f"real: {entry}('1')", lambda c=call: c("1"), TypeError,
                      r"must be a real number, got '1'"))
        if entry != "arange step":
            cases.append((f"real: {entry}(-1)", lambda c=call: c(-1.0), ValueError,
                          r"must lie in \[0, inf\), got -1\.0"))

    # placements: a style's layouts, Partial's op, placement lists
    for style, call in [
        ("ColwiseParallel input", lambda p: ColwiseParallel(input_layouts=p)),
        ("ColwiseParallel output", lambda p: ColwiseParallel(output_layouts=p)),
        ("RowwiseParallel input", lambda p: RowwiseParallel(input_layouts=p)),
        ("RowwiseParallel output", lambda p: RowwiseParallel(output_layouts=p)),
        ("PrepareModuleInput", lambda p: PrepareModuleInput(input_layouts=(p,),
                                                            desired_input_layouts=(None,))),
        ("PrepareModuleInput kwargs", lambda p: PrepareModuleInput(
            input_kwarg_layouts={"x": p}, desired_input_kwarg_layouts={"x": Replicate()})),
        ("PrepareModuleOutput", lambda p: PrepareModuleOutput(output_layouts=Replicate(),
                                                              desired_output_layouts=(p,))),
    ]:
        for p in NOT_LAYOUTS:
            if style == "PrepareModuleOutput" and isinstance(p, list):
                continue  # a list is the per-output form: its entry 0 is checked
            cases.append((f"layout: {style}({p!r})", lambda c=call, p=p: c(p), TypeError,
                          rf"takes one placement .* got {re.escape(repr(p))}"))
    for op in ("prod", 1, None, "SUM"):
        cases.append((f"placement: Partial({op!r})", lambda op=op: Partial(op), ValueError,
                      rf"reduce_op must be one of .* got {re.escape(repr(op))}"))
    for flag in ("use_local_output",):
        for style in (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput):
            cases.append((f"flag: {style.__name__}({flag}=1)",
                          lambda s=style: s(**{flag: 1}), TypeError,
                          rf"{flag} must be True or False, got 1"))

    # meshes: ranks, names, shapes (every case is collective: agreed before the MPI Split)
    mesh_cases = [
        ("float ranks", lambda: DeviceMesh("cpu", [0.0, 1.0]), TypeError,
         r"integer ranks, got \[0\.0, 1\.0\] \(numpy dtype float64\)"),
        ("half ranks", lambda: DeviceMesh("cpu", [0.5, 1]), TypeError, r"\[0\.5, 1\]"),
        ("string ranks", lambda: DeviceMesh("cpu", ["a", "b"]), TypeError, r"\['a', 'b'\]"),
        ("ragged", lambda: DeviceMesh("cpu", [[0], [1, 2]]), ValueError,
         r"\[\[0\], \[1, 2\]\] is ragged"),
        ("no ranks", lambda: DeviceMesh("cpu", None), ValueError, r"got None"),
        ("names str 1-d", lambda: DeviceMesh("cpu", [0, 1], mesh_dim_names="tp"), TypeError,
         r"got the string 'tp'; write mesh_dim_names=\('tp',\)"),
        ("names str 2-d", lambda: init_device_mesh("cpu", (1, 2), mesh_dim_names="dp"),
         TypeError, r"got the string 'dp'"),
        ("names int", lambda: init_device_mesh("cpu", (2,), mesh_dim_names=(0,)), TypeError,
         r"must all be strings, got 0"),
        ("names none entry", lambda: DeviceMesh("cpu", [0, 1], mesh_dim_names=(None,)),
         TypeError, r"got None"),
        ("names not tuple", lambda: init_device_mesh("cpu", (2,), mesh_dim_names=5),
         TypeError, r"tuple of strings.*got 5"),
        ("device", lambda: DeviceMesh("gpu", [0, 1]), ValueError, r"'gpu'"),
        ("slice by int", lambda: mesh[0], TypeError, r"sliced by dim names.*got 0"),
        ("slice by float", lambda: mesh[(1.5,)], TypeError, r"got \(1\.5,\)"),
    ]
    cases += [(f"mesh: {n}", c, e, r) for n, c, e, r in mesh_cases]
    return cases


# Not flags: as_bool takes True/False (numpy bools too) only; "no" would switch a flag on.
NOT_BOOLS = ["yes", 1, None]


def _flag_cases():
    """as_bool: wrong values x the entry points that take a flag."""
    import dtensor
    import dtensor.nn as nn
    import dtensor.nn.functional as F
    from dtensor.nn import LayerNorm, Linear

    x = dtensor.randn(2, 3, 4)
    q = dtensor.randn(1, 2, 4, 8)
    lin = Linear(2, 2)
    entries = [
        ("tensor requires_grad", lambda v: dtensor.tensor([1.0], requires_grad=v), "requires_grad"),
        ("zeros requires_grad", lambda v: dtensor.zeros(2, requires_grad=v), "requires_grad"),
        ("randn requires_grad", lambda v: dtensor.randn(2, requires_grad=v), "requires_grad"),
        ("requires_grad_", lambda v: dtensor.ones(2).requires_grad_(v), "requires_grad"),
        ("sum keepdim", lambda v: x.sum(0, keepdim=v), "keepdim"),
        ("mean keepdim", lambda v: x.mean(0, keepdim=v), "keepdim"),
        ("max keepdims", lambda v: x.max(0, v), "keepdims"),
        ("Linear bias", lambda v: Linear(2, 2, bias=v), "Linear: bias"),
        ("LayerNorm affine", lambda v: LayerNorm(3, elementwise_affine=v),
         "LayerNorm: elementwise_affine"),
        ("RMSNorm affine", lambda v: nn.RMSNorm(3, elementwise_affine=v),
         "RMSNorm: elementwise_affine"),
        ("dropout training", lambda v: F.dropout(x, 0.5, training=v), "dropout: training"),
        ("Module.train", lambda v: lin.train(v), "Linear.train: mode"),
        ("sdpa is_causal", lambda v: F.scaled_dot_product_attention(q, q, q, is_causal=v),
         "is_causal"),
        ("load_state_dict strict", lambda v: lin.load_state_dict(lin.state_dict(), strict=v),
         "strict"),
        ("Module.zero_grad", lambda v: lin.zero_grad(set_to_none=v), "set_to_none"),
    ]
    return [(f"flag: {entry}({v!r})", lambda c=call, v=v: c(v), TypeError,
             rf"{what} must be True or False, got {re.escape(repr(v))}")
            for entry, call, what in entries for v in NOT_BOOLS
            if not (v is None and what == "keepdim")]  # keepdim=None: not given


def _silent_cases():
    """Calls that used to return a wrong value silently."""
    import dtensor
    import dtensor.nn.functional as F
    from dtensor.nn import Embedding, LayerNorm, Linear

    m = dtensor.randn(3, 4)
    x = dtensor.randn(4, 6)
    ids = np.array([0, 1, 2, 3])
    cases = []
    for f in ("rand", "randn"):
        for dt in ("int64", "bool", "uint8"):
            cases.append((f"dtype: {f}({dt})", lambda f=f, dt=dt: getattr(dtensor, f)(2, dtype=dt),
                          TypeError, rf"dtensor\.{f}: dtype must be floating point.*got {dt}"))
    from dtensor import Replicate
    from dtensor.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    for f in ("rand", "randn"):
        cases.append((f"dtype: DTensor {f}(int64)", lambda f=f: getattr(dtensor, f)(
            4, dtype="int64", device_mesh=mesh, placements=[Replicate()]), TypeError,
            rf"dtensor\.{f}: dtype must be floating point.*got int64"))
    cases += [
        ("fill: DTensor full('a')", lambda: dtensor.full((2,), "a", device_mesh=mesh,
                                                         placements=[Replicate()]),
         TypeError, r"full: the fill value must be a number, got 'a'"),
        ("flag: DTensor zeros(requires_grad='yes')", lambda: dtensor.zeros(
            2, device_mesh=mesh, placements=[Replicate()], requires_grad="yes"),
         TypeError, r"requires_grad.*'yes'"),
        ("flag: zero_grad('x')", lambda: dtensor.optim.SGD(Linear(2, 2).parameters(), lr=0.1)
         .zero_grad("x"), TypeError, r"zero_grad: set_to_none.*'x'"),
        ("names: mesh_dim_names=('',)", lambda: init_device_mesh("cpu", (2,),
                                                               mesh_dim_names=("",)),
         ValueError, r"mesh_dim_names \(''\,\) holds an empty name"),
    ]
    for name, make in (("Linear", lambda: Linear(2, 2, dtype="int64")),
                       ("Embedding", lambda: Embedding(3, 2, dtype="int32")),
                       ("LayerNorm", lambda: LayerNorm(3, dtype="bool"))):
        cases.append((f"dtype: {name}", make, TypeError, rf"{name}: dtype must be floating"))
    for key in (slice(None, None, -1), slice(3, 0, -1), slice(None, None, -2)):
        cases.append((f"slice {key!r}", lambda k=key: m[k], ValueError,
                      r"step must be greater than zero"))
    cases += [
        ("var correction str", lambda: m.var(correction="a"), TypeError,
         r"var: correction must be a real number, got 'a'"),
        ("masked_fill float mask", lambda: m.masked_fill(dtensor.ones(3, 4), 0.0), TypeError,
         r"masked_fill: the mask must be a bool tensor, got dtype float32"),
        ("masked_fill int mask", lambda: m.masked_fill(np.ones((3, 4), np.int64), 0.0),
         TypeError, r"got dtype int64"),
        ("where float cond", lambda: dtensor.where(m, m, m), TypeError,
         r"where: the mask must be a bool tensor, got dtype float32"),
        ("where list cond", lambda: dtensor.where([True], m, m), TypeError,
         r"got \[True\] \(a list\)"),
        ("layer_norm eps -1", lambda: F.layer_norm(x, 6, eps=-1.0), ValueError,
         r"layer_norm: eps must lie in \[0, inf\), got -1\.0"),
        ("layer_norm eps str", lambda: F.layer_norm(x, 6, eps="a"), TypeError,
         r"layer_norm: eps must be a real number, got 'a'"),
        ("rms_norm eps str", lambda: F.rms_norm(x, 6, eps="a"), TypeError,
         r"rms_norm: eps must be a real number, got 'a'"),
        ("rms_norm eps nan", lambda: F.rms_norm(x, 6, eps=float("nan")), ValueError,
         r"rms_norm: eps must lie in .*got nan"),
        ("embedding 1-d weight", lambda: F.embedding(np.array([0]), dtensor.ones(5)),
         ValueError, r"weight must be 2-d .*got shape \(5,\)"),
        ("embedding 3-d weight", lambda: F.embedding(np.array([0]), dtensor.ones(5, 2, 2)),
         ValueError, r"got shape \(5, 2, 2\)"),
        ("cross_entropy reduction None", lambda: F.cross_entropy(x, ids, reduction=None),
         ValueError, r"reduction must be .*got None"),
        ("astype None", lambda: m.astype(None), TypeError, r"invalid dtype None"),
        ("manual_seed 2**70", lambda: dtensor.manual_seed(2**70), ValueError,
         r"seed must lie in \[-2\*\*63, 2\*\*64\), got 1180591620717411303424"),
        ("manual_seed -2**64", lambda: dtensor.manual_seed(-2**64), ValueError,
         r"seed must be >= -9223372036854775808, got -18446744073709551616"),
    ]
    for v in (1.5, "a", None):
        cases.append((f"cross_entropy ignore_index {v!r}",
                      lambda v=v: F.cross_entropy(x, ids, ignore_index=v), TypeError,
                      rf"ignore_index must be an integer, got {_value_regex(v)}"))
    lin = Linear(2, 2)
    for v in (5, np.ones((2, 2)), dtensor.ones(2, 2)):
        cases.append((f"setattr parameter {type(v).__name__}",
                      lambda v=v: setattr(lin, "weight", v), TypeError,
                      rf"cannot assign {type(v).__name__} as parameter 'weight' "
                      r"\(dtensor\.nn\.Parameter or None expected\)"))
    return cases


def _operand_cases():
    """Operands and inputs of the wrong type or dtype, which used to fail inside Python or
    numpy ('has no attribute', UFuncTypeError, 'could not convert'), and messages that named
    numpy's reshaped operands instead of the user's."""
    import dtensor
    import dtensor.nn.functional as F
    from dtensor.nn import GPT, GPTConfig, LayerNorm, Linear

    m = dtensor.randn(3, 4)
    x = dtensor.randn(4, 6)
    q = dtensor.randn(1, 2, 4, 8)
    ints = dtensor.ones(4, 6, dtype="int64")
    lin = Linear(6, 3)
    small = dict(vocab_size=50, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8)
    cases = []
    for sym, op, fn in (("+", "add", lambda v: m + v), ("*", "mul", lambda v: m * v),
                        ("**", "pow", lambda v: m ** v), ("r-", "sub", lambda v: v - m),
                        ("where", "where", lambda v: dtensor.where(m > 0, v, m)),
                        ("masked_fill", "where", lambda v: m.masked_fill(m > 0, v))):
        for v in ("a", None, [[1], [2, 3]]):
            cases.append((f"operand: {sym} {v!r}", lambda f=fn, v=v: f(v), TypeError,
                          rf"{op}: operand {re.escape(repr(v))} \(a {type(v).__name__}\) is "
                          r"not a tensor"))
    for v in ("a", None):
        cases.append((f"operand: @ {v!r}", lambda v=v: m @ v, TypeError,
                      rf"matmul: operand {re.escape(repr(v))} .* is not a tensor"))
    for name, fn in (("gelu", lambda: F.gelu(ints)), ("softmax", lambda: F.softmax(ints)),
                     ("log_softmax", lambda: F.log_softmax(ints)),
                     ("layer_norm", lambda: LayerNorm(6)(ints)),
                     ("rms_norm", lambda: F.rms_norm(ints, 6)),
                     ("cross_entropy", lambda: F.cross_entropy(ints, np.zeros(4, np.int64)))):
        cases.append((f"int input: {name}", fn, TypeError,
                      rf"{name}: input must be floating point, got dtype int64.*\.float\(\)"))
    cases += [
        ("zeros_like int", lambda: dtensor.zeros_like(5), TypeError, r"zeros_like .*got 5"),
        ("ones_like list", lambda: dtensor.ones_like([1]), TypeError, r"got \[1\] \(a list"),
        ("backward str", lambda: dtensor.ones(3, requires_grad=True).exp().backward("a"),
         TypeError, r"gradient must be a tensor of shape \(3,\).*got 'a'"),
        ("Linear str input", lambda: lin("abc"), TypeError, r"<U3|'abc'"),
        ("Linear None input", lambda: lin(None), TypeError, r"linear: input must be a tensor.*"
                                                            r"got None"),
        ("GPT dict", lambda: GPT(small), TypeError, r"GPT takes a GPTConfig, got dict"),
        ("full str", lambda: dtensor.full((2,), "a"), TypeError,
         r"full: the fill value must be a number, got 'a' \(a str\)"),
        ("full list", lambda: dtensor.full((2,), [1, 2, 3]), TypeError, r"got \[1, 2, 3\]"),
        ("fill_ str", lambda: dtensor.ones(2).fill_("x"), TypeError, r"fill_: .*got 'x'"),
        ("load_state_dict strings", lambda: lin.load_state_dict(
            {"weight": np.full((3, 6), "a"), "bias": np.ones(3)}), ValueError,
         r"weight: checkpoint dtype <U1 is not numeric"),
        ("arange inf", lambda: dtensor.arange(0, float("inf")), ValueError,
         r"end must be finite, got arange\(0, inf, 1\)"),
        ("arange nan", lambda: dtensor.arange(float("nan")), ValueError,
         r"arange: end must .*got nan"),
        ("tensor ragged", lambda: dtensor.tensor([[1, 2], [3]]), ValueError,
         r"\[\[1, 2\], \[3\]\]: the nested lists are ragged"),
        ("zeros huge", lambda: dtensor.zeros(10**6, 10**6), MemoryError,
         r"zeros: a tensor of shape \(1000000, 1000000\) and dtype float32 needs "
         r"4,000,000,000,000 bytes"),
        ("arange huge", lambda: dtensor.arange(0, 1e18), MemoryError,
         r"shape \(1000000000000000000,\).*bytes"),
        ("matmul 1-d", lambda: dtensor.ones(3) @ dtensor.ones(4), ValueError,
         r"\(3,\) @ \(4,\) do not fit \(3 != 4\)"),
        ("matmul batch", lambda: dtensor.ones(2, 3, 4) @ dtensor.ones(5, 4, 2), ValueError,
         r"\(2, 3, 4\) @ \(5, 4, 2\): the batch dims \(2,\) and \(5,\) do not broadcast"),
        ("linear 3-d weight", lambda: F.linear(x, dtensor.ones(2, 3, 6)), ValueError,
         r"weight must be 2-d .*got shape \(2, 3, 6\)"),
        ("linear bias shape", lambda: F.linear(x, dtensor.ones(3, 6), dtensor.ones(4, 3)),
         ValueError, r"linear: bias has shape \(4, 3\), expected \(3,\)"),
        ("layer_norm weight", lambda: F.layer_norm(x, 6, weight=dtensor.ones(5)), ValueError,
         r"layer_norm: weight has shape \(5,\), expected \(6,\)"),
        ("layer_norm bias", lambda: F.layer_norm(x, 6, bias=dtensor.ones(5)), ValueError,
         r"layer_norm: bias has shape \(5,\), expected \(6,\)"),
        ("rms_norm weight", lambda: F.rms_norm(x, 6, weight=dtensor.ones(5)), ValueError,
         r"rms_norm: weight has shape \(5,\), expected \(6,\)"),
        ("sdpa mask", lambda: F.scaled_dot_product_attention(
            q, q, q, attn_mask=dtensor.ones(3, 3, dtype="bool")), ValueError,
         r"attn_mask of shape \(3, 3\) does not broadcast to the scores' shape \(1, 2, 4, 4\)"),
        ("GPT targets", lambda: GPT(GPTConfig(**small))(np.ones((1, 4), np.int64),
                                                        np.ones((1, 3), np.int64)),
         ValueError, r"targets of shape \(1, 3\) must match idx of shape \(1, 4\)"),
        ("item (3, 4)", lambda: m.item(), RuntimeError, r"item\(\): a tensor of shape \(3, 4\)"),
        ("float (3, 4)", lambda: float(m), RuntimeError, r"float\(\): a tensor of shape "
                                                         r"\(3, 4\)"),
    ]
    return cases


def _plan_cases():
    """Plans whose keys overlap, or whose layouts do not fit the forward they wrap."""
    import dtensor
    import dtensor.nn as nn
    from dtensor.mesh import init_device_mesh
    from dtensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                  SequenceParallel, parallelize_module)
    from dtensor.placements import Replicate, Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_q, self.w_o = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, h):
            return self.w_o(self.w_q(h))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.attn, self.norm = nn.Embedding(16, 8), Attn(), nn.RMSNorm(8)

        def forward(self, ids):
            return self.norm(self.attn(self.tok(ids)))

    ids = np.ones((2, 4), np.int64)
    return [
        ("plan keys overlap", lambda: parallelize_module(Net(), mesh, {
            "attn.w_q": ColwiseParallel(), "attn.w_*": ColwiseParallel(),
            "attn.w_o": RowwiseParallel()}), ValueError,
         r"plan keys 'attn\.w_q' and 'attn\.w_\*' both match module 'attn\.w_q' \(Linear\)"),
        ("SequenceParallel dim", lambda: parallelize_module(Net(), mesh, {
            "norm": SequenceParallel(sequence_dim=5)})(ids), IndexError,
         r"SequenceParallel on 'norm': sequence_dim 5 is out of range for a tensor of shape "
         r"\(2, 4, 8\)"),
        ("PrepareModuleInput count", lambda: parallelize_module(Net(), mesh, {
            "attn": PrepareModuleInput(input_layouts=(Replicate(), Replicate()),
                                       desired_input_layouts=(Shard(0), Shard(0)))})(ids),
         ValueError, r"PrepareModuleInput on 'attn' \(Attn\): 2 input layouts .* 1 positional"),
        ("dtensor randn ok", lambda: dtensor.randn(2, dtype="float16").sum() + None, TypeError,
         r"add: operand None"),
    ]


def _value_regex(v) -> str:
    return "the bool True" if v is True else re.escape(repr(v))


def _unclear_cases():
    """Calls that used to fail inside Python or numpy (ZeroDivisionError, 'object is not
    iterable', 'tuple index out of range', KeyError) and now name the value and the fix."""
    import dtensor
    import dtensor.nn as nn
    import dtensor.nn.functional as F
    from dtensor.nn import GPT, GPTConfig, Linear
    from dtensor.mesh import init_device_mesh
    from dtensor.parallel import ColwiseParallel, parallelize, parallelize_module

    x = dtensor.randn(2, 3, 4)
    s = dtensor.tensor(3.0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    small = dict(vocab_size=50, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8)
    return [
        ("matmul 0-d left", lambda: s @ x, ValueError, r"\(\) @ \(2, 3, 4\).*`\*`"),
        ("matmul 0-d right", lambda: x @ s, ValueError, r"\(2, 3, 4\) @ \(\)"),
        ("cat 0-d", lambda: dtensor.cat([s, s]), ValueError, r"0-d tensors.*\[\(\), \(\)\]"),
        ("linear 0-d", lambda: F.linear(s, dtensor.randn(2, 1)), ValueError,
         r"linear: the input needs a features dim, got a 0-d tensor"),
        ("cat a tensor", lambda: dtensor.cat(x), TypeError, r"list or tuple of tensors, got a "
                                                             r"Tensor"),
        ("arange step 0", lambda: dtensor.arange(0, 5, 0), ValueError,
         r"step must not be 0, got arange\(0, 5, 0\)"),
        ("flatten order", lambda: x.flatten(2, 0), ValueError,
         r"start_dim 2 comes after end_dim 0"),
        ("permute repeat", lambda: x.permute(0, 1, 1), ValueError,
         r"\(0, 1, 1\) is not a permutation"),
        ("reshape two -1", lambda: x.reshape(-1, -1), ValueError, r"only one dim may be -1"),
        ("split sum", lambda: x.split([1, 2]), ValueError, r"sizes \[1, 2\] add up to 3, not "
                                                            r"to dim 0 of size 2"),
        ("slice float", lambda: x[0:1.5], TypeError, r"slice\(0, 1\.5, None\)"),
        ("n_head 0 (was ZeroDivisionError)", lambda: GPTConfig(n_head=0), ValueError,
         r"n_head must be positive, got 0"),
        ("Linear(-1) (was math domain error)", lambda: Linear(-1, 2), ValueError,
         r"in_features must be non-negative, got -1"),
        ("GPT 1-d ids (was not enough values to unpack)",
         lambda: GPT(GPTConfig(**small))(np.ones(4, np.int64)), ValueError,
         r"shape \(batch, sequence\), got shape \(4,\); a single sequence is idx\[None\]"),
        ("GPTConfig gelu", lambda: GPTConfig(gelu="relu"), ValueError, r"'relu'"),
        ("GPTConfig bias", lambda: GPTConfig(bias=1), TypeError, r"bias must be True or False"),
        ("load_state_dict not a mapping", lambda: Linear(2, 2).load_state_dict(5), TypeError,
         r"mapping of names to arrays.*got int"),
        ("ModuleList index", lambda: nn.ModuleList([Linear(2, 2)])[3], IndexError,
         r"index 3 is out of range for 1 modules"),
        ("Sequential entry", lambda: nn.Sequential(Linear(2, 2), 3), TypeError,
         r"entry 1 is 3"),
        ("register_parameter", lambda: nn.Module().register_parameter("w", 5), TypeError,
         r"register_parameter\('w', \.\.\.\) takes a Parameter"),
        ("add_module name", lambda: nn.Module().add_module(5, Linear(2, 2)), TypeError,
         r"non-empty string without dots, got 5"),
        ("register_buffer", lambda: nn.Module().register_buffer("b", [1]), TypeError,
         r"takes a tensor or None, got \[1\]"),
        ("set_rng_state {} (was KeyError)", lambda: dtensor.random.set_rng_state({}),
         TypeError, r"keys 'seed' and 'stream', got \{\}"),
        ("parallelize_module model", lambda: parallelize_module(5, mesh, {}), TypeError,
         r"model must be a dtensor.nn.Module, got 5"),
        ("parallelize mesh", lambda: parallelize(GPT(GPTConfig(**small)), (2,)), TypeError,
         r"mesh must be a DeviceMesh.*got \(2,\)"),
        ("parallelize flag", lambda: parallelize(GPT(GPTConfig(**small)), mesh,
                                                 sequence_parallel="yes"),
         TypeError, r"sequence_parallel must be True or False, got 'yes'"),
        ("plan key type", lambda: parallelize_module(GPT(GPTConfig(**small)), mesh,
                                                     {1: ColwiseParallel()}),
         TypeError, r"plan key 1 must be a dotted module path"),
        ("plan list", lambda: parallelize_module(Linear(2, 2), mesh, [ColwiseParallel()]),
         TypeError, r"ParallelStyle or a dict.*got list"),
    ]


def _agreement_cases():
    """parallelize checks the user's batch before its plan reshapes it; meshes and plans that
    differ across ranks, or fail on one rank only, raise on every rank."""
    import dtensor
    from dtensor.mesh import DeviceMesh, init_device_mesh
    from dtensor.nn import GPT, GPTConfig, Linear
    from dtensor.parallel import ColwiseParallel, parallelize, parallelize_module

    small = dict(vocab_size=50, n_layer=1, n_embd=16, n_head=2, mlp_hidden=32, block_size=8)
    dp = parallelize(GPT(GPTConfig(**small)), init_device_mesh("cpu", (2,),
                                                               mesh_dim_names=("dp",)))
    sp = parallelize(GPT(GPTConfig(**small)), init_device_mesh("cpu", (2,),
                                                               mesh_dim_names=("tp",)),
                     sequence_parallel=True)
    rank = dtensor.comm.get_world().rank

    def ids(*shape):
        return np.ones(shape, np.int64)

    return [
        ("batch not divisible by dp", lambda: dp(ids(3, 4), ids(3, 4)), ValueError,
         r"argument 0 of shape \(3, 4\) has batch size 3, which mesh dim 'dp' of size 2 "
         r"cannot split evenly.*multiple of 2"),
        ("more dp ranks than rows", lambda: dp(ids(1, 4)), ValueError,
         r"shape \(1, 4\) has batch size 1.*'dp' of size 2"),
        ("targets not divisible by dp", lambda: dp(ids(2, 4), targets=ids(3, 4)), ValueError,
         r"argument 'targets' of shape \(3, 4\) has batch size 3"),
        ("sequence of 1 under SP", lambda: sp(ids(2, 1)), ValueError,
         r"sequence_parallel=True\): argument 0 has shape \(2, 1\): its sequence length 1 "
         r"leaves some of the 2 ranks of mesh dim 'tp' without positions"),
        ("batch differs across ranks", lambda: dp(ids(2 + 2 * rank, 4)), ValueError,
         r"ranks passed different arguments \(batch: .*\(2, 4\).* on ranks \[0\].*\(4, 4\).* "
         r"on ranks \[1\]"),
        ("mesh names differ across ranks", lambda: init_device_mesh(
            "cpu", (2,), mesh_dim_names=("tp",) if rank == 0 else ("dp",)), ValueError,
         r"init_device_mesh: ranks passed different arguments \(mesh_dim_names: "
         r"\('tp',\) on ranks \[0\], \('dp',\) on ranks \[1\]\)"),
        ("mesh bad on one rank", lambda: DeviceMesh("cpu", [0, 1] if rank == 0 else [0.5, 1]),
         TypeError, r"DeviceMesh failed on rank 1: DeviceMesh: the mesh must hold integer "
                    r"ranks, got \[0\.5, 1\]"),
        ("model differs across ranks", lambda: parallelize_module(
            Linear(2, 2 + rank), init_device_mesh("cpu", (2,)), ColwiseParallel()), ValueError,
         r"parallelize_module: ranks passed different arguments \(params: .*\(2, 2\).* on "
         r"ranks \[0\].*\(3, 2\).* on ranks \[1\]"),
        ("plan differs across ranks", lambda: parallelize(
            GPT(GPTConfig(**small)), init_device_mesh("cpu", (2,)),
            sequence_parallel=rank == 1), ValueError,
         r"parallelize: ranks passed different arguments \(sequence_parallel: False on ranks "
         r"\[0\], True on ranks \[1\]\)"),
    ]


def _run_cases(cases):
    """Run every case on this rank; then every rank learns every rank's failures, so a case
    that raised on some ranks only fails the test (naming the ranks) instead of hanging."""
    names = [name for name, *_ in cases]
    assert len(set(names)) == len(names), [n for n in names if names.count(n) > 1]
    failures, slow = [], []
    for name, call, exc, pattern in cases:
        t = time.perf_counter()
        try:
            with pytest.raises(exc, match=pattern):
                call()
        except BaseException as e:  # noqa: BLE001 - reported below, with the rank
            failures.append(f"case {name!r}: {type(e).__name__}: {e}"[:600])
        took = time.perf_counter() - t
        if took > 1.0:
            slow.append((name, round(took, 3)))
    from mpi4py import MPI
    every = MPI.COMM_WORLD.allgather((failures, slow))
    report = [f"rank {r}: {f}" for r, (fs, _) in enumerate(every) for f in fs]
    assert not report, "\n".join(report)
    assert not any(s for _, s in every), every


@pytest.mark.ranks(2, timeout=240)
def test_every_bad_call_raises_a_clear_error_quickly_on_every_rank(tmp_path, rank):
    cases = _api_cases(str(tmp_path))
    assert len(cases) >= 45
    _run_cases(cases)


@pytest.mark.ranks(2, timeout=240)
def test_validation_tables_on_every_rank(rank):
    """Each helper's wrong values x the entry points that call it, and the cases that used
    to fail inside Python."""
    cases = (_table_cases() + _unclear_cases() + _agreement_cases() + _flag_cases()
             + _silent_cases() + _operand_cases() + _plan_cases())
    assert len(cases) >= 400, len(cases)
    _run_cases(cases)


DTLAUNCH = [sys.executable, "-m", "dtensor.launcher"]


SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "tp_mlp.py")


@pytest.mark.parametrize("args,pattern", [
    (["--nproc", "0", SCRIPT], r"--nproc.*0"),
    (["--nproc", "2", "--timeout", "-3", SCRIPT], r"-3"),
    (["--nproc", "2", "does_not_exist.py"], r"does_not_exist\.py"),
    (["--nproc", "2", "--hostfile", "/no/such/hostfile", SCRIPT], r"/no/such/hostfile"),
])
def test_launcher_flags(args, pattern):
    """Usage errors exit 2 with the offending value, before any rank starts."""
    t = time.perf_counter()
    out = subprocess.run([*DTLAUNCH, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert re.search(pattern, out.stderr + out.stdout), out.stderr
    assert time.perf_counter() - t < 5  # a Python start-up, no MPI job
