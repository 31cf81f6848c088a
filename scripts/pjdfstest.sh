#!/usr/bin/env bash
# pjdfstest, the POSIX conformance suite, inside a real ferry-mount (issue 42): builds
# the suite from a copy of ../shared/pjdfstest (read-only upstream source), starts a
# ferryd on loopback exporting a share with client owners (root not squashed, device
# nodes and set-ID bits allowed: the suite makes both, as root) on a tmpfs mounted
# `nodev,nosuid` (which ferryd requires for those), mounts it with
# `-o allow_other,default_permissions` (the suite runs steps as uids 65533-65534) and
# runs every test file in it (scripts/lib/pjdfstest.py). Every failure must be one
# that docs/conformance.md lists with its reason, and every listed one must still
# fail: the list stays true. Needs root and /dev/fuse.
#
#   scripts/pjdfstest.sh [--bin-dir DIR] [--json FILE] [--only GLOB] [--no-expect]
#
#   --bin-dir DIR   ferryd and ferry-mount from DIR (default target/debug)
#   --json FILE     write the counts and failures there (bench/run's conformance job)
#   --only GLOB     only the test files matching GLOB (e.g. 'chown/*'); implies --no-expect
#   --no-expect     count only: do not compare with docs/conformance.md
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$ROOT/${CARGO_TARGET_DIR:-target}/debug"
JSON=""
ONLY=()
EXPECT=(--expect "$ROOT/docs/conformance.md")
while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) BIN_DIR="$(cd "${2:?--bin-dir needs a value}" && pwd)"; shift ;;
        --json) JSON="${2:?--json needs a value}"; shift ;;
        --only) ONLY=(--only "${2:?--only needs a value}"); EXPECT=(); shift ;;
        --no-expect) EXPECT=() ;;
        *) echo "pjdfstest.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
    shift
done

SRC="${FERRY_PJDFSTEST_SRC:-$ROOT/../shared/pjdfstest}"
log() { echo "[pjdfstest] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (the suite tests owners with other uids)"
[ -f "$SRC/pjdfstest.c" ] || die "no pjdfstest source at $SRC (set FERRY_PJDFSTEST_SRC)"
[ -x "$BIN_DIR/ferryd" ] && [ -x "$BIN_DIR/ferry-mount" ] || die "no ferryd/ferry-mount in $BIN_DIR (cargo build --workspace --bins)"

WORK="$(mktemp -d /tmp/ferry-pjdfstest.XXXXXX)"
chmod 755 "$WORK"
FERRYD_PID="" MOUNT_PID=""
cleanup() {
    local rc=$?
    if [ -n "$MOUNT_PID" ]; then
        kill -TERM "$MOUNT_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$MOUNT_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    if grep -q " $WORK/mnt " /proc/self/mountinfo; then umount -l "$WORK/mnt" || true; fi
    if [ -n "$FERRYD_PID" ]; then
        kill -TERM "$FERRYD_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$FERRYD_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    if grep -q " $WORK/share " /proc/self/mountinfo; then umount -l "$WORK/share" || true; fi
    if [ "$rc" -ne 0 ]; then
        for f in ferryd.log ferry-mount.log; do
            [ -s "$WORK/$f" ] && { log "last lines of $f:"; tail -n 20 "$WORK/$f" | cut -c1-300 >&2; }
        done
    fi
    grep -q " $WORK/mnt \| $WORK/share " /proc/self/mountinfo || rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT

log "building the suite from $SRC"
python3 "$ROOT/scripts/lib/pjdfstest.py" build "$SRC" "$WORK/suite"

mkdir -m 755 "$WORK/share" "$WORK/mnt"
mount -t tmpfs -o size=1g,mode=755,nodev,nosuid ferry-pjdfstest "$WORK/share"
"$BIN_DIR/ferryd" --generate-secret "$WORK/secret" 2>/dev/null
cat >"$WORK/ferryd.toml" <<EOF
listen = "127.0.0.1:0"
[[share]]
name = "posix"
path = "$WORK/share"
owners = "client"
root_squash = false
allow_devices = true
allow_setid = true
EOF
"$BIN_DIR/ferryd" --config "$WORK/ferryd.toml" --secret-file "$WORK/secret" \
    --transport tcp --port-file "$WORK/port" 2>"$WORK/ferryd.log" &
FERRYD_PID=$!
for _ in $(seq 100); do [ -s "$WORK/port" ] && break; kill -0 "$FERRYD_PID" || die "ferryd exited at start"; sleep 0.1; done
[ -s "$WORK/port" ] || die "ferryd did not write its port file within 10 s"

FERRY_SECRET_FILE="$WORK/secret" "$BIN_DIR/ferry-mount" -f --transport tcp \
    -o allow_other,default_permissions "$(cat "$WORK/port"):posix" "$WORK/mnt" 2>"$WORK/ferry-mount.log" &
MOUNT_PID=$!
for _ in $(seq 200); do
    grep -q " $WORK/mnt .* - fuse.ferry " /proc/self/mountinfo && break
    kill -0 "$MOUNT_PID" || die "ferry-mount exited before mounting"
    sleep 0.1
done
grep -q " $WORK/mnt .* - fuse.ferry " /proc/self/mountinfo || die "ferry-mount did not mount within 20 s"
log "ferryd $(cat "$WORK/port") (share posix on a nodev,nosuid tmpfs, owners = client, no root squash, devices and set-ID bits allowed) mounted on $WORK/mnt"

python3 "$ROOT/scripts/lib/pjdfstest.py" run "$WORK/suite" "$WORK/mnt" --jobs 4 \
    ${JSON:+--json "$JSON"} "${ONLY[@]}" "${EXPECT[@]}"
