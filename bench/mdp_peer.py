"""One tandem MDP solved side by side: our solvers against pymdptoolbox's RelativeValueIteration.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mdp_peer.py [--case 4] [--cap 10] [--threads 4]
        [--repeat 3] [--json] [--no-write] [--results]

Ours: Anderson-accelerated RVI (the default solver) and plain RVI, each the best of ``--repeat``
CPU timings after one untimed warm-up call (numba's cache load), and policy iteration (one timed
run: its evaluations are ILU-preconditioned GMRES solves, BENCHMARKS.md's cli-table1 section says why it is not the
default); the speed-up is pymdptoolbox's CPU time over the default solver's, at equal g (both
policies' exact average costs are shown). ``--ours-only`` skips pymdptoolbox (for instances it
cannot hold, e.g. Table 1 case 8's 96,075 states) and writes no section. ``--results`` appends
one JSON line to bench/results/solver_speed.jsonl.

pymdptoolbox (PyPI, the `bench` extra) needs a fixed action set, one S×S matrix per action, and
maximises reward, so the instance is written in its pre-decision form: state y, action a = how
many threads to start from each queue (every vector with Σa ≤ K_max), transition from the
post-decision state y − a + a (to threads) through our event matrix P_E, reward −c(post)/Λ.
Actions that are impossible in y (a > waiting, thread cap, or leaving the processor idle) get a
self-loop and a reward of −10⁶, so they are never chosen. This is the same chain observed one
decision earlier, so the average cost is the same; both policies are also evaluated exactly.

pymdptoolbox's input check densifies sparse matrices (``util.isStochastic`` broadcasts a row
sum of an S×S ``csr_matrix`` to S×S: 74.5 GiB at 10⁵ states); it is bypassed with
``mdptoolbox.util.check = lambda *a, **k: None``. Timings are CPU seconds of this process
(the machine is shared); writes the ``mdp-peer`` section of bench/results/sections.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from _report import append_run, cpu_model, write_section

from overtake.api.scenario import load_scenario
from overtake.mdp.average_cost import anderson_rvi, induced_matrix, policy_iteration, relative_value_iteration
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.statespace import StateSpace, Truncation

ROOT = Path(__file__).resolve().parents[1]


def pre_decision_form(space: StateSpace) -> tuple[list[sp.csr_matrix], np.ndarray, np.ndarray]:
    """(P per action, R (S, A), post-decision index per (state, action) or −1)."""
    S, Q = space.size, space.Q
    PE = space.event_matrix
    cost = space.cost / space.rate
    actions = [a for a in itertools.product(range(space.k_max + 1), repeat=Q) if sum(a) <= space.k_max]
    post = np.full((S, len(actions)), -1, dtype=np.int64)
    P_list, R = [], np.empty((S, len(actions)))
    ar = np.arange(S)
    for i, a in enumerate(actions):
        av = np.asarray(a)
        rows = space.rows.copy()
        rows[:, :Q] -= av
        for q in range(Q):
            ((d, _),) = space.layout.spawn[q]
            rows[:, Q + d] += av[q]
        ok = (rows[:, :Q] >= 0).all(axis=1) & (rows[:, Q:].sum(axis=1) <= space.k_max)
        idx = np.full(S, -1)
        idx[ok] = space.find(rows[ok])
        ok &= idx >= 0
        ok &= ~((rows[:, Q:].sum(axis=1) == 0) & (rows.sum(axis=1) > 0))  # never idle
        post[ok, i] = idx[ok]
        # rows of P_E for the post-decision states; self-loops for impossible actions
        self_loop = sp.csr_matrix(((~ok).astype(float), (ar, ar)), shape=(S, S))
        P_list.append((sp.diags(ok.astype(float)) @ PE[np.where(ok, idx, 0)] + self_loop).tocsr())
        R[:, i] = np.where(ok, -cost[np.where(ok, idx, 0)], -1e6)
    return P_list, R, post


def exact_gain(space: StateSpace, decision: np.ndarray) -> float:
    reach, pi = stationary_distribution(induced_matrix(space, decision))
    return float(pi @ space.cost[reach])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=int, default=4)
    ap.add_argument("--cap", type=int, default=10)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="timings of our solvers; the best is kept")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    ap.add_argument("--results", action="store_true", help="append one JSON line to bench/results/solver_speed.jsonl")
    ap.add_argument("--ours-only", action="store_true", help="time our three solvers only (no pymdptoolbox, no section)")
    args = ap.parse_args()
    import mdptoolbox
    import mdptoolbox.mdp

    _, model = load_scenario(ROOT / "examples" / "table1" / f"case{args.case:02d}.yaml")
    space = StateSpace(model, Truncation(args.cap, args.threads))
    _ = space.event_matrix  # built once, outside both timings

    load0 = os.getloadavg()[0]
    timed = {}
    for name, fn in (("anderson", anderson_rvi), ("rvi", relative_value_iteration)):
        fn(space, tol=1e-9, max_iter=3)  # load the compiled kernels outside the timing
        best = np.inf
        for _ in range(args.repeat):
            c0 = time.process_time()
            res = fn(space, tol=1e-9)
            best = min(best, time.process_time() - c0)
        timed[name] = (res, best, exact_gain(space, res.decision))
    ours, t_ours, g_ours = timed["anderson"]
    rvi, t_rvi, g_rvi = timed["rvi"]
    c0 = time.process_time()
    pi = policy_iteration(space)
    t_pi = time.process_time() - c0
    g_pi = exact_gain(space, pi.decision)
    if args.ours_only:
        doc = {"bench": "mdp_peer", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "machine": f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}",
               "command": "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mdp_peer.py " + " ".join(sys.argv[1:]),
               "case": args.case, "states": space.size,
               "cpu_s": {"anderson": t_ours, "rvi": t_rvi, "pi": t_pi},
               "sweeps": {"anderson": ours.sweeps, "rvi": rvi.sweeps, "pi": pi.n_iter},
               "gain": {"anderson": ours.gain, "rvi": rvi.gain, "pi": pi.gain},
               "exact_g": {"anderson": g_ours, "rvi": g_rvi, "pi": g_pi},
               "pi_history": pi.history, "load_before": load0, "load_after": os.getloadavg()[0]}
        print(json.dumps(doc, indent=1))
        if args.results:
            append_run("solver_speed", doc)
        return 0
    c0 = time.process_time()
    P_list, R, post = pre_decision_form(space)
    t_build = time.process_time() - c0
    mdptoolbox.util.check = lambda *a, **k: None  # its check densifies sparse input (notes A.3)
    g_step = ours.gain / space.rate
    c0 = time.process_time()
    peer = mdptoolbox.mdp.RelativeValueIteration(P_list, R, epsilon=1e-9 * g_step, max_iter=1_000_000)
    peer.run()
    t_peer = time.process_time() - c0
    g_peer_reported = -peer.average_reward * space.rate
    pol = np.asarray(peer.policy)
    dec = post[np.arange(space.size), pol]
    if np.any(dec < 0):
        raise SystemExit("pymdptoolbox chose an impossible action")
    g_peer = exact_gain(space, dec)

    rel = abs(g_peer - g_ours) / g_ours
    nnz = sum(m.nnz for m in P_list)
    lines = [
        "## MDP solver side by side: ours vs pymdptoolbox RelativeValueIteration",
        "",
        f"Date {dt.date.today()}, machine: {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}, "
        f"pymdptoolbox {getattr(mdptoolbox, '__version__', '4.0b3')}; command: "
        f"`OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mdp_peer.py --case {args.case} --cap {args.cap} --threads {args.threads}`. "
        f"Instance: Table 1 case {args.case}, cap C = {args.cap}, K_max = {args.threads}: {space.size} states; pymdptoolbox gets "
        f"{len(P_list)} actions (every spawn vector), {nnz} nonzeros in its P. CPU seconds (shared machine). "
        f"Both average costs are also computed exactly from each returned policy's stationary law.",
        "",
        "| solver | sweeps | CPU s | g reported | g of its policy (exact) |",
        "|---|---|---|---|---|",
        f"| overtake Anderson-accelerated RVI (default) | {ours.sweeps} | {t_ours:.3f} | {ours.gain:.9f} [{ours.gain_bounds[0]:.9f}, {ours.gain_bounds[1]:.9f}] | {g_ours:.9f} |",
        f"| overtake RVI (box DP, compiled sweep) | {rvi.sweeps} | {t_rvi:.3f} | {rvi.gain:.9f} [{rvi.gain_bounds[0]:.9f}, {rvi.gain_bounds[1]:.9f}] | {g_rvi:.9f} |",
        f"| overtake policy iteration (ILU-GMRES evaluation) | {pi.n_iter} policies | {t_pi:.2f} | {pi.gain:.9f} [{pi.gain_bounds[0]:.9f}, {pi.gain_bounds[1]:.9f}] | {g_pi:.9f} |",
        f"| pymdptoolbox RelativeValueIteration | {peer.iter} | {t_peer:.2f} (+ {t_build:.2f} building its input) | {g_peer_reported:.9f} | {g_peer:.9f} |",
        "",
        f"Speed-up {t_peer / t_ours:.1f}× (CPU, solve only; plain RVI {t_peer / t_rvi:.1f}×, policy iteration "
        f"{t_peer / t_pi:.1f}×); relative difference of "
        f"the exact average costs {rel:.1e}; 1-min load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after.",
    ]
    text = "\n".join(lines)
    doc = {"bench": "mdp_peer", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}",
           "command": "OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mdp_peer.py " + " ".join(sys.argv[1:]),
           "states": space.size, "cpu_s": {"anderson": t_ours, "rvi": t_rvi, "pi": t_pi, "pymdptoolbox": t_peer},
           "sweeps": {"anderson": ours.sweeps, "rvi": rvi.sweeps, "pi": pi.n_iter, "pymdptoolbox": int(peer.iter)},
           "exact_g": {"anderson": g_ours, "rvi": g_rvi, "pi": g_pi, "pymdptoolbox": g_peer},
           "speedup": t_peer / t_ours, "speedup_rvi": t_peer / t_rvi, "rel_diff_g": rel,
           "load_before": load0, "load_after": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(text)
    if args.results:
        append_run("solver_speed", doc)
    if not args.no_write:
        write_section("mdp-peer", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
