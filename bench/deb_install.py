"""The Debian package on a clean Debian 12: install it, follow the guide, serve requests through it.

    sudo .venv/bin/python bench/deb_install.py [--deb FILE] [--keep-root | --root DIR] [--json] [--no-write]

1. ``make deb`` (or ``--deb FILE``), then ``debootstrap --variant=minbase bookworm`` into a
   temporary root with the host's Debian mirror (/etc/apt/sources.list*), /proc and /dev/shm
   mounted in it.
2. ``apt-get install /tmp/overtake-server_*.deb`` inside it (chroot): the dependencies and
   recommends (python3.11, apache2) resolve from the mirror; no service starts (policy-rc.d).
3. As the unit's user, with a home that does not exist (a read-only tree for it): ``overtake
   solve`` of examples/table1/case01.yaml (must not import numba: the kernels were built ahead of
   time) and ``overtake fit`` of a sample (numba's JIT kernels: must compile into a folder it can
   write).
4. The guide (docs/install-debian.md): ``a2enmod remoteip status overtake_prio``, Apache moved to
   the configuration's ``apache:`` address with the shipped vhost example, the example stages file
   and the solved policy in /etc/overtake; plus a mod_lua handler burning 30 ms of CPU on /stage1
   and /stage2, so that mod_overtake_prio demotes them.
5. No systemd runs in a chroot: Apache starts with ``apache2ctl start``, the sidecar with the
   unit's ExecStart, Environment=, User=, AmbientCapabilities= and the directories systemd would
   make, all in a private network namespace (the configuration's own ports, 80 among them).
   Requests go through the sidecar to Apache; mod_overtake_prio's status page must count
   demotions; the sidecar's metrics must answer at the shipped scrape job's ``metrics_path``;
   SIGTERM must stop it with status 0.
6. ``apt-get remove`` keeps the configuration, logs and user; ``apt-get purge`` deletes them.

Needs root, the network (the mirror) and a few minutes. Prints the run's record and appends it to
bench/results/deb_install.jsonl unless ``--no-write``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from _report import append_run, run_record

ROOT = Path(__file__).resolve().parents[1]
SUITE = "bookworm"
UNIT = "/lib/systemd/system/overtake-sidecar.service"
#: the mod_lua handler: ~30 ms of CPU in the worker thread, above the shipped first level (5 ms)
BURN_LUA = """
function handle(r)
    local t0 = os.clock()
    local x = 0
    while os.clock() - t0 < 0.03 do x = x + 1 end
    r.content_type = "text/plain"
    r:puts("burned " .. r.uri .. "\\n")
    return apache2.OK
end
"""
#: run inside the network namespace with the host's Python: the HTTP checks, as JSON on stdout
CLIENT = r"""
import http.client, json, sys, time
admin_host, admin_port, metrics_path, apache_host, apache_port, listen_port = sys.argv[1:7]

def get(host, port, path, timeout=30):
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()

out = {}
t0 = time.monotonic()
while True:
    try:
        out["healthz"] = get(admin_host, admin_port, "/-/healthz", 5)
        if out["healthz"][0] == 200:
            break
    except OSError as exc:
        out["healthz"] = [0, str(exc)]
    if time.monotonic() - t0 > 180:
        print(json.dumps(out)); sys.exit(0)
    time.sleep(0.2)
out["ready_seconds"] = round(time.monotonic() - t0, 2)
out["through_sidecar"] = [[s, b[:80]] for s, b in (get("127.0.0.1", listen_port, p) for p in ("/stage1", "/stage2", "/stage1", "/"))]
status, text = get(admin_host, admin_port, metrics_path)
out["metrics"] = [status, sorted({l.split("{")[0].split(" ")[0] for l in text.splitlines()
                                  if l.startswith("overtake_")})]
out["prio_status"] = get(apache_host, apache_port, "/overtake-prio-status")
print(json.dumps(out))
"""


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise with its output's tail."""
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    return r


def chroot(root: Path, *cmd: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8",
            **(env or {})}
    if check:
        return sh(["chroot", str(root), *cmd], env=full)
    return subprocess.run(["chroot", str(root), *cmd], env=full, capture_output=True, text=True)


def mirrors() -> dict[str, str]:
    """The host's Debian archive and security archive URIs (deb822 or one-line sources)."""
    found: dict[str, str] = {}
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text()
        uris = re.findall(r"^URIs:\s*(\S+)", text, re.MULTILINE) + re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text,
                                                                            re.MULTILINE)
        for uri in uris:
            key = "security" if uri.rstrip("/").endswith("debian-security") else "debian" if "/debian" in uri else None
            if key and key not in found:
                found[key] = uri
    found.setdefault("debian", "http://deb.debian.org/debian")
    found.setdefault("security", "http://deb.debian.org/debian-security")
    return found


@contextmanager
def mounted(root: Path) -> Iterator[None]:
    (root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
    sh(["mount", "-t", "proc", "proc", str(root / "proc")])
    try:
        sh(["mount", "-t", "tmpfs", "-o", "mode=1777", "shm", str(root / "dev" / "shm")])
        try:
            yield
        finally:
            subprocess.run(["umount", "-l", str(root / "dev" / "shm")], check=False)
    finally:
        subprocess.run(["umount", "-l", str(root / "proc")], check=False)


@contextmanager
def netns(name: str) -> Iterator[list[str]]:
    """A private network namespace (its own loopback: the configuration's ports are free there)."""
    sh(["ip", "netns", "add", name])
    try:
        sh(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def processes_in(root: Path) -> list[int]:
    """Processes whose root directory is the chroot (only those this bench started run there)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "root") == str(root):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def parse_unit(text: str) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)=(.*)$", line)
        if m:
            keys.setdefault(m[1], []).append(m[2])
    return keys


def host_port(addr: str) -> tuple[str, str]:
    host, _, port = addr.removeprefix("http://").rstrip("/").rpartition(":")
    return host, port


def bootstrap(root: Path, uris: dict[str, str], doc: dict[str, Any]) -> None:
    t0 = time.monotonic()
    sh(["debootstrap", "--variant=minbase", SUITE, str(root), uris["debian"]])
    doc["seconds"]["debootstrap"] = round(time.monotonic() - t0, 1)
    (root / "etc" / "apt" / "sources.list").unlink(missing_ok=True)
    (root / "etc" / "apt" / "sources.list.d" / "debian.sources").write_text(
        f"Types: deb\nURIs: {uris['debian']}\nSuites: {SUITE} {SUITE}-updates\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        f"Types: deb\nURIs: {uris['security']}\nSuites: {SUITE}-security\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    shutil.copyfile("/etc/resolv.conf", root / "etc" / "resolv.conf")
    policy = root / "usr" / "sbin" / "policy-rc.d"  # packages start no service while installing
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)


def install(root: Path, deb: Path, doc: dict[str, Any]) -> None:
    shutil.copyfile(deb, root / "tmp" / deb.name)
    t0 = time.monotonic()
    chroot(root, "apt-get", "-q", "update")
    out = chroot(root, "apt-get", "-q", "install", "-y", f"/tmp/{deb.name}")
    doc["seconds"]["apt_install"] = round(time.monotonic() - t0, 1)
    doc["apt_newly_installed"] = int(m[1]) if (m := re.search(r"(\d+) newly installed", out.stdout)) else None
    q = chroot(root, "dpkg-query", "-W", "-f", "${Package} ${Version} ${Status}\n", "overtake-server", "apache2",
               "python3.11")
    doc["installed"] = q.stdout.strip().splitlines()
    doc["user"] = chroot(root, "getent", "passwd", "overtake", check=False).stdout.strip()
    log = root / "var" / "log" / "overtake"
    st = log.stat()
    doc["log_dir"] = f"{oct(st.st_mode & 0o7777)} uid {st.st_uid}"


def as_user(root: Path, user: str, argv: list[str], env: dict[str, str]) -> list[str]:
    return ["chroot", str(root), "setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--",
            "env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv]


def read_only_runs(root: Path, doc: dict[str, Any]) -> None:
    """solve (ahead-of-time kernels: no numba) and fit (numba's JIT) as the service user, no writable home."""
    shutil.copyfile(ROOT / "examples" / "table1" / "case01.yaml", root / "tmp" / "case01.yaml")
    shutil.copyfile(ROOT / "examples" / "demo" / "stage1.txt", root / "tmp" / "stage1.txt")
    shutil.rmtree(root / "tmp" / "work", ignore_errors=True)
    (root / "tmp" / "work").mkdir()
    os.chown(root / "tmp" / "work", int(chroot(root, "id", "-u", "overtake").stdout),
             int(chroot(root, "id", "-g", "overtake").stdout))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "TMPDIR": "/tmp/work", "OPENBLAS_NUM_THREADS": "1"}
    probe = ("import sys, time; from overtake.api.cli import main; t = time.monotonic(); rc = main(sys.argv[1:]); "
             "print(rc, 'numba' in sys.modules, round(time.monotonic() - t, 2))")
    runs = {"solve": ["solve", "/tmp/case01.yaml", "--out", "/tmp/work/policy.npz", "--quiet"],
            "fit": ["fit", "/tmp/stage1.txt", "--order", "2", "--out", "/tmp/work/fits"]}
    for name, args in runs.items():
        r = subprocess.run(as_user(root, "overtake", ["/opt/overtake/venv/bin/python", "-c", probe, *args], env),
                           capture_output=True, text=True)
        last = r.stdout.strip().splitlines()[-1].split() if r.stdout.strip() else []
        doc["read_only"][name] = {"exit": r.returncode, "cli_status": int(last[0]) if last else None,
                                  "numba_imported": last[1] == "True" if last else None,
                                  "seconds": float(last[2]) if last else None,
                                  "no_locator_error": "no locator" not in r.stderr,
                                  "stderr_tail": r.stderr.strip()[-400:]}
    caches = sorted(str(p.relative_to(root)) for p in (root / "tmp" / "work").glob("overtake-numba-*"))
    doc["read_only"]["numba_cache"] = caches
    doc["read_only"]["nbi_files"] = sum(1 for c in caches for _ in (root / c).rglob("*.nbi"))
    doc["read_only"]["written_in_opt"] = sorted(str(p) for p in (root / "opt").rglob("*.nb[ic]"))


def follow_the_guide(root: Path, config: dict[str, Any]) -> None:
    apache_host, apache_port = host_port(config["apache"])
    chroot(root, "a2enmod", "-q", "remoteip", "status", "overtake_prio", "lua")
    ports = root / "etc" / "apache2" / "ports.conf"
    ports.write_text(re.sub(r"^Listen 80$", f"Listen {apache_host}:{apache_port}", ports.read_text(), flags=re.MULTILINE))
    vhost = (root / "usr/share/overtake/examples/vhost-behind-sidecar.conf").read_text()
    vhost = vhost.replace("127.0.0.1:8081", f"{apache_host}:{apache_port}")
    (root / "etc/apache2/sites-available/vhost-behind-sidecar.conf").write_text(vhost)
    chroot(root, "a2dissite", "-q", "000-default")
    chroot(root, "a2ensite", "-q", "vhost-behind-sidecar")
    # the bench's CPU-bound stages (a site's own pages in real use)
    (root / "var/www/burn.lua").write_text(BURN_LUA)
    (root / "etc/apache2/conf-available/overtake-bench.conf").write_text(
        'LuaMapHandler "^/stage[12]$" /var/www/burn.lua handle\n')
    chroot(root, "a2enconf", "-q", "overtake-bench")
    chroot(root, "apache2ctl", "configtest")
    etc = root / "etc" / "overtake"
    shutil.copyfile(root / "usr/share/overtake/examples/stages.yaml", etc / config["stages"])
    shutil.copyfile(root / "tmp/work/policy.npz", etc / config["policy"])


def serve(root: Path, ns: list[str], config: dict[str, Any], doc: dict[str, Any]) -> None:
    unit = parse_unit((root / UNIT.lstrip("/")).read_text())
    user = unit["User"][0]
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "HOME": chroot(root, "getent", "passwd", user).stdout.split(":")[5], "USER": user, "LOGNAME": user}
    for line in unit["Environment"]:
        env.update(dict(kv.split("=", 1) for kv in shlex.split(line)))
    for key, var in (("LogsDirectory", "LOGS_DIRECTORY"), ("StateDirectory", "STATE_DIRECTORY"),
                     ("CacheDirectory", "CACHE_DIRECTORY")):
        base = {"LOGS_DIRECTORY": "/var/log", "STATE_DIRECTORY": "/var/lib", "CACHE_DIRECTORY": "/var/cache"}[var]
        for d in unit.get(key, []):
            path = f"{base}/{d}"
            chroot(root, "install", "-d", "-o", user, "-g", unit["Group"][0], "-m", "0750", path)
            env[var] = path
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], w) for w in shlex.split(unit["ExecStart"][0])]
    caps = [c.lower().removeprefix("cap_") for line in unit.get("AmbientCapabilities", []) for c in line.split()]
    capflags = [f"--inh-caps={','.join('+' + c for c in caps)}", f"--ambient-caps={','.join('+' + c for c in caps)}"]
    doc["sidecar_command"] = shlex.join(argv)
    apache_host, apache_port = host_port(config["apache"])
    admin_host, admin_port = host_port(config["admin_listen"])
    listen_port = host_port(config["listen"])[1]
    scrape = yaml.safe_load((root / "usr/share/overtake/dashboards/prometheus-scrape.yml").read_text())
    metrics_path = scrape["scrape_configs"][0]["metrics_path"]
    sh([*ns, "chroot", str(root), "apache2ctl", "start"])
    side_log = (root / "tmp" / "sidecar.log").open("w")
    cmd = [*ns, "chroot", str(root), "setpriv", f"--reuid={user}", f"--regid={unit['Group'][0]}", "--init-groups",
           *capflags, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv]
    side = subprocess.Popen(cmd, stdout=side_log, stderr=subprocess.STDOUT)  # ip/chroot/setpriv/env exec: its pid
    try:
        t0 = time.monotonic()
        r = sh([*ns, sys.executable, "-c", CLIENT, admin_host, admin_port, metrics_path, apache_host, apache_port,
                listen_port], timeout=300)
        doc["http"] = json.loads(r.stdout)
        doc["seconds"]["sidecar_ready"] = round(time.monotonic() - t0, 1)
        side.send_signal(getattr(signal, unit.get("KillSignal", ["SIGTERM"])[0]))
        doc["sidecar_exit"] = side.wait(float(unit.get("TimeoutStopSec", ["45"])[0]))
    finally:
        if side.poll() is None:
            side.kill()
            side.wait()
        side_log.close()
        subprocess.run([*ns, "chroot", str(root), "apache2ctl", "stop"], capture_output=True)
    doc["sidecar_log_tail"] = (root / "tmp" / "sidecar.log").read_text()[-1500:]
    log = root / config["request_log"].lstrip("/")
    doc["request_log_lines"] = len(log.read_text().splitlines()) if log.exists() else 0


def remove_and_purge(root: Path, doc: dict[str, Any]) -> None:
    def state() -> dict[str, bool]:
        return {"user": bool(chroot(root, "getent", "passwd", "overtake", check=False).stdout.strip()),
                "config": (root / "etc/overtake/sidecar.yaml").exists(),
                "logs": (root / "var/log/overtake").exists(),
                "program": (root / "opt/overtake").exists(),
                "module_so": (root / "usr/lib/apache2/modules/mod_overtake_prio.so").exists()}

    chroot(root, "apt-get", "-q", "remove", "-y", "overtake-server")
    doc["after_remove"] = state()
    chroot(root, "apt-get", "-q", "purge", "-y", "overtake-server")
    doc["after_purge"] = state()


def prio_counts(text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(overtake_cpu_prio_(?:demotions|requests)_total)\{([^}]*)\}\s+(\S+)", line)
        if m:
            key = f"{m[1]}{{{m[2]}}}"
            counts[key] = counts.get(key, 0.0) + float(m[3])
    return counts


def checks(doc: dict[str, Any]) -> dict[str, bool]:
    http = doc.get("http", {})
    through = http.get("through_sidecar", [])
    prio = prio_counts(http.get("prio_status", [0, ""])[1]) if http.get("prio_status") else {}
    demoted = sum(v for k, v in prio.items() if k.startswith("overtake_cpu_prio_demotions_total") and 'cause="age"' in k)
    doc["prio_counters"] = prio
    ro = doc.get("read_only", {})
    return {
        "installed": any(line.startswith("overtake-server ") and line.endswith("installed") for line in doc.get("installed", [])),
        "system_user": doc.get("user", "").startswith("overtake:"),
        "solve_without_numba": ro.get("solve", {}).get("cli_status") == 0 and ro.get("solve", {}).get("numba_imported") is False,
        "fit_jit_read_only": ro.get("fit", {}).get("cli_status") == 0 and ro.get("nbi_files", 0) > 0
                             and not ro.get("written_in_opt"),
        "served_through_sidecar": len(through) >= 3 and all(s == 200 and "burned" in b for s, b in through[:3]),
        "demoted_in_apache": demoted >= 1,
        "metrics_at_scrape_path": http.get("metrics", [0])[0] == 200 and "overtake_policy_info" in http.get("metrics", [0, []])[1],
        "request_log_written": doc.get("request_log_lines", 0) >= 3,
        "sigterm_exit_0": doc.get("sidecar_exit") == 0,
        "remove_keeps": doc.get("after_remove", {}) == {"user": True, "config": True, "logs": True, "program": False,
                                                        "module_so": False},
        "purge_deletes": doc.get("after_purge", {}) == {"user": False, "config": False, "logs": False, "program": False,
                                                        "module_so": False},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deb", type=Path, help="the package to install (default: make deb)")
    ap.add_argument("--keep-root", action="store_true", help="leave the Debian root for inspection")
    ap.add_argument("--root", type=Path, help="reuse the Debian root an earlier --keep-root run left (no debootstrap)")
    ap.add_argument("--json", action="store_true", help="print the record as JSON (default: a summary)")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/results/deb_install.jsonl")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("deb_install: needs root (debootstrap, chroot, mounts, a network namespace)", file=sys.stderr)
        return 2
    sh(["sh", str(ROOT / "apache-conf" / "install-debian-packages.sh"), "debootstrap", "iproute2", "util-linux"])
    if args.deb is None:
        sh(["make", "-C", str(ROOT), "deb"])
        arch = sh(["dpkg", "--print-architecture"]).stdout.strip()
        version = re.search(r"^version *= *(\S+)", (ROOT / "setup.cfg").read_text(), re.MULTILINE)[1]  # type: ignore[index]
        args.deb = ROOT / "dist" / f"overtake-server_{version}_{arch}.deb"
    deb = args.deb.resolve()
    doc: dict[str, Any] = {"bench": "deb_install", "deb": deb.name, "deb_bytes": deb.stat().st_size,
                           "installed_size_kib": int(sh(["dpkg-deb", "-f", str(deb), "Installed-Size"]).stdout),
                           "suite": SUITE, "mirrors": mirrors(), "seconds": {}, "read_only": {}}
    root = args.root.resolve() if args.root else Path(tempfile.mkdtemp(prefix="overtake-deb-root-", dir="/var/tmp"))
    root.chmod(0o755)  # its "/": the service user must reach the system's files
    failure = None
    try:
        if args.root is None:
            bootstrap(root, doc["mirrors"], doc)
        with mounted(root):
            try:
                install(root, deb, doc)
                read_only_runs(root, doc)
                config = yaml.safe_load((root / "etc/overtake/sidecar.yaml").read_text())
                follow_the_guide(root, config)
                with netns(f"s17-deb-bench-{os.getpid()}") as ns:
                    serve(root, ns, config, doc)
                remove_and_purge(root, doc)
            finally:
                for pid in processes_in(root):  # anything still running in the chroot was started here
                    os.kill(pid, signal.SIGKILL)
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        failure = str(exc)
    finally:
        if args.keep_root or args.root:
            doc["root"] = str(root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    doc["failure"] = failure
    doc["checks"] = checks(doc)
    doc["ok"] = failure is None and all(doc["checks"].values())
    if not args.no_write:
        append_run("deb_install", run_record(doc))
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{doc['deb']} ({doc['deb_bytes'] / 2**20:.0f} MiB, installed {doc['installed_size_kib'] / 1024:.0f} MiB) "
              f"on a fresh Debian 12 ({SUITE}, minbase): {'ok' if doc['ok'] else 'FAILED'}")
        print("seconds: " + ", ".join(f"{k} {v}" for k, v in doc["seconds"].items()))
        for name, ok in doc["checks"].items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
        if failure:
            print(f"failure: {failure}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
