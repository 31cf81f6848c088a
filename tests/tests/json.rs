//! `--json`: exactly one JSON object on stdout with the contract's fields, counts that
//! match what was copied, and typed `errors` entries on failure.

use serde_json::Value;

use ferry_tests::{
    ferrytest, make_small_tree, rcp_args, unused_local_port, write_random_file, RcpOutput, MIB,
};

/// Checks every field the contract lists is present with the right type, and that
/// `ok`/`exit_code` agree with the process's exit code. Returns the object.
fn summary(out: &RcpOutput) -> Value {
    let v = out.json();
    let fail = |what: &str| -> ! { panic!("--json summary: {what}\n{v}\n{out}") };
    if !v["ok"].is_boolean() {
        fail("`ok` is not a boolean");
    }
    for key in ["exit_code", "files", "dirs", "symlinks", "bytes"] {
        if !v[key].is_u64() {
            fail(&format!("`{key}` is not a non-negative integer"));
        }
    }
    for key in ["seconds", "bytes_per_sec"] {
        if !v[key].as_f64().is_some_and(|x| x >= 0.0) {
            fail(&format!("`{key}` is not a non-negative number"));
        }
    }
    // null when rcp stopped before connecting; else the transport the suite runs on.
    if !(v["transport"].is_null() || v["transport"] == ferry_tests::test_transport()) {
        fail("`transport` is neither null nor the suite's transport");
    }
    if !(v["device"].is_null() || v["device"].is_string()) {
        fail("`device` is neither null nor a string");
    }
    if !(v["direction"] == "upload" || v["direction"] == "download") {
        fail("`direction` is neither \"upload\" nor \"download\"");
    }
    let Some(errors) = v["errors"].as_array() else {
        fail("`errors` is not an array")
    };
    for e in errors {
        if !(e["path"].is_string() && e["kind"].is_string() && e["message"].is_string()) {
            fail("an `errors` entry lacks a string path, kind or message");
        }
    }
    if v["exit_code"].as_i64() != out.code.map(i64::from) {
        fail("`exit_code` differs from the process's exit code");
    }
    if v["ok"].as_bool() != Some(out.code == Some(0)) {
        fail("`ok` disagrees with the exit code");
    }
    v
}

/// The single `errors` entry of a failed run; panics unless there is exactly one and
/// it has `kind`.
fn single_error<'a>(v: &'a Value, kind: &str) -> &'a Value {
    let errors = v["errors"].as_array().expect("errors array");
    assert_eq!(errors.len(), 1, "expected one error entry: {v}");
    assert_eq!(errors[0]["kind"], kind, "error kind: {v}");
    assert!(
        !errors[0]["message"].as_str().unwrap_or("").is_empty(),
        "empty error message: {v}"
    );
    &errors[0]
}

ferrytest!(json_upload_summary_counts_files_and_bytes, |env| {
    let sizes = [0, 17, MIB, 2 * MIB + 9];
    let mut args = rcp_args!["--json"];
    for (i, len) in sizes.iter().enumerate() {
        let path = env.local(&format!("f{i}"));
        write_random_file(&path, *len, i as u64);
        args.push(path.into_os_string());
    }
    args.push(env.remote("").into());
    let out = env.rcp(args);
    out.assert_success();
    let v = summary(&out);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["direction"], "upload", "{v}");
    assert_eq!(v["files"], sizes.len() as u64, "{v}");
    assert_eq!(v["bytes"], sizes.iter().sum::<u64>(), "{v}");
    assert_eq!(v["symlinks"], 0, "{v}");
    assert_eq!(v["errors"], serde_json::json!([]), "{v}");
});

ferrytest!(json_download_summary, |env| {
    let len = 3 * MIB + 1;
    write_random_file(&env.share("f.bin"), len, 7);
    let out = env.rcp(rcp_args!["--json", env.remote("f.bin"), env.local("f.bin")]);
    out.assert_success();
    let v = summary(&out);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["direction"], "download", "{v}");
    assert_eq!(v["files"], 1, "{v}");
    assert_eq!(v["bytes"], len, "{v}");
});

ferrytest!(json_tree_upload_counts_dirs_and_symlinks, |env| {
    let stats = make_small_tree(&env.local("tree"), 8);
    let out = env.rcp(rcp_args![
        "--json",
        "-r",
        env.local("tree"),
        env.remote("t")
    ]);
    out.assert_success();
    let v = summary(&out);
    assert_eq!(v["files"], stats.files, "{v}");
    assert_eq!(v["symlinks"], stats.symlinks, "{v}");
    assert_eq!(v["bytes"], stats.bytes, "{v}");
    // Whether the top directory itself counts is not pinned down by the contract.
    let dirs = v["dirs"].as_u64().unwrap();
    assert!(
        dirs == stats.dirs || dirs == stats.dirs + 1,
        "dirs {dirs}, expected {} or {}: {v}",
        stats.dirs,
        stats.dirs + 1
    );
});

ferrytest!(json_not_found_error, |env| {
    let out = env.rcp(rcp_args![
        "--json",
        env.remote("missing.bin"),
        env.local("m")
    ]);
    out.assert_code(4);
    let v = summary(&out);
    let e = single_error(&v, "not_found");
    assert!(
        e["path"].as_str().unwrap().contains("missing.bin"),
        "path: {v}"
    );
});

ferrytest!(json_no_such_share_error, |env| {
    write_random_file(&env.local("f"), 5, 9);
    let out = env.rcp(rcp_args![
        "--json",
        env.local("f"),
        env.remote_in("nosuch", "f")
    ]);
    out.assert_code(4);
    single_error(&summary(&out), "no_such_share");
});

ferrytest!(
    json_read_only_error,
    shares = [("data", false), ("ro", true)],
    |env| {
        write_random_file(&env.local("f"), 5, 10);
        let out = env.rcp(rcp_args![
            "--json",
            env.local("f"),
            env.remote_in("ro", "f")
        ]);
        out.assert_code(4);
        single_error(&summary(&out), "read_only");
    }
);

ferrytest!(json_outside_share_error, |env| {
    write_random_file(&env.local("f"), 5, 11);
    let out = env.rcp(rcp_args!["--json", env.local("f"), env.remote("../f")]);
    out.assert_code_in(&[2, 4]);
    let v = summary(&out);
    let kind = single_error_kind(&v);
    assert!(
        kind == "outside_share" || kind == "invalid_path",
        "kind {kind}: {v}"
    );
});

ferrytest!(json_local_missing_error, |env| {
    let out = env.rcp(rcp_args!["--json", env.local("nothere"), env.remote("x")]);
    out.assert_code(5);
    let v = summary(&out);
    let kind = single_error_kind(&v);
    assert!(kind == "not_found" || kind == "io", "kind {kind}: {v}");
    assert!(
        v["errors"][0]["path"].as_str().unwrap().contains("nothere"),
        "path: {v}"
    );
});

#[test]
fn json_connect_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f");
    write_random_file(&src, 5, 12);
    let remote = format!("127.0.0.1:{}:data/f", unused_local_port());
    let out = ferry_tests::rcp(rcp_args!["--json", src, remote]);
    out.assert_code(3);
    single_error(&summary(&out), "connect");
}

fn single_error_kind(v: &Value) -> String {
    let errors = v["errors"].as_array().expect("errors array");
    assert_eq!(errors.len(), 1, "expected one error entry: {v}");
    errors[0]["kind"].as_str().unwrap_or("").to_owned()
}

// Found in exploratory testing: special files inside a tree are skipped like rsync
// without -D, and said so (stderr line and the JSON `skipped` list), not silently.
ferrytest!(json_lists_skipped_special_files, |env| {
    let tree = env.local("t");
    std::fs::create_dir(&tree).unwrap();
    std::fs::write(tree.join("a"), b"a").unwrap();
    let fifo = tree.join("pipe");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let out = env.rcp(rcp_args!["--json", "-r", &tree, env.remote("t")]);
    out.assert_success().assert_stderr_has("skipped");
    let v = out.json();
    assert_eq!(v["files"], 1);
    assert_eq!(
        v["skipped"],
        serde_json::json!([fifo.display().to_string()])
    );
    assert!(!env.share("t/pipe").exists());
});
