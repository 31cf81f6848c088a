//! Metadata requests, as blocking filesystem calls (run them off the async threads).

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{symlink, DirBuilderExt};
use std::path::Path;

use ferry_common::attr::{attr_of, owner_of};
use ferry_common::msg::{
    Attr, DirEntry, FileKind, FsStat, Owner, Response, Timestamp, MAX_DIR_PAGE_ENTRIES,
};
use ferry_common::{STATE_DIR, TEMP_PREFIX};
use nix::sys::stat::{utimensat, UtimensatFlags};
use nix::sys::time::TimeSpec;

use crate::share::{Share, ShareError};

/// Bytes of names and symlink targets per listing page, so that a page of long names
/// stays well under the control frame limit.
const DIR_PAGE_BUDGET_BYTES: usize = 512 << 10;

/// A failed metadata request: each variant names the operation and the share-relative
/// path (`share/dir/file`) it failed on.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// `lstat` failed.
    #[error("{path}: cannot stat")]
    Stat {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Reading a symlink's target failed.
    #[error("{path}: cannot readlink")]
    ReadLink {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Reading a directory failed.
    #[error("{path}: cannot list")]
    List {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Setting permission bits failed.
    #[error("{path}: cannot chmod")]
    Chmod {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Creating a directory failed.
    #[error("{path}: cannot mkdir")]
    Mkdir {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `Mkdir` with `exist_ok` met something else than a directory.
    #[error("{path}: exists and is not a directory")]
    NotADirectory {
        /// The path.
        path: String,
    },
    /// Creating a symlink (or renaming it into place) failed.
    #[error("{path}: cannot symlink")]
    Symlink {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A symlink target that is empty or holds a NUL byte.
    #[error("{path}: invalid symlink target")]
    SymlinkTarget {
        /// The path.
        path: String,
    },
    /// `SetAttr` named a symlink.
    #[error("{path}: cannot set attributes of a symlink")]
    AttrOfSymlink {
        /// The path.
        path: String,
    },
    /// `lchown` failed.
    #[error("{path}: cannot chown")]
    Chown {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Setting the modification time failed.
    #[error("{path}: cannot set mtime")]
    SetMtime {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `renameat2` failed.
    #[error("{path}: cannot rename")]
    Rename {
        /// The destination path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Syncing the directory of a new name failed.
    #[error("{path}: cannot fsync")]
    Fsync {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `statvfs` of the share's root failed.
    #[error("{path}: cannot statfs")]
    StatFs {
        /// The share's name.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file request named a directory.
    #[error("{path}: is a directory")]
    IsADirectory {
        /// The path.
        path: String,
    },
    /// A file request named something else than a regular file or a directory.
    #[error("{path}: not a regular file")]
    NotRegular {
        /// The path.
        path: String,
    },
    /// A directory has the name a file or symlink is to take.
    #[error("{path}: a directory is in the way")]
    DirInTheWay {
        /// The path.
        path: String,
    },
}

/// Attributes of `path` itself (a symlink is described, not followed).
pub fn lstat(path: &Path, share: &Share, rel: &str) -> Result<Attr, FsError> {
    lstat_owned(path, share, rel).map(|(attr, _)| attr)
}

/// [`lstat`] with the numeric owner of `path` itself.
fn lstat_owned(path: &Path, share: &Share, rel: &str) -> Result<(Attr, Owner), FsError> {
    let meta = fs::symlink_metadata(path).map_err(|source| FsError::Stat {
        path: share.display(rel),
        source,
    })?;
    let target = if meta.file_type().is_symlink() {
        let t = fs::read_link(path).map_err(|source| FsError::ReadLink {
            path: share.display(rel),
            source,
        })?;
        Some(t.to_string_lossy().into_owned())
    } else {
        None
    };
    Ok((attr_of(&meta, target), owner_of(&meta)))
}

/// `Stat`.
pub fn stat(share: &Share, rel: &str, follow: bool) -> Result<Response, FsError> {
    let path = share.resolve(rel, follow)?;
    Ok(Response::Attr(lstat(&path, share, rel)?))
}

/// `StatMeta`: `Stat` with the owner.
pub fn stat_meta(share: &Share, rel: &str, follow: bool) -> Result<Response, FsError> {
    let path = share.resolve(rel, follow)?;
    let (attr, owner) = lstat_owned(&path, share, rel)?;
    Ok(Response::AttrMeta { attr, owner })
}

/// `ListDir`: the page of entries starting at index `cursor` in name order. Temporary
/// transfer files are not listed, nor the server's state directory at the root.
pub fn list_dir(share: &Share, rel: &str, cursor: u64) -> Result<Response, FsError> {
    let page = list_page(share, rel, cursor)?;
    Ok(Response::Dir {
        entries: page.entries,
        next: page.next,
    })
}

/// `ListDirMeta`: the page of [`list_dir`] with the owner of each entry and of the
/// directory itself.
pub fn list_dir_meta(share: &Share, rel: &str, cursor: u64) -> Result<Response, FsError> {
    let page = list_page(share, rel, cursor)?;
    Ok(Response::DirMeta {
        dir: page.dir,
        entries: page.entries,
        owners: page.owners,
        next: page.next,
    })
}

/// One page of a listing, with owners.
struct Page {
    dir: Owner,
    entries: Vec<DirEntry>,
    owners: Vec<Owner>,
    next: Option<u64>,
}

fn list_page(share: &Share, rel: &str, cursor: u64) -> Result<Page, FsError> {
    let what = share.display(rel);
    let path = share.resolve(rel, true)?;
    let dir = fs::metadata(&path)
        .map(|m| owner_of(&m))
        .map_err(|source| FsError::Stat {
            path: what.clone(),
            source,
        })?;
    let mut owners = Vec::new();
    let at_root = path == share.root();
    let mut names: Vec<String> = Vec::new();
    let list = |source| FsError::List {
        path: what.clone(),
        source,
    };
    for entry in fs::read_dir(&path).map_err(list)? {
        let entry = entry.map_err(list)?;
        match entry.file_name().into_string() {
            Ok(n) if at_root && n == STATE_DIR => {}
            Ok(n) if !n.starts_with(TEMP_PREFIX) => names.push(n),
            Ok(_) => {}
            Err(raw) => {
                tracing::warn!(dir = %what, name = ?raw, "skipping a name that is not UTF-8");
            }
        }
    }
    names.sort_unstable();
    let start = usize::try_from(cursor)
        .unwrap_or(usize::MAX)
        .min(names.len());
    let mut entries = Vec::new();
    let mut budget = DIR_PAGE_BUDGET_BYTES;
    let mut next = None;
    for (i, name) in names.iter().enumerate().skip(start) {
        if entries.len() == MAX_DIR_PAGE_ENTRIES || budget < 8 << 10 {
            next = Some(i as u64);
            break;
        }
        let child_rel = format!("{}/{name}", rel.trim_end_matches('/'));
        let (attr, owner) = match lstat_owned(&path.join(name), share, &child_rel) {
            Ok(a) => a,
            // Removed between readdir and lstat: just not there any more.
            Err(FsError::Stat { source, .. } | FsError::ReadLink { source, .. })
                if source.kind() == io::ErrorKind::NotFound =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        budget = budget
            .saturating_sub(name.len() + attr.symlink_target.as_ref().map_or(0, |t| t.len()) + 32);
        entries.push(DirEntry {
            name: name.clone(),
            attr,
        });
        owners.push(owner);
    }
    Ok(Page {
        dir,
        entries,
        owners,
        next,
    })
}

/// Sets the permission bits of the entry `path` names, never through a final symlink
/// (`fchmodat(AT_SYMLINK_NOFOLLOW)`, which refuses a symlink with `EOPNOTSUPP`).
/// Invariant: a write that checked or made its entry and then sets its mode by path
/// does it here, so a symlink a concurrent request put in the entry's place (a
/// `Symlink` renames over a name atomically) is refused, never followed out of the
/// share.
pub(crate) fn chmod_entry(path: &Path, mode: u32) -> io::Result<()> {
    let mode = nix::sys::stat::Mode::from_bits_truncate(mode & 0o7777);
    nix::sys::stat::fchmodat(
        None,
        path,
        mode,
        nix::sys::stat::FchmodatFlags::NoFollowSymlink,
    )
    .map_err(io::Error::from)
}

/// `Mkdir`.
pub fn mkdir(share: &Share, rel: &str, mode: u32, exist_ok: bool) -> Result<Response, FsError> {
    let what = share.display(rel);
    let path = share.resolve_for_write(rel)?;
    match fs::DirBuilder::new().mode(mode & 0o7777).create(&path) {
        // A caller's directory has its mode already (no umask while acting), and
        // keeps the set-group-ID bit it inherited, which a chmod would clear.
        Ok(()) if crate::owners::acting() => Ok(Response::Ok),
        Ok(()) => {
            // The umask may have cleared bits: set exactly what was asked.
            chmod_entry(&path, mode).map_err(|source| FsError::Chmod { path: what, source })?;
            Ok(Response::Ok)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && exist_ok => {
            match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => Ok(Response::Ok),
                _ => Err(FsError::NotADirectory { path: what }),
            }
        }
        Err(source) => Err(FsError::Mkdir { path: what, source }),
    }
}

/// `Symlink`: creates the link under a temporary name and renames it over `rel`, so an
/// existing file or link there is replaced atomically (a directory is not).
pub fn make_symlink(share: &Share, rel: &str, target: &str) -> Result<Response, FsError> {
    let what = share.display(rel);
    let path = share.resolve_for_write(rel)?;
    if target.contains('\0') || target.is_empty() {
        return Err(FsError::SymlinkTarget { path: what });
    }
    no_dir_in_the_way(&path, &what)?;
    let parent = path.parent().unwrap_or(share.root());
    let tmp = parent.join(format!("{TEMP_PREFIX}{:016x}", rand::random::<u64>()));
    if let Err(source) = symlink(target, &tmp) {
        return Err(FsError::Symlink { path: what, source });
    }
    if let Err(source) = fs::rename(&tmp, &path) {
        let _ = fs::remove_file(&tmp);
        return Err(FsError::Symlink { path: what, source });
    }
    Ok(Response::Ok)
}

/// Fails with [`FsError::DirInTheWay`] if a directory (not a symlink to one) is at
/// `path`, which a file or symlink `what` is about to replace by rename: a rename over
/// an empty directory would succeed, over another fail obscurely. Blocking.
pub fn no_dir_in_the_way(path: &Path, what: &str) -> Result<(), FsError> {
    if fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(FsError::DirInTheWay { path: what.into() });
    }
    Ok(())
}

/// Refuses `meta` unless it describes a regular file: [`FsError::IsADirectory`] for a
/// directory, [`FsError::NotRegular`] for anything else; `what` names it.
pub fn check_regular(meta: &fs::Metadata, what: &str) -> Result<(), FsError> {
    if meta.is_dir() {
        Err(FsError::IsADirectory { path: what.into() })
    } else if !meta.is_file() {
        Err(FsError::NotRegular { path: what.into() })
    } else {
        Ok(())
    }
}

/// `SetAttr` on a file or directory (never through a symlink).
pub fn set_attr(
    share: &Share,
    rel: &str,
    mode: Option<u32>,
    mtime: Option<Timestamp>,
) -> Result<Response, FsError> {
    let what = share.display(rel);
    let path = share.resolve_for_write(rel)?;
    let meta = fs::symlink_metadata(&path).map_err(|source| FsError::Stat {
        path: what.clone(),
        source,
    })?;
    if ferry_common::attr::kind_of(&meta) == FileKind::Symlink {
        return Err(FsError::AttrOfSymlink { path: what });
    }
    if let Some(mode) = mode {
        chmod_entry(&path, mode).map_err(|source| FsError::Chmod {
            path: what.clone(),
            source,
        })?;
    }
    if let Some(t) = mtime {
        // By path, never opened: opening would follow a symlink put in the entry's
        // place since the check above, wait on a FIFO, or open a device.
        let mtime = TimeSpec::new(t.secs, i64::from(t.nanos.min(999_999_999)));
        utimensat(
            None,
            &path,
            &TimeSpec::UTIME_OMIT,
            &mtime,
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|e| FsError::SetMtime {
            path: what,
            source: e.into(),
        })?;
    }
    Ok(Response::Ok)
}

/// `Rename`: renames `from` to `to` with `RENAME_NOREPLACE` (an existing `to` fails with
/// [`ferry_common::msg::ErrorKind::Exists`], whatever its kind), then fsyncs the
/// destination directory so the new name is durable. Neither name may be the share root or a temporary name.
pub fn rename(share: &Share, from: &str, to: &str) -> Result<Response, FsError> {
    let src = share.resolve_for_write(from)?;
    let dst = share.resolve_for_write(to)?;
    let what = share.display(to);
    crate::links::rename_keeping_record(share, &src, &dst, &what, || {
        nix::fcntl::renameat2(
            None,
            &src,
            None,
            &dst,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|errno| FsError::Rename {
            path: what.clone(),
            source: io::Error::from(errno),
        })
    })?;
    if let Some(parent) = dst.parent() {
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(|source| FsError::Fsync { path: what, source })?;
    }
    Ok(Response::Ok)
}

/// `StatFs`: `statvfs(3)` of the share's root. Counts are in units of `block_size` (the
/// fragment size, `f_frsize`, which is what `f_blocks` counts).
pub fn statfs(share: &Share) -> Result<Response, FsError> {
    let st = nix::sys::statvfs::statvfs(share.root()).map_err(|errno| FsError::StatFs {
        path: share.display(""),
        source: io::Error::from(errno),
    })?;
    let clamp32 = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    Ok(Response::FsStat(FsStat {
        block_size: clamp32(st.fragment_size() as u64),
        blocks: st.blocks() as u64,
        blocks_free: st.blocks_free() as u64,
        blocks_avail: st.blocks_available() as u64,
        files: st.files() as u64,
        files_free: st.files_free() as u64,
        name_max: clamp32(st.name_max() as u64),
    }))
}
