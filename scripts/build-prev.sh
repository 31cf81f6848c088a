#!/usr/bin/env bash
# Builds the previous release's `ferryd` and `rcp` (debug) from git history, for the
# backward-compatibility tests (tests/tests/compat.rs, docs/testing.md).
#
#   scripts/build-prev.sh                 # prints the bin dir as its last line
#   FERRY_PREV_BIN_DIR="$(scripts/build-prev.sh | tail -n 1)" \
#       cargo test -p ferry-tests --test compat
#
# The release's tree is exported with `git archive` into target/prev/src (no
# worktree, nothing else in the clone is touched) and built there with its own
# Cargo.lock, offline, into this clone's own target dir ($CARGO_TARGET_DIR or
# target/), so the dependencies both releases share at the same versions and features
# are compiled once; the binaries are copied to target/prev/bin with a stamp naming
# the commit, and the current build's target/debug/ferryd and rcp are put back as they
# were. A second run finds the stamp and builds nothing. FERRY_PREV_DIR moves
# target/prev elsewhere.
#
# Needs the commit in this clone's history: a shallow clone lacks it (see the
# message below). Everything but the bin dir goes to stderr.
set -euo pipefail

# The previous release: the last commit before BLAKE3 chunk hashes (issue 22), whose
# on-disk formats (journals of partial copies, the manifest store, backup snapshots)
# the compat tests check the current code against.
PREV_RELEASE=59c4d76

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PREV_DIR="${FERRY_PREV_DIR:-$ROOT/target/prev}"
SRC="$PREV_DIR/src"
BIN="$PREV_DIR/bin"
STAMP="$BIN/.built-from"
BINS=(ferryd rcp)

say() { printf '[build-prev] %s\n' "$*" >&2; }

if ! commit="$(git rev-parse --verify --quiet "$PREV_RELEASE^{commit}")"; then
    say "commit $PREV_RELEASE (the previous release) is not in this clone's history."
    if [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then
        say "This is a shallow clone: run \`git fetch --unshallow\` (or fetch that commit) and try again."
    else
        say "Fetch it from the repository this clone came from and try again."
    fi
    exit 1
fi

have_bins() {
    local b
    for b in "${BINS[@]}"; do
        [ -x "$BIN/$b" ] || return 1
    done
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$commit" ] && have_bins; then
    say "ferryd and rcp of $commit already built"
    printf '%s\n' "$BIN"
    exit 0
fi

start=$SECONDS
say "building ferryd and rcp of $commit (the previous release) in $PREV_DIR"
rm -rf "$SRC" "$BIN"
mkdir -p "$SRC" "$BIN"
git archive "$commit" | tar -x -C "$SRC"

# The package names as that release spells them (the binaries' crates).
pkg_of() {
    sed -n 's/^name = "\(.*\)"$/\1/p' "$SRC/$1/Cargo.toml" | head -n 1
}
server_pkg="$(pkg_of server)"
client_pkg="$(pkg_of client)"

TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
# The previous release's build writes its binaries where the current build's are
# (target/debug/ferryd, rcp): those are set aside first and put back afterwards, so
# the integration tests never start an old binary by mistake.
STASH="$PREV_DIR/stash"
rm -rf "$STASH"
mkdir -p "$STASH" "$TARGET/debug"
restore() {
    local b
    for b in "${BINS[@]}"; do
        rm -f "$TARGET/debug/$b"
        if [ -e "$STASH/$b" ]; then mv "$STASH/$b" "$TARGET/debug/$b"; fi
    done
    rm -rf "$STASH"
}
for b in "${BINS[@]}"; do
    if [ -e "$TARGET/debug/$b" ]; then mv "$TARGET/debug/$b" "$STASH/$b"; fi
done
trap restore EXIT
(
    cd "$SRC"
    CARGO_TARGET_DIR="$TARGET" CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" \
        cargo build --offline --bins -p "$server_pkg" -p "$client_pkg" >&2
)
for b in "${BINS[@]}"; do
    cp "$TARGET/debug/$b" "$BIN/$b"
done
restore
trap - EXIT
# Written last: a build stopped part-way leaves no stamp and is redone.
printf '%s\n' "$commit" >"$STAMP"
say "built in $((SECONDS - start))s"
printf '%s\n' "$BIN"
