"""Jobs end, and each input is solved once: a deadline stops a runaway job, DELETE cancels a
queued or running one, shutdown leaves no writer behind; the same input posted twice under one
name is one job, and concurrent posts never pass the queue limit.

A runaway job is a fault injected as the runner's ``entry`` (``job_faults``); every process
and store involved is real. No wall-clock bound is asserted: waits poll with a generous limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import job_faults
from support.api_helpers import exp2, wait

from overtake.api.app import create_app
from overtake.api.db import INTERRUPTED, Store
from overtake.api.deps import Settings
from overtake.api.errors import QueueFullError
from overtake.api.jobs import JobRunner

#: a solve of a few seconds: two H2 stages, 48,915 states
H2 = {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}
SLOW = {"load": 0.6, "truncation": {"max_requests": 12, "max_threads": 4},
        "stages": [{"name": "a", "service": H2}, {"name": "b", "service": H2}]}


def _until(check: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not {what} after {timeout} s"
        time.sleep(0.05)


def _status(store: Store, job_id: str) -> str:
    job = store.get(job_id)
    assert job is not None
    return job.status


@contextmanager
def _runner(store: Store, **kwargs: Any) -> Iterator[JobRunner]:
    runner = JobRunner(store, **kwargs)
    try:
        yield runner
    finally:
        runner.shutdown()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_job_past_its_deadline_is_stopped_and_the_next_runs(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    with _runner(store, workers=1, deadline=3, entry=job_faults.runaway_if_named) as runner:
        a, b = store.create("fit", "runaway", {}), store.create("fit", "quick", {})
        runner.submit(a)
        runner.submit(b)
        _until(lambda: _status(store, a) == "running", "running")
        [pid] = runner.pids()
        _until(lambda: _status(store, a) == "failed", "stopped at its deadline")
        reason = store.get(a).reason  # type: ignore[union-attr]
        assert reason is not None and reason.startswith("deadline: still running after the job deadline of 3 s")
        assert "overtake api --job-deadline SECONDS" in reason
        assert not _alive(pid)  # terminated, not left running
        _until(lambda: _status(store, b) == "done", "done")  # in a fresh process
        assert pid not in runner.pids()


def test_a_runaway_job_holds_one_worker_only_and_cancel_stops_it(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    with _runner(store, workers=2, entry=job_faults.runaway_if_named) as runner:
        a = store.create("fit", "runaway", {})
        runner.submit(a)
        _until(lambda: _status(store, a) == "running", "running")
        others = [store.create("fit", f"quick{i}", {}) for i in range(3)]
        for j in others:
            runner.submit(j)
        _until(lambda: all(_status(store, j) == "done" for j in others), "done beside the runaway job")
        assert _status(store, a) == "running"
        _until(lambda: len(runner.pids()) == 2, "two processes")
        before = set(runner.pids())
        assert runner.cancel(a, "cancelled: by the test") is True
        job = store.get(a)
        assert job is not None and (job.status, job.reason) == ("cancelled", "cancelled: by the test")
        assert len([p for p in before if _alive(p)]) == 1  # its process was terminated before the answer
        assert runner.cancel(a, "again") is False  # ended: nothing to cancel
        last = store.create("fit", "quick-last", {})
        runner.submit(last)
        _until(lambda: _status(store, last) == "done", "done after the cancel")


class Watched(Store):
    """A store that records the calls made from other threads once :meth:`watch` was called."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.owner: threading.Thread | None = None
        self.late: list[str] = []

    def watch(self) -> None:
        self.owner = threading.current_thread()

    def _seen(self, what: str) -> None:
        if self.owner is not None and threading.current_thread() is not self.owner:
            self.late.append(f"{what} from thread {threading.current_thread().name}")

    def fail(self, *args: Any, **kwargs: Any) -> None:
        self._seen("fail")
        super().fail(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self._seen("get")
        return super().get(*args, **kwargs)

    def cancel(self, *args: Any, **kwargs: Any) -> bool:
        self._seen("cancel")
        return super().cancel(*args, **kwargs)

    def fail_running(self, *args: Any, **kwargs: Any) -> list[str]:
        self._seen("fail_running")
        return super().fail_running(*args, **kwargs)


def test_shutdown_fails_running_jobs_itself_and_nothing_writes_after_it(tmp_path: Path) -> None:
    """Shutdown marks the running job interrupted before it returns, and no other thread of the
    runner touches the store from then on (one did, from the pool's thread, sometimes after the
    store's directory was gone: 'no such table: jobs')."""
    store = Watched(str(tmp_path / "jobs.db"))
    threads = set(threading.enumerate())
    runner = JobRunner(store, workers=1)
    sid = store.create("model", "slow", {"scenario": SLOW, "estimated_states": 48915})
    runner.submit(sid)
    _until(lambda: _status(store, sid) == "running", "running")
    store.watch()
    runner.shutdown()
    job = store.get(sid)
    assert job is not None and (job.status, job.reason) == ("failed", INTERRUPTED)
    for t in set(threading.enumerate()) - threads:  # the runner's threads, let them finish
        t.join(60)
    assert store.late == []


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(db=str(tmp_path / "api.db"), token="t"))
    with TestClient(app, headers={"Authorization": "Bearer t"}) as c:
        yield c


def _inject(c: TestClient, **kwargs: Any) -> JobRunner:
    """The app's runner replaced by one with a faulty entry (the lifespan stops it at the end)."""
    state = c.app.state  # type: ignore[attr-defined]
    state.runner.shutdown()
    state.runner = JobRunner(state.store, **kwargs)
    return state.runner  # type: ignore[no-any-return]


def test_delete_cancels_queued_and_running_jobs(client: TestClient) -> None:
    c = client
    _inject(c, workers=1, entry=job_faults.runaway_if_named)
    run = c.post("/v1/fits", json={"samples": {"runaway": [1.0, 2.0]}}).json()
    _until(lambda: c.get(run["url"]).json()["status"] == "running", "running")
    queued = c.post("/v1/fits", json={"samples": {"quick": [1.0, 2.0]}}).json()
    assert c.get(queued["url"]).json()["status"] == "queued"
    r = c.delete(queued["url"], headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    for job in (queued, run):
        r = c.delete(job["url"])
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["id"] == job["id"] and doc["status"] == "cancelled"
        assert doc["reason"] == f"cancelled: DELETE /v1/fits/{job['id']} stopped it; post it again to run it"
    after = c.post("/v1/fits", json={"samples": {"after": [1.0, 2.0]}}).json()  # the runner goes on
    _until(lambda: c.get(after["url"]).json()["status"] == "done", "done")
    r = c.delete(after["url"])
    assert r.status_code == 409 and r.json()["detail"] == f"id: fit {after['id']!r} is done; only a queued or " \
                                                          "running job can be cancelled"
    assert c.delete("/v1/fits/nope").status_code == 404
    model = c.post("/v1/models", json=exp2(0.3), params={"name": "runaway"}).json()
    _until(lambda: c.get(model["url"]).json()["status"] == "running", "running")
    r = c.delete(model["url"])
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert c.delete(model["url"]).status_code == 409


def test_the_same_input_under_one_name_is_one_job(client: TestClient) -> None:
    c = client
    body = {"samples": {"db": [0.5, 1.5, 2.5]}, "order": 1}
    first = c.post("/v1/fits", json=body).json()
    second = c.post("/v1/fits", json=body).json()  # while queued or running: the same job
    assert (second["id"], second["url"]) == (first["id"], first["url"])
    done = wait(c, first["url"])
    assert done["status"] == "done"
    again = c.post("/v1/fits", json=body)
    assert again.status_code == 202 and again.headers["location"] == first["url"]
    assert again.json() == {**first, "status": "done"}
    assert [f["id"] for f in c.get("/v1/fits").json()] == [first["id"]]
    assert c.post("/v1/fits", json={**body, "order": 2}).json()["id"] != first["id"]  # other options
    m = c.post("/v1/models", json=exp2(0.3)).json()
    assert c.post("/v1/models", json=exp2(0.3)).json()["id"] == m["id"]
    assert c.post("/v1/models", json=exp2(0.3), params={"name": "mine"}).json()["id"] != m["id"]  # other name


def test_a_failed_or_cancelled_job_is_solved_again(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    digest = "ab" * 32
    a = store.admit("fit", "x", {}, digest, max_queued=8)
    same = store.admit("fit", "x", {}, digest, max_queued=8)
    assert not a.existing and same.existing and same.id == a.id
    assert store.cancel(a.id, "cancelled: test")
    b = store.admit("fit", "x", {}, digest, max_queued=8)
    assert not b.existing and b.id != a.id
    store.fail(b.id, "broken")
    c = store.admit("fit", "x", {}, digest, max_queued=8)
    assert not c.existing and c.id not in (a.id, b.id)
    assert store.admit("fit", "y", {}, digest, max_queued=8).id != c.id  # another name: another job


def test_concurrent_admissions_never_pass_the_limit(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    start = threading.Barrier(45)

    def admit(i: int) -> bool:
        start.wait()
        try:
            store.admit("fit", f"f{i}", {}, f"{i:064x}", max_queued=32)
            return True
        except QueueFullError:
            return False

    with ThreadPoolExecutor(45) as pool:
        admitted = list(pool.map(admit, range(45)))
    assert sum(admitted) == 32 and store.counts() == {("fit", "queued"): 32}


def test_concurrent_posts_never_pass_max_queued(tmp_path: Path) -> None:
    app = create_app(Settings(db=str(tmp_path / "api.db"), max_queued=32))
    with TestClient(app) as c:
        _inject(c, workers=1, entry=job_faults.stall)  # no job leaves the queue
        with ThreadPoolExecutor(45) as pool:
            codes = list(pool.map(lambda i: c.post("/v1/fits", json={"samples": [1.0, 2.0 + i]}).status_code,
                                  range(45)))
        counts = app.state.store.counts()
    assert (codes.count(202), codes.count(429)) == (32, 13)
    assert counts == {("fit", "queued"): 32}


def test_openapi_documents_cancel_and_the_cancelled_status(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    for path, answer in (("/v1/models/{model_id}", "ModelDoc"), ("/v1/fits/{fit_id}", "FitDoc")):
        responses = doc["paths"][path]["delete"]["responses"]
        assert {"200", "401", "404", "409"} <= set(responses)
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(answer)
    status = doc["components"]["schemas"]["ModelDoc"]["properties"]["status"]
    assert "cancelled" in status["enum"]
    assert "--job-deadline" in doc["info"]["description"]
