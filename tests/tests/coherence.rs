//! Two clients of one share at once (issue 42, point 1): close-to-open between two
//! `ferry-mount`s of the same share, and between a mount and `rcp`, with the mounts'
//! default kernel caching (`attr_timeout` and `entry_timeout` of 1 s) and no sleeps:
//! every step follows the previous one's `close(2)` at once.
//!
//! The guarantee tested is NFS's: an `open` after another client's `close` sees that
//! close's data and size; `O_APPEND` writes land at the server's end of file as of
//! that open (plus this mount's own appends since).

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use ferry_tests::{
    rcp_args, run_tool, sh, skip_without_fuse, write_random_file, Env, Mount, ToolOutput,
};

/// How long one shell loop of appends may take.
const LOOP_LIMIT: Duration = Duration::from_secs(60);

/// `count` numbered lines, `prefix-0` to `prefix-(count-1)`.
fn lines(prefix: &str, count: usize) -> String {
    (0..count).map(|i| format!("{prefix}-{i}\n")).collect()
}

/// Opens `path` with `O_APPEND`, writes `line`, closes: what `echo line >> path` and
/// Python's `open(path, "a")` do.
fn append_line(path: &Path, line: &str) {
    let mut f = OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all(line.as_bytes()).unwrap();
    drop(f);
}

/// Opens `path`, reads it whole through that descriptor, and checks that the size the
/// descriptor's `fstat` gives agrees with what was read.
fn read_fresh(path: &Path) -> Vec<u8> {
    let mut f = fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = f.metadata().unwrap().len();
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert_eq!(
        size,
        got.len() as u64,
        "{}: fstat after open",
        path.display()
    );
    got
}

#[track_caller]
fn assert_text(path: &Path, want: &str, what: &str) {
    let got = fs::read(path).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        want,
        "{what}: {}",
        path.display()
    );
}

/// Two mounts take turns appending one line each, 20 lines in all: by `echo >>` in one
/// shell loop, then by a program's own open-append-close. Every line survives, in
/// order, on the server and as both mounts read the file.
#[test]
fn appends_alternating_between_two_mounts_keep_every_line() {
    if skip_without_fuse("appends_alternating_between_two_mounts_keep_every_line") {
        return;
    }
    let env = Env::new();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));

    let script = r#"i=0; while [ $i -lt 20 ]; do
        if [ $((i % 2)) -eq 0 ]; then m=$1; else m=$2; fi
        echo "sh-$i" >> "$m/log.txt" || exit 1
        i=$((i + 1))
    done"#;
    let mut cmd = sh(script);
    cmd.arg(a.path()).arg(b.path());
    let out: ToolOutput = run_tool(&mut cmd, LOOP_LIMIT);
    out.assert_success("the append loop");
    let want = lines("sh", 20);
    assert_text(
        &env.share("log.txt"),
        &want,
        "the server's file after echo >>",
    );
    assert_eq!(
        String::from_utf8_lossy(&read_fresh(&a.join("log.txt"))),
        want
    );
    assert_eq!(
        String::from_utf8_lossy(&read_fresh(&b.join("log.txt"))),
        want
    );

    // A file that exists already, appended to from a program.
    fs::write(env.share("prog.txt"), b"").unwrap();
    for i in 0..20 {
        let m = if i % 2 == 0 { &a } else { &b };
        append_line(&m.join("prog.txt"), &format!("prog-{i}\n"));
    }
    let want = lines("prog", 20);
    assert_text(
        &env.share("prog.txt"),
        &want,
        "the server's file after O_APPEND",
    );
    assert_eq!(
        String::from_utf8_lossy(&read_fresh(&b.join("prog.txt"))),
        want
    );
}

/// What one mount closes, the other's next open sees, whatever both cached: a file
/// rewritten shorter, truncated to nothing, replaced by a rename, and grown by an append.
#[test]
fn an_open_sees_the_other_mounts_truncate_rename_and_append() {
    if skip_without_fuse("an_open_sees_the_other_mounts_truncate_rename_and_append") {
        return;
    }
    let env = Env::new();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));
    let long = "x".repeat(100_000);
    fs::write(a.join("f"), &long).unwrap();
    assert_eq!(
        read_fresh(&b.join("f")),
        long.as_bytes(),
        "b reads a's file"
    );

    fs::write(a.join("f"), b"short\n").unwrap();
    assert_eq!(
        read_fresh(&b.join("f")),
        b"short\n",
        "b after a rewrote it shorter"
    );

    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(a.join("f"))
        .unwrap();
    assert_eq!(read_fresh(&b.join("f")), b"", "b after a truncated it");
    assert_eq!(fs::metadata(b.join("f")).unwrap().len(), 0, "b's stat");

    fs::write(a.join("f.tmp"), b"replaced by a rename\n").unwrap();
    fs::rename(a.join("f.tmp"), a.join("f")).unwrap();
    assert_eq!(
        read_fresh(&b.join("f")),
        b"replaced by a rename\n",
        "b after a rename"
    );

    append_line(&a.join("f"), "and an append\n");
    let want = "replaced by a rename\nand an append\n";
    assert_eq!(String::from_utf8_lossy(&read_fresh(&b.join("f"))), want);
    append_line(&b.join("f"), "b's append\n");
    let want = format!("{want}b's append\n");
    assert_eq!(String::from_utf8_lossy(&read_fresh(&a.join("f"))), want);
    assert_text(&env.share("f"), &want, "the server's file");
}

/// `rcp` replaces a file between a mount's appends: the mount's next open appends to
/// rcp's bytes, and reads them.
#[test]
fn a_mount_appends_to_what_rcp_just_wrote() {
    if skip_without_fuse("a_mount_appends_to_what_rcp_just_wrote") {
        return;
    }
    let env = Env::new();
    let m = Mount::start(env.remote(""));
    append_line(&m.join("log"), "first\n");
    assert_eq!(read_fresh(&m.join("log")), b"first\n");

    let local = env.root().join("from-rcp");
    write_random_file(&local, 300_000, 7);
    env.rcp(rcp_args![&local, env.remote("log")])
        .assert_success();
    let mut want = fs::read(&local).unwrap();
    assert_eq!(
        read_fresh(&m.join("log")),
        want,
        "the mount reads rcp's file"
    );

    append_line(&m.join("log"), "after rcp\n");
    want.extend_from_slice(b"after rcp\n");
    assert_eq!(
        fs::read(env.share("log")).unwrap(),
        want,
        "the server's file"
    );
    assert_eq!(read_fresh(&m.join("log")), want, "the mount's read");

    // And the other way: rcp downloads what the mount just closed.
    append_line(&m.join("log"), "before the download\n");
    want.extend_from_slice(b"before the download\n");
    let back = env.root().join("back");
    env.rcp(rcp_args![env.remote("log"), &back])
        .assert_success();
    assert_eq!(fs::read(&back).unwrap(), want, "rcp's download");
}
