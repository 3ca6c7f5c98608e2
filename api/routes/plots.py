"""PNG figures of a model (gains, policy, service distributions) and of a fit (samples against the PH)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

from overtake.mdp.scenario import parse_scenario

from .. import plots
from ..caches import PolicyCache
from ..db import Store
from ..deps import PlotsDep, PoliciesDep, ReadsDep, StoreDep, done_model, get_job
from ..errors import HTTPError
from ..schemas import Error

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

router = APIRouter(tags=["plots"])

_PNG: dict[int | str, dict[str, Any]] = {
    200: {"content": {"image/png": {}}}, 404: {"model": Error}, 409: {"model": Error}}


@router.get("/v1/models/{model_id}/plots/{kind}.png", responses=_PNG)
async def model_plot(model_id: str, kind: str, store: StoreDep, policies: PoliciesDep, images: PlotsDep,
                     reads: ReadsDep) -> Response:
    """``gains`` (E[W] per policy, van der Weij et al., Fig. 2), ``policy`` (heatmap) or ``distributions``."""
    if kind not in ("gains", "policy", "distributions"):
        raise HTTPError(404, f"kind: one of gains, policy, distributions, got {kind!r}")
    # reading the job (and the policy, the fits' samples) is off the loop; drawing on the plot thread
    build = await reads.run("id", _model_figure, store, policies, model_id, kind)
    blob = await images.png(f"{model_id}/{kind}", build)
    return Response(blob, media_type="image/png")


def _model_figure(store: Store, policies: PolicyCache, model_id: str, kind: str) -> Callable[[], Figure]:
    if kind == "gains":
        comparison = (done_model(store, model_id).result or {})["comparison"]
        return lambda: plots.gains_figure(comparison)
    if kind == "policy":
        done_model(store, model_id)
        pol = policies.get(model_id)
        return lambda: plots.policy_figure(pol)
    job = get_job(store, model_id, "model")
    sc = parse_scenario(job.request["scenario"])
    stages = [(s.name, *s.service.representation()) for s in sc.stages]
    samples: dict[str, list[float]] = {}
    for stage, ref in job.request.get("fits", {}).items():  # stages taken from a fit: show its data
        fit = store.get(ref["id"], "fit")
        if fit is not None:
            samples[stage] = fit.request["samples"].get(ref["stage"], [])
    return lambda: plots.distributions_figure(stages, samples=samples or None)


@router.get("/v1/fits/{fit_id}/plots/{stage}.png", responses=_PNG)
async def fit_plot(fit_id: str, stage: str, store: StoreDep, images: PlotsDep, reads: ReadsDep) -> Response:
    """Samples against the fitted PH of one stage (histogram + log-log survival)."""
    build = await reads.run("id", _fit_figure, store, fit_id, stage)
    blob = await images.png(f"fit/{fit_id}/{stage}", build)
    return Response(blob, media_type="image/png")


def _fit_figure(store: Store, fit_id: str, stage: str) -> Callable[[], Figure]:
    job = get_job(store, fit_id, "fit")
    if job.status != "done" or job.result is None:
        raise HTTPError(409, f"id: fit {fit_id!r} is {job.status}")
    ph = job.result["stages"].get(stage)
    if ph is None:
        raise HTTPError(404, f"stage: fit {fit_id!r} has stages {sorted(job.result['stages'])}")
    xs = job.request["samples"][stage]
    return lambda: plots.distributions_figure([(stage, ph["alpha"], ph["T"])], samples={stage: xs},
                                              title=f"{stage}: {ph['structure']}({ph['order']})")
