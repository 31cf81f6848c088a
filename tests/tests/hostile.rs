//! Hostile input: a hand-written client ([`RawClient`]) speaks the TCP transport's
//! frames directly to a real ferryd process and sends what rcp never would: truncated,
//! oversized and malformed frames, unknown frame kinds and enum tags, messages out of
//! order, paths that try to leave the share, one-sided READs and WRITEs outside the
//! regions ferryd advertised, and a barrage of such connections at once.
//!
//! Each case gets a typed answer (an error response, a `Refused`, an error status of a
//! one-sided operation) or, at worst, the end of its own connection, which ferryd
//! logs; a client that connected before the case keeps working through it; no file
//! outside the share is read or written; and ferryd's memory, descriptors and
//! connection count come back to what they were.
//!
//! TCP only, by nature: the raw client speaks the TCP transport, so the Soft-RoCE
//! suite leaves this file out (`scripts/rdma-tests-list.sh`).

use ferry_common::msg::HashAlgorithm;
use std::fs;
use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use ferry_client::Client;
use ferry_common::chunk::{hash_chunk, manifest_id};
use ferry_common::codec::{MAX_CTRL_FRAME_BYTES, MAX_SERVER_REQUEST_FRAME_BYTES};
use ferry_common::msg::{
    AttrEntry, BatchFile, BatchedFile, Caller, ErrorKind, FileKind, Hello, LockKind, MappedFile,
    Message, MetaEntry, NewDir, NodeKind, RegionDesc, RemoteError, Request, Response, ServerStats,
    SetAttrs, TimeSet, Timestamp, Welcome, XattrSetMode, BATCH_MAX_FILES, DEFAULT_CHUNK_BYTES,
    MAX_NAME_BYTES, MAX_PATH_BYTES, SMALL_FILE_MAX_BYTES,
};
use ferry_common::proto::MAX_INFLIGHT_REQUESTS;
use ferry_common::transport::tcp::wire::{Header, READ_REQ};
use ferry_common::transport::tcp::CTRL_QUEUE;
use ferry_common::transport::{RemoteSlice, TransportChoice};
use ferry_common::STATE_DIR;
use ferry_tests::{
    connect, ctrl_frame, frame_bytes, hello, msg_frame, open_fds, proc_status, raw_greet,
    raw_handshake, raw_socket, runtime, write_random_file, Env, Frame, RawClient,
    DEFAULT_SHARE as SHARE, MIB, STATUS_DENIED, STATUS_INVALID_RKEY, STATUS_OUT_OF_BOUNDS,
};

/// How long ferryd may take to log what it did.
const LOG_TIMEOUT: Duration = Duration::from_secs(10);

/// How long ferryd may take to release what a closed connection held.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(15);

/// A client-library session opened before the hostile traffic starts, on its own
/// connection, that must keep working through it.
struct Healthy {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl Healthy {
    fn open(env: &Env) -> Healthy {
        let rt = runtime();
        let client = rt
            .block_on(connect(env.server(), TransportChoice::Tcp))
            .expect("healthy client");
        Healthy { rt, client }
    }

    /// ferryd runs and still answers the healthy session on its old connection.
    #[track_caller]
    fn check(&self, env: &Env, after: &str) {
        env.server().assert_running();
        let attr = self
            .rt
            .block_on(self.client.stat(SHARE, "", true))
            .unwrap_or_else(|e| panic!("after {after}: the healthy client failed: {e}"));
        assert_eq!(attr.kind, FileKind::Dir, "after {after}");
    }

    fn stats(&self) -> ServerStats {
        self.rt.block_on(self.client.server_stats()).unwrap()
    }

    /// Waits until ferryd counts `connections` connections (this one included) and
    /// no open transfer; panics with the last counts if it does not within
    /// [`SETTLE_TIMEOUT`].
    #[track_caller]
    fn wait_settled(&self, connections: u64) -> ServerStats {
        let start = Instant::now();
        loop {
            let s = self.stats();
            if s.connections == connections && s.open_transfers == 0 {
                return s;
            }
            assert!(
                start.elapsed() < SETTLE_TIMEOUT,
                "ferryd did not settle to {connections} connections: {s:?}"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits for a line of ferryd's log that contains every one of `parts`; returns it.
#[track_caller]
fn log_line(env: &Env, parts: &[&str]) -> String {
    let start = Instant::now();
    loop {
        let log = env.server().stderr();
        if let Some(line) = log.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
            return line.to_owned();
        }
        assert!(
            start.elapsed() < LOG_TIMEOUT,
            "no line of ferryd's log has all of {parts:?}; log:\n{log}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// How far a raw connection gets before its case starts.
#[derive(Debug, Clone, Copy)]
enum Stage {
    /// Transport greetings exchanged, no `Hello` yet.
    Greeted,
    /// The session handshake done.
    InSession,
}

fn open_raw(env: &Env, stage: Stage) -> RawClient {
    let stream = raw_socket(env.server());
    match stage {
        Stage::Greeted => raw_greet(env.server(), stream),
        Stage::InSession => raw_handshake(env.server(), stream),
    }
}

/// Reads what ferryd sends on `stream` until it closes the connection, which it must
/// do within the socket's read timeout; returns the bytes.
#[track_caller]
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    match stream.read_to_end(&mut got) {
        Ok(_) => got,
        Err(e) if e.kind() == IoErrorKind::ConnectionReset => got,
        Err(e) => panic!("ferryd did not close the connection: {e} (got {got:?})"),
    }
}

fn stat(path: &str) -> Request {
    Request::Stat {
        share: SHARE.into(),
        path: path.into(),
        follow: true,
    }
}

/// The kind of an error response, or of the error of a batch's only file or link;
/// panics on anything else.
#[track_caller]
fn error_kind(r: Response) -> ErrorKind {
    match r {
        Response::Error(e) => e.kind,
        Response::UploadedBatch { results } if results.len() == 1 => match &results[0] {
            Some(e) => e.kind,
            None => panic!("expected the batch's file to fail, it was committed"),
        },
        Response::DownloadedBatch { files } if files.len() == 1 => match &files[0] {
            BatchedFile::Err(e) => e.kind,
            other => panic!("expected the batch's file to fail, got {other:?}"),
        },
        Response::LinkedBatch { results } if results.len() == 1 => match &results[0] {
            Some(e) => e.kind,
            None => panic!("expected the link to fail, it was made"),
        },
        Response::MetaSet { results } if results.len() == 1 => match &results[0] {
            Some(e) => e.kind,
            None => panic!("expected the entry to fail, it was set"),
        },
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A malformed frame and what ferryd logs when it closes the connection for it.
struct BadFrame {
    name: &'static str,
    bytes: Vec<u8>,
    /// Half-close after sending (what truncates the frame).
    then_close: bool,
    log: &'static str,
}

fn bad_frames() -> Vec<BadFrame> {
    let bad = |name, bytes, then_close, log| BadFrame {
        name,
        bytes,
        then_close,
        log,
    };
    let stat_bytes = ferry_common::codec::encode(&Message::Request {
        id: 1,
        body: stat(""),
    })
    .unwrap();
    let mut trailing = stat_bytes.clone();
    trailing.push(0);
    let long_path = Message::Request {
        id: 1,
        body: stat(&"p".repeat(MAX_PATH_BYTES + 1)),
    };
    let mut truncated_body = frame_bytes(Header::Ctrl { len: 64 }, &[]);
    truncated_body.extend_from_slice(&stat_bytes[..10]);
    let huge_write = RemoteSlice {
        rkey: 1,
        addr: 0,
        len: u32::MAX,
    };
    let mut huge_write = frame_bytes(
        Header::WriteReq {
            id: 1,
            slice: huge_write,
        },
        &[],
    );
    huge_write.extend_from_slice(&[0x55; 100]);
    vec![
        bad(
            "truncated header",
            vec![0x01, 0x10, 0x00],
            true,
            "read frame",
        ),
        bad(
            "truncated READ header",
            vec![READ_REQ, 1, 2, 3, 4, 5],
            true,
            "read frame",
        ),
        bad("truncated body", truncated_body, true, "read frame"),
        bad(
            "length over the maximum",
            frame_bytes(
                Header::Ctrl {
                    len: MAX_CTRL_FRAME_BYTES as u32 + 1,
                },
                &[],
            ),
            false,
            "exceeds",
        ),
        bad(
            "length over what a server accepts",
            frame_bytes(
                Header::Ctrl {
                    len: MAX_SERVER_REQUEST_FRAME_BYTES as u32 + 1,
                },
                &[],
            ),
            false,
            "exceeds the 81920 this side accepts",
        ),
        bad(
            "4 GiB length",
            frame_bytes(Header::Ctrl { len: u32::MAX }, &[]),
            false,
            "exceeds",
        ),
        bad(
            "garbage body",
            ctrl_frame(&[0xee, 0xee, 0xee]),
            false,
            "malformed control message",
        ),
        bad(
            "empty body",
            ctrl_frame(&[]),
            false,
            "malformed control message",
        ),
        bad(
            "unknown frame kind 0x06",
            vec![0x06, 0, 0, 0, 0],
            false,
            "unknown frame kind 0x06",
        ),
        bad(
            "unknown frame kind 0x00",
            vec![0x00],
            false,
            "unknown frame kind 0x00",
        ),
        bad(
            "unknown frame kind 0xff",
            vec![0xff; 32],
            false,
            "unknown frame kind 0xff",
        ),
        // Message has variants 0..=4.
        bad(
            "unknown Message tag",
            ctrl_frame(&[0x05]),
            false,
            "malformed control message",
        ),
        // Request has variants 0..=22: a Request { id: 1, <variant 127> }.
        bad(
            "unknown Request tag",
            ctrl_frame(&[0x03, 0x01, 0x7f]),
            false,
            "malformed control message",
        ),
        // ErrorKind has variants 0..=17: a Refused { kind: 127, message: "" }.
        bad(
            "unknown ErrorKind tag",
            ctrl_frame(&[0x02, 0x7f, 0x00]),
            false,
            "malformed control message",
        ),
        bad(
            "trailing byte",
            ctrl_frame(&trailing),
            false,
            "1 trailing bytes",
        ),
        bad(
            "path over 4096 bytes",
            msg_frame(&long_path),
            false,
            "exceeds its limit",
        ),
        bad(
            "READ answer to nothing",
            frame_bytes(Header::ReadRefused { id: 77, status: 1 }, &[]),
            false,
            "READ response for unknown operation 77",
        ),
        bad(
            "READ data for nothing",
            frame_bytes(Header::ReadData { id: 78, len: 4 }, &[1, 2, 3, 4]),
            false,
            "READ response for unknown operation 78",
        ),
        bad(
            "WRITE answer to nothing",
            frame_bytes(Header::WriteResp { id: 79, status: 0 }, &[]),
            false,
            "WRITE response for unknown operation 79",
        ),
        bad(
            "4 GiB WRITE cut short",
            huge_write,
            true,
            "discard WRITE payload",
        ),
    ]
}

#[test]
fn malformed_frames_close_only_their_own_connection() {
    let env = Env::new();
    let healthy = Healthy::open(&env);

    // Not Ferry at all, and a greeting cut short: ferryd greets, then closes.
    for (name, bytes, log) in [
        (
            "HTTP",
            &b"GET / HTTP/1.0\r\n\r\n"[..],
            "does not speak Ferry's TCP transport",
        ),
        ("short greeting", &b"FRYT"[..], "receive greeting"),
    ] {
        let mut s = raw_socket(env.server());
        let peer = s.local_addr().unwrap().to_string();
        s.write_all(bytes).unwrap();
        // Fails if ferryd has already reset the connection.
        let _ = s.shutdown(Shutdown::Write);
        let got = read_until_closed(&mut s);
        assert!(got.len() <= 8, "{name}: ferryd sent {got:?}");
        log_line(&env, &[&peer, log]);
        healthy.check(&env, name);
    }

    for stage in [Stage::Greeted, Stage::InSession] {
        for case in bad_frames() {
            let what = format!("{} ({stage:?})", case.name);
            let mut raw = open_raw(&env, stage);
            let peer = raw.local_addr();
            raw.send_bytes(&case.bytes).unwrap();
            if case.then_close {
                raw.shutdown_write();
            }
            let closed = raw.expect_closed();
            assert!(closed.frames.is_empty(), "{what}: {:?}", closed.frames);
            log_line(&env, &[&peer, case.log]);
            healthy.check(&env, &what);
        }
    }
    // Every hostile connection is gone; the healthy one is all that is left.
    healthy.wait_settled(1);
}

#[test]
fn messages_out_of_order_end_the_session() {
    let env = Env::new();
    let healthy = Healthy::open(&env);
    let welcome = Message::Welcome(Welcome {
        version: 2,
        software: "not a server".into(),
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        max_window_chunks: 64,
        max_inflight_requests: 256,
        nonce: [0; 32],
        capabilities: vec![],
    });
    let refused = Message::Refused(RemoteError {
        kind: ErrorKind::Busy,
        message: "no".into(),
    });
    let response = |id| Message::Response {
        id,
        body: Response::Ok,
    };
    let cases = [
        (
            Stage::Greeted,
            Message::Request {
                id: 1,
                body: stat(""),
            },
            "unexpected Request while awaiting the client's hello",
        ),
        (
            Stage::Greeted,
            response(1),
            "unexpected Response while awaiting",
        ),
        (
            Stage::Greeted,
            welcome.clone(),
            "unexpected Welcome while awaiting",
        ),
        (
            Stage::Greeted,
            refused.clone(),
            "unexpected Refused while awaiting",
        ),
        (
            Stage::InSession,
            Message::Hello(hello()),
            "unexpected Hello while in session",
        ),
        (
            Stage::InSession,
            welcome,
            "unexpected Welcome while in session",
        ),
        (
            Stage::InSession,
            response(1),
            "unexpected Response while in session",
        ),
        (
            Stage::InSession,
            response(u64::MAX),
            "unexpected Response while in session",
        ),
        (
            Stage::InSession,
            refused,
            "unexpected Refused while in session",
        ),
    ];
    for (stage, msg, log) in cases {
        let mut raw = open_raw(&env, stage);
        let peer = raw.local_addr();
        raw.send(&msg);
        let closed = raw.expect_closed();
        assert!(closed.frames.is_empty(), "{msg:?}: {:?}", closed.frames);
        log_line(&env, &[&peer, log]);
        healthy.check(&env, log);
    }

    // A hello ferryd cannot accept is answered with a typed refusal, then closed.
    let bad_magic = Hello {
        magic: *b"HTTP",
        ..hello()
    };
    let old = Hello {
        min_version: 0,
        max_version: 1,
        ..hello()
    };
    for (h, why) in [
        (bad_magic, "bad magic"),
        (old, "client speaks versions 0..=1"),
    ] {
        let mut raw = open_raw(&env, Stage::Greeted);
        raw.send(&Message::Hello(h));
        match &raw.expect_closed().frames[..] {
            [Frame::Ctrl(Message::Refused(e))] => {
                assert_eq!(e.kind, ErrorKind::Protocol);
                assert!(e.message.contains(why), "{e:?}");
            }
            other => panic!("expected one refusal for {why}, got {other:?}"),
        }
        healthy.check(&env, why);
    }

    // A hello of protocol version 5 (before capabilities: the same fields, one fewer)
    // does not decode, but its version range still reads: refused by name.
    let mut v5 = postcard::to_stdvec(&(0u8, ferry_common::msg::HELLO_MAGIC, 5u16, 5u16)).unwrap();
    v5.extend(postcard::to_stdvec(&("rcp/0.1.0", [0x7au8; 32])).unwrap());
    let mut raw = open_raw(&env, Stage::Greeted);
    raw.send_bytes(&ctrl_frame(&v5)).unwrap();
    match &raw.expect_closed().frames[..] {
        [Frame::Ctrl(Message::Refused(e))] => {
            assert_eq!(e.kind, ErrorKind::Protocol);
            assert!(e.message.contains("client speaks versions 5..=5"), "{e:?}");
        }
        other => panic!("expected one refusal of a version-5 hello, got {other:?}"),
    }
    healthy.check(&env, "version-5 hello");

    // A request id may be used again once it was answered...
    let mut raw = open_raw(&env, Stage::InSession);
    let peer = raw.local_addr();
    for _ in 0..2 {
        raw.send(&Message::Request {
            id: 5,
            body: stat(""),
        });
        assert!(matches!(
            raw.recv_msg(),
            Message::Response {
                id: 5,
                body: Response::Attr(_)
            }
        ));
    }
    // ...but not while it is outstanding: an upload window whose READ this client
    // never answers keeps request 6 outstanding.
    let transfer = open_upload(&mut raw, "dup", 4096);
    let data = vec![7u8; 4096];
    let hashes = vec![hash_chunk(HashAlgorithm::Blake3, &data)];
    let region = raw.offer(data);
    raw.send(&Message::Request {
        id: 6,
        body: Request::UploadWindow {
            transfer,
            offset: 0,
            region,
            hashes,
        },
    });
    match raw.recv_frame() {
        Ok(Some(Frame::ReadReq { .. })) => {}
        other => panic!("expected ferryd to READ the window, got {other:?}"),
    }
    raw.send(&Message::Request {
        id: 6,
        body: stat(""),
    });
    assert_closed_without_a_message(raw);
    log_line(&env, &[&peer, "request id 6 is already outstanding"]);
    // The unfinished upload went with its connection, temporary file and all.
    healthy.wait_settled(1);
    ferry_tests::assert_no_temp_files(&env.share(""));
    healthy.check(&env, "duplicate request id");
}

/// Waits for ferryd to close `raw`'s connection; panics if it sent a control message
/// first (READs of `raw`'s memory may come: they are not answered).
#[track_caller]
fn assert_closed_without_a_message(raw: RawClient) {
    let closed = raw.expect_closed();
    assert!(
        !closed.frames.iter().any(|f| matches!(f, Frame::Ctrl(_))),
        "{:?}",
        closed.frames
    );
}

/// Opens an upload of `size` bytes to `path` on `raw`; returns the transfer id.
#[track_caller]
fn open_upload(raw: &mut RawClient, path: &str, size: u64) -> u64 {
    let open = Request::UploadOpen {
        share: SHARE.into(),
        path: path.into(),
        size,
        mode: 0o644,
        mtime: Default::default(),
    };
    match raw.call(open) {
        Response::UploadOpened { transfer, .. } => transfer,
        other => panic!("upload of {path} did not open: {other:?}"),
    }
}

#[test]
fn transfer_requests_out_of_order_get_typed_errors() {
    let env = Env::new();
    let size = 3 * MIB + 5;
    write_random_file(&env.share("src"), size, 1);
    let healthy = Healthy::open(&env);
    let mut raw = open_raw(&env, Stage::InSession);
    let chunk = u64::from(DEFAULT_CHUNK_BYTES);

    // Transfers and handles that were never opened.
    for req in [
        Request::UploadWindow {
            transfer: 999,
            offset: 0,
            region: RegionDesc {
                addr: 0x1000,
                len: 4096,
                rkey: 1,
            },
            hashes: vec![[0; 32]],
        },
        Request::UploadCommit {
            transfer: 999,
            manifest: [0; 32],
        },
        Request::DownloadWindow {
            transfer: 999,
            offset: 0,
            region: RegionDesc {
                addr: 0x1000,
                len: 4096,
                rkey: 1,
            },
            verify: false,
        },
        Request::Close { transfer: 999 },
        Request::MapRelease { handle: 999 },
    ] {
        assert_eq!(
            error_kind(raw.call(req.clone())),
            ErrorKind::Protocol,
            "{req:?}"
        );
    }

    // An upload of `size` bytes: 4 chunks, the last 5 bytes long.
    let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    let hashes: Vec<_> = data
        .chunks(chunk as usize)
        .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
        .collect();
    let manifest = manifest_id(HashAlgorithm::Blake3, size, DEFAULT_CHUNK_BYTES, &hashes);
    let first_two = raw.offer(data[..2 * chunk as usize].to_vec());
    let up = open_upload(&mut raw, "up", size);
    let window = |offset: u64, len: u64, n: usize| Request::UploadWindow {
        transfer: up,
        offset,
        region: RegionDesc { len, ..first_two },
        hashes: vec![[0; 32]; n],
    };
    for (what, req) in [
        ("unaligned", window(17, 2 * chunk, 2)),
        ("past the end", window(4 * chunk, chunk, 1)),
        ("running past the end", window(3 * chunk, 2 * chunk, 2)),
        ("overflowing", window(u64::MAX - chunk + 1, chunk, 1)),
        ("ending inside a chunk", window(0, chunk + 1, 2)),
        ("hash count", window(0, 2 * chunk, 1)),
        ("empty", window(0, 0, 0)),
    ] {
        assert_eq!(error_kind(raw.call(req)), ErrorKind::Protocol, "{what}");
    }
    let commit = Request::UploadCommit {
        transfer: up,
        manifest,
    };
    assert_eq!(
        error_kind(raw.call(commit.clone())),
        ErrorKind::Integrity,
        "commit before any window"
    );
    let good = Request::UploadWindow {
        transfer: up,
        offset: 0,
        region: first_two,
        hashes: hashes[..2].to_vec(),
    };
    assert_eq!(
        raw.call(good),
        Response::WindowPulled {
            bytes: 2 * chunk,
            reused: 0
        }
    );
    assert_eq!(
        error_kind(raw.call(commit)),
        ErrorKind::Integrity,
        "commit before the last windows"
    );
    let as_download = Request::DownloadWindow {
        transfer: up,
        offset: 0,
        region: first_two,
        verify: false,
    };
    assert_eq!(error_kind(raw.call(as_download)), ErrorKind::Protocol);

    let down = match raw.call(Request::DownloadOpen {
        share: SHARE.into(),
        path: "src".into(),
    }) {
        Response::DownloadOpened { transfer, .. } => transfer,
        other => panic!("download did not open: {other:?}"),
    };
    let dest = RegionDesc {
        addr: 1 << 40,
        len: chunk,
        rkey: 0x77,
    };
    for (what, req) in [
        (
            "an upload window for a download",
            Request::UploadWindow {
                transfer: down,
                offset: 0,
                region: first_two,
                hashes: hashes[..2].to_vec(),
            },
        ),
        (
            "a commit of a download",
            Request::UploadCommit {
                transfer: down,
                manifest,
            },
        ),
        (
            "an unaligned download window",
            Request::DownloadWindow {
                transfer: down,
                offset: 17,
                region: dest,
                verify: false,
            },
        ),
        (
            "a download window past the end",
            Request::DownloadWindow {
                transfer: down,
                offset: 4 * chunk,
                region: dest,
                verify: false,
            },
        ),
    ] {
        assert_eq!(error_kind(raw.call(req)), ErrorKind::Protocol, "{what}");
    }
    for transfer in [down, up] {
        assert_eq!(raw.call(Request::Close { transfer }), Response::Ok);
        assert_eq!(
            error_kind(raw.call(Request::Close { transfer })),
            ErrorKind::Protocol,
            "closed twice"
        );
    }
    assert_eq!(
        error_kind(raw.call(window(0, 2 * chunk, 2))),
        ErrorKind::Protocol,
        "a window of a closed upload"
    );

    // The same connection still serves, and nothing was left behind.
    assert!(matches!(raw.call(stat("src")), Response::Attr(a) if a.size == size));
    match raw.call(Request::Stats) {
        Response::Stats(s) => assert_eq!(s.open_transfers, 0),
        other => panic!("{other:?}"),
    }
    ferry_tests::assert_entries(&env.share(""), &["src"]);
    healthy.check(&env, "bad transfer requests");
}

/// What hostile requests must leave alone outside the share: a canary directory and
/// file next to the share's parent, and the listings of the directories around it.
#[derive(Debug, PartialEq, Eq)]
struct Outside {
    root_entries: Vec<String>,
    shares_entries: Vec<String>,
    dir_entries: Vec<String>,
    dir_mode: u32,
    dir_mtime: SystemTime,
    file: Vec<u8>,
    file_mode: u32,
    file_mtime: SystemTime,
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // ferryd's own state (its manifest store) is not a client's file.
        .filter(|n| n != ferry_common::STATE_DIR)
        .collect();
    names.sort();
    names
}

fn outside(env: &Env) -> Outside {
    use std::os::unix::fs::PermissionsExt;
    let dir = env.root().join("outside");
    let file = dir.join("canary");
    let dir_meta = fs::metadata(&dir).unwrap();
    let file_meta = fs::metadata(&file).unwrap();
    Outside {
        root_entries: entries(env.root()),
        shares_entries: entries(&env.root().join("shares")),
        dir_entries: entries(&dir),
        dir_mode: dir_meta.permissions().mode(),
        dir_mtime: dir_meta.modified().unwrap(),
        file: fs::read(&file).unwrap(),
        file_mode: file_meta.permissions().mode(),
        file_mtime: file_meta.modified().unwrap(),
    }
}

/// Every request kind that takes a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathRequest {
    Stat {
        follow: bool,
    },
    ListDir,
    Mkdir,
    Symlink,
    SetAttr,
    UploadOpen,
    DownloadOpen,
    MapOpen,
    /// The path as `Link`'s existing file, then as its new name.
    Link,
    LinkTo,
    /// The same, as the one link of a `LinkBatch`.
    LinkBatch,
    LinkBatchTo,
    /// The path as `Rename`'s source, then as its destination.
    Rename,
    RenameTo,
    Manifest,
    /// The path as `UploadOpenBase`'s destination, then as its base.
    UploadOpenBase,
    UploadBase,
    Remove,
    DiskUsage,
    Verify,
    /// The path as the one file of an `UploadBatch` (empty, so no READ is needed) or
    /// the one path of a `DownloadBatch`: its entry must carry the error.
    UploadBatch,
    DownloadBatch,
    /// The requests of the `meta`, `dirs`, `write` and `finish` capabilities; the path
    /// as the one entry of a batch, as `Move`'s source and then its destination.
    StatMeta,
    ListDirMeta,
    SetMeta,
    MakeDirs,
    SetAttrBatch,
    SetAttrs,
    Move,
    MoveTo,
    FileOpen,
    FilePut,
    /// The requests of the `xattr` capability.
    XattrGet,
    XattrList,
    XattrSet,
    XattrRemove,
    /// The requests of the `locks` capability: `Lock` takes an exclusive lock.
    Lock,
    LockTest,
    /// The path-naming requests of the `posix` capability: `MakeNode` makes a FIFO,
    /// `SetTimes` sets both times to a given time.
    MakeNode,
    SetTimes,
}

const EVERY_KIND: [PathRequest; 41] = [
    PathRequest::Stat { follow: true },
    PathRequest::Stat { follow: false },
    PathRequest::ListDir,
    PathRequest::Mkdir,
    PathRequest::Symlink,
    PathRequest::SetAttr,
    PathRequest::UploadOpen,
    PathRequest::DownloadOpen,
    PathRequest::MapOpen,
    PathRequest::Link,
    PathRequest::LinkTo,
    PathRequest::LinkBatch,
    PathRequest::LinkBatchTo,
    PathRequest::Rename,
    PathRequest::RenameTo,
    PathRequest::Manifest,
    PathRequest::UploadOpenBase,
    PathRequest::UploadBase,
    PathRequest::Remove,
    PathRequest::DiskUsage,
    PathRequest::Verify,
    PathRequest::UploadBatch,
    PathRequest::DownloadBatch,
    PathRequest::StatMeta,
    PathRequest::ListDirMeta,
    PathRequest::SetMeta,
    PathRequest::MakeDirs,
    PathRequest::SetAttrBatch,
    PathRequest::SetAttrs,
    PathRequest::Move,
    PathRequest::MoveTo,
    PathRequest::FileOpen,
    PathRequest::FilePut,
    PathRequest::XattrGet,
    PathRequest::XattrList,
    PathRequest::XattrSet,
    PathRequest::XattrRemove,
    PathRequest::Lock,
    PathRequest::LockTest,
    PathRequest::MakeNode,
    PathRequest::SetTimes,
];

/// The kinds that follow a final symlink.
const FOLLOWING: [PathRequest; 10] = [
    PathRequest::Stat { follow: true },
    PathRequest::ListDir,
    PathRequest::DownloadOpen,
    PathRequest::MapOpen,
    PathRequest::Manifest,
    PathRequest::DownloadBatch,
    PathRequest::StatMeta,
    PathRequest::ListDirMeta,
    PathRequest::Lock,
    PathRequest::LockTest,
];

/// A region of no bytes: an upload batch of empty files needs no READ.
const NO_REGION: RegionDesc = RegionDesc {
    addr: 0,
    len: 0,
    rkey: 0,
};

/// A file of an upload batch holding `data`.
fn batch_file(path: &str, data: &[u8]) -> BatchFile {
    BatchFile {
        path: path.into(),
        size: data.len() as u64,
        mode: 0o640,
        mtime: Timestamp {
            secs: 1_500_000_000,
            nanos: 0,
        },
        hash: hash_chunk(HashAlgorithm::Blake3, data),
    }
}

impl PathRequest {
    fn on(self, share: &str, path: &str) -> Request {
        let (share, path) = (share.to_owned(), path.to_owned());
        match self {
            PathRequest::Stat { follow } => Request::Stat {
                share,
                path,
                follow,
            },
            PathRequest::ListDir => Request::ListDir {
                share,
                path,
                cursor: 0,
            },
            PathRequest::Mkdir => Request::Mkdir {
                share,
                path,
                mode: 0o777,
                exist_ok: true,
            },
            PathRequest::Symlink => Request::Symlink {
                share,
                path,
                target: "sub".into(),
            },
            PathRequest::SetAttr => Request::SetAttr {
                share,
                path,
                mode: Some(0o777),
                mtime: Some(Default::default()),
            },
            PathRequest::UploadOpen => Request::UploadOpen {
                share,
                path,
                size: 4096,
                mode: 0o777,
                mtime: Default::default(),
            },
            PathRequest::DownloadOpen => Request::DownloadOpen { share, path },
            PathRequest::MapOpen => Request::MapOpen {
                share,
                path,
                chunk_bytes: 4096,
            },
            PathRequest::Link => Request::Link {
                share,
                from: path,
                to: "new-link".into(),
            },
            PathRequest::LinkTo => Request::Link {
                share,
                from: "sub/f".into(),
                to: path,
            },
            PathRequest::LinkBatch => Request::LinkBatch {
                share,
                links: vec![(path, "new-link".into())],
            },
            PathRequest::LinkBatchTo => Request::LinkBatch {
                share,
                links: vec![("sub/f".into(), path)],
            },
            PathRequest::Rename => Request::Rename {
                share,
                from: path,
                to: "renamed".into(),
            },
            PathRequest::RenameTo => Request::Rename {
                share,
                from: "sub/f".into(),
                to: path,
            },
            PathRequest::Manifest => Request::Manifest {
                share,
                path,
                chunk_bytes: 4096,
                first_chunk: 0,
            },
            PathRequest::UploadOpenBase => Request::UploadOpenBase {
                share,
                path,
                size: 4096,
                mode: 0o777,
                mtime: Default::default(),
                base: "sub/f".into(),
            },
            PathRequest::UploadBase => Request::UploadOpenBase {
                share,
                path: "new-upload".into(),
                size: 4096,
                mode: 0o777,
                mtime: Default::default(),
                base: path,
            },
            PathRequest::Remove => Request::Remove {
                share,
                path,
                recursive: true,
            },
            PathRequest::DiskUsage => Request::DiskUsage { share, path },
            PathRequest::Verify => Request::Verify { share, path },
            PathRequest::UploadBatch => Request::UploadBatch {
                share,
                region: NO_REGION,
                algorithm: HashAlgorithm::Blake3,
                files: vec![batch_file(&path, b"")],
            },
            PathRequest::DownloadBatch => Request::DownloadBatch {
                share,
                paths: vec![path],
                region: NO_REGION,
            },
            other => other.on_write_caps(share, path),
        }
    }

    /// [`PathRequest::on`] for the requests of the later capabilities.
    fn on_write_caps(self, share: String, path: String) -> Request {
        let attrs = SetAttrs {
            mode: Some(0o777),
            mtime: Some(Default::default()),
            ..SetAttrs::default()
        };
        match self {
            PathRequest::StatMeta => Request::StatMeta {
                share,
                path,
                follow: true,
            },
            PathRequest::ListDirMeta => Request::ListDirMeta {
                share,
                path,
                cursor: 0,
            },
            PathRequest::SetMeta => Request::SetMeta {
                share,
                entries: vec![MetaEntry {
                    path,
                    uid: Some(0),
                    gid: Some(0),
                    mtime: Some(Default::default()),
                }],
            },
            PathRequest::MakeDirs => Request::MakeDirs {
                share,
                dirs: vec![NewDir { path, mode: 0o777 }],
            },
            PathRequest::SetAttrBatch => Request::SetAttrBatch {
                share,
                entries: vec![AttrEntry {
                    path,
                    mode: Some(0o777),
                    uid: None,
                    gid: None,
                    mtime: Some(Default::default()),
                }],
            },
            PathRequest::SetAttrs => Request::SetAttrs { share, path, attrs },
            PathRequest::Move => Request::Move {
                share,
                from: path,
                to: "moved".into(),
                no_replace: false,
            },
            PathRequest::MoveTo => Request::Move {
                share,
                from: "sub/f".into(),
                to: path,
                no_replace: false,
            },
            PathRequest::FileOpen => Request::FileOpen {
                share,
                path,
                create: Some(0o777),
                exclusive: false,
                truncate: true,
            },
            PathRequest::FilePut => Request::FilePut {
                share,
                path,
                mode: 0o777,
                exclusive: false,
                region: NO_REGION,
                algorithm: HashAlgorithm::Blake3,
                extents: Vec::new(),
                hashes: Vec::new(),
                attrs,
            },
            PathRequest::XattrGet => Request::XattrGet {
                share,
                path,
                name: b"user.hostile".to_vec(),
            },
            PathRequest::XattrList => Request::XattrList { share, path },
            PathRequest::XattrSet => Request::XattrSet {
                share,
                path,
                name: b"user.hostile".to_vec(),
                value: b"v".to_vec(),
                mode: XattrSetMode::Any,
            },
            PathRequest::XattrRemove => Request::XattrRemove {
                share,
                path,
                name: b"user.hostile".to_vec(),
            },
            other => other.on_lock_and_posix_caps(share, path),
        }
    }

    /// [`PathRequest::on`] for the requests of the `locks` and `posix` capabilities.
    fn on_lock_and_posix_caps(self, share: String, path: String) -> Request {
        match self {
            PathRequest::Lock => Request::Lock {
                share,
                path,
                owner: HOSTILE_LOCK_OWNER,
                kind: LockKind::Write,
                start: 0,
                end: u64::MAX,
                pid: 1,
            },
            PathRequest::LockTest => lock_test(share, path, HOSTILE_LOCK_OWNER),
            PathRequest::MakeNode => Request::MakeNode {
                share,
                path,
                kind: NodeKind::Fifo,
                mode: 0o666,
                rdev: 0,
            },
            PathRequest::SetTimes => Request::SetTimes {
                share,
                path,
                atime: TimeSet::At(HOSTILE_TIME),
                mtime: TimeSet::At(HOSTILE_TIME),
            },
            other => unreachable!("{other:?} is built by PathRequest::on"),
        }
    }

    /// [`PathRequest::on`], wrapped in `AsCaller` for `caller` if there is one.
    fn on_as(self, caller: Option<&Caller>, share: &str, path: &str) -> Request {
        let request = self.on(share, path);
        match caller {
            Some(caller) => Request::AsCaller {
                caller: caller.clone(),
                request: Box::new(request),
            },
            None => request,
        }
    }
}

/// A `LockTest` of `owner` for an exclusive lock of the whole file `path`.
fn lock_test(share: String, path: String, owner: u64) -> Request {
    Request::LockTest {
        share,
        path,
        owner,
        kind: LockKind::Write,
        start: 0,
        end: u64::MAX,
    }
}

/// The lock owner of every hostile `Lock` and `LockTest`.
const HOSTILE_LOCK_OWNER: u64 = 7;

/// The times a hostile `SetTimes` sets: unlike the canary's (2001).
const HOSTILE_TIME: Timestamp = Timestamp {
    secs: 1_234_567_890,
    nanos: 0,
};

/// Plants the canary outside the share and, inside, symlinks that lead to it.
fn plant_escapes(env: &Env) {
    use std::os::unix::fs::symlink;
    let outside = env.root().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(
        outside.join("canary"),
        b"canary: never to be read or written",
    )
    .unwrap();
    ferry_tests::set_mode(&outside.join("canary"), 0o640);
    ferry_tests::set_mtime(&outside.join("canary"), 1_000_000_000);
    ferry_tests::set_mode(&outside, 0o750);
    ferry_tests::set_mtime(&outside, 1_000_000_000);
    fs::create_dir(env.share("sub")).unwrap();
    fs::write(env.share("sub/f"), b"inside").unwrap();
    // The share is <root>/shares/data: `../..` is <root>.
    symlink(&outside, env.share("abs-dir")).unwrap();
    symlink("../../outside", env.share("rel-dir")).unwrap();
    symlink(outside.join("canary"), env.share("abs-file")).unwrap();
    symlink("../../outside/canary", env.share("rel-file")).unwrap();
    symlink("sub/../../../outside", env.share("sub-up")).unwrap();
    symlink(env.root().join("missing"), env.share("dangling-out")).unwrap();
    // ferryd's state directory (as it makes it once it records a manifest), and a
    // symlink that leads into it.
    fs::create_dir_all(env.share(".ferry-state/manifests")).unwrap();
    symlink(".ferry-state", env.share("to-state")).unwrap();
}

/// The hostile paths every path-naming request kind is tried with, and what each kind
/// must answer for each.
fn escape_cases(env: &Env) -> Vec<(String, ErrorKind)> {
    use ErrorKind::{InvalidPath, OutsideShare};
    let canary = env.root().join("outside/canary");
    let canary = canary.to_str().unwrap();
    let long_name = "n".repeat(MAX_NAME_BYTES + 1);
    let long_inner = format!("sub/{long_name}");
    // (path, what every request kind must answer).
    let mut cases: Vec<(String, ErrorKind)> = [
        ("../outside/canary", OutsideShare),
        ("sub/../../outside/canary", OutsideShare),
        ("sub/..", OutsideShare),
        ("..", OutsideShare),
        // New names next to the share and in the directory outside.
        ("../made-outside", OutsideShare),
        ("../../outside/new", OutsideShare),
        ("/", OutsideShare),
        (canary, OutsideShare),
        ("sub/a\0b", InvalidPath),
        ("\0", InvalidPath),
        (&long_name, InvalidPath),
        (&long_inner, InvalidPath),
        // A symlink to a directory outside, as an intermediate component.
        ("abs-dir/canary", OutsideShare),
        ("rel-dir/canary", OutsideShare),
        ("sub-up/canary", OutsideShare),
        ("abs-dir/new", OutsideShare),
        ("rel-dir/new/deeper", OutsideShare),
        ("dangling-out/x", OutsideShare),
        // The server's state directory, by name or through a symlink to it.
        (STATE_DIR, InvalidPath),
        (".ferry-state/manifests", InvalidPath),
        ("sub/../.ferry-state", OutsideShare),
        ("to-state/x", InvalidPath),
    ]
    .into_iter()
    .map(|(p, k)| (p.to_owned(), k))
    .collect();
    // A path of exactly the longest length is judged on its merits.
    let longest = format!("{}{}", "d/".repeat(MAX_PATH_BYTES / 2 - 1), "dd");
    assert_eq!(longest.len(), MAX_PATH_BYTES);
    cases.push((longest, ErrorKind::NotFound));
    cases
}

/// Sends every path-naming request kind (wrapped in `AsCaller` for `caller` if there
/// is one) with each of `cases` and with share names that are not names, and checks
/// each answer; then final symlinks that lead outside to every kind that follows them,
/// and the names the server reserves to the kinds that write them.
#[track_caller]
fn assert_every_kind_refused(
    raw: &mut RawClient,
    cases: &[(String, ErrorKind)],
    caller: Option<&Caller>,
) {
    use ErrorKind::{InvalidPath, NoSuchShare, OutsideShare};
    for kind in EVERY_KIND {
        for (path, expected) in cases {
            let got = match raw.call(kind.on_as(caller, SHARE, path)) {
                r @ (Response::Error(_)
                | Response::UploadedBatch { .. }
                | Response::DownloadedBatch { .. }
                | Response::LinkedBatch { .. }
                | Response::MetaSet { .. }) => error_kind(r),
                other => panic!("{kind:?} {path:?} as {caller:?} was not refused: {other:?}"),
            };
            assert_eq!(got, *expected, "{kind:?} {path:?} as {caller:?}");
        }
        for share in ["../data", "data/..", "data\0", "", "/"] {
            let got = error_kind(raw.call(kind.on_as(caller, share, "x")));
            assert_eq!(
                got, NoSuchShare,
                "{kind:?} in share {share:?} as {caller:?}"
            );
        }
    }
    for link in FINAL_LINKS_OUT {
        for kind in FOLLOWING {
            let got = error_kind(raw.call(kind.on_as(caller, SHARE, link)));
            assert_eq!(got, OutsideShare, "{kind:?} {link:?} as {caller:?}");
        }
    }
    // Names the server reserves, and the share root, are not write targets.
    for (kind, path) in [
        (PathRequest::UploadOpen, ".ferry-tmp.0123456789abcdef"),
        (PathRequest::Mkdir, ""),
        (PathRequest::SetAttr, ""),
        (PathRequest::Symlink, "."),
        (PathRequest::Remove, ""),
        (PathRequest::Remove, "."),
        (PathRequest::Remove, ".ferry-tmp.0123456789abcdef"),
        (PathRequest::Remove, ".ferry-state/manifests"),
        (PathRequest::DiskUsage, ".ferry-state"),
        (PathRequest::Rename, ""),
        (PathRequest::LinkTo, ".ferry-tmp.0123456789abcdef"),
        (PathRequest::LinkBatchTo, ".ferry-tmp.0123456789abcdef"),
        (PathRequest::LinkBatchTo, ""),
        (PathRequest::XattrSet, ""),
        (PathRequest::XattrSet, ".ferry-tmp.0123456789abcdef"),
        (PathRequest::XattrRemove, ""),
        (PathRequest::MakeNode, ""),
        (PathRequest::MakeNode, "."),
        (PathRequest::MakeNode, ".ferry-tmp.0123456789abcdef"),
        (PathRequest::SetTimes, ".ferry-tmp.0123456789abcdef"),
    ] {
        let got = error_kind(raw.call(kind.on_as(caller, SHARE, path)));
        assert_eq!(got, InvalidPath, "{kind:?} {path:?} as {caller:?}");
    }
}

/// The symlinks of [`plant_escapes`] that lead outside the share, and `made`, which a
/// client makes with a `Symlink` request ([`make_link_out`]).
const FINAL_LINKS_OUT: [&str; 7] = [
    "abs-dir",
    "rel-dir",
    "abs-file",
    "rel-file",
    "sub-up",
    "made",
    "dangling-out",
];

/// Makes the symlink `made`, which leads to the canary, with a `Symlink` request
/// (stored verbatim: following it is what is checked).
fn make_link_out(raw: &mut RawClient) {
    let made = Request::Symlink {
        share: SHARE.into(),
        path: "made".into(),
        target: "../../outside/canary".into(),
    };
    assert_eq!(raw.call(made), Response::Ok);
}

/// Nothing outside the share changed since `before`: entries, content, modes, times,
/// extended attributes; and no lock is held on the canary. A session of its own
/// checks the locks: through a hard link to the canary made inside the share only
/// now, after a lock it can see (on `sub/f`, taken by another new session) shows that
/// it would.
#[track_caller]
fn assert_outside_untouched(env: &Env, before: &Outside) {
    assert_eq!(&outside(env), before, "something outside the share changed");
    let canary = env.root().join("outside/canary");
    let got = ferry_common::xattr::get(&canary, b"user.hostile");
    assert!(got.is_err(), "an xattr was set outside the share: {got:?}");
    let (mut locker, mut other) = (
        open_raw(env, Stage::InSession),
        open_raw(env, Stage::InSession),
    );
    let held = |other: &mut RawClient, path: &str| {
        let test = lock_test(SHARE.into(), path.into(), HOSTILE_LOCK_OWNER + 1);
        match other.call(test) {
            Response::Lock { conflict, .. } => conflict,
            other => panic!("LockTest {path}: {other:?}"),
        }
    };
    match locker.call(PathRequest::Lock.on(SHARE, "sub/f")) {
        Response::Lock { conflict, .. } => assert_eq!(conflict, None, "lock sub/f"),
        other => panic!("lock sub/f: {other:?}"),
    }
    assert!(held(&mut other, "sub/f").is_some(), "the lock on sub/f");
    fs::hard_link(&canary, env.share("canary-link")).unwrap();
    let got = held(&mut other, "canary-link");
    fs::remove_file(env.share("canary-link")).unwrap();
    assert_eq!(
        got, None,
        "a lock was taken on the canary outside the share"
    );
}

/// Plants the escapes ([`plant_escapes`]) and `made` ([`make_link_out`]), and opens a
/// healthy session and a raw one; returns what is outside as it was then, and the two.
fn escapes_and_sessions(env: &Env) -> (Outside, Healthy, RawClient) {
    plant_escapes(env);
    let before = outside(env);
    let healthy = Healthy::open(env);
    let mut raw = open_raw(env, Stage::InSession);
    make_link_out(&mut raw);
    (before, healthy, raw)
}

#[test]
fn paths_that_leave_the_share_are_refused_for_every_request_kind() {
    use ErrorKind::InvalidPath;
    let env = Env::new();
    let (before, healthy, mut raw) = escapes_and_sessions(&env);
    assert_every_kind_refused(&mut raw, &escape_cases(&env), None);

    for link in FINAL_LINKS_OUT {
        // Final symlinks that lead outside are described, not followed, by a Stat
        // without follow.
        match raw.call(PathRequest::Stat { follow: false }.on(SHARE, link)) {
            Response::Attr(a) => assert_eq!(a.kind, FileKind::Symlink, "{link}"),
            other => panic!("lstat {link}: {other:?}"),
        }
        // Verify does not follow a final symlink at all.
        let got = error_kind(raw.call(PathRequest::Verify.on(SHARE, link)));
        assert_eq!(got, InvalidPath, "Verify {link:?}");
        // The writes that name the link itself do not go through it.
        let got = error_kind(raw.call(PathRequest::SetAttr.on(SHARE, link)));
        assert_eq!(got, InvalidPath, "SetAttr {link:?}");
        let got = error_kind(raw.call(PathRequest::Mkdir.on(SHARE, link)));
        assert_eq!(got, ErrorKind::Exists, "Mkdir {link:?}");
        let got = error_kind(raw.call(PathRequest::MakeNode.on(SHARE, link)));
        assert_eq!(got, ErrorKind::Exists, "MakeNode {link:?}");
        // SetTimes sets the times of the link itself (what is outside keeps its own).
        match raw.call(PathRequest::SetTimes.on(SHARE, link)) {
            Response::Attr(a) => {
                assert_eq!(a.kind, FileKind::Symlink, "SetTimes {link}");
                assert_eq!(a.mtime, HOSTILE_TIME, "SetTimes {link}");
            }
            other => panic!("SetTimes {link}: {other:?}"),
        }
        // The extended-attribute requests act on the link itself: it has none, and
        // the kernel allows no `user.*` attribute on a symlink.
        let got = error_kind(raw.call(PathRequest::XattrGet.on(SHARE, link)));
        assert_eq!(got, ErrorKind::NoAttribute, "XattrGet {link:?}");
        let got = error_kind(raw.call(PathRequest::XattrSet.on(SHARE, link)));
        assert_eq!(got, ErrorKind::PermissionDenied, "XattrSet {link:?}");
        match raw.call(PathRequest::XattrList.on(SHARE, link)) {
            Response::XattrNames { names } => assert!(names.is_empty(), "{link}: {names:?}"),
            other => panic!("XattrList {link}: {other:?}"),
        }
        // DiskUsage describes the link itself, and never walks what it points at.
        match raw.call(PathRequest::DiskUsage.on(SHARE, link)) {
            Response::DiskUsage(u) => assert_eq!((u.files, u.dirs), (1, 0), "{link}"),
            other => panic!("DiskUsage {link}: {other:?}"),
        }
    }
    for target in ["", "a\0b"] {
        let bad = Request::Symlink {
            share: SHARE.into(),
            path: "bad-target".into(),
            target: target.into(),
        };
        assert_eq!(error_kind(raw.call(bad)), InvalidPath, "target {target:?}");
    }

    // An upload to a link's name replaces the link; the file it pointed to is untouched.
    let data = b"replaces the link".to_vec();
    let hashes = vec![hash_chunk(HashAlgorithm::Blake3, &data)];
    let manifest = manifest_id(
        HashAlgorithm::Blake3,
        data.len() as u64,
        DEFAULT_CHUNK_BYTES,
        &hashes,
    );
    let region = raw.offer(data.clone());
    let up = open_upload(&mut raw, "abs-file", data.len() as u64);
    let window = Request::UploadWindow {
        transfer: up,
        offset: 0,
        region,
        hashes,
    };
    assert!(matches!(raw.call(window), Response::WindowPulled { .. }));
    let commit = Request::UploadCommit {
        transfer: up,
        manifest,
    };
    assert!(matches!(raw.call(commit), Response::Committed { .. }));
    assert!(fs::symlink_metadata(env.share("abs-file"))
        .unwrap()
        .is_file());
    assert_eq!(fs::read(env.share("abs-file")).unwrap(), data);

    // Removing the links that lead outside removes the links, nothing they point at.
    for link in [
        "abs-dir",
        "rel-dir",
        "abs-file",
        "sub-up",
        "made",
        "dangling-out",
    ] {
        assert_eq!(
            raw.call(PathRequest::Remove.on(SHARE, link)),
            Response::Ok,
            "{link}"
        );
        assert!(fs::symlink_metadata(env.share(link)).is_err(), "{link}");
    }
    // A path of more than 4096 bytes does not even decode: that connection ends.
    let peer = raw.local_addr();
    let too_long = format!("{}{}", "d/".repeat(MAX_PATH_BYTES / 2), "d");
    raw.send(&Message::Request {
        id: 1000,
        body: stat(&too_long),
    });
    assert!(raw.expect_closed().frames.is_empty());
    log_line(&env, &[&peer, "path exceeds its limit"]);

    healthy.check(&env, "hostile paths");
    assert_outside_untouched(&env, &before);
    ferry_tests::assert_no_temp_files(&env.share(""));
}

/// The same hostile paths, each request wrapped in `AsCaller`, on a share whose owners
/// are the clients' (so ferryd acts as the caller): for root (not squashed, so the
/// kernel's permission checks stop nothing) and for another user, every wrapped
/// request is refused exactly as unwrapped, and nothing outside changes.
#[test]
fn path_requests_as_a_caller_are_refused_as_unwrapped() {
    let env = Env::builder()
        .server_arg("--owners")
        .server_arg(format!("{SHARE}=client,no_root_squash"))
        .start();
    let (before, healthy, mut raw) = escapes_and_sessions(&env);
    let cases = escape_cases(&env);
    let root = Caller {
        uid: 0,
        gid: 0,
        groups: Vec::new(),
    };
    let user = Caller {
        uid: 65_533,
        gid: 65_533,
        groups: vec![0, 65_533],
    };
    for caller in [root, user] {
        assert_every_kind_refused(&mut raw, &cases, Some(&caller));
        healthy.check(&env, &format!("hostile paths as {caller:?}"));
    }
    assert_outside_untouched(&env, &before);
    ferry_tests::assert_no_temp_files(&env.share(""));
}

/// `SetAttr` of a FIFO sets its mode and mtime without opening it (an open for reading
/// would wait for a writer, holding one of ferryd's threads for good).
#[test]
fn set_attr_of_a_fifo_never_opens_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let env = Env::new();
    let mut raw = open_raw(&env, Stage::InSession);
    match raw.call(PathRequest::MakeNode.on(SHARE, "fifo")) {
        Response::AttrMeta { attr, .. } => assert_eq!(attr.mode, 0o666),
        other => panic!("MakeNode: {other:?}"),
    }
    let set = Request::SetAttr {
        share: SHARE.into(),
        path: "fifo".into(),
        mode: Some(0o640),
        mtime: Some(HOSTILE_TIME),
    };
    assert_eq!(raw.call(set), Response::Ok);
    let meta = fs::symlink_metadata(env.share("fifo")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    assert_eq!(meta.mtime(), HOSTILE_TIME.secs);
    Healthy::open(&env).check(&env, "SetAttr of a FIFO");
}

/// How long [`a_symlink_swapped_in_while_a_mode_is_set_is_never_followed`] races.
const SWAP_RACE: Duration = Duration::from_secs(3);

/// One session keeps making `x` (a FIFO, a directory) and setting its mode, which
/// ferryd does by path after making or checking it; another keeps putting a symlink
/// to the canary outside in its place (`Symlink` renames over a name atomically). A
/// mode is never set through that symlink: the canary keeps its mode.
#[test]
fn a_symlink_swapped_in_while_a_mode_is_set_is_never_followed() {
    let env = Env::new();
    let (before, healthy, mut maker) = escapes_and_sessions(&env);
    let mut swapper = open_raw(&env, Stage::InSession);
    let canary = env.root().join("outside/canary");
    let canary = canary.to_str().unwrap().to_owned();
    let end = Instant::now() + SWAP_RACE;
    let swaps = thread::scope(|s| {
        let swaps = s.spawn(move || {
            let mut swaps = 0u32;
            while Instant::now() < end {
                let link = Request::Symlink {
                    share: SHARE.into(),
                    path: "x".into(),
                    target: canary.clone(),
                };
                if swapper.call(link) == Response::Ok {
                    swaps += 1;
                }
            }
            swaps
        });
        // The mode only, on the FIFO (see `set_attr_of_a_fifo_never_opens_it`); the
        // mode and the mtime on the directory.
        let mode_only = Request::SetAttr {
            share: SHARE.into(),
            path: "x".into(),
            mode: Some(0o777),
            mtime: None,
        };
        while Instant::now() < end {
            // Every answer goes: what matters is what happens outside.
            maker.call(PathRequest::Remove.on(SHARE, "x"));
            maker.call(PathRequest::MakeNode.on(SHARE, "x"));
            maker.call(mode_only.clone());
            maker.call(PathRequest::Remove.on(SHARE, "x"));
            maker.call(PathRequest::Mkdir.on(SHARE, "x"));
            maker.call(PathRequest::SetAttr.on(SHARE, "x"));
        }
        swaps.join().unwrap()
    });
    assert!(swaps > 0, "the symlink was never put in place");
    healthy.check(&env, "modes set while symlinks are swapped in");
    assert_eq!(outside(&env), before, "something outside the share changed");
}

/// One `LinkBatch` mixing links that must be made with links whose source or new name
/// is hostile, many sharing parent directories (which ferryd opens once per batch):
/// each is judged as a lone `Link` of it is, whatever came before it in the batch, and
/// nothing outside the share or in ferryd's state gains a name.
#[test]
fn a_link_batch_judges_each_link_alone_whatever_its_neighbours() {
    use ErrorKind::{Exists, InvalidPath, NotADirectory, OutsideShare};
    let env = Env::new();
    plant_escapes(&env);
    let before = outside(&env);
    let state_before = entries(&env.share(".ferry-state/manifests"));
    let healthy = Healthy::open(&env);
    let mut raw = open_raw(&env, Stage::InSession);
    // (path, the answer as a link's source, the answer as its new name).
    let cases: [(&str, ErrorKind, ErrorKind); 14] = [
        ("abs-dir/canary", OutsideShare, OutsideShare),
        ("rel-dir/canary", OutsideShare, OutsideShare),
        ("sub-up/canary", OutsideShare, OutsideShare),
        ("abs-dir/new", OutsideShare, OutsideShare),
        ("dangling-out/x", OutsideShare, OutsideShare),
        ("sub/../x", OutsideShare, OutsideShare),
        ("to-state/x", InvalidPath, InvalidPath),
        (".ferry-state/manifests", InvalidPath, InvalidPath),
        ("sub/.ferry-tmp.0123456789abcdef", InvalidPath, InvalidPath),
        ("", InvalidPath, InvalidPath),
        ("sub/f/x", NotADirectory, NotADirectory),
        // Symlinks are not followed (as a source, not a regular file; as a new name,
        // taken), nor are directories linked.
        ("abs-file", InvalidPath, Exists),
        ("to-state", InvalidPath, Exists),
        ("sub", InvalidPath, Exists),
    ];
    let mut links = Vec::new();
    let mut expected = Vec::new();
    for (i, (path, as_from, as_to)) in cases.iter().enumerate() {
        links.push(("sub/f".to_string(), format!("sub/ok-{i}")));
        expected.push(None);
        links.push((path.to_string(), format!("sub/from-{i}")));
        expected.push(Some(*as_from));
        links.push(("sub/f".to_string(), path.to_string()));
        expected.push(Some(*as_to));
        links.push(("sub/f".to_string(), format!("ok-{i}")));
        expected.push(None);
    }
    let results = match raw.call(Request::LinkBatch {
        share: SHARE.into(),
        links: links.clone(),
    }) {
        Response::LinkedBatch { results } => results,
        other => panic!("expected a LinkedBatch, got {other:?}"),
    };
    let got: Vec<_> = results.iter().map(|r| r.as_ref().map(|e| e.kind)).collect();
    for ((link, got), want) in links.iter().zip(&got).zip(&expected) {
        assert_eq!(got, want, "{link:?}");
    }
    // Each refusal names its own link's path, as a lone Link's does.
    for ((from, to), result) in links.iter().zip(&results) {
        let Some(e) = result else { continue };
        let lone = error_kind(raw.call(Request::Link {
            share: SHARE.into(),
            from: from.clone(),
            to: to.clone(),
        }));
        assert_eq!(lone, e.kind, "{from:?} -> {to:?}");
        let named = [from, to].map(|p| format!("{SHARE}/{}", p.trim_matches('/')));
        assert!(
            named.iter().any(|n| e.message.starts_with(n.as_str()))
                || e.message.starts_with(&format!("{SHARE}:")),
            "{from:?} -> {to:?}: {}",
            e.message
        );
    }
    let inode = |p: &str| {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(env.share(p)).unwrap().ino()
    };
    for i in 0..cases.len() {
        assert_eq!(inode(&format!("sub/ok-{i}")), inode("sub/f"));
        assert_eq!(inode(&format!("ok-{i}")), inode("sub/f"));
        assert!(fs::symlink_metadata(env.share(&format!("sub/from-{i}"))).is_err());
    }
    assert_eq!(entries(&env.share(".ferry-state/manifests")), state_before);
    healthy.check(&env, "a hostile link batch");
    assert_eq!(outside(&env), before, "something outside the share changed");
    ferry_tests::assert_no_temp_files(&env.share(""));
}

/// The results of an `UploadedBatch` answer, as error kinds (`None`: committed).
#[track_caller]
fn batch_results(r: Response) -> Vec<Option<ErrorKind>> {
    match r {
        Response::UploadedBatch { results } => {
            results.into_iter().map(|e| e.map(|e| e.kind)).collect()
        }
        other => panic!("expected an upload batch's results, got {other:?}"),
    }
}

#[test]
fn hostile_batches_fail_per_file_or_as_a_whole_and_never_escape() {
    let env = Env::with_shares(&[(SHARE, false), ("ro", true)]);
    plant_escapes(&env);
    fs::create_dir(env.share("taken")).unwrap();
    let before = outside(&env);
    let healthy = Healthy::open(&env);
    let mut raw = open_raw(&env, Stage::InSession);

    // Good files next to hostile ones: each hostile one fails alone, the others land.
    let (good, other, bad) = (b"good bytes".to_vec(), b"more".to_vec(), b"lies".to_vec());
    let mut bytes = good.clone();
    bytes.extend_from_slice(&other);
    bytes.extend_from_slice(&bad);
    bytes.extend_from_slice(&good);
    let region = raw.offer(bytes.clone());
    let mut damaged = batch_file("damaged", &bad);
    damaged.hash = hash_chunk(HashAlgorithm::Blake3, b"something else");
    let files = vec![
        batch_file("sub/good", &good),
        batch_file("../outside/canary", b""),
        batch_file("abs-dir/new", b""),
        batch_file("to-state/x", b""),
        batch_file(".ferry-state/manifests/x", b""),
        batch_file(".ferry-tmp.0123456789abcdef", b""),
        batch_file("taken", &other),
        damaged,
        batch_file("sub/good", &good),
    ];
    let got = batch_results(raw.call(Request::UploadBatch {
        share: SHARE.into(),
        region,
        algorithm: HashAlgorithm::Blake3,
        files,
    }));
    use ErrorKind::{Integrity, InvalidPath, IsADirectory, OutsideShare};
    assert_eq!(
        got,
        [
            None,
            Some(OutsideShare),
            Some(OutsideShare),
            Some(InvalidPath),
            Some(InvalidPath),
            Some(InvalidPath),
            Some(IsADirectory),
            Some(Integrity),
            // The same name twice in one batch: the second is refused.
            Some(InvalidPath),
        ]
    );
    assert_eq!(fs::read(env.share("sub/good")).unwrap(), good);
    assert_eq!(ferry_tests::mode_of(&env.share("sub/good")), 0o640);
    assert_eq!(ferry_tests::mtime_of(&env.share("sub/good")), 1_500_000_000);
    assert!(!env.share("damaged").exists());
    assert!(env.share("taken").is_dir());

    // Whole-batch refusals: typed errors, nothing written, the session goes on.
    let call = |raw: &mut RawClient, share: &str, region, files| {
        raw.call(Request::UploadBatch {
            share: share.into(),
            region,
            algorithm: HashAlgorithm::Blake3,
            files,
        })
    };
    let region = raw.offer(good.clone());
    let short = RegionDesc {
        len: region.len - 1,
        ..region
    };
    let cases: Vec<(&str, &str, RegionDesc, Vec<BatchFile>, ErrorKind)> = vec![
        // Sizes that do not add up to the region's length, either way.
        (
            "sizes",
            SHARE,
            short,
            vec![batch_file("x", &good)],
            ErrorKind::Protocol,
        ),
        (
            "sizes",
            SHARE,
            region,
            vec![batch_file("x", b"go")],
            ErrorKind::Protocol,
        ),
        ("no file", SHARE, NO_REGION, vec![], ErrorKind::Protocol),
        // A region claiming more than the client registered, and a revoked rkey.
        (
            "out of bounds",
            SHARE,
            RegionDesc { len: 40, ..region },
            vec![batch_file("x", &[7; 40])],
            ErrorKind::Io,
        ),
        (
            "revoked",
            SHARE,
            RegionDesc {
                rkey: 0xdead_beef,
                ..region
            },
            vec![batch_file("x", &good)],
            ErrorKind::Io,
        ),
        (
            // This session negotiated medium batches: a file may fill a chunk buffer.
            "too large a file",
            SHARE,
            RegionDesc {
                len: u64::from(DEFAULT_CHUNK_BYTES) + 1,
                ..region
            },
            vec![batch_file("x", &vec![0; DEFAULT_CHUNK_BYTES as usize + 1])],
            ErrorKind::Protocol,
        ),
        (
            "too large a region",
            SHARE,
            RegionDesc {
                len: 32 * SMALL_FILE_MAX_BYTES,
                ..region
            },
            (0..32)
                .map(|i| batch_file(&format!("x{i}"), &vec![0; SMALL_FILE_MAX_BYTES as usize]))
                .collect(),
            ErrorKind::Protocol,
        ),
        (
            "read-only share",
            "ro",
            region,
            vec![batch_file("x", &good)],
            ErrorKind::ReadOnly,
        ),
    ];
    for (what, share, region, files, expected) in cases {
        assert_eq!(
            error_kind(call(&mut raw, share, region, files)),
            expected,
            "{what}"
        );
    }
    assert_eq!(entries(&env.share_dir("ro")), Vec::<String>::new());
    assert!(!env.share("x").exists());

    // Downloads: hostile paths fail alone; what cannot be written back fails the batch.
    fs::write(env.share("empty"), b"").unwrap();
    let down = |raw: &mut RawClient, paths: &[&str], region| {
        raw.call(Request::DownloadBatch {
            share: SHARE.into(),
            paths: paths.iter().map(|p| p.to_string()).collect(),
            region,
        })
    };
    let paths = [
        "empty",
        "abs-file",
        "rel-dir/canary",
        "to-state/x",
        "sub",
        "missing",
        "sub/good",
    ];
    // A region of no bytes: the empty file is included, the non-empty one is not.
    match down(&mut raw, &paths, NO_REGION) {
        Response::DownloadedBatch { files } => {
            let kinds: Vec<String> = files
                .iter()
                .map(|f| match f {
                    BatchedFile::Ok { attr, offset, .. } => format!("ok {} at {offset}", attr.size),
                    BatchedFile::Err(e) => format!("{:?}", e.kind),
                    BatchedFile::NotIncluded => "not included".into(),
                })
                .collect();
            assert_eq!(
                kinds,
                [
                    "ok 0 at 0",
                    "OutsideShare",
                    "OutsideShare",
                    "InvalidPath",
                    "IsADirectory",
                    "NotFound",
                    "not included"
                ]
            );
        }
        other => panic!("expected a download batch, got {other:?}"),
    }
    // The raw client refuses every WRITE, as a revoked region would.
    let region = RegionDesc {
        addr: 1 << 40,
        len: 1 << 20,
        rkey: 0xdead_beef,
    };
    assert_eq!(
        error_kind(down(&mut raw, &["sub/good"], region)),
        ErrorKind::Io
    );

    // More files than a batch may name does not even decode: that connection ends.
    let peer = raw.local_addr();
    raw.send(&Message::Request {
        id: 1000,
        body: Request::DownloadBatch {
            share: SHARE.into(),
            paths: vec!["p".into(); BATCH_MAX_FILES + 1],
            region: NO_REGION,
        },
    });
    assert!(raw.expect_closed().frames.is_empty());
    log_line(&env, &[&peer, "files exceeds its limit"]);

    healthy.check(&env, "hostile batches");
    healthy.wait_settled(1);
    assert_eq!(outside(&env), before, "something outside the share changed");
    ferry_tests::assert_no_temp_files(&env.share(""));
}

/// Maps `path` on `raw`; panics unless ferryd answers `Mapped`.
#[track_caller]
fn map_open(raw: &mut RawClient, path: &str, chunk_bytes: u32) -> MappedFile {
    let open = Request::MapOpen {
        share: SHARE.into(),
        path: path.into(),
        chunk_bytes,
    };
    match raw.call(open) {
        Response::Mapped(m) => *m,
        other => panic!("MapOpen {path}: {other:?}"),
    }
}

#[test]
fn one_sided_access_outside_advertised_regions_is_refused() {
    let env = Env::new();
    let size = 200 * 1024;
    write_random_file(&env.share("m"), size, 5);
    let file = fs::read(env.share("m")).unwrap();
    let mtime = fs::metadata(env.share("m")).unwrap().modified().unwrap();
    let healthy = Healthy::open(&env);
    let mut raw = open_raw(&env, Stage::InSession);

    let chunk_bytes = 64 * 1024;
    let m = map_open(&mut raw, "m", chunk_bytes);
    let region = m.regions[0];
    let manifest = m.manifest.expect("a manifest region");
    let slice = |r: &RegionDesc, offset: u64, len: u32| RemoteSlice {
        rkey: r.rkey,
        addr: r.addr.wrapping_add(offset),
        len,
    };

    // In bounds, the file's bytes and its chunk hashes come back: the refusals below
    // are refusals, not a dead connection.
    let id = raw.read(slice(&region, 4096, 1000));
    assert_eq!(
        raw.recv(),
        Frame::ReadData {
            id,
            data: file[4096..5096].to_vec()
        }
    );
    let hashes: Vec<u8> = file
        .chunks(chunk_bytes as usize)
        .flat_map(|c| hash_chunk(HashAlgorithm::Blake3, c))
        .collect();
    let id = raw.read(slice(&manifest, 0, manifest.len as u32));
    assert_eq!(raw.recv(), Frame::ReadData { id, data: hashes });

    let len = region.len;
    let reads = [
        (
            "before the region",
            slice(&region, u64::MAX, 1),
            STATUS_OUT_OF_BOUNDS,
        ),
        (
            "across its end",
            slice(&region, len - 10, 20),
            STATUS_OUT_OF_BOUNDS,
        ),
        (
            "just past its end",
            slice(&region, len, 1),
            STATUS_OUT_OF_BOUNDS,
        ),
        (
            "at address 0",
            RemoteSlice {
                addr: 0,
                ..slice(&region, 0, 1)
            },
            STATUS_OUT_OF_BOUNDS,
        ),
        (
            "everything",
            RemoteSlice {
                addr: u64::MAX,
                ..slice(&region, 0, u32::MAX)
            },
            STATUS_OUT_OF_BOUNDS,
        ),
        (
            "past the manifest",
            slice(&manifest, 0, manifest.len as u32 + 1),
            STATUS_OUT_OF_BOUNDS,
        ),
        (
            "an rkey never issued",
            RemoteSlice {
                rkey: region.rkey.wrapping_add(1),
                ..slice(&region, 0, 1)
            },
            STATUS_INVALID_RKEY,
        ),
        (
            "rkey 0",
            RemoteSlice {
                rkey: 0,
                ..slice(&region, 0, 1)
            },
            STATUS_INVALID_RKEY,
        ),
    ];
    for (what, s, status) in reads {
        let id = raw.read(s);
        assert_eq!(raw.recv(), Frame::ReadRefused { id, status }, "READ {what}");
    }

    // The regions are registered read-only: WRITEs are refused (rights before bounds)
    // and their payload discarded, however large.
    let writes: [(&str, &RegionDesc, u64, Vec<u8>, u8); 5] = [
        (
            "the file",
            &region,
            0,
            b"overwritten!".to_vec(),
            STATUS_DENIED,
        ),
        ("the manifest", &manifest, 0, vec![0; 32], STATUS_DENIED),
        (
            "across the end",
            &region,
            len - 4,
            vec![0; 64],
            STATUS_DENIED,
        ),
        ("a MiB", &region, 0, vec![0xaa; MIB as usize], STATUS_DENIED),
        (
            "an rkey never issued",
            &RegionDesc {
                rkey: region.rkey.wrapping_add(1),
                ..region
            },
            0,
            vec![0; 8],
            STATUS_INVALID_RKEY,
        ),
    ];
    for (what, r, offset, data, status) in writes {
        let id = raw.write(r.rkey, r.addr + offset, &data);
        assert_eq!(raw.recv(), Frame::WriteResp { id, status }, "WRITE {what}");
    }

    // Another connection cannot use this one's keys.
    let mut other = open_raw(&env, Stage::InSession);
    let id = other.read(slice(&region, 0, 16));
    assert_eq!(
        other.recv(),
        Frame::ReadRefused {
            id,
            status: STATUS_INVALID_RKEY
        }
    );

    // Released, the keys are revoked at once.
    assert_eq!(
        raw.call(Request::MapRelease { handle: m.handle }),
        Response::Ok
    );
    for r in [&region, &manifest] {
        let id = raw.read(slice(r, 0, 16));
        assert_eq!(
            raw.recv(),
            Frame::ReadRefused {
                id,
                status: STATUS_INVALID_RKEY
            },
            "READ after MapRelease"
        );
        let id = raw.write(r.rkey, r.addr, &[0; 16]);
        assert_eq!(
            raw.recv(),
            Frame::WriteResp {
                id,
                status: STATUS_INVALID_RKEY
            },
            "WRITE after MapRelease"
        );
    }

    // The connection serves on; the file is as it was.
    assert!(matches!(raw.call(stat("m")), Response::Attr(a) if a.size == size));
    assert_eq!(fs::read(env.share("m")).unwrap(), file);
    assert_eq!(
        fs::metadata(env.share("m")).unwrap().modified().unwrap(),
        mtime
    );
    healthy.check(&env, "one-sided accesses");
}

/// Connections of each kind in the barrage.
const STALLED: usize = 200;
const OVERSIZED: usize = 100;
const SILENT: usize = 20;
const FLOODERS: usize = 8;

/// Refused WRITEs each flooding connection sends without reading one answer: 25
/// bytes each on the wire, 64 MiB in all per connection.
const FLOOD_WRITES: usize = (64 << 20) / 25;

/// READs each flooding connection sends without reading one answer: more than the
/// 1024 a peer may have outstanding.
const FLOOD_READS: usize = 1100;

/// Connections that READ a whole mapped window of [`WHOLE_WINDOW_BYTES`].
const WHOLE_WINDOW_READERS: usize = 2;
const WHOLE_WINDOW_BYTES: u64 = 64 * MIB;

/// Refused accesses ferryd logs one by one per connection (the TCP transport's
/// engine; later ones are only counted).
const LOGGED_REFUSALS: usize = 16;

/// How much ferryd's peak resident memory may grow under the barrage. Without the
/// bounds it checks, the barrage costs far more: the answers queued for the flooders
/// that do not read them (hundreds of MiB), and the whole-window READs staged at once
/// (128 MiB).
const BARRAGE_RSS_BOUND: u64 = 64 * MIB;

#[test]
fn a_barrage_of_hostile_connections_leaves_memory_and_descriptors_bounded() {
    // The barrage holds well over a hundred unauthenticated connections from one
    // address at once, to measure what each costs: the limits on those (per address,
    // and the random early drop) are lifted so that all of them get in.
    let env = Env::builder()
        .server_arg("--max-startups-per-source=1024")
        .server_arg("--max-startups=1024")
        .start();
    // A mapped file for the READ floods: 16 MiB, one region.
    write_random_file(&env.share("big"), 16 * MIB, 3);
    let healthy = Healthy::open(&env);
    let pid = env.server().pid();
    let idle_fds = open_fds(pid);
    let rss_before = proc_status(pid, "VmRSS");
    let start = Instant::now();
    let mut held = Vec::new();

    // Control frames that claim the largest length ferryd accepts, then stall after
    // 1 KiB.
    for i in 0..STALLED {
        let stage = if i % 2 == 0 {
            Stage::Greeted
        } else {
            Stage::InSession
        };
        let mut raw = open_raw(&env, stage);
        let mut bytes = frame_bytes(
            Header::Ctrl {
                len: MAX_SERVER_REQUEST_FRAME_BYTES as u32,
            },
            &[],
        );
        bytes.extend_from_slice(&[0x03; 1024]);
        raw.send_bytes(&bytes).unwrap();
        held.push(raw);
    }
    // Lengths over the limit: closed at once.
    for _ in 0..OVERSIZED {
        let mut raw = open_raw(&env, Stage::Greeted);
        raw.send_bytes(&frame_bytes(Header::Ctrl { len: u32::MAX }, &[]))
            .unwrap();
        assert!(raw.expect_closed().frames.is_empty());
    }
    // Connections that never even greet.
    let silent: Vec<TcpStream> = (0..SILENT).map(|_| raw_socket(env.server())).collect();
    // Refused WRITEs, whose answers are never read.
    let mut flood = Vec::with_capacity(FLOOD_WRITES * 25);
    for id in 0..FLOOD_WRITES as u64 {
        let s = RemoteSlice {
            rkey: 3,
            addr: 0,
            len: 0,
        };
        flood.extend_from_slice(&frame_bytes(Header::WriteReq { id, slice: s }, &[]));
    }
    let writers: Vec<_> = (0..FLOODERS)
        .map(|_| {
            let mut raw = open_raw(&env, Stage::InSession);
            let flood = flood.clone();
            let peer = raw.local_addr();
            let sender = thread::spawn(move || {
                raw.stream()
                    .set_write_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                // Stops when ferryd stops reading, or closes.
                let _ = raw.send_bytes(&flood);
                raw
            });
            (peer, sender)
        })
        .collect();
    // READs of a mapped file whose answers are never read.
    let mut readers = Vec::new();
    for _ in 0..FLOODERS {
        let mut raw = open_raw(&env, Stage::InSession);
        let region = map_open(&mut raw, "big", 1 << 20).regions[0];
        let mut reads = Vec::new();
        for id in 0..FLOOD_READS as u64 {
            let s = RemoteSlice {
                rkey: region.rkey,
                addr: region.addr,
                len: 1 << 20,
            };
            reads.extend_from_slice(&frame_bytes(Header::ReadReq { id, slice: s }, &[]));
        }
        // ferryd may close before it has taken them all.
        let _ = raw.send_bytes(&reads);
        readers.push((raw.local_addr(), raw));
    }
    // READs of a whole 64 MiB window whose answer is never read.
    fs::File::create(env.share("sparse"))
        .unwrap()
        .set_len(WHOLE_WINDOW_BYTES)
        .unwrap();
    for _ in 0..WHOLE_WINDOW_READERS {
        let mut raw = open_raw(&env, Stage::InSession);
        let region = map_open(&mut raw, "sparse", 1 << 20).regions[0];
        raw.read(RemoteSlice {
            rkey: region.rkey,
            addr: region.addr,
            len: WHOLE_WINDOW_BYTES as u32,
        });
        held.push(raw);
    }
    // A session whose every request slot is taken by an upload window whose READ it
    // never answers, and which then sends more messages than may wait for a slot:
    // ferryd cannot stop reading it (its own READs' answers would wait behind them),
    // so it closes it, and lets go of the 256 uploads.
    let mut stuck = open_raw(&env, Stage::InSession);
    let stuck_peer = stuck.local_addr();
    let data = vec![1u8; 4096];
    let hashes = vec![hash_chunk(HashAlgorithm::Blake3, &data)];
    let region = stuck.offer(data);
    let slots = MAX_INFLIGHT_REQUESTS as usize;
    let uploads: Vec<u64> = (0..slots)
        .map(|i| open_upload(&mut stuck, &format!("stuck-{i}"), 4096))
        .collect();
    let requests = healthy.stats().requests;
    for transfer in uploads {
        stuck.request(Request::UploadWindow {
            transfer,
            offset: 0,
            region,
            hashes: hashes.clone(),
        });
    }
    // Every window is dispatched (and stuck) before the messages that cannot be taken.
    // (Each `Stats` request counts itself.)
    let waiting = Instant::now();
    let mut polls = 0;
    loop {
        polls += 1;
        if healthy.stats().requests - polls >= requests + slots as u64 {
            break;
        }
        assert!(
            waiting.elapsed() < SETTLE_TIMEOUT,
            "the windows were not dispatched"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let one = msg_frame(&Message::Request {
        id: u64::MAX,
        body: stat(""),
    });
    let frames: Vec<u8> = (0..=CTRL_QUEUE).flat_map(|_| one.clone()).collect();
    stuck.send_bytes(&frames).unwrap();
    assert_closed_without_a_message(stuck);
    log_line(&env, &[&stuck_peer, "control messages waiting to be taken"]);
    let writers: Vec<_> = writers
        .into_iter()
        .map(|(peer, t)| (peer, t.join().unwrap()))
        .collect();
    thread::sleep(Duration::from_millis(500));

    let rss = proc_status(pid, "VmRSS");
    let peak = proc_status(pid, "VmHWM");
    let growth = peak.saturating_sub(rss_before);
    let stats = healthy.stats();
    println!(
        "barrage of {} connections in {:?}: ferryd RSS {:.1} MiB before, {:.1} MiB now, \
         peak {:.1} MiB (bound: {:.1} MiB); {} connections counted",
        STALLED + OVERSIZED + SILENT + 2 * FLOODERS + WHOLE_WINDOW_READERS + 1,
        start.elapsed(),
        rss_before as f64 / MIB as f64,
        rss as f64 / MIB as f64,
        peak as f64 / MIB as f64,
        (rss_before + BARRAGE_RSS_BOUND) as f64 / MIB as f64,
        stats.connections,
    );
    healthy.check(&env, "the barrage");
    assert!(
        growth <= BARRAGE_RSS_BOUND,
        "ferryd's peak RSS grew by {:.1} MiB under the barrage (bound {} MiB)",
        growth as f64 / MIB as f64,
        BARRAGE_RSS_BOUND / MIB
    );
    // The flooders that read no answers were cut off; their refused accesses were
    // logged a few at a time, not one line each.
    for (peer, _) in writers.iter().chain(&readers) {
        log_line(&env, &[peer, "READs and WRITEs awaiting their answers"]);
    }
    let log = env.server().stderr();
    let logged = log.lines().filter(|l| l.contains("refused peer")).count();
    assert!(
        logged <= FLOODERS * LOGGED_REFUSALS,
        "{logged} refused accesses logged one by one"
    );
    log_line(
        &env,
        &["further refused accesses of this peer are only counted"],
    );

    drop((held, silent, writers, readers));
    let settled = healthy.wait_settled(1);
    assert_eq!(settled.registrations, 0, "{settled:?}");
    let start = Instant::now();
    loop {
        let fds = open_fds(pid);
        if fds == idle_fds {
            break;
        }
        assert!(
            start.elapsed() < SETTLE_TIMEOUT,
            "ferryd holds descriptors it did not hold before: {fds:?} (idle: {idle_fds:?})"
        );
        thread::sleep(Duration::from_millis(50));
    }
    healthy.check(&env, "the barrage ended");
}

/// The regular files below `dir`, relative to it, skipping ferryd's hidden names.
fn store_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().starts_with(".ferry") {
                continue;
            }
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

/// Every entry below `dir` (names, kinds and sizes, recursively, never following a
/// symlink): what a refused `Replicate` must leave as it was.
fn tree_listing(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = fs::symlink_metadata(e.path()).unwrap();
            out.push(format!(
                "{} {:?} {}",
                e.path().display(),
                m.file_type(),
                m.len()
            ));
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// `Replicate` (a node asked by a holder of the cluster secret to fetch an object from
/// another live node) with paths that climb out of the store, absolute paths, other
/// spellings of an object's path, and an object path whose directories are symlinks
/// that lead out: each refused before anything is fetched or made, nothing outside
/// the store changes, and nothing is named in the store either. An object that does
/// not verify names nothing, not even its directory; the same request with the right
/// manifest replicates the object (so the refusals are the paths', not the request's).
#[test]
fn replicate_paths_that_leave_the_store_are_refused_before_anything_is_made() {
    use ferry_cluster::model::STORE_SHARE;
    use ferry_tests::{rcp, rcp_args, skip_without_cluster, Cluster};
    if skip_without_cluster(
        "replicate_paths_that_leave_the_store_are_refused_before_anything_is_made",
    ) {
        return;
    }
    // One stripe on one replica: the other node's store holds nothing at all.
    let cluster = Cluster::start_with_share(2, "data", 1, 1);
    let src = cluster.dir().join("src.bin");
    let size = 300_000;
    write_random_file(&src, size, 41);
    rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();
    let layout = cluster.layout_of("data", "f");
    assert_eq!(layout.stripes.len(), 1);
    let object = layout.object_path("data", 0);
    let manifest = layout.manifest(0).expect("a manifest");
    let holder = layout.stripes[0].replicas[0].clone();
    let (from, to) = if holder == cluster.node_id(1) {
        (1, 2)
    } else {
        (2, 1)
    };
    let store = cluster.node_store(to);
    assert!(
        !store.join("data").exists(),
        "one replica: node {to} holds nothing"
    );

    // Outside the store: a directory with a canary, and symlinks in the store to it.
    let outside = cluster.dir().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("canary"), b"never to be written").unwrap();
    std::os::unix::fs::symlink(&outside, store.join("abs-dir")).unwrap();
    let before_outside = tree_listing(&outside);
    let before_store = store_files(&store);
    let climb = "../".repeat(store.components().count());
    let abs = outside.join("pwn");
    let id = &layout.id;
    let hostile: Vec<String> = vec![
        format!("{climb}{}/sub/pwn", outside.display()),
        format!("../outside/sub/{id}.0"),
        abs.display().to_string(),
        format!("{}/{}/{id}.0", outside.display(), &id[..2]),
        format!("data/../../outside/{id}.0"),
        format!("data//{}/{id}.0", &id[..2]),
        format!("data/{}/{id}.0/x", &id[..2]),
        format!("data/{}/{id}.00", &id[..2]),
        "data/x/y".into(),
        String::new(),
    ];
    let from_addr = cluster.node_addr(from);
    let (host, port) = cluster
        .node_addr(to)
        .rsplit_once(':')
        .map(|(h, p)| (h.to_owned(), p.parse().unwrap()))
        .unwrap();
    let rt = runtime();
    let c = rt
        .block_on(ferry_tests::connect_to(&host, port, TransportChoice::Tcp))
        .unwrap();
    rt.block_on(c.authenticate(STORE_SHARE)).unwrap();
    let replicate = |path: &str, manifest| {
        rt.block_on(c.replicate(STORE_SHARE, path, &from_addr, size, manifest))
    };
    for path in &hostile {
        let err = replicate(path, manifest).expect_err(path);
        assert_eq!(
            err.remote_kind(),
            Some(ErrorKind::InvalidPath),
            "{path:?}: {err}"
        );
    }
    // A path of an object's shape whose first directory is a symlink out of the store.
    let through = format!("abs-dir/{}/{id}.0", &id[..2]);
    let err = replicate(&through, manifest).expect_err("through abs-dir");
    assert_eq!(err.remote_kind(), Some(ErrorKind::OutsideShare), "{err}");
    // A valid object path whose share directory, then whose fan directory, is a
    // symlink that leads out of the store.
    let fan_dir = store.join("data").join(&id[..2]);
    for link in [store.join("data"), fan_dir.clone()] {
        fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let err = replicate(&object, manifest).expect_err("through a symlink");
        assert_eq!(
            err.remote_kind(),
            Some(ErrorKind::OutsideShare),
            "{link:?}: {err}"
        );
        fs::remove_file(&link).unwrap();
    }
    fs::remove_dir(store.join("data")).unwrap();
    assert_eq!(
        tree_listing(&outside),
        before_outside,
        "outside the store changed"
    );
    assert_eq!(store_files(&store), before_store, "the store gained a name");
    assert!(!store.join("data").exists());

    // An object that does not verify: refused after the fetch, and no directory made.
    let mut wrong = manifest;
    wrong[0] ^= 1;
    let err = replicate(&object, wrong).expect_err("a wrong manifest");
    assert_eq!(err.remote_kind(), Some(ErrorKind::Integrity), "{err}");
    assert!(
        !store.join("data").exists(),
        "made a directory for an object that failed"
    );

    // The same request with the right manifest replicates it.
    replicate(&object, manifest).expect("a valid replicate");
    let want = fs::read(cluster.node_store(from).join(&object)).unwrap();
    assert_eq!(fs::read(store.join(&object)).unwrap(), want);
    assert_eq!(
        tree_listing(&outside),
        before_outside,
        "outside the store changed"
    );
    c.close();
}
