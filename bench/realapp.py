"""A real application: MediaWiki on SQLite, Apache's default against Overtake and its peers.

    python bench/realapp.py --php prefork|fpm [--runs N] [--minutes M | --transactions T] [--arms a,b] [--json] [--no-write]

Set-up (the bench's own, not ``make test``; as root): Debian's MediaWiki, PHP and mod_qos
packages (bench/mediawiki/install-packages.sh, run when one is missing unless --no-setup), and
a wiki on SQLite in --data-dir whose articles follow a seeded recipe with heavy-tailed cost
(bench/mediawiki/pages.py; rebuilt only when the recipe or the settings change). MediaWiki is
set up as an operator would run it on one server (object caches in APCu, no jobs at the end of
requests; bench/mediawiki/wiki.py's SETTINGS say why) but for the parser cache: off, so every
request renders.

Stacks (--php): ``prefork`` = mpm_prefork + mod_php, ``fpm`` = mpm_event + proxy_fcgi to a private
php-fpm (Debian's pool defaults); a private Apache per arm and run from the bench's own config
(bench/mediawiki/httpd.conf.in, Debian's MPM defaults), pinned with php-fpm to the last core at
autogroup nice -20; the client and the sidecar on the first core.

Calibration (once per invocation, or the last one with --reuse-calibration): on an idle default
server, each article's preview and view in turn, in --cal-reps passes; the median of Apache's %D
over the passes is the article's idle service time.
They give the trace's arrival rate (--load / mean(preview + view)), the fits Overtake solves
with, and the wiki's structure (service floor, cost per section, preview-view correlation, and a
serialisation probe: four identical requests at once, mean completion over the last, about 1
under processor sharing, 0.625 when they run one at a time).

Workload: open-loop Poisson transactions, each a preview (``POST /api.php?action=parse`` of the
article's wikitext) then its view (``GET /wiki/Title``) on one connection, the article uniform.
The response time runs from the scheduled arrival to the view's last byte. A failure is a non-2xx
answer, a MediaWiki API error, a reset or a --timeout.

Blocks (the machine's speed drifts between minutes more than the effects measured): run k
(0-based) draws one trace (seed --seed + k) and brings every arm's stack up at once, each its own
private Apache (and php-fpm, and sidecar) on the same pinned core, only one receiving traffic at a
time. The trace is cut into blocks of about --block transactions; each block is replayed under
every arm in turn, its arrivals shifted to start at once on an idle server, the arms' order
alternating from block to block (A B, B A, ...; rotated by k), so that a drift linear in time
cancels between the arms. The gain is paired per transaction and its CI is over the blocks
(bench/mediawiki/stats.py). Per block and arm the CPU seconds the arm's Apache and php-fpm used
(``cpu_blocks``; ``cpu_drift``: each arm's over the first arm's, block by block). A run lasts
about arms x transactions / arrival rate (the rate is printed after the calibration), plus the
stacks' start and every block's drain.

Power: a gain's CI over blocks has a half-width of about t(blocks - 1) x (the per-block gain's
deviation) / sqrt(blocks), and that deviation grows as 1/sqrt(block length) (a block's gain
averages its transactions), so for a given run length the half-width falls as
1/sqrt(transactions) and shorter blocks only buy degrees of freedom (t(3) = 3.18 with four
blocks, 2.05 with thirty) and a finer cancellation of the drift. Hence the defaults: blocks of 30
and as many transactions as --minutes of replay gives (the arrival rate x minutes / arms, rounded
to whole blocks), rather than a fixed count whose duration depends on the wiki's speed.

Arms: ``default`` (Apache's default, no Overtake), ``overtake`` (the operator guide's deployment
for a PHP site, docs/howto/php-sites.md: the sidecar in ``auto`` mode with ``--cpu-priority auto``
over the policies ``overtake solve --phase-info none --cpu-priority age`` gives, the stages file
matching previews and views by method, path and query, keying previews on their body size and
views on the transaction link, previews exempt from demotion with ``lock: 1``, views'
``class_quantile`` 0.95; in front of an Apache with mod_overtake_prio at the solved age threshold,
level 1 at nice 19, and the sidecar's control file. Auto chooses the size class there, the views
keyed on the link predicting their sizes, and takes age off through the control file; the bench
fails the arm unless both happened; bench/mediawiki/product.py), ``overtake_age`` (the same with
``--cpu-priority age``, views unkeyed and level 1 at SCHED_IDLE: the previous deployment, age
priority from the control file), ``age`` (the module alone at the solved threshold; under
``fpm``, where the CPU runs in php-fpm's workers out of the module's reach, the overtake_prio PHP
extension in the pool at the same threshold replaces the module in the age arms, and with
``overtake_prio.class_header`` in the class arms), ``sidecar`` (the sidecar in
auto mode in front of a plain Apache: admission alone; with --view-lock m the sidecar arms also
hold views to m at a time in Apache, released by response ratio, predicted by the transaction link), ``modqos`` (mod_qos,
``QS_LocRequestLimitMatch`` of --qos-cap per stage; it rejects beyond the cap) and ``sizeclass``
(the sidecar with ``--cpu-priority class``: views keyed on the
transaction link, those predicted above the views' ``class_quantile`` started at nice 19 by
mod_overtake_prio with ``OvertakePrioAge Off``; controller/sidecar/size_class.py; under php-fpm, where the module
cannot reach the CPU, the overtake_prio extension in the pool reads the same header,
``overtake_prio.class_header``, and counts the requests it started low in
``overtake_php_class_low_requests_total``). The sizeclass arm's quantile is the one the size-class model
predicts best on the calibrated wiki (bench/mediawiki/class_model.py: an event simulation of the
lock and the CPU weights on the articles' idle times; every quantile's predicted mean and gain
in ``model.size_class``), or --class-quantile.

Where the probe says previews run one at a time, the document's ``model.lock`` holds the model
with the database lock's predictions for the arms (bench/mediawiki/lock_model.py): the preview
stage holds a lock of capacity 1, a preview started while another holds it waits in its worker.

Figures per arm: mean and p99 response time (successful transactions after a 5 % warm-up),
failures, CPU seconds in Apache and php-fpm, the module's and the sidecar's counters, what
Apache saw (time per stage, slowdown against the idle time, previews that overlapped another
preview apart) and where the time went (``time_split``, bench/mediawiki/split.py: outside Apache
— the sidecar's queue —, blocked — SQLite's lock under mod_php —, run-queue wait and CPU, per
stage and article size; every arm loads mod_overtake_prio's request-time split, the arms without
its priority as a meter with ``OvertakePrio Off``, unless --no-split); per run the paired gain of
every arm over ``default`` with its 95 % CI over the blocks — ``gain`` / ``gain_ci95`` are
``overtake``'s —, the model with the lock's prediction against the measured mean per arm
(``predicted``: under the rollback journal the default's with the views as the lock's readers,
simulated; the size-class arms' replayed in the bench's blocks from an idle server), the run's own trace replayed in the model of SQLite's locking
(``predicted_trace``, bench/mediawiki/sqlite_model.py: start-up outside the locks, a writer's commit
waiting for the running readers, the busy handler's retries; each arm's measured CPU per
transaction over the idle time of the same transactions as its demand, and for the other arms
also the default's) for Apache's default and the size-class arms, each arm's p99 over the
default's with a block-bootstrap interval, and over the runs the spread; ``db_written``: the
wiki's SQLite databases the runs wrote to (none with the bench's settings: a preview's
transaction changes nothing). ``--journal wal`` runs the whole bench with the wiki's database in
write-ahead-log mode (a preview's commit then waits for no view; the trace model likewise), put
back afterwards. ``--reanalyse DATE`` runs nothing and recomputes the trace model and the gains of
a recorded run. Raw runs go to bench/results/realapp.jsonl unless --no-write (no BENCHMARKS.md
section).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _report import append_run, halt_polling, read_runs, run_record
from mediawiki import class_model, lock_model, product, server, split, sqlite_model, stats, wiki, workload
from mediawiki.pages import Recipe, article_title, draw_units

from overtake.controller.harness import php_fpm
from overtake.controller.harness.apache import CpuPriority, fetch_prio_status
from overtake.controller.harness.apache.lifecycle import children
from overtake.controller.harness.scratch import free_port, scratch_dir
from overtake.controller.php_prio import read_counts

ARMS = ("default", "overtake", "age", "sidecar", "modqos", "sizeclass", "overtake_age")
SIDECAR_INFLIGHT = 120  # the sidecar's max_inflight: below Apache's MaxRequestWorkers (150)


@dataclass(frozen=True)
class Arm:
    """What one arm runs: mod_overtake_prio at the solved threshold, the sidecar (and whether it
    is told about the module), mod_qos caps."""

    module: bool = False
    sidecar: bool = False
    qos: bool = False
    #: the sidecar's CPU class from each view's predicted size (--cpu-priority class) instead of age
    size_class: bool = False
    #: the sidecar chooses its CPU priority (--cpu-priority auto) over the guide's stages file
    auto: bool = False

    @property
    def needs_model(self) -> bool:
        return self.module or self.sidecar


ARM_SPECS = {"default": Arm(), "overtake": Arm(module=True, sidecar=True, size_class=True, auto=True),
             "age": Arm(module=True), "sidecar": Arm(sidecar=True), "modqos": Arm(qos=True),
             "sizeclass": Arm(module=True, sidecar=True, size_class=True),
             "overtake_age": Arm(module=True, sidecar=True)}


def say(msg: str) -> None:
    print(f"realapp: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- set-up


def ensure_setup(args: argparse.Namespace, recipe: Recipe) -> dict[str, Any]:
    """Packages (their script, unless --no-setup) and the wiki of ``recipe``; its stamp."""
    if wiki.missing_packages():
        if args.no_setup:
            raise SystemExit(f"realapp: packages missing: {' '.join(wiki.missing_packages())}; run "
                             f"`sh {wiki.PACKAGES_SCRIPT}` as root (or drop --no-setup)")
        say(f"installing Debian packages: {' '.join(wiki.missing_packages())}")
        if subprocess.run(["sh", str(wiki.PACKAGES_SCRIPT)], stdout=sys.stderr, check=False).returncode != 0:
            raise SystemExit(f"realapp: {wiki.PACKAGES_SCRIPT} failed")
    try:
        return wiki.ensure_wiki(Path(args.data_dir), recipe, say=say)
    except wiki.WikiNotInstalled as exc:
        raise SystemExit(f"realapp: {exc}") from None


def transactions(data_dir: Path, recipe: Recipe) -> list[workload.Transaction]:
    """Every article's transaction, from the wikitext the set-up imported."""
    adir = data_dir / "pages" / "articles"
    out = []
    for i in range(recipe.articles):
        title = article_title(i)
        out.append(workload.Transaction(title, workload.preview_body(title, (adir / title).read_text())))
    return out


@dataclass
class Bench:
    """What every arm of every run shares: the options, the wiki's transactions and sizes, the
    calibration's idle service times, Overtake's model, the scratch directory."""

    args: argparse.Namespace
    tmp: Path
    txs: list[workload.Transaction]
    units: np.ndarray
    idle_preview: np.ndarray = field(default_factory=lambda: np.zeros(0))
    idle_view: np.ndarray = field(default_factory=lambda: np.zeros(0))
    model: product.Model | None = None
    #: the sizeclass arm's class_quantile (the model's choice, or --class-quantile)
    class_quantile: float | None = None

    @property
    def max_body(self) -> int:
        """The sidecar's ``max_body_bytes``: room for the largest preview (default 1 MiB)."""
        return max(1 << 20, 2 * max(len(t.body) for t in self.txs))


# --------------------------------------------------------------------------- servers


@contextlib.contextmanager
def arm_server(name: str, b: Bench, where: Path,
               meter: bool = False) -> Iterator[tuple[int, server.Server, product.Sidecar | None]]:
    """The arm's private Apache (and sidecar) for one run; yields the port clients use.
    ``meter``: mod_overtake_prio's request-time split in Apache's log (--split)."""
    spec, args = ARM_SPECS[name], b.args
    cp, php_ini, php_stats, control = None, None, None, None
    wd = where / f"{name}-{time.monotonic_ns()}"
    if spec.module and args.php == "fpm":
        # the CPU runs in php-fpm's workers, out of the module's reach: the PHP extension there,
        # at the age threshold or, for the size class, starting the sidecar's class 1 at nice 19
        assert b.model is not None
        wd.mkdir(parents=True)
        wd.chmod(0o755)
        php_stats = wd / "php-prio.stats"
        php_ini = (server.php_class_settings(php_extension(where), php_stats) if spec.size_class
                   else server.php_prio_settings(php_extension(where), b.model.threshold_s, php_stats))
    elif spec.auto:  # the guide's Apache: age levels at nice 19 and the control file; the sidecar chooses
        assert b.model is not None
        control = f"/dev/shm/overtake-realapp-control-{os.getpid()}-{time.monotonic_ns()}"
        cp = CpuPriority(levels=(b.model.threshold_s,), nice=(19,), control_file=control)
    elif spec.size_class:  # no age levels: the sidecar's class header alone, nice 19 (bounded)
        cp = CpuPriority(levels=(product.CLASS_LEVEL_S,), nice=(19,), age=False)
    elif spec.module:
        assert b.model is not None
        if spec.sidecar:  # the module takes the sidecar's thresholds from its control file
            control = f"/dev/shm/overtake-realapp-control-{os.getpid()}-{time.monotonic_ns()}"
        cp = CpuPriority(levels=(b.model.threshold_s,), nice=("idle",), control_file=control)
    srv = server.start(wd, php=args.php, port=free_port(), core=args.server_core, data_dir=Path(args.data_dir),
                       cpu_priority=cp, qos_cap=args.qos_cap if spec.qos else None, php_ini=php_ini,
                       request_times=meter)
    sc = None
    try:
        if spec.sidecar:
            assert b.model is not None
            sc = product.start_sidecar(wd / "sidecar", port=free_port(), apache_port=srv.port, model=b.model,
                                       cpu_priority=sidecar_priority(spec, cp),
                                       core=args.client_core,
                                       max_inflight=SIDECAR_INFLIGHT, max_body_bytes=b.max_body,
                                       php_stats_file=php_stats, control_file=control,
                                       preview_lock=args.preview_lock or None, view_lock=args.view_lock or None,
                                       size_class=spec.size_class,
                                       class_quantile=product.GUIDE_CLASS_QUANTILE if spec.auto else b.class_quantile)
            if spec.auto:
                product.expect_size_class(sc, srv.port if cp is not None and cp.control_file else None)
        yield (sc.port if sc else srv.port), srv, sc
    finally:
        try:
            if sc is not None:
                product.stop_sidecar(sc)
        finally:
            server.stop(srv)
            for p in ([control, control + ".key"] if control else []):
                Path(p).unlink(missing_ok=True)


def sidecar_priority(spec: Arm, cp: CpuPriority | None) -> str | None:
    """The sidecar's --cpu-priority: ``class`` for the size class (mod_overtake_prio or, under
    php-fpm, the PHP extension reads its header), ``age`` where mod_overtake_prio applies the
    policy's thresholds from the control file, else none."""
    if spec.auto:
        return "auto"
    if spec.size_class:
        return "class"
    return "age" if cp is not None else None


def php_extension(where: Path) -> Path:
    """The overtake_prio PHP extension, built once per bench run under ``where``."""
    so = where / "php-prio" / "build" / "modules" / "overtake_prio.so"
    if not so.exists():
        built = php_fpm.build_extension(where / "php-prio")
        assert built == so, built
    return so


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of ``pids`` and of their reaped children, seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(x) for x in f[11:15])  # utime, stime, cutime, cstime
    return total / tick


def stack_cpu(srv: server.Server) -> dict[str, float]:
    """CPU seconds so far in Apache's processes and in php-fpm's (where the PHP work runs)."""
    out = {"apache": cpu_seconds([srv.apache_pid, *children(srv.apache_pid)])}
    if srv.fpm is not None:
        out["php_fpm"] = cpu_seconds([srv.fpm.pid, *children(srv.fpm.pid)])
    return out


def foreign_servers(core: int, ours: set[int]) -> int:
    """Other Apache and php-fpm processes that may run on ``core``: other jobs' servers, often
    at the same raised autogroup priority as ours, share the core with the one measured."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in ours:
            continue
        try:
            if (d / "comm").read_text().strip() in ("apache2", "php-fpm8.2") and core in os.sched_getaffinity(int(d.name)):
                n += 1
        except OSError:
            continue
    return n


# --------------------------------------------------------------------------- calibration


def warm_up(port: int, b: Bench, n: int = 6) -> None:
    """A few sequential transactions of the smallest articles: PHP's opcode cache, MediaWiki's
    localisation and the sidecar's connections warm before anything is measured."""
    small = [int(i) for i in np.argsort(b.units, kind="stable")[:n]]
    for k, i in enumerate(small):
        res, _, _ = asyncio.run(workload.run_one("127.0.0.1", port, b.txs[i], f"warm-{k}"))
        if res != workload.OK:
            raise SystemExit(f"realapp: warm-up transaction on {article_title(i)} failed: {res}")


def calibrate(b: Bench) -> dict[str, Any]:
    """Idle service times of every article's preview and view (Apache's %D, s), their structure
    and the serialisation probe, on a default server of the stack.

    --cal-reps passes over all articles, one after another (a passing disturbance from other
    jobs hits one pass of a few articles, not every pass of one), and each article's time is the
    median of its passes."""
    reps, n = b.args.cal_reps, len(b.txs)
    client = np.full((reps, n, 2), np.nan)
    with arm_server("default", b, b.tmp / "calibration") as (port, srv, _):
        warm_up(port, b)
        for rep in range(reps):
            for i, tx in enumerate(b.txs):
                res, tp, tv = asyncio.run(workload.run_one("127.0.0.1", port, tx, f"cal-{i}-{rep}"))
                if res != workload.OK:
                    raise SystemExit(f"realapp: calibration of {tx.title} failed: {res}")
                client[rep, i] = tp, tv
        probe_i = int(np.argsort(b.units, kind="stable")[len(b.units) // 2])  # a median article
        probe = workload.serialisation_probe(port, b.txs[probe_i], k=4, rounds=3)
        log = [x for x in server.read_access(srv.workdir) if x.rid and x.rid.startswith("cal-")]
    apache = np.full((reps, n, 2), np.nan)
    for x in log:
        assert x.rid is not None
        _, i, rep, stage = x.rid.split("-")
        apache[int(rep), int(i), 0 if stage == "p" else 1] = x.duration_us / 1e6
    if np.isnan(apache).any():
        raise SystemExit("realapp: calibration: the access log lacks some requests")
    idle, cl = np.median(apache, axis=0), np.median(client, axis=0)
    return structure(idle[:, 0], idle[:, 1], b.units) | {
        "preview_s": idle[:, 0].tolist(), "view_s": idle[:, 1].tolist(), "client_preview_s": cl[:, 0].tolist(),
        "client_view_s": cl[:, 1].tolist(), "serialisation_probe": probe | {"k": 4, "article": article_title(probe_i)},
        "reps": reps, "pass_spread": pass_spread(apache), "php": b.args.php,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def pass_spread(x: np.ndarray) -> dict[str, float] | None:
    """How much the calibration's passes disagree: per stage the median over articles of
    (max - min) / median of an article's passes (None with one pass)."""
    if x.shape[0] < 2:
        return None
    rel = (x.max(axis=0) - x.min(axis=0)) / np.median(x, axis=0)
    return {"preview": float(np.median(rel[:, 0])), "view": float(np.median(rel[:, 1]))}


def structure(preview: np.ndarray, view: np.ndarray, units: np.ndarray) -> dict[str, Any]:
    """What the model needs to know of the wiki's service times: per stage mean, scv, floor,
    quantiles and a linear fit of cost on the article's sections; the stages' correlation."""
    out: dict[str, Any] = {}
    for name, x in (("preview", preview), ("view", view)):
        slope, intercept = np.polyfit(units.astype(float), x, 1)
        out[name] = {"mean": float(x.mean()), "scv": float(x.var() / x.mean() ** 2), "min": float(x.min()),
                     "p50": float(np.median(x)), "p99": float(np.percentile(x, 99)), "max": float(x.max()),
                     "per_section_s": float(slope), "intercept_s": float(intercept)}
    rank = np.argsort(np.argsort(preview)), np.argsort(np.argsort(view))
    out["correlation"] = {"pearson": float(np.corrcoef(preview, view)[0, 1]),
                          "spearman": float(np.corrcoef(*rank)[0, 1])}
    return out


def calibration(b: Bench, stamp: dict[str, Any]) -> dict[str, Any]:
    """The calibration: measured now, or with --reuse-calibration the last one of this stack and
    wiki (``DATA/calibration-<php>.json``) when there is one."""
    journal = "" if b.args.journal == "delete" else f"-{b.args.journal}"
    saved = Path(b.args.data_dir) / f"calibration-{b.args.php}{journal}.json"
    if b.args.reuse_calibration:
        try:
            cal = dict(json.loads(saved.read_text()))
            if cal.get("fingerprint") == stamp["fingerprint"] and cal.get("settings") == stamp.get("settings"):
                say(f"calibration: reusing {saved} ({cal.get('date')})")
                return cal | {"reused": str(saved)}
        except (OSError, ValueError):
            pass
        say(f"calibration: nothing to reuse for this wiki and its settings in {saved}; measuring")
    say(f"calibration: {len(b.txs)} articles' preview and view on an idle {b.args.php} server")
    cal = calibrate(b) | {"fingerprint": stamp["fingerprint"], "settings": stamp.get("settings")}
    saved.write_text(json.dumps(cal) + "\n")
    return cal


# --------------------------------------------------------------------------- runs


@dataclass
class Live:
    """One arm's stack, up for the whole run: the port its clients use, Apache (and php-fpm), the
    sidecar; what its replays gave so far and the CPU each block took."""

    port: int
    srv: server.Server
    sc: product.Sidecar | None
    got: workload.Replayed
    cpu_blocks: list[dict[str, float]] = field(default_factory=list)


def replay_block(live: Live, lo: int, hi: int, k: int, b: Bench, trace: dict[str, np.ndarray]) -> None:
    """Transactions ``lo`` to ``hi`` of run ``k``'s trace against one arm, its arrivals shifted to
    start at once (the stack is idle: every earlier block has finished); the CPU its stack used."""
    sub = {"arrival": trace["arrival"][lo:hi] - trace["arrival"][lo], "article": trace["article"][lo:hi]}
    c0, t0 = stack_cpu(live.srv), time.monotonic()
    r = workload.replay(live.port, sub, b.txs, tag=f"r{k}", first=lo, timeout=b.args.timeout)
    c1 = stack_cpu(live.srv)
    live.got.rt[lo:hi], live.got.outcomes[lo:hi], live.got.stages[lo:hi] = r.rt, r.outcomes, r.stages
    live.cpu_blocks.append({p: c1[p] - c0[p] for p in c0} | {"wall_s": time.monotonic() - t0})


def arm_figures(name: str, k: int, live: Live, b: Bench, trace: dict[str, np.ndarray]) -> dict[str, Any]:
    """The arm's figures once its run is over: times, failures, CPU, counters, what Apache saw."""
    srv, sc = live.srv, live.sc
    extra: dict[str, Any] = {"cpu_s": stack_cpu(srv), "cpu_blocks": live.cpu_blocks}
    if sc is not None:
        extra["sidecar_policy"] = sc.policy()
        extra["sidecar_metrics"] = {m: v for m, v in sc.metrics().items()
                                    if not any(x in m for x in ("_bucket{", "_created{"))}
    if srv.cpu_priority is not None:
        st = fetch_prio_status("127.0.0.1", srv.port)
        extra["prio"] = {"threshold_s": srv.cpu_priority.levels[0], "requests": list(st.requests),
                         "demotions_age": list(st.demotions_age), "demotions_class": list(st.demotions_class),
                         "restore_errors": st.restore_errors,
                         "exempt_header": st.exempt_header}
    php_stats = srv.workdir / "php-prio.stats"
    if php_stats.exists():  # the overtake_prio extension in php-fpm's workers
        c = read_counts(php_stats)
        extra["php_prio"] = None if c is None else dataclasses.asdict(c)
    log = [x for x in server.read_access(srv.workdir) if x.rid and x.rid.startswith(f"r{k}-")]
    extra["in_apache"] = in_apache(log, trace, b)
    extra["time_split"] = split.time_split(log, live.got, trace["article"], b.units)
    # every transaction's response time (NaN: failed), in trace order: the blocks can be recut
    return stats.arm_summary(live.got.rt, live.got.outcomes) | extra | {"rt": live.got.rt.tolist()}


def in_apache(log: list[server.AccessLine], trace: dict[str, np.ndarray], b: Bench) -> dict[str, Any]:
    """The replay's requests as Apache saw them: mean time in Apache per stage and the slowdowns
    against each article's idle service time (:func:`stats.slowdowns`)."""
    if not log:
        return {}
    art = np.array([int(trace["article"][int(x.rid.split("-")[1])]) for x in log if x.rid])
    is_p = np.array([x.rid.endswith("-p") for x in log if x.rid])
    begin = np.array([x.begin_us / 1e6 for x in log if x.rid])
    dur = np.array([x.duration_us / 1e6 for x in log if x.rid])
    idle = np.where(is_p, b.idle_preview[art], b.idle_view[art])
    return {"mean_s": {"preview": float(dur[is_p].mean()) if is_p.any() else None,
                       "view": float(dur[~is_p].mean()) if (~is_p).any() else None},
            "slowdown": stats.slowdowns(begin, dur, idle, is_p)}


def one_run(k: int, b: Bench, rate: float) -> dict[str, Any]:
    """Run k: every arm's stack up at once (on the same core, one receiving traffic at a time),
    the trace cut into blocks (--block) and each block replayed under every arm, the arms' order
    alternating from block to block (:func:`stats.block_order`)."""
    args, n = b.args, b.args.transactions
    trace = workload.make_trace(n, rate, len(b.txs), args.seed + k)
    bounds = stats.blocks(n, args.block)
    t0 = time.monotonic()
    with contextlib.ExitStack() as up:
        live: dict[str, Live] = {}
        for name in args.arms:
            port, srv, sc = up.enter_context(arm_server(name, b, b.tmp / f"run{k}", meter=args.split))
            live[name] = Live(port, srv, sc, workload.Replayed(np.full(n, np.nan), ["not_run"] * n, np.full((n, 2), np.nan)))
            warm_up(port, b)
        foreign = foreign_servers(args.server_core, {p for a in live.values() for p in a.srv.pids()})
        say(f"run {k + 1}/{args.runs}: {len(bounds)} blocks of ~{n // len(bounds)} transactions under "
            f"{len(live)} arms ({trace['arrival'][-1]:.0f} s of arrivals per arm)")
        orders = []
        for j, (lo, hi) in enumerate(bounds):
            orders.append(stats.block_order(args.arms, k, j))
            for name in orders[-1]:
                replay_block(live[name], lo, hi, k, b, trace)
            say(f"  block {j + 1}/{len(bounds)} ({' '.join(orders[-1])}) done, load {os.getloadavg()[0]:.1f}")
        arms = {name: arm_figures(name, k, a, b, trace) | {"foreign_servers": foreign} for name, a in live.items()}
    for name, a in arms.items():
        say(f"  {name}: mean {a['mean'] * 1e3:.1f} ms, p99 {a['p99'] * 1e3:.1f} ms, failures {a['failures']}")
    cost = (b.idle_preview + b.idle_view)[trace["article"]]
    rts = {name: a.got.rt for name, a in live.items()}
    return summarise_run(rts, arms, args.arms, bounds) | {
        "seed": args.seed + k, "block_orders": orders, "blocks": [list(x) for x in bounds],
        "offered_load": float(rate * cost.mean()), "wall_s": time.monotonic() - t0,
        "load_avg": os.getloadavg()[0], "cpu_drift": cpu_drift(arms, args.arms)}


def cpu_drift(arms: dict[str, Any], names: list[str]) -> dict[str, list[float]]:
    """Per arm but the first, per block, its stack's CPU seconds over the first arm's for the same
    block: the machine's drift (and the arm's own overhead) made visible."""
    first = arms[names[0]]["cpu_blocks"]
    tot = [sum(v for key, v in c.items() if key != "wall_s") for c in first]
    return {name: [sum(v for key, v in c.items() if key != "wall_s") / t if t > 0 else float("nan")
                   for c, t in zip(arms[name]["cpu_blocks"], tot, strict=True)] for name in names[1:]}


def summarise_run(rts: dict[str, np.ndarray], arms: dict[str, Any], names: list[str],
                  bounds: list[tuple[int, int]]) -> dict[str, Any]:
    """One run's document: the arms' figures, every arm's gain over ``default`` with its CI over
    the blocks ``bounds`` (:func:`stats.block_gain`; ``ci95_transactions``: the per-transaction
    batch-means CI, blind to drift between blocks) and, as ``gain`` / ``gain_ci95``, ``overtake``'s
    (None when either is missing)."""
    gains = {}
    if "default" in rts:
        for name in names:
            if name != "default" and name in rts:
                gains[name] = stats.block_gain(rts[name], rts["default"], bounds)
                gains[name]["ci95_transactions"] = stats.paired_gain(rts[name], rts["default"])[1]
                p99 = stats.p99_ratio(rts[name], rts["default"], bounds)
                gains[name]["p99_ratio"], gains[name]["p99_ratio_ci95"] = p99["ratio"], p99["ci95"]
    ov = gains.get("overtake", {"gain": None, "ci95": None})
    return {"arms": {n: arms[n] for n in names if n in arms}, "gain": ov["gain"], "gain_ci95": ov["ci95"], "gains": gains}


def across_runs(runs: list[dict[str, Any]], arm_names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in arm_names:
        out[name] = {"mean": stats.spread([r["arms"][name]["mean"] for r in runs]),
                     "p99": stats.spread([r["arms"][name]["p99"] for r in runs]),
                     "failures": stats.spread([r["arms"][name]["failures"] for r in runs])}
        if name != "default" and all(name in r["gains"] for r in runs):
            out[name]["gain"] = stats.spread([r["gains"][name]["gain"] for r in runs])
    return out


def render(doc: dict[str, Any]) -> str:
    """The run as a text table (stdout without --json)."""
    cal = doc["calibration"]
    lines = [f"MediaWiki, {doc['php']}, load {doc['load']}, {doc['transactions']} transactions a run, "
             f"{len(doc['runs'])} run(s); arrival rate {doc['arrival_rate']:.2f}/s",
             f"idle service: preview mean {cal['preview']['mean'] * 1e3:.1f} ms (scv {cal['preview']['scv']:.2f}, "
             f"floor {cal['preview']['min'] * 1e3:.1f}), view {cal['view']['mean'] * 1e3:.1f} ms "
             f"(scv {cal['view']['scv']:.2f}, floor {cal['view']['min'] * 1e3:.1f}); correlation "
             f"{cal['correlation']['pearson']:.2f}; serialisation probe preview "
             f"{cal['serialisation_probe']['preview']:.2f}, view {cal['serialisation_probe']['view']:.2f}"]
    if doc.get("model"):
        lines.append(f"model: age threshold {doc['model']['threshold_s'] * 1e3:.1f} ms")
        sized = doc["model"].get("size_class")
        if sized:
            lines.append("size-class model, predicted gain over default by quantile: " + ", ".join(
                f"{k} {100 * v['gain']:+.1f} %" for k, v in sized["arms"].items())
                + f"; the arm demotes above {sized['quantile']:g} ({sized['source']})")
    lines.append("| run | arm | mean ms | p99 ms | failures | gain over default (CI over blocks) | p99 / default (95 % CI) "
                 "| model ms | trace model ms |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, r in enumerate(doc["runs"]):
        for name, a in r["arms"].items():
            g = r["gains"].get(name)
            gs = "-" if g is None or g["gain"] is None or not math.isfinite(g["gain"]) else \
                f"{100 * g['gain']:+.1f} ± {100 * (g['ci95'] or math.nan):.1f} % ({g['blocks']} blocks)"
            p = (r.get("predicted") or {}).get(name)
            ps = "-" if p is None else f"{p['predicted'] * 1e3:.1f}"
            pt = (r.get("predicted_trace") or {}).get(name)
            ts = "-" if pt is None else f"{pt['predicted'] * 1e3:.1f}"
            q = "-" if g is None or g.get("p99_ratio") is None else \
                f"{g['p99_ratio']:.2f} ({g['p99_ratio_ci95'][0]:.2f}–{g['p99_ratio_ci95'][1]:.2f})"
            lines.append(f"| {k + 1} | {name} | {a['mean'] * 1e3:.1f} | {a['p99'] * 1e3:.1f} | {a['failures']} | {gs} | {q} "
                         f"| {ps} | {ts} |")
    if doc.get("predicted_vs_runs"):
        lines.append("the product's model against the mean of the runs: " + ", ".join(
            f"{name} {p['predicted'] * 1e3:.1f} ms vs {p['measured_mean'] * 1e3:.1f} ms ({100 * p['error']:+.1f} %"
            + (f"; at the CPU under load {100 * p['error_at_load']:+.1f} %" if "error_at_load" in p else "") + ")"
            for name, p in doc["predicted_vs_runs"].items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--php", choices=server.STACKS, default="prefork",
                    help="prefork: mpm_prefork + mod_php; fpm: mpm_event + php-fpm (default prefork)")
    ap.add_argument("--runs", type=int, default=3, help="runs, each a new trace (seed + run index); default 3")
    ap.add_argument("--transactions", type=int, default=None,
                    help="transactions per trace (default: as many as --minutes of replay allows)")
    ap.add_argument("--minutes", type=float, default=20.0,
                    help="replay minutes per run over all arms, without --transactions: the trace's length is "
                         "rate x minutes / arms, in whole blocks (default 20)")
    ap.add_argument("--arms", default=None, help=f"comma-separated, from {', '.join(ARMS)} (default: all)")
    ap.add_argument("--load", type=float, default=0.6, help="target CPU load of the trace (default 0.6)")
    ap.add_argument("--seed", type=int, default=2026, help="trace seed of run 1 (run k: seed + k - 1)")
    ap.add_argument("--articles", type=int, default=Recipe.articles, help="articles in the wiki (default 300)")
    ap.add_argument("--wiki-seed", type=int, default=Recipe.seed, help="seed of the page recipe")
    ap.add_argument("--data-dir", default=str(wiki.DEFAULT_DATA_DIR), help="the wiki's data directory")
    ap.add_argument("--qos-cap", type=int, default=2, help="mod_qos: requests at once per stage (default 2)")
    ap.add_argument("--preview-lock", type=int, default=1,
                    help="the sidecar arms' lock on previews (the stages file's lock; 0: no lock key; default 1)")
    ap.add_argument("--block", type=int, default=30,
                    help="transactions per block: every block is replayed under every arm in turn, the "
                         "order alternating (A B, B A, ...), each from an idle server (default 30)")
    ap.add_argument("--no-split", dest="split", action="store_false",
                    help="no request-time split in Apache's log (and no mod_overtake_prio at all in the arms without its priority)")
    ap.add_argument("--view-lock", type=int, default=0,
                    help="the sidecar arms' cap on views in Apache (the view stage's lock, keyed on the "
                         "transaction link: highest response ratio first); 0: none (default)")
    ap.add_argument("--class-quantile", type=float, default=None,
                    help="the sizeclass arm's class_quantile (views predicted above it start at nice 19); "
                         "default: the quantile the size-class model predicts best")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a transaction counts as failed")
    ap.add_argument("--cal-reps", type=int, default=3,
                    help="calibration passes over the articles; an article's idle time is their median (default 3)")
    ap.add_argument("--reuse-calibration", action="store_true",
                    help="reuse the last calibration of this stack and wiki (DATA/calibration-<php>.json) if any")
    ap.add_argument("--halt-poll-us", type=float, default=20000,
                    help="guest halt polling while measuring (as bench/apache_table2.py); 0 leaves it")
    ap.add_argument("--no-setup", action="store_true", help="fail instead of installing missing packages")
    ap.add_argument("--journal", choices=wiki.JOURNALS, default="delete",
                    help="the wiki's main SQLite database for the whole bench: delete (SQLite's default "
                         "rollback journal: a preview's commit waits for every running view) or wal (the "
                         "write-ahead log: it waits for none); put back as it was at the end (default delete)")
    ap.add_argument("--reanalyse", metavar="DATE", default=None,
                    help="run nothing: recompute the trace model and the p99 comparison of the run recorded in "
                         "bench/results/realapp.jsonl whose date starts with DATE (e.g. 2026-11-28T12:48), "
                         "from its recorded times and calibration; never appends")
    ap.add_argument("--json", action="store_true", help="print the run as JSON on stdout")
    ap.add_argument("--no-write", action="store_true", help="do not append the run to bench/results/realapp.jsonl")
    args = ap.parse_args(argv)
    if args.arms is None:
        args.arms = ",".join(ARMS)
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in names if a not in ARMS]
    if bad or not names or len(set(names)) != len(names):
        ap.error(f"--arms: distinct names from {', '.join(ARMS)}, got {args.arms!r}")
    args.arms = names
    if args.runs < 1:
        ap.error(f"--runs: at least 1, got {args.runs}")
    if args.transactions is not None and args.transactions < 50:
        ap.error(f"--transactions: at least 50 (paired batch means after warm-up), got {args.transactions}")
    if not args.minutes > 0:
        ap.error(f"--minutes: replay minutes per run, > 0, got {args.minutes}")
    if not 0 < args.load < 1:
        ap.error(f"--load: the target CPU load in (0, 1), got {args.load}")
    if args.block < 20:
        ap.error(f"--block: at least 20 transactions a block (a block starts from an idle server), got {args.block}")
    if args.transactions is not None and args.transactions < 2 * args.block:
        ap.error(f"--transactions: at least two blocks of --block {args.block} (the CI is over blocks), "
                 f"got {args.transactions}")
    if args.articles < 8:
        ap.error(f"--articles: at least 8, got {args.articles}")
    if args.qos_cap < 1:
        ap.error(f"--qos-cap: at least 1 request per stage, got {args.qos_cap}")
    if args.preview_lock < 0:
        ap.error(f"--preview-lock: a lock capacity >= 1, or 0 for no lock key, got {args.preview_lock}")
    if args.view_lock < 0:
        ap.error(f"--view-lock: a cap >= 1 on views in Apache, or 0 for none, got {args.view_lock}")
    if args.class_quantile is not None and not 0 < args.class_quantile < 1:
        ap.error(f"--class-quantile: a quantile in (0, 1), got {args.class_quantile}")
    if not args.timeout > 0 or args.cal_reps < 1:
        ap.error("--timeout must be > 0 s and --cal-reps >= 1")
    return args


def trace_length(rate: float, minutes: float, arms: int, block: int) -> int:
    """Transactions per run that ``minutes`` of replay under ``arms`` arms hold at ``rate``, in
    whole blocks of ``block``, at least two blocks (the CI is over blocks) and 50 transactions."""
    whole = round(rate * minutes * 60 / arms / block)
    return max(2, whole, -(-50 // block)) * block


def lock_prediction(cal: dict[str, Any], model: dict[str, Any], rate: float, php: str,
                    requests: int = 200_000, journal: str = "delete") -> dict[str, Any] | None:
    """The model with the database lock (bench/mediawiki/lock_model.py) where the calibration's
    probe says previews run one at a time, else None: its predictions for the arms, with and
    without the lock, from the fits and the age threshold the product solved with."""
    probe = cal.get("serialisation_probe") or {}
    if "preview" not in probe or not lock_model.serialises(float(probe["preview"]), int(probe["k"])):
        return None
    fits = {s: {"alpha": model["fits"][s]["alpha"], "T": model["fits"][s]["T"]} for s in ("preview", "view")}
    return lock_model.predict(fits, rate, php, threshold_s=model.get("threshold_s"), requests=requests, journal=journal)


#: the model-with-the-lock figure that stands for each arm (bench/mediawiki/lock_model.py): the
#: overtake arm runs every request at once but previews, which the sidecar's lock holds to one at
#: a time (a blocked preview costs no CPU wherever it waits), views demoted by age
PREDICTS = {"default": "default", "overtake_age": "passthrough+age", "age": "passthrough+age"}


def predicted_vs_measured(locked: dict[str, Any] | None, arms: dict[str, Any],
                          sized: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per arm the model's mean response time with the lock, the measured mean and their relative
    error (predicted / measured - 1); the sizeclass arm's from the size-class model at its
    quantile (``sized``, :func:`size_class_choice`)."""
    preds: dict[str, tuple[str, float]] = {}
    if locked is not None:
        preds = {name: (key, locked["lock"][key]) for name, key in PREDICTS.items()
                 if locked["lock"].get(key) is not None}
        if locked["lock"].get("default_readers") is not None:
            # the rollback journal: the views' reads hold a commit up (a chain cannot; simulated)
            preds["default"] = ("default with readers", locked["lock"]["default_readers"])
    if sized is not None:
        # the replay's figures where there are some: the bench's blocks from an idle server
        arms_sized, how = (sized["replay"]["arms"], " replayed") if sized.get("replay") else (sized["arms"], "")
        for name, quantile in (("sizeclass", sized["quantile"]), ("overtake", product.GUIDE_CLASS_QUANTILE)):
            q = f"{quantile:g}"
            if q in arms_sized:
                preds[name] = (f"size class {q}{how}", arms_sized[q]["mean"])
    out = {}
    for name, (key, pred) in preds.items():
        if name in arms:
            m = arms[name]["mean"]
            out[name] = {"model": key, "predicted": pred, "measured": m, "error": pred / m - 1 if m > 0 else None}
    if sized is not None and sized.get("replay") and "default" in out and out["default"]["measured"] > 0:
        # the default as the size-class replay has it (the bench's blocks from idle, the articles' own
        # idle times, the lock first come first served): beside the chain's stationary figure
        rep = sized["replay"]["default"]
        out["default"] |= {"predicted_replayed": rep, "error_replayed": rep / out["default"]["measured"] - 1}
    return out


def trace_idle(idle_both: np.ndarray, trace: dict[str, np.ndarray]) -> float:
    """The mean idle time (preview + view) of a trace's own transactions (its articles, not the
    wiki's average: a trace heavier than the average has its big articles in the replay already)."""
    return float(np.mean(idle_both[trace["article"]]))


def cpu_demand(arm: dict[str, Any], idle: float) -> float:
    """An arm's CPU per transaction under load over ``idle`` (:func:`trace_idle`)."""
    return float(sum(arm["cpu_s"].values()) / arm["transactions"] / idle)


def trace_prediction(run: dict[str, Any], cal: dict[str, Any], *, rate: float, transactions: int, php: str,
                     preview_lock: int, class_quantile: float | None, journal: str = "delete") -> dict[str, Any]:
    """The run's own trace under SQLite's locking (bench/mediawiki/sqlite_model.py), block by block
    from an idle server as replayed, per arm that it models (Apache's default and the sidecar's
    size-class arms): predicted and measured mean, their relative error, and the CPU demand the
    prediction uses: the CPU per transaction the arm's stack measured over the idle time of the
    same transactions (the trace's articles, not the wiki's average: a trace heavier than the
    average already has its big articles in the replay)."""
    idle_preview, idle_view = np.asarray(cal["preview_s"]), np.asarray(cal["view_s"])
    trace = workload.make_trace(transactions, rate, len(idle_preview), run["seed"])
    idle = trace_idle(idle_preview + idle_view, trace)
    startup = (float(cal["preview"]["intercept_s"]), float(cal["view"]["intercept_s"]))
    workers = lock_model.WORKERS["fpm"] if php == "fpm" else None

    def demand(a: dict[str, Any]) -> float:
        return cpu_demand(a, idle)

    def predict(spec: Arm, low: np.ndarray | None, cpu: float) -> float:
        rts = [sqlite_model.simulate(trace["arrival"][lo:hi] - trace["arrival"][lo], trace["article"][lo:hi],
                                     idle_preview, idle_view, startup=startup, demand=cpu, workers=workers,
                                     gate=spec.sidecar and preview_lock > 0, low=low, wal=journal == "wal")
               for lo, hi in run["blocks"]]
        return float(np.mean(np.concatenate(rts)))

    out: dict[str, Any] = {}
    base = run["arms"].get("default")
    for name, a in run["arms"].items():
        spec = ARM_SPECS[name]
        if spec.module and not spec.size_class or spec.qos or a["transactions"] == 0:
            continue  # age priority and mod_qos: not in this model
        q = product.GUIDE_CLASS_QUANTILE if spec.auto else class_quantile
        low = idle_view > np.quantile(idle_view, q) if spec.size_class and q is not None else None
        pred = predict(spec, low, demand(a))
        out[name] = {"predicted": pred, "measured": a["mean"], "error": pred / a["mean"] - 1, "demand": demand(a)}
        if name != "default" and base is not None and base["transactions"]:
            # nothing measured under the arm itself: the default's CPU per transaction
            common = predict(spec, low, demand(base))
            out[name] |= {"predicted_at_default_demand": common, "error_at_default_demand": common / a["mean"] - 1}
    return out


def replayed_size_class(idle_preview: np.ndarray, idle_view: np.ndarray, rate: float, quantile: float, block: int,
                        journal: str) -> dict[str, Any]:
    """The size-class model as the bench measures: blocks of ``block`` transactions, each from an
    idle server, the rollback journal's commits waiting for the views (not under the WAL); the
    chosen and the product's quantile."""
    qs = tuple(sorted({quantile, product.GUIDE_CLASS_QUANTILE}))
    return class_model.choose(idle_preview, idle_view, rate, quantiles=qs, readers=journal != "wal", block=block,
                              transactions=40 * block, seeds=range(1, 9))


def size_class_choice(b: Bench, rate: float) -> dict[str, Any]:
    """The size-class model on the calibrated wiki (bench/mediawiki/class_model.py): every
    quantile's predicted mean and gain over the default; sets the sizeclass arm's quantile to
    the best one unless --class-quantile fixed it (then that one is evaluated too)."""
    fixed = b.args.class_quantile
    qs = tuple(sorted(set(class_model.QUANTILES) | ({fixed} if fixed is not None else set())))
    out = class_model.choose(b.idle_preview, b.idle_view, rate, quantiles=qs)
    b.class_quantile = fixed if fixed is not None else out["chosen"]
    out["quantile"] = b.class_quantile
    out["source"] = "--class-quantile" if fixed is not None else "model"
    out["replay"] = replayed_size_class(b.idle_preview, b.idle_view, rate, b.class_quantile, b.args.block,
                                        b.args.journal)
    say("size-class model: predicted gain over default by quantile " + ", ".join(
        f"{k} {100 * v['gain']:+.1f} %" for k, v in out["arms"].items())
        + f"; the sizeclass arm demotes above {b.class_quantile:g} ({out['source']})")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Set-up, calibration, the model, the runs: the bench's document."""
    if os.geteuid() != 0:
        raise SystemExit("realapp: needs root (www-data workers, autogroup priority, mod_overtake_prio's RLIMIT_NICE)")
    recipe = Recipe(articles=args.articles, seed=args.wiki_seed)
    stamp = ensure_setup(args, recipe)
    cores = sorted(os.sched_getaffinity(0))
    args.server_core, args.client_core = cores[-1], cores[0]
    started, load_before = time.time(), os.getloadavg()[0]
    b = Bench(args, scratch_dir("overtake-realapp-"), transactions(Path(args.data_dir), recipe), draw_units(recipe)[1])
    try:
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    with (halt_polling(int(args.halt_poll_us * 1000)) if args.halt_poll_us > 0 else contextlib.nullcontext()) as hp, \
            wiki.journal_mode(Path(args.data_dir), args.journal):
        try:
            os.sched_setaffinity(0, {args.client_core})
            cal = calibration(b, stamp)
            b.idle_preview, b.idle_view = np.asarray(cal["preview_s"]), np.asarray(cal["view_s"])
            rate = workload.arrival_rate(args.load, b.idle_preview, b.idle_view)
            say(f"calibration: preview {cal['preview']['mean'] * 1e3:.1f} ms, view {cal['view']['mean'] * 1e3:.1f} ms "
                f"mean; {rate:.2f} transactions/s for load {args.load}")
            if args.transactions is None:
                args.transactions = trace_length(rate, args.minutes, len(args.arms), args.block)
                say(f"{args.transactions} transactions a run: {args.minutes:g} min of replay under {len(args.arms)} arms")
            if any(ARM_SPECS[a].needs_model for a in args.arms):
                b.model = product.prepare_model(b.tmp / "model", {"preview": b.idle_preview, "view": b.idle_view}, rate)
                say(f"model: age threshold {b.model.threshold_s * 1e3:.1f} ms; predicted {b.model.summary()['predicted']}")
            locked = lock_prediction(cal, b.model.summary(), rate, args.php, journal=args.journal) if b.model else None
            sized = size_class_choice(b, rate) if {"sizeclass", "overtake"} & set(args.arms) else None
            if locked is not None:
                say(f"model with the preview lock: default {locked['lock']['default']:.3f} s, "
                    f"passthrough+age {locked['lock'].get('passthrough+age', float('nan')):.3f} s")
            before = wiki.db_state(Path(args.data_dir))
            runs = [one_run(k, b, rate) for k in range(args.runs)]
            db_written = wiki.written_since(Path(args.data_dir), before)
            for r in runs:
                r["predicted"] = predicted_vs_measured(locked, r["arms"], sized)
                r["predicted_trace"] = trace_prediction(r, cal, rate=rate, transactions=args.transactions, php=args.php,
                                                        preview_lock=args.preview_lock, class_quantile=b.class_quantile,
                                                        journal=args.journal)
        finally:
            os.sched_setaffinity(0, set(cores))
            shutil.rmtree(b.tmp, ignore_errors=True)
    stack = {"php": args.php, "mpm": "prefork" if args.php == "prefork" else "event",
             "fpm_pool": server.FPM_DEFAULTS if args.php == "fpm" else None}
    doc = {"runs": runs, "across_runs": across_runs(runs, args.arms),
            "php": args.php, "stack": stack,
            "load": args.load, "transactions": args.transactions, "minutes": args.minutes, "arms": args.arms, "seed": args.seed,
            "arrival_rate": rate, "block": args.block, "split": args.split, "qos_cap": args.qos_cap,
            "preview_lock": args.preview_lock, "view_lock": args.view_lock, "timeout": args.timeout, "calibration": cal,
            "journal": args.journal,
            "model": b.model.summary() | {"lock": locked, "size_class": sized} if b.model else None, "wiki": stamp | {"units": b.units.tolist()},
            "recipe": asdict(recipe), "db_written": db_written, "cores": {"server": args.server_core, "client": args.client_core},
            "halt_poll_ns": hp, "load_before": load_before, "load_after": os.getloadavg()[0],
            "seconds": time.time() - started}
    doc["predicted_vs_runs"] = predicted_vs_runs(runs, *at_load(doc))
    return doc


def reanalyse(date: str) -> dict[str, Any]:
    """The recorded run (bench/results/realapp.jsonl) whose date starts with ``date``, its trace
    model and its arms' gains (p99 ratio included) recomputed from what it recorded: the
    per-transaction times, the blocks, each arm's CPU and the calibration."""
    found = [r for r in read_runs("realapp") if str(r.get("date", "")).startswith(date) and r.get("figures")]
    if len(found) != 1:
        dates = ", ".join(str(r.get("date")) for r in read_runs("realapp"))
        raise SystemExit(f"realapp: --reanalyse {date!r} matches {len(found)} recorded runs; give a date prefix "
                         f"that names one of: {dates}")
    doc = found[0]["figures"]
    quantile = ((doc.get("model") or {}).get("size_class") or {}).get("quantile")
    product_model(doc)
    for r in doc["runs"]:
        rts = {name: np.array([np.nan if x is None else x for x in a["rt"]], float) for name, a in r["arms"].items()}
        r.update(summarise_run(rts, r["arms"], list(r["arms"]), [tuple(b) for b in r["blocks"]]))
        r["predicted_trace"] = trace_prediction(r, doc["calibration"], rate=doc["arrival_rate"],
                                                transactions=doc["transactions"], php=doc["php"],
                                                preview_lock=doc["preview_lock"], class_quantile=quantile,
                                                journal=doc.get("journal", "delete"))
    doc["across_runs"] = across_runs(doc["runs"], list(doc["runs"][0]["arms"]))
    return doc | {"reanalysis_of": found[0]["date"], "reanalysis_command": found[0].get("command")}


def product_model(doc: dict[str, Any]) -> None:
    """The product's predictions of a recorded run (``doc``, its figures) recomputed from its fits,
    age threshold and calibration with today's models (the lock's readers under the rollback
    journal, the size class replayed in the bench's blocks): each run's ``predicted``, and
    ``predicted_vs_runs``, the prediction against the mean of the runs (runs of one arm differ by
    their traces' heavy-tailed articles, which a stationary model does not see)."""
    model, cal = doc.get("model"), doc["calibration"]
    if not model or "fits" not in model:
        return
    journal = doc.get("journal", "delete")
    locked = lock_prediction(cal, model, doc["arrival_rate"], doc["php"], journal=journal)
    sized = model.get("size_class")
    if sized is not None:
        sized = sized | {"replay": replayed_size_class(np.asarray(cal["preview_s"]), np.asarray(cal["view_s"]),
                                                       doc["arrival_rate"], sized["quantile"], doc["block"], journal)}
    doc["model"] = model | {"lock": locked, "size_class": sized}
    for r in doc["runs"]:
        r["predicted"] = predicted_vs_measured(locked, r["arms"], sized)
    doc["predicted_vs_runs"] = predicted_vs_runs(doc["runs"], *at_load(doc))


def arm_demands(doc: dict[str, Any]) -> dict[str, float]:
    """Per arm its CPU per transaction under load over the idle time of the same transactions, the
    mean of the runs (what mod_overtake_prio's per-request CPU would give the online refits)."""
    cal, rate = doc["calibration"], doc["arrival_rate"]
    idle_both = np.asarray(cal["preview_s"]) + np.asarray(cal["view_s"])
    per: dict[str, list[float]] = {}
    for r in doc["runs"]:
        idle = trace_idle(idle_both, workload.make_trace(doc["transactions"], rate, idle_both.size, r["seed"]))
        for name, a in r["arms"].items():
            if a["transactions"] and a.get("cpu_s"):
                per.setdefault(name, []).append(cpu_demand(a, idle))
    return {name: float(np.mean(v)) for name, v in per.items()}


def at_load(doc: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """The product's model of the default and overtake arms with the service times scaled to each
    arm's CPU under load (:func:`arm_demands`), in the bench's blocks from idle; (predictions,
    demands). Empty where the run has no such arm or no size-class model."""
    demands = arm_demands(doc)
    sized = (doc.get("model") or {}).get("size_class")
    cal, out = doc["calibration"], {}
    if sized is None:
        return out, demands
    q = f"{product.GUIDE_CLASS_QUANTILE:g}"
    for name in ("default", "overtake"):
        if name in demands:
            d = demands[name]
            rep = replayed_size_class(np.asarray(cal["preview_s"]) * d, np.asarray(cal["view_s"]) * d,
                                      doc["arrival_rate"], sized["quantile"], doc["block"], doc.get("journal", "delete"))
            out[name] = rep["default"] if name == "default" else rep["arms"][q]["mean"]
    return out, demands


def predicted_vs_runs(runs: list[dict[str, Any]], loaded: dict[str, float] | None = None,
                      demands: dict[str, float] | None = None) -> dict[str, Any]:
    """Per arm the product's prediction (the same in every run: it sees no trace) against the mean
    of the runs' measured means, and its error; the default's replayed figure beside it, and with
    ``loaded`` the prediction at the arm's CPU under load (``demands``, :func:`at_load`)."""
    out: dict[str, Any] = {}
    for name, p in (runs[0].get("predicted") or {}).items():
        measured = float(np.mean([r["predicted"][name]["measured"] for r in runs]))
        out[name] = {"model": p["model"], "predicted": p["predicted"], "measured_mean": measured,
                     "error": p["predicted"] / measured - 1}
        if "predicted_replayed" in p:
            out[name] |= {"predicted_replayed": p["predicted_replayed"],
                          "error_replayed": p["predicted_replayed"] / measured - 1}
        if loaded and name in loaded:
            out[name] |= {"predicted_at_load": loaded[name], "error_at_load": loaded[name] / measured - 1,
                          "demand": (demands or {}).get(name)}
    return out


def finite(x: Any) -> Any:
    """``x`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, np.generic):
        return finite(x.item())
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the servers
    doc = finite(reanalyse(args.reanalyse) if args.reanalyse else run(args))
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(render(doc))
    if not args.no_write and not args.reanalyse:
        path = append_run("realapp", run_record(doc, bench="realapp"))
        say(f"run appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
