"""Baseline thread policies as decision rules on the phase-blind layout.

The baselines are van der Weij et al.'s ("Dynamic thread assignment", §3–4):

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

    def rule(self, queue_stage: IntArray, coord_stage: IntArray) -> BaselineRule:
        """Vectorised rule: rows (w per stage, k per coordinate) → threads to start per stage."""
        queue_stage = np.asarray(queue_stage, dtype=np.int64)
        coord_stage = np.asarray(coord_stage, dtype=np.int64)
        if self.total is None and self.per_stage is None:
            return BaselineRule(RULE_ALL, np.zeros(1, dtype=np.int64), queue_stage, coord_stage)
        if self.per_stage is not None:
            return BaselineRule(RULE_PER_STAGE, np.asarray(self.per_stage, dtype=np.int64), queue_stage, coord_stage)
        return BaselineRule(RULE_TOTAL, np.array([self.total], dtype=np.int64), queue_stage, coord_stage)


#: :class:`BaselineRule` kinds, as the compiled chain builder numbers them (_kernels_jit.chain_bfs)
RULE_ALL, RULE_TOTAL, RULE_PER_STAGE = 1, 2, 3


@dataclass(frozen=True, eq=False)
class BaselineRule:
    """A baseline's decision rule: callable on state rows (w per queue, k per coordinate), and
    described by ``kind`` and ``param`` (π(∞); π(k): [k]; π(k1,…,kN): the caps) so that
    :func:`overtake.mdp.chain.build_chain` can run it compiled (the same counts)."""

    kind: int
    param: IntArray
    queue_stage: IntArray
    coord_stage: IntArray

    @property
    def priority(self) -> IntArray:
        """π(k)'s order of queues: later stages first, FCFS (lower index) within a stage."""
        order: IntArray = np.argsort(-self.queue_stage, kind="stable").astype(np.int64)
        return order

    def __call__(self, rows: IntArray) -> IntArray:
        Q = self.queue_stage.size
        if self.kind == RULE_ALL:
            everything: IntArray = rows[:, :Q].copy()
            return everything
        if self.kind == RULE_PER_STAGE:
            N = int(self.coord_stage.max()) + 1
            k = rows[:, Q:]
            threads = np.zeros((rows.shape[0], N), dtype=np.int64)
            for i in range(N):
                threads[:, i] = k[:, self.coord_stage == i].sum(axis=1)
            room = np.maximum(self.param[None, :] - threads, 0)
            capped: IntArray = np.minimum(rows[:, :Q], room[:, self.queue_stage])
            return capped
        room1 = np.maximum(int(self.param[0]) - rows[:, Q:].sum(axis=1), 0)
        out = np.zeros((rows.shape[0], Q), dtype=np.int64)
        for q in self.priority:  # later stages first
            take = np.minimum(rows[:, q], room1)
            out[:, q] = take
            room1 = room1 - take
        return out
