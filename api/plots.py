"""PNG figures for the CLI's ``--plot`` options and the API's page (matplotlib, no pyplot).

* :func:`gains_figure` — E[W] of π* and the baselines as bars, gains written above them
  (van der Weij et al., "Dynamic thread assignment", §4.1, Figure 2 "Expected response times", for one scenario).
* :func:`policy_figure` — π* as heatmaps over the two stages' waiting-queue lengths, one panel
  per (active-thread configuration, stage spawned from); data from :func:`policy_grid`.
* :func:`distributions_figure` — each stage's service-time density and survival function (the
  fitted or given PH), with the samples behind a fit when they are known.

Figures are built with :class:`matplotlib.figure.Figure` (no global state, thread-safe enough for
the API); :func:`png` turns one into bytes.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from overtake.mdp.policy import Policy

IntArray = npt.NDArray[np.int64]


def png(fig: Figure, *, dpi: int = 90) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


# ---- gains (van der Weij et al., Figure 2) -----------------------------------------------------------
def gains_figure(comparison: Mapping[str, Any], *, title: str = "") -> Figure:
    """Bars of E[W] per policy (π* first, highlighted); each baseline's gain over π* above its bar.

    Gain of π* over π: (E W(π) − E W(π*)) / E W(π*) (van der Weij et al., Table 1).
    """
    from matplotlib.figure import Figure

    pols = comparison["policies"]
    names = list(pols)
    ew = [float(pols[n]["mean_response_time"]) for n in names]
    gains = comparison.get("gains", {})
    # fixed margins: constrained layout costs seconds per figure on a busy 2-core machine
    fig = Figure(figsize=(6.4, 3.8))
    fig.subplots_adjust(left=0.11, right=0.98, bottom=0.1, top=0.9)
    ax = fig.subplots()
    colors = ["#d62728" if n == "pi*" else "#1f77b4" for n in names]
    bars = ax.bar(range(len(names)), ew, color=colors)
    for b, n in zip(bars, names):
        g = gains.get(n)
        label = "π*" if n == "pi*" else f"{100 * g:+.1f}%" if g is not None else ""
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    xytext=(0, 2), textcoords="offset points", fontsize=9)
    ax.set_xticks(range(len(names)), [n.replace("pi", "π").replace("inf", "∞") for n in names])
    ax.set_ylabel("mean response time E[W]")
    ax.set_ylim(0, max(ew) * 1.15)
    load = comparison.get("load")
    ax.set_title(title or (f"expected response times, ρ = {load:.3g}" if load is not None else "expected response times"))
    return fig


# ---- policy heatmap ------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyGrid:
    """π*'s spawn counts on a grid of waiting-queue lengths (stage a × stage b).

    ``spawn[c, s, i, j]``: threads π* starts for stage ``s`` of the two shown when ``i`` requests
    wait at the first shown stage, ``j`` at the second, and the active threads are ``configs[c]``.
    Waiting requests of a stage sit in the queue of its most likely entry phase. ``reached[c, i, j]``:
    the policy's chain visits that state from the empty system (None: not computed, see
    :func:`reached_rows`).
    """

    stages: tuple[str, ...]
    configs: tuple[str, ...]
    spawn: IntArray
    reached: npt.NDArray[np.bool_] | None = None


#: the chain is built to tell the reached states up to this many states (a few seconds)
REACH_MAX_STATES = 400_000


def reached_rows(policy: Policy, rows: IntArray) -> npt.NDArray[np.bool_] | None:
    """Which pre-decision state ``rows`` the policy's chain visits from the empty system (positive
    stationary probability: the chain is unichain on them). None where that is not told cheaply:
    observation policies, spawns that start a random phase, more than :data:`REACH_MAX_STATES`."""
    from overtake.mdp.average_cost import induced_matrix
    from overtake.mdp.evaluate import reachable
    from overtake.mdp.statespace import StateSpace, Truncation

    if policy.observed or policy.keys.size > REACH_MAX_STATES:
        return None
    space = StateSpace(policy.model, Truncation(policy.max_requests, policy.max_threads), policy.phase_info)
    if not space.layout.deterministic or space.size != policy.keys.size:
        return None
    Q = space.Q
    spawn = policy.actions(space.rows)
    post = space.rows.copy()
    post[:, :Q] -= spawn
    for q, targets in enumerate(space.layout.spawn):  # deterministic: one coordinate per queue
        post[:, Q + targets[0][0]] += spawn[:, q]
    P = induced_matrix(space, space.index(post))
    after = reachable(P, 0)  # post-decision states the chain visits
    seen = np.zeros(space.size, dtype=bool)
    seen[np.unique(space.event_matrix[after].indices)] = True  # the states one event leads to
    idx = space.find(rows)
    return np.where(idx >= 0, seen[np.maximum(idx, 0)], False)


def policy_grid(policy: Policy, *, size: int = 8, reached: bool = True) -> PolicyGrid:
    """Evaluate ``policy.actions`` on a (size+1)² grid of the first two stages' waiting requests
    (``reached``: also which of those states the policy's chain visits, :func:`reached_rows`)."""
    model = policy.model
    shown = list(range(min(2, model.n_stages)))
    Q, D = policy.Q, policy.D
    qstage = policy.layout.queue_stage
    # the queue a stage-s arrival waits in: its most likely entry phase (full layout) or the stage's queue
    entry_q = []
    for s in shown:
        qs = [q for q in range(Q) if qstage[q] == s]
        if len(qs) > 1:
            qs = [qs[int(np.argmax(model.stages[s].alpha))]]
        entry_q.append(qs[0])
    labels = model.coord_labels()
    configs: list[tuple[str, np.ndarray]] = [("no thread active", np.zeros(D, dtype=np.int64))]
    for s in shown:
        k = np.zeros(D, dtype=np.int64)
        if policy.observed:  # an observation policy counts threads per stage
            k[s] = 1
            configs.append((f"1 thread at {model.stages[s].name}", k))
            continue
        d = model.coord(s, int(np.argmax(model.stages[s].alpha)))
        k[d] = 1
        configs.append((f"1 thread at {labels[d]}", k))
    n = max(0, min(size, policy.max_requests - 1))
    ii, jj = np.meshgrid(np.arange(n + 1), np.arange(n + 1) if len(shown) > 1 else np.zeros(1, dtype=np.int64),
                         indexing="ij")
    out = np.zeros((len(configs), len(shown), ii.shape[0], ii.shape[1]), dtype=np.int64)
    grids = []
    for c, (_, k) in enumerate(configs):
        rows = np.zeros((ii.size, Q + D), dtype=np.int64)
        rows[:, entry_q[0]] += ii.ravel()
        if len(shown) > 1:
            rows[:, entry_q[1]] += jj.ravel()
        rows[:, Q:] = k
        grids.append(rows)
        act = policy.actions(rows)
        for si, s in enumerate(shown):
            out[c, si] = act[:, qstage == s].sum(axis=1).reshape(ii.shape)
    seen = reached_rows(policy, np.concatenate(grids)) if reached else None
    mask = None if seen is None else seen.reshape(len(configs), *ii.shape)
    return PolicyGrid(tuple(model.stages[s].name for s in shown), tuple(name for name, _ in configs), out, mask)


def policy_figure(policy: Policy, *, size: int = 8, title: str = "") -> Figure:
    """Heatmaps of :func:`policy_grid`: rows = active threads, columns = stage spawned from."""
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure

    g = policy_grid(policy, size=size)
    nc, ns = g.spawn.shape[:2]
    fig = Figure(figsize=(3.3 * ns + 1.2, 2.9 * nc))
    fig.subplots_adjust(left=0.1, right=0.84, bottom=0.06, top=0.92, hspace=0.45, wspace=0.35)
    axes = np.atleast_2d(fig.subplots(nc, ns, squeeze=False))
    vmax = max(1, int(g.spawn.max()))
    # thread counts are integers: one colour each; states the chain never visits stay blank
    cmap = ListedColormap(colormaps["viridis"](np.linspace(0, 1, vmax + 1))).with_extremes(bad="white")
    norm = BoundaryNorm(np.arange(-0.5, vmax + 1), cmap.N)
    im = None
    for c in range(nc):
        for s in range(ns):
            ax = axes[c, s]
            grid = g.spawn[c, s]
            shown = grid if g.reached is None else np.ma.masked_array(grid, ~g.reached[c])
            im = ax.imshow(shown.T, origin="lower", cmap=cmap, norm=norm, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if v and (g.reached is None or g.reached[c, i, j]):  # zeros: the dark background
                    ax.text(i, j, str(v), ha="center", va="center", fontsize=7, color="w" if v < vmax / 2 else "k")
            ax.set_xlabel(f"waiting at {g.stages[0]}")
            if len(g.stages) > 1:
                ax.set_ylabel(f"waiting at {g.stages[1]}")
            ax.set_title(f"start at {g.stages[s]} | {g.configs[c]}", fontsize=8)
    if im is not None:
        fig.colorbar(im, cax=fig.add_axes((0.88, 0.3, 0.025, 0.4)), label="threads started", ticks=range(vmax + 1))
    note = "" if g.reached is None else " (blank: never reached)"
    fig.suptitle((title or f"policy {policy.digest()}: threads started per state") + note)
    return fig


# ---- service-time distributions --------------------------------------------------------------
def distributions_figure(stages: Sequence[tuple[str, Any, Any]], *,
                         samples: Mapping[str, Sequence[float]] | None = None, title: str = "") -> Figure:
    """Density (left) and survival function (right, log-log) of each stage's PH (alpha, T).

    With ``samples`` for a stage, its histogram and empirical survival are drawn behind the fit.
    """
    from matplotlib.figure import Figure

    from overtake.fitting import PhaseType

    fig = Figure(figsize=(10, 3.8))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13, top=0.88, wspace=0.25)
    ax1, ax2 = fig.subplots(1, 2)
    phs = [(name, PhaseType(a, T)) for name, a, T in stages]
    # x range: from 1e-3 of the smallest mean to where the heaviest tail drops below 1e-4
    wide = np.geomspace(1e-3 * min(ph.mean() for _, ph in phs), 1e3 * max(ph.mean() for _, ph in phs), 400)
    tail = np.max([ph.sf(wide) for _, ph in phs], axis=0)
    hi = float(wide[min(int(np.searchsorted(-tail, -1e-4)), wide.size - 1)])
    grid = np.geomspace(wide[0], hi, 300)
    for i, (name, ph) in enumerate(phs):
        color = f"C{i}"
        x = None if samples is None else samples.get(name)
        if x is not None and len(x):
            xa = np.sort(np.asarray(x, dtype=float))
            bins = np.geomspace(max(xa[0], 1e-9), xa[-1], 50)
            ax1.hist(xa, bins=bins, density=True, alpha=0.3, color=color, label=f"{name} samples (n={xa.size})")
            ax2.step(xa, 1.0 - np.arange(xa.size) / xa.size, where="post", color=color, alpha=0.5)
        ax1.plot(grid, ph.pdf(grid), color=color,
                 label=f"{name}: PH({ph.order}), mean {ph.mean():.3g}, SCV {ph.scv():.2f}")
        ax2.plot(grid, ph.sf(grid), color=color, label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("service time")
    ax1.set_ylabel("density")
    ax1.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_ylim(1e-4, 1.05)
    ax2.set_xlabel("service time")
    ax2.set_ylabel("P(S > x)")
    ax2.legend(fontsize=7)
    fig.suptitle(title or "service-time distributions per stage")
    return fig
