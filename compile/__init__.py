"""``dtensor.compile``: trace a function (a whole train step included) into a per-rank graph,
run passes over it and generate code (see compile/api.py).

The module itself is callable, as torch.compile: ``dtensor.compile(fn)`` or ``@dtensor.compile``.
Submodules: api, passes, guards, cache, kernels (the kernel layer), numpy_backend, c_backend
(with c_prelude.c and c_typed.c), native (C builds and kernel threads), triton_backend,
triton_adapter.
"""
import importlib
import sys
import types

from dtensor.compile.api import Compiled, RecompileWarning, TracingError, compile

__all__ = ["compile", "Compiled", "TracingError", "RecompileWarning"]


class _CallableModule(types.ModuleType):
    def __call__(self, fn=None, **options):
        return compile(fn, **options)

    def __reduce__(self):  # pickled by name, as modules are (cloudpickle sends test bodies)
        return importlib.import_module, (self.__name__,)


sys.modules[__name__].__class__ = _CallableModule
