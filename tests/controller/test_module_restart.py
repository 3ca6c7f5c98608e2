"""Module mode across Apache's restarts, with requests held by the count table at the moment of
the signal (mpm_event and mpm_prefork; a table that caps stage ``capped`` at one running request).

- A graceful restart (SIGUSR1: ``apachectl graceful``, the ``reload`` Debian's log rotation runs
  every night) with the same stages: every request is answered, ``capped`` never runs two at once
  across the two generations of children, none waits out ``OvertakeStageHold``, the counts
  return to zero and the table stays in force.
- A graceful restart whose new config lists the stages in another order: every request is
  answered, none waits out the bound, the counts return to zero (the old children end their
  requests under the counts they started with, the new ones count afresh: until the old ones
  finish, each generation keeps the cap on its own; the module logs ``AH90305``), and afterwards
  the table applies to each stage by its name. Before the fix an old child ended
  its requests in the other stage's counts: ``capped`` ran three at once, three requests waited
  out the bound and ``free``'s waiting count stayed at -3, holding its requests from then on.
- A hard restart (SIGHUP) ends the requests in flight, as Apache does without the module; the
  counts of the killed children do not stay behind, nor their blocks (op_stage_child.c).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.control_apache import control_apache
from support.module_stages import config_generation, max_overlap, prio_status, settled, until, write_policy

from overtake.controller.harness import apache
from overtake.controller.harness.apache.lifecycle import children

#: OvertakeStageHold: far beyond a burst's 2.4 s of handler work (each request 0.2 s of CPU)
HOLD = 6.0
NAMES = ("capped", "free")
URL = {"capped": "/stage1", "free": "/stage2"}


@pytest.fixture(params=["event", "prefork"])
def restartable(apache_available: None, request: pytest.FixtureRequest) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("module-restart", levels=(0.5,), nice=("idle",), stage_hold=HOLD, mpm=request.param,
                        stages=(("capped", "^/stage1$"), ("free", "^/stage2$"))) as served:
        inst, path = served
        write_policy(path, "pi(1,8)", NAMES)
        until(lambda: prio_status(inst).get('overtake_stage_table_in_force{stage="capped"}') == 1, "the table")
        yield served


def _get(inst: apache.ApacheInstance, path: str) -> tuple[int | str, tuple[int, int] | None]:
    try:
        with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
            span = r.headers.get("X-Handler-Span-us")
            r.read()
            b, e = (int(v) for v in span.split())
            return r.status, (b, e)
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:  # a hard restart's
        return type(exc).__name__, None


def _burst_with(inst: apache.ApacheInstance, sig: int | None, n: int = 6,
                edit: str | None = None) -> dict[str, list[tuple[int | str, tuple[int, int] | None]]]:
    """n requests of each stage at once; once ``capped``'s are held (the table lets one run),
    ``edit`` replaces the config and ``sig`` goes to Apache's parent. Each stage's answers."""
    out: dict[str, list[tuple[int | str, tuple[int, int] | None]]] = {s: [] for s in NAMES}
    lock = threading.Lock()

    def one(stage: str) -> None:
        res = _get(inst, f"{URL[stage]}?work=0.2&trace=1")
        with lock:
            out[stage].append(res)

    threads = [threading.Thread(target=one, args=(s,)) for _ in range(n) for s in NAMES]
    for t in threads:
        t.start()
    if sig is not None:
        until(lambda: prio_status(inst)['overtake_stage_waiting{stage="capped"}'] >= 2, "requests held")
        if edit is not None:
            (Path(inst.workdir) / "httpd.conf").write_text(edit)
        os.kill(inst.pid, sig)
    for t in threads:
        t.join(120)
    return out


def _spans(answers: list[tuple[int | str, tuple[int, int] | None]]) -> list[tuple[int, int]]:
    return [span for _, span in answers if span is not None]


def _counters(inst: apache.ApacheInstance) -> dict[str, float]:
    """The status once nothing waits or runs; every stage's waiting and running count is then 0
    (a count left by a request that ended elsewhere would be negative, or never drop)."""
    st = settled(inst, NAMES)
    for s in NAMES:
        assert st[f'overtake_stage_waiting{{stage="{s}"}}'] == 0, st
        assert st[f'overtake_stage_active{{stage="{s}"}}'] == 0, st
    return st


def _timeouts(st: dict[str, float]) -> float:
    return sum(st.get(f'overtake_stage_hold_timeouts_total{{stage="{s}"}}', 0) for s in NAMES)


def _follows_the_table(inst: apache.ApacheInstance) -> None:
    before = _timeouts(prio_status(inst))
    out = _burst_with(inst, None)
    assert all(code == 200 for s in NAMES for code, _ in out[s]), out
    assert max_overlap(_spans(out["capped"])) == 1
    assert max_overlap(_spans(out["free"])) > 1
    assert _timeouts(_counters(inst)) == before


def test_a_graceful_restart_keeps_the_held_requests_and_the_cap(
        restartable: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = restartable
    gen, conf = config_generation(inst), _counters(inst)
    out = _burst_with(inst, signal.SIGUSR1)
    assert [code for code, _ in out["capped"] + out["free"]] == [200] * 12
    assert max_overlap(_spans(out["capped"])) == 1  # old and new children share the counts
    st = _counters(inst)
    assert _timeouts(st) == _timeouts(conf)
    assert config_generation(inst) == gen + 1
    assert st['overtake_stage_table_in_force{stage="capped"}'] == 1
    _follows_the_table(inst)


def test_a_graceful_restart_that_reorders_the_stages_loses_nothing_and_leaks_no_count(
        restartable: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = restartable
    text = (Path(inst.workdir) / "httpd.conf").read_text()
    blocks = re.findall(r"[ \t]*<LocationMatch [^\n]*>\n[^\n]*OvertakeStage \w+\n[ \t]*</LocationMatch>\n", text)
    assert len(blocks) == 2 and "capped" in blocks[0]
    swapped = text.replace(blocks[0], "\0").replace(blocks[1], blocks[0]).replace("\0", blocks[1])
    gen = config_generation(inst)
    out = _burst_with(inst, signal.SIGUSR1, edit=swapped)
    assert [code for code, _ in out["capped"] + out["free"]] == [200] * 12
    # each generation keeps the cap on its own: under prefork a request the old children had no
    # process for is accepted by a new one (before the fix: 3 or 4 at once)
    assert max_overlap(_spans(out["capped"])) <= 2
    st = _counters(inst)
    assert _timeouts(st) == 0
    assert config_generation(inst) == gen + 1
    assert list(re.findall(r'^overtake_stage_active\{stage="(\w+)"\}', "\n".join(st), re.M)) == ["free", "capped"]
    assert "AH90305" in (Path(inst.workdir) / "logs" / "error.log").read_text()
    _follows_the_table(inst)


def test_a_hard_restart_leaves_no_count_behind(restartable: tuple[apache.ApacheInstance, str]) -> None:
    inst, _ = restartable
    out = _burst_with(inst, signal.SIGHUP)
    answered = [code for code, _ in out["capped"] + out["free"]]
    dropped = {"RemoteDisconnected", "URLError", "ConnectionResetError", "IncompleteRead"}
    assert len(answered) == 12 and set(answered) <= {200, *dropped}
    _counters(inst)
    _follows_the_table(inst)
    # each child's share of the counts went with it: one block per child still there
    until(lambda: prio_status(inst)["overtake_stage_child_blocks"] == len(children(inst.pid)),
           "a block per child")
