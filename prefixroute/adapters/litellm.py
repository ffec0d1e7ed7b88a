"""Prefix-aware deployment selection for a ``litellm.Router`` model group (extra ``prefixroute[litellm]``).

:class:`PrefixRouteHook` is a LiteLLM ``CustomLogger`` that uses two of LiteLLM's hooks:

* ``async_filter_deployments``, the pre-call filter LiteLLM runs on the deployments that are *not* cooling down:
  it routes the request's token ids among them with a :class:`~prefixroute.Router` and keeps only the chosen one
  (so LiteLLM's cooldowns, retries and fallbacks work as before), then commits and starts the decision;
* ``async_log_success_event`` and ``async_log_failure_event``: they finish it (refused, so the router forgets the
  blocks it predicted, when the failure is the engine's 4xx refusal, e.g. ``ContextWindowExceededError``);
* ``async_post_call_streaming_iterator_hook``, which the LiteLLM Proxy runs every stream through: it finishes a
  stream's decision when the stream ends, also when the proxy closes it for a client gone (no callback comes then);
* ``async_pre_call_deployment_hook``, run as each attempt is sent: it ties the decision to the call's logging object,
  which lives as long as the call and its stream, so a call whose callbacks never come (a stream its caller closed
  early or dropped) ends when that object is gone. A filter's decision that no attempt was sent for (LiteLLM failed
  the call after the filters, with no callback) ends, refused, at the task's next filter.

Each model group routes in a namespace of its own, its name, so a group serving a LoRA adapter never shares prefixes
with the base model's group or another adapter's, even where their deployments share ``model_info.id`` (to share
in-flight counts per server). Groups named in ``base_groups`` route in the router's own namespace instead, where KV
events of the base model land (:class:`~prefixroute.vllm.Fleet`). A call with vLLM's ``cache_salt`` (its own
argument or in ``extra_body``) routes in a namespace of that salt within its group's, as vLLM caches it apart.

The decision id travels in the request's ``metadata`` (``prefixroute_decision``, with its deployment in
``prefixroute_deployment``), which LiteLLM hands to both; a callback that names another deployment than the latest
attempt's is a failed attempt's, already finished by the retry, and is ignored. As each attempt is sent, the hook
also ties its decision to LiteLLM's id for the attempt (``litellm_call_id``, which its callbacks carry), so calls
that pass one shared ``metadata`` dict, which LiteLLM writes into, still each end their own decision.
A retry runs the filter again: the failed attempt's decision is finished, and the deployments that already failed
this request are passed over while others remain, so the retry lands elsewhere and every count is balanced. A hook
listed twice in ``litellm.callbacks`` (registered and appended by hand too) runs its filter twice in each filter pass:
the second run keeps the deployment the first chose, so an attempt is routed and committed once.

>>> import litellm                                                                     # doctest: +SKIP
>>> hook = PrefixRouteHook(Router())                                                   # doctest: +SKIP
>>> router = litellm.Router(model_list=[...])  # one model group, several vLLM servers  # doctest: +SKIP
>>> litellm.logging_callback_manager.add_litellm_callback(hook)  # after it: its filters go first  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import weakref
from collections.abc import AsyncGenerator, Collection, Mapping
from typing import Any

import cachetools
from litellm.integrations.custom_logger import CustomLogger

from prefixroute._arguments import check_lease
from prefixroute.adapters.proxy.prompts import (
    BadRequest,
    ByteEncoder,
    PromptEncoding,
    check_encoder,
    request_tokens_async,
)
from prefixroute.adapters.serve.contract import CHAT_OPTIONS, is_refusal, salted
from prefixroute.errors import InvalidTypeError, PolicyError
from prefixroute.router import Router

__all__ = ["DEPLOYMENT_KEY", "METADATA_KEY", "PrefixRouteHook"]

METADATA_KEY = "prefixroute_decision"
"""The request metadata key that carries the decision id from the filter to the success or failure callback."""

DEPLOYMENT_KEY = "prefixroute_deployment"
"""The request metadata key that names the deployment of the attempt :data:`METADATA_KEY` belongs to: LiteLLM shares
one metadata dict among a request's attempts, so a failed attempt's callback that runs after the retry's filter reads
the retry's decision; its own deployment (``litellm_params.model_info.id``) tells them apart."""

_log = logging.getLogger("prefixroute.litellm")

# Decisions one task may hold unfinished (streams of a long-lived task); past this the oldest is left to its lease,
# so a task that never ends cannot grow the table without end.
_MAX_PER_TASK = 1024
# Attempts whose callbacks have not come yet, by LiteLLM's call id; past this the oldest is forgotten (its callback
# then reads the request's metadata, as without the table, or its lease ends it).
_MAX_ATTEMPTS = 65_536
_UNSEEN: Any = object()
_ORDER = re.compile(r"[+-]?[0-9]+")  # an order spelled as a str, as LiteLLM takes it


class PrefixRouteHook(CustomLogger):
    """Choose the deployment of a LiteLLM model group that holds the request's prompt prefix (module docstring).

    Args:
        router: decides; its backend ids are the deployments' ``model_info.id``.
        encoder: text and chat messages to token ids (default: UTF-8 bytes; pass the model's tokenizer,
            :class:`~prefixroute.adapters.proxy.TokenizerEncoder`, so counts are in tokens).
        model_groups: the model groups to route (default: every group).
        base_groups: the groups that serve the base model itself: they route in the router's namespace (None);
            every other group in the namespace of its name.
        lease: seconds after which a request whose callbacks never came (a cancelled call) stops counting.

    Requests it cannot read (no messages nor prompt, bad token ids) keep LiteLLM's own choice. So does a request
    whose routing fails unexpectedly (an encoder or a policy that raises): the error is logged and counted in
    :attr:`errors`, never raised into LiteLLM.

    Raises:
        TypeError: ``router`` is not a :class:`~prefixroute.Router`, ``encoder`` lacks ``encode`` /
            ``encode_chat``, or ``model_groups`` / ``base_groups`` is not a collection of str (a single str is not).
        ConfigurationError: ``lease`` is not a positive, finite number of seconds or None.
    """

    def __init__(
        self,
        router: Router,
        *,
        encoder: PromptEncoding | None = None,
        model_groups: Collection[str] | None = None,
        base_groups: Collection[str] = (),
        lease: float | None = 600.0,
    ) -> None:
        super().__init__()
        if not isinstance(router, Router):
            raise InvalidTypeError(f"router must be a prefixroute.Router, not {type(router).__name__}")
        if encoder is not None:
            check_encoder(encoder)
        self.router = router
        self._encoder: PromptEncoding = encoder if encoder is not None else ByteEncoder()
        self._groups = None if model_groups is None else _group_names(model_groups, "model_groups")
        self._base_groups = _group_names(base_groups, "base_groups")
        self._lease = check_lease(lease)
        self.errors = 0
        """Requests whose routing failed unexpectedly (logged; they kept LiteLLM's choice)."""
        # The decisions not yet finished by a callback, by the task that made the call: LiteLLM calls no callback
        # for a call cancelled (a client gone, a timeout of the caller's), so the task's end finishes them (decision
        # id -> whether it is a stream: a stream is finished only by a cancelled task, see _task_done).
        self._by_task: weakref.WeakKeyDictionary[asyncio.Task[Any], dict[str, bool]] = weakref.WeakKeyDictionary()
        # decision id -> its task's table; a stream kept past its task's end stays here until it ends (the oldest
        # dropped past _MAX_ATTEMPTS, should their ends never come: then left to their leases, as unwatched).
        self._task_of: cachetools.LRUCache[str, dict[str, bool]] = cachetools.LRUCache(maxsize=_MAX_ATTEMPTS)
        # The decisions watched through their call's logging object (async_pre_call_deployment_hook), until ended.
        self._gone: dict[str, weakref.finalize[Any, Any]] = {}
        # litellm_call_id of an attempt -> its decision, from async_pre_call_deployment_hook to the callback.
        self._attempts: cachetools.LRUCache[str, str] = cachetools.LRUCache(maxsize=_MAX_ATTEMPTS)
        # task -> the decision its latest filter made (None: it kept LiteLLM's choice), read by the deployment hook.
        self._filtered: weakref.WeakKeyDictionary[asyncio.Task[Any], str | None] = weakref.WeakKeyDictionary()
        # task -> the request dict its latest filter was given: LiteLLM hands one dict to every filter of a pass, so
        # a hook listed twice in litellm.callbacks knows its second run in a pass (_same_pass).
        self._passes: weakref.WeakKeyDictionary[asyncio.Task[Any], object] = weakref.WeakKeyDictionary()
        # decision id -> the LiteLLM trace id of its call: a call's retries and fallbacks keep it, a new call of the
        # same task gets its own (and may share the earlier call's metadata dict, with its decision in it).
        self._traces: cachetools.LRUCache[str, str] = cachetools.LRUCache(maxsize=_MAX_ATTEMPTS)
        # The decisions ended already (a failure callback ends an attempt before its retry's filter finds its id).
        self._ended: cachetools.LRUCache[str, None] = cachetools.LRUCache(maxsize=_MAX_ATTEMPTS)
        self._tasks_lock = threading.Lock()

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: list[Any] | None,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        """Keep the one deployment prefixroute chooses among ``healthy_deployments``. O(prompt + deployments).

        Never raises: a request it cannot route keeps ``healthy_deployments`` as given."""
        decision_id = None
        try:
            again = self._same_pass(healthy_deployments, request_kwargs)
            if again is not None:
                kept, decision_id = again
                return kept
            self._end_unsent()
            kept, decision_id = await self._filter(model, healthy_deployments, messages, request_kwargs)
            return kept
        except Exception:  # an encoder or policy that raises, garbage LiteLLM never sends: keep LiteLLM's choice
            self.errors += 1
            _log.exception("prefixroute could not route a request to model group %r; LiteLLM chooses", model)
            return healthy_deployments
        finally:
            task = asyncio.current_task()
            if task is not None:  # for async_pre_call_deployment_hook, next in this task: this attempt's decision
                with self._tasks_lock:
                    self._filtered[task] = decision_id
                    self._passes[task] = request_kwargs

    def _same_pass(
        self, healthy_deployments: list[Any], request: dict[str, Any] | None
    ) -> tuple[list[Any], str] | None:
        """The deployment this task's previous filter kept, and its decision, if this is a second run of the filter
        in the same filter pass (the hook listed twice in ``litellm.callbacks``: LiteLLM hands every filter of a
        pass one request dict, and this run the deployments the first one kept); else None: route. O(deployments).

        A retry, or a call LiteLLM failed after the filters, is a pass of its own, with a request dict of its own."""
        task = asyncio.current_task()
        if task is None or request is None:
            return None
        with self._tasks_lock:
            decision_id = self._filtered.get(task)
            same = self._passes.get(task) is request
        metadata = request.get("metadata") if same else None
        if decision_id is None or not isinstance(metadata, Mapping) or metadata.get(METADATA_KEY) != decision_id:
            return None
        backend = metadata.get(DEPLOYMENT_KEY)
        if not healthy_deployments or any(_deployment_id(each) != backend for each in healthy_deployments):
            return None  # not what the first run kept (a filter between took it away): route among these
        return healthy_deployments[:1], decision_id

    def _end_unsent(self) -> None:
        """End the decision of this task's previous filter if no attempt was sent for it: LiteLLM failed that call
        after the filters (a later filter left nothing, every deployment over its rpm) and calls no callback then.
        Refused: it reached no engine, so none cached the blocks its commit predicted."""
        task = asyncio.current_task()
        with self._tasks_lock:
            unsent = self._filtered.pop(task, None) if task is not None else None
        if unsent is not None:
            self._unwatch(unsent)
            self.router.finish(unsent, refused=True)

    async def _filter(
        self, model: str, healthy_deployments: list[Any], messages: list[Any] | None, request: dict[str, Any] | None
    ) -> tuple[list[Any], str | None]:
        metadata = request.get("metadata") if isinstance(request, Mapping) else None
        if not isinstance(metadata, dict):
            return healthy_deployments, None
        earlier = metadata.pop(METADATA_KEY, None)
        metadata.pop(DEPLOYMENT_KEY, None)
        trace = request.get("litellm_trace_id") if isinstance(request, Mapping) else None
        if isinstance(earlier, str) and self._retried(earlier, trace):
            # a retry (or a fallback to another group): the earlier attempt is over. Another call's decision (its
            # metadata dict shared with this one) is left to its own callback.
            self._unwatch(earlier)
            self.router.finish(earlier)
        if not healthy_deployments or (self._groups is not None and model not in self._groups):
            return healthy_deployments, None
        by_id: dict[str, Any] = {}
        for deployment in _order_level(healthy_deployments, request):
            identifier = _deployment_id(deployment)
            if identifier is not None:
                by_id.setdefault(identifier, deployment)
        previous = metadata.get("previous_models")
        failed = {
            p.get("deployment_id")
            for p in (previous if isinstance(previous, (list, tuple)) else ())
            if isinstance(p, Mapping) and isinstance(p.get("deployment_id"), str)
        }
        candidates = [i for i in by_id if i not in failed] or list(by_id)
        if not candidates:
            return healthy_deployments, None
        body = _request_body(messages, request)
        stream = bool(request.get("stream")) if request else False  # before start(): nothing to undo if it raises
        try:
            tokens = await request_tokens_async(body, chat=bool(messages), encoder=self._encoder)
            namespace = salted(None if model in self._base_groups else model, body.get("cache_salt"))
            decision = self.router.route(tokens, candidates, namespace=namespace)
        except PolicyError:  # a bug in the policy (a TypeError too): logged by the caller, not taken for bad input
            raise
        except (BadRequest, ValueError, TypeError):  # ValueError: bad ids, messages a template refuses
            return healthy_deployments, None
        self.router.start(decision, lease=self._lease)
        metadata[METADATA_KEY] = decision.id
        metadata[DEPLOYMENT_KEY] = decision.backend
        if isinstance(trace, str):
            with self._tasks_lock:
                self._traces[decision.id] = trace
        self._watch(decision.id, stream=stream)
        return [by_id[decision.backend]], decision.id

    def _watch(self, decision_id: str, *, stream: bool) -> None:
        """Finish the decision when the task that made the call ends, should no callback come first."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop: LiteLLM awaits the filter, so never
            return
        coroutine = task.get_coro() if task is not None else None
        if task is None or getattr(coroutine, "cr_code", None) is PrefixRouteHook.async_filter_deployments.__code__:
            return  # the filter run as a task of its own (by hand, not by LiteLLM): its end is not the call's
        with self._tasks_lock:
            held = self._by_task.get(task)
            if held is None:
                held = self._by_task[task] = {}
                task.add_done_callback(self._task_done)
            held[decision_id] = stream
            self._task_of[decision_id] = held
            if len(held) > _MAX_PER_TASK:  # left to its lease
                self._task_of.pop(next(iter(held)), None)
                del held[next(iter(held))]

    def _retried(self, decision_id: str, trace: object) -> bool:
        """Whether the call being routed is a retry (or fallback) of the one ``decision_id`` was made for, whose
        attempt is not ended yet: made in this task, for the same LiteLLM trace id when both are known (a task's
        later call may pass the same metadata dict, with that decision in it, while the earlier call streams on)."""
        with self._tasks_lock:
            if decision_id in self._ended:
                return False  # its failure callback ended it before this retry's filter
            made_for = self._traces.get(decision_id)
        if isinstance(trace, str) and made_for is not None and trace != made_for:
            return False
        return self._of_this_task(decision_id)

    def _of_this_task(self, decision_id: str) -> bool:
        """Whether ``decision_id`` was made for a call of the running task (or no task watches it: a filter run by
        hand, as before)."""
        task = asyncio.current_task()
        with self._tasks_lock:
            held = self._task_of.get(decision_id)
            return held is None or task is None or held is self._by_task.get(task)

    def _unwatch(self, decision_id: str) -> None:
        """Forget ``decision_id`` as watched, as it ends (every end calls this, then the router's finish)."""
        with self._tasks_lock:
            self._ended[decision_id] = None
            held = self._task_of.pop(decision_id, None)
            if held is not None:
                held.pop(decision_id, None)
            gone = self._gone.pop(decision_id, None)
        if gone is not None:
            gone.detach()

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> None:
        """LiteLLM sends an attempt: end its decision when the call's logging object is gone, should no callback
        have ended it first (LiteLLM calls none for a stream its caller closes early or drops). Changes nothing in
        the request; never raises."""
        try:
            if not isinstance(kwargs, Mapping):
                return
            task = asyncio.current_task()
            with self._tasks_lock:  # the filter ran in this task just before, for this attempt
                decision_id = self._filtered.pop(task, _UNSEEN) if task is not None else _UNSEEN
                if task is not None:
                    self._passes.pop(task, None)
            if decision_id is _UNSEEN:  # sent without the filter in this task: the request's metadata says
                metadata = kwargs.get("metadata")
                decision_id = metadata.get(METADATA_KEY) if isinstance(metadata, Mapping) else None
            if not isinstance(decision_id, str):
                return
            call_id = kwargs.get("litellm_call_id")
            if isinstance(call_id, str):
                with self._tasks_lock:
                    self._attempts[call_id] = decision_id
            call = kwargs.get("litellm_logging_obj")
            if call is None:
                return
            gone = weakref.finalize(call, self._call_gone, asyncio.get_running_loop(), decision_id)
            gone.atexit = False
            with self._tasks_lock:
                earlier = self._gone.pop(decision_id, None)
                self._gone[decision_id] = gone
            if earlier is not None:
                earlier.detach()
        except Exception:  # a logging object that takes no weak reference, a Mapping whose get() raises
            self.errors += 1
            _log.exception("prefixroute could not watch a LiteLLM call")

    def _call_gone(self, loop: asyncio.AbstractEventLoop, decision_id: str) -> None:
        """A call's logging object was collected. That may happen on any thread, inside any lock it holds (the
        router's too, for a cyclic collection): the decision is ended from the loop's next iteration."""
        try:
            loop.call_soon_threadsafe(self._abandoned, decision_id)
        except RuntimeError:  # the loop is closed: nothing runs there any more, nor holds a lock
            if self._gone.pop(decision_id, None) is not None:
                self.router.finish(decision_id)

    def _abandoned(self, decision_id: str) -> None:
        with self._tasks_lock:
            if self._gone.pop(decision_id, None) is None:
                return  # ended otherwise first
        self._unwatch(decision_id)
        self.router.finish(decision_id)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """The calling task ended: its calls are over, except a stream of a task that was not cancelled (it may have
        returned it: ``create_task(router.acompletion(..., stream=True))``), which its success or failure callback
        ends, or the end of its logging object, or else its lease. The task's result is not read, so an exception
        nobody retrieved is still reported by asyncio as usual."""
        try:
            with self._tasks_lock:
                unsent = self._filtered.pop(task, None)
                self._passes.pop(task, None)
            if unsent is not None:  # filtered, never sent: LiteLLM failed the call after the filters (over its rpm,
                self._unwatch(unsent)  # its parallel requests) and calls no callback; a stream too, the task over
                self.router.finish(unsent, refused=True)
            cancelled = task.cancelled()
            with self._tasks_lock:
                held = self._by_task.pop(task, None) or {}
                ended = [decision_id for decision_id, stream in held.items() if cancelled or not stream]
                for decision_id in ended:
                    self._task_of.pop(decision_id, None)
                    self._ended[decision_id] = None
                    del held[decision_id]
                # A stream it returned stays in ``held``, no running task's now: a call that finds it in a shared
                # metadata dict leaves it to its own callback (_of_this_task); _unwatch forgets it then.
                watched = [self._gone.pop(decision_id, None) for decision_id in ended]
            for gone in watched:
                if gone is not None:
                    gone.detach()
            for decision_id in ended:
                self.router.finish(decision_id)
        except Exception:
            self.errors += 1
            _log.exception("prefixroute could not finish the requests of an ended task")

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        """The attempt succeeded (for a stream: it ended): finish its decision."""
        self._finish(kwargs)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        """The attempt failed: finish its decision (a retry routes again); refused when the exception's
        ``status_code`` is the engine's refusal (a 4xx: ``BadRequestError``, ``ContextWindowExceededError``), so the
        router forgets the blocks it predicted there."""
        self._finish(kwargs, failed=True)

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: Any
    ) -> AsyncGenerator[Any, None]:
        """LiteLLM Proxy: pass the stream through, then finish its decision when it ends, whether read to its end,
        failed, or closed by the proxy when its client went away (then LiteLLM calls no success or failure callback,
        and the request's task ends without being cancelled). Never raises an error of its own."""
        try:
            async for chunk in response:
                yield chunk
        finally:
            self._finish_stream(request_data)

    def _finish_stream(self, request_data: Any) -> None:
        try:
            metadata = request_data.get("metadata") if isinstance(request_data, Mapping) else None
            decision_id = metadata.get(METADATA_KEY) if isinstance(metadata, Mapping) else None
            if isinstance(decision_id, str):
                self._unwatch(decision_id)
                self.router.finish(decision_id)
        except Exception:  # a Mapping whose get() raises: log, count, go on
            self.errors += 1
            _log.exception("prefixroute could not finish a LiteLLM Proxy stream")

    def _finish(self, kwargs: Any, *, failed: bool = False) -> None:
        try:
            if not isinstance(kwargs, Mapping):
                return
            call_id = kwargs.get("litellm_call_id")
            with self._tasks_lock:
                decision_id = self._attempts.pop(call_id, None) if isinstance(call_id, str) else None
            if decision_id is None:  # an attempt the deployment hook did not see: the request's metadata says
                params = kwargs.get("litellm_params")
                metadata = params.get("metadata") if isinstance(params, Mapping) else None
                if not isinstance(metadata, Mapping) or not isinstance(metadata.get(METADATA_KEY), str):
                    return
                info = params.get("model_info") if isinstance(params, Mapping) else None
                used = info.get("id") if isinstance(info, Mapping) else None
                routed = metadata.get(DEPLOYMENT_KEY)
                if isinstance(used, str) and isinstance(routed, str) and used != routed:
                    return  # an earlier attempt's callback, after the retry's filter finished it and routed again
                decision_id = metadata[METADATA_KEY]
            status = getattr(kwargs.get("exception"), "status_code", None) if failed else None
            self._unwatch(decision_id)
            self.router.finish(decision_id, refused=type(status) is int and is_refusal(status))
        except Exception:  # a Mapping whose get() raises: log, count, go on
            self.errors += 1
            _log.exception("prefixroute could not finish a LiteLLM request")


def _group_names(groups: object, what: str) -> frozenset[str]:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Collection):
        raise InvalidTypeError(f"{what} must be a collection of model group names, not {type(groups).__name__}")
    for group in groups:
        if not isinstance(group, str):
            raise InvalidTypeError(f"{what} must hold model group names (str), not {type(group).__name__} ({group!r})")
    return frozenset(groups)


def _order_level(deployments: list[Any], request: Mapping[str, Any] | None) -> list[Any]:
    """The deployments LiteLLM picks among after the filters: those of ``litellm_params.order`` equal to the
    request's ``_target_order`` (its fallback to the next order), else to the lowest order given; all of them when
    none has that order. A filter that chose outside this level would send the request to a backup deployment."""
    orders = [_order(deployment) for deployment in deployments]
    target = request.get("_target_order") if isinstance(request, Mapping) else None
    if not isinstance(target, int) or isinstance(target, bool):
        target = min((order for order in orders if order is not None), default=None)
    level = [deployment for deployment, order in zip(deployments, orders, strict=True) if order == target]
    return level if target is not None and level else deployments


def _order(deployment: object) -> int | None:
    """A deployment's order as LiteLLM reads it: ``litellm_params.order``, else ``model_info.order`` (where models
    added through its API keep it); ``1``, ``True``, ``1.0`` and ``"1"`` all order 1; anything else, none."""
    if not isinstance(deployment, Mapping):
        return None
    params, info = deployment.get("litellm_params"), deployment.get("model_info")
    order = params.get("order") if isinstance(params, Mapping) else None
    if order is None:
        order = info.get("order") if isinstance(info, Mapping) else None
    if isinstance(order, int):  # bool too: True is order 1
        return int(order)
    if isinstance(order, float):
        return int(order) if order.is_integer() else None
    return int(order) if isinstance(order, str) and _ORDER.fullmatch(order) else None


def _deployment_id(deployment: object) -> str | None:
    info = deployment.get("model_info") if isinstance(deployment, Mapping) else None
    identifier = info.get("id") if isinstance(info, Mapping) else None
    return identifier if isinstance(identifier, str) else None


def _request_body(messages: list[Any] | None, request: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request vLLM gets for a LiteLLM call: a chat's messages, else the call's ``prompt``; with what else of it
    vLLM's tokenizing and caching follow (a chat's tools and template options, ``add_special_tokens``,
    ``cache_salt``), from the call or its ``extra_body`` (where LiteLLM sends vLLM's own fields). O(1) beside the
    messages."""
    request = request if isinstance(request, Mapping) else {}
    body: dict[str, Any] = {"messages": messages} if messages else {"prompt": request.get("prompt")}
    names = (*CHAT_OPTIONS, "add_special_tokens", "cache_salt") if messages else ("add_special_tokens", "cache_salt")
    extra = request.get("extra_body")
    for source in (request, extra if isinstance(extra, Mapping) else {}):
        body.update((name, source[name]) for name in names if name in source)
    return body
