"""RankPool: N long-lived MPI ranks that run cloudpickled functions; ``spawn`` is a one-shot pool.

One mpiexec job runs ``bootstrap.py --worker`` on every rank. Each rank connects back to the
parent over an AF_UNIX socket in the job's private directory (multiprocessing.connection with a
random authkey; nothing listens on a network port), then loops: receive a task, run it, reply
``("ok", value)`` or ``("err", type name, traceback, time)``.

Failure handling, in the parent:
- a rank raises: wait ``grace`` seconds for the others; if all replied the pool stays usable,
  else the silent ones are stuck (in a collective waiting for the failed rank): dump their stacks,
  kill the job; the next ``run`` starts a new one.
- a rank returns while others still run: ``grace`` seconds on, if the others all sit in a
  blocking MPI call, at the same place in two looks, they wait for a rank that will never join:
  the same, with a message naming who returned.
- ``timeout``: SIGUSR1 every rank (faulthandler writes its Python stack), kill the job.
- a rank dies (EOF on its socket, mpiexec exits): report which, kill what is left.
"""
from __future__ import annotations

import io
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import types
from collections import ChainMap
from collections.abc import Callable, Mapping
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, ClassVar

import cloudpickle
from dtensor.launcher.bootstrap import ENV_AUTHKEY, ENV_CAPTURE
from dtensor.launcher.job import MpiJob, StuckWatch, find_mpiexec, pid_alive
from dtensor.launcher.job import ranks_text as _ranks


def _code_reduce(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return make, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    # cloudpickle names every code object's file "<dynamic-code>" (for reproducible bytes). The
    # ranks read the same files as this process, so keeping the real name gives a failing rank's
    # traceback its file, line and source text.
    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        {types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def _dumps(obj: Any) -> bytes:
    with io.BytesIO() as buf:
        _Pickler(buf).dump(obj)
        return buf.getvalue()


def _stacks_text(stacks: Mapping[int, str]) -> str:
    return "".join(f"--- rank {r} ---\n{s}" for r, s in sorted(stacks.items()))


class RankError(RuntimeError):
    """A run on the ranks failed: a rank raised, died, or the run timed out.

    Attributes:
        rank: the first rank that failed (by time), or None when none did (a timeout); for
            ranks left waiting in MPI by others that returned, the lowest of those.
        traceback: that rank's formatted traceback ("" for a timeout).
        failures: traceback of every rank that raised, by rank.
        exc_types: the exception type name of every rank that raised, by rank.
        stacks: Python stacks of the ranks that never replied, by rank.
        outputs: each rank's stdout/stderr during the run, by rank (pools with ``capture``).
    """

    def __init__(self, message: str, *, rank: int | None, traceback: str = "",
                 failures: Mapping[int, str] | None = None,
                 exc_types: Mapping[int, str] | None = None,
                 stacks: Mapping[int, str] | None = None,
                 outputs: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank, self.traceback = rank, traceback
        self.failures, self.stacks = dict(failures or {}), dict(stacks or {})
        self.exc_types = dict(exc_types or {})
        self.outputs = dict(outputs or {})


class RankTimeoutError(RankError):
    """The run did not finish within its timeout; ``stacks`` holds every rank's stack."""


class RankDiedError(RankError):
    """A rank process ended without replying (a crash, os._exit, SIGKILL)."""


class RankPool:
    """N MPI ranks kept alive between runs of cloudpickled functions.

    Args:
        nproc: number of ranks.
        capture: send each rank's stdout/stderr to a file of its own (returned in
            :attr:`last_output` and in errors) instead of this process's terminal.
        mpiexec: mpiexec to use (default: :func:`~dtensor.launcher.job.find_mpiexec`).
        env: extra environment variables for the ranks.
        grace: seconds to wait for the other ranks after one raised, or after one
            returned before looking whether the others wait for it in MPI.
        startup_timeout: seconds for every rank to start and connect.

    Example:
        >>> with RankPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(lambda x: int(os.environ["RANK"]) * x, 10)
        [0, 10]
    """

    def __init__(self, nproc: int, *, capture: bool = False, mpiexec: str | None = None,
                 env: Mapping[str, str] | None = None, grace: float = 2.0,
                 startup_timeout: float = 60.0) -> None:
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be a positive int (the number of ranks), got {nproc!r}")
        self.nproc, self.capture, self.grace = nproc, capture, grace
        self.startup_timeout = startup_timeout
        self._mpiexec = find_mpiexec(mpiexec)
        self._env = dict(env or {})
        self._job: MpiJob | None = None
        self._conns: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        self.last_output: dict[int, str] = {}

    @property
    def alive(self) -> bool:
        """True while the ranks are up and waiting for work."""
        proc = self._job.proc if self._job is not None else None
        return proc is not None and proc.poll() is None

    def start(self) -> None:
        """Start the ranks now (``run`` does it when needed); replaces a dead job."""
        if self.alive:
            return
        self.close()
        authkey = os.urandom(32)
        env = {**self._env, ENV_AUTHKEY: authkey.hex(), ENV_CAPTURE: "1" if self.capture else "0"}
        job = MpiJob(self.nproc, ["--worker"], mpiexec=self._mpiexec, prefix=not self.capture,
                     env=env)
        self._job = job
        listener = Listener(job.path("pool.sock"), family="AF_UNIX", backlog=self.nproc,
                            authkey=authkey)
        try:
            if self.capture:  # mpiexec's own messages (and output before a rank's redirect)
                with open(job.path("mpiexec.log"), "wb") as log:
                    job.start(stdout=log, stderr=subprocess.STDOUT)
            else:
                job.start()
            self._accept(listener, authkey)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _accept(self, listener: Listener, authkey: bytes) -> None:
        # accept() cannot time out, so it runs in a thread; on failure one dummy connection
        # wakes it up (its hello is an EOF) and it exits.
        assert self._job is not None and self._job.proc is not None
        arrivals: queue.Queue[Any] = queue.Queue()

        def accept_all() -> None:
            for _ in range(self.nproc):
                try:
                    conn = listener.accept()
                    arrivals.put((conn, conn.recv()))  # hello: (rank, pid)
                except Exception as exc:  # noqa: BLE001  (handed to the waiting thread)
                    arrivals.put(exc)
                    return

        thread = threading.Thread(target=accept_all, name="dtensor-pool-accept", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while len(self._conns) < self.nproc:
                try:
                    item = arrivals.get(timeout=0.05)
                except queue.Empty:
                    status = self._job.proc.poll()
                    if status is not None:
                        raise RuntimeError(f"the pool's mpiexec exited with status {status} before "
                                           f"all {self.nproc} ranks connected\n{self._log_tail()}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"only {len(self._conns)} of {self.nproc} ranks started "
                                           f"within {self.startup_timeout:g} s; raise "
                                           "startup_timeout on a loaded machine")
                    continue
                if isinstance(item, Exception):
                    raise RuntimeError(f"rank did not connect: {item!r}") from item  # noqa: TRY004
                conn, (rank, pid) = item
                self._conns[rank], self.pids[rank] = conn, pid
        finally:
            if thread.is_alive():
                try:
                    Client(listener.address, family="AF_UNIX", authkey=authkey).close()
                except OSError:
                    pass
                thread.join(timeout=2)

    def _log_tail(self, limit: int = 4000) -> str:
        return self._job.read("mpiexec.log")[-limit:] if self._job is not None else ""

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Args:
            fn: any function cloudpickle can send (closures and lambdas included).
            *args, **kwargs: its arguments (pickled once, the same on every rank).
            timeout: seconds before every rank's stack is taken and the job is killed.

        Returns:
            ``[result of rank 0, result of rank 1, ...]``.

        Raises:
            RankError: a rank raised (message: the first failing rank and its traceback);
                RankTimeoutError / RankDiedError for a timeout or a dead rank. After a timeout,
                a death or ranks stuck behind a failure the job is killed; the next run starts
                a new one.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        try:
            body = _dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"cannot send {fn!r} and its arguments to the ranks: {exc}") from exc
        self.start()
        try:
            return self._run(body, timeout)
        except RankError:
            raise
        except BaseException:
            # Interrupted mid-run (Ctrl-C, pytest-timeout): replies still in flight would be
            # read as the next run's, so this job cannot be reused.
            self.kill()
            raise

    def _run(self, body: bytes, timeout: float | None) -> list[Any]:
        job = self._job
        assert job is not None and job.proc is not None
        # Where each rank's output file ends now: what follows is this run's output.
        marks = {r: job.file_size(f"rank{r}.out") for r in range(self.nproc) if self.capture}
        message = pickle.dumps((list(sys.path), body))
        pending, died = set(range(self.nproc)), set()
        for rank, conn in self._conns.items():
            try:
                conn.send_bytes(message)
            except OSError:
                died.add(rank)
        results: dict[int, Any] = {}
        failures: dict[int, tuple[float, str, str]] = {}  # rank -> (time, type, traceback)
        start = time.monotonic()
        grace_end: float | None = None
        returned_at: float | None = None  # when a rank first returned while others still ran
        waits, stuck = StuckWatch(job), {}
        while pending and not died and not stuck:
            ends = [t for t in (grace_end, None if timeout is None else start + timeout) if t]
            now = time.monotonic()
            if ends and now >= min(ends):
                break
            slice_s = min([0.5, *(end - now for end in ends)])  # 0.5 s: notice a dead mpiexec
            ready = wait([self._conns[r] for r in pending], timeout=slice_s)
            for ready_conn in ready:
                rank = next(r for r, c in self._conns.items() if c is ready_conn)
                conn = self._conns[rank]
                try:
                    reply = cloudpickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    died.add(rank)
                    continue
                except Exception as exc:  # noqa: BLE001  (e.g. its class is not importable here)
                    why = f"rank {rank}: its return value could not be unpickled here: {exc!r}\n"
                    reply = ("err", type(exc).__name__, why, time.time())
                pending.discard(rank)
                if reply[0] == "ok":
                    results[rank] = reply[1]
                else:
                    failures[rank] = (reply[3], reply[1], reply[2])
            if not ready and job.proc.poll() is not None:
                died |= pending  # mpiexec is gone; nobody still pending can reply
            if died:
                # Look now: the rank that died first is gone, the ones hydra is about to kill
                # for it most likely are not yet.
                died = {r for r in died if not pid_alive(self.pids.get(r, -1))} or died
            if failures and grace_end is None:
                grace_end = time.monotonic() + self.grace
            if results and pending and not failures:
                returned_at = returned_at or time.monotonic()
                if time.monotonic() - returned_at >= self.grace:
                    stuck = waits.stuck(sorted(pending))
        outputs = {r: job.read(f"rank{r}.out", start) for r, start in marks.items()}
        self.last_output = {r: text for r, text in outputs.items() if text}
        if stuck:
            job.kill()
            returned = sorted(results)
            raise RankError(
                f"{_ranks(returned)} of {self.nproc} returned while {_ranks(stuck)} still ran, and "
                f"{self.grace:g} s later {'it waits' if len(stuck) == 1 else 'they wait'} in an "
                "MPI call that the returned ranks will never join (a collective that only some "
                "ranks call?); the pool was shut down. Python stacks:\n"
                + _stacks_text({r: s for r, (_, s) in stuck.items()}),
                rank=returned[0], stacks={r: s for r, (_, s) in stuck.items()},
                outputs=self.last_output)
        if not pending and not died and not failures:
            return [results[r] for r in range(self.nproc)]
        raise self._failure(failures, pending, died, timeout)

    def _failure(self, failures: dict[int, tuple[float, str, str]], pending: set[int],
                 died: set[int], timeout: float | None) -> RankError:
        assert self._job is not None
        tracebacks = {r: tb for r, (_, _, tb) in failures.items()}
        first = min(failures, key=lambda r: (failures[r][0], r)) if failures else None
        n = self.nproc
        if died:
            try:
                self._job.proc.wait(timeout=1)  # let hydra write why, for the message
            except subprocess.TimeoutExpired:
                pass
            self._job.kill()
            tail = self._log_tail()
            msg = (f"{_ranks(died)} of {n} died without replying (crash, os._exit or a signal); "
                   "the pool was shut down and is replaced on next use")
            parents = {(o["name"], o["pid"]) for o in self._job.records("orphan").values()}
            msg += "".join(f"\ntheir MPI process manager {name} (pid {pid}) had died (killed?)"
                           for name, pid in sorted(parents))
            msg += f"\nmpiexec said:\n{tail}" if tail.strip() else ""
            return RankDiedError(msg, rank=min(died), traceback=tracebacks.get(min(died), ""),
                                 failures=tracebacks, outputs=self.last_output)
        if first is None:  # nobody raised, somebody is late: the timeout
            stacks = self._job.dump_stacks()
            self._job.kill()
            msg = (f"the run did not finish within {timeout:g} s ({_ranks(pending)} of {n} still "
                   f"running: a deadlock?); Python stack of every rank:\n{_stacks_text(stacks)}")
            return RankTimeoutError(msg, rank=None, failures=tracebacks, stacks=stacks,
                                    outputs=self.last_output)
        msg = f"rank {first} of {n} raised {failures[first][1]}:\n{tracebacks[first]}"
        others = sorted(set(failures) - {first})
        if others:
            msg += f"(also failed: {_ranks(others)})\n"
        stuck: dict[int, str] = {}
        if pending:
            stuck = {r: s for r, s in self._job.dump_stacks().items() if r in pending}
            self._job.kill()
            msg += (f"{_ranks(pending)} had not finished {self.grace:g} s after rank {first} "
                    f"failed (waiting for it in a collective?); the pool was shut down. Their "
                    f"Python stacks:\n{_stacks_text(stuck)}")
        return RankError(msg, rank=first, traceback=tracebacks[first], failures=tracebacks,
                         exc_types={r: f[1] for r, f in failures.items()}, stacks=stuck,
                         outputs=self.last_output)

    def kill(self) -> None:
        """End the ranks now, without waiting for them; the next ``run`` starts new ones."""
        if self._job is not None:
            self._job.kill()
        self.close()

    def close(self) -> None:
        """Stop the ranks (they finalise MPI together) and remove the job's files."""
        job, self._job = self._job, None
        if job is None:
            return
        if job.proc is not None and job.proc.poll() is None:
            for conn in self._conns.values():
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
            try:
                job.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for conn in self._conns.values():
            conn.close()
        self._conns, self.pids = {}, {}
        job.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None,
          **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` fresh MPI ranks; return their results in rank order.

    Args:
        fn: any function cloudpickle can send (closures and lambdas included).
        nproc: number of ranks.
        *args, **kwargs: arguments for ``fn``.
        timeout: seconds before every rank's stack is taken and the job is killed.

    Returns:
        ``[result of rank 0, ..., result of rank nproc-1]``.

    Raises:
        RankError: a rank raised; the message names it and carries its traceback.

    Example:
        >>> spawn(lambda: int(os.environ["RANK"]) ** 2, 3)  # doctest: +SKIP
        [0, 1, 4]
    """
    with RankPool(nproc) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
