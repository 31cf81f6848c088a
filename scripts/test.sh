#!/usr/bin/env bash
# Ferry's test command: formatting, lints, build, unit + integration tests, a
# short fuzz run and a quick benchmark smoke run (bench/run --quick). Stops at
# the first failing step and says which.
#
#   scripts/test.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STEP=""
STEP_START=$SECONDS
# Ends the step running (printing how long it took) and starts the one named.
step() {
    if [ -n "$STEP" ]; then
        printf '=== [test] done in %ds: %s\n' $((SECONDS - STEP_START)) "$STEP" >&2
    fi
    STEP="$*"
    STEP_START=$SECONDS
    [ -z "$STEP" ] || printf '\n=== [test] %s\n' "$STEP" >&2
}
on_exit() {
    local rc=$?
    if [ "$rc" -ne 0 ] && [ -n "$STEP" ]; then
        printf '\n=== [test] FAILED (exit %d) after %ds in step: %s\n' \
            "$rc" $((SECONDS - STEP_START)) "$STEP" >&2
    fi
}
trap on_exit EXIT

step "setup (scripts/setup.sh)"
scripts/setup.sh
# setup.sh may have found cargo in ~/.cargo/bin; make sure we see it too.
if [ -d "${CARGO_HOME:-$HOME/.cargo}/bin" ]; then PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; fi

step "format (cargo fmt --all -- --check)"
cargo fmt --all -- --check

step "lint (cargo clippy --workspace --all-targets -- -D warnings)"
cargo clippy --workspace --all-targets -- -D warnings

step "build (cargo build --workspace --bins)"
cargo build --workspace --bins

# The compatibility tests (tests/tests/compat.rs, docs/testing.md) run the previous
# release's ferryd and rcp, built once from git history into target/prev.
step "previous release (scripts/build-prev.sh)"
FERRY_PREV_BIN_DIR="$(scripts/build-prev.sh | tail -n 1)"
export FERRY_PREV_BIN_DIR

# The integration tests start the binaries built above from target/debug.
step "test (cargo test --workspace)"
cargo test --workspace

# pjdfstest, the POSIX conformance suite, as root in a real ferry-mount of a share with
# client owners; every failure must be one docs/conformance.md lists (and every listed
# one must still fail).
step "pjdfstest in a ferry-mount (scripts/pjdfstest.sh)"
scripts/pjdfstest.sh

# Short coverage-guided fuzz run of every target (tests/fuzz, docs/fuzzing.md);
# installs cargo-fuzz once. A crash fails the step and names the input.
step "fuzz smoke run (scripts/fuzz.sh --seconds ${FERRY_FUZZ_SECONDS:-20})"
scripts/fuzz.sh --seconds "${FERRY_FUZZ_SECONDS:-20}"

# --- Soft-RoCE suite ----------------------------------------------------------
# The same integration suite (plus the verbs transport's own device tests and the
# hardware-counter proof) on the real kernel RDMA stack: scripts/softroce-vm.sh boots
# Debian's kernel in qemu with rdma_rxe and scripts/rdma-suite.sh runs the host-built
# test executables inside. Debian 12's own 6.1 kernel runs all of them; the newest
# 6.12 package runs the part where kernels can differ (compat.txt, named in
# scripts/rdma-tests-list.sh), which keeps a CI run well under 40 minutes under TCG.
# The whole suite on 6.12 as well:
#   scripts/test-rdma.sh -- scripts/rdma-suite.sh target/rdma-suite/tests.txt
# FERRY_SKIP_SOFTROCE=1 skips it (never in CI).
if [ "${FERRY_SKIP_SOFTROCE:-0}" = 1 ] && [ -z "${CI:-}" ]; then
    printf '\n=== [test] Soft-RoCE suite SKIPPED (FERRY_SKIP_SOFTROCE=1)\n' >&2
else
    step "Soft-RoCE suite: build the test executables (scripts/rdma-tests-list.sh)"
    scripts/rdma-tests-list.sh
    step "Soft-RoCE suite, all of it, on Debian 12's kernel 6.1 (scripts/test-rdma.sh --kernels default)"
    # About 1,000 s under TCG on a quiet 2-core machine (50 test files); the bound
    # leaves room for a slower machine without letting a hung test run for ever.
    SOFTROCE_TIMEOUT="${SOFTROCE_TIMEOUT:-1800}" scripts/test-rdma.sh --kernels default -- \
        scripts/rdma-suite.sh target/rdma-suite/tests.txt
    step "Soft-RoCE suite, the kernel-dependent part, on the newest 6.12 (scripts/test-rdma.sh --kernels newest-6.12)"
    SOFTROCE_TIMEOUT="${SOFTROCE_TIMEOUT:-1200}" scripts/test-rdma.sh --kernels newest-6.12 -- \
        scripts/rdma-suite.sh target/rdma-suite/compat.txt
fi
# ------------------------------------------------------------------------------

# Smoke run only: small sizes, one repetition, the debug binaries built above (no
# release build), no results written; installs nothing, but setup.sh has installed
# the peers, so every one of them runs.
step "bench smoke run (bench/run --quick --bin-dir ${CARGO_TARGET_DIR:-target}/debug --no-save)"
bench/run --quick --bin-dir "${CARGO_TARGET_DIR:-target}/debug" --no-save

step ""
printf '\n=== [test] all steps passed in %ds\n' "$SECONDS" >&2
