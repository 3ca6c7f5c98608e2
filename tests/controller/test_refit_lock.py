"""The online refit solves with the stages' locks (``lock: m``): the model it fits carries them, the
policy it writes says so, and both predictions are the lock model's (known answer:
``mdp.evaluate_baseline`` on the same fitted stages with the lock). Where the solver takes no lock
for the running policy's phase information, the refit solves without it as before and the loop
says why once (fault injection: a solver that refuses every lock)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

from overtake.controller.online import OnlineLoop, OnlineSettings
from overtake.controller.online.refit import RefitJob, refit_job
from overtake.controller.sidecar.options import SidecarOptions
from overtake.controller.sidecar.service import Sidecar
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.mdp import Policy, Stage, TandemModel, evaluate_baseline
from overtake.mdp.errors import ModelError

MEANS = (1.0, 0.5)
RATE = 0.45  # load 0.675 on one core; the lock alone (stage 1) is at 0.45


def _samples(seed: int = 3, n: int = 2000) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.exponential(m, n) for m in MEANS)


def _job(out: Path, locks: tuple[int | None, ...] | None) -> RefitJob:
    return RefitJob(stage_names=("write", "view"), samples=_samples(), arrival_rate=RATE, cores=1, overhead=0.0,
                    orders=(1, 1), max_order=1, phase_info="full", current="pi(inf)", tolerance=0.005,
                    out=str(out), locks=locks)


def _fitted(res: dict[str, Any], locks: tuple[int | None, ...] | None) -> TandemModel:
    return TandemModel(RATE, tuple(Stage(s["name"], np.array(s["alpha"]), np.array(s["T"])) for s in res["stages"]),
                       locks=locks)


def test_refit_solves_with_the_lock(tmp_path: Path) -> None:
    res = refit_job(_job(tmp_path / "locked.npz", (1, None)))
    assert res["locks"] == [1, None] and res["lock_ignored"] is None
    assert Policy.load(tmp_path / "locked.npz").model.locks == (1, None)
    locked = evaluate_baseline(_fitted(res, (1, None)), "pi(inf)", tol=0.005).metrics.mean_response_time
    free = evaluate_baseline(_fitted(res, None), "pi(inf)", tol=0.005).metrics.mean_response_time
    # the running policy (Apache's default) is predicted by the lock model, not the free one
    assert res["predicted_current"] == pytest.approx(locked, rel=0.02)
    assert locked != pytest.approx(free, rel=0.05)
    assert res["predicted_new"] <= res["predicted_current"]
    plain = refit_job(_job(tmp_path / "plain.npz", None))
    assert plain["locks"] is None and Policy.load(tmp_path / "plain.npz").model.locks is None
    assert plain["predicted_current"] == pytest.approx(free, rel=0.02)


def _refusing_solve() -> Any:
    from overtake.mdp import solve as real

    def solve(model: TandemModel, **kw: Any) -> Any:
        if model.has_lock:
            raise ModelError("locks: injected: no lock with this phase information")
        return real(model, **kw)

    return solve


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_unsupported_lock_solves_without_it_and_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = StageTable(StagesConfig.model_validate({"stages": [
        {"name": "write", "path": "^/w$", "lock": 1}, {"name": "view", "path": "^/v$"}]}))
    side = Sidecar(table, SidecarOptions.from_flat(policy="pi(inf)", apache="http://127.0.0.1:9", listen="127.0.0.1:9"))
    clock = _Clock()
    seen: list[RefitJob] = []

    def job(j: RefitJob) -> dict[str, Any]:
        seen.append(j)
        return refit_job(j)

    with ThreadPoolExecutor(1) as ex, mock.patch("overtake.mdp.solve", _refusing_solve()), \
            caplog.at_level(logging.WARNING, logger="overtake.sidecar"):
        loop = OnlineLoop(OnlineSettings(refit_interval=10.0, min_samples=100, arrival_window=100.0),
                          table=table, time_unit=1.0, policy=side.policy, current=lambda: side.limiter.policy,
                          swap=lambda p: side.swap(p, source="online"), executor=ex, job=job, clock=clock)
        assert loop.locks == (1, None)
        for stage, x in enumerate(_samples()):
            for v in x[:500]:
                loop.recorder.add_demand(stage, float(v), "attained")
        for t in np.cumsum(np.random.default_rng(1).exponential(1 / RATE, 60)):
            loop.recorder.add_arrival(0, clock.t - 100.0 + float(t))
        outcomes = []
        for _ in range(2):
            outcomes.append(asyncio.run(loop.refit()))
            clock.t += 11.0
        asyncio.run(loop.close())
    assert all(o in ("swapped", "kept") for o in outcomes), loop.last
    assert [j.locks for j in seen] == [(1, None), (1, None)]
    assert loop.last["locks"] is None  # solved without the lock, as before locks were modelled
    said = [r for r in caplog.records if getattr(r, "event", None) == "online_lock_ignored"]
    assert len(said) == 1 and "injected" in said[0].detail  # type: ignore[attr-defined]
