# shellcheck shell=bash
# Debian package helpers shared by scripts/setup.sh and bench/run (sourced, not run).
#
# The caller defines log MESSAGE and die MESSAGE. Nothing is installed that is
# already there; apt-get update runs at most once per process.
#
#   pkg_missing PKG...      print the packages of PKG... that are not installed
#   apt_install PKG...      apt-get install them (as root, or through sudo)

# as_root CMD...: run CMD as root: directly when we are root, through sudo when it exists.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root to run '$*' (not root, and sudo is not installed)"
    fi
}

APT_UPDATED=0
apt_install() {
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install manually: $*"
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "apt-get update"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        APT_UPDATED=1
    fi
    log "apt-get install $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

# is_installed PKG: dpkg knows PKG as installed.
is_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = "install ok installed" ]
}

pkg_missing() {
    local pkg
    for pkg in "$@"; do
        is_installed "$pkg" || echo "$pkg"
    done
}
