"""``/v1/fits``: phase-type fits of service times by EM, as ``overtake fit`` (from JSON, a CSV, a log).

A done fit's stages can serve a scenario: ``{"fit": {"id": FIT_ID, "stage": NAME}}``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from overtake.mdp.scenario import validation_message
from overtake.regex import check_pattern

from ..deps import (
    ACCEPTED_RESPONSES,
    MetricsDep,
    ParseDep,
    ReadsDep,
    RunnerDep,
    SettingsDep,
    StoreDep,
    WorkDep,
    accepted,
    authorize,
    cancel_job,
    get_job,
    parse_json,
    read_body,
    submit_job,
)
from ..documents import fit_doc
from ..errors import HTTPError
from ..schemas import Accepted, Error, FitDoc, FitOptions, FitRequest

router = APIRouter(tags=["fits"])

_STAGE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_UPLOAD_BYTES = 64 * 1024 * 1024

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

Samples = dict[str, list[float]]
Arrays = dict[str, "np.ndarray[Any, np.dtype[np.float64]]"]


@router.post("/v1/fits", status_code=202, response_model=Accepted, dependencies=[Depends(authorize)],
             responses={**ACCEPTED_RESPONSES, 401: {"model": Error}, 413: {"model": Error}, 429: {"model": Error}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {"$ref": "#/components/schemas/FitRequest"}},
                 "multipart/form-data": {"schema": FIT_FORM_SCHEMA}}}})
async def create_fit(request: Request, response: Response, store: StoreDep, settings: SettingsDep,
                     metrics: MetricsDep, runner: RunnerDep, work: WorkDep, parse: ParseDep) -> Accepted:
    """Fit a phase-type distribution per stage by EM (as ``overtake fit``).

    Three inputs: JSON ``{"samples": [...]}`` or ``{"samples": {stage: [...]}}`` (seconds); a
    multipart CSV upload (``file``, ``kind=csv``, optional ``column``, ``scale``); or an access
    log (``file``, ``kind=apache-log``, ``log_format``, one ``stage=NAME=REGEX`` per stage).
    The fit's name is its stages and a short hash of the samples and options; ``Location``
    points at the job.
    """
    if int(request.headers.get("content-length") or 0) > MAX_UPLOAD_BYTES:
        raise HTTPError(413, f"body: larger than {MAX_UPLOAD_BYTES} bytes")
    # parsing a large log, CSV or JSON and checking its samples is CPU work that would hold the
    # interpreter lock: in the parse process, which sends the samples back as arrays
    try:
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            # counted as it streams (a chunked upload declares no length), then parsed from memory
            request._body = await read_body(request, MAX_UPLOAD_BYTES)
            raw, fields, stage_specs = await _read_form(request)
            source, data, opts, report = await parse.run("file", fit_from_fields, raw, fields, stage_specs)
        else:
            source, data, opts, report = await parse.run("body", fit_from_json,
                                                         await read_body(request, MAX_UPLOAD_BYTES))
    except HTTPError as exc:
        if exc.status == 422:
            metrics.rejected.labels("fit", "invalid").inc()
        raise
    # stored off the loop (a large sample list is seconds of JSON), and without a deadline: a
    # 503 after the job is stored would have the client post it twice
    options = opts.model_dump()
    doc = await work.commit(lambda: submit_job(
        store, runner, settings, metrics, "fit", ", ".join(data),
        {"source": source, "samples": {k: v.tolist() for k, v in data.items()}, "options": options,
         "report": report}, _digest(data, options)))
    return accepted(doc, response)


def _digest(data: Arrays, options: dict[str, Any]) -> str:
    """What a fit computes: its options and each stage's samples, in stage-name order."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for name in sorted(data):
        h.update(name.encode() + b"\0")
        h.update(np.asarray(data[name], dtype=np.float64).tobytes())
    return h.hexdigest()


def _arrays(data: Samples) -> Arrays:
    return {k: np.asarray(v, dtype=np.float64) for k, v in data.items()}


def fit_from_json(body: bytes) -> tuple[str, Arrays, FitOptions, list[str]]:
    """A JSON fit request's samples and options (in the parse process)."""
    try:
        req = FitRequest.model_validate(parse_json(body))
    except ValidationError as exc:
        raise HTTPError(422, validation_message(exc.errors(), root="body")) from None
    data = req.samples if isinstance(req.samples, dict) else {req.name: req.samples}
    _check_samples(data)
    return "json", _arrays(data), FitOptions(**req.model_dump(exclude={"samples", "name"})), []


@router.get("/v1/fits", response_model=list[FitDoc])
async def list_fits(store: StoreDep, reads: ReadsDep) -> list[FitDoc]:
    """All fit jobs, newest first."""
    return await reads.run("fits", lambda: [fit_doc(j) for j in store.list("fit")])


@router.get("/v1/fits/{fit_id}", response_model=FitDoc, responses={404: {"model": Error}})
async def get_fit(fit_id: str, store: StoreDep, reads: ReadsDep) -> FitDoc:
    """Status, then the fitted PH per stage (alpha, T, loglik, mean, SCV, ...)."""
    return await reads.run("id", lambda: fit_doc(get_job(store, fit_id, "fit")))


@router.delete("/v1/fits/{fit_id}", response_model=FitDoc, dependencies=[Depends(authorize)],
               responses={401: {"model": Error}, 404: {"model": Error}, 409: {"model": Error}})
async def cancel_fit(fit_id: str, store: StoreDep, runner: RunnerDep, work: WorkDep) -> FitDoc:
    """Cancel a queued or running fit: a running one has its process stopped. The answer is the
    job, status ``cancelled``; 409 for a job that has already ended (done, failed, cancelled)."""
    return await work.commit(lambda: fit_doc(cancel_job(store, runner, fit_id, "fit")))


def _check_samples(data: Samples) -> None:
    if not data:
        raise HTTPError(422, "samples: no stage has samples")
    for name, xs in data.items():
        if not _STAGE_NAME.fullmatch(name):
            raise HTTPError(422, f"samples: stage name {name[:70]!r} must be 1-64 letters, digits, '_', '.', '-'")
        if len(xs) < 2:
            raise HTTPError(422, f"samples.{name}: needs at least 2 durations, got {len(xs)}")
        bad = next((i for i, v in enumerate(xs) if not (math.isfinite(v) and v > 0)), None)
        if bad is not None:
            raise HTTPError(422, f"samples.{name}[{bad}]: durations must be finite and > 0 seconds, got {xs[bad]!r}")


async def _read_form(request: Request) -> tuple[bytes, dict[str, Any], list[str]]:
    """The multipart form of ``POST /v1/fits``: the upload's bytes, the fields, the stage specs."""
    from starlette.datastructures import UploadFile

    async with request.form() as form:  # closes the spooled upload files
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise HTTPError(422, "file: upload the CSV or access log as the multipart field 'file'")
        raw = await upload.read()
        fields = {k: form.get(k) for k in ("kind", "order", "structure", "preserve_mean", "seed", "log_format",
                                            "scale", "name", "column")}
        stage_specs = [str(v) for v in form.getlist("stage")]
    return raw, fields, stage_specs


def fit_from_fields(raw: bytes, form: dict[str, Any],
                    stage_specs: list[str]) -> tuple[str, Arrays, FitOptions, list[str]]:
    """An uploaded CSV's or access log's samples and the form's options (in the parse process)."""
    opts = _form_options(form)
    text = raw.decode("utf-8", errors="replace")
    kind = str(form.get("kind") or "csv")
    if kind == "apache-log":
        data, report = _samples_from_log(text, form.get("log_format"), stage_specs)
        _check_samples(data)
        return "apache-log", _arrays(data), opts, report
    if kind != "csv":
        raise HTTPError(422, f"kind: must be csv or apache-log, got {kind!r}")
    data = _samples_from_csv(text, form)
    _check_samples(data)
    return "csv", _arrays(data), opts, []


def _form_options(form: dict[str, Any]) -> FitOptions:
    order_s = str(form.get("order") or "4")
    try:
        order: int | Literal["auto"] = "auto" if order_s == "auto" else int(order_s)
        return FitOptions(structure=str(form.get("structure") or "cf1"), order=order,
                          preserve_mean=str(form.get("preserve_mean") or "false").lower() in ("1", "true", "yes", "on"),
                          seed=int(str(form.get("seed") or 0)))
    except ValidationError as exc:
        raise HTTPError(422, validation_message(exc.errors(), root="body")) from None
    except ValueError as exc:
        raise HTTPError(422, f"form: {exc}") from None


def _samples_from_log(text: str, fmt: Any, stage_specs: list[str]) -> tuple[Samples, list[str]]:
    from overtake.fitting import io as fio

    if not isinstance(fmt, str) or not fmt:
        raise HTTPError(422, "log_format: required with kind=apache-log (the server's LogFormat string)")
    stages: dict[str, str] = {}
    for spec in stage_specs:
        name, sep, rx = spec.partition("=")
        if not sep or not name or not rx:
            raise HTTPError(422, f"stage: must be NAME=REGEX, got {spec!r}")
        if name in stages:
            raise HTTPError(422, f"stage: {name!r} given twice")
        try:
            stages[name] = check_pattern(rx)
        except ValueError as exc:
            raise HTTPError(422, f"stage: {name}={rx[:70]}: {exc}") from None
    if not stages:
        raise HTTPError(422, "stage: give at least one NAME=REGEX with kind=apache-log")
    try:
        res = fio.parse_apache_log(text.splitlines(), fmt, stages)
    except ValueError as exc:
        raise HTTPError(422, f"log_format: {exc}") from None
    return {k: [float(v) for v in x] for k, x in res.stages.items()}, res.report()


def _samples_from_csv(text: str, form: dict[str, Any]) -> Samples:
    from overtake.fitting import io as fio

    try:
        scale = float(str(form.get("scale") or 1.0))
    except ValueError:
        raise HTTPError(422, f"scale: must be a number, got {form.get('scale')!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise HTTPError(422, f"scale: must be > 0, got {scale}")
    name = str(form.get("name") or "stage1")
    column = form.get("column")
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=True) as fh:
        fh.write(text)
        fh.flush()
        try:
            x = fio.read_durations(fh.name, column=str(column) if column else None, scale=scale)
        except ValueError as exc:
            raise HTTPError(422, f"file: {str(exc).replace(fh.name, 'upload')}") from None
    return {name: [float(v) for v in x]}
