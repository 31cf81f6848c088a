//! Share secrets: a session must prove a share's secret (HMAC challenge-response)
//! before any path in the share is resolved; wrong or missing secrets get clear errors
//! and are logged with the peer; secret files must be private; each share has its own
//! secret and its own read-only or read-write access.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_client::{Client, Credentials};
use ferry_common::auth::Secret;
use ferry_common::msg::{ErrorKind, Request, Timestamp};
use ferry_tests::{
    bin, rcp_args, rcp_env, runtime, test_choice, write_random_file, Env, Share, MIB, TEST_SECRET,
};

/// Exit code of rcp for an authentication failure.
const RCP_AUTH: i32 = 7;

/// rcp's environment without the harness's secret.
const NO_SECRET: &[(&str, Option<&str>)] = &[("FERRY_SECRET", None)];

fn write_secret(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    path
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // ferryd's own state (its manifest store) is not a client's file.
        .filter(|n| n != ferry_common::STATE_DIR)
        .collect();
    v.sort();
    v
}

/// Waits (at most 10 s) for ferryd's log to contain `needle`.
#[track_caller]
fn assert_logged(env: &Env, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !env.server().stderr().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "ferryd's log does not say {needle:?}:\n{}",
            env.server().stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn rcp_without_a_secret_is_refused_with_a_hint_and_the_peer_is_logged() {
    let env = Env::new();
    write_random_file(&env.local("f"), 1000, 1);
    let out = rcp_env(NO_SECRET, rcp_args![env.local("f"), env.remote("f")]);
    out.assert_code(RCP_AUTH)
        .assert_stderr_has("requires a secret")
        .assert_stderr_has("--secret-file");
    assert!(entries(&env.share_dir("data")).is_empty());
    assert_logged(&env, "refused peer");
    assert_logged(&env, "request before authentication");
    // --json says why, for scripts.
    let out = rcp_env(
        NO_SECRET,
        rcp_args!["--json", env.local("f"), env.remote("f")],
    );
    out.assert_code(RCP_AUTH);
    let j = out.json();
    assert_eq!(j["errors"][0]["kind"], "auth_required", "{j}");
}

#[test]
fn a_wrong_secret_is_refused_and_the_server_keeps_serving() {
    let env = Env::new();
    write_random_file(&env.local("f"), 3 * MIB + 5, 2);
    let wrong: &[(&str, Option<&str>)] = &[("FERRY_SECRET", Some("not-the-secret-of-this-share"))];
    let out = rcp_env(wrong, rcp_args![env.local("f"), env.remote("f")]);
    out.assert_code(RCP_AUTH)
        .assert_stderr_has("wrong secret for share 'data'");
    assert!(entries(&env.share_dir("data")).is_empty());
    assert_logged(&env, "refused peer");
    assert_logged(&env, "wrong secret");
    // The same goes for downloads, and the server still serves the right secret.
    fs::write(env.share("g"), b"hello").unwrap();
    rcp_env(wrong, rcp_args![env.remote("g"), env.local("g")]).assert_code(RCP_AUTH);
    assert!(!env.local("g").exists());
    env.rcp(rcp_args![env.local("f"), env.remote("f")])
        .assert_success();
    ferry_tests::assert_files_equal(&env.local("f"), &env.share("f"));
    env.server().assert_running();
}

#[test]
fn secret_files_are_used_and_must_be_private() {
    let env = Env::new();
    let dir = tempfile::tempdir().unwrap();
    write_random_file(&env.local("f"), 1000, 3);
    let good = write_secret(dir.path(), "good", &format!("{TEST_SECRET}\n"), 0o600);
    let file_env: &[(&str, Option<&str>)] = &[("FERRY_SECRET", None)];
    rcp_env(
        file_env,
        rcp_args!["--secret-file", good, env.local("f"), env.remote("f")],
    )
    .assert_success();
    // $FERRY_SECRET_FILE works as the flag does.
    let good_str = good.to_str().unwrap();
    rcp_env(
        &[
            ("FERRY_SECRET", None),
            ("FERRY_SECRET_FILE", Some(good_str)),
        ],
        rcp_args![env.remote("f"), env.local("back")],
    )
    .assert_success();
    ferry_tests::assert_files_equal(&env.local("f"), &env.local("back"));
    // A file others may read is refused before anything is sent.
    fs::set_permissions(&good, fs::Permissions::from_mode(0o644)).unwrap();
    let before = env.server().stderr();
    rcp_env(
        file_env,
        rcp_args!["--secret-file", good, env.local("f"), env.remote("f2")],
    )
    .assert_code(RCP_AUTH)
    .assert_stderr_has("chmod 600");
    assert!(!env.share("f2").exists());
    let opened = |log: &str| log.matches("connection opened").count();
    assert_eq!(opened(&env.server().stderr()), opened(&before));
    // A secret too short to be one.
    let short = write_secret(dir.path(), "short", "abc\n", 0o600);
    rcp_env(
        file_env,
        rcp_args!["--secret-file", short, env.local("f"), env.remote("f3")],
    )
    .assert_code(RCP_AUTH)
    .assert_stderr_has("needs 16");
}

/// Runs ferryd with `args` and `env` (no harness secret) and expects it to exit at once
/// with code 2; returns its stderr.
fn ferryd_refuses(args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(bin("ferryd"));
    cmd.args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("FERRYD_SECRET")
        .env("FERRY_TRANSPORT", "tcp")
        .current_dir(dir.path())
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("ferryd {args:?} did not refuse to start");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "ferryd {args:?}: {err}");
    err
}

#[test]
fn ferryd_refuses_shares_without_a_usable_secret() {
    let dir = tempfile::tempdir().unwrap();
    let share = format!("data={}", dir.path().display());
    let err = ferryd_refuses(&["--share", &share], &[]);
    assert!(err.contains("share 'data' has no secret"), "{err}");
    assert!(err.contains("--insecure-no-auth"), "{err}");
    let open = write_secret(dir.path(), "open", &format!("{TEST_SECRET}\n"), 0o644);
    let err = ferryd_refuses(
        &["--share", &share, "--secret-file", open.to_str().unwrap()],
        &[],
    );
    assert!(err.contains("chmod 600"), "{err}");
    let err = ferryd_refuses(&["--share", &share, "--secret-file", "/nonexistent/s"], &[]);
    assert!(
        err.contains("cannot read secret file /nonexistent/s"),
        "{err}"
    );
    let err = ferryd_refuses(&["--share", &share, "--secret-file", "other=/x"], &[]);
    assert!(
        err.contains("share 'other', which is not configured"),
        "{err}"
    );
    let err = ferryd_refuses(&["--share", &share], &[("FERRYD_SECRET", "short")]);
    assert!(err.contains("needs 16"), "{err}");
}

#[test]
fn generated_secrets_are_private_and_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.secret");
    let gen = |p: &Path| {
        Command::new(bin("ferryd"))
            .arg("--generate-secret")
            .arg(p)
            .output()
            .unwrap()
    };
    let out = gen(&path);
    assert!(out.status.success(), "{out:?}");
    let meta = fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(text.trim().len(), 64, "{text:?}");
    assert!(text.trim().bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(Secret::from_file(&path).is_ok());
    let again = gen(&path);
    assert!(!again.status.success());
    assert_eq!(fs::read_to_string(&path).unwrap(), text, "overwritten");
    // Two secrets differ.
    let other = dir.path().join("other.secret");
    assert!(gen(&other).status.success());
    assert_ne!(fs::read_to_string(&other).unwrap(), text);
}

#[test]
fn each_share_has_its_own_secret_and_access() {
    let secrets = tempfile::tempdir().unwrap();
    let a = write_secret(secrets.path(), "a", "secret-of-share-a-0001\n", 0o600);
    let b = write_secret(secrets.path(), "b", "secret-of-share-b-0002\n", 0o600);
    let env = Env::builder()
        .share("a", false)
        .share("b", true)
        .server_env("FERRYD_SECRET", None)
        .server_arg(format!("--secret-file=a={}", a.display()))
        .server_arg(format!("--secret-file=b={}", b.display()))
        .start();
    fs::write(env.share_dir("b").join("readme"), b"read me").unwrap();
    write_random_file(&env.local("f"), 2000, 4);
    let with = |file: &Path, args: Vec<std::ffi::OsString>| {
        let mut all = rcp_args!["--secret-file", file];
        all.extend(args);
        rcp_env(NO_SECRET, all)
    };
    with(&a, rcp_args![env.local("f"), env.remote_in("a", "f")]).assert_success();
    // a's secret does not open b, nor b's a.
    with(&a, rcp_args![env.remote_in("b", "readme"), env.local("r")])
        .assert_code(RCP_AUTH)
        .assert_stderr_has("wrong secret for share 'b'");
    with(&b, rcp_args![env.local("f"), env.remote_in("a", "g")]).assert_code(RCP_AUTH);
    assert!(!env.share_dir("a").join("g").exists());
    // b's secret reads b, and b is read-only whatever the secret.
    with(&b, rcp_args![env.remote_in("b", "readme"), env.local("r")]).assert_success();
    assert_eq!(fs::read(env.local("r")).unwrap(), b"read me");
    with(&b, rcp_args![env.local("f"), env.remote_in("b", "f")])
        .assert_code(4)
        .assert_stderr_has("read-only");
    // The test secret (ferryd's environment was cleared of it) opens nothing.
    env.rcp(rcp_args![env.local("f"), env.remote_in("a", "h")])
        .assert_code(RCP_AUTH);
}

/// Every request that names a share is refused before the proof, and none of them
/// reaches the server's request handling: its request counter does not move.
#[test]
fn no_request_reaches_a_share_before_its_proof() {
    let env = Env::new();
    fs::write(env.share("file"), b"content").unwrap();
    let (host, port) = env.server().addr().rsplit_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    let share = || "data".to_string();
    let requests = vec![
        Request::Stat {
            share: share(),
            path: "file".into(),
            follow: true,
        },
        Request::ListDir {
            share: share(),
            path: "".into(),
            cursor: 0,
        },
        Request::Mkdir {
            share: share(),
            path: "newdir".into(),
            mode: 0o755,
            exist_ok: false,
        },
        Request::Symlink {
            share: share(),
            path: "link".into(),
            target: "file".into(),
        },
        Request::SetAttr {
            share: share(),
            path: "file".into(),
            mode: Some(0o600),
            mtime: Some(Timestamp { secs: 1, nanos: 0 }),
        },
        Request::UploadOpen {
            share: share(),
            path: "up".into(),
            size: 10,
            mode: 0o644,
            mtime: Timestamp::default(),
        },
        Request::DownloadOpen {
            share: share(),
            path: "file".into(),
        },
        Request::MapOpen {
            share: share(),
            path: "file".into(),
            chunk_bytes: 4096,
        },
        Request::StatFs { share: share() },
        Request::Stats,
    ];
    let mode_before = fs::metadata(env.share("file"))
        .unwrap()
        .permissions()
        .mode();
    runtime().block_on(async {
        let watcher = ferry_tests::connect_to(host, port, test_choice())
            .await
            .unwrap();
        let before = watcher.server_stats().await.unwrap().requests;
        let stranger = Client::connect_with(host, port, test_choice(), Credentials::none())
            .await
            .unwrap();
        for req in requests {
            let name = format!("{req:?}");
            let e = stranger.call(req).await.unwrap_err();
            assert_eq!(
                e.remote_kind(),
                Some(ErrorKind::AuthRequired),
                "{name}: {e}"
            );
        }
        // Only the watcher's own Stats calls were dispatched.
        let after = watcher.server_stats().await.unwrap().requests;
        assert_eq!(after - before, 1, "requests reached the server's code");
        // A wrong proof then ends the session.
        let wrong = Secret::from_bytes(b"a-wrong-secret-for-data", "test").unwrap();
        let liar =
            Client::connect_with(host, port, test_choice(), Credentials::with_default(wrong))
                .await
                .unwrap();
        let e = liar.authenticate("data").await.unwrap_err();
        assert_eq!(e.remote_kind(), Some(ErrorKind::AuthFailed), "{e}");
        let e = liar.call(Request::Stats).await.unwrap_err();
        assert!(
            matches!(e, ferry_client::ClientError::Disconnected(_)),
            "the session went on after a wrong proof: {e}"
        );
    });
    assert_eq!(entries(&env.share_dir("data")), vec!["file".to_string()]);
    assert_eq!(
        fs::metadata(env.share("file"))
            .unwrap()
            .permissions()
            .mode(),
        mode_before
    );
}

#[test]
fn insecure_no_auth_serves_shares_without_a_secret_and_says_so() {
    let env = Env::builder()
        .server_env("FERRYD_SECRET", None)
        .server_arg("--insecure-no-auth")
        .start();
    write_random_file(&env.local("f"), 5000, 5);
    rcp_env(NO_SECRET, rcp_args![env.local("f"), env.remote("f")]).assert_success();
    // A client that has a secret anyway is let in too.
    env.rcp(rcp_args![env.remote("f"), env.local("g")])
        .assert_success();
    ferry_tests::assert_files_equal(&env.local("f"), &env.local("g"));
    assert_logged(&env, "WITHOUT a secret");
}

#[test]
fn ferry_mount_with_a_wrong_or_missing_secret_does_not_mount() {
    if !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: no /dev/fuse");
        return;
    }
    let env = Env::new();
    let mnt = tempfile::tempdir().unwrap();
    for secret in [Some("not-the-secret-of-this-share"), None] {
        let mut cmd = Command::new(bin("ferry-mount"));
        cmd.arg("-f")
            .arg(env.remote(""))
            .arg(mnt.path())
            .env("FERRY_TRANSPORT", ferry_tests::test_transport())
            .env_remove("FERRY_SECRET_FILE")
            .stdin(Stdio::null());
        match secret {
            Some(s) => cmd.env("FERRY_SECRET", s),
            None => cmd.env_remove("FERRY_SECRET"),
        };
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(5), "{secret:?}: {err}");
        let expected = if secret.is_some() {
            "wrong secret"
        } else {
            "requires a secret"
        };
        assert!(err.contains(expected), "{secret:?}: {err}");
        let kind = ferry_tests::mount_type(mnt.path()).unwrap_or_default();
        assert!(!ferry_tests::is_fuse_type(&kind), "mounted: {kind}");
    }
    env.server().assert_running();
}

/// The test secret's share, once more, through a server started with secret files per
/// share rather than the environment: what every other test relies on also holds.
#[test]
fn a_secret_from_a_file_and_one_from_the_environment_agree() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_secret(dir.path(), "s", &format!("{TEST_SECRET}\n"), 0o600);
    let share_dir = dir.path().join("share");
    fs::create_dir(&share_dir).unwrap();
    let server = ferry_tests::Server::start_with(
        &[Share::rw("data", &share_dir)],
        ferry_tests::ServerOptions {
            args: vec!["--secret-file".into(), file.into()],
            env: vec![("FERRYD_SECRET".into(), None)],
            ..Default::default()
        },
    );
    fs::write(share_dir.join("x"), b"x").unwrap();
    let out = dir.path().join("x");
    ferry_tests::rcp(rcp_args![server.remote("data", "x"), out]).assert_success();
    assert_eq!(fs::read(&out).unwrap(), b"x");
}
