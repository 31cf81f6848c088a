//! The local tree walk that `rcp -r` uploads and backups share: a source directory
//! read once, up front, into a list of directories.
//!
//! Directories come out in pre-order (a parent's index is below its children's; the
//! root is index 0), each with its regular files and symlinks, names sorted. Entries
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

use ferry_common::attr::{attr_of, owner_of};
use ferry_common::msg::{FileKind, Owner, Timestamp};

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
    // Directories listed but not yet read: (index in `dirs`, path, names). Explicit,
    // so that deep trees cannot overflow the stack.
    let mut todo = vec![(0usize, root.to_path_buf(), names)];
    while let Some((index, path, names)) = todo.pop() {
        for name in names {
            let child = path.join(&name);
            let Some(name) = name.to_str() else {
                on_problem(Problem::NotUtf8(child))?;
                continue;
            };
            let meta = match fs::symlink_metadata(&child) {
                Ok(m) => m,
                Err(e) => {
                    on_problem(Problem::Stat(child, e))?;
                    continue;
                }
            };
            let rel = join(&dirs[index].rel, name);
            if filter.excludes(&rel, meta.is_dir()) {
                continue;
            }
            let kind = meta.file_type();
            if kind.is_dir() {
                let names = match sorted_names(&child) {
                    Ok(n) => n,
                    Err(e) => {
                        on_problem(Problem::List(child, e))?;
                        continue;
                    }
                };
                let sub = dirs.len();
                let depth = dirs[index].depth + 1;
                dirs.push(local_dir(rel, name.to_string(), depth, &meta));
                dirs[index].children.push(sub);
                todo.push((sub, child, names));
            } else if kind.is_symlink() {
                match fs::read_link(&child) {
                    Ok(target) => dirs[index].symlinks.push(LocalSymlink {
                        name: name.to_string(),
                        target: target.to_string_lossy().into_owned(),
                        mtime: attr_of(&meta, None).mtime,
                        owner: owner_of(&meta),
                    }),
                    Err(e) => on_problem(Problem::ReadLink(child, e))?,
                }
            } else if kind.is_file() {
                dirs[index].files.push(LocalFile {
                    name: name.to_string(),
                    path: child,
                    size: meta.len(),
                    mtime: attr_of(&meta, None).mtime,
                    owner: owner_of(&meta),
                    inode: (meta.dev(), meta.ino()),
                    nlink: meta.nlink(),
                });
            } else {
                on_problem(Problem::Special(child))?;
            }
        }
    }
    Ok(dirs)
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
    fn joins_drop_slashes_and_empty_parts() {
        assert_eq!(join("", "a"), "a");
        assert_eq!(join("/p/", "a"), "p/a");
        assert_eq!(join("p/q", ""), "p/q");
        assert_eq!(join("", ""), "");
    }

    #[test]
    fn a_walk_is_pre_order_filtered_and_hands_over_problems() {
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
