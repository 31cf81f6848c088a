//! Storage-node health: the one policy every cluster client (`rcp`, `rcp backup`,
//! `ferry cluster repair`, the mount) uses to pass over a node that is alive but hung.
//!
//! A node stopped (SIGSTOP), frozen or black-holed keeps its TCP connections and its
//! etcd lease for a while and answers nothing. Only a deadline notices it, and the
//! deadline is on *progress*, not on how long an operation takes:
//!
//! - Every stripe read or write runs under a [`watch`]: it fails with
//!   [`ClientError::Stalled`] once [`HealthPolicy::progress_deadline`] has passed with
//!   neither bytes moved (the transfer's progress callback, fed a window at a time)
//!   nor any message from the node while it owed one (a response, or the answer to
//!   its session's liveness probe, [`crate::Client::silent_since`]). A node that is
//!   merely slow, on a loaded machine or behind a long fsync, keeps answering probes
//!   from its connection task and is never cut off; time this client spends on its
//!   own work (hashing, its disk) with nothing asked of the node does not count.
//! - The caller then moves on (a read to the next replica, a write to the next node in
//!   the file's order), drops the node's session (never reused: the abandoned
//!   operation's state dies with it), and marks the node suspect ([`Health::suspect`]).
//! - A suspect node is read from only after the others and placed on only when no
//!   other node will do, for [`HealthPolicy::suspect_for`]; then it is tried again, on
//!   a fresh session.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::lock;
use std::time::{Duration, Instant};

use ferry_client::client::Client;
use ferry_client::error::ClientError;
use ferry_client::transfer::ProgressFn;

/// How long a stripe transfer may go without progress (bytes moved or a message from
/// the node) before it is abandoned there. A window is at most a few MiB and a live
/// node answers a probe within one [`ferry_common::proto::PROBE_AFTER`], so two
/// seconds is several times what a loaded two-core machine needs.
pub const PROGRESS_DEADLINE: Duration = Duration::from_secs(2);

/// How long a node that stalled or failed stays suspect before it is tried first again.
pub const SUSPECT_FOR: Duration = Duration::from_secs(30);

/// Environment variable overriding [`PROGRESS_DEADLINE`], in seconds (`0.5`, `2`).
pub const PROGRESS_DEADLINE_ENV: &str = "FERRY_PROGRESS_DEADLINE";

/// Environment variable overriding [`SUSPECT_FOR`], in seconds.
pub const SUSPECT_FOR_ENV: &str = "FERRY_SUSPECT_FOR";

/// Watchdog checks per progress deadline: a stall is noticed within
/// `deadline * (1 + 1 / WATCH_TICKS)`.
const WATCH_TICKS: u32 = 8;

/// When a node is passed over and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthPolicy {
    /// See [`PROGRESS_DEADLINE`].
    pub progress_deadline: Duration,
    /// See [`SUSPECT_FOR`].
    pub suspect_for: Duration,
}

impl Default for HealthPolicy {
    fn default() -> HealthPolicy {
        HealthPolicy {
            progress_deadline: PROGRESS_DEADLINE,
            suspect_for: SUSPECT_FOR,
        }
    }
}

impl HealthPolicy {
    /// The defaults, each overridden by its environment variable
    /// ([`PROGRESS_DEADLINE_ENV`], [`SUSPECT_FOR_ENV`]) where that holds a positive
    /// number of seconds (anything else is ignored, with a warning).
    pub fn from_env() -> HealthPolicy {
        let mut p = HealthPolicy::default();
        for (name, slot) in [
            (PROGRESS_DEADLINE_ENV, &mut p.progress_deadline),
            (SUSPECT_FOR_ENV, &mut p.suspect_for),
        ] {
            let Some(v) = std::env::var_os(name) else {
                continue;
            };
            match v.to_str().and_then(seconds) {
                Some(d) => *slot = d,
                None => tracing::warn!("{name}: not a positive number of seconds; ignored"),
            }
        }
        p
    }

    /// The liveness policy of a session to a storage node: it probes well within the
    /// progress deadline, so a live node answers before the deadline could pass.
    pub fn node_liveness(&self) -> ferry_common::proto::client::Liveness {
        ferry_common::proto::client::Liveness {
            probe_after: (self.progress_deadline / 4).min(ferry_common::proto::PROBE_AFTER),
            silence_limit: ferry_common::proto::SERVER_SILENCE_LIMIT.max(self.progress_deadline),
        }
    }
}

/// A positive, finite number of seconds.
fn seconds(s: &str) -> Option<Duration> {
    let v: f64 = s.trim().parse().ok()?;
    (v.is_finite() && v > 0.0 && v < 1e9).then(|| Duration::from_secs_f64(v))
}

/// The nodes suspected lately, shared by every operation of one client (one `rcp`
/// run, one mount).
#[derive(Debug, Default)]
pub struct Health {
    policy: HealthPolicy,
    /// Node id to when it was last suspected.
    suspects: Mutex<HashMap<String, Instant>>,
}

impl Health {
    /// No node suspect yet.
    pub fn new(policy: HealthPolicy) -> Health {
        Health {
            policy,
            suspects: Mutex::new(HashMap::new()),
        }
    }

    /// The policy.
    pub fn policy(&self) -> HealthPolicy {
        self.policy
    }

    /// Marks node `id` suspect from `now` (logged with `why`).
    pub fn suspect(&self, id: &str, why: &str, now: Instant) {
        tracing::warn!(
            node = id,
            "storage node {id} is suspect for {:?}: {why}",
            self.policy.suspect_for
        );
        lock(&self.suspects).insert(id.to_owned(), now);
    }

    /// True if node `id` was suspected within [`HealthPolicy::suspect_for`] of `now`.
    pub fn is_suspect(&self, id: &str, now: Instant) -> bool {
        lock(&self.suspects)
            .get(id)
            .is_some_and(|at| now.saturating_duration_since(*at) < self.policy.suspect_for)
    }

    /// `replicas` in the order to read from at `now`: those `live` and not suspect (in
    /// the layout's order), then the live suspect ones. Nodes not live are left out.
    pub fn read_order(
        &self,
        replicas: &[String],
        live: impl Fn(&str) -> bool,
        now: Instant,
    ) -> Vec<String> {
        let (mut good, suspect): (Vec<String>, Vec<String>) = replicas
            .iter()
            .filter(|n| live(n))
            .cloned()
            .partition(|n| !self.is_suspect(n, now));
        good.extend(suspect);
        good
    }
}

/// The progress clock of one watched operation. Cheap to clone.
#[derive(Clone)]
pub struct Progress {
    started: Instant,
    /// Nanoseconds from `started` to the last progress.
    last: Arc<AtomicU64>,
    /// The session the operation runs on, once it has one: its messages count.
    session: Arc<Mutex<Option<Client>>>,
}

impl Progress {
    fn new(now: Instant) -> Progress {
        Progress {
            started: now,
            last: Arc::new(AtomicU64::new(0)),
            session: Arc::new(Mutex::new(None)),
        }
    }

    /// Records progress now.
    pub fn tick(&self) {
        let nanos = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.fetch_max(nanos, Ordering::Relaxed);
    }

    /// `inner`, also recording progress whenever it is called (bytes completed).
    pub fn wrap(&self, inner: ProgressFn) -> ProgressFn {
        let me = self.clone();
        Arc::new(move |n| {
            me.tick();
            inner(n)
        })
    }

    /// Counts every message `client` receives from now on as progress.
    pub fn attach(&self, client: &Client) {
        *lock(&self.session) = Some(client.clone());
    }

    /// True if, at `now`, the operation has made no progress for `deadline` and
    /// (once it has a session) its node has owed an answer, silent, as long.
    fn stalled(&self, now: Instant, deadline: Duration) -> bool {
        let own = self.started + Duration::from_nanos(self.last.load(Ordering::Relaxed));
        if now.saturating_duration_since(own) <= deadline {
            return false;
        }
        match &*lock(&self.session) {
            Some(c) => c
                .silent_since()
                .is_some_and(|t| now.saturating_duration_since(t) > deadline),
            None => true,
        }
    }
}

/// Runs `op` (given its [`Progress`] to feed and attach its session to) on node `node`
/// until it finishes, or fails it with [`ClientError::Stalled`] once `deadline` passes
/// without progress. The abandoned operation is dropped: its caller must drop the
/// node's session too (see the module docs).
pub async fn watch<T, F, Fut>(node: &str, deadline: Duration, op: F) -> Result<T, ClientError>
where
    F: FnOnce(Progress) -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let progress = Progress::new(Instant::now());
    let op = op(progress.clone());
    tokio::pin!(op);
    let tick = (deadline / WATCH_TICKS).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            done = &mut op => return done,
            () = tokio::time::sleep(tick) => {
                if progress.stalled(Instant::now(), deadline) {
                    return Err(ClientError::Stalled {
                        node: node.to_owned(),
                        after: deadline,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_positive_and_finite() {
        assert_eq!(seconds("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(seconds(" 2 "), Some(Duration::from_secs(2)));
        for bad in ["0", "-1", "nan", "inf", "2s", ""] {
            assert_eq!(seconds(bad), None, "{bad}");
        }
    }

    #[test]
    fn suspects_go_last_and_are_forgiven_after_a_while() {
        let h = Health::new(HealthPolicy::default());
        let now = Instant::now();
        let replicas: Vec<String> = ["n1", "n2", "n3"].map(String::from).to_vec();
        let all = |_: &str| true;
        h.suspect("n1", "test", now);
        assert_eq!(h.read_order(&replicas, all, now), ["n2", "n3", "n1"]);
        assert_eq!(
            h.read_order(&replicas, all, now + SUSPECT_FOR),
            ["n1", "n2", "n3"],
            "a suspect is tried first again after SUSPECT_FOR"
        );
        let not_n2 = |n: &str| n != "n2";
        assert_eq!(h.read_order(&replicas, not_n2, now), ["n3", "n1"]);
    }

    #[tokio::test]
    async fn an_operation_without_progress_is_stalled_at_the_deadline() {
        let deadline = Duration::from_millis(300);
        let started = Instant::now();
        let r: Result<(), _> = watch("n1", deadline, |_| std::future::pending()).await;
        assert!(matches!(r, Err(ClientError::Stalled { ref node, .. }) if node == "n1"));
        let took = started.elapsed();
        // Never before the deadline; the upper bound is loose for a loaded machine.
        assert!(took > deadline && took < 10 * deadline, "{took:?}");
    }

    #[tokio::test]
    async fn steady_progress_is_never_stalled() {
        let deadline = Duration::from_secs(1);
        // Three deadlines long, with progress every tenth of one: not stalled.
        let r = watch("n1", deadline, |p| async move {
            for _ in 0..30 {
                tokio::time::sleep(deadline / 10).await;
                p.tick();
            }
            Ok(7)
        })
        .await;
        assert_eq!(r.unwrap(), 7);
    }
}
