//! Capabilities: what a session's features are, negotiated in the handshake.
//!
//! A client's `Hello` offers capabilities (a name and a comma-separated list of the
//! choices it accepts, in its order of preference); the server's `Welcome` answers
//! with one choice for each capability it knows. Names a peer does not know are
//! ignored, never an error, so a feature is added without a new protocol version: the
//! version changes only when the encoding of an existing message does
//! (`docs/protocol.md`, "Version rule").
//!
//! A capability a client leaves out takes its default, which every peer of this
//! protocol version supports; a server that leaves one out of its welcome chose the
//! default.
//!
//! Capabilities:
//! - [`HASH`]: the chunk-hash algorithms. The client offers those it accepts, preferred
//!   first; the server answers with the one new data of the session is hashed in (its
//!   choice among the client's, `blake3` where both support it; default `sha256`).
//!   Every manifest and hash list the session carries names its algorithm, which is
//!   always one the client offered: a file recorded in another algorithm than the
//!   session's is still read with its recorded hashes when the client accepts them;
//! - [`META`]: the metadata requests [`Request::SetMeta`] and
//!   [`Request::ListDirMeta`] (default: off). An optional feature: an offer with no
//!   version in common turns it off instead of refusing the session.
//! - [`BATCH`]: which files a batch may carry (default `small`: up to
//!   [`crate::msg::SMALL_FILE_MAX_BYTES`]; `medium`: any file that fits the batch's
//!   capacity, [`crate::proto::batch::batch_capacity`]). Optional like [`META`].
//! - [`DIRS`]: the batched directory requests [`Request::MakeDirs`] and
//!   [`Request::SetAttrBatch`] (default: off; a client without it sends one `Mkdir`
//!   and one `SetAttr` per directory). Optional like [`META`].
//! - [`FINISH`]: [`Request::FileFinish`] and [`Request::FilePut`], a mount's close in
//!   one round trip (default: off; a client without it sends `FileOpen` at create and
//!   `FileWrite`, `FileSetAttr` and `FileCommit` one after the other at close).
//!   Optional like [`META`]; it needs [`WRITE`] too.
//! - [`LOCKS`]: the lock requests [`Request::Lock`], [`Request::LockTest`] and
//!   [`Request::LockRelease`] (default: off; a mount without it keeps `flock` and
//!   `fcntl` locks local to itself). Optional like [`META`].
//! - [`XATTR`]: the extended-attribute requests [`Request::XattrGet`],
//!   [`Request::XattrList`], [`Request::XattrSet`] and [`Request::XattrRemove`]
//!   (default: off; a mount without it answers every extended-attribute call as not
//!   supported, and `rcp -X` refuses to start). Optional like [`META`].
//! - [`FALLOC`]: [`Request::FileFallocate`], punching holes and zeroing ranges
//!   through a handle (default: off; a mount without it answers those `fallocate`
//!   modes `EOPNOTSUPP`). Optional like [`META`]; it needs [`WRITE`] too.
//! - [`POSIX`]: a mount of many users on a local-like file system:
//!   [`Request::AsCaller`], [`Request::MakeNode`], [`Request::SetTimes`], and special
//!   files listed as what they are ([`crate::msg::FileKind::Node`]; a session without
//!   it sees them as `Other`). Optional like [`META`]; it needs [`WRITE`] too.
//! - [`ENCRYPT`], [`ENCRYPT_KEY`], [`ENCRYPT_POLICY`]: session encryption
//!   ([`crate::seal`]). The client offers the AEAD suites it accepts (fastest on its
//!   CPU first), its X25519 key share and whether it requires encryption; a server
//!   that encrypts the session answers with one suite and its own key share. The
//!   server encrypts when the client offers it and either requires it or any of the
//!   server's shares is not `off`; a client that requires encryption refuses a welcome
//!   without it (an older server, or a middlebox that removed the offer).
//! - [`REKEY`]: key updates in an encrypted session ([`crate::seal`]'s key schedule):
//!   each side updates the keys it sends under after an amount of data or time, and
//!   every piece of file data carries its key generation and is bound to where it
//!   belongs. A client offers it with [`ENCRYPT`]; the server chooses it when the
//!   session is encrypted and the client offered it. A peer without it (older) is
//!   served as before: one key per direction and use for the whole session, pieces
//!   without associated data, the session ending at a counter's limit.

use crate::msg::{Capability, Request};

/// Name of the chunk-hash capability: the algorithms a session's manifests may be in,
/// and the one its new data is hashed in.
pub const HASH: &str = "hash";

/// What a hello without a [`HASH`] capability accepts: SHA-256, the one algorithm of
/// the versions before BLAKE3.
const DEFAULT_HASH: &str = "sha256";

/// Name of the metadata capability: whether the session may use [`Request::SetMeta`]
/// and [`Request::ListDirMeta`] (numeric owners and symlink mtimes, for `rcp -r`).
pub const META: &str = "meta";

/// The versions of the metadata requests this build speaks, preferred first: the
/// client offers them, the server chooses one.
pub const META_VERSIONS: &[&str] = &["1"];

/// Name of the batch capability: which files an `UploadBatch` or `DownloadBatch` may
/// carry ([`crate::proto::batch::batch_file_max`]).
pub const BATCH: &str = "batch";

/// The batch modes this build speaks beyond the default (`small`), preferred first.
pub const BATCH_MODES: &[&str] = &["medium"];

/// Name of the write capability: whether the session may use the requests of a
/// writable mount (file handles `File*`, `Move`, `SetAttrs`, `ShareAccess`,
/// `Counters`). Optional like [`META`].
pub const WRITE: &str = "write";

/// The versions of the write requests this build speaks, preferred first.
pub const WRITE_VERSIONS: &[&str] = &["1"];

/// Name of the cluster capability: the session may send [`Request::Replicate`] (the
/// server is a cluster storage node that fetches objects from other nodes). Only a
/// cluster node's ferryd chooses it.
pub const CLUSTER: &str = "cluster";

/// The versions of the cluster requests this build speaks, preferred first.
pub const CLUSTER_VERSIONS: &[&str] = &["1"];

/// Name of the directory-batch capability: whether the session may use
/// [`Request::MakeDirs`] and [`Request::SetAttrBatch`] (many directories per round
/// trip, for `rcp -r`).
pub const DIRS: &str = "dirs";

/// The versions of the directory-batch requests this build speaks, preferred first.
pub const DIRS_VERSIONS: &[&str] = &["1"];

/// Name of the finish capability: whether the session may use [`Request::FileFinish`]
/// and [`Request::FilePut`] (a mount's close in one round trip: the write, the
/// attributes and the commit; for a new file, its creation too).
pub const FINISH: &str = "finish";

/// The versions of the finish request this build speaks, preferred first.
pub const FINISH_VERSIONS: &[&str] = &["1"];

/// Name of the locks capability: whether the session may use [`Request::Lock`],
/// [`Request::LockTest`] and [`Request::LockRelease`] (file locks held by the server,
/// excluding holders on every session; [`crate::locks`]).
pub const LOCKS: &str = "locks";

/// The versions of the lock requests this build speaks, preferred first.
pub const LOCKS_VERSIONS: &[&str] = &["1"];
/// Name of the extended-attribute capability: whether the session may use
/// [`Request::XattrGet`], [`Request::XattrList`], [`Request::XattrSet`] and
/// [`Request::XattrRemove`].
pub const XATTR: &str = "xattr";

/// The versions of the extended-attribute requests this build speaks, preferred first.
pub const XATTR_VERSIONS: &[&str] = &["1"];

/// Name of the fallocate capability: whether the session may use
/// [`Request::FileFallocate`] (punch a hole, zero a range).
pub const FALLOC: &str = "falloc";

/// The versions of the fallocate request this build speaks, preferred first.
pub const FALLOC_VERSIONS: &[&str] = &["1"];
/// Name of the POSIX capability: requests acting as a caller, special files, and
/// `utimensat`'s `UTIME_NOW`/`UTIME_OMIT`.
pub const POSIX: &str = "posix";

/// The versions of the POSIX requests this build speaks, preferred first.
pub const POSIX_VERSIONS: &[&str] = &["1"];

/// Name of the encryption capability: the AEAD suites a client accepts, preferred
/// first; in a welcome, the one the session uses.
pub const ENCRYPT: &str = "encrypt";

/// Name of the key-share capability: the side's X25519 public key, in hex.
pub const ENCRYPT_KEY: &str = "encrypt-key";

/// Name of the client's encryption policy capability (`required` or `preferred`).
pub const ENCRYPT_POLICY: &str = "encrypt-policy";

/// Name of the key-update capability.
pub const REKEY: &str = "rekey";

/// The versions of key updates this build speaks, preferred first.
pub const REKEY_VERSIONS: &[&str] = &["1"];

pub use crate::msg::HashAlgorithm;
use crate::seal::{from_hex, to_hex, Suite, PUBLIC_KEY_BYTES};

/// A client's offer to encrypt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncryptOffer {
    /// Suites it accepts, preferred first (not empty).
    pub suites: Vec<Suite>,
    /// Its X25519 key share.
    pub key: [u8; PUBLIC_KEY_BYTES],
    /// Whether it refuses a session in the clear.
    pub required: bool,
}

/// The encryption a session agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encrypted {
    /// The AEAD suite.
    pub suite: Suite,
    /// The client's key share.
    pub client_key: [u8; PUBLIC_KEY_BYTES],
    /// The server's key share.
    pub server_key: [u8; PUBLIC_KEY_BYTES],
    /// Whether both sides update keys ([`REKEY`]).
    pub rekey: bool,
}

/// What a server brings to the encryption negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerEncryption {
    /// Whether it asks for encryption itself (some share is not `off`).
    pub wants: bool,
    /// Its key share for this session.
    pub key: [u8; PUBLIC_KEY_BYTES],
}

/// A set of hash algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Algorithms(u8);

impl Algorithms {
    /// Every algorithm this build supports.
    pub const ALL: Algorithms = Algorithms(0b110);
    /// The set of `algorithms`.
    pub fn of(algorithms: &[HashAlgorithm]) -> Algorithms {
        Algorithms(algorithms.iter().fold(0, |m, a| m | (1 << a.code())))
    }

    /// Whether `a` is in the set.
    pub fn contains(self, a: HashAlgorithm) -> bool {
        self.0 & (1 << a.code()) != 0
    }
}

/// What a client offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// Hash algorithms it accepts, preferred first (not empty).
    pub hashes: Vec<HashAlgorithm>,
    /// Whether it offers the metadata requests ([`META`]).
    pub meta: bool,
    /// Whether it offers batches of medium files ([`BATCH`]).
    pub medium_batches: bool,
    /// Whether it offers the write requests ([`WRITE`]).
    pub write: bool,
    /// Whether it offers the cluster requests ([`CLUSTER`]).
    pub cluster: bool,
    /// Whether it offers the directory batches ([`DIRS`]).
    pub dirs: bool,
    /// Whether it offers the one-round-trip close ([`FINISH`]).
    pub finish: bool,
    /// Whether it offers the lock requests ([`LOCKS`]).
    pub locks: bool,
    /// Whether it offers the extended-attribute requests ([`XATTR`]).
    pub xattr: bool,
    /// Whether it offers [`Request::FileFallocate`] ([`FALLOC`]).
    pub falloc: bool,
    /// Whether it offers the POSIX requests ([`POSIX`]).
    pub posix: bool,
    /// Its offer to encrypt, if it makes one ([`ENCRYPT`]).
    pub encrypt: Option<EncryptOffer>,
}

impl Default for Offer {
    /// Everything this build supports.
    fn default() -> Offer {
        Offer {
            hashes: HashAlgorithm::SUPPORTED.to_vec(),
            meta: true,
            medium_batches: true,
            write: true,
            cluster: true,
            dirs: true,
            finish: true,
            locks: true,
            xattr: true,
            falloc: true,
            posix: true,
            encrypt: None,
        }
    }
}

impl Offer {
    /// The offer as a hello's capabilities.
    pub fn to_capabilities(&self) -> Vec<Capability> {
        let hashes: Vec<&str> = self.hashes.iter().map(|h| h.name()).collect();
        let mut caps = vec![Capability::new(HASH, &hashes.join(","))];
        if self.meta {
            caps.push(Capability::new(META, &META_VERSIONS.join(",")));
        }
        if self.medium_batches {
            caps.push(Capability::new(BATCH, &BATCH_MODES.join(",")));
        }
        if self.write {
            caps.push(Capability::new(WRITE, &WRITE_VERSIONS.join(",")));
        }
        if self.cluster {
            caps.push(Capability::new(CLUSTER, &CLUSTER_VERSIONS.join(",")));
        }
        if self.dirs {
            caps.push(Capability::new(DIRS, &DIRS_VERSIONS.join(",")));
        }
        if self.finish {
            caps.push(Capability::new(FINISH, &FINISH_VERSIONS.join(",")));
        }
        if self.locks {
            caps.push(Capability::new(LOCKS, &LOCKS_VERSIONS.join(",")));
        }
        if self.xattr {
            caps.push(Capability::new(XATTR, &XATTR_VERSIONS.join(",")));
        }
        if self.falloc {
            caps.push(Capability::new(FALLOC, &FALLOC_VERSIONS.join(",")));
        }
        if self.posix {
            caps.push(Capability::new(POSIX, &POSIX_VERSIONS.join(",")));
        }
        if let Some(e) = &self.encrypt {
            let suites: Vec<&str> = e.suites.iter().map(|s| s.name()).collect();
            caps.push(Capability::new(ENCRYPT, &suites.join(",")));
            caps.push(Capability::new(ENCRYPT_KEY, &to_hex(&e.key)));
            let policy = if e.required { "required" } else { "preferred" };
            caps.push(Capability::new(ENCRYPT_POLICY, policy));
            caps.push(Capability::new(REKEY, &REKEY_VERSIONS.join(",")));
        }
        caps
    }
}

/// What a session agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// The algorithm the session's new data is hashed in (uploads, and files the
    /// server holds no record of), unless a share requires another.
    pub hash: HashAlgorithm,
    /// Every algorithm the session's manifests may be in: those the client offered
    /// (and, on the server, supports).
    pub accepted: Algorithms,
    /// Whether the metadata requests ([`META`]) may be sent.
    pub meta: bool,
    /// Whether batches may carry medium files ([`BATCH`]).
    pub medium_batches: bool,
    /// Whether the write requests ([`WRITE`]) may be sent.
    pub write: bool,
    /// Whether the cluster requests ([`CLUSTER`]) may be sent.
    pub cluster: bool,
    /// Whether the directory batches ([`DIRS`]) may be sent.
    pub dirs: bool,
    /// Whether [`Request::FileFinish`] ([`FINISH`]) may be sent.
    pub finish: bool,
    /// Whether the lock requests ([`LOCKS`]) may be sent.
    pub locks: bool,
    /// Whether the extended-attribute requests ([`XATTR`]) may be sent.
    pub xattr: bool,
    /// Whether [`Request::FileFallocate`] ([`FALLOC`]) may be sent.
    pub falloc: bool,
    /// Whether the POSIX requests ([`POSIX`]) may be sent, and special files are
    /// listed as what they are.
    pub posix: bool,
    /// The session's encryption, if it is encrypted ([`ENCRYPT`]).
    pub encryption: Option<Encrypted>,
}

impl Negotiated {
    /// The agreement as a welcome's capabilities (an optional feature that is off is
    /// left out).
    pub fn to_capabilities(&self) -> Vec<Capability> {
        let mut caps = vec![Capability::new(HASH, self.hash.name())];
        if self.meta {
            caps.push(Capability::new(META, META_VERSIONS[0]));
        }
        if self.medium_batches {
            caps.push(Capability::new(BATCH, BATCH_MODES[0]));
        }
        if self.write {
            caps.push(Capability::new(WRITE, WRITE_VERSIONS[0]));
        }
        if self.cluster {
            caps.push(Capability::new(CLUSTER, CLUSTER_VERSIONS[0]));
        }
        if self.dirs {
            caps.push(Capability::new(DIRS, DIRS_VERSIONS[0]));
        }
        if self.finish {
            caps.push(Capability::new(FINISH, FINISH_VERSIONS[0]));
        }
        if self.locks {
            caps.push(Capability::new(LOCKS, LOCKS_VERSIONS[0]));
        }
        if self.xattr {
            caps.push(Capability::new(XATTR, XATTR_VERSIONS[0]));
        }
        if self.falloc {
            caps.push(Capability::new(FALLOC, FALLOC_VERSIONS[0]));
        }
        if self.posix {
            caps.push(Capability::new(POSIX, POSIX_VERSIONS[0]));
        }
        if let Some(e) = &self.encryption {
            caps.push(Capability::new(ENCRYPT, e.suite.name()));
            caps.push(Capability::new(ENCRYPT_KEY, &to_hex(&e.server_key)));
            if e.rekey {
                caps.push(Capability::new(REKEY, REKEY_VERSIONS[0]));
            }
        }
        caps
    }

    /// Whether `req` may be sent on this session: a request of a capability the
    /// session did not negotiate may not (the server refuses it with `Protocol`).
    /// Fails with the name of the missing capability.
    pub fn permits(&self, req: &Request) -> Result<(), &'static str> {
        match req {
            Request::SetMeta { .. } | Request::ListDirMeta { .. } if !self.meta => Err(META),
            Request::FileOpen { .. }
            | Request::FileWrite { .. }
            | Request::FileRead { .. }
            | Request::FileSetAttr { .. }
            | Request::FileAllocate { .. }
            | Request::FileSync { .. }
            | Request::FileClose { .. }
            | Request::FileDiscard { .. }
            | Request::FileCommit { .. }
            | Request::StatMeta { .. }
            | Request::Move { .. }
            | Request::SetAttrs { .. }
            | Request::ShareAccess { .. }
            | Request::Counters
                if !self.write =>
            {
                Err(WRITE)
            }
            Request::Replicate { .. } if !self.cluster => Err(CLUSTER),
            Request::MakeDirs { .. } | Request::SetAttrBatch { .. } if !self.dirs => Err(DIRS),
            Request::FileFinish { .. } | Request::FilePut { .. } if !self.write => Err(WRITE),
            Request::FileFinish { .. } | Request::FilePut { .. } if !self.finish => Err(FINISH),
            Request::Lock { .. } | Request::LockTest { .. } | Request::LockRelease { .. }
                if !self.locks =>
            {
                Err(LOCKS)
            }
            Request::XattrGet { .. }
            | Request::XattrList { .. }
            | Request::XattrSet { .. }
            | Request::XattrRemove { .. }
                if !self.xattr =>
            {
                Err(XATTR)
            }
            Request::FileFallocate { .. } if !self.write => Err(WRITE),
            Request::FileFallocate { .. } if !self.falloc => Err(FALLOC),
            Request::AsCaller { .. } | Request::MakeNode { .. } | Request::SetTimes { .. }
                if !self.posix =>
            {
                Err(POSIX)
            }
            Request::AsCaller { request, .. } => match **request {
                // Never nested, never around the session's own request.
                Request::AsCaller { .. } | Request::Auth { .. } => Err(POSIX),
                ref inner => self.permits(inner),
            },
            _ => Ok(()),
        }
    }
}

/// The value of the first capability called `name`, if any.
pub fn find<'a>(caps: &'a [Capability], name: &str) -> Option<&'a str> {
    caps.iter()
        .find(|c| c.name == name)
        .map(|c| c.value.as_str())
}

/// The server's choice for a client's `offered` capabilities: for each known
/// capability, the client's most preferred choice among `supported` ones. Unknown
/// capabilities and unknown choices are ignored. Fails, naming both sides' lists, when
/// a capability has no choice in common.
pub fn choose(offered: &[Capability], supported: &[HashAlgorithm]) -> Result<Negotiated, String> {
    let list = find(offered, HASH).unwrap_or(DEFAULT_HASH);
    let common: Vec<HashAlgorithm> = list
        .split(',')
        .filter_map(HashAlgorithm::from_name)
        .filter(|h| supported.contains(h))
        .collect();
    let hash = match common.first() {
        Some(&h) => h,
        None => {
            return Err({
                let ours: Vec<&str> = supported.iter().map(|h| h.name()).collect();
                format!(
                    "no hash algorithm in common: the client offers '{}', the server supports '{}'",
                    list.escape_debug(),
                    ours.join(",")
                )
            })
        }
    };
    let accepted = Algorithms::of(&common);
    // An optional feature: no version in common leaves it off.
    let meta = offers(offered, META, META_VERSIONS);
    let medium_batches = offers(offered, BATCH, BATCH_MODES);
    let write = offers(offered, WRITE, WRITE_VERSIONS);
    // Offered; the server turns it off unless it is a cluster node.
    let cluster = offers(offered, CLUSTER, CLUSTER_VERSIONS);
    let dirs = offers(offered, DIRS, DIRS_VERSIONS);
    // Only with the write requests it finishes.
    let finish = write && offers(offered, FINISH, FINISH_VERSIONS);
    let locks = offers(offered, LOCKS, LOCKS_VERSIONS);
    let xattr = offers(offered, XATTR, XATTR_VERSIONS);
    // Only with the write requests whose handles it acts on.
    let falloc = write && offers(offered, FALLOC, FALLOC_VERSIONS);
    // Only with the write requests it extends.
    let posix = write && offers(offered, POSIX, POSIX_VERSIONS);
    Ok(Negotiated {
        hash,
        accepted,
        meta,
        medium_batches,
        write,
        cluster,
        dirs,
        finish,
        locks,
        xattr,
        falloc,
        posix,
        encryption: None,
    })
}

/// Whether the client's `offered` capabilities offer `name` in a version among
/// `versions` (an optional feature: no version in common leaves it off).
fn offers(offered: &[Capability], name: &str, versions: &[&str]) -> bool {
    find(offered, name).is_some_and(|list| list.split(',').any(|v| versions.contains(&v)))
}

/// The server's encryption decision for a client's `offered` capabilities, given what
/// the server brings (`None`: it cannot encrypt this session). Encrypts when the
/// client offers and either requires it or the server wants it; picks the client's
/// most preferred suite, unless this CPU lacks AES instructions and the client also
/// accepts ChaCha20-Poly1305. Fails when the client requires encryption and it cannot
/// be had, or its offer is malformed.
pub fn choose_encryption(
    offered: &[Capability],
    server: Option<ServerEncryption>,
) -> Result<Option<Encrypted>, String> {
    let Some(list) = find(offered, ENCRYPT) else {
        return Ok(None);
    };
    let required = find(offered, ENCRYPT_POLICY) == Some("required");
    let Some(server) = server else {
        return if required {
            Err("the client requires encryption, which this server cannot provide".into())
        } else {
            Ok(None)
        };
    };
    if !required && !server.wants {
        return Ok(None);
    }
    let suites: Vec<Suite> = list.split(',').filter_map(Suite::from_name).collect();
    let suite = if !crate::seal::aes_hardware() && suites.contains(&Suite::ChaCha20Poly1305) {
        Some(Suite::ChaCha20Poly1305)
    } else {
        suites.first().copied()
    };
    let key = find(offered, ENCRYPT_KEY).and_then(from_hex::<PUBLIC_KEY_BYTES>);
    match (suite, key) {
        (Some(suite), Some(client_key)) => Ok(Some(Encrypted {
            suite,
            client_key,
            server_key: server.key,
            rekey: offers(offered, REKEY, REKEY_VERSIONS),
        })),
        _ if required => Err(format!(
            "the client requires encryption but offers no usable suite and key share (suites '{}')",
            list.escape_debug()
        )),
        _ => Ok(None),
    }
}

/// Checks the server's encryption choice in `chosen` against the client's `offer`:
/// the suite must be one offered and the key share well formed; a client that
/// requires encryption refuses a welcome without it.
pub fn accept_encryption(
    chosen: &[Capability],
    offer: &Offer,
) -> Result<Option<Encrypted>, String> {
    let Some(name) = find(chosen, ENCRYPT) else {
        return match &offer.encrypt {
            Some(e) if e.required => Err(
                "this client requires encryption (--encryption required), and the server's \
                 welcome does not encrypt the session: the server is older than encryption, or \
                 something on the path removed the offer"
                    .into(),
            ),
            _ => Ok(None),
        };
    };
    let Some(mine) = &offer.encrypt else {
        return Err("the server chose encryption, which this client did not offer".into());
    };
    let suite = Suite::from_name(name)
        .filter(|s| mine.suites.contains(s))
        .ok_or_else(|| {
            format!(
                "the server chose cipher suite '{}', which this client did not offer",
                name.escape_debug()
            )
        })?;
    let server_key = find(chosen, ENCRYPT_KEY)
        .and_then(from_hex::<PUBLIC_KEY_BYTES>)
        .ok_or("the server's welcome encrypts the session but has no valid key share")?;
    let rekey = match find(chosen, REKEY) {
        None => false,
        Some(v) if REKEY_VERSIONS.contains(&v) => true,
        Some(v) => {
            return Err(format!(
                "the server chose key-update version '{}', which this client did not offer",
                v.escape_debug()
            ))
        }
    };
    Ok(Some(Encrypted {
        suite,
        client_key: mine.key,
        server_key,
        rekey,
    }))
}

/// Checks the server's `chosen` capabilities against the client's `offer`: each choice
/// must be one the client offered. Unknown capabilities are ignored.
pub fn accept(chosen: &[Capability], offer: &Offer) -> Result<Negotiated, String> {
    let name = find(chosen, HASH).unwrap_or(DEFAULT_HASH);
    let hash = HashAlgorithm::from_name(name)
        .filter(|h| offer.hashes.contains(h))
        .ok_or_else(|| {
            format!(
                "the server chose hash algorithm '{}', which this client did not offer",
                name.escape_debug()
            )
        })?;
    let version =
        |name, offered, versions, what| accept_version(chosen, name, offered, versions, what, "");
    let meta = version(META, offer.meta, META_VERSIONS, "metadata version")?;
    let medium_batches = match find(chosen, BATCH) {
        None | Some("small") => false,
        Some(v) if offer.medium_batches && BATCH_MODES.contains(&v) => true,
        Some(v) => {
            return Err(format!(
                "the server chose batch mode '{}', which this client did not offer",
                v.escape_debug()
            ))
        }
    };
    let write = version(WRITE, offer.write, WRITE_VERSIONS, "write version")?;
    // Capabilities that work only with `write`.
    let with_write = |name, offered: bool, versions, what| {
        let note = " (or without write)";
        accept_version(chosen, name, offered && write, versions, what, note)
    };
    let cluster = version(CLUSTER, offer.cluster, CLUSTER_VERSIONS, "cluster version")?;
    let dirs = version(DIRS, offer.dirs, DIRS_VERSIONS, "directory-batch version")?;
    let finish = with_write(FINISH, offer.finish, FINISH_VERSIONS, "finish version")?;
    let locks = version(LOCKS, offer.locks, LOCKS_VERSIONS, "locks version")?;
    let posix = with_write(POSIX, offer.posix, POSIX_VERSIONS, "posix version")?;
    Ok(Negotiated {
        hash,
        accepted: Algorithms::of(&offer.hashes),
        meta,
        medium_batches,
        write,
        cluster,
        dirs,
        finish,
        locks,
        xattr: version(
            XATTR,
            offer.xattr,
            XATTR_VERSIONS,
            "extended-attribute version",
        )?,
        falloc: with_write(FALLOC, offer.falloc, FALLOC_VERSIONS, "fallocate version")?,
        posix,
        encryption: accept_encryption(chosen, offer)?,
    })
}

/// Whether the server's `chosen` capabilities turn capability `name` on: only a
/// version among `versions`, and only one the client `offered`. A refusal names the
/// choice as `what` (then `note`).
fn accept_version(
    chosen: &[Capability],
    name: &str,
    offered: bool,
    versions: &[&str],
    what: &str,
    note: &str,
) -> Result<bool, String> {
    match find(chosen, name) {
        None => Ok(false),
        Some(v) if offered && versions.contains(&v) => Ok(true),
        Some(v) => Err(format!(
            "the server chose {what} '{}', which this client did not offer{note}",
            v.escape_debug()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_capabilities_and_choices_are_ignored() {
        let offered = vec![
            Capability::new("zstd-control", "1"),
            Capability::new(HASH, "sha3-512,sha256"),
        ];
        let n = choose(&offered, HashAlgorithm::SUPPORTED).unwrap();
        assert_eq!(n.hash, HashAlgorithm::Sha256);
        assert!(!n.accepted.contains(HashAlgorithm::Blake3));
        let mut welcome = n.to_capabilities();
        welcome.push(Capability::new("future", "x"));
        let c = accept(&welcome, &Offer::default()).unwrap();
        assert_eq!(
            (c.hash, c.meta, c.medium_batches),
            (n.hash, n.meta, n.medium_batches)
        );
    }

    #[test]
    fn blake3_is_chosen_where_both_sides_have_it_and_sha256_where_asked() {
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert_eq!(n.hash, HashAlgorithm::Blake3);
        assert!(n.accepted.contains(HashAlgorithm::Sha256));
        // `--hash sha256`: only SHA-256 is offered, and so accepted.
        let only = Offer {
            hashes: vec![HashAlgorithm::Sha256],
            ..Offer::default()
        };
        let n = choose(&only.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert_eq!(n.hash, HashAlgorithm::Sha256);
        assert!(!n.accepted.contains(HashAlgorithm::Blake3));
        let c = accept(&n.to_capabilities(), &only).unwrap();
        assert_eq!(c, n);
        // A server without BLAKE3 (an older one) chooses SHA-256 for a new client.
        let n = choose(
            &Offer::default().to_capabilities(),
            &[HashAlgorithm::Sha256],
        )
        .unwrap();
        assert_eq!(n.hash, HashAlgorithm::Sha256);
        // A blake3-only client and a server that chose SHA-256 do not agree.
        let b3 = Offer {
            hashes: vec![HashAlgorithm::Blake3],
            ..Offer::default()
        };
        assert!(accept(&[Capability::new(HASH, "sha256")], &b3).is_err());
        assert!(accept(&[], &b3).is_err());
    }

    #[test]
    fn a_missing_capability_takes_its_default() {
        assert_eq!(
            choose(&[], HashAlgorithm::SUPPORTED).unwrap().hash,
            HashAlgorithm::Sha256
        );
        assert_eq!(
            accept(&[], &Offer::default()).unwrap().hash,
            HashAlgorithm::Sha256
        );
    }

    #[test]
    fn no_choice_in_common_is_an_error() {
        let e = choose(&[Capability::new(HASH, "md5")], HashAlgorithm::SUPPORTED).unwrap_err();
        assert!(e.contains("no hash algorithm in common"), "{e}");
        let e = accept(&[Capability::new(HASH, "md5")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn the_first_of_a_repeated_capability_counts() {
        let offered = vec![
            Capability::new(HASH, "sha256"),
            Capability::new(HASH, "md5"),
        ];
        assert!(choose(&offered, HashAlgorithm::SUPPORTED).is_ok());
        assert_eq!(
            Offer::default().to_capabilities(),
            vec![
                Capability::new(HASH, "blake3,sha256"),
                Capability::new(META, "1"),
                Capability::new(BATCH, "medium"),
                Capability::new(WRITE, "1"),
                Capability::new(CLUSTER, "1"),
                Capability::new(DIRS, "1"),
                Capability::new(FINISH, "1"),
                Capability::new(LOCKS, "1"),
                Capability::new(XATTR, "1"),
                Capability::new(FALLOC, "1"),
                Capability::new(POSIX, "1")
            ]
        );
    }

    #[test]
    fn locks_are_on_only_when_both_peers_speak_them() {
        let lock = Request::LockRelease {
            share: "s".into(),
            file: crate::locks::LockFile { dev: 1, ino: 2 },
            owner: 3,
        };
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.locks);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&lock), Ok(()));
        // A read-only client may lock too.
        let read_only = Offer {
            write: false,
            ..Offer::default()
        };
        let n = choose(&read_only.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(n.locks && !n.write);
        // An older client offers none: off, and the requests are refused.
        let n = choose(&[Capability::new(HASH, "sha256")], HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.locks);
        assert_eq!(n.permits(&lock), Err(LOCKS));
        // An older server welcomes without it: off.
        assert!(
            !accept(&[Capability::new(HASH, "sha256")], &Offer::default())
                .unwrap()
                .locks
        );
        let e = accept(&[Capability::new(LOCKS, "9")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn posix_is_on_only_with_write_and_never_nests() {
        let stat = Request::Stat {
            share: "s".into(),
            path: "p".into(),
            follow: false,
        };
        let wrap = |request: Request| Request::AsCaller {
            caller: crate::msg::Caller {
                uid: 1,
                gid: 1,
                groups: vec![],
            },
            request: Box::new(request),
        };
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.posix);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&wrap(stat.clone())), Ok(()));
        assert_eq!(n.permits(&wrap(wrap(stat.clone()))), Err(POSIX));
        let older = Offer {
            posix: false,
            ..Offer::default()
        };
        let n = choose(&older.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.posix);
        assert_eq!(n.permits(&wrap(stat)), Err(POSIX));
        let read_only = Offer {
            write: false,
            ..Offer::default()
        };
        let n = choose(&read_only.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.posix);
    }

    #[test]
    fn cluster_requests_need_the_capability_the_server_alone_grants() {
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        // `choose` takes the client's offer; ferryd clears it unless it is a node.
        assert!(n.cluster);
        let replicate = Request::Replicate {
            share: "cluster".into(),
            path: "p".into(),
            from: "n:1".into(),
            size: 1,
            manifest: [0; 32],
        };
        let off = Negotiated {
            cluster: false,
            ..n
        };
        assert_eq!(off.permits(&replicate), Err(CLUSTER));
        assert!(find(&off.to_capabilities(), CLUSTER).is_none());
        assert!(n.permits(&replicate).is_ok());
        let offer = Offer {
            cluster: false,
            ..Offer::default()
        };
        assert!(accept(
            &[
                Capability::new(HASH, "sha256"),
                Capability::new(CLUSTER, "1")
            ],
            &offer
        )
        .is_err());
        assert!(
            accept(&n.to_capabilities(), &Offer::default())
                .unwrap()
                .cluster
        );
    }

    fn set_meta() -> Request {
        Request::SetMeta {
            share: "s".into(),
            entries: vec![],
        }
    }

    #[test]
    fn meta_is_on_only_when_both_peers_speak_it() {
        // A client and a server of this build.
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.meta);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&set_meta()), Ok(()));

        // An older client offers no `meta`: the server turns it off and says nothing
        // of it, and refuses the metadata requests.
        let old_client = vec![Capability::new(HASH, "sha256")];
        let n = choose(&old_client, HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.meta);
        assert_eq!(n.to_capabilities(), old_client);
        assert_eq!(n.permits(&set_meta()), Err(META));
        let list = Request::ListDirMeta {
            share: "s".into(),
            path: String::new(),
            cursor: 0,
        };
        assert_eq!(n.permits(&list), Err(META));
        assert_eq!(n.permits(&Request::Stats), Ok(()));

        // An older server ignores the offer and welcomes without `meta`: off.
        let n = accept(&[Capability::new(HASH, "sha256")], &Offer::default()).unwrap();
        assert!(!n.meta);
        assert_eq!(n.permits(&set_meta()), Err(META));
        // So does a server of this version answering with no capabilities at all.
        assert!(!accept(&[], &Offer::default()).unwrap().meta);
    }

    #[test]
    fn dirs_is_on_only_when_both_peers_speak_it() {
        let make = Request::MakeDirs {
            share: "s".into(),
            dirs: vec![],
        };
        let set = Request::SetAttrBatch {
            share: "s".into(),
            entries: vec![],
        };
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.dirs);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&make), Ok(()));
        assert_eq!(n.permits(&set), Ok(()));
        // An older client offers no `dirs`: off, and both requests are refused.
        let n = choose(&[Capability::new(HASH, "sha256")], HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.dirs);
        assert_eq!(n.permits(&make), Err(DIRS));
        assert_eq!(n.permits(&set), Err(DIRS));
        // An older server welcomes without it: off.
        let n = accept(&[Capability::new(HASH, "sha256")], &Offer::default()).unwrap();
        assert!(!n.dirs);
        // No version in common: off, not refused; a server may not choose an unoffered one.
        let n = choose(&[Capability::new(DIRS, "9")], HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.dirs);
        let e = accept(&[Capability::new(DIRS, "9")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn finish_is_on_only_with_write_and_when_both_peers_speak_it() {
        let finish = Request::FileFinish {
            handle: 1,
            region: crate::msg::RegionDesc {
                addr: 0,
                len: 0,
                rkey: 0,
            },
            algorithm: HashAlgorithm::Blake3,
            extents: vec![],
            hashes: vec![],
            attrs: crate::msg::SetAttrs::default(),
            commit: true,
        };
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.finish);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&finish), Ok(()));
        // An older client offers no `finish`: off, and the request is refused.
        let older = Offer {
            finish: false,
            ..Offer::default()
        };
        let n = choose(&older.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(n.write && !n.finish);
        assert_eq!(n.permits(&finish), Err(FINISH));
        // Without write there is nothing to finish: off, refused as a write request.
        let read_only = Offer {
            write: false,
            ..Offer::default()
        };
        let n = choose(&read_only.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.finish);
        assert_eq!(n.permits(&finish), Err(WRITE));
        // An older server welcomes without it: off.
        let n = accept(
            &[Capability::new(HASH, "sha256"), Capability::new(WRITE, "1")],
            &Offer::default(),
        )
        .unwrap();
        assert!(n.write && !n.finish);
        // A server may not choose it unoffered, nor without write.
        let e = accept(&[Capability::new(FINISH, "1")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
        let e = accept(
            &[Capability::new(WRITE, "1"), Capability::new(FINISH, "1")],
            &older,
        )
        .unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn xattr_is_on_only_when_both_peers_speak_it() {
        let get = Request::XattrGet {
            share: "s".into(),
            path: "f".into(),
            name: b"user.a".to_vec(),
        };
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.xattr);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&get), Ok(()));
        // An older client offers no `xattr`: off, nothing said of it, refused.
        let older = Offer {
            xattr: false,
            ..Offer::default()
        };
        let n = choose(&older.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.xattr);
        assert!(find(&n.to_capabilities(), XATTR).is_none());
        assert_eq!(n.permits(&get), Err(XATTR));
        // An older server welcomes without it: off.
        let n = accept(&[Capability::new(HASH, "sha256")], &Offer::default()).unwrap();
        assert!(!n.xattr);
        // No version in common: off, not refused; a server may not choose it unoffered.
        let n = choose(&[Capability::new(XATTR, "9")], HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.xattr);
        let e = accept(&[Capability::new(XATTR, "1")], &older).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn falloc_is_on_only_with_write_and_when_both_peers_speak_it() {
        let punch = Request::FileFallocate {
            handle: 1,
            offset: 0,
            len: 1,
            mode: crate::msg::FallocMode::PunchHole,
        };
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.falloc);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        assert_eq!(n.permits(&punch), Ok(()));
        let older = Offer {
            falloc: false,
            ..Offer::default()
        };
        let n = choose(&older.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(n.write && !n.falloc);
        assert_eq!(n.permits(&punch), Err(FALLOC));
        let read_only = Offer {
            write: false,
            ..Offer::default()
        };
        let n = choose(&read_only.to_capabilities(), HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.falloc);
        assert_eq!(n.permits(&punch), Err(WRITE));
        let n = accept(&[Capability::new(WRITE, "1")], &Offer::default()).unwrap();
        assert!(!n.falloc);
        let e = accept(&[Capability::new(FALLOC, "1")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn meta_without_a_version_in_common_is_off_not_refused() {
        let offered = vec![Capability::new(META, "7,8")];
        let n = choose(&offered, HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.meta);
        // A server may not choose what was not offered.
        let no_meta = Offer {
            meta: false,
            ..Offer::default()
        };
        assert!(!no_meta.to_capabilities().iter().any(|c| c.name == META));
        let e = accept(&[Capability::new(META, "1")], &no_meta).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
        let e = accept(&[Capability::new(META, "9")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn write_requests_only_when_both_peers_speak_them() {
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.write);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        let open = Request::FileOpen {
            share: "s".into(),
            path: "f".into(),
            create: Some(0o644),
            exclusive: false,
            truncate: false,
        };
        assert_eq!(n.permits(&open), Ok(()));
        // An older client (rcp of the previous release) offers no `write`: the server
        // says nothing of it and refuses the write requests.
        let old_client = vec![
            Capability::new(HASH, "blake3,sha256"),
            Capability::new(META, "1"),
        ];
        let n = choose(&old_client, HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.write);
        assert!(find(&n.to_capabilities(), WRITE).is_none());
        assert_eq!(n.permits(&open), Err(WRITE));
        assert_eq!(n.permits(&Request::Counters), Err(WRITE));
        assert_eq!(n.permits(&Request::FileClose { handle: 1 }), Err(WRITE));
        // An older server welcomes without it: off, so a mount knows to stay read-only.
        let n = accept(&[Capability::new(HASH, "blake3")], &Offer::default()).unwrap();
        assert!(!n.write);
        // A server may not choose a version that was not offered.
        let e = accept(&[Capability::new(WRITE, "2")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn medium_batches_only_when_both_peers_speak_them() {
        let n = choose(
            &Offer::default().to_capabilities(),
            HashAlgorithm::SUPPORTED,
        )
        .unwrap();
        assert!(n.medium_batches);
        assert_eq!(accept(&n.to_capabilities(), &Offer::default()).unwrap(), n);
        // An older client offers no `batch`: small batches, nothing said of it.
        let old_client = vec![Capability::new(HASH, "sha256"), Capability::new(META, "1")];
        let n = choose(&old_client, HashAlgorithm::SUPPORTED).unwrap();
        assert!(!n.medium_batches);
        assert!(find(&n.to_capabilities(), BATCH).is_none());
        // An older server answers without it: small batches.
        let old_server = vec![Capability::new(HASH, "sha256")];
        assert!(
            !accept(&old_server, &Offer::default())
                .unwrap()
                .medium_batches
        );
        // A choice the client did not offer is refused.
        let no_medium = Offer {
            medium_batches: false,
            ..Offer::default()
        };
        let chose = vec![Capability::new(BATCH, "medium")];
        assert!(accept(&chose, &no_medium)
            .unwrap_err()
            .contains("batch mode"));
    }

    fn offer(required: bool) -> Offer {
        Offer {
            encrypt: Some(EncryptOffer {
                suites: vec![Suite::Aes256Gcm, Suite::ChaCha20Poly1305],
                key: [7; PUBLIC_KEY_BYTES],
                required,
            }),
            ..Offer::default()
        }
    }

    #[test]
    fn encryption_follows_both_policies_and_a_stripped_offer_is_refused_where_required() {
        let server = |wants| {
            Some(ServerEncryption {
                wants,
                key: [9; PUBLIC_KEY_BYTES],
            })
        };
        // Preferred client, a server that wants it: encrypted, both keys carried.
        let caps = offer(false).to_capabilities();
        let e = choose_encryption(&caps, server(true)).unwrap().unwrap();
        assert_eq!((e.client_key, e.server_key), ([7; 32], [9; 32]));
        let mut n = choose(&caps, HashAlgorithm::SUPPORTED).unwrap();
        n.encryption = Some(e);
        let back = accept(&n.to_capabilities(), &offer(false)).unwrap();
        assert_eq!(back.encryption, Some(e));
        // Preferred client, every share off: in the clear.
        assert_eq!(choose_encryption(&caps, server(false)).unwrap(), None);
        // A client that requires it gets it even then, and a server that cannot
        // encrypt refuses it.
        let required = offer(true).to_capabilities();
        assert!(choose_encryption(&required, server(false))
            .unwrap()
            .is_some());
        assert!(choose_encryption(&required, None).is_err());
        // No offer (an older client, or a stripped hello): in the clear; the share's
        // policy decides later.
        assert_eq!(
            choose_encryption(&Offer::default().to_capabilities(), server(true)).unwrap(),
            None
        );
        // A welcome without encryption (an older server, or a stripped welcome):
        // refused by a client that requires it, accepted by one that prefers it.
        let clear = choose(&caps, HashAlgorithm::SUPPORTED)
            .unwrap()
            .to_capabilities();
        assert!(accept(&clear, &offer(true))
            .unwrap_err()
            .contains("requires encryption"));
        assert_eq!(accept(&clear, &offer(false)).unwrap().encryption, None);
        // A welcome choosing a suite not offered, or with a broken key, is refused.
        let bad_suite = vec![
            Capability::new(ENCRYPT, "rot13"),
            Capability::new(ENCRYPT_KEY, &to_hex(&[1; 32])),
        ];
        assert!(accept_encryption(&bad_suite, &offer(false)).is_err());
        let bad_key = vec![
            Capability::new(ENCRYPT, "aes256gcm"),
            Capability::new(ENCRYPT_KEY, "abcd"),
        ];
        assert!(accept_encryption(&bad_key, &offer(false)).is_err());
        // Encryption the client never offered is refused.
        let n_caps = vec![
            Capability::new(ENCRYPT, "aes256gcm"),
            Capability::new(ENCRYPT_KEY, &to_hex(&[1; 32])),
        ];
        assert!(accept_encryption(&n_caps, &Offer::default()).is_err());
    }

    #[test]
    fn key_updates_are_chosen_with_the_offer_and_an_older_peer_is_served_without() {
        let server = Some(ServerEncryption {
            wants: true,
            key: [9; PUBLIC_KEY_BYTES],
        });
        let caps = offer(false).to_capabilities();
        assert_eq!(find(&caps, REKEY), Some("1"));
        let e = choose_encryption(&caps, server).unwrap().unwrap();
        assert!(e.rekey);
        let welcome = vec![
            Capability::new(ENCRYPT, "aes256gcm"),
            Capability::new(ENCRYPT_KEY, &to_hex(&[1; 32])),
            Capability::new(REKEY, "1"),
        ];
        assert!(
            accept_encryption(&welcome, &offer(false))
                .unwrap()
                .unwrap()
                .rekey
        );
        // An older client offers encryption without key updates: served without them.
        let older: Vec<Capability> = caps.iter().filter(|c| c.name != REKEY).cloned().collect();
        assert!(!choose_encryption(&older, server).unwrap().unwrap().rekey);
        // An older server's welcome has none: this client goes without them.
        let old_welcome = welcome[..2].to_vec();
        assert!(
            !accept_encryption(&old_welcome, &offer(false))
                .unwrap()
                .unwrap()
                .rekey
        );
        // A version this client did not offer is refused by name.
        let mut bad = welcome.clone();
        bad[2] = Capability::new(REKEY, "7");
        assert!(accept_encryption(&bad, &offer(false))
            .unwrap_err()
            .contains("key-update version"));
    }
}
