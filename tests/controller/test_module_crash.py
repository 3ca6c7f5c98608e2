"""Module mode when an Apache child dies without ending its requests (a crash: SIGKILL here, as
a segfault in mod_php or the OOM killer would), under mpm_prefork and mpm_event, with a table
that caps stage ``capped`` at one running request.

- The child running the stage's one request dies: the parent gives its count back
  (``overtake_stage_given_back_total``, ``AH90306``), and the next request of the stage runs at
  once. Before, the count stayed for good: with a cap of one every later request of the stage
  waited the whole ``OvertakeStageHold`` until Apache was stopped.
- Under prefork, a child holding a waiting request dies: its ticket is given back (it would have
  been granted to nobody, leaving a count behind), and the other waiters run in turn after the
  running request, none waiting out the bound; the counts end at zero.
- The running request's child dies while others are held (prefork, and mpm_event with two
  threads a child, so that the held requests are spread over several children): no request will
  end to start them, so the parent wakes them and they start at once by their own table.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.control_apache import control_apache
from support.module_stages import prio_status, until, write_policy

from overtake.controller.harness import apache
from overtake.controller.harness.apache.lifecycle import children

#: OvertakeStageHold: long enough that a request waiting it out stands out from its turn
HOLD = 10.0
NAMES = ("capped", "free")
CAPPED = 'stage="capped"'


@contextmanager
def _capped(mpm: str, **extra: int) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("module-crash", levels=(0.5,), nice=("idle",), stage_hold=HOLD, mpm=mpm,
                        stages=(("capped", "^/stage1$"), ("free", "^/stage2$")), **extra) as served:
        inst, path = served
        write_policy(path, "pi(1,8)", NAMES)
        until(lambda: _status(inst).get(f"overtake_stage_table_in_force{{{CAPPED}}}") == 1, "the table")
        yield served


@pytest.fixture(params=["prefork", "event"])
def capped(apache_available: None, request: pytest.FixtureRequest) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with _capped(request.param) as served:
        yield served


@pytest.fixture()
def prefork_capped(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """Prefork: each held request waits in a process of its own, which can die alone."""
    with _capped("prefork") as served:
        yield served


@pytest.fixture(params=["prefork", "event"])
def apart(apache_available: None, request: pytest.FixtureRequest) -> Iterator[tuple[apache.ApacheInstance, str]]:
    """Requests in several children: prefork's one a process, or mpm_event with two threads a child."""
    extra = {"threads_per_child": 2, "max_workers": 8} if request.param == "event" else {}
    with _capped(request.param, **extra) as served:
        yield served


def _status(inst: apache.ApacheInstance) -> dict[str, float]:
    return prio_status(inst)


def _get(inst: apache.ApacheInstance, path: str) -> tuple[int | str, float]:
    """The status (or the error of a request whose child died) and the seconds it took."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:
        return type(exc).__name__, time.monotonic() - t0


def _start(inst: apache.ApacheInstance, who: str, work: float, out: dict[str, tuple[int | str, float]]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.setdefault(who, _get(inst, f"/stage1?work={work}&who={who}")))
    t.start()
    return t


def _pid_serving(inst: apache.ApacheInstance, who: str) -> int:
    """The PID of the child whose worker has request ``who`` (Apache's /server-status table)."""
    with urllib.request.urlopen(inst.base_url + "/server-status", timeout=30) as r:
        html = r.read().decode()
    for row in re.findall(r"<tr><td><b>.*?</tr>", html, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        if len(cells) > 3 and cells[3] == "W" and any(f"who={who} " in c for c in cells):
            return int(cells[1])
    raise AssertionError(f"no worker is serving {who}")


def _error_log(inst: apache.ApacheInstance) -> str:
    return (Path(inst.workdir) / "logs" / "error.log").read_text()


def test_a_crashed_childs_running_request_is_given_back(capped: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = capped
    out: dict[str, tuple[int | str, float]] = {}
    t = _start(inst, "runner", 4.0, out)
    until(lambda: _status(inst)[f"overtake_stage_active{{{CAPPED}}}"] == 1, "the runner counted")
    os.kill(_pid_serving(inst, "runner"), signal.SIGKILL)
    t.join(30)
    assert out["runner"][0] != 200  # it died with its child
    until(lambda: _status(inst)[f"overtake_stage_active{{{CAPPED}}}"] == 0, "its count given back")
    code, took = _get(inst, "/stage1?work=0.05")
    assert code == 200 and took < HOLD / 2, took
    st = _status(inst)
    assert st[f"overtake_stage_given_back_total{{{CAPPED}}}"] == 1
    assert st[f"overtake_stage_hold_timeouts_total{{{CAPPED}}}"] == 0
    assert "AH90306" in _error_log(inst)
    until(lambda: _status(inst)["overtake_stage_child_blocks"] == len(children(inst.pid)), "a block per child")


WAITERS = ("w1", "w2", "w3")


def _held_behind(inst: apache.ApacheInstance, runner_work: float,
                 out: dict[str, tuple[int | str, float]]) -> list[threading.Thread]:
    """A runner of ``capped`` (``runner_work`` s), then three requests held behind it."""
    threads = [_start(inst, "runner", runner_work, out)]
    until(lambda: _status(inst)[f"overtake_stage_active{{{CAPPED}}}"] == 1, "the runner counted")
    for who in WAITERS:
        threads.append(_start(inst, who, 0.1, out))
        until(lambda w=who: _pid_serving_or_none(inst, w) is not None, f"{who} in a worker")
    until(lambda: _status(inst)[f"overtake_stage_waiting{{{CAPPED}}}"] == 3, "three held")
    return threads


def _served_in_turn(inst: apache.ApacheInstance, out: dict[str, tuple[int | str, float]],
                    served: list[str], given_back: int) -> None:
    """``served`` answered well before the bound, the counts at zero, no hold timed out."""
    for who in served:
        code, took = out[who]
        assert code == 200 and took < HOLD / 2, (who, out)
    until(lambda: _status(inst)[f"overtake_stage_active{{{CAPPED}}}"] == 0, "the counts at zero")
    st = _status(inst)
    assert st[f"overtake_stage_waiting{{{CAPPED}}}"] == 0
    assert st[f"overtake_stage_hold_timeouts_total{{{CAPPED}}}"] == 0
    assert st[f"overtake_stage_given_back_total{{{CAPPED}}}"] == given_back


def test_a_crashed_waiters_ticket_is_given_back(prefork_capped: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = prefork_capped
    out: dict[str, tuple[int | str, float]] = {}
    # the runner still runs when the parent has reaped the killed waiter (its maintenance loop
    # wakes once a second), so that the queue is seen at two waiting
    threads = _held_behind(inst, 2.5, out)
    os.kill(_pid_serving(inst, "w2"), signal.SIGKILL)
    until(lambda: _status(inst)[f"overtake_stage_waiting{{{CAPPED}}}"] == 2, "its ticket given back")
    for t in threads:
        t.join(60)
    assert out["w2"][0] != 200
    _served_in_turn(inst, out, ["runner", "w1", "w3"], given_back=1)


def test_the_held_requests_start_when_the_runners_child_dies(apart: tuple[apache.ApacheInstance, str]) -> None:
    """No request will end to start the held ones: the parent wakes them once the dead child's
    count is back, and they decide by their own table. (A held request in the runner's own
    child dies with it.)"""
    inst, _ = apart
    out: dict[str, tuple[int | str, float]] = {}
    threads = _held_behind(inst, 2 * HOLD, out)
    pid = {who: _pid_serving(inst, who) for who in ("runner", *WAITERS)}
    os.kill(pid["runner"], signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert out["runner"][0] != 200
    survivors = [w for w in WAITERS if pid[w] != pid["runner"]]
    assert survivors
    _served_in_turn(inst, out, survivors, given_back=1 + len(WAITERS) - len(survivors))


def _pid_serving_or_none(inst: apache.ApacheInstance, who: str) -> int | None:
    try:
        return _pid_serving(inst, who)
    except AssertionError:
        return None
