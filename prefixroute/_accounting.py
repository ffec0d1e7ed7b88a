"""The router's work accounting: per-backend figures that lifecycle calls keep in O(1) or O(log n) each.

:class:`~prefixroute.Router` owns them (a :class:`Footprint` per backend, one :class:`AttentionFit` for the fleet, a
:class:`StartedRequest` per request in flight) and the lock that guards them; nothing here locks, reads a clock or
logs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ANCHORS", "AttentionFit", "Footprint", "StartedRequest", "anchor_keys"]

# The attention fit weighs each earlier first token this much less than the next one (unit-free: about the last 50
# count), takes no fit whose two figures are this close to proportional (a squared correlation over 1 - this), and
# none whose pairs' coefficient is fewer standard errors than this from 0.
_FIT_MEMORY = 0.98
_FIT_COLLINEAR = 1e-6
_FIT_SIGNIFICANCE = 3.0


class AttentionFit:
    """A fleet-wide least-squares fit, with forgetting, of each request's wait for its first token on the prefill
    queued ahead of it (its own included) in tokens and in token × context pairs: ``wait ≈ a × tokens + b × pairs``.
    ``tokens`` is ``a / b``, the context length at which a prefill token's attention costs as much as the rest of its
    compute: None until both figures are positive and ``b`` is :data:`_FIT_SIGNIFICANCE` standard errors from 0 (where
    waits do not grow with context, or noise hides how, nothing is fitted). O(1) a first token.

    Errors are relative: each wait is weighed by ``1 / max(wait, predicted wait)²``, so that no first token moves the
    fit by more than a relative error of 1, late or early. The prediction is the fit's so far; without one (before
    the first fit, or coefficients not both positive) the fleet's mean seconds a token (forgetting as the fit does)
    times the tokens; the very first wait only seeds that mean, as nothing yet says whether it is early or late.
    Plain least squares let one late first token on a long prompt (a 40K-token prompt 3 s late: a pause of the
    gateway's) make the figure confidently wrong (1.5 to 4.6 times off) for 330 to 440 first tokens, long prompts
    weighing thousands of times more than short ones; weighed by the wait alone, a first token reported early (at the
    response's headers) as the very first one weighed so much that the figure stayed None for 800 first tokens."""

    __slots__ = ("_coefficients", "_rate", "_sums", "tokens")

    def __init__(self) -> None:
        # Σ w·x1², Σ w·x1·x2, Σ w·x2², Σ w·x1·y, Σ w·x2·y, Σ w·y², Σ 1, each observation weighed by its age
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self._coefficients = (0.0, 0.0)
        self._rate = (0.0, 0.0)  # Σ y, Σ x1 weighed by age: their ratio is the mean seconds a token
        self.tokens: float | None = None

    def add(self, tokens: int, pairs: int, seconds: float) -> None:
        x1, x2, y, f = float(tokens), float(pairs), seconds, _FIT_MEMORY
        a, b = self._coefficients
        waited, worked = self._rate
        predicted = a * x1 + b * x2 if a > 0.0 and b > 0.0 else waited / worked * x1 if worked > 0.0 else math.nan
        rate = f * waited + y, f * worked + x1
        if not (math.isfinite(rate[0]) and math.isfinite(rate[1])):  # a clock gone wrong: not learned
            return
        self._rate = rate
        if math.isnan(predicted):  # the first wait: nothing says yet whether it came early or late
            return
        scale = max(y, predicted)
        w = 1.0 / scale / scale if scale > 0.0 else math.inf  # an infinite weight (a wait of ~0 s): not learned
        s11, s12, s22, s1y, s2y, syy, n = self._sums
        sums = (
            f * s11 + w * x1 * x1,
            f * s12 + w * x1 * x2,
            f * s22 + w * x2 * x2,
            f * s1y + w * x1 * y,
            f * s2y + w * x2 * y,
            f * syy + w * y * y,
            f * n + 1.0,
        )
        if not all(map(math.isfinite, sums)):  # a prompt of billions of tokens, or a clock gone wrong: not learned
            return
        self._sums = s11, s12, s22, s1y, s2y, syy, n = sums
        self.tokens = None
        det = s11 * s22 - s12 * s12
        if n <= 2.0 or not det > _FIT_COLLINEAR * s11 * s22:  # too few, or the two figures move together
            return
        a, b = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
        self._coefficients = a, b
        residual = max(0.0, syy - a * s1y - b * s2y) / (n - 2.0)
        if a > 0.0 and b > 0.0 and b * b * det > _FIT_SIGNIFICANCE**2 * residual * s11:
            self.tokens = a / b if math.isfinite(a / b) else None


def _anchor_depths(limit: int = 1 << 26) -> tuple[int, ...]:
    """Block positions where :class:`Footprint` samples prompts: every block up to 8, then 1/4 further each."""
    depths = [0]
    while depths[-1] < limit:
        depths.append(depths[-1] + max(1, depths[-1] // 4))
    return tuple(depths)


# Anchors grow by a quarter, so a prompt of n blocks has O(log n) of them (28 at 512 blocks, 42 at 12K) and an
# estimate counts twice at most the quarter of a prompt between the anchor before two prompts part and that block.
ANCHORS = _anchor_depths()


class Footprint:
    """Distinct KV blocks of one backend's in-flight requests, a prefix they share counted once (an estimate).

    A request's blocks past its matched prefix are its own (the backend computes them for it). Its matched prefix is
    cut at anchor blocks (:data:`ANCHORS`) into segments, each keyed by the chained hash of its last block: prefixes
    whose hash agrees there share that whole segment (and all before it), so it is counted once. The estimate never
    falls short of the exact count; it is exact for one request and for requests that share whole matched prefixes
    (one system prompt, one document), and counts twice the part of a segment before two matched prefixes part, and
    a prefix that one request is still computing while another already matches it. A matched prefix is cut into
    segments once, when the first request in flight holds it; ``add``/``remove`` are O(1) for the requests that
    share it then (the common case: a system prompt), O(log n) for one of n blocks held by no other.
    """

    __slots__ = ("_groups", "_prefixes", "blocks")

    def __init__(self) -> None:
        self.blocks = 0
        self._groups: dict[int, list[int]] = {}  # segment key -> [segment length, matched prefixes holding it]
        # A whole matched prefix's key (its last block's hash) -> [requests holding it, its segment keys].
        self._prefixes: dict[int, list[Any]] = {}

    def add(self, hashes: Sequence[int], total: int, matched: int) -> tuple[int | None, int]:
        """Count a request of ``total`` blocks whose first ``matched`` blocks are cached; ``hashes``: its full blocks.

        Returns what :meth:`remove` needs to take exactly this request back: its matched prefix's key (None: it
        matched nothing) and its own blocks.
        """
        end = min(matched, len(hashes))
        if end <= 0:
            self.blocks += total
            return None, total
        prefix = hashes[end - 1]
        held = self._prefixes.get(prefix)
        if held is not None:
            held[0] += 1
            self.blocks += total - end
            return prefix, total - end
        keys = anchor_keys(hashes, end)
        groups = self._groups
        added = total - end
        for key, length in keys:
            group = groups.get(key)
            if group is None:
                groups[key] = [length, 1]
                added += length
            else:
                group[1] += 1
        self._prefixes[prefix] = [1, keys]
        self.blocks += added
        return prefix, total - end

    def remove(self, taken: tuple[int | None, int]) -> None:
        """Stop counting a request: ``taken`` is what :meth:`add` returned for it."""
        prefix, removed = taken
        if prefix is not None:
            held = self._prefixes[prefix]
            held[0] -= 1
            if not held[0]:
                del self._prefixes[prefix]
                groups = self._groups
                for key, _ in held[1]:
                    group = groups[key]
                    group[1] -= 1
                    if not group[1]:
                        removed += group[0]
                        del groups[key]
        self.blocks -= removed

    def _check(self, requests: Iterable[tuple[Sequence[int], int, tuple[int | None, int]]]) -> None:
        """Assert that the counts are what ``requests`` add up to: for each one in flight, its block hashes, its
        total blocks and what :meth:`add` returned for it (its matched prefix and segments are recomputed from its
        hashes). For tests; O(their matched blocks' anchors)."""
        prefixes: dict[int, list[Any]] = {}
        own = 0
        for hashes, total, (prefix, blocks) in requests:
            own += blocks
            end = total - blocks
            assert prefix == (hashes[end - 1] if end > 0 else None), prefix
            if prefix is not None:
                prefixes.setdefault(prefix, [0, anchor_keys(hashes, end)])[0] += 1
        assert self._prefixes == prefixes, (self._prefixes, prefixes)
        groups: dict[int, list[int]] = {}  # segment key -> [length, matched prefixes holding it]
        for _, keys in prefixes.values():
            for key, length in keys:
                groups.setdefault(key, [length, 0])[1] += 1
        assert self._groups == groups, (self._groups, groups)
        assert self.blocks == own + sum(length for length, _ in groups.values()), self.blocks


def anchor_keys(hashes: Sequence[int], end: int) -> tuple[tuple[int, int], ...]:
    """The segments of the matched prefix ``hashes[:end]`` (``end`` ≥ 1), cut at :data:`ANCHORS`: each one's key
    (the hash of its last block) and length in blocks. O(log end)."""
    depths = ANCHORS
    keys = []
    position = 0
    while depths[position] < end:
        depth = depths[position]
        position += 1
        stop = min(depths[position], end)
        keys.append((hashes[stop - 1], stop - depth))
    return tuple(keys)


class StartedRequest:
    """One started request: what it adds to its backend's counters, so finish() takes exactly that back."""

    __slots__ = (
        "backend",
        "blocks",
        "context",
        "context_before",
        "deadline",
        "footprint",
        "hashes",
        "held",
        "pending_before",
        "prefilling",
        "started_at",
        "uncached",
    )

    def __init__(
        self,
        backend: str,
        uncached: int,
        blocks: int,
        pending_before: int,
        started_at: float,
        deadline: float | None,
        footprint: tuple[int | None, int],
        hashes: Sequence[int],
        held: int,
        context: int,
        context_before: int,
    ) -> None:
        self.backend = backend
        self.uncached = uncached
        self.context = context  # its prefill's token × context pairs (see Candidate.pending_prefill_context)
        self.context_before = context_before
        self.blocks = blocks
        self.pending_before = pending_before
        self.started_at = started_at
        self.deadline = deadline
        self.footprint = footprint  # its matched prefix's key and own blocks in the backend's Footprint
        self.hashes = hashes  # its prompt's block hashes (the decision's own, not a copy), for a refusal
        self.held = held  # blocks its backend held at commit: a refusal retracts the rest (-1: never committed)
        self.prefilling = True
