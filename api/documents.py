"""A stored job as the document the API answers with (:mod:`overtake.api.schemas`)."""

from __future__ import annotations

from typing import Any

from .db import Job
from .schemas import FitDoc, ModelDoc


def _job_fields(job: Job) -> dict[str, Any]:
    return {"id": job.id, "kind": job.kind, "name": job.name, "status": job.status, "progress": job.progress,
            "message": job.message, "reason": job.reason, "created": job.created, "started": job.started,
            "finished": job.finished}


def model_doc(job: Job) -> ModelDoc:
    """``GET /v1/models/{id}``: the job, then (done) π*'s metrics and the comparison."""
    res = job.result or {}
    return ModelDoc(**_job_fields(job), scenario=job.request["scenario"],
                    estimated_states=job.request["estimated_states"], metrics=res.get("metrics"),
                    comparison=res.get("comparison"), policy_hash=res.get("policy_hash"))


def fit_doc(job: Job) -> FitDoc:
    """``GET /v1/fits/{id}``: the job, then (done) the fitted PH per stage."""
    res = job.result or {}
    return FitDoc(**_job_fields(job), source=job.request["source"], stages=res.get("stages"),
                  report=job.request.get("report", []))
