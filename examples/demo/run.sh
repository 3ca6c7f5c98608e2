#!/usr/bin/env bash
# The main job on the bundled example (`make demo`): fit each stage's measured service times, solve
# the thread policies for what the sidecar may know of a request (its phase from a header, or
# nothing) with CPU priority's predictions, compare them with Apache's default, then
# measure live: two private Apaches on one core (Apache's default, and one with mod_overtake_prio),
# the sidecar in auto mode, a private Prometheus, one open-loop trace replayed under Apache's
# default, under Overtake without a phase header and with it; measured next to the ideal twin and
# the model, with paired CIs, and demo-out/report.png.
# Everything started here is stopped on exit, on failure and on Ctrl-C; re-running starts afresh.
# DEMO_SECONDS (default 70) = length of the load trace per row; DEMO_OUT (default demo-out) = where
# its files go.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${DEMO_OUT:-demo-out}
BIN=.venv/bin
mkdir -p "$OUT/fits"
# The control file the sidecar writes and Apache's module reads: Apache takes an absolute path
# without spaces (one word of its config), so outside the output folder where its path has one.
CONTROL="$(cd "$OUT" && pwd)/control"
case "$CONTROL" in *[[:space:]\"]*) CONTROL="/dev/shm/overtake-demo-$(id -u)/control"; mkdir -p "${CONTROL%/*}";; esac

LIVE_PID=""
stop_all() {
    local pid
    [ -n "$LIVE_PID" ] && kill "$LIVE_PID" 2>/dev/null || true
    for f in "$OUT"/sidecar*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        # only our sidecar: the pid file may be stale and the number reused
        if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "overtake sidecar"; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$f"
    done
    [ -d "$OUT/prometheus" ] && $BIN/overtake prometheus stop --workdir "$OUT/prometheus" >/dev/null 2>&1 || true
    for d in "$OUT/apache" "$OUT/apache-prio"; do
        [ -d "$d" ] && $BIN/overtake apache stop --workdir "$d" >/dev/null 2>&1 || true
    done
}
on_exit() {
    local rc=$?
    trap - EXIT
    stop_all
    [ "$rc" -eq 0 ] || echo "demo: FAILED (exit $rc); Apache, sidecar and Prometheus stopped; logs in $OUT/" >&2
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM
stop_all  # leftovers of an interrupted earlier run

echo "== 1. fit a phase-type distribution per stage (examples/demo/stage*.txt, seconds)"
$BIN/overtake fit examples/demo/stage1.txt --structure hyperexp --order 2 --out "$OUT/fits" --plot
$BIN/overtake fit examples/demo/stage2.txt --structure hyperexp --order 2 --out "$OUT/fits" --plot
cat > "$OUT/scenario.yaml" <<YAML
# 60% CPU load on one core; stage service times fitted from the samples above
load: 0.6
tolerance: 0.005
stages:
  - name: stage1
    service: {file: fits/stage1.json}
  - name: stage2
    service: {file: fits/stage2.json}
YAML
echo "== 2. solve: pi* for known phases, the best policy on counts alone (no phase header), each also"
echo "       predicted with age priority in Apache (mod_overtake_prio) -> $OUT/policies/"
mkdir -p "$OUT/policies"
$BIN/overtake solve "$OUT/scenario.yaml" --out "$OUT/policies/full.npz" --cpu-priority age --quiet > /dev/null
$BIN/overtake solve "$OUT/scenario.yaml" --phase-info none --out "$OUT/policies/none.npz" --cpu-priority age --quiet > /dev/null
cp "$OUT/policies/full.npz" "$OUT/policy.npz"
$BIN/python - "$OUT/policies" <<'PY'
import sys
from pathlib import Path
from overtake.mdp import Policy
ps = None
for f in sorted(Path(sys.argv[1]).glob("*.npz")):
    pol = Policy.load(f)
    m = pol.meta
    ps, age = m["baselines"]["pi(inf)"], m["cpu_priority"]["age"]
    print(f"  {f.name:9s} (phase info {pol.phase_info}): E[W] {1e3 * m['metrics']['mean_response_time']:.1f} ms, "
          f"with age priority {1e3 * age['mean_response_time']:.1f} ms")
print(f"  Apache's default pi(inf): {1e3 * ps:.1f} ms; with age priority alone {1e3 * age['passthrough']:.1f} ms "
      f"(threshold {1e3 * age['thresholds'][0][0]:.1f} ms of thread CPU)")
PY
echo "== 3. compare pi* with pi(1) (one thread), pi(4), pi(inf) (Apache's default) and pi(1,1)"
$BIN/overtake compare "$OUT/scenario.yaml" --quiet | tee "$OUT/compare.txt"

echo "== 4. live: two private Apaches (the default, and one with mod_overtake_prio) + sidecars + Prometheus"
free_port() { $BIN/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
AP_PORT=$(free_port); AP2_PORT=$(free_port); SD_PORT=$(free_port); SC_PORT=$(free_port); PR_PORT=$(free_port)
SD_ADMIN=$(free_port); SC_ADMIN=$(free_port)  # each sidecar's admin listener (metrics, policy)
# the model is one processor: both Apaches get core 0 (one runs at a time), the sidecars and the load driver the rest
PIN=() ; AP_CPU=()
if [ "$(nproc)" -ge 2 ]; then AP_CPU=(--cpu 0); PIN=(taskset -c "1-$(( $(nproc) - 1 ))"); fi
$BIN/overtake apache start --workdir "$OUT/apache" --listen "127.0.0.1:$AP_PORT" "${AP_CPU[@]}" --max-workers 64
$BIN/overtake apache start --workdir "$OUT/apache-prio" --listen "127.0.0.1:$AP2_PORT" "${AP_CPU[@]}" --max-workers 64 \
    --cpu-priority-levels 0.005 --cpu-priority-nice idle --control-file "$CONTROL"
stages() {  # the private Apache's stage handler; the example's time unit is the second of CPU
    cat <<YAML
stages:
  - {name: stage1, path: "^/stage1\$", next: stage2}   # the driver asks for stage2 right after
  - {name: stage2, path: "^/stage2\$"}
limits: {max_inflight: 60, queue_cap: 100000, queue_timeout: 600}
classifier: {mode: $1, header: X-Overtake-Phase, time_unit: 1.0, auto_interval: 1}
YAML
}
stages explicit > "$OUT/stages-default.yaml"
stages auto > "$OUT/stages.yaml"
# own session = own scheduler autogroup, raised below like Apache's: on a busy machine a starved
# proxy delays every hand-off, which costs a policy that runs few threads far more than pi(inf)
start_sidecar() {  # NAME PORT ADMIN_PORT ARGS...
    local name=$1 port=$2 admin=$3; shift 3
    setsid "${PIN[@]}" $BIN/overtake sidecar --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" "$@" \
        > "$OUT/$name.log" 2>&1 &
    echo $! > "$OUT/$name.pid"
    for _ in $(seq 100); do
        $BIN/python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/-/healthz', timeout=1)" 2>/dev/null && break
        kill -0 "$(cat "$OUT/$name.pid")" 2>/dev/null || { cat "$OUT/$name.log" >&2; exit 1; }
        sleep 0.2
    done
    echo -20 > "/proc/$(cat "$OUT/$name.pid")/autogroup" 2>/dev/null || true  # root only, else unchanged
}
start_sidecar sidecar-default "$SD_PORT" "$SD_ADMIN" --policy passthrough --apache "http://127.0.0.1:$AP_PORT" \
    --stages "$OUT/stages-default.yaml"
start_sidecar sidecar "$SC_PORT" "$SC_ADMIN" --policy "$OUT/policies" --cpu-priority age --apache "http://127.0.0.1:$AP2_PORT" \
    --stages "$OUT/stages.yaml" --control-file "$CONTROL"
echo "sidecars on 127.0.0.1:$SD_PORT (passthrough to Apache's default) and 127.0.0.1:$SC_PORT (auto over $OUT/policies, age priority), logs $OUT/sidecar*.log"
rm -rf "$OUT/prometheus/data"
$BIN/overtake prometheus start --workdir "$OUT/prometheus" --listen "127.0.0.1:$PR_PORT" --sidecar "127.0.0.1:$SC_ADMIN"

echo "== 5. one open-loop trace under Apache's default, Overtake without and with a phase header (${DEMO_SECONDS:-70} s each)"
# in the background so that Ctrl-C reaches the trap at once (live.py moves to its own session)
"${PIN[@]}" $BIN/python examples/demo/live.py --out "$OUT" --default "127.0.0.1:$SD_PORT" --sidecar "127.0.0.1:$SC_PORT" \
    --default-admin "127.0.0.1:$SD_ADMIN" --sidecar-admin "127.0.0.1:$SC_ADMIN" --apache "127.0.0.1:$AP_PORT" --prometheus "http://127.0.0.1:$PR_PORT" --seconds "${DEMO_SECONDS:-70}" &
LIVE_PID=$!
wait "$LIVE_PID"
LIVE_PID=""
