# shellcheck shell=bash disable=SC2034 # its globals are read by bench/lib/jobs.sh
# The cluster job's cluster (sourced by bench/run): a real etcd in the root network
# namespace and N ferryd storage nodes, node K in namespace ferrybench-PID-nK, joined
# to the root namespace by a veth pair (root side 10.A.K.1/24, node side 10.A.K.2/24),
# the pair shaped at both ends with tc tbf to CLUSTER_RATE_MBS, the node's store under
# $WORK/cluster/nodeK on the local disk. The same layout as the tests' Cluster
# (tests/src/cluster.rs, netns.rs): A is claimed by an exclusive flock of
# /run/ferry-test-nets/10.A.lock on an A no interface uses, so that a bench and
# concurrent test clusters never share a subnet.
#
# cluster_up N REPLICAS / cluster_down bring one cluster up (nodes live in etcd, share
# bench created) and down; cluster_cleanup (called by cleanup in common.sh, also on
# failure) stops whatever is left and deletes every namespace made. Every process is
# tracked by PID (common.sh). A start-up failure returns 1 with the cause in REASON.

CLUSTER_A="" CLUSTER_LOCK_FD="" CLUSTER_PORT="" CLUSTER_N=0
CLUSTER_NS=()         # namespaces made (deleted by cluster_net_down)
declare -A CLUSTER_PID=() # node K -> ferryd's PID
CLUSTER_ETCD_PID=""
# The port every node listens on inside its namespace, and its lease.
CLUSTER_NODE_PORT=7447
CLUSTER_LEASE_TTL=3

# cluster_claim: claim a free 10.A.0.0/16 (A in 100..250) into CLUSTER_A, the lock
# held on fd CLUSTER_LOCK_FD until cluster_release.
cluster_claim() {
    local i a fd span=151
    mkdir -p /run/ferry-test-nets || { REASON="cannot create /run/ferry-test-nets"; return 1; }
    for ((i = 0; i < span; i++)); do
        a=$((100 + ($$ + i) % span))
        exec {fd}>>"/run/ferry-test-nets/10.$a.lock"
        if flock -n "$fd" && ! ip -o -4 addr show | grep -q " 10\.$a\."; then
            CLUSTER_A="$a" CLUSTER_LOCK_FD="$fd"
            return 0
        fi
        exec {fd}>&-
    done
    REASON="no free 10.A.0.0/16 (A in 100..250): all locked in /run/ferry-test-nets or in use"
    return 1
}
cluster_release() {
    [ -z "$CLUSTER_LOCK_FD" ] || exec {CLUSTER_LOCK_FD}>&-
    CLUSTER_LOCK_FD="" CLUSTER_A=""
}

# cluster_host_if K / cluster_ns K: names of node K's root-side interface (15 bytes at
# most) and namespace.
cluster_host_if() { printf 'fb%xh%s' "$$" "$1"; }
cluster_ns() { echo "ferrybench-$$-n$1"; }

# cluster_net_up N: N namespaces with their veth pairs, forwarding on the root sides
# (nodes reach each other through the root namespace), each link shaped to
# CLUSTER_RATE_MBS (MB/s, 10^6 bytes) at both ends: burst 2 ms at the rate (at least
# 64 KiB), queue 50 ms, as tests/src/netns.rs.
cluster_net_up() {
    local k ns h i bps burst tbf
    bps=$((CLUSTER_RATE_MBS * 1000000))
    burst=$((bps / 500))
    [ "$burst" -ge 65536 ] || burst=65536
    tbf=(tbf rate "$((bps * 8))bit" burst "$burst" latency 50ms)
    for k in $(seq 1 "$1"); do
        ns="$(cluster_ns "$k")" h="$(cluster_host_if "$k")" i="$(printf 'fb%xn%s' "$$" "$k")"
        ip netns add "$ns" 2>>"$WORK/logs/cluster-net.log" || { REASON="ip netns add $ns failed"; return 1; }
        CLUSTER_NS+=("$ns")
        if ! {
            ip link add "$h" type veth peer name "$i" netns "$ns" &&
                ip addr add "10.$CLUSTER_A.$k.1/24" dev "$h" && ip link set "$h" up &&
                echo 1 >"/proc/sys/net/ipv4/conf/$h/forwarding" &&
                ip -n "$ns" addr add "10.$CLUSTER_A.$k.2/24" dev "$i" && ip -n "$ns" link set "$i" up &&
                ip -n "$ns" link set lo up &&
                ip -n "$ns" route add "10.$CLUSTER_A.0.0/16" via "10.$CLUSTER_A.$k.1" &&
                tc qdisc replace dev "$h" root "${tbf[@]}" &&
                ip netns exec "$ns" tc qdisc replace dev "$i" root "${tbf[@]}"
        } 2>>"$WORK/logs/cluster-net.log"; then
            REASON="node $k's veth pair or tc failed: $(tail -n 1 "$WORK/logs/cluster-net.log")"
            return 1
        fi
    done
}
# cluster_net_down: delete every namespace made (the root side first: the pair then goes
# at once).
cluster_net_down() {
    local i ns
    for i in "${!CLUSTER_NS[@]}"; do
        ns="${CLUSTER_NS[$i]}"
        ip link del "$(cluster_host_if "${ns##*-n}")" 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || warn "cannot delete network namespace $ns"
        unset 'CLUSTER_NS[i]'
    done
}

# etcd_healthy PORT: GET /health on 127.0.0.1:PORT answers "health":"true" (2 s).
etcd_healthy() {
    # shellcheck disable=SC2016 # expanded by that bash
    timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" && printf "GET /health HTTP/1.0\r\n\r\n" >&3 && cat <&3' \
        etcd-health "$1" 2>/dev/null | tr -d ' ' | grep -q '"health":"true"'
}

# cluster_etcd_up N: a one-member etcd, data in $WORK/cluster/etcd, clients on
# 127.0.0.1:CLUSTER_PORT and on the root side of each of the N veth pairs.
cluster_etcd_up() {
    local try peer urls k _
    for try in 1 2 3; do
        CLUSTER_PORT="$(free_port)" peer="$(free_port)"
        [ "$CLUSTER_PORT" != "$peer" ] || continue
        urls="http://127.0.0.1:$CLUSTER_PORT"
        for k in $(seq 1 "$1"); do urls="$urls,http://10.$CLUSTER_A.$k.1:$CLUSTER_PORT"; done
        rm -rf "$WORK/cluster/etcd"
        etcd --name "ferrybench-$$" --data-dir "$WORK/cluster/etcd" \
            --listen-client-urls "$urls" --advertise-client-urls "http://127.0.0.1:$CLUSTER_PORT" \
            --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
            --initial-cluster "ferrybench-$$=http://127.0.0.1:$peer" --initial-cluster-token "ferrybench-$$" \
            --initial-cluster-state new --logger zap --log-outputs stderr --log-level warn \
            {CLUSTER_LOCK_FD}>&- >>"$WORK/logs/etcd.log" 2>&1 &
        CLUSTER_ETCD_PID=$!
        track "$CLUSTER_ETCD_PID"
        for _ in $(seq 1 200); do
            etcd_healthy "$CLUSTER_PORT" && return 0
            alive "$CLUSTER_ETCD_PID" || break
            sleep 0.1
        done
        stop_pid "$CLUSTER_ETCD_PID"
        CLUSTER_ETCD_PID=""
        # Only a lost race for the ports is worth another try.
        tail -n 20 "$WORK/logs/etcd.log" | grep -q 'address already in use' || break
    done
    REASON="etcd did not become healthy: $(tail -n 1 "$WORK/logs/etcd.log")"
    return 1
}

# cluster_node_up K: ferryd in node K's namespace (the contract of ferryd's cluster
# mode: --cluster URL --node-id nK --store DIR --listen ADDR --port-file FILE
# --lease-ttl S), until it writes its port file (10 s).
cluster_node_up() {
    local k="$1" ns pid port_file="$WORK/cluster/node$1.port" _
    ns="$(cluster_ns "$k")"
    mkdir -p "$WORK/cluster/node$k"
    rm -f "$port_file"
    ip netns exec "$ns" "$FERRYD" --cluster "http://10.$CLUSTER_A.$k.1:$CLUSTER_PORT" --node-id "n$k" \
        --store "$WORK/cluster/node$k" --listen "10.$CLUSTER_A.$k.2:$CLUSTER_NODE_PORT" \
        --port-file "$port_file" --lease-ttl "$CLUSTER_LEASE_TTL" --secret-file "$WORK/ferry.secret" \
        --transport tcp "${FERRYD_ENC[@]}" {CLUSTER_LOCK_FD}>&- 2>>"$WORK/logs/cluster-node$k.log" &
    pid=$!
    track "$pid"
    CLUSTER_PID[$k]="$pid"
    for _ in $(seq 1 100); do
        [ -s "$port_file" ] && return 0
        alive "$pid" || break
        sleep 0.1
    done
    REASON="node n$k's ferryd did not write its port file: $(tail -n 1 "$WORK/logs/cluster-node$k.log")"
    return 1
}

# cluster_live: how many nodes ferry cluster status --json reports live (empty if it
# fails).
cluster_live() {
    "$FERRY" cluster status --etcd "127.0.0.1:$CLUSTER_PORT" --json >"$WORK/cluster-status.json" 2>>"$WORK/logs/ferry.log" &&
        python3 "$BENCH_PY" live "$WORK/cluster-status.json"
}

# cluster_up N REPLICAS: claim a subnet, etcd, N nodes, wait (20 s) until all N are live,
# ferry cluster add-share bench --replicas REPLICAS. Returns 1 with REASON (cluster_down
# or the EXIT trap cleans up what was started).
cluster_up() {
    local n="$1" k _
    CLUSTER_N="$n"
    mkdir -p "$WORK/cluster"
    cluster_claim || return 1
    cluster_net_up "$n" || return 1
    cluster_etcd_up "$n" || return 1
    for k in $(seq 1 "$n"); do cluster_node_up "$k" || return 1; done
    for _ in $(seq 1 100); do
        [ "$(cluster_live)" != "$n" ] || break
        sleep 0.2
    done
    [ "$(cluster_live)" = "$n" ] || { REASON="ferry cluster status did not report $n live nodes within 20 s"; return 1; }
    if ! timeout -s KILL 30 "$FERRY" cluster add-share --etcd "127.0.0.1:$CLUSTER_PORT" bench --replicas "$2" \
        >>"$WORK/logs/ferry.log" 2>&1; then
        REASON="ferry cluster add-share failed: $(tail -n 1 "$WORK/logs/ferry.log")"
        return 1
    fi
    log "cluster: etcd 127.0.0.1:$CLUSTER_PORT, $n nodes on 10.$CLUSTER_A.K.2:$CLUSTER_NODE_PORT, links ${CLUSTER_RATE_MBS} MB/s, share bench (replicas $2)"
}

# cluster_down: stop the nodes and etcd, delete the namespaces and the stores, release
# the subnet.
cluster_down() {
    local k
    # Every node gets SIGTERM at once: they wind down together, not one after another.
    for k in "${!CLUSTER_PID[@]}"; do kill -TERM "${CLUSTER_PID[$k]}" 2>/dev/null || true; done
    for k in "${!CLUSTER_PID[@]}"; do
        stop_pid "${CLUSTER_PID[$k]}"
        unset 'CLUSTER_PID[k]'
    done
    [ -z "$CLUSTER_ETCD_PID" ] || stop_pid "$CLUSTER_ETCD_PID"
    CLUSTER_ETCD_PID="" CLUSTER_N=0
    cluster_net_down
    cluster_release
    rm -rf "$WORK/cluster"
}
# cluster_cleanup: at exit (common.sh cleanup, after the tracked processes are stopped).
cluster_cleanup() {
    cluster_net_down
    cluster_release
}
