#!/usr/bin/env bash
# softroce-vm.sh - run a host command inside a throw-away QEMU VM that has a
# real kernel RDMA stack: a Debian kernel with Soft-RoCE (rdma_rxe).
#
#   scripts/softroce-vm.sh [--kernel KERNEL] [--] COMMAND [ARGS...]
#   scripts/softroce-vm.sh [--kernel KERNEL] --prepare
#
# Examples
#   scripts/softroce-vm.sh ibv_devinfo
#   scripts/softroce-vm.sh --kernel newest-6.12 sh -c \
#       'ib_read_bw -F & sleep 2; ib_read_bw -F $SOFTROCE_IP; wait'
#   cargo build && scripts/softroce-vm.sh ./target/debug/some-test
#
# What it does
#   1. Installs missing Debian packages on the host (apt; idempotent;
#      `apt-get update` at most once, and only when an apt step fails).
#   2. Fills a cache dir ($SOFTROCE_CACHE): the kernel package, busybox-static
#      and, if no qemu-system-x86_64 is on PATH, Debian's qemu are downloaded
#      with `apt-get download` and unpacked (nothing is installed system-wide);
#      a small initramfs (busybox + the needed .ko files + /init) is built.
#   3. Boots the VM (KVM if usable, else TCG software emulation).  The VM's
#      root file system is the host's / (read-only over virtio-9p, with a
#      tmpfs overlay on top: writes inside the VM succeed but are thrown
#      away).  The current directory (plus $SOFTROCE_RW_DIRS) is shared
#      read-write at the same path, so binaries built on the host run
#      unchanged and files they write land on the host.
#   4. In the VM: loads rdma_rxe & co (and fuse), creates a dummy netdev with
#      $SOFTROCE_IP and a Soft-RoCE device rxe0 on it, waits for PORT_ACTIVE.
#   5. Runs COMMAND as root via bash (stdin /dev/null, host cwd, the host's
#      exported environment plus SOFTROCE_IN_VM=1 SOFTROCE_IP SOFTROCE_DEV
#      SOFTROCE_NETDEV, `ulimit -l unlimited`).  Its stdout/stderr are streamed
#      to this script's stdout/stderr.  Then the VM powers off.
#
# Exit status: COMMAND's; 124 if $SOFTROCE_TIMEOUT expired; 125 if the VM or
# the RDMA setup failed (the VM console log is then printed to stderr).
#
# Addressing: the VM has no network card.  rdma_cm (rdma_resolve_addr, rping,
# perftest -R) must use $SOFTROCE_IP - RoCE rdma_cm fails on 127.0.0.1.
# A TCP side channel for plain verbs programs may use either address.
#
# Options
#   --kernel KERNEL  same as SOFTROCE_KERNEL_PKG=KERNEL (the option wins)
#   --prepare        only install prerequisites and build the cache, exit 0
#
# KERNEL (SOFTROCE_KERNEL_PKG)
#   default       linux-image-amd64 (Debian 12: 6.1), resolved to the
#                 concrete package it depends on            [the default]
#   newest-X.Y    the newest available linux-image-X.Y.*+debN-amd64-unsigned
#                 (N = the host's Debian major), e.g. newest-6.12
#   PACKAGE       any Debian kernel image package name
#   Resolution uses the host's apt lists (apt-cache; redone whenever they
#   changed), so a newer kernel is picked up after `apt-get update`; offline,
#   the last resolution is reused.  Each run prints (unless SOFTROCE_QUIET=1)
#   `[softroce] kernel: PACKAGE (UNAME_R)`.
#
# Environment knobs (all optional)
#   SOFTROCE_CACHE        cache dir                (${TMPDIR:-/tmp}/softroce-cache)
#   SOFTROCE_TIMEOUT      max VM lifetime, seconds, boot included (900)
#   SOFTROCE_BOOT_TIMEOUT max seconds until the VM is ready (180; KVM: 60)
#   SOFTROCE_BOOT_TRIES   boots of the VM before giving up when it dies or
#                         hangs before it is ready (3; COMMAND never ran then)
#   SOFTROCE_ACCEL        auto | kvm | tcg (auto: KVM only if /dev/kvm is usable
#                         and the CPU shows vmx/svm; a failed KVM boot falls
#                         back to TCG)
#   SOFTROCE_MEM          guest RAM in MiB         (2048)
#   SOFTROCE_SMP          guest vCPUs              (min(nproc, 4))
#   SOFTROCE_KERNEL_PKG   see KERNEL above         (default)
#   SOFTROCE_IP           VM-internal IPv4 address (10.77.0.1)
#   SOFTROCE_MTU          dummy netdev MTU         (1500 -> RoCE MTU 1024;
#                         9000 -> RoCE MTU 4096, faster)
#   SOFTROCE_DEV / SOFTROCE_NETDEV  device names   (rxe0 / dummy0)
#   SOFTROCE_RW_DIRS      extra host dirs shared read-write, ':'-separated
#   SOFTROCE_QEMU         qemu-system-x86_64 binary to use
#   SOFTROCE_QUIET=1      no "[softroce]" progress lines on stderr
#   SOFTROCE_KEEP_RUN=1   keep the per-run dir (VM console log etc.)
#
# See docs/softroce.md.
set -euo pipefail

SCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

usage() { sed -n '2,/^set -euo/p' "$SCRIPT_PATH" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

PREPARE_ONLY=0
KERNEL_REQ=${SOFTROCE_KERNEL_PKG:-default}
while [ $# -gt 0 ]; do
    case $1 in
        --prepare) PREPARE_ONLY=1; shift ;;
        --kernel) [ $# -ge 2 ] || usage; KERNEL_REQ=$2; shift 2 ;;
        --kernel=*) KERNEL_REQ=${1#--kernel=}; shift ;;
        -h|--help) usage ;;
        --) shift; break ;;
        -*) echo "[softroce] unknown option: $1" >&2; usage ;;
        *) break ;;
    esac
done
[ "$PREPARE_ONLY" = 1 ] || [ $# -gt 0 ] || usage

CACHE=${SOFTROCE_CACHE:-${TMPDIR:-/tmp}/softroce-cache}
TIMEOUT=${SOFTROCE_TIMEOUT:-900}
ACCEL_REQ=${SOFTROCE_ACCEL:-auto}
MEM=${SOFTROCE_MEM:-2048}
NPROC=$(nproc 2>/dev/null || echo 2)
SMP=${SOFTROCE_SMP:-$(( NPROC < 4 ? NPROC : 4 ))}
VM_IP=${SOFTROCE_IP:-10.77.0.1}
VM_PREFIX=24
VM_MTU=${SOFTROCE_MTU:-1500}
RDMA_DEV=${SOFTROCE_DEV:-rxe0}
NETDEV=${SOFTROCE_NETDEV:-dummy0}
QUIET=${SOFTROCE_QUIET:-0}

# Kernel modules preloaded from the initramfs (dependencies are added with
# `modprobe --show-depends`; modules a kernel lacks or has built in are skipped).
# fuse: ferry-mount's tests (a module on 6.1, built into 6.12); without it there is
# no /dev/fuse until something loads it. loop: the data-at-rest tests (tests/tests/
# rot.rs) damage files under a loop-mounted ext4; without it there is no
# /dev/loop-control (ext4 itself is loaded on demand by its mount).
VM_MODULES="virtio_pci 9pnet_virtio 9p overlay dummy crc32_generic rdma_rxe ib_uverbs rdma_ucm ib_umad fuse loop"

# Host packages: RDMA user space (also what the VM runs: its root fs is the
# host's), kmod (depmod/modprobe for the unpacked kernel), iproute2 (`rdma`),
# util-linux (flock), xz-utils (vmlinux extraction, .ko.xz).  Not rdma-core:
# it would drag in udev/systemd upgrades and is not needed.
HOST_PKGS="kmod iproute2 util-linux xz-utils libibverbs1 librdmacm1 ibverbs-providers ibverbs-utils rdmacm-utils perftest"

log()  { [ "$QUIET" = 1 ] || echo "[softroce] $*" >&2; }
die()  { echo "[softroce] ERROR: $*" >&2; exit 125; }
now()  { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.1f", b-a}'; }
T0=$(now)

# ---------------------------------------------------------------- host prereqs
as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo -n "$@"
    else die "need root (or passwordless sudo) to run: $*"; fi
}
APT_UPDATED=0
apt_update_once() {
    [ "$APT_UPDATED" = 1 ] && return 0
    APT_UPDATED=1
    log "apt-get update"
    as_root apt-get update -qq >>"$CACHE/apt.log" 2>&1 || log "apt-get update failed (continuing)"
}
# apt_retry CMD...: run an apt command (output to $CACHE/apt.log); on failure
# run `apt-get update` once and retry; show the log's tail if it still fails.
apt_retry() {
    "$@" >>"$CACHE/apt.log" 2>&1 && return 0
    apt_update_once
    "$@" >>"$CACHE/apt.log" 2>&1 && return 0
    tail -n 20 "$CACHE/apt.log" >&2; return 1
}
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
install_missing() {
    local p missing=()
    for p in "$@"; do have_pkg "$p" || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing Debian packages: ${missing[*]}"
    apt_retry as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" </dev/null \
        || die "apt-get install ${missing[*]} failed"
}
# apt_download DIR PKG...: fetch .debs into DIR without installing them.
apt_download() {
    local dir=$1; shift
    local opts=()
    [ "$(id -u)" = 0 ] && opts=(-o APT::Sandbox::User=root)
    mkdir -p "$dir"
    pushd "$dir" >/dev/null                 # apt-get download writes to cwd
    apt_retry apt-get -qq "${opts[@]}" download "$@" || { popd >/dev/null; return 1; }
    popd >/dev/null
}
deb_file() {   # newest downloaded .deb of package $2 in dir $1
    local f
    f=$(find "$1" -maxdepth 1 -name "$2_*.deb" -printf '%T@ %p\n' 2>/dev/null | sort -rn | head -n1)
    echo "${f#* }"
}

# ---------------------------------------------------------------- cache build
mkdir -p "$CACHE/debs" "$CACHE/kernel"
exec 9>"$CACHE/.lock"
flock 9     # one builder at a time; concurrent runs wait here briefly

# shellcheck disable=SC2086  # word splitting intended
install_missing $HOST_PKGS

# --- kernel: KERNEL_REQ -> concrete package name (from the host's apt lists)
DEB_MAJOR=$(cut -d. -f1 /etc/debian_version 2>/dev/null || true)
case $DEB_MAJOR in ''|*[!0-9]*) DEB_MAJOR=12 ;; esac
resolve_kernel_pkg() {
    local pkg dep series re
    case $KERNEL_REQ in
        default) pkg=linux-image-amd64 ;;
        newest-*)
            series=${KERNEL_REQ#newest-}
            re="^linux-image-${series//./\\.}\\.[0-9]+\\+deb${DEB_MAJOR}-amd64-unsigned\$"
            for pkg in $(apt-cache pkgnames "linux-image-$series." 2>/dev/null \
                         | grep -E "$re" | sort -rV); do
                # a name can linger in pkgnames without an installable version
                if apt-cache show "$pkg" 2>/dev/null | grep -q '^Version:'; then
                    echo "$pkg"; return 0
                fi
            done
            return 1 ;;
        *) pkg=$KERNEL_REQ ;;
    esac
    # follow metapackages: linux-image-amd64 -> linux-image-6.1.0-NN-amd64
    for _ in 1 2 3; do
        dep=$(apt-cache depends --important "$pkg" 2>/dev/null \
              | awk '$1=="Depends:" && $2 ~ /^linux-image-/ {print $2; exit}')
        [ -n "$dep" ] || break
        pkg=$dep
    done
    apt-cache show "$pkg" 2>/dev/null | grep -q '^Version:' || return 1
    echo "$pkg"
}
fetch_kernel() {   # download + unpack package $1 into $CACHE/kernel/$1
    local pkg=$1 deb
    [ -d "$CACHE/kernel/$pkg" ] && return 0
    log "downloading kernel package $pkg"
    apt_download "$CACHE/debs" "$pkg" || return 1
    deb=$(deb_file "$CACHE/debs" "$pkg")
    [ -n "$deb" ] || return 1
    rm -rf "$CACHE/kernel/$pkg.tmp"
    dpkg-deb -x "$deb" "$CACHE/kernel/$pkg.tmp" || return 1
    mv "$CACHE/kernel/$pkg.tmp" "$CACHE/kernel/$pkg"
    rm -f "$deb"        # 60-110 MB, not needed once unpacked
}
case $KERNEL_REQ in
    newest-*) [[ ${KERNEL_REQ#newest-} =~ ^[0-9]+\.[0-9]+$ ]] \
                  || die "bad kernel '$KERNEL_REQ' (want newest-MAJOR.MINOR, e.g. newest-6.12)" ;;
    ''|*/*|*[[:space:]]*) die "bad kernel '$KERNEL_REQ'" ;;
esac
resolved_file="$CACHE/kernel.$KERNEL_REQ.resolved"
# The answer only changes with the apt lists: reuse the last one while they are
# unchanged (apt-cache costs ~0.5 s per call on hosts without a pkgcache.bin).
lists_changed() {
    [ -n "$(find /var/lib/apt/lists -maxdepth 1 -newer "$resolved_file" -print -quit 2>/dev/null)" ]
}
KERNEL_PKG=""
if [ -s "$resolved_file" ] && [ -d "$CACHE/kernel/$(cat "$resolved_file")" ] && ! lists_changed; then
    KERNEL_PKG=$(cat "$resolved_file")
else
    KERNEL_PKG=$(resolve_kernel_pkg) || { apt_update_once; KERNEL_PKG=$(resolve_kernel_pkg); } \
        || KERNEL_PKG=""
fi
if [ -z "$KERNEL_PKG" ]; then
    # offline / no apt lists: reuse the last resolution if it is still cached
    if [ -s "$resolved_file" ] && [ -d "$CACHE/kernel/$(cat "$resolved_file")" ]; then
        KERNEL_PKG=$(cat "$resolved_file")
        log "cannot resolve '$KERNEL_REQ' with apt-cache; reusing cached $KERNEL_PKG"
    else
        case $KERNEL_REQ in
            newest-*) die "no package linux-image-${KERNEL_REQ#newest-}.*+deb${DEB_MAJOR}-amd64-unsigned in the apt lists" ;;
            *) die "cannot resolve kernel '$KERNEL_REQ' to a Debian package (apt-cache)" ;;
        esac
    fi
fi
fetch_kernel "$KERNEL_PKG" || die "cannot download/unpack kernel package $KERNEL_PKG"
echo "$KERNEL_PKG" > "$resolved_file"
KROOT="$CACHE/kernel/$KERNEL_PKG"
[ -d "$KROOT/lib/modules" ] || { [ -d "$KROOT/usr/lib/modules" ] && ln -sfn usr/lib "$KROOT/lib"; }
KVER=$(find "$KROOT/lib/modules/" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | head -n1)
VMLINUZ="$KROOT/boot/vmlinuz-$KVER"
if [ -z "$KVER" ] || [ ! -f "$VMLINUZ" ]; then die "no kernel found in $KROOT"; fi
[ -f "$KROOT/lib/modules/$KVER/modules.dep" ] || depmod -b "$KROOT" "$KVER" \
    || die "depmod failed"
log "kernel: $KERNEL_PKG ($KVER)"

# Uncompressed vmlinux, booted via PVH: skips the (slow under TCG) in-guest
# decompression of the bzImage, ~4 s faster.  Falls back to the bzImage.
extract_vmlinux() {   # $1 = bzImage, $2 = output; like linux/scripts/extract-vmlinux
    local fmt magic off
    local -a cmd
    for fmt in xz gzip zstd; do
        case $fmt in
            xz)   cmd=(xz -dc --single-stream); magic=$'\xfd7zXZ' ;;
            gzip) cmd=(gzip -dc);               magic=$'\x1f\x8b\x08' ;;
            zstd) cmd=(zstd -qdc);              magic=$'\x28\xb5\x2f\xfd' ;;
        esac
        command -v "${cmd[0]}" >/dev/null || continue
        for off in $(LC_ALL=C grep -aboF "$magic" "$1" | head -n 3 | cut -d: -f1); do
            tail -c +$((off + 1)) "$1" | "${cmd[@]}" > "$2" 2>/dev/null || true
            [ "$(head -c 4 "$2" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ] && return 0
        done
    done
    rm -f "$2"; return 1
}
VMLINUX="$KROOT/boot/vmlinux-$KVER"
if [ ! -s "$VMLINUX" ] && [ ! -e "$VMLINUX.none" ]; then
    if grep -q '^CONFIG_PVH=y' "$KROOT/boot/config-$KVER" 2>/dev/null \
       && extract_vmlinux "$VMLINUZ" "$VMLINUX.tmp"; then
        mv "$VMLINUX.tmp" "$VMLINUX"
    else
        touch "$VMLINUX.none"; log "no PVH vmlinux; booting the bzImage"
    fi
fi
KERNEL_IMG=$VMLINUZ
[ -s "$VMLINUX" ] && KERNEL_IMG=$VMLINUX

# --- busybox-static (unpacked; the initramfs userland)
BUSYBOX="$CACHE/busybox/bin/busybox"
if [ ! -x "$BUSYBOX" ]; then
    log "downloading busybox-static"
    apt_download "$CACHE/debs" busybox-static || die "apt-get download busybox-static failed"
    rm -rf "$CACHE/busybox.tmp"
    dpkg-deb -x "$(deb_file "$CACHE/debs" busybox-static)" "$CACHE/busybox.tmp"
    mkdir -p "$CACHE/busybox/bin"
    cp "$CACHE/busybox.tmp/bin/busybox" "$BUSYBOX.tmp"
    mv "$BUSYBOX.tmp" "$BUSYBOX"
    rm -rf "$CACHE/busybox.tmp"
fi

# --- qemu: one on PATH, else Debian's unpacked into the cache.  (Unpacked, not
# installed: on some hosts bookworm's qemu-system-x86 conflicts with a newer
# qemu-utils from backports.)
QEMU_FW=()
QEMU_PKGS="qemu-system-x86 qemu-system-common qemu-system-data seabios"
if [ -n "${SOFTROCE_QEMU:-}" ]; then
    QEMU=$SOFTROCE_QEMU
elif command -v qemu-system-x86_64 >/dev/null; then
    QEMU=$(command -v qemu-system-x86_64)
else
    QEMU="$CACHE/qemu/usr/bin/qemu-system-x86_64"
    if [ ! -x "$QEMU" ]; then
        log "downloading qemu-system-x86 (unpacked into the cache, not installed)"
        # shellcheck disable=SC2086
        apt_download "$CACHE/debs" $QEMU_PKGS || die "apt-get download $QEMU_PKGS failed"
        rm -rf "$CACHE/qemu.tmp"
        for p in $QEMU_PKGS; do
            dpkg-deb -x "$(deb_file "$CACHE/debs" "$p")" "$CACHE/qemu.tmp"
        done
        rm -rf "$CACHE/qemu"; mv "$CACHE/qemu.tmp" "$CACHE/qemu"
    fi
    # Install the shared libraries qemu-system-x86 links against (plain
    # library packages): its Depends minus the qemu/firmware packages.
    if ldd "$QEMU" 2>/dev/null | grep -q 'not found'; then
        deps=$(dpkg-deb -f "$(deb_file "$CACHE/debs" qemu-system-x86)" Depends \
               | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/:any//; s/[[:space:]]//g' \
               | grep -vE '^(qemu-|seabios|ipxe-qemu|$)' || true)
        # shellcheck disable=SC2086
        install_missing $deps
    fi
    QEMU_FW=(-L "$CACHE/qemu/usr/share/qemu" -L "$CACHE/qemu/usr/share/seabios")
    # TCG itself is a loadable module (accel-tcg-x86_64.so, qemu-system-common).
    QEMU_MODULE_DIR=$(dirname "$(find "$CACHE/qemu" -name 'accel-tcg-x86_64.so' | head -n1)")
    export QEMU_MODULE_DIR
fi
if ldd "$QEMU" 2>/dev/null | grep -q 'not found'; then
    die "$QEMU is missing libraries: $(ldd "$QEMU" | grep 'not found' | tr -s ' \n' ' ')"
fi

# --- initramfs: busybox + preloaded modules + /init
# /init runs as PID 1 inside the VM (busybox sh).
read -r -d '' VM_INIT <<'INIT_EOF' || true
#!/bin/busybox sh
# PID 1 of the Soft-RoCE test VM (generated by scripts/softroce-vm.sh).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/null >/dev/console 2>&1
log() { echo "softroce-vm: $*"; }
halt_vm() { sync; poweroff -f; sleep 5; echo o > /proc/sysrq-trigger; }
fail() { log "ERROR: $*"; echo 125 > /rivm/rc 2>/dev/null; halt_vm; }
up() { cut -d' ' -f1 /proc/uptime; }

# 1. kernel modules (order computed on the host by modprobe --show-depends)
while read -r ko args; do
    insmod "$ko" $args 2>/dev/null || grep -q "^$(basename "$ko" .ko | tr - _) " /proc/modules \
        || log "insmod $ko failed"
done < /etc/modules.load
log "modules loaded at $(up)s"

# 2. file systems: host / (read-only 9p) + tmpfs overlay = new root
P9="trans=virtio,version=9p2000.L,msize=512000"
mkdir -p /host /rivm /rw /newroot
mount -t 9p -o "$P9" rivm /rivm || fail "cannot mount the run dir (9p tag rivm)"
. /rivm/vm.conf
mount -t 9p -o "$P9,cache=loose,ro" hostroot /host || fail "cannot mount host root (9p)"
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
if ! mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot; then
    log "overlayfs failed; using the read-only host root with tmpfs on /tmp"
    mount --bind /host /newroot
    mount -t tmpfs tmpfs /newroot/tmp
    mount -t tmpfs tmpfs /newroot/var/tmp
fi
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs -o mode=0755 tmpfs /newroot/run
mkdir -p /newroot/run/softroce
mount --bind /rivm /newroot/run/softroce
# The unpacked kernel's module tree (in the host cache, visible through 9p)
# becomes /lib/modules/$KVER, so `modprobe` and module auto-loading work.
KVER=$(uname -r)
if [ -d "/host$KMOD_DIR" ]; then
    mkdir -p "/newroot/lib/modules/$KVER" 2>/dev/null \
        && mount --bind "/host$KMOD_DIR" "/newroot/lib/modules/$KVER"
    printf '#!/bin/sh\nexec chroot /newroot /sbin/modprobe "$@"\n' > /bin/softroce-modprobe
    chmod +x /bin/softroce-modprobe
    echo /bin/softroce-modprobe > /proc/sys/kernel/modprobe
fi
# Read-write shares (host cwd etc.) at the same paths as on the host.
while IFS='	' read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "/newroot$path" 2>/dev/null
    mount -t 9p -o "$P9,cache=mmap" "$tag" "/newroot$path" || fail "cannot mount $path (9p $tag)"
done < /rivm/mounts.list
echo softroce-vm > /proc/sys/kernel/hostname
log "file systems mounted at $(up)s"

# 3. network (busybox ip) + Soft-RoCE device (the host's iproute2 `rdma`)
C="chroot /newroot /usr/bin/env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ip link set lo up
ip link add "$NETDEV" type dummy || fail "cannot create $NETDEV"
ip link set "$NETDEV" mtu "$MTU"
ip addr add "$IP/$PREFIX" dev "$NETDEV"
ip link set "$NETDEV" up
$C rdma link add "$RDMA_DEV" type rxe netdev "$NETDEV" || fail "rdma link add $RDMA_DEV failed"
i=0
until grep -q ACTIVE "/sys/class/infiniband/$RDMA_DEV/ports/1/state" 2>/dev/null; do
    i=$((i+1)); [ $i -lt 100 ] || fail "$RDMA_DEV port did not become ACTIVE"; sleep 0.1
done
log "ready at $(up)s: $RDMA_DEV on $NETDEV $IP (kernel $KVER)"
echo "SOFTROCE-READY"

# 4. run the command; stdout/stderr go through FIFOs + cat to ttyS1/ttyS2
#    (so the command sees pipes, not a tty); ttyS* in raw mode.
stty -F /dev/ttyS1 raw -echo; stty -F /dev/ttyS2 raw -echo
mkfifo /o /e
cat /o > /dev/ttyS1 & c1=$!
cat /e > /dev/ttyS2 & c2=$!
$C /bin/bash /run/softroce/cmd.sh </dev/null >/o 2>/e
rc=$?
# kill what the command left behind (background servers...) so the FIFOs
# close and cat can flush; then record the status and power off.
for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [ "$pid" = 1 ] || [ "$pid" = "$c1" ] || [ "$pid" = "$c2" ] || kill -9 "$pid" 2>/dev/null
done
wait $c1 $c2
echo "$rc" > /rivm/rc
log "command exited with $rc at $(up)s"
halt_vm
INIT_EOF

INITRD_KEY=$( { echo "$VM_INIT"; echo "$KVER $VM_MODULES"; sha256sum "$BUSYBOX"; } \
              | sha256sum | cut -c1-16)
INITRD="$CACHE/initrd-$KVER-$INITRD_KEY.cpio.gz"
if [ ! -s "$INITRD" ]; then
    log "building initramfs for $KVER"
    B="$CACHE/initrd.build"
    rm -rf "$B"; mkdir -p "$B"/{bin,dev,proc,sys,etc,tmp}
    cp "$BUSYBOX" "$B/bin/busybox"
    printf '%s\n' "$VM_INIT" > "$B/init"; chmod 755 "$B/init"
    : > "$B/etc/modules.load"
    for m in $VM_MODULES; do
        modprobe -C /dev/null -d "$KROOT" -S "$KVER" --show-depends "$m" 2>/dev/null \
            | awk '$1=="insmod"{print $2}' > "$B/deps" \
            || { log "module $m not available in $KVER (skipped)"; continue; }
        while read -r path; do
            rel=${path#"$KROOT"}; rel=/lib/modules/${rel#*/lib/modules/}
            case $rel in   # the initramfs holds plain .ko files (busybox insmod)
                *.ko.xz)  dst=${rel%.xz};  dec=("$BUSYBOX" xzcat) ;;
                *.ko.gz)  dst=${rel%.gz};  dec=(gzip -dc) ;;
                *.ko.zst) dst=${rel%.zst}; dec=(zstd -qdc) ;;
                *)        dst=$rel;        dec=(cat) ;;
            esac
            grep -qxF "$dst" "$B/etc/modules.load" 2>/dev/null && continue
            mkdir -p "$B$(dirname "$dst")"
            "${dec[@]}" "$path" > "$B$dst"
            echo "$dst" >> "$B/etc/modules.load"
        done < "$B/deps"
    done
    sed -i 's|/dummy\.ko$|/dummy.ko numdummies=0|' "$B/etc/modules.load"
    rm -f "$B/deps"
    ( cd "$B" && find . | "$BUSYBOX" cpio -o -H newc 2>/dev/null | gzip -1 ) > "$INITRD.tmp"
    mv "$INITRD.tmp" "$INITRD"
    rm -rf "$B"
fi
flock -u 9; exec 9>&-

if [ "$PREPARE_ONLY" = 1 ]; then
    log "prepared in $(elapsed "$T0" "$(now)")s: qemu $QEMU, cache $CACHE"
    exit 0
fi

# ---------------------------------------------------------------- per-run dir
RUN=$(mktemp -d "${TMPDIR:-/tmp}/softroce-run.XXXXXX")
QPID=""; CAT_PIDS=()
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    if [ -n "$QPID" ]; then kill "$QPID" 2>/dev/null || true; fi
    for p in "${CAT_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    if [ "${SOFTROCE_KEEP_RUN:-0}" = 1 ]; then log "run dir kept: $RUN"; else rm -rf "$RUN"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# vm.conf is sourced by /init
printf 'IP=%q\nPREFIX=%q\nMTU=%q\nRDMA_DEV=%q\nNETDEV=%q\nKMOD_DIR=%q\n' \
    "$VM_IP" "$VM_PREFIX" "$VM_MTU" "$RDMA_DEV" "$NETDEV" "$KROOT/lib/modules/$KVER" \
    > "$RUN/vm.conf"

# Read-write shares: cwd + $SOFTROCE_RW_DIRS ("/" is skipped: the root is
# already visible, read-only, through the overlay).
RW_DIRS=("$PWD")
if [ -n "${SOFTROCE_RW_DIRS:-}" ]; then
    IFS=: read -r -a extra <<< "$SOFTROCE_RW_DIRS"
    for d in "${extra[@]}"; do
        [ -n "$d" ] || continue
        [ -d "$d" ] || die "SOFTROCE_RW_DIRS: not a directory: $d"
        RW_DIRS+=("$(cd "$d" && pwd)")
    done
fi
SHARE_ARGS=(-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
            -virtfs "local,path=$RUN,mount_tag=rivm,security_model=none")
: > "$RUN/mounts.list"
n=0
for d in "${RW_DIRS[@]}"; do
    [ "$d" = / ] && continue
    case $d in *,*) die "directory names with ',' cannot be shared: $d" ;; esac
    SHARE_ARGS+=(-virtfs "local,path=$d,mount_tag=rw$n,security_model=none,multidevs=remap")
    printf 'rw%d\t%s\n' "$n" "$d" >> "$RUN/mounts.list"
    n=$((n+1))
done

# cmd.sh: host environment + cd + the command, quoted with printf %q.
{
    export -p | grep -vE '^declare -[a-zA-Z-]*x (PWD|OLDPWD|SHLVL|_|BASH[A-Z_]*|SHELLOPTS|EUID|UID|PPID|XDG_RUNTIME_DIR|DBUS_SESSION_BUS_ADDRESS|SSH_AUTH_SOCK|DISPLAY|WAYLAND_DISPLAY)(=|$)' || true
    printf 'export SOFTROCE_IN_VM=1 SOFTROCE_IP=%q SOFTROCE_DEV=%q SOFTROCE_NETDEV=%q\n' \
        "$VM_IP" "$RDMA_DEV" "$NETDEV"
    echo 'ulimit -l unlimited 2>/dev/null'
    printf 'cd -- %q || exit 125\n' "$PWD"
    printf 'exec'; printf ' %q' "$@"; echo
} > "$RUN/cmd.sh"

# ---------------------------------------------------------------- boot + run
kvm_usable() {
    [ -r /dev/kvm ] && [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo
}
case $ACCEL_REQ in
    kvm) ACCELS=(kvm) ;;
    tcg) ACCELS=(tcg) ;;
    auto) if kvm_usable; then ACCELS=(kvm tcg); else ACCELS=(tcg); fi ;;
    *) die "SOFTROCE_ACCEL must be auto, kvm or tcg" ;;
esac
# A guest kernel can die while it boots for reasons that are not ours: under
# multi-threaded TCG, Debian's 6.12 once panicked ~1.2 s into boot (RIP in
# sched_clock_cpu, on a just-patched static-branch NOP) and booted cleanly 12 times
# in a row after. Such a boot ran none of COMMAND, so it is retried, with every
# failed boot's console tail printed. Once the VM is ready nothing is retried:
# a panic or a failure from then on is the result.
BOOT_TRIES=${SOFTROCE_BOOT_TRIES:-3}
case $BOOT_TRIES in ''|*[!0-9]*|0) die "SOFTROCE_BOOT_TRIES must be a positive integer" ;; esac
last=${ACCELS[${#ACCELS[@]}-1]}
for ((i = 1; i < BOOT_TRIES; i++)); do ACCELS+=("$last"); done

T_START=$(now)
STATUS=125
BOOTS=0
for ACCEL in "${ACCELS[@]}"; do
    if [ "$ACCEL" = kvm ]; then
        ACCEL_ARGS=(-accel kvm -cpu host)
        APPEND_EXTRA=""
        BOOT_TIMEOUT=${SOFTROCE_BOOT_TIMEOUT:-60}
    else
        # shellcheck disable=SC2054  # the comma is part of the -accel value
        ACCEL_ARGS=(-accel tcg,thread=multi -cpu max)
        # the TSC is monotonic under TCG; avoids slow HPET reads
        APPEND_EXTRA="tsc=reliable clocksource=tsc"
        BOOT_TIMEOUT=${SOFTROCE_BOOT_TIMEOUT:-180}
    fi
    rm -f "$RUN/rc" "$RUN/console.log" "$RUN/out.fifo" "$RUN/err.fifo"
    mkfifo "$RUN/out.fifo" "$RUN/err.fifo"
    cat "$RUN/out.fifo" &  CAT_PIDS=($!)
    cat "$RUN/err.fifo" >&2 & CAT_PIDS+=($!)
    T_BOOT=$(now)
    remaining=$(awk -v t="$TIMEOUT" -v a="$T_START" -v b="$T_BOOT" 'BEGIN{r=int(t-(b-a)+0.5); print (r<1?1:r)}')
    log "booting $KVER with $ACCEL (${SMP} vCPU, ${MEM} MiB), timeout ${remaining}s"
    timeout -k 5 "$remaining" "$QEMU" "${QEMU_FW[@]}" \
        -nodefaults -no-user-config -display none -no-reboot \
        -machine pc "${ACCEL_ARGS[@]}" -smp "$SMP" -m "$MEM" \
        -kernel "$KERNEL_IMG" -initrd "$INITRD" \
        -append "console=ttyS0 panic=-1 quiet loglevel=4 mitigations=off $APPEND_EXTRA" \
        -chardev "file,id=con,path=$RUN/console.log" -serial chardev:con \
        -chardev "file,id=out,path=$RUN/out.fifo" -serial chardev:out \
        -chardev "file,id=err,path=$RUN/err.fifo" -serial chardev:err \
        "${SHARE_ARGS[@]}" -nic none \
        </dev/null >"$RUN/qemu.log" 2>&1 &
    QPID=$!
    READY=0
    while kill -0 "$QPID" 2>/dev/null; do
        if [ "$READY" = 0 ]; then
            if grep -q SOFTROCE-READY "$RUN/console.log" 2>/dev/null; then
                READY=1
                log "VM ready after $(elapsed "$T_BOOT" "$(now)")s"
            elif [ "$(elapsed "$T_BOOT" "$(now)" | cut -d. -f1)" -ge "$BOOT_TIMEOUT" ]; then
                log "VM did not become ready within ${BOOT_TIMEOUT}s ($ACCEL)"
                kill "$QPID" 2>/dev/null || true
            fi
        fi
        sleep 0.2
    done
    QSTATUS=0; wait "$QPID" || QSTATUS=$?
    QPID=""
    # Release a cat still blocked in open() (qemu died before opening its FIFO).
    for f in "$RUN/out.fifo" "$RUN/err.fifo"; do exec 8<>"$f"; exec 8>&-; done
    wait "${CAT_PIDS[@]}" 2>/dev/null || true
    CAT_PIDS=()
    if [ -s "$RUN/rc" ]; then
        STATUS=$(cat "$RUN/rc")
    elif [ "$QSTATUS" = 124 ] || [ "$QSTATUS" = 137 ]; then
        STATUS=124
        echo "[softroce] TIMEOUT: VM killed after ${TIMEOUT}s (SOFTROCE_TIMEOUT)" >&2
    else
        STATUS=125
    fi
    BOOTS=$((BOOTS + 1))
    if [ "$STATUS" = 125 ] || [ "$STATUS" = 124 ]; then
        { echo "[softroce] --- qemu output ---"; cat "$RUN/qemu.log"
          echo "[softroce] --- VM console (last 40 lines) ---"; tail -n 40 "$RUN/console.log"
        } >&2 2>/dev/null || true
        # Boot again only if this boot never got ready, did not use up
        # SOFTROCE_TIMEOUT (124) and a try is left.
        if [ "$READY" = 0 ] && [ "$BOOTS" -lt "${#ACCELS[@]}" ] && [ "$STATUS" = 125 ]; then
            next=${ACCELS[$BOOTS]}
            log "boot $BOOTS ($ACCEL) failed before the VM was ready; booting again with $next"
            continue
        fi
    fi
    break
done
log "exit status $STATUS; total $(elapsed "$T0" "$(now)")s, VM $(elapsed "$T_START" "$(now)")s (accel $ACCEL)"
exit "$STATUS"
