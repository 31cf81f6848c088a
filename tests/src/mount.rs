//! Running the real `ferry-mount` binary: a read-only FUSE mount of a share.
//!
//! [`Mount::builder`] spawns `ferry-mount -f [-o OPTS]... REMOTE <tmp>/mnt` with stderr
//! in `<tmp>/ferry-mount.stderr` and `FERRY_TRANSPORT` set to [`crate::test_transport`],
//! then waits (at most [`MOUNT_TIMEOUT`]) until `<tmp>/mnt` shows in
//! `/proc/self/mountinfo` as a FUSE mount. A process that exits before that is a failed
//! mount ([`MountFailed`]). The contract's exact type, [`FSTYPE`], is left to a test of
//! its own, so the other tests still run when only the type is wrong.
//!
//! Stopping ([`Mount::unmount`], or dropping the [`Mount`]) sends SIGTERM and waits
//! (at most [`UNMOUNT_TIMEOUT`]) for the process to exit and the mount to go; if
//! either does not happen it falls back to `umount -l` and SIGKILL. The temporary
//! directory is removed only once nothing is mounted on it, so a cleanup never walks
//! into a live mount. When the test is panicking, the drop prints the mount's stderr.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::server::bin;

/// The file system type a ready ferry mount shows in `/proc/self/mountinfo`.
pub const FSTYPE: &str = "fuse.ferry";

/// How long [`MountBuilder::start`] waits for the mount to appear.
pub const MOUNT_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a stop waits for `ferry-mount` to exit after SIGTERM (and a mount run by
/// [`ferry_mount`] to finish) before it is killed.
pub const UNMOUNT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the harness polls the process and the mount table.
const POLL: Duration = Duration::from_millis(20);

/// The name of the mount's log inside its temp dir.
const LOG_NAME: &str = "ferry-mount.stderr";

/// Whether `path` (absolute, canonical) is a mount point in `/proc/self/mountinfo`;
/// `Some(fstype)` of the topmost mount there.
pub fn mount_type(path: &Path) -> Option<String> {
    let table = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    let want = path.to_str()?;
    let mut found = None;
    for line in table.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.len() > dash + 1 && fields.len() > 4 && unescape(fields[4]) == want {
            found = Some(fields[dash + 1].to_owned());
        }
    }
    found
}

/// Whether `fstype` (a mountinfo type field) is a FUSE file system.
pub fn is_fuse_type(fstype: &str) -> bool {
    fstype == "fuse" || fstype.starts_with("fuse.")
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            let s = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(s, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `umount -l PATH`, ignoring the outcome (a cleanup step).
fn lazy_unmount(path: &Path) {
    let _ = Command::new("umount")
        .arg("-l")
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Sends `signal` (a `kill` name such as `TERM`) to `pid`; false if `kill` failed.
pub fn send_signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why FUSE mounts cannot be made here (`/dev/fuse` missing or not openable for
/// reading and writing, as in some containers), or `None` when they can. Probed once;
/// a test prints the reason when it skips.
pub fn fuse_unavailable() -> Option<String> {
    static PROBE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PROBE
        .get_or_init(|| {
            match fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/fuse")
            {
                Ok(_) => None,
                Err(e) => Some(format!("FUSE is unavailable: /dev/fuse: {e}")),
            }
        })
        .clone()
}

/// Prints why `test` is skipped and returns true when FUSE is unavailable
/// ([`fuse_unavailable`]). Under CI (`CI` set) FUSE is part of the machine the suite
/// needs, so a missing `/dev/fuse` fails the test instead of passing it as skipped.
pub fn skip_without_fuse(test: &str) -> bool {
    match fuse_unavailable() {
        None => false,
        Some(why) if std::env::var_os("CI").is_some() => {
            panic!("{test}: cannot run under CI: {why}")
        }
        Some(why) => {
            eprintln!("{test}: skipped: {why}");
            true
        }
    }
}

/// What [`Mount::builder`] starts `ferry-mount` with.
#[derive(Debug, Clone)]
pub struct MountBuilder {
    remote: String,
    args: Vec<OsString>,
    transport: String,
}

impl MountBuilder {
    /// Adds `-o OPTS` (comma-separated options, as given).
    pub fn opt(mut self, opts: &str) -> MountBuilder {
        self.args.push("-o".into());
        self.args.push(opts.into());
        self
    }

    /// Adds one raw argument before the remote and the mount point (e.g. `-v`).
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> MountBuilder {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Sets `FERRY_TRANSPORT` for the process (default: [`crate::test_transport`]).
    pub fn transport(mut self, transport: &str) -> MountBuilder {
        self.transport = transport.to_owned();
        self
    }

    /// Mounts; panics with the process's stderr if it fails.
    #[track_caller]
    pub fn start(self) -> Mount {
        match self.try_start() {
            Ok(mount) => mount,
            Err(failed) => panic!("ferry-mount failed to mount\n{failed}"),
        }
    }

    /// Mounts, or returns how the process ended if it exited before the mount was
    /// ready. Panics if neither happens within [`MOUNT_TIMEOUT`] (after cleaning up).
    pub fn try_start(self) -> Result<Mount, MountFailed> {
        let state = tempfile::Builder::new()
            .prefix("ferry-mount-")
            .tempdir()
            .expect("cannot create the mount's temp dir");
        let mountpoint = state.path().join("mnt");
        fs::create_dir(&mountpoint).expect("mkdir mount point");
        let mountpoint = mountpoint.canonicalize().expect("canonicalize mount point");
        let log_path = state.path().join(LOG_NAME);
        let log = File::create(&log_path).expect("cannot create the mount's log");

        let mut args: Vec<OsString> = vec!["-f".into()];
        args.extend(self.args.iter().cloned());
        args.push(self.remote.clone().into());
        args.push(mountpoint.clone().into_os_string());
        let mut cmd = Command::new(bin("ferry-mount"));
        cmd.args(&args)
            .env("FERRY_TRANSPORT", &self.transport)
            .env("FERRY_SECRET", crate::TEST_SECRET)
            .env_remove("FERRY_SECRET_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let mount = Mount {
            child: Mutex::new(child),
            mountpoint,
            log_path,
            remote: self.remote,
            args: args
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            stopped: None,
            state: Some(state),
        };
        let start = Instant::now();
        loop {
            if mount.is_mounted() {
                return Ok(mount);
            }
            if let Some(status) = mount.try_wait() {
                let failed = MountFailed {
                    args: mount.args.clone(),
                    code: status.code(),
                    stderr: mount.log(),
                    elapsed: start.elapsed(),
                };
                // Nothing is mounted; the drop only removes the temp dir.
                drop(mount);
                return Err(failed);
            }
            if start.elapsed() > MOUNT_TIMEOUT {
                let log = mount.log();
                let args = mount.args.join(" ");
                drop(mount);
                panic!(
                    "ferry-mount did not mount within {MOUNT_TIMEOUT:?} (killed)\n\
                     command: ferry-mount {args}\n--- stderr ---\n{log}"
                );
            }
            thread::sleep(POLL);
        }
    }
}

/// How a `ferry-mount` that never mounted ended.
#[derive(Debug, Clone)]
pub struct MountFailed {
    /// Its arguments (lossy UTF-8, for messages).
    pub args: Vec<String>,
    /// Its exit code; `None` if a signal ended it.
    pub code: Option<i32>,
    /// Everything it printed on stderr.
    pub stderr: String,
    /// Time from spawn to exit.
    pub elapsed: Duration,
}

impl fmt::Display for MountFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "command: ferry-mount {}", self.args.join(" "))?;
        writeln!(f, "exit code: {:?} after {:?}", self.code, self.elapsed)?;
        write!(f, "--- stderr ---\n{}", self.stderr)
    }
}

/// How a stopped mount ended.
#[derive(Debug, Clone)]
pub struct Stopped {
    /// The exit code; `None` if a signal ended the process (SIGKILL by the fallback).
    pub code: Option<i32>,
    /// Whether the process exited and the mount went away by themselves, without the
    /// `umount -l` / SIGKILL fallback.
    pub graceful: bool,
    /// Time from the stop request to the process's exit.
    pub elapsed: Duration,
}

/// A running `ferry-mount -f` with its file system mounted (see the module docs).
#[derive(Debug)]
pub struct Mount {
    child: Mutex<Child>,
    mountpoint: PathBuf,
    log_path: PathBuf,
    remote: String,
    args: Vec<String>,
    stopped: Option<Stopped>,
    /// Holds the mount point and the log; `None` once deliberately kept on disk.
    state: Option<TempDir>,
}

impl Mount {
    /// A builder mounting `remote` (`HOST:PORT:SHARE[/SUBDIR]`) with no options.
    pub fn builder(remote: impl Into<String>) -> MountBuilder {
        MountBuilder {
            remote: remote.into(),
            args: Vec::new(),
            transport: crate::test_transport().to_owned(),
        }
    }

    /// Mounts `remote` with the default options; panics if that fails.
    #[track_caller]
    pub fn start(remote: impl Into<String>) -> Mount {
        Mount::builder(remote).start()
    }

    /// The mount point (absolute and canonical).
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// `<mount point>/<rel>` (`rel` may be empty).
    pub fn join(&self, rel: &str) -> PathBuf {
        self.mountpoint.join(rel)
    }

    /// The remote argument it was started with.
    pub fn remote(&self) -> &str {
        &self.remote
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child().id()
    }

    /// Everything `ferry-mount` has written to stderr so far.
    pub fn log(&self) -> String {
        let mut text = String::new();
        match File::open(&self.log_path).and_then(|mut f| f.read_to_string(&mut text)) {
            Ok(_) => text,
            Err(e) => format!("<cannot read the mount's log: {e}>"),
        }
    }

    /// The lines of the log containing every one of `needles`.
    pub fn log_lines_with(&self, needles: &[&str]) -> Vec<String> {
        self.log()
            .lines()
            .filter(|line| needles.iter().all(|n| line.contains(n)))
            .map(str::to_owned)
            .collect()
    }

    /// Waits (at most `timeout`) for a log line containing every one of `needles`.
    pub fn wait_for_log_line(&self, needles: &[&str], timeout: Duration) -> Option<String> {
        let start = Instant::now();
        loop {
            if let Some(line) = self.log_lines_with(needles).into_iter().next() {
                return Some(line);
            }
            if start.elapsed() > timeout {
                return None;
            }
            thread::sleep(POLL);
        }
    }

    /// Whether the mount point shows a FUSE mount now (type `fuse` or `fuse.*`; the
    /// mount point is a fresh temp dir, so it is this process's).
    pub fn is_mounted(&self) -> bool {
        mount_type(&self.mountpoint).is_some_and(|t| is_fuse_type(&t))
    }

    /// The file system type the mount point shows now, if anything is mounted there.
    pub fn fstype(&self) -> Option<String> {
        mount_type(&self.mountpoint)
    }

    /// The exit status, if the process has exited.
    pub fn try_wait(&self) -> Option<ExitStatus> {
        self.child().try_wait().expect("cannot poll ferry-mount")
    }

    /// Waits at most `timeout` for the process to exit by itself.
    pub fn wait_for_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if start.elapsed() > timeout {
                return None;
            }
            thread::sleep(POLL);
        }
    }

    /// Waits at most `timeout` for the mount to disappear from the mount table.
    pub fn wait_for_unmount(&self, timeout: Duration) -> bool {
        let start = Instant::now();
        loop {
            if mount_type(&self.mountpoint).is_none() {
                return true;
            }
            if start.elapsed() > timeout {
                return false;
            }
            thread::sleep(POLL);
        }
    }

    /// Stops the mount with SIGTERM (see the module docs) and says how it ended. The
    /// temp dir is removed when the `Mount` is dropped.
    pub fn unmount(mut self) -> Stopped {
        self.stop()
    }

    fn child(&self) -> MutexGuard<'_, Child> {
        self.child
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn stop(&mut self) -> Stopped {
        if let Some(stopped) = &self.stopped {
            return stopped.clone();
        }
        let start = Instant::now();
        let mut status = self.try_wait();
        if status.is_none() {
            send_signal(self.pid(), "TERM");
            status = self.wait_for_exit(UNMOUNT_TIMEOUT);
        }
        let unmounted = self.wait_for_unmount(if status.is_some() {
            Duration::from_secs(2)
        } else {
            Duration::ZERO
        });
        let graceful = status.is_some() && unmounted;
        if !unmounted {
            lazy_unmount(&self.mountpoint);
        }
        if status.is_none() {
            let mut child = self.child();
            // Ignoring errors: it may have exited just now.
            let _ = child.kill();
            status = child.wait().ok();
        }
        let stopped = Stopped {
            code: status.and_then(|s| s.code()),
            graceful,
            elapsed: start.elapsed(),
        };
        self.stopped = Some(stopped.clone());
        stopped
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let stopped = self.stop();
        if thread::panicking() || !stopped.graceful || stopped.code != Some(0) {
            eprintln!(
                "----- ferry-mount {} on {} ({}) stderr -----\n{}----- end of ferry-mount stderr -----",
                self.remote,
                self.mountpoint.display(),
                if stopped.graceful {
                    format!("exit code {:?}", stopped.code)
                } else {
                    "did not stop by SIGTERM: unmounted with umount -l / SIGKILL".to_owned()
                },
                self.log()
            );
        }
        if mount_type(&self.mountpoint).is_some() {
            lazy_unmount(&self.mountpoint);
        }
        if mount_type(&self.mountpoint).is_some() {
            // Removing the temp dir would walk into the mount: keep it.
            if let Some(state) = self.state.take() {
                eprintln!(
                    "ferry-mount: {} is still mounted; leaving {} in place",
                    self.mountpoint.display(),
                    state.keep().display()
                );
            }
        }
    }
}

/// What one run of [`ferry_mount`] returned.
pub type MountOutput = crate::rcp::ProgramOutput;

/// Runs `ferry-mount ARGS...` exactly as given (no `-f` added) to completion, with
/// `FERRY_TRANSPORT` set to [`crate::test_transport`] and stdout/stderr captured.
/// Panics (after killing it) if it runs longer than [`MOUNT_TIMEOUT`] +
/// [`UNMOUNT_TIMEOUT`]. For arguments that are expected to fail, or for the detaching
/// (non-`-f`) mode, whose command returns once the mount is ready.
pub fn ferry_mount<I, S>(args: I) -> MountOutput
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let lossy: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let out_dir = tempfile::tempdir().expect("temp dir for ferry-mount's output");
    let (out_path, err_path) = (out_dir.path().join("stdout"), out_dir.path().join("stderr"));
    // Files, not pipes: a detaching daemon keeps inherited pipes open long after the
    // command returns.
    let mut child = Command::new(bin("ferry-mount"))
        .args(&args)
        .env("FERRY_TRANSPORT", crate::test_transport())
        .env("FERRY_SECRET", crate::TEST_SECRET)
        .env_remove("FERRY_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("create stdout file"))
        .stderr(File::create(&err_path).expect("create stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start ferry-mount {lossy:?}: {e}"));
    let start = Instant::now();
    let limit = MOUNT_TIMEOUT + UNMOUNT_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => thread::sleep(POLL),
            Err(e) => panic!("cannot wait for ferry-mount {lossy:?}: {e}"),
        }
    };
    let read = |p: &Path| fs::read_to_string(p).unwrap_or_default();
    let out = MountOutput {
        program: "ferry-mount",
        args: lossy,
        code: status.and_then(|s| s.code()),
        stdout: read(&out_path),
        stderr: read(&err_path),
        elapsed: start.elapsed(),
    };
    if status.is_none() {
        panic!("ferry-mount ran longer than {limit:?} and was killed\n{out}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/tmp/a\040b\011c\134d"), "/tmp/a b\tc\\d");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/trailing\04"), r"/trailing\04");
    }

    #[test]
    fn the_root_is_a_mount_point() {
        assert!(mount_type(Path::new("/")).is_some());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(mount_type(&dir.path().canonicalize().unwrap()), None);
    }
}
