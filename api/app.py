"""The REST API (FastAPI): solve jobs, policies, decisions, fits, metrics and an HTML page.

``create_app(Settings(db=...))`` builds the app; ``overtake api`` serves it with uvicorn. Routes
call the same library functions as the CLI (:func:`overtake.mdp.parse_scenario`, :func:`overtake.mdp.compare`,
:func:`overtake.fitting.fit_observations`); solves and fits run in worker processes (:mod:`overtake.api.jobs`),
results persist in SQLite (:mod:`overtake.api.db`).

Errors: every 4xx body is ``{"detail": "<field>: <what is wrong and the fix>"}``. Invalid input
(ρ ≥ 1, a bad PH, an unknown key) is 422 naming the field; a state space over the cap is 413 with
the estimate and the cap; a full queue is 429; a missing or wrong bearer token is 401.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from overtake.mdp.errors import ModelError, PolicyFileError
from overtake.mdp.model import TandemModel
from overtake.mdp.policy import Policy
from overtake.mdp.scenario import Scenario, parse_scenario
from overtake.mdp.statespace import Truncation, count_states

from . import plots
from .db import Job, Store
from .jobs import JobRunner
from .metrics import ApiMetrics
from .schemas import (
    STATE_FORMAT,
    Accepted,
    Decision,
    Error,
    FitDoc,
    FitOptions,
    FitRequest,
    ModelDoc,
    PolicyDoc,
)

HERE = Path(__file__).parent
_STAGE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# module level: route signatures are resolved in module globals (postponed annotations)
bearer = HTTPBearer(auto_error=False, description="required on POST when the API was started with --token")
MAX_UPLOAD_BYTES = 64 * 1024 * 1024


API_DESCRIPTION = """\
Solve the optimal thread-spawn policy π* of a multi-stage server (paper 004) and compare it with
π(1), π(4), π(∞) and per-stage caps; ask it for decisions; fit phase-type service times.

* `POST /v1/models` takes the scenario of `overtake solve|compare` (as JSON) and answers 202 with
  an id; `GET /v1/models/{id}` shows `queued`, `running` (with `progress`), `done` (metrics and the
  comparison) or `failed` (with the `reason`).
* Errors are `{"detail": "<field>: <what is wrong and the fix>"}`: invalid input (ρ ≥ 1, a bad PH,
  an unknown key) 422; an estimated state space over the server's cap 413 (both numbers given);
  a full queue 429; a missing or wrong bearer token on a POST 401 (when the server has a token).
"""


@dataclass(frozen=True)
class Settings:
    """What ``overtake api`` configures.

    Parameters
    ----------
    db
        SQLite file or ``sqlite:///PATH`` URL.
    token
        Bearer token required on mutating endpoints (POST); ``None``: open.
    workers
        Solver processes: at most this many jobs run at once.
    max_states
        Cap on the estimated state space of a solve (413 above it).
    max_queued
        Jobs waiting for a worker at most (429 above it).
    """

    db: str
    token: str | None = None
    workers: int = 1
    max_states: int = 300_000
    max_queued: int = 32


class ApiError(Exception):
    """An answer other than 2xx with a one-line ``detail``."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(x) for x in loc if x not in ("body",)]
    return ".".join(parts) or "body"


def _validation_detail(errors: list[Any]) -> str:
    err = errors[0]
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown key; remove it or check its spelling"
    elif err.get("type") == "missing":
        msg = "required field is missing"
    more = f" ({len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{_loc(err.get('loc', ()))}: {msg}{more}"


# ---- scenario helpers ------------------------------------------------------------------------
def estimate_states(sc: Scenario, model: TandemModel) -> int:
    """States of the largest truncated chain the job is expected to build.

    Fixed truncation: exact (:func:`overtake.mdp.count_states`) for π*, and for the π(∞) baseline in the
    phase-at-start layout on the same request cap. Auto-truncation: the request cap C at which a
    PS queue's tail ρ^C falls below ``tolerance·(1−ρ)`` (at least the solver's start, 10), grown
    1.5× for the re-evaluation, with ``cores + 3`` threads for π*.
    """
    tr = sc.fixed_truncation()
    if tr is None:
        rho = min(model.stable_load(model.cores), 0.999999)
        c = max(10, math.ceil(math.log(sc.tolerance * (1 - rho)) / math.log(rho)))
        c = math.ceil(1.5 * c)
        k = min(c, model.cores + 3 if sc.max_threads is None else sc.max_threads)
        tr = Truncation(c, k)
    star = count_states(model, tr, "full")
    inf = count_states(model, Truncation(tr.max_requests, None), "start")
    return max(star, inf)


def _resolve_fits(data: Any, store: Store, refs: dict[str, dict[str, str]] | None = None) -> Any:
    """Replace ``{"fit": {"id": ID, "stage": NAME}}`` services by the fitted ``{"ph": {alpha, T}}``.

    ``refs`` collects, per stage name, the fit it came from (the page overlays the fit's samples).
    """
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list):
        return data
    for i, st in enumerate(stages):
        svc = st.get("service") if isinstance(st, dict) else None
        if not (isinstance(svc, dict) and "fit" in svc):
            continue
        ref = svc["fit"]
        where = f"stages.{i}.service.fit"
        if len(svc) != 1 or not isinstance(ref, dict) or set(ref) != {"id", "stage"}:
            raise ModelError(f"{where}: give {{fit: {{id: FIT_ID, stage: NAME}}}} alone")
        job = store.get(str(ref["id"]), "fit")
        if job is None:
            raise ModelError(f"{where}.id: no fit {ref['id']!r} (POST /v1/fits first)")
        if job.status != "done" or job.result is None:
            raise ModelError(f"{where}.id: fit {ref['id']!r} is {job.status}, not done")
        ph = job.result["stages"].get(str(ref["stage"]))
        if ph is None:
            raise ModelError(f"{where}.stage: fit {ref['id']!r} has stages {sorted(job.result['stages'])}, "
                             f"not {ref['stage']!r}")
        st["service"] = {"ph": {"alpha": ph["alpha"], "T": ph["T"]}}
        if refs is not None:
            refs[str(st.get("name"))] = {"id": job.id, "stage": str(ref["stage"])}
    return data


# ---- documents -------------------------------------------------------------------------------
def _job_fields(job: Job) -> dict[str, Any]:
    return {"id": job.id, "kind": job.kind, "name": job.name, "status": job.status, "progress": job.progress,
            "message": job.message, "reason": job.reason, "created": job.created, "started": job.started,
            "finished": job.finished}


def model_doc(job: Job) -> ModelDoc:
    res = job.result or {}
    return ModelDoc(**_job_fields(job), scenario=job.request["scenario"],
                    estimated_states=job.request["estimated_states"], metrics=res.get("metrics"),
                    comparison=res.get("comparison"), policy_hash=res.get("policy_hash"))


def fit_doc(job: Job) -> FitDoc:
    res = job.result or {}
    return FitDoc(**_job_fields(job), source=job.request["source"], stages=res.get("stages"),
                  report=job.request.get("report", []))


class _LRU(OrderedDict[str, Any]):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: str, value: Any) -> Any:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value

    def hit(self, key: str) -> Any:
        v = self.get(key)
        if v is not None:
            self.move_to_end(key)
        return v


def _parse_state(text: str, policy: Policy) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    n = policy.Q + policy.D
    if len(parts) != n:
        raise ApiError(422, f"state: needs {n} comma-separated counts in the order {policy.columns}, got {len(parts)}")
    out = []
    for i, p in enumerate(parts):
        if not p.isdigit() or len(p) > 6:
            raise ApiError(422, f"state[{i}] ({policy.columns[i]}): must be an integer in 0..999999, got {p!r}")
        out.append(int(p))
    return out


def _scenario_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """Scenario's JSON schema with refs into the OpenAPI components, and its definitions."""
    schema = Scenario.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return schema, defs


FIT_FORM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "CSV or plain durations, or an access log"},
        "kind": {"type": "string", "enum": ["csv", "apache-log"], "default": "csv"},
        "column": {"type": "string", "description": "CSV column (header name or 0-based index); none: one value a line"},
        "scale": {"type": "number", "exclusiveMinimum": 0, "default": 1.0, "description": "multiplier to seconds"},
        "name": {"type": "string", "description": "stage name for a CSV (default stage1)"},
        "log_format": {"type": "string", "description": "the server's LogFormat, e.g. '%h %l %u %t \"%r\" %>s %b %D'"},
        "stage": {"type": "array", "items": {"type": "string"}, "description": "NAME=REGEX, repeatable (apache-log)"},
        "structure": {"type": "string", "default": "cf1"},
        "order": {"type": "string", "default": "4", "description": "integer or 'auto'"},
        "preserve_mean": {"type": "boolean", "default": False},
        "seed": {"type": "integer", "minimum": 0, "default": 0},
    },
}


class _Instrument:
    """Pure ASGI middleware counting requests by route template and timing them.

    (Starlette's ``BaseHTTPMiddleware`` costs a task and a stream per request; this costs two
    dictionary lookups.)
    """

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope["method"], path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)


def _mount_docs(app: FastAPI) -> None:
    """Swagger UI at ``/docs`` from the ``swagger-ui-bundle-v2`` wheel (FastAPI's default loads a CDN)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

    app.mount("/docs-static", StaticFiles(directory=str(swagger_ui_path)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Overtake API",
                                   swagger_js_url="/docs-static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-static/swagger-ui.css",
                                   swagger_favicon_url="/docs-static/favicon-32x32.png")


def create_app(settings: Settings) -> FastAPI:
    """The API over the store at ``settings.db``; the worker pool starts with the app's lifespan."""
    store = Store(settings.db)
    metrics = ApiMetrics(store.counts)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    policies: _LRU = _LRU(32)
    images: _LRU = _LRU(128)
    cache_dir = tempfile.TemporaryDirectory(prefix="overtake-api-")
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner = JobRunner(store, workers=settings.workers)
        state["runner"] = runner
        plot_pool = state["plot_pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overtake-plot")
        failed, queued = store.recover()
        for job_id in queued:
            runner.submit(job_id)
        state["recovered"] = {"failed": failed, "requeued": queued}
        try:
            yield
        finally:
            runner.shutdown()
            plot_pool.shutdown(wait=True)
            cache_dir.cleanup()

    app = FastAPI(
        title="Overtake",
        version="1",
        summary="Optimal thread-spawn policies for multi-stage web servers (paper 004)",
        lifespan=lifespan,
        responses={422: {"model": Error, "description": "invalid input; `detail` names the field"}},
        docs_url=None,  # served below from the swagger-ui-bundle package: no CDN, works offline
        redoc_url=None,
    )
    app.state.store = store
    app.state.settings = settings
    app.state.recovery = state
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    _mount_docs(app)

    # ---- errors and instrumentation ----------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _validation_detail(list(exc.errors()))}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_middleware(_Instrument, metrics=metrics)

    def authorize(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if settings.token is None:
            return
        if cred is None or not hmac.compare_digest(cred.credentials.encode(), settings.token.encode()):
            raise ApiError(401, "authorization: a valid bearer token is required (Authorization: Bearer TOKEN)",
                           {"WWW-Authenticate": "Bearer"})

    def runner() -> JobRunner:
        r: JobRunner = state["runner"]
        return r

    def queue_room(kind: str) -> None:
        counts = store.counts()
        queued = counts.get(("model", "queued"), 0) + counts.get(("fit", "queued"), 0)
        if queued >= settings.max_queued:
            metrics.rejected.labels(kind, "queue_full").inc()
            raise ApiError(429, f"queue: {queued} jobs are waiting (limit {settings.max_queued}); retry later",
                           {"Retry-After": "10"})

    def get_job(job_id: str, kind: str) -> Job:
        job = store.get(job_id, kind)
        if job is None:
            raise ApiError(404, f"id: no {kind} {job_id!r}")
        return job

    def done_model(job_id: str) -> Job:
        job = get_job(job_id, "model")
        if job.status != "done":
            raise ApiError(409, f"id: model {job_id!r} is {job.status}" + (f" ({job.reason})" if job.reason else "")
                           + "; the policy exists once status is done")
        return job

    def load_policy(job_id: str) -> Policy:
        pol = policies.hit(job_id)
        if pol is not None:
            return pol  # type: ignore[no-any-return]
        blob = store.artifact(job_id)
        if blob is None:
            raise ApiError(409, f"id: model {job_id!r} has no policy artifact")
        path = Path(cache_dir.name) / f"{job_id}.npz"
        path.write_bytes(blob)
        try:
            pol = Policy.load(path)
        except PolicyFileError as exc:
            raise ApiError(500, f"policy: stored artifact unreadable: {exc}") from None
        return policies.put(job_id, pol)  # type: ignore[no-any-return]

    # ---- models ------------------------------------------------------------------------------
    scenario_schema, scenario_defs = _scenario_schema()

    @app.post("/v1/models", status_code=202, response_model=Accepted, tags=["models"],
              dependencies=[Depends(authorize)],
              responses={401: {"model": Error}, 413: {"model": Error}, 429: {"model": Error}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": scenario_schema}}}})
    async def create_model(request: Request, name: Annotated[str | None, Query(max_length=80)] = None) -> Accepted:
        """Start a solve job for a scenario (the CLI's YAML schema, as JSON); returns its id at once.

        A stage's service may also be ``{"fit": {"id": FIT_ID, "stage": NAME}}``, a fit from
        ``POST /v1/fits``. Invalid scenarios (ρ ≥ 1, a bad PH, an unknown key) are 422 naming the
        field; an estimated state space over the server's cap is 413 with both numbers.
        """
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(422, f"body: not valid JSON ({exc})") from None
        refs: dict[str, dict[str, str]] = {}
        try:
            data = _resolve_fits(data, store, refs)
            sc = parse_scenario(data)
            model = sc.build_model()
        except ValueError as exc:
            metrics.rejected.labels("model", "invalid").inc()
            raise ApiError(422, str(exc)) from None
        try:
            est = estimate_states(sc, model)
        except ValueError as exc:  # too large to even index
            metrics.rejected.labels("model", "too_large").inc()
            raise ApiError(413, f"truncation: {exc}; the cap is {settings.max_states} states") from None
        if est > settings.max_states:
            metrics.rejected.labels("model", "too_large").inc()
            raise ApiError(413, f"truncation: estimated state space {est} states exceeds the cap of "
                                f"{settings.max_states}; lower truncation.max_requests, max_threads, the load, "
                                f"or the number of phases")
        queue_room("model")
        label = name or " + ".join(s.name for s in sc.stages) + f" @ rho {model.load:.3g}"
        job_id = store.create("model", label, {"scenario": sc.model_dump(exclude_none=True), "estimated_states": est,
                                               "fits": refs})
        runner().submit(job_id)
        metrics.submitted.labels("model").inc()
        return Accepted(id=job_id, status="queued", url=f"/v1/models/{job_id}")

    @app.get("/v1/models", response_model=list[ModelDoc], tags=["models"])
    async def list_models() -> list[ModelDoc]:
        """All model jobs, newest first."""
        return [model_doc(j) for j in store.list("model")]

    @app.get("/v1/models/{model_id}", response_model=ModelDoc, tags=["models"], responses={404: {"model": Error}})
    async def get_model(model_id: str) -> ModelDoc:
        """Status (queued, running with progress, done, failed with the reason), then π*'s metrics and
        the comparison with the baselines (the document of ``overtake compare --json``)."""
        return model_doc(get_job(model_id, "model"))

    @app.get("/v1/models/{model_id}/policy", response_model=PolicyDoc, tags=["models"],
             responses={404: {"model": Error}, 409: {"model": Error}})
    async def get_policy(model_id: str) -> PolicyDoc:
        """Readable overtaking rules (paper 004, Theorem 3.1) and the artifact's download URL."""
        job = done_model(model_id)
        res = job.result or {}
        return PolicyDoc(id=model_id, hash=res["policy_hash"], phase_info=res["phase_info"], columns=res["columns"],
                         max_requests=res["max_requests"], max_threads=res["max_threads"], states=res["states"],
                         rules=res.get("rules"), artifact=f"/v1/models/{model_id}/policy.npz")

    @app.get("/v1/models/{model_id}/policy.npz", tags=["models"],
             responses={200: {"content": {"application/octet-stream": {}}}, 304: {"description": "ETag matches"},
                        404: {"model": Error}, 409: {"model": Error}})
    async def get_policy_file(model_id: str, request: Request) -> Response:
        """The policy artifact (``mdp.Policy.load`` reads it; ``overtake solve --out`` writes the same format).

        The ETag is the policy's hash: a poller sending ``If-None-Match`` gets 304 while it is unchanged.
        """
        job = done_model(model_id)
        etag = f'"{(job.result or {}).get("policy_hash", "")}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        blob = store.artifact(model_id) or b""
        return Response(blob, media_type="application/octet-stream", headers={
            "Content-Disposition": f'attachment; filename="policy-{model_id}.npz"', "ETag": etag})

    @app.get("/v1/models/{model_id}/decision", response_model=Decision, tags=["models"],
             responses={404: {"model": Error}, 409: {"model": Error}})
    async def get_decision(model_id: str,
                           state: Annotated[str, Query(description=STATE_FORMAT, max_length=4000)]) -> Response:
        """Threads to start from each queue in the given state (π*'s action)."""
        if model_id not in policies:
            done_model(model_id)
        pol = load_policy(model_id)
        row = _parse_state(state, pol)
        act = pol.action(np.asarray(row, dtype=np.int64))
        metrics.decisions.inc()
        labels = [c.removeprefix("waiting:") for c in pol.columns[: pol.Q]]
        # the Decision document, serialised directly: this is the hot path (issue 7: p99 <= 5 ms)
        return JSONResponse({"state": row, "columns": pol.columns,
                             "spawn": {lab: int(a) for lab, a in zip(labels, act)}, "total": int(act.sum()),
                             "policy_hash": pol.meta.get("hash") or pol.digest()})

    # ---- fits --------------------------------------------------------------------------------
    @app.post("/v1/fits", status_code=202, response_model=Accepted, tags=["fits"], dependencies=[Depends(authorize)],
              responses={401: {"model": Error}, 413: {"model": Error}, 429: {"model": Error}},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {"$ref": "#/components/schemas/FitRequest"}},
                  "multipart/form-data": {"schema": FIT_FORM_SCHEMA}}}})
    async def create_fit(request: Request) -> Accepted:
        """Fit a phase-type distribution per stage by EM (as ``overtake fit``).

        Three inputs: JSON ``{"samples": [...]}`` or ``{"samples": {stage: [...]}}`` (seconds); a
        multipart CSV upload (``file``, ``kind=csv``, optional ``column``, ``scale``); or an access
        log (``file``, ``kind=apache-log``, ``log_format``, one ``stage=NAME=REGEX`` per stage).
        """
        ctype = request.headers.get("content-type", "")
        if int(request.headers.get("content-length") or 0) > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"body: larger than {MAX_UPLOAD_BYTES} bytes")
        if ctype.startswith("multipart/form-data"):
            source, data, opts, report = await _fit_from_form(request)
        else:
            try:
                body = json.loads(await request.body())
                req = FitRequest.model_validate(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(422, f"body: not valid JSON ({exc})") from None
            except ValidationError as exc:
                metrics.rejected.labels("fit", "invalid").inc()
                raise ApiError(422, _validation_detail(list(exc.errors()))) from None
            data = req.samples if isinstance(req.samples, dict) else {req.name: req.samples}
            source, opts, report = "json", FitOptions(**req.model_dump(exclude={"samples", "name"})), []
        _check_samples(data)
        queue_room("fit")
        job_id = store.create("fit", ", ".join(data), {"source": source, "samples": data,
                                                       "options": opts.model_dump(), "report": report})
        runner().submit(job_id)
        metrics.submitted.labels("fit").inc()
        return Accepted(id=job_id, status="queued", url=f"/v1/fits/{job_id}")

    @app.get("/v1/fits", response_model=list[FitDoc], tags=["fits"])
    async def list_fits() -> list[FitDoc]:
        """All fit jobs, newest first."""
        return [fit_doc(j) for j in store.list("fit")]

    @app.get("/v1/fits/{fit_id}", response_model=FitDoc, tags=["fits"], responses={404: {"model": Error}})
    async def get_fit(fit_id: str) -> FitDoc:
        """Status, then the fitted PH per stage (alpha, T, loglik, mean, SCV, ...)."""
        return fit_doc(get_job(fit_id, "fit"))

    # ---- plots and page ----------------------------------------------------------------------
    async def _png(key: str, build: Callable[[], Any]) -> Response:
        blob = images.hit(key)
        if blob is None:
            # matplotlib off the event loop (decisions must not wait for a figure), one figure at a
            # time (its font cache is not thread-safe)
            fig_bytes = await asyncio.get_running_loop().run_in_executor(state["plot_pool"], lambda: plots.png(build()))
            blob = images.put(key, fig_bytes)
        return Response(blob, media_type="image/png")

    @app.get("/v1/models/{model_id}/plots/{kind}.png", tags=["plots"],
             responses={200: {"content": {"image/png": {}}}, 404: {"model": Error}, 409: {"model": Error}})
    async def model_plot(model_id: str, kind: str) -> Response:
        """``gains`` (E[W] per policy, paper 004 Fig. 2), ``policy`` (heatmap) or ``distributions``."""
        if kind == "distributions":
            job = get_job(model_id, "model")
            sc = parse_scenario(job.request["scenario"])
            stages = [(s.name, *s.service.representation()) for s in sc.stages]
            samples: dict[str, list[float]] = {}
            for stage, ref in job.request.get("fits", {}).items():  # stages taken from a fit: show its data
                fit = store.get(ref["id"], "fit")
                if fit is not None:
                    samples[stage] = fit.request["samples"].get(ref["stage"], [])
            return await _png(f"{model_id}/distributions",
                              lambda: plots.distributions_figure(stages, samples=samples or None))
        if kind not in ("gains", "policy"):
            raise ApiError(404, f"kind: one of gains, policy, distributions, got {kind!r}")
        job = done_model(model_id)
        if kind == "gains":
            return await _png(f"{model_id}/gains", lambda: plots.gains_figure((job.result or {})["comparison"]))
        pol = load_policy(model_id)
        return await _png(f"{model_id}/policy", lambda: plots.policy_figure(pol))

    @app.get("/v1/fits/{fit_id}/plots/{stage}.png", tags=["plots"],
             responses={200: {"content": {"image/png": {}}}, 404: {"model": Error}, 409: {"model": Error}})
    async def fit_plot(fit_id: str, stage: str) -> Response:
        """Samples against the fitted PH of one stage (histogram + log-log survival)."""
        job = get_job(fit_id, "fit")
        if job.status != "done" or job.result is None:
            raise ApiError(409, f"id: fit {fit_id!r} is {job.status}")
        ph = job.result["stages"].get(stage)
        if ph is None:
            raise ApiError(404, f"stage: fit {fit_id!r} has stages {sorted(job.result['stages'])}")
        xs = job.request["samples"][stage]
        return await _png(f"fit/{fit_id}/{stage}", lambda: plots.distributions_figure(
            [(stage, ph["alpha"], ph["T"])], samples={stage: xs}, title=f"{stage}: {ph['structure']}({ph['order']})"))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index(request: Request) -> HTMLResponse:
        models = store.list("model", limit=50)
        fits = store.list("fit", limit=50)
        busy = any(j.status in ("queued", "running") for j in [*models, *fits])
        return templates.TemplateResponse(request, "index.html", {
            "models": [model_doc(j) for j in models], "fits": [fit_doc(j) for j in fits], "busy": busy})

    # ---- operations --------------------------------------------------------------------------
    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, Any]:
        """Liveness: the store answers; job counts and the worker pool's size."""
        counts = store.counts()
        return {"status": "ok", "workers": settings.workers, "pending": runner().pending,
                "jobs": {f"{k}:{s}": n for (k, s), n in sorted(counts.items())}}

    @app.get("/metrics", tags=["operations"], responses={200: {"content": {"text/plain": {}}}})
    async def metrics_endpoint() -> Response:
        """Prometheus text exposition of the API's own registry."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- OpenAPI: the scenario schema (shared with the CLI) in the components --------------------
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes,
                             description=API_DESCRIPTION)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps.update(scenario_defs)
        fit_schema = FitRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(fit_schema.pop("$defs", {}))
        comps["FitRequest"] = fit_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _check_samples(data: dict[str, list[float]]) -> None:
    if not data:
        raise ApiError(422, "samples: no stage has samples")
    for name, xs in data.items():
        if not _STAGE_NAME.fullmatch(name):
            raise ApiError(422, f"samples: stage name {name[:70]!r} must be 1-64 letters, digits, '_', '.', '-'")
        if len(xs) < 2:
            raise ApiError(422, f"samples.{name}: needs at least 2 durations, got {len(xs)}")
        bad = next((i for i, v in enumerate(xs) if not (math.isfinite(v) and v > 0)), None)
        if bad is not None:
            raise ApiError(422, f"samples.{name}[{bad}]: durations must be finite and > 0 seconds, got {xs[bad]!r}")


async def _fit_from_form(request: Request) -> tuple[str, dict[str, list[float]], FitOptions, list[str]]:
    """Parse the multipart form of ``POST /v1/fits`` into samples per stage."""
    from starlette.datastructures import UploadFile

    async with request.form() as form:  # closes the spooled upload files
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "file: upload the CSV or access log as the multipart field 'file'")
        raw = await upload.read()
        fields = {k: form.get(k) for k in ("kind", "order", "structure", "preserve_mean", "seed", "log_format",
                                            "scale", "name", "column")}
        stage_specs = [str(v) for v in form.getlist("stage")]
    # parsing a large log is CPU work: keep it off the event loop
    return await run_in_threadpool(_fit_from_fields, raw, fields, stage_specs)


def _fit_from_fields(raw: bytes, form: dict[str, Any],
                     stage_specs: list[str]) -> tuple[str, dict[str, list[float]], FitOptions, list[str]]:
    from overtake.fitting import io as fio

    kind = str(form.get("kind") or "csv")
    order_s = str(form.get("order") or "4")
    try:
        order: int | Literal["auto"] = "auto" if order_s == "auto" else int(order_s)
        opts = FitOptions(structure=str(form.get("structure") or "cf1"), order=order,
                          preserve_mean=str(form.get("preserve_mean") or "false").lower() in ("1", "true", "yes", "on"),
                          seed=int(str(form.get("seed") or 0)))
    except ValueError as exc:
        detail = _validation_detail(list(exc.errors())) if isinstance(exc, ValidationError) else f"form: {exc}"
        raise ApiError(422, detail) from None
    text = raw.decode("utf-8", errors="replace")
    if kind == "apache-log":
        fmt = form.get("log_format")
        if not isinstance(fmt, str) or not fmt:
            raise ApiError(422, "log_format: required with kind=apache-log (the server's LogFormat string)")
        stages: dict[str, str] = {}
        for spec in stage_specs:
            name, sep, rx = spec.partition("=")
            if not sep or not name or not rx:
                raise ApiError(422, f"stage: must be NAME=REGEX, got {spec!r}")
            if name in stages:
                raise ApiError(422, f"stage: {name!r} given twice")
            stages[name] = rx
        if not stages:
            raise ApiError(422, "stage: give at least one NAME=REGEX with kind=apache-log")
        try:
            res = fio.parse_apache_log(text.splitlines(), fmt, stages)
        except ValueError as exc:
            raise ApiError(422, f"log_format: {exc}") from None
        data = {k: [float(v) for v in x] for k, x in res.stages.items()}
        return "apache-log", data, opts, res.report()
    if kind != "csv":
        raise ApiError(422, f"kind: must be csv or apache-log, got {kind!r}")
    try:
        scale = float(str(form.get("scale") or 1.0))
    except ValueError:
        raise ApiError(422, f"scale: must be a number, got {form.get('scale')!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ApiError(422, f"scale: must be > 0, got {scale}")
    name = str(form.get("name") or "stage1")
    column = form.get("column")
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=True) as fh:
        fh.write(text)
        fh.flush()
        try:
            x = fio.read_durations(fh.name, column=str(column) if column else None, scale=scale)
        except ValueError as exc:
            raise ApiError(422, f"file: {str(exc).replace(fh.name, 'upload')}") from None
    return "csv", {name: [float(v) for v in x]}, opts, []
