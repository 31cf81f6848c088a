//! Small uploads in batches: a backup's new and changed files of at most
//! [`SMALL_FILE_MAX_BYTES`](ferry_common::msg::SMALL_FILE_MAX_BYTES) (see
//! [`crate::batch::is_small`]) go to the server as `UploadBatch`es
//! ([`crate::batch::upload_batch`]), many files per request and one flush per batch on
//! the server, not one upload (open, window, commit, fsync) each.
//!
//! A changed file goes whole, without its previous copy as base: a file this small is
//! one chunk, which a base could spare only if the content did not change at all, and
//! asking costs the round trips the batch saves. Files fail one by one, as the per-file
//! path fails them: the first failure is the batch's error, returned once the rest of
//! the batch is settled. A file the batch cannot carry (its size moved since the walk)
//! is uploaded on the per-file path, against its base if it has one.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_common::msg::BATCH_MAX_FILES;

use crate::batch::{self, Outcome as FileOutcome, SmallUpload};
use crate::client::Client;
use crate::error::ClientError;
use crate::progress::{advance_fn, Progress};
use crate::transfer::{upload_file, upload_file_with_base};

use super::plan::{Class, Outcome};

/// Upload batches in flight at once. The server commits a batch in one blocking task
/// (one flush for all its files), so a few at once overlap one batch's flush with the
/// next one's reading here and its transfer.
pub const UPLOAD_BATCHES_IN_FLIGHT: usize = 4;

/// One small file to upload: `item.src` to `item.target`; `base` is its previous copy,
/// used only should the file leave the batch for the per-file path.
pub(super) struct SmallJob {
    pub class: Class,
    pub item: SmallUpload,
    pub base: Option<String>,
}

/// Splits `jobs` (in order) into batches for `client`'s server: each within the limits
/// of [`batch::pack`], and with at most an even share of [`UPLOAD_BATCHES_IN_FLIGHT`]
/// so that a small run still has that many batches to overlap.
pub(super) fn pack(client: &Client, jobs: Vec<SmallJob>) -> Vec<Vec<SmallJob>> {
    let per_batch = jobs
        .len()
        .div_ceil(UPLOAD_BATCHES_IN_FLIGHT)
        .clamp(1, BATCH_MAX_FILES);
    let capacity = batch::capacity(client);
    let mut batches = Vec::new();
    let mut jobs = jobs.into_iter().peekable();
    while jobs.peek().is_some() {
        let group: Vec<SmallJob> = jobs.by_ref().take(per_batch).collect();
        batches.extend(batch::pack(
            group,
            capacity,
            |j| j.item.size,
            |j| j.item.target.len(),
        ));
    }
    batches
}

/// Sends one batch and settles each file: committed (its outcome), failed (the first
/// failure is returned, after the batch's other files are settled), or left to the
/// per-file path (uploaded there unless a file of the batch failed).
pub(super) async fn run_upload_batch(
    client: Client,
    share: String,
    jobs: Vec<SmallJob>,
    progress: Arc<dyn Progress>,
) -> Result<Vec<Outcome>, ClientError> {
    let advance = advance_fn(&progress);
    // Targets are distinct within a backup: each names one entry of the snapshot.
    let mut meta: HashMap<String, (Class, Option<String>)> = HashMap::with_capacity(jobs.len());
    let items = jobs
        .into_iter()
        .map(|j| {
            meta.insert(j.item.target.clone(), (j.class, j.base));
            j.item
        })
        .collect();
    let mut outcomes = Vec::new();
    let mut per_file = Vec::new();
    let mut first_err = None;
    for (item, result) in batch::upload_batch(&client, &share, items, &advance).await {
        let (class, base) = meta
            .remove(&item.target)
            .expect("upload_batch returns each of its items once, and targets are distinct");
        match result {
            FileOutcome::Copied(c) => outcomes.push(Outcome {
                class,
                bytes_sent: c.bytes_sent,
                bytes_reused: c.bytes_reused,
            }),
            FileOutcome::Failed(e) => {
                first_err.get_or_insert(e);
            }
            FileOutcome::PerFile => per_file.push((class, item, base)),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for (class, item, base) in per_file {
        let c = match base {
            Some(base) => {
                upload_file_with_base(
                    &client,
                    &item.src,
                    &share,
                    &item.target,
                    &base,
                    advance.clone(),
                )
                .await?
            }
            None => upload_file(&client, &item.src, &share, &item.target, advance.clone()).await?,
        };
        outcomes.push(Outcome {
            class,
            bytes_sent: c.bytes_sent,
            bytes_reused: c.bytes_reused,
        });
    }
    Ok(outcomes)
}
