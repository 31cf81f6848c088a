//! The committed seed corpus (`tests/fuzz/corpus/TARGET/NAME`): valid inputs that
//! show the fuzzer each target's input format. Written by
//! `cargo run --manifest-path tests/fuzz/Cargo.toml --example seeds`.

use ferry_common::codec;
use ferry_common::msg::*;
use ferry_common::transport::tcp::wire::Header;
use ferry_common::transport::RemoteSlice;

use crate::server_requests::{F_DATA, F_HASHES, F_LATEST, F_PIPELINED, F_RAW, F_REGION, F_RO};
use crate::Record;

/// One seed input.
#[derive(Debug, Clone)]
pub struct Seed {
    /// The target it is for.
    pub target: &'static str,
    /// Its file name.
    pub name: &'static str,
    /// The input.
    pub bytes: Vec<u8>,
}

/// Every seed, for every target.
pub fn seeds() -> Vec<Seed> {
    let mut out = Vec::new();
    for (name, m) in messages() {
        out.push(seed("codec_decode", name, encode(&m)));
    }
    out.extend(tcp_frames());
    out.extend(sessions());
    out.extend(request_sequences());
    out
}

fn seed(target: &'static str, name: &'static str, bytes: Vec<u8>) -> Seed {
    Seed {
        target,
        name,
        bytes,
    }
}

fn encode(m: &Message) -> Vec<u8> {
    codec::encode(m).expect("seed messages are within the limits")
}

fn ts(secs: i64) -> Timestamp {
    Timestamp { secs, nanos: 5 }
}

fn hello() -> Message {
    Message::Hello(Hello {
        magic: HELLO_MAGIC,
        min_version: PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        software: "rcp/0.1.0".into(),
        nonce: [0x11; 32],
        capabilities: vec![],
    })
}

fn req(id: u64, body: Request) -> Message {
    Message::Request { id, body }
}

fn resp(id: u64, body: Response) -> Message {
    Message::Response { id, body }
}

fn s(x: &str) -> String {
    x.into()
}

fn region(len: u64) -> RegionDesc {
    RegionDesc {
        addr: 0x7f00_0000_0000,
        len,
        rkey: 0x1234_5679,
    }
}

fn attr(kind: FileKind, target: Option<&str>) -> Attr {
    Attr {
        kind,
        size: 5000,
        mode: 0o644,
        mtime: ts(1_700_000_000),
        symlink_target: target.map(s),
        ino: 1234,
        nlink: 1,
        atime: ts(1_700_000_001),
        ctime: ts(1_700_000_002),
        blocks: 16,
        dev: 2049,
    }
}

/// One message of every request and response variant, and the handshake ones.
fn messages() -> Vec<(&'static str, Message)> {
    let data = || s("data");
    vec![
        ("hello", hello()),
        (
            "welcome",
            Message::Welcome(Welcome {
                version: PROTOCOL_VERSION,
                software: s("ferryd/0.1.0"),
                chunk_bytes: DEFAULT_CHUNK_BYTES,
                max_window_chunks: MAX_WINDOW_CHUNKS as u32,
                max_inflight_requests: 256,
                nonce: [0x22; 32],
                capabilities: vec![],
            }),
        ),
        (
            "refused",
            Message::Refused(RemoteError {
                kind: ErrorKind::Protocol,
                message: s("client speaks versions 1..=1, server speaks 2"),
            }),
        ),
        (
            "req-stat",
            req(
                7,
                Request::Stat {
                    share: data(),
                    path: s("a/b"),
                    follow: true,
                },
            ),
        ),
        (
            "req-list-dir",
            req(
                1,
                Request::ListDir {
                    share: data(),
                    path: s("dir"),
                    cursor: 0,
                },
            ),
        ),
        (
            "req-mkdir",
            req(
                2,
                Request::Mkdir {
                    share: data(),
                    path: s("dir/new"),
                    mode: 0o755,
                    exist_ok: true,
                },
            ),
        ),
        (
            "req-symlink",
            req(
                3,
                Request::Symlink {
                    share: data(),
                    path: s("sneaky"),
                    target: s("../canary"),
                },
            ),
        ),
        (
            "req-set-attr",
            req(
                4,
                Request::SetAttr {
                    share: data(),
                    path: s("file"),
                    mode: Some(0o600),
                    mtime: Some(ts(1_600_000_000)),
                },
            ),
        ),
        (
            "req-upload-open",
            req(
                5,
                Request::UploadOpen {
                    share: data(),
                    path: s("up"),
                    size: 3000,
                    mode: 0o644,
                    mtime: ts(1_650_000_000),
                },
            ),
        ),
        (
            "req-upload-window",
            req(
                6,
                Request::UploadWindow {
                    transfer: 1,
                    offset: 0,
                    region: region(3000),
                    hashes: vec![[0xab; 32]],
                },
            ),
        ),
        (
            "req-upload-commit",
            req(
                7,
                Request::UploadCommit {
                    transfer: 1,
                    manifest: [0xcd; 32],
                },
            ),
        ),
        (
            "req-download-open",
            req(
                8,
                Request::DownloadOpen {
                    share: data(),
                    path: s("file"),
                },
            ),
        ),
        (
            "req-download-window",
            req(
                9,
                Request::DownloadWindow {
                    transfer: 1,
                    offset: 0,
                    region: region(1 << 20),
                    verify: false,
                },
            ),
        ),
        ("req-close", req(10, Request::Close { transfer: 1 })),
        (
            "req-map-open",
            req(
                11,
                Request::MapOpen {
                    share: data(),
                    path: s("file"),
                    chunk_bytes: 4096,
                },
            ),
        ),
        (
            "req-map-release",
            req(12, Request::MapRelease { handle: 1 }),
        ),
        ("req-statfs", req(13, Request::StatFs { share: data() })),
        ("req-stats", req(14, Request::Stats)),
        (
            "req-auth",
            req(
                15,
                Request::Auth {
                    share: data(),
                    proof: [0x33; 32],
                },
            ),
        ),
        (
            "req-link",
            req(
                16,
                Request::Link {
                    share: data(),
                    from: s("file"),
                    to: s("dir/link"),
                },
            ),
        ),
        (
            "req-rename",
            req(
                17,
                Request::Rename {
                    share: data(),
                    from: s("dir"),
                    to: s("dir2"),
                },
            ),
        ),
        (
            "req-manifest",
            req(
                18,
                Request::Manifest {
                    share: data(),
                    path: s("file"),
                    chunk_bytes: 4096,
                    first_chunk: 0,
                },
            ),
        ),
        (
            "req-upload-open-base",
            req(
                19,
                Request::UploadOpenBase {
                    share: data(),
                    path: s("new"),
                    size: 5000,
                    mode: 0o644,
                    mtime: ts(1_700_000_000),
                    base: s("file"),
                },
            ),
        ),
        (
            "req-remove",
            req(
                20,
                Request::Remove {
                    share: data(),
                    path: s("dir"),
                    recursive: true,
                },
            ),
        ),
        (
            "req-disk-usage",
            req(
                21,
                Request::DiskUsage {
                    share: data(),
                    path: s("dir"),
                },
            ),
        ),
        (
            "req-verify",
            req(
                22,
                Request::Verify {
                    share: data(),
                    path: s("file"),
                },
            ),
        ),
        (
            "req-upload-batch",
            req(
                23,
                Request::UploadBatch {
                    share: data(),
                    region: region(7),
                    algorithm: HashAlgorithm::Blake3,
                    files: vec![batch_file("a", 3), batch_file("dir/b", 4)],
                },
            ),
        ),
        (
            "req-download-batch",
            req(
                24,
                Request::DownloadBatch {
                    share: data(),
                    paths: vec![s("file"), s("dir/inner")],
                    region: region(1 << 20),
                },
            ),
        ),
        (
            "req-link-batch",
            req(
                25,
                Request::LinkBatch {
                    share: data(),
                    links: vec![
                        (s("file"), s("dir/a")),
                        (s("dir/missing"), s("dir/b")),
                        (s("file"), s(".ferry-state/x")),
                    ],
                },
            ),
        ),
        ("resp-ok", resp(1, Response::Ok)),
        (
            "resp-attr",
            resp(2, Response::Attr(attr(FileKind::Symlink, Some("file")))),
        ),
        (
            "resp-dir",
            resp(
                3,
                Response::Dir {
                    entries: vec![
                        DirEntry {
                            name: s("file"),
                            attr: attr(FileKind::File, None),
                        },
                        DirEntry {
                            name: s("link"),
                            attr: attr(FileKind::Symlink, Some("file")),
                        },
                    ],
                    next: Some(2),
                },
            ),
        ),
        (
            "resp-upload-opened",
            resp(
                4,
                Response::UploadOpened {
                    transfer: 1,
                    algorithm: HashAlgorithm::Blake3,
                },
            ),
        ),
        (
            "resp-window-pulled",
            resp(
                5,
                Response::WindowPulled {
                    bytes: 3000,
                    reused: 0,
                },
            ),
        ),
        (
            "resp-committed",
            resp(6, Response::Committed { size: 3000 }),
        ),
        (
            "resp-download-opened",
            resp(
                7,
                Response::DownloadOpened {
                    transfer: 2,
                    attr: attr(FileKind::File, None),
                    algorithm: HashAlgorithm::Sha256,
                },
            ),
        ),
        (
            "resp-window-pushed",
            resp(
                8,
                Response::WindowPushed {
                    hashes: vec![[1; 32], [2; 32]],
                },
            ),
        ),
        (
            "resp-error",
            resp(
                9,
                Response::Error(RemoteError {
                    kind: ErrorKind::OutsideShare,
                    message: s("data/escape: path resolves outside the share"),
                }),
            ),
        ),
        (
            "resp-error-too-many-links",
            resp(
                9,
                Response::Error(RemoteError {
                    kind: ErrorKind::TooManyLinks,
                    message: s("data/snap/f: cannot link: too many links to the file"),
                }),
            ),
        ),
        (
            "resp-mapped",
            resp(
                10,
                Response::Mapped(Box::new(MappedFile {
                    handle: 1,
                    attr: attr(FileKind::File, None),
                    version: FileVersion {
                        algorithm: HashAlgorithm::Sha256,
                        size: 5000,
                        mtime: ts(1_700_000_000),
                        ctime: ts(1_700_000_002),
                        ino: 1234,
                        chunk_bytes: 4096,
                        manifest: [3; 32],
                    },
                    window_bytes: MAP_WINDOW_BYTES,
                    regions: vec![region(5000)],
                    manifest: Some(region(64)),
                })),
            ),
        ),
        (
            "resp-fs-stat",
            resp(
                11,
                Response::FsStat(FsStat {
                    block_size: 4096,
                    blocks: 1000,
                    blocks_free: 500,
                    blocks_avail: 400,
                    files: 100,
                    files_free: 50,
                    name_max: 255,
                }),
            ),
        ),
        (
            "resp-stats",
            resp(
                12,
                Response::Stats(ServerStats {
                    requests: 3,
                    connections: 1,
                    ..ServerStats::default()
                }),
            ),
        ),
        (
            "resp-authenticated",
            resp(
                13,
                Response::Authenticated {
                    proof: Some([0x44; 32]),
                },
            ),
        ),
        (
            "resp-manifest",
            resp(
                14,
                Response::Manifest {
                    version: FileVersion {
                        algorithm: HashAlgorithm::Sha256,
                        size: 5000,
                        mtime: ts(1_700_000_000),
                        ctime: ts(1_700_000_002),
                        ino: 1234,
                        chunk_bytes: 4096,
                        manifest: [3; 32],
                    },
                    first_chunk: 0,
                    hashes: vec![[5; 32], [6; 32]],
                },
            ),
        ),
        (
            "resp-disk-usage",
            resp(
                15,
                Response::DiskUsage(DiskUsage {
                    files: 3,
                    dirs: 2,
                    bytes: 5100,
                    unique_bytes: 8192,
                }),
            ),
        ),
        (
            "resp-verified",
            resp(
                16,
                Response::Verified(VerifyReport {
                    algorithm: HashAlgorithm::Sha256,
                    record: VerifyRecord::Stale {
                        size_changed: false,
                        mtime_changed: false,
                    },
                    size: 5000,
                    chunk_bytes: 4096,
                    chunks: 2,
                    bad_count: 1,
                    bad_chunks: vec![1],
                }),
            ),
        ),
        (
            "resp-uploaded-batch",
            resp(
                17,
                Response::UploadedBatch {
                    results: vec![
                        None,
                        Some(RemoteError::new(ErrorKind::Integrity, "data/b: damaged")),
                    ],
                },
            ),
        ),
        (
            "resp-downloaded-batch",
            resp(
                18,
                Response::DownloadedBatch {
                    files: vec![
                        BatchedFile::Ok {
                            algorithm: HashAlgorithm::Sha256,
                            attr: attr(FileKind::File, None),
                            offset: 0,
                            hash: [8; 32],
                        },
                        BatchedFile::Err(RemoteError::new(ErrorKind::NotFound, "data/x")),
                        BatchedFile::NotIncluded,
                    ],
                },
            ),
        ),
        (
            "resp-linked-batch",
            resp(
                19,
                Response::LinkedBatch {
                    results: vec![
                        None,
                        Some(RemoteError {
                            kind: ErrorKind::NotFound,
                            message: s("data/dir/missing: no such file or directory"),
                        }),
                    ],
                },
            ),
        ),
    ]
}

fn batch_file(path: &str, size: u64) -> BatchFile {
    BatchFile {
        path: s(path),
        size,
        mode: 0o640,
        mtime: ts(1_600_000_000),
        hash: [3; 32],
    }
}

fn frame(header: Header, payload: &[u8], out: &mut Vec<u8>) {
    header.encode(out);
    out.extend_from_slice(payload);
}

fn tcp_frames() -> Vec<Seed> {
    let slice = RemoteSlice {
        rkey: 0x1234_5679,
        addr: 0x7f00_0000_0000,
        len: 4,
    };
    let hello = encode(&hello());
    let mut ctrl = Vec::new();
    frame(
        Header::Ctrl {
            len: hello.len() as u32,
        },
        &hello,
        &mut ctrl,
    );
    let mut all = ctrl.clone();
    frame(Header::ReadReq { id: 1, slice }, &[], &mut all);
    frame(Header::ReadData { id: 2, len: 4 }, b"data", &mut all);
    frame(Header::ReadRefused { id: 3, status: 1 }, &[], &mut all);
    frame(Header::WriteReq { id: 4, slice }, b"wxyz", &mut all);
    frame(Header::WriteResp { id: 5, status: 0 }, &[], &mut all);
    vec![
        seed("tcp_frame", "ctrl-hello", ctrl),
        seed("tcp_frame", "every-kind", all),
    ]
}

/// `server_session` record kinds (see that module).
const MESSAGE: u8 = 0;
const ADVANCE: u8 = 1;
const SECONDS: u8 = 4;
const RESPOND_OUTSTANDING: u8 = 2;
const RESPOND_ANY: u8 = 3;
const VALID_AUTH: u8 = 4;

fn records(steps: &[(u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (flags, bytes) in steps {
        Record::encode(*flags, bytes, &mut out);
    }
    out
}

fn sessions() -> Vec<Seed> {
    let stat = |id| {
        encode(&req(
            id,
            Request::Stat {
                share: s("data"),
                path: s("file"),
                follow: false,
            },
        ))
    };
    let attr_resp = encode(&resp(0, Response::Attr(attr(FileKind::File, None))));
    let old_hello = encode(&Message::Hello(Hello {
        magic: HELLO_MAGIC,
        min_version: 1,
        max_version: 1,
        software: s("rcp/0.0.1"),
        nonce: [0; 32],
        capabilities: vec![],
    }));
    let session = |name, steps: &[(u8, Vec<u8>)]| seed("server_session", name, records(steps));
    let valid_auth = |id: u64, share: &str| [&id.to_le_bytes()[..], share.as_bytes()].concat();
    let wrong_auth = encode(&req(
        9,
        Request::Auth {
            share: s("data"),
            proof: [0x55; 32],
        },
    ));
    vec![
        session(
            "requests-and-answers",
            &[
                (MESSAGE, encode(&hello())),
                (MESSAGE, stat(7)),
                (MESSAGE | VALID_AUTH, valid_auth(8, "data")),
                (MESSAGE | VALID_AUTH, valid_auth(9, "pub")),
                (MESSAGE | VALID_AUTH, valid_auth(10, "nope")),
                (MESSAGE, stat(1)),
                (MESSAGE, encode(&req(2, Request::Stats))),
                (RESPOND_OUTSTANDING, [&[0][..], &attr_resp].concat()),
                (RESPOND_ANY, 2u64.to_le_bytes().to_vec()),
                (MESSAGE, stat(1)),
                (ADVANCE | SECONDS, 11u32.to_le_bytes().to_vec()),
            ],
        ),
        session(
            "handshake-timeout",
            &[
                (ADVANCE | SECONDS, 9u32.to_le_bytes().to_vec()),
                (ADVANCE, 1000u32.to_le_bytes().to_vec()),
                (MESSAGE, encode(&hello())),
            ],
        ),
        session(
            "wrong-secret",
            &[(MESSAGE, encode(&hello())), (MESSAGE, wrong_auth)],
        ),
        session("old-client", &[(MESSAGE, old_hello)]),
        session("tables", &tables()),
        session("request-before-hello", &[(MESSAGE, stat(1))]),
        session(
            "duplicate-request",
            &[
                (MESSAGE, encode(&hello())),
                (MESSAGE, stat(5)),
                (MESSAGE, stat(5)),
            ],
        ),
    ]
}

/// Requests the connection's tables decide: windows and closes of transfers that are
/// not open or not of the right kind (refused), an upload and a mapped file opened and
/// answered (then open), a close, a release, and a malformed batch.
fn tables() -> Vec<(u8, Vec<u8>)> {
    let public = |id, body| (MESSAGE, encode(&req(id, body)));
    let window = |transfer| Request::UploadWindow {
        transfer,
        offset: 0,
        region: RegionDesc {
            addr: 0,
            len: 4096,
            rkey: 1,
        },
        hashes: vec![[0; 32]],
    };
    let opened = encode(&resp(
        0,
        Response::UploadOpened {
            transfer: 1,
            algorithm: HashAlgorithm::Sha256,
        },
    ));
    vec![
        (MESSAGE, encode(&hello())),
        public(1, window(5)),
        public(
            2,
            Request::UploadOpen {
                share: s("pub"),
                path: s("f"),
                size: 4096,
                mode: 0o644,
                mtime: ts(1),
            },
        ),
        (RESPOND_OUTSTANDING, [&[0][..], &opened].concat()),
        public(3, window(1)),
        public(
            4,
            Request::DownloadWindow {
                verify: false,
                transfer: 1,
                offset: 0,
                region: RegionDesc {
                    addr: 0,
                    len: 4096,
                    rkey: 1,
                },
            },
        ),
        (RESPOND_ANY, 3u64.to_le_bytes().to_vec()),
        public(5, Request::Close { transfer: 1 }),
        public(6, Request::Close { transfer: 1 }),
        public(
            7,
            Request::MapOpen {
                share: s("pub"),
                path: s("f"),
                chunk_bytes: 4096,
            },
        ),
        (RESPOND_ANY, 7u64.to_le_bytes().to_vec()),
        public(8, Request::MapRelease { handle: 1 }),
        public(9, Request::MapRelease { handle: 1 }),
        public(
            10,
            Request::UploadBatch {
                algorithm: HashAlgorithm::Sha256,
                share: s("pub"),
                region: RegionDesc {
                    addr: 0,
                    len: 3,
                    rkey: 1,
                },
                files: vec![],
            },
        ),
    ]
}

fn request_sequences() -> Vec<Seed> {
    let r = |flags: u8, body: Request| (flags, encode(&req(0, body)));
    let d = s("data");
    let stat = |path: &str, follow| Request::Stat {
        share: s("data"),
        path: s(path),
        follow,
    };
    let upload_open = |path: &str, size| Request::UploadOpen {
        share: s("data"),
        path: s(path),
        size,
        mode: 0o640,
        mtime: ts(1_650_000_000),
    };
    let upload_window = Request::UploadWindow {
        transfer: 1,
        offset: 0,
        region: region(0),
        hashes: Vec::new(),
    };
    let commit = Request::UploadCommit {
        transfer: 1,
        manifest: [0; 32],
    };
    let sequence = |name, steps: &[(u8, Vec<u8>)]| seed("server_requests", name, records(steps));
    let both = F_REGION | F_HASHES | F_LATEST;
    vec![
        sequence(
            "metadata",
            &[
                r(F_DATA, stat("file", false)),
                r(F_DATA, stat("escape", true)),
                r(F_DATA, stat("dirlink/inner", true)),
                r(
                    F_DATA,
                    Request::ListDir {
                        share: d.clone(),
                        path: s(""),
                        cursor: 0,
                    },
                ),
                r(
                    F_DATA,
                    Request::Mkdir {
                        share: d.clone(),
                        path: s("dir/new"),
                        mode: 0o700,
                        exist_ok: false,
                    },
                ),
                r(
                    F_DATA,
                    Request::SetAttr {
                        share: d.clone(),
                        path: s("dir/new"),
                        mode: Some(0o755),
                        mtime: Some(ts(-1)),
                    },
                ),
                r(
                    F_DATA,
                    Request::Symlink {
                        share: d.clone(),
                        path: s("dir/sneaky"),
                        target: s("../../outside/secret"),
                    },
                ),
                r(F_DATA, stat("dir/sneaky", true)),
                r(F_DATA, Request::StatFs { share: d.clone() }),
                r(0, Request::Stats),
            ],
        ),
        sequence(
            "upload",
            &[
                r(F_DATA, upload_open("up", 3000)),
                r(both, upload_window.clone()),
                r(F_HASHES | F_LATEST, commit.clone()),
                r(F_DATA, stat("up", false)),
            ],
        ),
        sequence(
            "upload-two-chunks-over-a-link",
            &[
                r(F_DATA, upload_open("escape", (1 << 20) + 100)),
                r(both, upload_window.clone()),
                r(F_HASHES | F_LATEST, commit),
            ],
        ),
        sequence(
            "upload-abort",
            &[
                r(F_DATA, upload_open("dir/partial", 10)),
                r(F_REGION | F_LATEST, upload_window.clone()),
                r(F_LATEST, Request::Close { transfer: 1 }),
            ],
        ),
        sequence(
            "download",
            &[
                r(
                    F_DATA,
                    Request::DownloadOpen {
                        share: d.clone(),
                        path: s("link"),
                    },
                ),
                r(
                    F_REGION | F_LATEST,
                    Request::DownloadWindow {
                        verify: false,
                        transfer: 1,
                        offset: 0,
                        region: region(0),
                    },
                ),
                r(F_LATEST, Request::Close { transfer: 1 }),
            ],
        ),
        sequence(
            "map",
            &[
                r(
                    F_DATA,
                    Request::MapOpen {
                        share: d.clone(),
                        path: s("file"),
                        chunk_bytes: 4096,
                    },
                ),
                r(F_LATEST, Request::MapRelease { handle: 1 }),
                r(
                    F_DATA,
                    Request::MapOpen {
                        share: d.clone(),
                        path: s("dir/inner"),
                        chunk_bytes: 0,
                    },
                ),
            ],
        ),
        sequence(
            "backup",
            &[
                r(
                    F_DATA,
                    Request::UploadOpenBase {
                        share: d.clone(),
                        path: s("dir/new"),
                        size: 5000,
                        mode: 0o644,
                        mtime: ts(1_700_000_000),
                        base: s("file"),
                    },
                ),
                r(
                    F_LATEST | F_REGION | F_HASHES,
                    Request::UploadWindow {
                        transfer: 1,
                        offset: 0,
                        region: region(5000),
                        hashes: vec![],
                    },
                ),
                r(
                    F_LATEST | F_HASHES,
                    Request::UploadCommit {
                        transfer: 1,
                        manifest: [0; 32],
                    },
                ),
                r(
                    F_DATA,
                    Request::Manifest {
                        share: d.clone(),
                        path: s("dir/new"),
                        chunk_bytes: 4096,
                        first_chunk: 0,
                    },
                ),
                r(
                    F_DATA,
                    Request::Link {
                        share: d.clone(),
                        from: s("dir/new"),
                        to: s("linked"),
                    },
                ),
                r(
                    F_DATA,
                    Request::LinkBatch {
                        share: d.clone(),
                        links: vec![
                            (s("dir/new"), s("batch1")),
                            (s("dir/none"), s("batch2")),
                            (s("file"), s("linked")),
                            (s("file"), s(".ferry-state/x")),
                            (s("escape"), s("batch3")),
                            (s("file"), s("escape")),
                            (s("file"), s("batch4")),
                        ],
                    },
                ),
                r(
                    F_DATA,
                    Request::Verify {
                        share: d.clone(),
                        path: s("linked"),
                    },
                ),
                r(
                    F_DATA,
                    Request::Verify {
                        share: d.clone(),
                        path: s(".ferry-state/manifests"),
                    },
                ),
                r(
                    F_DATA,
                    Request::Rename {
                        share: d.clone(),
                        from: s("dir"),
                        to: s("dir2"),
                    },
                ),
                r(
                    F_DATA,
                    Request::DiskUsage {
                        share: d.clone(),
                        path: s(""),
                    },
                ),
                r(
                    F_DATA,
                    Request::Remove {
                        share: d.clone(),
                        path: s("linked"),
                        recursive: false,
                    },
                ),
                r(
                    F_DATA,
                    Request::Remove {
                        share: d.clone(),
                        path: s("dirlink"),
                        recursive: true,
                    },
                ),
                r(
                    F_DATA,
                    Request::Remove {
                        share: d.clone(),
                        path: s("dir2"),
                        recursive: true,
                    },
                ),
            ],
        ),
        sequence(
            "read-only-share",
            &[
                r(
                    F_RO,
                    Request::Mkdir {
                        share: s("ro"),
                        path: s("x"),
                        mode: 0o755,
                        exist_ok: true,
                    },
                ),
                r(F_RO, upload_open("file", 1)),
                r(
                    F_RO,
                    Request::Stat {
                        share: s("ro"),
                        path: s("escape"),
                        follow: true,
                    },
                ),
            ],
        ),
        sequence(
            "pipelined",
            &[
                r(F_DATA, upload_open("dir/racing", 4000)),
                r(both | F_PIPELINED, upload_window),
                r(F_LATEST | F_PIPELINED, Request::Close { transfer: 1 }),
                r(
                    F_DATA | F_PIPELINED,
                    Request::MapOpen {
                        share: s("data"),
                        path: s("file"),
                        chunk_bytes: 65536,
                    },
                ),
                r(F_PIPELINED, Request::MapRelease { handle: 1 }),
                r(
                    F_DATA | F_PIPELINED,
                    Request::Symlink {
                        share: s("data"),
                        path: s("file"),
                        target: s("dir"),
                    },
                ),
                r(F_DATA, stat("file", true)),
            ],
        ),
        sequence(
            "batches",
            &[
                r(
                    F_DATA | F_REGION | F_HASHES,
                    Request::UploadBatch {
                        algorithm: HashAlgorithm::Sha256,
                        share: d.clone(),
                        region: region(0),
                        files: vec![
                            batch_file("small", 3000),
                            batch_file("dir/small", 10),
                            batch_file("escape", 5),
                            batch_file("dir", 1),
                            batch_file(".ferry-state/x", 1),
                            batch_file("small", 2),
                        ],
                    },
                ),
                r(
                    F_DATA | F_REGION,
                    Request::DownloadBatch {
                        share: d.clone(),
                        paths: vec![
                            s("small"),
                            s("dir/small"),
                            s("link"),
                            s("dir"),
                            s("escape"),
                            s("missing"),
                        ],
                        region: region(0),
                    },
                ),
                r(
                    F_RO | F_REGION | F_HASHES,
                    Request::UploadBatch {
                        algorithm: HashAlgorithm::Sha256,
                        share: s("ro"),
                        region: region(0),
                        files: vec![batch_file("new", 1)],
                    },
                ),
                r(
                    F_DATA,
                    Request::UploadBatch {
                        algorithm: HashAlgorithm::Sha256,
                        share: d.clone(),
                        region: region(5),
                        files: vec![batch_file("sum-mismatch", 4)],
                    },
                ),
            ],
        ),
        sequence(
            "raw-garbage",
            &[r(F_DATA, stat("file", true)), (F_RAW, vec![3, 1, 99])],
        ),
    ]
}
