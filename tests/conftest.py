"""Helpers every test folder shares (imported as ``from ..conftest import ...``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from prefixroute import Candidate, LoadPolicy, PrefixRouteError

if TYPE_CHECKING:
    from prefixroute.testing.openai_engine import OpenAIEngine

# Under CI the property tests and fuzz harnesses draw the same examples every run (derandomized), so a landing is
# judged on the examples that passed before it; run locally, they explore new ones each time (and keep what failed).
# The suite runs offline: any module that imports LiteLLM (a docs block, an example) uses its bundled price map
# instead of fetching one (the LiteLLM test modules also set this themselves, for a run of one file).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")

T = TypeVar("T")

DEADLINE_S = 10.0
"""How long a test waits for something another thread or process does (generous: CI machines are slow)."""


def wait_until(predicate: Callable[[], bool], *, timeout: float = DEADLINE_S, what: str = "condition") -> None:
    """Poll ``predicate`` every few ms until it holds; fail the test, naming ``what``, at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def returns(call: Callable[[], T], *, what: str) -> T:
    """``call()``, run on a thread of its own; fail the test, naming ``what``, when it has not returned after
    :data:`DEADLINE_S`. A guard against a hang, never a measure of speed: give the call a fault that lasts longer than
    that (an engine that answers minutes late), so that only the call's own timeout, far shorter, can end it and the
    test passes or fails alike on any machine."""
    outcome: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-returns", daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        pytest.fail(f"{what} had not returned after {DEADLINE_S}s: its own timeout did not end it")
    if errors:
        raise errors[0]
    return outcome[0]


def run_together(*jobs: Callable[[], object]) -> None:
    """Run each job on a thread of its own, all released at once; fail with what any of them raised."""
    barrier = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def run(job: Callable[[], object]) -> None:
        try:
            barrier.wait()
            job()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]


class TickingClock:
    """A thread-safe clock that moves ``step`` seconds at every reading (stress tests); ``now`` can be moved too."""

    def __init__(self, step: float = 1e-4) -> None:
        self.now = 0.0
        self._step = step
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += self._step
            return self.now


class FakeClock:
    """A clock the test moves by hand (``Router(clock=...)``)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def running_engines(count: int, **options: Any) -> Iterator[list[OpenAIEngine]]:
    """``count`` fake OpenAI engines (seeds 0, 1, ...; ``options`` for each) on loopback, stopped after the yield.

    For a fixture: ``yield from running_engines(3, max_tokens=4)``.
    """
    from prefixroute.testing.openai_engine import OpenAIEngine

    started = [OpenAIEngine(seed=i, **options).start() for i in range(count)]
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(autouse=True)
def _prefixroute_log_level() -> Iterator[None]:
    """Put the ``prefixroute`` logger's level back after each test: the ``serve`` command sets it (``--log-level``,
    default error), as a CLI does for its process, and a test that runs it in-process would otherwise hide the
    warnings later tests read."""
    logger = logging.getLogger("prefixroute")
    level = logger.level
    try:
        yield
    finally:
        logger.setLevel(level)


@pytest.fixture
def refused_port() -> Iterator[Callable[[], int]]:
    """Hand out loopback ports that refuse connections: each stays bound, not listening, until the test ends.

    A port bound and closed at once could be given to a server the test starts next (one was, and a proxy refused a
    backend named twice); a port held bound cannot, and connecting to it is refused all the same."""
    with contextlib.ExitStack() as held:

        def port() -> int:
            probe = held.enter_context(socket.socket())
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])

        yield port


@pytest.fixture
def switchy() -> Iterator[None]:
    """Force thread switches every few bytecodes, so races show up in a short run."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


class BuggyPolicy(LoadPolicy):
    """A policy with a bug: its ``choose()`` raises the ValueError a bad prompt raises too."""

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        raise ValueError("a bug in the policy")


class StrangerPolicy(LoadPolicy):
    """A policy that returns a candidate it was not given."""

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return candidates[0]._replace(backend="elsewhere")


class StrSubclass(str):
    """A str subclass, for fuzz harnesses: ids given as one must behave as the plain str."""


def hostile_values(atoms: Sequence[object]) -> st.SearchStrategy[object]:
    """A fuzz harness's hostile values: ``atoms`` (its own odd values), ints far outside any range, every float
    (NaN and infinities too), short texts, and lists of atoms."""
    return st.one_of(
        st.sampled_from(atoms),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.lists(st.sampled_from(atoms), max_size=3),
    )


def call_or_refuse(function: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Call ``function``; return whether it worked. An error of the library's tree is a refusal (False); any other
    error leaked from deep inside and fails the test."""
    try:
        function(*args, **kwargs)
    except PrefixRouteError:
        return False
    except Exception as exc:  # noqa: BLE001 - any other error is the defect a harness looks for
        name = getattr(function, "__qualname__", function)
        pytest.fail(f"{name}{args!r:.200}{kwargs!r:.100} leaked {exc!r:.300}")
    return True
