"""Live verification: the policy against Apache's default on live traffic, kept only if it helps.

A model's prediction can be wrong for a real server (a lock that serialises a stage, costs that
are not independent, a floor under every request), so with ``verify`` on the sidecar does not
take its policy on trust. :class:`Verifier` runs it in alternating windows against Apache's
default — every request forwarded at once (π(∞)) and, with a control file, no CPU demotion in
Apache — two windows per pair in a random order (A/B or B/A). It measures the mean response time
of the stage requests that arrive in each window (from arrival at the sidecar to the end of the
response, the sojourn the policy was solved to minimise: every transaction visits each stage
once, so the mean over requests is the mean transaction sojourn over the stage count and has the
same ratio) and judges the pairs (:func:`~overtake.controller.sidecar.verify_stats.judge`): keep
the policy, fall back to Apache's default, or go on. The first ``settle`` seconds of a window are
not counted: the previous window's requests still run then.

Switching loses nothing: a switch is one atomic limiter swap (:meth:`overtake.controller.sidecar.limiter.Limiter.swap`)
plus a control-file write. Requests in Apache finish as they were started (the module puts new
thresholds in force at the next request start); requests queued in the sidecar when the default
window opens are forwarded at once, as the default would have. A window's requests are counted
until they end, across the switch; those still running one window after their own ended are
counted with their age so far.

After a decision the verdict stands until the policy changes (a refit that swaps, ``PUT
/-/policy``, the policy file, an auto choice): then the new policy is verified. A policy that is
Apache's default already (π(∞) without thresholds) needs no verification (state ``idle``).

Each decision is one log line (``event = verification_decision``, with the gain and its CI);
``GET /-/policy`` shows :meth:`Verifier.status`, the metrics are
:class:`overtake.controller.sidecar.verify_metrics.VerifyCollector`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.control_file import ControlPublisher, age_thresholds
from overtake.controller.sidecar.limiter import PASSTHROUGH, Limiter, LimiterListener, Ticket
from overtake.controller.sidecar.policies import SpawnPolicy
from overtake.controller.sidecar.verify_stats import Verdict, judge

__all__ = ["ARMS", "STATES", "VerifySettings", "Verifier", "Window"]

log = logging.getLogger("overtake.sidecar")

#: what a window runs: the sidecar's policy or Apache's default
ARMS = ("policy", "default")
#: idle: nothing to verify (the policy is Apache's default); verifying; kept; fell_back
STATES = ("idle", "verifying", "kept", "fell_back")


@dataclass(frozen=True)
class VerifySettings:
    """Options of the live verification (``overtake sidecar --verify ...``). Times in seconds."""

    window: float = 30.0  #: length of each window
    settle: float = 5.0  #: leading seconds of a window whose arrivals are not counted
    min_pairs: int = 3  #: pairs before any decision
    max_pairs: int = 20  #: pairs after which a decision is forced
    min_gain: float = 0.02  #: at max_pairs, the estimated gain a policy must show to be kept
    level: float = 0.95  #: confidence over all looks together (verify_stats)
    min_requests: int = 20  #: counted requests a window needs for its pair to count

    def __post_init__(self) -> None:
        checks = (
            ("verify-window", math.isfinite(self.window) and self.window > 0, "a number of seconds > 0, e.g. 30"),
            ("verify-settle", math.isfinite(self.settle) and 0 <= self.settle < self.window,
             f"a number of seconds in [0, --verify-window) = [0, {self.window:g}), e.g. 5"),
            ("verify-min-pairs", self.min_pairs >= 2, "an integer >= 2 (a CI needs two pairs), e.g. 3"),
            ("verify-max-pairs", self.max_pairs >= self.min_pairs,
             f"an integer >= --verify-min-pairs ({self.min_pairs}), e.g. 20"),
            ("verify-min-gain", math.isfinite(self.min_gain) and -1 < self.min_gain < 1,
             "a fraction in (-1, 1), e.g. 0.02"),
            ("verify-level", 0.5 <= self.level < 1, "a confidence in [0.5, 1), e.g. 0.95"),
            ("verify-min-requests", self.min_requests >= 1, "an integer >= 1, e.g. 20"),
        )
        for name, ok, fix in checks:
            if not ok:
                raise SidecarInputError(f"--{name}: must be {fix}")


class Window:
    """One window's arm and what its counted requests took."""

    __slots__ = ("arm", "counted_from", "end", "n", "outstanding", "rejected", "start", "total", "censored")

    def __init__(self, arm: str, start: float, settle: float) -> None:
        self.arm = arm
        self.start = start
        self.counted_from = start + settle
        self.end: float | None = None
        self.n = 0  #: counted requests ended (completed, failed, rejected, or censored)
        self.total = 0.0  #: their response times, seconds
        self.outstanding = 0  #: counted requests not ended yet
        self.rejected = 0
        self.censored = 0  #: still running one window after the end: counted with their age

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


def _pair_summary(pol: Window, dft: Window) -> dict[str, float | int]:
    """One pair of windows as ``status()`` shows it (``last_pair``)."""
    return {"policy_mean_seconds": pol.mean or 0.0, "default_mean_seconds": dft.mean or 0.0,
            "policy_requests": pol.n, "default_requests": dft.n,
            "policy_rejected": pol.rejected, "default_rejected": dft.rejected,
            "censored": pol.censored + dft.censored}


def _decision_text(v: Verdict) -> str:
    """The log line's account of a decision: what happens, after how many pairs, the gain and why."""
    ci = "" if v.ci is None else f" (CI {v.ci[0]:+.1%} .. {v.ci[1]:+.1%} at {v.confidence:.4g})"
    gain = "no estimate" if v.gain is None else f"gain {v.gain:+.1%}{ci}"
    what = ("kept" if v.decision == "keep" else "falling back to Apache's default")
    return f"{what} after {v.pairs} pairs: {gain} ({v.reason})"


class Verifier(LimiterListener):
    """Alternates the policy and Apache's default until the pairs decide (module docstring).

    Parameters
    ----------
    settings
        Window length, settle time, pairs, minimum gain, confidence.
    limiter
        Enforces the arm in force (:meth:`~overtake.controller.sidecar.limiter.Limiter.swap`); the
        verifier listens to its tickets (add it with ``limiter.add_listener``).
    passthrough
        π(∞) for the stages: the default's admission.
    control
        The control file, or None: the default's CPU side (no demotion) needs it.
    time_unit
        Seconds per model time unit now (the policy's thresholds are in model units).
    prio_levels
        The level count mod_overtake_prio reports (its configured ``OvertakePrioLevels``), or None:
        the default's thresholds need as many as the module has configured.
    """

    def __init__(self, settings: VerifySettings, *, limiter: Limiter, passthrough: SpawnPolicy,
                 control: ControlPublisher | None, time_unit: Callable[[], float],
                 prio_levels: Callable[[], int | None], rng: random.Random | None = None) -> None:
        self.settings = settings
        self.limiter = limiter
        self.passthrough = passthrough
        self.control = control
        self.time_unit = time_unit
        self.prio_levels = prio_levels
        self.rng = rng or random.Random()
        self.clock = limiter.clock
        self.chosen: SpawnPolicy = limiter.policy
        self.state = "idle"
        self.arm = "policy"
        self.windows: list[Window] = []
        self.ratios: list[float] = []  #: ln(default mean / policy mean), one per usable pair
        self.void_pairs = 0  #: pairs with a window of fewer than min_requests counted requests
        self.verdict: Verdict | None = None
        self.decided_at: float | None = None
        self.started_at: float | None = None
        self.last_pair: dict[str, float | int] | None = None
        #: over the sidecar's life, for the counters
        self.pairs_total = {"used": 0, "void": 0}
        self.decisions_total: dict[tuple[str, str], int] = {}
        self._tickets: dict[int, tuple[int, float]] = {}  # seq -> (window index, arrival)
        self._timer: asyncio.TimerHandle | None = None
        self._started = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Verify the policy in force (call on the running event loop)."""
        self._started = True
        self.adopt(self.limiter.policy)

    def close(self) -> None:
        self._cancel()
        self._started = False

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def is_default(self, policy: SpawnPolicy) -> bool:
        """``policy`` is Apache's default already: π(∞) admission and no thresholds of its own."""
        chosen = getattr(policy, "chosen", policy)
        unlimited = bool(getattr(chosen, "unlimited", False))
        return unlimited and (self.control is None or age_thresholds(policy) is None)

    def adopt(self, policy: SpawnPolicy) -> None:
        """A new policy was installed (it is in force): verify it from scratch."""
        self._cancel()
        self.chosen = policy
        self.windows, self.ratios, self._tickets = [], [], {}
        self.void_pairs, self.verdict, self.decided_at, self.last_pair = 0, None, None, None
        self.arm = "policy"
        if not self._started:
            return
        if self.is_default(policy):
            self.state = "idle"
            log.info(f"verification: {policy.name} is Apache's default, nothing to verify",
                     extra={"event": "verification_idle", "policy": policy.name})
            return
        self.state = "verifying"
        self.started_at = time.time()
        s = self.settings
        log.info(f"verification: {policy.name} against Apache's default in windows of {s.window:g} s, "
                 f"{s.min_pairs}..{s.max_pairs} pairs", extra={
                     "event": "verification_start", "policy": policy.name,
                     "detail": {"window": s.window, "settle": s.settle, "min_pairs": s.min_pairs,
                                "max_pairs": s.max_pairs, "min_gain": s.min_gain, "level": s.level,
                                "default_cpu": self._default_cpu()}})
        self._open(self.rng.choice(ARMS))

    # ---- the arms ----------------------------------------------------------------------------
    def _default_cpu(self) -> str:
        """What the default does about CPU priority, for the log."""
        if self.control is None:
            return "no control file: Apache's configured CPU priority stays in both arms"
        levels = self._levels()
        if not levels:
            return "the module's level count is unknown: its configured thresholds apply in the default"
        return f"no demotion ({levels} level(s) at the module's largest threshold)"

    def _levels(self) -> int | None:
        th = age_thresholds(self.chosen)
        return len(th[0]) if th else self.prio_levels()

    def _put(self, arm: str) -> None:
        """Put ``arm`` in force: the limiter's admission and Apache's thresholds."""
        self.arm = arm
        policy = self.chosen if arm == "policy" else self.passthrough
        if self.limiter.policy is not policy:
            self.limiter.swap(policy)
        if self.control is not None:
            if arm == "policy":
                self.control.publish(self.chosen, self.time_unit(), quiet=True)
            else:
                self.control.publish_off(self._levels(), quiet=True)

    def _open(self, arm: str) -> None:
        self.windows.append(Window(arm, self.clock(), self.settings.settle))
        self._put(arm)
        self._timer = asyncio.get_running_loop().call_later(self.settings.window, self._tick)

    def _tick(self) -> None:
        """A window ends: close it, judge the pairs that are complete, open the next window."""
        self._timer = None
        try:
            now = self.clock()
            self.windows[-1].end = now
            self._finish_pairs(now)
            if self.state != "verifying":
                return
            if len(self.windows) % 2:  # the pair's second window runs the other arm
                self._open("default" if self.windows[-1].arm == "policy" else "policy")
            else:
                self._open(self.rng.choice(ARMS))
        except Exception as exc:  # noqa: BLE001 - a timer callback: an escape would stall the arms unseen
            log.error("verification failed: falling back to Apache's default", extra={
                "event": "verification_error", "policy": self.chosen.name,
                "detail": f"{exc.__class__.__name__}: {exc}"})
            self._decide(Verdict("fall_back", "error", len(self.ratios), None, None, 0.0))

    # ---- the pairs ---------------------------------------------------------------------------
    def _final(self, index: int, now: float) -> bool:
        """Window ``index`` has all its requests counted (those still running one window after
        its end are counted with their age so far)."""
        w = self.windows[index]
        if w.end is None:
            return False
        if w.outstanding and now >= w.end + self.settings.window:
            for seq, (k, t0) in list(self._tickets.items()):
                if k == index:
                    del self._tickets[seq]
                    w.n += 1
                    w.total += now - t0
                    w.censored += 1
            w.outstanding = 0
        return w.outstanding == 0

    def _finish_pairs(self, now: float) -> None:
        s = self.settings
        while 2 * (done := len(self.ratios) + self.void_pairs) + 1 < len(self.windows):
            a, b = 2 * done, 2 * done + 1
            if not (self._final(a, now) and self._final(b, now)):
                return
            pol, dft = (self.windows[a], self.windows[b])[:: 1 if self.windows[a].arm == "policy" else -1]
            self.last_pair = _pair_summary(pol, dft)
            if pol.n < s.min_requests or dft.n < s.min_requests or not pol.total or not dft.total:
                self.void_pairs += 1
                self.pairs_total["void"] += 1
                log.info(f"verification pair {done + 1}: too few requests ({pol.n} policy, {dft.n} default; "
                         f"{s.min_requests} needed per window), not counted",
                         extra={"event": "verification_pair", "policy": self.chosen.name, "detail": self.last_pair})
                continue
            self.ratios.append(math.log(dft.total / dft.n) - math.log(pol.total / pol.n))
            self.pairs_total["used"] += 1
            self.verdict = v = judge(self.ratios, level=s.level, min_pairs=s.min_pairs, max_pairs=s.max_pairs,
                                     min_gain=s.min_gain)
            log.info(f"verification pair {len(self.ratios)}: policy {pol.mean:.4g} s, default {dft.mean:.4g} s"
                     + (f"; gain {v.gain:+.1%}" if v.gain is not None else ""),
                     extra={"event": "verification_pair", "policy": self.chosen.name,
                            "detail": {**self.last_pair, "gain": v.gain, "ci": v.ci}})
            if v.decision != "continue":
                self._decide(v)
                return

    def _decide(self, v: Verdict) -> None:
        self._cancel()
        self.verdict = v
        self.state = "kept" if v.decision == "keep" else "fell_back"
        self.decided_at = time.time()
        self._tickets = {}
        key = (self.state, v.reason)
        self.decisions_total[key] = self.decisions_total.get(key, 0) + 1
        self._put("policy" if v.decision == "keep" else "default")
        log.log(logging.INFO if v.decision == "keep" else logging.WARNING,
                f"verification: {self.chosen.name} {_decision_text(v)}",
                extra={"event": "verification_decision", "policy": self.chosen.name, "detail": {
                    "state": self.state, "reason": v.reason, "pairs": v.pairs, "gain": v.gain,
                    "ci": None if v.ci is None else list(v.ci), "confidence": v.confidence,
                    "void_pairs": self.void_pairs}})

    # ---- the tickets (LimiterListener: O(1) on the request path) ------------------------------
    def _count(self, t: Ticket, now: float) -> None:
        if self.state != "verifying" or t.stage == PASSTHROUGH or not self.windows:
            return
        w = self.windows[-1]
        if now >= w.counted_from:
            self._tickets[t.seq] = (len(self.windows) - 1, now)
            w.outstanding += 1

    def on_arrival(self, ticket: Ticket, now: float) -> None:
        self._count(ticket, now)

    def on_claim(self, ticket: Ticket, now: float) -> None:
        self._count(ticket, ticket.t_arrive)

    def _end(self, t: Ticket, now: float, rejected: bool) -> None:
        rec = self._tickets.pop(t.seq, None)
        if rec is None:
            return
        w = self.windows[rec[0]]
        w.outstanding -= 1
        w.n += 1
        w.total += now - rec[1]
        w.rejected += rejected

    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        if self._tickets:
            self._end(ticket, now, False)

    def on_reject(self, ticket: Ticket, reason: str) -> None:
        if self._tickets:
            self._end(ticket, self.clock(), True)

    # ---- the view ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The ``verify`` object of ``GET /-/policy``."""
        v, s = self.verdict, self.settings
        return {
            "state": self.state, "policy": self.chosen.name, "in_force": self.arm,
            "reason": None if v is None else v.reason, "pairs": len(self.ratios), "void_pairs": self.void_pairs,
            "gain": None if v is None else v.gain, "ci": None if v is None or v.ci is None else list(v.ci),
            "confidence": None if v is None else v.confidence, "started_at": self.started_at,
            "decided_at": self.decided_at, "last_pair": self.last_pair,
            "settings": {"window": s.window, "settle": s.settle, "min_pairs": s.min_pairs, "max_pairs": s.max_pairs,
                         "min_gain": s.min_gain, "level": s.level, "min_requests": s.min_requests},
        }
