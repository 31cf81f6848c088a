//! Encoding and decoding of control messages.
//!
//! A control message is the postcard encoding of one [`Message`] (see
//! `docs/protocol.md`), carried in one transport control frame. Decoding is strict:
//!
//! - the transport refuses a frame longer than [`MAX_CTRL_FRAME_BYTES`] before it
//!   allocates a buffer for it, so every length inside is bounded by the frame;
//! - postcard checks each string and byte length against the bytes actually left
//!   before allocating, and short input fails with [`CodecError::Truncated`];
//! - bytes left over after the message fail with [`CodecError::TrailingBytes`];
//! - semantic bounds (path and name lengths, hash-list and listing sizes) are checked
//!   by [`validate`] and fail with [`CodecError::Limit`].

use crate::msg::{
    Attr, BatchedFile, Capability, DirEntry, Message, RemoteError, Request, Response,
    BATCH_MAX_FILES, BATCH_MAX_PATH_BYTES, CALLER_MAX_GROUPS, LINK_BATCH_MAX, MAX_CAPABILITIES,
    MAX_CAPABILITY_NAME_BYTES, MAX_CAPABILITY_VALUE_BYTES, MAX_DIR_PAGE_ENTRIES,
    MAX_ERROR_MESSAGE_BYTES, MAX_MANIFEST_PAGE_CHUNKS, MAX_MAP_REGIONS, MAX_NAME_BYTES,
    MAX_PATH_BYTES, MAX_VERIFY_BAD_CHUNKS, MAX_WINDOW_CHUNKS, MAX_WRITE_EXTENTS, META_BATCH_MAX,
    XATTR_LIST_MAX, XATTR_NAME_MAX, XATTR_SIZE_MAX,
};

/// Largest control frame either side sends or accepts, in bytes.
pub const MAX_CTRL_FRAME_BYTES: usize = 1 << 20;

/// Largest control message a client sends (a `Hello` or a `Request`), in bytes: what
/// every server accepts from its peer, and what clients pack batches to. Every message
/// within [`validate`]'s limits is far shorter (the longest, a `Symlink` with a path
/// and a target of 4096 bytes each, takes under 9 KiB), but for an `XattrSet` with a
/// large value, which only a server of the `xattr` capability is sent (see
/// [`MAX_SERVER_REQUEST_FRAME_BYTES`]).
pub const MAX_REQUEST_FRAME_BYTES: usize = 64 << 10;

/// Largest request frame this build's server accepts: [`MAX_REQUEST_FRAME_BYTES`] and
/// room for an `XattrSet` of a value of [`XATTR_SIZE_MAX`] bytes with a path of 4096
/// and a name of 255 (under 70 KiB). A server refuses a longer frame before reading
/// it, so the requests waiting for it on one connection hold at most 256 times this.
pub const MAX_SERVER_REQUEST_FRAME_BYTES: usize = 80 << 10;

/// Bytes of the varint postcard writes for the length `n`.
fn varint_bytes(n: usize) -> usize {
    let bits = usize::BITS - n.leading_zeros();
    (bits.max(1) as usize).div_ceil(7)
}

/// Encoded bytes of a client's [`Message::Request`] carrying a
/// [`Request::LinkBatch`] of `share` with no links yet (for any request id and up to
/// [`LINK_BATCH_MAX`] links): add [`link_pair_bytes`] of each pair for the whole
/// message, which must stay within [`MAX_REQUEST_FRAME_BYTES`].
pub fn link_batch_base_bytes(share: &str) -> usize {
    // Message tag, request id (a u64 varint, at most 10 bytes), Request tag (< 128),
    // the share, the pair count (a varint; LINK_BATCH_MAX needs 2 bytes).
    1 + 10 + 1 + varint_bytes(share.len()) + share.len() + varint_bytes(LINK_BATCH_MAX)
}

/// Encoded bytes one `(from, to)` pair adds to a [`Request::LinkBatch`].
pub fn link_pair_bytes(from: &str, to: &str) -> usize {
    varint_bytes(from.len()) + from.len() + varint_bytes(to.len()) + to.len()
}

/// Why a control message could not be encoded or decoded.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum CodecError {
    /// The input ended inside a message.
    #[error("control message truncated")]
    Truncated,
    /// The input held more bytes after a complete message.
    #[error("{0} trailing bytes after control message")]
    TrailingBytes(usize),
    /// The frame is longer than [`MAX_CTRL_FRAME_BYTES`].
    #[error("control frame of {0} bytes exceeds the limit of {MAX_CTRL_FRAME_BYTES}")]
    FrameTooLarge(usize),
    /// The bytes are not a valid message (unknown variant, bad varint, bad UTF-8).
    #[error("malformed control message: {0}")]
    Malformed(String),
    /// A field exceeds a protocol limit.
    #[error("control message field {field} exceeds its limit ({len} > {max})")]
    Limit {
        /// Which field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Encodes `msg`, failing if the result would exceed [`MAX_CTRL_FRAME_BYTES`].
pub fn encode(msg: &Message) -> Result<Vec<u8>, CodecError> {
    let bytes = postcard::to_stdvec(msg).map_err(|e| CodecError::Malformed(e.to_string()))?;
    if bytes.len() > MAX_CTRL_FRAME_BYTES {
        return Err(CodecError::FrameTooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Decodes exactly one message from `bytes` and checks it against the protocol limits.
pub fn decode(bytes: &[u8]) -> Result<Message, CodecError> {
    if bytes.len() > MAX_CTRL_FRAME_BYTES {
        return Err(CodecError::FrameTooLarge(bytes.len()));
    }
    let (msg, rest) = postcard::take_from_bytes::<Message>(bytes).map_err(|e| match e {
        postcard::Error::DeserializeUnexpectedEnd => CodecError::Truncated,
        other => CodecError::Malformed(other.to_string()),
    })?;
    if !rest.is_empty() {
        return Err(CodecError::TrailingBytes(rest.len()));
    }
    validate(&msg)?;
    Ok(msg)
}

fn limit(field: &'static str, len: usize, max: usize) -> Result<(), CodecError> {
    if len > max {
        Err(CodecError::Limit { field, len, max })
    } else {
        Ok(())
    }
}

/// Checks the protocol's length limits on every variable-length field of `msg`.
pub fn validate(msg: &Message) -> Result<(), CodecError> {
    match msg {
        Message::Hello(h) => {
            limit("software", h.software.len(), MAX_NAME_BYTES)?;
            validate_capabilities(&h.capabilities)
        }
        Message::Welcome(w) => {
            limit("software", w.software.len(), MAX_NAME_BYTES)?;
            validate_capabilities(&w.capabilities)
        }
        Message::Refused(e) => validate_error(e),
        Message::Request { body, .. } => validate_request(body),
        Message::Response { body, .. } => validate_response(body),
    }
}

fn validate_capabilities(caps: &[Capability]) -> Result<(), CodecError> {
    limit("capabilities", caps.len(), MAX_CAPABILITIES)?;
    caps.iter().try_for_each(|c| {
        limit("capability name", c.name.len(), MAX_CAPABILITY_NAME_BYTES)?;
        limit(
            "capability value",
            c.value.len(),
            MAX_CAPABILITY_VALUE_BYTES,
        )
    })
}

/// The leading fields of a [`Hello`] of any version: its magic and version range come
/// first in every version, so a server can name the versions of a client whose hello
/// it cannot decode whole.
#[derive(serde::Deserialize)]
struct HelloHead {
    magic: [u8; 4],
    min_version: u16,
    max_version: u16,
}

/// The only variant [`hello_head`] reads; postcard tags a [`Message::Hello`] with 0.
#[derive(serde::Deserialize)]
enum MessageHead {
    Hello(HelloHead),
}

/// The magic and version range at the start of `bytes`, if they open a hello of any
/// protocol version (trailing fields not read).
pub fn hello_head(bytes: &[u8]) -> Option<([u8; 4], u16, u16)> {
    match postcard::take_from_bytes::<MessageHead>(bytes) {
        Ok((MessageHead::Hello(h), _)) => Some((h.magic, h.min_version, h.max_version)),
        Err(_) => None,
    }
}

fn share_and_path(share: &str, path: &str) -> Result<(), CodecError> {
    limit("share", share.len(), MAX_NAME_BYTES)?;
    limit("path", path.len(), MAX_PATH_BYTES)
}

/// [`validate_request`] of the requests that name a second path (or a link target).
fn validate_two_path_request(req: &Request) -> Result<(), CodecError> {
    match req {
        Request::Replicate {
            share, path, from, ..
        } => {
            share_and_path(share, path)?;
            limit("from", from.len(), MAX_PATH_BYTES)
        }
        Request::UploadOpenBase {
            share, path, base, ..
        } => {
            share_and_path(share, path)?;
            limit("base", base.len(), MAX_PATH_BYTES)
        }
        Request::Link { share, from, to }
        | Request::Rename { share, from, to }
        | Request::Move {
            share, from, to, ..
        } => {
            share_and_path(share, from)?;
            limit("to", to.len(), MAX_PATH_BYTES)
        }
        Request::Symlink {
            share,
            path,
            target,
        } => {
            share_and_path(share, path)?;
            limit("target", target.len(), MAX_PATH_BYTES)
        }
        _ => Ok(()),
    }
}

/// [`validate_request`] of the requests that carry many entries (paths, links).
fn validate_batch_request(req: &Request) -> Result<(), CodecError> {
    match req {
        Request::LinkBatch { share, links } => {
            limit("share", share.len(), MAX_NAME_BYTES)?;
            limit("links", links.len(), LINK_BATCH_MAX)?;
            links.iter().try_for_each(|(from, to)| {
                limit("from", from.len(), MAX_PATH_BYTES)?;
                limit("to", to.len(), MAX_PATH_BYTES)
            })
        }
        Request::UploadBatch { share, files, .. } => {
            limit("share", share.len(), MAX_NAME_BYTES)?;
            batch_paths(files.iter().map(|f| f.path.as_str()), files.len())
        }
        Request::DownloadBatch { share, paths, .. } => {
            limit("share", share.len(), MAX_NAME_BYTES)?;
            batch_paths(paths.iter().map(String::as_str), paths.len())
        }
        Request::SetMeta { share, entries } => {
            limit("share", share.len(), MAX_NAME_BYTES)?;
            limit("entries", entries.len(), META_BATCH_MAX)?;
            paths_within_budget(entries.iter().map(|e| e.path.as_str()))
        }
        Request::MakeDirs { share, dirs } => {
            limit("share", share.len(), MAX_NAME_BYTES)?;
            limit("dirs", dirs.len(), META_BATCH_MAX)?;
            paths_within_budget(dirs.iter().map(|d| d.path.as_str()))
        }
        Request::SetAttrBatch { share, entries } => {
            limit("share", share.len(), MAX_NAME_BYTES)?;
            limit("entries", entries.len(), META_BATCH_MAX)?;
            paths_within_budget(entries.iter().map(|e| e.path.as_str()))
        }
        _ => Ok(()),
    }
}

/// [`validate_request`] of the requests of the `xattr` capability.
fn validate_xattr_request(req: &Request) -> Result<(), CodecError> {
    match req {
        Request::XattrGet { share, path, name } | Request::XattrRemove { share, path, name } => {
            share_and_path(share, path)?;
            limit("xattr name", name.len(), XATTR_NAME_MAX)
        }
        Request::XattrSet {
            share,
            path,
            name,
            value,
            ..
        } => {
            share_and_path(share, path)?;
            limit("xattr name", name.len(), XATTR_NAME_MAX)?;
            limit("xattr value", value.len(), XATTR_SIZE_MAX)
        }
        Request::XattrList { share, path } => share_and_path(share, path),
        _ => Ok(()),
    }
}

/// Checks the protocol's length limits on every variable-length field of `req`: what a
/// peer checks on receipt, so that a sender refuses one request instead of sending
/// what its peer would take for a broken session.
pub fn validate_request(req: &Request) -> Result<(), CodecError> {
    match req {
        Request::Stat { share, path, .. }
        | Request::ListDir { share, path, .. }
        | Request::Mkdir { share, path, .. }
        | Request::SetAttr { share, path, .. }
        | Request::UploadOpen { share, path, .. }
        | Request::DownloadOpen { share, path }
        | Request::MapOpen { share, path, .. }
        | Request::Manifest { share, path, .. }
        | Request::Remove { share, path, .. }
        | Request::DiskUsage { share, path }
        | Request::Verify { share, path }
        | Request::ListDirMeta { share, path, .. }
        | Request::FileOpen { share, path, .. }
        | Request::SetAttrs { share, path, .. }
        | Request::StatMeta { share, path, .. }
        | Request::MakeNode { share, path, .. }
        | Request::SetTimes { share, path, .. } => share_and_path(share, path),
        Request::AsCaller { caller, request } => {
            limit("groups", caller.groups.len(), CALLER_MAX_GROUPS)?;
            validate_request(request)
        }
        Request::Replicate { .. }
        | Request::UploadOpenBase { .. }
        | Request::Link { .. }
        | Request::Rename { .. }
        | Request::Move { .. }
        | Request::Symlink { .. } => validate_two_path_request(req),
        Request::LinkBatch { .. }
        | Request::UploadBatch { .. }
        | Request::DownloadBatch { .. }
        | Request::SetMeta { .. }
        | Request::MakeDirs { .. }
        | Request::SetAttrBatch { .. } => validate_batch_request(req),
        Request::StatFs { share }
        | Request::ShareInfo { share }
        | Request::ShareAccess { share }
        | Request::LockRelease { share, .. }
        | Request::Auth { share, .. } => limit("share", share.len(), MAX_NAME_BYTES),
        Request::Lock { share, path, .. } | Request::LockTest { share, path, .. } => {
            share_and_path(share, path)
        }
        Request::UploadWindow { hashes, .. } => limit("hashes", hashes.len(), MAX_WINDOW_CHUNKS),
        Request::XattrGet { .. }
        | Request::XattrList { .. }
        | Request::XattrSet { .. }
        | Request::XattrRemove { .. } => validate_xattr_request(req),
        Request::FilePut {
            share,
            path,
            extents,
            hashes,
            ..
        } => {
            share_and_path(share, path)?;
            limit("extents", extents.len(), MAX_WRITE_EXTENTS)?;
            limit("hashes", hashes.len(), MAX_WRITE_EXTENTS)
        }
        Request::FileWrite {
            extents, hashes, ..
        }
        | Request::FileFinish {
            extents, hashes, ..
        } => {
            limit("extents", extents.len(), MAX_WRITE_EXTENTS)?;
            limit("hashes", hashes.len(), MAX_WRITE_EXTENTS)
        }
        Request::UploadCommit { .. }
        | Request::DownloadWindow { .. }
        | Request::Close { .. }
        | Request::MapRelease { .. }
        | Request::Stats
        | Request::FileRead { .. }
        | Request::FileSetAttr { .. }
        | Request::FileAllocate { .. }
        | Request::FileFallocate { .. }
        | Request::FileSync { .. }
        | Request::FileClose { .. }
        | Request::FileDiscard { .. }
        | Request::FileCommit { .. }
        | Request::Counters => Ok(()),
    }
}

/// A batch names at most [`BATCH_MAX_FILES`] paths of at most [`MAX_PATH_BYTES`] each,
/// and at most [`BATCH_MAX_PATH_BYTES`] of them in all.
fn batch_paths<'a>(paths: impl Iterator<Item = &'a str>, count: usize) -> Result<(), CodecError> {
    limit("files", count, BATCH_MAX_FILES)?;
    paths_within_budget(paths)
}

/// Each of `paths` is at most [`MAX_PATH_BYTES`], and all of them together at most
/// [`BATCH_MAX_PATH_BYTES`].
fn paths_within_budget<'a>(paths: impl Iterator<Item = &'a str>) -> Result<(), CodecError> {
    let mut total = 0usize;
    for p in paths {
        limit("path", p.len(), MAX_PATH_BYTES)?;
        total += p.len();
    }
    limit("batch paths", total, BATCH_MAX_PATH_BYTES)
}

fn validate_attr(attr: &Attr) -> Result<(), CodecError> {
    match &attr.symlink_target {
        Some(t) => limit("symlink_target", t.len(), MAX_PATH_BYTES),
        None => Ok(()),
    }
}

fn validate_error(e: &RemoteError) -> Result<(), CodecError> {
    limit("message", e.message.len(), MAX_ERROR_MESSAGE_BYTES)
}

fn validate_entries(entries: &[DirEntry]) -> Result<(), CodecError> {
    limit("entries", entries.len(), MAX_DIR_PAGE_ENTRIES)?;
    entries.iter().try_for_each(|DirEntry { name, attr }| {
        limit("name", name.len(), MAX_NAME_BYTES)?;
        validate_attr(attr)
    })
}

fn validate_response(resp: &Response) -> Result<(), CodecError> {
    match resp {
        Response::Attr(a) => validate_attr(a),
        Response::DownloadOpened { attr, .. }
        | Response::FileOpened { attr, .. }
        | Response::AttrMeta { attr, .. } => validate_attr(attr),
        Response::FileData { hashes, .. } => limit("hashes", hashes.len(), MAX_WINDOW_CHUNKS),
        Response::Dir { entries, .. } => validate_entries(entries),
        Response::DirMeta {
            entries, owners, ..
        } => {
            validate_entries(entries)?;
            limit("owners", owners.len(), MAX_DIR_PAGE_ENTRIES)
        }
        Response::MetaSet { results } => {
            limit("results", results.len(), META_BATCH_MAX)?;
            results.iter().flatten().try_for_each(validate_error)
        }
        Response::WindowPushed { hashes } => limit("hashes", hashes.len(), MAX_WINDOW_CHUNKS),
        Response::Manifest { hashes, .. } => {
            limit("hashes", hashes.len(), MAX_MANIFEST_PAGE_CHUNKS)
        }
        Response::Verified(r) => limit("bad_chunks", r.bad_chunks.len(), MAX_VERIFY_BAD_CHUNKS),
        Response::Error(e) => validate_error(e),
        Response::LinkedBatch { results } => {
            limit("results", results.len(), LINK_BATCH_MAX)?;
            results.iter().flatten().try_for_each(validate_error)
        }
        Response::Mapped(m) => {
            validate_attr(&m.attr)?;
            limit("regions", m.regions.len(), MAX_MAP_REGIONS)
        }
        Response::UploadedBatch { results } => {
            limit("results", results.len(), BATCH_MAX_FILES)?;
            results.iter().flatten().try_for_each(validate_error)
        }
        Response::DownloadedBatch { files } => {
            limit("files", files.len(), BATCH_MAX_FILES)?;
            files.iter().try_for_each(|f| match f {
                BatchedFile::Ok { attr, .. } => validate_attr(attr),
                BatchedFile::Err(e) => validate_error(e),
                BatchedFile::NotIncluded => Ok(()),
            })
        }
        Response::XattrValue { value } => limit("xattr value", value.len(), XATTR_SIZE_MAX),
        Response::XattrNames { names } => {
            names
                .iter()
                .try_for_each(|n| limit("xattr name", n.len(), XATTR_NAME_MAX))?;
            let listed: usize = names.iter().map(|n| n.len() + 1).sum();
            limit("xattr names", listed, XATTR_LIST_MAX)
        }
        Response::Ok
        | Response::FsStat(_)
        | Response::Stats(_)
        | Response::UploadOpened { .. }
        | Response::WindowPulled { .. }
        | Response::Committed { .. }
        | Response::Authenticated { .. }
        | Response::DiskUsage(_)
        | Response::ShareInfo { .. }
        | Response::FileWritten { .. }
        | Response::ShareAccess { .. }
        | Response::Counters(_)
        | Response::Lock { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::*;

    fn stat() -> Message {
        Message::Request {
            id: 7,
            body: Request::Stat {
                share: "data".into(),
                path: "a/b".into(),
                follow: true,
            },
        }
    }

    #[test]
    fn round_trip() {
        let m = stat();
        assert_eq!(decode(&encode(&m).unwrap()).unwrap(), m);
    }

    #[test]
    fn stat_request_bytes_are_stable() {
        // Message::Request = variant 3, id varint 7, Request::Stat = variant 0,
        // "data" (len 4), "a/b" (len 3), follow = 1. See docs/protocol.md.
        let bytes = encode(&stat()).unwrap();
        assert_eq!(
            bytes,
            vec![3, 7, 0, 4, b'd', b'a', b't', b'a', 3, b'a', b'/', b'b', 1]
        );
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = encode(&stat()).unwrap();
        for cut in 0..bytes.len() {
            assert_eq!(
                decode(&bytes[..cut]),
                Err(CodecError::Truncated),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = encode(&stat()).unwrap();
        bytes.extend_from_slice(&[0, 0]);
        assert_eq!(decode(&bytes), Err(CodecError::TrailingBytes(2)));
    }

    #[test]
    fn unknown_variant_is_malformed() {
        assert!(matches!(decode(&[5]), Err(CodecError::Malformed(_))));
        assert_eq!(decode(&[200]), Err(CodecError::Truncated));
        assert!(matches!(decode(&[3, 7, 99]), Err(CodecError::Malformed(_))));
    }

    #[test]
    fn oversized_string_length_fails_without_allocating() {
        // A Stat whose share claims 2^32 bytes: postcard must fail on the missing
        // bytes, not try to allocate them.
        let bytes = [3, 7, 0, 0x80, 0x80, 0x80, 0x80, 0x10, b'x'];
        assert!(decode(&bytes).is_err());
    }

    #[test]
    fn oversized_frame_is_rejected() {
        let big = vec![0u8; MAX_CTRL_FRAME_BYTES + 1];
        assert_eq!(
            decode(&big),
            Err(CodecError::FrameTooLarge(MAX_CTRL_FRAME_BYTES + 1))
        );
    }

    #[test]
    fn too_long_path_hits_the_limit() {
        let m = Message::Request {
            id: 1,
            body: Request::Stat {
                share: "s".into(),
                path: "x".repeat(MAX_PATH_BYTES + 1),
                follow: false,
            },
        };
        let bytes = postcard::to_stdvec(&m).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit { field: "path", .. })
        ));
    }

    #[test]
    fn too_many_hashes_hit_the_limit() {
        let m = Message::Request {
            id: 1,
            body: Request::UploadWindow {
                transfer: 1,
                offset: 0,
                region: RegionDesc {
                    addr: 0,
                    len: 0,
                    rkey: 0,
                },
                hashes: vec![[0; 32]; MAX_WINDOW_CHUNKS + 1],
            },
        };
        let bytes = postcard::to_stdvec(&m).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit {
                field: "hashes",
                ..
            })
        ));
    }

    #[test]
    fn backup_requests_have_appended_indices() {
        // Variant indices are the first varint of a request body: Link 16, Rename 17,
        // Manifest 18 (appended after Auth 15).
        let link = Request::Link {
            share: "s".into(),
            from: "a".into(),
            to: "b".into(),
        };
        assert_eq!(
            postcard::to_stdvec(&link).unwrap(),
            [16, 1, b's', 1, b'a', 1, b'b']
        );
        let rename = Request::Rename {
            share: "s".into(),
            from: "a".into(),
            to: "b".into(),
        };
        assert_eq!(postcard::to_stdvec(&rename).unwrap()[0], 17);
        let manifest = Request::Manifest {
            share: "s".into(),
            path: "p".into(),
            chunk_bytes: 1,
            first_chunk: 2,
        };
        assert_eq!(
            postcard::to_stdvec(&manifest).unwrap(),
            [18, 1, b's', 1, b'p', 1, 2]
        );
        let open = Request::UploadOpenBase {
            share: "s".into(),
            path: "p".into(),
            size: 3,
            mode: 4,
            mtime: Timestamp { secs: 5, nanos: 6 },
            base: "b".into(),
        };
        assert_eq!(
            postcard::to_stdvec(&open).unwrap(),
            [19, 1, b's', 1, b'p', 3, 4, 10, 6, 1, b'b']
        );
    }

    /// Index of `Request::Verify` (after Remove 20 and DiskUsage 21) and of
    /// `Response::Verified` (after the DiskUsage response 14).
    const VERIFY_REQUEST_INDEX: u8 = 22;
    const VERIFIED_RESPONSE_INDEX: u8 = 15;

    #[test]
    fn verify_has_an_appended_index() {
        let verify = Request::Verify {
            share: "s".into(),
            path: "p".into(),
        };
        assert_eq!(
            postcard::to_stdvec(&verify).unwrap(),
            [VERIFY_REQUEST_INDEX, 1, b's', 1, b'p']
        );
        let verified = Response::Verified(VerifyReport {
            algorithm: HashAlgorithm::Blake3,
            record: VerifyRecord::Stale {
                size_changed: false,
                mtime_changed: true,
            },
            size: 3,
            chunk_bytes: 4,
            chunks: 5,
            bad_count: 1,
            bad_chunks: vec![2],
        });
        // The algorithm (BLAKE3 = 1), VerifyRecord::Stale = 2, then its two bools; the
        // report's fields in order.
        assert_eq!(
            postcard::to_stdvec(&verified).unwrap(),
            [VERIFIED_RESPONSE_INDEX, 1, 2, 0, 1, 3, 4, 5, 1, 1, 2]
        );
        let report = |n| Message::Response {
            id: 1,
            body: Response::Verified(VerifyReport {
                algorithm: HashAlgorithm::Blake3,
                record: VerifyRecord::Current,
                size: u64::MAX,
                chunk_bytes: u32::MAX,
                chunks: u64::MAX,
                bad_count: u64::MAX,
                bad_chunks: vec![u64::MAX; n],
            }),
        };
        let bytes = encode(&report(MAX_VERIFY_BAD_CHUNKS)).unwrap();
        assert!(bytes.len() < MAX_CTRL_FRAME_BYTES / 32, "{}", bytes.len());
        assert_eq!(decode(&bytes).unwrap(), report(MAX_VERIFY_BAD_CHUNKS));
        let over = postcard::to_stdvec(&report(MAX_VERIFY_BAD_CHUNKS + 1)).unwrap();
        assert!(matches!(
            decode(&over),
            Err(CodecError::Limit {
                field: "bad_chunks",
                ..
            })
        ));
    }

    /// Index of `Request::LinkBatch` (appended after DownloadBatch 24) and of
    /// `Response::LinkedBatch` (after DownloadedBatch 17).
    const LINK_BATCH_REQUEST_INDEX: u8 = 25;
    const LINKED_BATCH_RESPONSE_INDEX: u8 = 18;

    #[test]
    fn link_batch_has_an_appended_index_and_bounds() {
        let batch = Request::LinkBatch {
            share: "s".into(),
            links: vec![("a".into(), "b".into()), ("c".into(), "de".into())],
        };
        assert_eq!(
            postcard::to_stdvec(&batch).unwrap(),
            [
                LINK_BATCH_REQUEST_INDEX,
                1,
                b's',
                2,
                1,
                b'a',
                1,
                b'b',
                1,
                b'c',
                2,
                b'd',
                b'e'
            ]
        );
        // Result 0 made, result 1 refused with NotFound (ErrorKind 0) and message "m".
        let linked = Response::LinkedBatch {
            results: vec![None, Some(RemoteError::new(ErrorKind::NotFound, "m"))],
        };
        assert_eq!(
            postcard::to_stdvec(&linked).unwrap(),
            [LINKED_BATCH_RESPONSE_INDEX, 2, 0, 1, 0, 1, b'm']
        );
        for msg in [
            Message::Request { id: 1, body: batch },
            Message::Response {
                id: 1,
                body: linked,
            },
        ] {
            assert_eq!(decode(&encode(&msg).unwrap()).unwrap(), msg);
        }
        let over = Message::Request {
            id: 1,
            body: Request::LinkBatch {
                share: "s".into(),
                links: vec![("a".into(), "b".into()); LINK_BATCH_MAX + 1],
            },
        };
        assert!(matches!(
            decode(&postcard::to_stdvec(&over).unwrap()),
            Err(CodecError::Limit { field: "links", .. })
        ));
        let long = Message::Request {
            id: 1,
            body: Request::LinkBatch {
                share: "s".into(),
                links: vec![("a".repeat(MAX_PATH_BYTES + 1), "b".into())],
            },
        };
        assert!(matches!(
            decode(&postcard::to_stdvec(&long).unwrap()),
            Err(CodecError::Limit { field: "from", .. })
        ));
        let answers = Message::Response {
            id: 1,
            body: Response::LinkedBatch {
                results: vec![None; LINK_BATCH_MAX + 1],
            },
        };
        assert!(matches!(
            decode(&postcard::to_stdvec(&answers).unwrap()),
            Err(CodecError::Limit {
                field: "results",
                ..
            })
        ));
        // The size estimate the client packs batches with is exact but for the count
        // (two varint bytes reserved, one used here) and the id (ten reserved).
        let Message::Request { body, .. } = over else {
            unreachable!()
        };
        let Request::LinkBatch { links, .. } = body else {
            unreachable!()
        };
        let msg = Message::Request {
            id: u64::MAX,
            body: Request::LinkBatch {
                share: "s".into(),
                links: links[..100].to_vec(),
            },
        };
        let pairs: usize = links[..100]
            .iter()
            .map(|(f, t)| link_pair_bytes(f, t))
            .sum();
        assert_eq!(
            encode(&msg).unwrap().len() + 1,
            link_batch_base_bytes("s") + pairs
        );
    }

    #[test]
    fn remove_and_disk_usage_have_their_agreed_indices() {
        // Request::Remove 20, Request::DiskUsage 21, Response::DiskUsage 14.
        let remove = Request::Remove {
            share: "s".into(),
            path: "p".into(),
            recursive: true,
        };
        assert_eq!(
            postcard::to_stdvec(&remove).unwrap(),
            [20, 1, b's', 1, b'p', 1]
        );
        let du = Request::DiskUsage {
            share: "s".into(),
            path: "p".into(),
        };
        assert_eq!(postcard::to_stdvec(&du).unwrap(), [21, 1, b's', 1, b'p']);
        let usage = Response::DiskUsage(DiskUsage {
            files: 1,
            dirs: 2,
            bytes: 300,
            unique_bytes: 4,
        });
        assert_eq!(
            postcard::to_stdvec(&usage).unwrap(),
            [14, 1, 2, 0xac, 0x02, 4]
        );
        let long = Message::Request {
            id: 1,
            body: Request::Remove {
                share: "s".into(),
                path: "x".repeat(MAX_PATH_BYTES + 1),
                recursive: false,
            },
        };
        assert!(matches!(
            decode(&postcard::to_stdvec(&long).unwrap()),
            Err(CodecError::Limit { field: "path", .. })
        ));
    }

    #[test]
    fn too_many_links_is_error_kind_17() {
        // An error response's body: Response::Error's index, then the kind's.
        let e = Response::Error(RemoteError {
            kind: ErrorKind::TooManyLinks,
            message: "m".into(),
        });
        let bytes = postcard::to_stdvec(&e).unwrap();
        assert_eq!(bytes[1], 17, "{bytes:?}");
        assert_eq!(&bytes[2..], [1, b'm']);
        assert_eq!(ErrorKind::TooManyLinks.as_str(), "too_many_links");
    }

    #[test]
    fn too_long_link_target_hits_the_limit() {
        let m = Message::Request {
            id: 1,
            body: Request::Rename {
                share: "s".into(),
                from: "a".into(),
                to: "x".repeat(MAX_PATH_BYTES + 1),
            },
        };
        let bytes = postcard::to_stdvec(&m).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit { field: "to", .. })
        ));
    }

    #[test]
    fn manifest_pages_are_bounded() {
        let page = |n| Message::Response {
            id: 1,
            body: Response::Manifest {
                version: FileVersion {
                    algorithm: HashAlgorithm::Blake3,
                    size: u64::MAX,
                    mtime: Timestamp {
                        secs: i64::MIN,
                        nanos: u32::MAX,
                    },
                    ctime: Timestamp {
                        secs: i64::MIN,
                        nanos: u32::MAX,
                    },
                    ino: u64::MAX,
                    chunk_bytes: u32::MAX,
                    manifest: [0xff; 32],
                },
                first_chunk: u64::MAX,
                hashes: vec![[0xff; 32]; n],
            },
        };
        let full = encode(&page(MAX_MANIFEST_PAGE_CHUNKS)).unwrap();
        assert!(full.len() < MAX_CTRL_FRAME_BYTES / 16, "{}", full.len());
        assert_eq!(decode(&full).unwrap(), page(MAX_MANIFEST_PAGE_CHUNKS));
        let over = postcard::to_stdvec(&page(MAX_MANIFEST_PAGE_CHUNKS + 1)).unwrap();
        assert!(matches!(
            decode(&over),
            Err(CodecError::Limit {
                field: "hashes",
                ..
            })
        ));
    }

    #[test]
    fn the_longest_client_messages_fit_a_request_frame() {
        let longest = [
            Request::Link {
                share: "s".repeat(MAX_NAME_BYTES),
                from: "f".repeat(MAX_PATH_BYTES),
                to: "t".repeat(MAX_PATH_BYTES),
            },
            Request::Symlink {
                share: "s".repeat(MAX_NAME_BYTES),
                path: "p".repeat(MAX_PATH_BYTES),
                target: "t".repeat(MAX_PATH_BYTES),
            },
            Request::UploadWindow {
                transfer: u64::MAX,
                offset: u64::MAX,
                region: RegionDesc {
                    addr: u64::MAX,
                    len: u64::MAX,
                    rkey: u32::MAX,
                },
                hashes: vec![[0xff; 32]; MAX_WINDOW_CHUNKS],
            },
            Request::SetAttr {
                share: "s".repeat(MAX_NAME_BYTES),
                path: "p".repeat(MAX_PATH_BYTES),
                mode: Some(u32::MAX),
                mtime: Some(Timestamp {
                    secs: i64::MIN,
                    nanos: u32::MAX,
                }),
            },
        ];
        for body in longest {
            let msg = Message::Request { id: u64::MAX, body };
            let len = encode(&msg).unwrap().len();
            assert!(len < MAX_REQUEST_FRAME_BYTES / 4, "{len}");
        }
        let hello = Message::Hello(Hello {
            magic: HELLO_MAGIC,
            min_version: u16::MAX,
            max_version: u16::MAX,
            software: "s".repeat(MAX_NAME_BYTES),
            nonce: [0xff; 32],
            capabilities: vec![
                Capability {
                    name: "n".repeat(MAX_CAPABILITY_NAME_BYTES),
                    value: "v".repeat(MAX_CAPABILITY_VALUE_BYTES),
                };
                MAX_CAPABILITIES
            ],
        });
        assert!(encode(&hello).unwrap().len() < MAX_REQUEST_FRAME_BYTES);
    }

    fn hello(capabilities: Vec<Capability>) -> Message {
        Message::Hello(Hello {
            magic: HELLO_MAGIC,
            min_version: 3,
            max_version: 9,
            software: "t".into(),
            nonce: [1; 32],
            capabilities,
        })
    }

    #[test]
    fn capabilities_are_bounded() {
        let cap = |n: usize, v: usize| Capability {
            name: "n".repeat(n),
            value: "v".repeat(v),
        };
        let ok = hello(vec![cap(1, 0); MAX_CAPABILITIES]);
        assert_eq!(decode(&encode(&ok).unwrap()).unwrap(), ok);
        for (bad, field) in [
            (vec![cap(1, 0); MAX_CAPABILITIES + 1], "capabilities"),
            (
                vec![cap(MAX_CAPABILITY_NAME_BYTES + 1, 0)],
                "capability name",
            ),
            (
                vec![cap(1, MAX_CAPABILITY_VALUE_BYTES + 1)],
                "capability value",
            ),
        ] {
            let bytes = postcard::to_stdvec(&hello(bad)).unwrap();
            assert!(
                matches!(decode(&bytes), Err(CodecError::Limit { field: f, .. }) if f == field),
                "{field}"
            );
        }
    }

    #[test]
    fn the_versions_of_an_older_hello_can_be_read() {
        // Version 5's hello: the same fields without the capabilities.
        #[derive(serde::Serialize)]
        enum OldMessage {
            Hello {
                magic: [u8; 4],
                min_version: u16,
                max_version: u16,
                software: String,
                nonce: [u8; 32],
            },
        }
        let old = postcard::to_stdvec(&OldMessage::Hello {
            magic: HELLO_MAGIC,
            min_version: 5,
            max_version: 5,
            software: "rcp/0.1.0".into(),
            nonce: [2; 32],
        })
        .unwrap();
        assert!(decode(&old).is_err());
        assert_eq!(hello_head(&old), Some((HELLO_MAGIC, 5, 5)));
        let new = encode(&hello(vec![])).unwrap();
        assert_eq!(hello_head(&new), Some((HELLO_MAGIC, 3, 9)));
        let request = encode(&Message::Request {
            id: 1,
            body: Request::Stats,
        })
        .unwrap();
        assert_eq!(hello_head(&request), None);
        assert_eq!(hello_head(&[]), None);
    }

    /// Indices of the batch messages: requests 23 and 24 (after Verify 22), responses
    /// 16 and 17 (after Verified 15).
    const UPLOAD_BATCH_INDEX: u8 = 23;
    const DOWNLOAD_BATCH_INDEX: u8 = 24;
    const UPLOADED_BATCH_INDEX: u8 = 16;
    const DOWNLOADED_BATCH_INDEX: u8 = 17;

    fn region() -> RegionDesc {
        RegionDesc {
            addr: 1,
            len: 2,
            rkey: 3,
        }
    }

    fn batch_file(path: String) -> BatchFile {
        BatchFile {
            path,
            size: u64::MAX,
            mode: u32::MAX,
            mtime: Timestamp {
                secs: i64::MIN,
                nanos: u32::MAX,
            },
            hash: [0xff; 32],
        }
    }

    #[test]
    fn batch_messages_have_their_agreed_indices() {
        let up = Request::UploadBatch {
            algorithm: HashAlgorithm::Blake3,
            share: "s".into(),
            region: region(),
            files: vec![BatchFile {
                path: "p".into(),
                size: 4,
                mode: 5,
                mtime: Timestamp { secs: 6, nanos: 7 },
                hash: [9; 32],
            }],
        };
        let mut want = vec![
            UPLOAD_BATCH_INDEX,
            1,
            b's',
            1,
            2,
            3,
            // The algorithm: BLAKE3 is variant 1.
            1,
            1,
            1,
            b'p',
            4,
            5,
            12,
            7,
        ];
        want.extend([9; 32]);
        assert_eq!(postcard::to_stdvec(&up).unwrap(), want);
        let down = Request::DownloadBatch {
            share: "s".into(),
            paths: vec!["a".into(), "b".into()],
            region: region(),
        };
        assert_eq!(
            postcard::to_stdvec(&down).unwrap(),
            [DOWNLOAD_BATCH_INDEX, 1, b's', 2, 1, b'a', 1, b'b', 1, 2, 3]
        );
        let uploaded = Response::UploadedBatch {
            results: vec![
                None,
                Some(RemoteError {
                    kind: ErrorKind::Exists,
                    message: "m".into(),
                }),
            ],
        };
        assert_eq!(
            postcard::to_stdvec(&uploaded).unwrap(),
            [UPLOADED_BATCH_INDEX, 2, 0, 1, 9, 1, b'm']
        );
        let downloaded = Response::DownloadedBatch {
            files: vec![
                BatchedFile::NotIncluded,
                BatchedFile::Err(RemoteError {
                    kind: ErrorKind::NotFound,
                    message: String::new(),
                }),
            ],
        };
        // BatchedFile: Ok 0, Err 1, NotIncluded 2.
        assert_eq!(
            postcard::to_stdvec(&downloaded).unwrap(),
            [DOWNLOADED_BATCH_INDEX, 2, 2, 1, 0, 0]
        );
    }

    #[test]
    fn the_longest_batches_fit_their_frames_and_longer_ones_are_refused() {
        // As many files as allowed, their paths using up the path budget.
        let each = BATCH_MAX_PATH_BYTES / BATCH_MAX_FILES;
        let paths = || (0..BATCH_MAX_FILES).map(|_| "p".repeat(each));
        let up = |files: Vec<BatchFile>| Message::Request {
            id: u64::MAX,
            body: Request::UploadBatch {
                algorithm: HashAlgorithm::Blake3,
                share: "s".repeat(MAX_NAME_BYTES),
                region: region(),
                files,
            },
        };
        let full = encode(&up(paths().map(batch_file).collect())).unwrap();
        // Under 50 KiB: well inside the server's request frame.
        assert!(full.len() < 50 << 10, "{}", full.len());
        let down = |paths: Vec<String>| Message::Request {
            id: u64::MAX,
            body: Request::DownloadBatch {
                share: "s".repeat(MAX_NAME_BYTES),
                paths,
                region: region(),
            },
        };
        let full = encode(&down(paths().collect())).unwrap();
        // Under 50 KiB: well inside the server's request frame.
        assert!(full.len() < 50 << 10, "{}", full.len());

        let too_many: Vec<String> = (0..=BATCH_MAX_FILES).map(|_| "p".into()).collect();
        let bytes = postcard::to_stdvec(&down(too_many.clone())).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit { field: "files", .. })
        ));
        let bytes =
            postcard::to_stdvec(&up(too_many.into_iter().map(batch_file).collect())).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit { field: "files", .. })
        ));
        let too_long: Vec<String> = (0..9).map(|_| "p".repeat(MAX_PATH_BYTES)).collect();
        let bytes = postcard::to_stdvec(&down(too_long)).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit {
                field: "batch paths",
                ..
            })
        ));
        let one_too_long = vec!["p".repeat(MAX_PATH_BYTES + 1)];
        let bytes = postcard::to_stdvec(&down(one_too_long)).unwrap();
        assert!(matches!(
            decode(&bytes),
            Err(CodecError::Limit { field: "path", .. })
        ));
    }

    #[test]
    fn batch_answers_are_bounded() {
        let error = || RemoteError::new(ErrorKind::Io, "e".repeat(MAX_ERROR_MESSAGE_BYTES));
        let uploaded = |n| Message::Response {
            id: 1,
            body: Response::UploadedBatch {
                results: vec![Some(error()); n],
            },
        };
        let full = encode(&uploaded(BATCH_MAX_FILES)).unwrap();
        assert!(full.len() < MAX_CTRL_FRAME_BYTES / 2, "{}", full.len());
        assert_eq!(decode(&full).unwrap(), uploaded(BATCH_MAX_FILES));
        let over = postcard::to_stdvec(&uploaded(BATCH_MAX_FILES + 1)).unwrap();
        assert!(matches!(
            decode(&over),
            Err(CodecError::Limit {
                field: "results",
                ..
            })
        ));
        let downloaded = |n, file: BatchedFile| Message::Response {
            id: 1,
            body: Response::DownloadedBatch {
                files: vec![file; n],
            },
        };
        let full = encode(&downloaded(BATCH_MAX_FILES, BatchedFile::Err(error()))).unwrap();
        assert!(full.len() < MAX_CTRL_FRAME_BYTES / 2, "{}", full.len());
        let over = postcard::to_stdvec(&downloaded(BATCH_MAX_FILES + 1, BatchedFile::NotIncluded))
            .unwrap();
        assert!(matches!(
            decode(&over),
            Err(CodecError::Limit { field: "files", .. })
        ));
    }

    #[test]
    fn invalid_utf8_is_malformed() {
        let bytes = [3, 7, 0, 1, 0xff, 1, b'a', 0];
        assert!(matches!(decode(&bytes), Err(CodecError::Malformed(_))));
    }

    #[test]
    fn error_messages_quoting_long_names_are_cut_to_what_decodes() {
        // A share name of escaped control characters grows sixfold in a message.
        let name = "\u{1b}".repeat(MAX_NAME_BYTES);
        let msg = Message::Response {
            id: 1,
            body: Response::Error(RemoteError::new(
                ErrorKind::NoSuchShare,
                format!("no such share '{}'", name.escape_debug()),
            )),
        };
        let Message::Response {
            body: Response::Error(e),
            ..
        } = decode(&encode(&msg).unwrap()).unwrap()
        else {
            panic!("not an error response");
        };
        assert_eq!(e.message.len(), MAX_ERROR_MESSAGE_BYTES);
        // A cut never splits a character.
        let wide = RemoteError::new(ErrorKind::Io, "é".repeat(MAX_ERROR_MESSAGE_BYTES));
        assert_eq!(wide.message.len(), MAX_ERROR_MESSAGE_BYTES);
        let odd = RemoteError::new(ErrorKind::Io, format!("x{}", "é".repeat(600)));
        assert_eq!(odd.message.len(), MAX_ERROR_MESSAGE_BYTES - 1);
    }

    /// Indices of the `meta` capability's messages: requests appended after LinkBatch
    /// 25, responses after LinkedBatch 18.
    const SET_META_REQUEST_INDEX: u8 = 26;
    const LIST_DIR_META_REQUEST_INDEX: u8 = 27;
    const META_SET_RESPONSE_INDEX: u8 = 19;
    const DIR_META_RESPONSE_INDEX: u8 = 20;

    fn meta_entry(path: String) -> MetaEntry {
        MetaEntry {
            path,
            uid: Some(u32::MAX),
            gid: Some(u32::MAX),
            mtime: Some(Timestamp {
                secs: i64::MIN,
                nanos: u32::MAX,
            }),
        }
    }

    #[test]
    fn meta_messages_have_appended_indices_and_bounds() {
        let set = Request::SetMeta {
            share: "s".into(),
            entries: vec![MetaEntry {
                path: "a".into(),
                uid: Some(1),
                gid: None,
                mtime: Some(Timestamp { secs: 2, nanos: 3 }),
            }],
        };
        assert_eq!(
            postcard::to_stdvec(&set).unwrap(),
            [
                SET_META_REQUEST_INDEX,
                1,
                b's',
                1,
                1,
                b'a',
                1,
                1,
                0,
                1,
                4,
                3
            ]
        );
        let list = Request::ListDirMeta {
            share: "s".into(),
            path: "d".into(),
            cursor: 5,
        };
        assert_eq!(
            postcard::to_stdvec(&list).unwrap(),
            [LIST_DIR_META_REQUEST_INDEX, 1, b's', 1, b'd', 5]
        );
        let done = Response::MetaSet {
            results: vec![None, Some(RemoteError::new(ErrorKind::NotFound, "m"))],
        };
        assert_eq!(
            postcard::to_stdvec(&done).unwrap(),
            [META_SET_RESPONSE_INDEX, 2, 0, 1, 0, 1, b'm']
        );
        let page = Response::DirMeta {
            dir: Owner { uid: 1, gid: 2 },
            entries: vec![],
            owners: vec![],
            next: None,
        };
        assert_eq!(
            postcard::to_stdvec(&page).unwrap(),
            [DIR_META_RESPONSE_INDEX, 1, 2, 0, 0, 0]
        );
        for body in [set, list] {
            let msg = Message::Request { id: 1, body };
            assert_eq!(decode(&encode(&msg).unwrap()).unwrap(), msg);
        }
        for body in [done, page] {
            let msg = Message::Response { id: 1, body };
            assert_eq!(decode(&encode(&msg).unwrap()).unwrap(), msg);
        }

        // The longest request fits a request frame; one more entry, or more path
        // bytes, is refused.
        let each = BATCH_MAX_PATH_BYTES / META_BATCH_MAX;
        let entries: Vec<MetaEntry> = (0..META_BATCH_MAX)
            .map(|_| meta_entry("p".repeat(each)))
            .collect();
        let full = Message::Request {
            id: u64::MAX,
            body: Request::SetMeta {
                share: "s".repeat(MAX_NAME_BYTES),
                entries: entries.clone(),
            },
        };
        let len = encode(&full).unwrap().len();
        assert!(len < MAX_REQUEST_FRAME_BYTES, "{len}");
        assert_eq!(decode(&encode(&full).unwrap()).unwrap(), full);
        let mut over = entries.clone();
        over.push(meta_entry("p".into()));
        let mut longer = entries;
        longer[0].path.push('p');
        for (entries, field) in [(over, "entries"), (longer, "batch paths")] {
            let msg = Message::Request {
                id: 1,
                body: Request::SetMeta {
                    share: "s".into(),
                    entries,
                },
            };
            assert!(matches!(
                decode(&postcard::to_stdvec(&msg).unwrap()),
                Err(CodecError::Limit { field: f, .. }) if f == field
            ));
        }
        let answers = Message::Response {
            id: 1,
            body: Response::MetaSet {
                results: vec![None; META_BATCH_MAX + 1],
            },
        };
        assert!(matches!(
            decode(&postcard::to_stdvec(&answers).unwrap()),
            Err(CodecError::Limit {
                field: "results",
                ..
            })
        ));
        let owners = Message::Response {
            id: 1,
            body: Response::DirMeta {
                dir: Owner::default(),
                entries: vec![],
                owners: vec![Owner::default(); MAX_DIR_PAGE_ENTRIES + 1],
                next: None,
            },
        };
        assert!(matches!(
            decode(&postcard::to_stdvec(&owners).unwrap()),
            Err(CodecError::Limit {
                field: "owners",
                ..
            })
        ));
    }

    #[test]
    fn the_longest_xattr_set_fits_a_server_request_frame_and_more_is_refused() {
        let set = |name: usize, value: usize| Message::Request {
            id: u64::MAX,
            body: Request::XattrSet {
                share: "s".repeat(MAX_NAME_BYTES),
                path: "p".repeat(MAX_PATH_BYTES),
                name: vec![b'n'; name],
                value: vec![7; value],
                mode: XattrSetMode::Replace,
            },
        };
        let full = set(XATTR_NAME_MAX, XATTR_SIZE_MAX);
        let bytes = encode(&full).unwrap();
        assert!(
            bytes.len() < MAX_SERVER_REQUEST_FRAME_BYTES,
            "{}",
            bytes.len()
        );
        assert_eq!(decode(&bytes).unwrap(), full);
        for (name, value) in [(XATTR_NAME_MAX + 1, 0), (1, XATTR_SIZE_MAX + 1)] {
            let bytes = encode(&set(name, value)).unwrap();
            assert!(matches!(decode(&bytes), Err(CodecError::Limit { .. })));
        }
        let names = |n: usize| Message::Response {
            id: 1,
            body: Response::XattrNames {
                names: vec![vec![b'n'; XATTR_NAME_MAX]; n],
            },
        };
        let fit = XATTR_LIST_MAX / (XATTR_NAME_MAX + 1);
        assert!(decode(&encode(&names(fit)).unwrap()).is_ok());
        let over = encode(&names(fit + 1)).unwrap();
        assert!(matches!(decode(&over), Err(CodecError::Limit { .. })));
    }
}
