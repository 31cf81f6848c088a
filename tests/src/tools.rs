//! Running the real command-line tools that tests drive a mount with (`cp`, `tar`,
//! `rsync`, `git`, `sqlite3`, `python3`, `dd`, ...): found on `PATH`, run with a time
//! limit, their output captured for the failure message.

use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// How often [`run_tool`] polls the process.
const POLL: Duration = Duration::from_millis(10);

/// The path of program `name` on `$PATH`, if it is there (an executable file).
pub fn program_on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Prints why `test` is skipped and returns true when `tool` is not on `$PATH`.
pub fn skip_without_tool(test: &str, tool: &str) -> bool {
    if program_on_path(tool).is_some() {
        return false;
    }
    eprintln!("{test}: skipped: `{tool}` is not installed (see scripts/setup.sh)");
    true
}

/// `sh -c SCRIPT`, for [`run_tool`]. Paths are best passed as positional
/// parameters (`$1`...) with [`Command::arg`], not pasted into the script.
pub fn sh(script: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script).arg("sh");
    cmd
}

/// `python3 -c SCRIPT ARGS...`, for [`run_tool`].
pub fn python<I, S>(script: &str, args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(script).args(args);
    cmd
}

/// How one run of [`run_tool`] ended.
#[derive(Debug, Clone)]
pub struct ToolOutput {
    /// The command as run (lossy, for messages).
    pub command: String,
    /// The exit code; `None` if a signal ended it.
    pub code: Option<i32>,
    /// Everything printed on stdout.
    pub stdout: String,
    /// Everything printed on stderr.
    pub stderr: String,
    /// Wall time from spawn to exit.
    pub elapsed: Duration,
}

impl fmt::Display for ToolOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "command: {}", self.command)?;
        writeln!(f, "exit code: {:?} after {:?}", self.code, self.elapsed)?;
        writeln!(f, "--- stdout ---\n{}", self.stdout)?;
        write!(f, "--- stderr ---\n{}", self.stderr)
    }
}

impl ToolOutput {
    /// Panics (with the output) unless the command exited 0; `what` says what it did.
    #[track_caller]
    pub fn assert_success(&self, what: &str) -> &Self {
        if self.code != Some(0) {
            panic!("{what}: the command failed\n{self}");
        }
        self
    }

    /// Panics (with the output) if the command exited 0.
    #[track_caller]
    pub fn assert_failure(&self, what: &str) -> &Self {
        if self.code == Some(0) {
            panic!("{what}: the command succeeded, it must fail\n{self}");
        }
        self
    }
}

/// Runs `cmd` (stdin from /dev/null, stdout and stderr captured in files) and waits
/// for it at most `limit`; past that it is SIGKILLed and the test panics with what it
/// printed so far (a write hung in the mount must not hang the suite).
#[track_caller]
pub fn run_tool(cmd: &mut Command, limit: Duration) -> ToolOutput {
    let command = describe(cmd);
    let dir = tempfile::tempdir().expect("temp dir for a command's output");
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("create stdout file"))
        .stderr(File::create(&err_path).expect("create stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {command}: {e}"));
    let start = Instant::now();
    let read = |p: &Path| String::from_utf8_lossy(&fs::read(p).unwrap_or_default()).into_owned();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return ToolOutput {
                    command,
                    code: status.code(),
                    stdout: read(&out_path),
                    stderr: read(&err_path),
                    elapsed: start.elapsed(),
                }
            }
            Ok(None) if start.elapsed() > limit => {
                // Not waited for: a process stuck in the file system may take until
                // the mount is gone to die.
                let _ = child.kill();
                panic!(
                    "command did not finish within {limit:?} (killed)\n{}",
                    ToolOutput {
                        command,
                        code: None,
                        stdout: read(&out_path),
                        stderr: read(&err_path),
                        elapsed: start.elapsed(),
                    }
                );
            }
            Ok(None) => thread::sleep(POLL),
            Err(e) => panic!("cannot wait for {command}: {e}"),
        }
    }
}

fn describe(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    parts.extend(cmd.get_args().map(|a| {
        let a = a.to_string_lossy();
        if a.contains(char::is_whitespace) {
            format!("'{a}'")
        } else {
            a.into_owned()
        }
    }));
    if let Some(dir) = cmd.get_current_dir() {
        parts.push(format!("(in {})", dir.display()));
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_runs_and_its_output_is_kept() {
        let out = run_tool(
            sh("echo out; echo err >&2; exit 3").arg("x"),
            Duration::from_secs(10),
        );
        assert_eq!(out.code, Some(3));
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.stderr, "err\n");
        assert!(program_on_path("sh").is_some());
        assert!(program_on_path("no-such-program-ferry").is_none());
    }

    #[test]
    fn a_tool_past_its_limit_is_killed() {
        let result = std::panic::catch_unwind(|| {
            run_tool(&mut sh("sleep 30"), Duration::from_millis(200));
        });
        assert!(result.is_err());
    }
}
