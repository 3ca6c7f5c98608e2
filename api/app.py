"""The REST API (FastAPI): solve jobs, policies, decisions, fits, metrics and an HTML page.

``create_app(Settings(db=...))`` builds the app; ``overtake api`` serves it with uvicorn. The routes
live in :mod:`overtake.api.routes` (one router per concern) and reach the store, the settings and
the job runner through :mod:`overtake.api.deps`. They call the same library functions as the CLI
(:func:`overtake.api.scenario.resolve_scenario`, :func:`overtake.mdp.compare`,
:func:`overtake.fitting.fit_observations`); solves and fits run in worker processes
(:mod:`overtake.api.jobs`), results persist in SQLite (:mod:`overtake.api.db`).

Errors: every 4xx body is ``{"detail": "<field>: <what is wrong and the fix>"}``. Invalid input
(ρ ≥ 1, a bad PH, an unknown key) is 422 naming the field; a state space over the cap is 413 with
the estimate and the cap; a full queue is 429; a missing or wrong bearer token is 401.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from overtake.mdp.scenario import validation_message

from .caches import PlotCache, PolicyCache
from .db import Store
from .deps import Settings
from .errors import HTTPError
from .jobs import JobRunner
from .metrics import ApiMetrics, InstrumentMiddleware
from .offload import Offload, ParseProcess
from .routes import fits, load_parsers, models, operations, page, plots
from .schemas import Error, FitRequest

__all__ = ["Settings", "create_app"]

HERE = Path(__file__).parent

API_DESCRIPTION = """\
Solve the optimal thread-spawn policy π* of a multi-stage server (van der Weij, Bhulai and van der
Mei, *Dynamic thread assignment in web server performance optimization*) and compare it with π(1),
π(4), π(∞) and per-stage caps; ask it for decisions; fit phase-type service times.

* `POST /v1/models` takes the scenario of `overtake solve|compare` (as JSON) and answers 202 with
  an id; `GET /v1/models/{id}` shows `queued`, `running` (with `progress`), `done` (metrics and the
  comparison), `failed` or `cancelled` (with the `reason`); `DELETE /v1/models/{id}` cancels it.
* The same input posted again under the same name answers the job it already has (queued,
  running or done) instead of solving it again; a failed or cancelled one is run again.
* A job runs for at most the server's job deadline (`overtake api --job-deadline`); past it, it
  fails with a reason saying so.
* Errors are `{"detail": "<field>: <what is wrong and the fix>"}`: invalid input (ρ ≥ 1, a bad PH,
  an unknown key) 422; an estimated state space over the server's cap 413 (both numbers given);
  a full queue 429; a missing or wrong bearer token on a POST or DELETE 401 (when the server has a
  token); a DELETE of a job that has ended 409.
"""


def create_app(settings: Settings) -> FastAPI:
    """The API over the store at ``settings.db``; the worker pool starts with the app's lifespan."""
    app = FastAPI(
        title="Overtake",
        version="1",
        summary="Optimal thread-spawn policies for multi-stage web servers (van der Weij et al.)",
        lifespan=_lifespan,
        responses={422: {"model": Error, "description": "invalid input; `detail` names the field"}},
        docs_url=None,  # served below from the swagger-ui-bundle package: no CDN, works offline
        redoc_url=None,
    )
    store = Store(settings.db)
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = ApiMetrics(store.counts)
    app.state.policies = PolicyCache(store)
    app.state.plots = PlotCache(deadline=settings.request_deadline)
    app.state.work = Offload(settings.request_deadline, threads=2)
    app.state.reads = Offload(settings.request_deadline, threads=4)
    app.state.parse = ParseProcess(settings.request_deadline, preload=load_parsers)
    app.state.large_body = asyncio.Semaphore(1)  # deps.read_body: one large upload received at a time
    app.state.runner = None  # the lifespan's
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    _mount_docs(app)
    app.add_exception_handler(HTTPError, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _starlette_error)  # type: ignore[arg-type]
    app.add_middleware(InstrumentMiddleware, metrics=app.state.metrics)
    for router in (models.router, fits.router, plots.router, page.router, operations.router):
        app.include_router(router)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the worker pool and the plot thread; re-queue the jobs a previous run left queued."""
    state = app.state
    runner = state.runner = JobRunner(state.store, workers=state.settings.workers,
                                      deadline=state.settings.job_deadline)
    state.plots.start()
    state.work.start()
    state.reads.start()
    state.parse.start()
    failed, queued = state.store.recover()
    for job_id in queued:
        runner.submit(job_id)
    state.recovered = {"failed": failed, "requeued": queued}
    try:
        yield
    finally:
        if state.runner is not None:  # the runner in use (a test may have replaced the first)
            state.runner.shutdown()
        state.runner = None
        state.plots.close()
        state.work.close()
        state.reads.close()
        state.parse.close()


async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": validation_message(list(exc.errors()), root="body")}, status_code=422)


async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def _mount_docs(app: FastAPI) -> None:
    """Swagger UI at ``/docs`` from the ``swagger-ui-bundle-v2`` wheel (FastAPI's default loads a CDN)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from swagger_ui_bundle import swagger_ui_path

    app.mount("/docs-static", StaticFiles(directory=str(swagger_ui_path)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Overtake API",
                                   swagger_js_url="/docs-static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-static/swagger-ui.css",
                                   swagger_favicon_url="/docs-static/favicon-32x32.png")


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with the scenario schema (shared with the CLI) and FitRequest in its components."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes,
                         description=API_DESCRIPTION)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.update(models.SCENARIO_DEFS)
    fit_schema = FitRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.update(fit_schema.pop("$defs", {}))
    comps["FitRequest"] = fit_schema
    app.openapi_schema = schema
    return schema
