#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu`, tests/gpu/) in one command, on a machine with a CUDA GPU and
# vLLM 0.33 (docs/gpu-tests.md says what each test checks and what to carry).
#
# Here, on CPU, first: build what the tests read from the cache (tiny family, trained drafts, the
# compressed-tensors draft; minutes the first time), then carry .cache/nemotron-spec:
#   bash scripts/gpu-tests.sh --prepare
# On the lent H200, from the repository root:
#   source .gpu-bundle/device-setup.sh && GPU_TESTS_COMMIT=<commit> bash scripts/gpu-tests.sh
#
# Installs the package (its vLLM plugin entry point), runs the tests (tests/gpu, or the test files
# or node ids given after DIR) and writes into DIR (the first argument, else $OUT, else
# ./gpu-test-results): gpu-tests.xml (JUnit), gpu-tests.log
# (pytest's output), pip.log, gpu-tests-summary.txt (one line: verdict, counts, time, date,
# commit, device). The commit is $GPU_TESTS_COMMIT, else `git rev-parse --short HEAD` where the
# working tree has its .git (the device's copy has none). pytest stops after
# $GPU_TESTS_TIMEOUT seconds (default 540, inside the device's 10-minute command limit).
# Exit status: 0 when the summary says PASS (tests ran, none failed), else pytest's or 1.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
CACHE=${NEMOTRON_SPEC_CACHE:-$PWD/.cache/nemotron-spec}
export NEMOTRON_SPEC_CACHE="$CACHE"
if [ "${1:-}" = "--prepare" ]; then
  exec "$PYTHON" -m tests.gpu.drafts
fi
DIR=${1:-${OUT:-gpu-test-results}}
[ $# -gt 0 ] && shift
TESTS=("$@")
[ ${#TESTS[@]} -eq 0 ] && TESTS=(tests/gpu)
mkdir -p "$DIR" || exit 1
COMMIT=${GPU_TESTS_COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo "unknown (set GPU_TESTS_COMMIT)")}
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$DIR/pip.log" 2>&1 \
  || { cat "$DIR/pip.log"; exit 1; }
# SIGINT at the deadline: pytest stops like on Ctrl-C and still writes its report of what ran;
# unbuffered, so the log keeps every line printed before it.
PYTHONUNBUFFERED=1 timeout -s INT -k 20 "${GPU_TESTS_TIMEOUT:-540}" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider "${TESTS[@]}" \
  --junitxml="$DIR/gpu-tests.xml" -o junit_suite_name=gpu-tests 2>&1 | tee "$DIR/gpu-tests.log"
rc=${PIPESTATUS[0]}
if [ -f "$DIR/gpu-tests.xml" ]; then
  "$PYTHON" -m tests.gpu.checks "$DIR/gpu-tests.xml" "$COMMIT" "$rc" | tee "$DIR/gpu-tests-summary.txt"
elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  # Stopped at the deadline before pytest wrote its report (e.g. inside an engine's start-up):
  # what ran is in the log, what it did not reach was not checked.
  echo "GPU TESTS INCOMPLETE (stopped at the deadline, ${GPU_TESTS_TIMEOUT:-540} s, before pytest wrote its report; what ran: $DIR/gpu-tests.log); $(date -u '+%F %H:%M UTC'); commit $COMMIT" \
    | tee "$DIR/gpu-tests-summary.txt"
else
  echo "GPU TESTS FAIL: no JUnit report (pytest exit $rc); $(date -u '+%F %H:%M UTC'); commit $COMMIT" \
    | tee "$DIR/gpu-tests-summary.txt"
fi
grep -q "^GPU TESTS PASS" "$DIR/gpu-tests-summary.txt" && exit 0
[ "$rc" -ne 0 ] && exit "$rc"
exit 1
