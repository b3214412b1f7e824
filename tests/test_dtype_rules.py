"""PyTorch's dtype rules where numpy would silently promote: a GEMM (matmul, linear) refuses
operands of different dtypes, naming both and the cast that fixes it, in every interpretation
(eager, DTensor, compiled); and a gradient always has its input's dtype, whatever promotion the
forward did. Also: the documented subpackages are attributes of ``dtensor`` without MPI."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor.nn import Embedding, Linear

f32, f64 = np.float32, np.float64


def _mixed_gemms():
    """(label, call) for every public way to run a GEMM, each given a float64 input and float32
    weights (or the reverse)."""
    rng = np.random.default_rng(0)
    x64 = rng.standard_normal((3, 4))
    lin = Linear(4, 2)
    w32 = dtensor.randn(2, 4)
    return [
        ("Linear(numpy float64)", lambda: lin(x64)),
        ("Linear(tensor float64)", lambda: lin(dtensor.tensor(x64))),
        ("Linear(int64)", lambda: lin(np.ones((3, 4), np.int64))),
        ("F.linear", lambda: F.linear(dtensor.tensor(x64), w32)),
        ("F.linear float64 weight", lambda: F.linear(dtensor.randn(3, 4), w32.double())),
        ("F.linear bias", lambda: F.linear(dtensor.randn(3, 4), w32, dtensor.zeros(2).double())),
        ("@", lambda: dtensor.tensor(x64) @ w32.mT),
        ("matmul", lambda: dtensor.matmul(w32, dtensor.tensor(x64).mT)),
        ("compiled", lambda: dtensor.compile(lambda a, b: a @ b)(dtensor.tensor(x64), w32.mT)),
    ]


@pytest.mark.parametrize("label,call", _mixed_gemms(), ids=[c[0] for c in _mixed_gemms()])
def test_a_gemm_of_two_dtypes_is_refused_naming_both(label, call):
    with pytest.raises(TypeError) as e:
        call()
    msg = str(e.value)
    assert "float32" in msg and ("float64" in msg or "int64" in msg), msg
    assert "astype" in msg and "dtensor.tensor(x, dtype=" in msg, msg


@pytest.mark.ranks(2, timeout=120)
def test_a_dtensor_gemm_of_two_dtypes_is_refused_on_every_rank(rank):
    from dtensor import Replicate, Shard, distribute_tensor
    mesh = dtensor.init_device_mesh("cpu", (2,))
    x = distribute_tensor(dtensor.randn(4, 6).double(), mesh, [Shard(0)])
    w = distribute_tensor(dtensor.randn(6, 3), mesh, [Replicate()])
    with pytest.raises(TypeError, match=r"float64 \(4, 6\) @ float32 \(6, 3\)"):
        x @ w


# (label, forward of a float32 leaf w and a float64 tensor c): numpy promotes each to float64
PROMOTING = [
    ("mul", lambda w, c: w * c),
    ("add", lambda w, c: w + c),
    ("div", lambda w, c: c / w),
    ("where", lambda w, c: dtensor.where(c > 0, w, c)),
    ("broadcast mul", lambda w, c: w[None, :] * c),
]


@pytest.mark.parametrize("label,fn", PROMOTING, ids=[p[0] for p in PROMOTING])
def test_a_gradient_has_its_inputs_dtype(label, fn):
    rng = np.random.default_rng(1)
    w = dtensor.nn.Parameter(dtensor.tensor(rng.uniform(1, 2, 5).astype(f32)))
    c = dtensor.tensor(rng.standard_normal((3, 5)) if "broadcast" in label
                       else rng.standard_normal(5))
    out = fn(w, c)
    assert out.dtype == f64  # the forward promotes, as numpy and PyTorch do
    out.sum().backward()
    assert w.grad.dtype == f32
    # the values: finite differences of the float64 forward at w
    w64 = w.data.astype(f64)
    eps = 1e-6
    want = np.empty(5)
    for i in range(5):
        d = np.zeros(5)
        d[i] = eps
        hi = fn(dtensor.tensor(w64 + d), c).numpy().sum()
        lo = fn(dtensor.tensor(w64 - d), c).numpy().sum()
        want[i] = (hi - lo) / (2 * eps)
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-6)


def test_embedding_keeps_its_weights_dtype_and_refuses_float_ids():
    emb = Embedding(7, 3)
    assert emb(np.array([1, 2])).dtype == f32
    with pytest.raises(TypeError, match="indices must be integers, got dtype float64"):
        emb(np.array([1.0, 2.0]))


def test_subpackages_are_attributes_and_start_no_mpi():
    code = ("import sys, dtensor\n"
            "for name in ('parallel', 'comm', 'launcher', 'checkpoint', 'distributed', "
            "'compile'):\n"
            "    assert getattr(dtensor, name).__name__ == 'dtensor.' + name, name\n"
            "assert dtensor.distributed.get_world_size() == 1\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI started'\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "RANK")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("given", [[[1.0, 2.0]], ((1.0, 2.0),), [[1.0, 2]]],
                         ids=["nested list", "nested tuple", "mixed list"])
def test_a_layer_takes_python_lists_of_floats_in_its_own_dtype(given):
    # a list of floats becomes float32 (dtensor's default float, as torch.tensor's), the layer's
    lin = Linear(2, 3)
    y = lin(given)
    assert y.dtype == f32
    want = np.asarray(given, f32) @ lin.weight.numpy().T + lin.bias.numpy()
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)


def test_a_list_of_ints_is_an_int_tensor_and_refused_like_pytorch():
    with pytest.raises(TypeError, match="input is int64 but weight is float32"):
        Linear(2, 3)([[1, 2]])
