//! The job scheduler that copies and backups share: items in *lanes*, each lane with a
//! limit of its own on the items in flight, all lanes running at once.
//!
//! A lane is one kind of work with one cost: `rcp -r` runs batches of small files and
//! large files in one lane of `--jobs` and symlinks in another; a backup runs link
//! batches, upload batches, small jobs and big uploads in four (see
//! `backup::jobs`), its directories a level at a time in one, and a verify its files
//! in one. Items of a lane start in the order given. The first failure stops
//! new items from starting in every lane; the running ones are waited for, then it is
//! returned. Work that must go on past a failure (a copy's items) records its failure
//! itself and returns `Ok`.

use std::future::Future;

use tokio::task::JoinSet;

use crate::error::ClientError;

/// A lane without a limit of its own: every item starts at once.
pub const UNLIMITED: usize = usize::MAX;

/// Runs `op` on every item of every lane, each lane with at most its limit of items
/// at once (a limit of 0 counts as 1) and all lanes at the same time, and returns the
/// results in completion order. The first failure stops new items from starting; the
/// running ones are waited for, then it is returned.
pub async fn run_lanes<T, R, F, Fut>(
    lanes: Vec<(Vec<T>, usize)>,
    op: F,
) -> Result<Vec<R>, ClientError>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = Result<R, ClientError>> + Send + 'static,
    R: Send + 'static,
{
    let mut lanes: Vec<_> = lanes
        .into_iter()
        .map(|(items, limit)| (items.into_iter(), limit.max(1), 0usize))
        .collect();
    let mut tasks = JoinSet::new();
    let mut results = Vec::new();
    let mut first_err = None;
    loop {
        for (lane, (queue, limit, running)) in lanes.iter_mut().enumerate() {
            while first_err.is_none() && *running < *limit {
                let Some(item) = queue.next() else { break };
                *running += 1;
                let fut = op(item);
                tasks.spawn(async move { (lane, fut.await) });
            }
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        match joined {
            Ok((lane, result)) => {
                lanes[lane].2 -= 1;
                match result {
                    Ok(r) => results.push(r),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            // A task that panicked: nothing more starts (its lane's count stays up).
            Err(e) => {
                first_err.get_or_insert(ClientError::Disconnected(format!("a task failed: {e}")));
            }
        }
    }
    first_err.map_or(Ok(results), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn each_lane_keeps_its_limit_and_a_failure_stops_new_items() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let op = |_: u32| {
            let (running, most) = (running.clone(), most.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        };
        let done = run_lanes(vec![((0..20).collect(), 3)], op).await.unwrap();
        assert_eq!(done.len(), 20);
        assert!(most.load(Ordering::SeqCst) <= 3);

        let started = Arc::new(AtomicUsize::new(0));
        let failing = |i: u32| {
            let started = started.clone();
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                match i {
                    0 => Err(ClientError::Usage("first".into())),
                    _ => Ok(i),
                }
            }
        };
        let e = run_lanes(vec![((0..100).collect(), 1)], failing).await;
        assert!(matches!(e, Err(ClientError::Usage(m)) if m == "first"));
        assert_eq!(started.load(Ordering::SeqCst), 1);
    }
}
