"""Online refits keep coupled stages: the sidecar pairs one transaction's two requests (the
follow-up claims the reservation the first one's completion left, ``next`` in the stages file),
and the refit fits the routing on those pairs and solves with it.

Known answers: transactions drawn from a coupled PH, served one at a time through a real limiter
(π(1), one core: each request's attained service is its drawn time), give back exactly their
pairs; the refit's routing has the model's correlation (within 0.05: the estimator's spread over
seeds at 4,000 pairs is about 0.015), and the running π(1)'s predicted E[W] is the
Pollaczek–Khinchine mean of M/G/1 with S = S₁ + S₂ under the fitted coupled model (E[S²] has the
cross moment 2E[S₁S₂]), which the independent model misses. Where pairing is impossible (no
``next``), a running model's routing is dropped and the log says so once.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from overtake.controller.online import OnlineLoop, OnlineSettings
from overtake.controller.online.refit import RefitJob
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.limiter import Limiter
from overtake.controller.sidecar.policies import load_policy
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.fitting.coupled import CoupledPH
from overtake.fitting.phase_type import PhaseType
from overtake.mdp import Stage, TandemModel, Truncation, solve

TRUE = CoupledPH.build(PhaseType([0.8, 0.2], np.diag([-2.0, -1.0 / 3.0])), np.diag([-1.0 / 0.6, -1.0 / 3.5]),
                       np.array([[0.9, 0.1], [0.4, 0.6]]))


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _table(linked: bool) -> StageTable:
    first: dict[str, Any] = {"name": "preview", "path": "^/p$", **({"next": "view"} if linked else {})}
    return StageTable(StagesConfig.model_validate({"stages": [first, {"name": "view", "path": "^/v$"}]}))


def _pk(stages: list[dict[str, Any]], routing: Any, rate: float) -> float:
    """M/G/1 mean sojourn with S = S₁ + S₂ of the coupled (or independent) fitted stages."""
    a, b = (PhaseType(np.array(s["alpha"]), np.array(s["T"])) for s in stages)
    cross = CoupledPH(a, b, np.asarray(routing)).correlation() * a.std() * b.std() if routing is not None else 0.0
    es = a.mean() + b.mean()
    es2 = a.moment(2) + b.moment(2) + 2 * (cross + a.mean() * b.mean())
    return es + rate * es2 / (2 * (1 - rate * es))


def test_linked_transactions_are_paired_and_the_refit_keeps_their_routing() -> None:
    x, y = TRUE.rvs(4000, random_state=2)
    idle = np.random.default_rng(3).exponential(x.mean() + y.mean(), x.size)  # load about 0.5
    table, clock = _table(linked=True), _Clock()
    pol = load_policy("pi(1)", table.names)
    lim = Limiter(pol, Classifier(table.config.classifier, pol), stage_names=table.names, queue_caps=(100, 100),
                  max_inflight=64, passthrough_cap=None, passthrough_queue_cap=10, clock=clock)
    with ThreadPoolExecutor(1) as ex:
        loop = OnlineLoop(OnlineSettings(refit_interval=10.0, min_samples=200, reservoir=4000,
                                         arrival_window=1e6, max_order=2),
                          table=table, time_unit=1.0, policy=pol, current=lambda: lim.policy, swap=lambda p: pol,
                          executor=ex, clock=clock)
        lim.add_listener(loop.recorder)

        async def serve() -> str:
            for a, b, gap in zip(x, y, idle):
                t = lim.submit(0, 0, "p")
                assert t is not None
                clock.t += a
                hold = lim.release(t, "completed", (1, 0))
                assert hold is not None
                claimed = lim.claim(hold, 0, "v")
                assert claimed is not None
                clock.t += b
                lim.release(claimed, "completed")
                clock.t += gap
            return await loop.refit()

        outcome = asyncio.run(serve())
        asyncio.run(loop.close())
    assert loop.recorder.paired(0) == pytest.approx(np.column_stack([x, y]))
    rec = loop.last
    assert outcome in ("swapped", "kept"), rec
    assert rec["routing_correlation"][0] == pytest.approx(TRUE.correlation(), abs=0.05)
    rate = rec["arrival_rate_per_second"]
    coupled = _pk(rec["fit"], rec["routing"][0], rate)
    independent = _pk(rec["fit"], None, rate)
    assert rec["predicted_current"] == pytest.approx(coupled, rel=1e-3)
    assert abs(coupled / independent - 1) > 0.03  # the routing is what the prediction follows


def _coupled_policy(tmp_path: Path, table: StageTable) -> Any:
    model = TandemModel(0.3, (Stage("preview", TRUE.first.alpha, TRUE.first.T),
                              Stage("view", TRUE.second.alpha, TRUE.second.T)), routing=(TRUE.routing,))
    path = tmp_path / "coupled.npz"
    solve(model, truncation=Truncation(6, 3)).policy.save(path)
    return load_policy(str(path), table.names)


@pytest.mark.parametrize("linked", [False, True])
def test_a_routing_that_cannot_be_paired_again_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            linked: bool) -> None:
    table, clock = _table(linked=linked), _Clock()
    pol = _coupled_policy(tmp_path, table)
    seen: list[RefitJob] = []

    def job(j: RefitJob) -> dict[str, Any]:
        seen.append(j)
        raise RuntimeError("injected: the test needs the job, not its solve")

    with ThreadPoolExecutor(1) as ex, caplog.at_level(logging.WARNING, logger="overtake.sidecar"):
        loop = OnlineLoop(OnlineSettings(refit_interval=10.0, min_samples=100, arrival_window=1e6), table=table,
                          time_unit=1.0, policy=pol, current=lambda: pol, swap=lambda p: pol, executor=ex, job=job,
                          clock=clock)
        x, y = TRUE.rvs(300, random_state=4)
        for stage, v in ((0, x), (1, y)):
            for d in v:
                loop.recorder.add_demand(stage, float(d), "attained")
        for t in range(0, 60, 2):
            loop.recorder.add_arrival(0, float(t))
        clock.t = 100.0
        for _ in range(2):
            asyncio.run(loop.refit())
            clock.t += 11.0
        asyncio.run(loop.close())
    said = [r for r in caplog.records if getattr(r, "event", None) == "online_routing_dropped"]
    if linked:  # linked, but no pairs seen yet: independent rows kept in a coupled model, nothing said
        assert not said and all(j.pairs == (None,) for j in seen) and len(seen) == 2
    else:
        assert len(said) == 1 and "next:" in said[0].detail, loop.last  # type: ignore[attr-defined]
        assert [j.pairs for j in seen] == [None, None]
