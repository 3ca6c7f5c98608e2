"""Request and response documents of the REST API (pydantic; no FastAPI import).

The scenario body of ``POST /v1/models`` is :class:`overtake.mdp.scenario_schema.Scenario` itself — the schema of
the CLI's YAML — so the CLI and the API cannot drift. This module adds what only the API needs:
job status documents, the fit request, the decision answer and the error document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from overtake.fitting import STRUCTURES

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]

STATE_FORMAT = (
    "Comma-separated non-negative integers, one per component of the policy's state vector, in the "
    "order of `columns` in `GET /v1/models/{id}/policy`: first the requests *waiting* in each queue "
    "(one queue per (stage, phase) with full phase information, the paper's layout), then the "
    "*active threads* per (stage, phase) coordinate. Example for two exponential stages "
    "(columns waiting:stage1, waiting:stage2, threads:stage1, threads:stage2): `state=2,0,1,0` "
    "= two requests waiting at stage 1, one thread active at stage 1. States beyond the truncation "
    "get the policy file's documented projection (mdp.policy)."
)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Error(_Doc):
    """Every 4xx answer: ``detail`` is one line naming the field and the fix."""

    detail: str


class Accepted(_Doc):
    """``202``: the job was stored and queued."""

    id: str
    status: JobStatus
    url: str


class JobDoc(_Doc):
    """Common part of a model or fit job."""

    id: str
    kind: Literal["model", "fit"]
    name: str
    status: JobStatus
    progress: float = Field(ge=0, le=1, description="fraction of the job's steps done (0 while queued)")
    message: str = Field(description="last progress line while running")
    reason: str | None = Field(default=None, description="why the job failed or was cancelled")
    created: float
    started: float | None = None
    finished: float | None = None


class ModelDoc(JobDoc):
    """``GET /v1/models/{id}``: the job, then (status done) π*'s metrics and the comparison."""

    scenario: dict[str, Any]
    estimated_states: int
    metrics: dict[str, Any] | None = Field(default=None, description="π*'s exact metrics (mdp PolicyMetrics)")
    comparison: dict[str, Any] | None = Field(
        default=None, description="the document of `overtake compare --json` (mdp.compare): policies, gains, ...")
    policy_hash: str | None = None


class FitDoc(JobDoc):
    """``GET /v1/fits/{id}``: the job, then (status done) a fitted PH per stage."""

    source: str = Field(description="json, csv or apache-log")
    stages: dict[str, Any] | None = Field(
        default=None,
        description="per stage: the `overtake fit` JSON (alpha, T, structure, loglik, mean, scv, ...) "
        "usable as a scenario service {ph: {alpha, T}} or {fit: {id, stage}}")
    report: list[str] = Field(default_factory=list, description="what the log reader kept and dropped")


class FitOptions(_Doc):
    """EM options shared by the three ways of posting samples (as ``overtake fit``)."""

    structure: str = Field(default="cf1", description=f"one of {', '.join(STRUCTURES)}")
    order: int | Literal["auto"] = Field(default=4, description="phases, or 'auto' (BIC over 1..12)")
    preserve_mean: bool = False
    seed: int = Field(default=0, ge=0)
    max_iter: int = Field(default=5000, ge=1, le=100_000)

    @field_validator("structure")
    @classmethod
    def _structure(cls, v: str) -> str:
        if v not in STRUCTURES:
            raise ValueError(f"must be one of {', '.join(STRUCTURES)}, got {v!r}")
        return v

    @field_validator("order")
    @classmethod
    def _order(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 32:
            raise ValueError(f"must be in 1..32 or 'auto', got {v}")
        return v


class FitRequest(FitOptions):
    """``POST /v1/fits`` as JSON: durations in seconds, one array or one array per stage."""

    samples: list[float] | dict[str, list[float]] = Field(
        description="durations (seconds, > 0): an array (stage name from `name`) or {stage: array}")
    name: str = Field(default="stage1", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class Decision(_Doc):
    """``GET /v1/models/{id}/decision``: threads to start from each queue."""

    state: list[int]
    columns: list[str]
    spawn: dict[str, int] = Field(description="queue label -> threads to start now")
    total: int
    policy_hash: str


class PolicyDoc(_Doc):
    """``GET /v1/models/{id}/policy``: readable rules and where to download the artifact."""

    id: str
    hash: str
    phase_info: str
    columns: list[str]
    max_requests: int
    max_threads: int
    states: int
    rules: dict[str, Any] | None
    artifact: str = Field(description="URL of the .npz policy file (mdp.Policy.load reads it)")
