#!/usr/bin/env bash
# RDMA benchmark on Soft-RoCE: inside the VM (scripts/softroce-vm.sh), rcp copies one
# file over the verbs transport (upload = server RDMA READs; download = server RDMA
# WRITEs), and perftest's ib_read_bw / ib_write_bw run with the same message size
# (the 1 MiB chunk) in the same VM run. It prints rcp's throughput as a fraction of
# the raw verbs ceiling. Those rows are unencrypted (rcp --encryption off, ferryd
# --encryption preferred); the same copies with --encryption required follow, with the
# suite rcp --json names and encrypted / unencrypted (binaries without --encryption:
# the plain rows only).
#
#   bench/rdma.sh                       # 256 MiB, 3 repetitions, release build, kernel 6.1
#   bench/rdma.sh --quick               # 32 MiB, 1 repetition
#   bench/rdma.sh --size-mib 512 --reps 5 --kernel newest-6.12 --bin-dir target/debug
#
# The table is printed and written to bench/results/rdma-<date>.md (--no-save: print
# only), then the chunk hash rcp used and the CPU-seconds per GB of rcp and of ferryd
# (FERRY_HASH=sha256 bench/rdma.sh: the same with SHA-256 chunk hashes), and the CPU
# ceiling of the VM: what a copy doing only perftest's verbs work, the file I/O (dd)
# and its hashing can reach on these vCPUs, each measured in this run, beside how
# busy the vCPUs were during rcp's copies. Under TCG every number is far below real
# hardware; the ratios are the point.
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
        -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
        { echo "# bench/rdma.sh — $(date -u +%FT%TZ), $(nproc) host cores, kernel arg $KERNEL"; echo; sed -n '/^| /p;/^rcp /p;/^kernel/p;/^sha256/p;/^blake3/p;/^CPU ceiling/p;/^chunk hash/p;/^encryption/p' "$out"; } >"$f"
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
# Session encryption where the binaries have it: ferryd lets each client pick; the
# plain rows ask for none (OFF), the encrypted ones require it.
FERRYD_ENC=() OFF=() ENC=0
if "$BIN_DIR/ferryd" --help 2>&1 | grep -q -- --encryption; then FERRYD_ENC=(--encryption preferred); fi
if "$BIN_DIR/rcp" --help 2>&1 | grep -q -- --encryption; then OFF=(--encryption off) ENC=1; fi
"$BIN_DIR/ferryd" --transport rdma --listen "$IP:0" --port-file "$W/port" \
    --share "b=$W/share" --secret-file "$W/b.secret" "${FERRYD_ENC[@]}" 2>"$W/ferryd.log" &
FERRYD=$!
# On a failure, show why ferryd ended or refused.
trap 'rc=$?; if [ "$rc" -ne 0 ]; then echo "[bench] ferryd log:" >&2; tail -n 20 "$W/ferryd.log" >&2; fi' EXIT
for _ in $(seq 100); do [ -s "$W/port" ] && break; sleep 0.1; done
PORT=$(sed 's/.*://' "$W/port")

now() { date +%s.%N; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mibps() { awk -v b="$((SIZE_MIB << 20))" -v s="$1" 'BEGIN {printf "%.1f", b / s / 1048576}'; }
# ferryd_cpu: ferryd's CPU-seconds so far (utime + stime, fields 14 and 15 of its stat).
TICK=$(getconf CLK_TCK)
# busy: the VM's busy and idle clock ticks so far, over all vCPUs (/proc/stat: user,
# nice, system, irq, softirq; idle, iowait). rxe moves every byte in the kernel
# (softirq and its own threads), which no process's own CPU time shows.
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat; }
ferryd_cpu() { awk -v t="$TICK" '{ sub(/.*\) /, ""); print ($12 + $13) / t }' "/proc/$FERRYD/stat"; }
# rcp_timed ARGS...: one rcp --json; sets DT (seconds), RCP_CPU (its user + system CPU,
# from bash's times in a subshell that ran only rcp), SRV_CPU (ferryd's over the same
# span), HASH (the chunk hash rcp --json names), SUITE (its encryption; empty if none)
# and BUSY (the percentage of the VM's vCPU time that was busy over the copy).
rcp_timed() {
    local t0 t1 c0 c1 v0 v1 i0 i1
    c0=$(ferryd_cpu)
    read -r v0 i0 <<<"$(busy)"
    t0=$(now)
    ("$BIN_DIR/rcp" -q --json --transport rdma "$@" >"$W/rcp.json"; times >"$W/times")
    t1=$(now)
    read -r v1 i1 <<<"$(busy)"
    BUSY=$(awk -v b="$((v1 - v0))" -v i="$((i1 - i0))" 'BEGIN { if (b + i > 0) printf "%.0f", 100 * b / (b + i); else print 0 }')
    c1=$(ferryd_cpu)
    DT=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
    # times: the subshell's own user/system, then its children's ("0m1.234s 0m0.567s").
    RCP_CPU=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); sub(/s$/, "", p[2]); n += p[1] * 60 + p[2] } print n }' "$W/times")
    SRV_CPU=$(awk -v a="$c0" -v b="$c1" 'BEGIN {print b - a}')
    HASH=$(sed -n 's/.*"hash":"\([a-z0-9]*\)".*/\1/p' "$W/rcp.json")
    SUITE=$(sed -n 's/.*"encryption":"\([a-z0-9_-]*\)".*/\1/p' "$W/rcp.json")
}
per_gb() { awk -v c="$1" -v b="$((SIZE_MIB << 20))" 'BEGIN {printf "%.3f", c / (b / 1e9)}'; }

up=() down=() up_rcp=() up_srv=() down_rcp=() down_srv=() hashes=() up_busy=() down_busy=()
eup=() edown=() eup_rcp=() eup_srv=() edown_rcp=() edown_srv=() suites=()
for _ in $(seq "$REPS"); do
    # The VM's /tmp is small: never hold the last copy while the next reserves its size.
    rm -f "$W/share/up.bin"
    rcp_timed "${OFF[@]}" "$W/local/src.bin" "$IP:$PORT:b/up.bin"
    up+=("$DT") up_rcp+=("$RCP_CPU") up_srv+=("$SRV_CPU") hashes+=("${HASH:-unknown}") up_busy+=("$BUSY")
    rm -f "$W/local/back.bin"
    rcp_timed "${OFF[@]}" "$IP:$PORT:b/up.bin" "$W/local/back.bin"
    down+=("$DT") down_rcp+=("$RCP_CPU") down_srv+=("$SRV_CPU") hashes+=("${HASH:-unknown}") down_busy+=("$BUSY")
    cmp "$W/local/src.bin" "$W/local/back.bin"
    [ "$ENC" = 1 ] || continue
    rm -f "$W/share/up.bin"
    rcp_timed --encryption required "$W/local/src.bin" "$IP:$PORT:b/up.bin"
    eup+=("$DT") eup_rcp+=("$RCP_CPU") eup_srv+=("$SRV_CPU") suites+=("${SUITE:-none}")
    rm -f "$W/local/back.bin"
    rcp_timed --encryption required "$IP:$PORT:b/up.bin" "$W/local/back.bin"
    edown+=("$DT") edown_rcp+=("$RCP_CPU") edown_srv+=("$SRV_CPU") suites+=("${SUITE:-none}")
    cmp "$W/local/src.bin" "$W/local/back.bin"
done
kill "$FERRYD"; wait "$FERRYD" 2>/dev/null || true

# perftest with the chunk size, about as many bytes as one copy. PERF_CPU is the CPU
# the VM spent per MiB moved (busy ticks over the client's run), with completion
# events (-e) where that run works, so a polling loop is not counted as work.
iters=$SIZE_MIB
perf() {
    local tool=$1 b0 b1
    shift
    timeout 120 "$tool" -F -s 1048576 -n "$iters" "$@" >/dev/null 2>&1 &
    local srv=$!
    sleep 1
    read -r b0 _ <<<"$(busy)"
    PERF_BW=$(timeout 120 "$tool" -F -s 1048576 -n "$iters" "$@" "$IP" 2>/dev/null | awk '$1 == 1048576 {print $4}') || true
    read -r b1 _ <<<"$(busy)"
    PERF_CPU=$(awk -v b="$((b1 - b0))" -v t="$TICK" -v n="$iters" 'BEGIN {printf "%.5f", b / t / n}')
    wait "$srv" || true
}
perf ib_read_bw
read_bw=$PERF_BW read_cpu=$PERF_CPU
perf ib_write_bw
write_bw=$PERF_BW write_cpu=$PERF_CPU
perf ib_read_bw -e
[ -n "$PERF_BW" ] && read_cpu=$PERF_CPU
perf ib_write_bw -e
[ -n "$PERF_BW" ] && write_cpu=$PERF_CPU
# What reading the source and writing the copy cost, the file I/O any copy does
# (dd between the VM's file systems, busy ticks per MiB), the copies made gone first:
# the VM's /tmp is small.
rm -f "$W/local/back.bin" "$W/share/up.bin"
read -r b0 _ <<<"$(busy)"
dd if="$W/local/src.bin" of="$W/local/dd.bin" bs=1M status=none
read -r b1 _ <<<"$(busy)"
rm -f "$W/local/dd.bin"
io_cpu=$(awk -v b="$((b1 - b0))" -v t="$TICK" -v n="$SIZE_MIB" 'BEGIN {printf "%.5f", b / t / n}')
# What one vCPU hashes: rcp SHA-256-hashes every byte twice (client and server), on
# the same vCPUs that run rxe's software packet path, so this bounds it too.
sha_bw=$(openssl speed -evp sha256 -bytes 1048576 -seconds 3 2>/dev/null |
    awk '$1 == "sha256" {printf "%.1f", $2 * 1000 / 1048576}')
# The same for blake3 (b3sum on one thread over the source file, its user CPU), where
# b3sum and python3 are installed.
b3_bw=""
if command -v b3sum >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
    b3_bw=$(python3 bench/lib/bench.py hashspeed "$W/local/src.bin" 1 2>/dev/null |
        python3 -c 'import json, sys; v = json.load(sys.stdin).get("blake3"); print(f"{v * 1e9 / 1048576:.1f}" if v else "")' 2>/dev/null) || b3_bw=""
fi

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
if [ "$ENC" = 1 ]; then
    suite=$(printf '%s\n' "${suites[@]}" | sort -u | paste -sd, -)
    eup_bw=$(mibps "$(printf '%s\n' "${eup[@]}" | median)")
    edown_bw=$(mibps "$(printf '%s\n' "${edown[@]}" | median)")
    echo "| encrypted rcp upload (server RDMA READ, $suite) | $eup_bw | ib_read_bw $read_bw | $(ratio "$eup_bw" "$read_bw") |"
    echo "| encrypted rcp download (server RDMA WRITE, $suite) | $edown_bw | ib_write_bw $write_bw | $(ratio "$edown_bw" "$write_bw") |"
    echo "encryption: the rcp rows --encryption off, the encrypted rows --encryption required (suite $suite, rcp --json); encrypted / unencrypted: upload $(ratio "$eup_bw" "$up_bw"), download $(ratio "$edown_bw" "$down_bw"); AES instructions in the VM: $(grep -qw aes /proc/cpuinfo && echo yes || echo no)"
else
    echo "encryption: none (these binaries have no --encryption)"
fi
echo "sha256 (openssl, 1 MiB blocks, one vCPU): ${sha_bw:-n/a} MiB/s; $(nproc) vCPUs"
echo "blake3 (b3sum --num-threads 1, user CPU): ${b3_bw:-n/a} MiB/s"
# The CPU ceiling: what a copy that does only the work every copy here must do, on
# these vCPUs, can reach: the verbs path as perftest measured it, reading and writing
# the file (dd), and the chunk hash once per side that hashes (an upload: rcp, and
# ferryd verifying; a download: rcp alone, ferryd sending the hashes it recorded at
# the upload), capped by perftest's own bandwidth.
hash_used=$(printf '%s\n' "${hashes[@]}" | sort -u | paste -sd, -)
case "$hash_used" in
    blake3) hash_bw=${b3_bw:-} ;;
    sha256) hash_bw=${sha_bw:-} ;;
    *) hash_bw="" ;;
esac
ceiling() {
    awk -v v="$1" -v k="$2" -v p="$3" -v io="$io_cpu" -v h="${hash_bw:-0}" -v n="$(nproc)" 'BEGIN {
        c = v + io + (h > 0 ? k / h : 0); m = (c > 0 ? n / c : 0)
        if (p > 0 && m > p) m = p
        printf "%.1f", m }'
}
up_ceiling=$(ceiling "$read_cpu" 2 "$read_bw")
down_ceiling=$(ceiling "$write_cpu" 1 "$write_bw")
up_busy_m=$(printf '%s\n' "${up_busy[@]}" | median)
down_busy_m=$(printf '%s\n' "${down_busy[@]}" | median)
if [ -n "$hash_bw" ]; then
    echo "CPU ceiling ($(nproc) vCPUs, $hash_used at $hash_bw MiB/s per vCPU): the verbs path costs $read_cpu (READ) and $write_cpu (WRITE) CPU-s per MiB (perftest, the whole VM's busy time), reading and writing the file $io_cpu (dd), the hash 1/$hash_bw per side that hashes; a copy doing only that reaches at most $up_ceiling MiB/s up ($(ratio "$up_ceiling" "$read_bw") of ib_read_bw; rcp: $(ratio "$up_bw" "$up_ceiling") of this ceiling, the VM's vCPUs $up_busy_m% busy) and $down_ceiling down ($(ratio "$down_ceiling" "$write_bw") of ib_write_bw; rcp: $(ratio "$down_bw" "$down_ceiling"), $down_busy_m% busy)"
fi
echo "chunk hash (rcp --json): $(printf '%s\n' "${hashes[@]}" | sort -u | paste -sd, -); CPU-seconds per GB (1e9 bytes), median of $REPS: rcp its own (bash times), ferryd utime + stime over the copy"
echo "| CPU-s/GB | rcp | ferryd | both | cores per side for 12.5 GB/s (rcp, ferryd) |"
echo "|---|---:|---:|---:|---:|"
cpu_row() {
    local name=$1 r s
    r=$(per_gb "$(printf '%s\n' "${@:2:$REPS}" | median)")
    s=$(per_gb "$(printf '%s\n' "${@:$((REPS + 2)):$REPS}" | median)")
    echo "| $name | $r | $s | $(awk -v a="$r" -v b="$s" 'BEGIN {printf "%.3f", a + b}') | $(awk -v a="$r" -v b="$s" 'BEGIN {printf "%.1f, %.1f", a * 12.5, b * 12.5}') |"
}
cpu_row "CPU upload" "${up_rcp[@]}" "${up_srv[@]}"
cpu_row "CPU download" "${down_rcp[@]}" "${down_srv[@]}"
if [ "$ENC" = 1 ]; then
    cpu_row "CPU upload, encrypted" "${eup_rcp[@]}" "${eup_srv[@]}"
    cpu_row "CPU download, encrypted" "${edown_rcp[@]}" "${edown_srv[@]}"
fi
rm -rf "$W"
