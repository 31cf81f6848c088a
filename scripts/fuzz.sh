#!/usr/bin/env bash
# Coverage-guided fuzzing of Ferry's decoders, session and request handling
# (tests/fuzz, cargo-fuzz + libFuzzer). See docs/fuzzing.md.
#
#   scripts/fuzz.sh [--seconds N] [TARGET...]
#
# Runs each TARGET (default: all of them) for N seconds (default 20, what CI
# runs; a real hunt is e.g. --seconds 600 or 3600). Installs cargo-fuzz with
# `cargo install` if it is missing. The fuzz targets need nightly compiler flags
# (sanitizer coverage, AddressSanitizer); RUSTC_BOOTSTRAP=1 lets the stable
# toolchain take them.
#
# Everything it writes is under target/ (never committed):
#   target/fuzz/                  the instrumented build
#   target/fuzz-corpus/TARGET/    the corpus, grown run after run; the committed
#                                 seeds in tests/fuzz/corpus/TARGET/ are read too
#   target/fuzz-artifacts/TARGET/ crashing inputs (crash-*, timeout-*, oom-*)
#   target/fuzz-logs/TARGET.log   libFuzzer's full output of the last run
# A crash stops the script with exit status 1 and prints how to reproduce it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ALL_TARGETS=(codec_decode tcp_frame server_session server_requests)
CARGO_FUZZ_VERSION=0.13.2

log() { echo "[fuzz] $*" >&2; }
die() { echo "[fuzz] ERROR: $*" >&2; exit 2; }

seconds=20
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) [ $# -ge 2 ] || die "--seconds needs a value"; seconds="$2"; shift 2 ;;
        --seconds=*) seconds="${1#--seconds=}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) targets+=("$1"); shift ;;
    esac
done
case "$seconds" in ''|*[!0-9]*) die "--seconds takes a whole number, not '$seconds'" ;; esac
[ ${#targets[@]} -gt 0 ] || targets=("${ALL_TARGETS[@]}")
for t in "${targets[@]}"; do
    [ -f "tests/fuzz/fuzz_targets/$t.rs" ] || die "no fuzz target '$t' (have: ${ALL_TARGETS[*]})"
done

if [ -d "${CARGO_HOME:-$HOME/.cargo}/bin" ]; then PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz $CARGO_FUZZ_VERSION (cargo install, once)"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" >&2
fi

export RUSTC_BOOTSTRAP=1
FUZZ=(cargo fuzz)
COMMON=(--fuzz-dir tests/fuzz --target-dir target/fuzz)

log "building ${targets[*]}"
if [ "${targets[*]}" = "${ALL_TARGETS[*]}" ]; then
    "${FUZZ[@]}" build "${COMMON[@]}"
else
    for t in "${targets[@]}"; do
        "${FUZZ[@]}" build "${COMMON[@]}" "$t"
    done
fi

mkdir -p target/fuzz-logs
for t in "${targets[@]}"; do
    corpus="target/fuzz-corpus/$t"
    artifacts="target/fuzz-artifacts/$t"
    logfile="target/fuzz-logs/$t.log"
    mkdir -p "$corpus" "$artifacts"
    log "$t: ${seconds}s (corpus $corpus + tests/fuzz/corpus/$t, log $logfile)"
    set +e
    "${FUZZ[@]}" run "${COMMON[@]}" "$t" "$corpus" "tests/fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -timeout=60 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" >"$logfile" 2>&1
    rc=$?
    set -e
    if [ "$rc" -ne 0 ]; then
        tail -n 60 "$logfile" >&2
        # The panic message sits above the backtrace that the tail shows: print it last.
        if grep -q 'panicked at' "$logfile"; then
            log "$t panicked:"
            grep -A 4 'panicked at' "$logfile" | head -n 12 | cut -c 1-2000 >&2
        fi
        crash="$(ls -t "$artifacts" 2>/dev/null | head -n 1)"
        log "$t FAILED (exit $rc); full output in $logfile"
        if [ -n "$crash" ]; then
            log "crashing input: $artifacts/$crash; reproduce with"
            log "  RUSTC_BOOTSTRAP=1 cargo fuzz run ${COMMON[*]} $t $artifacts/$crash"
            log "(FERRY_FUZZ_TRACE=1 prints each request and answer of server_requests)"
        fi
        exit 1
    fi
    runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$logfile" | tail -n 1)"
    secs="$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$logfile" | tail -n 1)"
    cov="$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$logfile" | tail -n 1)"
    log "$t: ok, ${runs:-?} runs in ${secs:-?}s ($cov)"
done
log "all targets ran clean"
