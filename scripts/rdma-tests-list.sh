#!/usr/bin/env bash
# Builds the test executables of the Soft-RoCE suite on the host and writes their list
# (NAME PATH [FILTER] per line) to target/rdma-suite/tests.txt, for scripts/rdma-suite.sh,
# and the part of it that scripts/test.sh runs on the second kernel to
# target/rdma-suite/compat.txt (COMPAT below).
# Also builds the binaries those tests start (ferryd, rcp, ferry-mount: target/debug).
# Left out (TCP_ONLY below): test files that speak the TCP transport's frames by hand
# (they test ferryd's TCP listener, whatever transport the suite runs rcp on), and those
# of requests that move no file data and whose outcome is the server's file system's
# (extended attributes, fallocate modes: the VM's /tmp has neither on 6.1), and those
# that open no session at all (check_config: ferryd reading its configuration).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p target/rdma-suite
cargo build --workspace --bins --quiet
# The whole workspace, as `cargo test --workspace` builds it: asking for two packages
# alone would unify features differently and rebuild half the dependency graph.
cargo test --workspace --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, os
# Raw TCP-transport clients (tests/src/raw.rs): nothing in them runs over RDMA.
# hostile: a peer that speaks only the control protocol. xattr and falloc: requests
# that move no data (control messages only), whose outcome is up to the server file
# system: the VM /tmp (tmpfs under overlayfs on 6.1) has no user.* attributes and
# no FALLOC_FL_ZERO_RANGE, so the host runs them, on ext4.
# check_config: ferryd --check-config, which opens no connection.
TCP_ONLY = {"hostile", "xattr", "falloc", "check_config"}
common = os.path.abspath("common/Cargo.toml")
suite = os.path.abspath("tests/Cargo.toml")
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name = m["target"]["name"]
    exe = os.path.relpath(m["executable"])
    manifest = m.get("manifest_path")
    if manifest not in (common, suite):
        continue
    if manifest == common:
        # Only the verbs transport unit tests (in the library) need the device; the
        # rest, and the test files of ferry-common, ran on the host.
        if "lib" in m["target"]["kind"]:
            print("ferry_common_rdma", exe, "transport::rdma")
    elif m["target"]["kind"] == ["test"] and name not in TCP_ONLY:
        print(name, exe)
' > target/rdma-suite/tests.txt
cat target/rdma-suite/tests.txt >&2

# What can differ between kernels: the verbs transport's own device tests (MRs, bad
# rkeys, rdma_cm events), the hardware-counter proof, copies both ways, FUSE reads,
# mmapped-file registration, killed peers, corrupted chunks and error reporting.
COMPAT="ferry_common_rdma rdma roundtrip mount mapped resilience corruption errors"
pattern="^($(echo $COMPAT | tr ' ' '|')) "
grep -E "$pattern" target/rdma-suite/tests.txt > target/rdma-suite/compat.txt
want=$(echo $COMPAT | wc -w)
got=$(wc -l < target/rdma-suite/compat.txt)
if [ "$got" -ne "$want" ]; then
    echo "rdma-tests-list: compat.txt has $got of the $want executables named in COMPAT ($COMPAT)" >&2
    exit 1
fi
