"""The tables an observation-policy search starts from (:mod:`overtake.mdp.observed`, step 1).

Each baseline (π(1), π(2), π(4), π(∞), π(1,…,1)) as a table over the observation classes of an
:class:`~overtake.mdp.observation.ObservationSpace`; with route classes, the threads a baseline
starts per stage are given to the routes with the least expected work first. For ``none`` also
the overtaking heuristic restricted to the observation: per class, the action the heuristic takes
most often there, weighted by its own stationary law of decision epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from .baselines import Baseline
from .chain import build_chain
from .evaluate import chain_law
from .heuristic import overtaking_heuristic
from .lock import Locks
from .model import TandemModel
from .observation import ObservationSpace
from .statespace import Layout, transitions

__all__ = ["heuristic_table", "lift", "stage_rule", "stage_view", "starting_tables"]

IntArray = npt.NDArray[np.int64]


def stage_rule(model: TandemModel, name: str) -> Callable[[IntArray], IntArray]:
    """A baseline as a rule on ``none`` observation rows (waiting per stage, threads per stage)."""
    b = Baseline.parse(name, model.n_stages)
    lay = Layout.build(model, "start")
    rule = b.rule(lay.queue_stage, model.coord_stage())
    N = model.n_stages

    def on_obs(obs: IntArray) -> IntArray:
        rows = np.zeros((obs.shape[0], N + model.n_coords), dtype=np.int64)
        rows[:, :N] = obs[:, :N]
        for i in range(N):  # baselines read threads per stage only: put them in the first phase
            rows[:, N + model.offsets[i]] = obs[:, N + i]
        return np.asarray(rule(rows), dtype=np.int64)

    return on_obs


def stage_view(osp: ObservationSpace) -> IntArray:
    """Each class's ``none`` observation: waiting summed over a stage's routes, threads per stage."""
    N, Q = osp.N, osp.Q
    out = np.zeros((osp.n_classes, 2 * N), dtype=np.int64)
    for q in range(Q):
        out[:, osp.layout.queue_stage[q]] += osp.classes[:, q]
    out[:, N:] = osp.classes[:, Q:]
    return out


def lift(osp: ObservationSpace, per_stage: IntArray) -> IntArray:
    """Per-stage thread counts → per-queue counts, the routes with the least expected work first."""
    model = osp.model
    means = np.concatenate([st.phase_means() for st in model.stages])  # per coordinate
    work = np.array([sum(p * means[d] for d, p in osp.layout.spawn[q]) for q in range(osp.Q)])
    out = np.zeros((osp.n_classes, osp.Q), dtype=np.int64)
    for i in range(osp.N):
        qs = [q for q in np.argsort(work, kind="stable") if osp.layout.queue_stage[q] == i]
        left = per_stage[:, i].copy()
        for q in qs:
            take = np.minimum(osp.classes[:, q], left)
            out[:, q] = take
            left -= take
    return out


def heuristic_table(osp: ObservationSpace, fallback: IntArray) -> IntArray:
    """The overtaking heuristic restricted to the ``none`` observation (module docstring)."""
    model = osp.model
    h = overtaking_heuristic(model)
    full = Layout.build(model, "full")
    ch = build_chain(model, full, h.actions, max_requests=osp.cap, max_threads=osp.k_max)
    reach, pi = chain_law(ch)
    rows = ch.rows[reach]
    s, pre, rate = transitions(model, full, rows, osp.cap)
    # blocked threads of a locked stage count among its threads (:mod:`overtake.mdp.lock`)
    fold = Locks.build(model, full.n_queues).fold
    rows, pre = fold(rows), fold(pre)
    D, N = model.n_coords, model.n_stages
    cs = model.coord_stage()

    def none_obs(r: IntArray) -> IntArray:
        o = np.zeros((r.shape[0], 2 * N), dtype=np.int64)
        for d in range(D):
            o[:, cs[d]] += r[:, d]
            o[:, N + cs[d]] += r[:, D + d]
        return o

    o_pre = none_obs(pre)
    seen = np.any(o_pre != none_obs(rows)[s], axis=1)  # decision epochs of an observation policy
    act = h.actions(pre[seen], max_threads=osp.k_max)
    per_stage = np.zeros((act.shape[0], N), dtype=np.int64)
    for d in range(D):
        per_stage[:, cs[d]] += act[:, d]
    cls = np.searchsorted(osp.keys, osp.ranker.rank(o_pre[seen]))
    weight = pi[s[seen]] * rate[seen]
    base = osp.cap + 1
    code = cls * base**N + (per_stage * base ** np.arange(N - 1, -1, -1)).sum(axis=1)
    uc, inv = np.unique(code, return_inverse=True)
    tot = np.bincount(inv.ravel(), weights=weight)
    order = np.lexsort((-tot, uc // base**N))  # per class, the heaviest action first
    first = np.ones(order.size, dtype=bool)
    first[1:] = (uc[order][1:] // base**N) != (uc[order][:-1] // base**N)
    win = uc[order][first]
    table = fallback.copy()
    c = win // base**N
    for i in range(N):
        table[c, i] = (win // base ** (N - 1 - i)) % base
    return osp.repair(table)


def starting_tables(
    osp: ObservationSpace, baselines: Sequence[str], heuristic: bool, extra: dict[str, IntArray]
) -> dict[str, IntArray]:
    """The starting tables by name: the ``baselines`` (for ``route``: lightest route first), the
    restricted heuristic if ``heuristic`` (``none`` only), and ``extra``, each made feasible."""
    out: dict[str, IntArray] = {}
    view = stage_view(osp)
    routed = osp.layout.phase_info == "route"
    for name in baselines:
        per_stage = stage_rule(osp.model, name)(view)
        t = lift(osp, per_stage) if routed else per_stage
        out[name + (" (lightest route first)" if routed else "")] = osp.repair(t)
    if heuristic and not routed:
        best = out[baselines[0]] if baselines else osp.repair(np.zeros((osp.n_classes, osp.Q), np.int64))
        out["heuristic (restricted)"] = heuristic_table(osp, best)
    out.update({k: osp.repair(v) for k, v in extra.items()})
    return out
