//! Hard links (`Link`, `LinkBatch`), made relative to directory descriptors.
//!
//! Each name of a link is split into its parent directory and its final component.
//! Within one request, each distinct parent (as named) is resolved and opened once
//! ([`Parents`]): from the share root, one component at a time, with
//! `O_PATH | O_DIRECTORY | O_NOFOLLOW`, which succeeds only when no component is a
//! symlink and so reaches the directory [`Share::resolve`] would. A parent that cannot
//! be opened that way (a symlink on the way, something missing, the state directory
//! named) is resolved by [`Share::resolve_dir`], which gives the answer, or the error,
//! that any request naming it gets, and its canonical path is then opened the same way.
//! Every link is made with `linkat` relative to its two parents' descriptors, so a
//! backup's batch of links into a few directories resolves each directory once, not
//! both paths of every link component by component.
//!
//! Invariants (those of [`crate::share`] for every path, plus):
//! - a parent descriptor is a directory inside the share, reached without following a
//!   symlink after the resolution; a directory swapped for a symlink later does not
//!   redirect it (it holds a directory, not a path);
//! - the source's final component is never followed and must be a regular file (or,
//!   for a caller on a client-owners share, a FIFO, socket or device node): a
//!   handle on it (`O_PATH | O_NOFOLLOW`) is checked, the entry is linked by name
//!   without following it, and the new name must then hold the handle's inode (which the
//!   handle keeps from being freed and reused); if the source was swapped meanwhile, the
//!   link just made is removed again and the link fails as changed;
//! - a link never replaces anything (`EEXIST`); temporary transfer names can neither be
//!   linked nor be a link's new name; the state directory at the root is reached by
//!   neither name; the share root is never a new name;
//! - each link fails alone, with the error a lone `Link` of it gets: errors are checked
//!   in the same order, and a parent that fails is not remembered, so each link naming
//!   it resolves it again and gets its own message.
//!
//! Known limit, as for every path ferryd resolves: a local user (not a client) who
//! moves a directory a request holds open while it runs moves the links made in it
//! with it.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ferry_common::msg::Response;
use ferry_common::transport::sys::at::open_at;
use ferry_common::{STATE_DIR, TEMP_PREFIX};
use nix::fcntl::{AtFlags, OFlag};
use nix::unistd::{linkat, unlinkat, UnlinkatFlags};

use crate::filekey::{mtime_settled, ManifestKey};
use crate::share::{Share, ShareError};
use crate::store::ManifestStore;

/// Parent directories one request keeps open at most; beyond that the ones it holds
/// are closed and opened again as needed. Two per link at the most, and a backup's
/// batch names a few directories, so this rarely binds; it bounds the descriptors of a
/// batch whose every link names other directories.
const MAX_OPEN_PARENTS: usize = 64;

/// A failed hard link, naming the operation and the share-relative path
/// (`share/dir/file`) it failed on.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// A path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// A directory on the way is gone or no longer a directory since it was resolved.
    #[error("{path}: a directory on the path changed while it was used")]
    Moved {
        /// The path.
        path: String,
    },
    /// The source is not a regular file.
    #[error("{path}: only regular files can be hard-linked")]
    NotAFile {
        /// The source.
        path: String,
    },
    /// The source was replaced between its check and the link.
    #[error("{path}: changed while it was linked")]
    SourceChanged {
        /// The source.
        path: String,
    },
    /// Opening the share root, a parent or the source failed.
    #[error("{0}: cannot open")]
    Open(String, #[source] io::Error),
    /// `fstat` of the source failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] io::Error),
    /// `linkat` failed.
    #[error("{0}: cannot link")]
    Link(String, #[source] io::Error),
}

/// `Link`: hard-links the regular file `from` (its final component not followed) to the
/// new name `to`; see the module docs. Blocking.
pub fn link(share: &Share, from: &str, to: &str) -> Result<Response, LinkError> {
    let rekey = Parents::new(share).link(from, to)?;
    if let Some(r) = rekey {
        r.apply(share.store());
    }
    Ok(Response::Ok)
}

/// `LinkBatch`: every pair, in order, each failing alone; one result per pair (`None`
/// for a link made, or why it failed). The whole batch runs in one blocking task (the
/// caller's) and resolves each distinct parent directory once, so a backup's unchanged
/// files cost one request, one task and a few resolutions per batch, not per file.
///
/// The store's re-keys the links call for run after all links, on up to
/// [`REKEY_THREADS`] threads: each reads a small record file, usually not cached
/// (measured: half of an incremental backup's time when they ran one by one).
pub fn link_batch(share: &Share, links: &[(String, String)]) -> Vec<Option<LinkError>> {
    let mut parents = Parents::new(share);
    let mut rekeys = Vec::new();
    let results = links
        .iter()
        .map(|(from, to)| match parents.link(from, to) {
            Ok(r) => {
                rekeys.extend(r);
                None
            }
            Err(e) => Some(e),
        })
        .collect();
    apply_all(share.store(), &rekeys);
    results
}

/// Most threads one `LinkBatch` re-keys records on.
pub const REKEY_THREADS: usize = 8;

/// Applies `rekeys` on up to [`REKEY_THREADS`] scoped threads (one per 16 re-keys).
/// Blocking; returns when all are done.
fn apply_all(store: &ManifestStore, rekeys: &[Rekey]) {
    let threads = rekeys.len().div_ceil(16).min(REKEY_THREADS);
    if threads <= 1 {
        rekeys.iter().for_each(|r| r.apply(store));
        return;
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while let Some(r) = rekeys.get(next.fetch_add(1, Ordering::Relaxed)) {
                    r.apply(store);
                }
            });
        }
    });
}

/// A parent directory opened for a request.
#[derive(Clone)]
struct Parent {
    /// `O_PATH | O_DIRECTORY` descriptor of the directory.
    dir: Rc<File>,
    /// True if it is the share root.
    is_root: bool,
}

/// The parent directories one request has opened, by their share-relative path as
/// named (components joined by `/`): only directories that resolved.
struct Parents<'a> {
    share: &'a Share,
    root: Option<Rc<File>>,
    open: HashMap<String, Parent>,
}

fn path_flags() -> OFlag {
    OFlag::O_PATH | OFlag::O_NOFOLLOW
}

fn dir_flags() -> OFlag {
    path_flags() | OFlag::O_DIRECTORY
}

/// `name` as a C string. Share paths hold no NUL ([`ferry_common::path`] refuses one),
/// nor does a component of a canonical path.
fn c_name(name: &[u8], what: &str) -> Result<CString, LinkError> {
    CString::new(name).map_err(|_| ShareError::NotAName { path: what.into() }.into())
}

/// Opens the directories `comps` one below the other from `root`, each with
/// [`dir_flags`] (a symlink fails with `ELOOP` or `ENOTDIR`); `None` for no component
/// (the root itself). Blocking.
fn descend<'c>(root: &File, comps: impl IntoIterator<Item = &'c [u8]>) -> io::Result<Option<File>> {
    let mut dir: Option<File> = None;
    for comp in comps {
        let name = CString::new(comp).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        dir = Some(open_at(dir.as_ref().unwrap_or(root), &name, dir_flags())?);
    }
    Ok(dir)
}

/// The error for a resolved directory that could not be opened again: gone, or no
/// longer a directory (swapped for a symlink or a file since it was resolved).
fn moved(what: &str, e: io::Error) -> LinkError {
    match e.raw_os_error() {
        Some(nix::libc::ELOOP | nix::libc::ENOTDIR) => LinkError::Moved { path: what.into() },
        _ => LinkError::Open(what.into(), e),
    }
}

/// `fstat` of the entry `name` in `dir` itself (a symlink is not followed). Blocking.
fn lstat_at(dir: &File, name: &CStr) -> io::Result<Metadata> {
    open_at(dir, name, path_flags())?.metadata()
}

fn same_inode(a: &Metadata, b: &Metadata) -> bool {
    a.dev() == b.dev() && a.ino() == b.ino()
}

impl<'a> Parents<'a> {
    fn new(share: &'a Share) -> Parents<'a> {
        Parents {
            share,
            root: None,
            open: HashMap::new(),
        }
    }

    /// The share root, opened once per request. `rel` names the path being resolved,
    /// for the error.
    fn root(&mut self, rel: &str) -> Result<Rc<File>, LinkError> {
        if let Some(root) = &self.root {
            return Ok(root.clone());
        }
        let root = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH | nix::libc::O_DIRECTORY)
            .open(self.share.root())
            .map_err(|e| LinkError::Open(self.share.display(rel), e))?;
        let root = Rc::new(root);
        self.root = Some(root.clone());
        Ok(root)
    }

    /// Opens the directory `parents` (the components of `rel` before its last); fails
    /// as resolving `rel`'s parent fails ([`Share::resolve_dir`]).
    fn open_dir(&mut self, rel: &str, parents: &[&str]) -> Result<Parent, LinkError> {
        let root = self.root(rel)?;
        // Named directly and free of symlinks: the directory resolution would reach.
        // The state directory is left to the resolution, which refuses it.
        if parents.first() != Some(&STATE_DIR) {
            if let Ok(dir) = descend(&root, parents.iter().map(|c| c.as_bytes())) {
                return Ok(Parent {
                    dir: dir.map_or(root, Rc::new),
                    is_root: parents.is_empty(),
                });
            }
        }
        let what = self.share.display(rel);
        let canonical = self.share.resolve_dir(parents, rel)?;
        let inside = canonical
            .strip_prefix(self.share.root())
            .map_err(|_| ShareError::Outside { path: what.clone() })?;
        let dir =
            descend(&root, inside.iter().map(|c| c.as_bytes())).map_err(|e| moved(&what, e))?;
        Ok(Parent {
            is_root: dir.is_none(),
            dir: dir.map_or(root, Rc::new),
        })
    }

    /// Where `rel` is: its parent directory and its final component; `None` for the
    /// share root. Fails as [`Share::resolve`] without follow fails for `rel`.
    fn locate<'r>(&mut self, rel: &'r str) -> Result<Option<(Parent, &'r str)>, LinkError> {
        let comps = self.share.components(rel)?;
        let Some((last, parents)) = comps.split_last() else {
            return Ok(None);
        };
        let key = parents.join("/");
        let parent = match self.open.get(&key) {
            Some(p) => p.clone(),
            None => {
                let p = self.open_dir(rel, parents)?;
                if self.open.len() >= MAX_OPEN_PARENTS {
                    self.open.clear();
                }
                self.open.insert(key, p.clone());
                p
            }
        };
        if parent.is_root && *last == STATE_DIR {
            return Err(self.share.reserved(rel).into());
        }
        Ok(Some((parent, *last)))
    }

    /// Hard-links the regular file `from` to the new name `to` (see the module docs).
    ///
    /// `link(2)` changes the inode's ctime, hence its manifest key: if the share's
    /// store holds a record of the file as it was just before, the record is to be
    /// re-keyed to the new key when nothing but this link happened: the returned
    /// [`Rekey`], for the caller to apply (see [`Rekey::after_link`]).
    fn link(&mut self, from: &str, to: &str) -> Result<Option<Rekey>, LinkError> {
        let share = self.share;
        let from_what = share.display(from);
        let to_what = share.display(to);
        let src = self.locate(from)?;
        if src
            .as_ref()
            .is_some_and(|(_, name)| name.starts_with(TEMP_PREFIX))
        {
            return Err(ShareError::TempName { path: from_what }.into());
        }
        share.check_writable()?;
        let Some((dst_dir, dst_name)) = self.locate(to)? else {
            return Err(ShareError::WriteRoot { path: to_what }.into());
        };
        if dst_name.starts_with(TEMP_PREFIX) {
            return Err(ShareError::TempName { path: to_what }.into());
        }
        let not_a_file = || LinkError::NotAFile {
            path: from_what.clone(),
        };
        // The share root is a directory.
        let Some((src_dir, src_name)) = src else {
            return Err(not_a_file());
        };
        let src_name = c_name(src_name.as_bytes(), &from_what)?;
        let dst_name = c_name(dst_name.as_bytes(), &to_what)?;
        let handle = open_at(&src_dir.dir, &src_name, path_flags())
            .map_err(|e| LinkError::Open(from_what.clone(), e))?;
        let before = handle
            .metadata()
            .map_err(|e| LinkError::Stat(from_what.clone(), e))?;
        // A caller on a client-owners share links special files too (never opened).
        let special = crate::owners::acting() && {
            use std::os::unix::fs::FileTypeExt;
            let t = before.file_type();
            t.is_fifo() || t.is_socket() || t.is_char_device() || t.is_block_device()
        };
        if !before.is_file() && !special {
            return Err(not_a_file());
        }
        // linkat(2) without AT_SYMLINK_FOLLOW: the entry itself, never a symlink's
        // target.
        linkat(
            Some(src_dir.dir.as_raw_fd()),
            src_name.as_c_str(),
            Some(dst_dir.dir.as_raw_fd()),
            dst_name.as_c_str(),
            AtFlags::empty(),
        )
        .map_err(|errno| LinkError::Link(to_what.clone(), errno.into()))?;
        let after = match lstat_at(&dst_dir.dir, &dst_name) {
            Ok(linked) if same_inode(&linked, &before) => linked,
            linked => {
                // The source was swapped after the check: the new name holds what it
                // names now. Removed again only if it still is that (this link).
                let ours = linked.is_ok_and(|l| {
                    lstat_at(&src_dir.dir, &src_name).is_ok_and(|now| same_inode(&l, &now))
                });
                if ours {
                    let _ = unlinkat(
                        Some(dst_dir.dir.as_raw_fd()),
                        dst_name.as_c_str(),
                        UnlinkatFlags::NoRemoveDir,
                    );
                }
                return Err(LinkError::SourceChanged { path: from_what });
            }
        };
        Ok(Rekey::after_link(
            share.store(),
            &before,
            &after,
            &from_what,
        ))
    }
}

/// Renames `from` to `to` (paths inside `share`, resolved by the caller, neither
/// followed) with `rename`, which does the `rename(2)`; a regular file renamed keeps
/// its manifest record ([`Rekey::after_ctime_change`]): otherwise the rename's new ctime
/// would leave it unrecorded, and rot after it unnoticed until it is read again.
/// Blocking.
pub fn rename_keeping_record<E>(
    share: &Share,
    from: &std::path::Path,
    to: &std::path::Path,
    what: &str,
    rename: impl FnOnce() -> Result<(), E>,
) -> Result<(), E> {
    let before = std::fs::symlink_metadata(from)
        .ok()
        .filter(Metadata::is_file);
    rename()?;
    let after = std::fs::symlink_metadata(to).ok();
    if let (Some(before), Some(after)) = (before, after) {
        if let Some(r) = Rekey::after_ctime_change(share.store(), &before, &after, what) {
            r.apply(share.store());
        }
    }
    Ok(())
}

/// A re-key of a manifest record that a link or a rename calls for.
pub struct Rekey {
    old: ManifestKey,
    new: ManifestKey,
    what: String,
}

impl Rekey {
    /// After ferryd linked a file whose metadata was `before` to a new name that it
    /// checked holds the same inode, now with metadata `after`: the re-key of the
    /// store's record of the `before` version to the key now, if nothing but that link
    /// happened: same inode, size and mtime, one link more, and an mtime that any later
    /// write would change ([`mtime_settled`]). `None` otherwise (the record stays as it
    /// is: a miss for the new key, so the file is hashed again when next needed).
    pub fn after_link(
        store: &ManifestStore,
        before: &Metadata,
        after: &Metadata,
        what: &str,
    ) -> Option<Rekey> {
        Rekey::after_own_change(store, before, after, 1, what)
    }

    /// [`Rekey::after_link`] for a change by ferryd that moves the file's ctime and
    /// leaves its links, size and mtime as they were: a rename (`Move`, `Rename`; ext4,
    /// XFS, btrfs and tmpfs all set the renamed inode's ctime), `after` being the
    /// metadata under the new name; or a change of mode, owner or atime (`SetAttrs`
    /// without a size or an mtime).
    pub fn after_ctime_change(
        store: &ManifestStore,
        before: &Metadata,
        after: &Metadata,
        what: &str,
    ) -> Option<Rekey> {
        Rekey::after_own_change(store, before, after, 0, what)
    }

    /// The re-key after a change by ferryd that added `links` links to the file and
    /// changed nothing else but its ctime (see [`Rekey::after_link`]).
    fn after_own_change(
        store: &ManifestStore,
        before: &Metadata,
        after: &Metadata,
        links: u64,
        what: &str,
    ) -> Option<Rekey> {
        let old = ManifestKey::of(before, store.chunk_bytes());
        let new = ManifestKey::of(after, store.chunk_bytes());
        let only_that = same_inode(after, before)
            && after.is_file()
            && after.size() == before.size()
            && new.mtime_ns == old.mtime_ns
            && after.nlink() == before.nlink() + links;
        (only_that && mtime_settled(&new)).then(|| Rekey {
            old,
            new,
            what: what.to_string(),
        })
    }

    /// Re-keys the record if it is of exactly the old version (a record changed since
    /// is left alone). Blocking; failures are logged, never returned.
    pub fn apply(&self, store: &ManifestStore) {
        match store.rekey(&self.old, &self.new) {
            Ok(true) => tracing::debug!(file = %self.what, "manifest record re-keyed"),
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(file = %self.what, "cannot re-key the manifest record: {e}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::test_share;
    use ferry_common::msg::{ErrorKind, HashAlgorithm, RemoteError};
    use std::fs;
    use std::os::unix::fs::symlink;

    fn share(dir: &std::path::Path) -> Share {
        test_share("s", dir, false)
    }

    fn kinds(results: Vec<Option<LinkError>>) -> Vec<Option<ErrorKind>> {
        results
            .into_iter()
            .map(|r| r.map(|e| RemoteError::from(e).kind))
            .collect()
    }

    #[test]
    fn a_batch_resolves_each_parent_once_and_judges_each_link_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::create_dir_all(root.join("n/b")).unwrap();
        fs::create_dir(tmp.path().join("out")).unwrap();
        for i in 0..4 {
            fs::write(root.join(format!("a/b/f{i}")), b"x").unwrap();
        }
        symlink("a", root.join("via")).unwrap();
        symlink("../out", root.join("esc")).unwrap();
        let s = share(&root);
        let pairs: Vec<(String, String)> = [
            ("a/b/f0", "n/b/f0"),
            ("a//b/./f1", "n/b/f1"),
            ("via/b/f2", "n/b/f2"),
            ("a/b/f3", "esc/f3"),
            ("a/b/f3", "n/missing/f3"),
            ("a/b/f3", "n/b/f0"),
            ("a/b/f3", "a/b/f3/x"),
            ("a/b", "n/b/dir"),
            ("a/b/f3", "n/b/f3"),
        ]
        .iter()
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect();
        use ErrorKind::*;
        assert_eq!(
            kinds(link_batch(&s, &pairs)),
            [
                None,
                None,
                None,
                Some(OutsideShare),
                Some(NotFound),
                Some(Exists),
                Some(NotADirectory),
                Some(InvalidPath),
                None,
            ]
        );
        for i in 0..4 {
            let (a, b) = (
                fs::metadata(root.join(format!("a/b/f{i}"))).unwrap(),
                fs::metadata(root.join(format!("n/b/f{i}"))).unwrap(),
            );
            assert_eq!(a.ino(), b.ino(), "f{i}");
        }
        assert_eq!(fs::read_dir(tmp.path().join("out")).unwrap().count(), 0);
        // A lone link gets the same answers, with messages naming its own paths.
        let e = RemoteError::from(link(&s, "a/b/f3", "n/nope/x").unwrap_err());
        assert_eq!(e.kind, NotFound);
        assert!(e.message.starts_with("s/n/nope/x"), "{}", e.message);
    }

    #[test]
    fn a_directory_swapped_for_a_symlink_after_it_was_opened_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        fs::create_dir_all(root.join("src")).unwrap();
        fs::create_dir_all(root.join("dst")).unwrap();
        fs::create_dir(tmp.path().join("out")).unwrap();
        fs::write(root.join("src/f"), b"x").unwrap();
        fs::write(root.join("src/g"), b"y").unwrap();
        let s = share(&root);
        let mut parents = Parents::new(&s);
        parents.link("src/f", "dst/f").unwrap();
        // `dst` now leads outside; the request holds the directory, not the path.
        fs::rename(root.join("dst"), root.join("old-dst")).unwrap();
        symlink("../out", root.join("dst")).unwrap();
        parents.link("src/g", "dst/g").unwrap();
        assert!(root.join("old-dst/g").exists());
        assert_eq!(fs::read_dir(tmp.path().join("out")).unwrap().count(), 0);
        // A new request resolves afresh and refuses it.
        let e = RemoteError::from(link(&s, "src/g", "dst/h").unwrap_err());
        assert_eq!(e.kind, ErrorKind::OutsideShare);
    }

    #[test]
    fn a_rename_by_ferryd_keeps_the_files_record_but_not_a_changed_files() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        fs::create_dir(&root).unwrap();
        let s = share(&root);
        let store = s.store();
        let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_600_000_000);
        let recorded = |name: &str, bytes: &[u8]| {
            let f = fs::File::create(root.join(name)).unwrap();
            std::io::Write::write_all(&mut &f, bytes).unwrap();
            f.set_modified(old).unwrap();
            let key = ManifestKey::of(&f.metadata().unwrap(), store.chunk_bytes());
            let hash = ferry_common::chunk::hash_chunk(HashAlgorithm::Blake3, bytes);
            store.save(&key, HashAlgorithm::Blake3, &[hash]).unwrap();
            key
        };
        let key_of = |name: &str| {
            ManifestKey::of(&fs::metadata(root.join(name)).unwrap(), store.chunk_bytes())
        };
        let before = recorded("f", b"hello");
        crate::fsops::rename(&s, "f", "g").unwrap();
        let after = key_of("g");
        assert_ne!(
            before.ctime_ns, after.ctime_ns,
            "the rename moved the ctime"
        );
        assert!(store.get(&after).is_some(), "re-keyed");
        // Changed after its record: the rename keeps nothing.
        recorded("h", b"world");
        fs::write(root.join("h"), b"WORLD").unwrap();
        crate::files::move_entry(&s, "h", "i", true).unwrap();
        assert!(store.get(&key_of("i")).is_none());
    }
}
