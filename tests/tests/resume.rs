//! Killed peers and resume (issue 6, point 4).
//!
//! The kill tests run real `rcp` and `ferryd` processes. Each iteration starts `rcp -r`
//! of a tree (three files of 8 to 24 MiB, small ones, an empty one, a symlink) and
//! SIGKILLs `rcp` or `ferryd` at a random point (seeded; the seed is printed and
//! `FERRY_RESUME_SEED=N` replays it, as far as timing allows): every other iteration
//! after a random delay within the time an uninterrupted copy took (which also hits
//! connection set-up, planning, hashing and commits), the others once a random fraction
//! of the tree's bytes has landed at the destination (files under their final names
//! plus chunks journaled in partials), so those kills always fall while data moves.
//! 13 kills of each of the four kinds (rcp or ferryd, uploads or downloads), 52 in all;
//! under the Soft-RoCE suite 2 of each kind, of 1 to 3 MiB files. After the kill:
//!
//! - every file under a final name at the destination is byte-identical to its source
//!   (a file is whole or absent);
//! - `ferryd`, when it was not the one killed, still answers; when it was, it is
//!   restarted on the same share, and once its startup cleanup has run no hidden file
//!   is left but resumable partials with their journals.
//!
//! Then the same `rcp` runs again: it exits 0, the trees are identical, nothing hidden
//! is left, and it sent only what the destination lacked: `bytes_sent + bytes_reused`
//! is the tree's size and `bytes_reused` covers at least every chunk the destination's
//! journals recorded after the kill (each of them verified again before reuse). The
//! kill point depends on timing, so what survives a kill differs between runs; the
//! assertions hold for any kill point.
//!
//! Two more tests build partial files by hand, so their outcome is exact: ferryd's
//! startup cleanup (stale hidden files, the partial TTL, `--partial-ttl 0`) with an
//! upload that reuses exactly the verified chunk of a partial, and a download that
//! reuses a partial of the same source version only.

use std::fs;
use std::os::unix::fs::{symlink, FileExt};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use ferry_common::attr::attr_of;
use ferry_common::chunk::hash_chunk;
use ferry_common::journal::{source_tag, JournalHeader};
use ferry_common::msg::{HashAlgorithm, DEFAULT_CHUNK_BYTES};
use ferry_common::proto::caps::Algorithms;
use ferry_common::staging::{partial_paths, Staged};
use ferry_common::transport::TransportChoice;
use ferry_tests::{
    assert_no_temp_files, assert_only_resumable_temp_files, assert_trees_equal, first_difference,
    journaled_bytes, on_rdma, rcp_args, runtime, spawn_rcp, temp_files, test_host,
    write_random_file, Env, RcpOutput, MIB, TEMP_PREFIX,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Kill iterations of each of the four kinds (rcp or ferryd killed, during uploads or
/// downloads): 52 in all.
const KILLS_PER_KIND: usize = 13;
/// Sizes of the tree's multi-chunk files.
const BIG_FILES: [u64; 3] = [8 * MIB + 5, 16 * MIB + 77, 24 * MIB - 3];
/// The same under the Soft-RoCE suite, whose emulated VM copies a few MiB/s: fewer
/// kills of smaller trees (the binary takes about 40 s there), still on the verbs
/// transport, where a killed peer is seen through rdma_cm rather than a TCP reset.
const RDMA_KILLS_PER_KIND: usize = 2;
const RDMA_BIG_FILES: [u64; 3] = [MIB + 5, 2 * MIB + 77, 3 * MIB - 3];

/// How long a restarted ferryd may take to finish its startup cleanup.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long ferryd may take to let go of the transfers of a killed rcp.
const IDLE_TIMEOUT: Duration = Duration::from_secs(20);
/// The line ferryd logs when the startup cleanup of a share is done.
const CLEANUP_LINE: &str = "startup cleanup removed";

const CHUNK: u64 = DEFAULT_CHUNK_BYTES as u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Upload,
    Download,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    Rcp,
    Ferryd,
}

/// The run's seed: `FERRY_RESUME_SEED`, or the clock.
fn base_seed() -> u64 {
    match std::env::var("FERRY_RESUME_SEED") {
        Ok(s) => s.parse().expect("FERRY_RESUME_SEED must be a number"),
        Err(_) => SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    }
}

/// Writes the source tree under `root`; returns the bytes of its regular files.
fn make_source(root: &Path, seed: u64) -> u64 {
    let big = if on_rdma() { RDMA_BIG_FILES } else { BIG_FILES };
    let files: [(&str, u64); 7] = [
        ("a.bin", big[0]),
        ("sub/b.bin", big[1]),
        ("sub/deep/c.bin", big[2]),
        ("small.txt", 100),
        ("one-chunk.bin", MIB),
        ("sub/two-chunks.bin", MIB + 1),
        ("sub/deep/empty", 0),
    ];
    fs::create_dir_all(root.join("sub/deep")).unwrap();
    for (i, (rel, len)) in files.iter().enumerate() {
        write_random_file(&root.join(rel), *len, seed.wrapping_add(i as u64));
    }
    symlink("a.bin", root.join("link")).unwrap();
    files.iter().map(|(_, len)| len).sum()
}

/// Bytes of a copy that reached `dir`: regular files under final names, and the chunks
/// journaled in partials.
fn landed_bytes(dir: &Path) -> u64 {
    fn finals(dir: &Path) -> u64 {
        let Ok(entries) = fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                !name.starts_with(TEMP_PREFIX) && name != ferry_common::STATE_DIR
            })
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => finals(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => 0,
            })
            .sum()
    }
    finals(dir) + journaled_bytes(dir)
}

/// When an iteration kills.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// This long after rcp started.
    After(Duration),
    /// Once this many bytes landed at the destination (or rcp ended).
    Landed(u64),
}

/// Panics unless every regular file under `dst` (hidden temporary files aside) is a
/// byte-identical copy of the file at the same relative path under `src`.
#[track_caller]
fn assert_finals_whole(src: &Path, dst: &Path, what: &str) {
    let Ok(entries) = fs::read_dir(dst) else {
        return;
    };
    for entry in entries {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with(TEMP_PREFIX) || name == ferry_common::STATE_DIR {
            continue;
        }
        let (s, d) = (src.join(&name), entry.path());
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            assert_finals_whole(&s, &d, what);
        } else if kind.is_file() {
            match first_difference(&s, &d) {
                Ok(None) => {}
                other => panic!(
                    "{what}: {} is under its final name but not whole: {other:?}",
                    d.display()
                ),
            }
        }
    }
}

/// Waits until ferryd holds no open transfer (so a killed rcp's uploads are let go of
/// and their journals complete); answering at all shows it still serves.
fn wait_until_idle(env: &Env) {
    let port = env.server().port();
    let rt = runtime();
    rt.block_on(async {
        let client = ferry_tests::connect_to(&test_host(), port, TransportChoice::Tcp)
            .await
            .expect("ferryd still accepts connections");
        let start = Instant::now();
        loop {
            let stats = tokio::time::timeout(IDLE_TIMEOUT, client.server_stats())
                .await
                .expect("ferryd answers Stats")
                .expect("Stats");
            if stats.open_transfers == 0 {
                break;
            }
            assert!(
                start.elapsed() < IDLE_TIMEOUT,
                "ferryd still holds {} transfers of a killed rcp",
                stats.open_transfers
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        client.close();
    });
}

/// The `--json` report's `bytes_sent` and `bytes_reused`.
fn sent_and_reused(out: &RcpOutput) -> (u64, u64) {
    let v = out.json();
    let field = |k: &str| {
        v[k].as_u64()
            .unwrap_or_else(|| panic!("no {k} in the report: {v}"))
    };
    (field("bytes_sent"), field("bytes_reused"))
}

/// One kind of kill test: its environment, the source tree and where copies go.
struct Kills {
    env: Env,
    way: Way,
    victim: Victim,
    src: PathBuf,
    total: u64,
    /// Journaled bytes found after kills, bytes reused and sent by the reruns.
    journaled: u64,
    reused: u64,
    sent: u64,
    /// Kills that found the copy still running.
    interrupted: usize,
}

impl Kills {
    fn new(way: Way, victim: Victim, seed: u64) -> Kills {
        let env = Env::new();
        let src = match way {
            Way::Upload => env.local("src"),
            Way::Download => env.share("src"),
        };
        let total = make_source(&src, seed);
        Kills {
            env,
            way,
            victim,
            src,
            total,
            journaled: 0,
            reused: 0,
            sent: 0,
            interrupted: 0,
        }
    }

    /// Iteration `n`'s destination directory (created) and where the tree lands in it.
    fn destination(&self, n: usize) -> (PathBuf, PathBuf) {
        let dir = match self.way {
            Way::Upload => self.env.share(&format!("it{n}")),
            Way::Download => self.env.local(&format!("it{n}")),
        };
        fs::create_dir_all(&dir).unwrap();
        let tree = dir.join("src");
        (dir, tree)
    }

    /// The same rcp command line for every run of iteration `n` (the port follows a
    /// restarted ferryd).
    fn args(&self, n: usize) -> Vec<std::ffi::OsString> {
        match self.way {
            Way::Upload => rcp_args![
                "-r",
                "--json",
                &self.src,
                self.env.remote(&format!("it{n}/"))
            ],
            Way::Download => rcp_args![
                "-r",
                "--json",
                self.env.remote("src"),
                format!("{}/", self.env.local(&format!("it{n}")).display())
            ],
        }
    }

    /// An uninterrupted copy: checks it and returns how long it took.
    fn calibrate(&mut self) -> Duration {
        let (dir, tree) = self.destination(0);
        let start = Instant::now();
        let out = self.env.rcp(self.args(0));
        let took = start.elapsed();
        out.assert_success();
        assert_eq!(sent_and_reused(&out), (self.total, 0), "a fresh copy");
        assert_trees_equal(&self.src, &tree);
        fs::remove_dir_all(dir).unwrap();
        took
    }

    /// Iteration `n`: start the copy, kill the victim at `at`, check, resume, check.
    fn iteration(&mut self, n: usize, at: KillAt) {
        let what = format!("{:?} {:?} kill {n} ({at:?})", self.victim, self.way);
        let (dir, tree) = self.destination(n);
        let mut child = spawn_rcp(self.args(n));
        match at {
            KillAt::After(d) => thread::sleep(d),
            KillAt::Landed(bytes) => {
                let deadline = Instant::now() + Duration::from_secs(30);
                while child.is_running() && landed_bytes(&dir) < bytes && Instant::now() < deadline
                {
                    thread::sleep(Duration::from_millis(1));
                }
            }
        }
        let running = child.is_running();
        match self.victim {
            Victim::Rcp => {
                let out = child.kill();
                // A run that ended before the kill must have succeeded.
                if out.code.is_some() {
                    out.assert_success();
                }
            }
            Victim::Ferryd => {
                self.env.server().kill();
                let out = child.wait();
                if out.code != Some(0) {
                    out.assert_failure();
                }
            }
        }
        if running {
            self.interrupted += 1;
        }
        assert_finals_whole(&self.src, &tree, &what);
        match self.victim {
            Victim::Rcp => {
                self.env.server().assert_running();
                wait_until_idle(&self.env);
            }
            Victim::Ferryd => {
                self.env.server_mut().restart(&[] as &[&str]);
                assert!(
                    self.env
                        .server()
                        .wait_for_log(CLEANUP_LINE, 1, CLEANUP_TIMEOUT),
                    "{what}: the restarted ferryd did not finish its startup cleanup:\n{}",
                    self.env.server().stderr()
                );
                assert_only_resumable_temp_files(&self.env.share(""));
            }
        }
        let journaled = journaled_bytes(&dir);

        let out = self.env.rcp(self.args(n));
        out.assert_success();
        let (sent, reused) = sent_and_reused(&out);
        assert_eq!(sent + reused, self.total, "{what}: sent + reused\n{out}");
        assert!(
            reused >= journaled,
            "{what}: {journaled} bytes were journaled at the destination but only {reused} reused\n{out}"
        );
        assert_trees_equal(&self.src, &tree);
        assert_no_temp_files(&dir);
        self.env.server().assert_running();
        fs::remove_dir_all(dir).unwrap();
        self.journaled += journaled;
        self.reused += reused;
        self.sent += sent;
    }
}

/// Runs [`KILLS_PER_KIND`] kills of `victim` during copies in direction `way`.
fn kill_and_resume(way: Way, victim: Victim, salt: u64) {
    let iterations = if on_rdma() {
        RDMA_KILLS_PER_KIND
    } else {
        KILLS_PER_KIND
    };
    let seed = base_seed() ^ salt;
    eprintln!(
        "{victim:?} {way:?}: seed {seed} (FERRY_RESUME_SEED={})",
        seed ^ salt
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut kills = Kills::new(way, victim, seed);
    let typical = kills.calibrate();
    let started = Instant::now();
    for n in 1..=iterations {
        let at = match n % 2 {
            1 => KillAt::Landed((kills.total as f64 * rng.gen_range(0.02..0.98)) as u64),
            _ => KillAt::After(typical.mul_f64(rng.gen_range(0.02..0.98))),
        };
        kills.iteration(n, at);
    }
    eprintln!(
        "{victim:?} {way:?}: {iterations} kills in {:.1} s ({} while the copy ran; an \
         uninterrupted copy took {typical:?}); after them {:.1} MiB were journaled, the \
         reruns reused {:.1} MiB and sent {:.1} MiB of {:.1} MiB",
        started.elapsed().as_secs_f64(),
        kills.interrupted,
        kills.journaled as f64 / MIB as f64,
        kills.reused as f64 / MIB as f64,
        kills.sent as f64 / MIB as f64,
        (kills.total * iterations as u64) as f64 / MIB as f64,
    );
}

#[test]
fn killed_rcp_during_uploads_resumes() {
    kill_and_resume(Way::Upload, Victim::Rcp, 0x11);
}

#[test]
fn killed_rcp_during_downloads_resumes() {
    kill_and_resume(Way::Download, Victim::Rcp, 0x22);
}

#[test]
fn killed_ferryd_during_uploads_resumes() {
    kill_and_resume(Way::Upload, Victim::Ferryd, 0x33);
}

#[test]
fn killed_ferryd_during_downloads_resumes() {
    kill_and_resume(Way::Download, Victim::Ferryd, 0x44);
}

/// Leaves what an interrupted transfer of `final_path` would: a resumable partial of
/// `header` whose journal records `chunks` (index, written), with the hash of
/// `source`'s bytes; a chunk given with `false` is journaled but never written (a lying
/// record). Returns the
/// partial's and the journal's paths.
fn leave_partial(
    final_path: &Path,
    header: &JournalHeader,
    source: &Path,
    chunks: &[(u64, bool)],
) -> (PathBuf, PathBuf) {
    let staged = Staged::open(final_path, header, Algorithms::ALL).unwrap();
    let src = fs::File::open(source).unwrap();
    let journal = staged.journal().unwrap();
    for &(i, written) in chunks {
        let len = (header.size - i * CHUNK).min(CHUNK) as usize;
        let mut buf = vec![0u8; len];
        src.read_exact_at(&mut buf, i * CHUNK).unwrap();
        if written {
            staged.file().write_all_at(&buf, i * CHUNK).unwrap();
        }
        journal
            .append(i, &hash_chunk(header.algorithm, &buf))
            .unwrap();
    }
    drop(staged);
    partial_paths(final_path).unwrap()
}

fn age(path: &Path, by: Duration) {
    let f = fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - by).unwrap();
}

#[test]
fn startup_cleanup_removes_stale_files_and_keeps_young_partials() {
    let mut env = Env::new();
    let dir = env.share("sub");
    fs::create_dir(&dir).unwrap();
    let size = 3 * CHUNK + 5;
    let header = JournalHeader {
        size,
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        algorithm: HashAlgorithm::Blake3,
        source: [0; 32],
    };
    for name in ["fresh.bin", "old.bin"] {
        write_random_file(&env.local(name), size, 7);
    }
    // What interrupted uploads leave: a young partial (chunk 1 written; chunk 2
    // journaled but never written) and one two days old...
    let (fresh_part, fresh_journal) = leave_partial(
        &dir.join("fresh.bin"),
        &header,
        &env.local("fresh.bin"),
        &[(1, true), (2, false)],
    );
    let (old_part, old_journal) = leave_partial(
        &dir.join("old.bin"),
        &header,
        &env.local("old.bin"),
        &[(0, true)],
    );
    age(&old_part, Duration::from_secs(2 * 86_400));
    age(&old_journal, Duration::from_secs(2 * 86_400));
    // ...and what is never resumable: a scratch file, a journal without its partial, a
    // partial without its journal.
    fs::write(dir.join(".ferry-tmp.0123456789abcdef"), b"scratch").unwrap();
    let (_, lone_journal) = partial_paths(&dir.join("gone.bin")).unwrap();
    fs::write(&lone_journal, b"journal").unwrap();
    let (lone_part, _) = partial_paths(&dir.join("lost.bin")).unwrap();
    fs::write(&lone_part, b"partial").unwrap();

    env.server_mut().restart(&[] as &[&str]);
    assert!(env.server().wait_for_log(CLEANUP_LINE, 1, CLEANUP_TIMEOUT));
    assert!(
        env.server().stderr().contains(
            "share data: startup cleanup removed 5 stale temporary files, kept 1 resumable"
        ),
        "{}",
        env.server().stderr()
    );
    assert_eq!(temp_files(&env.share("")), vec![fresh_journal, fresh_part]);

    // The young partial is resumed: its written chunk is verified and not pulled, the
    // lying record's chunk is pulled.
    let out = env.rcp(rcp_args![
        "--json",
        env.local("fresh.bin"),
        env.remote("sub/fresh.bin")
    ]);
    out.assert_success();
    assert_eq!(sent_and_reused(&out), (size - CHUNK, CHUNK));
    ferry_tests::assert_files_equal(&env.local("fresh.bin"), &dir.join("fresh.bin"));
    assert_no_temp_files(&env.share(""));

    // With --partial-ttl 0, no partial survives a restart.
    leave_partial(
        &dir.join("old.bin"),
        &header,
        &env.local("old.bin"),
        &[(0, true), (3, true)],
    );
    env.server_mut().restart(&["--partial-ttl", "0"]);
    assert!(env.server().wait_for_log(CLEANUP_LINE, 1, CLEANUP_TIMEOUT));
    assert!(
        env.server()
            .stderr()
            .contains("startup cleanup removed 2 stale temporary files, kept 0"),
        "{}",
        env.server().stderr()
    );
    assert_no_temp_files(&env.share(""));
    let out = env.rcp(rcp_args![
        "--json",
        env.local("old.bin"),
        env.remote("sub/old.bin")
    ]);
    out.assert_success();
    assert_eq!(sent_and_reused(&out), (size, 0));
}

#[test]
fn a_download_resumes_only_a_partial_of_the_same_source_version() {
    let env = Env::new();
    let size = 4 * CHUNK + 9;
    write_random_file(&env.share("f.bin"), size, 11);
    let header = JournalHeader {
        size,
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        algorithm: HashAlgorithm::Blake3,
        source: source_tag(&attr_of(&fs::metadata(env.share("f.bin")).unwrap(), None)),
    };
    let dst = env.local("f.bin");
    // Chunks 0 and 4 (the short last one) written and journaled, chunk 2 journaled only.
    leave_partial(
        &dst,
        &header,
        &env.share("f.bin"),
        &[(0, true), (2, false), (4, true)],
    );
    let out = env.rcp(rcp_args!["--json", env.remote("f.bin"), &dst]);
    out.assert_success();
    assert_eq!(sent_and_reused(&out), (3 * CHUNK, CHUNK + 9));
    ferry_tests::assert_files_equal(&env.share("f.bin"), &dst);
    assert_no_temp_files(&env.local(""));

    // A partial of another version of the file (another mtime) is started over.
    let other = JournalHeader {
        source: [1; 32],
        ..header
    };
    fs::remove_file(&dst).unwrap();
    leave_partial(&dst, &other, &env.share("f.bin"), &[(0, true), (1, true)]);
    let out = env.rcp(rcp_args!["--json", env.remote("f.bin"), &dst]);
    out.assert_success();
    assert_eq!(sent_and_reused(&out), (size, 0));
    ferry_tests::assert_files_equal(&env.share("f.bin"), &dst);
    assert_no_temp_files(&env.local(""));
}
