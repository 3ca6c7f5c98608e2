"""The online loop's decisions, apart from running them: what a refit re-solves for, whether the
window's samples can be refitted, whether a refit's policy replaces the running one, and the
record each decision logs.
"""

from __future__ import annotations

from typing import Any

from overtake.controller.sidecar.policies import BaselinePolicy, TablePolicy

__all__ = ["THRESHOLD_MOVE", "check_window", "refit_record", "resolve_target", "thresholds_moved"]


def resolve_target(pol: Any, n: int, classifier_mode: str) -> tuple[Any, tuple[int | None, ...], str, Any] | None:
    """What a refit re-solves for, from the running policy: (the current policy or baseline name,
    phase counts to fit (None: the fit chooses), the information level, the route split); None
    for a policy of no known family."""
    if isinstance(pol, TablePolicy):
        # keep the model's phase counts (not the policy's labels): an exact comparison; re-solve
        # for the information the running policy uses
        return (pol.policy, tuple(int(st.phases) for st in pol.policy.model.stages), pol.policy.phase_info,
                pol.policy.routes)
    if isinstance(pol, BaselinePolicy):
        # what the classifier can see: without phases, the best policy over counts (mdp.observed)
        return pol.baseline.name, (None,) * n, "none" if classifier_mode == "hidden" else "full", None
    return None


#: a refit whose count policy is no better than the running one still swaps when its age thresholds
#: moved by more than this fraction: they follow the fitted demands (the control file), while the
#: count policy's E[W] may not change at all (a time scale change leaves the best count policy as it is)
THRESHOLD_MOVE = 0.1


def thresholds_moved(current: tuple[tuple[float, ...], ...] | None, new: Any, u: float) -> str | None:
    """Why the new age thresholds (model units) replace the current ones, or None when they did not
    move by more than :data:`THRESHOLD_MOVE` (or the refit chose none)."""
    if not new or not new[0] or any(v is None for row in new for v in row):
        return None
    first = [float(v) for v in new[0]]
    if current is None or len(current[0]) != len(first):
        return f"the age thresholds {[round(v * u, 6) for v in first]} s replace none"
    old = list(current[0])
    if all(abs(n - o) <= THRESHOLD_MOVE * o for n, o in zip(first, old)):
        return None
    return (f"the age thresholds moved from {[round(v * u, 6) for v in old]} s to {[round(v * u, 6) for v in first]} s "
            f"(more than {THRESHOLD_MOVE:.0%})")


def refit_record(base: dict[str, Any], res: dict[str, Any], wall: float, policy: str, u: float) -> dict[str, Any]:
    """The decision record of a finished refit job; ``u`` converts its model units to seconds."""
    return {**base, "fit": res["stages"], "predicted_new": res["predicted_new"],
            "predicted_current": res["predicted_current"], "current_error": res["current_error"],
            "predicted_new_seconds": res["predicted_new"] * u, "predicted_current_seconds": res["predicted_current"] * u,
            "states": res["states"], "worker_seconds": res["seconds"], "seconds": wall,
            "policy": policy, "new_hash": res["hash"], "cpu_seconds": res["cpu_seconds"],
            "worker_pid": res["pid"], "worker_nice": res["nice"], "locks": res.get("locks"),
            "routing": res.get("routing"), "routing_correlation": res.get("routing_correlation")}


def check_window(names: tuple[str, ...], chosen: list[tuple[str, Any]], lam: float | None, time_unit: float, cores: int,
                  s: Any) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """The record of the window's samples and load, and (outcome, reason) if they cannot be refitted:
    too few samples in a stage, no arrivals, or a load with no stationary optimum."""
    counts = {n: int(x.size) for n, (_, x) in zip(names, chosen)}
    sources = {n: src for n, (src, _) in zip(names, chosen)}
    base: dict[str, Any] = {"samples": counts, "source": sources,
                            "arrival_rate_per_second": lam, "time_unit": time_unit}
    short = [n for n, c in counts.items() if c < s.min_samples]
    if short:
        return base, ("skipped_samples", f"stages {short} have fewer than {s.min_samples} demand samples")
    if not lam:
        return base, ("skipped_samples", "no arrivals in the window")
    means = [float(x.mean()) for _, x in chosen]
    load = lam * time_unit * sum(means) / cores
    base.update(load=load, means_seconds={n: m * time_unit for n, m in zip(names, means)})
    if load >= s.max_load:
        return base, ("skipped_load", f"estimated load {load:.3f} >= {s.max_load:g}: "
                      "the model has no stationary optimum to re-solve for")
    return base, None
