"""Module and Parameter, with PyTorch's names and semantics."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

import numpy as np

from dtensor.ops import registry
from dtensor.tensor import Tensor, TensorMethods
from dtensor.validate import as_bool, as_int

__all__ = ["Parameter", "Module", "ModuleList", "Sequential"]


class Parameter(Tensor):
    """A Tensor that a Module registers as trainable (requires_grad=True by default).

    ``Parameter(dtensor)`` marks a DTensor as a parameter and returns it (as torch does).
    """

    __slots__ = ()

    def __new__(cls, data=None, requires_grad: bool = True):
        from dtensor.dtensor import DTensor
        if isinstance(data, DTensor):
            data.requires_grad = requires_grad
            data._is_param = True
            return data
        return super().__new__(cls)

    def __init__(self, data, requires_grad: bool = True):
        super().__init__(data.numpy() if isinstance(data, TensorMethods) else data)
        if requires_grad:
            self.requires_grad_(True)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


registry._EAGER.add(Parameter)


class _HookHandle:
    def __init__(self, hooks: dict, key: int):
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


class Module:
    """Base class for layers: parameters and submodules assigned as attributes are registered.

    Example:
        >>> class Net(dtensor.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = dtensor.nn.Linear(4, 2)
        ...     def forward(self, x):
        ...         return self.fc(x)
    """

    _hook_id = 0

    def __init__(self) -> None:
        d = self.__dict__
        d["_parameters"] = OrderedDict()
        d["_buffers"] = OrderedDict()
        d["_modules"] = OrderedDict()
        d["_forward_pre_hooks"] = OrderedDict()
        d["_forward_hooks"] = OrderedDict()
        d["training"] = True

    # -- registration
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"cannot assign {name!r} before Module.__init__() is called; "
                                 f"call super().__init__() first in {type(self).__name__}.")
        is_param = isinstance(value, Parameter) or getattr(value, "_is_param", False)
        if name in self._buffers and (value is None or isinstance(value, TensorMethods)):
            self._buffers[name] = value  # reassigning a buffer keeps it registered
            return
        if name in self._parameters and (value is None or is_param):
            self._parameters[name] = value  # in place: parameter order stays as declared
            return
        if name in self._parameters:  # as PyTorch: a plain value never replaces a Parameter
            raise TypeError(f"cannot assign {type(value).__name__} as parameter {name!r} "
                            f"(dtensor.nn.Parameter or None expected); to change its values "
                            f"use {type(self).__name__}.{name}.copy_(...) or wrap them in "
                            f"Parameter(...).")
        for table in (self._parameters, self._buffers, self._modules):
            table.pop(name, None)
        if is_param:
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str):
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def _check_entry(self, what: str, name, value, kinds: tuple, expected: str) -> None:
        if not isinstance(name, str) or not name or "." in name:
            raise TypeError(f"{type(self).__name__}.{what}: the name must be a non-empty string "
                            f"without dots, got {name!r}.")
        if value is not None and not isinstance(value, kinds) \
                and not getattr(value, "_is_param", False):
            raise TypeError(f"{type(self).__name__}.{what}({name!r}, ...) takes {expected} or "
                            f"None, got {value!r} (type {type(value).__name__}).")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        self._check_entry("register_parameter", name, param, (Parameter,),
                          "a Parameter (dtensor.nn.Parameter(tensor))")
        if param is None:
            self._parameters[name] = None
        else:
            setattr(self, name, param)

    def register_buffer(self, name: str, tensor: Tensor | None) -> None:
        self._check_entry("register_buffer", name, tensor, (TensorMethods,), "a tensor")
        self._buffers[name] = tensor

    def add_module(self, name: str, module: "Module | None") -> None:
        self._check_entry("add_module", name, module, (Module,), "a Module")
        self._modules[name] = module

    # -- traversal
    def named_modules(self, prefix: str = "", memo: set | None = None):
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def modules(self) -> Iterator["Module"]:
        return (m for _, m in self.named_modules())

    def named_children(self):
        return ((n, m) for n, m in self._modules.items() if m is not None)

    def children(self):
        return (m for _, m in self.named_children())

    def _named_members(self, table: str, recurse: bool):
        seen = set()
        mods = self.named_modules() if recurse else [("", self)]
        for mprefix, m in mods:
            for name, t in getattr(m, table).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mprefix}.{name}" if mprefix else name), t

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        for name, p in self._named_members("_parameters", recurse):
            yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self, recurse: bool = True):
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_buffers(self, prefix: str = "", recurse: bool = True):
        for name, b in self._named_members("_buffers", recurse):
            yield (f"{prefix}.{name}" if prefix else name), b

    def buffers(self, recurse: bool = True):
        return (b for _, b in self.named_buffers(recurse=recurse))

    def apply(self, fn: Callable[["Module"], None]) -> "Module":
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # -- modes and grads
    def train(self, mode: bool = True) -> "Module":
        mode = as_bool(mode, f"{type(self).__name__}.train: mode")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        set_to_none = as_bool(set_to_none, "zero_grad: set_to_none")
        for p in self.parameters():
            p.grad = None if set_to_none or p.grad is None else p.grad * 0.0

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        requires_grad = as_bool(requires_grad, "requires_grad_: requires_grad")
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    # -- state
    def state_dict(self) -> "OrderedDict[str, Tensor]":
        """Parameters and buffers by dotted name (the live tensors, as PyTorch's detach())."""
        sd = OrderedDict(self.named_parameters())
        sd.update(self.named_buffers())
        return sd

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy values into this module's parameters/buffers; returns (missing, unexpected).

        Raises KeyError on missing or unexpected keys when strict, ValueError on a shape
        mismatch, listing every offending key.
        """
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"load_state_dict for {type(self).__name__} takes a mapping of "
                            f"names to arrays (as model.state_dict() gives), got "
                            f"{type(state_dict).__name__}.")
        strict = as_bool(strict, "load_state_dict: strict")
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_state_dict for {type(self).__name__}: missing keys {missing}, unexpected "
                f"keys {unexpected}. Rename the keys to match model.state_dict(), or pass "
                f"strict=False to load the matching ones.")
        bad = []
        for k, t in own.items():
            if k in state_dict:
                v = state_dict[k]
                shape, dtype = tuple(np.shape(v)), getattr(v, "dtype", None)
                dtype = np.asarray(v).dtype if dtype is None else np.dtype(dtype)
                if shape != tuple(t.shape):
                    bad.append(f"{k}: checkpoint {shape} vs model {tuple(t.shape)}")
                elif dtype.kind not in "biuf":  # strings, objects: copy_ would fail in numpy
                    bad.append(f"{k}: checkpoint dtype {dtype} is not numeric (model "
                               f"{t.dtype})")
        if bad:
            raise ValueError(f"load_state_dict for {type(self).__name__}: shape or dtype mismatch "
                             f"for " + "; ".join(bad) + ". Build the model with the "
                             "checkpoint's config.")
        for k, t in own.items():
            if k in state_dict:
                src = state_dict[k]
                t.copy_(src if isinstance(src, TensorMethods) else np.asarray(src))
        return missing, unexpected

    # -- hooks and call
    def _add_hook(self, table: dict, hook) -> _HookHandle:
        Module._hook_id += 1
        table[Module._hook_id] = hook
        return _HookHandle(table, Module._hook_id)

    def register_forward_pre_hook(self, hook) -> _HookHandle:
        """``hook(module, args)`` runs before forward; a non-None return replaces ``args``."""
        return self._add_hook(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook) -> _HookHandle:
        """``hook(module, args, output)`` runs after forward; a non-None return replaces it."""
        return self._add_hook(self._forward_hooks, hook)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward().")

    def __call__(self, *args, **kwargs):
        for hook in list(self._forward_pre_hooks.values()):
            res = hook(self, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
        out = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            res = hook(self, args, out)
            if res is not None:
                out = res
        return out

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({n}): " + repr(m).replace("\n", "\n  ") for n, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n  " + "\n  ".join(lines) + "\n)" if lines else ")")


class ModuleList(Module):
    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, m: Module) -> "ModuleList":
        if not isinstance(m, Module):
            raise TypeError(f"{type(self).__name__} holds Modules; entry {len(self._modules)} "
                            f"is {m!r} (type {type(m).__name__}).")
        self._modules[str(len(self._modules))] = m
        return self

    def __getitem__(self, i: int) -> Module:
        n = len(self._modules)
        i = as_int(i, f"{type(self).__name__} index")
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} is out of range for {n} "
                             f"modules (valid: {-n}..{n - 1}).")
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Sequential(ModuleList):
    def __init__(self, *modules: Module):
        super().__init__(modules)

    def forward(self, x):
        for m in self:
            x = m(x)
        return x


class ModuleDict(Module):
    """Modules by name, in insertion order (a dict's interface); torchtitan keeps its layers in
    one, keyed "0", "1", ..."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __setitem__(self, key: str, m: Module) -> None:
        if not isinstance(key, str):
            raise TypeError(f"ModuleDict keys are strings, got {key!r} (type "
                            f"{type(key).__name__}).")
        if not isinstance(m, Module):
            raise TypeError(f"ModuleDict holds Modules; entry {key!r} is {m!r} (type "
                            f"{type(m).__name__}).")
        self.add_module(key, m)

    def _known(self, key) -> str:
        if key not in self._modules:
            raise KeyError(f"ModuleDict has no entry {key!r}; its keys are "
                           f"{list(self._modules)}.")
        return key

    def __getitem__(self, key: str) -> Module:
        return self._modules[self._known(key)]

    def __delitem__(self, key: str) -> None:
        del self._modules[self._known(key)]

    def update(self, modules) -> None:
        for key, m in (modules.items() if hasattr(modules, "items") else modules):
            self[key] = m

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key) -> bool:
        return key in self._modules

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()
