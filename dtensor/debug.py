"""CommDebugMode: every collective of a block of code, by the module that caused it.

As PyTorch's ``torch.distributed.tensor.debug.CommDebugMode``::

    with CommDebugMode() as comm_mode:
        loss = model(x, y)[1]
        loss.backward()
    comm_mode.get_total_counts()          # 24
    comm_mode.get_comm_counts()           # {"all_gather": 8, "reduce_scatter": 8, ...}
    print(comm_mode.table())              # a tree of module paths, counts and bytes per kind

Each collective is attributed to the module whose forward was running, or, in the backward, to
the module whose forward recorded the op being differentiated; collectives outside any module
(the optimizer's, a loss computed outside the model) belong to ``Global``. Each event also
keeps the op and sharding rule that asked for the redistribute, the placements before and
after, the group and the bytes (``events``). A compiled function reports the same: its graph's
collectives keep the module, op and placements they were traced under.

While any mode is open, the hooks that keep the cause (``_Tracking``) are installed: Module
calls push their path, autograd nodes remember it, and the DTensor interpreter notes the op.
With none open, nothing of this runs on the dispatch path.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from dtensor import autograd, comm, observe
from dtensor.ops import registry

__all__ = ["CommDebugMode", "CommEvent", "tracking"]


# ----------------------------------------------------------------------------- the hooks

class _Tracking:
    """Installs the hooks that keep ``observe.CAUSE`` while at least one user needs them."""

    users = 0
    _saved: tuple = ()
    _stack: list = []  # (module, path) of the forwards running now
    _paths: dict = {}  # (id(parent), id(module)) -> path, for this installation

    @classmethod
    def acquire(cls) -> None:
        cls.users += 1
        if cls.users > 1:
            return
        from dtensor.dtensor import DTensor
        from dtensor.nn.module import Module
        plain_call, plain_record = Module.__call__, autograd.record
        plain_interpret = registry._INTERPRETERS[DTensor]
        cls._saved = (Module, plain_call, plain_record, DTensor, plain_interpret)
        cls._paths = {}

        def call(module, *args, **kwargs):
            path = cls.path_of(module)
            before = observe.CAUSE.get("module"), observe.CAUSE.get("phase")
            cls._stack.append((module, path))
            observe.where(path, "forward")
            try:
                return plain_call(module, *args, **kwargs)
            finally:
                cls._stack.pop()
                observe.where(*before)

        def record(op, inputs, params, out) -> None:
            out.requires_grad = True
            out._node = autograd.Node(op, inputs, params, observe.CAUSE.get("module"))

        def interpret(op, args, params):
            cause = observe.CAUSE
            before = cause.get("op"), cause.get("rule")
            shard = op.shard
            cause["op"] = op.name
            cause["rule"] = shard if isinstance(shard, str) else getattr(shard, "__name__", None)
            try:
                return plain_interpret(op, args, params)
            finally:
                cause["op"], cause["rule"] = before

        Module.__call__, autograd.record = call, record
        registry.register_interpreter(DTensor, interpret)
        observe.TRACKING = True

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users:
            return
        Module, plain_call, plain_record, DTensor, plain_interpret = cls._saved
        Module.__call__, autograd.record = plain_call, plain_record
        registry.register_interpreter(DTensor, plain_interpret)
        observe.TRACKING = False
        for key in ("module", "phase", "op", "rule"):
            observe.CAUSE.pop(key, None)
        observe.OWNERS.clear()

    @classmethod
    def path_of(cls, module) -> str:
        """``GPT.h.0.attn``: the caller's path and the name it holds ``module`` under (its
        class name at the top, or where the caller does not hold it)."""
        parent, prefix = cls._stack[-1] if cls._stack else (None, "")
        key = (id(parent), id(module))
        path = cls._paths.get(key)
        if path is None:
            name = next((n for n, m in parent.named_modules() if m is module and n), None) \
                if parent is not None else None
            name = name or type(module).__name__
            path = cls._paths[key] = f"{prefix}.{name}" if prefix else name
            if parent is None:  # a model called at the top: who holds each parameter
                for mod_path, m in module.named_modules():
                    for p in m._parameters.values():
                        if p is not None:
                            observe.OWNERS[id(p)] = f"{path}.{mod_path}" if mod_path else path
        return path


@contextmanager
def tracking():
    """The hooks, for a block that needs causes without an observer (compile's tracing)."""
    _Tracking.acquire()
    try:
        yield
    finally:
        _Tracking.release()


# ----------------------------------------------------------------------------- the mode

@dataclass(frozen=True)
class CommEvent:
    """One collective: kind, bytes (the debug counter's convention), the ranks of its group,
    and its cause: module path (``Global`` outside any), phase, op, sharding rule, placements."""

    kind: str
    bytes: int
    group: tuple
    module: str
    phase: str
    op: str | None
    rule: str | None
    placements: str | None
    site: str


class CommDebugMode:
    """Record the collectives of a block by module (see the module doc)."""

    def __init__(self):
        self.events: list[CommEvent] = []

    def __enter__(self) -> "CommDebugMode":
        self.events = []
        _Tracking.acquire()
        observe.OBSERVERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        observe.OBSERVERS.remove(self)
        _Tracking.release()

    def on_collective(self, entry, done: bool) -> None:
        if done or entry.kind in comm.UNCOUNTED:  # as count_collectives() counts
            return
        c = entry.cause or {}
        # a redistribute outside any op (a parallel wrapper's, a gradient's reduction) is its
        # own op: every DTensor collective comes with its placements
        op = c.get("op") or ("redistribute" if c.get("placements") else None)
        self.events.append(CommEvent(entry.kind, entry.bytes, tuple(entry.group),
                                     c.get("module") or "Global", c.get("phase") or "-", op,
                                     c.get("rule"), c.get("placements"), entry.site))

    # -- PyTorch's queries
    def get_total_counts(self) -> int:
        return len(self.events)

    def get_comm_counts(self) -> dict[str, int]:
        """kind -> count."""
        out: dict[str, int] = {}
        for e in self.events:
            out[e.kind] = out.get(e.kind, 0) + 1
        return out

    def get_comm_module_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """module path -> phase -> kind -> count, counting each module's descendants too
        (a block's row holds its attention's and MLP's collectives)."""
        return self._by_module(lambda e: 1)

    def get_comm_module_bytes(self) -> dict[str, dict[str, dict[str, int]]]:
        """As get_comm_module_counts, in bytes."""
        return self._by_module(lambda e: e.bytes)

    def _by_module(self, value) -> dict:
        out: dict = {}
        for e in self.events:
            for path in _ancestors(e.module):
                kinds = out.setdefault(path, {}).setdefault(e.phase, {})
                kinds[e.kind] = kinds.get(e.kind, 0) + value(e)
        return out

    def table(self, ops: bool = False) -> str:
        """The per-module table: a tree of module paths (in the order they first communicated),
        each phase's count and bytes per collective kind, totals at the bottom. ``ops``: under
        each module, its own collectives' ops, rules and placements too."""
        counts, nbytes = self.get_comm_module_counts(), self.get_comm_module_bytes()
        kinds = sorted({e.kind for e in self.events})
        order = list(dict.fromkeys(p for e in self.events for p in _ancestors(e.module)))
        label_w = max([len("module")] + [2 * p.count(".") + len(p.rsplit(".", 1)[-1]) + 2
                                          + len("(backward)") for p in order])
        cols = [f"{k} (n, bytes)" for k in kinds]
        width = [max(len(c), 20) for c in cols]
        lines = ["module".ljust(label_w) + "  " + "  ".join(c.rjust(w) for c, w in
                                                            zip(cols, width))]
        lines.append("-" * len(lines[0]))

        def row(label: str, n: dict, b: dict) -> str:
            return label.ljust(label_w) + "  " + "  ".join(
                (f"{n[k]}, {_size(b[k])}" if k in n else "").rjust(w)
                for k, w in zip(kinds, width))

        for path in sorted(order, key=_tree_key(order)):
            depth, name = path.count("."), path.rsplit(".", 1)[-1]
            for phase in ("forward", "backward", "-"):
                if phase in counts[path]:
                    tag = "" if phase == "-" else f" ({phase})"
                    lines.append(row("  " * depth + name + tag, counts[path][phase],
                                     nbytes[path][phase]))
            if ops:
                for e in dict.fromkeys((e.phase, e.kind, e.op, e.rule, e.placements)
                                       for e in self.events if e.module == path):
                    lines.append("  " * (depth + 1) + f"- {e[0]} {e[1]}: op {e[2] or '-'}, "
                                 f"rule {e[3] or '-'}, {e[4] or '-'}")
        total_n, total_b = self.get_comm_counts(), {}
        for e in self.events:
            total_b[e.kind] = total_b.get(e.kind, 0) + e.bytes
        lines.append("-" * len(lines[0]))
        lines.append(row("total", total_n, total_b))
        lines.append(f"{self.get_total_counts()} collectives, "
                     f"{_size(sum(total_b.values()))}")
        return "\n".join(lines)

    generate_comm_debug_tracing_table = table  # PyTorch's name

    def __str__(self) -> str:
        return self.table()


def _ancestors(path: str) -> list[str]:
    """``a.b.c`` -> [a, a.b, a.b.c]; Global alone."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _tree_key(order: list[str]):
    """Sort key: each path after its parent, siblings in first-seen order."""
    rank = {p: i for i, p in enumerate(order)}
    return lambda p: [rank[a] for a in _ancestors(p)]


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"
