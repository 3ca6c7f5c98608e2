"""Operations: liveness at ``/healthz`` and the API's own Prometheus metrics at ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..deps import MetricsDep, RunnerDep, SettingsDep, StoreDep

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz(store: StoreDep, settings: SettingsDep, runner: RunnerDep) -> dict[str, Any]:
    """Liveness: the store answers; job counts and the worker pool's size."""
    counts = store.counts()
    return {"status": "ok", "workers": settings.workers, "pending": runner.pending,
            "jobs": {f"{k}:{s}": n for (k, s), n in sorted(counts.items())}}


@router.get("/metrics", responses={200: {"content": {"text/plain": {}}}})
async def metrics_endpoint(metrics: MetricsDep) -> Response:
    """Prometheus text exposition of the API's own registry."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
