"""``lock: auto``: the serialisation detector's verdict sets the stage's lock, in the sidecar's
:class:`StageLock` and in the refits' model, with its source in ``/-/policy`` and the metrics.

Known answers on the exact lock simulation (tests/support/lock_sim.py): a stage behind a lock of
one holder is learned with capacity 1 (then the limiter never has two of its requests in Apache),
the same stage without a lock is learned as none. A stage with ``lock: m`` keeps m.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from support.lock_sim import simulate

from overtake.controller.errors import SidecarInputError
from overtake.controller.online import OnlineSettings
from overtake.controller.online.serialisation import TimedRequest
from overtake.controller.sidecar.options import SidecarOptions
from overtake.controller.sidecar.service import Sidecar
from overtake.controller.sidecar.stages import StagesConfig, StageTable

T0 = 1_763_719_200.0


def _table(lock: Any) -> StageTable:
    return StageTable(StagesConfig.model_validate({"stages": [
        {"name": "writes", "path": "^/stage1$", "lock": lock}, {"name": "views", "path": "^/stage2$"}]}))


def _line(path: str, r: TimedRequest) -> str:
    begin = int((T0 + r.start) * 1e6) - 100
    us = [round(x * 1e6) for x in (r.wall, r.cpu, r.wait, r.blocked)]
    return (f'127.0.0.1 {begin} "GET {path}?work=0.01 HTTP/1.1" 200 12 D=20000 msT=20 usT=20000 stage=1 '
            f"cpu_us=10000 tid=77 rid=- owall_us={us[0]} ostart_us=100 ocpu_us={us[1]} owait_us={us[2]} "
            f"oblocked_us={us[3]}")


def _sidecar(tmp_path: Path, table: StageTable, online: bool = True) -> Sidecar:
    log = tmp_path / "access.log"
    log.touch()
    opts = SidecarOptions.from_flat(policy="pi(inf)", apache="http://127.0.0.1:9", listen="127.0.0.1:9",
                                    online=OnlineSettings(access_log=str(log)) if online else None)
    return Sidecar(table, opts)


def _feed(side: Sidecar, lock: int | None, tmp_path: Path) -> None:
    recs = simulate(400, lock, seed=4)
    with (tmp_path / "access.log").open("a") as f:
        f.writelines(_line("/stage1", r) + "\n" for r in recs["A"])
        f.writelines(_line("/stage2", r) + "\n" for r in recs["B"])
    assert side.online is not None

    async def poll() -> None:
        assert side.online is not None
        await side.online.poll_log()

    asyncio.run(poll())


def test_a_serialised_stage_gets_the_learned_lock(tmp_path: Path) -> None:
    side = _sidecar(tmp_path, _table("auto"))
    lock = side.limiter.lock
    assert lock is not None and lock.caps == (None, None)  # nothing learned yet: no lock
    assert side.online is not None and side.online.locks is None
    _feed(side, 1, tmp_path)
    assert lock.caps == (1, None) and lock.source[0] == "learned"
    assert side.online.locks == (1, None)  # what the refit's model gets (RefitJob.locks)
    info = lock.info(side.limiter.policy)
    assert info["writes"]["capacity"] == 1 and info["writes"]["source"] == "learned"
    status = side.online.status()["serialisation"]["writes"]
    assert status["serialising"] is True and status["lock"] == {"capacity": 1, "source": "learned"}
    text = generate_latest(side.metrics.registry).decode()
    assert 'overtake_stage_lock_capacity{stage="writes"} 1.0' in text
    assert 'overtake_stage_lock_learned{stage="writes"} 1.0' in text


def test_a_stage_without_a_lock_learns_none(tmp_path: Path) -> None:
    side = _sidecar(tmp_path, _table("auto"))
    _feed(side, None, tmp_path)
    assert side.online is not None and side.online.lock_watch is not None
    assert side.online.lock_watch.verdicts["writes"].serialising is False
    assert side.limiter.lock is not None and side.limiter.lock.caps == (None, None)
    assert side.online.locks is None
    assert side.limiter.lock.info(None)["writes"]["source"] == "auto: not serialised (yet)"


def test_a_configured_lock_keeps_its_capacity(tmp_path: Path) -> None:
    side = _sidecar(tmp_path, _table(2))
    _feed(side, 1, tmp_path)
    assert side.limiter.lock is not None and side.limiter.lock.caps == (2, None)
    assert side.limiter.lock.source[0] == "configured"
    assert side.online is not None and side.online.locks == (2, None)
    text = generate_latest(side.metrics.registry).decode()
    assert 'overtake_stage_lock_learned{stage="writes"} 0.0' in text


def test_auto_without_the_online_loop_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SidecarInputError, match="lock: auto is learned by the online loop"):
        _sidecar(tmp_path, _table("auto"), online=False)
    with pytest.raises(ValueError, match="or auto"):
        _table("sometimes")
