//! Property tests of the control-message codec (`docs/protocol.md` section 2):
//!
//! - every [`Message`] within the protocol limits round-trips through
//!   [`codec::encode`] and [`codec::decode`] exactly;
//! - a message with one field over its limit fails [`codec::validate`] and
//!   [`codec::decode`] with [`CodecError::Limit`] naming that field;
//! - every strict prefix of a valid encoding fails with [`CodecError::Truncated`], and
//!   extra bytes after one with [`CodecError::TrailingBytes`];
//! - arbitrary bytes decode to a message or a typed error, never a panic, and whatever
//!   decodes encodes back to an equal message (postcard accepts over-long varints, so
//!   not always to the same bytes).
//!
//! The generators cover every variant: the exhaustive matches in [`request_variant`]
//! and [`response_variant`] stop compiling when a variant is appended, as a reminder
//! to extend them.

use ferry_common::codec::{self, CodecError, MAX_CTRL_FRAME_BYTES};
use ferry_common::msg::*;
use proptest::collection::vec;
use proptest::prelude::*;

/// A string of at most `max_bytes` UTF-8 bytes: mostly short ASCII path-like text,
/// sometimes any Unicode, sometimes exactly at the limit.
fn capabilities() -> BoxedStrategy<Vec<Capability>> {
    vec(
        (
            text(MAX_CAPABILITY_NAME_BYTES),
            text(MAX_CAPABILITY_VALUE_BYTES),
        )
            .prop_map(|(name, value)| Capability { name, value }),
        0..4,
    )
    .boxed()
}

fn text(max_bytes: usize) -> BoxedStrategy<String> {
    let ascii = vec(prop_oneof![Just(b'/'), Just(b'.'), b'a'..=b'z'], 0..=16)
        .prop_map(|c| c.into_iter().map(char::from).collect::<String>());
    let any_unicode = vec(any::<char>(), 0..=32).prop_map(|c| c.into_iter().collect::<String>());
    let at_limit = Just("x".repeat(max_bytes));
    prop_oneof![6 => ascii, 3 => any_unicode, 1 => at_limit]
        .prop_map(move |s| cut_to(s, max_bytes))
        .boxed()
}

/// `s` cut to at most `max` bytes on a character boundary.
fn cut_to(mut s: String, max: usize) -> String {
    let mut cut = s.len().min(max);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s
}

fn timestamp() -> impl Strategy<Value = Timestamp> {
    (any::<i64>(), any::<u32>()).prop_map(|(secs, nanos)| Timestamp { secs, nanos })
}

fn region() -> impl Strategy<Value = RegionDesc> {
    (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(addr, len, rkey)| RegionDesc {
        addr,
        len,
        rkey,
    })
}

fn hashes(max: usize) -> impl Strategy<Value = Vec<Hash256>> {
    vec(any::<[u8; 32]>(), 0..=max)
}

fn file_kind() -> impl Strategy<Value = FileKind> {
    prop_oneof![
        Just(FileKind::File),
        Just(FileKind::Dir),
        Just(FileKind::Symlink),
        Just(FileKind::Other),
        (node_kind(), any::<u64>()).prop_map(|(kind, rdev)| FileKind::Node { kind, rdev }),
    ]
}

fn attr() -> impl Strategy<Value = Attr> {
    (
        (file_kind(), any::<u64>(), any::<u32>(), timestamp()),
        proptest::option::of(text(MAX_PATH_BYTES)),
        (any::<u64>(), any::<u32>(), timestamp(), timestamp()),
        (any::<u64>(), any::<u64>()),
    )
        .prop_map(
            |(
                (kind, size, mode, mtime),
                symlink_target,
                (ino, nlink, atime, ctime),
                (blocks, dev),
            )| {
                Attr {
                    kind,
                    size,
                    mode,
                    mtime,
                    symlink_target,
                    ino,
                    nlink,
                    atime,
                    ctime,
                    blocks,
                    dev,
                }
            },
        )
}

const ERROR_KINDS: [ErrorKind; 25] = [
    ErrorKind::NotFound,
    ErrorKind::NoSuchShare,
    ErrorKind::PermissionDenied,
    ErrorKind::OutsideShare,
    ErrorKind::ReadOnly,
    ErrorKind::NoSpace,
    ErrorKind::NotADirectory,
    ErrorKind::IsADirectory,
    ErrorKind::InvalidPath,
    ErrorKind::Exists,
    ErrorKind::Integrity,
    ErrorKind::Protocol,
    ErrorKind::Changed,
    ErrorKind::Io,
    ErrorKind::Busy,
    ErrorKind::AuthRequired,
    ErrorKind::AuthFailed,
    ErrorKind::TooManyLinks,
    ErrorKind::NotEmpty,
    ErrorKind::QuotaExceeded,
    ErrorKind::Unsupported,
    ErrorKind::FileTooBig,
    ErrorKind::Invalid,
    ErrorKind::NoAttribute,
    ErrorKind::AttributeTooBig,
];

fn remote_error() -> impl Strategy<Value = RemoteError> {
    (
        proptest::sample::select(&ERROR_KINDS[..]),
        text(MAX_ERROR_MESSAGE_BYTES),
    )
        .prop_map(|(kind, message)| RemoteError { kind, message })
}

fn share_path() -> impl Strategy<Value = (String, String)> {
    (text(MAX_NAME_BYTES), text(MAX_PATH_BYTES))
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (share_path(), any::<bool>()).prop_map(|((share, path), follow)| Request::Stat {
            share,
            path,
            follow
        }),
        (share_path(), any::<u64>()).prop_map(|((share, path), cursor)| Request::ListDir {
            share,
            path,
            cursor
        }),
        (share_path(), any::<u32>(), any::<bool>()).prop_map(|((share, path), mode, exist_ok)| {
            Request::Mkdir {
                share,
                path,
                mode,
                exist_ok,
            }
        }),
        (share_path(), text(MAX_PATH_BYTES)).prop_map(|((share, path), target)| Request::Symlink {
            share,
            path,
            target
        }),
        (
            share_path(),
            proptest::option::of(any::<u32>()),
            proptest::option::of(timestamp())
        )
            .prop_map(|((share, path), mode, mtime)| Request::SetAttr {
                share,
                path,
                mode,
                mtime
            }),
        (share_path(), any::<u64>(), any::<u32>(), timestamp()).prop_map(
            |((share, path), size, mode, mtime)| Request::UploadOpen {
                share,
                path,
                size,
                mode,
                mtime,
            }
        ),
        (
            any::<u64>(),
            any::<u64>(),
            region(),
            hashes(MAX_WINDOW_CHUNKS)
        )
            .prop_map(|(transfer, offset, region, hashes)| Request::UploadWindow {
                transfer,
                offset,
                region,
                hashes,
            }),
        (any::<u64>(), any::<[u8; 32]>())
            .prop_map(|(transfer, manifest)| Request::UploadCommit { transfer, manifest }),
        share_path().prop_map(|(share, path)| Request::DownloadOpen { share, path }),
        (any::<u64>(), any::<u64>(), region(), any::<bool>()).prop_map(
            |(transfer, offset, region, verify)| {
                Request::DownloadWindow {
                    transfer,
                    offset,
                    region,
                    verify,
                }
            }
        ),
        any::<u64>().prop_map(|transfer| Request::Close { transfer }),
        (share_path(), any::<u32>()).prop_map(|((share, path), chunk_bytes)| Request::MapOpen {
            share,
            path,
            chunk_bytes
        }),
        any::<u64>().prop_map(|handle| Request::MapRelease { handle }),
        text(MAX_NAME_BYTES).prop_map(|share| Request::StatFs { share }),
        Just(Request::Stats),
        (text(MAX_NAME_BYTES), any::<[u8; 32]>())
            .prop_map(|(share, proof)| Request::Auth { share, proof }),
        (share_path(), text(MAX_PATH_BYTES)).prop_map(|((share, from), to)| Request::Link {
            share,
            from,
            to
        }),
        (share_path(), text(MAX_PATH_BYTES)).prop_map(|((share, from), to)| Request::Rename {
            share,
            from,
            to
        }),
        (share_path(), any::<u32>(), any::<u64>()).prop_map(
            |((share, path), chunk_bytes, first_chunk)| Request::Manifest {
                share,
                path,
                chunk_bytes,
                first_chunk
            }
        ),
        (
            share_path(),
            any::<u64>(),
            any::<u32>(),
            timestamp(),
            text(MAX_PATH_BYTES)
        )
            .prop_map(|((share, path), size, mode, mtime, base)| {
                Request::UploadOpenBase {
                    share,
                    path,
                    size,
                    mode,
                    mtime,
                    base,
                }
            }),
        (share_path(), any::<bool>()).prop_map(|((share, path), recursive)| Request::Remove {
            share,
            path,
            recursive
        }),
        share_path().prop_map(|(share, path)| Request::DiskUsage { share, path }),
        share_path().prop_map(|(share, path)| Request::Verify { share, path }),
        (
            text(MAX_NAME_BYTES),
            region(),
            algorithm(),
            vec(batch_file(), 0..=8)
        )
            .prop_map(|(share, region, algorithm, files)| Request::UploadBatch {
                share,
                region,
                algorithm,
                files
            }),
        (
            text(MAX_NAME_BYTES),
            vec(text(MAX_PATH_BYTES), 0..=8),
            region()
        )
            .prop_map(|(share, paths, region)| Request::DownloadBatch {
                share,
                paths,
                region
            }),
        (
            text(MAX_NAME_BYTES),
            vec((text(MAX_PATH_BYTES), text(MAX_PATH_BYTES)), 0..8)
        )
            .prop_map(|(share, links)| Request::LinkBatch { share, links }),
        (text(MAX_NAME_BYTES), vec(meta_entry(), 0..=8))
            .prop_map(|(share, entries)| Request::SetMeta { share, entries }),
        (share_path(), any::<u64>()).prop_map(|((share, path), cursor)| {
            Request::ListDirMeta {
                share,
                path,
                cursor,
            }
        }),
        text(MAX_NAME_BYTES).prop_map(|share| Request::ShareInfo { share }),
        (
            share_path(),
            proptest::option::of(any::<u32>()),
            any::<(bool, bool)>()
        )
            .prop_map(
                |((share, path), create, (exclusive, truncate))| Request::FileOpen {
                    share,
                    path,
                    create,
                    exclusive,
                    truncate,
                }
            ),
        (
            any::<u64>(),
            region(),
            algorithm(),
            vec((any::<u64>(), any::<u32>(), any::<[u8; 32]>()), 0..=16)
        )
            .prop_map(|(handle, region, algorithm, ext)| {
                let (extents, hashes) = ext
                    .into_iter()
                    .map(|(offset, len, h)| (Extent { offset, len }, h))
                    .unzip();
                Request::FileWrite {
                    handle,
                    region,
                    algorithm,
                    extents,
                    hashes,
                }
            }),
        (any::<u64>(), any::<u64>(), region()).prop_map(|(handle, offset, region)| {
            Request::FileRead {
                handle,
                offset,
                region,
            }
        }),
        (any::<u64>(), set_attrs())
            .prop_map(|(handle, attrs)| Request::FileSetAttr { handle, attrs }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<bool>()).prop_map(
            |(handle, offset, len, keep_size)| Request::FileAllocate {
                handle,
                offset,
                len,
                keep_size,
            }
        ),
        (any::<u64>(), any::<bool>())
            .prop_map(|(handle, data_only)| Request::FileSync { handle, data_only }),
        any::<u64>().prop_map(|handle| Request::FileClose { handle }),
        (share_path(), text(MAX_PATH_BYTES), any::<bool>()).prop_map(
            |((share, from), to, no_replace)| Request::Move {
                share,
                from,
                to,
                no_replace,
            }
        ),
        (share_path(), set_attrs()).prop_map(|((share, path), attrs)| Request::SetAttrs {
            share,
            path,
            attrs
        }),
        text(MAX_NAME_BYTES).prop_map(|share| Request::ShareAccess { share }),
        Just(Request::Counters),
        any::<u64>().prop_map(|handle| Request::FileDiscard { handle }),
        any::<u64>().prop_map(|handle| Request::FileCommit { handle }),
        (share_path(), any::<bool>()).prop_map(|((share, path), follow)| Request::StatMeta {
            share,
            path,
            follow
        }),
        (
            share_path(),
            text(MAX_PATH_BYTES),
            any::<u64>(),
            any::<[u8; 32]>()
        )
            .prop_map(|((share, path), from, size, manifest)| Request::Replicate {
                share,
                path,
                from,
                size,
                manifest
            }),
        (
            text(MAX_NAME_BYTES),
            vec(
                (text(MAX_PATH_BYTES), any::<u32>()).prop_map(|(path, mode)| NewDir { path, mode }),
                0..=8
            )
        )
            .prop_map(|(share, dirs)| Request::MakeDirs { share, dirs }),
        (text(MAX_NAME_BYTES), vec(attr_entry(), 0..=8))
            .prop_map(|(share, entries)| Request::SetAttrBatch { share, entries }),
        (
            (any::<u64>(), region(), algorithm()),
            vec((any::<u64>(), any::<u32>(), any::<[u8; 32]>()), 0..=16),
            set_attrs(),
            any::<bool>()
        )
            .prop_map(|((handle, region, algorithm), ext, attrs, commit)| {
                let (extents, hashes) = ext
                    .into_iter()
                    .map(|(offset, len, h)| (Extent { offset, len }, h))
                    .unzip();
                Request::FileFinish {
                    handle,
                    region,
                    algorithm,
                    extents,
                    hashes,
                    attrs,
                    commit,
                }
            }),
        (
            (share_path(), any::<u32>(), any::<bool>()),
            (region(), algorithm()),
            vec((any::<u64>(), any::<u32>(), any::<[u8; 32]>()), 0..=16),
            set_attrs()
        )
            .prop_map(
                |(((share, path), mode, exclusive), (region, algorithm), ext, attrs)| {
                    let (extents, hashes) = ext
                        .into_iter()
                        .map(|(offset, len, h)| (Extent { offset, len }, h))
                        .unzip();
                    Request::FilePut {
                        share,
                        path,
                        mode,
                        exclusive,
                        region,
                        algorithm,
                        extents,
                        hashes,
                        attrs,
                    }
                }
            ),
        (
            share_path(),
            any::<u64>(),
            lock_kind(),
            any::<(u64, u64, u32)>()
        )
            .prop_map(
                |((share, path), owner, kind, (start, end, pid))| Request::Lock {
                    share,
                    path,
                    owner,
                    kind,
                    start,
                    end,
                    pid,
                }
            ),
        (share_path(), any::<u64>(), lock_kind(), any::<(u64, u64)>()).prop_map(
            |((share, path), owner, kind, (start, end))| Request::LockTest {
                share,
                path,
                owner,
                kind,
                start,
                end,
            }
        ),
        (text(MAX_NAME_BYTES), any::<(u64, u64, u64)>()).prop_map(|(share, (dev, ino, owner))| {
            Request::LockRelease {
                share,
                file: LockFile { dev, ino },
                owner,
            }
        }),
        (share_path(), xattr_name()).prop_map(|((share, path), name)| Request::XattrGet {
            share,
            path,
            name
        }),
        share_path().prop_map(|(share, path)| Request::XattrList { share, path }),
        (share_path(), xattr_name(), xattr_value(), xattr_mode()).prop_map(
            |((share, path), name, value, mode)| Request::XattrSet {
                share,
                path,
                name,
                value,
                mode
            }
        ),
        (any::<[u64; 3]>(), fallocate_mode()).prop_map(|([handle, offset, len], mode)| {
            Request::FileFallocate {
                handle,
                offset,
                len,
                mode,
            }
        }),
        (share_path(), xattr_name()).prop_map(|((share, path), name)| Request::XattrRemove {
            share,
            path,
            name
        }),
        (share_path(), node_kind(), any::<u32>(), any::<u64>()).prop_map(
            |((share, path), kind, mode, rdev)| Request::MakeNode {
                share,
                path,
                kind,
                mode,
                rdev,
            }
        ),
        (share_path(), time_set(), time_set()).prop_map(|((share, path), atime, mtime)| {
            Request::SetTimes {
                share,
                path,
                atime,
                mtime,
            }
        }),
        (
            any::<u32>(),
            any::<u32>(),
            vec(any::<u32>(), 0..=32),
            share_path(),
            any::<bool>()
        )
            .prop_map(|(uid, gid, groups, (share, path), follow)| {
                Request::AsCaller {
                    caller: Caller { uid, gid, groups },
                    request: Box::new(Request::Stat {
                        share,
                        path,
                        follow,
                    }),
                }
            }),
    ]
}

fn lock_kind() -> impl Strategy<Value = LockKind> {
    prop_oneof![
        Just(LockKind::Read),
        Just(LockKind::Write),
        Just(LockKind::Unlock)
    ]
}

/// An extended attribute name of up to `XATTR_NAME_MAX` bytes.
fn xattr_name() -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..=XATTR_NAME_MAX)
}

/// An extended attribute value (values at the limit: see the limit tests).
fn xattr_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => vec(any::<u8>(), 0..=64),
        1 => vec(any::<u8>(), XATTR_SIZE_MAX..=XATTR_SIZE_MAX),
    ]
}

fn fallocate_mode() -> impl Strategy<Value = FallocMode> {
    prop_oneof![
        Just(FallocMode::PunchHole),
        any::<bool>().prop_map(|keep_size| FallocMode::ZeroRange { keep_size }),
    ]
}

fn xattr_mode() -> impl Strategy<Value = XattrSetMode> {
    prop_oneof![
        Just(XattrSetMode::Any),
        Just(XattrSetMode::Create),
        Just(XattrSetMode::Replace)
    ]
}

fn node_kind() -> impl Strategy<Value = NodeKind> {
    prop_oneof![
        Just(NodeKind::Fifo),
        Just(NodeKind::Socket),
        Just(NodeKind::Char),
        Just(NodeKind::Block),
    ]
}

fn time_set() -> impl Strategy<Value = TimeSet> {
    prop_oneof![
        Just(TimeSet::Omit),
        Just(TimeSet::Now),
        timestamp().prop_map(TimeSet::At),
    ]
}

fn attr_entry() -> impl Strategy<Value = AttrEntry> {
    (
        text(MAX_PATH_BYTES),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(timestamp()),
    )
        .prop_map(|(path, mode, uid, gid, mtime)| AttrEntry {
            path,
            mode,
            uid,
            gid,
            mtime,
        })
}

fn set_attrs() -> impl Strategy<Value = SetAttrs> {
    (
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(timestamp()),
        proptest::option::of(timestamp()),
    )
        .prop_map(|(size, mode, uid, gid, atime, mtime)| SetAttrs {
            size,
            mode,
            uid,
            gid,
            atime,
            mtime,
        })
}

/// Eight of these stay within the path budget (8 x 4096 bytes).
fn meta_entry() -> impl Strategy<Value = MetaEntry> {
    (
        text(MAX_PATH_BYTES),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(timestamp()),
    )
        .prop_map(|(path, uid, gid, mtime)| MetaEntry {
            path,
            uid,
            gid,
            mtime,
        })
}

fn owner() -> impl Strategy<Value = Owner> {
    (any::<u32>(), any::<u32>()).prop_map(|(uid, gid)| Owner { uid, gid })
}

/// Eight of these stay within the batch's path budget (8 x 4096 bytes).
fn batch_file() -> impl Strategy<Value = BatchFile> {
    (
        text(MAX_PATH_BYTES),
        any::<u64>(),
        any::<u32>(),
        timestamp(),
        any::<[u8; 32]>(),
    )
        .prop_map(|(path, size, mode, mtime, hash)| BatchFile {
            path,
            size,
            mode,
            mtime,
            hash,
        })
}

fn batched_file() -> impl Strategy<Value = BatchedFile> {
    prop_oneof![
        (attr(), any::<u64>(), any::<[u8; 32]>(), algorithm()).prop_map(
            |(attr, offset, hash, algorithm)| BatchedFile::Ok {
                attr,
                offset,
                hash,
                algorithm
            }
        ),
        remote_error().prop_map(BatchedFile::Err),
        Just(BatchedFile::NotIncluded),
    ]
}

fn dir_entry() -> impl Strategy<Value = DirEntry> {
    (text(MAX_NAME_BYTES), attr()).prop_map(|(name, attr)| DirEntry { name, attr })
}

fn file_version() -> impl Strategy<Value = FileVersion> {
    (
        any::<u64>(),
        timestamp(),
        timestamp(),
        any::<u64>(),
        any::<u32>(),
        any::<[u8; 32]>(),
        algorithm(),
    )
        .prop_map(
            |(size, mtime, ctime, ino, chunk_bytes, manifest, algorithm)| FileVersion {
                size,
                mtime,
                ctime,
                ino,
                chunk_bytes,
                manifest,
                algorithm,
            },
        )
}

fn algorithm() -> impl Strategy<Value = HashAlgorithm> {
    prop_oneof![Just(HashAlgorithm::Sha256), Just(HashAlgorithm::Blake3)]
}

fn mapped_file() -> impl Strategy<Value = MappedFile> {
    (
        any::<u64>(),
        attr(),
        file_version(),
        any::<u64>(),
        // Up to the limit would be slow to generate; the limit itself is tested below.
        vec(region(), 0..=32),
        proptest::option::of(region()),
    )
        .prop_map(
            |(handle, attr, version, window_bytes, regions, manifest)| MappedFile {
                handle,
                attr,
                version,
                window_bytes,
                regions,
                manifest,
            },
        )
}

fn fs_stat() -> impl Strategy<Value = FsStat> {
    (any::<u32>(), any::<[u64; 5]>(), any::<u32>()).prop_map(
        |(block_size, [blocks, blocks_free, blocks_avail, files, files_free], name_max)| FsStat {
            block_size,
            blocks,
            blocks_free,
            blocks_avail,
            files,
            files_free,
            name_max,
        },
    )
}

fn server_stats() -> impl Strategy<Value = ServerStats> {
    any::<[u64; 6]>().prop_map(
        |[requests, connections, mapped_files, mapped_bytes, registrations, open_transfers]| {
            ServerStats {
                requests,
                connections,
                mapped_files,
                mapped_bytes,
                registrations,
                open_transfers,
            }
        },
    )
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        Just(Response::Ok),
        attr().prop_map(Response::Attr),
        // Pages of up to the limit would be slow to generate; see the limit tests.
        (vec(dir_entry(), 0..=8), proptest::option::of(any::<u64>()))
            .prop_map(|(entries, next)| Response::Dir { entries, next }),
        (any::<u64>(), algorithm()).prop_map(|(transfer, algorithm)| Response::UploadOpened {
            transfer,
            algorithm
        }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(bytes, reused)| Response::WindowPulled { bytes, reused }),
        any::<u64>().prop_map(|size| Response::Committed { size }),
        (any::<u64>(), attr(), algorithm()).prop_map(|(transfer, attr, algorithm)| {
            Response::DownloadOpened {
                transfer,
                attr,
                algorithm,
            }
        }),
        hashes(MAX_WINDOW_CHUNKS).prop_map(|hashes| Response::WindowPushed { hashes }),
        remote_error().prop_map(Response::Error),
        mapped_file().prop_map(|m| Response::Mapped(Box::new(m))),
        fs_stat().prop_map(Response::FsStat),
        server_stats().prop_map(Response::Stats),
        proptest::option::of(any::<[u8; 32]>()).prop_map(|proof| Response::Authenticated { proof }),
        (
            file_version(),
            any::<u64>(),
            hashes(MAX_MANIFEST_PAGE_CHUNKS)
        )
            .prop_map(|(version, first_chunk, hashes)| Response::Manifest {
                version,
                first_chunk,
                hashes
            }),
        any::<[u64; 4]>().prop_map(|[files, dirs, bytes, unique_bytes]| {
            Response::DiskUsage(DiskUsage {
                files,
                dirs,
                bytes,
                unique_bytes,
            })
        }),
        verify_report().prop_map(Response::Verified),
        vec(proptest::option::of(remote_error()), 0..=8)
            .prop_map(|results| Response::UploadedBatch { results }),
        vec(batched_file(), 0..=8).prop_map(|files| Response::DownloadedBatch { files }),
        vec(proptest::option::of(remote_error()), 0..8)
            .prop_map(|results| Response::LinkedBatch { results }),
        vec(proptest::option::of(remote_error()), 0..=8)
            .prop_map(|results| Response::MetaSet { results }),
        (
            owner(),
            vec((dir_entry(), owner()), 0..=8),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(dir, page, next)| {
                let (entries, owners) = page.into_iter().unzip();
                Response::DirMeta {
                    dir,
                    entries,
                    owners,
                    next,
                }
            }),
        algorithm().prop_map(|algorithm| Response::ShareInfo { algorithm }),
        (any::<u64>(), attr(), any::<bool>()).prop_map(|(handle, attr, staged)| {
            Response::FileOpened {
                handle,
                attr,
                staged,
            }
        }),
        any::<u64>().prop_map(|size| Response::FileWritten { size }),
        (any::<u64>(), algorithm(), hashes(MAX_WINDOW_CHUNKS)).prop_map(
            |(len, algorithm, hashes)| Response::FileData {
                len,
                algorithm,
                hashes,
            }
        ),
        any::<bool>().prop_map(|writable| Response::ShareAccess { writable }),
        any::<[u64; 5]>().prop_map(|c| Response::Counters(Counters {
            read_bytes: c[0],
            write_bytes: c[1],
            ctrl_received_bytes: c[2],
            ctrl_sent_bytes: c[3],
            file_written_bytes: c[4],
        })),
        (attr(), owner()).prop_map(|(attr, owner)| Response::AttrMeta { attr, owner }),
        (
            any::<(u64, u64)>(),
            proptest::option::of((lock_kind(), any::<(u64, u64, u32)>()))
        )
            .prop_map(|((dev, ino), held)| Response::Lock {
                file: LockFile { dev, ino },
                conflict: held.map(|(kind, (start, end, pid))| LockHeld {
                    kind,
                    start,
                    end,
                    pid,
                }),
            }),
        xattr_value().prop_map(|value| Response::XattrValue { value }),
        vec(vec(1u8..=255, 1..=32), 0..=64).prop_map(|names| Response::XattrNames { names }),
    ]
}

fn verify_report() -> impl Strategy<Value = VerifyReport> {
    let record = prop_oneof![
        Just(VerifyRecord::Missing),
        Just(VerifyRecord::Current),
        (any::<bool>(), any::<bool>()).prop_map(|(size_changed, mtime_changed)| {
            VerifyRecord::Stale {
                size_changed,
                mtime_changed,
            }
        }),
    ];
    (
        record,
        any::<(u64, u32, u64, u64)>(),
        // Lists at the limit are slow to generate; see the limit tests.
        vec(any::<u64>(), 0..=64),
        algorithm(),
    )
        .prop_map(
            |(record, (size, chunk_bytes, chunks, bad_count), bad_chunks, algorithm)| {
                VerifyReport {
                    record,
                    algorithm,
                    size,
                    chunk_bytes,
                    chunks,
                    bad_count,
                    bad_chunks,
                }
            },
        )
}

/// Any message within the protocol limits.
fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        1 => (
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<u16>(),
            text(MAX_NAME_BYTES),
            any::<[u8; 32]>(),
            capabilities()
        )
            .prop_map(|(magic, min_version, max_version, software, nonce, capabilities)| {
                Message::Hello(Hello {
                    magic,
                    min_version,
                    max_version,
                    software,
                    nonce,
                    capabilities,
                })
            }),
        1 => (
            any::<u16>(),
            text(MAX_NAME_BYTES),
            any::<[u32; 3]>(),
            any::<[u8; 32]>(),
            capabilities()
        )
            .prop_map(
                |(
                    version,
                    software,
                    [chunk_bytes, max_window_chunks, max_inflight_requests],
                    nonce,
                    capabilities,
                )| {
                    Message::Welcome(Welcome {
                        version,
                        software,
                        chunk_bytes,
                        max_window_chunks,
                        max_inflight_requests,
                        nonce,
                        capabilities,
                    })
                }
            ),
        1 => remote_error().prop_map(Message::Refused),
        4 => (any::<u64>(), request()).prop_map(|(id, body)| Message::Request { id, body }),
        4 => (any::<u64>(), response()).prop_map(|(id, body)| Message::Response { id, body }),
    ]
}

/// Which request variant `r` is; exhaustive, so a new variant needs a generator.
fn request_variant(r: &Request) -> usize {
    match r {
        Request::Stat { .. } => 0,
        Request::ListDir { .. } => 1,
        Request::Mkdir { .. } => 2,
        Request::Symlink { .. } => 3,
        Request::SetAttr { .. } => 4,
        Request::UploadOpen { .. } => 5,
        Request::UploadWindow { .. } => 6,
        Request::UploadCommit { .. } => 7,
        Request::DownloadOpen { .. } => 8,
        Request::DownloadWindow { .. } => 9,
        Request::Close { .. } => 10,
        Request::MapOpen { .. } => 11,
        Request::MapRelease { .. } => 12,
        Request::StatFs { .. } => 13,
        Request::Stats => 14,
        Request::Auth { .. } => 15,
        Request::Link { .. } => 16,
        Request::Rename { .. } => 17,
        Request::Manifest { .. } => 18,
        Request::UploadOpenBase { .. } => 19,
        Request::Remove { .. } => 20,
        Request::DiskUsage { .. } => 21,
        Request::Verify { .. } => 22,
        Request::UploadBatch { .. } => 23,
        Request::DownloadBatch { .. } => 24,
        Request::LinkBatch { .. } => 25,
        Request::SetMeta { .. } => 26,
        Request::ListDirMeta { .. } => 27,
        Request::ShareInfo { .. } => 28,
        Request::FileOpen { .. } => 29,
        Request::FileWrite { .. } => 30,
        Request::FileRead { .. } => 31,
        Request::FileSetAttr { .. } => 32,
        Request::FileAllocate { .. } => 33,
        Request::FileSync { .. } => 34,
        Request::FileClose { .. } => 35,
        Request::Move { .. } => 36,
        Request::SetAttrs { .. } => 37,
        Request::ShareAccess { .. } => 38,
        Request::Counters => 39,
        Request::FileDiscard { .. } => 40,
        Request::StatMeta { .. } => 41,
        Request::FileCommit { .. } => 42,
        Request::Replicate { .. } => 43,
        Request::MakeDirs { .. } => 44,
        Request::SetAttrBatch { .. } => 45,
        Request::FileFinish { .. } => 46,
        Request::FilePut { .. } => 47,
        Request::Lock { .. } => 48,
        Request::LockTest { .. } => 49,
        Request::LockRelease { .. } => 50,
        Request::XattrGet { .. } => 51,
        Request::XattrList { .. } => 52,
        Request::XattrSet { .. } => 53,
        Request::XattrRemove { .. } => 54,
        Request::FileFallocate { .. } => 55,
        Request::AsCaller { .. } => 56,
        Request::MakeNode { .. } => 57,
        Request::SetTimes { .. } => 58,
    }
}

/// Which response variant `r` is; exhaustive, so a new variant needs a generator.
fn response_variant(r: &Response) -> usize {
    match r {
        Response::Ok => 0,
        Response::Attr(_) => 1,
        Response::Dir { .. } => 2,
        Response::UploadOpened { .. } => 3,
        Response::WindowPulled { .. } => 4,
        Response::Committed { .. } => 5,
        Response::DownloadOpened { .. } => 6,
        Response::WindowPushed { .. } => 7,
        Response::Error(_) => 8,
        Response::Mapped(_) => 9,
        Response::FsStat(_) => 10,
        Response::Stats(_) => 11,
        Response::Authenticated { .. } => 12,
        Response::Manifest { .. } => 13,
        Response::DiskUsage(_) => 14,
        Response::Verified(_) => 15,
        Response::UploadedBatch { .. } => 16,
        Response::DownloadedBatch { .. } => 17,
        Response::LinkedBatch { .. } => 18,
        Response::MetaSet { .. } => 19,
        Response::DirMeta { .. } => 20,
        Response::ShareInfo { .. } => 21,
        Response::FileOpened { .. } => 22,
        Response::FileWritten { .. } => 23,
        Response::FileData { .. } => 24,
        Response::ShareAccess { .. } => 25,
        Response::Counters(_) => 26,
        Response::AttrMeta { .. } => 27,
        Response::Lock { .. } => 28,
        Response::XattrValue { .. } => 29,
        Response::XattrNames { .. } => 30,
    }
}

/// The first byte of a request or response body is its variant index (all are below
/// 128, so one varint byte).
fn body_index(bytes: &[u8]) -> usize {
    // Message::Request / Response: variant byte, id varint, then the body's index.
    let id_len = bytes[1..].iter().position(|b| b & 0x80 == 0).unwrap() + 1;
    usize::from(bytes[1 + id_len])
}

/// A message with exactly one field over its limit, and that field's name.
fn over_limit() -> impl Strategy<Value = (Message, &'static str)> {
    let long = |max: usize| (1..=64usize).prop_map(move |extra| "y".repeat(max + extra));
    let req = |body: Request| Message::Request { id: 1, body };
    let resp = |body: Response| Message::Response { id: 1, body };
    let base_attr = || Attr {
        kind: FileKind::Symlink,
        size: 0,
        mode: 0,
        mtime: Timestamp::default(),
        symlink_target: None,
        ino: 0,
        nlink: 0,
        atime: Timestamp::default(),
        ctime: Timestamp::default(),
        blocks: 0,
        dev: 0,
    };
    prop_oneof![
        long(MAX_NAME_BYTES).prop_map(|software| (
            Message::Hello(Hello {
                magic: HELLO_MAGIC,
                min_version: 1,
                max_version: 2,
                software,
                nonce: [0; 32],
                capabilities: vec![],
            }),
            "software"
        )),
        long(MAX_NAME_BYTES).prop_map(|software| (
            Message::Welcome(Welcome {
                version: 2,
                software,
                chunk_bytes: 1,
                max_window_chunks: 1,
                max_inflight_requests: 1,
                nonce: [0; 32],
                capabilities: vec![],
            }),
            "software"
        )),
        long(MAX_ERROR_MESSAGE_BYTES).prop_map(|message| (
            Message::Refused(RemoteError {
                kind: ErrorKind::Protocol,
                message,
            }),
            "message"
        )),
        long(MAX_NAME_BYTES).prop_map(move |share| (
            req(Request::Stat {
                share,
                path: "p".into(),
                follow: false,
            }),
            "share"
        )),
        long(MAX_PATH_BYTES).prop_map(move |path| (
            req(Request::ListDir {
                share: "s".into(),
                path,
                cursor: 0,
            }),
            "path"
        )),
        long(MAX_PATH_BYTES).prop_map(move |target| (
            req(Request::Symlink {
                share: "s".into(),
                path: "p".into(),
                target,
            }),
            "target"
        )),
        long(MAX_NAME_BYTES).prop_map(move |share| (req(Request::StatFs { share }), "share")),
        (MAX_WINDOW_CHUNKS + 1..=MAX_WINDOW_CHUNKS + 8).prop_map(move |n| (
            req(Request::UploadWindow {
                transfer: 1,
                offset: 0,
                region: RegionDesc {
                    addr: 0,
                    len: 0,
                    rkey: 0,
                },
                hashes: vec![[7; 32]; n],
            }),
            "hashes"
        )),
        long(MAX_PATH_BYTES).prop_map(move |t| (
            resp(Response::Attr(Attr {
                symlink_target: Some(t),
                ..base_attr()
            })),
            "symlink_target"
        )),
        long(MAX_NAME_BYTES).prop_map(move |name| (
            resp(Response::Dir {
                entries: vec![DirEntry {
                    name,
                    attr: base_attr(),
                }],
                next: None,
            }),
            "name"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::Dir {
                entries: vec![
                    DirEntry {
                        name: "n".into(),
                        attr: base_attr(),
                    };
                    MAX_DIR_PAGE_ENTRIES + extra
                ],
                next: None,
            }),
            "entries"
        )),
        (MAX_WINDOW_CHUNKS + 1..=MAX_WINDOW_CHUNKS + 8).prop_map(move |n| (
            resp(Response::WindowPushed {
                hashes: vec![[1; 32]; n],
            }),
            "hashes"
        )),
        long(MAX_ERROR_MESSAGE_BYTES).prop_map(move |message| (
            resp(Response::Error(RemoteError {
                kind: ErrorKind::Io,
                message,
            })),
            "message"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::Mapped(Box::new(MappedFile {
                handle: 1,
                attr: base_attr(),
                version: FileVersion {
                    algorithm: HashAlgorithm::Blake3,
                    size: 0,
                    mtime: Timestamp::default(),
                    ctime: Timestamp::default(),
                    ino: 0,
                    chunk_bytes: 4096,
                    manifest: [0; 32],
                },
                window_bytes: MAP_WINDOW_BYTES,
                regions: vec![
                    RegionDesc {
                        addr: 0,
                        len: 0,
                        rkey: 0,
                    };
                    MAX_MAP_REGIONS + extra
                ],
                manifest: None,
            }))),
            "regions"
        )),
        long(MAX_PATH_BYTES).prop_map(move |path| (
            req(Request::Verify {
                share: "s".into(),
                path,
            }),
            "path"
        )),
        (1..=4usize).prop_map(move |extra| (
            req(Request::DownloadBatch {
                share: "s".into(),
                paths: vec!["p".into(); BATCH_MAX_FILES + extra],
                region: RegionDesc {
                    addr: 0,
                    len: 0,
                    rkey: 0,
                },
            }),
            "files"
        )),
        (1..=64usize).prop_map(move |extra| (
            req(Request::UploadBatch {
                algorithm: HashAlgorithm::Blake3,
                share: "s".into(),
                region: RegionDesc {
                    addr: 0,
                    len: 0,
                    rkey: 0,
                },
                files: (0..BATCH_MAX_PATH_BYTES / MAX_PATH_BYTES)
                    .map(|_| "p".repeat(MAX_PATH_BYTES))
                    .chain(["q".repeat(extra)])
                    .map(|path| BatchFile {
                        path,
                        size: 0,
                        mode: 0,
                        mtime: Timestamp::default(),
                        hash: [0; 32],
                    })
                    .collect(),
            }),
            "batch paths"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::UploadedBatch {
                results: vec![None; BATCH_MAX_FILES + extra],
            }),
            "results"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::DownloadedBatch {
                files: vec![BatchedFile::NotIncluded; BATCH_MAX_FILES + extra],
            }),
            "files"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::Verified(VerifyReport {
                algorithm: HashAlgorithm::Blake3,
                record: VerifyRecord::Current,
                size: 0,
                chunk_bytes: 4096,
                chunks: 0,
                bad_count: 0,
                bad_chunks: vec![0; MAX_VERIFY_BAD_CHUNKS + extra],
            })),
            "bad_chunks"
        )),
        (1..=4usize).prop_map(move |extra| (
            req(Request::LinkBatch {
                share: "s".into(),
                links: vec![("a".into(), "b".into()); LINK_BATCH_MAX + extra],
            }),
            "links"
        )),
        (long(MAX_PATH_BYTES), 0..LINK_BATCH_MAX).prop_map(move |(path, at)| {
            let mut links = vec![("a".to_string(), "b".to_string()); LINK_BATCH_MAX];
            links[at].1 = path;
            (
                req(Request::LinkBatch {
                    share: "s".into(),
                    links,
                }),
                "to",
            )
        }),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::LinkedBatch {
                results: vec![None; LINK_BATCH_MAX + extra],
            }),
            "results"
        )),
        (1..=4usize).prop_map(move |extra| (
            req(Request::SetMeta {
                share: "s".into(),
                entries: vec![
                    MetaEntry {
                        path: "a".into(),
                        uid: None,
                        gid: None,
                        mtime: None,
                    };
                    META_BATCH_MAX + extra
                ],
            }),
            "entries"
        )),
        (1..=4usize).prop_map(move |extra| (
            req(Request::MakeDirs {
                share: "s".into(),
                dirs: vec![
                    NewDir {
                        path: "a".into(),
                        mode: 0o755,
                    };
                    META_BATCH_MAX + extra
                ],
            }),
            "dirs"
        )),
        (1..=4usize).prop_map(move |extra| (
            req(Request::SetAttrBatch {
                share: "s".into(),
                entries: vec![
                    AttrEntry {
                        path: "a".into(),
                        mode: None,
                        uid: None,
                        gid: None,
                        mtime: None,
                    };
                    META_BATCH_MAX + extra
                ],
            }),
            "entries"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::MetaSet {
                results: vec![None; META_BATCH_MAX + extra],
            }),
            "results"
        )),
        (1..=4usize).prop_map(move |extra| (
            resp(Response::DirMeta {
                dir: Owner::default(),
                entries: vec![],
                owners: vec![Owner::default(); MAX_DIR_PAGE_ENTRIES + extra],
                next: None,
            }),
            "owners"
        )),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn messages_round_trip_exactly(m in message()) {
        codec::validate(&m).unwrap();
        let bytes = codec::encode(&m).unwrap();
        prop_assert!(bytes.len() <= MAX_CTRL_FRAME_BYTES);
        prop_assert_eq!(codec::decode(&bytes).unwrap(), m.clone());
        // The variant indices on the wire are the documented ones.
        match &m {
            Message::Request { body, .. } => {
                prop_assert_eq!(bytes[0], 3);
                prop_assert_eq!(body_index(&bytes), request_variant(body));
            }
            Message::Response { body, .. } => {
                prop_assert_eq!(bytes[0], 4);
                prop_assert_eq!(body_index(&bytes), response_variant(body));
            }
            Message::Hello(_) => prop_assert_eq!(bytes[0], 0),
            Message::Welcome(_) => prop_assert_eq!(bytes[0], 1),
            Message::Refused(_) => prop_assert_eq!(bytes[0], 2),
        }
    }

    #[test]
    fn every_prefix_is_truncated(m in message()) {
        let bytes = codec::encode(&m).unwrap();
        for cut in 0..bytes.len() {
            prop_assert_eq!(codec::decode(&bytes[..cut]), Err(CodecError::Truncated), "cut {}", cut);
        }
    }

    #[test]
    fn trailing_bytes_are_counted(m in message(), extra in vec(any::<u8>(), 1..16)) {
        let mut bytes = codec::encode(&m).unwrap();
        bytes.extend_from_slice(&extra);
        prop_assert_eq!(codec::decode(&bytes), Err(CodecError::TrailingBytes(extra.len())));
    }

    #[test]
    fn over_limit_fields_are_refused((m, field) in over_limit()) {
        let refused = |r: Result<_, CodecError>| matches!(
            r,
            Err(CodecError::Limit { field: f, len, max }) if f == field && len > max
        );
        prop_assert!(refused(codec::validate(&m)), "validate {:?}", codec::validate(&m));
        // The same bytes from a peer that does not check: refused by decode.
        let bytes = postcard::to_stdvec(&m).unwrap();
        prop_assert!(refused(codec::decode(&bytes).map(|_| ())));
    }

    #[test]
    fn arbitrary_bytes_decode_or_fail_typed(bytes in vec(any::<u8>(), 0..256)) {
        match codec::decode(&bytes) {
            Ok(m) => {
                // Not byte-exact: postcard also accepts over-long varints.
                let again = codec::encode(&m).unwrap();
                prop_assert!(again.len() <= bytes.len());
                prop_assert_eq!(codec::decode(&again).unwrap(), m);
            }
            Err(
                CodecError::Truncated
                | CodecError::TrailingBytes(_)
                | CodecError::Malformed(_)
                | CodecError::Limit { .. },
            ) => {}
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }
}

#[test]
fn lists_exactly_at_their_limits_round_trip() {
    let attr = Attr {
        kind: FileKind::Symlink,
        size: u64::MAX,
        mode: u32::MAX,
        mtime: Timestamp {
            secs: i64::MIN,
            nanos: u32::MAX,
        },
        symlink_target: Some("t".repeat(64)),
        ino: u64::MAX,
        nlink: u32::MAX,
        atime: Timestamp::default(),
        ctime: Timestamp::default(),
        blocks: u64::MAX,
        dev: u64::MAX,
    };
    let entries = (0..MAX_DIR_PAGE_ENTRIES)
        .map(|i| DirEntry {
            name: format!("{i:0>255}"),
            attr: attr.clone(),
        })
        .collect();
    let region = RegionDesc {
        addr: u64::MAX,
        len: u64::MAX,
        rkey: u32::MAX,
    };
    let at_limit = [
        Response::Dir {
            entries,
            next: Some(u64::MAX),
        },
        Response::WindowPushed {
            hashes: vec![[0xff; 32]; MAX_WINDOW_CHUNKS],
        },
        Response::Mapped(Box::new(MappedFile {
            handle: u64::MAX,
            attr: Attr {
                symlink_target: Some("p".repeat(MAX_PATH_BYTES)),
                ..attr
            },
            version: FileVersion {
                algorithm: HashAlgorithm::Blake3,
                size: u64::MAX,
                mtime: Timestamp::default(),
                ctime: Timestamp::default(),
                ino: u64::MAX,
                chunk_bytes: u32::MAX,
                manifest: [0xff; 32],
            },
            window_bytes: u64::MAX,
            regions: vec![region; MAX_MAP_REGIONS],
            manifest: Some(region),
        })),
        // Every link of a full batch refused with the longest message.
        Response::LinkedBatch {
            results: vec![
                Some(RemoteError {
                    kind: ErrorKind::TooManyLinks,
                    message: "m".repeat(MAX_ERROR_MESSAGE_BYTES),
                });
                LINK_BATCH_MAX
            ],
        },
    ];
    for body in at_limit {
        let m = Message::Response { id: u64::MAX, body };
        let bytes = codec::encode(&m).unwrap();
        assert_eq!(codec::decode(&bytes).unwrap(), m);
    }
    // A full batch of short links fits the server's request frame.
    let batch = Message::Request {
        id: u64::MAX,
        body: Request::LinkBatch {
            share: "s".repeat(MAX_NAME_BYTES),
            links: (0..LINK_BATCH_MAX)
                .map(|i| (format!("prev/d{i:03}/file"), format!("next/d{i:03}/file")))
                .collect(),
        },
    };
    let bytes = codec::encode(&batch).unwrap();
    assert!(
        bytes.len() <= codec::MAX_REQUEST_FRAME_BYTES,
        "{}",
        bytes.len()
    );
    assert_eq!(codec::decode(&bytes).unwrap(), batch);
}

#[test]
fn every_request_and_response_variant_is_generated() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut requests, mut responses) = ([false; 59], [false; 31]);
    for _ in 0..4000 {
        match message().new_tree(&mut runner).unwrap().current() {
            Message::Request { body, .. } => requests[request_variant(&body)] = true,
            Message::Response { body, .. } => responses[response_variant(&body)] = true,
            _ => {}
        }
    }
    assert!(requests.iter().all(|&b| b), "requests {requests:?}");
    assert!(responses.iter().all(|&b| b), "responses {responses:?}");
}

/// The committed seeds of the `codec_decode` fuzz target (`tests/fuzz/corpus`) still
/// decode; after a protocol change, write them again (see `docs/fuzzing.md`).
#[test]
fn committed_fuzz_seeds_decode() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz/corpus/codec_decode");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if let Err(e) = codec::decode(&bytes) {
            panic!(
                "{} no longer decodes ({e}): regenerate the seeds with \
                 `cargo run --manifest-path tests/fuzz/Cargo.toml --example seeds`",
                path.display()
            );
        }
        seen += 1;
    }
    assert!(seen >= 30, "only {seen} seeds in {}", dir.display());
}
