"""What the routes share, as FastAPI dependencies: settings, store, runner, metrics, caches, checks.

:func:`overtake.api.app.create_app` puts each long-lived part on ``app.state``; a route asks for
one with its ``...Dep`` annotation (``store: StoreDep``). The job runner exists only while the
app's lifespan runs (it owns worker processes). The checks below answer with the API's one-line
errors: 401 without the bearer token, 404 for an unknown id, 409 for a model not done yet or a
job that cannot be cancelled, 429 for a full queue.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Annotated, Any, cast

from fastapi import Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .caches import PlotCache, PolicyCache
from .db import Job, Store
from .errors import HTTPError, QueueFullError
from .jobs import DEFAULT_JOB_DEADLINE, JobRunner, cancelled_reason
from .metrics import ApiMetrics
from .offload import DEFAULT_DEADLINE, Offload, ParseProcess
from .schemas import Accepted


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
    request_deadline
        Seconds a request's own work (validation, parsing, reading the store) may take off the
        event loop before the answer is a 503 (:mod:`overtake.api.offload`).
    job_deadline
        Seconds a job may run; past it its process is stopped and the job fails saying so
        (:class:`overtake.api.jobs.JobRunner`).
    """

    db: str
    token: str | None = None
    workers: int = 1
    max_states: int = 300_000
    max_queued: int = 32
    request_deadline: float = DEFAULT_DEADLINE
    job_deadline: float = DEFAULT_JOB_DEADLINE


def get_settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


def get_store(request: Request) -> Store:
    return cast(Store, request.app.state.store)


def get_metrics(request: Request) -> ApiMetrics:
    return cast(ApiMetrics, request.app.state.metrics)


def get_runner(request: Request) -> JobRunner:
    runner = getattr(request.app.state, "runner", None)
    if runner is None:
        raise HTTPError(503, "server: the job runner is not running (start the app with its lifespan)")
    return cast(JobRunner, runner)


def get_policies(request: Request) -> PolicyCache:
    return cast(PolicyCache, request.app.state.policies)


def get_plots(request: Request) -> PlotCache:
    return cast(PlotCache, request.app.state.plots)


def get_work(request: Request) -> Offload:
    return cast(Offload, request.app.state.work)


def get_reads(request: Request) -> Offload:
    return cast(Offload, request.app.state.reads)


def get_parse(request: Request) -> ParseProcess:
    return cast(ParseProcess, request.app.state.parse)


# module level: FastAPI resolves the annotations of route signatures in their module's globals
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[ApiMetrics, Depends(get_metrics)]
RunnerDep = Annotated[JobRunner, Depends(get_runner)]
PoliciesDep = Annotated[PolicyCache, Depends(get_policies)]
PlotsDep = Annotated[PlotCache, Depends(get_plots)]
#: CPU work of a request (validation, parsing); reads of the store and of policies have their own
#: threads, so work that overruns its deadline cannot hold up polling and decisions
WorkDep = Annotated[Offload, Depends(get_work)]
ReadsDep = Annotated[Offload, Depends(get_reads)]
#: decoding request bodies, in its own process (the interpreter lock stays with the loop)
ParseDep = Annotated[ParseProcess, Depends(get_parse)]

bearer = HTTPBearer(auto_error=False, description="required on POST when the API was started with --token")


#: the 202 answers' header pointing at the job to poll (RFC 9110 §15.3.3)
ACCEPTED_RESPONSES: dict[int | str, dict[str, Any]] = {202: {"headers": {"Location": {
    "description": "the job to poll (the document's url)", "schema": {"type": "string"}}}}}


def accepted(doc: Accepted, response: Response) -> Accepted:
    """``doc``, with its URL in the response's ``Location`` header."""
    response.headers["Location"] = doc.url
    return doc


def authorize(settings: SettingsDep,
              cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    """401 unless the server is open or the request carries its bearer token (constant-time compare)."""
    if settings.token is None:
        return
    if cred is None or not hmac.compare_digest(cred.credentials.encode(), settings.token.encode()):
        raise HTTPError(401, "authorization: a valid bearer token is required (Authorization: Bearer TOKEN)",
                        {"WWW-Authenticate": "Bearer"})


def unique_name(store: Store, kind: str, label: str, digest: str) -> str:
    """``label · <digest prefix>``: two different jobs (digests) never share a name on the page
    (:meth:`overtake.api.db.Store.unique_name`)."""
    return store.unique_name(kind, label, digest)


def submit_job(store: Store, runner: JobRunner, settings: Settings, metrics: ApiMetrics, kind: str, label: str,
               payload: dict[str, Any], digest: str) -> Accepted:
    """Queue a ``kind`` job (429 when the queue is full) and hand it to a worker: the 202 document.

    ``digest`` identifies what is computed (the scenario, the samples and options): it makes the
    job's name unique (:func:`unique_name`) and is stored with the request. The same input
    posted again under the same name while its job is queued, running or done answers that job
    and solves nothing (:meth:`overtake.api.db.Store.admit`).
    """
    try:
        job = store.admit(kind, label, payload, digest, max_queued=settings.max_queued)
    except QueueFullError as exc:
        metrics.rejected.labels(kind, "queue_full").inc()
        raise HTTPError(429, f"queue: {exc.queued} jobs are waiting (limit {settings.max_queued}; overtake api "
                             "--max-queued); retry later", {"Retry-After": "10"}) from None
    if not job.existing:
        runner.submit(job.id)
        metrics.submitted.labels(kind).inc()
    return Accepted(id=job.id, status=job.status, url=f"/v1/{kind}s/{job.id}")  # type: ignore[arg-type]


#: the largest JSON document ``read_body`` takes by default: a scenario. The largest the schema
#: allows (16 stages of 64-phase PH, every number at full precision) is about 1.5 MB; fits have
#: their own cap (MAX_UPLOAD_BYTES)
MAX_JSON_BYTES = 2 << 20
#: values (numbers, strings, booleans, nulls) in such a scenario: 16 x (64 + 64 x 64) and its fields
MAX_SCENARIO_VALUES = 70_000


#: a body past this many bytes is read only while no other such body is (:func:`read_body`)
LARGE_BODY_BYTES = 1 << 20


async def read_body(request: Request, cap: int = MAX_JSON_BYTES) -> bytes:
    """The request body, read as it streams: 413 as soon as it exceeds ``cap`` (a declared
    Content-Length over it is refused before reading; a chunked body is counted).

    Past ``LARGE_BODY_BYTES`` a body goes on only with the app's one large-body permit: the
    others wait unread (their sockets push back on the clients), 503 after ``request_deadline``.
    So N clients streaming 64 MiB uploads hold one upload's memory, not N, and take one
    stream's share of the event loop (bench/sidecar_attack.py, ``api: chunked_fits``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > cap:
        raise HTTPError(413, f"body: {declared} bytes, larger than the limit of {cap}; send less")
    parts, n = [], 0
    permit: asyncio.Semaphore | None = None
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > cap:
                raise HTTPError(413, f"body: larger than the limit of {cap} bytes; send less")
            if permit is None and n > LARGE_BODY_BYTES:
                permit = cast(asyncio.Semaphore, request.app.state.large_body)
                deadline = get_settings(request).request_deadline
                try:
                    await asyncio.wait_for(permit.acquire(), deadline)
                except TimeoutError:
                    permit = None
                    raise HTTPError(503, f"body: other uploads over {LARGE_BODY_BYTES} bytes were being received "
                                         f"for the whole request deadline ({deadline:g} s); retry later",
                                    {"Retry-After": "5"}) from None
            parts.append(chunk)
    finally:
        if permit is not None:
            permit.release()
    return b"".join(parts)


def parse_json(data: bytes) -> Any:
    """JSON of a request body; 422 naming the problem (malformed, or nested too deeply) instead of a 500."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(422, f"body: not valid JSON ({exc})") from None
    except RecursionError:
        raise HTTPError(422, "body: JSON nested too deeply; a scenario is a few levels deep") from None


def count_values(data: Any, limit: int) -> int:
    """The leaves of a parsed JSON document, counted up to ``limit + 1`` (then it stops)."""
    n, todo = 0, [data]
    while todo and n <= limit:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
            n += len(x)  # a key is a value too: a mapping of 10^6 empty keys is no smaller
        elif isinstance(x, list):
            todo.extend(x)
        else:
            n += 1
    return n


def get_job(store: Store, job_id: str, kind: str) -> Job:
    """The job, or 404."""
    job = store.get(job_id, kind)
    if job is None:
        raise HTTPError(404, f"id: no {kind} {job_id!r}")
    return job


def cancel_job(store: Store, runner: JobRunner, job_id: str, kind: str) -> Job:
    """Cancel a queued or running job (its process stopped first): the job, now cancelled; 404 for
    an unknown id, 409 for a job that has ended."""
    job = get_job(store, job_id, kind)
    if job.status in ("queued", "running") and runner.cancel(job_id, cancelled_reason(kind, job_id)):
        return get_job(store, job_id, kind)
    job = get_job(store, job_id, kind)
    raise HTTPError(409, f"id: {kind} {job_id!r} is {job.status}; only a queued or running job can be cancelled")


def done_model(store: Store, job_id: str) -> Job:
    """The model job once done, or 404 / 409 (with the failure reason)."""
    job = get_job(store, job_id, "model")
    if job.status != "done":
        raise HTTPError(409, f"id: model {job_id!r} is {job.status}" + (f" ({job.reason})" if job.reason else "")
                        + "; the policy exists once status is done")
    return job
