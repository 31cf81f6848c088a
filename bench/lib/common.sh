# shellcheck shell=bash disable=SC2034 # some globals (DSTFS_WHY, DSTFS_DIO) are read by bench/run
# Shared by bench/run and bench/lib/*.sh (sourced): logging, processes started in
# the background and stopped by PID, mounts, the time budget, result records.
#
# The caller sets WORK (the scratch directory; logs in $WORK/logs) and BENCH_PY.

log() { echo "[bench] $*" >&2; }
warn() { echo "[bench] warning: $*" >&2; }
# die MESSAGE: show the tail of every service log, then exit 1 (the EXIT trap cleans up).
die() {
    local f
    for f in "${WORK:-/nonexistent}"/logs/*.log; do
        [ -s "$f" ] || continue
        echo "[bench] last lines of $(basename "$f"):" >&2
        tail -n 15 "$f" >&2
    done
    echo "[bench] ERROR: $*" >&2
    exit 1
}
# positive_int NAME VALUE: VALUE is a whole number > 0, or exit 2.
positive_int() {
    case "$2" in '' | *[!0-9]* | 0) echo "bench: $1 takes a positive whole number (got '$2')" >&2; exit 2 ;; esac
}

# --- processes ---------------------------------------------------------------
# Every background process started by the benchmark is tracked by PID and stopped
# (SIGTERM, then SIGKILL) in reverse start order at exit: clients before servers.
TRACKED=()
track() { TRACKED+=("$1"); }
untrack() {
    local i
    for i in "${!TRACKED[@]}"; do [ "${TRACKED[$i]}" != "$1" ] || unset 'TRACKED[i]'; done
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
# stop_pid PID: SIGTERM, up to 10 s, then SIGKILL; reap it; untrack it.
stop_pid() {
    kill -TERM "$1" 2>/dev/null || true
    wait_exit "$1" 10 || kill -KILL "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    untrack "$1"
}

# --- mounts ------------------------------------------------------------------
MOUNTS=()
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
# wait_mounted DIR FSTYPE PID: until DIR is mounted with FSTYPE (10 s), while PID lives.
wait_mounted() {
    local _
    for _ in $(seq 1 100); do
        [ "$(fstype_at "$1")" = "$2" ] && return 0
        alive "$3" || return 1
        sleep 0.1
    done
    return 1
}

# --- the destinations' file system -------------------------------------------
# Every copy lands on a fresh journaled ext4 (data=ordered, the default: what storage
# nodes run) on a loop device over a sparse image in $WORK, mounted at DSTFS_MNT and
# made again (umount, mkfs, mount) before each tool's run (dstfs_fresh), so that no
# tool pays for another's deleted inodes or uncheckpointed journal. Without root, a
# loop device or mkfs.ext4, DSTFS_DEV stays empty (DSTFS_WHY says why) and the
# destinations are a plain directory on $WORK's file system, cleared by discard.
DSTFS_DEV="" DSTFS_IMG="" DSTFS_MNT="" DSTFS_WHY="" DSTFS_DIO=""
# shellcheck disable=SC2054 # the commas are mkfs.ext4's, inside one argument
DSTFS_MKFS=(mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0)
# dstfs_setup DIR SIZE_MIB: a new SIZE_MIB image, on a loop device, mounted at DIR;
# returns 1 with the cause in DSTFS_WHY (and nothing left behind).
dstfs_setup() {
    local c
    DSTFS_MNT="$1"
    mkdir -p "$DSTFS_MNT"
    if [ "$(id -u)" -ne 0 ]; then DSTFS_WHY="not root"; return 1; fi
    for c in losetup mkfs.ext4 mount umount; do
        command -v "$c" >/dev/null 2>&1 || { DSTFS_WHY="no $c"; return 1; }
    done
    [ -c /dev/loop-control ] || { DSTFS_WHY="no /dev/loop-control"; return 1; }
    DSTFS_IMG="$WORK/dstfs.img"
    truncate -s "${2}M" "$DSTFS_IMG" || { DSTFS_WHY="cannot make a ${2} MiB image file"; return 1; }
    # Direct I/O: the image's blocks are not cached a second time, as on a disk.
    if DSTFS_DEV="$(losetup --find --show --direct-io=on "$DSTFS_IMG" 2>>"$WORK/logs/dstfs.log")"; then
        case "$(cat "/sys/block/${DSTFS_DEV#/dev/}/loop/dio" 2>/dev/null)" in 1) DSTFS_DIO=on ;; *) DSTFS_DIO=off ;; esac
    elif DSTFS_DIO=off && ! DSTFS_DEV="$(losetup --find --show "$DSTFS_IMG" 2>>"$WORK/logs/dstfs.log")"; then
        DSTFS_DEV="" DSTFS_WHY="losetup failed: $(tail -n 1 "$WORK/logs/dstfs.log")"
        return 1
    fi
    if ! "${DSTFS_MKFS[@]}" "$DSTFS_DEV" >>"$WORK/logs/dstfs.log" 2>&1 ||
        ! mount -t ext4 "$DSTFS_DEV" "$DSTFS_MNT" 2>>"$WORK/logs/dstfs.log"; then
        DSTFS_WHY="mkfs.ext4 or mount of $DSTFS_DEV failed: $(tail -n 1 "$WORK/logs/dstfs.log")"
        losetup -d "$DSTFS_DEV" 2>/dev/null || true
        DSTFS_DEV=""
        return 1
    fi
}
# dstfs_umount: unmount DSTFS_MNT; a server that has just answered may still be closing
# its files (an rsync daemon's child), so retry for 10 s. Fails if still busy.
dstfs_umount() {
    local _
    for _ in $(seq 1 100); do
        umount "$DSTFS_MNT" 2>/dev/null && return 0
        sleep 0.1
    done
    umount "$DSTFS_MNT" 2>>"$WORK/logs/dstfs.log"
}
# dstfs_fresh: a new, empty file system at DSTFS_MNT (umount, mkfs, mount). Dies if
# something still holds the old one: no server may keep a descriptor into it, or its
# writes would land on a file system that is no longer the destination.
dstfs_fresh() {
    [ -n "$DSTFS_DEV" ] || return 0
    if ! dstfs_umount; then
        local who=""
        ! command -v fuser >/dev/null 2>&1 || who=" by PIDs $(fuser -m "$DSTFS_MNT" 2>/dev/null | tr -s ' ')"
        die "cannot unmount $DSTFS_MNT to make it fresh: still held$who"
    fi
    "${DSTFS_MKFS[@]}" "$DSTFS_DEV" >>"$WORK/logs/dstfs.log" 2>&1 || die "mkfs.ext4 $DSTFS_DEV failed"
    mount -t ext4 "$DSTFS_DEV" "$DSTFS_MNT" 2>>"$WORK/logs/dstfs.log" || die "mount $DSTFS_DEV on $DSTFS_MNT failed"
}
# clear_dest PATH...: make each PATH go away for the next run: a fresh file system
# under the loop device, else discard.
clear_dest() {
    if [ -n "$DSTFS_DEV" ]; then dstfs_fresh; else discard "$@"; fi
}

# discard PATH...: make each PATH go away for the next run where the destinations are
# not on the loop device. A directory is moved into
# $WORK/trash (same file system: a rename), not deleted: on an ext4 without a journal
# (these machines' disks) the inode allocator skips every inode deleted in the last
# 60-300 s, one by one, so a tree of 10,000 files created just after 10,000 were
# deleted pays a scan per file (profiled: 45-60 % of the CPU of rsync and of Ferry
# alike, and runs 1.1-2x slower) that depends on which tool ran before it. The trash
# goes with $WORK at the end.
TRASHED=0
discard() {
    local p
    for p in "$@"; do
        if [ -d "$p" ] && [ ! -L "$p" ]; then
            mkdir -p "$WORK/trash"
            TRASHED=$((TRASHED + 1))
            mv -- "$p" "$WORK/trash/$TRASHED"
        else
            rm -rf -- "$p"
        fi
    done
}

cleanup() {
    local i m
    for ((i = ${#TRACKED[@]} - 1; i >= 0; i--)); do
        [ -z "${TRACKED[$i]:-}" ] || stop_pid "${TRACKED[$i]}"
    done
    # The cluster job's network namespaces and subnet claim (bench/lib/cluster.sh).
    if declare -F cluster_cleanup >/dev/null; then cluster_cleanup; fi
    # Whatever is still mounted (a client that crashed or hung) goes lazily.
    for m in "${MOUNTS[@]}"; do
        if [ -n "$(fstype_at "$m")" ]; then
            warn "$m is still mounted; lazy unmount"
            fusermount3 -u -z "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
        fi
    done
    # The destinations' file system, then its loop device (a lazy unmount if it is
    # still busy: the device then goes when its last user does, autoclear).
    if [ -n "$DSTFS_DEV" ]; then
        if [ -n "$(fstype_at "$DSTFS_MNT")" ] && ! dstfs_umount; then
            warn "$DSTFS_MNT is still busy; lazy unmount"
            umount -l "$DSTFS_MNT" 2>/dev/null || true
        fi
        losetup -d "$DSTFS_DEV" 2>/dev/null || warn "losetup -d $DSTFS_DEV failed"
        DSTFS_DEV=""
    fi
    # --one-file-system: never descend into a mount that could not be removed.
    if [ -n "${WORK:-}" ]; then rm -rf --one-file-system "$WORK"; fi
}

# --- the time budget ---------------------------------------------------------
# SECONDS counts from the start of the measured part (after install and build).
budget_left() { echo $((BUDGET_S - SECONDS)); }
# limit N: print N, cut to what is left of the budget (at least 1).
limit() {
    local left=$((BUDGET_S - SECONDS))
    [ "$left" -ge 1 ] || left=1
    echo $((left < $1 ? left : $1))
}

# --- caches ------------------------------------------------------------------
# CACHE=cold: write back and drop the page cache before each run (needs a writable
# /proc/sys/vm/drop_caches); CACHE=warm: read the run's source into it instead.
# settle SOURCE...: bring the page cache into the run's starting state. The files in
# PRELOAD are read into it last, in both modes: a write job's input, held in memory so
# that what is measured is the writing.
PRELOAD=()
settle() {
    sync
    if [ "$CACHE" = cold ]; then
        echo 3 >/proc/sys/vm/drop_caches
    elif [ $# -gt 0 ]; then
        find "$@" -type f -exec cat {} + >/dev/null
    fi
    [ "${#PRELOAD[@]}" -eq 0 ] || cat -- "${PRELOAD[@]}" >/dev/null
}

# --- results -----------------------------------------------------------------
# record ROW TOOL VALUE / record_fail ROW TOOL REASON / record_skip ROW TOOL WHY
record() { printf '%s\t%s\tv\t%s\n' "$1" "$2" "$3" >>"$WORK/results.tsv"; }
record_fail() {
    printf '%s\t%s\tfail\t%s\n' "$1" "$2" "$(printf '%s' "$3" | tr '\t\n' '  ' | cut -c1-160)" >>"$WORK/results.tsv"
}
record_skip() { printf '%s\t%s\tskip\t%s\n' "$1" "$2" "$3" >>"$WORK/results.tsv"; }
# meta KEY VALUE: a fact about the run for the report header.
meta() { printf '%s\t%s\n' "$1" "$(printf '%s' "$2" | tr '\t\n' '  ')" >>"$WORK/meta.tsv"; }
# rate AMOUNT SECONDS [SCALE]: AMOUNT / SECONDS / SCALE, printed with 3 decimals.
rate() { awk -v a="$1" -v s="$2" -v k="${3:-1}" 'BEGIN { printf "%.3f", a / s / k }'; }
