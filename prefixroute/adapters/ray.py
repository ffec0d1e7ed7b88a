"""Prefix-aware replica choice for Ray Serve deployments (extra ``prefixroute[ray]``).

:class:`PrefixRouteRequestRouter` is a ``ray.serve.request_router.RequestRouter``: Ray asks it to rank the replicas
for each request, and it ranks them with prefixroute's index and policy, on token ids (Ray's own prefix router
matches characters) and within the policy's load bound. A call with a ``multiplexed_model_id`` is ranked among the
replicas Ray's multiplexing offers (those that hold the model first), in a namespace of its own, the model id. It
plugs in through the deployment's ``request_router_config``::

    @serve.deployment(num_replicas=3, request_router_config=RequestRouterConfig(
        request_router_class="prefixroute.adapters.ray:PrefixRouteRequestRouter",
        request_router_kwargs={"policy": "bounded-load", "tokenizer": "/models/llama/tokenizer.json"}))
    class LLMServer: ...

How it pairs Ray's callbacks: each routing attempt is kept by itself, by its routing future (Ray gives every
retry of a request a fresh one): :meth:`choose_replicas` :meth:`Router.decide` s and counts the attempt in flight at
once (Ray routes many requests concurrently before it reports any of them routed); Ray asking again for the same
attempt replaces its decision, and a new attempt of the same request (Ray's retry after a rejection) ends the earlier
one. Calls that share a request id (a replica's downstream calls inherit its id) are apart attempts, each handed the
replica ranked for it. The routing future names the replica Ray sends the attempt to: the decision is committed
there (:meth:`Router.commit`; it may differ from prefixroute's first choice, and the count moves with it).
:meth:`on_request_routed` hands the count to that request's own result (its done callback); without such a result,
:meth:`on_request_completed` finishes it only when it names that same request *and* replica. A request Ray sends
without its rejection protocol (no :meth:`on_request_routed`: a Ray Client driver's handle, Java replicas, a
handle's ``choose_replica`` then ``dispatch``) ends with a completion notice of that request id from that replica. A
rejected attempt's notice (Ray sends one after a rejected send, none after a rejected reservation) ends the attempt
it names if it is still there; should it land once the retry went to the same replica, it ends the retry's count
until :meth:`on_request_routed` counts it again. A request its caller cancels before it is routed stops counting
when its routing future is cancelled; one that Ray stops ranking before handing it a replica (a pick-only
``choose_replica(..., _reserve=False)``) is committed to the replica ranked first and counts nothing. A reservation
never dispatched tells the request router nothing and counts until its lease (see docs/adapters.md).
Each process that holds a handle (every Serve proxy, every upstream replica) has its own router; they share no state
but place new prefixes alike (rendezvous hashing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from functools import partial
from typing import Any

from ray.serve.request_router import MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixroute._arguments import check_lease
from prefixroute.adapters.proxy.prompts import BadRequest, ByteEncoder, PromptEncoding, request_tokens_async
from prefixroute.adapters.serve.contract import salted
from prefixroute.errors import InvalidTypeError, PolicyError
from prefixroute.policies import policy_from_name
from prefixroute.router import Decision, Router

__all__ = ["PrefixRouteRequestRouter", "request_body"]

_log = logging.getLogger("prefixroute.ray")

# Requests whose routing has begun but not ended are few (bounded by Ray's queue); past this many the oldest
# undecided ones are dropped, so requests Ray abandons between choose and route cannot grow the table without end.
_MAX_PENDING = 10_000


def _finish_quietly(router: Router, decision_id: str, _result: object) -> None:
    """A result's done callback (Ray may run it on a thread of its own; :meth:`Router.finish` is thread-safe)."""
    try:
        router.finish(decision_id)
    except Exception:  # finish never raises; a done callback must not either
        _log.exception("prefixroute could not finish a completed request")


class _Attempt:
    """One routing attempt of one request (Ray's PendingRequest, again after each rejection with a fresh routing
    future), not yet routed: its decision, and the replica its routing future named (None until it did)."""

    __slots__ = ("committed", "decision", "future", "key", "replica", "request", "request_id")

    def __init__(self, decision: Decision, request: PendingRequest, future: Any) -> None:
        self.decision = decision
        # held while routing, so the ids the tables key it by stay its own (None once only a late notice may come)
        self.request: PendingRequest | None = request
        self.future = future
        self.key = id(request if future is None else future)  # see _attempt_key()
        self.request_id: str = request.metadata.internal_request_id
        self.replica: str | None = None
        self.committed = False


def _attempt_key(request: PendingRequest) -> int:
    """The attempt a request is at: its routing future (Ray's ``reset_future`` gives each retry its own)."""
    future = getattr(request, "future", None)
    return id(request if future is None else future)


def request_body(pending_request: PendingRequest | None) -> Mapping[str, Any] | None:
    """The OpenAI-style body of a Serve request: its first positional argument or its ``body`` keyword, when that
    is a dict with ``prompt`` or ``messages``; None otherwise (such requests are ranked by load alone).

    Raises:
        InvalidTypeError: ``pending_request`` is neither None nor a request with ``args`` and ``kwargs``.
    """
    if pending_request is None:
        return None
    args, kwargs = getattr(pending_request, "args", None), getattr(pending_request, "kwargs", None)
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence) or not isinstance(kwargs, Mapping):
        raise InvalidTypeError(
            f"request_body() takes a Ray Serve PendingRequest (args and kwargs) or None, not "
            f"{type(pending_request).__name__}"
        )
    for value in (*args[:1], kwargs.get("body"), kwargs):
        if isinstance(value, Mapping) and ("prompt" in value or "messages" in value):
            return value
    return None


class PrefixRouteRequestRouter(MultiplexMixin, RequestRouter):
    """Rank a deployment's replicas by prefixroute (see the module docstring).

    ``request_router_kwargs`` (JSON, from the deployment's ``RequestRouterConfig``) go to :meth:`initialize_state`:
    ``policy`` (a registry name, default ``"predicted-ttft"``, the library's), ``block_size`` (16), ``tokenizer``
    (the model's local folder or its ``tokenizer.json``; chat messages through its chat template when the folder has
    one; without it text routes on its UTF-8 bytes) and ``lease`` (seconds after which a request Ray never reports
    complete stops counting; default 600). Bad options raise there, when Ray builds the router: TypeError for a
    wrong type, :class:`~prefixroute.errors.ConfigurationError` for a bad value. ``clock`` (the router's, for the
    leases; ``time.monotonic``) is for tests that call :meth:`initialize_state` themselves: it is no JSON value, so
    no deployment's config can give one.

    Its callbacks never raise into Ray: a request it cannot route (no prompt, bad token ids, a policy or tokenizer
    that raises) keeps Ray's ranking; unexpected errors are logged and counted in :attr:`errors`.
    """

    def initialize_state(
        self,
        *,
        policy: str = "predicted-ttft",
        block_size: int = 16,
        tokenizer: str | None = None,
        lease: float | None = 600.0,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        """Build the router from ``request_router_kwargs`` (extra ``options`` go to the policy).

        Raises:
            TypeError: ``tokenizer`` is not a str (a path), ``clock`` is not callable, or ``policy`` / ``block_size``
                has a wrong type.
            ConfigurationError: an unknown policy or options it does not take, a bad ``block_size``, or ``lease``
                not a positive, finite number of seconds or None.
        """
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise InvalidTypeError(f"tokenizer must be a path (str) or None, not {type(tokenizer).__name__}")
        self._lease = check_lease(lease)
        self.router = Router(block_size=block_size, policy=policy_from_name(policy, **options), clock=clock)
        self._encoder: PromptEncoding = ByteEncoder()
        if tokenizer is not None:
            from prefixroute.adapters.serve.text import PromptEncoder

            self._encoder = PromptEncoder(tokenizer)
        self.errors = 0
        """Callbacks that failed unexpectedly (logged; the request kept Ray's ranking or stopped counting)."""
        # Routing attempts not yet routed, by _attempt_key; and each request's latest (by id of its PendingRequest).
        self._attempts: dict[int, _Attempt] = {}
        self._latest: dict[int, _Attempt] = {}
        # Attempts whose routing future named a replica, by internal request id (oldest first): a completion notice
        # from that replica for that id ends one (requests Ray sends without on_request_routed).
        self._sent: dict[str, dict[int, _Attempt]] = {}
        # Attempts a completion notice ended before Ray reported them routed (the notice was an earlier, rejected
        # attempt's, or another request's that shares the id): on_request_routed counts them again.
        self._noticed: dict[int, _Attempt] = {}
        self._started: dict[str, Decision] = {}  # by internal request id: routed with no result to watch
        self._listed: set[str] = set()  # the replicas of Ray's latest update_replicas
        self._max_pending = _MAX_PENDING

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Rank ``candidate_replicas``: prefixroute's choice first, then the rest (Ray tries them in turn)."""
        if not candidate_replicas:
            return []
        try:
            return await self._choose(candidate_replicas, pending_request)
        except Exception:  # a policy or tokenizer that raises: keep Ray's ranking, never fail the request
            self.errors += 1
            _log.exception("prefixroute could not rank replicas; Ray's ranking is kept")
            return [candidate_replicas]

    async def _choose(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        model = getattr(getattr(pending_request, "metadata", None), "multiplexed_model_id", None)
        if isinstance(model, str) and model and pending_request is not None:
            # As Ray's own router: the replicas that hold the model (widening as Ray asks again), in its namespace.
            allowed = self.apply_multiplex_routing(pending_request)
            candidate_replicas = [replica for replica in candidate_replicas if replica.replica_id in allowed]
            if not candidate_replicas:
                return []  # Ray backs off and asks again
        else:
            model = None
        body = request_body(pending_request)
        if body is None or pending_request is None:
            return [candidate_replicas]
        future: Any = getattr(pending_request, "future", None)
        key = _attempt_key(pending_request)
        again = self._attempts.get(key)
        if again is not None:  # the same attempt asked again (Ray backs off and asks while every replica is busy)
            self._end(again)
        elif (earlier := self._latest.get(id(pending_request))) is not None:
            self._end(earlier)  # a new attempt of the request (Ray's retry): the earlier one led nowhere
        try:
            tokens = await request_tokens_async(dict(body), chat="messages" in body, encoder=self._encoder)
            by_id: dict[str, RunningReplica] = {}
            for replica in candidate_replicas:
                by_id.setdefault(replica.replica_id.unique_id, replica)
            decision = self.router.decide(tokens, list(by_id), namespace=salted(model, body.get("cache_salt")))
        except PolicyError:  # a bug in the policy (a TypeError too): logged by the caller, not taken for bad input
            raise
        except (BadRequest, ValueError, TypeError):  # ValueError: bad ids, messages a template refuses
            return [candidate_replicas]
        if len(self._attempts) >= self._max_pending:
            self._end(next(iter(self._attempts.values())))
        # Counted at once: Ray routes many requests concurrently, before it reports any of them routed.
        self.router.start(decision, lease=self._lease)
        attempt = self._attempts[key] = self._latest[id(pending_request)] = _Attempt(decision, pending_request, future)
        if again is None and callable(getattr(future, "add_done_callback", None)):
            try:
                future.add_done_callback(partial(self._future_done, key))
            except BaseException:  # garbage Ray never sends: count nothing that no notice would end
                self._end(attempt)
                raise
        chosen = by_id[decision.backend]
        return [[chosen], [replica for replica in candidate_replicas if replica is not chosen]]

    def _end(self, attempt: _Attempt, *, keep: bool = False, refused: bool = False) -> None:
        """Stop counting ``attempt`` and forget it (``keep``: among the noticed, should Ray still report it routed;
        ``refused``: as :meth:`Router.finish` takes it)."""
        self.router.finish(attempt.decision, refused=refused)
        self._drop(attempt)
        if keep:
            if attempt.future is not None:  # its key (the future's id) stays its own without the request
                attempt.request = None  # whose arguments (the prompt) are not held for a report that may never come
            self._noticed[attempt.key] = attempt
            if len(self._noticed) > self._max_pending:
                del self._noticed[next(iter(self._noticed))]

    def _drop(self, attempt: _Attempt) -> None:
        """Forget ``attempt`` as not yet routed (its count is left as it is)."""
        self._attempts.pop(attempt.key, None)
        if attempt.request is not None and self._latest.get(id(attempt.request)) is attempt:
            del self._latest[id(attempt.request)]
        sent = self._sent.get(attempt.request_id)
        if sent is not None and sent.pop(attempt.key, None) is not None and not sent:
            del self._sent[attempt.request_id]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give ``replica`` to the request it was chosen for, as Ray's base router does: the pending request whose
        metadata this is; else, as Ray's, the one its index holds for that internal request id, or the oldest pending
        with that id.

        Ray's base router finds the request through an index that holds one request per id, dropped once that request
        is fulfilled: every call a replica makes downstream carries the replica's own id, so of several such calls at
        once the first was answered and the others routed on for ever, and a replica ranked for one call went to
        another (Ray's FIFO routers hand a replica to whichever request is first, which would undo the prefix
        routing). O(1) for a request the index holds; else O(pending).
        """
        pending = self._get_pending_request_matching_internal_request_id(request_metadata)
        if pending is not None and pending.metadata is not request_metadata:
            pending = next(
                (
                    queued
                    for queued in self._pending_requests_to_fulfill
                    if not queued.future.done() and queued.metadata is request_metadata
                ),
                pending,
            )
        if pending is None and request_metadata is not None:
            wanted = request_metadata.internal_request_id
            pending = next(
                (
                    queued
                    for queued in self._pending_requests_to_fulfill
                    if not queued.future.done() and queued.metadata.internal_request_id == wanted
                ),
                None,
            )
        if pending is None:
            return
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)

    async def _choose_replicas_with_backoff(
        self, pending_request: PendingRequest | None = None
    ) -> AsyncGenerator[list[RunningReplica], None]:
        """Ray's ranking loop for one request, as Ray runs it; when Ray stops asking before a replica was handed to the
        request, its attempt ends: committed to the replica ranked first (a pick-only selection, ``_reserve=False``:
        Ray's caller sends it there itself, and no notice will come), counting nothing."""
        key = None if pending_request is None else _attempt_key(pending_request)  # the attempt Ray asks for
        ranks = super()._choose_replicas_with_backoff(pending_request)
        try:
            async for rank in ranks:
                yield rank
        finally:
            await ranks.aclose()
            if key is not None:
                self._asked(key)

    def _asked(self, key: int) -> None:
        try:
            attempt = self._attempts.get(key)
            if attempt is None or (attempt.future is not None and attempt.future.done()):
                return
            # Ended as refused (it ran nowhere yet: no lifetime of milliseconds is learned, nothing is forgotten of a
            # decision never committed), then committed where the caller sends it.
            self._end(attempt, refused=True)
            self.router.commit(attempt.decision)
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not end a request Ray stopped routing")

    def _future_done(self, key: int, future: Any) -> None:
        """An attempt's routing future is done. Cancelled: its caller gave up before a replica took it. Else it names
        the replica Ray sends this attempt to: the count moves there, and should Ray send it without the rejection
        protocol (no :meth:`on_request_routed`: a Ray Client driver, Java replicas, a handle's ``choose_replica`` /
        ``dispatch``), that replica's completion notice ends it."""
        try:
            attempt = self._attempts.get(key)
            if attempt is None or attempt.future is not future:
                return
            if future.cancelled():
                self._end(attempt)
                return
            if future.exception() is not None:
                return
            used = getattr(getattr(future.result(), "replica_id", None), "unique_id", None)
            if not isinstance(used, str):
                return
            attempt.replica = used
            self._sent.setdefault(attempt.request_id, {})[key] = attempt
            if any(c.backend == used for c in attempt.decision.candidates):
                # Committed here, where it goes, also to the replica ranked first: a request Ray sends without
                # on_request_routed would otherwise teach the index nothing (its completion notice only ends it).
                moved = used != attempt.decision.backend
                attempt.decision = self.router.commit(attempt.decision, used)
                attempt.committed = True
                if moved:
                    self.router.start(attempt.decision, lease=self._lease)  # the count moves with it
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not follow a request's routing")

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Ray sent the request to ``replica_id``: commit the decision there and count it in flight until ``result``
        is done (or, for a result without ``add_done_callback``, until Ray's completion notice)."""
        super().on_request_routed(pending_request, replica_id, result)
        try:
            self._routed(pending_request, replica_id.unique_id, result)
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not record a routed request")

    def _routed(self, pending_request: PendingRequest, used: str, result: Any = None) -> None:
        key = _attempt_key(pending_request)
        attempt = self._attempts.get(key)
        noticed = attempt is None
        if attempt is not None:
            self._drop(attempt)  # its count goes on below, as the routed request's
        else:
            attempt = self._noticed.pop(key, None)  # a notice not its own ended it: it counts again
            if attempt is None:
                return
        decision = attempt.decision
        if not any(c.backend == used for c in decision.candidates):  # a replica Ray added since: not counted
            self.router.finish(decision)
            return
        # Committed again where it ended (a notice not its own): the router counts a start after an end only then.
        if noticed or not (attempt.committed and decision.backend == used):
            decision = self.router.commit(decision, used)
        # Ignored when already counted there; where Ray used another replica than the first ranked, the count moves.
        self.router.start(decision, lease=self._lease)
        if callable(getattr(result, "add_done_callback", None)):
            # Exact: this request's own result, whatever other requests share its id (every call a replica makes
            # downstream inherits that replica's request id) and whatever notices rejected attempts send.
            try:
                result.add_done_callback(partial(_finish_quietly, self.router, decision.id))
            except BaseException:  # garbage Ray never sends: nothing would end the count
                self.router.finish(decision)
                raise
            return
        request_id = attempt.request_id
        replaced = self._started.pop(request_id, None)
        if replaced is not None and replaced.id != decision.id:  # routed again, no completion notice between
            self.router.finish(replaced)
        self._started[request_id] = decision

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request ended on ``replica_id``: finish the one started there with that id (routed with no result to
        watch), else one sent there with that id and not reported routed (see :meth:`_future_done`)."""
        super().on_request_completed(replica_id, internal_request_id)
        try:
            used = replica_id.unique_id
            decision = self._started.get(internal_request_id)
            if decision is not None and decision.backend == used:
                del self._started[internal_request_id]
                self.router.finish(decision)
                return
            sent = self._sent.get(internal_request_id, {})
            attempt = next((a for a in sent.values() if a.replica == used), None)
            if attempt is not None:
                # Ray reports a rejected attempt's end too, a moment later, perhaps once its retry went to the same
                # replica: kept, so that on_request_routed, should it come, counts the request again.
                self._end(attempt, keep=True)
        except Exception:  # an unhashable id, a replica id without unique_id: garbage Ray never sends
            self.errors += 1
            _log.exception("prefixroute could not finish a completed request")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica is gone: forget its blocks and its requests."""
        super().on_replica_actor_died(replica_id)
        try:
            self._forget(replica_id.unique_id)
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not remove a dead replica")

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's set of replicas changed: forget those that left it (scaled down, replaced) as a dead one. Each new
        replica has a new id, so without this every replica an autoscaler ever removed would keep its blocks."""
        super().update_replicas(replicas)
        try:
            listed = {replica.replica_id.unique_id for replica in replicas}
            for gone in self._listed - listed:
                self._forget(gone)
            self._listed = listed
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not follow Ray's replicas")

    def _forget(self, replica: str) -> None:
        self.router.remove_backend(replica)
        for request_id in [i for i, d in self._started.items() if d.backend == replica]:
            del self._started[request_id]
