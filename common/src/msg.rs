//! Control messages: the only things that cross the wire outside one-sided READ/WRITE.
//!
//! Every message is small. Bulk file data never travels in a control message; it moves
//! by RDMA READ / RDMA WRITE against a region named by a [`RegionDesc`]. The byte layout
//! (postcard encoding of these types inside a transport control frame) is documented in
//! `docs/protocol.md`; variants are only ever appended, never reordered.

use serde::{Deserialize, Serialize};

use crate::auth::{Nonce, Proof};
pub use crate::locks::{LockFile, LockHeld, LockKind};

/// Protocol version spoken by this build. Bumped only when the encoding of an existing
/// message changes incompatibly; new features are negotiated as [`Capability`]s in the
/// handshake instead (the version rule of `docs/protocol.md`).
pub const PROTOCOL_VERSION: u16 = 7;

/// Magic bytes opening a [`Hello`]: rejects peers that speak something else.
pub const HELLO_MAGIC: [u8; 4] = *b"FRY\x01";

/// Default chunk size: the unit of hashing, verification and one-sided transfer.
pub const DEFAULT_CHUNK_BYTES: u32 = 1 << 20;
/// Smallest chunk size a peer may ask for.
pub const MIN_CHUNK_BYTES: u32 = 4 << 10;
/// Largest chunk size a peer may ask for (bounds the server's per-chunk buffers).
pub const MAX_CHUNK_BYTES: u32 = 16 << 20;
/// Most chunks one transfer window may hold (bounds hash lists and region sizes).
pub const MAX_WINDOW_CHUNKS: usize = 64;
/// Longest share-relative path accepted, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest single path component accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 255;
/// Longest extended attribute name, namespace prefix included (`XATTR_NAME_MAX`).
pub const XATTR_NAME_MAX: usize = 255;
/// Largest extended attribute value (`XATTR_SIZE_MAX`), carried inline in a control
/// message (never file data).
pub const XATTR_SIZE_MAX: usize = 64 << 10;
/// Largest list of an entry's extended attribute names, each counted with a
/// terminating NUL as `listxattr(2)` returns it (`XATTR_LIST_MAX`).
pub const XATTR_LIST_MAX: usize = 64 << 10;
/// Most entries in one directory-listing page.
pub const MAX_DIR_PAGE_ENTRIES: usize = 1024;
/// Longest human-readable error message carried in a response.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;
/// Bytes of a mapped file covered by one registered region of a [`MappedFile`]: the
/// server registers an open file as windows of this size (the last one shorter), so no
/// single registration spans a multi-GiB file.
pub const MAP_WINDOW_BYTES: u64 = 256 << 20;
/// Most regions one [`MappedFile`] may carry (bounds the largest mappable file at
/// `MAX_MAP_REGIONS * MAP_WINDOW_BYTES` = 1 TiB).
pub const MAX_MAP_REGIONS: usize = 4096;
/// Most chunk hashes in one [`Response::Manifest`] page (32 KiB of hashes).
pub const MAX_MANIFEST_PAGE_CHUNKS: usize = 1024;
/// Most chunk indices one [`VerifyReport::bad_chunks`] lists (about 10 KiB); the
/// report's `bad_count` counts them all.
pub const MAX_VERIFY_BAD_CHUNKS: usize = 1024;
/// Most links one [`Request::LinkBatch`] carries (and results its
/// [`Response::LinkedBatch`] answers). A batch must also fit the server's request
/// frame (`codec::MAX_REQUEST_FRAME_BYTES`), so long paths make batches shorter.
pub const LINK_BATCH_MAX: usize = 256;

/// Most entries one [`Request::SetMeta`] names (and results its
/// [`Response::MetaSet`] answers); their paths also count against
/// [`BATCH_MAX_PATH_BYTES`], so the longest request stays inside the server's request
/// frame.
pub const META_BATCH_MAX: usize = 256;

/// Largest file sent in a batch ([`Request::UploadBatch`], [`Request::DownloadBatch`]):
/// regular files of at most this many bytes travel many per round trip; larger ones
/// take the windowed per-file path.
pub const SMALL_FILE_MAX_BYTES: u64 = 64 << 10;
/// Most file bytes one batch carries: its region, which the server moves with one
/// one-sided operation into or out of one of its chunk buffers (so a server whose chunk
/// size is smaller takes batches of its chunk size at most).
pub const BATCH_MAX_BYTES: u64 = 1 << 20;
/// Most files one batch names.
pub const BATCH_MAX_FILES: usize = 256;
/// Most path bytes (the sum of the paths' lengths) one batch names: with
/// [`BATCH_MAX_FILES`] this keeps the longest batch request under 50 KiB, inside the
/// server's 64 KiB request frame.
pub const BATCH_MAX_PATH_BYTES: usize = 32 << 10;

/// Most extents one [`Request::FileWrite`] carries.
pub const MAX_WRITE_EXTENTS: usize = 1024;
/// Most bytes one [`Request::FileWrite`] or [`Request::FileRead`] moves: as much as one
/// transfer window of the server's chunk size holds (`MAX_WINDOW_CHUNKS` chunks), and
/// never more than this.
pub const MAX_FILE_IO_BYTES: u64 = 64 << 20;
/// Most file handles one connection may have open ([`Request::FileOpen`]).
pub const MAX_OPEN_FILES: usize = 1024;

/// Most capabilities one [`Hello`] or [`Welcome`] carries.
pub const MAX_CAPABILITIES: usize = 32;
/// Longest capability name, in bytes.
pub const MAX_CAPABILITY_NAME_BYTES: usize = 64;
/// Longest capability value, in bytes.
pub const MAX_CAPABILITY_VALUE_BYTES: usize = 256;

/// A 256-bit hash value: a chunk hash or a manifest id, in the algorithm its manifest
/// names ([`HashAlgorithm`]).
pub type Hash256 = [u8; 32];

/// A chunk-hash algorithm. Every manifest, chunk-hash list, journal and manifest
/// record names the one its hashes are in; the handshake's `hash` capability says
/// which ones a session accepts (`proto::caps`).
///
/// On the wire, a variant's index; new algorithms are appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HashAlgorithm {
    /// SHA-256: what every Ferry before BLAKE3 wrote, and what `--hash sha256` keeps.
    Sha256,
    /// BLAKE3 (256-bit output): the default where both sides support it.
    Blake3,
}

impl HashAlgorithm {
    /// Every algorithm this build supports, in its order of preference.
    pub const SUPPORTED: &'static [HashAlgorithm] = &[HashAlgorithm::Blake3, HashAlgorithm::Sha256];

    /// Its name on the wire, in configuration and in messages.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Sha256 => "sha256",
            HashAlgorithm::Blake3 => "blake3",
        }
    }

    /// The algorithm called `name`, if this build knows it.
    pub fn from_name(name: &str) -> Option<HashAlgorithm> {
        Self::SUPPORTED.iter().copied().find(|a| a.name() == name)
    }

    /// Its number in journals and manifest records (stable: never reused).
    pub fn code(self) -> u8 {
        match self {
            HashAlgorithm::Sha256 => 1,
            HashAlgorithm::Blake3 => 2,
        }
    }

    /// The algorithm numbered `code` in a journal or record.
    pub fn from_code(code: u8) -> Option<HashAlgorithm> {
        Self::SUPPORTED.iter().copied().find(|a| a.code() == code)
    }
}

impl std::fmt::Display for HashAlgorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for HashAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<HashAlgorithm, String> {
        HashAlgorithm::from_name(s).ok_or_else(|| {
            let names: Vec<&str> = HashAlgorithm::SUPPORTED.iter().map(|a| a.name()).collect();
            format!("unknown hash algorithm '{s}' (known: {})", names.join(", "))
        })
    }
}

/// One named capability or parameter of a [`Hello`] or [`Welcome`]. A peer ignores the
/// names it does not know (`proto::caps` holds the known ones and the negotiation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    /// The capability's name (at most [`MAX_CAPABILITY_NAME_BYTES`]).
    pub name: String,
    /// Its value: a parameter, or a comma-separated list of choices in a client's
    /// order of preference (at most [`MAX_CAPABILITY_VALUE_BYTES`]).
    pub value: String,
}

impl Capability {
    /// A capability `name = value`.
    pub fn new(name: &str, value: &str) -> Capability {
        Capability {
            name: name.into(),
            value: value.into(),
        }
    }
}

/// One file of a [`Request::UploadBatch`]: its bytes are the next `size` bytes of the
/// batch's region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchFile {
    /// Share-relative destination path.
    pub path: String,
    /// Size in bytes (at most [`SMALL_FILE_MAX_BYTES`]).
    pub size: u64,
    /// Permission bits of the final file.
    pub mode: u32,
    /// Modification time of the final file.
    pub mtime: Timestamp,
    /// SHA-256 of the file's bytes.
    pub hash: Hash256,
}

/// One entry of a [`Request::SetMeta`]: what to set on the file, directory or symlink
/// `path` (its final component never followed). A field left `None` is left as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaEntry {
    /// Share-relative path of an existing entry.
    pub path: String,
    /// Numeric owner to give it (applied only by a server running as root).
    pub uid: Option<u32>,
    /// Numeric group to give it (applied only by a server running as root).
    pub gid: Option<u32>,
    /// Modification time to give it (the entry's own: a symlink's, not its target's).
    pub mtime: Option<Timestamp>,
}

/// One directory of a [`Request::MakeDirs`]: created at `path` with permission bits
/// `mode` (exactly those, whatever the server's umask) unless a directory is there
/// already.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewDir {
    /// Share-relative path of the directory.
    pub path: String,
    /// Permission bits (`& 0o7777`).
    pub mode: u32,
}

/// One entry of a [`Request::SetAttrBatch`]: what to set on the existing file,
/// directory or symlink `path` (its final component never followed). A field left
/// `None` is left as it is; a symlink has no mode of its own, so its `mode` is
/// ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttrEntry {
    /// Share-relative path of an existing entry.
    pub path: String,
    /// Permission bits to give it (`& 0o7777`), set after the owner.
    pub mode: Option<u32>,
    /// Numeric owner to give it (applied only by a server running as root).
    pub uid: Option<u32>,
    /// Numeric group to give it (applied only by a server running as root).
    pub gid: Option<u32>,
    /// Modification time to give it, set last.
    pub mtime: Option<Timestamp>,
}

/// One extent of a [`Request::FileWrite`]: `len` bytes at file offset `offset`, which
/// are the next `len` bytes of the request's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// File offset of the extent's first byte.
    pub offset: u64,
    /// Its length: at least 1, at most the server's chunk size.
    pub len: u32,
}

/// Attribute changes of a [`Request::SetAttrs`] or [`Request::FileSetAttr`]; a field
/// left `None` is left as it is. Applied in the order size, owner, mode, times (so a
/// chown that clears set-id bits comes before the mode that sets them again, and the
/// times are the last word).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SetAttrs {
    /// New size (`ftruncate`): regular files only.
    pub size: Option<u64>,
    /// New permission bits (`mode & 0o7777`).
    pub mode: Option<u32>,
    /// New numeric owner (a server not running as root refuses a change with
    /// [`ErrorKind::PermissionDenied`]).
    pub uid: Option<u32>,
    /// New numeric group (as `uid`).
    pub gid: Option<u32>,
    /// New access time.
    pub atime: Option<Timestamp>,
    /// New modification time.
    pub mtime: Option<Timestamp>,
}

impl SetAttrs {
    /// Whether nothing is to change.
    pub fn is_empty(&self) -> bool {
        *self == SetAttrs::default()
    }
}

/// The server's traffic counters, for [`Request::Counters`]: what moved one-sided and
/// what moved in control messages, since the server started, over every connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counters {
    /// Bytes the server pulled from clients' memory with one-sided READs.
    pub read_bytes: u64,
    /// Bytes the server pushed into clients' memory with one-sided WRITEs.
    pub write_bytes: u64,
    /// Bytes of control messages received (frames, as encoded).
    pub ctrl_received_bytes: u64,
    /// Bytes of control messages sent.
    pub ctrl_sent_bytes: u64,
    /// File bytes written to disk by [`Request::FileWrite`] (every one of them pulled
    /// with a one-sided READ and verified against its hash first).
    pub file_written_bytes: u64,
}

/// The numeric owner and group of a filesystem object, as the server's `lstat` gives
/// them (no name mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Owner {
    /// Numeric user id.
    pub uid: u32,
    /// Numeric group id.
    pub gid: u32,
}

/// What a [`Response::DownloadedBatch`] says about one path of the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BatchedFile {
    /// The file's `attr.size` bytes are in the client's region at `offset`.
    Ok {
        /// Attributes of the file as it was read.
        attr: Attr,
        /// Offset of the file's first byte in the region.
        offset: u64,
        /// The algorithm of `hash` (as for [`Response::DownloadOpened`]).
        algorithm: HashAlgorithm,
        /// SHA-256 of the file's bytes.
        hash: Hash256,
    },
    /// This file failed; the others are unaffected.
    Err(RemoteError),
    /// Not in this batch: larger than [`SMALL_FILE_MAX_BYTES`] or did not fit in the
    /// region. The client fetches it on the per-file path.
    NotIncluded,
}

/// Names a registered memory region of the sender: `{addr, len, rkey}` as in RDMA.
///
/// Valid only for the transfer window that advertised it; the owner revokes the rkey
/// when that window completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Virtual address of the first byte of the region in its owner's address space.
    pub addr: u64,
    /// Length of the region in bytes.
    pub len: u64,
    /// Remote key that grants access to the region.
    pub rkey: u32,
}

/// A point in time as seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Timestamp {
    /// Whole seconds since the epoch (negative before 1970).
    pub secs: i64,
    /// Nanoseconds within the second, `< 1_000_000_000`.
    pub nanos: u32,
}

/// The kind of a filesystem object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed).
    Symlink,
    /// Anything else (device, fifo, socket); never transferred.
    Other,
    /// A FIFO, socket or device node, as what it is: sent only to a session that
    /// negotiated the `posix` capability (`proto::caps::POSIX`); other sessions see
    /// [`FileKind::Other`] (see [`Response::hide_nodes`]). Never opened for data.
    Node {
        /// Which kind of node.
        kind: NodeKind,
        /// The device number of a device node (`st_rdev`), 0 for the others.
        rdev: u64,
    },
}

/// The kind of a special file ([`FileKind::Node`], [`Request::MakeNode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeKind {
    /// A named pipe.
    Fifo,
    /// A Unix-domain socket's name.
    Socket,
    /// A character device.
    Char,
    /// A block device.
    Block,
}

/// Who a [`Request::AsCaller`] acts as: numeric ids, as NFS's AUTH_SYS sends them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caller {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups, at most [`CALLER_MAX_GROUPS`].
    pub groups: Vec<u32>,
}

/// Most supplementary groups a [`Caller`] may carry (the kernel's `NGROUPS_MAX`).
pub const CALLER_MAX_GROUPS: usize = 65_536;

/// One time of a [`Request::SetTimes`] (`utimensat`'s `UTIME_OMIT`, `UTIME_NOW`, or a
/// time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeSet {
    /// Left as it is (`UTIME_OMIT`).
    Omit,
    /// The server's current time (`UTIME_NOW`), which a user with write access may set
    /// on a file it does not own.
    Now,
    /// This time, which only the owner may set.
    At(Timestamp),
}

/// Attributes of a filesystem object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    /// What the object is.
    pub kind: FileKind,
    /// Size in bytes (for symlinks, the length of the target).
    pub size: u64,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
    /// Last modification time.
    pub mtime: Timestamp,
    /// Target of a symlink; `None` for other kinds.
    pub symlink_target: Option<String>,
    /// Inode number on the server's filesystem.
    pub ino: u64,
    /// Number of hard links.
    pub nlink: u32,
    /// Last access time.
    pub atime: Timestamp,
    /// Last status change time.
    pub ctime: Timestamp,
    /// Allocated size in 512-byte blocks.
    pub blocks: u64,
    /// Device number of the server filesystem holding it (`ino` is unique per `dev`).
    pub dev: u64,
}

#[cfg(test)]
impl Attr {
    /// A regular file of `size` bytes (mode 0644, times at the epoch, inode 7 on device
    /// 1), for the core's tests.
    pub(crate) fn test_file(size: u64) -> Attr {
        Attr {
            kind: FileKind::File,
            size,
            mode: 0o644,
            mtime: Timestamp::default(),
            symlink_target: None,
            ino: 7,
            nlink: 1,
            atime: Timestamp::default(),
            ctime: Timestamp::default(),
            blocks: size.div_ceil(512),
            dev: 1,
        }
    }
}

/// Identifies one version of a file's content: what a reader of a mapped file verifies
/// against, and what tells a client that a file changed between two opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileVersion {
    /// Size in bytes.
    pub size: u64,
    /// Modification time when the manifest was taken.
    pub mtime: Timestamp,
    /// Status change time when the manifest was taken.
    pub ctime: Timestamp,
    /// Inode number on the server's filesystem.
    pub ino: u64,
    /// Chunk size of the manifest.
    pub chunk_bytes: u32,
    /// Manifest hash (see [`crate::chunk::manifest_id`]) of the chunk hashes.
    pub manifest: Hash256,
    /// The algorithm of the manifest hash and of every chunk hash of this version.
    pub algorithm: HashAlgorithm,
}

/// A file the server has opened, mapped and registered read-only for one-sided reads.
///
/// Invariant: while the handle is open, `regions[i]` holds file bytes
/// `i * window_bytes .. min(size, (i + 1) * window_bytes)` as they were when the
/// manifest was taken — or, if the file is changed in place on the server, bytes that
/// fail their chunk hash. `manifest` holds the `size.div_ceil(chunk_bytes)` chunk
/// hashes, 32 bytes each, in order; they hash to `version.manifest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MappedFile {
    /// Names the open file in [`Request::MapRelease`].
    pub handle: u64,
    /// Attributes of the file at open time.
    pub attr: Attr,
    /// The content version the regions and manifest describe.
    pub version: FileVersion,
    /// File bytes per region ([`MAP_WINDOW_BYTES`]).
    pub window_bytes: u64,
    /// The file's read-only regions, in file order; empty for an empty file.
    pub regions: Vec<RegionDesc>,
    /// The read-only region holding the chunk hashes; `None` for an empty file.
    pub manifest: Option<RegionDesc>,
}

/// Filesystem statistics of a share, as `statvfs(3)` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FsStat {
    /// Block size the counts below are in.
    pub block_size: u32,
    /// Total blocks.
    pub blocks: u64,
    /// Free blocks.
    pub blocks_free: u64,
    /// Blocks free to unprivileged users.
    pub blocks_avail: u64,
    /// Total inodes.
    pub files: u64,
    /// Free inodes.
    pub files_free: u64,
    /// Longest file name.
    pub name_max: u32,
}

/// Counters of a running ferryd, for monitoring and for tests that prove which work the
/// server's application code did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ServerStats {
    /// Requests dispatched since start, over every connection (this one included).
    pub requests: u64,
    /// Connections open now.
    pub connections: u64,
    /// Mapped files open now, over every connection.
    pub mapped_files: u64,
    /// File bytes registered for mapped files now.
    pub mapped_bytes: u64,
    /// Memory regions the server holds registered now, over every connection: chunk
    /// buffers (kept in each connection's pool until it ends), mapped-file windows and
    /// manifests. Zero when no connection is open.
    pub registrations: u64,
    /// Uploads and downloads open now, over every connection. An unfinished upload's
    /// temporary file is removed before its count falls.
    pub open_transfers: u64,
}

/// One directory entry of a listing page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// The entry's name (one path component).
    pub name: String,
    /// Its attributes, symlinks not followed.
    pub attr: Attr,
}

/// First message of a session, client to server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must equal [`HELLO_MAGIC`].
    pub magic: [u8; 4],
    /// Lowest protocol version the client speaks.
    pub min_version: u16,
    /// Highest protocol version the client speaks.
    pub max_version: u16,
    /// Free-form software name and version, for logs.
    pub software: String,
    /// The client's fresh random nonce for this session's [`Request::Auth`] proofs.
    pub nonce: Nonce,
    /// What the client offers: features and the choices it accepts for each.
    pub capabilities: Vec<Capability>,
}

/// The server's answer to a [`Hello`] it accepts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The version the session will speak.
    pub version: u16,
    /// Free-form software name and version, for logs.
    pub software: String,
    /// Chunk size the server uses for transfers on this session.
    pub chunk_bytes: u32,
    /// Most chunks per transfer window the server accepts.
    pub max_window_chunks: u32,
    /// Most requests the client may have outstanding at once.
    pub max_inflight_requests: u32,
    /// The server's fresh random nonce for this session's [`Request::Auth`] proofs.
    pub nonce: Nonce,
    /// What the session will use: the server's choice for each capability it knows.
    pub capabilities: Vec<Capability>,
}

/// A request from client to server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Attributes of `path`; `follow` resolves a final symlink.
    Stat {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// Follow a symlink in the final component.
        follow: bool,
    },
    /// One page of a directory listing, starting at entry index `cursor`.
    ListDir {
        /// Share name.
        share: String,
        /// Share-relative path of the directory.
        path: String,
        /// Index of the first entry wanted (0 for the first page).
        cursor: u64,
    },
    /// Create a directory.
    Mkdir {
        /// Share name.
        share: String,
        /// Share-relative path of the new directory.
        path: String,
        /// Permission bits.
        mode: u32,
        /// Succeed if a directory already exists there.
        exist_ok: bool,
    },
    /// Create a symlink at `path` pointing to `target` (stored verbatim).
    Symlink {
        /// Share name.
        share: String,
        /// Share-relative path of the link.
        path: String,
        /// Link target, stored as given.
        target: String,
    },
    /// Set mode and/or mtime of an existing file or directory (not a symlink).
    SetAttr {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// New permission bits.
        mode: Option<u32>,
        /// New modification time.
        mtime: Option<Timestamp>,
    },
    /// Start an upload of `size` bytes to `path`; data follows as windows.
    UploadOpen {
        /// Share name.
        share: String,
        /// Share-relative destination path.
        path: String,
        /// Final size in bytes.
        size: u64,
        /// Permission bits of the final file.
        mode: u32,
        /// Modification time of the final file.
        mtime: Timestamp,
    },
    /// Pull one window of an upload: the server RDMA-READs `region` (file bytes
    /// `offset..offset+region.len`) and verifies each chunk against `hashes`.
    UploadWindow {
        /// Transfer id from [`Response::UploadOpened`].
        transfer: u64,
        /// File offset of the window's first byte; a multiple of the chunk size.
        offset: u64,
        /// The client's registered, read-only source window.
        region: RegionDesc,
        /// SHA-256 of each chunk of the window, in order.
        hashes: Vec<Hash256>,
    },
    /// Finish an upload: every chunk verified and `manifest` matches, then fsync and
    /// rename into place.
    UploadCommit {
        /// Transfer id.
        transfer: u64,
        /// Manifest hash of the whole file (see [`crate::chunk::Manifest::id`]).
        manifest: Hash256,
    },
    /// Start a download of `path` (symlinks followed within the share).
    DownloadOpen {
        /// Share name.
        share: String,
        /// Share-relative source path.
        path: String,
    },
    /// Push one window of a download: the server RDMA-WRITEs file bytes
    /// `offset..offset+region.len` into `region`, then answers with their hashes.
    DownloadWindow {
        /// Transfer id from [`Response::DownloadOpened`].
        transfer: u64,
        /// File offset of the window's first byte; a multiple of the chunk size.
        offset: u64,
        /// The client's registered, writable destination buffer.
        region: RegionDesc,
        /// Set when the client found a chunk of this window not matching the hash the
        /// server sent for it: the server then hashes what it reads and compares it
        /// with the manifest recorded when the file was written, failing with
        /// [`ErrorKind::Integrity`] (and logging it) where the file on its disk no
        /// longer matches.
        verify: bool,
    },
    /// End a transfer. For an upload that was not committed this aborts it and removes
    /// its temporary file; for a download it checks the file did not change meanwhile.
    Close {
        /// Transfer id.
        transfer: u64,
    },
    /// Open `path` for one-sided reads (symlinks followed within the share): the server
    /// maps the file, registers it read-only and returns its regions and manifest.
    MapOpen {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// Chunk size wanted for the manifest; the server clamps it to
        /// `MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES` and rounds it to a power of two, and for
        /// a very large file doubles it until the manifest holds at most 2^20 hashes.
        /// [`FileVersion::chunk_bytes`] is the size used.
        chunk_bytes: u32,
    },
    /// Revoke the registrations of a mapped file and forget it.
    MapRelease {
        /// Handle from [`Response::Mapped`].
        handle: u64,
    },
    /// Filesystem statistics of the share.
    StatFs {
        /// Share name.
        share: String,
    },
    /// The server's counters. Allowed once the session has authenticated for some
    /// share (or the server has an open share).
    Stats,
    /// Prove this session knows `share`'s secret (see [`crate::auth`]): `proof` is the
    /// client proof over both nonces of the handshake. Until it succeeds, every
    /// request naming `share` fails with [`ErrorKind::AuthRequired`]; a wrong proof is
    /// answered with [`ErrorKind::AuthFailed`] and the server closes the connection.
    Auth {
        /// Share name.
        share: String,
        /// HMAC-SHA256 client proof.
        proof: Proof,
    },
    /// Hard-link the existing regular file `from` to the new name `to`, both in
    /// `share` (the final component of `from` is not followed; `to` must not exist).
    /// Backups use it to share an unchanged file with the previous snapshot.
    Link {
        /// Share name.
        share: String,
        /// Share-relative path of the existing file.
        from: String,
        /// Share-relative path of the new link.
        to: String,
    },
    /// Rename `from` (a file, symlink or directory) to `to` within `share`; fails with
    /// [`ErrorKind::Exists`] if `to` exists (never replaces). Backups use it to give a
    /// finished snapshot its final name.
    Rename {
        /// Share name.
        share: String,
        /// Share-relative path of the existing entry.
        from: String,
        /// Share-relative new path.
        to: String,
    },
    /// One page of the chunk manifest of the regular file `path` (symlinks followed
    /// within the share): the hashes of chunks `first_chunk..`, at most
    /// [`MAX_MANIFEST_PAGE_CHUNKS`] of them. `chunk_bytes` is chosen as for
    /// [`Request::MapOpen`]. Every page names the [`FileVersion`] it belongs to; a
    /// client reading several pages checks they name the same version.
    Manifest {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// Chunk size wanted (see [`Request::MapOpen`]).
        chunk_bytes: u32,
        /// Index of the first chunk wanted.
        first_chunk: u64,
    },
    /// [`Request::UploadOpen`] with a `base`: a file in the same share (an earlier
    /// version of this one, e.g. in the previous snapshot) whose chunks the server may
    /// copy locally instead of pulling them. For each chunk of a window whose hash the
    /// base's manifest lists, the server reads that chunk of the base and hashes it
    /// again; only if it equals the client's hash is it written without being pulled
    /// (counted in [`Response::WindowPulled::reused`]). So every chunk of the committed
    /// file is still verified against the client's hash by the server.
    UploadOpenBase {
        /// Share name.
        share: String,
        /// Share-relative destination path.
        path: String,
        /// Final size in bytes.
        size: u64,
        /// Permission bits of the final file.
        mode: u32,
        /// Modification time of the final file.
        mtime: Timestamp,
        /// Share-relative path of the base file (a regular file; its final component
        /// is not followed).
        base: String,
    },
    /// Remove the file, symlink or directory `path` (its final component not
    /// followed: a symlink is removed, never its target). A directory must be empty
    /// unless `recursive`, which removes the whole tree below it without following any
    /// symlink in it. The share root, reserved names (`.ferry-`) and read-only shares
    /// are refused. Backups use it for retention and stale partial snapshots.
    Remove {
        /// Share name.
        share: String,
        /// Share-relative path of the entry to remove.
        path: String,
        /// Remove a directory with everything in it.
        recursive: bool,
    },
    /// Counts and sizes of the tree at `path` (its final component not followed,
    /// no symlink followed below it), answered with [`Response::DiskUsage`].
    DiskUsage {
        /// Share name.
        share: String,
        /// Share-relative path of the tree (or single entry).
        path: String,
    },
    /// Re-read the regular file `path` (its final component not followed) from the
    /// disk, hash every chunk and compare with the manifest the server recorded for
    /// that file (its persistent manifest store); answered by [`Response::Verified`].
    /// Unlike [`Request::Manifest`], never answered from a cache.
    Verify {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
    },
    /// Upload many small files at once: the server RDMA-READs `region` (the files'
    /// bytes back to back, in the order of `files`, whose sizes add up to
    /// `region.len`), checks each file's SHA-256 and commits each under its path.
    /// Answered by [`Response::UploadedBatch`], one result per file.
    UploadBatch {
        /// Share name.
        share: String,
        /// The client's registered, read-only region holding every file's bytes.
        region: RegionDesc,
        /// The algorithm of every [`BatchFile::hash`]: the share's
        /// ([`Response::ShareInfo`]).
        algorithm: HashAlgorithm,
        /// The files, in region order.
        files: Vec<BatchFile>,
    },
    /// Download many small files at once: the server reads what fits into one buffer
    /// and RDMA-WRITEs it into `region` with one operation. Answered by
    /// [`Response::DownloadedBatch`], one entry per path.
    DownloadBatch {
        /// Share name.
        share: String,
        /// Share-relative paths of the files (symlinks followed within the share).
        paths: Vec<String>,
        /// The client's registered, writable destination buffer.
        region: RegionDesc,
    },
    /// Many [`Request::Link`]s in one request, done in order; answered by
    /// [`Response::LinkedBatch`] with one result per link. A link that fails (missing
    /// source, existing target, a refused path, the link limit) fails alone: the
    /// others are still made. At most [`LINK_BATCH_MAX`] links. Backups send their
    /// unchanged files this way.
    LinkBatch {
        /// Share name.
        share: String,
        /// `(from, to)` pairs, each as in [`Request::Link`].
        links: Vec<(String, String)>,
    },
    /// Set numeric owners and/or modification times of existing entries, in order,
    /// never following an entry's final component (`lchown`, `utimensat` with
    /// `AT_SYMLINK_NOFOLLOW`); answered by [`Response::MetaSet`] with one result per
    /// entry, each failing alone. Owners are applied only by a server running as root
    /// (otherwise ignored, as rsync does). Sent only on a session that negotiated the
    /// `meta` capability (`proto::caps::META`). At most [`META_BATCH_MAX`] entries.
    SetMeta {
        /// Share name.
        share: String,
        /// The entries, done in order.
        entries: Vec<MetaEntry>,
    },
    /// [`Request::ListDir`] with owners: one page of the listing of `path`, answered by
    /// [`Response::DirMeta`]. Sent only on a session that negotiated the `meta`
    /// capability.
    ListDirMeta {
        /// Share name.
        share: String,
        /// Share-relative path of the directory (symlinks followed within the share).
        path: String,
        /// Index of the first entry wanted (0 for the first page).
        cursor: u64,
    },
    /// What a share requires of the session: the hash algorithm its new data is
    /// recorded in. Answered by [`Response::ShareInfo`].
    ShareInfo {
        /// Share name.
        share: String,
    },
    /// Open the regular file `path` for writing (and reading back) through a handle;
    /// answered by [`Response::FileOpened`]. The final component is never followed (a
    /// symlink there is refused). If the file exists and `truncate` is not set, the
    /// handle writes in place. If it does not exist (and `create` is set), or
    /// `truncate` is set, the handle is *staged*: it writes a hidden file beside the
    /// final name, empty at first, which takes the final name at the first
    /// [`Request::FileSync`] or [`Request::FileClose`] (fsynced first), so readers see
    /// the old content or the new, never a mix; after that the handle writes the file
    /// in place. A connection that ends drops its staged files that never took their
    /// name. Sent only on a session that negotiated the `write` capability, as are
    /// every `File*` request, [`Request::Move`], [`Request::SetAttrs`] and
    /// [`Request::ShareAccess`].
    FileOpen {
        /// Share name.
        share: String,
        /// Share-relative path of the file.
        path: String,
        /// Create the file with these permission bits if it does not exist.
        create: Option<u32>,
        /// Fail with [`ErrorKind::Exists`] if it exists (with `create`: `O_EXCL`); a
        /// staged file made so takes its name only if the name is still free then.
        exclusive: bool,
        /// Start from an empty file (`O_TRUNC`).
        truncate: bool,
    },
    /// Write through a handle: the server RDMA-READs `region` (the extents' bytes back
    /// to back, in order, `region.len` their sum), verifies each extent against its
    /// hash in `algorithm` (one of the session's), and only then writes the extents
    /// at their offsets. Answered by [`Response::FileWritten`]. At most
    /// [`MAX_WRITE_EXTENTS`] extents, each at most the server's chunk size.
    FileWrite {
        /// Handle from [`Response::FileOpened`].
        handle: u64,
        /// The client's registered, read-only region holding the extents' bytes.
        region: RegionDesc,
        /// The algorithm of `hashes`.
        algorithm: HashAlgorithm,
        /// Where the bytes go.
        extents: Vec<Extent>,
        /// The hash of each extent's bytes, as many as `extents`.
        hashes: Vec<Hash256>,
    },
    /// Read through a handle: the server reads file bytes `offset..offset+region.len`
    /// (fewer at the end of the file), RDMA-WRITEs them into `region` and answers with
    /// [`Response::FileData`]: their length and hashes.
    FileRead {
        /// Handle.
        handle: u64,
        /// File offset of the first byte wanted.
        offset: u64,
        /// The client's registered, writable destination buffer.
        region: RegionDesc,
    },
    /// Change attributes through a handle (`ftruncate`, `fchmod`, `fchown`,
    /// `futimens`); answered by [`Response::Attr`] with the attributes after. With
    /// nothing to change it is an `fstat` (a mount revalidating an open handle at
    /// `open(2)`, for close-to-open), and leaves the file as it was.
    FileSetAttr {
        /// Handle.
        handle: u64,
        /// What to change.
        attrs: SetAttrs,
    },
    /// Allocate file space through a handle (`fallocate`; with `keep_size`,
    /// `FALLOC_FL_KEEP_SIZE`); a filesystem without it fails with
    /// [`ErrorKind::Unsupported`]. Answered by [`Response::Attr`].
    FileAllocate {
        /// Handle.
        handle: u64,
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Leave the file's size as it is.
        keep_size: bool,
    },
    /// Make what was written through a handle durable (`fsync`, or `fdatasync` with
    /// `data_only`); a staged file then takes its final name, its data durable before
    /// the rename (with `data_only` the directory is not flushed: after a crash the
    /// name may be missing, never on a half-written file). Answered by
    /// [`Response::Attr`] once durable.
    FileSync {
        /// Handle.
        handle: u64,
        /// Data only (`fdatasync`).
        data_only: bool,
    },
    /// Forget the handle: a staged file takes its name first (as by a
    /// [`Request::FileCommit`]; nothing is made durable that a `FileSync` did not).
    /// Answered by [`Response::Attr`].
    FileClose {
        /// Handle.
        handle: u64,
    },
    /// `rename(2)` within `share`: `from` (never followed) takes the name `to`,
    /// replacing what is there (a file, or an empty directory for a directory) unless
    /// `no_replace` (`RENAME_NOREPLACE`: then [`ErrorKind::Exists`]).
    Move {
        /// Share name.
        share: String,
        /// Share-relative path of the entry.
        from: String,
        /// Share-relative new path.
        to: String,
        /// Fail instead of replacing an existing `to`.
        no_replace: bool,
    },
    /// Change the attributes of `path` (its final component never followed: a
    /// symlink's own owner and times); answered by [`Response::Attr`] with the
    /// attributes after. A mode or size on a symlink is refused.
    SetAttrs {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// What to change.
        attrs: SetAttrs,
    },
    /// Whether the session may change `share`; answered by [`Response::ShareAccess`].
    ShareAccess {
        /// Share name.
        share: String,
    },
    /// The server's traffic counters ([`Counters`]); allowed as [`Request::Stats`].
    Counters,
    /// Forget a handle without syncing it: a staged file that has not taken its name
    /// is removed (what was written in place stays). Answered by [`Response::Ok`]. A
    /// client whose write-back failed sends it, so nothing half-written takes a name.
    FileDiscard {
        /// Handle.
        handle: u64,
    },
    /// [`Request::Stat`] with the owner (symlinks followed within the share as
    /// `follow` says); answered by [`Response::AttrMeta`].
    StatMeta {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// Follow a symlink in the final component.
        follow: bool,
    },
    /// Give a staged file its final name now (see [`Request::FileOpen`]), without
    /// making it durable (that is [`Request::FileSync`]'s job): other clients see it
    /// from now on. A handle already in place has nothing to do. Answered by
    /// [`Response::Attr`]. A mount sends it at `close(2)`.
    FileCommit {
        /// Handle.
        handle: u64,
    },
    /// Fetch the file `path` of `share` from the cluster node at `from` (`HOST:PORT`,
    /// a live node of this server's cluster) over the data path, verify it against
    /// `manifest` (the manifest id of its chunks, `size` bytes), and publish it under
    /// the same path here. Answered by [`Response::Committed`]. A cluster repair sends
    /// it; only sessions that negotiated the `cluster` capability may.
    Replicate {
        /// Share name (the cluster store share).
        share: String,
        /// Share-relative path, the same on both nodes.
        path: String,
        /// The node to fetch from, `HOST:PORT`.
        from: String,
        /// The file's size.
        size: u64,
        /// Its manifest id.
        manifest: Hash256,
    },
    /// Make each of `dirs` in order, each failing alone: a directory already there (not
    /// a symlink to one) counts as made. Each directory's parent is resolved once per
    /// request, and a directory made earlier in the request serves as the parent of a
    /// later one. Answered by [`Response::MetaSet`], one result per directory. Sent
    /// only on a session that negotiated the `dirs` capability (`proto::caps::DIRS`).
    /// At most [`META_BATCH_MAX`] directories; their paths also count against
    /// [`BATCH_MAX_PATH_BYTES`].
    MakeDirs {
        /// Share name.
        share: String,
        /// The directories, parents before children.
        dirs: Vec<NewDir>,
    },
    /// Set owners (applied only by a server running as root, as for
    /// [`Request::SetMeta`]), modes and modification times of existing entries, in that
    /// order for each entry, each entry failing alone. Answered by
    /// [`Response::MetaSet`]. Sent only on a session that negotiated the `dirs`
    /// capability. At most [`META_BATCH_MAX`] entries; their paths also count against
    /// [`BATCH_MAX_PATH_BYTES`].
    SetAttrBatch {
        /// Share name.
        share: String,
        /// The entries, done in order.
        entries: Vec<AttrEntry>,
    },
    /// Finish what a mount's `close(2)` needs of a handle in one round trip: write
    /// `extents` (as [`Request::FileWrite`], when there are any: then `region` holds
    /// them; with none, `region` is empty and `hashes` too), then set `attrs` (as
    /// [`Request::FileSetAttr`], when any is set), then with `commit` give a staged file
    /// its name (as [`Request::FileCommit`]). Each step runs only once the one before it
    /// succeeded; the first failure is the answer, and a staged file then keeps no
    /// name. Answered by [`Response::Attr`] with the attributes after. Sent only on a
    /// session that negotiated the `finish` capability (`proto::caps::FINISH`).
    FileFinish {
        /// Handle from [`Response::FileOpened`].
        handle: u64,
        /// The client's registered, read-only region holding the extents' bytes.
        region: RegionDesc,
        /// The algorithm of `hashes`.
        algorithm: HashAlgorithm,
        /// Where the bytes go (none: nothing to write).
        extents: Vec<Extent>,
        /// The hash of each extent's bytes, as many as `extents`.
        hashes: Vec<Hash256>,
        /// What to change after the write.
        attrs: SetAttrs,
        /// Give a staged file its name last.
        commit: bool,
    },
    /// A whole new file in one round trip, no handle kept: `FileOpen` with `create:
    /// Some(mode)`, `truncate` (staged), then `FileFinish` with `commit`, then the handle
    /// is gone. A mount sends it at the `close(2)` of a file it created (`O_EXCL` or
    /// `O_TRUNC`) whose bytes all fit its write-back cache. `exclusive` and a name that
    /// exists: `Exists`, at the rename. Answered by [`Response::Attr`] with the
    /// attributes after. Sent only on a session that negotiated `finish`.
    FilePut {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// Permission bits of a new file.
        mode: u32,
        /// Fail if the name exists.
        exclusive: bool,
        /// The client's registered, read-only region holding the extents' bytes.
        region: RegionDesc,
        /// The algorithm of `hashes`.
        algorithm: HashAlgorithm,
        /// The file's bytes (none: an empty file).
        extents: Vec<Extent>,
        /// The hash of each extent's bytes, as many as `extents`.
        hashes: Vec<Hash256>,
        /// What to change after the write.
        attrs: SetAttrs,
    },
    /// Take, change or drop (`kind` [`LockKind::Unlock`]) the byte-range lock of
    /// `owner` on bytes `start..=end` of the file `path` resolves to (symlinks
    /// followed), as `fcntl(F_SETLK)` does; a mount carries `flock` as a lock of the
    /// whole file. Locks belong to the file (its `(dev, ino)` on the server), exclude
    /// holders on every session, and belong to `(session, owner)`: a session's locks
    /// all go when it ends. Answered by [`Response::Lock`]: no conflict means done; a
    /// conflict names a lock that stopped it, and nothing changed (the client waits
    /// and asks again for `F_SETLKW`). Sent only on a session that negotiated the
    /// `locks` capability (`proto::caps::LOCKS`), as are the two requests below.
    Lock {
        /// Share name.
        share: String,
        /// Share-relative path of the file.
        path: String,
        /// The lock's owner within the session (the kernel's lock owner).
        owner: u64,
        /// Shared, exclusive, or unlock.
        kind: LockKind,
        /// First byte.
        start: u64,
        /// Last byte, inclusive (`u64::MAX` or `i64::MAX`: to the end of the file).
        end: u64,
        /// The process asking, reported to `F_GETLK` callers elsewhere.
        pid: u32,
    },
    /// `fcntl(F_GETLK)`: the first lock of another owner that would stop `owner`
    /// taking `kind` on `start..=end` of `path`. Answered by [`Response::Lock`]; nothing
    /// changes.
    LockTest {
        /// Share name.
        share: String,
        /// Share-relative path of the file.
        path: String,
        /// The owner asking.
        owner: u64,
        /// Shared or exclusive.
        kind: LockKind,
        /// First byte.
        start: u64,
        /// Last byte, inclusive.
        end: u64,
    },
    /// Drop every lock of `owner` on `file` (the identity a [`Response::Lock`] gave):
    /// a mount sends it at the close of a descriptor whose owner locked the file.
    /// Answered by [`Response::Ok`].
    LockRelease {
        /// Share name.
        share: String,
        /// The file.
        file: LockFile,
        /// The owner whose locks go.
        owner: u64,
    },
    /// The value of the extended attribute `name` of the entry `path` itself (a final
    /// symlink is not followed: `lgetxattr(2)`). Answered by [`Response::XattrValue`].
    /// Sent only on a session that negotiated the `xattr` capability, as are the three
    /// requests below.
    XattrGet {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// The attribute's name, namespace prefix included (at most
        /// [`XATTR_NAME_MAX`] bytes, no NUL).
        name: Vec<u8>,
    },
    /// The names of the extended attributes of the entry `path` itself that the
    /// server may show (`llistxattr(2)`). Answered by [`Response::XattrNames`].
    XattrList {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
    },
    /// Sets the extended attribute `name` of the entry `path` itself to `value`
    /// (`lsetxattr(2)`). Answered by [`Response::Ok`].
    XattrSet {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// The attribute's name (as in [`Request::XattrGet`]).
        name: Vec<u8>,
        /// Its new value (at most [`XATTR_SIZE_MAX`] bytes).
        value: Vec<u8>,
        /// Whether the attribute must exist, or must not, before.
        mode: XattrSetMode,
    },
    /// Removes the extended attribute `name` of the entry `path` itself
    /// (`lremovexattr(2)`). Answered by [`Response::Ok`].
    XattrRemove {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// The attribute's name (as in [`Request::XattrGet`]).
        name: Vec<u8>,
    },
    /// `fallocate` through a handle with a mode that changes the file's bytes:
    /// [`FallocMode`]. Reads of the range give zeros after; the size changes only as
    /// the mode says. Answered by [`Response::Attr`] with the attributes after. Sent
    /// only on a session that negotiated the `falloc` capability (and `write`).
    FileFallocate {
        /// Handle.
        handle: u64,
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u64,
        /// What to do to the range.
        mode: FallocMode,
    },
    /// Perform `request` as `caller`: on a share whose owners are the clients' (and a
    /// ferryd running as root), the server makes the request's file-system calls with
    /// the caller's file-system ids and groups (uid 0 squashed unless the share says
    /// otherwise), so the kernel checks permissions and picks owners as for a local
    /// process of that user; elsewhere as if unwrapped. Answered as `request` is. Sent
    /// only on a session that negotiated `posix` (`proto::caps::POSIX`); never nested,
    /// never around [`Request::Auth`].
    AsCaller {
        /// Who the request acts for.
        caller: Caller,
        /// The request.
        request: Box<Request>,
    },
    /// Make a FIFO, socket or device node `path` (`mknod`), with permission bits
    /// `mode` and, for a device, device number `rdev`; answered by
    /// [`Response::AttrMeta`]. A device node is refused unless the share allows devices
    /// and its file system is mounted `nodev`. Sent only on a `posix` session.
    MakeNode {
        /// Share name.
        share: String,
        /// Share-relative path of the new node.
        path: String,
        /// What to make.
        kind: NodeKind,
        /// Permission bits.
        mode: u32,
        /// Device number (devices only).
        rdev: u64,
    },
    /// Set the access and modification times of `path` (its final component never
    /// followed), each omitted, the server's now, or a given time (`utimensat`);
    /// answered by [`Response::Attr`]. Sent only on a `posix` session.
    SetTimes {
        /// Share name.
        share: String,
        /// Share-relative path.
        path: String,
        /// The access time.
        atime: TimeSet,
        /// The modification time.
        mtime: TimeSet,
    },
}

/// What a [`Request::FileFallocate`] does to its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FallocMode {
    /// Deallocate it (`FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`): the size stays.
    PunchHole,
    /// Make it zeros, allocated (`FALLOC_FL_ZERO_RANGE`): past the end of the file
    /// the size grows to its end unless `keep_size` (`FALLOC_FL_KEEP_SIZE`).
    ZeroRange {
        /// Leave the file's size as it is.
        keep_size: bool,
    },
}

/// How a [`Request::XattrSet`] treats an attribute that exists (`setxattr(2)`'s flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum XattrSetMode {
    /// Create it or replace it (no flag).
    Any,
    /// Fail with [`ErrorKind::Exists`] if it exists (`XATTR_CREATE`).
    Create,
    /// Fail with [`ErrorKind::NoAttribute`] unless it exists (`XATTR_REPLACE`).
    Replace,
}

impl Request {
    /// The share a request names, if it names one. Requests that name none act on
    /// transfers or mapped files that were opened in an authenticated share, or (for
    /// [`Request::Stats`]) on the server as a whole.
    pub fn share(&self) -> Option<&str> {
        match self {
            Request::Stat { share, .. }
            | Request::ListDir { share, .. }
            | Request::Mkdir { share, .. }
            | Request::Symlink { share, .. }
            | Request::SetAttr { share, .. }
            | Request::UploadOpen { share, .. }
            | Request::DownloadOpen { share, .. }
            | Request::MapOpen { share, .. }
            | Request::StatFs { share }
            | Request::Auth { share, .. }
            | Request::Link { share, .. }
            | Request::Rename { share, .. }
            | Request::Manifest { share, .. }
            | Request::UploadOpenBase { share, .. }
            | Request::Remove { share, .. }
            | Request::DiskUsage { share, .. }
            | Request::Verify { share, .. }
            | Request::UploadBatch { share, .. }
            | Request::DownloadBatch { share, .. }
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
            | Request::FilePut { share, .. }
            | Request::Lock { share, .. }
            | Request::LockTest { share, .. }
            | Request::LockRelease { share, .. } => Some(share),
            Request::XattrGet { share, .. }
            | Request::XattrList { share, .. }
            | Request::XattrSet { share, .. }
            | Request::XattrRemove { share, .. }
            | Request::MakeNode { share, .. }
            | Request::SetTimes { share, .. } => Some(share),
            Request::AsCaller { request, .. } => request.share(),
            Request::UploadWindow { .. }
            | Request::UploadCommit { .. }
            | Request::DownloadWindow { .. }
            | Request::Close { .. }
            | Request::MapRelease { .. }
            | Request::Stats
            | Request::FileWrite { .. }
            | Request::FileRead { .. }
            | Request::FileSetAttr { .. }
            | Request::FileAllocate { .. }
            | Request::FileSync { .. }
            | Request::FileClose { .. }
            | Request::FileDiscard { .. }
            | Request::FileCommit { .. }
            | Request::FileFinish { .. }
            | Request::FileFallocate { .. }
            | Request::Counters => None,
        }
    }
}

/// A response from server to client, matched to its request by id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// The request succeeded and has nothing to return.
    Ok,
    /// Attributes for [`Request::Stat`].
    Attr(Attr),
    /// A listing page; `next` is the cursor of the following page, if any.
    Dir {
        /// Entries of this page, sorted by name.
        entries: Vec<DirEntry>,
        /// Cursor for the next page, `None` at the end.
        next: Option<u64>,
    },
    /// An upload was opened.
    UploadOpened {
        /// Id naming the transfer in later requests.
        transfer: u64,
        /// The algorithm the client hashes this upload's chunks and manifest in: the
        /// share's, or, for an upload that resumes an interrupted one, the algorithm
        /// that one started with, or for an upload with a base, the base's manifest's.
        algorithm: HashAlgorithm,
    },
    /// A window was received: every chunk in it verified and written. `bytes + reused`
    /// is the window's length.
    WindowPulled {
        /// Bytes pulled (RDMA READ) from the client's region.
        bytes: u64,
        /// Bytes not pulled because the server's resumable partial file already held
        /// those chunks with the client's hashes (read back and verified by the server).
        reused: u64,
    },
    /// An upload was committed under its final name.
    Committed {
        /// Final size.
        size: u64,
    },
    /// A download was opened.
    DownloadOpened {
        /// Id naming the transfer in later requests.
        transfer: u64,
        /// Attributes of the file at open time.
        attr: Attr,
        /// The algorithm of the hashes in [`Response::WindowPushed`]: that of the
        /// manifest the server recorded when the file was written, if it holds one of
        /// this version in an algorithm the client accepts (those hashes are then
        /// sent, never taken again from the bytes read), else the session's.
        algorithm: HashAlgorithm,
    },
    /// A window was pushed into the client's region; here are its chunk hashes.
    WindowPushed {
        /// SHA-256 of each chunk of the window, in order.
        hashes: Vec<Hash256>,
    },
    /// The request failed.
    Error(RemoteError),
    /// A file was mapped for one-sided reads.
    Mapped(Box<MappedFile>),
    /// Filesystem statistics for [`Request::StatFs`].
    FsStat(FsStat),
    /// Counters for [`Request::Stats`].
    Stats(ServerStats),
    /// The session proved the share's secret. `proof` is the server proof over the
    /// same values (the client checks it); `None` for a share the server serves
    /// without a secret.
    Authenticated {
        /// HMAC-SHA256 server proof.
        proof: Option<Proof>,
    },
    /// A page of a file's chunk manifest, for [`Request::Manifest`].
    Manifest {
        /// The file version the hashes belong to (its `manifest` covers every chunk).
        version: FileVersion,
        /// Index of the first chunk in `hashes`.
        first_chunk: u64,
        /// SHA-256 of chunks `first_chunk..first_chunk + hashes.len()`; empty past the
        /// last chunk.
        hashes: Vec<Hash256>,
    },
    /// Counts and sizes of a tree, for [`Request::DiskUsage`].
    DiskUsage(DiskUsage),
    /// The outcome of a [`Request::Verify`].
    Verified(VerifyReport),
    /// The outcome of a [`Request::UploadBatch`]: for each file, in request order,
    /// `None` if it was committed under its path, or why not.
    UploadedBatch {
        /// One entry per file of the request.
        results: Vec<Option<RemoteError>>,
    },
    /// The outcome of a [`Request::DownloadBatch`]: one entry per path, in request
    /// order. Every file marked [`BatchedFile::Ok`] is in the region.
    DownloadedBatch {
        /// One entry per path of the request.
        files: Vec<BatchedFile>,
    },
    /// The outcome of a [`Request::LinkBatch`]: `results[i]` is `None` if its link
    /// `i` was made, else why not. Exactly one result per link, in order.
    LinkedBatch {
        /// One entry per link of the request.
        results: Vec<Option<RemoteError>>,
    },
    /// The outcome of a [`Request::SetMeta`]: `results[i]` is `None` if entry `i` was
    /// set, else why not. Exactly one result per entry, in order.
    MetaSet {
        /// One entry per entry of the request.
        results: Vec<Option<RemoteError>>,
    },
    /// A listing page with owners, for [`Request::ListDirMeta`]: the page of
    /// [`Response::Dir`] and the owner of each entry (`owners[i]` is `entries[i]`'s,
    /// symlinks not followed), with the owner of the listed directory itself.
    DirMeta {
        /// Owner of the listed directory (after following symlinks to it).
        dir: Owner,
        /// Entries of this page, sorted by name.
        entries: Vec<DirEntry>,
        /// Owner of each entry, as many as `entries`.
        owners: Vec<Owner>,
        /// Cursor for the next page, `None` at the end.
        next: Option<u64>,
    },
    /// Answer to [`Request::ShareInfo`].
    ShareInfo {
        /// The algorithm uploads to the share hash in (and batches name): the share's
        /// own (`hash` in ferryd's configuration), else the session's.
        algorithm: HashAlgorithm,
    },
    /// A file was opened for writing ([`Request::FileOpen`]).
    FileOpened {
        /// Handle naming the file in later requests.
        handle: u64,
        /// Attributes of the file the handle writes (for a staged file, the hidden
        /// file that will take the name: its inode is the final file's).
        attr: Attr,
        /// The handle writes a staged file (see [`Request::FileOpen`]).
        staged: bool,
    },
    /// Every extent of a [`Request::FileWrite`] was verified and written.
    FileWritten {
        /// The file's size after the write.
        size: u64,
    },
    /// The bytes of a [`Request::FileRead`] are in the client's region.
    FileData {
        /// Bytes placed at the start of the region (fewer than asked at the end of
        /// the file, 0 past it).
        len: u64,
        /// The algorithm of `hashes`: the session's.
        algorithm: HashAlgorithm,
        /// The hash of each piece of the data, pieces of the server's chunk size (the
        /// last one shorter).
        hashes: Vec<Hash256>,
    },
    /// Answer to [`Request::ShareAccess`].
    ShareAccess {
        /// The share may be changed (it is not exported read-only).
        writable: bool,
    },
    /// Answer to [`Request::Counters`].
    Counters(Counters),
    /// Answer to [`Request::StatMeta`].
    AttrMeta {
        /// The attributes.
        attr: Attr,
        /// The numeric owner and group.
        owner: Owner,
    },
    /// Answer to [`Request::Lock`] and [`Request::LockTest`].
    Lock {
        /// The file's identity on the server, for a later [`Request::LockRelease`].
        file: LockFile,
        /// The lock that stopped the request (or, for a test, would): `None` when the
        /// lock was taken, changed or dropped (for a test: would be granted).
        conflict: Option<LockHeld>,
    },
    /// Answer to [`Request::XattrGet`].
    XattrValue {
        /// The value (at most [`XATTR_SIZE_MAX`] bytes).
        value: Vec<u8>,
    },
    /// Answer to [`Request::XattrList`].
    XattrNames {
        /// The names, in the server's order (together at most [`XATTR_LIST_MAX`]
        /// bytes, a NUL counted after each).
        names: Vec<Vec<u8>>,
    },
}

impl Response {
    /// Shows every special file the response describes as [`FileKind::Other`], for a
    /// session that did not negotiate `posix` (whose decoder knows no
    /// [`FileKind::Node`]).
    pub fn hide_nodes(&mut self) {
        let hide = |a: &mut Attr| {
            if let FileKind::Node { .. } = a.kind {
                a.kind = FileKind::Other;
            }
        };
        match self {
            Response::Attr(attr)
            | Response::DownloadOpened { attr, .. }
            | Response::FileOpened { attr, .. }
            | Response::AttrMeta { attr, .. } => hide(attr),
            Response::Mapped(m) => hide(&mut m.attr),
            Response::Dir { entries, .. } | Response::DirMeta { entries, .. } => {
                entries.iter_mut().for_each(|e| hide(&mut e.attr))
            }
            Response::DownloadedBatch { files } => files.iter_mut().for_each(|f| {
                if let BatchedFile::Ok { attr, .. } = f {
                    hide(attr)
                }
            }),
            _ => {}
        }
    }
}

/// What a tree holds, as [`Request::DiskUsage`] reports it. Symlinks are counted, never
/// followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiskUsage {
    /// Entries that are not directories (regular files, symlinks, others), each name
    /// counted once (so a file with two links in the tree counts twice).
    pub files: u64,
    /// Directories, the tree's top one included.
    pub dirs: u64,
    /// Apparent size: the sum of the sizes of the non-directory entries, hard links
    /// counted at each name.
    pub bytes: u64,
    /// What removing the tree would free: the allocated bytes (`st_blocks * 512`) of
    /// every directory and of every other inode all of whose links lie in the tree
    /// (seen in the walk as many times as its link count), each inode counted once.
    pub unique_bytes: u64,
}

/// What the server's manifest record of a verified file says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VerifyRecord {
    /// The server holds no manifest of this file (it did not receive or hash it
    /// settled, or the record was lost): nothing to compare with, so the file is
    /// unverifiable. Not damage.
    Missing,
    /// The record was taken of exactly this file version (device, inode, size, mtime,
    /// ctime, chunk size). Chunks that differ from it changed below the filesystem's
    /// notice: damage (bit rot, a faulty disk or controller).
    Current,
    /// The record is of this inode, but its status changed since (ctime): the file was
    /// written, truncated or had its attributes changed after the record was taken.
    /// Differing chunks mean it was modified after the backup; with `mtime_changed`
    /// and `size_changed` both false, someone changed it and set its mtime back.
    Stale {
        /// The size differs from the recorded one.
        size_changed: bool,
        /// The mtime differs from the recorded one.
        mtime_changed: bool,
    },
}

/// The answer to a [`Request::Verify`]: the file's bytes as read from the disk now,
/// compared chunk by chunk with its recorded manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// The algorithm the file's chunks were hashed in: its record's (else the one it
    /// is now recorded in).
    pub algorithm: HashAlgorithm,
    /// What the record says (see [`VerifyRecord`]); with `Missing`, nothing was
    /// compared and `bad_count` is 0.
    pub record: VerifyRecord,
    /// Size of the file now, in bytes.
    pub size: u64,
    /// Chunk size of the comparison (the record's).
    pub chunk_bytes: u32,
    /// Chunks read and hashed.
    pub chunks: u64,
    /// Chunks that differ from the record, could not be read, or exist in only one of
    /// the file and the record.
    pub bad_count: u64,
    /// The first [`MAX_VERIFY_BAD_CHUNKS`] of those chunks' indices, ascending.
    pub bad_chunks: Vec<u64>,
}

/// Why a request failed, as the server reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    /// Machine-readable class.
    pub kind: ErrorKind,
    /// Human-readable detail (bounded by [`MAX_ERROR_MESSAGE_BYTES`]).
    pub message: String,
}

impl RemoteError {
    /// An error whose message is cut (at a character boundary) to
    /// [`MAX_ERROR_MESSAGE_BYTES`], so it always encodes into a message the peer
    /// accepts, however long the names it quotes.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> RemoteError {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE_BYTES {
            let mut cut = MAX_ERROR_MESSAGE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        RemoteError { kind, message }
    }
}

/// Classes of failure a server reports. Appended to, never reordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No such file or directory.
    NotFound,
    /// No share by that name.
    NoSuchShare,
    /// The filesystem refused access.
    PermissionDenied,
    /// The path, or a symlink on it, resolves outside the share.
    OutsideShare,
    /// The share is exported read-only.
    ReadOnly,
    /// The server's filesystem is full.
    NoSpace,
    /// A path component is not a directory.
    NotADirectory,
    /// The target is a directory.
    IsADirectory,
    /// The path is malformed (NUL byte, absolute, `..`, too long).
    InvalidPath,
    /// Something already exists there.
    Exists,
    /// A chunk did not match its SHA-256.
    Integrity,
    /// The request broke the protocol (bad window, unknown transfer...).
    Protocol,
    /// The file changed while it was being transferred.
    Changed,
    /// Another I/O error.
    Io,
    /// The server is at a resource limit (open mapped files, registered bytes).
    Busy,
    /// The share needs a secret this session has not proved.
    AuthRequired,
    /// The proof of a share's secret was wrong (the server closes the connection).
    AuthFailed,
    /// The file has as many hard links as the server's filesystem allows (`EMLINK`;
    /// 65,000 on ext4): a `Link` to it cannot be made.
    TooManyLinks,
    /// A directory to remove or replace is not empty (`ENOTEMPTY`). Sent only in
    /// answer to the requests of the `write` capability, as are the kinds below.
    NotEmpty,
    /// The user's disk quota on the server is exhausted (`EDQUOT`).
    QuotaExceeded,
    /// The server's filesystem does not support the operation (`EOPNOTSUPP`).
    Unsupported,
    /// The file would exceed the largest size the server's filesystem allows
    /// (`EFBIG`).
    FileTooBig,
    /// The server's filesystem refused the arguments (`EINVAL`: a directory moved into
    /// itself, a negative size).
    Invalid,
    /// The entry has no extended attribute of that name (`ENODATA`). Sent only in
    /// answer to the requests of the `xattr` capability, as is the kind below.
    NoAttribute,
    /// An extended attribute's name or value is over the protocol's limits or the
    /// server's file system's (`E2BIG`, `ERANGE`).
    AttributeTooBig,
}

impl ErrorKind {
    /// Stable snake_case name, used in rcp's `--json` output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::NoSuchShare => "no_such_share",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::OutsideShare => "outside_share",
            ErrorKind::ReadOnly => "read_only",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::NotADirectory => "not_a_directory",
            ErrorKind::IsADirectory => "is_a_directory",
            ErrorKind::InvalidPath => "invalid_path",
            ErrorKind::Exists => "exists",
            ErrorKind::Integrity => "integrity",
            ErrorKind::Protocol => "protocol",
            ErrorKind::Changed => "changed",
            ErrorKind::Io => "io",
            ErrorKind::Busy => "busy",
            ErrorKind::AuthRequired => "auth_required",
            ErrorKind::AuthFailed => "auth_failed",
            ErrorKind::TooManyLinks => "too_many_links",
            ErrorKind::NotEmpty => "not_empty",
            ErrorKind::QuotaExceeded => "quota_exceeded",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::FileTooBig => "file_too_big",
            ErrorKind::Invalid => "invalid",
            ErrorKind::NoAttribute => "no_attribute",
            ErrorKind::AttributeTooBig => "attribute_too_big",
        }
    }
}

/// Everything that crosses the wire as a control message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Client opens the session.
    Hello(Hello),
    /// Server accepts the session.
    Welcome(Welcome),
    /// Server refuses the session (bad magic, no common version: in answer to the
    /// `Hello`; at its connection limit: as soon as the transport is up, with
    /// [`ErrorKind::Busy`]); it then closes.
    Refused(RemoteError),
    /// A client request with its id.
    Request {
        /// Client-chosen id, unique among the client's outstanding requests.
        id: u64,
        /// The request.
        body: Request,
    },
    /// A server response to the request with the same id.
    Response {
        /// Id of the request answered.
        id: u64,
        /// The response.
        body: Response,
    },
}
