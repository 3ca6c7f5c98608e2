#!/usr/bin/env bash
# The main job on the bundled example (`make demo`): fit each stage's measured service times, solve
# the optimal thread policy, compare it with Apache's default and fixed caps, then measure it live:
# a private Apache + the sidecar + a private Prometheus on loopback, the same open-loop load under
# Apache's default pi(inf) and under pi*, measured next to predicted, and demo-out/report.png.
# Everything started here is stopped on exit, on failure and on Ctrl-C; re-running starts afresh.
# DEMO_SECONDS (default 45) = length of the load trace per policy.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=demo-out
BIN=.venv/bin
mkdir -p "$OUT/fits"

LIVE_PID=""
stop_all() {
    local pid
    [ -n "$LIVE_PID" ] && kill "$LIVE_PID" 2>/dev/null || true
    if [ -f "$OUT/sidecar.pid" ]; then
        pid=$(cat "$OUT/sidecar.pid")
        # only our sidecar: the pid file may be stale and the number reused
        if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "overtake sidecar"; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$OUT/sidecar.pid"
    fi
    [ -d "$OUT/prometheus" ] && $BIN/overtake prometheus stop --workdir "$OUT/prometheus" >/dev/null 2>&1 || true
    [ -d "$OUT/apache" ] && $BIN/overtake apache stop --workdir "$OUT/apache" >/dev/null 2>&1 || true
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
echo "== 2. solve the optimal policy -> $OUT/policy.npz"
$BIN/overtake solve "$OUT/scenario.yaml" --out "$OUT/policy.npz" --quiet
echo "== 3. compare with pi(1) (one thread), pi(4), pi(inf) (Apache's default) and pi(1,1)"
$BIN/overtake compare "$OUT/scenario.yaml" --quiet | tee "$OUT/compare.txt"

echo "== 4. live: private Apache + sidecar + Prometheus on loopback"
free_port() { $BIN/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
AP_PORT=$(free_port); SC_PORT=$(free_port); PR_PORT=$(free_port)
# the model is one processor: Apache gets core 0, the sidecar and the load driver the rest
PIN=() ; AP_CPU=()
if [ "$(nproc)" -ge 2 ]; then AP_CPU=(--cpu 0); PIN=(taskset -c "1-$(( $(nproc) - 1 ))"); fi
$BIN/overtake apache start --workdir "$OUT/apache" --listen "127.0.0.1:$AP_PORT" "${AP_CPU[@]}" --max-workers 64
cat > "$OUT/stages.yaml" <<YAML
# the private Apache's stage handler; the example's time unit is the second of CPU
stages:
  - {name: stage1, path: "^/stage1\$", next: stage2}   # the driver asks for stage2 right after
  - {name: stage2, path: "^/stage2\$"}
limits: {max_inflight: 60, queue_cap: 100000, queue_timeout: 600}
classifier: {mode: explicit, header: X-Overtake-Phase, time_unit: 1.0}
YAML
# own session = own scheduler autogroup, raised below like Apache's: on a busy machine a starved
# proxy delays every hand-off, which costs a policy that runs few threads far more than pi(inf)
setsid "${PIN[@]}" $BIN/overtake sidecar --policy passthrough --apache "http://127.0.0.1:$AP_PORT" \
    --listen "127.0.0.1:$SC_PORT" --stages "$OUT/stages.yaml" > "$OUT/sidecar.log" 2>&1 &
echo $! > "$OUT/sidecar.pid"
for _ in $(seq 100); do
    $BIN/python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$SC_PORT/-/healthz', timeout=1)" 2>/dev/null && break
    kill -0 "$(cat "$OUT/sidecar.pid")" 2>/dev/null || { cat "$OUT/sidecar.log" >&2; exit 1; }
    sleep 0.2
done
echo -20 > "/proc/$(cat "$OUT/sidecar.pid")/autogroup" 2>/dev/null || true  # root only, else unchanged
echo "sidecar on 127.0.0.1:$SC_PORT (policy passthrough = Apache's default, autogroup $(cut -d' ' -f3 "/proc/$(cat "$OUT/sidecar.pid")/autogroup" 2>/dev/null)), log $OUT/sidecar.log"
rm -rf "$OUT/prometheus/data"
$BIN/overtake prometheus start --workdir "$OUT/prometheus" --listen "127.0.0.1:$PR_PORT" --sidecar "127.0.0.1:$SC_PORT"

echo "== 5. the same open-loop load under pi(inf) and under pi* (${DEMO_SECONDS:-45} s each)"
# in the background so that Ctrl-C reaches the trap at once (live.py moves to its own session)
"${PIN[@]}" $BIN/python examples/demo/live.py --out "$OUT" --sidecar "127.0.0.1:$SC_PORT" \
    --apache "127.0.0.1:$AP_PORT" --prometheus "http://127.0.0.1:$PR_PORT" --seconds "${DEMO_SECONDS:-45}" &
LIVE_PID=$!
wait "$LIVE_PID"
LIVE_PID=""
