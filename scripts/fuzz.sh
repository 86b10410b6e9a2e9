#!/usr/bin/env bash
# Structured fuzzing for about SECONDS: runs a proptest fuzz target round after round (each
# round draws fresh random cases) and stops at the first failure, which proptest prints with
# its minimal failing input.
#
#   scripts/fuzz.sh state 1800      # damaged state files (crates/model/tests/fuzz_state.rs)
#
# No nightly toolchain is needed. CI runs every target's default case count as part of the
# test suite; this script is for long runs (RELIABILITY.md).
set -euo pipefail
usage="usage: scripts/fuzz.sh TARGET SECONDS (targets: state)"
target=${1:?$usage}
seconds=${2:?$usage}
case "$target" in
  state) pkg=picaso-model; test=fuzz_state ;;
  *) echo "unknown target '$target'; $usage" >&2; exit 2 ;;
esac
per_round=${FUZZ_CASES_PER_ROUND:-20000}
cargo test --release -q -p "$pkg" --test "$test" --no-run
start=$SECONDS
rounds=0
while (( SECONDS - start < seconds )); do
  PROPTEST_CASES=$per_round cargo test --release -q -p "$pkg" --test "$test" >/dev/null 2>"${TMPDIR:-/tmp}/fuzz-$target.err" || {
    cat "${TMPDIR:-/tmp}/fuzz-$target.err" >&2
    echo "$target: FAILED in round $((rounds + 1)) after $((rounds * per_round)) clean cases" >&2
    exit 1
  }
  rounds=$((rounds + 1))
done
echo "$target: $((rounds * per_round)) cases in $rounds rounds, $((SECONDS - start)) s, 0 failures"
