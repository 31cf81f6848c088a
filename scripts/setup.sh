#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu machine.
#
# Installs only what is missing, checks for a Rust >= 1.85 toolchain and
# fetches the crates the workspace needs. Quiet when there is nothing to do;
# everything it reports goes to stderr as `[setup] ...` lines.
#
# PACKAGES covers building the workspace, including the verbs transport: the
# rdma-sys crate links libibverbs/librdmacm (found with pkg-config) and runs
# bindgen at build time, which needs libclang (rdma-sys 0.3 breaks with
# clang >= 16; Debian 12's default libclang-dev is clang 14). It also covers
# the RDMA user space run inside the Soft-RoCE VM (scripts/softroce-vm.sh),
# whose root file system is this host's /. The VM harness installs what else
# it needs itself (kmod, iproute2, ...) and keeps its kernel and qemu in a
# cache dir, see docs/softroce.md.
#
# To add system packages, append them to PACKAGES below.
set -euo pipefail

# Debian/Ubuntu packages needed to build and run Ferry.
PACKAGES=(
    build-essential
    pkg-config
    ca-certificates
    # build: rdma-sys (verbs + rdma_cm headers, bindgen's libclang)
    libibverbs-dev
    librdmacm-dev
    libclang-dev
    # run: verbs provider (rxe) and tools used inside the Soft-RoCE VM
    ibverbs-providers
    ibverbs-utils
    rdmacm-utils
    perftest
    # bench/run: FUSE (fusermount3) and the peers Ferry is measured against,
    # each started on 127.0.0.1 by the benchmark itself (an rsync daemon, a
    # private sshd for scp and sshfs, iperf3 -s), fio for the random reads,
    # gnuplot for the chart
    fuse3
    rsync
    sshfs
    openssh-server
    openssh-client
    iperf3
    fio
    gnuplot-nox
    # test: tools the read-write mount tests drive (tests/tests/mount_write.rs)
    sqlite3
    git
    # build: protoc, for the etcd client's gRPC definitions (etcd-client's build.rs),
    # and the well-known types they import (google/protobuf/descriptor.proto...),
    # which Debian ships in libprotobuf-dev, only a Recommends of protobuf-compiler
    protobuf-compiler
    libprotobuf-dev
    # cluster mode's metadata store, started by the tests and the benchmark
    # (tests/tests/cluster.rs, bench cluster job) on ports of their own
    etcd-server
    # etcdctl, which restores a saved etcd snapshot (tests/tests/cluster_snapshot.rs)
    etcd-client
    # network namespaces, veth pairs and tc shaping for the cluster tests
    iproute2
    # certificates for the TLS etcd of the cluster tests (tests/src/certs.rs)
    openssl
)

# Commands needed by the scripts, as COMMAND:PACKAGE. The package is installed
# only when the command is not found on PATH (whichever way it was installed).
COMMANDS=(
    python3:python3
)

# Minimum Rust toolchain (matches rust-version in Cargo.toml).
RUST_MIN_MAJOR=1
RUST_MIN_MINOR=85

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { echo "[setup] $*" >&2; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# as_root, apt_install, is_installed, pkg_missing (shared with bench/run).
# shellcheck source=scripts/lib/pkg.sh
. "$ROOT/scripts/lib/pkg.sh"

# --- 1. system packages -------------------------------------------------------
if command -v dpkg-query >/dev/null 2>&1; then
    mapfile -t missing < <(pkg_missing "${PACKAGES[@]}")
    for entry in "${COMMANDS[@]}"; do
        command -v "${entry%%:*}" >/dev/null 2>&1 || missing+=("${entry#*:}")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        apt_install "${missing[@]}"
    fi
else
    log "warning: not a Debian/Ubuntu system (no dpkg-query); make sure these are installed: ${PACKAGES[*]} ${COMMANDS[*]#*:}"
fi

# --- 2. Rust toolchain --------------------------------------------------------
# A rustup install lives in ~/.cargo/bin, which a fresh shell may not have on PATH.
if [ -d "${CARGO_HOME:-$HOME/.cargo}/bin" ]; then
    case ":$PATH:" in
        *":${CARGO_HOME:-$HOME/.cargo}/bin:"*) ;;
        *) PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; export PATH ;;
    esac
fi

# Prints the rustc version as MAJOR.MINOR.PATCH, or nothing.
rust_version() {
    rustc --version 2>/dev/null | sed -n 's/^rustc \([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\).*/\1/p'
}

rust_ok() {
    command -v cargo >/dev/null 2>&1 || return 1
    command -v rustc >/dev/null 2>&1 || return 1
    local v major minor
    v="$(rust_version)"
    [ -n "$v" ] || return 1
    major="${v%%.*}"
    minor="${v#*.}"; minor="${minor%%.*}"
    [ "$major" -gt "$RUST_MIN_MAJOR" ] ||
        { [ "$major" -eq "$RUST_MIN_MAJOR" ] && [ "$minor" -ge "$RUST_MIN_MINOR" ]; }
}

need_rustup() {
    local have
    have="$(rust_version)"
    die "a Rust >= ${RUST_MIN_MAJOR}.${RUST_MIN_MINOR} toolchain is needed (found: ${have:-none}).
[setup] Install one with rustup (https://rustup.rs):
[setup]   curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
[setup]   . \"\$HOME/.cargo/env\"
[setup] then run this script again."
}

if ! rust_ok; then
    if ! command -v cargo >/dev/null 2>&1 || ! command -v rustc >/dev/null 2>&1; then
        if command -v apt-get >/dev/null 2>&1; then
            log "cargo/rustc not found; trying the distribution's packages"
            apt_install cargo rustc || true
        fi
    fi
    rust_ok || need_rustup
fi

# --- 3. crates ----------------------------------------------------------------
cd "$ROOT"
if [ -f Cargo.lock ]; then
    cargo fetch --locked --quiet || die "cargo fetch --locked failed (is Cargo.lock up to date with Cargo.toml?)"
else
    log "no Cargo.lock; running cargo fetch"
    cargo fetch --quiet || die "cargo fetch failed"
fi
