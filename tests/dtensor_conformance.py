"""Brute-force DTensor conformance over the whole op registry (imported by test_dtensor_ops.py).

For an op and a mesh, every combination of input placements (per mesh dim: Replicate, Shard of
each dim, and, for float inputs, Partial built from asymmetric splits plus noise that cancels
across ranks) is run on DTensors and compared with the same op on full tensors in one process:
values, and gradients of every float input. Samples are the registry tests' own (test_ops.py),
so their uneven sizes (dims of 1, 2, 3, 5 over meshes of 2, 3, 4) carry over.
"""
from __future__ import annotations

import itertools

import numpy as np

import dtensor
from dtensor import Partial, Replicate, Shard
from dtensor.dtensor import DTensor, DTensorSpec, distribute_tensor
from dtensor.ops import OPS, apply
from dtensor.redistribute import local_shape_and_offset
from test_ops import SAMPLES

# Ops whose result is meant to differ from the one-process run, with the reason.
NOT_COMPARED = {}

# Per sample on a 2-d mesh; beyond it a deterministic subset (a 4-input op has 16^4 combinations).
MAX_COMBOS_2D = 256


def _options(a, op, k):
    """Placements an input may take on one mesh dim."""
    opts = [Replicate()] + [Shard(d) for d in range(a.ndim)]
    if a.dtype.kind == "f":
        opts.append(Partial("sum"))
    return opts


def _partial_local(full_local: np.ndarray, mesh, placements, salt: int) -> np.ndarray:
    """This rank's share of a Partial(sum) value: uneven weights plus noise that cancels."""
    coord = mesh.get_coordinate()
    local = full_local.copy()
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            n, c = mesh.shape[m], coord[m]
            local *= (c + 1) / (n * (n + 1) / 2)
            noise = np.random.default_rng(salt + m).standard_normal(local.shape)
            local += noise * (-(n - 1) if c == 0 else 1)
    return local


def make_input(a: np.ndarray, mesh, placements, salt: int, requires_grad: bool):
    if not any(isinstance(p, Partial) for p in placements):
        out = distribute_tensor(dtensor.Tensor(a), mesh, placements, src_data_rank=None)
    else:
        # The block under the shard placements, then split into partial shares.
        shard_only = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        shape, off = local_shape_and_offset(a.shape, shard_only, mesh.shape,
                                            mesh.get_coordinate())
        block = a[tuple(slice(o, o + n) for o, n in zip(off, shape))]
        spec = DTensorSpec(mesh, tuple(placements), a.shape, a.dtype)
        out = DTensor._make(_partial_local(block, mesh, placements, salt), spec)
    out.requires_grad = requires_grad
    return out


def _close(got, want, what):
    if got.shape != want.shape:
        return f"{what}: shape {got.shape} != {want.shape}"
    if want.dtype.kind in "biu":
        ok = np.array_equal(got, want)
    else:  # float32 results (cast) sum their partials after rounding
        tol = 1e-9 if want.dtype == np.float64 else 1e-5
        ok = np.allclose(got, want, rtol=tol, atol=tol, equal_nan=True)
    if not ok:
        return f"{what}: max diff {np.nanmax(np.abs(got.astype(float) - want.astype(float)))}"
    return None


def run_op(name: str, mesh, max_combos: int | None = None):
    """Returns (cases run, failures) for every sample of op ``name`` on ``mesh``."""
    op = OPS[name]
    cases, failures = 0, []
    for si, (args, params) in enumerate(SAMPLES[name]):
        tensor_pos = [k for k, a in enumerate(args) if isinstance(a, np.ndarray)]
        per_input = [list(itertools.product(*[_options(args[k], op, k)] * mesh.ndim))
                     for k in tensor_pos]
        combos = list(itertools.product(*per_input))
        if max_combos and len(combos) > max_combos:
            pick = np.random.default_rng(si).choice(len(combos), max_combos, replace=False)
            combos = [combos[i] for i in sorted(pick)]
        diff = [k for k in tensor_pos if args[k].dtype == np.float64 and k not in op.nondiff
                and op.vjp is not None]
        # The one-process reference: values and input gradients for a fixed upstream gradient.
        ref_in = [dtensor.Tensor(a, requires_grad=k in diff) if isinstance(a, np.ndarray) else a
                  for k, a in enumerate(args)]
        ref_out = apply(op, *ref_in, **params)
        g = np.random.default_rng(99).standard_normal(ref_out.shape)
        if diff:
            ref_out.backward(dtensor.Tensor(g.astype(ref_out.dtype)))
        for combo in combos:
            cases += 1
            label = f"{name}[{si}] {[list(c) for c in combo]}"
            dargs = list(args)
            for k, pl in zip(tensor_pos, combo):
                dargs[k] = make_input(args[k], mesh, pl, salt=31 * k + si, requires_grad=k in diff)
            try:
                out = apply(op, *dargs, **params)
                err = _close(out.full_tensor().numpy(), ref_out.numpy(), label + " value")
                if err is None and diff:
                    out.backward(distribute_tensor(dtensor.Tensor(g.astype(out.dtype)), mesh,
                                                   [Replicate()] * mesh.ndim, src_data_rank=None))
                    for k in diff:
                        err = err or _close(dargs[k].grad.full_tensor().numpy(),
                                            ref_in[k].grad.numpy(), f"{label} grad {k}")
            except ValueError as e:
                # Only reshape may refuse (a shard it cannot keep without moving data), and it
                # must say so; anything else is a failure. A mesh dim of size 1 never refuses:
                # a dim "sharded" over one rank is whole.
                refusal = "cannot keep tensor dim" in str(e) and "mesh dim of size 1 " not in str(e)
                err = None if name == "reshape" and refusal else \
                    f"{label}: {type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - report every failure, keep going
                err = f"{label}: {type(e).__name__}: {e}"
            if err:
                failures.append(err)
    return cases, failures
