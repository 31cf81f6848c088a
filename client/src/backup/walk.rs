//! The local side of a backup: the source tree, walked once up front.
//!
//! Directories come out in pre-order (a parent's index is below its children's), each
//! with its regular files and symlinks; excluded entries and special files (devices,
//! fifos, sockets) are left out, and an excluded directory is not descended into.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use ferry_common::attr::attr_of;
use ferry_common::msg::{FileKind, Timestamp};

use crate::error::ClientError;
use crate::filter::Filter;

use super::join;

/// One directory of the source.
pub(super) struct LocalDir {
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
    /// Indices of the subdirectories (each greater than this directory's).
    pub children: Vec<usize>,
    /// Regular files, by name.
    pub files: Vec<LocalFile>,
    /// Symlinks: name and target.
    pub symlinks: Vec<(String, String)>,
}

impl LocalDir {
    /// What each entry of this directory is, by name (`tree` holds its children).
    pub fn kinds<'a>(&'a self, tree: &'a [LocalDir]) -> HashMap<&'a str, FileKind> {
        let files = self.files.iter().map(|f| (f.name.as_str(), FileKind::File));
        let links = self
            .symlinks
            .iter()
            .map(|(n, _)| (n.as_str(), FileKind::Symlink));
        let dirs = self
            .children
            .iter()
            .map(|&c| (tree[c].name.as_str(), FileKind::Dir));
        files.chain(links).chain(dirs).collect()
    }
}

/// One regular file of the source.
pub(super) struct LocalFile {
    /// Its name in its directory.
    pub name: String,
    /// Where it is.
    pub path: PathBuf,
    /// Its size when walked.
    pub size: u64,
    /// Its mtime when walked.
    pub mtime: Timestamp,
}

/// Walks `src` (a directory). A name that is not UTF-8 is skipped with a warning (the
/// protocol carries names as UTF-8); any other failure to list or stat fails the walk,
/// since a snapshot missing part of the source would pass for a complete one.
pub(super) fn walk(src: &Path, filter: &Filter) -> Result<Vec<LocalDir>, ClientError> {
    let meta = fs::metadata(src).map_err(|e| ClientError::local(src, "cannot stat", e))?;
    let mut dirs = vec![local_dir(String::new(), String::new(), 0, &meta)];
    // Directories still to read: (index in `dirs`, path). Explicit, so that deep trees
    // cannot overflow the stack.
    let mut todo = vec![(0usize, src.to_path_buf())];
    while let Some((index, path)) = todo.pop() {
        let mut names: Vec<_> = fs::read_dir(&path)
            .map_err(|e| ClientError::local(&path, "cannot list", e))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| ClientError::local(&path, "cannot list", e))?;
        names.sort();
        for name in names {
            let child = path.join(&name);
            let Some(name) = name.to_str() else {
                tracing::warn!(path = %child.display(), "skipping a name that is not UTF-8");
                continue;
            };
            let meta = fs::symlink_metadata(&child)
                .map_err(|e| ClientError::local(&child, "cannot stat", e))?;
            let rel = join(&dirs[index].rel, name);
            if filter.excludes(&rel, meta.is_dir()) {
                continue;
            }
            if meta.is_dir() {
                let sub = dirs.len();
                let depth = dirs[index].depth + 1;
                dirs.push(local_dir(rel, name.to_string(), depth, &meta));
                dirs[index].children.push(sub);
                todo.push((sub, child));
            } else if meta.file_type().is_symlink() {
                let target = fs::read_link(&child)
                    .map_err(|e| ClientError::local(&child, "cannot read the link", e))?;
                dirs[index]
                    .symlinks
                    .push((name.to_string(), target.to_string_lossy().into_owned()));
            } else if meta.is_file() {
                dirs[index].files.push(LocalFile {
                    name: name.to_string(),
                    path: child,
                    size: meta.len(),
                    mtime: attr_of(&meta, None).mtime,
                });
            }
        }
    }
    Ok(dirs)
}

fn local_dir(rel: String, name: String, depth: usize, meta: &fs::Metadata) -> LocalDir {
    LocalDir {
        rel,
        name,
        depth,
        mode: meta.mode() & 0o7777,
        mtime: attr_of(meta, None).mtime,
        children: Vec::new(),
        files: Vec::new(),
        symlinks: Vec::new(),
    }
}
