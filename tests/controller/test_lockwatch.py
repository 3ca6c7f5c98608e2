"""The online loop's serialisation verdicts (overtake.controller.online.lockwatch), from an access log.

The log's lines carry mod_overtake_prio's time split (LOG_FORMAT) of requests from the exact
simulation of test_serialisation: /stage1 holds an exclusive lock, /stage2 shares the core. Known
answers: stage1 serialised with capacity 1 and stage2 not, logged once each, exported as
``overtake_stage_serialised{stage}`` and ``overtake_stage_serialised_capacity{stage}``, in ``/-/policy``'s
status, and stage1 named for exemption unless the stages file sets its ``cpu_exempt``. Lines of the
older format (no split) give demands and no verdict.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.lock_sim import simulate

from overtake.controller.online import OnlineCollector, OnlineLoop, OnlineSettings
from overtake.controller.online.serialisation import TimedRequest
from overtake.controller.sidecar.policies import load_policy
from overtake.controller.sidecar.stages import StagesConfig, StageTable

T0 = 1_763_719_200.0  # the log's epoch offset


def _table(**stage1: Any) -> StageTable:
    return StageTable(StagesConfig.model_validate(
        {"stages": [{"name": "stage1", "path": "^/stage1$", **stage1}, {"name": "stage2", "path": "^/stage2$"}]}))


def _line(path: str, r: TimedRequest | None, cpu_us: int = 10_000) -> str:
    begin = int((T0 + (r.start if r else 0.0)) * 1e6) - 100  # the handler starts 100 µs after the request
    head = (f'127.0.0.1 {begin} "GET {path}?work=0.01 HTTP/1.1" 200 12 D=20000 msT=20 usT=20000 '
            f"stage=1 cpu_us={cpu_us} tid=77 rid=-")
    if r is None:
        return head
    us = [round(x * 1e6) for x in (r.wall, r.cpu, r.wait, r.blocked)]
    return head + f" owall_us={us[0]} ostart_us=100 ocpu_us={us[1]} owait_us={us[2]} oblocked_us={us[3]}"


def _loop(tmp_path: Path, table: StageTable) -> OnlineLoop:
    log = tmp_path / "access.log"
    log.touch()
    pol = load_policy("pi(1)", table.names)
    return OnlineLoop(OnlineSettings(access_log=str(log)), table=table, time_unit=1.0, policy=pol,
                      current=lambda: pol, swap=lambda p: pol)


def _write(loop: OnlineLoop, lines: list[str]) -> None:
    assert loop.settings.access_log is not None
    with open(loop.settings.access_log, "a") as f:
        f.writelines(line + "\n" for line in lines)


def test_a_serialised_stage_is_reported_and_exempted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recs = simulate(400, 1, seed=4)
    loop = _loop(tmp_path, _table())
    assert loop.lock_watch is not None
    exempted: list[frozenset[int]] = []
    loop.lock_watch.on_exempt = exempted.append
    _write(loop, [_line("/stage1", r) for r in recs["A"]] + [_line("/stage2", r) for r in recs["B"]])
    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        asyncio.run(loop.poll_log())
    v1, v2 = loop.lock_watch.verdicts["stage1"], loop.lock_watch.verdicts["stage2"]
    assert v1.serialising is True and v1.lock_capacity == 1, v1
    assert v2.serialising is False, v2
    assert exempted == [frozenset({0})]
    said = [r for r in caplog.records if getattr(r, "event", None) == "online_serialisation"]
    assert [(r.stage, r.verdict["serialising"]) for r in said] == [("stage1", True), ("stage2", False)]  # type: ignore[attr-defined]
    assert loop.status()["serialisation"]["stage1"]["lock_capacity"] == 1
    reg = CollectorRegistry()
    reg.register(OnlineCollector(loop))
    text = generate_latest(reg).decode()
    assert 'overtake_stage_serialised{stage="stage1"} 1.0' in text
    assert 'overtake_stage_serialised{stage="stage2"} 0.0' in text
    assert 'overtake_stage_serialised_capacity{stage="stage1"} 1.0' in text
    assert 'overtake_stage_serialised_capacity{stage="stage2"}' not in text
    assert len(loop.recorder.stages[0].reservoirs["access_log"]) == 400  # the demands still flow


def test_the_stages_file_keeps_its_word(tmp_path: Path) -> None:
    """``cpu_exempt: []`` (never) on stage1: reported serialised, not exempted."""
    recs = simulate(400, 1, seed=4)
    loop = _loop(tmp_path, _table(cpu_exempt=[]))
    assert loop.lock_watch is not None
    exempted: list[frozenset[int]] = []
    loop.lock_watch.on_exempt = exempted.append
    _write(loop, [_line("/stage1", r) for r in recs["A"]])
    asyncio.run(loop.poll_log())
    assert loop.lock_watch.verdicts["stage1"].serialising is True
    assert exempted == [] and loop.lock_watch.exempt == frozenset()


def test_older_log_lines_give_demands_and_no_verdict(tmp_path: Path) -> None:
    loop = _loop(tmp_path, _table())
    assert loop.lock_watch is not None
    _write(loop, [_line("/stage1", None) for _ in range(50)])
    asyncio.run(loop.poll_log())
    assert len(loop.recorder.stages[0].reservoirs["access_log"]) == 50
    assert loop.recorder.tail is not None and loop.recorder.tail.bad_lines == 0
    assert loop.lock_watch.verdicts == {}  # no split seen: nothing to decide
