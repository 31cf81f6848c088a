//! The per-test environment: a temp dir with a local side and served shares.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use crate::rcp::{rcp, RcpOutput};
use crate::server::{Server, Share};

/// The share every [`Env::new`] serves, read-write.
pub const DEFAULT_SHARE: &str = "data";

/// A test's world: `<tmp>/local/` for rcp's local side, `<tmp>/shares/<name>/` for each
/// share, and a [`Server`] exporting them.
///
/// Dropping it stops the server first, then removes the temp dir.
#[derive(Debug)]
pub struct Env {
    // Field order is drop order: the server goes before its directories.
    server: Server,
    root: TempDir,
}

impl Env {
    /// An environment serving one read-write share, [`DEFAULT_SHARE`].
    pub fn new() -> Env {
        Env::with_shares(&[(DEFAULT_SHARE, false)])
    }

    /// An environment serving the `(name, read_only)` shares, each from an empty
    /// directory `<tmp>/shares/<name>`.
    pub fn with_shares(shares: &[(&str, bool)]) -> Env {
        let root = tempfile::Builder::new()
            .prefix("ferry-test-")
            .tempdir()
            .expect("cannot create the test's temp dir");
        fs::create_dir(root.path().join("local")).expect("mkdir local");
        fs::create_dir(root.path().join("shares")).expect("mkdir shares");
        let shares: Vec<Share> = shares
            .iter()
            .map(|&(name, read_only)| {
                let path = root.path().join("shares").join(name);
                fs::create_dir(&path).expect("mkdir share");
                if read_only {
                    Share::ro(name, path)
                } else {
                    Share::rw(name, path)
                }
            })
            .collect();
        let server = Server::start(&shares);
        Env { server, root }
    }

    /// The temp dir holding everything.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// The server.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// `<tmp>/local/<rel>` (`rel` may be empty).
    pub fn local(&self, rel: &str) -> PathBuf {
        self.root().join("local").join(rel)
    }

    /// The directory that share `name` exports: `<tmp>/shares/<name>`.
    pub fn share_dir(&self, name: &str) -> PathBuf {
        self.root().join("shares").join(name)
    }

    /// `<rel>` inside the [`DEFAULT_SHARE`] directory, on the server's disk.
    pub fn share(&self, rel: &str) -> PathBuf {
        self.share_dir(DEFAULT_SHARE).join(rel)
    }

    /// The rcp argument for `rel` in [`DEFAULT_SHARE`]: `127.0.0.1:PORT:data/rel`.
    pub fn remote(&self, rel: &str) -> String {
        self.server.remote(DEFAULT_SHARE, rel)
    }

    /// The rcp argument for `rel` in share `name`.
    pub fn remote_in(&self, name: &str, rel: &str) -> String {
        self.server.remote(name, rel)
    }

    /// Runs rcp with `args` (see [`rcp()`]).
    pub fn rcp<I, S>(&self, args: I) -> RcpOutput
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        rcp(args)
    }
}

impl Default for Env {
    fn default() -> Env {
        Env::new()
    }
}
