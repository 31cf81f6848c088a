//! The connection's tables: every refusal of a request naming a transfer, a mapped
//! file or a batch, decided by the server's core before its driver sees the request,
//! and the limits on what one connection holds.

use super::{error_kind, Pair, CHUNK};
use crate::chunk::hash_chunk;
use crate::msg::*;
use crate::proto::batch::batch_capacity;
use crate::proto::conn::{MAX_OPEN_MAPS, MAX_OPEN_TRANSFERS};

fn open_upload(p: &mut Pair, path: &str, size: u64) -> u64 {
    match p.call(Request::UploadOpen {
        share: "s".into(),
        path: path.into(),
        size,
        mode: 0o644,
        mtime: Timestamp { secs: 0, nanos: 0 },
    }) {
        Response::UploadOpened { transfer, .. } => transfer,
        other => panic!("{other:?}"),
    }
}

fn open_download(p: &mut Pair, path: &str) -> Response {
    p.call(Request::DownloadOpen {
        share: "s".into(),
        path: path.into(),
    })
}

fn region(len: u64) -> RegionDesc {
    RegionDesc {
        addr: 0,
        len,
        rkey: 77,
    }
}

/// Sends `body`, expects a refusal of `kind` whose message holds `words`, and checks
/// the driver never saw the request.
fn refused(p: &mut Pair, body: Request, kind: ErrorKind, words: &str) {
    let reached = p.reached_driver();
    let answer = p.call(body.clone());
    match &answer {
        Response::Error(e) => {
            assert_eq!(e.kind, kind, "{body:?}: {e:?}");
            assert!(e.message.contains(words), "{body:?}: {e:?}");
        }
        other => panic!("{body:?} was answered {other:?}"),
    }
    assert_eq!(p.reached_driver(), reached, "{body:?} reached the driver");
}

#[test]
fn requests_naming_transfers_are_checked_against_the_table() {
    let (mut p, sim) = Pair::served();
    sim.borrow_mut().files.insert("d".into(), vec![1; 100]);
    let up = open_upload(&mut p, "u", 8192);
    let Response::DownloadOpened { transfer: down, .. } = open_download(&mut p, "d") else {
        panic!("download not opened");
    };
    let window = |transfer| Request::UploadWindow {
        transfer,
        offset: 0,
        region: region(4096),
        hashes: vec![[0; 32]],
    };
    let push = |transfer| Request::DownloadWindow {
        verify: false,
        transfer,
        offset: 0,
        region: region(100),
    };
    let commit = |transfer| Request::UploadCommit {
        transfer,
        manifest: [0; 32],
    };
    let protocol = ErrorKind::Protocol;
    refused(&mut p, window(99), protocol, "no open transfer 99");
    refused(&mut p, window(down), protocol, "is not an upload");
    refused(&mut p, commit(down), protocol, "is not an upload");
    refused(&mut p, push(up), protocol, "is not a download");
    refused(&mut p, push(99), protocol, "no open transfer 99");
    refused(
        &mut p,
        Request::Close { transfer: 99 },
        protocol,
        "no open transfer 99",
    );
    // A close takes the transfer out of the table: nothing can name it after.
    assert_eq!(p.call(Request::Close { transfer: down }), Response::Ok);
    refused(
        &mut p,
        push(down),
        protocol,
        &format!("no open transfer {down}"),
    );
    refused(
        &mut p,
        Request::Close { transfer: down },
        protocol,
        "no open transfer",
    );
    assert_eq!(p.server.conn().transfers(), 1);
    assert!(p.server_closed().is_none());
}

#[test]
fn window_geometry_and_incomplete_commits_are_refused_by_the_upload_core() {
    let (mut p, sim) = Pair::served();
    let up = open_upload(&mut p, "u", 3 * 4096);
    let data = vec![3u8; 2 * 4096];
    let hashes = vec![hash_chunk(HashAlgorithm::Blake3, &data[..4096]); 2];
    let r = sim.borrow_mut().memory.register(data);
    let send = |p: &mut Pair, offset, hashes: Vec<Hash256>| {
        p.call(Request::UploadWindow {
            transfer: up,
            offset,
            region: r,
            hashes,
        })
    };
    // One hash short, unaligned, past the end.
    for (offset, n) in [(0, 1), (100, 2), (2 * 4096, 2)] {
        let answer = send(&mut p, offset, hashes[..n].to_vec());
        assert_eq!(error_kind(&answer), Some(ErrorKind::Protocol), "{answer:?}");
    }
    assert!(matches!(
        send(&mut p, 0, hashes.clone()),
        Response::WindowPulled { bytes: 8192, .. }
    ));
    // The same chunks twice.
    let again = send(&mut p, 0, hashes);
    assert_eq!(error_kind(&again), Some(ErrorKind::Protocol), "{again:?}");
    // One chunk of three verified: the commit is refused and the upload stays open.
    let answer = p.call(Request::UploadCommit {
        transfer: up,
        manifest: [0; 32],
    });
    assert_eq!(error_kind(&answer), Some(ErrorKind::Protocol), "{answer:?}");
    assert_eq!(p.server.conn().transfers(), 1);
    assert!(!sim.borrow().files.contains_key("u"));
}

#[test]
fn a_connection_holds_a_bounded_number_of_transfers() {
    let (mut p, sim) = Pair::served();
    sim.borrow_mut().files.insert("d".into(), vec![1; 10]);
    // A failed open gives its slot back.
    let missing = open_download(&mut p, "missing");
    assert_eq!(error_kind(&missing), Some(ErrorKind::NotFound));
    assert_eq!(p.server.conn().transfers(), 0);
    let ids: Vec<u64> = (0..MAX_OPEN_TRANSFERS)
        .map(|_| match open_download(&mut p, "d") {
            Response::DownloadOpened { transfer, .. } => transfer,
            other => panic!("{other:?}"),
        })
        .collect();
    let reached = p.reached_driver();
    let over = open_download(&mut p, "d");
    assert_eq!(error_kind(&over), Some(ErrorKind::Protocol), "{over:?}");
    assert_eq!(p.reached_driver(), reached, "a refused open costs no I/O");
    assert_eq!(p.call(Request::Close { transfer: ids[0] }), Response::Ok);
    let Response::DownloadOpened { transfer, .. } = open_download(&mut p, "d") else {
        panic!("no slot after a close");
    };
    // Ids are never reused on a connection.
    assert!(!ids.contains(&transfer));
}

#[test]
fn a_connection_holds_a_bounded_number_of_mapped_files() {
    let (mut p, sim) = Pair::served();
    sim.borrow_mut().files.insert("m".into(), vec![2; 5000]);
    let map = |p: &mut Pair| {
        p.call(Request::MapOpen {
            share: "s".into(),
            path: "m".into(),
            chunk_bytes: CHUNK,
        })
    };
    let handles: Vec<u64> = (0..MAX_OPEN_MAPS)
        .map(|_| match map(&mut p) {
            Response::Mapped(m) => m.handle,
            other => panic!("{other:?}"),
        })
        .collect();
    let reached = p.reached_driver();
    let over = map(&mut p);
    assert_eq!(error_kind(&over), Some(ErrorKind::Busy), "{over:?}");
    assert_eq!(p.reached_driver(), reached);
    refused(
        &mut p,
        Request::MapRelease { handle: 1 << 40 },
        ErrorKind::Protocol,
        "no mapped file",
    );
    assert_eq!(
        p.call(Request::MapRelease { handle: handles[7] }),
        Response::Ok
    );
    refused(
        &mut p,
        Request::MapRelease { handle: handles[7] },
        ErrorKind::Protocol,
        "no mapped file",
    );
    assert!(matches!(map(&mut p), Response::Mapped(_)));
    // A failed open gives its slot back.
    assert_eq!(
        p.call(Request::MapRelease { handle: handles[8] }),
        Response::Ok
    );
    let missing = p.call(Request::MapOpen {
        share: "s".into(),
        path: "missing".into(),
        chunk_bytes: CHUNK,
    });
    assert_eq!(error_kind(&missing), Some(ErrorKind::NotFound));
    assert_eq!(p.server.conn().maps(), MAX_OPEN_MAPS - 1);
    assert!(matches!(map(&mut p), Response::Mapped(_)));
}

#[test]
fn upload_batches_are_checked_as_a_whole() {
    let (mut p, _sim) = Pair::served();
    let file = |size: u64| BatchFile {
        path: format!("f{size}"),
        size,
        mode: 0o644,
        mtime: Timestamp { secs: 0, nanos: 0 },
        hash: [0; 32],
    };
    let batch = |files: Vec<BatchFile>, len: u64| Request::UploadBatch {
        algorithm: HashAlgorithm::Blake3,
        share: "s".into(),
        region: region(len),
        files,
    };
    let capacity = batch_capacity(CHUNK);
    let protocol = ErrorKind::Protocol;
    refused(&mut p, batch(vec![], 0), protocol, "no file");
    refused(
        &mut p,
        batch(
            vec![file(SMALL_FILE_MAX_BYTES + 1)],
            SMALL_FILE_MAX_BYTES + 1,
        ),
        protocol,
        "a batched file of",
    );
    refused(
        &mut p,
        batch(vec![file(10), file(20)], 31),
        protocol,
        "hold 30 bytes",
    );
    refused(
        &mut p,
        batch(vec![file(capacity), file(1)], capacity + 1),
        protocol,
        "a batch region of",
    );
    assert!(p.server_closed().is_none());
}

#[test]
fn a_closed_session_forgets_what_was_being_opened() {
    let (mut p, _sim) = Pair::served();
    // The driver never answers the open; then the session ends.
    p.responder = Box::new(|_, _| None);
    p.client
        .request(
            p.now,
            Request::UploadOpen {
                share: "s".into(),
                path: "u".into(),
                size: 1,
                mode: 0o644,
                mtime: Timestamp { secs: 0, nanos: 0 },
            },
        )
        .unwrap();
    p.drive();
    assert_eq!(p.server.conn().transfers(), 1);
    p.to_server.push_back(vec![0xff]);
    p.drive();
    assert!(p.server_closed().is_some());
    assert_eq!(p.server.conn().transfers(), 0);
}

#[test]
fn namespace_and_admin_requests_pass_the_tables_to_their_driver() {
    let mut p = Pair::new();
    let grants = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let seen = grants.clone();
    p.responder = Box::new(move |req, grant| {
        seen.borrow_mut()
            .push((crate::proto::conn::Family::of(req), grant));
        Some(Response::Ok)
    });
    use crate::proto::conn::{Family, Grant};
    let requests = [
        (super::stat("a"), Family::Namespace),
        (
            Request::Mkdir {
                share: "s".into(),
                path: "d".into(),
                mode: 0o755,
                exist_ok: true,
            },
            Family::Namespace,
        ),
        (
            Request::Rename {
                share: "s".into(),
                from: "a".into(),
                to: "b".into(),
            },
            Family::Namespace,
        ),
        (
            Request::SetMeta {
                share: "s".into(),
                entries: vec![],
            },
            Family::Namespace,
        ),
        (
            Request::ListDirMeta {
                share: "s".into(),
                path: "d".into(),
                cursor: 0,
            },
            Family::Namespace,
        ),
        (Request::Stats, Family::Admin),
        (
            Request::Verify {
                share: "s".into(),
                path: "a".into(),
            },
            Family::Admin,
        ),
    ];
    for (req, _) in &requests {
        assert_eq!(p.call(req.clone()), Response::Ok);
    }
    let want: Vec<_> = requests.iter().map(|(_, f)| (*f, Grant::None)).collect();
    assert_eq!(*grants.borrow(), want);
}
