//! Packing hard links into [`Request::LinkBatch`](ferry_common::msg::Request)es, for
//! backups (`backup::links`) and `rcp -r -H` (`copy::upload`).

use ferry_common::codec::{link_batch_base_bytes, link_pair_bytes, MAX_REQUEST_FRAME_BYTES};
use ferry_common::msg::LINK_BATCH_MAX;

/// Splits `links` (in order) into batches of at most `max_links` links whose request
/// for `share` fits [`MAX_REQUEST_FRAME_BYTES`]; `pair` names a link's `(from, to)`.
/// A single link too long for any batch (paths of 4 KiB each cannot make one: the
/// frame holds several) still gets a batch of its own, which the client library
/// refuses with a clear error.
pub fn pack_links<T>(
    share: &str,
    links: Vec<T>,
    max_links: usize,
    pair: impl Fn(&T) -> (&String, &String),
) -> Vec<Vec<T>> {
    let base = link_batch_base_bytes(share);
    let max_links = max_links.clamp(1, LINK_BATCH_MAX);
    let mut batches = Vec::new();
    let mut batch: Vec<T> = Vec::new();
    let mut bytes = base;
    for link in links {
        let (from, to) = pair(&link);
        let more = link_pair_bytes(from, to);
        if !batch.is_empty() && (batch.len() == max_links || bytes + more > MAX_REQUEST_FRAME_BYTES)
        {
            batches.push(std::mem::take(&mut batch));
            bytes = base;
        }
        bytes += more;
        batch.push(link);
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches
}
