//! The directories of an upload, made a level at a time while files already go into
//! the levels that exist: a file waits only for its own directory's level, not for the
//! whole tree's.

use std::collections::HashSet;
use std::sync::Mutex;

use tokio::sync::watch;

/// Which levels of the planned directories exist, and which directories failed.
///
/// Invariant: once [`DirGate::level_done`] has published depth `d`, every planned
/// directory of depth `d` or less has been made or is in `failed` (or lies below one
/// that is); `failed` only grows.
pub(super) struct DirGate {
    /// The planned directories' targets (share-relative).
    planned: HashSet<String>,
    /// The deepest level finished so far (`None`: none yet).
    done: watch::Sender<Option<usize>>,
    failed: Mutex<Vec<String>>,
}

/// A directory's level: the number of `/` in its share-relative target.
pub(super) fn depth(target: &str) -> usize {
    target.matches('/').count()
}

/// True if `path` lies strictly below one of `dirs` (share-relative paths).
pub(super) fn under_any(dirs: &[String], path: &str) -> bool {
    dirs.iter().any(|d| {
        path.len() > d.len() && path.starts_with(d.as_str()) && path.as_bytes()[d.len()] == b'/'
    })
}

impl DirGate {
    pub(super) fn new<'a>(planned: impl IntoIterator<Item = &'a str>) -> DirGate {
        DirGate {
            planned: planned.into_iter().map(str::to_owned).collect(),
            done: watch::Sender::new(None),
            failed: Mutex::new(Vec::new()),
        }
    }

    /// Records that `target` could not be made.
    pub(super) fn fail(&self, target: String) {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(target);
    }

    /// The directories that could not be made so far.
    pub(super) fn failed(&self) -> Vec<String> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Publishes that every planned directory of depth `depth` or less is settled.
    pub(super) fn level_done(&self, depth: usize) {
        self.done.send_replace(Some(depth));
    }

    /// Publishes that every planned directory is settled (also when making them
    /// stopped early): nobody waits any more.
    pub(super) fn all_done(&self) {
        self.done.send_replace(Some(usize::MAX));
    }

    /// Waits until the directory that `target` goes into is settled, if it is a
    /// planned one; then whether `target` may go ahead (false: below a directory that
    /// failed, which was reported once for everything under it).
    pub(super) async fn admit(&self, target: &str) -> bool {
        if let Some((parent, _)) = target.rsplit_once('/') {
            if self.planned.contains(parent) {
                let need = depth(parent);
                let mut rx = self.done.subscribe();
                // The sender lives as long as `self`: the wait ends with a level.
                let _ = rx.wait_for(|d| d.is_some_and(|d| d >= need)).await;
            }
        }
        !under_any(&self.failed(), target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_file_waits_for_its_own_level_only_and_not_below_a_failed_dir() {
        let gate = Arc::new(DirGate::new(["t", "t/a", "t/a/b", "t/c"]));
        // Not planned: no wait.
        assert!(gate.admit("elsewhere/f").await);
        let deep = tokio::spawn({
            let gate = gate.clone();
            async move { gate.admit("t/a/b/f").await }
        });
        gate.level_done(0);
        assert!(gate.admit("t/f").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!deep.is_finished(), "t/a/b is not made yet");
        gate.fail("t/a".into());
        gate.level_done(1);
        assert!(gate.admit("t/c/f").await);
        assert!(!gate.admit("t/a/f").await);
        gate.all_done();
        assert!(!deep.await.unwrap(), "below the failed t/a");
        assert_eq!(gate.failed(), vec!["t/a".to_owned()]);
    }

    #[test]
    fn under_any_means_strictly_below() {
        let dirs = vec!["a/b".to_owned()];
        assert!(under_any(&dirs, "a/b/c"));
        assert!(!under_any(&dirs, "a/b"));
        assert!(!under_any(&dirs, "a/bc"));
    }
}
