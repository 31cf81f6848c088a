//! Running a backup's plan (see `plan`) with many requests in flight.
//!
//! The plan's work runs in four lanes of the shared scheduler ([`run_lanes`]) at once:
//! links in batches (see `links`), [`LINK_BATCHES_IN_FLIGHT`] batches at a time;
//! uploads of small files ([`crate::batch::is_small`]) in batches (see `uploads`),
//! [`UPLOAD_BATCHES_IN_FLIGHT`] batches at a time; the other *small* jobs (symlinks,
//! uploads of files of at most one chunk) up to `jobs` at a time, since they are bound
//! by round trips; and uploads of larger files up to [`BIG_UPLOADS_IN_FLIGHT`] at a
//! time, since each keeps whole windows of its file mapped (and, over RDMA,
//! registered). A dry run batches nothing: it sends nothing, and estimates each upload
//! as a job of its own. The first failure stops new work from starting; the running
//! ones are waited for.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use ferry_common::chunk::hash_chunk;

use crate::batch::{is_small, SmallUpload};
use crate::client::Client;
use crate::error::ClientError;
use crate::progress::{advance_fn, Progress};
use crate::schedule::run_lanes;
use crate::transfer::{upload_file, upload_file_with_base};

use super::links::{batch_size, pack, run_batch, LINK_BATCHES_IN_FLIGHT};
use super::plan::{Action, Job, LinkJob, Outcome, Work};
use super::uploads::{self, run_upload_batch, SmallJob, UPLOAD_BATCHES_IN_FLIGHT};

/// Uploads of files larger than one chunk in flight at once.
pub const BIG_UPLOADS_IN_FLIGHT: usize = 4;

impl Job {
    /// True for an upload (or, in a dry run, an estimate) of more than one chunk.
    fn is_big(&self, chunk_bytes: u32) -> bool {
        matches!(self.action, Action::Upload { .. }) && self.size > u64::from(chunk_bytes)
    }

    /// The job as a file of an upload batch, if it is the upload of a small file; else
    /// the job itself.
    fn into_small(self, client: &Client) -> Result<SmallJob, Job> {
        match self.action {
            Action::Upload { path, to, base } if is_small(client, self.size) => Ok(SmallJob {
                class: self.class,
                item: SmallUpload {
                    src: path,
                    target: to,
                    size: self.size,
                },
                base,
            }),
            action => Err(Job { action, ..self }),
        }
    }

    /// Does the job; in a dry run, writes nothing and says what it would send.
    async fn run(
        self,
        client: Client,
        share: String,
        dry_run: bool,
        progress: Arc<dyn Progress>,
    ) -> Result<Outcome, ClientError> {
        let outcome = |bytes_sent, bytes_reused| Outcome {
            class: self.class,
            bytes_sent,
            bytes_reused,
        };
        let advance = advance_fn(&progress);
        match self.action {
            Action::Symlink { to, target } => {
                if !dry_run {
                    client.symlink(&share, &to, &target).await?;
                }
                Ok(outcome(0, 0))
            }
            Action::Keep => {
                progress.advance(self.size);
                Ok(outcome(0, self.size))
            }
            Action::Upload { path, base, .. } if dry_run => {
                // A small file goes whole in a batch (see `uploads`).
                let sent = match base {
                    Some(base) if !is_small(&client, self.size) => {
                        estimate_sent(&client, &share, &path, &base).await?
                    }
                    _ => self.size,
                };
                progress.advance(self.size);
                Ok(outcome(sent, self.size.saturating_sub(sent)))
            }
            Action::Upload { path, to, base } => {
                let c = match base {
                    Some(base) => {
                        upload_file_with_base(&client, &path, &share, &to, &base, advance).await?
                    }
                    None => upload_file(&client, &path, &share, &to, advance).await?,
                };
                Ok(outcome(c.bytes_sent, c.bytes_reused))
            }
        }
    }
}

/// The bytes an upload of `local` against the server's `base` would send: the chunks
/// whose hash the base's manifest does not list (the server matches by hash, at any
/// offset).
async fn estimate_sent(
    client: &Client,
    share: &str,
    local: &Path,
    base: &str,
) -> Result<u64, ClientError> {
    let chunk_bytes = client.welcome().chunk_bytes;
    // In the base's manifest's algorithm, which the upload would use too.
    let (version, hashes) = client.manifest(share, base, chunk_bytes).await?;
    let algorithm = version.algorithm;
    let held: HashSet<_> = hashes.into_iter().collect();
    let local = local.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut file =
            File::open(&local).map_err(|e| ClientError::local(&local, "cannot open", e))?;
        let mut buf = vec![0u8; chunk_bytes.max(1) as usize];
        let mut missing = 0u64;
        loop {
            let n = read_full(&mut file, &mut buf)
                .map_err(|e| ClientError::local(&local, "cannot read", e))?;
            if n == 0 {
                return Ok(missing);
            }
            if !held.contains(&hash_chunk(algorithm, &buf[..n])) {
                missing += n as u64;
            }
        }
    })
    .await
    .map_err(|e| ClientError::Disconnected(format!("hashing task failed: {e}")))?
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// What one lane task runs.
enum Task {
    One(Job),
    Links(Vec<LinkJob>),
    Uploads(Vec<SmallJob>),
}

/// Runs `work` in the four lanes of the module docs, `small_limit` small jobs at
/// once, and returns their outcomes (in completion order). In a dry run, links are
/// only counted: nothing is sent.
pub(super) async fn run_jobs(
    client: &Client,
    share: &str,
    work: Vec<Work>,
    small_limit: usize,
    dry_run: bool,
    progress: Arc<dyn Progress>,
) -> Result<Vec<Outcome>, ClientError> {
    let chunk_bytes = client.welcome().chunk_bytes;
    let mut links = Vec::new();
    let mut jobs = Vec::new();
    for w in work {
        match w {
            Work::Link(l) => links.push(l),
            Work::Job(j) => jobs.push(j),
        }
    }
    let mut outcomes = Vec::new();
    let batches = if dry_run {
        for l in links {
            progress.advance(l.size);
            outcomes.push(Outcome {
                class: l.class,
                bytes_sent: 0,
                bytes_reused: l.size,
            });
        }
        Vec::new()
    } else {
        let per_batch = batch_size(links.len());
        pack(share, links, per_batch)
    };
    let mut batched = Vec::new();
    let mut singles = Vec::new();
    for job in jobs {
        if dry_run {
            singles.push(job);
            continue;
        }
        match job.into_small(client) {
            Ok(s) => batched.push(s),
            Err(job) => singles.push(job),
        }
    }
    let (big, small): (Vec<Job>, Vec<Job>) =
        singles.into_iter().partition(|j| j.is_big(chunk_bytes));
    let tasks = |jobs: Vec<Job>| jobs.into_iter().map(Task::One).collect::<Vec<_>>();
    let lanes = vec![
        (
            batches.into_iter().map(Task::Links).collect(),
            LINK_BATCHES_IN_FLIGHT,
        ),
        (
            uploads::pack(client, batched)
                .into_iter()
                .map(Task::Uploads)
                .collect(),
            UPLOAD_BATCHES_IN_FLIGHT,
        ),
        (tasks(small), small_limit),
        (tasks(big), BIG_UPLOADS_IN_FLIGHT),
    ];
    let done = run_lanes(lanes, |task: Task| {
        let (client, share, progress) = (client.clone(), share.to_string(), progress.clone());
        async move {
            match task {
                Task::One(job) => Ok(vec![job.run(client, share, dry_run, progress).await?]),
                Task::Links(batch) => run_batch(client, share, batch, progress).await,
                Task::Uploads(batch) => run_upload_batch(client, share, batch, progress).await,
            }
        }
    })
    .await?;
    outcomes.extend(done.into_iter().flatten());
    Ok(outcomes)
}
