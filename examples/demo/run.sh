#!/usr/bin/env bash
# The main job on the bundled example: fit each stage's measured service times, solve the optimal
# thread policy, compare it with Apache's default and fixed caps, and write the policy file.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=demo-out
BIN=.venv/bin
mkdir -p "$OUT/fits"
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
