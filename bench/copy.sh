#!/usr/bin/env bash
# Copy benchmark: rcp upload and download of one big file through a ferryd on
# 127.0.0.1, next to two references measured in the same run:
#   - cp of the same file on the same disk, timed including `sync`;
#   - a raw loopback TCP stream of the file (python3 socket.sendfile into a
#     server that discards with recv_into a 1 MiB buffer): the ceiling of the
#     tcp transport.
# Each job is timed with a monotonic clock; the table shows the median.
#
#   bench/copy.sh                 # 2 GiB file, 3 repetitions, release build
#   bench/copy.sh --quick         # 64 MiB, 1 repetition
#   bench/copy.sh --size-mib 512 --reps 5
#
# The table is printed and written to bench/results/copy-<date>.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage() {
    cat <<'USAGE'
usage: bench/copy.sh [--quick] [--size-mib N] [--reps N] [--bin-dir DIR] [--no-save]

  --quick         64 MiB and 1 repetition (a smoke run)
  --size-mib N    size of the test file in MiB (default 2048)
  --reps N        repetitions per job; the median is reported (default 3)
  --bin-dir DIR   use the ferryd and rcp already in DIR instead of building
                  target/release (e.g. --bin-dir target/debug)
  --no-save       print the table only; do not write bench/results/copy-<date>.md

Temporary data goes under ${TMPDIR:-/tmp} and is removed on exit.
USAGE
}

SIZE_MIB=2048
REPS=3
BIN_DIR=""
SAVE=1
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) SIZE_MIB=64; REPS=1 ;;
        --size-mib) SIZE_MIB="${2:?--size-mib needs a value}"; shift ;;
        --size-mib=*) SIZE_MIB="${1#*=}" ;;
        --reps) REPS="${2:?--reps needs a value}"; shift ;;
        --reps=*) REPS="${1#*=}" ;;
        --bin-dir) BIN_DIR="${2:?--bin-dir needs a value}"; shift ;;
        --bin-dir=*) BIN_DIR="${1#*=}" ;;
        --no-save) SAVE=0 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "bench: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
for v in "$SIZE_MIB" "$REPS"; do
    case "$v" in '' | *[!0-9]* | 0) echo "bench: --size-mib and --reps take a positive whole number (got '$v')" >&2; exit 2 ;; esac
done

log() { echo "[bench] $*" >&2; }
die() {
    if [ -s "${WORK:-}/ferryd.log" ]; then
        echo "[bench] last lines of the ferryd log:" >&2
        tail -n 20 "$WORK/ferryd.log" >&2
    fi
    echo "[bench] ERROR: $*" >&2
    exit 1
}

# Hard limit for the whole run, so a stuck copy cannot hang CI.
BUDGET_S=540
# Per-command limit: generous for the size (at least 20 MiB/s), within the budget.
JOB_LIMIT_S=$((30 + SIZE_MIB / 20))

command -v python3 >/dev/null 2>&1 || die "python3 is needed (scripts/setup.sh installs it)"

# --- binaries -----------------------------------------------------------------
if [ -z "$BIN_DIR" ]; then
    if [ -d "${CARGO_HOME:-$HOME/.cargo}/bin" ]; then PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; fi
    log "building release binaries (cargo build --release --bins)"
    cargo build --release --bins --quiet
    BIN_DIR="$ROOT/target/release"
fi
BIN_DIR="$(cd "$BIN_DIR" && pwd)"
FERRYD="$BIN_DIR/ferryd"
RCP="$BIN_DIR/rcp"
if [ ! -x "$FERRYD" ] || [ ! -x "$RCP" ]; then die "no ferryd/rcp in $BIN_DIR"; fi
# The budget covers the benchmark itself, not the build.
SECONDS=0

# --- scratch space and clean-up -----------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferry-bench.XXXXXX")"
FERRYD_PID=""
cleanup() {
    if [ -n "$FERRYD_PID" ]; then
        kill "$FERRYD_PID" 2>/dev/null || true
        wait "$FERRYD_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

SHARE="$WORK/share"
TIMES="$WORK/times"
mkdir -p "$SHARE" "$TIMES"
FILE="$WORK/file.bin"
SIZE_BYTES=$((SIZE_MIB * 1024 * 1024))

# The original plus one copy at a time must fit.
avail_kib="$(df -Pk "$WORK" | awk 'NR == 2 { print $4 }')"
need_kib=$((2 * SIZE_MIB * 1024 + 256 * 1024))
[ "$avail_kib" -ge "$need_kib" ] ||
    die "not enough space under ${TMPDIR:-/tmp}: need $((need_kib / 1024)) MiB, have $((avail_kib / 1024)) MiB (set TMPDIR or use --size-mib)"

# --- helper: monotonic timing, raw TCP stream, table ----------------------------
cat >"$WORK/bench.py" <<'PY'
import os, signal, socket, statistics, subprocess, sys, threading, time


def run_timed(argv):
    """time LIMIT_S STDOUT_FILE -- CMD...: run CMD, print its wall time (monotonic)."""
    limit, out, sep, cmd = float(argv[0]), argv[1], argv[2], argv[3:]
    assert sep == "--" and cmd
    with open(out, "wb") as f:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=f, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            sys.exit(f"timed out after {limit:.0f} s: {' '.join(cmd)}")
        dt = time.monotonic() - t0
    if rc != 0:
        sys.stderr.write(f"exit code {rc}: {' '.join(cmd)}\n")
        sys.exit(rc if 0 < rc < 256 else 1)
    print(f"{dt:.6f}")


def raw_tcp(argv):
    """tcp FILE: stream FILE over loopback TCP with sendfile; print seconds."""
    path = argv[0]
    size = os.path.getsize(path)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = []

    def serve():
        conn, _ = srv.accept()
        buf = memoryview(bytearray(1 << 20))
        n = 0
        while True:
            k = conn.recv_into(buf)
            if k == 0:
                break
            n += k
        conn.close()
        got.append(n)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    with open(path, "rb") as f:
        t0 = time.monotonic()
        c = socket.create_connection(srv.getsockname())
        c.sendfile(f)
        c.shutdown(socket.SHUT_WR)
        th.join()
        dt = time.monotonic() - t0
        c.close()
    if got != [size]:
        sys.exit(f"raw TCP: received {got} bytes, expected {size}")
    print(f"{dt:.6f}")


JOBS = [
    ("cp", "cp + sync (same disk)"),
    ("tcp", "raw TCP loopback (sendfile)"),
    ("upload", "rcp upload"),
    ("download", "rcp download"),
]


def table(argv):
    """table TIMES_DIR SIZE_BYTES: markdown table of the medians."""
    d, size = argv[0], int(argv[1])
    med = {}
    for key, _ in JOBS:
        with open(os.path.join(d, key)) as f:
            med[key] = statistics.median(float(x) for x in f.read().split())
    rate = {k: size / s for k, s in med.items()}
    print("| job | seconds | GB/s | vs cp | vs raw TCP |")
    print("|---|---:|---:|---:|---:|")
    for key, label in JOBS:
        print(f"| {label} | {med[key]:.3f} | {rate[key] / 1e9:.3f} "
              f"| {rate[key] / rate['cp']:.2f}x | {rate[key] / rate['tcp']:.2f}x |")


if __name__ == "__main__":
    {"time": run_timed, "tcp": raw_tcp, "table": table}[sys.argv[1]](sys.argv[2:])
PY

# set_limit: LIMIT = the per-job limit, cut to what is left of the budget.
set_limit() {
    local left=$((BUDGET_S - SECONDS))
    [ "$left" -gt 5 ] || die "the run exceeded its ${BUDGET_S} s budget"
    LIMIT=$((left < JOB_LIMIT_S ? left : JOB_LIMIT_S))
}
# timed JOB CMD...: run CMD under the limit, append its seconds to $TIMES/JOB.
timed() {
    local job="$1" t
    shift
    sync # start clean: no dirty pages of earlier steps charged to this job
    set_limit
    t="$(python3 "$WORK/bench.py" time "$LIMIT" "$WORK/stdout" -- "$@")" || die "$job failed"
    echo "$t" >>"$TIMES/$job"
    log "  $job: ${t} s"
}

# --- test file and server -----------------------------------------------------
log "writing a ${SIZE_MIB} MiB random test file under $WORK"
head -c "$SIZE_BYTES" /dev/urandom >"$FILE"
# Download source: the same bytes inside the share (a hard link costs no space).
ln "$FILE" "$SHARE/dl.bin" 2>/dev/null || cp "$FILE" "$SHARE/dl.bin"
sync # the test file is written back now, not during the first timed job

"$FERRYD" --generate-secret "$WORK/bench.secret" 2>/dev/null
export FERRY_SECRET_FILE="$WORK/bench.secret" # for rcp and ferry-mount
"$FERRYD" --share "bench=$SHARE" --secret-file "$WORK/bench.secret" --listen 127.0.0.1:0 --port-file "$WORK/port" 2>"$WORK/ferryd.log" &
FERRYD_PID=$!
for _ in $(seq 1 100); do
    [ -s "$WORK/port" ] && break
    kill -0 "$FERRYD_PID" 2>/dev/null || { FERRYD_PID=""; die "ferryd exited at start"; }
    sleep 0.1
done
[ -s "$WORK/port" ] || die "ferryd did not write its port file within 10 s"
ADDR="$(head -n 1 "$WORK/port")"
log "ferryd on $ADDR, binaries from $BIN_DIR"

# --- the runs -----------------------------------------------------------------
TRANSPORT="?"
for rep in $(seq 1 "$REPS"); do
    log "repetition $rep/$REPS"

    # shellcheck disable=SC2016 # $1 and $2 are expanded by the inner sh
    timed cp sh -c 'cp --reflink=never -- "$1" "$2" && sync' sh "$FILE" "$WORK/cp.out"
    rm -f "$WORK/cp.out"

    set_limit
    t="$(timeout "$LIMIT" python3 "$WORK/bench.py" tcp "$FILE")" || die "raw TCP stream failed"
    echo "$t" >>"$TIMES/tcp"
    log "  tcp: ${t} s"

    timed upload "$RCP" --json "$FILE" "$ADDR:bench/up.bin"
    TRANSPORT="$(sed -n 's/.*"transport":"\([^"]*\)".*/\1/p' "$WORK/stdout")"
    cmp "$FILE" "$SHARE/up.bin" || die "uploaded file differs from the original"
    rm -f "$SHARE/up.bin"

    timed download "$RCP" --json "$ADDR:bench/dl.bin" "$WORK/dl.out"
    cmp "$FILE" "$WORK/dl.out" || die "downloaded file differs from the original"
    rm -f "$WORK/dl.out"
done

# --- report -------------------------------------------------------------------
REV="$(git rev-parse --short HEAD 2>/dev/null || echo 'no commit')"
if [ -n "$(git status --porcelain 2>/dev/null | head -n 1)" ]; then REV="$REV (dirty)"; fi
REPORT="$WORK/report.md"
{
    echo "# rcp copy benchmark, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- file: ${SIZE_MIB} MiB of random data, median of ${REPS} run(s); GB/s = 10^9 bytes/s"
    echo "- rcp transport: ${TRANSPORT:-?}; binaries: ${BIN_DIR#"$ROOT"/}; revision: $REV"
    echo "- host: $(nproc) CPUs, $(uname -sr); temp dir on $(df -PT "$WORK" | awk 'NR == 2 { print $2 }')"
    echo "- cp is timed including sync; rcp upload and download are the whole rcp command"
    echo "- vs cp / vs raw TCP: throughput relative to that job (>1x is faster)"
    echo
    python3 "$WORK/bench.py" table "$TIMES" "$SIZE_BYTES"
} >"$REPORT"

echo
cat "$REPORT"
if [ "$SAVE" -eq 1 ]; then
    mkdir -p bench/results
    OUT="bench/results/copy-$(date -u '+%Y-%m-%d-%H%M%S').md"
    cp "$REPORT" "$OUT"
    echo
    log "written to $OUT"
fi
