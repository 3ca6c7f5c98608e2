"""Module mode when the client of a held request goes away before its turn, under mpm_event and
mpm_prefork, with a table that caps stage ``capped`` at one running request.

A client that gives up (a browser's stop, a front end's timeout) leaves its request held; at its
turn it would run for nobody while the stage's next request waits behind it. The module looks at
the client of each held request every 100 ms:

- The client reset the connection (no answer can reach it): the request is dropped, not run
  (logged with status 499, ``overtake_stage_dropped_total``), and the stage's next request starts
  right after the running one. Before, its handler ran in full and the next one waited for it.
- The client half-closed (sent its FIN, as a client that closes its socket does): dropped too,
  unless ``OvertakeStageAbortOnClose Off``, which serves clients that half-close and still read
  (their answer arrives).

HTTP/2 streams are covered in ``test_module_tls.py``.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.control_apache import control_apache
from support.module_stages import prio_status, settled, until, write_policy

from overtake.controller.harness import apache

HOLD = 10.0
NAMES = ("capped", "free")
CAPPED = 'stage="capped"'
RUNNER_S, DEAD_S, NEXT_S = 1.0, 1.0, 0.1  # CPU seconds of each request's handler


@contextmanager
def _capped(mpm: str, abort_on_close: bool = True) -> Iterator[apache.ApacheInstance]:
    with control_apache("module-gone", levels=(0.5,), nice=("idle",), stage_hold=HOLD, mpm=mpm,
                        stage_abort_on_close=abort_on_close,
                        stages=(("capped", "^/stage1$"), ("free", "^/stage2$"))) as (inst, path):
        write_policy(path, "pi(1,8)", NAMES)
        until(lambda: prio_status(inst).get(f"overtake_stage_table_in_force{{{CAPPED}}}") == 1, "the table")
        yield inst


def _timed_get(inst: apache.ApacheInstance, path: str, out: dict[str, tuple[int, float]], who: str) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        with urllib.request.urlopen(inst.base_url + path, timeout=60) as r:
            r.read()
            out[who] = (r.status, time.monotonic() - t0)
    t = threading.Thread(target=run)
    t.start()
    return t


def _held_behind_a_runner(inst: apache.ApacheInstance, leave: str) -> tuple[dict[str, tuple[int, float]], socket.socket]:
    """A runner of ``capped``; then a request on a raw connection, held, whose client leaves
    (``reset``: SO_LINGER 0 and close; ``half-close``: shutdown of its sending side) while it
    waits; then the stage's next request, held behind both. Returns once all but the raw one
    are answered: their status and seconds, and the raw socket (closed when reset)."""
    out: dict[str, tuple[int, float]] = {}
    runner = _timed_get(inst, f"/stage1?work={RUNNER_S}", out, "runner")
    until(lambda: prio_status(inst)[f"overtake_stage_active{{{CAPPED}}}"] == 1, "the runner counted")
    host, port = apache.parse_listen(inst.listen)
    raw = socket.create_connection((host, port))
    raw.sendall(f"GET /stage1?work={DEAD_S} HTTP/1.1\r\nHost: t\r\nX-Request-Id: left\r\n\r\n".encode())
    until(lambda: prio_status(inst)[f"overtake_stage_waiting{{{CAPPED}}}"] == 1, "the raw request held")
    nxt = _timed_get(inst, f"/stage1?work={NEXT_S}", out, "next")
    until(lambda: prio_status(inst)[f"overtake_stage_waiting{{{CAPPED}}}"] == 2, "the next request held")
    if leave == "reset":
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()
    else:
        raw.shutdown(socket.SHUT_WR)
    runner.join(60)
    nxt.join(60)
    return out, raw


def _log_status(inst: apache.ApacheInstance, rid: str) -> str:
    """The access log's status for the request whose X-Request-Id is ``rid`` (its line is written
    at its end, which follows its answer)."""
    log = Path(inst.workdir) / "logs" / "access.log"
    pattern = re.compile(rf'" (\d+) \S+ .* rid={rid} ')
    until(lambda: pattern.search(log.read_text()) is not None, f"the log line of {rid}")
    m = pattern.search(log.read_text())
    assert m
    return m.group(1)


def _grew(after: dict[str, float], before: dict[str, float], name: str) -> float:
    key = f"overtake_stage_{name}{{{CAPPED}}}"
    return after[key] - before.get(key, 0.0)


@pytest.mark.parametrize("mpm", ["event", "prefork"])
def test_a_held_request_whose_client_reset_is_dropped_not_run(apache_available: None, mpm: str) -> None:
    with _capped(mpm) as inst:
        before = prio_status(inst)
        out, _ = _held_behind_a_runner(inst, "reset")
        assert out["runner"][0] == out["next"][0] == 200
        # the next request ran right after the runner, not after the dropped one's second of CPU
        assert out["next"][1] < RUNNER_S + NEXT_S + DEAD_S / 2, out
        assert _log_status(inst, "left") == "499"
        st = settled(inst, NAMES)
        assert _grew(st, before, "dropped_total") == 1
        assert _grew(st, before, "requests_total") == 3 and _grew(st, before, "held_total") == 2
        assert _grew(st, before, "hold_timeouts_total") == 0
        served = 'overtake_stage_served_total{stage="capped",by="apache"}'
        assert st[served] - before.get(served, 0.0) == 2  # the dropped one ran nowhere
        assert st[f"overtake_stage_active{{{CAPPED}}}"] == 0 and st[f"overtake_stage_waiting{{{CAPPED}}}"] == 0
        assert st["overtake_stage_abort_on_close"] == 1  # the default


@pytest.mark.parametrize("abort_on_close", [True, False], ids=["dropped", "served"])
def test_a_half_closed_client_is_dropped_unless_abort_on_close_is_off(apache_available: None, abort_on_close: bool) -> None:
    with _capped("event", abort_on_close) as inst:
        before = prio_status(inst)
        out, raw = _held_behind_a_runner(inst, "half-close")
        try:
            raw.settimeout(30)
            answer = b""
            while chunk := raw.recv(65536):  # until Apache closes: it reads the client's FIN next
                answer += chunk
        finally:
            raw.close()
        st = settled(inst, NAMES)
        assert st["overtake_stage_abort_on_close"] == int(abort_on_close)
        if abort_on_close:
            assert answer == b""  # dropped: the connection closed with no answer
            assert _log_status(inst, "left") == "499"
            assert _grew(st, before, "dropped_total") == 1
            assert out["next"][1] < RUNNER_S + NEXT_S + DEAD_S / 2, out
        else:
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:80]  # a half-closed client still reads
            assert _log_status(inst, "left") == "200"
            assert _grew(st, before, "dropped_total") == 0
            assert out["next"][1] > RUNNER_S + DEAD_S, out  # it ran, and the next waited for it
        assert _grew(st, before, "hold_timeouts_total") == 0
        assert st[f"overtake_stage_active{{{CAPPED}}}"] == 0 and st[f"overtake_stage_waiting{{{CAPPED}}}"] == 0
