//! Hard links in batches: a backup's unchanged files (most of an incremental run) go
//! to the server as [`Request::LinkBatch`](ferry_common::msg::Request)es of up to
//! [`LINK_BATCH_MAX`] links, not one `Link` request each.
//!
//! A batch is packed by count and by encoded size, so that it always fits the server's
//! request frame ([`MAX_REQUEST_FRAME_BYTES`]). Links fail one by one: a link refused
//! with `TooManyLinks` falls back to an upload against its source, as a lone `Link`
//! would; any other refused link fails the backup.

use std::sync::Arc;

use ferry_common::msg::{ErrorKind, LINK_BATCH_MAX};

use crate::client::Client;
use crate::error::ClientError;
use crate::links::pack_links;
use crate::progress::{advance_fn, Progress};
use crate::transfer::upload_file_with_base;

use super::plan::{LinkJob, Outcome};

/// Link batches in flight at once. The server does a batch in one blocking task, so a
/// few at once keep its blocking pool and the connection busy while the client packs
/// and answers the others.
pub const LINK_BATCHES_IN_FLIGHT: usize = 4;

/// Splits `links` (in order) into batches of at most `max_links` links whose request
/// for `share` fits the request frame ([`pack_links`]).
pub(super) fn pack(share: &str, links: Vec<LinkJob>, max_links: usize) -> Vec<Vec<LinkJob>> {
    pack_links(share, links, max_links, |l| (&l.from, &l.to))
}

/// Links of `total` unchanged files per batch: full batches for big runs, smaller ones
/// for small runs, so that [`LINK_BATCHES_IN_FLIGHT`] batches still overlap.
pub(super) fn batch_size(total: usize) -> usize {
    total
        .div_ceil(LINK_BATCHES_IN_FLIGHT)
        .clamp(1, LINK_BATCH_MAX)
}

/// Sends one batch and settles each link: made (nothing sent), or at the link limit
/// (uploaded against its source, which the server copies locally). The first other
/// refusal is returned after the fallbacks already started have finished.
pub(super) async fn run_batch(
    client: Client,
    share: String,
    batch: Vec<LinkJob>,
    progress: Arc<dyn Progress>,
) -> Result<Vec<Outcome>, ClientError> {
    let pairs = batch
        .iter()
        .map(|l| (l.from.clone(), l.to.clone()))
        .collect();
    let results = client.link_batch(&share, pairs).await?;
    let mut outcomes = Vec::with_capacity(batch.len());
    for (link, result) in batch.into_iter().zip(results) {
        let outcome = |bytes_sent, bytes_reused| Outcome {
            class: link.class,
            bytes_sent,
            bytes_reused,
        };
        match result {
            Ok(()) => {
                progress.advance(link.size);
                outcomes.push(outcome(0, link.size));
            }
            Err(e) if e.kind == ErrorKind::TooManyLinks => {
                tracing::info!(file = %link.from, "at the link limit: copying it on the server instead");
                let advance = advance_fn(&progress);
                let c = upload_file_with_base(
                    &client, &link.path, &share, &link.to, &link.from, advance,
                )
                .await?;
                outcomes.push(outcome(c.bytes_sent, c.bytes_reused));
            }
            Err(e) => return Err(ClientError::Remote(e)),
        }
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup::plan::Class;
    use ferry_common::codec::{
        encode, link_batch_base_bytes, link_pair_bytes, MAX_REQUEST_FRAME_BYTES,
    };
    use ferry_common::msg::{Message, Request, MAX_PATH_BYTES};
    use std::path::PathBuf;

    fn job(from: String, to: String) -> LinkJob {
        LinkJob {
            class: Class::Unchanged,
            size: 1,
            from,
            to,
            path: PathBuf::new(),
        }
    }

    fn encoded(share: &str, batch: &[LinkJob]) -> usize {
        let links = batch
            .iter()
            .map(|l| (l.from.clone(), l.to.clone()))
            .collect();
        let msg = Message::Request {
            id: u64::MAX,
            body: Request::LinkBatch {
                share: share.into(),
                links,
            },
        };
        encode(&msg).unwrap().len()
    }

    #[test]
    fn batches_respect_the_count_and_the_request_frame() {
        let share = "s".repeat(255);
        // Short names: bound by the count.
        let short: Vec<_> = (0..1000)
            .map(|i| job(format!("prev/{i}"), format!("new/{i}")))
            .collect();
        let batches = pack(&share, short, LINK_BATCH_MAX);
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            [256, 256, 256, 232]
        );
        // Long names: bound by the frame, every batch as full as it can be.
        let long: Vec<_> = (0..100)
            .map(|i| {
                let name = format!("{i:03}{}", "x".repeat(MAX_PATH_BYTES / 2 - 3));
                job(format!("a{name}"), format!("b{name}"))
            })
            .collect();
        let batches = pack(&share, long, LINK_BATCH_MAX);
        assert!(batches.len() > 1);
        let mut seen = 0;
        for b in &batches {
            let len = encoded(&share, b);
            assert!(len <= MAX_REQUEST_FRAME_BYTES, "{len}");
            seen += b.len();
            if seen < 100 {
                // One more link would not have fit.
                assert!(len + 2 * MAX_PATH_BYTES > MAX_REQUEST_FRAME_BYTES, "{len}");
            }
        }
        assert_eq!(seen, 100);
        // The estimate is exact for the longest id, but for the count: one link takes
        // one byte of varint, the estimate reserves two (for up to LINK_BATCH_MAX).
        let one = pack("share", vec![job("a/b".into(), "c/d".into())], 8);
        assert_eq!(
            encoded("share", &one[0]) + 1,
            link_batch_base_bytes("share") + link_pair_bytes("a/b", "c/d")
        );
    }

    #[test]
    fn small_runs_get_smaller_batches() {
        assert_eq!(batch_size(0), 1);
        assert_eq!(batch_size(10), 3);
        assert_eq!(batch_size(2000), 256);
        assert_eq!(pack("s", Vec::new(), 10).len(), 0);
    }
}
