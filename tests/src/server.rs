//! Locating the binaries and running a real `ferryd` process.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::user::User;

/// How long [`Server::start`] waits for ferryd's port file before giving up.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

/// How often [`Server::start`] looks for the port file.
const PORT_FILE_POLL: Duration = Duration::from_millis(20);

/// The directory holding the `ferryd` and `rcp` binaries.
///
/// `$FERRY_BIN_DIR` if set, else two levels above the running test executable
/// (`target/debug/deps/<test>` -> `target/debug`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERRY_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("cannot find the test executable's path");
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("no directory two levels above {}", exe.display()))
}

/// The path of binary `name` in [`bin_dir`]; panics with instructions if it is missing.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    if !path.is_file() {
        panic!(
            "binary `{name}` not found at {}: run `cargo build --workspace --bins` first \
             (or point FERRY_BIN_DIR at the directory holding ferryd and rcp)",
            path.display()
        );
    }
    path
}

/// Sets the environment every test ferryd runs with: `FERRY_TRANSPORT` (the test
/// transport; `auto` under the RDMA suite, where ferryd serves both transports because
/// the in-process protocol tests speak TCP and rcp is forced onto RDMA by its own
/// environment), `FERRYD_SECRET` ([`crate::TEST_SECRET`]) and `FERRYD_ENCRYPTION`.
pub(crate) fn set_ferryd_env(cmd: &mut Command) {
    let transport = match crate::test_transport() {
        "rdma" => "auto",
        other => other,
    };
    cmd.env("FERRY_TRANSPORT", transport)
        .env("FERRYD_SECRET", crate::TEST_SECRET)
        // Shares accept sessions in the clear as well: the raw clients of the
        // protocol tests speak the clear protocol. rcp and ferry-mount still
        // encrypt every session (they prefer it, and so does ferryd); the
        // default `required` is tested by tests/tests/encryption.rs, which
        // removes this.
        .env("FERRYD_ENCRYPTION", "preferred");
    for key in crate::rcp::ETCD_ENV {
        cmd.env_remove(key);
    }
}

/// Polls (at most [`STARTUP_TIMEOUT`]) for the port file of the ferryd `child`, whose
/// stderr goes to `log_path`, and returns the address in it. A file without its
/// trailing newline is still being written (ferryd renames it into place, but be
/// tolerant of a plain write). Fails if ferryd exits first (with its stderr) or the
/// file never appears.
pub(crate) fn wait_for_port_file(
    port_file: &Path,
    child: &mut Child,
    log_path: &Path,
) -> Result<String, String> {
    let start = Instant::now();
    loop {
        if let Ok(text) = fs::read_to_string(port_file) {
            if text.ends_with('\n') && !text.trim().is_empty() {
                return Ok(text.trim().to_owned());
            }
        }
        if let Some(status) = child.try_wait().expect("cannot poll ferryd") {
            return Err(format!(
                "ferryd exited with {status} before writing its port file; stderr:\n{}",
                read_log(log_path)
            ));
        }
        if start.elapsed() > STARTUP_TIMEOUT {
            return Err(format!(
                "ferryd did not write its port file {} within {:?}",
                port_file.display(),
                STARTUP_TIMEOUT
            ));
        }
        thread::sleep(PORT_FILE_POLL);
    }
}

/// A process's captured log, or why it cannot be read (for failure messages).
pub(crate) fn read_log(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| format!("<cannot read log: {e}>"))
}

/// One `--share NAME=PATH[:ro]` argument of ferryd.
#[derive(Debug, Clone)]
pub struct Share {
    /// The share's name, as used in `host:NAME/path`.
    pub name: String,
    /// The exported directory.
    pub path: PathBuf,
    /// Whether the share is exported read-only (`:ro`).
    pub read_only: bool,
}

impl Share {
    /// A read-write share `name` exporting `path`.
    pub fn rw(name: &str, path: impl Into<PathBuf>) -> Share {
        Share {
            name: name.to_owned(),
            path: path.into(),
            read_only: false,
        }
    }

    /// A read-only share `name` exporting `path`.
    pub fn ro(name: &str, path: impl Into<PathBuf>) -> Share {
        Share {
            read_only: true,
            ..Share::rw(name, path)
        }
    }

    pub(crate) fn arg(&self) -> OsString {
        let mut arg = OsString::from(&self.name);
        arg.push("=");
        arg.push(&self.path);
        if self.read_only {
            arg.push(":ro");
        }
        arg
    }
}

/// What [`Server::start_with`] may change.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// Run ferryd as this user.
    pub user: Option<User>,
    /// Arguments added after the harness's own.
    pub args: Vec<OsString>,
    /// Environment variables to set (`Some`) or remove (`None`).
    pub env: Vec<(String, Option<String>)>,
    /// `--listen` this `ADDR:PORT` instead of the test host's port 0.
    pub listen: Option<String>,
}

/// A running `ferryd` on [`crate::test_host`] (`127.0.0.1` by default) with an
/// ephemeral port.
///
/// Dropping it SIGKILLs and reaps the process; if the current thread is panicking, the
/// drop also prints ferryd's captured stderr so the failing test shows the server log.
/// [`Server::restart`] kills it and starts another ferryd on the same shares.
#[derive(Debug)]
pub struct Server {
    child: Mutex<Child>,
    /// The ferryd binary it runs (and a [`Server::restart`] runs again).
    program: PathBuf,
    addr: String,
    log_path: PathBuf,
    shares: Vec<Share>,
    opts: ServerOptions,
    /// Holds the port file and the log; removed after the process is gone.
    _state: TempDir,
}

impl Server {
    /// Starts `ferryd --listen HOST:0 --port-file <tmp>/port --share ...` and waits
    /// (at most [`STARTUP_TIMEOUT`]) until the port file appears.
    ///
    /// Panics if ferryd exits early or the port file never appears.
    pub fn start(shares: &[Share]) -> Server {
        Server::start_as(shares, None)
    }

    /// [`Server::start`], with ferryd running as `user` when one is given (its port
    /// file's directory is given to that user; the shares must be reachable by it).
    pub fn start_as(shares: &[Share], user: Option<User>) -> Server {
        Server::start_with(
            shares,
            ServerOptions {
                user,
                ..ServerOptions::default()
            },
        )
    }

    /// [`Server::start`] with more options: a user, extra arguments, and changes to
    /// ferryd's environment (applied after the harness's own, so they win).
    pub fn start_with(shares: &[Share], opts: ServerOptions) -> Server {
        Server::try_start_with(shares, opts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Server::start_with`], returning why ferryd did not come up (it exited first,
    /// with its stderr, or never wrote its port file) instead of panicking.
    pub fn try_start_with(shares: &[Share], opts: ServerOptions) -> Result<Server, String> {
        Server::try_start_binary(&bin("ferryd"), shares, opts)
    }

    /// [`Server::start_with`], running the ferryd binary at `program` instead of the
    /// one in [`bin_dir`] (another release's, for the compatibility tests); a
    /// [`Server::restart`] runs the same binary again.
    pub fn start_binary(program: &Path, shares: &[Share], opts: ServerOptions) -> Server {
        Server::try_start_binary(program, shares, opts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Server::try_start_with`], running the ferryd binary at `program`.
    pub fn try_start_binary(
        program: &Path,
        shares: &[Share],
        opts: ServerOptions,
    ) -> Result<Server, String> {
        let user = opts.user;
        let opts = opts.clone();
        let state = tempfile::Builder::new()
            .prefix("ferryd-")
            .tempdir()
            .expect("cannot create ferryd's temp dir");
        if let Some(user) = user {
            user.own(state.path());
        }
        let port_file = state.path().join("port");
        let log_path = state.path().join("ferryd.stderr");
        let log = File::create(&log_path).expect("cannot create ferryd's log file");

        let mut cmd = Command::new(program);
        let listen = (opts.listen.clone()).unwrap_or_else(|| format!("{}:0", crate::test_host()));
        cmd.arg("--listen")
            .arg(listen)
            .arg("--port-file")
            .arg(&port_file);
        set_ferryd_env(&mut cmd);
        for share in shares {
            cmd.arg("--share").arg(share.arg());
        }
        cmd.args(&opts.args);
        for (key, value) in &opts.env {
            match value {
                Some(v) => cmd.env(key, v),
                None => cmd.env_remove(key),
            };
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if let Some(user) = user {
            user.apply(&mut cmd);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd));

        let mut server = Server {
            child: Mutex::new(child),
            program: program.to_path_buf(),
            addr: String::new(),
            log_path,
            shares: shares.to_vec(),
            opts,
            _state: state,
        };
        server.addr = server.wait_for_port_file(&port_file)?;
        Ok(server)
    }

    fn wait_for_port_file(&self, port_file: &Path) -> Result<String, String> {
        wait_for_port_file(port_file, &mut self.child(), &self.log_path)
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Child> {
        self.child
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The names of the shares it serves.
    pub fn share_names(&self) -> Vec<String> {
        self.shares.iter().map(|s| s.name.clone()).collect()
    }

    /// The listening address, e.g. `127.0.0.1:41234`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The port ferryd listens on.
    pub fn port(&self) -> u16 {
        self.addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in ferryd's address {}", self.addr))
    }

    /// The ferryd process's id (for [`crate::proc_status`] and [`crate::open_fds`]).
    pub fn pid(&self) -> u32 {
        self.child().id()
    }

    /// The rcp remote argument for `path` in `share`: `127.0.0.1:PORT:share/path`
    /// (`127.0.0.1:PORT:share` when `path` is empty). `path` is used verbatim, so a
    /// trailing `/` or a `..` stays in.
    pub fn remote(&self, share: &str, path: &str) -> String {
        if path.is_empty() {
            format!("{}:{share}", self.addr)
        } else {
            format!("{}:{share}/{path}", self.addr)
        }
    }

    /// Everything ferryd has written to stderr so far.
    pub fn stderr(&self) -> String {
        read_log(&self.log_path)
    }

    /// SIGKILLs ferryd now (it gets no chance to clean up) and reaps it.
    pub fn kill(&self) {
        let mut child = self.child();
        // Ignoring errors: the process may have exited already.
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGKILLs this ferryd and starts another on the same shares with the same
    /// options, plus `extra` arguments; it listens on a new port ([`Server::addr`] and
    /// [`Server::remote`] follow) and logs to a new [`Server::stderr`].
    pub fn restart<S: AsRef<OsStr>>(&mut self, extra: &[S]) {
        self.kill();
        let mut opts = self.opts.clone();
        opts.args
            .extend(extra.iter().map(|a| a.as_ref().to_os_string()));
        *self = Server::start_binary(&self.program, &self.shares, opts);
    }

    /// [`Server::restart`], running the ferryd binary at `program` from now on: what
    /// an upgrade (or a downgrade) of the server does to the same shares, their
    /// partial files and manifest store.
    pub fn restart_binary<S: AsRef<OsStr>>(&mut self, program: &Path, extra: &[S]) {
        self.program = program.to_path_buf();
        self.restart(extra);
    }

    /// The ferryd binary this server runs.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// Waits up to `timeout` until ferryd's stderr holds `needle` at least `times`
    /// times; returns whether it did.
    pub fn wait_for_log(&self, needle: &str, times: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.stderr().matches(needle).count() >= times {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            thread::sleep(PORT_FILE_POLL);
        }
    }

    /// Lines of ferryd's stderr that contain `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.stderr().lines().filter(|l| l.contains(needle)).count()
    }

    /// Waits up to `limit` for the ferryd process to exit (after a signal); returns
    /// its status, or `None` if it is still running.
    pub fn wait_for_exit(&self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child().try_wait().expect("cannot poll ferryd") {
                return Some(status);
            }
            if start.elapsed() > limit {
                return None;
            }
            thread::sleep(PORT_FILE_POLL);
        }
    }

    /// Panics (with ferryd's stderr) if the ferryd process has exited.
    #[track_caller]
    pub fn assert_running(&self) {
        let status = self.child().try_wait().expect("cannot poll ferryd");
        if let Some(status) = status {
            panic!(
                "ferryd exited unexpectedly with {status}; stderr:\n{}",
                self.stderr()
            );
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let mut child = self.child();
        // Ignoring errors: the process may have exited already, and a drop cannot fail.
        let _ = child.kill();
        let _ = child.wait();
        drop(child);
        if thread::panicking() {
            eprintln!(
                "----- ferryd {} stderr -----\n{}----- end of ferryd stderr -----",
                self.addr,
                self.stderr()
            );
        }
    }
}
