# shellcheck shell=bash disable=SC2034 # its globals are read by bench/run and the other libs
# The servers of bench/run, each on 127.0.0.1 with its own configuration in $WORK,
# started in the background and tracked by PID (bench/lib/common.sh stops them):
# ferryd, an rsync daemon, a private sshd (for scp and sshfs), iperf3 -s; and the
# two FUSE clients, ferry-mount and sshfs. All export or mount $SRV.
#
# A peer's start-up function returns 1 with the cause in REASON; ferryd's failure
# is fatal.

REASON=""
SSH_OPTS=()

# listening PORT [NETNS]: something listens on 127.0.0.1:PORT (or on any address); in
# network namespace NETNS if given.
listening() {
    local hex in=()
    hex="$(printf '%04X' "$1")"
    [ -z "${2:-}" ] || in=(ip netns exec "$2")
    # shellcheck disable=SC2016 # awk's program, not the shell's
    "${in[@]}" awk -v p=":$hex" 'NR > 1 && $4 == "0A" && substr($2, length($2) - 4) == p { f = 1 } END { exit !f }' /proc/net/tcp
}
# wait_listening PORT PID: up to 10 s, while PID lives.
wait_listening() {
    local _
    for _ in $(seq 1 100); do
        listening "$1" && return 0
        alive "$2" || return 1
        sleep 0.1
    done
    return 1
}
free_port() { python3 "$BENCH_PY" port; }

# --- ferryd --------------------------------------------------------------------
start_ferryd() {
    "$FERRYD" --generate-secret "$WORK/ferry.secret" 2>/dev/null || die "ferryd --generate-secret failed"
    export FERRY_SECRET_FILE="$WORK/ferry.secret" # for rcp and ferry-mount
    # FERRYD_ENC (bench/run): --encryption preferred where ferryd has it, so that each
    # client picks (the crypt job both ways, the other rows off).
    "$FERRYD" --share "bench=$SRV" --secret-file "$WORK/ferry.secret" --listen 127.0.0.1:0 \
        --port-file "$WORK/ferryd.port" --transport tcp "${FERRYD_ENC[@]}" 2>"$WORK/logs/ferryd.log" &
    FERRYD_PID=$!
    track "$FERRYD_PID"
    local _
    for _ in $(seq 1 100); do
        [ -s "$WORK/ferryd.port" ] && break
        alive "$FERRYD_PID" || die "ferryd exited at start"
        sleep 0.1
    done
    [ -s "$WORK/ferryd.port" ] || die "ferryd did not write its port file within 10 s"
    FERRY_ADDR="$(head -n 1 "$WORK/ferryd.port")"
    log "ferryd on $FERRY_ADDR (pid $FERRYD_PID), share bench=$SRV${FERRYD_ENC[*]:+, ${FERRYD_ENC[*]}}"
}

# --- rsync daemon ----------------------------------------------------------------
start_rsyncd() {
    local port pid
    port="$(free_port)"
    cat >"$WORK/rsyncd.conf" <<EOF
pid file = $WORK/rsyncd.pid
use chroot = no
# Without a chroot the daemon would rewrite every symlink it receives (the mixed tree
# has some) to /rsyncd-munged/TARGET; this module is ours alone.
munge symlinks = no
[bench]
    path = $SRV
    read only = no
    uid = $(id -un)
    gid = $(id -gn)
EOF
    rsync --daemon --no-detach --config="$WORK/rsyncd.conf" --address=127.0.0.1 --port="$port" \
        --log-file="$WORK/logs/rsyncd.log" 2>>"$WORK/logs/rsyncd.log" &
    pid=$!
    track "$pid"
    if ! wait_listening "$port" "$pid"; then
        stop_pid "$pid"
        REASON="rsync daemon did not start"
        return 1
    fi
    RSYNC_URL="rsync://127.0.0.1:$port/bench"
    RSYNCD_PID="$pid" # its children's CPU (cutime, cstime) is the daemon side of a copy
    log "rsync daemon on 127.0.0.1:$port (pid $pid), module bench=$SRV"
}

# --- private sshd (scp, sshfs) -------------------------------------------------------
# Its own host key, client key and authorized_keys in $WORK/ssh; /etc/ssh and ~/.ssh
# are not read or written. It lets in only the current user, with that key.
start_sshd() {
    local sshd port pid _
    sshd="$(command -v sshd || echo /usr/sbin/sshd)"
    mkdir -m 700 "$WORK/ssh"
    ssh-keygen -q -t ed25519 -N '' -C ferry-bench-host -f "$WORK/ssh/host_key"
    ssh-keygen -q -t ed25519 -N '' -C ferry-bench-client -f "$WORK/ssh/client_key"
    cp "$WORK/ssh/client_key.pub" "$WORK/ssh/authorized_keys"
    # sshd as root refuses to start without its privilege separation directory
    # (normally made by the ssh service, which need not be running).
    if [ "$(id -u)" -eq 0 ] && [ ! -d /run/sshd ]; then mkdir -m 0755 /run/sshd; fi
    for _ in 1 2 3; do
        port="$(free_port)"
        cat >"$WORK/ssh/sshd_config" <<EOF
ListenAddress 127.0.0.1:$port
HostKey $WORK/ssh/host_key
PidFile $WORK/ssh/sshd.pid
AuthorizedKeysFile $WORK/ssh/authorized_keys
StrictModes no
AllowUsers $(id -un)
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
X11Forwarding no
AllowTcpForwarding no
Subsystem sftp internal-sftp
EOF
        if ! "$sshd" -t -f "$WORK/ssh/sshd_config" 2>"$WORK/logs/sshd.log"; then
            REASON="sshd rejects its configuration: $(tail -n 1 "$WORK/logs/sshd.log")"
            return 1
        fi
        "$sshd" -D -e -f "$WORK/ssh/sshd_config" 2>"$WORK/logs/sshd.log" &
        pid=$!
        track "$pid"
        if wait_listening "$port" "$pid"; then
            SSH_PORT="$port"
            SSH_USER_HOST="$(id -un)@127.0.0.1"
            # Options of both ssh and scp (scp takes the port as -P, ssh as -p).
            SSH_OPTS=(-F /dev/null -i "$WORK/ssh/client_key" -o IdentitiesOnly=yes -o BatchMode=yes
                -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR)
            log "sshd on 127.0.0.1:$port (pid $pid), key in $WORK/ssh"
            return 0
        fi
        # Most likely the port was taken between the check and the bind: try another.
        stop_pid "$pid"
    done
    REASON="the private sshd did not start: $(tail -n 1 "$WORK/logs/sshd.log")"
    return 1
}

# --- iperf3 -s -------------------------------------------------------------------------
start_iperf3() {
    local port pid
    port="$(free_port)"
    iperf3 -s -B 127.0.0.1 -p "$port" >"$WORK/logs/iperf3.log" 2>&1 &
    pid=$!
    track "$pid"
    if ! wait_listening "$port" "$pid"; then
        stop_pid "$pid"
        REASON="iperf3 -s did not start"
        return 1
    fi
    IPERF_PORT="$port"
    log "iperf3 -s on 127.0.0.1:$port (pid $pid)"
}

# --- FUSE clients ------------------------------------------------------------------------
# mount_ferry / unmount_ferry: ferry-mount of share bench on $MNT_FERRY. Failing is fatal;
# on SIGTERM ferry-mount must unmount and exit 0.
mount_ferry() {
    "$FERRY_MOUNT" -f --transport tcp "${MOUNT_ENC[@]}" "$FERRY_ADDR:bench" "$MNT_FERRY" >>"$WORK/logs/ferry-mount.log" 2>&1 &
    FERRY_MOUNT_PID=$!
    track "$FERRY_MOUNT_PID"
    wait_mounted "$MNT_FERRY" fuse.ferry "$FERRY_MOUNT_PID" ||
        die "ferry-mount did not mount $MNT_FERRY as fuse.ferry within 10 s"
}
unmount_ferry() {
    local rc=0
    kill -TERM "$FERRY_MOUNT_PID"
    wait_exit "$FERRY_MOUNT_PID" 10 || die "ferry-mount did not exit within 10 s of SIGTERM"
    wait "$FERRY_MOUNT_PID" || rc=$?
    untrack "$FERRY_MOUNT_PID"
    [ -z "$(fstype_at "$MNT_FERRY")" ] || die "ferry-mount exited (status $rc) on SIGTERM but left $MNT_FERRY mounted"
    [ "$rc" -eq 0 ] || die "ferry-mount unmounted but exited with status $rc on SIGTERM"
}
# mount_sshfs / unmount_sshfs: sshfs of $SRV on $MNT_SSHFS; return 1 with REASON.
mount_sshfs() {
    local o
    o="IdentityFile=$WORK/ssh/client_key,IdentitiesOnly=yes,BatchMode=yes,StrictHostKeyChecking=no"
    o="$o,UserKnownHostsFile=/dev/null,LogLevel=ERROR,port=$SSH_PORT${SSHFS_OPTS:+,$SSHFS_OPTS}"
    sshfs -f -F /dev/null -o "$o" "$SSH_USER_HOST:$SRV" "$MNT_SSHFS" >>"$WORK/logs/sshfs.log" 2>&1 &
    SSHFS_PID=$!
    track "$SSHFS_PID"
    if ! wait_mounted "$MNT_SSHFS" fuse.sshfs "$SSHFS_PID"; then
        REASON="sshfs did not mount: $(tail -n 1 "$WORK/logs/sshfs.log")"
        stop_pid "$SSHFS_PID"
        return 1
    fi
}
unmount_sshfs() {
    fusermount3 -u "$MNT_SSHFS" || { REASON="fusermount3 -u failed"; return 1; }
    wait_exit "$SSHFS_PID" 10 || { REASON="sshfs did not exit after its unmount"; return 1; }
    wait "$SSHFS_PID" 2>/dev/null || true
    untrack "$SSHFS_PID"
}
