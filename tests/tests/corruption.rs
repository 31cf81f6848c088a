//! A transport wrapper flips bits of file data in flight (in the server's one-sided
//! READs of uploads and WRITEs of downloads). Every flip must be detected by the
//! SHA-256 check; a single flip is repaired by the window retry (for a batch of small
//! files, by sending the damaged file again); a persistent one fails the file (in a
//! batch, that file only), and no corrupt or partial file ever appears under its final
//! name. Every test runs twice: with the share recording BLAKE3 hashes and with it
//! recording SHA-256 (ferryd's per-share `hash`), so detection holds for both.

use std::path::Path;
use std::sync::Arc;

use ferry_client::batch::{download_batch, upload_batch, Outcome, SmallDownload, SmallUpload};
use ferry_client::transfer::{download_file, upload_file, ProgressFn};
use ferry_common::msg::{ErrorKind, HashAlgorithm};
use ferry_common::proto::retry::WINDOW_ATTEMPTS;
use ferry_common::transport::faulty::{FaultPlan, Faulty, Flip};
use ferry_common::transport::tcp::Tcp;
use ferry_common::transport::TransportChoice;
use ferry_server::{Config, Server, ShareConfig};
use ferry_tests::{assert_only_resumable_temp_files, write_random_file as write_random};

/// Starts an in-process ferryd whose every connection is wrapped in `plan`.
/// The share's secret file goes beside `root`.
async fn faulty_server(root: &Path, plan: FaultPlan, alg: HashAlgorithm) -> u16 {
    faulty_server_handle(root, plan, alg).await.0
}

/// [`faulty_server`], also returning the server (to see when its connections ended).
async fn faulty_server_handle(
    root: &Path,
    plan: FaultPlan,
    alg: HashAlgorithm,
) -> (u16, Arc<Server>) {
    let secret = ferry_tests::write_secret_file(root.parent().unwrap());
    let mut config = Config::with_shares(
        "127.0.0.1:0".parse().unwrap(),
        vec![ShareConfig {
            name: "data".into(),
            path: root.to_owned(),
            read_only: false,
            secret_file: Some(secret),
            secret_env: None,
            hash: Some(alg),
            // The faults are injected under the encryption layer: in the clear, so
            // that they reach the hash checks this file is about (an encrypted
            // session ends at the first forged piece, tests/tests/encryption.rs).
            encryption: Some(ferry_common::seal::Encryption::Off),
            owners: Default::default(),
            root_squash: true,
            allow_devices: false,
            allow_setid: false,
        }],
    );
    config.queue_depth = 4;
    let server = Server::new(&config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let serving = server.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let tcp = Arc::new(Tcp::start(stream).await.unwrap());
            let wrapped = Faulty::new(tcp, plan.clone());
            tokio::spawn(serving.clone().handle_connection(wrapped));
        }
    });
    (port, server)
}

fn no_progress() -> ProgressFn {
    Arc::new(|_| {})
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // ferryd's own state (its manifest store) is not a client's file.
        .filter(|n| n != ferry_common::STATE_DIR)
        .collect();
    v.sort();
    v
}

const SIZE: u64 = 5 * 1024 * 1024 + 123;

async fn one_flipped_upload_chunk_is_detected_and_resent(alg: HashAlgorithm) {
    let dir = tempfile::tempdir().unwrap();
    let (share, src) = (dir.path().join("share"), dir.path().join("src.bin"));
    std::fs::create_dir(&share).unwrap();
    write_random(&src, SIZE, 1);
    let plan = FaultPlan {
        flip_read: Flip::Nth(2),
        ..FaultPlan::default()
    };
    let port = faulty_server(&share, plan.clone(), alg).await;
    let client = ferry_tests::connect_to("127.0.0.1", port, TransportChoice::Tcp)
        .await
        .unwrap();
    upload_file(&client, &src, "data", "dst.bin", no_progress())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(share.join("dst.bin")).unwrap(),
        std::fs::read(&src).unwrap()
    );
    assert_eq!(entries(&share), vec!["dst.bin"]);
    assert_eq!(plan.fired(), 1, "the flip happened");
}

async fn persistent_upload_corruption_fails_and_leaves_nothing(alg: HashAlgorithm) {
    let dir = tempfile::tempdir().unwrap();
    let (share, src) = (dir.path().join("share"), dir.path().join("src.bin"));
    std::fs::create_dir(&share).unwrap();
    write_random(&src, SIZE, 2);
    let plan = FaultPlan {
        flip_read: Flip::Every,
        ..FaultPlan::default()
    };
    let port = faulty_server(&share, plan.clone(), alg).await;
    let client = ferry_tests::connect_to("127.0.0.1", port, TransportChoice::Tcp)
        .await
        .unwrap();
    let err = upload_file(&client, &src, "data", "dst.bin", no_progress())
        .await
        .unwrap_err();
    assert_eq!(err.remote_kind(), Some(ErrorKind::Integrity), "{err}");
    // Neither the final name nor a temporary file remains.
    assert_eq!(entries(&share), Vec::<String>::new());
    assert!(
        plan.fired() >= WINDOW_ATTEMPTS as u64,
        "flips: {}",
        plan.fired()
    );
}

async fn one_flipped_download_chunk_is_detected_and_refetched(alg: HashAlgorithm) {
    let dir = tempfile::tempdir().unwrap();
    let (share, out) = (dir.path().join("share"), dir.path().join("out"));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::create_dir(&share).unwrap();
    write_random(&share.join("f.bin"), SIZE, 3);
    let plan = FaultPlan {
        flip_write: Flip::Nth(4),
        ..FaultPlan::default()
    };
    let port = faulty_server(&share, plan.clone(), alg).await;
    let client = ferry_tests::connect_to("127.0.0.1", port, TransportChoice::Tcp)
        .await
        .unwrap();
    download_file(&client, "data", "f.bin", &out.join("f.bin"), no_progress())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(out.join("f.bin")).unwrap(),
        std::fs::read(share.join("f.bin")).unwrap()
    );
    assert_eq!(entries(&out), vec!["f.bin"]);
    assert_eq!(plan.fired(), 1, "the flip happened");
}

async fn persistent_download_corruption_fails_and_leaves_nothing(alg: HashAlgorithm) {
    let dir = tempfile::tempdir().unwrap();
    let (share, out) = (dir.path().join("share"), dir.path().join("out"));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::create_dir(&share).unwrap();
    write_random(&share.join("f.bin"), SIZE, 4);
    let plan = FaultPlan {
        flip_write: Flip::Every,
        ..FaultPlan::default()
    };
    let port = faulty_server(&share, plan.clone(), alg).await;
    let client = ferry_tests::connect_to("127.0.0.1", port, TransportChoice::Tcp)
        .await
        .unwrap();
    let err = download_file(&client, "data", "f.bin", &out.join("f.bin"), no_progress())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "integrity", "{err}");
    assert_eq!(entries(&out), Vec::<String>::new());
    assert!(
        plan.fired() >= WINDOW_ATTEMPTS as u64,
        "flips: {}",
        plan.fired()
    );
}

async fn a_failing_transport_mid_upload_leaves_no_file_under_its_name(alg: HashAlgorithm) {
    let dir = tempfile::tempdir().unwrap();
    let (share, src) = (dir.path().join("share"), dir.path().join("src.bin"));
    std::fs::create_dir(&share).unwrap();
    write_random(&src, SIZE, 5);
    let plan = FaultPlan {
        fail_after: Some(3),
        ..FaultPlan::default()
    };
    let (port, server) = faulty_server_handle(&share, plan.clone(), alg).await;
    let client = ferry_tests::connect_to("127.0.0.1", port, TransportChoice::Tcp)
        .await
        .unwrap();
    assert!(upload_file(&client, &src, "data", "dst.bin", no_progress())
        .await
        .is_err());
    // The server drops the upload when its connection ends, which it counts until
    // everything the connection held is gone: look at the share only after that.
    drop(client);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while server.connections() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the failed connection was not closed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Nothing under the final name; at most the resumable partial and its journal,
    // which a later upload of the same file would continue (whether they stay depends
    // on whether the client's close still reached the server).
    assert!(!share.join("dst.bin").exists());
    assert_only_resumable_temp_files(&share);
    assert!(plan.fired() >= 1, "the transport never failed");
}

/// Ten files `f0`..`f9` of 1000 bytes under `dir`: the middle byte of a batch of all
/// ten, which the faulty transport flips, is in `f5`.
fn ten_small_files(dir: &Path, seed: u64) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    (0..10)
        .map(|i| {
            let name = format!("f{i}");
            write_random(&dir.join(&name), 1000, seed + i);
            name
        })
        .collect()
}

/// Names with what became of them: "ok" or the error's `--json` kind.
fn outcomes(done: impl IntoIterator<Item = (String, Outcome)>) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = done
        .into_iter()
        .map(|(name, o)| {
            let what = match o {
                Outcome::Copied(_) => "ok".to_string(),
                Outcome::Failed(e) => e.kind().to_string(),
                Outcome::PerFile => "per-file".to_string(),
            };
            (name, what)
        })
        .collect();
    v.sort();
    v
}

/// `got` says every one of the ten files was copied but `bad`, whose outcome is
/// `bad_outcome` (an upload: "integrity"; a download: "per-file", left to the per-file
/// path, which asks the server to check its disk), the copied ones are byte-identical
/// in `to`, and `to` holds nothing else.
#[track_caller]
fn assert_batch(
    got: &[(String, String)],
    (from, to): (&Path, &Path),
    bad: Option<&str>,
    bad_outcome: &str,
) {
    let names: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    let is_bad = |n: &str| Some(n) == bad;
    let want: Vec<(String, String)> = names
        .iter()
        .map(|n| (n.clone(), if is_bad(n) { bad_outcome } else { "ok" }.into()))
        .collect();
    assert_eq!(got, want);
    let landed: Vec<String> = names.into_iter().filter(|n| !is_bad(n)).collect();
    for n in &landed {
        assert_eq!(
            std::fs::read(to.join(n)).unwrap(),
            std::fs::read(from.join(n)).unwrap(),
            "{n}"
        );
    }
    assert_eq!(entries(to), landed);
}

/// A client of a faulty server of `share`.
async fn faulty_client(share: &Path, plan: FaultPlan, alg: HashAlgorithm) -> ferry_client::Client {
    let port = faulty_server(share, plan, alg).await;
    ferry_tests::connect_to("127.0.0.1", port, TransportChoice::Tcp)
        .await
        .unwrap()
}

/// Uploads the ten files through a server whose READs flip as `flip_read` says;
/// returns their outcomes and how many flips happened.
async fn upload_ten(
    flip_read: Flip,
    seed: u64,
    alg: HashAlgorithm,
) -> (tempfile::TempDir, Vec<(String, String)>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (share, src) = (dir.path().join("share"), dir.path().join("src"));
    std::fs::create_dir(&share).unwrap();
    let names = ten_small_files(&src, seed);
    let plan = FaultPlan {
        flip_read,
        ..FaultPlan::default()
    };
    let client = faulty_client(&share, plan.clone(), alg).await;
    let items = names
        .iter()
        .map(|n| SmallUpload {
            src: src.join(n),
            target: n.clone(),
            size: 1000,
        })
        .collect();
    let done = upload_batch(&client, "data", items, &no_progress()).await;
    let got = outcomes(done.into_iter().map(|(i, o)| (i.target, o)));
    (dir, got, plan.fired())
}

/// Downloads the ten files through a server whose WRITEs flip as `flip_write` says;
/// returns their outcomes and how many flips happened.
async fn download_ten(
    flip_write: Flip,
    seed: u64,
    alg: HashAlgorithm,
) -> (tempfile::TempDir, Vec<(String, String)>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (share, out) = (dir.path().join("share"), dir.path().join("out"));
    std::fs::create_dir(&out).unwrap();
    let names = ten_small_files(&share, seed);
    let plan = FaultPlan {
        flip_write,
        ..FaultPlan::default()
    };
    let client = faulty_client(&share, plan.clone(), alg).await;
    let items = names
        .iter()
        .map(|n| SmallDownload {
            src: n.clone(),
            target: out.join(n),
            size: 1000,
        })
        .collect();
    let done = download_batch(&client, "data", items, &no_progress()).await;
    let got = outcomes(done.into_iter().map(|(i, o)| (i.src, o)));
    (dir, got, plan.fired())
}

/// One flipped bit in a batch's READ (upload) or WRITE (download) damages `f5` only:
/// it is sent again and every file arrives; flipped every time, `f5` alone fails.
/// Each direction checks its flips happened: exactly one for a single flip, at least
/// one per attempt for a persistent one.
async fn flip_batches(flip: Flip, bad: Option<&str>, seed: u64, alg: HashAlgorithm) {
    let fired_enough = |n: u64| match bad {
        None => n == 1,
        Some(_) => n >= WINDOW_ATTEMPTS as u64,
    };
    let (dir, got, fired) = upload_ten(flip, seed, alg).await;
    let (src, share) = (dir.path().join("src"), dir.path().join("share"));
    assert_batch(&got, (&src, &share), bad, "integrity");
    assert!(fired_enough(fired), "upload flips: {fired}");
    let (dir, got, fired) = download_ten(flip, seed + 1, alg).await;
    let (share, out) = (dir.path().join("share"), dir.path().join("out"));
    assert_batch(&got, (&share, &out), bad, "per-file");
    assert!(fired_enough(fired), "download flips: {fired}");
}

async fn a_flipped_batch_sends_the_damaged_file_again(alg: HashAlgorithm) {
    flip_batches(Flip::Nth(0), None, 20, alg).await;
}

async fn persistent_batch_corruption_fails_only_the_damaged_file(alg: HashAlgorithm) {
    flip_batches(Flip::Every, Some("f5"), 30, alg).await;
}

/// Each test above, once per hash algorithm.
macro_rules! with_both_hashes {
    ($($name:ident),* $(,)?) => {
        mod blake3 {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::HashAlgorithm::Blake3).await
                }
            )*
        }
        mod sha256 {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::HashAlgorithm::Sha256).await
                }
            )*
        }
    };
}

with_both_hashes!(
    one_flipped_upload_chunk_is_detected_and_resent,
    persistent_upload_corruption_fails_and_leaves_nothing,
    one_flipped_download_chunk_is_detected_and_refetched,
    persistent_download_corruption_fails_and_leaves_nothing,
    a_failing_transport_mid_upload_leaves_no_file_under_its_name,
    a_flipped_batch_sends_the_damaged_file_again,
    persistent_batch_corruption_fails_only_the_damaged_file,
);
