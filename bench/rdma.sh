#!/usr/bin/env bash
# RDMA benchmark on Soft-RoCE: inside the VM (scripts/softroce-vm.sh), rcp copies one
# file over the verbs transport (upload = server RDMA READs; download = server RDMA
# WRITEs), and perftest's ib_read_bw / ib_write_bw run with the same message size
# (the 1 MiB chunk) in the same VM run. It prints rcp's throughput as a fraction of
# the raw verbs ceiling.
#
#   bench/rdma.sh                       # 256 MiB, 3 repetitions, release build, kernel 6.1
#   bench/rdma.sh --quick               # 32 MiB, 1 repetition
#   bench/rdma.sh --size-mib 512 --reps 5 --kernel newest-6.12 --bin-dir target/debug
#
# The table is printed and written to bench/results/rdma-<date>.md (--no-save: print
# only). Under TCG every number is far below real hardware; the ratio is the point.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SIZE_MIB=256
REPS=3
BIN_DIR=""
SAVE=1
KERNEL=default
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) SIZE_MIB=32; REPS=1 ;;
        --size-mib) SIZE_MIB="${2:?}"; shift ;;
        --reps) REPS="${2:?}"; shift ;;
        --bin-dir) BIN_DIR="${2:?}"; shift ;;
        --kernel) KERNEL="${2:?}"; shift ;;
        --no-save) SAVE=0 ;;
        --run-in-vm) IN_VM=1; BIN_DIR="$2"; SIZE_MIB="$3"; REPS="$4"; shift 3 ;;
        -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench: unknown argument '$1'" >&2; exit 2 ;;
    esac
    shift
done

if [ -z "${IN_VM:-}" ]; then
    if [ -z "$BIN_DIR" ]; then
        cargo build --release --bins >&2
        BIN_DIR=target/release
    fi
    out=$(mktemp)
    trap 'rm -f "$out"' EXIT
    SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-1500} scripts/softroce-vm.sh --kernel "$KERNEL" -- \
        bench/rdma.sh --run-in-vm "$BIN_DIR" "$SIZE_MIB" "$REPS" | tee "$out"
    if [ "$SAVE" = 1 ]; then
        mkdir -p bench/results
        f="bench/results/rdma-$(date +%Y-%m-%d-%H%M%S).md"
        { echo "# bench/rdma.sh — $(date -u +%FT%TZ), $(nproc) host cores, kernel arg $KERNEL"; echo; sed -n '/^| /p;/^rcp /p;/^kernel/p;/^sha256/p' "$out"; } >"$f"
        echo "saved $f" >&2
    fi
    exit 0
fi

# ---- inside the VM ----------------------------------------------------------------
IP=$SOFTROCE_IP
W=$(mktemp -d /tmp/ferry-bench.XXXXXX)
mkdir -p "$W/share" "$W/local"
head -c "$((SIZE_MIB << 20))" /dev/urandom >"$W/local/src.bin"
"$BIN_DIR/ferryd" --generate-secret "$W/b.secret" 2>/dev/null
export FERRY_SECRET_FILE="$W/b.secret"
"$BIN_DIR/ferryd" --transport rdma --listen "$IP:0" --port-file "$W/port" \
    --share "b=$W/share" --secret-file "$W/b.secret" 2>"$W/ferryd.log" &
FERRYD=$!
# On a failure, show why ferryd ended or refused.
trap 'rc=$?; if [ "$rc" -ne 0 ]; then echo "[bench] ferryd log:" >&2; tail -n 20 "$W/ferryd.log" >&2; fi' EXIT
for _ in $(seq 100); do [ -s "$W/port" ] && break; sleep 0.1; done
PORT=$(sed 's/.*://' "$W/port")

now() { date +%s.%N; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mibps() { awk -v b="$((SIZE_MIB << 20))" -v s="$1" 'BEGIN {printf "%.1f", b / s / 1048576}'; }

up=() down=()
for _ in $(seq "$REPS"); do
    # The VM's /tmp is small: never hold the last copy while the next reserves its size.
    rm -f "$W/share/up.bin"
    t0=$(now); "$BIN_DIR/rcp" -q --transport rdma "$W/local/src.bin" "$IP:$PORT:b/up.bin"; t1=$(now)
    up+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')")
    rm -f "$W/local/back.bin"
    t0=$(now); "$BIN_DIR/rcp" -q --transport rdma "$IP:$PORT:b/up.bin" "$W/local/back.bin"; t1=$(now)
    down+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')")
    cmp "$W/local/src.bin" "$W/local/back.bin"
done
kill "$FERRYD"; wait "$FERRYD" 2>/dev/null || true

# perftest with the chunk size, about as many bytes as one copy.
iters=$SIZE_MIB
perf() {
    local tool=$1
    "$tool" -F -s 1048576 -n "$iters" >/dev/null 2>&1 &
    local srv=$!
    sleep 1
    "$tool" -F -s 1048576 -n "$iters" "$IP" 2>/dev/null | awk '$1 == 1048576 {print $4}'
    wait "$srv" || true
}
read_bw=$(perf ib_read_bw)
write_bw=$(perf ib_write_bw)
# What one vCPU hashes: rcp SHA-256-hashes every byte twice (client and server), on
# the same vCPUs that run rxe's software packet path, so this bounds it too.
sha_bw=$(openssl speed -evp sha256 -bytes 1048576 -seconds 3 2>/dev/null |
    awk '$1 == "sha256" {printf "%.1f", $2 * 1000 / 1048576}')

up_s=$(printf '%s\n' "${up[@]}" | median)
down_s=$(printf '%s\n' "${down[@]}" | median)
up_bw=$(mibps "$up_s")
down_bw=$(mibps "$down_s")
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else print "n/a" }'; }
echo "kernel $(uname -r), device ${SOFTROCE_DEV:-rxe0}, RoCE over netdev MTU $(cat /sys/class/net/"${SOFTROCE_NETDEV:-dummy0}"/mtu), $SIZE_MIB MiB, median of $REPS"
echo "| job | MiB/s | verbs ceiling (perftest, 1 MiB messages) | rcp / ceiling |"
echo "|---|---:|---:|---:|"
echo "| rcp upload (server RDMA READ) | $up_bw | ib_read_bw $read_bw | $(ratio "$up_bw" "$read_bw") |"
echo "| rcp download (server RDMA WRITE) | $down_bw | ib_write_bw $write_bw | $(ratio "$down_bw" "$write_bw") |"
echo "sha256 (openssl, 1 MiB blocks, one vCPU): ${sha_bw:-n/a} MiB/s; $(nproc) vCPUs"
rm -rf "$W"
