"""Module mode's lock-free path: an arrival that finds nothing waiting and the table's leave, and
an end that finds nothing waiting, change the stage counts with one compare-and-swap on a shared
word and take no decision under the lock; when a request must wait, the lock owns the counts until
nothing waits again.

A private Apache (mpm_event, children of 4 threads: several processes share the word) with two
stages. Sequential requests never wait: the decisions counted under the lock do not move, while
the requests counted do. Bursts under a table capping ``capped`` at one running request hold some
of them (the locked path); afterwards nothing is counted waiting or running, the requests counted
are those sent, none waited out ``OvertakeStageHold``, ``capped`` never ran two at once, and
sequential requests take the lock-free path again (the word was handed back).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from support.control_apache import control_apache
from support.module_stages import at_once, max_overlap, prio_status, settled, write_policy

from overtake.controller.harness import apache

NAMES = ("capped", "free")
URL = {"capped": "/stage1", "free": "/stage2"}
SEQUENTIAL, BURSTS, PER_STAGE = 30, 4, 8


@pytest.fixture(scope="module")
def served(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("module-fast", levels=(0.5,), nice=("idle",), stage_hold=5.0, threads_per_child=4,
                        max_workers=16, stages=(("capped", "^/stage1$"), ("free", "^/stage2$"))) as s:
        yield s


def _get(inst: apache.ApacheInstance, path: str) -> tuple[int, str | None]:
    with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
        r.read()
        return r.status, r.headers.get("X-Handler-Span-us")


def _in_force(inst: apache.ApacheInstance, gen: int) -> None:
    for _ in range(200):
        if prio_status(inst)["overtake_stage_table_generation"] == gen:
            return
    raise AssertionError(f"generation {gen} not in force")


def _sequential(inst: apache.ApacheInstance, stage: str) -> tuple[float, float]:
    """SEQUENTIAL requests of ``stage`` one after another: (decisions, requests) counted meanwhile."""
    before = settled(inst, NAMES)
    for _ in range(SEQUENTIAL):
        assert _get(inst, URL[stage] + "?work=0")[0] == 200
    after = settled(inst, NAMES)
    key = f'overtake_stage_requests_total{{stage="{stage}"}}'
    return (after["overtake_stage_decisions_total"] - before["overtake_stage_decisions_total"],
            after[key] - before[key])


def test_requests_that_find_nothing_waiting_take_no_lock(served: tuple[apache.ApacheInstance, str]) -> None:
    inst, path = served
    _in_force(inst, write_policy(path, "pi(8,8)", NAMES))
    for stage in NAMES:
        assert _sequential(inst, stage) == (0, SEQUENTIAL)


def test_held_bursts_conserve_the_counts_and_hand_the_word_back(served: tuple[apache.ApacheInstance, str]) -> None:
    inst, path = served
    _in_force(inst, write_policy(path, "pi(1,8)", NAMES))
    before = settled(inst, NAMES)

    def one(stage: str) -> tuple[str, int, int]:
        status, span = _get(inst, f"{URL[stage]}?work=0.02&trace=1")
        assert status == 200 and span is not None
        b, e = (int(v) for v in span.split())
        return stage, b, e

    for _ in range(BURSTS):
        run = at_once([s for _ in range(PER_STAGE) for s in NAMES], one)
        assert max_overlap([(b, e) for s, b, e in run if s == "capped"]) == 1, run
    st = settled(inst, NAMES)
    for s in NAMES:
        assert st[f'overtake_stage_waiting{{stage="{s}"}}'] == 0
        assert st[f'overtake_stage_active{{stage="{s}"}}'] == 0
        key = f'overtake_stage_requests_total{{stage="{s}"}}'
        assert st[key] - before[key] == BURSTS * PER_STAGE
        key = f'overtake_stage_hold_timeouts_total{{stage="{s}"}}'
        assert st[key] == before[key]
    assert st['overtake_stage_held_total{stage="capped"}'] > before['overtake_stage_held_total{stage="capped"}']
    assert st["overtake_stage_decisions_total"] > before["overtake_stage_decisions_total"]  # the locked path ran
    assert _sequential(inst, "free") == (0, SEQUENTIAL)  # ... and gave the word back
