"""Request bodies are decoded in the parse process, not in a thread of the server.

A thread shares the interpreter lock with the event loop: ``json.loads`` of a 16 MB body is one C
call that held it for about a second, and ``/healthz`` waited that long (bench/sidecar_attack.py,
``api: json_bodies``). So the scenario and the fits' samples are decoded by
:class:`overtake.api.offload.ParseProcess`, which sends back only what passed its checks. Checked
here without timing: the work runs in another process; errors and a dying process come back as
answers; the routes hand their bodies to it; what may cross back is bounded (the caps against the
largest scenario the schema allows).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from overtake.api.app import create_app
from overtake.api.deps import MAX_JSON_BYTES, MAX_SCENARIO_VALUES, Settings, count_values
from overtake.api.errors import HTTPError
from overtake.api.offload import ParseProcess
from overtake.api.routes import fits, load_parsers, models


def _refuse() -> None:
    raise HTTPError(422, "field: refused in the child", {"X-Why": "test"})


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    async def main() -> Any:
        p = ParseProcess(deadline=60, preload=load_parsers)
        p.start()
        try:
            return await p.run("test", fn, *args)
        finally:
            p.close()
    return asyncio.run(main())


def test_the_work_runs_in_another_process() -> None:
    assert _run(os.getpid) != os.getpid()


def test_an_error_in_the_child_is_the_same_answer() -> None:
    with pytest.raises(HTTPError) as exc:
        _run(_refuse)
    assert (exc.value.status, exc.value.detail, exc.value.headers) == (422, "field: refused in the child",
                                                                       {"X-Why": "test"})


def test_a_dead_parse_process_is_a_503_and_is_replaced() -> None:
    async def main() -> tuple[int, int]:
        p = ParseProcess(deadline=60, preload=load_parsers)
        p.start()
        try:
            with pytest.raises(HTTPError) as exc:
                await p.run("body", os._exit, 1)
            return exc.value.status, await p.run("body", os.getpid)
        finally:
            p.close()

    status, pid = asyncio.run(main())
    assert status == 503 and pid != os.getpid()


def _say_pid_then_sleep(path: str) -> None:
    """A step that never ends (the fault injected): it writes its process id first."""
    import time

    Path(path).write_text(str(os.getpid()))
    time.sleep(600)


def test_a_step_past_the_deadline_is_stopped_and_the_others_are_served(tmp_path: Path) -> None:
    """A step still running at the deadline is a 503 and its process is terminated; another
    request is answered while it runs, and the next after it too."""
    marker = tmp_path / "pid"

    async def main() -> tuple[int, HTTPError, int]:
        p = ParseProcess(deadline=3, preload=load_parsers)
        p.start()
        try:
            await asyncio.to_thread(p.wait_ready, 120)
            stuck = asyncio.ensure_future(p.run("file", _say_pid_then_sleep, str(marker)))
            for _ in range(2400):  # until the step runs (at most 120 s)
                if marker.exists() and marker.read_text():
                    break
                await asyncio.sleep(0.05)
            other = await p.run("body", os.getpid)  # while the step sleeps
            with pytest.raises(HTTPError) as exc:
                await stuck
            return other, exc.value, await p.run("body", os.getpid)
        finally:
            p.close()

    other, err, after = asyncio.run(main())
    stuck_pid = int(marker.read_text())
    assert err.status == 503 and err.detail.startswith("file: not done within the request deadline of 3 s"), err.detail
    assert other not in (stuck_pid, os.getpid()) and after not in (stuck_pid, os.getpid())
    assert not Path(f"/proc/{stuck_pid}").exists()  # terminated and reaped, not left running


class Recording(ParseProcess):
    def __init__(self) -> None:
        super().__init__(deadline=60, preload=load_parsers)
        self.calls: list[str] = []

    async def run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls.append(fn.__name__)
        return await super().run(what, fn, *args, **kwargs)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Recording]]:
    app = create_app(Settings(db=str(tmp_path_factory.mktemp("parse") / "api.db")))
    app.state.parse = rec = Recording()
    with TestClient(app) as c:
        yield c, rec


LOG = "\n".join(f'1.2.3.4 - - [21/Nov/2026:08:00:00 +0000] "GET /a HTTP/1.1" 200 1 {d}' for d in (1500, 2500, 3500))


@pytest.mark.parametrize(("url", "kwargs", "step", "status"), [
    ("/v1/models", {"json": {"load": 0.5, "stages": [{"name": "a", "service": {"exponential": {"mean": 1.0}}}],
                             "truncation": {"max_requests": 6}}}, "decode_scenario", 202),
    ("/v1/models", {"content": b"[" * 100_000, "headers": {"content-type": "application/json"}},
     "decode_scenario", 422),
    ("/v1/fits", {"json": {"samples": [1.0, 2.0, 3.0], "order": 1}}, "fit_from_json", 202),
    ("/v1/fits", {"json": {"samples": [1.0, -2.0]}}, "fit_from_json", 422),
    ("/v1/fits", {"data": {"kind": "apache-log", "log_format": '%h %l %u %t "%r" %>s %b %D', "stage": ["a=^/a"],
                           "order": "1"}, "files": {"file": ("a.log", io.BytesIO(LOG.encode()), "text/plain")}},
     "fit_from_fields", 202),
])
def test_routes_decode_their_bodies_in_the_parse_process(client: tuple[TestClient, Recording], url: str,
                                                         kwargs: dict[str, Any], step: str, status: int) -> None:
    c, rec = client
    rec.calls.clear()
    r = c.post(url, **kwargs)
    assert r.status_code == status, r.text
    assert rec.calls == [step]


def _largest_scenario() -> dict[str, Any]:
    """16 stages of 64-phase PH, every number a 17-digit float: the most the schema allows."""
    x = 0.12345678901234567
    ph = {"alpha": [x] * 64, "T": [[-x] * 64 for _ in range(64)]}
    return {"load": 0.5, "stages": [{"name": f"stage{i:02d}", "service": {"ph": ph}} for i in range(16)],
            "truncation": {"max_requests": 2000, "max_threads": 2000}, "tolerance": 0.001, "cores": 64,
            "overhead": 0.0, "phase_info": "full"}


def test_the_largest_scenario_fits_both_caps() -> None:
    sc = _largest_scenario()
    body = json.dumps(sc).encode()
    # by construction: per stage 64 + 64 x 64 numbers, its name and 5 keys (name, service, ph,
    # alpha, T); 7 top-level keys and 5 values; truncation's 2 keys and 2 values
    expected = 16 * (64 + 64 * 64 + 1 + 5) + 7 + 5 + 2 + 2
    assert count_values(sc, 10**6) == expected <= MAX_SCENARIO_VALUES
    assert len(body) <= MAX_JSON_BYTES
    assert models.decode_scenario(body) == sc


def test_a_body_of_a_million_numbers_never_crosses_back() -> None:
    body = b"[" + b"0," * (MAX_JSON_BYTES // 2 - 2) + b"0]"
    assert len(body) <= MAX_JSON_BYTES
    with pytest.raises(HTTPError) as exc:
        models.decode_scenario(body)
    assert exc.value.status == 413 and exc.value.detail.startswith("body: more than")


def test_fit_samples_cross_back_as_arrays(tmp_path: Path) -> None:
    source, data, _, _ = fits.fit_from_json(b'{"samples": {"s1": [1.0, 2.0], "s2": [0.5, 4.0, 8.0]}}')
    assert source == "json" and {k: v.tolist() for k, v in data.items()} == {"s1": [1.0, 2.0], "s2": [0.5, 4.0, 8.0]}
    assert all(v.dtype.kind == "f" for v in data.values())


CHILD = """
import asyncio, os, sys
from overtake.api.offload import ParseProcess
from overtake.api.routes import load_parsers

async def main():
    p = ParseProcess(deadline=60, preload=load_parsers)
    p.start()
    print(await p.run("pid", os.getpid), flush=True)

asyncio.run(main())
os._exit(0)  # as a killed server: no shutdown of the pool
"""


def test_the_parse_process_ends_with_a_killed_server() -> None:
    import subprocess
    import sys
    import time

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"parse process {pid} outlived its server"
        time.sleep(0.2)
