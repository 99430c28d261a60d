#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time and fails on the first crash,
# printing the reproducer. Called by .ci/run after the tests; runs on its own too.
#
#   FUZZ_SECONDS   seconds per target (default 20; six targets take about 2.5 min)
#   FUZZ_MAX_LEN   largest input libFuzzer tries, in bytes (default 8192)
#   FUZZ_TARGETS   space-separated targets to run (default: every target)
#   FUZZ_SANITIZER address (default) or none
#   FUZZ_BUILD_ONLY 1: build the targets and stop (.ci/run builds them this way in the
#                  background while the tests run; the later full run finds them built)
#
# cargo-fuzz passes nightly-only compiler flags (-Zsanitizer, sancov passes);
# RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them. Builds go to fuzz/target.
# A crash leaves its input in fuzz/artifacts/<target>/; replay it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run --codegen-units 16 <target> fuzz/artifacts/<target>/<file>
# and turn it into a regression test (tests/it/fuzz_regressions.rs or a unit test).
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECONDS=${FUZZ_SECONDS:-20}
FUZZ_MAX_LEN=${FUZZ_MAX_LEN:-8192}
FUZZ_SANITIZER=${FUZZ_SANITIZER:-address}
export RUSTC_BOOTSTRAP=1
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

if ! command -v cargo-fuzz >/dev/null; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked --version 0.13.2
fi

# cargo-fuzz's default build: optimised, with debug assertions and overflow checks (an
# arithmetic overflow is a crash too). 16 codegen units instead of its 1: the dependency tree
# (tokio, axum, rustls) builds much faster on a small machine for slightly slower runs.
build_flags=(--sanitizer "$FUZZ_SANITIZER" --codegen-units 16)
targets=${FUZZ_TARGETS:-$(cargo fuzz list)}

echo "== building fuzz targets ($FUZZ_SANITIZER sanitizer)"
start=$SECONDS
cargo fuzz build "${build_flags[@]}"
echo "   built in $((SECONDS - start)) s"
if [[ ${FUZZ_BUILD_ONLY:-0} == 1 ]]; then
    exit 0
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
for target in $targets; do
    echo "== fuzzing $target for ${FUZZ_SECONDS}s"
    # New inputs go to a scratch directory (the first corpus directory); the committed seeds
    # in fuzz/corpus/<target> are only read.
    mkdir -p "$scratch/$target" "fuzz/corpus/$target"
    log="$scratch/$target.log"
    if cargo fuzz run "${build_flags[@]}" "$target" "$scratch/$target" "fuzz/corpus/$target" -- \
        -max_total_time="$FUZZ_SECONDS" -max_len="$FUZZ_MAX_LEN" -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" | sed 's/^/   /'
    else
        tail -n 60 "$log"
        reproducer=$(grep -o "Test unit written to .*" "$log" | sed 's/Test unit written to //' | tail -n 1)
        echo "!! $target failed; reproducer: ${reproducer:-none written (see the log above)}"
        echo "!! replay: RUSTC_BOOTSTRAP=1 cargo fuzz run ${build_flags[*]} $target ${reproducer:-<input>}"
        failed+=("$target")
    fi
done

if ((${#failed[@]})); then
    echo "fuzzing found crashes in: ${failed[*]}"
    exit 1
fi
echo "== fuzzing: no crash in $((SECONDS - start)) s"
