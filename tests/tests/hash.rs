//! Chunk-hash negotiation end to end (issue 22): BLAKE3 by default, `rcp --hash
//! sha256` and ferryd's `--hash` (a share's `hash` setting) keep SHA-256, and what is
//! recorded in one algorithm is read, verified and used as a base in it.

use ferry_common::msg::{HashAlgorithm, Request, Response, DEFAULT_CHUNK_BYTES};
use ferry_tests::{
    assert_files_equal, raw_handshake, raw_socket, rcp_args, set_mtime, write_random_file, Env, MIB,
};

/// The algorithm of the manifest ferryd gives for the share's `path` (its record when
/// it holds one).
fn recorded_algorithm(env: &Env, path: &str) -> HashAlgorithm {
    let mut raw = raw_handshake(env.server(), raw_socket(env.server()));
    match raw.call(Request::Manifest {
        share: ferry_tests::DEFAULT_SHARE.into(),
        path: path.into(),
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        first_chunk: 0,
    }) {
        Response::Manifest { version, .. } => version.algorithm,
        other => panic!("manifest of {path}: {other:?}"),
    }
}

fn source(env: &Env, name: &str, seed: u64) -> std::path::PathBuf {
    let path = env.local(name);
    write_random_file(&path, 2 * MIB + 9, seed);
    // Settled: ferryd records the upload's hashes at commit.
    set_mtime(&path, 1_600_000_000);
    path
}

#[test]
fn blake3_by_default_and_sha256_on_request_each_read_back_in_its_own() {
    let env = Env::new();
    let a = source(&env, "a.bin", 1);
    let out = env.rcp(rcp_args!["--json", &a, env.remote("a.bin")]);
    out.assert_success();
    assert_eq!(out.json()["hash"], "blake3");
    assert_eq!(recorded_algorithm(&env, "a.bin"), HashAlgorithm::Blake3);

    let b = source(&env, "b.bin", 2);
    let out = env.rcp(rcp_args![
        "--json",
        "--hash",
        "sha256",
        &b,
        env.remote("b.bin")
    ]);
    out.assert_success();
    assert_eq!(out.json()["hash"], "sha256");
    assert_eq!(recorded_algorithm(&env, "b.bin"), HashAlgorithm::Sha256);

    // Settled (ctime a second old, CACHE_SETTLE): a reader that hashed a whole file
    // could record it now, so the checks below see whether it replaced a record.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    // Each is read back with its record, whatever the reader prefers; a reader that
    // offers only the other algorithm still gets verified bytes.
    // `--json` names the algorithm the file came in.
    for (name, flags, hash) in [
        ("a.bin", vec![], "blake3"),
        ("b.bin", vec![], "sha256"),
        ("a.bin", vec!["--hash", "sha256"], "sha256"),
        ("b.bin", vec!["--hash", "blake3"], "blake3"),
    ] {
        let back = env.local("back.bin");
        let mut args = rcp_args!["--json"];
        args.extend(flags.iter().map(std::ffi::OsString::from));
        args.extend(rcp_args![env.remote(name), &back]);
        let out = env.rcp(args);
        out.assert_success();
        assert_eq!(out.json()["hash"], hash, "{name} {flags:?}");
        assert_eq!(out.json()["hashes"], serde_json::json!([hash]));
        assert_files_equal(&env.local(name), &back);
        std::fs::remove_file(&back).unwrap();
    }
    // The records were not replaced by what the readers were sent.
    assert_eq!(recorded_algorithm(&env, "a.bin"), HashAlgorithm::Blake3);
    assert_eq!(recorded_algorithm(&env, "b.bin"), HashAlgorithm::Sha256);
}

#[test]
fn a_share_that_requires_sha256_records_sha256_and_refuses_a_blake3_only_client() {
    let env = Env::builder()
        .server_arg("--hash")
        .server_arg("sha256")
        .start();
    let tree = env.local("tree");
    std::fs::create_dir(&tree).unwrap();
    write_random_file(&tree.join("small"), 5000, 3);
    source(&env, "tree/big", 4);
    // The client prefers BLAKE3, the share records SHA-256: batches and per-file
    // uploads alike.
    let out = env.rcp(rcp_args!["-r", "--json", &tree, env.remote("")]);
    out.assert_success();
    assert_eq!(out.json()["hash"], "sha256", "what the share records");
    assert_eq!(recorded_algorithm(&env, "tree/big"), HashAlgorithm::Sha256);
    assert_files_equal(&tree.join("small"), &env.share("tree/small"));
    // A client that offers only BLAKE3 is told why it cannot upload there.
    let out = env.rcp(rcp_args![
        "--hash",
        "blake3",
        env.local("tree/big"),
        env.remote("other")
    ]);
    // Refused by the share's policy: rcp's "server refused" code.
    out.assert_code(4);
    let err = &out.stderr;
    assert!(
        err.contains("sha256") && err.contains("blake3") && err.contains("does not accept"),
        "{err}"
    );
    assert!(!env.share("other").exists());
}

/// A share kept on SHA-256 takes a mount's writes in SHA-256 only: a mount that
/// prefers BLAKE3 asks the share (`ShareInfo`) and hashes its writes in SHA-256, and a
/// mount that offers only BLAKE3 cannot write there (ferryd refuses writes hashed in
/// another algorithm than the share's).
#[test]
fn a_share_kept_on_sha256_takes_mount_writes_in_sha256_only() {
    if ferry_tests::skip_without_fuse("a_share_kept_on_sha256_takes_mount_writes_in_sha256_only") {
        return;
    }
    let env = Env::builder()
        .server_arg("--hash")
        .server_arg("sha256")
        .start();
    let src = env.local("src.bin");
    write_random_file(&src, 3 * MIB + 5, 7);
    let data = std::fs::read(&src).unwrap();
    {
        let mount = ferry_tests::Mount::start(env.remote(""));
        std::fs::write(mount.join("by-default.bin"), &data).unwrap();
        std::fs::write(mount.join("small.txt"), b"small").unwrap();
    }
    assert_eq!(std::fs::read(env.share("by-default.bin")).unwrap(), data);
    assert_eq!(std::fs::read(env.share("small.txt")).unwrap(), b"small");

    let mount = ferry_tests::Mount::builder(env.remote(""))
        .arg("--hash")
        .arg("blake3")
        .start();
    for (name, len) in [("b3.bin", data.len()), ("b3.txt", 5)] {
        let wrote = std::fs::write(mount.join(name), &data[..len]);
        assert!(
            wrote.is_err(),
            "{name}: a BLAKE3-only mount wrote to a SHA-256 share"
        );
        assert!(!env.share(name).exists(), "{name}");
    }
}
