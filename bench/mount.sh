#!/usr/bin/env bash
# Mount benchmark: one file read through ferry-mount (FUSE client of a ferryd on
# 127.0.0.1, tcp transport), next to two references measured in the same run:
#   - the file itself on the local disk;
#   - the same directory mounted with sshfs from a private sshd on 127.0.0.1.
# Jobs, each one cold: page cache dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`)
# and the FUSE client freshly mounted (ferry-mount keeps verified chunks in its own
# memory, which drop_caches does not reach); ferryd and sshd keep running:
#   - sequential read of the whole file (dd bs=1M, timed with a monotonic clock);
#   - 4 KiB random reads at queue depth 1 (fio psync, time-bounded): p50 and p99
#     latency and IOPS.
# The table shows the median of the repetitions. ferry-mount is stopped with SIGTERM
# before each remount and at the end; it must unmount and exit 0.
#
#   bench/mount.sh                 # 2 GiB file, 3 repetitions, fio 10 s, release build
#   bench/mount.sh --quick         # 64 MiB, 1 repetition, fio 3 s
#   bench/mount.sh --size-mib 512 --reps 5
#
# Needs root (drop_caches, a private sshd that lets root in with a throw-away key)
# and fuse3, sshfs, openssh-server, openssh-client, fio (scripts/setup.sh installs
# them). /etc/ssh and ~/.ssh are not touched. The table is printed and written to
# bench/results/mount-<date>.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CMDLINE="bench/mount.sh${*:+ $*}"

usage() {
    cat <<'USAGE'
usage: bench/mount.sh [--quick] [--size-mib N] [--reps N] [--bin-dir DIR] [--no-save]

  --quick         64 MiB, 1 repetition, 3 s per fio run (a smoke run)
  --size-mib N    size of the test file in MiB (default 2048)
  --reps N        repetitions per job; the median is reported (default 3)
  --bin-dir DIR   use the ferryd and ferry-mount already in DIR instead of
                  building target/release (e.g. --bin-dir target/debug)
  --no-save       print the table only; do not write bench/results/mount-<date>.md

The run stops with an error after 15 min (2 min with --quick; BENCH_BUDGET_S
overrides). Temporary data goes under ${TMPDIR:-/tmp} and is removed on exit,
after the mounts are gone.
USAGE
}

SIZE_MIB=2048
REPS=3
FIO_RUNTIME_S=10
BUDGET_S=900
BIN_DIR=""
SAVE=1
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) SIZE_MIB=64; REPS=1; FIO_RUNTIME_S=3; BUDGET_S=120 ;;
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
BUDGET_S="${BENCH_BUDGET_S:-$BUDGET_S}"
case "$BUDGET_S" in '' | *[!0-9]*) echo "bench: BENCH_BUDGET_S must be a whole number of seconds (got '$BUDGET_S')" >&2; exit 2 ;; esac

log() { echo "[bench] $*" >&2; }
# die MESSAGE: print the tail of every service log we have, then fail.
die() {
    local f
    for f in ferryd ferry-mount sshd sshfs; do
        if [ -s "${WORK:-/nonexistent}/$f.log" ]; then
            echo "[bench] last lines of the $f log:" >&2
            tail -n 20 "$WORK/$f.log" >&2
        fi
    done
    echo "[bench] ERROR: $*" >&2
    exit 1
}

# Per-command limit for a whole-file read: at least 20 MiB/s.
SEQ_LIMIT_S=$((30 + SIZE_MIB / 20))
# fio stops itself after its runtime; the margin covers start-up and one slow read.
FIO_LIMIT_S=$((FIO_RUNTIME_S + 30))

# --- prerequisites ------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || die "must run as root (drop_caches; the private sshd logs in as root)"
for c in python3 fio sshfs fusermount3 ssh ssh-keygen dd; do
    command -v "$c" >/dev/null 2>&1 || die "'$c' not found (scripts/setup.sh installs it)"
done
SSHD="$(command -v sshd || true)"
[ -n "$SSHD" ] || { [ -x /usr/sbin/sshd ] && SSHD=/usr/sbin/sshd; } ||
    die "'sshd' not found (scripts/setup.sh installs openssh-server)"
[ -c /dev/fuse ] || die "/dev/fuse is missing (FUSE is not available on this machine)"
[ -w /proc/sys/vm/drop_caches ] || die "cannot write /proc/sys/vm/drop_caches"

# --- binaries -----------------------------------------------------------------
if [ -z "$BIN_DIR" ]; then
    if [ -d "${CARGO_HOME:-$HOME/.cargo}/bin" ]; then PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; fi
    log "building release binaries (cargo build --release --bins)"
    cargo build --release --bins --quiet
    BIN_DIR="$ROOT/target/release"
fi
BIN_DIR="$(cd "$BIN_DIR" && pwd)"
FERRYD="$BIN_DIR/ferryd"
FERRY_MOUNT="$BIN_DIR/ferry-mount"
[ -x "$FERRYD" ] || die "no ferryd in $BIN_DIR"
[ -x "$FERRY_MOUNT" ] ||
    die "no ferry-mount in $BIN_DIR: the FUSE client (fuse/) has not been built there (cargo build --release --bins, or pass --bin-dir)"
# The budget covers the benchmark itself, not the build.
SECONDS=0

# --- scratch space and clean-up -----------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferry-bench-mount.XXXXXX")"
SHARE="$WORK/share"
FILE="$SHARE/file.bin"
MNT_FERRY="$WORK/mnt-ferry"
MNT_SSHFS="$WORK/mnt-sshfs"
SSH_DIR="$WORK/ssh"
VALS="$WORK/values"
mkdir -p "$SHARE" "$MNT_FERRY" "$MNT_SSHFS" "$VALS"
mkdir -m 700 "$SSH_DIR"
SIZE_BYTES=$((SIZE_MIB * 1024 * 1024))

# fstype_at DIR: the file system type of the topmost mount exactly at DIR (e.g.
# fuse.ferry), or nothing. mountinfo writes space, tab, newline and backslash in
# octal; DIR is escaped the same way to compare.
fstype_at() {
    local m="${1//\\/\\134}"
    m="${m// /\\040}"
    m="${m//$'\t'/\\011}"
    m="${m//$'\n'/\\012}"
    M="$m" awk '$5 == ENVIRON["M"] { for (i = 7; i <= NF; i++) if ($i == "-") { t = $(i + 1); break } } END { print t }' /proc/self/mountinfo
}
# alive PID: PID is running (a zombie does not count).
alive() {
    local st
    st="$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null || true)"
    [ -n "$st" ] && [ "$st" != Z ]
}
# wait_exit PID SECONDS: wait up to SECONDS for PID to exit; fails if it has not.
wait_exit() {
    local _
    for _ in $(seq 1 $(($2 * 10))); do
        alive "$1" || return 0
        sleep 0.1
    done
    ! alive "$1"
}

FERRYD_PID=""
FERRY_MOUNT_PID=""
SSHD_PID=""
SSHFS_PID=""
cleanup() {
    local pid m
    if [ -n "$FERRY_MOUNT_PID" ]; then
        kill -TERM "$FERRY_MOUNT_PID" 2>/dev/null || true
        wait_exit "$FERRY_MOUNT_PID" 10 || kill -KILL "$FERRY_MOUNT_PID" 2>/dev/null || true
    fi
    if [ -n "$SSHFS_PID" ]; then
        [ -z "$(fstype_at "$MNT_SSHFS")" ] || fusermount3 -u "$MNT_SSHFS" 2>/dev/null || true
        wait_exit "$SSHFS_PID" 5 || kill -KILL "$SSHFS_PID" 2>/dev/null || true
    fi
    # Whatever is still mounted (a client that crashed or hung) goes lazily.
    for m in "$MNT_FERRY" "$MNT_SSHFS"; do
        if [ -n "$(fstype_at "$m")" ]; then
            echo "[bench] warning: $m is still mounted; lazy unmount" >&2
            fusermount3 -u -z "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
        fi
    done
    for pid in "$SSHD_PID" "$FERRYD_PID"; do
        if [ -n "$pid" ]; then
            kill -TERM "$pid" 2>/dev/null || true
            wait_exit "$pid" 5 || kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    # --one-file-system: never descend into a mount that could not be removed.
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The test file plus a little room for logs.
avail_kib="$(df -Pk "$WORK" | awk 'NR == 2 { print $4 }')"
need_kib=$((SIZE_MIB * 1024 + 64 * 1024))
[ "$avail_kib" -ge "$need_kib" ] ||
    die "not enough space under ${TMPDIR:-/tmp}: need $((need_kib / 1024)) MiB, have $((avail_kib / 1024)) MiB (set TMPDIR or use --size-mib)"

# --- helper: monotonic timing, free port, fio JSON, table ---------------------
cat >"$WORK/bench.py" <<'PY'
import json, os, signal, socket, statistics, subprocess, sys, time


def run_timed(argv):
    """time LIMIT_S -- CMD...: run CMD (stdout discarded), print its wall time (monotonic)."""
    limit, sep, cmd = float(argv[0]), argv[1], argv[2:]
    assert sep == "--" and cmd
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
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


def free_port(argv):
    """port: a TCP port on 127.0.0.1 that is free right now."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])
    s.close()


def fio(argv):
    """fio JSON_FILE: print 'p50_us p99_us iops' of the (single) read job."""
    with open(argv[0]) as f:
        text = f.read()
    # fio may print warnings before the JSON object.
    doc = json.loads(text[text.index("{"):])
    job = doc["jobs"][0]
    if job.get("error", 0):
        sys.exit(f"fio job error {job['error']}")
    rd = job["read"]
    if rd["total_ios"] <= 0:
        sys.exit("fio completed no reads")
    # lat = submission + completion; for psync, the whole pread().
    lat = rd.get("lat_ns", {}).get("percentile") or rd["clat_ns"]["percentile"]
    p = {float(k): v for k, v in lat.items()}
    print(f"{p[50.0] / 1e3:.3f} {p[99.0] / 1e3:.3f} {rd['iops']:.3f}")


TARGETS = [("local", "local"), ("ferry", "ferry-mount"), ("sshfs", "sshfs")]
METRICS = [
    ("seq", "sequential read, MiB/s", "{:.1f}"),
    ("p50", "4 KiB random read QD1, p50 µs", "{:.1f}"),
    ("p99", "4 KiB random read QD1, p99 µs", "{:.1f}"),
    ("iops", "4 KiB random read QD1, IOPS", "{:.0f}"),
]


def values(d, target, metric):
    with open(os.path.join(d, f"{target}.{metric}")) as f:
        return [float(x) for x in f.read().split()]


def table(argv):
    """table VALUES_DIR: markdown table of the medians."""
    d = argv[0]
    print("| job | " + " | ".join(label for _, label in TARGETS) + " | ferry:sshfs |")
    print("|---|" + "---:|" * (len(TARGETS) + 1))
    for key, label, fmt in METRICS:
        med = {t: statistics.median(values(d, t, key)) for t, _ in TARGETS}
        ratio = f"{med['ferry'] / med['sshfs']:.2f}x" if med["sshfs"] > 0 else "n/a"
        cells = " | ".join(fmt.format(med[t]) for t, _ in TARGETS)
        print(f"| {label} | {cells} | {ratio} |")


def raw(argv):
    """raw VALUES_DIR: every repetition's value, for spotting warm caches or outliers."""
    d = argv[0]
    print("| job | " + " | ".join(label for _, label in TARGETS) + " |")
    print("|---|" + "---|" * len(TARGETS))
    for key, label, fmt in METRICS:
        cells = " | ".join(", ".join(fmt.format(v) for v in values(d, t, key)) for t, _ in TARGETS)
        print(f"| {label} | {cells} |")


if __name__ == "__main__":
    {"time": run_timed, "port": free_port, "fio": fio, "table": table, "raw": raw}[sys.argv[1]](sys.argv[2:])
PY

# set_limit N: LIMIT = N seconds, cut to what is left of the budget.
set_limit() {
    local left=$((BUDGET_S - SECONDS))
    [ "$left" -gt 5 ] || die "the run exceeded its ${BUDGET_S} s budget"
    LIMIT=$((left < $1 ? left : $1))
}
drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
}
# wait_mounted DIR FSTYPE PID NAME: until DIR is mounted with FSTYPE (10 s), while PID lives.
wait_mounted() {
    local _
    for _ in $(seq 1 100); do
        [ "$(fstype_at "$1")" = "$2" ] && return 0
        alive "$3" || die "$4 exited before $1 was mounted"
        sleep 0.1
    done
    die "$4 did not mount $1 as $2 within 10 s (mounted there: '$(fstype_at "$1")')"
}

# --- test file ----------------------------------------------------------------
log "writing a ${SIZE_MIB} MiB random test file under $WORK"
head -c "$SIZE_BYTES" /dev/urandom >"$FILE"
sync
# ferryd caches a file's chunk hashes only once its ctime is over 1 s old (a file
# still being written is hashed on every open); files served are normally older.
sleep 2

# --- ferryd + ferry-mount -----------------------------------------------------
"$FERRYD" --generate-secret "$WORK/bench.secret" 2>/dev/null
export FERRY_SECRET_FILE="$WORK/bench.secret" # for rcp and ferry-mount
"$FERRYD" --share "bench=$SHARE" --secret-file "$WORK/bench.secret" --listen 127.0.0.1:0 --port-file "$WORK/port" --transport tcp 2>"$WORK/ferryd.log" &
FERRYD_PID=$!
for _ in $(seq 1 100); do
    [ -s "$WORK/port" ] && break
    alive "$FERRYD_PID" || die "ferryd exited at start"
    sleep 0.1
done
[ -s "$WORK/port" ] || die "ferryd did not write its port file within 10 s"
ADDR="$(head -n 1 "$WORK/port")"
log "ferryd on $ADDR, binaries from $BIN_DIR"

# The first problem with stopping ferry-mount that still let the run go on.
SHUTDOWN_PROBLEM=""
mount_ferry() {
    "$FERRY_MOUNT" -f --transport tcp "$ADDR:bench" "$MNT_FERRY" >>"$WORK/ferry-mount.log" 2>&1 &
    FERRY_MOUNT_PID=$!
    wait_mounted "$MNT_FERRY" fuse.ferry "$FERRY_MOUNT_PID" ferry-mount
}
# unmount_ferry: SIGTERM; ferry-mount must unmount and exit 0. Still mounted (or
# still running) fails the run; a non-zero status is recorded and reported.
unmount_ferry() {
    local rc=0 problem=""
    kill -TERM "$FERRY_MOUNT_PID"
    wait_exit "$FERRY_MOUNT_PID" 10 || die "ferry-mount did not exit within 10 s of SIGTERM"
    wait "$FERRY_MOUNT_PID" || rc=$?
    FERRY_MOUNT_PID=""
    [ -z "$(fstype_at "$MNT_FERRY")" ] || die "ferry-mount exited (status $rc) on SIGTERM but left $MNT_FERRY mounted"
    [ "$rc" -eq 0 ] || problem="ferry-mount unmounted but exited with status $rc on SIGTERM"
    if [ -n "$problem" ] && [ -z "$SHUTDOWN_PROBLEM" ]; then
        SHUTDOWN_PROBLEM="$problem"
        log "ERROR: $problem (the run goes on; it fails at the end)"
    fi
}
mount_ferry
log "ferry-mount: $ADDR:bench on $MNT_FERRY"

# --- private sshd + sshfs -----------------------------------------------------
ssh-keygen -q -t ed25519 -N '' -C ferry-bench-host -f "$SSH_DIR/host_key"
ssh-keygen -q -t ed25519 -N '' -C ferry-bench-client -f "$SSH_DIR/client_key"
cp "$SSH_DIR/client_key.pub" "$SSH_DIR/authorized_keys"
# sshd running as root refuses to start without its privilege separation directory
# (normally made by the ssh service, which is not running here).
[ -d /run/sshd ] || mkdir -m 0755 /run/sshd
SSH_PORT=""
for _ in 1 2 3; do
    port="$(python3 "$WORK/bench.py" port)"
    cat >"$SSH_DIR/sshd_config" <<EOF
ListenAddress 127.0.0.1:$port
HostKey $SSH_DIR/host_key
PidFile $SSH_DIR/sshd.pid
AuthorizedKeysFile $SSH_DIR/authorized_keys
StrictModes no
AllowUsers root
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
X11Forwarding no
AllowTcpForwarding no
Subsystem sftp internal-sftp
EOF
    "$SSHD" -t -f "$SSH_DIR/sshd_config" 2>"$WORK/sshd.log" || die "sshd rejects its configuration"
    "$SSHD" -D -e -f "$SSH_DIR/sshd_config" 2>"$WORK/sshd.log" &
    SSHD_PID=$!
    for _ in $(seq 1 100); do
        grep -q "Server listening on" "$WORK/sshd.log" && break
        alive "$SSHD_PID" || break
        sleep 0.1
    done
    if grep -q "Server listening on" "$WORK/sshd.log"; then SSH_PORT="$port"; break; fi
    # Most likely the port was taken between the check and the bind: try another.
    kill "$SSHD_PID" 2>/dev/null || true
    wait "$SSHD_PID" 2>/dev/null || true
    SSHD_PID=""
done
[ -n "$SSH_PORT" ] || die "the private sshd did not start"

mount_sshfs() {
    sshfs -f -F /dev/null \
        -o "IdentityFile=$SSH_DIR/client_key,IdentitiesOnly=yes,BatchMode=yes,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,LogLevel=ERROR,port=$SSH_PORT" \
        "root@127.0.0.1:$SHARE" "$MNT_SSHFS" >>"$WORK/sshfs.log" 2>&1 &
    SSHFS_PID=$!
    wait_mounted "$MNT_SSHFS" fuse.sshfs "$SSHFS_PID" sshfs
}
unmount_sshfs() {
    fusermount3 -u "$MNT_SSHFS" || die "fusermount3 -u $MNT_SSHFS failed"
    wait_exit "$SSHFS_PID" 10 || die "sshfs did not exit within 10 s of its unmount"
    wait "$SSHFS_PID" 2>/dev/null || true
    SSHFS_PID=""
}
mount_sshfs
log "sshfs: root@127.0.0.1:$SHARE (sshd port $SSH_PORT) on $MNT_SSHFS"

# --- the same bytes through every path ----------------------------------------
declare -A PATH_OF=([local]="$FILE" [ferry]="$MNT_FERRY/file.bin" [sshfs]="$MNT_SSHFS/file.bin")
for t in ferry sshfs; do
    size="$(stat -c %s "${PATH_OF[$t]}")" || die "cannot stat ${PATH_OF[$t]}"
    [ "$size" -eq "$SIZE_BYTES" ] || die "$t: file.bin has size $size, expected $SIZE_BYTES"
    set_limit "$SEQ_LIMIT_S"
    timeout -s KILL "$LIMIT" cmp "$FILE" "${PATH_OF[$t]}" ||
        die "$t: file.bin read through the mount differs from the original (or cmp timed out)"
done
log "the file reads back identical through ferry-mount and sshfs"

# --- the runs -----------------------------------------------------------------
# cold TARGET: a fresh client for TARGET and an empty page cache.
cold() {
    case "$1" in
        ferry) unmount_ferry; mount_ferry ;;
        sshfs) unmount_sshfs; mount_sshfs ;;
    esac
    drop_caches
}
# seq TARGET: read the whole file once, cold; append MiB/s to $VALS/TARGET.seq.
seq_read() {
    local t="$1" s rate
    cold "$t"
    set_limit "$SEQ_LIMIT_S"
    s="$(python3 "$WORK/bench.py" time "$LIMIT" -- \
        dd if="${PATH_OF[$t]}" of=/dev/null bs=1M status=none)" || die "$t: sequential read failed"
    rate="$(awk -v b="$SIZE_BYTES" -v s="$s" 'BEGIN { printf "%.3f", b / s / 1048576 }')"
    echo "$rate" >>"$VALS/$t.seq"
    log "  $t sequential read: ${s} s, ${rate} MiB/s"
}
# rand TARGET: fio 4 KiB random reads at QD1, cold; append p50/p99 (µs) and IOPS.
# fio's random map reads every block once before any block again, so a read hits
# the page cache only through readahead, or after a full pass of a small file.
rand_read() {
    local t="$1" out p50 p99 iops
    set_limit "$FIO_LIMIT_S"
    [ "$LIMIT" -gt "$FIO_RUNTIME_S" ] || die "the run exceeded its ${BUDGET_S} s budget"
    cold "$t"
    # fio splits --filename at ':'; escape it.
    timeout -s KILL "$LIMIT" fio --name=randread --filename="${PATH_OF[$t]//:/\\:}" --readonly \
        --rw=randread --bs=4k --ioengine=psync --iodepth=1 --numjobs=1 \
        --time_based --runtime="$FIO_RUNTIME_S" --randrepeat=0 \
        --lat_percentiles=1 --percentile_list=50:99 \
        --output-format=json --output="$WORK/fio.json" >/dev/null 2>"$WORK/fio.err" ||
        { cat "$WORK/fio.err" >&2; die "$t: fio failed or timed out"; }
    out="$(python3 "$WORK/bench.py" fio "$WORK/fio.json")" || die "$t: cannot read fio's output"
    read -r p50 p99 iops <<<"$out"
    echo "$p50" >>"$VALS/$t.p50"
    echo "$p99" >>"$VALS/$t.p99"
    echo "$iops" >>"$VALS/$t.iops"
    log "  $t 4k random read: p50 ${p50} µs, p99 ${p99} µs, ${iops} IOPS"
}

for rep in $(seq 1 "$REPS"); do
    log "repetition $rep/$REPS"
    for t in local ferry sshfs; do
        seq_read "$t"
        rand_read "$t"
    done
done

# --- stop the clients -----------------------------------------------------------
# A non-zero exit of ferry-mount on SIGTERM is in the notes and fails the run, but
# only after the numbers are saved: they were measured regardless.
unmount_ferry
unmount_sshfs

# --- report -------------------------------------------------------------------
REV="$(git rev-parse --short HEAD 2>/dev/null || echo 'no commit')"
if [ -n "$(git status --porcelain 2>/dev/null | head -n 1)" ]; then REV="$REV (dirty)"; fi
CPU="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
MEM_GIB="$(awk '/^MemTotal:/ { printf "%.0f", $2 / 1048576 }' /proc/meminfo)"
FM_VERSION="$("$FERRY_MOUNT" --version 2>/dev/null | head -n 1 || true)"
SSHFS_VERSION="$(sshfs --version 2>&1 | sed -n 's/^SSHFS version //p' | head -n 1)"
FUSE_VERSION="$(sshfs --version 2>&1 | sed -n 's/^FUSE library version //p' | head -n 1)"
SSH_VERSION="$(ssh -V 2>&1 | sed 's/,.*//')"
CIPHER="$(ssh -F /dev/null -G 127.0.0.1 2>/dev/null | sed -n 's/^ciphers \([^,]*\).*/\1/p')"
REPORT="$WORK/report.md"
{
    echo "# ferry-mount read benchmark, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- command: \`$CMDLINE\`"
    echo "- file: ${SIZE_MIB} MiB of random data, median of ${REPS} run(s); fio ${FIO_RUNTIME_S} s per run; MiB/s = 2^20 bytes/s"
    echo "- host: ${CPU:-unknown CPU}, $(nproc) CPUs, ${MEM_GIB} GiB RAM; $(uname -sr); temp dir on $(df -PT "$WORK" | awk 'NR == 2 { print $2 }')"
    echo "- ferry: revision $REV, binaries ${BIN_DIR#"$ROOT"/}; ${FM_VERSION:-ferry-mount (no --version)}; ferryd and \`ferry-mount -f --transport tcp\` on 127.0.0.1"
    echo "- sshfs $SSHFS_VERSION (FUSE $FUSE_VERSION) to a private sshd on 127.0.0.1 ($SSH_VERSION, internal-sftp, cipher ${CIPHER:-default}); fio $(fio --version | sed 's/^fio-//')"
    echo "- every job starts cold: page cache dropped (sync; drop_caches), so the local disk is read in all three columns, and ferry-mount or sshfs freshly mounted (ferry-mount's own chunk cache starts empty); ferryd and sshd keep running (ferryd's chunk hashes of the file stay cached)"
    echo "- sequential read: \`dd bs=1M\` of the whole file; random read: fio randread bs=4k psync iodepth=1, time-based; p50/p99 are of the whole pread()"
    echo "- ferry:sshfs = ferry-mount's value / sshfs's (throughput and IOPS: >1x is better; latency: <1x is better)"
    if [ -n "$SHUTDOWN_PROBLEM" ]; then echo "- **ferry-mount shutdown failed:** $SHUTDOWN_PROBLEM (first occurrence)"; fi
    echo
    python3 "$WORK/bench.py" table "$VALS"
    echo
    echo "Every repetition, in order:"
    echo
    python3 "$WORK/bench.py" raw "$VALS"
} >"$REPORT"

echo
cat "$REPORT"
if [ "$SAVE" -eq 1 ]; then
    mkdir -p bench/results
    OUT="bench/results/mount-$(date -u '+%Y-%m-%d').md"
    # A second run on the same day does not overwrite the first.
    [ ! -e "$OUT" ] || OUT="bench/results/mount-$(date -u '+%Y-%m-%d-%H%M%S').md"
    cp "$REPORT" "$OUT"
    echo
    log "written to $OUT"
fi
[ -z "$SHUTDOWN_PROBLEM" ] || die "$SHUTDOWN_PROBLEM"
log "done in ${SECONDS} s"
