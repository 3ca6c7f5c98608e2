"""The sidecar as a service: config file, graceful drain on SIGTERM, reload on SIGHUP,
a separate admin listener, the access log, X-Forwarded-Proto/Host, and a start from the shipped
systemd unit.

Known answers: under pi(1) two concurrent 0.3 s requests to one stage run one after the other,
so the access log must show a queue wait of about 0.3 s for one of them and ~0 for the other,
and an upstream time of at least 0.3 s for both. A SIGTERM during a bounded load must lose no
request that was sent before it (each gets its 200), and the process must exit 0.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.service_helpers import REPO, STAGES, SidecarProc, StubApache, admin_token_file, free_port

UNIT = REPO / "apache-conf" / "overtake-sidecar.service"
VHOST = REPO / "apache-conf" / "examples" / "vhost-behind-sidecar.conf"
EXAMPLE_CONFIG = REPO / "apache-conf" / "examples" / "sidecar.yaml"


def _config(work: Path, stub: StubApache, name: str = "sidecar.yaml", **extra: Any) -> tuple[Path, int, int]:
    """A config file on free ports: (its path, the public port, the admin port)."""
    (work / "stages.yaml").write_text(STAGES)
    port, admin = free_port(), free_port()
    cfg = {"apache": stub.url, "listen": f"127.0.0.1:{port}", "stages": "stages.yaml", "policy": "pi(2)",
           "loop": "asyncio", "admin_listen": f"127.0.0.1:{admin}", "admin_token_file": str(admin_token_file(work)),
           **extra}
    path = work / name
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in cfg.items()) + "\n")
    return path, port, admin


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overtake.api.cli", "sidecar", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


# ---- config file ---------------------------------------------------------------------------------
def test_config_file_and_flags_override_it(work: Path, stub: StubApache) -> None:
    cfg, port, admin = _config(work, stub, policy="pi(3)", drain_timeout=5)
    override = free_port()
    argv = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--config", str(cfg), "--listen",
            f"127.0.0.1:{override}"]
    s = SidecarProc(work, [], argv=argv, ready_port=override, admin_port=admin)
    s.port = override
    try:
        assert json.loads(s.request("GET", "/-/policy")[2])["name"] == "pi(3)"  # from the file
        with pytest.raises(OSError):  # the file's listen was overridden by --listen
            s.request("GET", "/-/healthz", port=port, timeout=2)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize(("line", "message"), [
    ("drain_timout: 5", r"drain_timout: unknown key; known keys: .*drain_timeout"),
    ("drain_timeout: -1", r"drain_timeout: Input should be greater than or equal to 0"),
    ("request_log_format: xml", r"request_log_format: Input should be 'json' or 'combined'"),
    ("online: {refit_every: 3}", r"online\.refit_every: unknown key; known keys: .*refit_interval"),
    ("admin_put: maybe", r"admin_put: Input should be a valid boolean"),
])
def test_config_errors_are_one_line_naming_the_key(work: Path, stub: StubApache, line: str, message: str) -> None:
    cfg, _, _ = _config(work, stub, name="bad.yaml")
    cfg.write_text(cfg.read_text() + line + "\n")
    r = _cli("--config", str(cfg))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), r.stderr
    assert "Traceback" not in r.stderr


def test_missing_required_key_names_the_flag(work: Path) -> None:
    cfg = work / "partial.yaml"
    cfg.write_text("policy: pi(2)\nlisten: 127.0.0.1:1\n")
    r = _cli("--config", str(cfg))
    assert r.returncode == 2 and "apache: required: set it in the config file or give --apache" in r.stderr, r.stderr


# ---- SIGTERM: drain ------------------------------------------------------------------------------
def _load_until_signal(port: int, n_clients: int, t_stop: float) -> list[tuple[float, float, int | str]]:
    """``n_clients`` threads each loop: new connection, GET /slow/0.3, until ``t_stop``. Each
    result: (time the request was written, time answered, status or error name)."""
    out: list[tuple[float, float, int | str]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        path = "/slow/0.3" if i % 2 else "/stage2"
        while time.monotonic() < t_stop:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.connect()
            except OSError:
                time.sleep(0.05)
                continue
            try:
                conn.request("GET", path)
                sent = time.monotonic()
            except OSError as exc:
                conn.close()
                with lock:
                    out.append((time.monotonic(), time.monotonic(), type(exc).__name__))
                continue
            try:
                r = conn.getresponse()
                r.read()
                res: int | str = r.status
            except (OSError, http.client.HTTPException) as exc:
                res = type(exc).__name__
            finally:
                conn.close()
            with lock:
                out.append((sent, time.monotonic(), res))

    th = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
    return out


def test_sigterm_drains_every_accepted_request(work: Path, stub: StubApache) -> None:
    """pi(2) over 12 clients of 0.3 s requests: at the signal some run in Apache and more wait in
    the sidecar's queue. Every request written before the signal is answered 200; the process
    exits 0 within the drain deadline."""
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--drain-timeout", "20"])
    t_sig = time.monotonic() + 1.5
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.update(res=_load_until_signal(s.port, 12, t_sig + 1.0)))
    th.start()
    time.sleep(max(0.0, t_sig - time.monotonic()))
    queued = _metric(s, "overtake_stage_queued")
    t_sig = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(30)
    t_exit = time.monotonic()
    th.join(60)
    res = box["res"]
    before = [r for r in res if r[0] < t_sig]
    lost = [r for r in before if r[2] != 200]
    assert code == 0, s.text()
    assert queued > 0, "no request was queued at the signal: the test did not exercise the queue"
    assert len(before) >= 12 and not lost, (len(before), lost)
    assert t_exit - t_sig < 5
    drained = [e for e in s.events() if e.get("event") == "drained"]
    assert drained and drained[0]["cut"] == 0, s.text()
    assert "Traceback" not in s.text()
    print(f"drain: {len(before)} requests sent before SIGTERM, {len(lost)} lost, {queued:g} queued at the "
          f"signal, exit {code} after {t_exit - t_sig:.2f} s")


def _metric(s: SidecarProc, name: str, port: int | None = None) -> float:
    text = s.request("GET", "/-/metrics", port=port)[2].decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_drain_deadline_cuts_and_still_exits_0(work: Path, stub: StubApache) -> None:
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--drain-timeout", "0.5"])
    box: dict[str, Any] = {}

    def slow() -> None:
        try:
            box["r"] = s.request("GET", "/slow/3", timeout=10)[0]
        except (OSError, http.client.HTTPException) as exc:
            box["r"] = type(exc).__name__

    th = threading.Thread(target=slow)
    th.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0
    assert time.monotonic() - t0 < 2.5
    th.join(10)
    assert box["r"] != 200
    drained = [e for e in s.events() if e.get("event") == "drained"]
    assert drained and drained[0]["cut"] == 1


# ---- SIGHUP: reload ------------------------------------------------------------------------------
def test_sighup_reloads_config_and_policy(work: Path, stub: StubApache) -> None:
    log1, log2 = work / "req1.log", work / "req2.log"
    cfg, port, admin = _config(work, stub, name="hup.yaml", request_log=str(log1))
    argv = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--config", str(cfg)]
    s = SidecarProc(work, [], argv=argv, ready_port=port, admin_port=admin)
    s.port = port
    try:
        assert json.loads(s.request("GET", "/-/policy")[2])["name"] == "pi(2)"
        text = cfg.read_text().replace('policy: "pi(2)"', 'policy: "pi(1)"').replace(str(log1), str(log2))
        cfg.write_text(text + f'listen: "127.0.0.1:{free_port()}"\n'.replace("listen", "admin_listen"))
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while json.loads(s.request("GET", "/-/policy")[2])["name"] != "pi(1)":
            assert time.monotonic() < deadline, s.text()
            time.sleep(0.05)
        s.request("GET", "/stage2")
        while not (log2.exists() and '"stage": "stage2"' in log2.read_text()):  # written after the answer
            assert time.monotonic() < deadline + 5, "the reloaded request_log got no line"
            time.sleep(0.05)
        partial = [e for e in s.events() if e.get("event") == "reload_partial"]
        assert partial and "admin_listen" in partial[0]["detail"]  # needs a restart: named, not applied
        assert s.request("GET", "/-/healthz")[0] == 200  # still on the public listener
        # a broken config on reload is refused and the running one kept
        cfg.write_text(cfg.read_text() + "nonsense_key: 1\n")
        s.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        refused = [e for e in s.events() if e.get("event") == "reload_refused"]
        assert refused and "nonsense_key: unknown key" in refused[0]["detail"]
        assert s.request("GET", "/stage2")[0] == 200
    finally:
        assert s.stop() == 0


def test_sighup_with_a_non_utf8_config_is_refused_and_logged(work: Path, stub: StubApache) -> None:
    """A config saved as Latin-1 on reload: one ``reload_refused`` line naming the file and the
    byte, the old config kept (on main the reload task died with "Task exception was never
    retrieved" and a UnicodeDecodeError traceback)."""
    cfg, port, admin = _config(work, stub, name="latin1.yaml")
    argv = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--config", str(cfg)]
    s = SidecarProc(work, [], argv=argv, ready_port=port, admin_port=admin)
    s.port = port
    try:
        cfg.write_bytes(cfg.read_bytes() + "# caf\u00e9\n".encode("latin-1"))
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not [e for e in s.events() if e.get("event") == "reload_refused"]:
            assert time.monotonic() < deadline, s.text()
            time.sleep(0.05)
        refused = [e for e in s.events() if e.get("event") == "reload_refused"]
        assert "latin1.yaml: not UTF-8 text (byte 0xe9" in refused[0]["detail"], refused
        assert "Task exception" not in s.text() and "Traceback" not in s.text(), s.text()
        assert s.request("GET", "/stage2")[0] == 200
    finally:
        assert s.stop() == 0


# ---- admin listener, access log, forwarded headers ------------------------------------------------
def test_admin_listener_takes_the_control_endpoints(work: Path, stub: StubApache) -> None:
    """The public listener answers only the health checks; metrics (at /-/metrics and at
    Prometheus's default /metrics) and the policy are on the admin listener, which proxies
    nothing (on main /metrics was a 404 there)."""
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url])
    admin = s.admin_port
    try:
        for path in ("/-/metrics", "/metrics", "/-/policy", "/-/healthz", "/-/livez"):
            code, _, body = s.request("GET", path, port=admin)
            assert code == 200, (path, body)
        assert b"overtake_stage_limit" in s.request("GET", "/metrics", port=admin)[2]
        for path in ("/-/metrics", "/-/policy"):
            code, _, body = s.request("GET", path, port=s.port)
            assert code == 404 and b"admin_listen" in body, (path, body)
        assert s.request("GET", "/-/healthz", port=s.port)[2] == b"ok\n"
        assert s.request("GET", "/-/livez", port=s.port)[2] == b"ok\n"
        code, _, body = s.request("PUT", "/-/policy", body=b"pi(1)", port=s.port)
        assert code == 403 and b"not served on this listener" in body
        assert s.request("PUT", "/-/policy", body=b"pi(1)", port=admin)[0] == 200
        assert s.request("GET", "/stage2", port=admin)[0] == 404  # the admin listener proxies nothing
        assert s.request("GET", "/stage2")[0] == 200
    finally:
        assert s.stop() == 0


def test_options_group_the_config_keys_and_give_each_back() -> None:
    """Every config-file key lands in one sub-record of SidecarOptions and comes back under its
    own name (a reload compares and names options by these keys); an unknown key is refused."""
    from overtake.controller.sidecar.config import SidecarConfig
    from overtake.controller.sidecar.options import GROUPS, KEYS, SidecarOptions

    keys = [k for _, names in GROUPS.values() for k in names] + ["online", "phase_header", "drain_timeout", "verify", "enforce"]
    assert len(set(keys)) == len(keys) and set(keys) <= set(SidecarConfig.model_fields)
    sent = {k: f"value of {k}" for k in keys}
    assert SidecarOptions.from_flat(**sent).flat() == sent and tuple(SidecarOptions.from_flat(**sent).flat()) == KEYS
    opts = SidecarOptions.from_flat(policy="pi(1)", apache="http://127.0.0.1:1", listen="127.0.0.1:2",
                                    uplink="srpt", gate_slots=3, request_log_format="combined")
    assert (opts.policy.spec, opts.uplink.name, opts.apache_side.gate_slots) == ("pi(1)", "srpt", 3)
    assert opts.observability.request_log_format == "combined" and opts.guards.admin_put is True
    with pytest.raises(TypeError, match="unknown sidecar options: \\['polcy'\\]"):
        SidecarOptions.from_flat(polcy="pi(1)", apache="http://127.0.0.1:1", listen="127.0.0.1:2")


def test_admin_listener_is_on_loopback_by_default(work: Path, stub: StubApache) -> None:
    """Without admin_listen the control endpoints are on 127.0.0.1:9089 and the public listener
    answers 404 for them (on main they answered any client on the public listener)."""
    from overtake.controller.sidecar.admin import DEFAULT_ADMIN_LISTEN
    from overtake.controller.sidecar.config import SidecarConfig
    from overtake.controller.sidecar.options import SidecarOptions

    assert DEFAULT_ADMIN_LISTEN == "127.0.0.1:9089"
    assert SidecarOptions.from_flat(policy="pi(1)", apache="http://127.0.0.1:1",
                                   listen="127.0.0.1:2").endpoints.admin_listen == \
        DEFAULT_ADMIN_LISTEN
    assert SidecarConfig(apache="http://127.0.0.1:1", listen="127.0.0.1:2", stages="s").admin_listen == \
        DEFAULT_ADMIN_LISTEN
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 9089)) == 0:
            pytest.skip("port 9089 is in use here: cannot start a sidecar on its default admin port")
    st = work / "stages-default-admin.yaml"
    st.write_text(STAGES)
    port = free_port()
    argv = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--listen", f"127.0.0.1:{port}", "--stages", str(st),
            "--loop", "asyncio", "--policy", "pi(2)", "--apache", stub.url]
    s = SidecarProc(work, [], argv=argv, ready_port=port, admin_port=9089)
    s.port = port
    try:
        assert s.request("GET", "/-/metrics", port=port)[0] == 404
        assert s.request("GET", "/-/policy", port=port)[0] == 404
        assert s.request("GET", "/-/metrics", port=9089)[0] == 200
        start = next(e for e in s.events() if e.get("event") == "start")
        assert start["admin_listen"] == "127.0.0.1:9089"
    finally:
        assert s.stop() == 0


def test_writes_need_the_admin_token(work: Path, stub: StubApache) -> None:
    """PUT /-/policy from loopback: refused (403, naming the config key) while no token is
    configured, also before a large body is read; with a token configured, refused without it or
    with a wrong one, taken with it. On main a loopback peer needed no token at all."""
    st = work / "stages-token.yaml"
    st.write_text(STAGES)
    port, admin = free_port(), free_port()
    base = [sys.executable, "-m", "overtake.api.cli", "sidecar", "--listen", f"127.0.0.1:{port}", "--stages", str(st),
            "--loop", "asyncio", "--policy", "pi(2)", "--apache", stub.url, "--admin-listen", f"127.0.0.1:{admin}"]
    s = SidecarProc(work, [], argv=base, ready_port=port, admin_port=admin)
    s.port = port
    try:
        code, _, body = s.request("PUT", "/-/policy", body=b"pi(1)")
        assert code == 403 and b"admin_token_file" in body, body
        with socket.create_connection(("127.0.0.1", admin), timeout=10) as c:
            c.sendall(b"PUT /-/policy HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n"
                      b"Content-Length: 1000000\r\n\r\n")  # the body never comes: refused from the head
            answer = c.recv(65536)
        assert answer.startswith(b"HTTP/1.1 403 ") and b"admin_token_file" in answer, answer
        assert json.loads(s.request("GET", "/-/policy")[2])["name"] == "pi(2)"
    finally:
        assert s.stop() == 0
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url])  # with --admin-token-file
    try:
        assert s.request("PUT", "/-/policy", body=b"pi(1)", token=None)[0] == 403
        code, _, body = s.request("PUT", "/-/policy", body=b"pi(1)", token="wrong")
        assert code == 403 and b"Authorization: Bearer" in body, body
        assert json.loads(s.request("GET", "/-/policy")[2])["name"] == "pi(2)"
        code, _, body = s.request("PUT", "/-/policy", body=b"pi(1)")
        assert code == 200 and json.loads(body)["name"] == "pi(1)", body
    finally:
        assert s.stop() == 0


def test_access_log_has_stage_phase_queue_wait_and_upstream(work: Path, stub: StubApache) -> None:
    log = work / "access.jsonl"
    s = SidecarProc(work, ["--policy", "pi(1)", "--apache", stub.url, "--request-log", str(log)])
    try:
        th = [threading.Thread(target=s.request, args=("GET", "/slow/0.3"), kwargs={"headers": {"User-Agent": "t/1"}})
              for _ in range(2)]
        th[0].start()
        deadline = time.monotonic() + 10
        while stub.hits["/slow/0.3"] < 1 and time.monotonic() < deadline:  # the first is in Apache's hands
            time.sleep(0.005)
        th[1].start()  # pi(1): one thread, so this one waits in the sidecar until the first is answered
        for t in th:
            t.join()
        s.request("GET", "/-/healthz")
        s.request("GET", "/other")
    finally:
        assert s.stop() == 0
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    slow = sorted((r for r in recs if r["target"] == "/slow/0.3"), key=lambda r: r["ts"])
    assert len(slow) == 2 and all(r["stage"] == "stage1" and r["phase"] == 1 and r["status"] == 200 for r in slow)
    # the first is admitted at once; the second when the first's answer is back (its wait is what the
    # first had left to run), whatever the delays of the client threads
    first_done = slow[0]["ts"] + slow[0]["queue_wait"] + slow[0]["upstream"]
    assert slow[0]["queue_wait"] < 0.05 and 0 < slow[1]["queue_wait"] < slow[0]["upstream"] + 0.05, slow
    assert abs(slow[1]["ts"] + slow[1]["queue_wait"] - first_done) < 0.05, slow
    assert all(r["upstream"] >= 0.3 and r["duration"] >= r["queue_wait"] + r["upstream"] - 0.01 for r in slow)
    assert slow[0]["user_agent"] == "t/1" and slow[0]["bytes"] > 0
    other = [r for r in recs if r["target"] == "/other"]
    assert other[0]["stage"] == "passthrough" and other[0]["phase"] is None
    assert next(r for r in recs if r["target"] == "/-/healthz")["stage"] == "admin"


def test_access_log_combined_format(work: Path, stub: StubApache) -> None:
    log = work / "access.log"
    s = SidecarProc(work, ["--policy", "pi(1)", "--apache", stub.url, "--request-log", str(log),
                           "--request-log-format", "combined"])
    try:
        s.request("GET", "/slow/0.1?x=1", headers={"User-Agent": 'quote"d', "Referer": "http://r/"})
    finally:
        assert s.stop() == 0
    line = next(ln for ln in log.read_text().splitlines() if "/slow/" in ln)
    m = re.fullmatch(r'127\.0\.0\.1 - - \[[^]]+\] "GET /slow/0\.1\?x=1 HTTP/1\.1" 200 (\d+) "http://r/" "quote\\"d" '
                     r"stage=stage1 phase=1 queue_wait=([0-9.]+) upstream=([0-9.]+) duration=([0-9.]+)", line)
    assert m is not None, line
    assert float(m[3]) >= 0.1 and int(m[1]) > 0


def test_forwarded_proto_and_host(work: Path, stub: StubApache) -> None:
    """From a client outside ``trusted_sources`` (test_header_trust.py: a trusted one's proto is kept)."""
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--trusted-source", "127.0.0.1/32"])
    try:
        body = s.request("GET", "/stage2", headers={"Host": "shop.example:8443", "X-Forwarded-Proto": "gopher",
                                                    "X-Forwarded-Host": "evil"}, source="127.0.0.2")[2]
    finally:
        s.stop()
    h = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert h["x-forwarded-proto"] == "http" and h["x-forwarded-host"] == "shop.example:8443"
    assert h["x-forwarded-for"] == "127.0.0.2" and h["host"] == "shop.example:8443"


# ---- the shipped unit file -------------------------------------------------------------------------
def _parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax as far as the shipped unit uses it: sections, repeated keys,
    backslash line continuation, comments."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def _unit_env(unit: dict[str, dict[str, list[str]]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in unit["Service"].get("Environment", []):
        for word in shlex.split(item):
            k, _, v = word.partition("=")
            env[k] = v
    return env


def _expand(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), word)


def _systemd_usable() -> bool:
    if shutil.which("systemctl") is None or shutil.which("systemd-run") is None:
        return False
    r = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, check=False)
    return r.stdout.strip() in ("running", "degraded")


def test_unit_file_runs_the_sidecar_and_stops_it_gracefully(work: Path, stub: StubApache) -> None:
    """Start the sidecar from apache-conf/overtake-sidecar.service as systemd would: its
    Environment= and ExecStart= (the config path pointed at a test config, as a drop-in would),
    then KillSignal= to the main process with a request in flight; it must finish that request
    and exit 0 within TimeoutStopSec=. Under systemd-run when systemd is PID 1 here; otherwise
    this supervisor (systemd is 'offline' in the CI container)."""
    unit = _parse_unit(UNIT)
    svc = unit["Service"]
    assert svc["Type"] == ["exec"] and svc["KillSignal"] == ["SIGTERM"] and svc["ExecReload"]
    stop_timeout = float(svc["TimeoutStopSec"][0])
    cfg, port, _ = _config(work, stub, name="unit.yaml", drain_timeout=min(20.0, stop_timeout - 5))
    env = {**_unit_env(unit), "OVERTAKE_CONFIG": str(cfg)}
    argv = [_expand(w, env) for w in shlex.split(svc["ExecStart"][0])]
    assert Path(argv[0]).name == "overtake" and argv[1:3] == ["sidecar", "--config"]
    # the unit names the installed entry point; here it is this interpreter's
    argv = [sys.executable, "-m", "overtake.api.cli", *argv[1:]]
    if _systemd_usable():  # pragma: no cover - not in the CI container
        name = f"overtake-test-{port}"
        props = [f"--property={k}={v}" for k in ("KillSignal", "TimeoutStopSec") for v in svc[k]]
        subprocess.run(["systemd-run", f"--unit={name}", *props, *[f"--setenv={k}={v}" for k, v in env.items()],
                        *argv], check=True)
        stopper = ["systemctl", "stop", name]
        proc = None
    else:
        with (work / "unit.log").open("wb") as err:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            c.request("GET", "/-/healthz")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        finally:
            c.close()
        assert time.monotonic() < deadline, (work / "unit.log").read_text()
        time.sleep(0.1)
    box: dict[str, Any] = {}

    def inflight() -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            c.request("GET", "/slow/1")
            r = c.getresponse()
            box["status"], box["body"] = r.status, r.read()
        finally:
            c.close()

    th = threading.Thread(target=inflight)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    if proc is None:  # pragma: no cover
        subprocess.run(stopper, check=True)
        code = 0
    else:
        proc.send_signal(getattr(signal, svc["KillSignal"][0]))  # KillMode=mixed: to the main process
        code = proc.wait(stop_timeout)
    th.join(10)
    assert code == 0, (work / "unit.log").read_text()
    assert box.get("status") == 200, box
    assert time.monotonic() - t0 < stop_timeout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_passes_systemd_analyze_verify(work: Path) -> None:
    """systemd's own parser accepts every directive (ExecStart pointed at this checkout's entry
    point: verify also checks that the program exists)."""
    exe = Path(sys.executable).with_name("overtake")
    if not exe.exists():
        pytest.skip(f"no {exe}: the package is not installed with its console script")
    unit = work / "overtake-sidecar.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/overtake", str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_vhost_example_trusts_the_sidecar_and_keeps_server_status_private() -> None:
    text = VHOST.read_text()
    assert re.search(r"^\s*RemoteIPHeader\s+X-Forwarded-For", text, re.MULTILINE)
    assert re.search(r"^\s*RemoteIPInternalProxy\s+127\.0\.0\.1", text, re.MULTILINE)
    status = re.search(r"<Location\s+/server-status>(.*?)</Location>", text, re.DOTALL)
    assert status is not None and "SetHandler server-status" in status[1]
    # with mod_remoteip the client's address (from X-Forwarded-For) replaces the sidecar's, so a
    # loopback-only rule admits the sidecar's own scrape (no X-Forwarded-For) and not its clients
    assert re.search(r"^\s*Require\s+ip\s+127\.0\.0\.1\s+::1\s*$", status[1], re.MULTILINE), status[1]
    assert EXAMPLE_CONFIG.exists()


def test_unit_and_examples_are_package_data() -> None:
    cfg = (REPO / "setup.cfg").read_text()
    line = next(ln for ln in cfg.splitlines() if ln.startswith("overtake.apache_conf ="))
    assert "*.service" in line and "examples/*" in line


@pytest.mark.apache_functional
def test_vhost_example_on_a_real_apache_behind_the_sidecar(apache_available: None, work: Path) -> None:
    """Debian's apache2 with the example vhost (its address, DocumentRoot and log folder moved
    into a temporary folder) behind the sidecar: the sidecar's own mod_status scrape is allowed
    (apache_up 1), a client arriving through the sidecar from 127.0.0.2 is logged by Apache as
    127.0.0.2 (mod_remoteip); /server-status is refused by the sidecar itself (404), and the
    vhost's Require rule, which now sees the client rather than the sidecar, would refuse it too."""
    root = Path(tempfile.mkdtemp(prefix="overtake-vhost-", dir="/tmp"))
    root.chmod(0o755)
    (root / "htdocs").mkdir()
    (root / "htdocs" / "index.html").write_text("hello\n")
    (root / "logs").mkdir()
    (root / "run").mkdir()
    port = free_port()
    vhost = (VHOST.read_text().replace("127.0.0.1:8081", f"127.0.0.1:{port}")
             .replace("/var/www/html", str(root / "htdocs")).replace("${APACHE_LOG_DIR}", str(root / "logs")))
    (root / "vhost.conf").write_text(vhost)
    mods = "/usr/lib/apache2/modules"
    user = "User www-data\nGroup www-data\n" if os.geteuid() == 0 else ""
    (root / "httpd.conf").write_text(
        f'ServerRoot "{root}"\nDefaultRuntimeDir "{root}/run"\nPidFile "{root}/run/httpd.pid"\n'
        f'ErrorLog "{root}/logs/error.log"\nListen 127.0.0.1:{port}\nServerName localhost\n{user}'
        + "".join(f"LoadModule {m}_module {mods}/mod_{m}.so\n"
                  for m in ("mpm_event", "authz_core", "authz_host", "mime", "status", "remoteip"))
        + f"TypesConfig /etc/mime.types\nInclude {root}/vhost.conf\n")
    subprocess.run(["apache2", "-f", str(root / "httpd.conf"), "-t"], check=True, capture_output=True)
    subprocess.run(["apache2", "-f", str(root / "httpd.conf"), "-k", "start"], check=True)
    s = None
    try:
        s = SidecarProc(work, ["--policy", "pi(2)", "--apache", f"http://127.0.0.1:{port}"])
        assert "apache_up 1.0" in s.request("GET", "/-/metrics")[2].decode()
        code, _, body = s.request("GET", "/index.html", source="127.0.0.2")
        assert code == 200 and body == b"hello\n"
        assert s.request("GET", "/server-status", source="127.0.0.2")[0] == 404
        assert s.request("GET", "//server-status?auto", source="127.0.0.2")[0] == 404
        deadline = time.monotonic() + 5
        while "GET /index.html" not in (root / "logs" / "access.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        line = next(ln for ln in (root / "logs" / "access.log").read_text().splitlines() if "GET /index.html" in ln)
        assert line.startswith("127.0.0.2 "), line
    finally:
        if s is not None:
            s.stop()
        subprocess.run(["apache2", "-f", str(root / "httpd.conf"), "-k", "stop"], check=False, capture_output=True)
        deadline = time.monotonic() + 10
        while (root / "run" / "httpd.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(root, ignore_errors=True)
