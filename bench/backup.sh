#!/usr/bin/env bash
# Backup benchmark: `rcp backup` against `rsync -a --link-dest` to an rsync daemon,
# both over loopback on one machine (ferryd on 127.0.0.1; rsyncd on 127.0.0.1, no ssh).
#
# A tree of FILES small files (1..8 KiB) in 350 directories and BIG_MIB MiB of large
# files (8 MiB each) is backed up once (full), then 1 % of the small files and one
# 4 KiB range of every tenth big file are changed and it is backed up again
# (incremental). Reported: wall time of each run for both, their ratio, rcp's bytes
# sent (--json), and how many files of rsync's second copy are hard links (a check
# that --link-dest worked). rsync's times include a `sync` (ferryd fsyncs every file
# it commits; rsync does not).
#
#   bench/backup.sh                    # 20,000 files + 512 MiB, release build
#   bench/backup.sh --quick            # 2,000 files + 64 MiB
#   bench/backup.sh --bin-dir DIR      # use built binaries (e.g. $CARGO_TARGET_DIR/debug)
#   bench/backup.sh --jobs N           # rcp backup -j N
#   bench/backup.sh --reps N           # N full + incremental pairs (fresh prefixes), one row each
#   bench/backup.sh --ferryd-log LEVEL # run ferryd with RUST_LOG=LEVEL (default: its own)
#   bench/backup.sh --profile DIR      # perf record -g ferryd and rcp during rep 1's incremental
#   bench/backup.sh --strace DIR       # strace -c -f ferryd and rcp during rep 1's incremental
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

FILES=20000
BIG_MIB=512
BIN_DIR=""
JOBS=""
REPS=1
FERRYD_LOG=""
PROFILE=""
STRACE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) FILES=2000; BIG_MIB=64 ;;
        --files) FILES="${2:?}"; shift ;;
        --big-mib) BIG_MIB="${2:?}"; shift ;;
        --bin-dir) BIN_DIR="${2:?}"; shift ;;
        --jobs) JOBS="${2:?}"; shift ;;
        --reps) REPS="${2:?}"; shift ;;
        --ferryd-log) FERRYD_LOG="${2:?}"; shift ;;
        --profile) PROFILE="${2:?}"; shift ;;
        --strace) STRACE="${2:?}"; shift ;;
        -h | --help) sed -n 2,22p "$0"; exit 0 ;;
        *) echo "bench: unknown argument '$1'" >&2; exit 2 ;;
    esac
    shift
done

log() { echo "[bench] $*" >&2; }
if [ -z "$BIN_DIR" ]; then
    log "building release binaries"
    cargo build --release --bins --quiet
    BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
FERRYD="$BIN_DIR/ferryd"
RCP="$BIN_DIR/rcp"
if ! command -v rsync >/dev/null; then
    log "installing rsync"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get install -y -qq rsync >/dev/null || { echo "bench: cannot install rsync" >&2; exit 2; }
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferry-backup-bench.XXXXXX")"
FERRYD_PID=""
RSYNCD_PID=""
cleanup() {
    [ -n "$FERRYD_PID" ] && kill "$FERRYD_PID" 2>/dev/null && wait "$FERRYD_PID" 2>/dev/null
    [ -n "$RSYNCD_PID" ] && kill "$RSYNCD_PID" 2>/dev/null && wait "$RSYNCD_PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

SRC="$WORK/src"
log "making the tree: $FILES small files, $BIG_MIB MiB of big ones"
python3 - "$SRC" "$FILES" "$BIG_MIB" <<'PY'
import os, random, sys
src, files, big_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(1)
for i in range(files):
    d = os.path.join(src, f"d{i % 50:02}", f"s{i % 7}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i:06}"), "wb") as f:
        f.write(rng.randbytes(rng.randint(1024, 8192)))
os.makedirs(os.path.join(src, "big"), exist_ok=True)
for i in range(big_mib // 8):
    with open(os.path.join(src, "big", f"b{i:04}"), "wb") as f:
        f.write(os.urandom(8 << 20))
PY

change() {
    python3 - "$SRC" <<'PY'
import os, sys
src = sys.argv[1]
small = sorted(os.path.join(r, n) for r, _, ns in os.walk(src) for n in ns if "/big" not in r)
for p in small[::100]:
    with open(p, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
big = sorted(os.listdir(os.path.join(src, "big")))
for n in big[::10]:
    with open(os.path.join(src, "big", n), "r+b") as f:
        f.seek(3 << 20)
        f.write(os.urandom(4096))
PY
}

SHARE="$WORK/share"
mkdir -p "$SHARE"
"$FERRYD" --generate-secret "$WORK/bench.secret" 2>/dev/null
export FERRY_SECRET_FILE="$WORK/bench.secret"
${FERRYD_LOG:+env RUST_LOG=$FERRYD_LOG} "$FERRYD" --share "bench=$SHARE" --secret-file "$WORK/bench.secret" --listen 127.0.0.1:0 --port-file "$WORK/port" 2>"$WORK/ferryd.log" &
FERRYD_PID=$!
for _ in $(seq 100); do [ -s "$WORK/port" ] && break; sleep 0.1; done
ADDR="$(head -n 1 "$WORK/port")"

now() { date +%s.%N; }
elapsed() { python3 -c "print(f'{$2 - $1:.2f}')"; }

RSYNC_DST="$WORK/rsync"
mkdir -p "$RSYNC_DST"
RSYNC_PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cat >"$WORK/rsyncd.conf" <<EOF
pid file = $WORK/rsyncd.pid
use chroot = no
[bench]
    path = $RSYNC_DST
    read only = no
    uid = $(id -un)
    gid = $(id -gn)
EOF
rsync --daemon --no-detach --config="$WORK/rsyncd.conf" --address=127.0.0.1 --port="$RSYNC_PORT" \
    --log-file="$WORK/rsyncd.log" &
RSYNCD_PID=$!
RSYNC_URL="rsync://127.0.0.1:$RSYNC_PORT/bench"
for _ in $(seq 100); do rsync "$RSYNC_URL/" >/dev/null 2>&1 && break; sleep 0.1; done

now() { date +%s.%N; }
elapsed() { python3 -c "print(f'{$2 - $1:.2f}')"; }
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
RCP_ARGS=(backup --json)
[ -n "$JOBS" ] && RCP_ARGS+=(-j "$JOBS")

field() { sed -n "s/.*\"$2\":\([0-9]*\).*/\1/p" "$1"; }
echo
echo "| run | rsync --link-dest to rsyncd (s) | rcp backup (s) | rcp / rsync | rcp bytes sent | rcp bytes reused |"
echo "|---|---|---|---|---|---|"
LINKED=""
for rep in $(seq "$REPS"); do
    # Each repetition backs up into fresh destinations: rsync's R1/R2, rcp's hostR.
    sync
    t0=$(now); rsync -a "$SRC/" "$RSYNC_URL/${rep}a/"; sync; t1=$(now); RSYNC_FULL=$(elapsed "$t0" "$t1")
    t0=$(now); "$RCP" "${RCP_ARGS[@]}" "$SRC" "$ADDR:bench/host$rep" >"$WORK/full.json"; t1=$(now); RCP_FULL=$(elapsed "$t0" "$t1")
    sleep 1.1 # snapshot names have second resolution
    change
    sync
    t0=$(now); rsync -a --link-dest="../${rep}a" "$SRC/" "$RSYNC_URL/${rep}b/"; sync; t1=$(now); RSYNC_INC=$(elapsed "$t0" "$t1")
    WRAP=()
    OBSERVER=""
    if [ "$rep" = 1 ] && [ -n "$PROFILE" ]; then
        mkdir -p "$PROFILE"
        perf record -q -g -p "$FERRYD_PID" -o "$PROFILE/ferryd.data" 2>/dev/null &
        OBSERVER=$!
        WRAP=(perf record -q -g -o "$PROFILE/rcp.data" --)
    elif [ "$rep" = 1 ] && [ -n "$STRACE" ]; then
        mkdir -p "$STRACE"
        strace -c -f -p "$FERRYD_PID" -o "$STRACE/ferryd.txt" &
        OBSERVER=$!
        WRAP=(strace -c -f -o "$STRACE/rcp.txt")
    fi
    [ -n "$OBSERVER" ] && sleep 1
    t0=$(now); "${WRAP[@]}" "$RCP" "${RCP_ARGS[@]}" "$SRC" "$ADDR:bench/host$rep" >"$WORK/inc.json"; t1=$(now); RCP_INC=$(elapsed "$t0" "$t1")
    if [ -n "$OBSERVER" ]; then kill -INT "$OBSERVER"; wait "$OBSERVER" || true; fi
    LINKED="$LINKED $(find "$RSYNC_DST/${rep}b" -type f -links +1 | wc -l)"
    echo "| full | $RSYNC_FULL | $RCP_FULL | $(ratio "$RCP_FULL" "$RSYNC_FULL") | $(field "$WORK/full.json" bytes_sent) | $(field "$WORK/full.json" bytes_reused) |"
    echo "| 1 % changed | $RSYNC_INC | $RCP_INC | $(ratio "$RCP_INC" "$RSYNC_INC") | $(field "$WORK/inc.json" bytes_sent) | $(field "$WORK/inc.json" bytes_reused) |"
done
echo
echo "($FILES small files + $BIG_MIB MiB; rcp over the tcp transport on loopback; rsync to an"
echo "rsync daemon on 127.0.0.1; files of rsync's second copies that are hard links:$LINKED.)"
