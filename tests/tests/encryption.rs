//! Encrypted sessions end to end: real ferryd and rcp processes, with a proxy on the
//! wire that records, flips, drops, replays and reorders frames, and a middlebox that
//! strips the encryption offer.
//!
//! The proxies speak the TCP transport's framing, so those tests run on TCP (on the
//! host); the tests that only look at what rcp reports run on whatever transport the
//! suite runs on (RDMA in the Soft-RoCE VM).

use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use ferry_common::codec;
use ferry_common::msg::Message;
use ferry_common::transport::tcp::wire::{CTRL, GREETING};
use ferry_tests::{
    assert_files_equal, replay, write_random_file, Direction, Env, Fault, FaultKind, TamperProxy,
    MIB,
};

fn on_tcp() -> bool {
    ferry_tests::test_transport() == "tcp"
}

/// A server with ferryd's defaults for encryption (every share `required`).
fn required_env() -> Env {
    Env::builder().server_env("FERRYD_ENCRYPTION", None).start()
}

/// A name nobody would find in a frame by chance.
const NAME: &str = "quarterly-report-7f3a9c.bin";

fn upload(env: &Env, remote: &str, extra: &[&str]) -> ferry_tests::RcpOutput {
    let mut args: Vec<String> = vec!["--transport".into(), "tcp".into(), "--json".into()];
    args.extend(extra.iter().map(|s| s.to_string()));
    args.push(env.local(NAME).display().to_string());
    args.push(remote.to_string());
    env.rcp(args)
}

fn json(out: &ferry_tests::RcpOutput) -> serde_json::Value {
    serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

/// Writes `len` random bytes (from `seed`) to `path` and returns them.
fn known_file(path: &std::path::Path, len: u64, seed: u64) -> Vec<u8> {
    write_random_file(path, len, seed);
    fs::read(path).unwrap()
}

/// Windows of the file's bytes a recording must not contain.
fn samples(data: &[u8]) -> Vec<&[u8]> {
    (0..16)
        .map(|i| {
            let at = i * (data.len() - 64) / 15;
            &data[at..at + 64]
        })
        .collect()
}

#[test]
fn copies_report_their_encryption_and_the_default_share_refuses_clear_sessions() {
    let env = required_env();
    write_random_file(&env.local(NAME), MIB + 17, 1);
    let out = env.rcp([
        "--json".into(),
        env.local(NAME).into_os_string(),
        env.remote(NAME).into(),
    ]);
    out.assert_success();
    let j = json(&out);
    assert_eq!(j["encrypted"], true, "{j}");
    assert!(
        ["aes256gcm", "chacha20poly1305"].contains(&j["encryption"].as_str().unwrap()),
        "{j}"
    );
    assert_files_equal(&env.local(NAME), &env.share(NAME));
    // Download too, on the suite's transport (RDMA in the VM).
    let back = env.local("back.bin");
    let out = env.rcp([
        "--json".into(),
        env.remote(NAME).into(),
        back.clone().into_os_string(),
    ]);
    out.assert_success();
    assert_eq!(json(&out)["encrypted"], true);
    assert_files_equal(&env.local(NAME), &back);
    // A client that does not encrypt is refused by a share that requires it, by
    // name, and writes nothing.
    let out = env.rcp([
        "--encryption".into(),
        "off".into(),
        env.local(NAME).into_os_string(),
        env.remote("clear.bin").into(),
    ]);
    out.assert_failure()
        .assert_stderr_has("requires an encrypted session");
    assert!(!env.share("clear.bin").exists());
    assert!(env.server().stderr().contains("session not encrypted"));
}

#[test]
fn a_recording_proxy_sees_neither_the_bytes_nor_the_name() {
    if !on_tcp() {
        return;
    }
    let env = required_env();
    let data = known_file(&env.local(NAME), 3 * MIB + 1234, 2);
    let data_len = data.len();
    let proxy = TamperProxy::start(env.server().addr(), None);
    upload(&env, &proxy.remote("data", NAME), &[]).assert_success();
    assert_files_equal(&env.local(NAME), &env.share(NAME));
    let back = env.local("back.bin");
    env.rcp([
        "--transport".into(),
        "tcp".into(),
        proxy.remote("data", NAME),
        back.display().to_string(),
    ])
    .assert_success();
    assert_files_equal(&env.local(NAME), &back);
    assert!(proxy.connections() >= 2);
    let recorded = proxy.recorded_all(Direction::ClientToServer).len()
        + proxy.recorded_all(Direction::ServerToClient).len();
    assert!(
        recorded > 2 * data_len,
        "the file crossed the proxy both ways"
    );
    assert!(
        !proxy.contains(NAME.as_bytes()),
        "the file name crossed in the clear"
    );
    for s in samples(&data) {
        assert!(!proxy.contains(s), "file bytes crossed in the clear");
    }

    // The same check sees both in a session in the clear (the proxy records what it
    // should): a share that allows it, a client that asks for it.
    let clear = Env::new();
    write_random_file(&clear.local(NAME), data_len as u64, 2);
    let proxy = TamperProxy::start(clear.server().addr(), None);
    let out = upload(
        &clear,
        &proxy.remote("data", NAME),
        &["--encryption", "off"],
    );
    out.assert_success();
    assert_eq!(json(&out)["encrypted"], false);
    assert!(proxy.contains(NAME.as_bytes()));
    assert!(samples(&data).iter().all(|s| proxy.contains(s)));
}

/// Uploads through a proxy with `fault`: the copy must fail cleanly and leave no file
/// under the final name; then a clean run succeeds (ferryd kept serving).
fn tampered_upload_fails_cleanly(fault: Fault) {
    let env = required_env();
    write_random_file(&env.local(NAME), 6 * MIB + 3, 3);
    let proxy = TamperProxy::start(env.server().addr(), Some(fault));
    let out = upload(&env, &proxy.remote("data", NAME), &[]);
    assert_eq!(proxy.fired(), 1, "the fault fired: {}", out.stderr);
    out.assert_failure();
    assert!(!env.share(NAME).exists(), "nothing under the final name");
    let clean = upload(&env, &env.remote(NAME), &[]);
    clean.assert_success();
    assert_files_equal(&env.local(NAME), &env.share(NAME));
    let log = env.server().stderr();
    // The side that received the forged frame says why it ended the session.
    assert!(
        log.contains("failed authentication")
            || clean.stderr.contains("failed authentication")
            || out.stderr.contains("failed authentication"),
        "rcp: {}\nferryd: {log}",
        out.stderr
    );
}

#[test]
fn flipped_dropped_replayed_and_reordered_frames_fail_the_copy_cleanly() {
    if !on_tcp() {
        return;
    }
    // Client-to-server control frames: 1 is the hello (in the clear), then sealed
    // requests and the answers to the server's pulls; 6 is well inside the transfer.
    for kind in [
        FaultKind::FlipCtrl,
        FaultKind::DropCtrl,
        FaultKind::ReplayCtrl,
        FaultKind::SwapCtrl,
    ] {
        tampered_upload_fails_cleanly(Fault::new(kind, Direction::ClientToServer, 6));
        tampered_upload_fails_cleanly(Fault::new(kind, Direction::ServerToClient, 4));
    }
    // Ciphertext of the file data itself, on its way to the server (the answer to the
    // server's READ of the client's scratch).
    tampered_upload_fails_cleanly(Fault::new(
        FaultKind::FlipData,
        Direction::ClientToServer,
        2,
    ));
}

#[test]
fn a_tampered_download_leaves_no_file_and_the_next_one_succeeds() {
    if !on_tcp() {
        return;
    }
    let env = required_env();
    write_random_file(&env.share(NAME), 5 * MIB + 9, 4);
    for fault in [
        // The answer to the client's READ of the server's scratch.
        Fault::new(FaultKind::FlipData, Direction::ServerToClient, 2),
        Fault::new(FaultKind::FlipCtrl, Direction::ServerToClient, 5),
        Fault::new(FaultKind::DropCtrl, Direction::ServerToClient, 5),
    ] {
        let proxy = TamperProxy::start(env.server().addr(), Some(fault));
        let dest = env.local("down.bin");
        let out = env.rcp([
            "--transport".into(),
            "tcp".into(),
            proxy.remote("data", NAME),
            dest.display().to_string(),
        ]);
        assert_eq!(proxy.fired(), 1, "{}", out.stderr);
        out.assert_failure();
        assert!(!dest.exists(), "nothing under the final name");
        env.rcp([
            "--transport".into(),
            "tcp".into(),
            env.remote(NAME),
            dest.display().to_string(),
        ])
        .assert_success();
        assert_files_equal(&env.share(NAME), &dest);
        fs::remove_file(&dest).unwrap();
    }
}

#[test]
fn a_recorded_session_replayed_to_ferryd_is_refused() {
    if !on_tcp() {
        return;
    }
    let env = required_env();
    write_random_file(&env.local(NAME), 2 * MIB, 5);
    let proxy = TamperProxy::start(env.server().addr(), None);
    upload(&env, &proxy.remote("data", NAME), &[]).assert_success();
    fs::remove_file(env.share(NAME)).unwrap();
    let recorded = proxy.recorded(0, Direction::ClientToServer);
    let outcome = replay(env.server().addr(), &recorded, Duration::from_secs(10));
    assert!(outcome.closed, "ferryd ended the replayed session");
    assert!(!env.share(NAME).exists(), "the replay wrote nothing");
    // Refused by whichever layer met the replay first: the sealed records (the
    // recorded `Auth` does not open under this session's keys) or the transport
    // (answers to READs this connection never issued).
    let log = env.server().stderr();
    assert!(
        log.contains("failed authentication") || log.contains("transport protocol violation"),
        "{log}"
    );
    // ferryd keeps serving.
    upload(&env, &env.remote(NAME), &[]).assert_success();
}

/// A middlebox that rewrites the first control frame of one direction (the hello, or
/// the welcome) without any `encrypt*` capability, and forwards everything else.
struct Stripper {
    addr: String,
}

impl Stripper {
    fn start(upstream: String, strip: Direction) -> Stripper {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        thread::spawn(move || {
            let Ok((client, _)) = listener.accept() else {
                return;
            };
            let server = TcpStream::connect(&upstream).unwrap();
            let pipe = |mut from: TcpStream, mut to: TcpStream, rewrite: bool| {
                thread::spawn(move || {
                    let mut greeting = [0u8; 8];
                    if from.read_exact(&mut greeting).is_err() || greeting != GREETING {
                        return;
                    }
                    let _ = to.write_all(&greeting);
                    if rewrite {
                        let mut head = [0u8; 5];
                        if from.read_exact(&mut head).is_err() || head[0] != CTRL {
                            return;
                        }
                        let len = u32::from_le_bytes(head[1..].try_into().unwrap()) as usize;
                        let mut body = vec![0u8; len];
                        from.read_exact(&mut body).unwrap();
                        let msg = match codec::decode(&body).unwrap() {
                            Message::Hello(mut h) => {
                                h.capabilities.retain(|c| !c.name.starts_with("encrypt"));
                                Message::Hello(h)
                            }
                            Message::Welcome(mut w) => {
                                w.capabilities.retain(|c| !c.name.starts_with("encrypt"));
                                Message::Welcome(w)
                            }
                            other => other,
                        };
                        let body = codec::encode(&msg).unwrap();
                        let _ = to.write_all(&[CTRL]);
                        let _ = to.write_all(&(body.len() as u32).to_le_bytes());
                        let _ = to.write_all(&body);
                    }
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(Shutdown::Write);
                })
            };
            let a = pipe(
                client.try_clone().unwrap(),
                server.try_clone().unwrap(),
                strip == Direction::ClientToServer,
            );
            let b = pipe(server, client, strip == Direction::ServerToClient);
            let _ = (a.join(), b.join());
        });
        Stripper { addr }
    }

    fn remote(&self, rel: &str) -> String {
        format!("{}:data/{rel}", self.addr)
    }
}

#[test]
fn a_middlebox_that_strips_the_offer_is_refused() {
    if !on_tcp() {
        return;
    }
    let env = required_env();
    write_random_file(&env.local(NAME), MIB, 6);
    let addr = env.server().addr().to_string();
    // Stripped from the hello: the server sees a client that does not encrypt, and
    // the share requires it.
    let mb = Stripper::start(addr.clone(), Direction::ClientToServer);
    upload(&env, &mb.remote(NAME), &[])
        .assert_failure()
        .assert_stderr_has("requires an encrypted session");
    // Stripped from the welcome: a client that requires encryption refuses the
    // session before it sends anything else.
    let mb = Stripper::start(addr.clone(), Direction::ServerToClient);
    upload(&env, &mb.remote(NAME), &["--encryption", "required"])
        .assert_failure()
        .assert_stderr_has("requires encryption");
    // Stripped from the welcome, client merely preferring: the server seals, the
    // client does not; the session breaks, nothing is written.
    let mb = Stripper::start(addr, Direction::ServerToClient);
    upload(&env, &mb.remote(NAME), &[]).assert_failure();
    assert!(!env.share(NAME).exists());
    // Without a middlebox all is well.
    upload(&env, &env.remote(NAME), &["--encryption", "required"]).assert_success();
    assert_files_equal(&env.local(NAME), &env.share(NAME));
}

#[test]
fn the_mount_and_backups_cross_a_recording_proxy_encrypted_too() {
    if !on_tcp() {
        return;
    }
    let env = required_env();
    let data = known_file(&env.share(NAME), 2 * MIB + 77, 7);
    // A backup of a directory holding a second file with a known name and content.
    let src = env.local("src");
    fs::create_dir(&src).unwrap();
    const BACKED_UP: &str = "ledger-5d1e2b.bin";
    write_random_file(&src.join(BACKED_UP), MIB + 3, 8);
    let backed = fs::read(src.join(BACKED_UP)).unwrap();
    let proxy = TamperProxy::start(env.server().addr(), None);
    env.rcp([
        "backup".into(),
        "--transport".into(),
        "tcp".into(),
        src.display().to_string(),
        proxy.remote("data", "backups"),
    ])
    .assert_success();
    // The mount reads one file and writes another through the same proxy.
    if !ferry_tests::skip_without_fuse("the_mount_crosses_a_recording_proxy_encrypted") {
        let mount = ferry_tests::Mount::builder(proxy.remote("data", ""))
            .transport("tcp")
            .start();
        assert!(mount.log().contains("encrypted with"), "{}", mount.log());
        assert_eq!(fs::read(mount.join(NAME)).unwrap(), data);
        fs::write(mount.join("written-by-mount.bin"), &backed).unwrap();
        mount.unmount();
        assert_eq!(fs::read(env.share("written-by-mount.bin")).unwrap(), backed);
        assert!(!proxy.contains(b"written-by-mount"));
    }
    assert!(proxy.connections() >= 1);
    for needle in [NAME.as_bytes(), BACKED_UP.as_bytes()] {
        assert!(!proxy.contains(needle), "a name crossed in the clear");
    }
    for s in samples(&data).into_iter().chain(samples(&backed)) {
        assert!(!proxy.contains(s), "file bytes crossed in the clear");
    }
}

/// What ferryd logs each time it moves to new keys for what it sends, and each time
/// it opens a client's key update.
const SENT_UPDATE: &str = "key update: this side now sends under new keys";
const RECEIVED_UPDATE: &str = "key update: the peer now sends under new keys";

/// A server with ferryd's encryption defaults that updates its keys after every
/// 4 MiB it sends under one.
fn rekeying_env() -> Env {
    Env::builder()
        .server_env("FERRYD_ENCRYPTION", None)
        .server_env("FERRYD_REKEY_AFTER", Some("4M"))
        .start()
}

fn count(log: &str, what: &str) -> usize {
    log.matches(what).count()
}

/// A copy from `from` to `to` by rcp with `--rekey-after 4M`, on the suite's
/// transport (RDMA in the VM).
fn rekeying_copy(env: &Env, from: String, to: String) -> ferry_tests::RcpOutput {
    env.rcp(["--json", "--rekey-after", "4M", &from, &to].map(String::from))
}

#[test]
fn keys_update_every_4_mib_both_ways_and_64_mib_cross_intact() {
    let env = rekeying_env();
    write_random_file(&env.local(NAME), 64 * MIB + 5, 11);
    let local = env.local(NAME).display().to_string();
    let out = rekeying_copy(&env, local, env.remote(NAME));
    out.assert_success();
    assert_eq!(json(&out)["encrypted"], true, "{}", out.stdout);
    assert_files_equal(&env.local(NAME), &env.share(NAME));
    // rcp sealed 64 MiB in 1 MiB pieces: a new key every 4 pieces, each announced to
    // ferryd by an update of the control key.
    let log = env.server().stderr();
    let received = count(&log, RECEIVED_UPDATE);
    assert!(
        (8..=20).contains(&received),
        "{received} updates from rcp\n{log}"
    );
    assert_eq!(count(&log, SENT_UPDATE), 0, "ferryd sent no file data yet");
    // Down: ferryd seals, so ferryd updates.
    let dest = env.local("down.bin");
    rekeying_copy(&env, env.remote(NAME), dest.display().to_string()).assert_success();
    assert_files_equal(&env.local(NAME), &dest);
    let log = env.server().stderr();
    let sent = count(&log, SENT_UPDATE);
    assert!((8..=20).contains(&sent), "{sent} updates by ferryd\n{log}");
    assert!(!log.contains("failed authentication"), "{log}");
}

#[test]
fn a_flip_after_key_updates_still_fails_the_copy() {
    if !on_tcp() {
        return;
    }
    // Data frame 24 (a 1 MiB piece) and control frame 30 from rcp (about 40 go each
    // way in this copy): both after rcp's first key updates (one per 4 pieces), which
    // ferryd's log must show before the failure.
    for fault in [
        Fault::new(FaultKind::FlipData, Direction::ClientToServer, 24),
        Fault::new(FaultKind::FlipCtrl, Direction::ClientToServer, 30),
    ] {
        let env = rekeying_env();
        write_random_file(&env.local(NAME), 32 * MIB, 12);
        let proxy = TamperProxy::start(env.server().addr(), Some(fault));
        let out = upload(&env, &proxy.remote("data", NAME), &["--rekey-after", "4M"]);
        assert_eq!(proxy.fired(), 1, "{fault:?} fired: {}", out.stderr);
        out.assert_failure();
        assert!(!env.share(NAME).exists(), "nothing under the final name");
        let log = env.server().stderr();
        assert!(
            count(&log, RECEIVED_UPDATE) >= 2,
            "keys were updated before the flip: {log}"
        );
        assert!(
            log.contains("failed authentication") || out.stderr.contains("failed authentication"),
            "rcp: {}\nferryd: {log}",
            out.stderr
        );
        let clean = upload(&env, &env.remote(NAME), &["--rekey-after", "4M"]);
        clean.assert_success();
        assert_files_equal(&env.local(NAME), &env.share(NAME));
    }
}
