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

How it pairs Ray's callbacks: :meth:`choose_replicas` may run several times for one request (every routing attempt
after replicas reject it); each run :meth:`Router.decide` s afresh, counts the request in flight at once (Ray routes
many requests concurrently before it reports any of them routed) and keeps the latest decision by request id,
finishing the earlier attempt's. :meth:`on_request_routed` names the replica Ray actually used: the decision is
committed there (:meth:`Router.commit`; it may differ from prefixroute's first choice, and the count moves with it)
and counts until that request's own result is done (its done callback), so requests sharing an id (calls a replica
makes downstream inherit its request id) and notices of rejected attempts never finish another; without such a
result, :meth:`on_request_completed` finishes it only when it names that same request *and* replica. The routing
future Ray resolves for each attempt names the replica it sends that attempt to: the count moves there at once, and a
request Ray sends without its rejection protocol (no :meth:`on_request_routed`: a Ray Client driver's handle, Java
replicas, a handle's ``_choose_replica`` then ``_dispatch``) ends with that replica's completion notice. A request its
caller cancels before it is routed stops counting when its routing future is cancelled. Each process that holds a
handle (every Serve proxy, every upstream replica) has its
own router; they share no state but place new prefixes alike (rendezvous hashing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
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
    """A request's latest routing attempt not yet routed: its decision, its routing future, and the replica that
    future named (None until it did) with whether the decision was committed there."""

    __slots__ = ("committed", "decision", "future", "replica")

    def __init__(self, decision: Decision, future: Any) -> None:
        self.decision = decision
        self.future = future
        self.replica: str | None = None
        self.committed = False


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
        # By internal request id: the latest attempt, not yet routed (its decision, the routing future it watches, and
        # the replica that future named, once it did).
        self._decided: dict[str, _Attempt] = {}
        self._started: dict[str, Decision] = {}  # by internal request id: committed and in flight
        # By internal request id: the replicas its earlier attempts were sent to (and rejected there) whose completion
        # notices have not come yet; Ray sends each from a worker thread, a moment after its retry may have gone to
        # that same replica, and such a notice is the rejected attempt's, not the retry's.
        self._owed: dict[str, list[str]] = {}
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
        request_id = pending_request.metadata.internal_request_id
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
        earlier = self._decided.pop(request_id, None)
        if earlier is not None:  # an earlier attempt for this request led nowhere
            self.router.finish(earlier.decision)
            if earlier.replica is not None:  # sent there and rejected: its completion notice is still to come
                self._owed.setdefault(request_id, []).append(earlier.replica)
                if len(self._owed) > self._max_pending:
                    del self._owed[next(iter(self._owed))]
        if len(self._decided) >= self._max_pending:
            self.router.finish(self._decided.pop(next(iter(self._decided))).decision)
        # Counted at once: Ray routes many requests concurrently, before it reports any of them routed.
        self.router.start(decision, lease=self._lease)
        future: Any = getattr(pending_request, "future", None)
        self._decided[request_id] = _Attempt(decision, future)
        if (earlier is None or earlier.future is not future) and callable(getattr(future, "add_done_callback", None)):
            try:
                future.add_done_callback(partial(self._future_done, request_id))
            except BaseException:  # garbage Ray never sends: count nothing that no notice would end
                self._decided.pop(request_id, None)
                self.router.finish(decision)
                raise
        chosen = by_id[decision.backend]
        return [[chosen], [replica for replica in candidate_replicas if replica is not chosen]]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give ``replica`` to the request it was chosen for, as Ray's base router does, matched by internal request
        id; among requests sharing that id, to the oldest still pending.

        Ray's base router finds the request through an index that holds one request per id, dropped once that request
        is fulfilled: every call a replica makes downstream carries the replica's own id, so of several such calls at
        once the first was answered and the others routed on for ever (Ray's FIFO routers hand a replica to whichever
        request is first, which would undo the prefix routing). O(1); O(pending) only when the index lost the id.
        """
        pending = self._get_pending_request_matching_internal_request_id(request_metadata)
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

    def _future_done(self, request_id: str, future: Any) -> None:
        """The request's routing future is done. Cancelled: its caller gave up before a replica took it. Else it
        names the replica Ray sends this attempt to: the count moves there, and should Ray send it without the
        rejection protocol (no :meth:`on_request_routed`: a Ray Client driver, Java replicas, a handle's
        ``_choose_replica`` / ``_dispatch``), that replica's completion notice ends it."""
        try:
            attempt = self._decided.get(request_id)
            if attempt is None or attempt.future is not future:
                return
            if future.cancelled():
                del self._decided[request_id]
                self.router.finish(attempt.decision)
                return
            if future.exception() is not None:
                return
            used = getattr(getattr(future.result(), "replica_id", None), "unique_id", None)
            if not isinstance(used, str):
                return
            attempt.replica = used
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
            self._routed(pending_request.metadata.internal_request_id, replica_id.unique_id, result)
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not record a routed request")

    def _routed(self, request_id: str, used: str, result: Any = None) -> None:
        attempt = self._decided.pop(request_id, None)
        if attempt is None:
            return
        decision = attempt.decision
        if not any(c.backend == used for c in decision.candidates):  # a replica Ray added since: not counted
            self.router.finish(decision)
            return
        if not (attempt.committed and decision.backend == used):
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
        replaced = self._started.pop(request_id, None)
        if replaced is not None and replaced.id != decision.id:  # routed again, no completion notice between
            self.router.finish(replaced)
        self._started[request_id] = decision

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request ended on ``replica_id``: finish it if it is the one started there (else a rejected attempt)."""
        super().on_request_completed(replica_id, internal_request_id)
        try:
            owed = self._owed.get(internal_request_id)
            if owed is not None and replica_id.unique_id in owed:  # an earlier, rejected attempt's notice
                owed.remove(replica_id.unique_id)
                if not owed:
                    del self._owed[internal_request_id]
                return
            decision = self._started.get(internal_request_id)
            if decision is not None and decision.backend == replica_id.unique_id:
                del self._started[internal_request_id]
                self.router.finish(decision)
                return
            attempt = self._decided.get(internal_request_id)
            if attempt is not None and attempt.replica is not None and attempt.replica == replica_id.unique_id:
                del self._decided[internal_request_id]  # sent with no on_request_routed (see _future_done)
                self.router.finish(attempt.decision)
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
