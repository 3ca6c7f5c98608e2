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

This module is the schedule: which arm is in force when, and when the pairs are judged. The
options are :mod:`.verify_settings`'s, the counting of requests into windows and a pair's number
:mod:`.verify_windows`'s, the statistics :mod:`.verify_stats`'s, the log lines and the status
document :mod:`.verify_report`'s.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from overtake.controller.sidecar import verify_report as report
from overtake.controller.sidecar.control_file import ControlPublisher, age_thresholds
from overtake.controller.sidecar.limiter import PASSTHROUGH, Limiter, LimiterListener, Ticket
from overtake.controller.sidecar.policies import SpawnPolicy
from overtake.controller.sidecar.verify_settings import VerifySettings
from overtake.controller.sidecar.verify_stats import Verdict, judge
from overtake.controller.sidecar.verify_windows import Window, WindowLedger, pair_log_ratio

__all__ = ["ARMS", "STATES", "VerifySettings", "Verifier", "Window"]

#: what a window runs: the sidecar's policy or Apache's default
ARMS = ("policy", "default")
#: idle: nothing to verify (the policy is Apache's default); verifying; kept; fell_back
STATES = ("idle", "verifying", "kept", "fell_back")


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
        self.ledger = WindowLedger(settings.settle, settings.window)
        self.ratios: list[float] = []  #: ln(default mean / policy mean), one per usable pair
        self.void_pairs = 0  #: pairs with a window of fewer than min_requests counted requests
        self.verdict: Verdict | None = None
        self.decided_at: float | None = None
        self.started_at: float | None = None
        self.last_pair: dict[str, float | int] | None = None
        #: over the sidecar's life, for the counters
        self.pairs_total = {"used": 0, "void": 0}
        self.decisions_total: dict[tuple[str, str], int] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._started = False

    @property
    def windows(self) -> list[Window]:
        """The windows of the current verification, in order (pairs are windows 2k and 2k + 1)."""
        return self.ledger.windows

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
        self.ledger.reset()
        self.ratios = []
        self.void_pairs, self.verdict, self.decided_at, self.last_pair = 0, None, None, None
        self.arm = "policy"
        if not self._started:
            return
        if self.is_default(policy):
            self.state = "idle"
            report.log_idle(policy.name)
            return
        self.state = "verifying"
        self.started_at = time.time()
        report.log_start(policy.name, self.settings, self._default_cpu())
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
        self.ledger.open(arm, self.clock())
        self._put(arm)
        self._timer = asyncio.get_running_loop().call_later(self.settings.window, self._tick)

    def _next_arm(self) -> str:
        """A pair's second window runs the other arm; a pair's first is drawn at random (A/B or B/A)."""
        if len(self.windows) % 2:
            return "default" if self.windows[-1].arm == "policy" else "policy"
        return self.rng.choice(ARMS)

    def _tick(self) -> None:
        """A window ends: close it, judge the pairs that are complete, open the next window."""
        self._timer = None
        try:
            now = self.clock()
            self.ledger.close(now)
            self._finish_pairs(now)
            if self.state == "verifying":
                self._open(self._next_arm())
        except Exception as exc:  # noqa: BLE001 - a timer callback: an escape would stall the arms unseen
            report.log_error(self.chosen.name, exc)
            self._decide(Verdict("fall_back", "error", len(self.ratios), None, None, 0.0))

    # ---- the pairs ---------------------------------------------------------------------------
    def _finish_pairs(self, now: float) -> None:
        """Judge every pair whose windows are final, in order, until one decides."""
        while (pair := self.ledger.pair(len(self.ratios) + self.void_pairs, now)) is not None:
            if (v := self._take_pair(*pair)) is not None and v.decision != "continue":
                self._decide(v)
                return

    def _take_pair(self, pol: Window, dft: Window) -> Verdict | None:
        """Count one complete pair (or void it) and judge the pairs so far; None for a void pair."""
        s = self.settings
        self.last_pair = report.pair_summary(pol, dft)
        ratio = pair_log_ratio(pol, dft, s.min_requests)
        if ratio is None:
            self.void_pairs += 1
            self.pairs_total["void"] += 1
            report.log_void_pair(self.chosen.name, len(self.ratios) + self.void_pairs, pol, dft, s.min_requests,
                                 self.last_pair)
            return None
        self.ratios.append(ratio)
        self.pairs_total["used"] += 1
        self.verdict = v = judge(self.ratios, level=s.level, min_pairs=s.min_pairs, max_pairs=s.max_pairs,
                                 min_gain=s.min_gain)
        report.log_pair(self.chosen.name, len(self.ratios), pol, dft, v, self.last_pair)
        return v

    def _decide(self, v: Verdict) -> None:
        self._cancel()
        self.verdict = v
        self.state = "kept" if v.decision == "keep" else "fell_back"
        self.decided_at = time.time()
        self.ledger.tickets = {}
        key = (self.state, v.reason)
        self.decisions_total[key] = self.decisions_total.get(key, 0) + 1
        self._put("policy" if v.decision == "keep" else "default")
        report.log_decision(self.chosen.name, self.state, v, self.void_pairs)

    # ---- the tickets (LimiterListener: O(1) on the request path) ------------------------------
    def _count(self, t: Ticket, arrived: float) -> None:
        if self.state == "verifying" and t.stage != PASSTHROUGH:
            self.ledger.count(t.seq, arrived)

    def on_arrival(self, ticket: Ticket, now: float) -> None:
        self._count(ticket, now)

    def on_claim(self, ticket: Ticket, now: float) -> None:
        self._count(ticket, ticket.t_arrive)

    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        if self.ledger.tickets:
            self.ledger.end(ticket.seq, now, False)

    def on_reject(self, ticket: Ticket, reason: str) -> None:
        if self.ledger.tickets:
            self.ledger.end(ticket.seq, self.clock(), True)

    # ---- the view ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The ``verify`` object of ``GET /-/policy``."""
        return report.status_document(
            state=self.state, policy=self.chosen.name, in_force=self.arm, verdict=self.verdict,
            pairs=len(self.ratios), void_pairs=self.void_pairs, started_at=self.started_at,
            decided_at=self.decided_at, last_pair=self.last_pair, settings=self.settings)
