#!/usr/bin/env bash
# Run one pytest selection N times in a row, each in a fresh pytest session (fresh caches and temp dirs), and stop
# at the first failure: the check that a test which once failed without a bug now passes every time.
#   bash benchmarks/repeat_test.sh 20 "tests/test_checkpoint.py::test_kill_9_and_resume_is_bitwise_exact"
set -u
n=${1:?how many runs}; shift
cd "$(dirname "$0")/.."
for i in $(seq 1 "$n"); do
  base=$(mktemp -d)
  if ! python -m pytest -q -p no:cacheprovider --basetemp="$base/t" "$@" > "$base/log" 2>&1; then
    echo "run $i of $n FAILED (log: $base/log)"; tail -30 "$base/log"; exit 1
  fi
  echo "run $i of $n: $(tail -1 "$base/log")"
  rm -rf "$base"
done
echo "all $n runs passed"
