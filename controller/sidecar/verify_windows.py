"""The live verification's measurement: which requests each window counts and what they took.

A window counts the stage requests that arrive after its first ``settle`` seconds (the previous
window's requests still run then), each from arrival at the sidecar to the end of its response,
across the switch to the next window; those still running one window after their own window
ended are counted with their age so far (censored), so a pair is complete in bounded time. A
pair's two windows give one number, ``ln(mean_default / mean_policy)``
(:func:`pair_log_ratio`), which :func:`overtake.controller.sidecar.verify_stats.judge` reads.

Apart from the verifier's schedule (:mod:`overtake.controller.sidecar.verify`) so that the
accounting and the pair's number can be checked alone, without an event loop.
"""

from __future__ import annotations

import math

__all__ = ["Window", "WindowLedger", "pair_log_ratio"]


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


def pair_log_ratio(pol: Window, dft: Window, min_requests: int) -> float | None:
    """``ln(mean_default / mean_policy)`` of one pair, or None when the pair is void: a window with
    fewer than ``min_requests`` counted requests, or with no time at all, says nothing about its arm."""
    if pol.n < min_requests or dft.n < min_requests or not pol.total or not dft.total:
        return None
    return math.log(dft.total / dft.n) - math.log(pol.total / pol.n)


class WindowLedger:
    """The windows so far and the counted requests still running (O(1) per request event).

    Parameters
    ----------
    settle
        Leading seconds of a window whose arrivals are not counted.
    grace
        Seconds after a window's end at which its requests still running are counted with their
        age so far (one window length).
    """

    def __init__(self, settle: float, grace: float) -> None:
        self.settle = settle
        self.grace = grace
        self.windows: list[Window] = []
        self.tickets: dict[int, tuple[int, float]] = {}  # seq -> (window index, arrival)

    def reset(self) -> None:
        """Forget every window and request (a new policy is verified from scratch)."""
        self.windows, self.tickets = [], {}

    def open(self, arm: str, now: float) -> None:
        """A window running ``arm`` starts at ``now``."""
        self.windows.append(Window(arm, now, self.settle))

    def close(self, now: float) -> None:
        """The current window ends at ``now`` (its requests still running go on being counted)."""
        self.windows[-1].end = now

    def count(self, seq: int, arrived: float) -> None:
        """A request ``seq`` that arrived at ``arrived``: the current window counts it unless it
        arrived in the settle time."""
        if not self.windows:
            return
        w = self.windows[-1]
        if arrived >= w.counted_from:
            self.tickets[seq] = (len(self.windows) - 1, arrived)
            w.outstanding += 1

    def end(self, seq: int, now: float, rejected: bool) -> None:
        """Request ``seq`` ended at ``now``: its window adds its response time (if it counts it)."""
        rec = self.tickets.pop(seq, None)
        if rec is None:
            return
        w = self.windows[rec[0]]
        w.outstanding -= 1
        w.n += 1
        w.total += now - rec[1]
        w.rejected += rejected

    def final(self, index: int, now: float) -> bool:
        """Window ``index`` has all its requests counted (those still running ``grace`` after its
        end are counted with their age so far)."""
        w = self.windows[index]
        if w.end is None:
            return False
        if w.outstanding and now >= w.end + self.grace:
            for seq, (k, t0) in list(self.tickets.items()):
                if k == index:
                    del self.tickets[seq]
                    w.n += 1
                    w.total += now - t0
                    w.censored += 1
            w.outstanding = 0
        return w.outstanding == 0

    def pair(self, k: int, now: float) -> tuple[Window, Window] | None:
        """Pair ``k``'s windows as (policy, default) once both are final, else None."""
        a, b = 2 * k, 2 * k + 1
        if b >= len(self.windows) or not (self.final(a, now) and self.final(b, now)):
            return None
        first, second = self.windows[a], self.windows[b]
        return (first, second) if first.arm == "policy" else (second, first)
