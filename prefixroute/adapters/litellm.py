"""Prefix-aware deployment selection for a ``litellm.Router`` model group (extra ``prefixroute[litellm]``).

:class:`PrefixRouteHook` is a LiteLLM ``CustomLogger`` that uses two of LiteLLM's hooks:

* ``async_filter_deployments``, the pre-call filter LiteLLM runs on the deployments that are *not* cooling down:
  it routes the request's token ids among them with a :class:`~prefixroute.Router` and keeps only the chosen one
  (so LiteLLM's cooldowns, retries and fallbacks work as before), then commits and starts the decision;
* ``async_log_success_event`` and ``async_log_failure_event``: they finish it.

Each model group routes in a namespace of its own, its name, so a group serving a LoRA adapter never shares prefixes
with the base model's group or another adapter's, even where their deployments share ``model_info.id`` (to share
in-flight counts per server). Groups named in ``base_groups`` route in the router's own namespace instead, where KV
events of the base model land (:class:`~prefixroute.vllm.Fleet`).

The decision id travels in the request's ``metadata`` (``prefixroute_decision``), which LiteLLM hands to both.
A retry runs the filter again: the failed attempt's decision is finished, and the deployments that already failed
this request are passed over while others remain, so the retry lands elsewhere and every count is balanced.

>>> import litellm                                                                     # doctest: +SKIP
>>> hook = PrefixRouteHook(Router())                                                   # doctest: +SKIP
>>> litellm.logging_callback_manager.add_litellm_callback(hook)                        # doctest: +SKIP
>>> router = litellm.Router(model_list=[...])  # one model group, several vLLM servers  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from prefixroute.adapters.proxy.prompts import BadRequest, ByteEncoder, PromptEncoding, request_tokens
from prefixroute.router import Router

__all__ = ["METADATA_KEY", "PrefixRouteHook"]

METADATA_KEY = "prefixroute_decision"
"""The request metadata key that carries the decision id from the filter to the success or failure callback."""


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

    Requests it cannot read (no messages nor prompt, bad token ids) keep LiteLLM's own choice.
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
            raise TypeError(f"router must be a prefixroute.Router, not {type(router).__name__}")
        self.router = router
        self._encoder: PromptEncoding = encoder if encoder is not None else ByteEncoder()
        self._groups = None if model_groups is None else frozenset(model_groups)
        self._base_groups = frozenset(base_groups)
        self._lease = lease

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: list[Any] | None,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        """Keep the one deployment prefixroute chooses among ``healthy_deployments``. O(prompt + deployments)."""
        request = request_kwargs if request_kwargs is not None else {}
        metadata = request.get("metadata")
        if not isinstance(metadata, dict) or not healthy_deployments:
            return healthy_deployments
        earlier = metadata.pop(METADATA_KEY, None)
        if earlier is not None:  # a retry: the earlier attempt is over
            self.router.finish(earlier)
        if self._groups is not None and model not in self._groups:
            return healthy_deployments
        by_id = {i: d for d in healthy_deployments if (i := _deployment_id(d)) is not None}
        failed = {p.get("deployment_id") for p in metadata.get("previous_models") or () if isinstance(p, Mapping)}
        candidates = [i for i in by_id if i not in failed] or list(by_id)
        if not candidates:
            return healthy_deployments
        body = {"messages": messages} if messages else {"prompt": request.get("prompt")}
        try:
            tokens = request_tokens(body, chat=bool(messages), encoder=self._encoder)
            namespace = None if model in self._base_groups else model
            decision = self.router.route(tokens, candidates, namespace=namespace)
        except (BadRequest, ValueError, TypeError):  # ValueError: bad ids, messages a template refuses
            return healthy_deployments
        self.router.start(decision, lease=self._lease)
        metadata[METADATA_KEY] = decision.id
        return [by_id[decision.backend]]

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        """The attempt succeeded (for a stream: it ended): finish its decision."""
        self._finish(kwargs)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        """The attempt failed: finish its decision (a retry routes again)."""
        self._finish(kwargs)

    def _finish(self, kwargs: Any) -> None:
        params = kwargs.get("litellm_params") if isinstance(kwargs, Mapping) else None
        metadata = params.get("metadata") if isinstance(params, Mapping) else None
        if isinstance(metadata, Mapping) and isinstance(metadata.get(METADATA_KEY), str):
            self.router.finish(metadata[METADATA_KEY])


def _deployment_id(deployment: object) -> str | None:
    info = deployment.get("model_info") if isinstance(deployment, Mapping) else None
    identifier = info.get("id") if isinstance(info, Mapping) else None
    return identifier if isinstance(identifier, str) else None
