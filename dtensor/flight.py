"""The flight recorder: each rank's last collectives, and a watchdog that reports a hang.

Every collective a Comm issues is an :class:`Entry` in a ring of the last ``DTENSOR_FLIGHT_N``
(default 64): its sequence number on its group, kind, shape, dtype, bytes, the user's source
line that led to it, what caused it (``observe.CAUSE``: module, op, placements), and when it
started and ended. ``WAITING`` is the entry the main thread blocks in right now.

A watchdog thread (started with the first collective) looks every half second. When the main
thread has waited in one collective for ``DTENSOR_WATCHDOG_S`` seconds (default 300; ``0`` or
``inf``: off), or when dtlaunch asks (a ``flight.request`` file in its launch directory: another
rank's watchdog fired, or dtlaunch got SIGUSR1), the rank writes ``rank{r}.flight`` there: its
ring, the entry it waits in, and its main thread's Python stack. dtlaunch reads every rank's and
prints one diagnosis (launcher/cli.py). Outside dtlaunch the rank prints its own report to stderr
and exits with status 124.
"""
from __future__ import annotations

import ast
import collections
import json
import os
import socket
import sys
import threading
import time
import traceback

from dtensor.errors import OWN_DIRS

__all__ = ["Entry", "RING", "WAITING", "watchdog_seconds", "snapshot", "describe", "REQUEST",
           "ENV_FLIGHT"]

REQUEST = "flight.request"  # in the launch directory: every rank dumps its ring once
ENV_FLIGHT = "DTENSOR_LAUNCH_FLIGHT"  # "1": dtlaunch gathers the reports (set by dtlaunch)


class Entry:
    """One collective of this rank (see the module doc)."""

    __slots__ = ("seq", "kind", "group", "shape", "dtype", "bytes", "site", "cause", "start",
                 "end", "slot")
    FIELDS = __slots__[:-1]

    def __init__(self, seq, kind, group, shape, dtype, nbytes, site, cause):
        self.seq, self.kind, self.group, self.shape = seq, kind, group, shape
        self.dtype, self.bytes, self.site, self.cause = dtype, nbytes, site, cause
        self.start, self.end, self.slot = time.time(), None, 0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.FIELDS}
        d["dtype"] = _name(self.dtype)
        return d


_NAMES: dict = {}


def _name(dtype) -> str:
    """A dtype's name, cached: numpy's str(dtype) runs Python code (microseconds)."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype)
    return name


def record(e: Entry) -> None:
    """A collective starts (comm.py): into the ring, and under dtlaunch onto the rank's disk
    ring too."""
    global _count
    RING.append(e)
    if _disk is None:
        _open_disk()
    if _disk:
        e.slot = _count % SLOTS
        _count += 1
        _persist(e)


def ended(e: Entry) -> None:
    e.end = time.time()
    if _disk:
        _disk[e.slot * SLOT] = _DONE  # the line's first byte: R(unning) -> D(one)


# The disk ring: ``rank{r}.ring`` in dtlaunch's launch directory, memory-mapped, holds this
# rank's last SLOTS collectives, one line each, written as they start and end. It outlives
# the process: when MPI aborts a rank from inside a collective (MPICH does so for some
# mismatched sizes, with no Python left to run), dtlaunch still reads which call it was in,
# and what the other ranks called at that place (launcher/hang.py's post_mortem).
SLOTS, SLOT = 8, 512
_DONE = ord("D")
_disk = None  # the mmap; False: none (not under dtlaunch)
_count = 0


def _open_disk() -> None:
    global _disk
    where = _launch_dir()
    if where is None:
        _disk = False
        return
    import mmap
    path = os.path.join(where, f"rank{os.environ.get('RANK', '0')}.ring")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SLOTS * SLOT)
        _disk = mmap.mmap(fd, SLOTS * SLOT)
    finally:
        os.close(fd)


_LINES: dict = {}  # what a collective's line holds besides its number and time, encoded


def _persist(e: Entry) -> None:
    placements = (e.cause or {}).get("placements") or ""
    key = (e.kind, e.group, e.shape, e.dtype, e.bytes, e.site, placements)
    body = _LINES.get(key)
    if body is None:  # a training loop repeats its collectives: made once each
        if len(_LINES) > 4096:
            _LINES.clear()
        body = _LINES[key] = (f"{e.kind}\t{e.group}\t{e.shape}\t{_name(e.dtype)}\t{e.bytes}\t"
                              f"{e.site}\t{placements}\t").encode()[:SLOT - 64]
    line = b"R\t%d\t%s%r\n\0" % (e.seq, body, e.start)
    _disk[e.slot * SLOT:e.slot * SLOT + len(line)] = line


def read_disk_ring(path: str) -> list[dict]:
    """A rank's disk ring as entries (as_dict's keys), oldest first; [] if there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    out = []
    for i in range(0, len(data), SLOT):
        text = data[i:i + SLOT].split(b"\0", 1)[0].decode(errors="replace")
        parts = text.rstrip("\n").split("\t")
        if len(parts) != 10:
            continue
        state, seq, kind, group, shape, dtype, nbytes, site, placements, start = parts
        out.append({"seq": int(seq), "kind": kind, "group": list(ast.literal_eval(group)),
                    "shape": list(ast.literal_eval(shape)), "dtype": dtype,
                    "bytes": int(nbytes), "site": site,
                    "cause": {"placements": placements} if placements else None,
                    "start": float(start), "end": float(start) if state == "D" else None})
    return sorted(out, key=lambda e: e["start"])


RING: collections.deque = collections.deque(maxlen=max(1, int(os.environ.get("DTENSOR_FLIGHT_N",
                                                                            "64"))))
WAITING: Entry | None = None  # set around each blocking wait (comm.py)


def watchdog_seconds() -> float:
    """DTENSOR_WATCHDOG_S: seconds in one collective before the ranks dump (default 300)."""
    text = os.environ.get("DTENSOR_WATCHDOG_S", "300")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"DTENSOR_WATCHDOG_S={text!r} must be a number of seconds (0 or inf: "
                         f"no watchdog).") from None
    return value if value > 0 else float("inf")


# ----------------------------------------------------------------------------- where

_SKIP = OWN_DIRS + ("<",)  # and frozen modules (runpy)

def user_site(depth: int = 2) -> str:
    """``file:line`` of the innermost frame outside the framework (the user's call; a
    compiled graph's generated file, ``dtc_*.py``, is the framework's too)."""
    f = sys._getframe(depth)
    last = None
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_SKIP) and "dtc_" not in name:
            return f"{name}:{f.f_lineno}"
        last = f
        f = f.f_back
    return f"{last.f_code.co_filename}:{last.f_lineno}" if last is not None else "?"


# ----------------------------------------------------------------------------- the watchdog

watchdog: threading.Thread | None = None
_main_ident = threading.main_thread().ident
_BOOTSTRAP = os.path.join("launcher", "bootstrap.py")


def start_watchdog() -> None:
    """Start the watchdog thread once (comm.py calls it with the first collective)."""
    global watchdog
    if watchdog is not None:
        return
    limit = watchdog_seconds()  # a bad value raises here, in the caller's thread
    watchdog = threading.Thread(target=_watch_loop, args=(limit,), name="dtensor-flight",
                                daemon=True)
    watchdog.start()


def snapshot(why: str) -> dict:
    """This rank's report: its ring, what it waits in, its main thread's Python stack."""
    frame = sys._current_frames().get(_main_ident)
    # the launcher's frames (its bootstrap, runpy) above the user's script tell nothing
    frames = [f for f in (traceback.extract_stack(frame) if frame is not None else [])
              if not (f.filename.startswith("<frozen") or f.filename.endswith(_BOOTSTRAP))]
    stack = "".join(traceback.format_list(frames)) or "(no Python frames)"
    waiting = WAITING
    return {"rank": int(os.environ.get("RANK", "0")), "host": socket.gethostname(),
            "pid": os.getpid(), "why": why, "time": time.time(),
            "waiting": waiting.as_dict() if waiting is not None else None,
            "ring": [e.as_dict() for e in list(RING)], "stack": stack}


def _launch_dir() -> str | None:
    d = os.environ.get("DTENSOR_LAUNCH_DIR")
    return d if d and os.environ.get(ENV_FLIGHT) == "1" else None


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _watch_loop(limit: float) -> None:
    where = _launch_dir()
    rank = int(os.environ.get("RANK", "0"))
    dumped = False
    while True:
        time.sleep(0.5)
        w = WAITING
        fired = w is not None and time.time() - w.start > limit
        asked = where is not None and os.path.exists(os.path.join(where, REQUEST))
        if dumped or not (fired or asked):
            continue
        why = (f"waited {time.time() - w.start:.1f} s in {w.kind} #{w.seq} "
               f"(DTENSOR_WATCHDOG_S={limit:g})") if fired else "asked by dtlaunch"
        report = snapshot(why)
        if where is None:  # no launcher to gather the ranks' reports: say what we know, end
            sys.stderr.write(format_rank(report))
            sys.stderr.flush()
            os._exit(124)
        _write(os.path.join(where, f"rank{rank}.flight"), json.dumps(report))
        if fired and not asked:
            _write(os.path.join(where, REQUEST), json.dumps({"rank": rank, "why": why}))
        dumped = True


def describe(e: dict) -> str:
    """One line for a ring entry: ``all_reduce #5 (4, 8) float32 on ranks [0, 1] at f.py:12``."""
    cause = e.get("cause") or {}
    extra = "".join(f", {k} {v}" for k, v in cause.items() if v)
    return (f"{e['kind']} #{e['seq']} {tuple(e['shape'])} {e['dtype']} on ranks "
            f"{list(e['group'])} at {e['site']}{extra}")


def format_rank(report: dict) -> str:
    """A rank's report as text (what a rank prints outside dtlaunch)."""
    lines = [f"dtensor flight recorder, rank {report['rank']} ({report['host']}): "
             f"{report['why']}\n"]
    if report["waiting"]:
        lines.append(f"  waiting in {describe(report['waiting'])}\n")
    lines.append(f"  last {len(report['ring'])} collectives, oldest first:\n")
    lines += [f"    {describe(e)}{'' if e['end'] else '  (not finished)'}\n"
              for e in report["ring"]]
    lines.append("  Python stack of the main thread:\n")
    lines += ["    " + line + "\n" for line in report["stack"].rstrip("\n").split("\n")]
    return "".join(lines)
