"""Guards: the Python values a trace baked in, so that a call whose values changed recompiles
instead of running stale (TorchDynamo's guards, found without reading bytecode).

The tracer sees only tensor work: a global ``SCALE``, a closure cell, ``m.scale`` on a module,
a dict passed as an argument are read at trace time and become constants of the graph. So
before tracing, every value the function could read is fingerprinted: the globals its code
names (nested functions' code too, and the code of user functions and user classes' methods,
properties, static and class methods it reaches), its closure cells and defaults, the
attributes of the objects reachable from those and from the arguments (a Module's plain
attributes and its submodules', a plain object's ``vars`` and ``__slots__``, a user class's
data attributes along its MRO), the contents of containers (namedtuples, deques and other
sequences and mappings too), and, for every user module reached (a global, an argument,
``pkg.sub``, ``obj.cfg``), its attributes that the walked code names. Code that reads globals
by a computed name (``globals()["G"]``, ``getattr(mod, name)``, ``vars``) also guards every
scalar global of its module and of the user modules reached. The fingerprint is a flat tuple
of (type, value) tokens; each call recomputes it and looks its graph up by it.

What is not a guard: tensors' values (parameters, gradients and optimizer state are graph
inputs, and a parameter is fingerprinted by identity only), the optimizers (their
hyperparameters are in the cache key, their per-step scalars are runtime slots), and dtensor's
own code. Limits (a change there is not seen, and the graph runs with the old value): a numpy
array is guarded by identity, shape and dtype, and by its bytes only up to ``SMALL_ARRAY``
elements (a bigger one changed in place is not seen: pass it as a tensor argument); a walk
stops at ``MAX_DEPTH`` levels of plain objects and containers and after ``MAX_TOKENS`` tokens;
library objects count by equality or identity, not by their insides; a non-scalar global read
by a computed name, a value a ``__getattr__`` computes from state the walk does not reach, and
attributes of the ``builtins`` module are not guarded.
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import dis
import functools
import os
import sys
import sysconfig
import types
from collections import OrderedDict

import numpy as np

from dtensor.errors import OWN_DIRS
from dtensor.nn.module import Module
from dtensor.optim import Optimizer
from dtensor.tensor import TensorMethods

__all__ = ["fingerprint", "explain", "first_change"]

MAX_DEPTH = 12
MAX_TOKENS = 50_000
SMALL_ARRAY = 64

_SCALARS = frozenset((type(None), bool, int, float, complex, str, bytes))
_CONTAINERS = frozenset((tuple, list, dict, OrderedDict))
_LIBRARY_DIRS = tuple(os.path.abspath(p) + os.sep for p in {
    sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_NOT_USER = OWN_DIRS + _LIBRARY_DIRS
# Names through which code reads a module's globals by a computed name: ``globals()["G"]``,
# ``vars(m)``, ``m.__dict__``, ``getattr(m, "G" + "A")``.
_OWN_GLOBALS_BY_NAME = frozenset(("globals", "vars", "eval", "exec", "locals"))
_ATTRS_BY_NAME = frozenset(("getattr", "vars", "__dict__", "eval", "exec"))
_FLAT = (bytearray, memoryview)


@functools.lru_cache(maxsize=4096)
def _is_user(filename: str) -> bool:
    """Code outside dtensor, the standard library and installed packages: its reads are
    guarded (library code's module-level values are taken as constants)."""
    return not os.path.abspath(filename).startswith(_NOT_USER)


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """Names ``code`` (and the code nested in it) loads as globals or attributes."""
    names = set()
    for instr in dis.get_instructions(code):
        if instr.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"):
            names.add(instr.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_names(const))
    return tuple(sorted(names))


class _Walk:
    """One fingerprint. ``explain``: also a (path, tokens) record per leaf, for messages."""

    def __init__(self, params: frozenset, explain: bool):
        self.out: list = []
        self.leaves: list | None = [] if explain else None
        self.params = params
        self.seen: dict[int, int] = {}  # id -> token index: shared and cyclic objects once
        self.keep: list = []  # objects whose ids are in seen stay alive for the walk
        self.names: set = set()  # every name the walked code loads
        self.modules: list = []  # (user module, path) reached, walked last
        self.by_name = False  # some walked code reads attributes by a computed name

    def leaf(self, path, *tokens) -> None:
        self.out.extend(tokens)
        if self.leaves is not None:
            self.leaves.append((path, tokens))

    def once(self, obj, path) -> bool:
        """False (and a back-reference token) if ``obj`` was walked already."""
        i = self.seen.get(id(obj))
        if i is not None:
            self.leaf(path, "seen", i)
            return False
        self.seen[id(obj)] = len(self.out)
        self.keep.append(obj)
        return True

    def sub(self, path, key: str):
        return None if self.leaves is None else f"{path}{key}".lstrip()

    # -- values
    def value(self, v, path, depth: int) -> None:
        t = type(v)
        if t in _SCALARS:
            self.leaf(path, t, v if v == v else "nan")  # NaN != NaN would recompile forever
        elif len(self.out) > MAX_TOKENS or depth > MAX_DEPTH:
            self.leaf(path, "cut", t)
        elif t in _CONTAINERS:
            if not v:
                self.leaf(path, t, 0)
            elif t is tuple or self.once(v, path):  # a tuple holds no cycle of its own
                self.leaf(path, t, len(v))
                if t is tuple or t is list:
                    for i, x in enumerate(v):
                        self.value(x, self.sub(path, f"[{i}]"), depth + 1)
                else:
                    for k, x in v.items():
                        self.value(k, self.sub(path, " key"), depth + 1)
                        self.value(x, self.sub(path, f"[{k!r}]"), depth + 1)
        elif t is types.FunctionType:
            self.function(v, path)
        elif isinstance(v, TensorMethods):
            if id(v) in self.params:
                self.leaf(path, "param", id(v))
            else:
                self.array(v._loc() if v.is_distributed else v.data, path, id(v))
        elif isinstance(v, Module):
            self.module(v, path)
        else:
            self.other(v, t, path, depth)

    def other(self, v, t, path, depth: int) -> None:
        if isinstance(v, np.ndarray):
            self.array(v, path, None)
        elif isinstance(v, np.generic):
            self.leaf(path, t, v.tobytes())
        elif isinstance(v, dict):  # a dict subclass (OrderedDict, defaultdict, ...)
            self.value(dict(v), path, depth)
        elif t in (set, frozenset):
            self.leaf(path, t, frozenset(v))
        elif isinstance(v, type):
            self.leaf(path, "id", id(v))
            if _class_is_user(v):  # `C.S`, `cls.K`: its data attributes and its code
                self.user_class(v, path)
        elif isinstance(v, Optimizer):
            self.leaf(path, "id", id(v))
        elif isinstance(v, types.ModuleType):
            self.leaf(path, "module", id(v))
            if _module_is_user(v) and self.once(v, path):
                self.modules.append((v, path))  # its attributes, once every name is known
        elif t is types.MethodType:
            self.value(v.__self__, self.sub(path, ".__self__"), depth + 1)
            self.function(v.__func__, path)
        elif isinstance(v, functools.partial):  # a subclass too: its call is the same
            self.leaf(path, t)
            self.value(v.func, self.sub(path, ".func"), depth + 1)
            self.value(v.args, self.sub(path, ".args"), depth + 1)
            self.value(v.keywords, self.sub(path, ".keywords"), depth + 1)
            if t is not functools.partial:
                self.attributes(v, t, path, depth)
        elif isinstance(v, _FLAT):
            self.leaf(path, t, bytes(v))
        elif isinstance(v, (tuple, list, collections.deque, collections.abc.MutableSequence)):
            # a namedtuple, a deque, a list subclass: its items (a namedtuple's are its fields)
            if self.once(v, path):
                self.leaf(path, t, len(v))
                for i, x in enumerate(v):
                    self.value(x, self.sub(path, f"[{i}]"), depth + 1)
        elif isinstance(v, collections.abc.Mapping):  # a mappingproxy, a ChainMap, ...
            if self.once(v, path):
                self.leaf(path, t, len(v))
                for k, x in v.items():
                    self.value(k, self.sub(path, " key"), depth + 1)
                    self.value(x, self.sub(path, f"[{k!r}]"), depth + 1)
        elif not (_class_is_user(t) or t is types.SimpleNamespace
                  or dataclasses.is_dataclass(v)):
            try:  # a library object: by value where its type defines equality, else identity
                hash(v)
                self.leaf(path, t, v)
            except TypeError:
                self.leaf(path, "id", id(v))
        elif self.once(v, path):  # a user object or a dataclass: its attributes, its code
            self.leaf(path, t)
            self.user_class(t, path)
            self.attributes(v, t, path, depth)

    def attributes(self, v, t, path, depth: int) -> None:
        """An object's ``vars`` and its ``__slots__`` along the MRO."""
        for k, x in getattr(v, "__dict__", {}).items():
            self.leaf(path, k)
            self.value(x, self.sub(path, f".{k}"), depth + 1)
        for k in _slots(t):
            self.leaf(path, k)
            self.value(getattr(v, k, _UNSET), self.sub(path, f".{k}"), depth + 1)

    def array(self, a, path, tensor_id) -> None:
        small = a.tobytes() if a.size <= SMALL_ARRAY else None
        self.leaf(path, "array", tensor_id, id(a), a.shape, a.dtype, small)

    def module(self, m, path) -> None:
        """A dtensor Module: its plain attributes, buffers, parameters by identity, and its
        submodules the same way (a tree has no depth cap: it is the model)."""
        if not self.once(m, path):
            return
        t = type(m)
        self.leaf(path, t)
        if _class_is_user(t):
            self.user_class(t, path)
        out, fast = self.out, self.leaves is None
        for k, x in vars(m).items():
            tx = type(x)
            if fast and (tx in _SCALARS and x == x or tx in _CONTAINERS and not x):
                # the common case inline (a model has hundreds): a scalar, an empty table
                out += (k, tx, x if tx in _SCALARS else 0)
            elif k == "_parameters":
                self.leaf(path, tuple(x), tuple(map(id, x.values())))
            elif k == "_modules":
                self.leaf(path, tuple(x))
                for n, sub in x.items():
                    if sub is not None:
                        self.module(sub, self.sub(path, f".{n}"))
            else:
                self.leaf(path, k)
                self.value(x, self.sub(path, f".{k}"), 1)

    # -- code
    def function(self, f, path) -> None:
        self.leaf(path, "fn", id(f))
        code = f.__code__
        if not _is_user(code.co_filename) or not self.once(f, path):
            return
        self.code_reads(code, f.__globals__, path)
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # not yet assigned
                contents = None
            self.value(contents, self.sub(path, f" closure {name!r}"), 1)
        if f.__defaults__ or f.__kwdefaults__:
            self.value((f.__defaults__, f.__kwdefaults__), self.sub(path, " defaults"), 1)

    def code_reads(self, code, g: dict, path) -> None:
        names = _names(code)
        self.names.update(names)
        for name in names:
            if name in g:
                self.value(g[name], self.sub("", f"global {name!r}"), 1)
        if not _OWN_GLOBALS_BY_NAME.isdisjoint(names) and self.once(g, path):
            self.simple_globals(g, self.sub("", "globals()"))  # `globals()["G"]`
        if not _ATTRS_BY_NAME.isdisjoint(names):
            self.by_name = True

    def simple_globals(self, d: dict, path) -> None:
        """Every scalar global of a module: what code reading globals by a computed name may
        read (a container or object read that way is not seen)."""
        fast, out = self.leaves is None, self.out
        for k, x in d.items():
            t = type(x)
            if t in _SCALARS:
                if fast:  # inline: a module may hold hundreds
                    out += (k, t, x if x == x else "nan")
                else:
                    self.leaf(f"{path}[{k!r}]", k, t, x if x == x else "nan")
            elif isinstance(x, np.generic):
                self.leaf(self.sub(path, f"[{k!r}]"), k, t, x.tobytes())

    def user_modules(self) -> None:
        """The user modules reached (a global, an argument, ``pkg.sub``, ``obj.cfg``): their
        attributes any walked code names, and all their scalars if some code reads attributes
        by a computed name. Last, when every name is known; walking them may name more."""
        done: dict[int, set] = {}
        by_name = set()
        grew = True
        while grew:
            grew = False
            for m, path in self.modules:  # grows while walked
                d = vars(m)
                seen = done.setdefault(id(m), set())
                for attr in sorted(n for n in self.names if n in d and n not in seen):
                    grew = True
                    seen.add(attr)
                    self.leaf(path, attr)
                    self.value(d[attr], self.sub(path, f".{attr}"), 1)
                if self.by_name and id(m) not in by_name:
                    grew = True
                    by_name.add(id(m))
                    self.simple_globals(d, path)

    def user_class(self, cls, path) -> None:
        """A class defined in user code: its methods read globals too (``forward``; a property's,
        a staticmethod's and a classmethod's code as well), and its data attributes (``C.S``,
        ``self.FACTOR``, ``cls.K``) are values like any other."""
        for klass in cls.__mro__:
            if not (_class_is_user(klass) and self.once(klass, path)):
                continue
            where = self.sub(path, f" {klass.__name__}")
            for k, attr in vars(klass).items():
                ta = type(attr)
                if ta is types.FunctionType:
                    self.function(attr, self.sub(where, f".{k}"))
                elif ta is property:
                    for f in (attr.fget, attr.fset, attr.fdel):
                        if type(f) is types.FunctionType:
                            self.function(f, self.sub(where, f".{k}"))
                elif ta is staticmethod or ta is classmethod:
                    self.value(attr.__func__, self.sub(where, f".{k}"), 1)
                elif k[:2] != "__" and not hasattr(ta, "__get__"):  # data, not a descriptor
                    self.leaf(where, k)
                    self.value(attr, self.sub(where, f".{k}"), 1)


_UNSET = ("unset",)  # a slot never assigned


@functools.lru_cache(maxsize=1024)
def _slots(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` names along ``cls``'s MRO (a slots dataclass's fields)."""
    out = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for k in (slots,) if isinstance(slots, str) else slots:
            if k not in ("__dict__", "__weakref__") and k not in out:
                out.append(k)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _class_is_user(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return cls.__module__ == "__main__" or module is not None and _module_is_user(module)


def _module_is_user(module: types.ModuleType) -> bool:
    """A module of user code (a builtin module has no file: not user code)."""
    f = getattr(module, "__file__", None)
    return f is not None and _is_user(f)


def _roots(w: _Walk, fn, args, kwargs) -> None:
    if type(fn) is types.MethodType:
        w.value(fn.__self__, w.sub("", "self"), 0)
        w.function(fn.__func__, w.sub("", ""))
    else:
        w.value(fn, w.sub("", "" if type(fn) is types.FunctionType else type(fn).__name__), 0)
    for i, a in enumerate(args):
        if not isinstance(a, (TensorMethods, np.ndarray)):  # tensors are inputs (cache key)
            w.value(a, w.sub("", f"argument {i}"), 0)
    for k, a in kwargs.items():
        if not isinstance(a, (TensorMethods, np.ndarray)):
            w.value(a, w.sub("", f"argument {k!r}"), 0)
    w.user_modules()


def fingerprint(fn, args, kwargs, params: frozenset) -> tuple:
    """The hashable fingerprint of what ``fn(*args, **kwargs)`` could read besides tensors;
    ``params``: ids of the parameters (guarded by identity, their values are inputs)."""
    w = _Walk(params, explain=False)
    _roots(w, fn, args, kwargs)
    return tuple(w.out)


def explain(fn, args, kwargs, params: frozenset) -> list:
    """The same walk as ``fingerprint``, as (path, tokens) leaves for messages."""
    w = _Walk(params, explain=True)
    _roots(w, fn, args, kwargs)
    return w.leaves


def first_change(old: list, new: list) -> str:
    """``"global 'SCALE' changed from 2.0 to 5.0"``: the first leaf where two walks differ."""
    for (path, a), (_, b) in zip(old, new):
        if a != b:
            return f"{path or 'the function'} changed from {_show(a)} to {_show(b)}"
    return "the values it reads changed"


def _show(tokens) -> str:
    if len(tokens) == 2 and tokens[0] in _SCALARS:
        return repr(tokens[1])
    if tokens and tokens[0] == "array":
        return f"an array {tokens[4]}{list(tokens[3])}"
    if tokens and isinstance(tokens[0], type) and len(tokens) == 2:
        return f"a {tokens[0].__name__} of {tokens[1]}"
    return " ".join(map(str, tokens))[:80]
