//! `ferryd --check-config`: a configuration checked without serving, creating or
//! changing anything; the exit code and message say what is wrong.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use ferry_tests::bin;

fn check(args: &[&str], dir: &Path) -> Output {
    Command::new(bin("ferryd"))
        .arg("--check-config")
        .args(args)
        .current_dir(dir)
        .env_remove("FERRYD_SECRET")
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_good_configuration_is_summarised_and_nothing_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    fs::create_dir(&data).unwrap();
    let secret = dir.path().join("data.secret");
    fs::write(&secret, "0123456789abcdef0123456789abcdef\n").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let config = dir.path().join("ferryd.toml");
    fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:7999\"\nmax_connections = 77\n\n[[share]]\nname = \"data\"\npath = \"{}\"\nsecret_file = \"{}\"\n",
            data.display(),
            secret.display()
        ),
    )
    .unwrap();
    let before = (names(dir.path()), names(&data));
    let out = check(&["--config", config.to_str().unwrap()], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("configuration OK"), "{said}");
    assert!(
        said.contains(&format!(
            "share data: {} (read-write, secret",
            data.display()
        )),
        "{said}"
    );
    assert!(
        said.contains("listen 127.0.0.1:7999, at most 77 connections"),
        "{said}"
    );
    assert_eq!((names(dir.path()), names(&data)), before, "nothing created");
    // Nothing listens: the port is free for a real ferryd.
    assert!(std::net::TcpListener::bind("127.0.0.1:7999").is_ok());
}

#[test]
fn bad_configurations_exit_2_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    fs::create_dir(&data).unwrap();
    let share = format!("data={}", data.display());
    // No secret for the share.
    let out = check(&["--share", &share], dir.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("data"), "{}", text(&out));
    // A share root that does not exist.
    let missing = format!("gone={}", dir.path().join("gone").display());
    let out = check(&["--share", &missing, "--insecure-no-auth"], dir.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("gone"), "{}", text(&out));
    // A configuration file that does not parse.
    let config = dir.path().join("bad.toml");
    fs::write(&config, "[[share]]\nname = 7\n").unwrap();
    let out = check(&["--config", config.to_str().unwrap()], dir.path());
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("bad.toml"), "{}", text(&out));
    // An open share is served, and the summary says it has no secret.
    let out = check(&["--share", &share, "--insecure-no-auth"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("NO SECRET"), "{}", text(&out));
}
