//! Locks across clients (issue 42, point 4): `flock` and `fcntl` record locks taken
//! through one `ferry-mount` of a share exclude holders on another mount of it, because
//! ferryd holds them; they go when their holder closes, dies, or its mount dies; a
//! waiter wakes when the lock is released and a signal interrupts it; a descriptor
//! whose locks were lost to a reconnection fails with `EIO` rather than run unlocked;
//! and two SQLite writers on two mounts serialise their transactions.
//!
//! Each lock holder is a small Python program ([`Locker`]) driven line by line over
//! its stdin, answering each command on its stdout, so a test knows what a holder has
//! done before it takes its next step. A waiter is known to wait when the kernel shows
//! it blocked in the lock's system call (`/proc/PID/syscall`), not after a sleep.

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ferry_tests::{send_signal, skip_without_fuse, skip_without_tool, Env, Mount};

/// How long one command of a [`Locker`] may take to answer.
const ANSWER: Duration = Duration::from_secs(20);

/// How long a released lock may take to reach another mount's waiter or `LOCK_NB`
/// (bounded by the mount's retry pause and a close's round trip; generous for a busy
/// machine).
const RELEASED: Duration = Duration::from_secs(20);

/// The lock holder: opens its file, then runs one command a line and answers `ok`,
/// `err NAME` (an errno name) or, for `getlk`, what `F_GETLK` says. A blocking lock
/// command answers `waiting` first. SIGUSR1 raises in the program, so an interrupted lock wait
/// answers `err EINTR` (Python would otherwise retry the call).
const LOCKER: &str = r#"
import errno, fcntl, os, signal, struct, sys
class Interrupted(Exception):
    pass
def on_usr1(sig, frame):
    raise Interrupted()
signal.signal(signal.SIGUSR1, on_usr1)
if sys.argv[2:] == ["ro"]:
    fd = os.open(sys.argv[1], os.O_RDONLY)
else:
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
print("ready", flush=True)
KINDS = {"ex": fcntl.LOCK_EX, "sh": fcntl.LOCK_SH, "un": fcntl.LOCK_UN}
TYPES = {"w": fcntl.F_WRLCK, "r": fcntl.F_RDLCK, "u": fcntl.F_UNLCK}
NAMES = {fcntl.F_WRLCK: "w", fcntl.F_RDLCK: "r", fcntl.F_UNLCK: "u"}
def run(words):
    global fd
    op = words[0]
    if op == "flock":
        how = KINDS[words[1]]
        if len(words) > 2:
            how |= fcntl.LOCK_NB
        elif how != fcntl.LOCK_UN:
            print("waiting", flush=True)
        fcntl.flock(fd, how)
    elif op in ("setlk", "setlkw", "getlk"):
        start, length = int(words[2]), int(words[3])
        arg = struct.pack("hhqqi4x", TYPES[words[1]], 0, start, length, 0)
        if op == "getlk":
            t, _, s, l, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, arg))
            return "%s %d %d %d" % (NAMES[t], s, l, pid)
        if op == "setlkw":
            print("waiting", flush=True)
        fcntl.fcntl(fd, fcntl.F_SETLKW if op == "setlkw" else fcntl.F_SETLK, arg)
    elif op == "write":
        os.pwrite(fd, words[1].encode(), 0)
    elif op == "read":
        return "data " + os.pread(fd, 100, 0).decode()
    elif op == "close":
        os.close(fd)
    return "ok"
for line in sys.stdin:
    try:
        print(run(line.split()), flush=True)
    except Interrupted:
        print("err EINTR", flush=True)
    except OSError as e:
        print("err " + errno.errorcode.get(e.errno, str(e.errno)), flush=True)
"#;

/// A running [`LOCKER`] on one file.
struct Locker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Locker {
    /// Starts a holder of `path` (opened read-write) and waits until it has opened it.
    fn open(path: &Path) -> Locker {
        Locker::start(path, "rw")
    }

    /// [`Locker::open`], opening `path` read-only.
    fn open_ro(path: &Path) -> Locker {
        Locker::start(path, "ro")
    }

    fn start(path: &Path, mode: &str) -> Locker {
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(LOCKER)
            .arg(path)
            .arg(mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start python3");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut l = Locker {
            child,
            stdin,
            lines,
        };
        assert_eq!(l.next(), "ready", "{}", path.display());
        l
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one command without waiting for its answer.
    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").expect("write to the locker");
        self.stdin.flush().unwrap();
    }

    /// The next line it answers.
    #[track_caller]
    fn next(&mut self) -> String {
        match self.lines.recv_timeout(ANSWER) {
            Ok(line) => line,
            Err(e) => panic!("the locker did not answer within {ANSWER:?}: {e}"),
        }
    }

    /// Runs `cmd` and returns its answer.
    #[track_caller]
    fn ask(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.next()
    }

    /// Nothing answered yet.
    fn quiet(&self) -> bool {
        matches!(
            self.lines.try_recv(),
            Err(std::sync::mpsc::TryRecvError::Empty)
        )
    }

    /// Starts the blocking `cmd` and returns once the kernel shows the program blocked
    /// in `syscall` (its number).
    #[track_caller]
    fn start_waiting(&mut self, cmd: &str, syscall: u64) {
        self.send(cmd);
        assert_eq!(self.next(), "waiting");
        let deadline = Instant::now() + ANSWER;
        loop {
            let now = std::fs::read_to_string(format!("/proc/{}/syscall", self.pid()))
                .unwrap_or_default();
            if now.split_whitespace().next() == Some(&syscall.to_string()) {
                return;
            }
            assert!(self.quiet(), "{cmd} answered without waiting");
            assert!(Instant::now() < deadline, "{cmd} never blocked: {now}");
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILLs it and reaps it.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Locker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// System call numbers as `/proc/PID/syscall` shows them.
#[cfg(target_arch = "x86_64")]
const SYS_FLOCK: u64 = 73;
#[cfg(target_arch = "x86_64")]
const SYS_FCNTL: u64 = 72;
#[cfg(target_arch = "aarch64")]
const SYS_FLOCK: u64 = 32;
#[cfg(target_arch = "aarch64")]
const SYS_FCNTL: u64 = 25;

/// Asks `cmd` of `who` until it answers `want`, within [`RELEASED`].
#[track_caller]
fn eventually(who: &mut Locker, cmd: &str, want: &str) {
    let deadline = Instant::now() + RELEASED;
    loop {
        let got = who.ask(cmd);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{cmd}: still {got} after {RELEASED:?}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

fn skip(test: &str) -> bool {
    skip_without_fuse(test) || skip_without_tool(test, "python3")
}

/// Two mounts of one share, with `file` (mount-relative) made on the share.
fn two_mounts(file: &str) -> (Env, Mount, Mount) {
    let env = Env::new();
    std::fs::write(env.share(file), b"0123456789").unwrap();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));
    (env, a, b)
}

/// For `test` (`None` if it is skipped): two mounts of one share with a file `f` on
/// it, and a locker of `f` on each: (env, mount a, mount b, locker on a, locker on b).
fn two_lockers(test: &str) -> Option<(Env, Mount, Mount, Locker, Locker)> {
    if skip(test) {
        return None;
    }
    let (env, a, b) = two_mounts("f");
    let holder = Locker::open(&a.join("f"));
    let other = Locker::open(&b.join("f"));
    Some((env, a, b, holder, other))
}

/// `other` starts the blocking `wait` (seen blocked in `syscall`) on what `holder`
/// holds: it must wait until `holder` asks `release`, and then get it.
#[track_caller]
fn waits_for_release(
    holder: &mut Locker,
    other: &mut Locker,
    (wait, syscall): (&str, u64),
    release: &str,
) {
    other.start_waiting(wait, syscall);
    assert!(other.quiet(), "{wait}: the waiter got it while it was held");
    assert_eq!(holder.ask(release), "ok");
    assert_eq!(other.next(), "ok", "{wait}: the waiter did not get it");
}

/// `flock(LOCK_EX)` on one mount makes `LOCK_EX|LOCK_NB` on the other fail with
/// `EWOULDBLOCK`; a blocking `LOCK_EX` there waits, and gets the lock once the holder
/// unlocks; a shared lock admits other shared locks only.
#[test]
fn flock_excludes_across_two_mounts_and_a_waiter_wakes_at_release() {
    let Some((_env, _a, _b, mut holder, mut other)) =
        two_lockers("flock_excludes_across_two_mounts_and_a_waiter_wakes_at_release")
    else {
        return;
    };
    assert_eq!(holder.ask("flock ex nb"), "ok");
    assert_eq!(other.ask("flock ex nb"), "err EAGAIN");
    assert_eq!(other.ask("flock sh nb"), "err EAGAIN");

    waits_for_release(&mut holder, &mut other, ("flock ex", SYS_FLOCK), "flock un");
    assert_eq!(holder.ask("flock ex nb"), "err EAGAIN");

    // Shared locks share.
    assert_eq!(other.ask("flock sh nb"), "ok");
    assert_eq!(holder.ask("flock sh nb"), "ok");
    assert_eq!(holder.ask("flock ex nb"), "err EAGAIN");
    assert_eq!(other.ask("flock un"), "ok");
    assert_eq!(holder.ask("flock ex nb"), "ok");
}

/// `fcntl` byte ranges: disjoint ranges on two mounts are both granted, an overlapping
/// one is refused, `F_GETLK` on the other mount names the holder's range, type and
/// process, and `F_SETLKW` waits for the range to be unlocked.
#[test]
fn fcntl_ranges_exclude_across_two_mounts_and_getlk_names_the_holder() {
    let Some((_env, _a, _b, mut holder, mut other)) =
        two_lockers("fcntl_ranges_exclude_across_two_mounts_and_getlk_names_the_holder")
    else {
        return;
    };
    assert_eq!(holder.ask("setlk w 0 100"), "ok");
    assert_eq!(other.ask("setlk w 100 100"), "ok");
    assert_eq!(other.ask("setlk r 50 100"), "err EAGAIN");
    assert_eq!(other.ask("setlk w 99 1"), "err EAGAIN");
    let pid = holder.pid();
    assert_eq!(other.ask("getlk r 0 0"), format!("w 0 100 {pid}"));
    assert_eq!(other.ask("getlk w 300 10"), "u 300 10 0");
    // A read lock shares with read locks only.
    assert_eq!(holder.ask("setlk r 0 100"), "ok");
    assert_eq!(other.ask("setlk r 50 10"), "ok");
    assert_eq!(other.ask("setlk w 0 10"), "err EAGAIN");

    let wait = ("setlkw w 0 10", SYS_FCNTL);
    waits_for_release(&mut holder, &mut other, wait, "setlk u 0 50");
    assert_eq!(holder.ask("setlk w 55 1"), "err EAGAIN");
    assert_eq!(holder.ask("setlk w 70 10"), "ok");
}

/// A holder's close releases its record locks, and a holder killed with SIGKILL
/// releases its `flock` and record locks.
#[test]
fn locks_go_when_their_holder_closes_or_is_killed() {
    if skip("locks_go_when_their_holder_closes_or_is_killed") {
        return;
    }
    let (_env, a, b) = two_mounts("f");
    let mut other = Locker::open(&b.join("f"));

    let mut holder = Locker::open(&a.join("f"));
    assert_eq!(holder.ask("setlk w 0 0"), "ok");
    assert_eq!(other.ask("setlk w 0 1"), "err EAGAIN");
    assert_eq!(holder.ask("close"), "ok");
    eventually(&mut other, "setlk w 0 1", "ok");
    assert_eq!(other.ask("setlk u 0 0"), "ok");

    let mut holder = Locker::open(&a.join("f"));
    assert_eq!(holder.ask("flock ex nb"), "ok");
    assert_eq!(other.ask("flock ex nb"), "err EAGAIN");
    holder.kill();
    eventually(&mut other, "flock ex nb", "ok");
    assert_eq!(other.ask("flock un"), "ok");

    let mut holder = Locker::open(&a.join("f"));
    assert_eq!(holder.ask("setlk w 5 5"), "ok");
    assert_eq!(other.ask("setlk w 0 10"), "err EAGAIN");
    holder.kill();
    eventually(&mut other, "setlk w 0 10", "ok");
}

/// The locks of a mount whose `ferry-mount` is SIGKILLed go with its session.
#[test]
fn locks_go_when_the_holding_mount_is_killed() {
    let Some((_env, a, _b, mut holder, mut other)) =
        two_lockers("locks_go_when_the_holding_mount_is_killed")
    else {
        return;
    };
    assert_eq!(holder.ask("flock ex nb"), "ok");
    assert_eq!(other.ask("flock ex nb"), "err EAGAIN");
    assert!(send_signal(a.pid(), "KILL"));
    eventually(&mut other, "flock ex nb", "ok");
    holder.kill();
}

/// A waiter interrupted by a signal gets `EINTR`, and holds nothing after.
#[test]
fn a_signal_interrupts_a_lock_waiter_with_eintr() {
    let Some((_env, _a, _b, mut holder, mut other)) =
        two_lockers("a_signal_interrupts_a_lock_waiter_with_eintr")
    else {
        return;
    };
    assert_eq!(holder.ask("flock ex nb"), "ok");
    other.start_waiting("flock ex", SYS_FLOCK);
    assert!(send_signal(other.pid(), "USR1"));
    assert_eq!(other.next(), "err EINTR");
    other.start_waiting("setlkw w 0 1", SYS_FCNTL);
    assert!(send_signal(other.pid(), "USR1"));
    assert_eq!(other.next(), "err EINTR");
    // The holder still holds; once it lets go, the waiter's try succeeds.
    assert_eq!(other.ask("flock ex nb"), "err EAGAIN");
    assert_eq!(holder.ask("flock un"), "ok");
    eventually(&mut other, "flock ex nb", "ok");
}

/// A TCP relay between a mount and ferryd whose connections can be cut, so the mount
/// reconnects (through the relay again) to the same server.
struct Cutter {
    port: u16,
    streams: Arc<Mutex<Vec<TcpStream>>>,
}

impl Cutter {
    fn start(upstream: String) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let streams: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let kept = streams.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                    thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
                kept.lock().unwrap().extend([client, server]);
            }
        });
        Cutter { port, streams }
    }

    /// Ends every relayed connection.
    fn cut(&self) {
        for s in self.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// A descriptor whose lock was lost when its mount reconnected fails its reads and
/// locks with `EIO`, while a descriptor of the same file that held no lock reads on;
/// another mount may take the lock. (Read-only descriptors: a write handle is bound to
/// its connection and fails after a reconnection, locked or not.)
#[test]
fn a_lock_lost_to_a_reconnection_fails_later_io_with_eio() {
    if skip("a_lock_lost_to_a_reconnection_fails_later_io_with_eio") {
        return;
    }
    let env = Env::new();
    std::fs::write(env.share("f"), b"0123456789").unwrap();
    let cutter = Cutter::start(env.server().addr().to_string());
    let via = env.remote("").replacen(
        env.server().addr(),
        &format!("127.0.0.1:{}", cutter.port),
        1,
    );
    // The cutter is a TCP relay on loopback: this mount speaks TCP whatever the
    // suite's transport (an RDMA connection cannot go through it).
    let a = Mount::builder(via).transport("tcp").start();
    let b = Mount::start(env.remote(""));
    let mut holder = Locker::open_ro(&a.join("f"));
    let mut unlocked = Locker::open_ro(&a.join("f"));
    let mut other = Locker::open(&b.join("f"));
    assert_eq!(holder.ask("setlk r 0 0"), "ok");
    assert_eq!(other.ask("setlk w 0 0"), "err EAGAIN");
    cutter.cut();
    // The server drops the session's locks with it.
    eventually(&mut other, "setlk w 0 0", "ok");
    // The mount reconnects at its next request.
    let deadline = Instant::now() + RELEASED;
    while std::fs::read_dir(a.path()).is_err() {
        assert!(Instant::now() < deadline, "the mount did not reconnect");
        thread::sleep(Duration::from_millis(20));
    }
    // (Nothing read the file on this mount yet, so the kernel has no page of it
    // cached: each read reaches the mount.)
    assert_eq!(holder.ask("read"), "err EIO");
    assert_eq!(holder.ask("setlk r 0 0"), "err EIO");
    assert_eq!(unlocked.ask("read"), "data 0123456789");
    // The mount itself works on: another file locks, writes and reads.
    let mut fresh = Locker::open(&a.join("g"));
    assert_eq!(fresh.ask("setlk w 0 0"), "ok");
    assert_eq!(fresh.ask("write fresh"), "ok");
    assert_eq!(fresh.ask("read"), "data fresh");
}

/// The SQLite writer: `n` transactions, each reading the counter and writing it plus
/// one (`BEGIN IMMEDIATE`, with a busy timeout); it starts at `go` on stdin.
const SQLITE_WRITER: &str = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
print("ready", flush=True)
sys.stdin.readline()
for i in range(int(sys.argv[2])):
    db.execute("BEGIN IMMEDIATE")
    (v,) = db.execute("SELECT v FROM counter WHERE id = 1").fetchone()
    db.execute("UPDATE counter SET v = ? WHERE id = 1", (v + 1,))
    db.execute("INSERT INTO log (who, seen) VALUES (?, ?)", (sys.argv[3], v))
    db.execute("COMMIT")
db.close()
print("done", flush=True)
"#;

/// Two SQLite writers, one per mount, each doing read-modify-write transactions on one
/// counter row at once: every increment survives, and the database passes
/// `PRAGMA integrity_check` (read through a mount and on the server's disk).
#[test]
fn two_sqlite_writers_on_two_mounts_serialise_their_transactions() {
    if skip("two_sqlite_writers_on_two_mounts_serialise_their_transactions") {
        return;
    }
    const EACH: usize = 100;
    let (env, a, b) = two_mounts("unused");
    let setup = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("CREATE TABLE counter (id INTEGER PRIMARY KEY, v INTEGER)")
db.execute("CREATE TABLE log (who TEXT, seen INTEGER, pad TEXT DEFAULT (hex(randomblob(200))))")
db.execute("INSERT INTO counter VALUES (1, 0)")
db.close()
"#;
    let made = Command::new("python3")
        .args(["-c", setup])
        .arg(a.join("db.sqlite"))
        .status()
        .unwrap();
    assert!(made.success());

    let mut writers: Vec<(Child, Receiver<String>)> = [("a", &a), ("b", &b)]
        .into_iter()
        .map(|(who, m)| {
            let mut child = Command::new("python3")
                .args(["-c", SQLITE_WRITER])
                .arg(m.join("db.sqlite"))
                .arg(EACH.to_string())
                .arg(who)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let stdout = child.stdout.take().unwrap();
            let (tx, rx) = channel();
            thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            (child, rx)
        })
        .collect();
    for (_, rx) in &writers {
        assert_eq!(rx.recv_timeout(ANSWER).unwrap(), "ready");
    }
    for (child, _) in &mut writers {
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    }
    let limit = Duration::from_secs(240);
    for (child, rx) in &mut writers {
        match rx.recv_timeout(limit) {
            Ok(line) => assert_eq!(line, "done"),
            Err(RecvTimeoutError::Timeout) => panic!("a writer did not finish in {limit:?}"),
            Err(e) => panic!("a writer failed: {e} ({:?})", child.wait()),
        }
        assert!(child.wait().unwrap().success());
    }

    let check = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
print(db.execute("SELECT v FROM counter WHERE id = 1").fetchone()[0])
print(db.execute("SELECT count(*), count(DISTINCT seen) FROM log").fetchone())
print(db.execute("PRAGMA integrity_check").fetchone()[0])
"#;
    let want = format!("{}\n({}, {})\nok\n", 2 * EACH, 2 * EACH, 2 * EACH);
    for path in [b.join("db.sqlite"), env.share("db.sqlite")] {
        let out = Command::new("python3")
            .args(["-c", check])
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            want,
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Whether process `pid` is stopped (`T` in `/proc/PID/stat`).
fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
    state == Some(Some('T'))
}

/// A cluster share's locks are held in etcd under each mount's lease: `flock` and
/// `fcntl` ranges exclude across two cluster mounts, a waiter wakes at release,
/// `F_GETLK` names the holder, a close releases; a holder whose `ferry-mount` hangs
/// (SIGSTOP) loses its locks once its lease expires, and after it resumes its locked
/// descriptor fails with `EIO` instead of running unlocked.
#[test]
fn cluster_locks_exclude_across_two_mounts_and_a_hung_mount_loses_them() {
    let name = "cluster_locks_exclude_across_two_mounts_and_a_hung_mount_loses_them";
    if skip(name) || ferry_tests::skip_without_cluster(name) {
        return;
    }
    let cluster = ferry_tests::Cluster::start_with_share(2, "data", 1, 1);
    let a = Mount::start(cluster.url("data", ""));
    let b = Mount::start(cluster.url("data", ""));
    std::fs::write(a.join("f"), b"0123456789").unwrap();
    let mut holder = Locker::open(&a.join("f"));
    let mut other = Locker::open(&b.join("f"));

    assert_eq!(holder.ask("flock ex nb"), "ok");
    assert_eq!(other.ask("flock ex nb"), "err EAGAIN");
    other.start_waiting("flock ex", SYS_FLOCK);
    assert!(other.quiet(), "the waiter got the lock while it was held");
    assert_eq!(holder.ask("flock un"), "ok");
    assert_eq!(other.next(), "ok", "the waiter did not get the lock");
    assert_eq!(other.ask("flock un"), "ok");

    assert_eq!(holder.ask("setlk w 0 100"), "ok");
    assert_eq!(other.ask("setlk w 100 100"), "ok");
    assert_eq!(other.ask("setlk r 50 10"), "err EAGAIN");
    let pid = holder.pid();
    assert_eq!(other.ask("getlk r 0 0"), format!("w 0 100 {pid}"));
    assert_eq!(holder.ask("close"), "ok");
    eventually(&mut other, "setlk w 0 100", "ok");
    assert_eq!(other.ask("setlk u 0 0"), "ok");

    // A hung mount: its lease expires, and the other mount takes the lock.
    let mut holder = Locker::open(&a.join("f"));
    assert_eq!(holder.ask("setlk w 0 0"), "ok");
    assert_eq!(other.ask("setlk w 0 1"), "err EAGAIN");
    assert!(send_signal(a.pid(), "STOP"));
    let stopped = Instant::now();
    let ttl = Duration::from_secs(10);
    let deadline = stopped + ttl + RELEASED;
    loop {
        let got = other.ask("setlk w 0 1");
        if got == "ok" {
            break;
        }
        assert_eq!(got, "err EAGAIN");
        assert!(
            Instant::now() < deadline,
            "still locked {:?} after the stop",
            stopped.elapsed()
        );
        thread::sleep(Duration::from_millis(200));
    }
    assert!(
        is_stopped(a.pid()),
        "the holder's mount did not stay stopped"
    );
    assert!(
        stopped.elapsed() >= ttl - Duration::from_secs(1),
        "released after {:?}, before the lease could expire",
        stopped.elapsed()
    );
    assert!(send_signal(a.pid(), "CONT"));
    assert_eq!(holder.ask("write x"), "err EIO", "{}", a.log());
    assert_eq!(holder.ask("setlk w 0 0"), "err EIO");
    assert_eq!(holder.ask("close"), "ok");
    // A new descriptor locks again, under a new lease.
    assert_eq!(other.ask("setlk u 0 0"), "ok");
    let mut again = Locker::open(&a.join("f"));
    assert_eq!(again.ask("setlk w 0 0"), "ok");
    assert_eq!(other.ask("setlk w 0 1"), "err EAGAIN");
}
