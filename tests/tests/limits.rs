//! ferryd's connection limit (`--max-connections`) and handshake deadline.
//!
//! A connection over the limit is told why (`Refused`, `Busy`, "server at its
//! connection limit (N)") and closed: rcp prints that and exits 3. ferryd counts TCP and
//! RDMA connections together, from accept, so connections that never finish their
//! handshake count too, but only until the handshake deadline (`HANDSHAKE_TIMEOUT`,
//! 10 s after accept) drops them.
//!
//! Runs on both transports: the idle connections that fill the limit are raw TCP
//! sockets, and the connections refused are rcp and the client library on the suite's
//! transport (RDMA under the Soft-RoCE suite).

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ferry_client::{Client, ClientError};
use ferry_common::proto::HANDSHAKE_TIMEOUT;
use ferry_server::MAX_REFUSING;
use ferry_tests::{
    connect, raw_greet, raw_socket, rcp_args, read_until_closed, runtime, send_signal, test_choice,
    wait_connections, write_random_file, Env,
};

const LIMIT: usize = 4;

/// What ferryd says to a connection over the limit.
const AT_LIMIT: &str = "server at its connection limit (4)";

fn limited_env(limit: usize) -> Env {
    Env::builder()
        .server_arg("--max-connections")
        .server_arg(limit.to_string())
        .start()
}

/// A session on the suite's transport that ferryd must refuse for its limit.
#[track_caller]
fn assert_refused(rt: &tokio::runtime::Runtime, env: &Env) {
    match rt.block_on(connect(env.server(), test_choice())) {
        Err(e @ ClientError::Handshake { .. }) => {
            assert!(e.to_string().contains(AT_LIMIT), "{e}");
        }
        Err(e) => panic!("refused without saying why: {e}"),
        Ok(_) => panic!("a connection over the limit was served"),
    }
}

/// Lines of ferryd's log that contain `needle`.
fn log_count(env: &Env, needle: &str) -> usize {
    env.server().log_count(needle)
}

#[test]
fn a_connection_over_the_limit_is_refused_with_a_clear_error() {
    let env = limited_env(LIMIT);
    write_random_file(&env.local("f"), 100_000, 1);
    let rt = runtime();
    let mut clients: Vec<Client> = (0..LIMIT)
        .map(|_| rt.block_on(connect(env.server(), test_choice())).unwrap())
        .collect();

    // The fifth: rcp says why and exits 3, at once.
    let out = env.rcp(rcp_args![env.local("f"), env.remote("f")]);
    out.assert_code(3).assert_stderr_has(AT_LIMIT);
    assert!(
        out.elapsed < Duration::from_secs(5),
        "rcp took {:?}",
        out.elapsed
    );
    assert!(!env.share("f").exists());
    // The library says the same, as a handshake error.
    assert_refused(&rt, &env);
    // ferryd logged both, and counts neither.
    assert_eq!(log_count(&env, &format!("refused: {AT_LIMIT}")), 2);
    wait_connections(&rt, &clients[0], LIMIT as u64);

    // Once one closes, there is room for another.
    clients.pop().unwrap().close();
    wait_connections(&rt, &clients[0], LIMIT as u64 - 1);
    env.rcp(rcp_args![env.local("f"), env.remote("f")])
        .assert_success();
    ferry_tests::assert_files_equal(&env.local("f"), &env.share("f"));
    assert_eq!(log_count(&env, &format!("refused: {AT_LIMIT}")), 2);
    env.server().assert_running();
}

#[test]
fn idle_connections_count_against_the_limit_only_until_the_handshake_deadline() {
    let env = limited_env(LIMIT);
    let rt = runtime();
    let start = Instant::now();
    // Two that send nothing at all, two that greet the transport and stop there.
    let mut silent: Vec<TcpStream> = (0..2).map(|_| raw_socket(env.server())).collect();
    let mut greeted: Vec<TcpStream> = (0..2)
        .map(|_| raw_greet(env.server(), raw_socket(env.server())).into_stream())
        .collect();
    assert_refused(&rt, &env);

    // ferryd drops each at the deadline: ferryd's greeting, then the end of stream.
    for s in &mut silent {
        assert_eq!(
            read_until_closed(s, HANDSHAKE_TIMEOUT + Duration::from_secs(10)),
            ferry_common::transport::tcp::wire::GREETING
        );
    }
    for s in &mut greeted {
        assert_eq!(
            read_until_closed(s, HANDSHAKE_TIMEOUT + Duration::from_secs(10)),
            b""
        );
    }
    let waited = start.elapsed();
    assert!(
        waited >= HANDSHAKE_TIMEOUT - Duration::from_millis(500)
            && waited < HANDSHAKE_TIMEOUT + Duration::from_secs(5),
        "idle connections were dropped after {waited:?}"
    );
    // ferryd logs each drop just after closing the socket: wait for the lines, then
    // check there are no more than two of each.
    for needle in [
        "transport not set up within 10s",
        "session closed: handshake timed out",
    ] {
        assert!(
            env.server()
                .wait_for_log(needle, 2, Duration::from_secs(10)),
            "{needle}: {}",
            env.server().stderr()
        );
        assert_eq!(log_count(&env, needle), 2, "{needle}");
    }

    // Their places are free again.
    let clients: Vec<Client> = (0..LIMIT)
        .map(|_| rt.block_on(connect(env.server(), test_choice())).unwrap())
        .collect();
    assert_refused(&rt, &env);
    wait_connections(&rt, &clients[0], LIMIT as u64);
}

#[test]
fn refusals_in_progress_are_bounded_too() {
    let env = limited_env(1);
    let _admitted = raw_socket(env.server());
    // Connections over the limit that never greet each hold a refusal for a while;
    // past MAX_REFUSING of them, the next are closed at accept without a word.
    let mut over: Vec<TcpStream> = (0..MAX_REFUSING + 8)
        .map(|_| raw_socket(env.server()))
        .collect();
    let mut greeted = 0;
    for s in &mut over {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut greeting = [0u8; 8];
        if s.read_exact(&mut greeting).is_ok() {
            greeted += 1;
        }
    }
    assert!(
        greeted <= MAX_REFUSING,
        "{greeted} refusals ran at once (at most {MAX_REFUSING})"
    );
    assert!(
        log_count(&env, "closed at accept") >= 8,
        "{}",
        env.server().stderr()
    );
    env.server().assert_running();
}

#[test]
fn a_connection_that_never_greets_does_not_hold_up_shutdown() {
    let env = limited_env(LIMIT);
    let rt = runtime();
    let _silent = raw_socket(env.server());
    let client = rt.block_on(connect(env.server(), test_choice())).unwrap();
    // Counted from accept, before its transport is up.
    wait_connections(&rt, &client, 2);
    client.close();
    let start = Instant::now();
    assert!(send_signal(env.server().pid(), "TERM"));
    let status = env
        .server()
        .wait_for_exit(Duration::from_secs(4))
        .unwrap_or_else(|| panic!("ferryd still runs {:?} after SIGTERM", start.elapsed()));
    assert!(status.success(), "{status}");
    let log = env.server().stderr();
    assert!(!log.contains("still open"), "{log}");
}
