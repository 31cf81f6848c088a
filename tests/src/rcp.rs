//! Running the real `rcp` binary with a time limit and checking what it returned.

use std::ffi::OsStr;
use std::fmt;
use std::io::Read;
use std::path::Path;
use std::process::{Child, ChildStderr, ChildStdout, Command, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::server::bin;
use crate::user::User;

/// The longest one `rcp` run may take before it is killed and the test fails.
pub const RCP_TIMEOUT: Duration = Duration::from_secs(120);

/// How often a waiting [`RcpChild`] polls the process.
const WAIT_POLL: Duration = Duration::from_millis(10);

/// Runs `rcp ARGS...` to completion (at most [`RCP_TIMEOUT`]).
pub fn rcp<I, S>(args: I) -> RcpOutput
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_rcp(args).wait()
}

/// Starts `rcp ARGS...` without waiting, with stdin closed and stdout/stderr captured.
/// Call [`RcpChild::wait`] to collect the result; dropping it kills the process.
pub fn spawn_rcp<I, S>(args: I) -> RcpChild
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_rcp_as(None, args)
}

/// [`spawn_rcp`], with rcp running as `user` when one is given.
pub fn spawn_rcp_as<I, S>(user: Option<User>, args: I) -> RcpChild
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_rcp_env(user, &[], args)
}

/// Runs `rcp ARGS...` to completion with changes to its environment: each
/// `(KEY, Some(VALUE))` is set and each `(KEY, None)` removed, after the harness's own
/// settings (so `("FERRY_SECRET", None)` runs rcp without the test secret).
pub fn rcp_env<I, S>(env: &[(&str, Option<&str>)], args: I) -> RcpOutput
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_rcp_env(None, env, args).wait()
}

/// [`spawn_rcp_as`] with the environment changes of [`rcp_env`].
pub fn spawn_rcp_env<I, S>(user: Option<User>, env: &[(&str, Option<&str>)], args: I) -> RcpChild
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_program("rcp", &bin("rcp"), user, env, args)
}

/// Runs the rcp binary at `program` (another release's, for the compatibility tests)
/// with `ARGS...` to completion, as [`rcp()`] runs the one in [`crate::bin_dir`].
pub fn rcp_binary<I, S>(program: &Path, args: I) -> RcpOutput
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_rcp_binary(program, args).wait()
}

/// [`spawn_rcp`] of the rcp binary at `program`.
pub fn spawn_rcp_binary<I, S>(program: &Path, args: I) -> RcpChild
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_program("rcp", program, None, &[], args)
}

/// The environment variables of the etcd options, which no test inherits.
pub const ETCD_ENV: [&str; 6] = [
    "FERRY_CLUSTER_CONFIG",
    "FERRY_ETCD_CA",
    "FERRY_ETCD_CERT",
    "FERRY_ETCD_KEY",
    "FERRY_ETCD_USER",
    "FERRY_ETCD_PASSWORD_FILE",
];

/// Starts the Ferry client program at `program` (`rcp`, or `ferry`; `name` is how
/// messages call it) with `ARGS...` as [`spawn_rcp_env`] starts rcp: the test transport
/// and [`crate::TEST_SECRET`] in its environment, then the changes of `env`.
pub(crate) fn spawn_program<I, S>(
    name: &'static str,
    program: &Path,
    user: Option<User>,
    env: &[(&str, Option<&str>)],
    args: I,
) -> RcpChild
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect();
    let mut cmd = Command::new(program);
    cmd.args(&args)
        .env("FERRY_TRANSPORT", crate::test_transport())
        .env("FERRY_SECRET", crate::TEST_SECRET)
        .env_remove("FERRY_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // etcd settings come only from the test's arguments and `env`.
    for key in ETCD_ENV {
        cmd.env_remove(key);
    }
    for (key, value) in env {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    if let Some(user) = user {
        user.apply(&mut cmd);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name} {args:?}: {e}"));
    let stdout = child.stdout.take().map(drain::<ChildStdout>);
    let stderr = child.stderr.take().map(drain::<ChildStderr>);
    RcpChild {
        child,
        name,
        args,
        start: Instant::now(),
        stdout,
        stderr,
    }
}

/// Reads a pipe to its end on a thread, so a chatty child never blocks on a full pipe.
fn drain<R: Read + Send + 'static>(mut pipe: R) -> JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        // A read error only truncates the captured text; the exit status still counts.
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}

/// An `rcp` process started by [`spawn_rcp`] (or a `ferry` one, [`crate::ferry`]).
#[derive(Debug)]
pub struct RcpChild {
    child: Child,
    name: &'static str,
    args: Vec<String>,
    start: Instant,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

impl RcpChild {
    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit, at most [`RCP_TIMEOUT`] after it started; on
    /// timeout, kills it and panics with what it printed so far.
    #[track_caller]
    pub fn wait(self) -> RcpOutput {
        self.wait_at_most(RCP_TIMEOUT)
    }

    /// [`RcpChild::wait`] with its own time limit, counted from the start.
    #[track_caller]
    pub fn wait_at_most(mut self, limit: Duration) -> RcpOutput {
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return self.collect(),
                Ok(None) if self.start.elapsed() > limit => {
                    let _ = self.child.kill();
                    let out = self.collect();
                    panic!(
                        "{} ran longer than {limit:?} and was killed\n{out}",
                        self.name
                    );
                }
                Ok(None) => thread::sleep(WAIT_POLL),
                Err(e) => panic!("cannot wait for {} {:?}: {e}", self.name, self.args),
            }
        }
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILLs the process now and returns what it printed.
    pub fn kill(mut self) -> RcpOutput {
        let _ = self.child.kill();
        self.collect()
    }

    fn collect(&mut self) -> RcpOutput {
        let status = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("cannot wait for {} {:?}: {e}", self.name, self.args));
        let elapsed = self.start.elapsed();
        let text = |h: Option<JoinHandle<Vec<u8>>>| {
            h.map(|h| String::from_utf8_lossy(&h.join().unwrap_or_default()).into_owned())
                .unwrap_or_default()
        };
        RcpOutput {
            program: self.name,
            args: self.args.clone(),
            code: status.code(),
            stdout: text(self.stdout.take()),
            stderr: text(self.stderr.take()),
            elapsed,
        }
    }
}

impl Drop for RcpChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What one run of a Ferry program (`rcp`, `ferry-mount`) returned.
#[derive(Debug, Clone)]
pub struct ProgramOutput {
    /// The program's name, for messages.
    pub program: &'static str,
    /// The arguments it ran with (lossy UTF-8, for messages).
    pub args: Vec<String>,
    /// The exit code; `None` if a signal ended it.
    pub code: Option<i32>,
    /// Everything printed on stdout.
    pub stdout: String,
    /// Everything printed on stderr.
    pub stderr: String,
    /// Wall time from spawn to exit.
    pub elapsed: Duration,
}

/// What one `rcp` run returned.
pub type RcpOutput = ProgramOutput;

impl fmt::Display for ProgramOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "command: {} {}", self.program, self.args.join(" "))?;
        writeln!(f, "exit code: {:?} after {:?}", self.code, self.elapsed)?;
        writeln!(f, "--- stdout ---\n{}", self.stdout)?;
        write!(f, "--- stderr ---\n{}", self.stderr)
    }
}

impl ProgramOutput {
    /// Panics unless rcp exited 0.
    #[track_caller]
    pub fn assert_success(&self) -> &Self {
        self.assert_code(0)
    }

    /// Panics unless rcp exited with `code`.
    #[track_caller]
    pub fn assert_code(&self, code: i32) -> &Self {
        if self.code != Some(code) {
            panic!("expected {} to exit {code}\n{self}", self.program);
        }
        self
    }

    /// Panics unless rcp exited with one of `codes`.
    #[track_caller]
    pub fn assert_code_in(&self, codes: &[i32]) -> &Self {
        if !self.code.is_some_and(|c| codes.contains(&c)) {
            panic!(
                "expected {} to exit with one of {codes:?}\n{self}",
                self.program
            );
        }
        self
    }

    /// Panics unless rcp exited with a code other than 0 (a signal does not count).
    #[track_caller]
    pub fn assert_failure(&self) -> &Self {
        if !matches!(self.code, Some(c) if c != 0) {
            panic!(
                "expected {} to fail with a nonzero exit code\n{self}",
                self.program
            );
        }
        self
    }

    /// Panics unless stderr, lowercased, contains at least one of `needles` (which are
    /// lowercased too).
    #[track_caller]
    pub fn assert_stderr_has_any(&self, needles: &[&str]) -> &Self {
        let stderr = self.stderr.to_lowercase();
        if !needles.iter().any(|n| stderr.contains(&n.to_lowercase())) {
            panic!(
                "expected {}'s stderr to mention one of {needles:?}\n{self}",
                self.program
            );
        }
        self
    }

    /// Panics unless stderr contains `needle` exactly (case-sensitive: for paths).
    #[track_caller]
    pub fn assert_stderr_has(&self, needle: &str) -> &Self {
        if !self.stderr.contains(needle) {
            panic!(
                "expected {}'s stderr to contain {needle:?}\n{self}",
                self.program
            );
        }
        self
    }

    /// Panics unless stderr has a line in the contract's error format,
    /// `rcp: PATH: CAUSE`, for exactly this `path` (the argument as given on the command
    /// line), whose CAUSE, lowercased, contains one of `causes` (any CAUSE if empty).
    #[track_caller]
    pub fn assert_error_line(&self, path: impl AsRef<Path>, causes: &[&str]) -> &Self {
        let prefix = format!("rcp: {}: ", path.as_ref().display());
        let found = self.stderr.lines().any(|line| {
            line.strip_prefix(&prefix).is_some_and(|cause| {
                let cause = cause.to_lowercase();
                causes.is_empty() || causes.iter().any(|w| cause.contains(&w.to_lowercase()))
            })
        });
        if !found {
            panic!("expected a stderr line `{prefix}CAUSE` with CAUSE mentioning one of {causes:?}\n{self}");
        }
        self
    }

    /// Parses stdout as exactly one JSON object on one line (the `--json` summary).
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        let lines: Vec<&str> = self
            .stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        if lines.len() != 1 {
            panic!(
                "expected exactly one JSON line on stdout, got {}\n{self}",
                lines.len()
            );
        }
        let value: serde_json::Value = serde_json::from_str(lines[0])
            .unwrap_or_else(|e| panic!("stdout is not JSON: {e}\n{self}"));
        if !value.is_object() {
            panic!("the JSON on stdout is not an object\n{self}");
        }
        value
    }
}
