#!/usr/bin/env bash
# The Soft-RoCE suite, run INSIDE the VM by scripts/test.sh through
# scripts/test-rdma.sh (one run per kernel):
#
#   scripts/test-rdma.sh -- scripts/rdma-suite.sh target/rdma-suite/tests.txt
#
# tests.txt lists test executables built on the host (cargo test --no-run), one per
# line, as "NAME PATH [FILTER]". Each runs with --include-ignored (the ignored tests
# are the ones that need an RDMA device) and with the whole integration suite on the
# verbs transport: rcp is forced onto RDMA (FERRY_TEST_TRANSPORT=rdma) and every test
# server listens on the device's address ($SOFTROCE_IP), since rdma_cm cannot route
# 127.0.0.1. The ferry-mount tests (tests/tests/mount.rs) mount FUSE file systems on
# the same RDMA transport: softroce-vm.sh loads the fuse module (6.1; 6.12 has it built
# in), the binaries (ferryd, rcp, ferry-mount) come from $FERRY_BIN_DIR. Exits non-zero
# if any executable failed.
set -uo pipefail

LIST=${1:?usage: rdma-suite.sh TESTS.TXT}
[ "${SOFTROCE_IN_VM:-}" = 1 ] || { echo "rdma-suite: run me inside the VM (scripts/test-rdma.sh)" >&2; exit 2; }

export FERRY_TEST_TRANSPORT=rdma
export FERRY_TEST_ADDR="$SOFTROCE_IP"
export FERRY_RDMA_ADDR="$SOFTROCE_IP"
export FERRY_RDMA_DEV="${SOFTROCE_DEV:-rxe0}"
export FERRY_BIN_DIR="${FERRY_BIN_DIR:-$PWD/target/debug}"
export RUST_BACKTRACE=1

echo "[rdma-suite] kernel $(uname -r), device $FERRY_RDMA_DEV at $SOFTROCE_IP"
# FUSE for the ferry-mount tests (a no-op when softroce-vm.sh preloaded it).
[ -e /dev/fuse ] || modprobe fuse 2>/dev/null || true
[ -e /dev/fuse ] || echo "[rdma-suite] WARNING: no /dev/fuse: the ferry-mount tests will fail"
failed=()
while read -r name path filter; do
    [ -n "$name" ] || continue
    start=$(date +%s)
    # shellcheck disable=SC2086 # FILTER is one optional word
    if "$path" --include-ignored --test-threads 2 --nocapture $filter >"/tmp/rdma-suite-$name.log" 2>&1; then
        echo "[rdma-suite] ok     $name ($(grep -h '^test result' "/tmp/rdma-suite-$name.log" | tail -n1 | sed 's/test result: //'); $(( $(date +%s) - start ))s)"
        # The counter proof prints what the device carried.
        grep -h 'SEND messages' "/tmp/rdma-suite-$name.log" | sed 's/^/[rdma-suite]        /' || true
    else
        echo "[rdma-suite] FAILED $name"
        grep -E '^test .* FAILED$' "/tmp/rdma-suite-$name.log" | sed 's/^/[rdma-suite]        /'
        # The panics and logs, without the passing tests and the backtraces' frames.
        grep -vE '^test .* \.\.\. ok$|^ +([0-9]+: |at )' "/tmp/rdma-suite-$name.log" | tail -n 80
        failed+=("$name")
    fi
done <"$LIST"
# The device's counters over the whole run, for the record.
for c in sent_pkts rdma_sends; do
    printf '[rdma-suite] %s: %s\n' "$c" "$(cat "/sys/class/infiniband/$FERRY_RDMA_DEV/ports/1/hw_counters/$c" 2>/dev/null || echo '?')"
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "[rdma-suite] FAILED: ${failed[*]}"
    exit 1
fi
echo "[rdma-suite] all passed"
