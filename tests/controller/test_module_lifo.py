"""Module mode's order within a stage: the oldest waiting request first, or, once the stage's
queue has stood longer than ``OvertakeStageLifoAfter``, the newest first (adaptive LIFO) until it
empties. Stage ``capped`` at one running request (π(1,8)) under mpm_event: a runner, then four
requests held behind it, arriving 0.1 s apart; each reports its handler's span."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from support.control_apache import control_apache
from support.module_stages import prio_status, settled, until, write_policy

NAMES = ("capped", "free")
CAPPED = 'stage="capped"'


@pytest.mark.parametrize(("lifo_after", "order"), [(0.0, ["w0", "w1", "w2", "w3"]), (0.3, ["w3", "w2", "w1", "w0"])],
                         ids=["oldest-first", "newest-first"])
def test_a_standing_queue_starts_its_newest_first(apache_available: None, lifo_after: float, order: list[str]) -> None:
    with control_apache("module-lifo", levels=(0.5,), nice=("idle",), stage_hold=10.0, mpm="event",
                        stage_lifo_after=lifo_after, stages=(("capped", "^/stage1$"), ("free", "^/stage2$"))) as (inst, path):
        write_policy(path, "pi(1,8)", NAMES)
        until(lambda: prio_status(inst).get(f"overtake_stage_table_in_force{{{CAPPED}}}") == 1, "the table")
        before = prio_status(inst)
        begun: dict[str, int] = {}

        def get(who: str, work: float) -> None:
            with urllib.request.urlopen(f"{inst.base_url}/stage1?work={work}&trace=1&who={who}", timeout=60) as r:
                assert r.status == 200
                begun[who] = int(r.headers["X-Handler-Span-us"].split()[0])

        threads = [threading.Thread(target=get, args=("runner", 1.0))]
        threads[0].start()
        until(lambda: prio_status(inst)[f"overtake_stage_active{{{CAPPED}}}"] == 1, "the runner counted")
        for k in range(4):
            threads.append(threading.Thread(target=get, args=(f"w{k}", 0.05)))
            threads[-1].start()
            until(lambda k=k: prio_status(inst)[f"overtake_stage_waiting{{{CAPPED}}}"] == k + 1, f"w{k} held")
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        assert sorted(begun, key=begun.__getitem__) == ["runner", *order]
        st = settled(inst, NAMES)
        assert st["overtake_stage_lifo_after_seconds"] == lifo_after
        grew = st[f"overtake_stage_newest_first_total{{{CAPPED}}}"] - before[f"overtake_stage_newest_first_total{{{CAPPED}}}"]
        assert grew == (4 if lifo_after else 0)
        assert st[f"overtake_stage_hold_timeouts_total{{{CAPPED}}}"] == before[f"overtake_stage_hold_timeouts_total{{{CAPPED}}}"]
        assert st[f"overtake_stage_active{{{CAPPED}}}"] == 0 and st[f"overtake_stage_waiting{{{CAPPED}}}"] == 0
