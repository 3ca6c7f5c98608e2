"""The HTML page at ``/``: recent models and fits with their figures (Jinja2, no JavaScript framework)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from ..deps import ReadsDep, StoreDep
from ..documents import fit_doc, model_doc

router = APIRouter()
templates = Jinja2Templates(directory=str(Path(__file__).parents[1] / "templates"))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index(request: Request, store: StoreDep, reads: ReadsDep) -> HTMLResponse:
    models, fits = await reads.run("page", lambda: (store.list("model", limit=50), store.list("fit", limit=50)))
    busy = any(j.status in ("queued", "running") for j in [*models, *fits])
    return templates.TemplateResponse(request, "index.html", {
        "models": [model_doc(j) for j in models], "fits": [fit_doc(j) for j in fits], "busy": busy})
