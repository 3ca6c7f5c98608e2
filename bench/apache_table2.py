"""Table 2 of paper 004 on a real Apache: measured E[W] under π*, π(1), π(∞) through the sidecar.

    python bench/apache_table2.py --cases 1,4 --transactions N --json

For each case (examples/table1/caseNN.yaml): π* is solved with `overtake solve` (cached in
--policy-dir), the model's E[W] of π*, π(1), π(∞) give the predicted gains; then one trace of
open-loop Poisson transactions (arrival rate λ of the scenario) with service demands drawn from
the stages' PH (start phase recorded) is replayed through `overtake sidecar` under each policy
(common random numbers; swapped with PUT /-/policy between runs, the same code path). A
transaction is GET /stage1?work=d1 then, on the same connection once it completes, GET
/stage2?work=d2, each with the start phase in X-Overtake-Phase; one model time unit = --time-unit
seconds of thread CPU (default 10 ms). Apache is pinned to the last core with autogroup -20; the
sidecar and this load generator share core 0 (raised autogroup too).

E[W] per policy: mean response time of the transactions after a 5 % warm-up, 95 % CI by 20 batch
means (t_{19}). Gains are fractions (E W(π) − E W(π*)) / E W(π*), measured and predicted.
Writes the `apache-table2` (or, with --classifier hidden, `apache-table2-hidden`) section of
BENCHMARKS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api.commands._scenario import load_scenario  # noqa: E402
from controller import apache  # noqa: E402
from mdp import Policy, TandemModel  # noqa: E402
from mdp.truncation import evaluate_baseline  # noqa: E402

POLICIES = ("pi*", "pi(1)", "pi(inf)")
T_975_19 = 2.093  # Student t, 19 degrees of freedom (20 batch means)

STAGES = """stages:
  - name: stage1
    path: "^/stage1$"
  - name: stage2
    path: "^/stage2$"
limits: {{max_inflight: {cap}, queue_cap: 100000, queue_timeout: 3600, upstream_timeout: 3600, client_timeout: 3600}}
classifier: {{mode: {mode}, header: X-Overtake-Phase, time_unit: {unit}}}
"""


# --------------------------------------------------------------------------- trace


def sample_ph(alpha: np.ndarray, T: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n PH(α, T) samples by simulating the absorbing CTMC; returns (values, start phases 0-based)."""
    m = T.shape[0]
    rates = -np.diag(T)
    exit_p = np.concatenate([np.maximum(T - np.diag(np.diag(T)), 0), -T.sum(axis=1, keepdims=True)], axis=1)
    exit_p = exit_p / rates[:, None]
    start = rng.choice(m, size=n, p=alpha / alpha.sum())
    out = np.zeros(n)
    for i in range(n):
        j = start[i]
        t = 0.0
        while j < m:
            t += rng.exponential(1.0 / rates[j])
            j = rng.choice(m + 1, p=exit_p[j])
        out[i] = t
    return out, start


def make_trace(model: TandemModel, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / model.arrival_rate, size=n))
    tr: dict[str, np.ndarray] = {"arrival": arrivals}
    for i, st in enumerate(model.stages):
        d, ph = sample_ph(np.asarray(st.alpha, float), np.asarray(st.T, float), n, rng)
        tr[f"demand{i}"] = d
        tr[f"phase{i}"] = ph
    return tr


# --------------------------------------------------------------------------- load generator


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, phase: int) -> int:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nX-Overtake-Phase: {phase}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    await reader.readexactly(n)
    return status


async def replay(port: int, trace: dict[str, np.ndarray], unit: float, n_stages: int,
                 overhead: float = 0.0) -> tuple[np.ndarray, int]:
    """Open-loop replay; returns response times (s) from the *scheduled* arrival, and failures."""
    loop = asyncio.get_running_loop()
    n = trace["arrival"].size
    out = np.full(n, np.nan)
    failures = 0
    t0 = loop.time() + 0.2

    async def one(i: int) -> None:
        nonlocal failures
        due = t0 + trace["arrival"][i] * unit
        await asyncio.sleep(max(0.0, due - loop.time()))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                for s in range(n_stages):
                    work = max(trace[f"demand{s}"][i] * unit - overhead, 0.0)
                    code = await _get(reader, writer, f"/stage{s + 1}?work={work:.6f}", int(trace[f"phase{s}"][i]) + 1)
                    if code != 200:
                        failures += 1
                        return
            finally:
                writer.close()
            out[i] = loop.time() - due
        except (OSError, asyncio.IncompleteReadError, ValueError):
            failures += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return out, failures


async def _makespan(port: int, n: int, work: float) -> float:
    loop = asyncio.get_running_loop()

    async def one() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await _get(r, w, f"/stage1?work={work:.6f}", 1) == 200
        finally:
            w.close()

    t = loop.time()
    await asyncio.gather(*(one() for _ in range(n)))
    return loop.time() - t


def calibrate(port: int, unit: float, n: int = 40, rounds: int = 3) -> float:
    """Apache's CPU per request beyond the stage handler's burn (s): n concurrent requests of one
    time unit each, direct to Apache (all share the core), overhead = makespan / n - unit; the
    median of ``rounds``. Subtracted from every demand so a request costs Apache d x unit in all."""
    asyncio.run(_makespan(port, n, 0.0))  # warm every worker thread's Lua state
    runs = [asyncio.run(_makespan(port, n, unit)) / n - unit for _ in range(rounds)]
    return max(0.0, statistics.median(runs))


def foreign_apaches(core: int, ours: set[int]) -> int:
    """Other apache2 processes that may run on ``core`` (they compete with ours at autogroup -20)."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in ours:
            continue
        try:
            if (d / "comm").read_text().strip() == "apache2" and core in os.sched_getaffinity(int(d.name)):
                n += 1
        except OSError:
            continue
    return n


def batch_means(x: np.ndarray, batches: int = 20) -> tuple[float, float]:
    x = x[~np.isnan(x)]
    x = x[int(0.05 * x.size):]
    means = [float(b.mean()) for b in np.array_split(x, batches)]
    return float(np.mean(means)), T_975_19 * float(np.std(means, ddof=1)) / np.sqrt(batches)


# --------------------------------------------------------------------------- plumbing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_idle(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = _http("GET", f"http://127.0.0.1:{port}/-/metrics")[1].decode()
        line = next((ln for ln in text.splitlines() if ln.startswith("overtake_inflight ")), "overtake_inflight 1")
        if float(line.split()[1]) == 0:
            return
        time.sleep(0.2)


def policy_file(case: int, policy_dir: Path) -> Path:
    out = policy_dir / f"case{case:02d}.npz"
    if not out.exists():
        scen = REPO / "examples" / "table1" / f"case{case:02d}.yaml"
        subprocess.run([sys.executable, "-m", "api.cli", "solve", str(scen), "--out", str(out)], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    return out


def predicted(model: TandemModel, pol: Policy) -> dict[str, float]:
    w = {"pi*": float(pol.meta["metrics"]["mean_response_time"])}
    for name in ("pi(1)", "pi(inf)"):
        w[name] = float(evaluate_baseline(model, name).metrics.mean_response_time)
    return w


def write_section(text: str, name: str) -> None:
    path = REPO / "BENCHMARKS.md"
    cur = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text}\n{end}"
    if begin in cur:
        cur = cur[: cur.index(begin)] + block + cur[cur.index(end) + len(end):]
    else:
        cur = cur.rstrip() + "\n\n" + block + "\n"
    path.write_text(cur)


def run_case(case: int, args: argparse.Namespace, inst: apache.ApacheInstance, tmp: Path, client_core: int) -> dict[str, Any]:
    _, model = load_scenario(REPO / "examples" / "table1" / f"case{case:02d}.yaml")
    pfile = policy_file(case, Path(args.policy_dir))
    pol = Policy.load(pfile)
    pred_w = predicted(model, pol)
    trace = make_trace(model, args.transactions, args.seed + case)
    port = _free_port()
    stages = tmp / f"stages{case}.yaml"
    stages.write_text(STAGES.format(cap=args.max_workers - 4, mode=args.classifier, unit=args.time_unit))
    log = (tmp / f"sidecar{case}.log").open("wb")
    side = subprocess.Popen(
        ["taskset", "-c", str(client_core), sys.executable, "-m", "api.cli", "sidecar", "--policy", str(pfile),
         "--apache", inst.base_url, "--listen", f"127.0.0.1:{port}", "--stages", str(stages)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _http("GET", f"http://127.0.0.1:{port}/-/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if side.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"apache_table2: sidecar did not start: {(tmp / f'sidecar{case}.log').read_text()}")
            time.sleep(0.2)
        res: dict[str, Any] = {}
        for name in args.policies.split(","):
            spec = pfile.read_bytes() if name == "pi*" else name.encode()
            code, body = _http("PUT", f"http://127.0.0.1:{port}/-/policy", spec)
            if code != 200:
                raise SystemExit(f"apache_table2: PUT {name} refused: {body.decode()}")
            _wait_idle(port)
            t = time.monotonic()
            rt, failures = asyncio.run(replay(port, trace, args.time_unit, model.n_stages, args.overhead_s))
            mean, ci = batch_means(rt)
            res[name] = {"mean_response_time": mean, "ci95": ci, "failures": failures,
                         "model_units": mean / args.time_unit, "seconds": time.monotonic() - t}
            print(f"case {case} {name}: E[W] {mean * 1e3:.1f} ms ± {ci * 1e3:.1f} "
                  f"(model {pred_w.get(name, float('nan')) * args.time_unit * 1e3:.1f} ms), failures {failures}",
                  file=sys.stderr)
    finally:
        side.terminate()
        side.wait(10)
        log.close()
    star = res.get("pi*", {}).get("mean_response_time")
    out: dict[str, Any] = {"policies": res, "measured_gains": {}, "predicted_gains": {},
                           "predicted_mean_response_time": {k: v * args.time_unit for k, v in pred_w.items()}}
    for name in ("pi(1)", "pi(inf)"):
        if star and name in res:
            out["measured_gains"][name] = (res[name]["mean_response_time"] - star) / star
        out["predicted_gains"][name] = (pred_w[name] - pred_w["pi*"]) / pred_w["pi*"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(str(i) for i in range(1, 13)))
    ap.add_argument("--transactions", type=int, default=5000)
    ap.add_argument("--time-unit", type=float, default=0.01, help="seconds of CPU per model time unit")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--classifier", choices=["explicit", "hidden"], default="explicit")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--max-workers", type=int, default=64)
    ap.add_argument("--policy-dir", default="/tmp/overtake-table2-policies")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="do not subtract Apache's measured per-request CPU overhead from the demands")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    try:
        cases = [int(c) for c in args.cases.split(",")]
    except ValueError:
        raise SystemExit(f"apache_table2: --cases: comma-separated case numbers 1..12, got {args.cases!r}") from None
    if any(not 1 <= c <= 12 for c in cases):
        raise SystemExit(f"apache_table2: --cases: case numbers must be in 1..12, got {args.cases!r}")
    Path(args.policy_dir).mkdir(parents=True, exist_ok=True)
    try:
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[-1], cores[0]
    tmp = Path(tempfile.mkdtemp(prefix="overtake-table2-", dir="/tmp"))
    tmp.chmod(0o755)
    inst = apache.start(tmp / "apache", f"127.0.0.1:{_free_port()}", cpu=server_core, max_workers=args.max_workers)
    os.sched_setaffinity(0, {client_core})  # after Apache's start: it checks the core against ours
    args.overhead_s = 0.0
    if not args.no_calibrate:
        args.overhead_s = calibrate(apache.parse_listen(inst.listen)[1], args.time_unit)
        print(f"calibration: Apache CPU per request beyond the burn {args.overhead_s * 1e3:.2f} ms "
              "(subtracted from every demand)", file=sys.stderr)
    ours = {inst.pid, *inst.child_pids}
    foreign = foreign_apaches(server_core, ours)
    results: dict[str, Any] = {}
    started = time.time()
    try:
        for c in cases:
            results[str(c)] = run_case(c, args, inst, tmp, client_core)
    finally:
        apache.stop(inst.workdir, graceful=False)
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"cases": results, "transactions": args.transactions, "time_unit": args.time_unit,
           "per_request_overhead_s": args.overhead_s, "foreign_apache_processes": foreign,
           "classifier": args.classifier, "seed": args.seed}
    if args.json:
        print(json.dumps(doc, indent=2))
    lines = [
        f"## apache-table2{'-hidden' if args.classifier == 'hidden' else ''}: paper 004 Table 2 on a real Apache "
        f"through the sidecar ({args.classifier} phases)",
        "",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} vCPU, shared "
        f"with other jobs (load average {os.getloadavg()[0]:.1f} at the end; {foreign} other apache2 processes "
        f"could run on Apache's core at the start); {time.time() - started:.0f} s.",
        f"Command: `python bench/apache_table2.py --cases {args.cases} --transactions {args.transactions} "
        f"--time-unit {args.time_unit:g} --classifier {args.classifier}`. Apache on core {server_core} "
        f"(autogroup -20), sidecar + load generator on core {client_core}; one time unit = "
        f"{args.time_unit * 1e3:g} ms of Apache CPU (measured per-request overhead {args.overhead_s * 1e3:.2f} ms "
        f"subtracted from each burn{'; calibration off' if args.no_calibrate else ''}); same trace for every "
        "policy; 95 % CI from 20 batch means.",
        "",
        "| case | E[W] pi* ms | E[W] pi(1) ms | E[W] pi(inf) ms | gain vs pi(1) meas / model | gain vs pi(inf) meas / model |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c, r in results.items():
        p = r["policies"]

        def w(name: str, p: dict[str, Any] = p) -> str:
            return f"{p[name]['mean_response_time'] * 1e3:.1f} ± {p[name]['ci95'] * 1e3:.1f}" if name in p else "-"

        def g(name: str, r: dict[str, Any] = r) -> str:
            m = r["measured_gains"].get(name)
            return f"{100 * m:.1f} % / {100 * r['predicted_gains'][name]:.1f} %" if m is not None else "-"

        lines.append(f"| {c} | {w('pi*')} | {w('pi(1)')} | {w('pi(inf)')} | {g('pi(1)')} | {g('pi(inf)')} |")
    if not args.no_write:
        write_section("\n".join(lines), "apache-table2" + ("-hidden" if args.classifier == "hidden" else ""))
    print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
