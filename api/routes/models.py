"""``/v1/models``: solve jobs from a scenario, their documents, policies and decisions
(van der Weij et al., "Dynamic thread assignment").

A scenario is the CLI's YAML as JSON (:class:`overtake.mdp.scenario.Scenario`, read by
:func:`overtake.api.scenario.resolve_scenario`); a stage's service may also be a fit of
``POST /v1/fits``. The job runs what ``overtake compare`` runs (:func:`overtake.api.jobs.run_model`),
on the same auto-truncation, so both give the same answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from overtake.mdp.errors import ModelError
from overtake.mdp.policy import Policy
from overtake.mdp.scenario_schema import Scenario

from ..caches import PolicyCache
from ..db import Store
from ..deps import (
    ACCEPTED_RESPONSES,
    MAX_SCENARIO_VALUES,
    MetricsDep,
    ParseDep,
    PoliciesDep,
    ReadsDep,
    RunnerDep,
    Settings,
    SettingsDep,
    StoreDep,
    WorkDep,
    accepted,
    authorize,
    cancel_job,
    count_values,
    done_model,
    get_job,
    parse_json,
    read_body,
    submit_job,
)
from ..documents import model_doc
from ..errors import HTTPError
from ..jobs import estimate_states
from ..metrics import ApiMetrics
from ..scenario import resolve_scenario
from ..schemas import STATE_FORMAT, Accepted, Decision, Error, ModelDoc, PolicyDoc

router = APIRouter(tags=["models"])


def scenario_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """Scenario's JSON schema with refs into the OpenAPI components, and its definitions."""
    schema = Scenario.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return schema, defs


SCENARIO_SCHEMA, SCENARIO_DEFS = scenario_schema()


class FitResolver:
    """Resolves ``{fit: {id: FIT_ID, stage: NAME}}`` services from the store's done fits.

    ``used`` maps each stage name to the fit it came from (the distributions plot shows its samples).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.used: dict[str, dict[str, str]] = {}

    def __call__(self, ref: Any, *, where: str, stage: str) -> Mapping[str, Any]:
        if not isinstance(ref, dict) or set(ref) != {"id", "stage"}:
            raise ModelError(f"{where}: give {{fit: {{id: FIT_ID, stage: NAME}}}}")
        job = self.store.get(str(ref["id"]), "fit")
        if job is None:
            raise ModelError(f"{where}.id: no fit {ref['id']!r} (POST /v1/fits first)")
        if job.status != "done" or job.result is None:
            raise ModelError(f"{where}.id: fit {ref['id']!r} is {job.status}, not done")
        ph: Mapping[str, Any] | None = job.result["stages"].get(str(ref["stage"]))
        if ph is None:
            raise ModelError(f"{where}.stage: fit {ref['id']!r} has stages {sorted(job.result['stages'])}, "
                             f"not {ref['stage']!r}")
        self.used[stage] = {"id": job.id, "stage": str(ref["stage"])}
        return ph


_COUNT = re.compile(r"[0-9]{1,6}")


def _parse_state(text: str, policy: Policy) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    n = policy.Q + policy.D
    if len(parts) != n:
        raise HTTPError(422, f"state: needs {n} comma-separated counts in the order {policy.columns}, got {len(parts)}")
    out = []
    for i, p in enumerate(parts):
        if not _COUNT.fullmatch(p):  # str.isdigit() also takes '²' and '٣', which int() refuses or reads
            raise HTTPError(422, f"state[{i}] ({policy.columns[i]}): must be an integer in 0..999999 written "
                                 f"with the ASCII digits 0-9, got {p[:20]!r}")
        out.append(int(p))
    return out


@router.post("/v1/models", status_code=202, response_model=Accepted, dependencies=[Depends(authorize)],
             responses={**ACCEPTED_RESPONSES, 401: {"model": Error}, 413: {"model": Error}, 429: {"model": Error}},
             openapi_extra={"requestBody": {"required": True,
                                            "content": {"application/json": {"schema": SCENARIO_SCHEMA}}}})
async def create_model(request: Request, response: Response, store: StoreDep, settings: SettingsDep,
                       metrics: MetricsDep, runner: RunnerDep, work: WorkDep, parse: ParseDep,
                       name: Annotated[str | None, Query(max_length=80)] = None) -> Accepted:
    """Start a solve job for a scenario (the CLI's YAML schema, as JSON); returns its id at once.

    A stage's service may also be ``{"fit": {"id": FIT_ID, "stage": NAME}}``, a fit from
    ``POST /v1/fits``. Invalid scenarios (ρ ≥ 1, a bad PH, an unknown key) are 422 naming the
    field; an estimated state space over the server's cap is 413 with both numbers. The job's
    name is ``name`` (default: the stages and the load) and a short hash of the scenario, so two
    different models never share one; ``Location`` points at the job.
    """
    data = await parse.run("body", decode_scenario, await read_body(request))
    label, payload = await work.run("body", _check_model, data, store, settings, metrics, name)
    digest = hashlib.sha256(json.dumps(payload["scenario"], sort_keys=True).encode()).hexdigest()
    doc = await work.commit(submit_job, store, runner, settings, metrics, "model", label, payload, digest)
    return accepted(doc, response)


def decode_scenario(body: bytes) -> Any:
    """The JSON of a scenario body, in the parse process (:class:`overtake.api.offload.ParseProcess`):
    what crosses back to the server is at most ``MAX_SCENARIO_VALUES`` values, so a body of a
    million numbers costs the server's interpreter nothing."""
    data = parse_json(body)
    if count_values(data, MAX_SCENARIO_VALUES) > MAX_SCENARIO_VALUES:
        raise HTTPError(413, f"body: more than {MAX_SCENARIO_VALUES} values; a scenario has at most 16 stages "
                             "of 64 phases; send a smaller document")
    return data


def _check_model(data: Any, store: Store, settings: Settings, metrics: ApiMetrics,
                 name: str | None) -> tuple[str, dict[str, Any]]:
    """Validate a scenario and estimate its state space (CPU: off the loop): label and payload."""
    fits = FitResolver(store)
    try:
        sc, model = resolve_scenario(data, {"fit": fits})
    except ValueError as exc:
        metrics.rejected.labels("model", "invalid").inc()
        raise HTTPError(422, str(exc)) from None
    est = estimate_states(sc, model)
    if est > settings.max_states:
        metrics.rejected.labels("model", "too_large").inc()
        raise HTTPError(413, f"truncation: estimated state space {est} states exceeds the cap of "
                             f"{settings.max_states}; give a smaller truncation (truncation.max_requests, "
                             f"truncation.max_threads), a lower load, or fewer phases")
    label = name or " + ".join(s.name for s in sc.stages) + f" @ rho {model.load:.3g}"
    return label, {"scenario": sc.to_dict(exclude_none=True), "estimated_states": est, "fits": fits.used}


@router.get("/v1/models", response_model=list[ModelDoc])
async def list_models(store: StoreDep, reads: ReadsDep) -> list[ModelDoc]:
    """All model jobs, newest first."""
    return await reads.run("models", lambda: [model_doc(j) for j in store.list("model")])


@router.get("/v1/models/{model_id}", response_model=ModelDoc, responses={404: {"model": Error}})
async def get_model(model_id: str, store: StoreDep, reads: ReadsDep) -> ModelDoc:
    """Status (queued, running with progress, done, failed with the reason), then π*'s metrics and
    the comparison with the baselines (the document of ``overtake compare --json``)."""
    return await reads.run("id", lambda: model_doc(get_job(store, model_id, "model")))


@router.delete("/v1/models/{model_id}", response_model=ModelDoc, dependencies=[Depends(authorize)],
               responses={401: {"model": Error}, 404: {"model": Error}, 409: {"model": Error}})
async def cancel_model(model_id: str, store: StoreDep, runner: RunnerDep, work: WorkDep) -> ModelDoc:
    """Cancel a queued or running solve: a running one has its process stopped. The answer is the
    job, status ``cancelled``; 409 for a job that has already ended (done, failed, cancelled)."""
    return await work.commit(lambda: model_doc(cancel_job(store, runner, model_id, "model")))


@router.get("/v1/models/{model_id}/policy", response_model=PolicyDoc,
            responses={404: {"model": Error}, 409: {"model": Error}})
async def get_policy(model_id: str, store: StoreDep, reads: ReadsDep) -> PolicyDoc:
    """Readable overtaking rules (van der Weij et al., Theorem 3.1) and the artifact's download URL."""
    res = (await reads.run("id", done_model, store, model_id)).result or {}
    return PolicyDoc(id=model_id, hash=res["policy_hash"], phase_info=res["phase_info"], columns=res["columns"],
                     max_requests=res["max_requests"], max_threads=res["max_threads"], states=res["states"],
                     rules=res.get("rules"), artifact=f"/v1/models/{model_id}/policy.npz")


@router.get("/v1/models/{model_id}/policy.npz",
            responses={200: {"content": {"application/octet-stream": {}}}, 304: {"description": "ETag matches"},
                       404: {"model": Error}, 409: {"model": Error}})
async def get_policy_file(model_id: str, request: Request, store: StoreDep, reads: ReadsDep) -> Response:
    """The policy artifact (``mdp.Policy.load`` reads it; ``overtake solve --out`` writes the same format).

    The ETag is the policy's hash: a poller sending ``If-None-Match`` gets 304 while it is unchanged.
    """
    job = await reads.run("id", done_model, store, model_id)
    etag = f'"{(job.result or {}).get("policy_hash", "")}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    blob = await reads.run("id", store.artifact, model_id) or b""
    return Response(blob, media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="policy-{model_id}.npz"', "ETag": etag})


@router.get("/v1/models/{model_id}/decision", response_model=Decision,
            responses={404: {"model": Error}, 409: {"model": Error}})
async def get_decision(model_id: str, state: Annotated[str, Query(description=STATE_FORMAT, max_length=4000)],
                       store: StoreDep, policies: PoliciesDep, metrics: MetricsDep, reads: ReadsDep) -> Response:
    """Threads to start from each queue in the given state (π*'s action)."""
    if model_id in policies:  # the hot path: a cached policy, answered on the loop
        pol = policies.get(model_id)
    else:  # reading the job and loading its artifact: off the loop
        pol = await reads.run("id", _load_policy, store, policies, model_id)
    row = _parse_state(state, pol)
    act = pol.action(np.asarray(row, dtype=np.int64))
    metrics.decisions.inc()
    labels = [c.removeprefix("waiting:") for c in pol.columns[: pol.Q]]
    # the Decision document, serialised directly: this is the hot path (its latency target is in BENCHMARKS.md § api)
    return JSONResponse({"state": row, "columns": pol.columns,
                         "spawn": {lab: int(a) for lab, a in zip(labels, act)}, "total": int(act.sum()),
                         "policy_hash": pol.meta.get("hash") or pol.digest()})


def _load_policy(store: Store, policies: PolicyCache, model_id: str) -> Policy:
    done_model(store, model_id)
    return policies.get(model_id)
