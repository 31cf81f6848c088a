//! `server_requests`: fuzzed requests to a real in-process ferryd.
//!
//! One [`Server`] (shares `data`, writable, and `ro`, read-only) lives for the whole
//! run, in a temporary directory that also holds things no request may touch: a
//! `canary` file and an `outside` directory next to the share roots, which symlinks in
//! the share point at. Each input opens one connection over the tcp transport on
//! loopback, exactly as `ferryd` serves one (`Server::handle_connection`), says hello,
//! and sends its records as requests one at a time, waiting for each answer.
//!
//! Record flags: bit 7 sends `bytes` as they are (decodable or not, but never an
//! upload too large, see below) and ends the input; otherwise `bytes` must decode to a `Message::Request` (anything else is
//! skipped) whose id the harness replaces with a fresh one, whose upload size it keeps
//! below [`MAX_RESERVED_BYTES`] unless no disk could hold it, and which the low bits
//! adjust so that the fuzzer reaches deep paths: [`F_DATA`] / [`F_RO`] set the share,
//! [`F_REGION`] points a window at the harness's registered buffer, [`F_HASHES`] puts
//! in the right chunk hashes or manifest, [`F_LATEST`] names the transfer or mapped
//! file the server opened last (of those answered), and [`F_PIPELINED`] sends the
//! next request without waiting for this one's answer, so requests run concurrently.
//!
//! Checked for every input: nothing panics (in any task); every request gets exactly
//! one answer, which decodes within the protocol limits; the server never closes the
//! connection on a well-formed request; no answer describes a file outside the shares
//! or names the server's own paths; no listing shows a temporary file; a committed
//! upload holds exactly the bytes of its manifest, and a pushed download window the
//! bytes of its hashes (checked when no other request is in flight); when the
//! connection ends, the server's connection task finishes, no temporary file is left
//! in the share but the resumable partials (and journals) of unfinished uploads, and
//! no mapped file, transfer or registration is still counted; the
//! canary, the `outside` directory and the read-only share are untouched.
//!
//! With `FERRY_FUZZ_TRACE` set, every request and its answer are printed to stderr.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_common::auth::{Nonce, Secret};
use ferry_common::chunk::{hash_chunk, hash_chunks, manifest_id};
use ferry_common::codec;
use ferry_common::journal::read_journal;
use ferry_common::msg::{
    Attr, BatchedFile, Hash256, HashAlgorithm, Hello, Message, Request, Response,
    DEFAULT_CHUNK_BYTES, HELLO_MAGIC, PROTOCOL_VERSION, SMALL_FILE_MAX_BYTES,
};
use ferry_common::path::components;
use ferry_common::staging::{JOURNAL_SUFFIX, PART_SUFFIX};
use ferry_common::transport::tcp::Tcp;
use ferry_common::transport::{Access, Buffer, Memory, Registration, Transport};
use ferry_common::{STATE_DIR, TEMP_PREFIX};
use ferry_server::{Config, Server};
use tokio::net::{TcpListener, TcpSocket};
use tokio::runtime::Runtime;

use crate::records;

/// Flag: send to share `data`.
pub const F_DATA: u8 = 1;
/// Flag: send to share `ro` (with [`F_DATA`]: leave the share as it is).
pub const F_RO: u8 = 2;
/// Flag: a window's region is the harness's registered buffer.
pub const F_REGION: u8 = 4;
/// Flag: a window's hashes, or a commit's manifest, are right for the buffer's bytes.
pub const F_HASHES: u8 = 8;
/// Flag: the transfer or mapped file is the one the server opened last.
pub const F_LATEST: u8 = 16;
/// Flag: do not wait for the answer before sending the next request.
pub const F_PIPELINED: u8 = 32;
/// Flag: send the bytes unchanged, then end the input.
pub const F_RAW: u8 = 0x80;

/// Bytes of the harness's source and destination buffers: one whole chunk and a bit,
/// so a window may hold two chunks.
const BUFFER_BYTES: usize = DEFAULT_CHUNK_BYTES as usize + 4096;
/// Largest upload size sent as fuzzed: the server reserves an upload's whole size on
/// disk when it opens it, and the share lives on the machine's real disk. Sizes from
/// here up to [`IMPOSSIBLE_BYTES`] are taken modulo this.
const MAX_RESERVED_BYTES: u64 = 16 << 20;
/// Sizes from here up cannot be reserved on any disk the fuzzer runs on (16 TiB, also
/// ext4's largest file), so they are sent as they are: they test the refusal.
const IMPOSSIBLE_BYTES: u64 = 1 << 44;
/// Longest the harness waits for one answer or for the connection to end.
const PATIENCE: Duration = Duration::from_secs(20);

/// Sends the records of `data` to the server over one connection; see the module docs.
pub fn server_requests(data: &[u8]) {
    let w = world();
    w.reset_share();
    w.rt.block_on(w.run(data));
    w.check_untouched();
}

/// Everything that lives for the whole fuzzing run.
struct World {
    rt: Runtime,
    server: Arc<Server>,
    listener: TcpListener,
    /// The temporary directory holding the shares, the canary and `outside`.
    base: tempfile::TempDir,
    share: PathBuf,
    /// Bytes the harness uploads from: registered, and a plain copy.
    src: Arc<Buffer>,
    src_bytes: Vec<u8>,
    /// Where the harness lets the server download to.
    dst: Arc<Buffer>,
    /// `(dev, ino)` of everything outside the shares that a symlink points at.
    forbidden: Vec<(u64, u64)>,
    /// What must never change: see [`snapshot`].
    untouched: BTreeMap<PathBuf, String>,
    /// `FERRY_FUZZ_TRACE` is set: print every request and answer (for triage).
    trace: bool,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(World::new)
}

impl World {
    fn new() -> World {
        let base = tempfile::tempdir().expect("temporary directory");
        let b = base.path();
        let (share, ro) = (b.join("data"), b.join("ro"));
        for d in [&share, &ro, &b.join("outside")] {
            fs::create_dir(d).expect("create a directory");
        }
        fs::write(b.join("canary"), b"canary: never read or written").expect("canary");
        fs::write(b.join("outside/secret"), b"secret").expect("secret");
        fs::write(ro.join("file"), b"read-only").expect("read-only file");
        fs::create_dir(ro.join("dir")).expect("read-only dir");
        symlink("../canary", ro.join("escape")).expect("symlink");
        let outside = [
            b.to_path_buf(),
            b.join("canary"),
            b.join("outside"),
            b.join("outside/secret"),
            PathBuf::from("/"),
        ];
        let forbidden = outside
            .iter()
            .map(|p| {
                let m = fs::metadata(p).expect("stat");
                (m.dev(), m.ino())
            })
            .collect();
        let secret_file = b.join("ferry.secret");
        fs::write(&secret_file, SECRET).expect("secret file");
        fs::set_permissions(&secret_file, fs::Permissions::from_mode(0o600)).expect("chmod");
        let mut config = Config::build(
            None,
            Some(([127, 0, 0, 1], 0).into()),
            Some(2),
            Some(4 << 20),
            None,
            None,
            &[
                format!("data={}", share.display()),
                format!("ro={}:ro", ro.display()),
            ],
        )
        .expect("config");
        config
            .apply_secrets(&[secret_file.display().to_string()], None)
            .expect("secrets");
        // The harness speaks the protocol in the clear (encrypted sessions are
        // exercised by tests/tests/encryption.rs and the sealed transport's tests).
        config.encryption = ferry_common::seal::Encryption::Preferred;
        let server = Server::new(&config).expect("server");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("listen");
        let buffer = |bytes: &[u8]| {
            let buf = Buffer::new(BUFFER_BYTES).expect("buffer");
            buf.blocking_write().copy_from_slice(bytes);
            buf
        };
        let src_bytes = pattern_bytes(BUFFER_BYTES);
        let untouched = snapshot(b);
        World {
            rt,
            server,
            listener,
            share,
            src: buffer(&src_bytes),
            dst: buffer(&[0; BUFFER_BYTES]),
            src_bytes,
            forbidden,
            untouched,
            base,
            trace: std::env::var_os("FERRY_FUZZ_TRACE").is_some(),
        }
    }

    /// Empties the writable share and puts the fixture back.
    fn reset_share(&self) {
        let s = &self.share;
        if let Err(e) = empty_dir(s) {
            // A fuzzed mode may have locked a directory (only without root's powers).
            unlock(s);
            empty_dir(s).unwrap_or_else(|_| panic!("cannot empty the share: {e}"));
        }
        fs::write(s.join("file"), pattern_bytes(5000)).expect("fixture");
        fs::write(s.join("empty"), b"").expect("fixture");
        fs::create_dir_all(s.join("dir/sub")).expect("fixture");
        fs::write(s.join("dir/inner"), pattern_bytes(100)).expect("fixture");
        for (target, link) in [
            ("file", "link"),
            ("dir", "dirlink"),
            ("../canary", "escape"),
            ("../outside", "outside"),
            ("/", "abs"),
            ("loop", "loop"),
            ("nowhere", "dangling"),
        ] {
            symlink(target, s.join(link)).expect("fixture symlink");
        }
    }

    async fn run(&self, data: &[u8]) {
        let (client, served) = self.connect().await;
        let mut c = Client {
            world: self,
            src: client
                .register(Memory::Buffer(self.src.clone()), Access::RemoteRead)
                .expect("register"),
            dst: client
                .register(Memory::Buffer(self.dst.clone()), Access::RemoteWrite)
                .expect("register"),
            tcp: client,
            next_id: 1,
            waiting: BTreeMap::new(),
            uploads: BTreeMap::new(),
            downloads: BTreeMap::new(),
            last_upload: None,
            last_download: None,
            last_transfer: None,
            last_map: None,
            last_file: None,
            welcome_nonce: [0; 32],
        };
        c.hello().await;
        let mut raw = false;
        for r in records(data) {
            if r.flags & F_RAW != 0 {
                if !reserves_too_much(r.bytes) {
                    let _ = c.tcp.send(r.bytes.to_vec()).await;
                }
                // The server may close the session now: no more answers to wait for.
                raw = true;
                break;
            }
            let Ok(Message::Request { body, .. }) = codec::decode(r.bytes) else {
                continue;
            };
            let body = c.adjust(r.flags, body);
            c.call(body, r.flags & F_PIPELINED != 0).await;
        }
        if !raw {
            c.drain().await;
        }
        drop(c);
        tokio::time::timeout(PATIENCE, served)
            .await
            .expect("the server's connection task did not end")
            .expect("the server's connection task failed");
        let stats = self.server.stats();
        assert_eq!(self.server.connections(), 0);
        assert_eq!(
            (stats.mapped_files, stats.mapped_bytes),
            (0, 0),
            "{stats:?}"
        );
        assert_eq!(
            (stats.open_transfers, stats.registrations),
            (0, 0),
            "{stats:?}"
        );
    }

    /// One loopback connection: our end, and the server's task serving the other.
    async fn connect(&self) -> (Tcp, tokio::task::JoinHandle<()>) {
        let addr = self.listener.local_addr().expect("address");
        let socket = TcpSocket::new_v4().expect("socket");
        // Reset instead of TIME_WAIT, so long runs do not run out of ports.
        socket.set_zero_linger().expect("linger");
        let (ours, theirs) = tokio::join!(
            async { Tcp::start(socket.connect(addr).await.expect("connect")).await },
            async {
                let (stream, _) = self.listener.accept().await.expect("accept");
                Tcp::start(stream).await
            }
        );
        let served = tokio::spawn(
            self.server
                .clone()
                .handle_connection(Arc::new(theirs.expect("server side"))),
        );
        (ours.expect("client side"), served)
    }

    /// Checks an answer against the invariants that hold for every request.
    fn check_response(&self, req: &Request, resp: &Response) {
        let base = self.base.path().to_string_lossy();
        let attr_ok = |a: &Attr| {
            assert!(
                !self.forbidden.contains(&(a.dev, a.ino)),
                "{req:?} described a file outside the shares: {a:?}"
            );
        };
        match resp {
            Response::Attr(a)
            | Response::DownloadOpened { attr: a, .. }
            | Response::FileOpened { attr: a, .. }
            | Response::AttrMeta { attr: a, .. } => attr_ok(a),
            Response::Mapped(m) => attr_ok(&m.attr),
            Response::DownloadedBatch { files } => {
                for f in files {
                    match f {
                        BatchedFile::Ok { attr, .. } => attr_ok(attr),
                        BatchedFile::Err(e) => assert!(
                            !e.message.contains(&*base),
                            "{req:?}: an error names the server's paths: {e:?}"
                        ),
                        BatchedFile::NotIncluded => {}
                    }
                }
            }
            Response::UploadedBatch { results } => {
                for e in results.iter().flatten() {
                    assert!(
                        !e.message.contains(&*base),
                        "{req:?}: an error names the server's paths: {e:?}"
                    );
                }
            }
            Response::Dir { entries, .. } => {
                let at_root = matches!(req, Request::ListDir { path, .. } if path.trim_matches('/').is_empty());
                for e in entries {
                    assert!(!e.name.starts_with(TEMP_PREFIX), "{req:?} listed {e:?}");
                    assert!(!(at_root && e.name == STATE_DIR), "{req:?} listed {e:?}");
                    attr_ok(&e.attr);
                }
            }
            Response::Error(e) => assert!(
                !e.message.contains(&*base),
                "{req:?}: an error names the server's paths: {e:?}"
            ),
            Response::LinkedBatch { results } => {
                let Request::LinkBatch { links, .. } = req else {
                    panic!("{req:?} answered with {resp:?}");
                };
                assert_eq!(results.len(), links.len(), "{req:?}: {resp:?}");
                for e in results.iter().flatten() {
                    assert!(
                        !e.message.contains(&*base),
                        "{req:?}: an error names the server's paths: {e:?}"
                    );
                }
            }
            _ => {}
        }
    }

    /// The share holds no temporary file but the resumable partials of uploads the
    /// connection left unfinished (a `.part` whose journal names a chunk, and that
    /// journal), and nothing outside it changed.
    fn check_untouched(&self) {
        let resumable = |p: &Path| {
            let name = file_name(p);
            let stem = name
                .strip_suffix(PART_SUFFIX)
                .or_else(|| name.strip_suffix(JOURNAL_SUFFIX));
            let Some(stem) = stem else {
                return false;
            };
            let dir = p.parent().expect("a file in the share");
            let part = dir.join(format!("{stem}{PART_SUFFIX}"));
            let journal = dir.join(format!("{stem}{JOURNAL_SUFFIX}"));
            part.is_file() && read_journal(&journal).is_ok_and(|j| !j.chunks.is_empty())
        };
        let leftover = walk(&self.share)
            .into_iter()
            .find(|p| file_name(p).starts_with(TEMP_PREFIX) && !resumable(p));
        assert_eq!(leftover, None, "a temporary file outlived its connection");
        let now = snapshot(self.base.path());
        assert_eq!(now, self.untouched, "something outside the share changed");
    }
}

/// Our end of one connection.
struct Client<'w> {
    world: &'w World,
    tcp: Tcp,
    src: Registration,
    dst: Registration,
    next_id: u64,
    /// Requests sent and not answered yet.
    waiting: BTreeMap<u64, Request>,
    /// Announced size and share-relative path of each upload the server opened.
    uploads: BTreeMap<u64, (u64, String)>,
    /// Size at open of each download the server opened.
    downloads: BTreeMap<u64, u64>,
    last_upload: Option<u64>,
    last_download: Option<u64>,
    last_transfer: Option<u64>,
    last_map: Option<u64>,
    /// The handle of the last file opened for writing.
    last_file: Option<u64>,
    /// The server's nonce from its welcome.
    welcome_nonce: Nonce,
}

/// The secret of both shares.
const SECRET: &str = "fuzz-secret-of-the-shares";
/// Our nonce (fixed: runs must be deterministic; the server's is fresh).
const CLIENT_NONCE: Nonce = [0x3c; 32];

fn secret() -> Secret {
    Secret::from_bytes(SECRET.as_bytes(), "fuzz").expect("a valid secret")
}

impl Client<'_> {
    /// Makes a write's region one valid extent: the source buffer's first bytes, at a
    /// fuzzed offset, with its SHA-256.
    fn one_extent(
        &self,
        region: &mut ferry_common::msg::RegionDesc,
        algorithm: &mut HashAlgorithm,
        extents: &mut Vec<ferry_common::msg::Extent>,
        hashes: &mut Vec<ferry_common::msg::Hash256>,
    ) {
        // One extent of the source buffer's first bytes, at a fuzzed offset.
                    let len = region.len.clamp(1, BUFFER_BYTES as u64);
                    let offset = extents.first().map_or(0, |e| e.offset % (1 << 30));
                    *region = self.src.desc();
                    region.len = len;
                    *extents = vec![ferry_common::msg::Extent {
                        offset,
                        len: len as u32,
                    }];
                    *algorithm = HashAlgorithm::Sha256;
                    *hashes = vec![hash_chunk(
                        HashAlgorithm::Sha256,
                        &self.world.src_bytes[..len as usize],
                    )];
    }

    async fn hello(&mut self) {
        let hello = Message::Hello(Hello {
            magic: HELLO_MAGIC,
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            software: "ferry-fuzz".into(),
            nonce: CLIENT_NONCE,
            // SHA-256 (as before BLAKE3, so the harness's hashes match), and the write
            // requests (the one-round-trip finish too) and directory batches, so they
            // are fuzzed too.
            capabilities: vec![
                ferry_common::msg::Capability::new(ferry_common::proto::caps::WRITE, "1"),
                ferry_common::msg::Capability::new(ferry_common::proto::caps::DIRS, "1"),
                ferry_common::msg::Capability::new(ferry_common::proto::caps::FINISH, "1"),
            ],
        });
        self.tcp
            .send(codec::encode(&hello).expect("encode"))
            .await
            .expect("send hello");
        match self.receive("hello").await {
            Message::Welcome(w) => self.welcome_nonce = w.nonce,
            other => panic!("expected a welcome, got {other:?}"),
        }
        // Prove both shares' secret, so the fuzzed requests reach the server's code.
        for share in ["data", "ro"] {
            let auth = Message::Request {
                id: 0,
                body: Request::Auth {
                    share: share.into(),
                    proof: secret().client_proof(share, &CLIENT_NONCE, &self.welcome_nonce),
                },
            };
            self.tcp
                .send(codec::encode(&auth).expect("encode"))
                .await
                .expect("send auth");
            match self.receive("auth").await {
                Message::Response {
                    id: 0,
                    body: Response::Authenticated { proof: Some(_) },
                } => {}
                other => panic!("expected the proof accepted, got {other:?}"),
            }
        }
    }

    /// The next message from the server, which must come, and decode.
    async fn receive(&mut self, what: &str) -> Message {
        let bytes = match tokio::time::timeout(PATIENCE, self.tcp.recv()).await {
            Ok(Ok(Some(bytes))) => bytes,
            Ok(Ok(None)) => panic!("the server closed the connection during {what}"),
            Ok(Err(e)) => panic!("transport failed during {what}: {e}"),
            Err(_) => panic!("no answer to {what} in {PATIENCE:?}"),
        };
        codec::decode(&bytes)
            .unwrap_or_else(|e| panic!("the answer to {what} does not decode: {e}"))
    }

    /// Applies the record's flags to a fuzzed request.
    fn adjust(&self, flags: u8, mut body: Request) -> Request {
        let latest = |t: &mut u64, last: Option<u64>| {
            if let (true, Some(l)) = (flags & F_LATEST != 0, last) {
                *t = l;
            }
        };
        if let Request::UploadOpen { size, .. } | Request::UploadOpenBase { size, .. } = &mut body {
            if (MAX_RESERVED_BYTES..IMPOSSIBLE_BYTES).contains(size) {
                *size %= MAX_RESERVED_BYTES;
            }
        }
        match &mut body {
            Request::Stat { share, .. }
            | Request::ListDir { share, .. }
            | Request::Mkdir { share, .. }
            | Request::Symlink { share, .. }
            | Request::SetAttr { share, .. }
            | Request::UploadOpen { share, .. }
            | Request::DownloadOpen { share, .. }
            | Request::MapOpen { share, .. }
            | Request::Link { share, .. }
            | Request::Rename { share, .. }
            | Request::Manifest { share, .. }
            | Request::UploadOpenBase { share, .. }
            | Request::Remove { share, .. }
            | Request::DiskUsage { share, .. }
            | Request::Verify { share, .. }
            | Request::LinkBatch { share, .. }
            | Request::SetMeta { share, .. }
            | Request::ListDirMeta { share, .. }
            | Request::ShareInfo { share }
            | Request::FileOpen { share, .. }
            | Request::Move { share, .. }
            | Request::SetAttrs { share, .. }
            | Request::ShareAccess { share }
            | Request::StatMeta { share, .. }
            | Request::Replicate { share, .. }
            | Request::MakeDirs { share, .. }
            | Request::SetAttrBatch { share, .. }
            | Request::Lock { share, .. }
            | Request::LockTest { share, .. }
            | Request::LockRelease { share, .. }
            | Request::XattrGet { share, .. }
            | Request::XattrList { share, .. }
            | Request::XattrSet { share, .. }
            | Request::XattrRemove { share, .. }
            | Request::MakeNode { share, .. }
            | Request::SetTimes { share, .. }
            | Request::StatFs { share } => match flags & (F_DATA | F_RO) {
                F_DATA => *share = "data".into(),
                F_RO => *share = "ro".into(),
                _ => {}
            },
            Request::UploadWindow {
                transfer,
                offset,
                region,
                hashes,
            } => {
                latest(transfer, self.last_upload);
                if flags & F_REGION != 0 {
                    let size = self.uploads.get(transfer).map_or(region.len, |u| u.0);
                    let len = size.saturating_sub(*offset).min(BUFFER_BYTES as u64);
                    *region = self.src.desc();
                    region.len = len;
                }
                if flags & F_HASHES != 0 {
                    *hashes = self.src_hashes(region.len);
                }
            }
            Request::UploadCommit { transfer, manifest } => {
                latest(transfer, self.last_upload);
                if flags & F_HASHES != 0 {
                    if let Some(&(size, _)) = self.uploads.get(transfer) {
                        let len = size.min(BUFFER_BYTES as u64);
                        *manifest = manifest_id(
                            HashAlgorithm::Sha256,
                            size,
                            DEFAULT_CHUNK_BYTES,
                            &self.src_hashes(len),
                        );
                    }
                }
            }
            Request::DownloadWindow {
                transfer, region, ..
            } => {
                latest(transfer, self.last_download);
                if flags & F_REGION != 0 {
                    *region = self.dst.desc();
                }
            }
            Request::UploadBatch {
                share,
                region,
                algorithm,
                files,
            } => {
                match flags & (F_DATA | F_RO) {
                    F_DATA => *share = "data".into(),
                    F_RO => *share = "ro".into(),
                    _ => {}
                }
                if flags & F_REGION != 0 {
                    // Small files back to back in the source buffer, as many as fit.
                    let mut offset = 0u64;
                    for f in files.iter_mut() {
                        f.size %= (SMALL_FILE_MAX_BYTES + 1).min(BUFFER_BYTES as u64 - offset + 1);
                        if flags & F_HASHES != 0 {
                            // The session offered no `hash`: SHA-256, as before BLAKE3.
                            *algorithm = HashAlgorithm::Sha256;
                            let (start, end) = (offset as usize, (offset + f.size) as usize);
                            f.hash = hash_chunk(*algorithm, &self.world.src_bytes[start..end]);
                        }
                        offset += f.size;
                    }
                    *region = self.src.desc();
                    region.len = offset;
                }
            }
            Request::DownloadBatch { share, region, .. } => {
                match flags & (F_DATA | F_RO) {
                    F_DATA => *share = "data".into(),
                    F_RO => *share = "ro".into(),
                    _ => {}
                }
                if flags & F_REGION != 0 {
                    *region = self.dst.desc();
                }
            }
            Request::Close { transfer } => latest(transfer, self.last_transfer),
            Request::MapRelease { handle } => latest(handle, self.last_map),
            Request::FileWrite {
                handle,
                region,
                algorithm,
                extents,
                hashes,
            }
            | Request::FileFinish {
                handle,
                region,
                algorithm,
                extents,
                hashes,
                ..
            } => {
                latest(handle, self.last_file);
                if flags & F_REGION != 0 {
                    self.one_extent(region, algorithm, extents, hashes);
                }
            }
            Request::FilePut {
                share,
                region,
                algorithm,
                extents,
                hashes,
                ..
            } => {
                match flags & (F_DATA | F_RO) {
                    F_DATA => *share = "data".into(),
                    F_RO => *share = "ro".into(),
                    _ => {}
                }
                if flags & F_REGION != 0 {
                    self.one_extent(region, algorithm, extents, hashes);
                }
            }
            Request::FileRead { handle, region, .. } => {
                latest(handle, self.last_file);
                if flags & F_REGION != 0 {
                    *region = self.dst.desc();
                }
            }
            Request::FileSetAttr { handle, .. }
            | Request::FileAllocate { handle, .. }
            | Request::FileSync { handle, .. }
            | Request::FileClose { handle }
            | Request::FileDiscard { handle }
            | Request::FileCommit { handle }
            | Request::FileFallocate { handle, .. } => latest(handle, self.last_file),
            // The wrapped request, adjusted as it would be unwrapped.
            Request::AsCaller { request, .. } => {
                let inner = std::mem::replace(request.as_mut(), Request::Stats);
                **request = self.adjust(flags, inner);
            }
            Request::Stats | Request::Counters => {}
            // A wrong proof ends the connection, which the harness does not model:
            // proofs for the real shares are made valid (re-proving is allowed).
            Request::Auth { share, proof } => {
                if share == "data" || share == "ro" {
                    *proof = secret().client_proof(share, &CLIENT_NONCE, &self.welcome_nonce);
                }
            }
        }
        body
    }

    /// Chunk hashes of the first `len` bytes of the source buffer (the window at
    /// offset 0 of a file with those bytes).
    fn src_hashes(&self, len: u64) -> Vec<[u8; 32]> {
        let len = (len as usize).min(BUFFER_BYTES);
        hash_chunks(
            HashAlgorithm::Sha256,
            &self.world.src_bytes[..len],
            DEFAULT_CHUNK_BYTES as usize,
        )
    }

    /// Sends one request; unless `pipelined`, waits for its answer (checking the
    /// answers to earlier pipelined requests that come first).
    async fn call(&mut self, body: Request, pipelined: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let msg = Message::Request {
            id,
            body: body.clone(),
        };
        let bytes = codec::encode(&msg).expect("a decoded request encodes");
        if self.tcp.send(bytes).await.is_err() {
            panic!("the connection broke before {body:?}");
        }
        self.waiting.insert(id, body);
        if !pipelined {
            while self.waiting.contains_key(&id) {
                self.answer().await;
            }
        }
    }

    /// Waits for the answers to every request sent.
    async fn drain(&mut self) {
        while !self.waiting.is_empty() {
            self.answer().await;
        }
    }

    /// Receives and checks one answer.
    async fn answer(&mut self) {
        let what = format!("{:?}", self.waiting.values().collect::<Vec<_>>());
        let (id, resp) = match self.receive(&what).await {
            Message::Response { id, body } => (id, body),
            other => panic!("expected a response to {what}, got {other:?}"),
        };
        let Some(body) = self.waiting.remove(&id) else {
            panic!("answer {id} to no request waiting for one: {resp:?}");
        };
        if self.world.trace {
            eprintln!("{body:?}\n  -> {resp:?}");
        }
        self.world.check_response(&body, &resp);
        // With nothing else in flight, the bytes an answer vouches for are still there.
        let alone = self.waiting.is_empty();
        match (&body, &resp) {
            (
                Request::UploadOpen { size, path, .. } | Request::UploadOpenBase { size, path, .. },
                Response::UploadOpened { transfer, .. },
            ) => {
                self.uploads.insert(*transfer, (*size, path.clone()));
                self.last_upload = Some(*transfer);
                self.last_transfer = Some(*transfer);
            }
            (Request::DownloadOpen { .. }, Response::DownloadOpened { transfer, attr, .. }) => {
                self.downloads.insert(*transfer, attr.size);
                self.last_download = Some(*transfer);
                self.last_transfer = Some(*transfer);
            }
            (Request::MapOpen { .. }, Response::Mapped(m)) => self.last_map = Some(m.handle),
            (Request::FileOpen { .. }, Response::FileOpened { handle, .. }) => {
                self.last_file = Some(*handle)
            }
            (Request::UploadCommit { transfer, manifest }, Response::Committed { size }) => {
                // Known unless its open was pipelined and is still unanswered.
                if let Some((announced, path)) = self.uploads.get(transfer) {
                    assert_eq!(size, announced, "committed another size than announced");
                    if alone {
                        self.check_committed(path, *size, manifest);
                    }
                }
            }
            (
                Request::DownloadWindow {
                    transfer,
                    offset,
                    region,
                    ..
                },
                Response::WindowPushed { hashes },
            ) if alone && *region == self.dst.desc() => {
                // Alone: the open was answered before.
                let size = self.downloads[transfer];
                let len = (size - offset).min(BUFFER_BYTES as u64) as usize;
                let pushed = hash_chunks(
                    HashAlgorithm::Sha256,
                    &self.world.dst.read().await[..len],
                    DEFAULT_CHUNK_BYTES as usize,
                );
                assert_eq!(
                    &pushed, hashes,
                    "the pushed bytes do not match their hashes"
                );
            }
            _ => {}
        }
    }

    /// The file an upload committed holds exactly the bytes of `manifest`.
    fn check_committed(&self, path: &str, size: u64, manifest: &Hash256) {
        let parts = components(path).expect("a committed path is valid");
        let file = parts
            .iter()
            .fold(self.world.share.clone(), |p, c| p.join(c));
        let meta = fs::symlink_metadata(&file).expect("the committed file exists");
        assert!(meta.is_file(), "committed {path} is not a file");
        let bytes = fs::read(&file).expect("the committed file reads");
        assert_eq!(
            bytes.len() as u64,
            size,
            "committed {path} has the wrong size"
        );
        let got = manifest_id(
            HashAlgorithm::Sha256,
            size,
            DEFAULT_CHUNK_BYTES,
            &hash_chunks(HashAlgorithm::Sha256, &bytes, DEFAULT_CHUNK_BYTES as usize),
        );
        assert_eq!(
            &got, manifest,
            "committed {path} does not match its manifest"
        );
    }
}

/// True if `bytes` are an upload that would reserve more than the harness allows.
fn reserves_too_much(bytes: &[u8]) -> bool {
    matches!(
        codec::decode(bytes),
        Ok(Message::Request {
            body: Request::UploadOpen { size, .. },
            ..
        }) if (MAX_RESERVED_BYTES..IMPOSSIBLE_BYTES).contains(&size)
    )
}

fn pattern_bytes(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Every path under `dir`, symlinks not followed.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// Everything outside the writable share, described: names, kinds, modes, times and
/// contents.
fn snapshot(base: &Path) -> BTreeMap<PathBuf, String> {
    let share = base.join("data");
    let mut out = BTreeMap::new();
    for p in walk(base).into_iter().chain([base.to_path_buf()]) {
        if p.starts_with(&share) && p != share {
            continue;
        }
        let desc = match fs::symlink_metadata(&p) {
            Ok(m) if m.is_file() => format!(
                "file {:o} {} {:?}",
                m.mode(),
                m.mtime(),
                fs::read(&p).unwrap_or_default()
            ),
            Ok(m) if m.is_symlink() => format!("link {:?}", fs::read_link(&p).ok()),
            Ok(m) if p == share => format!("share root {:o}", m.mode()),
            Ok(m) => format!("dir {:o} {}", m.mode(), m.mtime()),
            Err(e) => format!("error {e}"),
        };
        out.insert(p, desc);
    }
    out
}

fn empty_dir(dir: &Path) -> std::io::Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            fs::remove_dir_all(e.path())?;
        } else {
            fs::remove_file(e.path())?;
        }
    }
    Ok(())
}

fn unlock(dir: &Path) {
    for p in walk(dir).into_iter().chain([dir.to_path_buf()]) {
        if fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
            let _ = fs::set_permissions(&p, fs::Permissions::from_mode(0o700));
        }
    }
}
