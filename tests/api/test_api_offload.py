"""Long work of a request runs off the event loop, under a deadline.

Each heavy step a route takes (validating a scenario and estimating its state space, checking
inline samples, parsing an access log, reading a stored job, loading a policy, rendering a
figure) is replaced by a version that blocks until the test releases it. While it blocks:

* ``GET /healthz`` answers. Had the step run on the event loop, the loop would wait for the
  release, which comes only after /healthz answers: the /healthz client would time out (30 s),
  so no wall-clock bound is asserted;
* with a short ``request_deadline`` the blocked request is answered 503 naming the limit.

The server is uvicorn on a loopback port, in a thread of the test process (so the steps can be
patched).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn
from support.api_helpers import exp2, free_port

from overtake.api import plots
from overtake.api.app import create_app
from overtake.api.db import Store
from overtake.api.deps import Settings
from overtake.api.routes import models
from overtake.mdp.policy import Policy


class Gate:
    """Wraps a function: each call says it entered, then waits for :meth:`open` (at most 120 s)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def blocked(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            self.released.wait(120)
            return fn(*args, **kwargs)
        return blocked

    def open(self) -> None:
        self.released.set()


def _serve(settings: Settings) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        if not t.is_alive():
            raise AssertionError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(30)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(Settings(db=str(tmp_path_factory.mktemp("offload") / "api.db")))


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(Settings(db=str(tmp_path_factory.mktemp("deadline") / "api.db"), request_deadline=0.5))


def _done_model(base: str) -> str:
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/models", json=exp2(0.3, max_requests=6))
        assert r.status_code == 202, r.text
        t0 = time.monotonic()
        while (doc := c.get(r.json()["url"]).json())["status"] not in ("done", "failed"):
            assert time.monotonic() - t0 < 120, doc
            time.sleep(0.1)
        assert doc["status"] == "done", doc
        return str(doc["id"])


# (name, patch target (object, attribute), request: (method, url template, httpx kwargs)); the
# fits' samples (inline, CSV, access log) are decoded in the parse process: test_api_parse_process
HEAVY: list[tuple[str, tuple[Any, str], tuple[str, str, Callable[[], dict[str, Any]]]]] = [
    ("model validation", (models, "resolve_scenario"), ("POST", "/v1/models", lambda: {"json": exp2(0.3)})),
    ("job read", (Store, "get"), ("GET", "/v1/models/{id}", dict)),
    ("job list", (Store, "list"), ("GET", "/v1/fits", dict)),
    ("page", (Store, "list"), ("GET", "/", dict)),
    ("policy load", (Policy, "load"), ("GET", "/v1/models/{id}/decision?state=0,0,0,0", dict)),
    ("figure", (plots, "png"), ("GET", "/v1/models/{id}/plots/gains.png", dict)),
]


def _in_flight(base: str, monkeypatch: pytest.MonkeyPatch, target: tuple[Any, str],
               request: tuple[str, str, Callable[[], dict[str, Any]]], model_id: str,
               check: Callable[[Future[httpx.Response], Gate], None]) -> httpx.Response:
    """Send ``request`` with ``target`` gated; run ``check`` once the gate is entered; then open it."""
    gate = Gate()
    monkeypatch.setattr(target[0], target[1], gate.wrap(getattr(target[0], target[1])))
    method, url, kwargs = request
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=base, timeout=120) as c:
        heavy = pool.submit(c.request, method, url.format(id=model_id), **kwargs())
        try:
            assert gate.entered.wait(60), "the gated step was never reached"
            check(heavy, gate)
        finally:
            gate.open()
        return heavy.result(120)


@pytest.mark.parametrize(("name", "target", "request_"), HEAVY, ids=[h[0] for h in HEAVY])
def test_healthz_answers_while_heavy_work_is_in_flight(base: str, monkeypatch: pytest.MonkeyPatch, name: str,
                                                       target: tuple[Any, str], request_: Any) -> None:
    model_id = _done_model(base)  # a fresh model each time: its policy and figures are not cached

    def healthz(heavy: Future[httpx.Response], gate: Gate) -> None:
        try:
            r = httpx.get(base + "/healthz", timeout=30)
        except httpx.TimeoutException:
            pytest.fail(f"{name}: /healthz got no answer while the request was in flight: the event loop is blocked")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert not heavy.done()  # still gated: /healthz answered before it

    r = _in_flight(base, monkeypatch, target, request_, model_id, healthz)
    assert r.status_code in (200, 202), r.text


@pytest.mark.parametrize(("name", "target", "request_"), HEAVY, ids=[h[0] for h in HEAVY])
def test_work_over_the_deadline_is_a_503_naming_the_limit(strict: str, monkeypatch: pytest.MonkeyPatch, name: str,
                                                          target: tuple[Any, str], request_: Any) -> None:
    model_id = _done_model(strict)
    answers: list[httpx.Response] = []

    def over_deadline(heavy: Future[httpx.Response], gate: Gate) -> None:
        # the step stays blocked until the answer arrives: the answer can only be the deadline's
        answers.append(heavy.result(60))

    _in_flight(strict, monkeypatch, target, request_, model_id, over_deadline)
    r = answers[0]
    assert r.status_code == 503, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert "request deadline of 0.5 s" in detail and "--request-deadline" in detail, detail
    assert r.headers.get("retry-after")
