//! ferryd's admission of connections that have not authenticated yet, and its limit on
//! failed authentications (issue 44, point 2):
//!
//! - an idle flood from one address (127.0.0.2) holds at most
//!   `--max-startups-per-source` slots, the rest are refused at once, and a real rcp
//!   copy from 127.0.0.1 meanwhile succeeds byte for byte;
//! - a server full of authenticated sessions (and a flood) tells the next client the
//!   documented "server at its connection limit (N)", not an early end of stream;
//! - a connection that has not authenticated within `--startup-timeout` is closed,
//!   even one whose handshake finished; an authenticated one is not;
//! - past `--max-auth-failures`, the address is refused with "too many failed
//!   authentications from ADDR, retry in S s", logged once, while another address
//!   still gets in.
//!
//! Every 127.0.0.0/8 address is loopback on Linux: the flooding sockets bind
//! 127.0.0.2, and rcp and the client library connect from 127.0.0.1.

use std::io::Write;
use std::net::{Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use ferry_client::Client;
use ferry_common::msg::{Message, Request, Response};
use ferry_common::transport::tcp::wire::{Header, GREETING};
use ferry_tests::{
    assert_files_equal, connect, frame_bytes, hello, raw_greet, raw_handshake, raw_socket_from,
    rcp_args, rcp_env, read_until_closed, runtime, test_choice, wait_connections,
    write_random_file, Env, RawClient, MIB,
};

/// The address the floods and other peers come from.
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Exit code of rcp for an authentication failure.
const RCP_AUTH: i32 = 7;

/// Exit code of rcp when the server refuses the session at the handshake (busy, or
/// the address refused).
const RCP_REFUSED: i32 = 3;

/// Lines of ferryd's log that contain `needle`.
fn log_count(env: &Env, needle: &str) -> usize {
    env.server().log_count(needle)
}

/// `n` connections from [`OTHER`] that never authenticate: every other one sends
/// nothing at all, the others greet the transport and send half a control frame.
fn idle_flood(env: &Env, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| {
            let mut s = raw_socket_from(env.server(), OTHER);
            if i % 2 == 1 {
                // A control frame's header claiming 64 bytes, and 3 of them.
                let mut half = GREETING.to_vec();
                half.extend_from_slice(&frame_bytes(Header::Ctrl { len: 64 }, &[0x7a; 3]));
                // ferryd may have closed a refused one already.
                let _ = s.write_all(&half);
            }
            s
        })
        .collect()
}

#[test]
fn an_idle_flood_from_one_address_does_not_keep_a_copy_from_another_out() {
    // The flood outlives the copy: only the per-source limit keeps it out.
    let env = Env::builder()
        .server_arg("--max-connections=16")
        .server_arg("--max-startups-per-source=4")
        .server_arg("--startup-timeout=60s")
        .start();
    write_random_file(&env.local("f"), 8 * MIB, 1);
    let flood = idle_flood(&env, 600);
    assert!(
        env.server().wait_for_log(
            "too many unauthenticated connections from 127.0.0.2 (at most 4 at once)",
            100,
            Duration::from_secs(20)
        ),
        "{}",
        env.server().stderr()
    );

    let out = env.rcp(rcp_args![env.local("f"), env.remote("f")]);
    out.assert_success();
    assert!(out.elapsed < Duration::from_secs(20), "{:?}", out.elapsed);
    assert_files_equal(&env.local("f"), &env.share("f"));
    let back = env.rcp(rcp_args![env.remote("f"), env.local("back")]);
    back.assert_success();
    assert_files_equal(&env.local("f"), &env.local("back"));

    // The flood still holds its four: ferryd counts them and this session.
    let rt = runtime();
    let client = rt.block_on(connect(env.server(), test_choice())).unwrap();
    wait_connections(&rt, &client, 5);
    drop(flood);
    wait_connections(&rt, &client, 1);
    env.server().assert_running();
}

#[test]
fn a_server_full_of_sessions_says_so_even_under_a_flood() {
    let env = Env::builder()
        .server_arg("--max-connections=8")
        .server_arg("--max-startups-per-source=4")
        .start();
    write_random_file(&env.local("f"), 100_000, 2);
    let _flood = idle_flood(&env, 200);
    let rt = runtime();
    // The flood holds 4 slots; 4 sessions from 127.0.0.1 take the rest.
    let clients: Vec<Client> = (0..4)
        .map(|_| rt.block_on(connect(env.server(), test_choice())).unwrap())
        .collect();
    wait_connections(&rt, &clients[0], 8);

    let out = env.rcp(rcp_args![env.local("f"), env.remote("f")]);
    out.assert_code(RCP_REFUSED)
        .assert_stderr_has("server at its connection limit (8)");
    assert!(!out.stderr.contains("early eof"), "{}", out.stderr);
    assert!(!env.share("f").exists());
    env.server().assert_running();
}

/// How long an idle connection may take to be closed, at most.
const CLOSE_WITHIN: Duration = Duration::from_secs(15);

/// A session from [`OTHER`] whose handshake finished (ferryd welcomed it) and that
/// proves nothing.
fn welcomed(env: &Env) -> RawClient {
    let mut raw = raw_greet(env.server(), raw_socket_from(env.server(), OTHER));
    raw.send(&Message::Hello(hello()));
    match raw.recv_msg() {
        Message::Welcome(_) => raw,
        other => panic!("ferryd did not welcome us: {other:?}"),
    }
}

#[test]
fn connections_that_do_not_authenticate_in_time_are_closed_and_sessions_are_not() {
    let env = Env::builder().server_arg("--startup-timeout=2s").start();
    let start = Instant::now();
    let mut silent = raw_socket_from(env.server(), OTHER);
    let welcomed = welcomed(&env);
    let mut session = raw_handshake(env.server(), raw_socket_from(env.server(), OTHER));

    assert_eq!(read_until_closed(&mut silent, CLOSE_WITHIN), GREETING);
    let mut welcomed = welcomed.into_stream();
    assert_eq!(read_until_closed(&mut welcomed, CLOSE_WITHIN), b"");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(8),
        "closed after {waited:?}"
    );
    for needle in [
        "transport not set up within 2s",
        "connection closed: not authenticated within 2s",
    ] {
        assert!(
            env.server()
                .wait_for_log(needle, 1, Duration::from_secs(10)),
            "{needle}: {}",
            env.server().stderr()
        );
        assert_eq!(log_count(&env, needle), 1, "{needle}");
    }
    // The authenticated session outlived the deadline and is served.
    assert!(start.elapsed() > Duration::from_secs(2));
    match session.call(Request::Stats) {
        Response::Stats(s) => assert_eq!(s.connections, 1),
        other => panic!("{other:?}"),
    }
}

#[test]
fn failed_authentications_are_limited_per_address() {
    let env = Env::builder()
        .server_arg("--max-auth-failures=3/60s")
        .start();
    write_random_file(&env.local("f"), 100_000, 3);
    // rcp connects from the address it connects to: 127.0.0.1 on the host, the VM's
    // own address in the Soft-RoCE suite.
    let me = env.server().addr().rsplit_once(':').unwrap().0.to_owned();
    let wrong: &[(&str, Option<&str>)] = &[("FERRY_SECRET", Some("not-the-secret-of-this-share"))];
    for _ in 0..3 {
        rcp_env(wrong, rcp_args![env.local("f"), env.remote("f")])
            .assert_code(RCP_AUTH)
            .assert_stderr_has("wrong secret for share 'data'");
    }
    // The right secret from the same address is refused now, twice, saying why.
    for _ in 0..2 {
        // rcp exits as for any session the server refused at the handshake.
        let out = env.rcp(rcp_args![env.local("f"), env.remote("f")]);
        out.assert_code(RCP_REFUSED).assert_stderr_has(&format!(
            "too many failed authentications from {me}, retry in"
        ));
    }
    assert!(!env.share("f").exists());
    // Another address still gets in.
    let mut other = raw_handshake(env.server(), raw_socket_from(env.server(), OTHER));
    assert!(matches!(other.call(Request::Stats), Response::Stats(_)));
    // Logged once, when the address ran out; its refusals within the window are not.
    assert_eq!(
        log_count(&env, &format!("refusing connections from {me} for")),
        1,
        "{}",
        env.server().stderr()
    );
    assert_eq!(
        log_count(&env, &format!("too many failed authentications from {me}")),
        0,
        "{}",
        env.server().stderr()
    );
    env.server().assert_running();
}
