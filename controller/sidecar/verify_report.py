"""What the live verification tells: its log lines and ``GET /-/policy``'s ``verify`` object.

Every step of a verification is one log line on ``overtake.sidecar`` (``event`` =
``verification_idle``, ``verification_start``, ``verification_pair``, ``verification_decision``,
``verification_error``) with its numbers in ``detail``. Apart from the verifier's schedule
(:mod:`overtake.controller.sidecar.verify`) so that the wording and the documents live in one place.
"""

from __future__ import annotations

import logging
from typing import Any

from overtake.controller.sidecar.verify_settings import VerifySettings
from overtake.controller.sidecar.verify_stats import Verdict
from overtake.controller.sidecar.verify_windows import Window

__all__ = ["decision_text", "log_decision", "log_error", "log_idle", "log_pair", "log_start", "log_void_pair",
           "pair_summary", "status_document"]

log = logging.getLogger("overtake.sidecar")


def pair_summary(pol: Window, dft: Window) -> dict[str, float | int]:
    """One pair of windows as ``status()`` shows it (``last_pair``)."""
    return {"policy_mean_seconds": pol.mean or 0.0, "default_mean_seconds": dft.mean or 0.0,
            "policy_requests": pol.n, "default_requests": dft.n,
            "policy_rejected": pol.rejected, "default_rejected": dft.rejected,
            "censored": pol.censored + dft.censored}


def decision_text(v: Verdict) -> str:
    """The log line's account of a decision: what happens, after how many pairs, the gain and why."""
    ci = "" if v.ci is None else f" (CI {v.ci[0]:+.1%} .. {v.ci[1]:+.1%} at {v.confidence:.4g})"
    gain = "no estimate" if v.gain is None else f"gain {v.gain:+.1%}{ci}"
    what = ("kept" if v.decision == "keep" else "falling back to Apache's default")
    return f"{what} after {v.pairs} pairs: {gain} ({v.reason})"


def log_idle(policy: str) -> None:
    """The policy is Apache's default already: nothing to verify."""
    log.info(f"verification: {policy} is Apache's default, nothing to verify",
             extra={"event": "verification_idle", "policy": policy})


def log_start(policy: str, s: VerifySettings, default_cpu: str) -> None:
    """A verification starts: its windows, pairs, and what the default does about CPU priority."""
    log.info(f"verification: {policy} against Apache's default in windows of {s.window:g} s, "
             f"{s.min_pairs}..{s.max_pairs} pairs", extra={
                 "event": "verification_start", "policy": policy,
                 "detail": {"window": s.window, "settle": s.settle, "min_pairs": s.min_pairs,
                            "max_pairs": s.max_pairs, "min_gain": s.min_gain, "level": s.level,
                            "default_cpu": default_cpu}})


def log_void_pair(policy: str, number: int, pol: Window, dft: Window, min_requests: int,
                  summary: dict[str, float | int]) -> None:
    """Pair ``number`` had a window with too few requests: it is not counted."""
    log.info(f"verification pair {number}: too few requests ({pol.n} policy, {dft.n} default; "
             f"{min_requests} needed per window), not counted",
             extra={"event": "verification_pair", "policy": policy, "detail": summary})


def log_pair(policy: str, number: int, pol: Window, dft: Window, v: Verdict, summary: dict[str, float | int]) -> None:
    """Pair ``number`` counted: both means and the gain so far."""
    log.info(f"verification pair {number}: policy {pol.mean:.4g} s, default {dft.mean:.4g} s"
             + (f"; gain {v.gain:+.1%}" if v.gain is not None else ""),
             extra={"event": "verification_pair", "policy": policy,
                    "detail": {**summary, "gain": v.gain, "ci": v.ci}})


def log_decision(policy: str, state: str, v: Verdict, void_pairs: int) -> None:
    """The verdict: kept (info) or falling back (warning), with the gain and its CI."""
    log.log(logging.INFO if v.decision == "keep" else logging.WARNING,
            f"verification: {policy} {decision_text(v)}",
            extra={"event": "verification_decision", "policy": policy, "detail": {
                "state": state, "reason": v.reason, "pairs": v.pairs, "gain": v.gain,
                "ci": None if v.ci is None else list(v.ci), "confidence": v.confidence,
                "void_pairs": void_pairs}})


def log_error(policy: str, exc: Exception) -> None:
    """The schedule failed: the verifier falls back to Apache's default."""
    log.error("verification failed: falling back to Apache's default", extra={
        "event": "verification_error", "policy": policy, "detail": f"{exc.__class__.__name__}: {exc}"})


def status_document(*, state: str, policy: str, in_force: str, verdict: Verdict | None, pairs: int, void_pairs: int,
                    started_at: float | None, decided_at: float | None, last_pair: dict[str, float | int] | None,
                    settings: VerifySettings) -> dict[str, Any]:
    """The ``verify`` object of ``GET /-/policy``."""
    v = verdict
    return {
        "state": state, "policy": policy, "in_force": in_force,
        "reason": None if v is None else v.reason, "pairs": pairs, "void_pairs": void_pairs,
        "gain": None if v is None else v.gain, "ci": None if v is None or v.ci is None else list(v.ci),
        "confidence": None if v is None else v.confidence, "started_at": started_at,
        "decided_at": decided_at, "last_pair": last_pair, "settings": settings.as_dict(),
    }
