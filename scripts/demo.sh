#!/usr/bin/env bash
# Ferry demo: start a ferryd on loopback, copy a big file and a small tree up
# and back down with rcp, verify every byte, and show the throughput.
#
#   scripts/demo.sh                  # 256 MiB file
#   DEMO_SIZE_MIB=1024 scripts/demo.sh
#
# Everything lives in a temporary directory that is removed on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SIZE_MIB="${DEMO_SIZE_MIB:-256}"
case "$SIZE_MIB" in
    '' | *[!0-9]*) echo "demo: DEMO_SIZE_MIB must be a whole number of MiB (got '$SIZE_MIB')" >&2; exit 2 ;;
esac

if [ -t 1 ]; then
    BOLD=$'\033[1m'; RED=$'\033[31m'; GREEN=$'\033[32m'; RESET=$'\033[0m'
else
    BOLD=''; RED=''; GREEN=''; RESET=''
fi
step() { printf '\n%s==> %s%s\n' "$BOLD" "$*" "$RESET"; }
info() { printf '    %s\n' "$*"; }
fail() {
    if [ -s "${WORK:-}/ferryd.log" ]; then
        printf '\n--- last lines of the ferryd log ---\n' >&2
        tail -n 20 "$WORK/ferryd.log" >&2
    fi
    printf '\n%sdemo FAILED: %s%s\n' "$RED" "$*" "$RESET" >&2
    exit 1
}

# --- set-up and build ---------------------------------------------------------
step "Checking the machine (scripts/setup.sh)"
scripts/setup.sh
# setup.sh may have found cargo in ~/.cargo/bin; make sure we see it too.
if [ -d "${CARGO_HOME:-$HOME/.cargo}/bin" ]; then PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; fi
info "ok"

step "Building ferryd and rcp (cargo build --release --bins)"
cargo build --release --bins
FERRYD="$ROOT/target/release/ferryd"
RCP="$ROOT/target/release/rcp"
[ -x "$FERRYD" ] || fail "$FERRYD was not built"
[ -x "$RCP" ] || fail "$RCP was not built"
info "ok: $FERRYD, $RCP"

# --- scratch space and clean-up -----------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferry-demo.XXXXXX")"
FERRYD_PID=""
cleanup() {
    if [ -n "$FERRYD_PID" ]; then
        kill "$FERRYD_PID" 2>/dev/null || true
        wait "$FERRYD_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

SHARE="$WORK/share"   # what ferryd exports as share "demo"
SRC="$WORK/src"       # local originals
DOWN="$WORK/down"     # local copies downloaded back
mkdir -p "$SHARE" "$SRC" "$DOWN"

# --- server -------------------------------------------------------------------
step "Starting ferryd (share demo=$SHARE, loopback, ephemeral port)"
# Every share has a secret; clients prove it (HMAC challenge-response) without sending it.
"$FERRYD" --generate-secret "$WORK/demo.secret"
export FERRY_SECRET_FILE="$WORK/demo.secret"   # rcp reads its secret from here
info "share secret in $FERRY_SECRET_FILE (mode 0600; rcp uses it through \$FERRY_SECRET_FILE)"
"$FERRYD" --share "demo=$SHARE" --secret-file "$WORK/demo.secret" \
    --listen 127.0.0.1:0 --port-file "$WORK/port" 2>"$WORK/ferryd.log" &
FERRYD_PID=$!
for _ in $(seq 1 100); do
    [ -s "$WORK/port" ] && break
    if ! kill -0 "$FERRYD_PID" 2>/dev/null; then
        FERRYD_PID=""
        fail "ferryd exited before it was listening"
    fi
    sleep 0.1
done
[ -s "$WORK/port" ] || fail "ferryd did not write its port file within 10 s"
ADDR="$(head -n 1 "$WORK/port")"
info "ferryd (pid $FERRYD_PID) is listening on $ADDR"
info "remote paths look like $ADDR:demo/PATH"

# --- test data ----------------------------------------------------------------
step "Creating test data"
head -c "$((SIZE_MIB * 1024 * 1024))" /dev/urandom >"$SRC/big.bin"
info "big.bin: $SIZE_MIB MiB of random bytes"

TREE="$SRC/tree"
mkdir -p "$TREE/docs/notes" "$TREE/data/raw" "$TREE/data/empty" "$TREE/bin"
n=0
for dir in docs docs/notes data data/raw bin; do
    for i in $(seq 1 20); do
        n=$((n + 1))
        # sizes from 0 bytes to ~20 KiB
        head -c "$(( (n * 211) % 20480 ))" /dev/urandom >"$TREE/$dir/file$i.dat"
    done
done
: >"$TREE/docs/empty.txt"
head -c $((3 * 1024 * 1024 + 12345)) /dev/urandom >"$TREE/data/medium.bin"   # spans 4 chunks
printf '#!/bin/sh\necho hello from ferry\n' >"$TREE/bin/hello.sh"
chmod 755 "$TREE/bin/hello.sh"
chmod 600 "$TREE/docs/file1.dat"
chmod 750 "$TREE/data/raw"
ln -s ../docs/notes/file1.dat "$TREE/data/link-to-note"
touch -d '2020-02-02 12:34:56' "$TREE/docs/file2.dat" "$TREE/data/medium.bin"
info "tree/: $(find "$TREE" -type f | wc -l) files, $(find "$TREE" -mindepth 1 -type d | wc -l) directories" \
    "(one empty), $(find "$TREE" -type l | wc -l) symlink, $(du -sh "$TREE" | cut -f1) in all"

# --- helpers ------------------------------------------------------------------
# json_field JSON KEY: the value of a top-level scalar field of rcp --json output.
json_field() {
    printf '%s\n' "$1" | sed -n 's/.*"'"$2"'":\("[^"]*"\|[-+0-9.eE]*\|true\|false\).*/\1/p' | tr -d '"'
}

TRANSPORT=""
SEALED=""
# copy LABEL RCP-ARGS...: run rcp --json and print what it reports.
copy() {
    local label="$1" json rc
    shift
    info "\$ rcp --json $*"
    rc=0
    json="$("$RCP" --json "$@")" || rc=$?
    if [ "$rc" -ne 0 ]; then
        [ -n "$json" ] && info "rcp said: $json"
        fail "$label: rcp exited with code $rc"
    fi
    local bytes seconds bps files dirs links what transport
    bytes="$(json_field "$json" bytes)"
    seconds="$(json_field "$json" seconds)"
    bps="$(json_field "$json" bytes_per_sec)"
    files="$(json_field "$json" files)"
    dirs="$(json_field "$json" dirs)"
    links="$(json_field "$json" symlinks)"
    transport="$(json_field "$json" transport)"
    TRANSPORT="${transport:-?}"
    # The cipher suite, or "null" for a session in the clear.
    SEALED="$(json_field "$json" encryption)"
    case "$SEALED" in ""|null) SEALED="NOT encrypted" ;; *) SEALED="encrypted with $SEALED" ;; esac
    what="${files:-?} file(s)"
    if [ "${dirs:-0}" != 0 ] || [ "${links:-0}" != 0 ]; then
        what="$what, ${dirs:-?} dir(s), ${links:-?} symlink(s)"
    fi
    awk -v label="$label" -v w="$what" -v b="${bytes:-0}" -v s="${seconds:-0}" -v r="${bps:-0}" -v t="$TRANSPORT" -v e="$SEALED" 'BEGIN {
        printf "    %s: %s, %.1f MiB in %.2f s = %.0f MB/s (transport %s, %s)\n",
            label, w, b / 1048576, s, r / 1e6, t, e
    }'
}

# --- the copies ---------------------------------------------------------------
step "1. Upload big.bin into the share (the server pulls it with RDMA READ)"
copy "upload" "$SRC/big.bin" "$ADDR:demo/"
cmp "$SRC/big.bin" "$SHARE/big.bin" || fail "the uploaded big.bin differs from the original"
info "cmp: share/big.bin is identical to the original"

step "2. Download it back under another name (the server pushes it with RDMA WRITE)"
copy "download" "$ADDR:demo/big.bin" "$DOWN/big-copy.bin"
cmp "$SRC/big.bin" "$DOWN/big-copy.bin" || fail "the downloaded big-copy.bin differs from the original"
info "cmp: big-copy.bin is identical to the original"

step "3. Upload the tree with -r"
copy "upload -r" -r "$TREE" "$ADDR:demo/tree"
diff -r --no-dereference "$TREE" "$SHARE/tree" || fail "the uploaded tree differs from the original"
info "diff -r: share/tree is identical to the original (files, empty dir, symlink)"

step "4. Download the tree back with -r"
copy "download -r" -r "$ADDR:demo/tree" "$DOWN/tree"
diff -r --no-dereference "$TREE" "$DOWN/tree" || fail "the downloaded tree differs from the original"
info "diff -r: the downloaded tree is identical to the original"

# Mode of files and directories, and mtime of files, must survive both trips.
meta() { (cd "$1" && find . \( -type f -o -type d \) -exec stat -c '%n %F %a' {} + && find . -type f -exec stat -c '%n mtime %Y' {} +) | sort; }
diff <(meta "$TREE") <(meta "$SHARE/tree") | head -n 20 >&2 || fail "modes or mtimes differ after the upload"
diff <(meta "$TREE") <(meta "$DOWN/tree") | head -n 20 >&2 || fail "modes or mtimes differ after the download"
info "file and directory modes and file mtimes are preserved"

printf '\n%sdemo OK%s: transport %s, %s, every copy verified byte for byte.\n' "$GREEN" "$RESET" "$TRANSPORT" "$SEALED"
