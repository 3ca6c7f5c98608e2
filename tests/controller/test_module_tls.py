"""Module mode behind TLS and HTTP/2: Apache terminates both (mod_ssl, mod_http2) and the count
table is in force on their requests, with no proxy in front.

A private Apache (the project's template plus a TLS virtual host with ``Protocols h2 http/1.1``
and a self-signed certificate made here) holds stage ``capped`` at one running request. Over
HTTPS (HTTP/1.1, one connection per request) and over HTTP/2 (curl multiplexing the requests as
streams of one connection, run by mod_http2's workers), ``capped``'s handler spans never overlap
while ``free``'s do, and every request is answered (the module counts each once). A request that
starts demoted (the class header) is restored when its body is complete, before TLS and HTTP/2
write it out.

The stack Debian recommends for PHP (mpm_event, mod_http2 over TLS, proxy_fcgi to a PHP-FPM pool)
with the same table: HTTP/2 streams of a stage capped at one never overlap in FPM's workers (PHP
reports each script's span), FPM's listen queue stays empty (the held streams wait in Apache), and
each stream's count ends when FPM has answered it, counted as served by FastCGI.
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.control_apache import control_apache
from support.module_stages import at_once, max_overlap, prio_status, settled, until, write_policy

from overtake.controller.harness import apache
from overtake.controller.harness import php_fpm as pf
from overtake.controller.harness.apache.config import DEFAULT_CONF_DIR
from overtake.controller.harness.apache.cpu_priority import CpuPriority
from overtake.controller.harness.apache.prio_status import fetch_prio_status
from overtake.controller.harness.scratch import free_port, scratch_dir

NAMES = ("capped", "free")
URL = {"capped": "/stage1", "free": "/stage2"}
TLS_VHOST = """
LoadModule socache_shmcb_module @MODULES_DIR@/mod_socache_shmcb.so
LoadModule ssl_module @MODULES_DIR@/mod_ssl.so
LoadModule http2_module @MODULES_DIR@/mod_http2.so
Listen 127.0.0.1:{port}
SSLSessionCache "shmcb:@APACHE_DIR@/run/ssl_scache(512000)"
<VirtualHost 127.0.0.1:{port}>
    SSLEngine on
    SSLCertificateFile "{cert}"
    SSLCertificateKeyFile "{key}"
    Protocols h2 http/1.1
</VirtualHost>
"""


def _cert(d: Path) -> tuple[Path, Path]:
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    os.chmod(d, 0o755)
    os.chmod(cert, 0o644)
    os.chmod(key, 0o644)  # read by the root parent only, but a scratch key of a loopback test
    return cert, key


def _needs_tls_tools() -> None:
    if os.geteuid() != 0 or shutil.which("apxs") is None:
        pytest.skip("needs root and apxs (apache2-dev): mod_overtake_prio")
    for tool in ("openssl", "curl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")
    if "HTTP2" not in subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout:
        pytest.skip("curl without HTTP/2 (nghttp2)")


def _tls_conf(parent: Path) -> tuple[Path, int, Path]:
    """The project's templates plus the TLS virtual host; (templates, TLS port, certificate)."""
    conf = parent / "conf"
    shutil.copytree(DEFAULT_CONF_DIR, conf)
    cert, key = _cert(parent)
    tls_port = free_port()
    with (conf / "httpd.conf.in").open("a") as f:
        f.write(TLS_VHOST.format(port=tls_port, cert=cert, key=key))
    return conf, tls_port, cert


@pytest.fixture(scope="module")
def tls_apache(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, int, Path]]:
    _needs_tls_tools()
    parent = scratch_dir("overtake-tls-test-")
    try:
        conf, tls_port, cert = _tls_conf(parent)
        with control_apache("module-tls", levels=(0.5,), nice=("idle",), stage_hold=30, mpm="event", conf_dir=conf,
                            stages=(("capped", "^/stage1$"), ("free", "^/stage2$"))) as (inst, path):
            write_policy(path, "pi(1,16)", NAMES)
            yield inst, tls_port, cert
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_class_apache(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, int, Path]]:
    """The same TLS and HTTP/2 set-up, with the class header (a request may start demoted)."""
    _needs_tls_tools()
    parent = scratch_dir("overtake-tls-class-test-")
    try:
        conf, tls_port, cert = _tls_conf(parent)
        inst = apache.start(parent / "wd", f"127.0.0.1:{free_port()}", max_workers=16, conf_dir=conf,
                            cpu_priority=CpuPriority(levels=(0.5,), nice=("idle",)))
        try:
            yield inst, tls_port, cert
        finally:
            apache.stop(inst.workdir, graceful=False)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


SPAN_PHP = r"""<?php
$t0 = microtime(true);
usleep((int)(1e6 * (float)($_GET['s'] ?? 0)));
header(sprintf('X-Php-Span: %d %d', (int)(1e6 * $t0), (int)(1e6 * microtime(true))));
echo "ok\n";
"""
FPM_CHILDREN = 3  # pm.max_children: the table pi(1,2)'s total cap


@pytest.fixture(scope="module")
def tls_fpm_apache(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, int, Path, pf.FpmPool]]:
    """The TLS and HTTP/2 set-up with the two stages' PHP scripts served by a PHP-FPM pool."""
    _needs_tls_tools()
    if (why := pf.php_available()) is not None:
        pytest.skip(why)
    parent = scratch_dir("overtake-tls-fpm-test-")
    parent.chmod(0o755)  # www-data's workers read the scripts
    try:
        pool = pf.start_pool(parent / "pool", None, {}, children=FPM_CHILDREN, pool={"pm.status_path": "/fpm-status"},
                             scripts={"capped.php": SPAN_PHP, "free.php": SPAN_PHP})
        try:
            conf, tls_port, cert = _tls_conf(parent)
            with control_apache("module-tls-fpm", levels=(0.5,), nice=("idle",), stage_hold=30, mpm="event",
                                conf_dir=conf, extra_conf=pf.proxy_conf(pool),
                                stages=(("capped", r"^/capped\.php$"), ("free", r"^/free\.php$"))) as (inst, path):
                write_policy(path, "pi(1,2)", NAMES)
                yield inst, tls_port, cert, pool
        finally:
            pool.stop()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _spans(lines: list[tuple[str, str]]) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {s: [] for s in NAMES}
    for stage, span in lines:
        b, e = (int(v) for v in span.split())
        out[stage].append((b, e))
    return out


def _h2_burst(urls: list[str], cert: Path, span_header: str) -> tuple[list[str], dict[str, list[tuple[int, int]]]]:
    """The URLs fetched at once as HTTP/2 streams by one curl (which shares connections between
    them), each answered 200 over HTTP/2: curl's line per URL (code, version, connects, span,
    URL) and the spans the handler reported in ``span_header`` ("begin end", µs) by stage (the
    URL's ``stage=``)."""
    argv = ["curl", "--http2", "--cacert", str(cert), "-s", "--parallel", "--parallel-max", str(len(urls)),
            "-w", f"%{{http_code}} %{{http_version}} %{{num_connects}} %header{{{span_header}}} %{{url}}\\n"]
    for u in urls:
        argv += ["-o", "/dev/null", u]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert len(out) == len(urls), out
    lines = []
    for line in out:
        code, version, _, b, e, url = line.split()
        assert code == "200" and version == "2", line  # HTTP/2, answered
        lines.append((url.rsplit("stage=", 1)[1], f"{b} {e}"))
    return out, _spans(lines)


def _wait_table(inst: apache.ApacheInstance) -> dict[str, float]:
    for _ in range(100):
        st = prio_status(inst)
        if st.get("overtake_stage_table_generation", 0) > 0:
            return st
        urllib.request.urlopen(inst.base_url + "/stage2?work=0", timeout=30).read()  # a start reads the file
    raise AssertionError("the count table never came into force")


def test_https_requests_are_held_by_the_table(tls_apache: tuple[apache.ApacheInstance, int, Path]) -> None:
    inst, port, cert = tls_apache
    before = _wait_table(inst)
    ctx = ssl.create_default_context(cafile=str(cert))
    def one(stage: str) -> tuple[str, str]:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{URL[stage]}?work=0.1&trace=1", timeout=60,
                                    context=ctx) as r:
            assert r.status == 200
            return stage, r.headers["X-Handler-Span-us"]

    spans = _spans(at_once([s for _ in range(6) for s in NAMES], one))
    assert max_overlap(spans["capped"]) == 1, spans["capped"]
    assert max_overlap(spans["free"]) > 1, spans["free"]
    st = settled(inst, NAMES)
    assert st['overtake_stage_requests_total{stage="capped"}'] - before['overtake_stage_requests_total{stage="capped"}'] == 6
    assert st['overtake_stage_active{stage="capped"}'] == 0 and st['overtake_stage_waiting{stage="capped"}'] == 0


def test_http2_streams_are_held_by_the_table(tls_apache: tuple[apache.ApacheInstance, int, Path]) -> None:
    inst, port, cert = tls_apache
    before = _wait_table(inst)
    urls = [f"https://127.0.0.1:{port}{URL[s]}?work=0.1&trace=1&stage={s}" for _ in range(6) for s in NAMES]
    out, spans = _h2_burst(urls, cert, "x-handler-span-us")
    assert max_overlap(spans["capped"]) == 1, spans["capped"]
    assert max_overlap(spans["free"]) > 1, spans["free"]
    assert sum(int(line.split()[2]) for line in out) < len(urls)  # streams shared connections
    st = settled(inst, NAMES)
    assert st['overtake_stage_requests_total{stage="capped"}'] - before['overtake_stage_requests_total{stage="capped"}'] == 6
    assert st['overtake_stage_held_total{stage="capped"}'] > before['overtake_stage_held_total{stage="capped"}']
    assert st['overtake_stage_active{stage="capped"}'] == 0 and st['overtake_stage_waiting{stage="capped"}'] == 0
    # each stream's end started the next: none waited OvertakeStageHold for a purge of its stream
    assert st['overtake_stage_hold_timeouts_total{stage="capped"}'] == before[
        'overtake_stage_hold_timeouts_total{stage="capped"}']


@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
def test_a_demoted_request_is_restored_before_tls_and_http2_write_it(
        tls_class_apache: tuple[apache.ApacheInstance, int, Path], version: str) -> None:
    """The end filter sits before mod_ssl's and mod_http2's output: a client reading a large
    response slowly finds its thread restored (and no thread demoted) while the response is
    still being written."""
    inst, port, cert = tls_class_apache
    host, plain_port = apache.parse_listen(inst.listen)
    big = Path(inst.workdir) / "htdocs" / "static" / f"overtake-big{version[2:]}.bin"
    with big.open("wb") as f:
        # 64 MiB (sparse) at 1 MB/s: more than the kernel's buffers on loopback take (the receive
        # side's grows to 32 MiB, the send side's to 4 MiB), so it is written for many seconds
        f.truncate(64 << 20)
    before = fetch_prio_status(host, plain_port)
    curl = subprocess.Popen(["curl", version, "--cacert", str(cert), "-s", "-o", "/dev/null", "--limit-rate", "1M",
                             "-H", "X-Overtake-Class: 1", f"https://127.0.0.1:{port}/static/{big.name}"])
    try:
        deadline = time.monotonic() + 20
        while (mid := fetch_prio_status(host, plain_port)).restores == before.restores:
            assert time.monotonic() < deadline, "the demoted request was not restored at its end of body"
            assert curl.poll() is None, "curl ended before the restore"
            time.sleep(0.05)
        assert curl.poll() is None, "the response was written already: raise the file's size"
        assert mid.demotions_class[1] - before.demotions_class[1] == 1
        assert mid.restore_errors == 0 and mid.in_flight[1] == 0
    finally:
        curl.kill()
        curl.wait()
        big.unlink()


def test_http2_streams_to_php_fpm_are_held_in_apache_not_in_fpm(
        tls_fpm_apache: tuple[apache.ApacheInstance, int, Path, pf.FpmPool]) -> None:
    inst, port, cert, pool = tls_fpm_apache
    while prio_status(inst).get("overtake_stage_table_generation", 0) == 0:  # a start reads the file
        urllib.request.urlopen(inst.base_url + "/free.php", timeout=30).read()
    before, fpm0 = settled(inst, NAMES), pf.fpm_status(pool)
    urls = [f"https://127.0.0.1:{port}/{s}.php?s=0.3&stage={s}" for _ in range(5) for s in NAMES]
    out, spans = _h2_burst(urls, cert, "x-php-span")  # PHP's own spans
    assert max_overlap(spans["capped"]) == 1, spans["capped"]
    assert max_overlap(spans["free"]) == 2, spans["free"]  # the other stage runs two at once
    assert sum(int(line.split()[2]) for line in out) < len(urls)  # streams shared connections
    fpm1 = pf.fpm_status(pool)
    assert int(fpm1["max listen queue"]) == 0, fpm1  # the held streams waited in Apache, not in FPM
    assert int(fpm1["accepted conn"]) - int(fpm0["accepted conn"]) == len(urls) + 1  # + the status request
    st = settled(inst, NAMES)
    def grew(name: str, stage: str = "capped") -> float:
        key = f'overtake_stage_{name}{{stage="{stage}"}}'
        return st[key] - before.get(key, 0.0)
    assert grew("requests_total") == 5 and grew("held_total") > 0
    assert grew("hold_timeouts_total") == 0  # each stream's end started the next
    served = 'overtake_stage_served_total{stage="capped",by="fcgi"}'
    assert st[served] - before.get(served, 0.0) == 5  # each stream's count ended with FPM's answer
    assert st['overtake_stage_active{stage="capped"}'] == 0 and st['overtake_stage_waiting{stage="capped"}'] == 0


def test_an_http2_stream_whose_client_went_away_is_dropped(tls_apache: tuple[apache.ApacheInstance, int, Path]) -> None:
    """A held stream whose client gave up (curl's --max-time closes the connection) is dropped at
    its turn, not run: mod_http2 marks it aborted, the module sees that within 100 ms, and the
    stage's next request starts right after the running one."""
    inst, port, cert = tls_apache
    before = _wait_table(inst)
    ctx = ssl.create_default_context(cafile=str(cert))
    took: dict[str, float] = {}
    def get(who: str, work: float) -> None:
        t0 = time.monotonic()
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/stage1?work={work}", timeout=60, context=ctx) as r:
            assert r.status == 200
        took[who] = time.monotonic() - t0
    capped = 'overtake_stage_{}{{stage="capped"}}'
    runner = threading.Thread(target=get, args=("runner", 1.0))
    runner.start()
    until(lambda: prio_status(inst)[capped.format("active")] == 1, "the runner counted")
    gone = subprocess.run(["curl", "--http2", "--cacert", str(cert), "-s", "-o", "/dev/null", "--max-time", "0.3",
                           "-w", "%{http_code}", "-H", "X-Request-Id: h2left",
                           f"https://127.0.0.1:{port}/stage1?work=1.0"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 28, gone  # curl's timeout: the stream was held, then left
    nxt = threading.Thread(target=get, args=("next", 0.1))
    nxt.start()
    runner.join(60)
    nxt.join(60)
    assert took["next"] < 1.0 + 0.5, took  # not behind the left stream's second of CPU
    st = settled(inst, NAMES)
    assert st[capped.format("dropped_total")] - before[capped.format("dropped_total")] == 1
    assert st[capped.format("hold_timeouts_total")] == before[capped.format("hold_timeouts_total")]
    assert st[capped.format("active")] == 0 and st[capped.format("waiting")] == 0
    log = (Path(inst.workdir) / "logs" / "access.log").read_text()
    assert re.search(r'"GET /stage1\?work=1\.0 HTTP/2\.0" 499 .* rid=h2left ', log), log[-2000:]
