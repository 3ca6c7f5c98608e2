"""Baseline thread policies of paper 004, §3–4, as decision rules on the phase-blind layout.

* π(k): at most k threads in total, later stages first (requests at stage i have priority over
  stage j when i ≥ j), FCFS within a stage.
* π(k1,…,kN): at most k_i threads at stage i, independently.
* π(∞): every request gets a thread at once — Apache's default.

FCFS within a stage is exact in law through the phase-blind layout: starting a uniformly chosen
waiting request (its phase drawn from α_i when it starts) gives FCFS's queue-length law, and lets
the waiting requests of a stage be lumped into one count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import ModelError

IntArray = npt.NDArray[np.int64]

_NAME = re.compile(r"^pi\(\s*(inf|\d+(?:\s*,\s*\d+)*)\s*\)$")


@dataclass(frozen=True)
class Baseline:
    """A parsed baseline name: ``pi(k)``, ``pi(k1,...,kN)`` or ``pi(inf)``."""

    name: str
    total: int | None  # π(k): k; π(∞): None
    per_stage: tuple[int, ...] | None  # π(k1,…,kN)

    @staticmethod
    def parse(name: str, n_stages: int) -> Baseline:
        m = _NAME.match(name.strip().replace("∞", "inf").replace("π", "pi"))
        if not m:
            raise ModelError(
                f"policy {name!r} is not a baseline name; use pi(k), pi(k1,...,kN) or pi(inf)"
            )
        body = m.group(1)
        if body == "inf":
            return Baseline("pi(inf)", None, None)
        ks = tuple(int(x) for x in body.split(","))
        if any(k < 1 for k in ks):
            raise ModelError(f"policy {name!r}: thread caps must be >= 1")
        if len(ks) == 1 and n_stages > 1:
            return Baseline(f"pi({ks[0]})", ks[0], None)
        if len(ks) != n_stages:
            raise ModelError(
                f"policy {name!r} gives {len(ks)} per-stage caps but the scenario has {n_stages} stages"
            )
        if n_stages == 1:
            return Baseline(f"pi({ks[0]})", ks[0], None)
        return Baseline("pi(" + ",".join(map(str, ks)) + ")", None, ks)

    @property
    def max_threads(self) -> int | None:
        if self.total is not None:
            return self.total
        if self.per_stage is not None:
            return sum(self.per_stage)
        return None

    def rule(self, queue_stage: IntArray, coord_stage: IntArray):  # type: ignore[no-untyped-def]
        """Vectorised rule: rows (w per stage, k per coordinate) → threads to start per stage."""
        Q = queue_stage.size
        N = int(coord_stage.max()) + 1

        def threads_per_stage(rows: IntArray) -> IntArray:
            k = rows[:, Q:]
            out = np.zeros((rows.shape[0], N), dtype=np.int64)
            for i in range(N):
                out[:, i] = k[:, coord_stage == i].sum(axis=1)
            return out

        if self.total is None and self.per_stage is None:
            return lambda rows: rows[:, :Q].copy()

        if self.per_stage is not None:
            caps = np.asarray(self.per_stage, dtype=np.int64)

            def per_stage_rule(rows: IntArray) -> IntArray:
                room = np.maximum(caps[None, :] - threads_per_stage(rows), 0)
                capped: IntArray = np.minimum(rows[:, :Q], room[:, queue_stage])
                return capped

            return per_stage_rule

        total = int(self.total)  # type: ignore[arg-type]

        def total_rule(rows: IntArray) -> IntArray:
            room = np.maximum(total - rows[:, Q:].sum(axis=1), 0)
            out = np.zeros((rows.shape[0], Q), dtype=np.int64)
            # later stages first
            for q in np.argsort(-queue_stage, kind="stable"):
                take = np.minimum(rows[:, q], room)
                out[:, q] = take
                room = room - take
            return out

        return total_rule
