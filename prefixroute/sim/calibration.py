"""The packaged calibration points: measured times the cost model was fitted to, and what a profile predicts.

Shared by :mod:`prefixroute.sim.costfit` (which fits and writes them; needs numpy) and
:mod:`prefixroute.sim.costplot` (which plots and tabulates them; needs matplotlib). Neither imports the other's
dependencies through this module: it needs only the standard library and the profiles.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

from prefixroute.sim.costmodel import Profile

__all__ = ["Measurement", "predicted_seconds", "read_measurements", "read_points"]


@dataclass(frozen=True)
class Measurement:
    """One measured point: a Vidur per-layer linear time or a SplitwiseSim prefill/decode time."""

    source: str  # "vidur" | "splitwise"
    kind: str  # "linear" | "prefill" | "decode"
    model: str
    gpu: str
    tp: int
    tokens: int  # linear: tokens; prefill: prompt tokens per sequence; decode: context per sequence
    batch: int
    seconds: float


def predicted_seconds(profile: Profile, m: Measurement) -> float:
    """What ``profile`` predicts for measurement ``m`` (same units as ``m.seconds``)."""
    if m.kind == "linear":
        return profile.linear_seconds(m.tokens)
    if m.kind == "prefill":
        return profile.step_seconds([(m.tokens, 0)] * m.batch, ())
    return profile.step_seconds((), [m.tokens] * m.batch)


def read_points() -> list[dict[str, str]]:
    """The packaged measured calibration points, one dict per CSV row."""
    text = resources.files("prefixroute.sim.data").joinpath("calibration_points.csv").read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


def read_measurements() -> list[Measurement]:
    """The packaged calibration points as :class:`Measurement` records."""
    return [
        Measurement(
            p["source"],
            p["kind"],
            p["model"],
            p["gpu"],
            int(p["tp"]),
            int(p["tokens"]),
            int(p["batch"]),
            float(p["seconds"]),
        )
        for p in read_points()
    ]
