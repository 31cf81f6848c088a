//! A share with client owners used by many users (issue 42, points 2 and 3): ferryd as
//! root with `--owners data=client`, two `ferry-mount`s with
//! `-o allow_other,default_permissions`, commands run as other users with `setpriv`.
//! Owners are checked on the server's disk and from the other mount; the POSIX rules
//! (who may chown, sticky directories, set-group-ID inheritance, `UTIME_NOW` against a
//! given time) are the server kernel's, applied because ferryd acts as the caller.
//! The share is a tmpfs mounted `nodev,nosuid` ([`Tmpfs`]).

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::time::Duration;

use ferry_tests::{run_tool, skip_without_fuse, Env, Mount, Tmpfs, ToolOutput};

const LIMIT: Duration = Duration::from_secs(30);

/// Runs `script` with `sh -c` in directory `dir` as `uid`/`gid` without supplementary
/// groups (`setpriv`), or as root with `None`.
fn run_as(ids: Option<(u32, u32)>, dir: &std::path::Path, script: &str) -> ToolOutput {
    let mut cmd = std::process::Command::new("setpriv");
    if let Some((u, g)) = ids {
        cmd.arg(format!("--reuid={u}"))
            .arg(format!("--regid={g}"))
            .arg("--clear-groups");
    }
    cmd.args(["sh", "-c", script]).current_dir(dir);
    run_tool(&mut cmd, LIMIT)
}

fn ok(out: ToolOutput) {
    assert_eq!(out.code, Some(0), "{} failed: {}", out.command, out.stderr);
}

fn refused(out: ToolOutput, errno_text: &str) {
    assert_ne!(out.code, Some(0), "{} succeeded", out.command);
    assert!(
        out.stderr.contains(errno_text),
        "{}: wanted '{errno_text}', got: {}",
        out.command,
        out.stderr
    );
}

const NOBODY: Option<(u32, u32)> = Some((65534, 65534));
const OTHER: Option<(u32, u32)> = Some((65533, 65533));

/// ferryd with `owners`, a tmpfs share, two mounts for other users; `None` if the
/// host cannot (no FUSE, no tmpfs, not root).
fn setup(test: &str, owners: &str) -> Option<(Env, Mount, Mount)> {
    if skip_without_fuse(test) {
        return None;
    }
    if let Err(e) = Tmpfs::available() {
        eprintln!("skipping {test}: {e}");
        return None;
    }
    let env = Env::builder()
        .tmpfs(ferry_tests::DEFAULT_SHARE, 64 << 20)
        .server_arg("--owners")
        .server_arg(format!("{}={owners}", ferry_tests::DEFAULT_SHARE))
        .start();
    // Root is squashed by default: the share's top is open to all, as /tmp.
    let top = env.share_dir(ferry_tests::DEFAULT_SHARE);
    fs::set_permissions(&top, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    let opts = "allow_other,default_permissions";
    let a = Mount::builder(env.remote("")).opt(opts).start();
    let b = Mount::builder(env.remote("")).opt(opts).start();
    Some((env, a, b))
}

#[test]
fn files_belong_to_their_callers_and_the_kernel_applies_posix_rules() {
    let Some((env, a, b)) = setup("posix owners", "client") else {
        return;
    };
    // Root is squashed: its directory is nobody's.
    ok(run_as(None, a.path(), "mkdir top && chmod 1777 top"));
    let disk = env.share("top");
    assert_eq!(fs::metadata(&disk).unwrap().uid(), 65534);
    // Another user's file, seen from the other mount and on the disk.
    ok(run_as(
        OTHER,
        a.path(),
        "echo hi > top/x && mkfifo top/fifo",
    ));
    assert_eq!(fs::metadata(env.share("top/x")).unwrap().uid(), 65533);
    assert_eq!(fs::metadata(b.join("top/x")).unwrap().uid(), 65533);
    assert_eq!(fs::metadata(b.join("top/x")).unwrap().gid(), 65533);
    assert!(fs::symlink_metadata(env.share("top/fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(fs::symlink_metadata(b.join("top/fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    // Nobody cannot give a file away, nor remove another's from a sticky directory.
    refused(
        run_as(OTHER, a.path(), "chown 65534 top/x"),
        "Operation not permitted",
    );
    ok(run_as(OTHER, a.path(), "touch sx"));
    refused(
        run_as(NOBODY, b.path(), "rm -f sx"),
        "Operation not permitted",
    );
    ok(run_as(OTHER, b.path(), "rm sx"));
    // The fifo is renamed and removed as what it is (never opened).
    ok(run_as(
        OTHER,
        b.path(),
        "mv top/fifo top/fifo2 && rm top/fifo2",
    ));
    assert!(!env.share("top/fifo2").exists());
    // Set-group-ID directories hand down their group.
    ok(run_as(
        NOBODY,
        a.path(),
        "mkdir top/sg && chmod 2777 top/sg",
    ));
    ok(run_as(OTHER, a.path(), "touch top/sg/f && mkdir top/sg/d"));
    assert_eq!(fs::metadata(env.share("top/sg/f")).unwrap().gid(), 65534);
    let d = fs::metadata(env.share("top/sg/d")).unwrap();
    assert_eq!((d.uid(), d.gid()), (65533, 65534));
    assert_ne!(d.mode() & 0o2000, 0, "a subdirectory inherits set-group-ID");
    // A device node and a set-user-ID file are refused without the share's consent.
    refused(run_as(None, a.path(), "mknod top/null c 1 3"), "");
    refused(run_as(OTHER, a.path(), "chmod 4755 top/x"), "");
    assert_eq!(fs::metadata(env.share("top/x")).unwrap().mode() & 0o4000, 0);
}

#[test]
fn utime_now_needs_write_access_and_a_given_time_ownership() {
    let Some((env, a, _b)) = setup("posix utimensat", "client") else {
        return;
    };
    ok(run_as(OTHER, a.path(), "touch w && chmod 666 w"));
    ok(run_as(NOBODY, a.path(), "touch w"));
    refused(
        run_as(NOBODY, a.path(), "touch -d 2001-01-01 w"),
        "Operation not permitted",
    );
    ok(run_as(OTHER, a.path(), "touch -d 2001-01-01 w"));
    assert_eq!(fs::metadata(env.share("w")).unwrap().mtime(), 978307200);
    // UTIME_OMIT: the access time alone moves.
    ok(run_as(OTHER, a.path(), "touch -a w"));
    let m = fs::metadata(env.share("w")).unwrap();
    assert_eq!(m.mtime(), 978307200);
    assert!(m.atime() > 978307200);
}

#[test]
fn link_counts_of_other_names_are_fresh_after_unlink_and_link() {
    let Some((_env, a, _b)) = setup("posix nlink", "client") else {
        return;
    };
    ok(run_as(OTHER, a.path(), "echo x > f && ln f g && ln f h"));
    assert_eq!(fs::metadata(a.join("f")).unwrap().nlink(), 3);
    assert_eq!(fs::metadata(a.join("g")).unwrap().nlink(), 3);
    ok(run_as(OTHER, a.path(), "rm h"));
    assert_eq!(fs::metadata(a.join("f")).unwrap().nlink(), 2);
    assert_eq!(fs::metadata(a.join("g")).unwrap().nlink(), 2);
    ok(run_as(OTHER, a.path(), "mv g k"));
    assert_eq!(fs::metadata(a.join("k")).unwrap().nlink(), 2);
    ok(run_as(OTHER, a.path(), "rm k"));
    assert_eq!(fs::metadata(a.join("f")).unwrap().nlink(), 1);
}

#[test]
fn devices_where_the_share_allows_them_and_root_unsquashed() {
    let Some((env, a, b)) = setup("posix devices", "client,no_root_squash,allow_devices") else {
        return;
    };
    ok(run_as(None, a.path(), "mknod null c 1 3 && touch mine"));
    let m = fs::symlink_metadata(env.share("null")).unwrap();
    assert!(m.file_type().is_char_device());
    assert_eq!(m.rdev(), nix::sys::stat::makedev(1, 3));
    let seen = fs::symlink_metadata(b.join("null")).unwrap();
    assert!(seen.file_type().is_char_device());
    assert_eq!(seen.rdev(), m.rdev());
    assert_eq!(fs::metadata(env.share("mine")).unwrap().uid(), 0);
    // Set-user-ID stays refused: allow_setid was not given.
    refused(run_as(None, a.path(), "chmod 4755 mine"), "");
}

#[test]
fn server_owners_keep_todays_behaviour() {
    let Some((env, a, _b)) = setup("posix server owners", "server") else {
        return;
    };
    ok(run_as(None, a.path(), "mkdir top && chmod 777 top"));
    ok(run_as(OTHER, a.path(), "touch top/x"));
    assert_eq!(fs::metadata(env.share("top/x")).unwrap().uid(), 0);
}

#[test]
fn rcp_uploads_belong_to_its_user() {
    if let Err(e) = Tmpfs::available() {
        eprintln!("skipping rcp owners: {e}");
        return;
    }
    let user = match ferry_tests::User::unprivileged() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("skipping rcp owners: {e}");
            return;
        }
    };
    let env = Env::builder()
        .tmpfs(ferry_tests::DEFAULT_SHARE, 64 << 20)
        .server_arg("--owners")
        .server_arg(format!("{}=client", ferry_tests::DEFAULT_SHARE))
        .rcp_user(user)
        .start();
    let share = env.share_dir(ferry_tests::DEFAULT_SHARE);
    fs::set_permissions(&share, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    fs::write(env.local("f"), b"from rcp").unwrap();
    user.own(&env.local("f"));
    env.rcp(ferry_tests::rcp_args![env.local("f"), env.remote("f")])
        .assert_success();
    let m = fs::metadata(env.share("f")).unwrap();
    assert_eq!((m.uid(), m.gid()), (user.uid, user.gid));
    assert_eq!(fs::read(env.share("f")).unwrap(), b"from rcp");
}
