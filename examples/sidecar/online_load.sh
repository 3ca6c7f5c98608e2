#!/bin/sh
# Case-4 transactions for the sidecar's online loop (README "Sidecar online loop"):
# N transactions, each GET /stage1 then /stage2 with H2 demands (p = 0.91/0.09, means 0.55/5.45
# model units x UNIT seconds) in ?work= and the true phase in X-Overtake-Phase; Poisson gaps at RATE/s.
# usage: sh examples/sidecar/online_load.sh [URL] [N] [RATE] [UNIT]
URL=${1:-http://127.0.0.1:18180}; N=${2:-300}; RATE=${3:-30}; UNIT=${4:-0.01}
awk -v n="$N" -v r="$RATE" -v u="$UNIT" 'BEGIN{srand(4); for(i=0;i<n;i++){for(s=0;s<2;s++){
  p=(rand()<0.09)?2:1; m=(p==2)?5.45:0.55; printf "%d %.6f ", p, -m*u*log(1-rand())}; printf "%.4f\n", -log(1-rand())/r}}' |
while read p1 w1 p2 w2 gap; do
  (curl -s -H "X-Overtake-Phase: $p1" "$URL/stage1?work=$w1" -o /dev/null
   curl -s -H "X-Overtake-Phase: $p2" "$URL/stage2?work=$w2" -o /dev/null) &
  sleep "$gap"
done
wait
