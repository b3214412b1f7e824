"""Counter-based random numbers (Philox4x32-10) that are shard-invariant.

Why counter-based: a sharded tensor must hold the same values whatever the
mesh, so the value of global element ``i`` may depend only on (seed, stream,
i) and never on which rank computes it or in what order.  Philox is a pure
function ``(counter, key) -> 4 x uint32``; we use the element's global flat
(row-major) index as the counter and a per-call 64-bit ``key`` as the key, so
every shard computes exactly its own slice of one global draw.

The word-level functions (``randint``, ``randint4x``, ``rand``, ``randn``)
mirror ``triton.language.random`` bit for bit (``randn`` up to float32
transcendental rounding), so a Triton kernel calling ``tl.rand(key, i)``
produces the same numbers as the numpy fallback.

Everything is vectorised numpy; there are no Python loops over elements.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from dtensor.validate import as_int

__all__ = [
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_W0",
    "PHILOX_W1",
    "philox4x32",
    "randint",
    "randint4x",
    "rand",
    "randn",
    "uint_to_uniform_float",
    "pair_uniform_to_normal",
    "manual_seed",
    "initial_seed",
    "get_rng_state",
    "set_rng_state",
    "next_key",
    "uniform",
    "normal",
    "uniform_like_shape",
]

# Philox4x32 multipliers (round constants) and Weyl key increments.
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85

_MASK32 = np.uint64(0xFFFFFFFF)
_MASK64 = (1 << 64) - 1
N_ROUNDS_DEFAULT = 10


def _u32_as_u64(x: ArrayLike) -> np.ndarray:
    """Reduce ``x`` mod 2**32 and widen to uint64 so products cannot wrap."""
    return np.asarray(x).astype(np.uint32).astype(np.uint64)


def philox4x32(
    c0: ArrayLike,
    c1: ArrayLike,
    c2: ArrayLike,
    c3: ArrayLike,
    k0: ArrayLike,
    k1: ArrayLike,
    n_rounds: int = N_ROUNDS_DEFAULT,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-``n_rounds`` on broadcastable uint32 arrays.

    Same round structure as triton's ``philox_impl`` (and Random123): per round
    ``c0' = hi(M1*c2) ^ c1 ^ k0``, ``c1' = lo(M1*c2)``,
    ``c2' = hi(M0*c0) ^ c3 ^ k1``, ``c3' = lo(M0*c0)``, then the key is bumped
    by the Weyl constants.  The 32x32->64 products are done in uint64, which is
    exact because both factors are < 2**32.  Inputs are taken mod 2**32.
    """
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(
        *(_u32_as_u64(v) for v in (c0, c1, c2, c3, k0, k1))
    )
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    s32 = np.uint64(32)
    for _ in range(n_rounds):  # loop over rounds only, never over elements
        p0 = m0 * c0  # product for c0 (uses M0 = PHILOX_ROUND_A)
        p1 = m1 * c2  # product for c2 (uses M1 = PHILOX_ROUND_B)
        c0, c1, c2, c3 = (
            (p1 >> s32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> s32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
        k0 = (k0 + w0) & _MASK32
        k1 = (k1 + w1) & _MASK32
    return (
        c0.astype(np.uint32),
        c1.astype(np.uint32),
        c2.astype(np.uint32),
        c3.astype(np.uint32),
    )


def _seed_words(seed: int) -> tuple[np.uint32, np.uint32]:
    """Split a Python int seed into Philox key words like triton's ``philox``.

    Triton casts the seed to uint64 (sign-extending negative ints) and uses
    ``k0 = lo32``, ``k1 = hi32``; a Python int taken mod 2**64 is the same.
    """
    s = int(seed) & _MASK64
    return np.uint32(s & 0xFFFFFFFF), np.uint32(s >> 32)


def randint4x(
    seed: int, offset: ArrayLike, n_rounds: int = N_ROUNDS_DEFAULT
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Four uint32 words per offset, as ``tl.randint4x(seed, offset)``.

    The counter is ``(lo32(offset), hi32(offset), 0, 0)``.  As in triton, the
    high word is used only when the offset dtype is wider than 32 bits (it is
    the arithmetic ``offset >> 32``); 32-bit offsets get ``hi = 0`` even when
    negative.  Triton returns the words as int32-typed bits; we return uint32.
    """
    off = np.asarray(offset)
    if off.dtype.kind not in "iu":
        raise TypeError(f"offset must be an integer array, got dtype {off.dtype}")
    lo = off.astype(np.uint32)
    if off.dtype.itemsize > 4:
        hi = (off >> 32).astype(np.uint32)
    else:
        hi = np.zeros_like(lo)
    k0, k1 = _seed_words(seed)
    return philox4x32(lo, hi, 0, 0, k0, k1, n_rounds)


def randint(seed: int, offset: ArrayLike, n_rounds: int = N_ROUNDS_DEFAULT) -> np.ndarray:
    """First word of :func:`randint4x`, as ``tl.randint`` (uint32 bits)."""
    return randint4x(seed, offset, n_rounds)[0]


def uint_to_uniform_float(x: ArrayLike) -> np.ndarray:
    """uint32 bits -> float32 in [0, 1), exactly as triton's helper.

    Reinterpret as int32, fold negatives with ``~x`` (so 31 random bits in
    [0, 2**31-1]), convert to float32 (round to nearest even) and multiply by
    float32(4.6566127342e-10), the largest scale keeping ``(2**31-1)*scale``
    below 1.0 after float32 rounding.
    """
    xi = np.asarray(x).astype(np.uint32).view(np.int32)
    xi = np.where(xi < 0, ~xi, xi)
    return xi.astype(np.float32) * np.float32(4.6566127342e-10)


def pair_uniform_to_normal(u1: np.ndarray, u2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Box-Muller in float32 with triton's constants (``u1`` clamped to 1e-7).

    All intermediates are float32, as in the kernel, so log/sqrt/cos/sin round
    the same way up to the platform's float32 libm.
    """
    u1 = np.maximum(np.float32(1.0e-7), np.asarray(u1, dtype=np.float32))
    th = np.float32(6.283185307179586) * np.asarray(u2, dtype=np.float32)
    r = np.sqrt(np.float32(-2.0) * np.log(u1))
    return r * np.cos(th), r * np.sin(th)


def rand(seed: int, offset: ArrayLike, n_rounds: int = N_ROUNDS_DEFAULT) -> np.ndarray:
    """float32 uniforms in [0, 1), bit-identical to ``tl.rand(seed, offset)``."""
    return uint_to_uniform_float(randint(seed, offset, n_rounds))


def randn(seed: int, offset: ArrayLike, n_rounds: int = N_ROUNDS_DEFAULT) -> np.ndarray:
    """float32 standard normals, as ``tl.randn(seed, offset)`` (words 0 and 1)."""
    i1, i2, _, _ = randint4x(seed, offset, n_rounds)
    n1, _ = pair_uniform_to_normal(uint_to_uniform_float(i1), uint_to_uniform_float(i2))
    return n1


# ---------------------------------------------------------------------------
# Framework generator state.
# ---------------------------------------------------------------------------

DEFAULT_SEED = 0
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # odd, so n -> n * gamma is a bijection

_seed: int = DEFAULT_SEED
_stream: int = 0


def _splitmix64_mix(z: int) -> int:
    """SplitMix64 finaliser: a bijection of uint64 with good avalanche."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def manual_seed(seed: int) -> None:
    """Set the user seed (taken mod 2**64; in [-2**63, 2**64), as PyTorch) and reset the
    stream counter to 0.

    Every rank must call this with the same seed so they agree on keys.
    """
    global _seed, _stream
    seed = as_int(seed, "manual_seed: seed", low=-(1 << 63))
    if seed > _MASK64:  # the Philox key holds 64 bits: a larger seed would alias a smaller one
        raise ValueError(f"manual_seed: seed must lie in [-2**63, 2**64), got {seed}; the "
                         f"generator's key holds 64 bits.")
    _seed = seed & _MASK64
    _stream = 0


def get_rng_state() -> dict:
    """The generator's whole state, (seed, stream), as a JSON-able dict (for checkpoints)."""
    return {"seed": _seed, "stream": _stream}


def set_rng_state(state: dict) -> None:
    """Restore a state from :func:`get_rng_state`: the next keys are the ones that followed it."""
    global _seed, _stream
    if not isinstance(state, dict) or set(state) != {"seed", "stream"}:
        raise TypeError(f"set_rng_state takes the dict get_rng_state() returns, with keys "
                        f"'seed' and 'stream', got {state!r}.")
    seed = as_int(state["seed"], "set_rng_state: state['seed']")
    stream = as_int(state["stream"], "set_rng_state: state['stream']", low=0)
    _seed, _stream = seed & _MASK64, stream


def initial_seed() -> int:
    """The seed last given to :func:`manual_seed` (``DEFAULT_SEED`` if never)."""
    return _seed


def next_key() -> int:
    """Return a fresh 64-bit key for one random op and advance the stream.

    ``key = mix(seed + (stream + 1) * 0x9E3779B97F4A7C15 mod 2**64)`` with
    ``mix`` the SplitMix64 finaliser, i.e. the ``stream+1``-th output of
    SplitMix64 seeded with ``seed``; then ``stream += 1``.  It is a pure
    function of (seed, stream), so ranks that issue the same sequence of ops
    get the same keys without communicating, and distinct streams of one seed
    never collide (gamma is odd and ``mix`` is a bijection).

    Contract: element ``i`` (global row-major flat index) of the tensor drawn
    with this key is ``rand(key, i)`` / ``randn(key, i)``.
    """
    global _stream
    _stream += 1
    return _splitmix64_mix((_seed + _stream * _GOLDEN_GAMMA) & _MASK64)


def _flat_offsets(offsets: ArrayLike) -> np.ndarray:
    off = np.asarray(offsets)
    if off.dtype.kind not in "iu":
        raise TypeError(f"offsets must be integers, got dtype {off.dtype}")
    # int64 always, so the counter's high word is honoured for huge tensors
    # and results do not depend on whether the caller used int32 or int64.
    return off.astype(np.int64, copy=False)


def uniform(key: int, offsets: ArrayLike, dtype: DTypeLike = np.float32) -> np.ndarray:
    """U[0, 1) values at global flat ``offsets``: ``rand(key, offsets)`` cast to ``dtype``."""
    return rand(key, _flat_offsets(offsets)).astype(dtype, copy=False)


def normal(key: int, offsets: ArrayLike, dtype: DTypeLike = np.float32) -> np.ndarray:
    """N(0, 1) values at global flat ``offsets``: ``randn(key, offsets)`` cast to ``dtype``."""
    return randn(key, _flat_offsets(offsets)).astype(dtype, copy=False)


def uniform_like_shape(
    key: int, shape: Sequence[int] | int, dtype: DTypeLike = np.float32
) -> np.ndarray:
    """The whole (unsharded) uniform tensor of ``shape`` for ``key``."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64))
    return uniform(key, np.arange(n, dtype=np.int64).reshape(shape), dtype)
