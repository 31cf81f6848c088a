//! The per-test environment: a temp dir with a local side and served shares.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use crate::rcp::{spawn_rcp_as, RcpOutput};
use crate::server::{Server, ServerOptions, Share};
use crate::tmpfs::Tmpfs;
use crate::user::{open_dir_to_all, User};

/// The share every [`Env::new`] serves, read-write.
pub const DEFAULT_SHARE: &str = "data";

/// A test's world: `<tmp>/local/` for rcp's local side, `<tmp>/shares/<name>/` for each
/// share, and a [`Server`] exporting them.
///
/// Dropping it stops the server first, then unmounts the tmpfs file systems of
/// [`EnvBuilder::tmpfs`], then removes the temp dir.
#[derive(Debug)]
pub struct Env {
    // Field order is drop order: the server goes before its file systems and
    // directories.
    server: Server,
    mounts: Vec<(String, Tmpfs)>,
    root: TempDir,
    rcp_user: Option<User>,
}

/// Builds an [`Env`] that needs more than [`Env::with_shares`]: a share on a small
/// tmpfs, or ferryd or rcp running as an unprivileged [`User`].
#[derive(Debug, Default)]
pub struct EnvBuilder {
    shares: Vec<(String, bool)>,
    tmpfs: Vec<(String, u64)>,
    server_user: Option<User>,
    rcp_user: Option<User>,
    server_args: Vec<std::ffi::OsString>,
    server_env: Vec<(String, Option<String>)>,
    server_program: Option<PathBuf>,
}

impl EnvBuilder {
    /// Adds an argument to ferryd's command line.
    pub fn server_arg(mut self, arg: impl Into<std::ffi::OsString>) -> Self {
        self.server_args.push(arg.into());
        self
    }

    /// Sets (`Some`) or removes (`None`) a variable of ferryd's environment, after the
    /// harness's own (so `("FERRYD_SECRET", None)` starts ferryd without the test
    /// secret).
    pub fn server_env(mut self, key: &str, value: Option<&str>) -> Self {
        self.server_env
            .push((key.to_owned(), value.map(str::to_owned)));
        self
    }

    /// Runs the ferryd binary at `program` instead of the one in [`crate::bin_dir`]
    /// (another release's, for the compatibility tests; see
    /// [`Server::restart_binary`] to change it later).
    pub fn server_binary(mut self, program: impl Into<PathBuf>) -> Self {
        self.server_program = Some(program.into());
        self
    }

    /// Serves share `name` (read-only if `read_only`). Without any, the environment
    /// serves [`DEFAULT_SHARE`], read-write.
    pub fn share(mut self, name: &str, read_only: bool) -> Self {
        self.shares.push((name.to_owned(), read_only));
        self
    }

    /// Mounts a tmpfs of `size_bytes` on share `name`'s directory before ferryd starts
    /// (see [`Tmpfs`]); [`EnvBuilder::start`] panics if that fails, so check
    /// [`Tmpfs::available`] first. `name` must be a served share.
    pub fn tmpfs(mut self, name: &str, size_bytes: u64) -> Self {
        self.tmpfs.push((name.to_owned(), size_bytes));
        self
    }

    /// Runs ferryd as `user`: the temp dir can be entered by all and every share
    /// directory belongs to `user` (its files keep their owner).
    pub fn server_user(mut self, user: User) -> Self {
        self.server_user = Some(user);
        self
    }

    /// Runs [`Env::rcp`] as `user`: the temp dir can be entered by all and `local/`
    /// belongs to `user`.
    pub fn rcp_user(mut self, user: User) -> Self {
        self.rcp_user = Some(user);
        self
    }

    /// Creates the directories, mounts, and starts ferryd.
    pub fn start(self) -> Env {
        let root = tempfile::Builder::new()
            .prefix("ferry-test-")
            .tempdir()
            .expect("cannot create the test's temp dir");
        // Declared after `root`, so a panic below unmounts before the dir is removed.
        let mut mounts = Vec::new();
        fs::create_dir(root.path().join("local")).expect("mkdir local");
        fs::create_dir(root.path().join("shares")).expect("mkdir shares");
        let mut shares = self.shares;
        if shares.is_empty() {
            shares.push((DEFAULT_SHARE.to_owned(), false));
        }
        for (name, size) in &self.tmpfs {
            assert!(
                shares.iter().any(|(n, _)| n == name),
                "tmpfs for {name}, which is not a share"
            );
            let path = root.path().join("shares").join(name);
            let tmpfs = Tmpfs::mount(&path, *size).unwrap_or_else(|e| panic!("{e}"));
            mounts.push((name.clone(), tmpfs));
        }
        let shares: Vec<Share> = shares
            .iter()
            .map(|(name, read_only)| {
                let path = root.path().join("shares").join(name);
                if !path.exists() {
                    fs::create_dir(&path).expect("mkdir share");
                }
                if let Some(user) = self.server_user {
                    user.own(&path);
                }
                if *read_only {
                    Share::ro(name, path)
                } else {
                    Share::rw(name, path)
                }
            })
            .collect();
        if self.server_user.is_some() || self.rcp_user.is_some() {
            open_dir_to_all(root.path());
            open_dir_to_all(&root.path().join("shares"));
        }
        if let Some(user) = self.rcp_user {
            user.own(&root.path().join("local"));
        }
        let opts = ServerOptions {
            user: self.server_user,
            args: self.server_args,
            env: self.server_env,
            listen: None,
        };
        let server = match &self.server_program {
            Some(program) => Server::start_binary(program, &shares, opts),
            None => Server::start_with(&shares, opts),
        };
        Env {
            server,
            mounts,
            root,
            rcp_user: self.rcp_user,
        }
    }
}

impl Env {
    /// An environment serving one read-write share, [`DEFAULT_SHARE`].
    pub fn new() -> Env {
        Env::with_shares(&[(DEFAULT_SHARE, false)])
    }

    /// An environment serving the `(name, read_only)` shares, each from an empty
    /// directory `<tmp>/shares/<name>`.
    pub fn with_shares(shares: &[(&str, bool)]) -> Env {
        shares
            .iter()
            .fold(Env::builder(), |b, &(name, ro)| b.share(name, ro))
            .start()
    }

    /// A builder for environments with tmpfs shares or unprivileged programs.
    pub fn builder() -> EnvBuilder {
        EnvBuilder::default()
    }

    /// The tmpfs mounted on share `name` by [`EnvBuilder::tmpfs`]; panics if none.
    pub fn tmpfs(&self, name: &str) -> &Tmpfs {
        self.mounts
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .unwrap_or_else(|| panic!("share {name} has no tmpfs"))
    }

    /// The temp dir holding everything.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// The server.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// The server, to [`Server::restart`] it.
    pub fn server_mut(&mut self) -> &mut Server {
        &mut self.server
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

    /// Runs rcp with `args` (see [`crate::rcp()`]), as the [`EnvBuilder::rcp_user`] if
    /// one was set.
    pub fn rcp<I, S>(&self, args: I) -> RcpOutput
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        spawn_rcp_as(self.rcp_user, args).wait()
    }
}

impl Default for Env {
    fn default() -> Env {
        Env::new()
    }
}
