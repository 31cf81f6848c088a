//! A client that sends requests and does not read what ferryd answers.
//!
//! - Paced so that it never has more than the allowed 256 requests outstanding (the
//!   session counts a request done once it is answered), such a client could make
//!   ferryd queue answers without end. ferryd's memory must stay bounded: once a connection
//!   has [`MAX_QUEUED_CTRL_BYTES`] of answers waiting, ferryd stops taking its requests.
//! - When ferryd ends such a connection itself (here: a malformed frame) while its
//!   one-sided WRITEs are stuck behind the unread socket, it must still let go of the
//!   connection (tasks, buffers, transfer, socket) within the transport's close grace,
//!   though the peer never reads.

use std::fs;
use std::io::Write;
use std::thread;
use std::time::{Duration, Instant};

use ferry_client::Client;
use ferry_common::codec;
use ferry_common::msg::{Message, RegionDesc, Request, Response};
use ferry_common::proto::MAX_INFLIGHT_REQUESTS;
use ferry_common::transport::{TransportChoice, MAX_QUEUED_CTRL_BYTES};
use ferry_tests::{
    connect, ctrl_frame, msg_frame, open_fds, proc_status, raw_handshake, raw_socket, runtime,
    write_random_file, Env, RawClient, MIB,
};

/// Entries of the listed directory, and the length of each name: one listing page is
/// about 50 KiB.
const ENTRIES: usize = 200;
const NAME_BYTES: usize = 200;

/// Requests the flooding client sends at most: their answers would take about 190 MiB.
const FLOOD_REQUESTS: u64 = 4000;
/// Requests sent at once, well under the 256 a client may have outstanding.
const BATCH: u64 = 128;
/// How long ferryd's request counter may stand still before the flooding client
/// concludes that ferryd has stopped reading from it.
const BATCH_WAIT: Duration = Duration::from_secs(2);

/// How long ferryd may take to let go of a connection whose peer stopped reading (the
/// TCP transport's close grace is 5 s).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(20);

/// A raw session with ferryd (see [`ferry_tests::RawClient`]). With
/// `small_receive_buffer`, the socket's receive buffer is shrunk to 4 KiB first, so
/// ferryd's writes stall soon once this side stops reading.
fn raw_session(env: &Env, small_receive_buffer: bool) -> RawClient {
    let stream = raw_socket(env.server());
    if small_receive_buffer {
        use nix::sys::socket::{setsockopt, sockopt::RcvBuf};
        setsockopt(&stream, RcvBuf, &4096).unwrap();
    }
    raw_handshake(env.server(), stream)
}

fn request(id: u64, body: Request) -> Message {
    Message::Request { id, body }
}

/// The first listing page of the large directory.
fn list_dir() -> Request {
    Request::ListDir {
        share: "data".into(),
        path: "dir".into(),
        cursor: 0,
    }
}

/// A directory whose listing page is large.
fn make_listed_dir(env: &Env) {
    fs::create_dir(env.share("dir")).unwrap();
    for i in 0..ENTRIES {
        let name = format!("{i:04}{}", "n".repeat(NAME_BYTES - 4));
        fs::write(env.share(&format!("dir/{name}")), b"").unwrap();
    }
}

/// The encoded size of one listing answer.
fn answer_bytes(rt: &tokio::runtime::Runtime, client: &Client) -> u64 {
    let body = rt.block_on(client.call(list_dir())).unwrap();
    codec::encode(&Message::Response { id: 1, body })
        .unwrap()
        .len() as u64
}

fn connect_client(rt: &tokio::runtime::Runtime, env: &Env) -> Client {
    // The raw clients speak TCP; so does this one, whatever the suite's transport.
    rt.block_on(connect(env.server(), TransportChoice::Tcp))
        .unwrap()
}

/// ferryd's request counter, less the `Stats` requests this poll and earlier ones
/// (counted in `polls`) added.
fn requests(rt: &tokio::runtime::Runtime, client: &Client, polls: &mut u64) -> u64 {
    *polls += 1;
    rt.block_on(client.server_stats()).unwrap().requests - *polls
}

/// Waits until ferryd's request counter (less our polls) reaches `target`; returns
/// false if it stops moving for `stall` first (ferryd is not taking requests).
fn wait_for_requests(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    polls: &mut u64,
    target: u64,
    stall: Duration,
) -> bool {
    let mut last = requests(rt, client, polls);
    let mut moved = Instant::now();
    while last < target {
        if moved.elapsed() > stall {
            return false;
        }
        thread::sleep(Duration::from_millis(10));
        let now = requests(rt, client, polls);
        if now != last {
            (last, moved) = (now, Instant::now());
        }
    }
    true
}

/// Waits until ferryd has let go of every connection but `client`'s: its counters are
/// back to zero and its descriptors are `idle_fds` again. Panics after
/// [`RELEASE_TIMEOUT`].
fn assert_released(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    pid: u32,
    idle_fds: &[String],
) -> Duration {
    let start = Instant::now();
    loop {
        let s = rt.block_on(client.server_stats()).unwrap();
        let fds = open_fds(pid);
        if s.connections == 1 && s.registrations == 0 && s.open_transfers == 0 && fds == idle_fds {
            return start.elapsed();
        }
        if start.elapsed() > RELEASE_TIMEOUT {
            panic!(
                "ferryd still holds the connection after {RELEASE_TIMEOUT:?}: {s:?}\n\
                 fds now {fds:?}\nidle {idle_fds:?}"
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_client_that_never_reads_cannot_grow_ferryds_memory() {
    let env = Env::new();
    make_listed_dir(&env);
    let rt = runtime();
    let client = connect_client(&rt, &env);
    let answer = answer_bytes(&rt, &client);
    let pid = env.server().pid();
    let idle_fds = open_fds(pid);

    let mut raw = raw_session(&env, false);
    raw.stream()
        .set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut polls = 0;
    let base = requests(&rt, &client, &mut polls);
    let before = proc_status(pid, "VmHWM");
    // Batch after batch, each sent once ferryd has taken the one before (so it never
    // sees more than BATCH outstanding), until ferryd stops taking them.
    let mut sent = 0;
    while sent < FLOOD_REQUESTS {
        let batch: Vec<u8> = (sent + 1..=sent + BATCH)
            .flat_map(|id| msg_frame(&request(id, list_dir())))
            .collect();
        raw.stream().write_all(&batch).unwrap();
        sent += BATCH;
        if !wait_for_requests(&rt, &client, &mut polls, base + sent, BATCH_WAIT) {
            break;
        }
    }
    let taken = requests(&rt, &client, &mut polls) - base;
    let growth = proc_status(pid, "VmHWM").saturating_sub(before);

    // What may wait: the transport's queue of control bytes, plus the answers of the
    // requests still running when it filled (at most the 256 outstanding; each held
    // decoded and then encoded: twice its size), plus a margin for the blocking
    // threads that built them.
    let bound =
        MAX_QUEUED_CTRL_BYTES as u64 + u64::from(MAX_INFLIGHT_REQUESTS) * 2 * answer + 32 * MIB;
    println!(
        "never-reading client: sent {sent} listings of {answer} bytes, ferryd took {taken}; \
         its peak RSS grew by {:.1} MiB (bound {:.1} MiB; answering all would queue \
         {:.1} MiB)",
        growth as f64 / MIB as f64,
        bound as f64 / MIB as f64,
        (FLOOD_REQUESTS * answer) as f64 / MIB as f64,
    );
    assert!(
        taken < FLOOD_REQUESTS,
        "ferryd answered all {FLOOD_REQUESTS} requests into a socket nobody reads"
    );
    assert!(
        growth <= bound,
        "ferryd's peak RSS grew by {growth} bytes for a client that does not read (bound {bound})"
    );

    // Reset by the peer: ferryd ends the connection and frees what it held.
    drop(raw);
    let took = assert_released(&rt, &client, pid, &idle_fds);
    println!("released {took:?} after the reset");
    env.server().assert_running();
}

#[test]
fn a_connection_ended_by_ferryd_is_released_though_the_peer_never_reads() {
    let env = Env::new();
    let rt = runtime();
    let client = connect_client(&rt, &env);
    let pid = env.server().pid();
    let idle_fds = open_fds(pid);
    let size = 32 * MIB;
    write_random_file(&env.share("big.bin"), size, 6);

    // A download whose WRITEs land in a socket that is never read: they cannot
    // complete, so the window's request task waits on them.
    let mut raw = raw_session(&env, true);
    raw.send(&request(
        1,
        Request::DownloadOpen {
            share: "data".into(),
            path: "big.bin".into(),
        },
    ));
    let transfer = match raw.recv_msg() {
        Message::Response {
            body: Response::DownloadOpened { transfer, .. },
            ..
        } => transfer,
        other => panic!("expected DownloadOpened, got {other:?}"),
    };
    let region = RegionDesc {
        addr: 1 << 30,
        len: 16 * MIB,
        rkey: 7,
    };
    for (id, offset) in [(2, 0), (3, 16 * MIB)] {
        raw.send(&request(
            id,
            Request::DownloadWindow {
                transfer,
                offset,
                region,
                verify: false,
            },
        ));
    }
    let mut polls = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = rt.block_on(client.server_stats()).unwrap();
        polls += 1;
        if s.requests - polls >= 3 && s.registrations > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ferryd did not start the windows: {s:?}"
        );
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(200));

    // A frame that does not decode: ferryd ends the session itself.
    raw.send_bytes(&ctrl_frame(&[0xee, 0xee, 0xee])).unwrap();
    let took = assert_released(&rt, &client, pid, &idle_fds);
    println!("released {took:?} after the malformed frame, the peer reading nothing");
    // The peer held its end, unread, until now.
    drop(raw);
    assert!(env.server().stderr().contains("malformed control message"));
    env.server().assert_running();
}
