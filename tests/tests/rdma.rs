//! Proof that file data really moves by RDMA READ/WRITE on a kernel RDMA device.
//!
//! These tests read the device's hardware counters, so they need one: they are
//! `#[ignore]`d on ordinary machines and run by `scripts/test-rdma.sh` with `--ignored`
//! inside the Soft-RoCE VM, where `FERRY_TEST_TRANSPORT=rdma`, `FERRY_TEST_ADDR` is the
//! device's address and `FERRY_RDMA_DEV` names it.
//!
//! rxe counts packets (`sent_pkts`, `rcvd_pkts`) and SEND messages (`rdma_sends`,
//! `rdma_recvs`, which also count the connection manager's own handshake, about 42 per
//! connection). Client and server share one device here, so every packet is counted
//! once sent and once received. A file of `N` bytes moved by READ or WRITE costs at least
//! `N / 4096` packets (4096 is the largest RoCE MTU), while Ferry's control messages
//! are a handful of SENDs per window.

use std::fs;
use std::path::PathBuf;

use ferry_tests::{
    assert_files_equal, rcp_args, write_random_file, Env, Server, ServerOptions, Share, MIB,
};

fn counter_dir() -> PathBuf {
    let dev = std::env::var("FERRY_RDMA_DEV").unwrap_or_else(|_| "rxe0".into());
    PathBuf::from(format!("/sys/class/infiniband/{dev}/ports/1/hw_counters"))
}

#[derive(Debug, Clone, Copy)]
struct Counters {
    sent_pkts: u64,
    rdma_sends: u64,
}

fn counters() -> Counters {
    let read = |name: &str| -> u64 {
        let p = counter_dir().join(name);
        fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    Counters {
        sent_pkts: read("sent_pkts"),
        rdma_sends: read("rdma_sends"),
    }
}

/// Runs `copy` and checks that the device carried `bytes` as one-sided traffic.
fn assert_moved_by_rdma(bytes: u64, what: &str, copy: impl FnOnce()) {
    let before = counters();
    let started = std::time::Instant::now();
    copy();
    let seconds = started.elapsed().as_secs();
    let after = counters();
    let pkts = after.sent_pkts - before.sent_pkts;
    let sends = after.rdma_sends - before.rdma_sends;
    eprintln!("{what}: {bytes} bytes -> {pkts} packets, {sends} SEND messages in {seconds} s");
    assert!(
        pkts >= bytes / 4096,
        "{what}: only {pkts} packets on the device for {bytes} bytes: the data did not move by RDMA"
    );
    // Control traffic: rdma_cm's handshake (~42) plus a few messages per 16 MiB window;
    // an encrypted session (the default) adds three small records per 1 MiB piece
    // (PULL or PUSH and their answers, docs/protocol.md section 9) and one ALIVE a
    // side every 2 s.
    let limit = 100 + 4 * bytes.div_ceil(MIB) + seconds + 2;
    assert!(
        sends <= limit,
        "{what}: {sends} SEND messages (most {limit}): control traffic is not small"
    );
    assert!(
        sends * 50 < pkts,
        "{what}: {sends} SENDs against {pkts} packets: data seems to travel in control messages"
    );
}

#[test]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh runs it in the Soft-RoCE VM"]
fn upload_and_download_move_the_file_by_rdma_read_and_write() {
    assert_eq!(
        ferry_tests::test_transport(),
        "rdma",
        "run under FERRY_TEST_TRANSPORT=rdma"
    );
    let env = Env::new();
    let len = 48 * MIB + 5;
    let src = env.local("src.bin");
    write_random_file(&src, len, 42);

    // Upload: the server pulls the client's registered source window with RDMA READ.
    assert_moved_by_rdma(len, "upload (RDMA READ)", || {
        let out = env.rcp(rcp_args!["--json", src, env.remote("up.bin")]);
        out.assert_success();
        assert_eq!(out.json()["transport"], "rdma", "{out}");
    });
    assert_files_equal(&src, &env.share("up.bin"));

    // Download: the server pushes into the client's registered buffers with RDMA WRITE.
    let back = env.local("back.bin");
    assert_moved_by_rdma(len, "download (RDMA WRITE)", || {
        let out = env.rcp(rcp_args!["--json", env.remote("up.bin"), back]);
        out.assert_success();
        assert_eq!(out.json()["transport"], "rdma", "{out}");
    });
    assert_files_equal(&src, &back);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh runs it in the Soft-RoCE VM"]
fn forcing_rdma_to_loopback_fails_clearly() {
    // rdma_cm cannot route 127.0.0.1 on RoCE: forcing RDMA there is a clear exit-3
    // error naming RDMA, not a crash or a hang.
    let env = Env::new();
    let src = env.local("f");
    write_random_file(&src, 1000, 1);
    let port = env.server().addr().rsplit_once(':').unwrap().1.to_string();
    let loopback = format!("127.0.0.1:{port}:data/f");
    let out = env.rcp(rcp_args!["--transport", "rdma", &src, &loopback]);
    assert_eq!(out.code, Some(3), "{out}");
    out.assert_stderr_has("RDMA");
}

#[test]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh runs it in the Soft-RoCE VM"]
fn a_named_port_rdma_cannot_have_is_served_over_tcp_alone() {
    // TCP and the RDMA connection manager have separate port spaces. An RDMA-only
    // ferryd holds port P in the RDMA space, so P is free for TCP but not for RDMA: a
    // second ferryd told to listen on P (transport auto) warns and serves TCP alone,
    // and both keep serving.
    //
    // P comes from the same ephemeral range as outgoing TCP connections, so TCP may
    // hold it too (the second ferryd then cannot listen at all): take another P.
    let mut tries = 0;
    let (env, tcp_only) = loop {
        tries += 1;
        let env = Env::builder()
            .share("data", false)
            .server_arg("--transport")
            .server_arg("rdma")
            .start();
        let second = Server::try_start_with(
            &[Share::rw("data", env.share_dir("data"))],
            ServerOptions {
                listen: Some(env.server().addr().to_owned()),
                ..ServerOptions::default()
            },
        );
        match second {
            Ok(server) => break (env, server),
            Err(e) if tries < 5 && e.contains("Address already in use") => {
                eprintln!("port {} is taken for TCP too; again", env.server().port());
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(tcp_only.addr(), env.server().addr());
    let log = tcp_only.stderr();
    assert!(
        log.contains("serving TCP only") && log.contains("Address already in use"),
        "ferryd should warn that RDMA cannot have the port:\n{log}"
    );

    let src = env.local("f");
    write_random_file(&src, 3 * MIB + 7, 9);
    let out = env.rcp(rcp_args![
        "--transport",
        "tcp",
        &src,
        &tcp_only.remote("data", "by-tcp")
    ]);
    out.assert_success();
    let out = env.rcp(rcp_args![
        "--transport",
        "rdma",
        &src,
        &env.remote("by-rdma")
    ]);
    out.assert_success();
    assert_files_equal(&src, &env.share("by-tcp"));
    assert_files_equal(&src, &env.share("by-rdma"));
    tcp_only.assert_running();
    env.server().assert_running();
}
