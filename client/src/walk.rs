//! The local tree walk that `rcp -r` uploads and backups share: a source directory
//! read once, up front, into a list of directories.
//!
//! Directories come out a level at a time (breadth-first: a parent's index is below
//! its children's; the root is index 0), each with its regular files and symlinks,
//! names sorted. Entries
//! the [`Filter`] excludes are left out, and an excluded directory is not descended
//! into. Everything else the walk cannot take is a [`Problem`] handed to the caller,
//! which decides: a backup fails on an unreadable entry (a snapshot missing part of
//! the source would pass for a complete one), a copy records it and goes on. A
//! directory that cannot be listed is never in the tree (an empty copy would pass for
//! a complete one), and so neither is anything below it.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ferry_common::attr::{attr_of, owner_of};
use ferry_common::msg::{FileKind, Owner, Timestamp};
use rayon::prelude::*;

use crate::error::ClientError;
use crate::filter::Filter;

/// One directory of the source.
pub struct LocalDir {
    /// Path relative to the source directory (`""` for the source itself).
    pub rel: String,
    /// Its name in its parent (`""` for the source itself).
    pub name: String,
    /// Distance from the source directory (0 for the source itself).
    pub depth: usize,
    /// Permission bits to give the copy once its contents are in.
    pub mode: u32,
    /// mtime to give the copy once its contents are in.
    pub mtime: Timestamp,
    /// Its numeric owner and group.
    pub owner: Owner,
    /// Indices of the subdirectories (each greater than this directory's).
    pub children: Vec<usize>,
    /// Regular files, by name.
    pub files: Vec<LocalFile>,
    /// Symlinks, by name.
    pub symlinks: Vec<LocalSymlink>,
}

impl LocalDir {
    /// What each entry of this directory is, by name (`tree` holds its children).
    pub fn kinds<'a>(&'a self, tree: &'a [LocalDir]) -> HashMap<&'a str, FileKind> {
        let files = self.files.iter().map(|f| (f.name.as_str(), FileKind::File));
        let links = self
            .symlinks
            .iter()
            .map(|l| (l.name.as_str(), FileKind::Symlink));
        let dirs = self
            .children
            .iter()
            .map(|&c| (tree[c].name.as_str(), FileKind::Dir));
        files.chain(links).chain(dirs).collect()
    }
}

/// One regular file of the source.
pub struct LocalFile {
    /// Its name in its directory.
    pub name: String,
    /// Where it is.
    pub path: PathBuf,
    /// Its size when walked.
    pub size: u64,
    /// Its mtime when walked.
    pub mtime: Timestamp,
    /// Its numeric owner and group when walked.
    pub owner: Owner,
    /// Its inode (device, inode number) when walked: names of one inode are hard links
    /// of each other.
    pub inode: (u64, u64),
    /// Its number of names (hard links) when walked.
    pub nlink: u64,
}

/// One symlink of the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalSymlink {
    /// Its name in its directory.
    pub name: String,
    /// Its target, as stored.
    pub target: String,
    /// Its own mtime (not its target's).
    pub mtime: Timestamp,
    /// Its own numeric owner and group.
    pub owner: Owner,
}

/// An entry the walk could not take into the tree.
#[derive(Debug)]
#[non_exhaustive]
pub enum Problem {
    /// A directory that cannot be listed (left out, with everything below it).
    List(PathBuf, io::Error),
    /// An entry that cannot be stat'ed.
    Stat(PathBuf, io::Error),
    /// A symlink whose target cannot be read.
    ReadLink(PathBuf, io::Error),
    /// A name that is not UTF-8 (the protocol carries names as UTF-8).
    NotUtf8(PathBuf),
    /// A special file: a device, fifo or socket.
    Special(PathBuf),
}

/// Walks the directory `root` (`meta` is its metadata), leaving out what `filter`
/// excludes. Each [`Problem`] goes to `on_problem`: `Ok` leaves the entry out and goes
/// on, an error ends the walk with it. Blocking.
///
/// A level of the tree at a time: the entries of every directory of the level are
/// looked at (`lstat`, `readlink`, the listing of subdirectories) by several threads
/// at once ([`look_all`]), then taken into the tree in order, so the result and the
/// problems' order do not depend on the threads. On a tree whose metadata is not in
/// the page cache the disk reads overlap instead of coming one at a time.
pub fn walk(
    root: &Path,
    meta: &fs::Metadata,
    filter: &Filter,
    mut on_problem: impl FnMut(Problem) -> Result<(), ClientError>,
) -> Result<Vec<LocalDir>, ClientError> {
    let names = match sorted_names(root) {
        Ok(n) => n,
        Err(e) => {
            on_problem(Problem::List(root.to_path_buf(), e))?;
            return Ok(Vec::new());
        }
    };
    let mut dirs = vec![local_dir(String::new(), String::new(), 0, meta)];
    // The directories of the level being read: (index in `dirs`, path, names).
    let mut level = vec![(0usize, root.to_path_buf(), names)];
    while !level.is_empty() {
        let looked = look_all(&level, &dirs, filter);
        let mut next = Vec::new();
        for ((index, _, _), entries) in level.into_iter().zip(looked) {
            for entry in entries {
                let Looked {
                    child,
                    rel,
                    meta,
                    more,
                } = entry;
                let name = match child.file_name().and_then(|n| n.to_str()) {
                    Some(n) => n.to_owned(),
                    None => {
                        on_problem(Problem::NotUtf8(child))?;
                        continue;
                    }
                };
                let meta = match meta {
                    Ok(m) => m,
                    Err(e) => {
                        on_problem(Problem::Stat(child, e))?;
                        continue;
                    }
                };
                match more {
                    More::Excluded => {}
                    More::Listing(Ok(names)) => {
                        let sub = dirs.len();
                        let depth = dirs[index].depth + 1;
                        dirs.push(local_dir(rel, name, depth, &meta));
                        dirs[index].children.push(sub);
                        next.push((sub, child, names));
                    }
                    More::Listing(Err(e)) => on_problem(Problem::List(child, e))?,
                    More::Target(Ok(target)) => dirs[index].symlinks.push(LocalSymlink {
                        name,
                        target: target.to_string_lossy().into_owned(),
                        mtime: attr_of(&meta, None).mtime,
                        owner: owner_of(&meta),
                    }),
                    More::Target(Err(e)) => on_problem(Problem::ReadLink(child, e))?,
                    More::File => dirs[index].files.push(LocalFile {
                        name,
                        path: child,
                        size: meta.len(),
                        mtime: attr_of(&meta, None).mtime,
                        owner: owner_of(&meta),
                        inode: (meta.dev(), meta.ino()),
                        nlink: meta.nlink(),
                    }),
                    More::Special => on_problem(Problem::Special(child))?,
                }
            }
        }
        level = next;
    }
    Ok(dirs)
}

/// What the walk learnt of one entry, before taking it into the tree.
struct Looked {
    child: PathBuf,
    /// Its path relative to the walk's root (empty for a name that is not UTF-8).
    rel: String,
    meta: io::Result<fs::Metadata>,
    /// What else there is to know, by kind (meaningless when `meta` failed).
    more: More,
}

enum More {
    /// Left out by the filter.
    Excluded,
    /// A directory: its names, sorted.
    Listing(io::Result<Vec<OsString>>),
    /// A symlink: its target.
    Target(io::Result<PathBuf>),
    File,
    /// A device, fifo or socket.
    Special,
}

/// Threads that look at a level's entries: metadata reads of a cold tree wait on the
/// disk, so more of them than cores overlap those waits.
const LOOK_THREADS: usize = 8;

/// Looks at every entry of the directories of `level` (children of `dirs`' entries),
/// on [`LOOK_THREADS`] threads; per directory, its entries in name order.
fn look_all(
    level: &[(usize, PathBuf, Vec<OsString>)],
    dirs: &[LocalDir],
    filter: &Filter,
) -> Vec<Vec<Looked>> {
    let look = |(index, path, name): (usize, &PathBuf, &OsString)| {
        let child = path.join(name);
        let rel = name
            .to_str()
            .map_or_else(String::new, |n| join(&dirs[index].rel, n));
        let meta = fs::symlink_metadata(&child);
        let more = match &meta {
            Err(_) => More::Special,
            Ok(_) if name.to_str().is_none() => More::Special,
            Ok(m) if filter.excludes(&rel, m.is_dir()) => More::Excluded,
            Ok(m) if m.is_dir() => More::Listing(sorted_names(&child)),
            Ok(m) if m.file_type().is_symlink() => More::Target(fs::read_link(&child)),
            Ok(m) if m.is_file() => More::File,
            Ok(_) => More::Special,
        };
        Looked {
            child,
            rel,
            meta,
            more,
        }
    };
    let entries: Vec<(usize, &PathBuf, &OsString)> = level
        .iter()
        .flat_map(|(index, path, names)| names.iter().map(move |n| (*index, path, n)))
        .collect();
    let mut looked: Vec<Looked> = match look_pool() {
        Some(pool) if entries.len() >= 64 => {
            pool.install(|| entries.into_par_iter().map(look).collect())
        }
        _ => entries.into_iter().map(look).collect(),
    };
    // Back into one list per directory, in the level's order.
    let mut out = Vec::with_capacity(level.len());
    for (_, _, names) in level.iter().rev() {
        out.push(looked.split_off(looked.len() - names.len()));
    }
    out.reverse();
    out
}

/// The walk's own thread pool (a few idle threads once made); `None` where threads
/// cannot be started, and then the walk looks at one entry at a time.
fn look_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(LOOK_THREADS)
            .thread_name(|i| format!("ferry-walk-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// The names in the directory `path`, sorted.
fn sorted_names(path: &Path) -> io::Result<Vec<OsString>> {
    let mut names: Vec<_> = fs::read_dir(path)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    names.sort();
    Ok(names)
}

fn local_dir(rel: String, name: String, depth: usize, meta: &fs::Metadata) -> LocalDir {
    LocalDir {
        rel,
        name,
        depth,
        mode: meta.mode() & 0o7777,
        mtime: attr_of(meta, None).mtime,
        owner: owner_of(meta),
        children: Vec::new(),
        files: Vec::new(),
        symlinks: Vec::new(),
    }
}

/// The relative (or share-relative) path `dir/name`: `dir` without leading or trailing
/// `/`; `name` alone when `dir` is empty, `dir` alone when `name` is.
pub fn join(dir: &str, name: &str) -> String {
    let dir = dir.trim_matches('/');
    match (dir.is_empty(), name.is_empty()) {
        (true, _) => name.to_owned(),
        (_, true) => dir.to_owned(),
        _ => format!("{dir}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::{Rule, RuleKind};

    #[test]
    fn a_wide_level_is_looked_at_by_the_pool_and_comes_out_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in ["b", "a", "a/x", "c"] {
            fs::create_dir(root.join(d)).unwrap();
            for i in (0..50).rev() {
                fs::write(root.join(format!("{d}/f{i:02}")), vec![b'x'; i]).unwrap();
            }
        }
        std::os::unix::fs::symlink("f01", root.join("c/link")).unwrap();
        let meta = fs::metadata(root).unwrap();
        let filter = Filter::new(vec![Rule::new(RuleKind::Exclude, "f4?").unwrap()]);
        let tree = walk(root, &meta, &filter, |p| panic!("{p:?}")).unwrap();
        let rels: Vec<_> = tree.iter().map(|d| d.rel.as_str()).collect();
        assert_eq!(rels, ["", "a", "b", "c", "a/x"]);
        assert_eq!(tree[0].children, [1, 2, 3]);
        assert_eq!(tree[1].children, [4]);
        for d in &tree[1..] {
            let names: Vec<_> = d.files.iter().map(|f| f.name.clone()).collect();
            let want: Vec<_> = (0..40).map(|i| format!("f{i:02}")).collect();
            assert_eq!(names, want, "{}", d.rel);
            assert!(d
                .files
                .iter()
                .all(|f| f.size == f.name[1..].parse::<u64>().unwrap()
                    && f.path == root.join(&d.rel).join(&f.name)));
        }
        assert_eq!(tree[3].symlinks[0].target, "f01");
    }

    #[test]
    fn joins_drop_slashes_and_empty_parts() {
        assert_eq!(join("", "a"), "a");
        assert_eq!(join("/p/", "a"), "p/a");
        assert_eq!(join("p/q", ""), "p/q");
        assert_eq!(join("", ""), "");
    }

    #[test]
    fn a_walk_is_parents_first_filtered_and_hands_over_problems() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::create_dir(root.join("skip")).unwrap();
        fs::write(root.join("a/b/f"), b"12345").unwrap();
        fs::write(root.join("top"), b"x").unwrap();
        std::os::unix::fs::symlink("top", root.join("link")).unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let filter = Filter::new(vec![Rule::new(RuleKind::Exclude, "skip/").unwrap()]);
        let mut problems = Vec::new();
        let meta = fs::metadata(root).unwrap();
        let tree = walk(root, &meta, &filter, |p| {
            problems.push(p);
            Ok(())
        })
        .unwrap();
        let rels: Vec<_> = tree.iter().map(|d| d.rel.as_str()).collect();
        assert_eq!(rels, ["", "a", "a/b"]);
        assert!(tree
            .iter()
            .enumerate()
            .all(|(i, d)| d.children.iter().all(|&c| c > i)));
        assert_eq!(tree[2].files[0].size, 5);
        let links: Vec<_> = tree[0]
            .symlinks
            .iter()
            .map(|l| (l.name.as_str(), l.target.as_str()))
            .collect();
        assert_eq!(links, [("link", "top")]);
        assert!(matches!(&problems[..], [Problem::Special(p)] if p.ends_with("fifo")));
        // A caller that refuses problems ends the walk.
        let refused = walk(root, &meta, &filter, |_| {
            Err(ClientError::Usage("no".into()))
        });
        assert!(refused.is_err());
    }
}
