#!/usr/bin/env bash
# Run a command in the Soft-RoCE VM (scripts/softroce-vm.sh) on each kernel.
#
#   scripts/test-rdma.sh [--kernels K1,K2,...] -- CMD [ARGS...]
#
# Kernels are what softroce-vm.sh --kernel takes (default, newest-X.Y or a
# Debian kernel package name); the default list is "default,newest-6.12"
# (Debian 12's 6.1 and the newest 6.12 in the apt lists).
#
# First prepares every kernel (install, download, unpack; a download failure
# is reported here, before anything runs), then runs CMD once per kernel,
# each under a `=== [rdma] ...` header, and ends with one summary line per
# kernel: kernel package, uname -r, exit status, seconds.  Exits 0 when CMD
# passed on every kernel, 1 otherwise (2: usage).  The softroce-vm.sh
# environment knobs (SOFTROCE_TIMEOUT, SOFTROCE_MTU, ...) apply to every run.
#
#   scripts/test-rdma.sh -- ibv_devinfo
#   scripts/test-rdma.sh --kernels newest-6.12 -- sh -c \
#       'ib_read_bw -F & sleep 2; ib_read_bw -F $SOFTROCE_IP; wait'
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VM="$ROOT/scripts/softroce-vm.sh"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

KERNELS="default,newest-6.12"
while [ $# -gt 0 ]; do
    case $1 in
        --kernels) [ $# -ge 2 ] || usage; KERNELS=$2; shift 2 ;;
        --kernels=*) KERNELS=${1#--kernels=}; shift ;;
        -h|--help) usage ;;
        --) shift; break ;;
        *) echo "[rdma] unexpected argument: $1 (the command goes after --)" >&2; usage ;;
    esac
done
[ $# -gt 0 ] || usage
IFS=, read -r -a KLIST <<< "$KERNELS"
[ "${#KLIST[@]}" -gt 0 ] || usage

LOGDIR=$(mktemp -d "${TMPDIR:-/tmp}/test-rdma.XXXXXX")
trap 'rm -rf "$LOGDIR"' EXIT

# --- 1. prepare every kernel (sequentially; the cache is shared) ----------------
declare -A PKG KVER RC SECS NOTE
prep_failed=0
for k in "${KLIST[@]}"; do
    log="$LOGDIR/prepare-${k//\//_}.log"
    printf '=== [rdma] prepare kernel %s\n' "$k" >&2
    if SOFTROCE_QUIET=0 "$VM" --kernel "$k" --prepare 2>"$log"; then
        line=$(sed -n 's/^\[softroce\] kernel: //p' "$log" | tail -n1)   # "PKG (KVER)"
        PKG[$k]=${line%% (*}
        KVER[$k]=${line##* (}; KVER[$k]=${KVER[$k]%)}
        printf '    %s (%s)\n' "${PKG[$k]}" "${KVER[$k]}" >&2
    else
        rc=$?
        prep_failed=1
        PKG[$k]="?"; KVER[$k]="?"; RC[$k]=$rc; SECS[$k]=0; NOTE[$k]=" (prepare failed)"
        printf '=== [rdma] ERROR: preparing kernel %s failed (exit %d):\n' "$k" "$rc" >&2
        sed 's/^/    /' "$log" >&2
    fi
done
if [ "$prep_failed" = 1 ]; then
    printf '=== [rdma] some kernels could not be prepared (see above); running the others\n' >&2
fi

# --- 2. run CMD on each prepared kernel --------------------------------------
for k in "${KLIST[@]}"; do
    [ -z "${RC[$k]:-}" ] || continue
    printf '\n=== [rdma] kernel %s: %s (%s)\n' "$k" "${PKG[$k]}" "${KVER[$k]}" >&2
    t0=$(date +%s.%N)
    rc=0
    "$VM" --kernel "$k" "$@" || rc=$?
    t1=$(date +%s.%N)
    RC[$k]=$rc
    SECS[$k]=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
    printf '=== [rdma] kernel %s: exit %d after %ss\n' "$k" "$rc" "${SECS[$k]}" >&2
done

# --- 3. summary --------------------------------------------------------------
failed=0
printf '\n=== [rdma] summary: %s\n' "$*" >&2
for k in "${KLIST[@]}"; do
    if [ "${RC[$k]}" = 0 ]; then verdict=ok; else verdict=FAILED; failed=1; fi
    printf '    %-6s %-12s %-44s %-24s rc=%-3s %6ss%s\n' "$verdict" "$k" "${PKG[$k]}" "${KVER[$k]}" \
        "${RC[$k]}" "${SECS[$k]}" "${NOTE[$k]:-}" >&2
done
exit "$failed"
