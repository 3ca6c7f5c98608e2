"""Readable overtaking rules from π* (van der Weij, Bhulai and van der Mei, "Dynamic thread assignment", Theorem 3.1).

Theorem 3.1: π* starts s threads for phase-j requests at stage i when they overtake, in
expectation, the requests in service at stages ≥ i. So π*'s decision for a waiting class is a
function of *which threads are active*, far more than of queue lengths. :func:`overtaking_rule`
extracts that function — for each waiting queue and each active-thread configuration, the number
of threads π* starts (the most frequent answer, weighted by how often the state is visited) —
and reports the stationary mass of decision epochs on which the rule and π* agree exactly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .average_cost import SolveResult, induced_matrix
from .evaluate import stationary_distribution
from .policy import Policy

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class OvertakingRules:
    """Per waiting queue: active-thread configuration → threads to start; plus agreement with π*."""

    rules: dict[str, list[dict[str, Any]]]
    agreement: float
    text: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"rules": self.rules, "agreement": self.agreement, "text": self.text}


def _config_label(labels: list[str], k: tuple[int, ...]) -> str:
    parts = [f"{c}x {labels[d]}" if c > 1 else labels[d] for d, c in enumerate(k) if c > 0]
    return "{" + ", ".join(parts) + "}" if parts else "{no thread active}"


#: (queue, active-thread configuration) -> threads started -> stationary visit rate
Table = dict[tuple[int, tuple[int, ...]], dict[int, float]]


def overtaking_rule(res: SolveResult, policy: Policy) -> OvertakingRules:
    """Extract Theorem-3.1-style rules from a solved π* and measure their agreement with it."""
    space = res.space
    Q = space.Q
    ys, w = _decision_epochs(res)
    acts = policy.spawn[ys].astype(np.int64)
    ks = space.rows[ys, Q:]
    table: Table = defaultdict(lambda: defaultdict(float))
    for q in range(Q):
        has = space.rows[ys, q] > 0
        for k, a, ww in zip(map(tuple, ks[has]), acts[has, q], w[has]):
            table[(q, k)][int(a)] += float(ww)
    rule_of = {key: max(v.items(), key=lambda kv: kv[1])[0] for key, v in table.items()}
    agreement = _agreement(res, ys, w, acts, ks, rule_of)
    labels = space.model.coord_labels()
    qlabels = [c.removeprefix("waiting:") for c in policy.columns[:Q]]
    rules: dict[str, list[dict[str, Any]]] = {}
    text: list[str] = []
    for q in range(Q):
        entries, spawn_when, hold_when = _queue_rules(q, table, rule_of, labels)
        rules[qlabels[q]] = entries
        text.append(_rule_text(qlabels[q], spawn_when, hold_when))
    return OvertakingRules(rules, agreement, text)


def _decision_epochs(res: SolveResult) -> tuple[IntArray, npt.NDArray[np.float64]]:
    """The pre-decision states with a request waiting that π* visits, and their visit rates
    Σ_x π(x) P_E(x, y) (self-loops included): the weights of the majority vote."""
    space = res.space
    P = induced_matrix(space, res.decision)
    reach, pi = stationary_distribution(P)
    full = np.zeros(space.size)
    full[reach] = pi
    weight = space.event_matrix.T @ full
    waiting = space.rows[:, : space.Q].sum(axis=1) > 0
    ys = np.flatnonzero((weight > 0) & waiting)
    return ys, weight[ys]


def _agreement(res: SolveResult, ys: IntArray, w: npt.NDArray[np.float64], acts: IntArray, ks: IntArray,
               rule_of: dict[tuple[int, tuple[int, ...]], int]) -> float:
    """The visit-weighted share of decision epochs where the rule's whole spawn vector (capped by
    the queue) equals π*'s."""
    rows, Q = res.space.rows, res.space.Q
    agree = 0.0
    for i, y in enumerate(ys):
        k = tuple(ks[i])
        ok = True
        for q in range(Q):
            if rows[y, q] > 0:
                r = min(rule_of[(q, k)], int(rows[y, q]))
                if r != acts[i, q]:
                    ok = False
                    break
        if ok:
            agree += float(w[i])
    return agree / float(w.sum()) if w.size else 1.0


def _queue_rules(q: int, table: Table, rule_of: dict[tuple[int, tuple[int, ...]], int],
                 labels: list[str]) -> tuple[list[dict[str, Any]], list[tuple[str, int]], list[tuple[str, int]]]:
    """Queue ``q``'s rule entries, most visited configurations first (so a shortened list keeps
    what matters), and the configurations where it starts threads and where it holds."""
    entries = []
    spawn_when: list[tuple[str, int]] = []
    hold_when: list[tuple[str, int]] = []
    keyed = sorted(((k, a) for (qq, k), a in rule_of.items() if qq == q),
                   key=lambda ka: -sum(table[(q, ka[0])].values()))
    for k, a in keyed:
        mass = sum(table[(q, k)].values())
        entries.append({"active": dict(zip(labels, map(int, k))), "start": int(a), "mass": mass})
        (spawn_when if a > 0 else hold_when).append((_config_label(labels, k), a))
    return entries, spawn_when, hold_when


def _listing(items: list[tuple[str, int]], with_count: bool) -> str:
    shown = "; ".join(f"{c} -> start {a}" if with_count else c for c, a in items[:12])
    return shown + (f" (+{len(items) - 12} more)" if len(items) > 12 else "")


def _rule_text(qlabel: str, spawn_when: list[tuple[str, int]], hold_when: list[tuple[str, int]]) -> str:
    """One queue's rule in a sentence: never overtakes, one thread unless (the exceptions), or
    the configurations that start threads."""
    if not spawn_when:
        return f"{qlabel}: waits until the other classes are served (never overtakes)"
    if all(a == 1 for _, a in spawn_when) and len(hold_when) < len(spawn_when):
        unless = f" unless active threads are {_listing(hold_when, False)}" if hold_when else " always"
        return f"{qlabel}: start 1 thread{unless}"
    return f"{qlabel}: start threads when active threads are {_listing(spawn_when, True)}"
