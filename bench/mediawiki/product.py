"""Overtake on the wiki as the README's operator guide deploys it, by its own commands.

1. Measure the stages: the calibration's idle service times (Apache's ``%D`` of each article's
   preview and view, a quiet server) are fitted with ``overtake fit`` (``--structure hyperexp
   --order 2``, the demo's choice: ``--order auto`` picks orders the solver cannot afford).
2. Solve: a scenario with the trace's arrival rate, ``overtake solve --phase-info none
   --cpu-priority age`` (real clients send no phase header): the policy over counts, the
   predictions with age priority and the age threshold ``T`` (seconds: the fits are in seconds,
   ``classifier.time_unit: 1``).
3. Run: ``overtake sidecar`` in ``auto`` mode over the policy's directory, with ``--cpu-priority
   age`` and ``--control-file`` in front of an Apache loading mod_overtake_prio at ``T`` that maps
   that control file (the ``overtake`` arm: the module applies the thresholds the sidecar's policy
   carries, no hand-copying), or without it in front of a plain Apache (the ``sidecar`` arm,
   admission alone).

The stages file is the operator guide's for MediaWiki on SQLite: ``preview`` (``POST
/api.php?action=parse``, matched by method, path and query; followed by ``view`` on the same
connection) keyed on its body size (its cost grows with the wikitext), exempt from demotion
(``cpu_exempt: unsafe``: a write holds the database lock) and ``lock: 1`` (SQLite takes one
writer at a time, so the sidecar holds the others and releases the highest response ratio first);
``view`` (``GET /wiki/Title`` or ``GET /index.php?title=Title``); other requests pass through.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from overtake.controller.harness.apache import fetch_prio_status
from overtake.controller.harness.loadgen import http_request, sidecar_admin, wait_idle, wait_sidecar
from overtake.mdp import Policy

from .server import raise_autogroup

__all__ = ["Model", "Sidecar", "prepare_model", "start_sidecar", "stages_yaml", "stop_sidecar"]

CLI = [sys.executable, "-m", "overtake.api.cli"]
FIT_ARGS = ("--structure", "hyperexp", "--order", "2")
STAGES = ("preview", "view")


@dataclass(frozen=True)
class Model:
    """What ``overtake fit`` and ``overtake solve`` produced for one stack: the policy directory
    the sidecar runs, the age threshold (s), the policy's metadata, the fits, the seconds taken."""

    workdir: Path
    policy_dir: Path
    threshold_s: float
    meta: dict[str, Any]
    fits: dict[str, Any]
    seconds: float

    def summary(self) -> dict[str, Any]:
        m = self.meta
        age = m.get("cpu_priority", {}).get("age", {})
        return {"fit_args": list(FIT_ARGS), "threshold_s": self.threshold_s, "fits": self.fits, "solve_s": self.seconds,
                "predicted": {"pi(inf)": m.get("baselines", {}).get("pi(inf)"),
                              "none": m.get("metrics", {}).get("mean_response_time"),
                              "none+age": age.get("mean_response_time"), "passthrough+age": age.get("passthrough")}}


def _cli(*args: str, log: Path) -> None:
    with log.open("a") as out:
        out.write("$ overtake " + " ".join(args) + "\n")
        out.flush()
        proc = subprocess.run([*CLI, *args], stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`overtake {' '.join(args)}` failed (rc {proc.returncode}); log {log}:\n"
                           + "\n".join(log.read_text(errors="replace").splitlines()[-10:]))


def prepare_model(workdir: Path, samples: dict[str, np.ndarray], arrival_rate: float) -> Model:
    """Fit each stage's idle service times, write the scenario and solve (see the module docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, fits_dir, pol_dir = workdir / "overtake.log", workdir / "fits", workdir / "policies"
    t0 = time.monotonic()
    for stage in STAGES:
        f = workdir / f"{stage}.txt"
        f.write_text("".join(f"{x:.6f}\n" for x in samples[stage]))
        _cli("fit", str(f), *FIT_ARGS, "--out", str(fits_dir), log=log)
    scen = {"arrival_rate": float(arrival_rate), "tolerance": 0.005,
            "stages": [{"name": s, "service": {"file": str(fits_dir / f"{s}.json")}} for s in STAGES]}
    (workdir / "scenario.yaml").write_text(yaml.safe_dump(scen, sort_keys=False))
    pol_dir.mkdir(exist_ok=True)
    out = pol_dir / "none.npz"
    _cli("solve", str(workdir / "scenario.yaml"), "--phase-info", "none", "--cpu-priority", "age", "--out", str(out),
         "--quiet", log=log)
    meta = Policy.load(out).meta
    th = float(meta["cpu_priority"]["age"]["thresholds"][0][0])  # model time unit = 1 s
    fits = {s: json.loads((fits_dir / f"{s}.json").read_text()) for s in STAGES}
    return Model(workdir, pol_dir, th, meta, fits, time.monotonic() - t0)


PREVIEW_ROUTE = {"path": r"^/api\.php$", "query": "(^|&)action=parse(&|$)", "methods": ["POST"], "key": ["body_size"]}
VIEW_ROUTES = [{"path": "^/wiki/", "methods": ["GET", "HEAD"]},
               {"path": r"^/index\.php$", "query": "(^|&)title=", "methods": ["GET", "HEAD"]}]


#: mod_overtake_prio's age threshold under class priority alone (``OvertakePrioAge Off``): unused, required
CLASS_LEVEL_S = 30.0
#: the views' ``class_quantile`` of the operator guide's stages file for a wiki (docs/howto/php-sites.md)
GUIDE_CLASS_QUANTILE = 0.95


def stages_yaml(max_inflight: int, max_body_bytes: int, preview_lock: int | None = 1,
                view_lock: int | None = None, size_class: bool = False, class_quantile: float | None = None) -> str:
    """The stages file (module docstring): preview then view, ``auto`` classifier, generous queue
    limits (the bench counts a queue timeout as a failure, it does not want one); ``preview_lock``
    None leaves the lock key out; ``view_lock`` m admits at most m views into Apache at once,
    released highest response ratio first, predicted by the transaction link (a view is keyed on its preview's
    key, whose body size predicts it); ``size_class``: views keyed on the link too, so that
    ``--cpu-priority class`` sends the ones predicted largest at the low level
    (controller.sidecar.size_class), above the views' ``class_quantile`` (None: the sidecar's
    default)."""
    preview: dict[str, Any] = {"name": "preview", "routes": [PREVIEW_ROUTE], "next": "view", "cpu_exempt": "unsafe"}
    if preview_lock is not None:
        preview["lock"] = preview_lock
    view: dict[str, Any] = {"name": "view", "routes": VIEW_ROUTES}
    if view_lock is not None or size_class:
        view = {"name": "view", "routes": [r | {"key": ["link"]} for r in VIEW_ROUTES]}
    if view_lock is not None:
        view["lock"] = view_lock
    if size_class and class_quantile is not None:
        view["class_quantile"] = class_quantile
    doc = {"stages": [preview, view],
           "limits": {"max_inflight": max_inflight, "queue_cap": 100000, "queue_timeout": 600,
                      "upstream_timeout": 600, "client_timeout": 600, "max_body_bytes": max_body_bytes},
           "classifier": {"mode": "auto", "time_unit": 1.0, "auto_interval": 1}}
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass(frozen=True)
class Sidecar:
    """A running ``overtake sidecar``: its process, port, admin listener's port and log."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    admin: int

    def policy(self) -> dict[str, Any]:
        """``GET /-/policy``: what auto runs and why."""
        code, body = http_request("GET", f"http://127.0.0.1:{self.admin}/-/policy")
        return dict(json.loads(body)) if code == 200 else {"status": code}

    def metrics(self, prefixes: tuple[str, ...] = ("overtake_",)) -> dict[str, float]:
        """The sidecar's ``/-/metrics`` samples whose names start with ``prefixes``."""
        out: dict[str, float] = {}
        for line in http_request("GET", f"http://127.0.0.1:{self.admin}/metrics")[1].decode().splitlines():
            if line and not line.startswith("#") and line.startswith(prefixes):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out


def start_sidecar(workdir: Path, *, port: int, apache_port: int, model: Model, cpu_priority: str | None, core: int,
                  max_inflight: int, max_body_bytes: int, php_stats_file: Path | None = None,
                  control_file: str | None = None, preview_lock: int | None = 1,
                  view_lock: int | None = None, size_class: bool = False,
                  class_quantile: float | None = None) -> Sidecar:
    """``overtake sidecar`` in auto mode, pinned to ``core`` in a session (autogroup) of its own,
    raised like Apache's (a starved proxy delays every hand-off); ``cpu_priority``: its
    ``--cpu-priority`` (age, class, or None); ``control_file``: the one Apache's module maps
    (``--control-file``); ``size_class``: the stages file's views keyed for the class by size,
    demoted above ``class_quantile``."""
    workdir.mkdir(parents=True, exist_ok=True)
    stages = workdir / "stages.yaml"
    stages.write_text(stages_yaml(max_inflight, max_body_bytes, preview_lock, view_lock, size_class, class_quantile))
    log = workdir / "sidecar.log"
    args = ["taskset", "-c", str(core), *CLI, "sidecar", "--policy", str(model.policy_dir), "--apache",
            f"http://127.0.0.1:{apache_port}", "--listen", f"127.0.0.1:{port}", "--stages", str(stages)]
    admin, admin_flags, _ = sidecar_admin(workdir / "admin-token")  # metrics and policy on loopback
    args += admin_flags
    if cpu_priority is not None:
        args += ["--cpu-priority", cpu_priority]
    if control_file is not None:  # the policy's thresholds reach the module through it
        args += ["--control-file", control_file]
    if php_stats_file is not None:  # age priority inside php-fpm's workers: its counters
        args += ["--php-stats-file", str(php_stats_file)]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_sidecar(port, proc, log)
    except RuntimeError:
        proc.kill()
        proc.wait()
        raise
    raise_autogroup([proc.pid])
    return Sidecar(proc, port, log, admin)


def stop_sidecar(sc: Sidecar, timeout: float = 15.0) -> None:
    if sc.proc.poll() is None:
        try:
            wait_idle(sc.admin, timeout=5)
        except OSError:
            pass
        sc.proc.send_signal(signal.SIGTERM)
        try:
            sc.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            sc.proc.kill()
            sc.proc.wait()


def expect_size_class(sc: Sidecar, apache_port: int | None, timeout: float = 20.0) -> None:
    """Fail the arm unless ``--cpu-priority auto`` chose the size class and, where Apache's module
    has age levels and the control file (``apache_port``), the sidecar took age off through it
    (thresholds no request reaches): the arm is then the configuration it claims to be."""
    info = sc.policy()
    choice = info.get("cpu_priority_choice") or {}
    if info.get("cpu_priority") != "class":
        raise RuntimeError(f"sidecar --cpu-priority auto chose {info.get('cpu_priority')!r}, not class: "
                           f"{choice.get('reason')}; log {sc.log}")
    if apache_port is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        st = fetch_prio_status("127.0.0.1", apache_port)
        if st.thresholds and st.thresholds[0] > 3000:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the control file did not take age off within {timeout:g} s (threshold "
                               f"{st.thresholds} s in force); log {sc.log}")
        time.sleep(0.2)
