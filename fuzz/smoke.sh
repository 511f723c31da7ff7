#!/usr/bin/env bash
# Bounded fuzzing smoke for CI, on the stable toolchain (docs/fuzzing.md).
#
#   install cargo-fuzz if missing ─► build every target once
#   ─► replay fuzz/regressions/<target>/* ─► fuzz each target SMOKE_SECS seconds
#
# Exits non-zero if any stage fails or any target crashes; crashing inputs
# land in fuzz/artifacts/<target>/. Knobs (environment):
#   SMOKE_SECS        seconds of fuzzing per target (default 20)
#   SMOKE_TARGETS     space-separated targets (default: all of them)
#   FUZZ_TARGET_DIR   cargo target dir (default fuzz/target)
set -uo pipefail

cd "$(dirname "$0")/.."
SMOKE_SECS=${SMOKE_SECS:-20}
SMOKE_TARGETS=${SMOKE_TARGETS:-"batch hello roce qp mux_peer"}
FUZZ_TARGET_DIR=${FUZZ_TARGET_DIR:-fuzz/target}
CARGO_FUZZ_VERSION=0.13.2
# Stable rustc: no sanitizer (ASan needs -Zsanitizer), no -Zbuild-std.
FLAGS=(--sanitizer none -O -a --target-dir "$FUZZ_TARGET_DIR")
# Memory: libFuzzer's RSS watchdog works without a sanitizer; its malloc
# limit needs a sanitizer's hooks, so the harnesses cap their own inputs.
LIBFUZZER=(-rss_limit_mb=1024 -malloc_limit_mb=256 -timeout=10)

start=$SECONDS
stage_start=$SECONDS
failed=()

stage() {
    local now=$SECONDS
    printf '== %-40s %4ds (total %4ds)\n' "$1" $((now - stage_start)) $((now - start))
    stage_start=$now
}

if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" || exit 1
fi
stage "cargo-fuzz $CARGO_FUZZ_VERSION ready"

cargo fuzz build "${FLAGS[@]}" || exit 1
stage "build all targets"

for target in $SMOKE_TARGETS; do
    shopt -s nullglob
    inputs=(fuzz/regressions/"$target"/*)
    shopt -u nullglob
    if ((${#inputs[@]})); then
        # Files, not a directory: libFuzzer runs each once and writes nothing.
        if ! cargo fuzz run "${FLAGS[@]}" "$target" "${inputs[@]}" -- "${LIBFUZZER[@]}"; then
            failed+=("$target (regression replay)")
        fi
        stage "$target: replay ${#inputs[@]} regression inputs"
    fi

    corpus=$(mktemp -d)
    log=$(mktemp)
    cargo fuzz run "${FLAGS[@]}" "$target" "$corpus" -- "${LIBFUZZER[@]}" \
        -max_total_time="$SMOKE_SECS" -print_final_stats=1 >"$log" 2>&1
    rc=$?
    grep -E '^(Done|stat::(number_of_executed_units|peak_rss_mb))' "$log"
    if ((rc != 0)); then
        tail -n 40 "$log"
        failed+=("$target")
    fi
    rm -f "$log"
    rm -rf "$corpus"
    stage "$target: fuzz ${SMOKE_SECS}s"
done

if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]} (inputs under fuzz/artifacts/)"
    exit 1
fi
echo "fuzz smoke passed in $((SECONDS - start))s"
