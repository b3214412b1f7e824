"""Multi-rank pytest tests: ``@pytest.mark.ranks(N, timeout=None)`` runs the body on N MPI ranks.

Loaded by pytest through the ``pytest11`` entry point ``dtensor``. Example::

    @pytest.mark.ranks(2)
    def test_allreduce(rank, world_size):
        from mpi4py import MPI
        assert MPI.COMM_WORLD.allreduce(rank) == world_size * (world_size - 1) // 2

How it runs: one :class:`~dtensor.launcher.RankPool` per N, started by the first test that needs
it and reused by the next ones (start-up is what costs; a warm run is milliseconds). The test
function travels by value (cloudpickle, the test module registered for pickling by value), so the
ranks never import the test module, and pytest's assertion rewriting comes along with it.

Fixtures: ``rank``, ``world_size``, ``comm`` (``dtensor.comm.get_world()``), ``capsys`` (that
rank's sys.stdout/sys.stderr, with pytest's ``readouterr()``) and ``monkeypatch`` (undone on the
rank when the body ends) are evaluated on each rank; every other fixture the test asks for is
evaluated here and pickled over (tmp_path, ...).

Failures: any rank raising fails the test, naming the first failing rank and showing its
traceback; a test still running after its timeout (marker ``timeout=``, else the ini option
``dtensor_rank_timeout``, else 60 s) fails with every rank's Python stack; so does a rank dying.
After a timeout, a death, or ranks stuck behind a failed one, the pool is killed and the next
test gets a fresh one. Each rank's stdout/stderr goes to a file of its own (never into pytest's
capture) and is attached to the report as "Captured rank N output".
"""
from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from dtensor.launcher.pool import RankPool

RANK_SIDE_FIXTURES = ("rank", "world_size", "comm", "capsys", "monkeypatch")
DEFAULT_TIMEOUT = 60.0
_POOLS = pytest.StashKey[dict[int, "RankPool"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("dtensor_rank_timeout", type="string", default=str(DEFAULT_TIMEOUT),
                  help="seconds before a @pytest.mark.ranks test is failed with every rank's "
                       "stack (default 60; the marker's timeout= wins)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ranks(n, timeout=None): run the test body on n MPI ranks; fixtures rank, "
                   "world_size, comm and capsys are evaluated on each rank, timeout in seconds "
                   "(default: ini dtensor_rank_timeout, 60) (dtensor.testing.plugin)")
    config.stash[_POOLS] = {}


def pytest_unconfigure(config: pytest.Config) -> None:
    for pool in config.stash.get(_POOLS, {}).values():
        pool.close()
    config.stash[_POOLS] = {}


def _marker_args(item: pytest.Function, marker: pytest.Mark) -> tuple[int, float]:
    nproc = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        pytest.fail(f"@pytest.mark.ranks needs a positive number of ranks, got {nproc!r}; "
                    "e.g. @pytest.mark.ranks(2)", pytrace=False)
    timeout = marker.kwargs.get("timeout")
    if timeout is None:
        raw = item.config.getini("dtensor_rank_timeout")
        try:
            timeout = float(raw)
        except ValueError:
            pytest.fail(f"ini option dtensor_rank_timeout must be a number of seconds, got "
                        f"{raw!r}; e.g. dtensor_rank_timeout = 120", pytrace=False)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        pytest.fail(f"@pytest.mark.ranks timeout must be a positive number of seconds, got "
                    f"{timeout!r}; e.g. @pytest.mark.ranks(2, timeout=30)", pytrace=False)
    return nproc, float(timeout)


def _rank_side(request: pytest.FixtureRequest, name: str) -> Any:
    if request.node.get_closest_marker("ranks") is None:
        pytest.fail(f"the {name!r} fixture exists only on the ranks of a test marked "
                    f"@pytest.mark.ranks(N); mark {request.node.name} or drop the fixture",
                    pytrace=False)
    return f"<{name}: evaluated on each rank>"  # a placeholder, replaced on the rank


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """This rank's number in MPI.COMM_WORLD (tests marked ``@pytest.mark.ranks(N)`` only)."""
    return _rank_side(request, "rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks N (tests marked ``@pytest.mark.ranks(N)`` only)."""
    return _rank_side(request, "world_size")


@pytest.fixture
def comm(request: pytest.FixtureRequest) -> Any:
    """``dtensor.comm.get_world()`` on each rank (tests marked ``@pytest.mark.ranks(N)`` only)."""
    return _rank_side(request, "comm")


def run_test_body(fn: Any, parent_args: dict[str, Any], rank_side: list[str]) -> None:
    """On a rank: evaluate the rank-side fixtures and call the test function."""
    __tracebackhide__ = True  # the worker leaves this frame out of the reported traceback
    kwargs = dict(parent_args)
    if rank_side:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        # monkeypatch is made here and undone after the body: the pooled ranks outlive the
        # test, and one made in the pytest process would undo its changes there, not here.
        makers = {"rank": world.Get_rank, "world_size": world.Get_size, "capsys": _RankCapsys,
                  "monkeypatch": pytest.MonkeyPatch}
        for name in rank_side:
            if name == "comm":
                from dtensor.comm import get_world

                kwargs[name] = get_world()
            else:
                kwargs[name] = makers[name]()
    capture = kwargs.get("capsys")
    patch = kwargs.get("monkeypatch")
    try:
        with capture if isinstance(capture, _RankCapsys) else contextlib.nullcontext():
            fn(**kwargs)
    finally:
        if isinstance(patch, pytest.MonkeyPatch):
            patch.undo()


class _Tee(io.TextIOBase):
    # Writes go to the capture buffer and on to the rank's own output (shown in the report).
    def __init__(self, stream: Any, buffer: io.StringIO) -> None:
        self._stream, self._buffer = stream, buffer

    def write(self, text: str) -> int:
        self._buffer.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, ...
        return getattr(self._stream, name)


class _RankCapsys:
    """``capsys`` on a rank: ``readouterr()`` returns what this rank printed since the last call.

    pytest's own capsys lives in the pytest process and cannot travel; this one mirrors its
    ``readouterr()`` / ``disabled()`` for the rank's sys.stdout and sys.stderr.
    """

    def __init__(self) -> None:
        self._out, self._err = io.StringIO(), io.StringIO()
        self._saved: tuple[Any, Any] = (sys.stdout, sys.stderr)

    def __enter__(self) -> _RankCapsys:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._out), _Tee(sys.stderr, self._err)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout, sys.stderr = self._saved

    def readouterr(self) -> Any:
        from _pytest.capture import CaptureResult

        result = CaptureResult(self._out.getvalue(), self._err.getvalue())
        for buffer in (self._out, self._err):
            buffer.seek(0)
            buffer.truncate()
        return result

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        captured = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = self._saved
        try:
            yield
        finally:
            sys.stdout, sys.stderr = captured


def _register_by_value(fn: Any) -> None:
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", ""))
    # A test module is not importable on the ranks (rootdir-relative names, pytester's tmp
    # dirs) and need not be: send its functions by value.
    if module is not None and module.__name__ not in ("__main__", "builtins"):
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:  # not registrable (no __name__ in sys.modules): pickle by reference
            pass


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    from dtensor.launcher.pool import RankError, RankPool  # only when a multi-rank test runs

    nproc, timeout = _marker_args(pyfuncitem, marker)
    # What pytest itself would pass to the function (its own pytest_pyfunc_call does the same).
    names = pyfuncitem._fixtureinfo.argnames
    parent_args = {n: pyfuncitem.funcargs[n] for n in names if n not in RANK_SIDE_FIXTURES}
    rank_side = [n for n in names if n in RANK_SIDE_FIXTURES]
    _register_by_value(pyfuncitem.obj)
    pools = pyfuncitem.config.stash[_POOLS]
    if nproc not in pools:
        pools[nproc] = RankPool(nproc, capture=True)
    pool = pools[nproc]
    failure: RankError | None = None
    unsendable: str | None = None
    try:
        pool.run(run_test_body, pyfuncitem.obj, parent_args, rank_side, timeout=timeout)
    except RankError as err:
        failure = err
    except TypeError:  # cannot pickle: say which fixture, if it is one
        unsendable = _unpicklable_fixture(parent_args)
        if unsendable is None:
            raise
    if unsendable is not None:
        pytest.fail(unsendable, pytrace=False)
    _attach_outputs(pyfuncitem, failure.outputs if failure else pool.last_output)
    if failure is None:
        return True
    # Outside `except`, so the report shows the ranks' story, not this plugin's frames.
    skipped = [tb for r, tb in failure.failures.items() if failure.exc_types[r] == "Skipped"]
    if len(skipped) == nproc:  # pytest.skip() on every rank skips the test
        pytest.skip(skipped[0].rstrip().rsplit("Skipped: ", 1)[-1])
    pytest.fail(f"{nproc}-rank test failed: {failure}", pytrace=False)


def _unpicklable_fixture(parent_args: dict[str, Any]) -> str | None:
    import cloudpickle

    for name, value in parent_args.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001  (any pickling failure: name the fixture)
            return (f"fixture {name!r} ({type(value).__name__}) cannot be sent to the ranks: "
                    f"{exc}. Fixtures other than rank, world_size, comm, capsys and monkeypatch "
                    "are made in the pytest process and pickled over; use a picklable one, or "
                    "build the object inside the test body")
    return None


def _attach_outputs(item: pytest.Function, outputs: dict[int, str]) -> None:
    for rank_, text in sorted(outputs.items()):
        item.add_report_section("call", f"rank {rank_} output", text)
