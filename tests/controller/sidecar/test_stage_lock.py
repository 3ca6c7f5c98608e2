"""``lock: m`` on a stage (overtake.controller.sidecar.stage_lock), no network: the stages file's
field, the release order on a deterministic trace (known answers), the capacity under random
interleavings composed with the policy's own caps, and the lock's metrics."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from support.limiters import make_limiter, picked

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.limiter import ADMITTED, QUEUED, Limiter, Ticket
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.policies import BaselinePolicy
from overtake.controller.sidecar.stage_lock import StageLock
from overtake.controller.sidecar.stages import StagesConfig, StageTable, load_stages

NAMES = ("preview", "view")


def _table(lock: int | None = 1, key: bool = True, aging: float | None = None) -> StageTable:
    route: dict[str, Any] = {"path": "^/api[.]php$", "methods": ["POST"]}
    if key:
        route["key"] = ["body_size"]
    preview: dict[str, Any] = {"name": "preview", "routes": [route], "next": "view"}
    if lock is not None:
        preview["lock"] = lock
    if aging is not None:
        preview["lock_aging"] = aging
    return StageTable(StagesConfig.model_validate({"stages": [preview, {"name": "view", "path": "^/wiki/"}]}))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _limiter(table: StageTable, policy: str = "pi(inf)", clock: Clock | None = None,
             lock: bool = True) -> Limiter:
    lim = make_limiter(BaselinePolicy(policy, 2), NAMES, clock=clock or Clock())
    if lock:
        lim.set_lock(StageLock.from_table(table))
    return lim


# --------------------------------------------------------------------------- the stages file


@pytest.mark.parametrize(
    ("preview", "message"),
    [
        ({"lock": 0}, "stages[0].lock: the number of requests of the stage that may hold its lock at once"),
        ({"lock": -1}, "stages[0].lock: "),
        ({"lock": True}, "stages[0].lock: "),
        ({"lock": 1.5}, "stages[0].lock: "),
        ({"lock": "1"}, "omit lock for a stage without one"),
        ({"lock": 1, "lock_aging": 0}, "stages[0].lock_aging: seconds a request waits for the lock"),
        ({"lock": 1, "lock_aging": "1s"}, "stages[0].lock_aging: "),
        ({"lock_aging": 2}, "stages[0]: lock_aging applies to a stage with a lock: add lock: 1"),
    ],
)
def test_bad_lock_fields_name_the_field_and_the_fix(tmp_path: Path, preview: dict[str, Any], message: str) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(yaml.safe_dump({"stages": [{"name": "preview", "path": "^/api", **preview}]}))
    with pytest.raises(SidecarInputError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_stages(f)


def test_lock_fields_load(tmp_path: Path) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(yaml.safe_dump({"stages": [{"name": "a", "path": "^/a", "lock": 2, "lock_aging": 0.5},
                                            {"name": "b", "path": "^/b"}]}))
    t = load_stages(f)
    assert (t.lock(0), t.lock(1)) == (2, None)
    lock = StageLock.from_table(t)
    assert lock is not None and lock.caps == (2, None) and lock.aging == (0.5, None) and lock.keyed == (False, False)
    assert StageLock.from_table(_table(lock=None)) is None



def test_a_locked_stage_is_cpu_exempt_unless_the_file_says_otherwise() -> None:
    """Its requests hold the lock the others wait for: never demoted, whatever the method, unless
    ``cpu_exempt`` says otherwise; a stage without a lock keeps today's rule (demotable)."""
    t = _table(lock=1)
    assert t.cpu_exempt(0, "POST") and t.cpu_exempt(0, "GET") and not t.cpu_exempt(1, "GET")
    assert not _table(lock=None).cpu_exempt(0, "POST")
    cfg = {"stages": [{"name": "a", "path": "^/a", "lock": 1, "cpu_exempt": []},
                      {"name": "b", "path": "^/b", "lock": 1, "cpu_exempt": "unsafe"}]}
    t2 = StageTable(StagesConfig.model_validate(cfg))
    assert not t2.cpu_exempt(0, "POST") and t2.cpu_exempt(1, "POST") and not t2.cpu_exempt(1, "GET")

# --------------------------------------------------------------------------- the release order (known answers)

# holding times learned before the trace: key -> seconds (k? is never seen: the stage's mean)
LEARNED = {"k1": 0.01, "k2": 0.1, "k3": 1.0}
# (arrival time, key) of A..E; A finds the lock free
TRACE = [(0.0, "k3"), (0.1, "k3"), (0.2, "k2"), (0.3, "k1"), (0.4, "k?")]
COMPLETIONS = (0.5, 0.55, 0.6, 0.65, 0.7)  # each ends the request holding the lock


def _replay(lim: Limiter, clock: Clock) -> tuple[list[str], list[int]]:
    """Submit TRACE, then end the holder at each COMPLETIONS time: the order of admission (A..E)
    and, after every event, the requests of the locked stage inside Apache."""

    async def body() -> tuple[list[str], list[int]]:
        tickets: list[Ticket] = []
        inside: list[int] = []
        for t, key in TRACE:
            clock.t = t
            tk = lim.submit(0, 0, key)
            assert tk is not None
            tickets.append(tk)
            inside.append(lim.threads[0])
        for t in COMPLETIONS:
            clock.t = t
            for tk in sorted((x for x in tickets if x.status == ADMITTED), key=lambda x: x.t_admit):
                lim.release(tk, "completed")
                break
            inside.append(lim.threads[0])
        assert all(tk.status != QUEUED for tk in tickets)
        order = sorted(range(len(tickets)), key=lambda i: (tickets[i].t_admit, tickets[i].seq))
        return ["ABCDE"[i] for i in order], inside

    return asyncio.run(body())


def _learned(lim: Limiter) -> None:
    assert lim.lock is not None
    for key, s in LEARNED.items():
        lim.lock.learn(0, key, s)


def test_highest_response_ratio_first() -> None:
    clock = Clock()
    lim = _limiter(_table(), clock=clock)
    _learned(lim)
    order, inside = _replay(lim, clock)
    # A holds the lock. Ratios (wait + predicted) / predicted, the predictions learning each
    # completion (admission to answer): at 0.5 (A's 0.5 s joins k3: 0.75; the stage's mean 0.4025)
    # B 1.53, C 4.0, D 21, E 1.25: D; at 0.55 (k1 0.03, mean 0.332) B 1.60, C 4.5, E 1.45: C;
    # at 0.6 (k2 0.075, mean 0.285) B 1.67, E 1.70: E, then B
    assert order == ["A", "D", "C", "E", "B"]
    assert max(inside) == 1
    assert lim.lock is not None and lim.lock.aged == [0, 0]


def test_a_long_wait_goes_before_a_short_newcomer() -> None:
    """Shortest first would pass the long request over as long as short ones keep coming; its
    ratio (1 + wait / predicted) overtakes a newcomer's."""
    lock = StageLock(("s",), (1,), (True,), (None,))
    lock.learn(0, "long", 1.0)
    lock.learn(0, "short", 0.01)
    old, new = Ticket(0, 0, "long", 1, 0.0), Ticket(0, 0, "short", 2, 0.0)
    new.t_arrive = 1.5
    # at 1.504: the long one's ratio (1.504 + 1) / 1 = 2.504, the newcomer's (0.004 + 0.01) / 0.01 = 1.4
    assert lock.pick(0, [old, new], 1.504) is old and lock.aged == [1]
    # at 1.52 the newcomer's is 3.0, the long one's 2.52
    assert lock.pick(0, [old, new], 1.52) is new and lock.aged == [1]


def test_aging_bounds_the_pass_over() -> None:
    clock = Clock()
    lim = _limiter(_table(aging=0.48), clock=clock)
    _learned(lim)
    order, _ = _replay(lim, clock)
    # at 0.5 nothing has waited 0.48 s: D by its ratio; at 0.55 B (0.45 s) has not either: C; at 0.6
    # B has (0.5 s) and goes before E, whose ratio was the higher
    assert order == ["A", "D", "C", "B", "E"]
    assert lim.lock is not None and lim.lock.aged[0] == 1


def test_nothing_learned_is_oldest_first() -> None:
    lock = StageLock(("s",), (1,), (True,), (None,))
    a, b = Ticket(0, 0, "x", 1, 0.0), Ticket(0, 0, "y", 2, 0.1)
    assert lock.pick(0, [b, a], 0.2) is a and lock.aged == [0]


def test_no_key_is_oldest_first() -> None:
    clock = Clock()
    lim = _limiter(_table(key=False), clock=clock)
    _learned(lim)
    order, inside = _replay(lim, clock)
    assert order == ["A", "B", "C", "D", "E"] and max(inside) == 1


def test_without_the_lock_every_preview_goes_in_at_once() -> None:
    """The rule's counterfactual: π(∞) alone admits all five at their arrival."""
    clock = Clock()
    lim = _limiter(_table(), clock=clock, lock=False)
    order, inside = _replay(lim, clock)
    assert order == ["A", "B", "C", "D", "E"] and max(inside) == 5


def test_lock_wait_is_the_integral_of_the_requests_waiting_on_it() -> None:
    clock = Clock()
    lim = _limiter(_table(), clock=clock)
    _learned(lim)
    _replay(lim, clock)
    lock = lim.lock
    assert lock is not None
    # B waits 0.1 -> 0.65, C 0.2 -> 0.55, D 0.3 -> 0.5, E 0.4 -> 0.6, all on a full lock
    assert lock.wait_seconds[0] == pytest.approx(0.55 + 0.35 + 0.2 + 0.2)
    assert lock.waiting == [0, 0]
    # each completion taught its key: k3 learned 1.0 s, then A's 0.5 s and B's 0.05 s
    assert lock.predict(0, "k3") == pytest.approx((1.0 + 0.5 + 0.05) / 3)
    text = generate_latest(SidecarMetrics(lambda: lim, time_unit=1.0).registry).decode()
    assert 'overtake_stage_lock_capacity{stage="preview"} 1.0' in text
    assert 'overtake_stage_lock_waiting{stage="preview"} 0.0' in text
    samples = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("overtake_stage_lock")}
    assert samples['overtake_stage_lock_wait_seconds_total{stage="preview"}'] == pytest.approx(1.3)
    assert 'overtake_stage_lock_aged_total{stage="preview"} 0.0' in text
    assert 'stage="view"' not in "".join(x for x in text.splitlines() if x.startswith("overtake_stage_lock"))
    info = lock.info()
    assert list(info) == ["preview"] and info["preview"]["capacity"] == 1
    assert info["preview"]["order"] == "shortest predicted first"


def test_waiting_gauge_counts_requests_behind_a_full_lock() -> None:
    clock = Clock()
    lim = _limiter(_table(lock=2), clock=clock)

    async def body() -> None:
        for key in ("k1", "k2", "k3", "k1"):
            assert lim.submit(0, 0, key) is not None
        assert lim.threads[0] == 2 and lim.lock is not None and lim.lock.waiting == [2, 0]
        assert lim.submit(1, 0, "view") is not None  # another stage is not held back
        assert lim.threads[1] == 1

    asyncio.run(body())


# --------------------------------------------------------------------------- policy ∧ lock, any interleaving

ops = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "finish", "cancel"]), st.integers(0, 1),
                         st.integers(0, 10_000)), min_size=1, max_size=100)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, m=st.integers(1, 3), cap=st.one_of(st.just("inf"), st.integers(1, 4)))
def test_never_more_than_m_and_never_idle_with_room(program: list[Any], m: int, cap: str) -> None:
    lim = _limiter(_table(lock=m), policy="pi(inf)" if cap == "inf" else f"pi({cap},{cap})")
    pcap = float("inf") if cap == "inf" else int(cap)

    async def body() -> None:
        tickets: list[Ticket] = []
        for op, stage, pick in program:
            if op == "arrive":
                t = lim.submit(stage, 0, f"k{pick % 4}")
                if t is not None:
                    tickets.append(t)
            else:
                t = picked(tickets, op, pick)
                if t is None:
                    continue
                if op == "cancel":
                    lim.cancel(t, "client_gone")
                else:
                    lim.release(t, "completed")
            assert lim.threads[0] <= min(m, pcap)  # policy ∧ lock
            assert lim.threads[1] <= pcap
            # nothing waits while both the policy and the lock have room (work conserving)
            if lim.stage_waiting[0]:
                assert lim.threads[0] == min(m, pcap)
            assert sum(lim.admitted.values()) == sum(lim.completed.values()) + lim.inflight_total

    asyncio.run(body())


def test_policy_endpoint_shows_the_lock() -> None:
    from overtake.controller.sidecar.options import SidecarOptions
    from overtake.controller.sidecar.service import Sidecar

    side = Sidecar(_table(lock=2), SidecarOptions.from_flat(policy="pi(inf)", apache="http://127.0.0.1:9", listen="127.0.0.1:9"))
    info = side.policy_info()
    assert info["lock"]["preview"]["capacity"] == 2
    assert info["lock"]["preview"]["order"] == "shortest predicted first"
    assert side.limiter.lock is not None and side.limiter.lock in side.limiter.listeners
    plain = Sidecar(_table(lock=None), SidecarOptions.from_flat(policy="pi(inf)", apache="http://127.0.0.1:9",
                                                      listen="127.0.0.1:9"))
    assert "lock" not in plain.policy_info() and plain.limiter.lock is None


class _Holding:
    """A solved policy (its model has ``locks``) that never starts a preview: a policy solved
    without the lock can keep the locked stage waiting while the lock is free."""

    def __init__(self, locks: tuple[int | None, ...] | None) -> None:
        self.inner = BaselinePolicy("pi(inf)", 2)
        for k in ("name", "version", "hash", "phases", "per_phase_queues", "threads_per_stage", "phase_info",
                  "predicted_wait", "passthrough_wait", "alpha", "T", "labels"):
            setattr(self, k, getattr(self.inner, k))
        self.policy = SimpleNamespace(model=SimpleNamespace(locks=locks))

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        a = self.inner.action(state)
        return (0, *a[1:])


@pytest.mark.parametrize(("locks", "starts"), [(None, 1), ((1, None), 0), ((2, None), 1)])
def test_a_policy_solved_without_the_lock_does_not_idle_it(locks: tuple[int | None, ...] | None, starts: int) -> None:
    """Solved without this lock: the lock fills its free slot; solved with it: the policy's word
    (0 starts; the view in service keeps the liveness guard out)."""
    pol = _Holding(locks)
    lim = make_limiter(pol, NAMES, clock=Clock())
    lim.set_lock(StageLock.from_table(_table()))

    async def body() -> None:
        assert lim.submit(1, 0, "view") is not None and lim.threads[1] == 1
        for key in ("k1", "k2", "k3"):
            assert lim.submit(0, 0, key) is not None
        assert lim.threads[0] == starts and lim.stage_waiting[0] == 3 - starts
        assert lim.lock is not None
        assert lim.lock.info(pol)["preview"]["starts"] == ("lock" if starts else "policy and lock")

    asyncio.run(body())


def test_a_locked_stage_never_waits_in_apaches_gate(tmp_path: Path) -> None:
    """With Apache's admission gate on, queued requests are sent ahead and held inside Apache; a
    locked stage's are not (they would be inside Apache beyond the lock's m)."""
    from overtake.controller.sidecar.options import SidecarOptions
    from overtake.controller.sidecar.service import Sidecar
    from overtake.controller.sidecar.tandem import Ticket as T

    gate = f"/dev/shm/s19-lockq-gate-{os.getpid()}"
    try:
        side = Sidecar(_table(), SidecarOptions.from_flat(policy="pi(1)", apache="http://127.0.0.1:9", listen="127.0.0.1:9",
                                                gate=gate, gate_slots=4))
        gw = side.gateway
        gw.gate_on = True
        assert gw.admission._arm(T(0, 0, "k1", 1, 0.0)) is None  # the locked preview stage waits in the sidecar
        armed = gw.admission._arm(T(1, 0, "view", 2, 0.0))  # the view stage may wait in the gate
        assert armed is not None
        assert side.gate is not None
        side.gate.free(armed[0])
    finally:
        for p in (gate, gate + ".key"):
            Path(p).unlink(missing_ok=True)
