"""overtake.controller.sidecar.limiter under random interleavings (hypothesis), no network.

Checked after every operation: the global hard cap, per-stage caps of π(k1,k2), the conservation
law admitted = completed + failed + inflight, queue bookkeeping, that a listener has heard one
event per admission, release and rejection (the limiter's own counters, by stage), and — for a
solved table policy — that the threads started in each (stage, phase) are exactly the policy's
answer at the state it was asked in.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.limiters import Mode, make_limiter, picked

from overtake.controller.sidecar.limiter import ADMITTED, DONE, PASSTHROUGH, QUEUED, Limiter, LimiterListener, Ticket
from overtake.controller.sidecar.policies import BaselinePolicy, SpawnPolicy, load_policy
from overtake.mdp import Stage, TandemModel, Truncation, solve

NAMES = ("stage1", "stage2")


@pytest.fixture(scope="module")
def h2_policy(tmp_path_factory: pytest.TempPathFactory) -> SpawnPolicy:
    a, T = np.array([0.91, 0.09]), np.diag(-1.0 / np.array([0.55, 5.45]))
    model = TandemModel(arrival_rate=0.3, stages=(Stage("stage1", a, T), Stage("stage2", a, T)))
    opt = solve(model, truncation=Truncation(8, 3))
    path = tmp_path_factory.mktemp("pol") / "h2.npz"
    opt.policy.save(path)
    return load_policy(str(path), NAMES)


class Recording:
    """Wraps a policy and records every (state, action) consult."""

    def __init__(self, inner: SpawnPolicy) -> None:
        self.inner = inner
        self.log: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for k in ("name", "version", "hash", "phases", "per_phase_queues", "threads_per_stage", "phase_info",
                  "predicted_wait", "passthrough_wait", "alpha", "T", "labels"):
            setattr(self, k, getattr(inner, k))

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        a = self.inner.action(state)
        self.log.append((state, a))
        return a


class Events(LimiterListener):
    """Every event a limiter reports, in order: (kind, ticket, stage, detail)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Ticket, int, str]] = []

    def on_arrival(self, ticket: Ticket, now: float) -> None:
        self.log.append(("arrival", ticket, ticket.stage, ""))

    def on_admit(self, ticket: Ticket, now: float) -> None:
        self.log.append(("admit", ticket, ticket.stage, ""))

    def on_release(self, ticket: Ticket, now: float, outcome: str) -> None:
        self.log.append(("release", ticket, ticket.stage, outcome))

    def on_reject(self, ticket: Ticket, reason: str) -> None:
        self.log.append(("reject", ticket, ticket.stage, reason))

    def on_claim(self, ticket: Ticket, now: float) -> None:
        self.log.append(("claim", ticket, ticket.stage, ""))

    def count(self, kind: str) -> dict[tuple[int, str], int]:
        out: dict[tuple[int, str], int] = {}
        for k, _, stage, detail in self.log:
            if k == kind:
                out[(stage, detail)] = out.get((stage, detail), 0) + 1
        return out


def _limiter(policy: Any, *, max_inflight: int = 1000, queue_cap: int = 1000, pt_cap: int | None = None,
             mode: Mode = "explicit") -> Limiter:
    lim = make_limiter(policy, NAMES, max_inflight=max_inflight, queue_cap=queue_cap, pt_cap=pt_cap, mode=mode)
    lim.add_listener(Events())
    return lim


def _check(lim: Limiter, tickets: list[Ticket]) -> None:
    # the listener heard each admission, release and rejection once, with the right stage
    ev = lim.listeners[0]
    assert isinstance(ev, Events)
    by_stage: dict[tuple[int, str], int] = {}
    for (stage, _phase), n in lim.admitted.items():
        if n:
            by_stage[(stage, "")] = by_stage.get((stage, ""), 0) + n
    assert ev.count("admit") == by_stage
    assert ev.count("release") == {k: v for k, v in _by_stage_outcome(lim).items() if v}
    assert ev.count("reject") == {k: v for k, v in lim.rejected.items() if v}
    assert lim.inflight_total <= lim.max_inflight
    admitted = sum(lim.admitted.values())
    ended = sum(lim.completed.values())
    assert admitted == ended + lim.inflight_total
    live = [t for t in tickets if t.status == ADMITTED]
    assert len(live) == lim.inflight_total
    queued = [t for t in tickets if t.status == QUEUED and t.stage != PASSTHROUGH]
    assert sum(lim.waiting) == sum(lim.stage_waiting) == len(queued)
    assert sum(lim.threads) == len([t for t in live if t.stage != PASSTHROUGH])
    if lim.passthrough_cap is not None:
        assert lim.pt_inflight <= lim.passthrough_cap


def _by_stage_outcome(lim: Limiter) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    for (stage, _phase, outcome), n in lim.completed.items():
        out[(stage, outcome)] = out.get((stage, outcome), 0) + n
    return out


ops = st.lists(
    st.tuples(st.sampled_from(["arrive", "arrive", "arrive", "finish", "fail", "cancel"]),
              st.integers(0, 2), st.integers(0, 1), st.integers(0, 10_000)),
    min_size=1, max_size=120,
)


def _run(lim: Limiter, program: list[tuple[str, int, int, int]], after: Any = None) -> list[Ticket]:
    async def body() -> list[Ticket]:
        tickets: list[Ticket] = []
        for op, stage, phase, pick in program:
            completed_coord = None
            threads0 = list(lim.threads)
            consults0 = len(getattr(lim.policy, "log", []))
            guard0 = lim.guard_admissions
            if op == "arrive":
                s = PASSTHROUGH if stage == 2 else stage
                ph = 0 if s == PASSTHROUGH else min(phase, lim.phases[s] - 1)
                t = lim.submit(s, ph, "r")
                if t is not None:
                    tickets.append(t)
            else:
                t = picked(tickets, op, pick)
                if t is None:
                    continue
                if op == "cancel":
                    assert lim.cancel(t, "client_gone")
                else:
                    if t.stage != PASSTHROUGH:
                        completed_coord = lim.offset[t.stage] + t.phase
                    lim.release(t, "completed" if op == "finish" else "failed")
                assert t.status == DONE
            _check(lim, tickets)
            if after is not None:
                after(threads0, completed_coord, consults0, guard0)
        return tickets

    return asyncio.run(body())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, caps=st.tuples(st.integers(1, 3), st.integers(1, 3)), hard=st.integers(1, 5),
       pt=st.one_of(st.none(), st.integers(1, 3)))
def test_per_stage_caps_and_hard_cap_hold(program: list[Any], caps: tuple[int, int], hard: int, pt: int | None) -> None:
    lim = _limiter(BaselinePolicy(f"pi({caps[0]},{caps[1]})", 2), max_inflight=hard, pt_cap=pt)

    def after(*_: Any) -> None:
        assert lim.threads[0] <= caps[0] and lim.threads[1] <= caps[1]
        # work conserving up to the caps: nothing waits while its stage and the hard cap have room
        for i in range(2):
            if lim.stage_waiting[i] and lim.inflight_total < hard:
                assert lim.threads[i] == caps[i]

    _run(lim, program, after)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, k=st.integers(1, 4))
def test_pi_k_total_cap(program: list[Any], k: int) -> None:
    lim = _limiter(BaselinePolicy(f"pi({k})", 2))

    def after(*_: Any) -> None:
        assert sum(lim.threads) <= k
        if any(lim.stage_waiting):
            assert sum(lim.threads) == k

    _run(lim, program, after)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops)
def test_table_policy_is_followed_exactly(h2_policy: SpawnPolicy, program: list[Any]) -> None:
    rec = Recording(h2_policy)
    lim = _limiter(rec)

    def after(threads0: list[int], done: int | None, consults0: int, guard0: int) -> None:
        started = np.array(lim.threads) - np.array(threads0)
        if done is not None:
            started[done] += 1
        want = np.zeros(len(started), dtype=int)
        for _state, act in rec.log[consults0:]:
            want += np.array(act)
        assert lim.guard_admissions == guard0  # a solved policy never idles with work waiting
        np.testing.assert_array_equal(started, want)

    _run(lim, program, after)


def test_swap_keeps_queue_order_and_counts(h2_policy: SpawnPolicy) -> None:
    async def body() -> None:
        lim = _limiter(BaselinePolicy("pi(1)", 2))
        ts = [lim.submit(0, 0, "r") for _ in range(5)]
        assert [t.status for t in ts] == [ADMITTED] + [QUEUED] * 4  # type: ignore[union-attr]
        lim.swap(h2_policy)  # 1 -> 2 phases per stage; queued requests re-bucketed in order
        assert sum(lim.waiting) + sum(lim.threads) == 5
        lim.swap(BaselinePolicy("pi(3)", 2))
        admitted = [t for t in ts if t.status == ADMITTED]  # type: ignore[union-attr]
        assert len(admitted) == 3 and admitted == ts[:3]  # FCFS kept across two swaps
        for t in admitted:
            lim.release(t, "completed")
        assert lim.inflight_total == 2 and sum(lim.completed.values()) == 3

    asyncio.run(body())


def test_queue_full_and_cancel_are_counted() -> None:
    async def body() -> None:
        lim = _limiter(BaselinePolicy("pi(1)", 2), queue_cap=2)
        a = lim.submit(0, 0, "r")
        b = lim.submit(0, 0, "r")
        c = lim.submit(0, 0, "r")
        assert a is not None and b is not None and c is not None
        assert lim.submit(0, 0, "r") is None
        assert lim.cancel(b, "queue_timeout") and not lim.cancel(a, "client_gone")
        lim.release(a, "completed")
        assert c.status == ADMITTED and c.future is not None and c.future.done()
        assert lim.rejected == {(0, "queue_full"): 1, (0, "queue_timeout"): 1}

    asyncio.run(body())


def test_queue_cap_zero_admits_while_room_and_rejects_waiters() -> None:
    async def body() -> None:
        lim = _limiter(BaselinePolicy("pi(2)", 2), queue_cap=0)
        a, b = lim.submit(0, 0, "r"), lim.submit(1, 0, "r")
        assert a is not None and b is not None and a.status == b.status == ADMITTED
        assert lim.submit(0, 0, "r") is None  # would have to wait: no queue allowed
        assert lim.rejected == {(0, "queue_full"): 1} and sum(lim.waiting) == 0
        assert lim.stage_limit(0, 0) == 1 and lim.stage_limit(1, 0) == 1  # pi(2): both threads busy
        unlimited = _limiter(BaselinePolicy("passthrough", 2))
        assert unlimited.stage_limit(0, 0) == float("inf")

    asyncio.run(body())


# ---- tandem routing: reservations for the client's next-stage request -----------------------


def test_reservation_takes_the_thread_a_waiting_first_stage_request_would_get() -> None:
    # pi(1): one thread in all, later stages first (van der Weij et al., "Dynamic thread assignment" §3).
    # When A's stage-1 request ends,
    # its stage-2 follow-up must run before B's waiting stage-1 request, as in the model's
    # tandem where A joins queue 2 at that instant; without the reservation B goes first.
    async def body(reserve: bool) -> tuple[str, Limiter]:
        lim = _limiter(BaselinePolicy("pi(1)", 2))
        a = lim.submit(0, 0, "a")
        b = lim.submit(0, 0, "b")
        assert a is not None and b is not None and a.status == ADMITTED and b.status == QUEUED
        hold = lim.release(a, "completed", (1, 0) if reserve else None)
        if not reserve:
            assert hold is None
            return ("b" if b.status == ADMITTED else "a2"), lim
        assert hold is not None and hold.status == ADMITTED and b.status == QUEUED
        a2 = lim.claim(hold, 0, "a2")
        assert a2 is hold and a2.status == ADMITTED and a2.route == "a2"
        return "a2", lim

    assert asyncio.run(body(True))[0] == "a2"
    assert asyncio.run(body(False))[0] == "b"


def test_lapsed_reservations_are_counted_and_free_their_thread() -> None:
    async def body() -> Limiter:
        lim = _limiter(BaselinePolicy("pi(1)", 2))
        a = lim.submit(0, 0, "a")
        b = lim.submit(0, 0, "b")
        assert a is not None and b is not None
        hold = lim.release(a, "completed", (1, 0))
        assert hold is not None and hold.status == ADMITTED and b.status == QUEUED
        lim.abandon(hold)  # the follow-up never came: its thread goes to b
        assert hold.status == DONE and b.status == ADMITTED
        assert lim.claim(hold, 0, "late") is None  # a late follow-up is submitted afresh
        lim.abandon(hold)  # idempotent
        # a queued reservation that lapses is a rejection, not a completion
        c = lim.submit(0, 0, "c")
        assert c is not None and c.status == QUEUED
        hold2 = lim.release(b, "completed", (1, 0))
        assert hold2 is not None and hold2.status == ADMITTED and c.status == QUEUED
        lim.abandon(hold2)
        assert c.status == ADMITTED
        return lim

    lim = asyncio.run(body())
    assert lim.completed[(1, 0, "unused")] == 2
    assert lim.completed[(0, 0, "completed")] == 2
    assert sum(lim.admitted.values()) == sum(lim.completed.values()) + lim.inflight_total


def test_claim_in_another_phase_moves_the_reservation(h2_policy: SpawnPolicy) -> None:
    async def body() -> Limiter:
        lim = _limiter(h2_policy)
        a = lim.submit(0, 0, "a")
        assert a is not None and a.status == ADMITTED
        hold = lim.release(a, "completed", (1, 0))
        assert hold is not None and hold.status == ADMITTED
        assert lim.threads[lim.offset[1] + 0] == 1
        t = lim.claim(hold, 1, "a2")  # the follow-up turned out to be in phase 2
        assert t is hold and t.phase == t.start_phase == 1
        assert lim.threads[lim.offset[1] + 0] == 0 and lim.threads[lim.offset[1] + 1] == 1
        return lim

    asyncio.run(body())


def test_listener_hears_each_event_once_with_its_stage() -> None:
    """A known sequence under π(1) (one thread in all, later stages first) with a passthrough lane
    of 1 and queues of 1: the listener hears exactly these events, in this order."""

    async def body() -> tuple[Limiter, list[tuple[str, str, int, str]]]:
        lim = _limiter(BaselinePolicy("pi(1)", 2), pt_cap=1, queue_cap=1)
        a = lim.submit(0, 0, "a")
        b = lim.submit(1, 0, "b")
        c = lim.submit(0, 0, "c")
        assert lim.submit(0, 0, "x") is None  # c already waits at stage 1: the queue is full
        p = lim.submit(PASSTHROUGH, 0, "p")
        assert a is not None and b is not None and c is not None and p is not None
        assert lim.cancel(c, "client_gone")
        hold = lim.release(a, "completed", (1, 0))  # b is older in stage 2: it gets the thread
        assert hold is not None and hold.status == QUEUED and b.status == ADMITTED
        lim.release(b, "failed")
        assert lim.claim(hold, 0, "a2") is hold and hold.status == ADMITTED
        lim.release(hold, "completed")
        lim.release(p, "completed")
        ev = lim.listeners[0]
        assert isinstance(ev, Events)
        return lim, [(kind, t.route, stage, detail) for kind, t, stage, detail in ev.log]

    lim, log = asyncio.run(body())
    assert log == [
        ("arrival", "a", 0, ""), ("admit", "a", 0, ""),
        ("arrival", "b", 1, ""),
        ("arrival", "c", 0, ""),
        ("arrival", "x", 0, ""), ("reject", "x", 0, "queue_full"),
        ("arrival", "p", PASSTHROUGH, ""), ("admit", "p", PASSTHROUGH, ""),
        ("reject", "c", 0, "client_gone"),
        ("release", "a", 0, "completed"), ("admit", "b", 1, ""),
        ("release", "b", 1, "failed"), ("admit", "a2", 1, ""),
        ("claim", "a2", 1, ""),
        ("release", "a2", 1, "completed"),
        ("release", "p", PASSTHROUGH, "completed"),
    ]
    assert lim.admitted_total == sum(1 for e in log if e[0] == "admit") == 4
    assert sum(lim.completed.values()) == sum(1 for e in log if e[0] == "release") == 4


follow_ops = st.lists(
    st.tuples(st.sampled_from(["arrive", "arrive", "finish", "follow", "claim", "abandon", "cancel"]),
              st.integers(0, 1), st.integers(0, 1), st.integers(0, 10_000)),
    min_size=1, max_size=120,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=follow_ops, hard=st.integers(1, 4))
def test_reservations_keep_every_invariant(h2_policy: SpawnPolicy, program: list[Any], hard: int) -> None:
    lim = _limiter(h2_policy, max_inflight=hard)

    async def body() -> None:
        tickets: list[Ticket] = []
        holds: list[Ticket] = []
        for op, stage, phase, pick in program:
            if op == "arrive":
                t = lim.submit(stage, phase, "r")
                if t is not None:
                    tickets.append(t)
            elif op in ("finish", "follow"):
                pool = [t for t in tickets if t.status == ADMITTED and not t.held]
                if not pool:
                    continue
                t = pool[pick % len(pool)]
                hold = lim.release(t, "completed", (1, phase) if op == "follow" and t.stage == 0 else None)
                if hold is not None:
                    tickets.append(hold)
                    holds.append(hold)
            elif op in ("claim", "abandon"):
                live = [h for h in holds if h.held]
                if not live:
                    continue
                h = live[pick % len(live)]
                if op == "claim":
                    assert lim.claim(h, phase, "r2") is h and not h.held
                else:
                    lim.abandon(h)
                    assert h.status == DONE
            else:
                pool = [t for t in tickets if t.status == QUEUED and not t.held]
                if pool:
                    assert lim.cancel(pool[pick % len(pool)], "client_gone")
            _check(lim, tickets)
            # work-conserving: something waits only if something is in service or the cap is full
            if any(lim.stage_waiting):
                assert sum(lim.threads) > 0 or lim.inflight_total >= lim.max_inflight

    asyncio.run(body())
