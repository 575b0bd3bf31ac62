#!/usr/bin/env bash
# On the lent H200, after `source .gpu-bundle/device-setup.sh` (docs/DEVELOPING.md): install the
# package, run benchmarks/gpu_multiturn.py once per phase inside one command's time limit, and tar
# each phase's --out (kept on the machine between back-to-back commands) to $OUT.
#   PHASES="/tmp/sb3:dspark3-upstream,dspark3-ours" \
#   MTARGS="--side-by-side --instances 2 --concurrency 1,4,16 --repeats 3" \
#   END=560 bash scripts/gpu-multiturn-phases.sh
# PHASES: space-separated DIR:RUNS; END: seconds after start by which every phase has stopped;
# MINROW: a phase with fewer seconds left is skipped (default 150).
set -u
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip.log 2>&1 \
  || { cat /tmp/pip.log; exit 1; }
END=${END:-560}
MTARGS=${MTARGS:---instances 2 --concurrency 1,4 --repeats 3}
for phase in ${PHASES:?set PHASES=DIR:RUNS ...}; do
  dir=${phase%%:*} runs=${phase#*:}
  name=$(basename "$dir")
  left=$(( END - ($(date +%s) - t0) ))
  if [ "$left" -lt "${MINROW:-150}" ]; then echo "phase $phase skipped: $left s left"; continue; fi
  echo "phase $phase: $left s left"
  mkdir -p "$dir"
  echo "== $(date -u '+%F %T') $phase, $left s left" >> "$dir/$name-calls.log"
  # shellcheck disable=SC2086  # MTARGS is a list of arguments
  timeout "$left" python3 benchmarks/gpu_multiturn.py --out "$dir" --runs "$runs" $MTARGS \
    --budget-s $(( left - 15 )) >> "$dir/$name-calls.log" 2>&1
  echo "phase $phase: rc $? after $(( $(date +%s) - t0 )) s"
  tail -30 "$dir/$name-calls.log"
  tar -czf "$OUT/$name.tgz" -C "$(dirname "$dir")" "$name"
done
# A server left behind keeps its GPU memory (docs/DEVELOPING.md): stop whatever still holds it.
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2> /dev/null
fi
true
