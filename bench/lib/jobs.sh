# shellcheck shell=bash disable=SC2034 # its globals are read by bench/run and the other libs
# The jobs of bench/run (sourced). Each job_X REP runs one repetition: Ferry first,
# then each peer, every run from the same cache state (settle) onto a fresh file
# system (dstfs_fresh; or with its destination removed, see clear_dest), and checked
# against its source (cmp or tree SHA-256 in the first
# repetition, size or file count in the others). Ferry failing ends the run; a
# peer failing gets a "failed: ..." cell and is not run again in that job. The
# "ceiling" tool is iperf3 for one big file, the local disk (tar | tar, dd, fio on the
# file itself, under the same protocol) for trees and the FUSE reads.

declare -A UNAVAIL=() # TOOL -> "skip:WHY" or "fail:WHY" for a peer that cannot run at all
declare -A DEAD=()    # ROW.TOOL -> 1 once that peer failed in that row
declare -A NOTED=()
NOTES=()
SOURCE=() # what settle warms up (CACHE=warm) for the next run

# peer_ok ROW TOOL: TOOL can run in ROW; otherwise record why (once per row) and fail.
peer_ok() {
    local why="${UNAVAIL[$2]:-}"
    [ -z "${DEAD[$1.$2]:-}" ] || return 1
    [ -n "$why" ] || return 0
    if [ -z "${NOTED[$1.$2]:-}" ]; then
        NOTED[$1.$2]=1
        case "$why" in
            skip:*) record_skip "$1" "$2" "${why#skip:}" ;;
            *) record_fail "$1" "$2" "${why#fail:}" ;;
        esac
    fi
    return 1
}

# fail ROW TOOL REASON: Ferry's failure ends the run (exit 1); a peer's is recorded,
# and so is Ferry's while FERRY_SOFT=1 (the mountwrite job: a ferry-mount that cannot
# write yet gets "failed: ..." cells, the run goes on).
FERRY_SOFT=0
fail() {
    if [ "$2" = ferry ] && [ "$FERRY_SOFT" = 0 ]; then
        [ ! -s "$WORK/err" ] || { echo "[bench] its stderr:" >&2; tail -n 20 "$WORK/err" >&2; }
        die "$1: Ferry failed: $3"
    fi
    warn "$1: $2 failed: $3 (its cell says so; the run goes on)"
    # The cell names paths relative to the work dir: the reason is cut at 160 characters.
    record_fail "$1" "$2" "${3//"$WORK/"/}"
    DEAD[$1.$2]=1
    return 1
}

# timed ROW TOOL LIMIT_S CMD...: settle the cache, run CMD; sets T (seconds) and TS
# (seconds until the file system of directory SYNC_FS was synced after it returned,
# syncfs(2): the destination durable; a whole sync(2) where SYNC_FS is empty), CPU_C
# (CPU-seconds of CMD and what it waited for) and CPU_S (CPU-seconds of the server
# CPU_PID and its reaped children over the same span and the sync; "-" where CPU_PID
# is empty). stdout is in $WORK/out. A command cut
# short because the time budget ran out is nobody's failure: it sets OUT_OF_BUDGET,
# after which timed runs nothing more (run_job stops the job, and skips the rest).
OUT_OF_BUDGET=0
SYNC_FS=""
CPU_PID=""
timed() {
    local row="$1" tool="$2" own="$3" lim res sync=()
    [ "$OUT_OF_BUDGET" = 0 ] || return 1
    lim="$(limit "$own")"
    shift 3
    [ -z "$SYNC_FS" ] || sync=(--syncfs "$SYNC_FS")
    [ -z "$CPU_PID" ] || sync+=(--cpu-pid "$CPU_PID")
    settle "${SOURCE[@]}"
    if res="$(python3 "$BENCH_PY" run "$lim" "$WORK/out" "$WORK/err" "${sync[@]}" -- "$@")"; then
        read -r T TS CPU_C CPU_S <<<"$res"
        return 0
    fi
    if [ "$lim" -lt "$own" ] && [ "$(budget_left)" -le 0 ]; then
        OUT_OF_BUDGET=1
        warn "$row: $tool was stopped when the time budget ran out; not counted"
        return 1
    fi
    fail "$row" "$tool" "$res"
}

# same_tree ORIGINAL COPY: the trees have the same names and contents. ORIGINAL's
# checksum is computed once (unset TREESUM[ORIGINAL] after changing it).
declare -A TREESUM=()
same_tree() {
    [ -n "${TREESUM[$1]:-}" ] || TREESUM[$1]="$(python3 "$BENCH_PY" treesum "$1")"
    [ "${TREESUM[$1]}" = "$(python3 "$BENCH_PY" treesum "$2")" ]
}
count_files() { find "$1" -type f | wc -l; }

# check ROW ORIGINAL COPY REP: COPY is a good copy of ORIGINAL (a file or a tree).
check() {
    if [ -f "$2" ]; then
        if [ "$4" -eq 1 ]; then cmp -s "$2" "$3"; else [ "$(stat -c %s "$3" 2>/dev/null)" = "$(stat -c %s "$2")" ]; fi
    elif [ "$4" -eq 1 ]; then
        same_tree "$2" "$3"
    else
        [ -d "$3" ] && [ "$(count_files "$3")" -eq "$(count_files "$2")" ]
    fi
}

# copy_run ROW TOOL ORIGINAL DEST REP CMD...: one timed copy of ORIGINAL to DEST by
# CMD onto a fresh destination file system, timed until that file system is synced
# too; records GB/s (a file) or files/s (a tree; and MB/s of the mixed tree, as
# ROW.mb), without (ROW) and with the sync (ROW.sync). For Ferry (ferry, ferry_sha256)
# and the rsync daemon it also records the CPU-seconds per GB copied (1e9 bytes of
# file data) of the client (ROW.cpu_client: rcp, the rsync client), of the server
# (ROW.cpu_server: ferryd, the rsync daemon's children) and of both (ROW.cpu_sum);
# for Ferry the chunk-hash algorithm and the encryption suite rcp --json names (rows
# ROW.hash, kind "hash", and ROW.suite, kind "suite": "none" for an unencrypted session).
copy_run() {
    local row="$1" tool="$2" orig="$3" dest="$4" rep="$5" amount scale=1 ok=1 bytes
    shift 5
    clear_dest "$dest"
    SOURCE=("$orig")
    SYNC_FS="$(dirname "$dest")"
    CPU_PID=""
    case "$tool" in
        ferry*) CPU_PID="$FERRYD_PID" ;;
        rsync) CPU_PID="${RSYNCD_PID:-}" ;;
    esac
    timed "$row" "$tool" "$COPY_LIMIT_S" "$@" || ok=0
    SYNC_FS="" CPU_PID=""
    [ "$ok" = 1 ] || return 0
    if ! check "$row" "$orig" "$dest" "$rep"; then
        [ -n "$DSTFS_DEV" ] || discard "$dest"
        fail "$row" "$tool" "the copy differs from the original" || return 0
    fi
    [ -n "$DSTFS_DEV" ] || discard "$dest"
    case "$row" in
        upload | download | crypt_up | crypt_down) amount="$SIZE_BYTES" scale=1e9 bytes="$SIZE_BYTES" ;;
        small_* | crypt_small_*) amount="$SMALL_N" bytes=$((SMALL_N * 4096)) ;;
        mixed_*)
            amount="$MIXED_FILES" bytes="$MIXED_BYTES"
            record "$row.mb" "$tool" "$(rate "$MIXED_BYTES" "$T" 1e6)"
            record "$row.sync.mb" "$tool" "$(rate "$MIXED_BYTES" "$TS" 1e6)"
            ;;
    esac
    record "$row" "$tool" "$(rate "$amount" "$T" "$scale")"
    record "$row.sync" "$tool" "$(rate "$amount" "$TS" "$scale")"
    if [ "$tool" = rsync ] || [ "${tool#ferry}" != "$tool" ]; then
        record_cpu "$row" "$tool" "$bytes"
    fi
}
# record_cpu ROW TOOL BYTES: CPU_C and CPU_S of the last timed run as CPU-s per GB of
# BYTES (ROW.cpu_client, ROW.cpu_server, ROW.cpu_sum); Ferry's hash and suite from
# $WORK/out.
record_cpu() {
    local row="$1" tool="$2" bytes="$3" hash suite want got
    [ "${bytes:-0}" -gt 0 ] || return 0
    record "$row.cpu_client" "$tool" "$(awk -v c="$CPU_C" -v b="$bytes" 'BEGIN { printf "%.4f", c / (b / 1e9) }')"
    if [ "${CPU_S:--}" != - ]; then
        record "$row.cpu_server" "$tool" "$(awk -v c="$CPU_S" -v b="$bytes" 'BEGIN { printf "%.4f", c / (b / 1e9) }')"
        record "$row.cpu_sum" "$tool" "$(awk -v c="$CPU_C" -v s="$CPU_S" -v b="$bytes" 'BEGIN { printf "%.4f", (c + s) / (b / 1e9) }')"
    fi
    if [ "${tool#ferry}" != "$tool" ]; then
        hash="$(python3 "$BENCH_PY" field "$WORK/out" hash 2>/dev/null)" || hash="unknown"
        printf '%s\t%s\thash\t%s\n' "$row.hash" "$tool" "$hash" >>"$WORK/results.tsv"
        # JSON null (an unencrypted session) prints as None; an older rcp has no such key.
        suite="$(python3 "$BENCH_PY" field "$WORK/out" encryption 2>/dev/null)" || suite="unknown"
        [ "$suite" != None ] || suite=none
        printf '%s\t%s\tsuite\t%s\n' "$row.suite" "$tool" "$suite" >>"$WORK/results.tsv"
        # Only ferry_enc asks for encryption (where rcp has --encryption: ENC_OK).
        want=none got=none
        [ "$tool" != ferry_enc ] || want=encrypted
        [ "$suite" = none ] || got=encrypted
        if [ "$ENC_OK" = 1 ] && [ "$got" != "$want" ] && [ -z "${NOTED[$row.$tool.suite]:-}" ]; then
            NOTED[$row.$tool.suite]=1
            NOTES+=("$row: $tool's session had encryption '$suite' (rcp --json), not what it asked for")
            warn "${NOTES[-1]}"
        fi
    fi
}

# ceiling_run ROW [-R]: iperf3 -l 1M of SIZE bytes, the raw TCP ceiling, GB/s.
ceiling_run() {
    local row="$1" bps
    shift
    peer_ok "$row" ceiling || return 0
    SOURCE=()
    timed "$row" ceiling "$COPY_LIMIT_S" iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -l 1M -n "$SIZE_BYTES" -J "$@" || return 0
    bps="$(python3 "$BENCH_PY" iperf "$WORK/out" 2>&1)" || { fail "$row" ceiling "$bps" || return 0; }
    record "$row" ceiling "$(rate "$bps" 1 1e9)"
}

# plain_run ROW: the big file copied file to file over loopback TCP with no hash at all
# (bench.py plaincopy: read and written direct, 1 MiB at a time, by two processes) from
# the same cache state onto the same fresh destination file system, until synced: its
# CPU-s/GB of both ends (tool "plain", ROW.cpu_*), the floor under the hash-cost ratio
# (bench.py cpu_report).
plain_run() {
    local row="$1" res bytes
    peer_ok "$row" plain || return 0
    clear_dest "$DST/plain.bin"
    settle "$BIG"
    if ! res="$(python3 "$BENCH_PY" plaincopy "$BIG" "$DST/plain.bin" "$(limit "$COPY_LIMIT_S")" 2>"$WORK/err")"; then
        fail "$row" plain "${res:-$(tail -n 1 "$WORK/err")}" || true
        rm -f "$DST/plain.bin"
        return 0
    fi
    read -r bytes T CPU_C CPU_S <<<"$res"
    rm -f "$DST/plain.bin"
    record_cpu "$row" plain "$bytes"
}

# --- (a, b, c, g) copies: one big file, many small files, a mixed tree; each both ways ---------
# command_for ROW TOOL: CMD = the command line of TOOL for ROW, DEST its destination.
# Every destination is under $DST (inside $SRV, so that ferryd's share and the rsync
# module reach uploads there as dst/...): the loop file system's mount, made fresh
# before each run.
# Ferry's commands carry RCP_ENC (bench/run: --encryption off where rcp has it; the
# crypt job sets it per run).
command_for() {
    local rcp=("$RCP" --json --transport tcp "${RCP_ENC[@]}") scp=(scp "${SSH_OPTS[@]}" -P "${SSH_PORT:-22}")
    local tree="" src name
    case "$1" in
        small_*) tree=small src="$SMALL" ;;
        mixed_*) tree=mixed src="$MIXED" ;;
    esac
    if [ -n "$tree" ]; then
        # ROW is TREE_up (DEST dst/TREE-up, uploaded) or TREE_down (DEST dst/TREE, downloaded).
        name="$tree"
        [ "$1" != "${tree}_up" ] || name="$tree-up"
        # shellcheck disable=SC2153 # DST is set by bench/run
        DEST="$DST/$name"
        case "$1.$2" in
            *_up.ferry) CMD=("${rcp[@]}" -r "$src" "$FERRY_ADDR:bench/dst/$name") ;;
            *_up.rsync) CMD=(rsync -a "$src/" "$RSYNC_URL/dst/$name/") ;;
            *_up.scp) CMD=("${scp[@]}" -r "$src" "$SSH_USER_HOST:$DEST") ;;
            *_down.ferry) CMD=("${rcp[@]}" -r "$FERRY_ADDR:bench/$tree" "$DEST") ;;
            *_down.rsync) CMD=(rsync -a "$RSYNC_URL/$tree/" "$DEST/") ;;
            *_down.scp) CMD=("${scp[@]}" -r "$SSH_USER_HOST:$src" "$DEST") ;;
            *.local) CMD=(bash -c "$LOCAL_TREE_COPY" local-copy "$src" "$DEST") ;;
        esac
        return 0
    fi
    case "$1.$2" in
        upload.ferry) CMD=("${rcp[@]}" "$BIG" "$FERRY_ADDR:bench/dst/up.bin") DEST="$DST/up.bin" ;;
        upload.ferry_sha256) CMD=("${rcp[@]}" --hash sha256 "$BIG" "$FERRY_ADDR:bench/dst/up.bin") DEST="$DST/up.bin" ;;
        download.ferry_sha256) CMD=("${rcp[@]}" --hash sha256 "$FERRY_ADDR:bench/${BIG_SHA##*/}" "$DST/big.bin") DEST="$DST/big.bin" ;;
        upload.rsync) CMD=(rsync -W "$BIG" "$RSYNC_URL/dst/up.bin") DEST="$DST/up.bin" ;;
        upload.scp) CMD=("${scp[@]}" "$BIG" "$SSH_USER_HOST:$DST/up.bin") DEST="$DST/up.bin" ;;
        download.ferry) CMD=("${rcp[@]}" "$FERRY_ADDR:bench/big.bin" "$DST/big.bin") DEST="$DST/big.bin" ;;
        download.rsync) CMD=(rsync -W "$RSYNC_URL/big.bin" "$DST/big.bin") DEST="$DST/big.bin" ;;
        download.scp) CMD=("${scp[@]}" "$SSH_USER_HOST:$BIG" "$DST/big.bin") DEST="$DST/big.bin" ;;
    esac
}
# The local-disk ceiling of a tree copy: the same tree copied from the same source to
# the same fresh destination file system, no network, into a new directory (bash -c
# SCRIPT NAME SOURCE DEST).
# shellcheck disable=SC2016 # expanded by that bash, not this one
LOCAL_TREE_COPY='set -o pipefail; mkdir -- "$2" && tar -C "$1" -cf - . | tar -C "$2" -xf -'
# copy_job ROW ORIGINAL REP: Ferry, then rsync and scp, copy ORIGINAL once each; for a
# tree, then the local-disk ceiling (tar | tar into the row's own destination: the
# same removal, settle and check as the others), recorded as ROW's ceiling. The big
# file's rows run Ferry twice: rcp as it comes (blake3 chunk hashes by default; tool
# ferry, the headline) and rcp --hash sha256 (tool ferry_sha256; a failure of that run
# is recorded in its cells, and the run goes on).
copy_job() {
    local tool tools=(ferry rsync scp)
    [ -d "$2" ] || tools=(ferry ferry_sha256 rsync scp)
    for tool in "${tools[@]}"; do
        [ "$tool" = ferry ] || peer_ok "$1" "$tool" || continue
        command_for "$1" "$tool"
        copy_run "$1" "$tool" "$2" "$DEST" "$3" "${CMD[@]}"
    done
    if [ -d "$2" ] && [ -z "${DEAD[$1.ceiling]:-}" ]; then
        command_for "$1" local
        copy_run "$1" ceiling "$2" "$DEST" "$3" "${CMD[@]}"
    fi
}
job_upload() {
    copy_job upload "$BIG" "$1"
    ceiling_run upload
    plain_run upload
}
# The download rows' Ferry sources: big.bin for rcp as it comes (blake3) and its copy
# BIG_SHA (bench/run) for rcp --hash sha256, each recorded by ferryd in its own
# algorithm before the timed runs, as a file uploaded with that hash is: the first
# download of a file with no record records the hashes it took. Then neither run hashes
# on ferryd and the two differ by rcp's hash alone. (With one file for both, the sha256
# runs would hash on ferryd against the blake3 record, every time.)
setup_download() {
    local name hash
    # ferryd records only a file that had settled before the download began.
    sleep 1.1
    for name in "${BIG##*/}:blake3" "${BIG_SHA##*/}:sha256"; do
        hash="${name#*:}" name="${name%%:*}"
        "$RCP" --transport tcp "${RCP_ENC[@]}" --hash "$hash" "$FERRY_ADDR:bench/$name" "$WORK/prime.bin" \
            >/dev/null 2>"$WORK/err" ||
            warn "download: the untimed $hash download of $name failed ($(tail -n 1 "$WORK/err")); its runs may hash on ferryd"
        rm -f "$WORK/prime.bin"
    done
}
job_download() {
    copy_job download "$BIG" "$1"
    ceiling_run download -R
    plain_run download
}
job_small() {
    copy_job small_up "$SMALL" "$1"
    copy_job small_down "$SMALL" "$1"
}
# The mixed tree of bench.py mkmixed (issue 20): what real trees hold, symlinks too.
job_mixed() {
    copy_job mixed_up "$MIXED" "$1"
    copy_job mixed_down "$MIXED" "$1"
}

# --- (d) FUSE: ferry-mount and sshfs ----------------------------------------------------
FUSE_ROWS=(fuse_seq fuse_iops fuse_p50 fuse_p99)
# setup_mount: mount both, check the file reads back identical through each.
setup_mount() {
    local t row
    MNT_FERRY="$WORK/mnt-ferry"
    MNT_SSHFS="$WORK/mnt-sshfs"
    mkdir -p "$MNT_FERRY" "$MNT_SSHFS"
    MOUNTS+=("$MNT_FERRY" "$MNT_SSHFS")
    mount_ferry
    log "ferry-mount: $FERRY_ADDR:bench on $MNT_FERRY"
    if peer_ok fuse_seq sshfs; then
        if mount_sshfs; then
            log "sshfs: $SSH_USER_HOST:$SRV on $MNT_SSHFS"
        else
            warn "sshfs: $REASON (its cells say so; the run goes on)"
            UNAVAIL[sshfs]="fail:$REASON"
        fi
    fi
    for t in ferry sshfs; do
        [ "$t" = ferry ] || [ -z "${UNAVAIL[sshfs]:-}" ] || continue
        local mnt="$MNT_FERRY"
        [ "$t" = ferry ] || mnt="$MNT_SSHFS"
        if ! timeout -s KILL "$(limit "$COPY_LIMIT_S")" cmp -s "$BIG" "$mnt/big.bin"; then
            [ "$t" = ferry ] && die "big.bin read through ferry-mount differs from the original (or cmp timed out)"
            UNAVAIL[sshfs]="fail:big.bin read through sshfs differs (or cmp timed out)"
        fi
    done
    for row in "${FUSE_ROWS[@]}"; do peer_ok "$row" sshfs || true; done
    log "big.bin reads back identical through the mounts"
    if [ "$FIO_OK" = 0 ]; then
        for row in fuse_iops fuse_p50 fuse_p99; do
            record_skip "$row" ferry "fio not installed"
            record_skip "$row" ceiling "fio not installed"
        done
    fi
}
teardown_mount() {
    unmount_ferry
    if [ -z "${UNAVAIL[sshfs]:-}" ]; then unmount_sshfs || warn "$REASON"; fi
}
# fresh TOOL: a new client for TOOL (its own cache empty); fails for a broken sshfs.
fresh() {
    if [ "$1" = ferry ]; then
        unmount_ferry
        mount_ferry
    else
        unmount_sshfs && mount_sshfs && return 0
        warn "sshfs: $REASON (its cells say so; the run goes on)"
        UNAVAIL[sshfs]="fail:$REASON"
        local row
        for row in "${FUSE_ROWS[@]}"; do peer_ok "$row" sshfs || true; done
        return 1
    fi
}
# randread TOOL FILE: 4 KiB random reads of FILE at queue depth 1 for FIO_S seconds
# (fio), recorded as TOOL's fuse_iops, fuse_p50 and fuse_p99: the one fio job of the
# mounts and of the local-disk ceiling. Fails (1) when it did not measure.
randread() {
    local tool="$1" file="$2" out p50 p99 iops
    # fio splits --filename at ':'; escape it. psync at QD1: p50/p99 are of the whole pread().
    timed fuse_iops "$tool" $((FIO_S + 30)) fio --name=randread --filename="${file//:/\\:}" --readonly \
        --rw=randread --bs=4k --ioengine=psync --iodepth=1 --numjobs=1 \
        --time_based --runtime="$FIO_S" --randrepeat=0 \
        --lat_percentiles=1 --percentile_list=50:99 \
        --output-format=json --output="$WORK/fio.json" || return 1
    out="$(python3 "$BENCH_PY" fio "$WORK/fio.json" 2>&1)" || { fail fuse_iops "$tool" "$out" || return 1; }
    read -r p50 p99 iops <<<"$out"
    record fuse_iops "$tool" "$iops"
    record fuse_p50 "$tool" "$p50"
    record fuse_p99 "$tool" "$p99"
}
job_mount() {
    local t mnt
    SOURCE=("$BIG")
    for t in ferry sshfs; do
        if [ "$t" = ferry ]; then mnt="$MNT_FERRY"; else mnt="$MNT_SSHFS"; fi
        if [ "$t" = sshfs ] && ! peer_ok fuse_seq sshfs; then continue; fi
        fresh "$t" || continue
        if timed fuse_seq "$t" "$COPY_LIMIT_S" dd if="$mnt/big.bin" of=/dev/null bs=1M status=none; then
            record fuse_seq "$t" "$(rate "$SIZE_BYTES" "$T" 1e6)"
        fi
        [ "$FIO_OK" = 1 ] || continue
        fresh "$t" || continue
        randread "$t" "$mnt/big.bin" || continue
    done
    # The local-disk ceiling: the same reads of the file itself, no FUSE, no network,
    # from the same cache state (settled by timed), recorded as the rows' ceiling.
    if [ -z "${DEAD[fuse_seq.ceiling]:-}" ] &&
        timed fuse_seq ceiling "$COPY_LIMIT_S" dd if="$BIG" of=/dev/null bs=1M status=none; then
        record fuse_seq ceiling "$(rate "$SIZE_BYTES" "$T" 1e6)"
    fi
    if [ "$FIO_OK" = 1 ] && [ -z "${DEAD[fuse_iops.ceiling]:-}" ]; then randread ceiling "$BIG" || true; fi
    [ -z "$RTT" ] || rtt_floor
}
# rtt_floor: bench/rtt.c's TCP round trip between two processes (64 B out, 16 KiB
# back, QD1), on any CPU and pinned to one; recorded as row rtt (µs: tools any and one
# for p50, any_p99 and one_p99), which the report prints under its table as the floor
# under every FUSE miss.
rtt_floor() {
    local out any any99 one one99
    if ! out="$(timeout -s KILL 120 "$RTT" "$RTT_COUNT" 16384 2>&1)"; then
        record_fail rtt any "rtt: ${out:-killed after 120 s}"
        return 0
    fi
    read -r any any99 one one99 <<<"$out"
    record rtt any "$any"
    record rtt one "$one"
    record rtt any_p99 "$any99"
    record rtt one_p99 "$one99"
}

# --- (d') FUSE writes (issue 21): ferry-mount read-write, sshfs, the local disk ----------
# Four rows, each run by ferry-mount (mounted read-write: no -o ro), by sshfs (the
# private sshd; writable) and directly on the destination file system as the local-disk
# ceiling (tool "ceiling"). Every run writes under $DST (dst/ in both mounts): a fresh
# file system (clear_dest), the client freshly mounted just before it and unmounted
# after it; SYNC_FS=$DST, so each time also covers a syncfs of that file system (the
# server's disk) after the command. What a run writes is read back from $DST itself,
# not through the mount, before the client is unmounted: a client that still held it
# in a cache would fail.
#   fusew_seq   dd if=BIG of=DIR/wseq.bin bs=1M conv=fsync; BIG is held in the page
#               cache (PRELOAD, read after the cache is dropped): MB/s
#   fusew_tar   mkdir DIR/wtar && tar --no-same-owner -C DIR/wtar -xf $WTAR && sync -f
#               DIR/wtar, $WTAR (the small-file tree, tarred once) in the page cache:
#               files/s, and the seconds as fusew_tar.s
#   fusew_qd1   fio 4 KiB buffered random writes (--direct=0) into DIR/wrand.bin, a file
#   fusew_qd16  of FIOW_MIB MiB written (and synced) on $DST before the client mounts,
#               for FIO_S s, --end_fsync=1; psync at QD1, $FIOW_ENGINE at QD16: IOPS
#               (fio's, over its runtime, which includes the end fsync; that runtime
#               as ROW.runtime_s) and p50/p99 of each write (ROW.p50, ROW.p99, µs)
# DIR is $MNT_FERRY/dst, $MNT_SSHFS/dst or $DST. Ferry's failures are recorded, not
# fatal (FERRY_SOFT): an older ferry-mount is read-only, and its cells say why.
FUSEW_ROWS=(fusew_seq fusew_tar fusew_qd1 fusew_qd16)
FUSEW_TOOLS=(ferry sshfs ceiling)
# shellcheck disable=SC2016 # expanded by that bash, not this one
WTAR_X='mkdir -- "$1" && tar --no-same-owner -C "$1" -xf "$2" && sync -f "$1"'
# fusew_fail ROW... TOOL REASON: TOOL fails in every ROW, with REASON in its cells.
fusew_fail() {
    local args=("$@") n=$(($# - 2)) row
    for row in "${args[@]:0:n}"; do
        record_fail "$row" "${args[n]}" "${args[n + 1]//"$WORK/"/}"
        DEAD[$row.${args[n]}]=1
    done
}
# unmount_ferry_soft: unmount_ferry, but a failure returns 1 with REASON instead of
# ending the run (a mount it left behind goes lazily).
unmount_ferry_soft() {
    local rc=0
    REASON=""
    kill -TERM "$FERRY_MOUNT_PID" 2>/dev/null || true
    if ! wait_exit "$FERRY_MOUNT_PID" 30; then
        kill -KILL "$FERRY_MOUNT_PID" 2>/dev/null || true
        REASON="ferry-mount did not exit within 30 s of SIGTERM"
    fi
    wait "$FERRY_MOUNT_PID" 2>/dev/null || rc=$?
    untrack "$FERRY_MOUNT_PID"
    if [ -n "$(fstype_at "$MNT_FERRY")" ]; then
        fusermount3 -u -z "$MNT_FERRY" 2>/dev/null || umount -l "$MNT_FERRY" 2>/dev/null || true
        REASON="${REASON:-ferry-mount exited (status $rc) on SIGTERM but left its mount behind}"
    fi
    if [ -z "$REASON" ] && [ "$rc" -ne 0 ]; then REASON="ferry-mount exited with status $rc on SIGTERM"; fi
    [ -z "$REASON" ]
}
# setup_mountwrite: the mount points; whether ferry-mount can write at all (a file
# made and removed through it: if not, every Ferry cell of the job says why); fio's
# engine for QD16.
setup_mountwrite() {
    local out row m
    MNT_FERRY="$WORK/mnt-ferry"
    MNT_SSHFS="$WORK/mnt-sshfs"
    mkdir -p "$MNT_FERRY" "$MNT_SSHFS"
    for m in "$MNT_FERRY" "$MNT_SSHFS"; do
        case " ${MOUNTS[*]} " in *" $m "*) ;; *) MOUNTS+=("$m") ;; esac
    done
    FERRY_SOFT=1
    clear_dest "$DST/.bench-write-probe"
    mount_ferry
    log "ferry-mount (read-write): $FERRY_ADDR:bench on $MNT_FERRY"
    # shellcheck disable=SC2016 # expanded by that sh
    if ! out="$(timeout -s KILL 30 sh -c 'printf x >"$1" && rm -- "$1"' probe "$MNT_FERRY/dst/.bench-write-probe" 2>&1)"; then
        out="$(printf '%s' "${out:-killed after 30 s}" | tail -n 1)"
        fusew_fail "${FUSEW_ROWS[@]}" ferry "ferry-mount is not writable: $out"
        warn "ferry-mount is not writable ($out): its mountwrite cells say so; the run goes on"
    fi
    unmount_ferry_soft || fusew_fail "${FUSEW_ROWS[@]}" ferry "$REASON"
    if [ "$FIO_OK" = 0 ]; then
        for row in fusew_qd1 fusew_qd16; do
            record_skip "$row" ferry "fio not installed"
            record_skip "$row" ceiling "fio not installed"
            DEAD[$row.ferry]=1 DEAD[$row.ceiling]=1 DEAD[$row.sshfs]=1
        done
        return 0
    fi
    # io_uring runs buffered writes at their queue depth (io-wq workers take those that
    # would block); buffered libaio writes complete inside io_submit, one at a time.
    FIOW_ENGINE=io_uring
    if ! fio --name=probe --filename="$WORK/fio-probe" --size=1m --rw=randwrite --bs=4k \
        --ioengine=io_uring --iodepth=16 --direct=0 --output="$WORK/fio-probe.out" \
        >>"$WORK/logs/fio-probe.log" 2>&1; then
        FIOW_ENGINE=libaio
        NOTES+=("mountwrite: fio's io_uring engine does not run here (logs/fio-probe.log): QD16 uses libaio, whose buffered writes complete inside io_submit, so that row is close to QD1")
        warn "${NOTES[-1]}"
    fi
    rm -f "$WORK/fio-probe" "$WORK/fio-probe.out"
}
teardown_mountwrite() { FERRY_SOFT=0; }
# fusew_start ROW TOOL NAME: ready for TOOL's run in ROW, which writes NAME: TOOL has
# not failed in ROW (a peer: can run at all), $DST is fresh (for the fio rows with
# NAME written on it), TOOL's client is freshly mounted; sets TGT, the directory TOOL
# writes NAME into. Fails (1) when TOOL does not run.
fusew_start() {
    local row="$1" tool="$2" name="$3"
    [ "$OUT_OF_BUDGET" = 0 ] || return 1
    [ -z "${DEAD[$row.$tool]:-}" ] || return 1
    [ "$tool" != sshfs ] || peer_ok "$row" sshfs || return 1
    clear_dest "$DST/$name"
    case "$row" in
        fusew_qd*)
            dd if="$BIG" of="$DST/$name" bs=1M count="$FIOW_MIB" conv=fsync status=none ||
                die "$row: cannot write its $FIOW_MIB MiB file on $DST"
            ;;
    esac
    case "$tool" in
        ferry) mount_ferry && TGT="$MNT_FERRY/dst" ;;
        sshfs)
            if ! mount_sshfs; then
                warn "sshfs: $REASON (its cells say so; the run goes on)"
                UNAVAIL[sshfs]="fail:$REASON"
                local r
                for r in "${FUSEW_ROWS[@]}"; do peer_ok "$r" sshfs || true; done
                return 1
            fi
            TGT="$MNT_SSHFS/dst"
            ;;
        *) TGT="$DST" ;;
    esac
}
# fusew_end ROW TOOL: unmount TOOL's client; fails (1), its cell failed, if that did
# not go cleanly.
fusew_end() {
    case "$2" in
        ferry) unmount_ferry_soft || { fusew_fail "$1" ferry "$REASON"; return 1; } ;;
        sshfs)
            if ! unmount_sshfs; then
                UNAVAIL[sshfs]="fail:$REASON"
                fail "$1" sshfs "$REASON" || return 1
            fi
            ;;
    esac
}
# fusew_seq TOOL REP: the sequential write of the big file.
fusew_seq() {
    local tool="$1" rep="$2" ok=1
    fusew_start fusew_seq "$tool" wseq.bin || return 0
    SOURCE=() PRELOAD=("$BIG") SYNC_FS="$DST"
    timed fusew_seq "$tool" "$COPY_LIMIT_S" dd if="$BIG" of="$TGT/wseq.bin" bs=1M conv=fsync status=none || ok=0
    PRELOAD=() SYNC_FS=""
    if [ "$ok" = 1 ] && ! check fusew_seq "$BIG" "$DST/wseq.bin" "$rep"; then
        fail fusew_seq "$tool" "the file on the server's disk differs from its source" || ok=0
    fi
    [ -n "$DSTFS_DEV" ] || rm -f "$DST/wseq.bin"
    fusew_end fusew_seq "$tool" || ok=0
    [ "$ok" = 1 ] || return 0
    record fusew_seq "$tool" "$(rate "$SIZE_BYTES" "$TS" 1e6)"
}
# fusew_tar TOOL REP: tar x of the small-file tree, then sync -f.
fusew_tar() {
    local tool="$1" rep="$2" ok=1
    fusew_start fusew_tar "$tool" wtar || return 0
    SOURCE=() PRELOAD=("$WTAR") SYNC_FS="$DST"
    timed fusew_tar "$tool" "$COPY_LIMIT_S" bash -c "$WTAR_X" tar-x "$TGT/wtar" "$WTAR" || ok=0
    PRELOAD=() SYNC_FS=""
    if [ "$ok" = 1 ] && ! check fusew_tar "$WTREE" "$DST/wtar" "$rep"; then
        fail fusew_tar "$tool" "the tree on the server's disk differs from the tar's" || ok=0
    fi
    [ -n "$DSTFS_DEV" ] || discard "$DST/wtar"
    fusew_end fusew_tar "$tool" || ok=0
    [ "$ok" = 1 ] || return 0
    record fusew_tar "$tool" "$(rate "$SMALL_N" "$TS")"
    record fusew_tar.s "$tool" "$TS"
}
# fusew_fio ROW TOOL: 4 KiB random writes at ROW's queue depth.
fusew_fio() {
    local row="$1" tool="$2" ok=1 depth=1 engine=psync out p50 p99 iops file size rt
    if [ "$row" = fusew_qd16 ]; then depth=16 engine="$FIOW_ENGINE"; fi
    fusew_start "$row" "$tool" wrand.bin || return 0
    file="$TGT/wrand.bin"
    SOURCE=() SYNC_FS="$DST"
    # fio splits --filename at ':'; escape it.
    timed "$row" "$tool" $((FIO_S + 120)) fio --name=randwrite --filename="${file//:/\\:}" \
        --rw=randwrite --bs=4k --size="${FIOW_MIB}m" --ioengine="$engine" --iodepth="$depth" \
        --direct=0 --end_fsync=1 --numjobs=1 --time_based --runtime="$FIO_S" --randrepeat=0 \
        --lat_percentiles=1 --percentile_list=50:99 \
        --output-format=json --output="$WORK/fio.json" || ok=0
    SYNC_FS=""
    if [ "$ok" = 1 ]; then
        if ! out="$(python3 "$BENCH_PY" fio "$WORK/fio.json" write 2>&1)"; then
            fail "$row" "$tool" "$out" || ok=0
        elif size="$(stat -c %s "$DST/wrand.bin" 2>/dev/null)" && [ "$size" = "$FIOW_BYTES" ]; then
            read -r p50 p99 iops <<<"$out"
            # fio's runtime, its end fsync included (FIO_S asked): what the fsync took.
            rt="$(python3 "$BENCH_PY" field "$WORK/fio.json" jobs 0 job_runtime 2>/dev/null)" || rt=""
        else
            fail "$row" "$tool" "the file on the server's disk is ${size:-gone}, not $FIOW_BYTES bytes" || ok=0
        fi
    fi
    fusew_end "$row" "$tool" || ok=0
    [ "$ok" = 1 ] || return 0
    record "$row" "$tool" "$iops"
    record "$row.p50" "$tool" "$p50"
    record "$row.p99" "$tool" "$p99"
    [ -z "$rt" ] || record "$row.runtime_s" "$tool" "$(rate "$rt" 1000)"
}
job_mountwrite() {
    local t
    for t in "${FUSEW_TOOLS[@]}"; do fusew_seq "$t" "$1"; done
    for t in "${FUSEW_TOOLS[@]}"; do fusew_tar "$t" "$1"; done
    for t in "${FUSEW_TOOLS[@]}"; do fusew_fio fusew_qd1 "$t"; done
    for t in "${FUSEW_TOOLS[@]}"; do fusew_fio fusew_qd16 "$t"; done
}

# --- (d'') POSIX conformance (issue 42): pjdfstest in ferry-mount, sshfs, the local disk ---
# Each tool's count is the tests of the suite that failed (scripts/lib/pjdfstest.py counts
# as prove does); the number run goes to the meta (conf_tests_TOOL), since a hung file
# counts its unreported tests as failed.
setup_conformance() {
    CONF_SUITE="$WORK/pjdfstest"
    python3 "$ROOT/scripts/lib/pjdfstest.py" build "${FERRY_PJDFSTEST_SRC:-$ROOT/../shared/pjdfstest}" \
        "$CONF_SUITE" >>"$WORK/logs/pjdfstest-build.log" 2>&1 || die "pjdfstest did not build (see $WORK/logs/pjdfstest-build.log)"
    MNT_SSHFS="$WORK/mnt-conf-sshfs"
    mkdir -p "$MNT_SSHFS" "$WORK/conf-local"
    chmod 755 "$WORK/conf-local"
    MOUNTS+=("$MNT_SSHFS")
}
# conf_record TOOL JSON: the failures and the tests run, from the runner's JSON.
conf_record() {
    record conf_failed "$1" "$(python3 "$ROOT/bench/lib/bench.py" field "$2" counts failed)"
    meta "conf_tests_$1" "$(python3 "$ROOT/bench/lib/bench.py" field "$2" counts tests)"
}
job_conformance() {
    local json
    [ "$(id -u)" = 0 ] || { record_skip conf_failed ferry "not run: needs root"; return 0; }
    json="$WORK/conf-ceiling.json"
    python3 "$ROOT/scripts/lib/pjdfstest.py" run "$CONF_SUITE" "$WORK/conf-local" --json "$json" \
        >>"$WORK/logs/pjdfstest-local.log" 2>&1 || true
    conf_record ceiling "$json"
    if peer_ok conf_failed sshfs; then
        if SSHFS_OPTS=allow_other,default_permissions mount_sshfs; then
            json="$WORK/conf-sshfs.json"
            python3 "$ROOT/scripts/lib/pjdfstest.py" run "$CONF_SUITE" "$MNT_SSHFS" --json "$json" \
                >>"$WORK/logs/pjdfstest-sshfs.log" 2>&1 || true
            conf_record sshfs "$json"
            unmount_sshfs || warn "$REASON"
        else
            record_fail conf_failed sshfs "$REASON"
        fi
    fi
    json="$WORK/conf-ferry.json"
    if "$ROOT/scripts/pjdfstest.sh" --bin-dir "$(dirname "$FERRYD")" --no-expect --json "$json" \
        >>"$WORK/logs/pjdfstest-ferry.log" 2>&1 && [ -s "$json" ]; then
        conf_record ferry "$json"
    else
        record_fail conf_failed ferry "scripts/pjdfstest.sh failed: $(tail -n 1 "$WORK/logs/pjdfstest-ferry.log")"
    fi
}

# --- (e) incremental backup -------------------------------------------------------------
# backup_run ROW TOOL REP CMD...: one timed backup of $BSRC into $DST, timed until
# $DST's file system is synced too; the snapshot it made must equal $BSRC (rcp
# backup's is named in its --json; rsync's is $RSYNC_SNAP).
backup_run() {
    local row="$1" tool="$2" rep="$3" snap ok=1
    shift 3
    SOURCE=("$BSRC")
    SYNC_FS="$DST"
    timed "$row" "$tool" "$COPY_LIMIT_S" "$@" || ok=0
    SYNC_FS=""
    [ "$ok" = 1 ] || return 0
    if [ "$tool" = ferry ]; then
        snap="$SRV/$(python3 "$BENCH_PY" field "$WORK/out" targets 0 snapshot)" || die "$row: no snapshot in rcp backup's --json"
    else
        snap="$RSYNC_SNAP"
    fi
    if ! check "$row" "$BSRC" "$snap" "$rep"; then
        fail "$row" "$tool" "the snapshot differs from the source" || return 0
    fi
    record "$row" "$tool" "$T"
    record "$row.sync" "$tool" "$TS"
}
# One fresh file system per repetition holds both tools' snapshots (an incremental
# backup needs the full one before it); nothing is deleted on it during the repetition.
job_backup() {
    local r="$1"
    clear_dest "$DST/bk" "$DST/bk-rsync"
    mkdir -p "$DST/bk-rsync"
    backup_run backup_full ferry "$r" "$RCP" backup --json --transport tcp "${BACKUP_ENC[@]}" "$BSRC" "$FERRY_ADDR:bench/dst/bk"
    RSYNC_SNAP="$DST/bk-rsync/1"
    if peer_ok backup_full rsync; then backup_run backup_full rsync "$r" rsync -a "$BSRC/" "$RSYNC_URL/dst/bk-rsync/1/"; fi
    sleep 1.1 # rcp backup's snapshot names have a resolution of one second
    python3 "$BENCH_PY" change "$BSRC"
    unset 'TREESUM[$BSRC]'
    backup_run backup_inc ferry "$r" "$RCP" backup --json --transport tcp "${BACKUP_ENC[@]}" "$BSRC" "$FERRY_ADDR:bench/dst/bk"
    RSYNC_SNAP="$DST/bk-rsync/2"
    if peer_ok backup_inc rsync && [ -z "${DEAD[backup_full.rsync]:-}" ]; then
        backup_run backup_inc rsync "$r" rsync -a --link-dest=../1 "$BSRC/" "$RSYNC_URL/dst/bk-rsync/2/"
    fi
}

# --- (h) encryption: the same copies encrypted and not, beside scp -----------------------
# Each row runs the copy of upload, download, small_up or small_down (command_for) with
# rcp --encryption required (tool ferry_enc) and --encryption off (tool ferry_off), both
# against the same ferryd (--encryption preferred), then scp (encrypted too, to the
# private sshd); through copy_run like the others: the same settle, fresh destination
# file system, check, durable and tool-alone rates, CPU-seconds per GB, and the suite
# rcp --json names (ROW.suite). A Ferry run that fails gets "failed: ..." cells (like
# rcp --hash sha256); the run goes on. bench/run runs the job only where rcp has
# --encryption.
CRYPT_ROWS=(crypt_up crypt_down crypt_small_up crypt_small_down)
job_crypt() {
    local row base orig tool off=("${RCP_ENC[@]}")
    for row in "${CRYPT_ROWS[@]}"; do
        base="${row#crypt_}" orig="$SMALL"
        case "$base" in up) base=upload orig="$BIG" ;; down) base=download orig="$BIG" ;; esac
        for tool in ferry_enc ferry_off scp; do
            peer_ok "$row" "$tool" || continue
            case "$tool" in
                ferry_enc) RCP_ENC=(--encryption required) ;;
                ferry_off) RCP_ENC=(--encryption off) ;;
            esac
            command_for "$base" "${tool%_*}"
            RCP_ENC=("${off[@]}")
            copy_run "$row" "$tool" "$orig" "$DEST" "$1" "${CMD[@]}"
        done
    done
}

# --- (f) RDMA in the Soft-RoCE VM ---------------------------------------------------------
# bench/rdma.sh prints "| rcp upload ... | MiB/s | ib_read_bw MiB/s | ratio |" rows (the
# unencrypted ones, matched at the start of the cell; its "| encrypted rcp upload ..." rows
# are left out).
job_rdma() {
    local args=(--no-save --bin-dir "$BIN_DIR" --reps "$REPS") line row rcp verbs
    [ "$QUICK" = 0 ] || args+=(--quick)
    log "rdma: bench/rdma.sh ${args[*]} (boots the Soft-RoCE VM; takes minutes)"
    timeout -s KILL "$(limit 1500)" bench/rdma.sh "${args[@]}" >"$WORK/rdma.out" 2>"$WORK/logs/rdma.log" ||
        die "rdma: bench/rdma.sh failed (its output: $WORK/logs/rdma.log)"
    for line in upload download; do
        read -r rcp verbs < <(awk -F'|' -v j=" rcp $line" 'index($2, j) == 1 { gsub(/[^0-9.]/, "", $3); gsub(/[^0-9.]/, "", $4); print $3, $4 }' "$WORK/rdma.out")
        if [ -z "${rcp:-}" ] || [ -z "${verbs:-}" ]; then die "rdma: no 'rcp $line' row with numbers in bench/rdma.sh's output"; fi
        row=rdma_up
        [ "$line" = upload ] || row=rdma_down
        record "$row" ferry "$rcp"
        record "$row" ceiling "$verbs"
    done
}

# --- (i) cluster: one big file spread over 1, 2 and 4 storage nodes -----------------------
# bench/lib/cluster.sh brings up a real etcd and N ferryd nodes, each in its own network
# namespace behind a veth shaped to CLUSTER_RATE_MBS each way, their stores on the
# local disk; every configuration is a fresh cluster. Each runs rcp --replicas R of the
# big file up to share bench (cluster://127.0.0.1:PORT/bench/big.bin) and back into
# $WORK/cluster/back.bin, each timed until synced (the nodes' stores and the copy are on
# $WORK's file system), the copy compared with cmp: rows cluster_up_nN, cluster_down_nN
# (N = 1, 2, 4, replicas 1) and cluster_up_n4r2, cluster_down_n4r2 (replicas 2, for
# information), MB/s (ROW: the tool alone; ROW.sync: until durable). cluster_link_up and
# cluster_link_down: iperf3 -l 1M of the big file's size through one shaped veth (iperf3
# -s in node 1's namespace), the rate the link really gives. The hung-node rows
# (cluster_hung, seconds): on a fresh cluster of 3 nodes with 2 replicas, the big file up
# and down healthy (cluster_hung_up_ok, cluster_hung_down_ok) and again with node 1
# SIGSTOPped a third of the healthy time in (cluster_hung_up, cluster_hung_down), and a
# read through ferry-mount -o ro with node 1 stopped before it (cluster_hung_mount, and
# cluster_hung_mount_stall: its longest 1 MiB read). bench/run runs the job only where
# cluster_usable says it can.
CLUSTER_ROWS=(cluster_up_n1 cluster_down_n1 cluster_up_n2 cluster_down_n2 cluster_up_n4 cluster_down_n4
    cluster_up_n4r2 cluster_down_n4r2 cluster_link_up cluster_link_down
    cluster_hung_up_ok cluster_hung_down_ok cluster_hung_up cluster_hung_down cluster_hung_mount
    cluster_hung_mount_stall)
# cluster_usable: whether this machine and build can run the job; REASON says why not.
cluster_usable() {
    local c
    [ "$(id -u)" -eq 0 ] || { REASON="needs root (ip netns, veth, tc)"; return 1; }
    for c in ip tc etcd flock; do have "$c" || { REASON="no $c"; return 1; }; done
    [ -x "$FERRY" ] || { REASON="no ferry binary in $BIN_DIR"; return 1; }
    "$FERRYD" --help 2>&1 | grep -q -- --cluster || { REASON="this ferryd has no --cluster"; return 1; }
    "$RCP" --help 2>&1 | grep -q -- --replicas || { REASON="this rcp has no --replicas"; return 1; }
}
# cluster_copy ROW CMD...: one timed copy by CMD (its destination synced after it: the
# nodes' stores and the download are on $WORK's file system); records MB/s of the big
# file, the tool alone (ROW) and until durable (ROW.sync).
cluster_copy() {
    local row="$1" ok=1
    shift
    SOURCE=("$BIG")
    SYNC_FS="$WORK"
    timed "$row" ferry "$CLUSTER_LIMIT_S" "$@" || ok=0
    SYNC_FS=""
    [ "$ok" = 1 ] || return 1
    record "$row" ferry "$(rate "$SIZE_BYTES" "$T" 1e6)"
    record "$row.sync" ferry "$(rate "$SIZE_BYTES" "$TS" 1e6)"
}
# cluster_config N REPLICAS SUFFIX: a fresh cluster of N nodes, the big file up and down
# (compared with cmp), the cluster gone again.
cluster_config() {
    local n="$1" r="$2" sfx="$3" url rcp=("$RCP" --json --transport tcp "${RCP_ENC[@]}")
    peer_ok "cluster_up_$sfx" ferry || return 0
    if ! cluster_up "$n" "$r"; then
        cluster_down
        fail "cluster_up_$sfx" ferry "$REASON" || true
        return 0
    fi
    url="cluster://127.0.0.1:$CLUSTER_PORT/bench/big.bin"
    if cluster_copy "cluster_up_$sfx" "${rcp[@]}" --replicas "$r" "$BIG" "$url" &&
        cluster_copy "cluster_down_$sfx" "${rcp[@]}" "$url" "$WORK/cluster/back.bin"; then
        cmp -s "$BIG" "$WORK/cluster/back.bin" ||
            fail "cluster_down_$sfx" ferry "the copy downloaded from $n nodes differs from the original" || true
    fi
    cluster_down
}
# cluster_link: iperf3 -l 1M through node 1's shaped veth, both ways, in MB/s.
cluster_link() {
    local pid port bps dir ns _
    peer_ok cluster_link_up ceiling || return 0
    if ! { cluster_claim && cluster_net_up 1; }; then
        cluster_down
        fail cluster_link_up ceiling "$REASON" || true
        return 0
    fi
    port="$(free_port)" ns="$(cluster_ns 1)"
    ip netns exec "$ns" iperf3 -s -B "10.$CLUSTER_A.1.2" -p "$port" {CLUSTER_LOCK_FD}>&- \
        >"$WORK/logs/iperf3-cluster.log" 2>&1 &
    pid=$!
    track "$pid"
    for _ in $(seq 1 100); do
        listening "$port" "$ns" && break
        sleep 0.1
    done
    for dir in up down; do
        local args=()
        [ "$dir" = up ] || args=(-R)
        SOURCE=()
        timed "cluster_link_$dir" ceiling "$CLUSTER_LIMIT_S" \
            iperf3 -c "10.$CLUSTER_A.1.2" -p "$port" -l 1M -n "$SIZE_BYTES" -J "${args[@]}" || continue
        if bps="$(python3 "$BENCH_PY" iperf "$WORK/out" 2>&1)"; then
            record "cluster_link_$dir" ceiling "$(rate "$bps" 1 1e6)"
        else
            fail "cluster_link_$dir" ceiling "$bps" || true
        fi
    done
    stop_pid "$pid"
    cluster_down
}
# cluster_hung_copy ROW HEALTHY_S CMD...: CMD timed with node 1 SIGSTOPped a third of
# HEALTHY_S in (SIGCONT when CMD ends); records the seconds in ROW.
cluster_hung_copy() {
    local row="$1" delay out
    delay="$(awk -v t="$2" 'BEGIN { printf "%.2f", t / 3 }')"
    shift 2
    settle "$BIG"
    if out="$(python3 "$BENCH_PY" hung "$(limit "$CLUSTER_LIMIT_S")" "$delay" "${CLUSTER_PID[1]}" \
        "$WORK/out" "$WORK/err" -- "$@")"; then
        record "$row" ferry "$out"
    else
        fail "$row" ferry "$out" || true
        return 1
    fi
}
# cluster_wait_live N: until ferry cluster status reports N live nodes (20 s).
cluster_wait_live() {
    local _
    for _ in $(seq 1 100); do
        [ "$(cluster_live)" != "$1" ] || return 0
        sleep 0.2
    done
    return 1
}
# cluster_hung_mount: ferry-mount -f -o ro of share bench, node 1 stopped, the big file
# read through it (bench.py readlat), node 1 continued, the mount gone (SIGTERM).
cluster_hung_mount() {
    local mnt="$WORK/cluster/mnt" out node1="${CLUSTER_PID[1]}" mpid
    mkdir -p "$mnt"
    "$FERRY_MOUNT" -f -o ro --transport tcp "${MOUNT_ENC[@]}" "cluster://127.0.0.1:$CLUSTER_PORT/bench" "$mnt" \
        {CLUSTER_LOCK_FD}>&- >>"$WORK/logs/cluster-mount.log" 2>&1 &
    mpid=$!
    track "$mpid"
    if ! wait_mounted "$mnt" fuse.ferry "$mpid"; then
        fail cluster_hung_mount ferry "ferry-mount did not mount: $(tail -n 1 "$WORK/logs/cluster-mount.log")" || true
        stop_pid "$mpid"
        untrack "$mpid"
        return 0
    fi
    sync
    echo 3 >/proc/sys/vm/drop_caches
    kill -STOP "$node1"
    if out="$(timeout -s KILL "$(limit "$CLUSTER_LIMIT_S")" python3 "$BENCH_PY" readlat "$mnt/big.bin" 2>&1)"; then
        record cluster_hung_mount ferry "${out% *}"
        record cluster_hung_mount_stall ferry "${out#* }"
    else
        fail cluster_hung_mount ferry "$out" || true
    fi
    kill -CONT "$node1"
    stop_pid "$mpid"
    untrack "$mpid"
    [ -z "$(fstype_at "$mnt")" ] || umount -l "$mnt" 2>/dev/null || true
}
# cluster_hung: the hung-node rows (see CLUSTER_ROWS), on a fresh cluster of 3 nodes.
cluster_hung() {
    local url rcp=("$RCP" --json --transport tcp "${RCP_ENC[@]}") up="" down=""
    peer_ok cluster_hung_up ferry || return 0
    if ! cluster_up 3 2; then
        cluster_down
        fail cluster_hung_up ferry "$REASON" || true
        return 0
    fi
    url="cluster://127.0.0.1:$CLUSTER_PORT/bench/big.bin"
    SOURCE=("$BIG")
    timed cluster_hung_up_ok ferry "$CLUSTER_LIMIT_S" "${rcp[@]}" --replicas 2 "$BIG" "$url" &&
        record cluster_hung_up_ok ferry "$T" && up="$T"
    timed cluster_hung_down_ok ferry "$CLUSTER_LIMIT_S" "${rcp[@]}" "$url" "$WORK/cluster/back.bin" &&
        record cluster_hung_down_ok ferry "$T" && down="$T"
    if [ -n "$down" ] && cluster_hung_copy cluster_hung_down "$down" "${rcp[@]}" "$url" "$WORK/cluster/back.bin"; then
        cmp -s "$BIG" "$WORK/cluster/back.bin" ||
            fail cluster_hung_down ferry "the copy downloaded with node 1 hung differs from the original" || true
    fi
    # Node 1's lease ran out while it was stopped: it registers again once continued.
    cluster_wait_live 3 || warn "cluster_hung: node 1 did not register again within 20 s"
    if [ -n "$up" ] && cluster_hung_copy cluster_hung_up "$up" "${rcp[@]}" --replicas 2 "$BIG" "$url.2"; then
        cluster_wait_live 3 || true
        "${rcp[@]}" "$url.2" "$WORK/cluster/back.bin" >/dev/null 2>>"$WORK/logs/ferry.log" &&
            cmp -s "$BIG" "$WORK/cluster/back.bin" ||
            fail cluster_hung_up ferry "the file uploaded with node 1 hung does not read back whole" || true
    fi
    rm -f "$WORK/cluster/back.bin"
    cluster_wait_live 3 || true
    cluster_hung_mount
    cluster_down
}
# A Ferry failure here gets "failed: ..." cells and the run goes on (cluster mode is
# new): FERRY_SOFT.
job_cluster() {
    local n
    CLUSTER_LIMIT_S=$((60 + SIZE_MIB * 3 / CLUSTER_RATE_MBS))
    FERRY_SOFT=1
    for n in 1 2 4; do cluster_config "$n" 1 "n$n"; done
    cluster_config 4 2 n4r2
    cluster_hung
    FERRY_SOFT=0
    cluster_link
}
