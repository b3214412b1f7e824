"""Pass numpy arrays to ``@triton.jit`` kernels under the Triton CPU interpreter.

Why: without torch there is no tensor type Triton knows, but the interpreter
(``TRITON_INTERPRET=1``, set before triton is first imported) only needs a
duck-typed tensor: it reads ``data_ptr()`` and ``dtype`` (via
``triton.runtime.jit.mangle_type``, which accepts a numpy dtype directly),
and around each launch ``GridExecutor._init_args_hst`` / ``_restore_args_dev``
call ``untyped_storage()`` (``data_ptr``/``cpu``/``copy_``),
``storage_offset()``, ``size()``, ``stride()``, ``new_empty()`` and ``set_()``
to stage a host copy and copy it back.  The interpreter then loads and stores
through raw addresses, so we make the "host copy" the very same memory:
``cpu()`` returns the storage itself and ``copy_`` between identical storages
is a no-op.  Kernel writes therefore land in the caller's numpy array with no
copies.  This module does not import triton.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["NumpyArg", "NumpyStorage", "as_triton_arg"]

# Canonical dtype objects, kept alive here.  Triton's native mangle_type caches
# by the identity of the dtype object, so a short-lived dtype whose address is
# later reused by another dtype could be mangled wrongly; these never die.
_CANONICAL_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).str: np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
    )
}


def _canonical_dtype(dtype: np.dtype) -> np.dtype:
    try:
        return _CANONICAL_DTYPES[np.dtype(dtype).str]
    except KeyError:
        raise TypeError(
            f"dtype {dtype!r} is not supported by the Triton numpy adapter "
            "(native-endian bool/int/uint/float only)"
        ) from None


def _span(a: np.ndarray) -> tuple[int, int]:
    """Lowest byte address touched by ``a`` and the byte length of its span."""
    ptr = a.__array_interface__["data"][0]
    if a.size == 0:
        return ptr, 0
    lo = ptr + sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s < 0)
    hi = ptr + sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s > 0) + a.itemsize
    return lo, hi - lo


class NumpyStorage:
    """Torch-``UntypedStorage``-like view of the bytes an array spans.

    Holds a reference to the owning array so the memory outlives any view.
    """

    def __init__(self, owner: np.ndarray) -> None:
        self._owner = owner
        self._ptr, self._nbytes = _span(owner)

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes

    size = nbytes

    def cpu(self) -> NumpyStorage:
        """Already host memory: return self so the interpreter works in place."""
        return self

    def copy_(self, src: NumpyStorage) -> NumpyStorage:
        """Copy bytes from ``src``; a no-op when both are the same memory."""
        if src.data_ptr() != self._ptr:
            if src.nbytes() != self._nbytes:
                raise ValueError(f"storage size mismatch: {src.nbytes()} vs {self._nbytes}")
            ctypes.memmove(self._ptr, src.data_ptr(), self._nbytes)
        return self

    def _buffer(self) -> Any:
        return (ctypes.c_char * self._nbytes).from_address(self._ptr)


class NumpyArg:
    """Duck-typed tensor over a numpy array for the Triton interpreter.

    ``data_ptr()`` is the address of element 0 (the array's own data pointer,
    so strided views and negative strides work); ``size()``/``stride()`` are
    in elements, like torch.  ``.array`` is the wrapped numpy array.
    """

    def __init__(self, array: np.ndarray, *, _storage: NumpyStorage | None = None) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"expected numpy.ndarray, got {type(array).__name__}")
        self.dtype = _canonical_dtype(array.dtype)
        if any(s % array.itemsize for s in array.strides):
            raise ValueError("array strides must be multiples of the item size")
        self.array = array
        self._storage = _storage if _storage is not None else NumpyStorage(array)

    # -- what the interpreter reads -------------------------------------------------
    def data_ptr(self) -> int:
        return self.array.__array_interface__["data"][0]

    def untyped_storage(self) -> NumpyStorage:
        return self._storage

    def storage_offset(self) -> int:
        return (self.data_ptr() - self._storage.data_ptr()) // self.array.itemsize

    def size(self, dim: int | None = None) -> Any:
        return self.array.shape if dim is None else self.array.shape[dim]

    def stride(self, dim: int | None = None) -> Any:
        st = tuple(s // self.array.itemsize for s in self.array.strides)
        return st if dim is None else st[dim]

    def new_empty(self, *size: Any, device: str = "cpu", **_: Any) -> NumpyArg:
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            size = tuple(size[0])
        return NumpyArg(np.empty(size, dtype=self.dtype))

    def set_(self, storage: NumpyStorage, offset: int, size: Any, stride: Any) -> NumpyArg:
        """Become a view of ``storage`` (no copy), like ``torch.Tensor.set_``."""
        item = self.dtype.itemsize
        self.array = np.ndarray(
            shape=tuple(size),
            dtype=self.dtype,
            buffer=storage._buffer(),
            offset=int(offset) * item,
            strides=tuple(int(s) * item for s in stride),
        )
        self._storage = storage  # keeps the owning array alive
        return self

    # -- conveniences -----------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def device(self) -> str:
        return "cpu"

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        return self.array

    def __repr__(self) -> str:
        return f"NumpyArg(shape={self.array.shape}, dtype={self.dtype}, ptr=0x{self.data_ptr():x})"


def as_triton_arg(a: np.ndarray | NumpyArg) -> NumpyArg:
    """Wrap ``a`` so a Triton-interpreted kernel reads/writes it in place.

    Only arrays are wrapped; Python scalars go to the kernel as they are.
    Note the interpreter writes through raw pointers and ignores numpy's
    ``writeable`` flag.
    """
    if isinstance(a, NumpyArg):
        return a
    return NumpyArg(a)
