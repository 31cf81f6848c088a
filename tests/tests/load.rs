//! Load (issue 6, point 6): many clients doing mixed uploads and downloads against one
//! ferryd for a bounded time.
//!
//! [`RCP_CLIENTS`] worker threads each run real `rcp` processes one after another, and
//! [`LIB_CLIENTS`] in-process [`Client`]s each keep one connection for the whole run:
//! [`CLIENTS`] clients in flight at every moment. A job uploads or downloads one to
//! three files of seeded random content (a few KiB up to 32 MiB; smaller under RDMA,
//! where everything runs in a slow VM), to a new name or into a directory; about one
//! rcp job in ten is SIGKILLed part-way. Every completed result is compared byte for
//! byte with its source; a killed job's result must be either absent or whole.
//!
//! Afterwards ferryd must be back where it started: its open descriptors equal the
//! idle baseline taken before the load, its counters show no registration and no open
//! transfer, no temporary file is left in the share but the resumable partials (with
//! their journals) of killed uploads, and its peak RSS (VmHWM) stays under
//! [`rss_bound`].

use std::ffi::OsString;
use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ferry_client::transfer::{download_file, upload_file, ProgressFn};
use ferry_client::Client;
use ferry_common::msg::{ServerStats, DEFAULT_CHUNK_BYTES};
use ferry_server::config::DEFAULT_QUEUE_DEPTH;
use ferry_tests::{
    assert_no_temp_files, assert_only_resumable_temp_files, open_fds, proc_status, rcp_args,
    spawn_rcp, test_choice, test_host, test_transport, write_random_file, Env, RcpChild, RcpOutput,
    MIB,
};
use rand::distributions::{Distribution, WeightedIndex};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Worker threads running real `rcp` processes, one at a time each.
const RCP_CLIENTS: usize = 24;
/// In-process clients, one long-lived connection each.
const LIB_CLIENTS: usize = 8;
/// Clients in flight at once.
const CLIENTS: usize = RCP_CLIENTS + LIB_CLIENTS;
/// Seed of every random choice (file sizes, contents, jobs).
const SEED: u64 = 0x10ad_0006;
/// One rcp job in this many is killed part-way.
const KILL_ONE_IN: u32 = 10;
/// How often the monitor samples ferryd's counters during the load.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// How long ferryd may take to tear the last connections down after the load.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long ferryd may take to answer one `Stats`, however loaded.
const STATS_TIMEOUT: Duration = Duration::from_secs(30);
/// What ferryd may use beyond its idle RSS and its connections' buffers: blocking-pool
/// thread stacks, the allocator's per-thread arenas, tokio tasks and request state.
const RSS_MARGIN_BYTES: u64 = 64 * MIB;
/// Per connection beyond its chunk buffers: the TCP engine's 256 KiB read and write
/// buffers, control messages and request bookkeeping; on RDMA the registered control
/// rings (16 send + 32 receive slots of 16 KiB).
const CONN_OVERHEAD_BYTES: u64 = MIB;

/// How big and how long: the host's TCP run, or the scaled-down Soft-RoCE run.
struct Scale {
    /// How long new jobs are started.
    load_time: Duration,
    /// The longest one job may take (a hard limit: the job is killed and the test fails).
    job_timeout: Duration,
    /// Sizes of the seed files, in bytes.
    sizes: Vec<u64>,
}

fn scale() -> Scale {
    let mut rng = StdRng::seed_from_u64(SEED);
    let mut draw = |n: usize, lo: u64, hi: u64| -> Vec<u64> {
        (0..n).map(|_| rng.gen_range(lo..hi)).collect()
    };
    if test_transport() == "rdma" {
        // Soft-RoCE in a 2 GiB VM is 10-15x slower: still every client at once, but
        // small files, and each rcp's registered windows stay small.
        let mut sizes = draw(6, 4 << 10, 256 << 10);
        sizes.extend(draw(4, 256 << 10, 2 * MIB));
        sizes.extend([MIB, 4 * MIB]);
        Scale {
            load_time: Duration::from_secs(20),
            job_timeout: Duration::from_secs(120),
            sizes,
        }
    } else {
        let mut sizes = draw(6, 4 << 10, 256 << 10);
        sizes.extend(draw(6, 256 << 10, 4 * MIB));
        sizes.extend(draw(3, 4 * MIB, 12 * MIB));
        // Chunk and window boundaries, and the largest files.
        sizes.extend([MIB, 16 * MIB, 16 * MIB + 1, 32 * MIB]);
        Scale {
            load_time: Duration::from_secs(15),
            job_timeout: Duration::from_secs(60),
            sizes,
        }
    }
}

/// The peak RSS ferryd may reach with `connections` open at once, having started at
/// `idle_rss` bytes:
///
/// ```text
/// idle_rss + connections * (queue_depth * chunk_bytes + CONN_OVERHEAD_BYTES) + RSS_MARGIN_BYTES
/// ```
///
/// Each connection's bulk memory is its pool of at most `queue_depth` (default 8)
/// registered chunk buffers of `chunk_bytes` (1 MiB), whatever the number and size of
/// its transfers; everything else a connection holds is small and bounded
/// ([`CONN_OVERHEAD_BYTES`]); the margin covers what grows with threads rather than
/// connections ([`RSS_MARGIN_BYTES`]).
fn rss_bound(idle_rss: u64, connections: u64) -> u64 {
    let pool = DEFAULT_QUEUE_DEPTH as u64 * u64::from(DEFAULT_CHUNK_BYTES);
    idle_rss + connections * (pool + CONN_OVERHEAD_BYTES) + RSS_MARGIN_BYTES
}

/// The seed files: `<local>/seed/<name>` to upload, the same bytes in the share's
/// `seed/` to download.
struct Seeds {
    names: Vec<String>,
    sizes: Vec<u64>,
    local: PathBuf,
}

impl Seeds {
    fn write(env: &Env, sizes: &[u64]) -> Seeds {
        let local = env.local("seed");
        fs::create_dir(&local).unwrap();
        fs::create_dir(env.share("seed")).unwrap();
        let names: Vec<String> = sizes
            .iter()
            .enumerate()
            .map(|(i, len)| format!("f{i:02}-{len}.bin"))
            .collect();
        for (i, (name, &len)) in names.iter().zip(sizes).enumerate() {
            write_random_file(&local.join(name), len, SEED + i as u64);
            fs::copy(local.join(name), env.share("seed").join(name)).unwrap();
        }
        Seeds {
            names,
            sizes: sizes.to_vec(),
            local,
        }
    }

    /// `n` distinct seed files, small ones more often than big ones: the file of size
    /// rank `r` (1 = the smallest) has weight `1/sqrt(r)`.
    fn pick(&self, rng: &mut StdRng, n: usize) -> Vec<usize> {
        let mut by_size: Vec<usize> = (0..self.sizes.len()).collect();
        by_size.sort_by_key(|&i| self.sizes[i]);
        let weights = (1..=by_size.len()).map(|r| 1.0 / (r as f64).sqrt());
        let ranks = WeightedIndex::new(weights).expect("positive weights");
        let mut picked = Vec::new();
        while picked.len() < n.min(by_size.len()) {
            let i = by_size[ranks.sample(rng)];
            if !picked.contains(&i) {
                picked.push(i);
            }
        }
        picked
    }
}

/// What the clients did.
#[derive(Debug, Default)]
struct Tally {
    jobs: u64,
    killed: u64,
    uploads: u64,
    downloads: u64,
    bytes: u64,
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        self.jobs += other.jobs;
        self.killed += other.killed;
        self.uploads += other.uploads;
        self.downloads += other.downloads;
        self.bytes += other.bytes;
    }
}

/// What the monitor saw during the load.
#[derive(Debug, Default, Clone, Copy)]
struct Peaks {
    samples: u64,
    connections: u64,
    registrations: u64,
    open_transfers: u64,
    /// ferryd's threads (runtime workers plus the blocking pool).
    threads: u64,
}

/// Everything a worker needs.
struct Ctx {
    env: Env,
    seeds: Seeds,
    scale: Scale,
    start: Instant,
    /// Set by the first worker that fails, so the others stop starting jobs.
    failed: AtomicBool,
    tally: Mutex<Tally>,
}

impl Ctx {
    fn running(&self) -> bool {
        self.start.elapsed() < self.scale.load_time && !self.failed.load(Ordering::SeqCst)
    }
}

/// Marks the run failed if the worker holding it panics.
struct FailFlag<'a>(&'a AtomicBool);

impl Drop for FailFlag<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

/// Waits for `child` at most `limit`; on timeout kills it and panics.
fn wait_within(mut child: RcpChild, limit: Duration) -> RcpOutput {
    let start = Instant::now();
    while child.is_running() {
        if start.elapsed() > limit {
            let out = child.kill();
            panic!("rcp ran longer than {limit:?} and was killed\n{out}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    child.wait()
}

/// One rcp job of worker `w`: 1-3 files up or down, maybe killed part-way. Returns
/// what it moved.
fn rcp_job(ctx: &Ctx, rng: &mut StdRng, w: usize, n: u64) -> Tally {
    let env = &ctx.env;
    let count = [1, 1, 1, 2, 3][rng.gen_range(0..5)];
    let files = ctx.seeds.pick(rng, count);
    let upload = rng.gen_bool(0.5);
    let to_dir = count > 1 || rng.gen_bool(0.5);
    let kill_after =
        (rng.gen_ratio(1, KILL_ONE_IN)).then(|| Duration::from_millis(rng.gen_range(10..400)));
    let tag = format!("w{w:02}-{n:04}");
    let name = |i: usize| &ctx.seeds.names[i];

    // (source, result) pairs, and the rcp arguments.
    let (pairs, args): (Vec<(PathBuf, PathBuf)>, Vec<OsString>) = if upload {
        let sources: Vec<PathBuf> = files
            .iter()
            .map(|&i| ctx.seeds.local.join(name(i)))
            .collect();
        if to_dir {
            let rel = format!("up/{tag}");
            fs::create_dir(env.share(&rel)).unwrap();
            let pairs = files
                .iter()
                .map(|&i| {
                    let src = ctx.seeds.local.join(name(i));
                    (src, env.share(&format!("{rel}/{}", name(i))))
                })
                .collect();
            let mut args: Vec<OsString> = sources.iter().map(Into::into).collect();
            args.push(env.remote(&format!("{rel}/")).into());
            (pairs, args)
        } else {
            let rel = format!("up/{tag}-{}", name(files[0]));
            (
                vec![(sources[0].clone(), env.share(&rel))],
                rcp_args![sources[0], env.remote(&rel)],
            )
        }
    } else {
        let share_src = |i: usize| env.share(&format!("seed/{}", name(i)));
        if to_dir {
            let dir = env.local(&format!("down/{tag}"));
            fs::create_dir(&dir).unwrap();
            let pairs = files
                .iter()
                .map(|&i| (share_src(i), dir.join(name(i))))
                .collect();
            let mut args: Vec<OsString> = files
                .iter()
                .map(|&i| env.remote(&format!("seed/{}", name(i))).into())
                .collect();
            args.push(dir.clone().into());
            (pairs, args)
        } else {
            let dst = env.local(&format!("down/{tag}-{}", name(files[0])));
            (
                vec![(share_src(files[0]), dst.clone())],
                rcp_args![env.remote(&format!("seed/{}", name(files[0]))), dst],
            )
        }
    };

    let child = spawn_rcp(args);
    let mut tally = Tally {
        jobs: 1,
        ..Tally::default()
    };
    match kill_after {
        Some(delay) => {
            thread::sleep(delay);
            let out = child.kill();
            tally.killed = 1;
            // A run that ended before the kill must have succeeded.
            if out.code.is_some() {
                out.assert_success();
            }
            // Killed or not (it may have finished first), nothing partial may appear
            // under a final name: each result is absent or whole.
            for (src, dst) in &pairs {
                if dst.exists() {
                    ferry_tests::assert_files_equal(src, dst);
                } else if out.code == Some(0) {
                    panic!("rcp succeeded but {} is missing\n{out}", dst.display());
                }
            }
            // What is left (whole results; the resumable partial and journal a killed
            // upload leaves, or ferryd's scratch file of one, which it must remove
            // itself) stays for the final checks.
        }
        None => {
            wait_within(child, ctx.scale.job_timeout).assert_success();
            for (src, dst) in &pairs {
                ferry_tests::assert_files_equal(src, dst);
                let len = fs::metadata(dst).unwrap().len();
                tally.bytes += len;
                if upload {
                    tally.uploads += 1;
                } else {
                    tally.downloads += 1;
                }
                fs::remove_file(dst).unwrap();
            }
            if !upload && to_dir {
                // rcp removed its own temporary files.
                assert_no_temp_files(pairs[0].1.parent().unwrap());
            }
        }
    }
    tally
}

fn rcp_worker(ctx: &Ctx, w: usize) {
    let _flag = FailFlag(&ctx.failed);
    let mut rng = StdRng::seed_from_u64(SEED ^ ((w as u64 + 1) << 32));
    let mut mine = Tally::default();
    let mut n = 0;
    while ctx.running() {
        mine.add(&rcp_job(ctx, &mut rng, w, n));
        n += 1;
    }
    ctx.tally.lock().unwrap().add(&mine);
}

/// One in-process client: a connection for the whole run, 1-3 concurrent transfers per
/// job.
async fn lib_worker(ctx: Arc<Ctx>, w: usize, port: u16) {
    let _flag = FailFlag(&ctx.failed);
    let client = ferry_tests::connect_to(&test_host(), port, test_choice())
        .await
        .unwrap_or_else(|e| panic!("in-process client {w} cannot connect: {e}"));
    let mut rng = StdRng::seed_from_u64(SEED ^ ((w as u64 + 1) << 40));
    let mut mine = Tally::default();
    let mut n = 0u64;
    while ctx.running() {
        let count = [1, 1, 2, 3][rng.gen_range(0..4)];
        let mut jobs = tokio::task::JoinSet::new();
        for i in ctx.seeds.pick(&mut rng, count) {
            let upload = rng.gen_bool(0.5);
            let name = ctx.seeds.names[i].clone();
            let tag = format!("c{w:02}-{n:04}-{name}");
            let (src, dst) = if upload {
                (
                    ctx.seeds.local.join(&name),
                    ctx.env.share(&format!("up/{tag}")),
                )
            } else {
                (
                    ctx.env.share(&format!("seed/{name}")),
                    ctx.env.local(&format!("down/{tag}")),
                )
            };
            let (client, limit) = (client.clone(), ctx.scale.job_timeout);
            jobs.spawn(async move {
                let progress: ProgressFn = Arc::new(|_| {});
                let (up_rel, down_rel) = (format!("up/{tag}"), format!("seed/{name}"));
                let moved = if upload {
                    let f = upload_file(&client, &src, "data", &up_rel, progress);
                    tokio::time::timeout(limit, f).await
                } else {
                    let f = download_file(&client, "data", &down_rel, &dst, progress);
                    tokio::time::timeout(limit, f).await
                };
                let moved = moved
                    .unwrap_or_else(|_| panic!("{tag}: not done within {limit:?}"))
                    .unwrap_or_else(|e| panic!("{tag}: {e}"));
                tokio::task::spawn_blocking(move || {
                    ferry_tests::assert_files_equal(&src, &dst);
                    fs::remove_file(&dst).unwrap();
                })
                .await
                .unwrap();
                (upload, moved)
            });
        }
        while let Some(done) = jobs.join_next().await {
            let (upload, moved) =
                done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            mine.bytes += moved.bytes;
            if upload {
                mine.uploads += 1;
            } else {
                mine.downloads += 1;
            }
        }
        mine.jobs += 1;
        n += 1;
    }
    client.close();
    ctx.tally.lock().unwrap().add(&mine);
}

/// ferryd's counters, asked on `client`'s connection (at most [`STATS_TIMEOUT`]).
fn stats(rt: &tokio::runtime::Runtime, client: &Client) -> ServerStats {
    // The timer is made inside the runtime.
    rt.block_on(async { tokio::time::timeout(STATS_TIMEOUT, client.server_stats()).await })
        .unwrap_or_else(|_| panic!("ferryd did not answer Stats within {STATS_TIMEOUT:?}"))
        .expect("Stats")
}

/// Polls `stats` until `done` holds for them, at most [`SETTLE_TIMEOUT`]; returns the
/// last stats either way.
fn settle(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    done: impl Fn(&ServerStats) -> bool,
) -> ServerStats {
    let start = Instant::now();
    loop {
        let stats = stats(rt, client);
        if done(&stats) || start.elapsed() > SETTLE_TIMEOUT {
            return stats;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn many_clients_mixed_load_leaves_no_leaks_and_bounded_memory() {
    let test_start = Instant::now();
    let env = Env::new();
    let scale = scale();
    let seeds = Seeds::write(&env, &scale.sizes);
    fs::create_dir(env.share("up")).unwrap();
    fs::create_dir(env.local("down")).unwrap();
    let pid = env.server().pid();
    let port = env.server().port();

    // The idle baseline, with the monitoring connection open.
    let rt = ferry_tests::runtime();
    let monitor = rt
        .block_on(ferry_tests::connect_to(&test_host(), port, test_choice()))
        .expect("monitoring client");
    let idle = stats(&rt, &monitor);
    assert_eq!(
        (idle.connections, idle.registrations, idle.open_transfers),
        (1, 0, 0),
        "an idle ferryd with one connection: {idle:?}"
    );
    let idle_fds = open_fds(pid);
    let idle_rss = proc_status(pid, "VmRSS");

    let ctx = Arc::new(Ctx {
        env,
        seeds,
        scale,
        start: Instant::now(),
        failed: AtomicBool::new(false),
        tally: Mutex::new(Tally::default()),
    });
    let lib: Vec<_> = (0..LIB_CLIENTS)
        .map(|w| rt.spawn(lib_worker(ctx.clone(), w, port)))
        .collect();
    let rcp: Vec<_> = (0..RCP_CLIENTS)
        .map(|w| {
            let ctx = ctx.clone();
            thread::Builder::new()
                .name(format!("rcp-worker-{w}"))
                .spawn(move || rcp_worker(&ctx, w))
                .unwrap()
        })
        .collect();

    // Sample the counters while the clients run.
    let mut peaks = Peaks::default();
    while rcp.iter().any(|h| !h.is_finished()) || lib.iter().any(|h| !h.is_finished()) {
        let s = stats(&rt, &monitor);
        peaks.samples += 1;
        peaks.connections = peaks.connections.max(s.connections);
        peaks.registrations = peaks.registrations.max(s.registrations);
        peaks.open_transfers = peaks.open_transfers.max(s.open_transfers);
        peaks.threads = peaks.threads.max(proc_status(pid, "Threads"));
        thread::sleep(SAMPLE_EVERY);
    }
    let mut panics = Vec::new();
    for h in rcp {
        if let Err(p) = h.join() {
            panics.push(p);
        }
    }
    for h in lib {
        if let Err(e) = rt.block_on(h) {
            panics.push(e.into_panic());
        }
    }
    if let Some(p) = panics.into_iter().next() {
        std::panic::resume_unwind(p);
    }
    let load_secs = ctx.start.elapsed().as_secs_f64();
    let env = &ctx.env;
    env.server().assert_running();

    // Every other connection ends; then nothing may be left.
    let after = settle(&rt, &monitor, |s| {
        s.connections == 1 && s.registrations == 0 && s.open_transfers == 0
    });
    let start = Instant::now();
    let mut fds = open_fds(pid);
    while fds != idle_fds && start.elapsed() < SETTLE_TIMEOUT {
        thread::sleep(Duration::from_millis(20));
        fds = open_fds(pid);
    }
    let peak_rss = proc_status(pid, "VmHWM");
    // The clients and the monitor; a killed rcp's connection may still be ending when
    // its worker's next one starts, so take the sampled peak where it is higher.
    let connections = peaks.connections.max(CLIENTS as u64 + 1);
    let bound = rss_bound(idle_rss, connections);
    let tally = ctx.tally.lock().unwrap();
    println!(
        "load ({}): {CLIENTS} clients ({RCP_CLIENTS} rcp workers, {LIB_CLIENTS} in-process) for \
         {load_secs:.1} s: {} jobs ({} rcp killed), {} uploads + {} downloads verified, \
         {:.1} MiB",
        test_transport(),
        tally.jobs,
        tally.killed,
        tally.uploads,
        tally.downloads,
        tally.bytes as f64 / MIB as f64,
    );
    println!(
        "ferryd: peaks during the load: {} connections, {} registrations, {} open transfers, {} threads \
         ({} samples); after: {after:?}",
        peaks.connections, peaks.registrations, peaks.open_transfers, peaks.threads, peaks.samples
    );
    println!(
        "ferryd: fds idle {} / after {}; RSS idle {:.1} MiB, peak (VmHWM) {:.1} MiB, bound {:.1} MiB; \
         test took {:.1} s",
        idle_fds.len(),
        fds.len(),
        idle_rss as f64 / MIB as f64,
        peak_rss as f64 / MIB as f64,
        bound as f64 / MIB as f64,
        test_start.elapsed().as_secs_f64(),
    );

    assert!(
        tally.uploads > 0 && tally.downloads > 0,
        "the load moved files both ways: {tally:?}"
    );
    assert!(
        peaks.connections >= CLIENTS as u64 / 2,
        "the clients overlapped: at most {} connections seen",
        peaks.connections
    );
    // Each connection's pool holds at most queue_depth buffers.
    assert!(
        peaks.registrations <= connections * DEFAULT_QUEUE_DEPTH as u64,
        "registrations beyond the pools' bound: {peaks:?}"
    );
    assert_eq!(
        (
            after.connections,
            after.registrations,
            after.open_transfers,
            after.mapped_files
        ),
        (1, 0, 0, 0),
        "ferryd still holds resources of finished connections: {after:?}"
    );
    assert_eq!(
        fds, idle_fds,
        "ferryd's open descriptors after the load differ from the idle baseline"
    );
    // Killed uploads leave their resumable partials, and nothing else.
    assert_only_resumable_temp_files(&env.share(""));
    assert!(
        peak_rss <= bound,
        "ferryd's peak RSS {peak_rss} exceeds the bound {bound}"
    );
    env.server().assert_running();
}
