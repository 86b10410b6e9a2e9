#!/usr/bin/env bash
# Structured fuzzing for about SECONDS: runs a proptest fuzz target round after round (each
# round draws fresh random cases) and stops at the first failure, which proptest prints with
# its minimal failing input.
#
#   scripts/fuzz.sh state 1800      # damaged state files (crates/model/tests/fuzz_state.rs)
#   scripts/fuzz.sh loaders 1800    # config.json and model.safetensors (crates/model/tests/fuzz_loaders.rs)
#   scripts/fuzz.sh sources 1800    # WikiText, JSON-lines, text folders (crates/store/tests/fuzz_sources.rs)
#   scripts/fuzz.sh catalog 1800    # hand-edited or damaged catalog rows (crates/store/tests/fuzz_catalog.rs)
#   scripts/fuzz.sh http 1800       # request bodies, paths, content types (crates/cli/tests/fuzz_http.rs)
#   scripts/fuzz.sh templates 1800  # chat templates × messages in the render sandbox (crates/server/tests/fuzz_templates.rs)
#   scripts/fuzz.sh afl-state 1800  # coverage-guided (AFL++): the state-file reader (fuzz/afl/src/state.rs)
#   scripts/fuzz.sh afl-loader 1800 # coverage-guided (AFL++): config.json or model.safetensors (fuzz/afl/src/loader.rs)
#   FUZZ_KEEP_CORPUS=1 scripts/fuzz.sh afl-state 1800   # and minimise what it found into fuzz/afl/corpus
#
# No nightly toolchain is needed. CI runs every target's default case count as part of the
# test suite; this script is for long runs (RELIABILITY.md).
set -euo pipefail
usage="usage: scripts/fuzz.sh TARGET SECONDS (targets: state, loaders, sources, catalog, http, templates, afl-state, afl-loader)"
target=${1:?$usage}
seconds=${2:?$usage}
if [[ $target == afl-* ]]; then
  # AFL++ through cargo-afl (stable toolchain; needs a C compiler and make). Its queue and
  # findings go to FUZZ_OUT (default /tmp/picaso-afl/TARGET).
  bin=${target#afl-}
  [ -f "fuzz/afl/src/$bin.rs" ] || { echo "unknown target '$target'; $usage" >&2; exit 2; }
  command -v cargo-afl >/dev/null || cargo install --locked cargo-afl
  cargo afl config --build 2>/dev/null || true # builds AFL++ itself once
  (cd fuzz/afl && cargo afl build --release -q --bin "$bin")
  out=${FUZZ_OUT:-/tmp/picaso-afl/$bin}
  rm -rf "$out" "$out.in"; mkdir -p "$out.in"
  # Start from the seeds and the corpus earlier runs kept (minimised with afl-cmin.bash:
  # RELIABILITY.md says how); both are replayed by cargo test too.
  cp fuzz/afl/seeds/"$bin"/* "$out.in"/
  if [ -d "fuzz/afl/corpus/$bin" ]; then cp fuzz/afl/corpus/"$bin"/* "$out.in"/; fi
  # No UI, no CPU binding or frequency checks (shared machines); a piped core_pattern only
  # slows crash detection.
  AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_NO_AFFINITY=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
    cargo afl fuzz -V "$seconds" -i "$out.in" -o "$out" "fuzz/afl/target/release/$bin" >"$out.log" 2>&1 || {
    tail -20 "$out.log" >&2; exit 1; }
  stat() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$out/default/fuzzer_stats"; }
  echo "$target: $(stat execs_done) executions, $(stat corpus_count) corpus entries, $(stat run_time) s," \
    "$(stat saved_crashes) crashes, $(stat saved_hangs) hangs"
  [ "$(stat saved_crashes)" = 0 ] || { echo "crashes in $out/default/crashes" >&2; exit 1; }
  if [ "${FUZZ_KEEP_CORPUS:-0}" = 1 ]; then
    # Minimise the queue (the inputs that each reached new code) into fuzz/afl/corpus/TARGET,
    # numbered: AFL++'s names hold ':' and ','.
    afl_bin=$(ls -d "${XDG_DATA_HOME:-$HOME/.local/share}"/afl.rs/*/*/afl/bin | tail -1)
    rm -rf "$out.min"
    PATH="$afl_bin:$PATH" AFL_SKIP_CPUFREQ=1 AFL_NO_AFFINITY=1 \
      "$afl_bin/afl-cmin.bash" -i "$out/default/queue" -o "$out.min" -- "fuzz/afl/target/release/$bin" >"$out.cmin.log" 2>&1
    rm -rf "fuzz/afl/corpus/$bin" && mkdir -p "fuzz/afl/corpus/$bin"
    i=0
    for f in "$out.min"/*; do cp "$f" "fuzz/afl/corpus/$bin/$(printf '%04d' $i)"; i=$((i + 1)); done
    echo "$target: kept $i inputs in fuzz/afl/corpus/$bin"
  fi
  exit 0
fi
case "$target" in
  state) pkg=picaso-model; test=fuzz_state ;;
  loaders) pkg=picaso-model; test=fuzz_loaders ;;
  sources) pkg=picaso-store; test=fuzz_sources ;;
  catalog) pkg=picaso-store; test=fuzz_catalog ;;
  http) pkg=picaso; test=fuzz_http ;;
  templates) pkg=picaso-server; test=fuzz_templates ;;
  *) echo "unknown target '$target'; $usage" >&2; exit 2 ;;
esac
per_round=${FUZZ_CASES_PER_ROUND:-20000}
# Built once and run from a copy (the http target's server too, through PICASO_BIN), so that
# editing or rebuilding the sources during a long run changes nothing under it.
exe=$(cargo test --release -q -p "$pkg" --test "$test" --no-run --message-format=json |
  grep "\"name\":\"$test\"" | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$exe" ] || { echo "could not build the $test test binary" >&2; exit 1; }
copy="${TMPDIR:-/tmp}/fuzz-$target.bin"
cp "$exe" "$copy"
if [ "$target" = http ]; then
  cargo build --release -q -p picaso
  cp target/release/picaso "${TMPDIR:-/tmp}/fuzz-picaso"
  export PICASO_BIN="${TMPDIR:-/tmp}/fuzz-picaso"
fi
start=$SECONDS
rounds=0
while (( SECONDS - start < seconds )); do
  # libtest reports a failing test on stdout: keep both streams of the round.
  PROPTEST_CASES=$per_round "$copy" >"${TMPDIR:-/tmp}/fuzz-$target.err" 2>&1 || {
    cat "${TMPDIR:-/tmp}/fuzz-$target.err" >&2
    echo "$target: FAILED in round $((rounds + 1)) after $((rounds * per_round)) clean cases" >&2
    exit 1
  }
  rounds=$((rounds + 1))
done
echo "$target: $((rounds * per_round)) cases in $rounds rounds, $((SECONDS - start)) s, 0 failures"
