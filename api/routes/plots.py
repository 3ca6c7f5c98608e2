"""PNG figures of a model (gains, policy, service distributions) and of a fit (samples against the PH)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from overtake.mdp.scenario import parse_scenario

from .. import plots
from ..deps import PlotsDep, PoliciesDep, StoreDep, done_model, get_job
from ..errors import HTTPError
from ..schemas import Error

router = APIRouter(tags=["plots"])

_PNG: dict[int | str, dict[str, Any]] = {
    200: {"content": {"image/png": {}}}, 404: {"model": Error}, 409: {"model": Error}}


@router.get("/v1/models/{model_id}/plots/{kind}.png", responses=_PNG)
async def model_plot(model_id: str, kind: str, store: StoreDep, policies: PoliciesDep, images: PlotsDep) -> Response:
    """``gains`` (E[W] per policy, paper 004 Fig. 2), ``policy`` (heatmap) or ``distributions``."""
    if kind == "distributions":
        job = get_job(store, model_id, "model")
        sc = parse_scenario(job.request["scenario"])
        stages = [(s.name, *s.service.representation()) for s in sc.stages]
        samples: dict[str, list[float]] = {}
        for stage, ref in job.request.get("fits", {}).items():  # stages taken from a fit: show its data
            fit = store.get(ref["id"], "fit")
            if fit is not None:
                samples[stage] = fit.request["samples"].get(ref["stage"], [])
        blob = await images.png(f"{model_id}/distributions",
                                lambda: plots.distributions_figure(stages, samples=samples or None))
    elif kind == "gains":
        comparison = (done_model(store, model_id).result or {})["comparison"]
        blob = await images.png(f"{model_id}/gains", lambda: plots.gains_figure(comparison))
    elif kind == "policy":
        done_model(store, model_id)
        pol = policies.get(model_id)
        blob = await images.png(f"{model_id}/policy", lambda: plots.policy_figure(pol))
    else:
        raise HTTPError(404, f"kind: one of gains, policy, distributions, got {kind!r}")
    return Response(blob, media_type="image/png")


@router.get("/v1/fits/{fit_id}/plots/{stage}.png", responses=_PNG)
async def fit_plot(fit_id: str, stage: str, store: StoreDep, images: PlotsDep) -> Response:
    """Samples against the fitted PH of one stage (histogram + log-log survival)."""
    job = get_job(store, fit_id, "fit")
    if job.status != "done" or job.result is None:
        raise HTTPError(409, f"id: fit {fit_id!r} is {job.status}")
    ph = job.result["stages"].get(stage)
    if ph is None:
        raise HTTPError(404, f"stage: fit {fit_id!r} has stages {sorted(job.result['stages'])}")
    xs = job.request["samples"][stage]
    blob = await images.png(f"fit/{fit_id}/{stage}", lambda: plots.distributions_figure(
        [(stage, ph["alpha"], ph["T"])], samples={stage: xs}, title=f"{stage}: {ph['structure']}({ph['order']})"))
    return Response(blob, media_type="image/png")
