//! When a key is updated: the rekeying policy and what one key has sealed so far.

use std::time::{Duration, Instant};

/// Bytes of one gibibyte.
const GIB: u64 = 1 << 30;

/// Most records (control messages or pieces of file data) one key seals, whatever the
/// policy says: RFC 8446 §5.5 puts AES-GCM's margin at 2^24.5 full-size records.
pub const RECORD_LIMIT: u64 = 1 << 24;

/// When a side updates the keys of its sending direction: after `after_bytes` bytes
/// sealed under one key, [`RECORD_LIMIT`] records, or `after` since the key's first
/// record, whichever comes first. Each side applies its own policy to what it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RekeyPolicy {
    /// Bytes sealed under one key before the next key takes over (at least 1).
    pub after_bytes: u64,
    /// Time from a key's first record before the next key takes over.
    pub after: Duration,
}

impl Default for RekeyPolicy {
    /// 64 GiB (a sixth of AES-GCM's margin for full-size records) or one hour.
    fn default() -> RekeyPolicy {
        RekeyPolicy {
            after_bytes: 64 * GIB,
            after: Duration::from_secs(3600),
        }
    }
}

/// What one key has sealed: bytes, records, and when its first record was sealed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Budget {
    bytes: u64,
    records: u64,
    since: Option<Instant>,
}

impl Budget {
    /// Counts one record of `len` bytes sealed at `now`.
    pub(crate) fn charge(&mut self, now: Instant, len: usize) {
        self.since.get_or_insert(now);
        self.bytes = self.bytes.saturating_add(len as u64);
        self.records = self.records.saturating_add(1);
    }

    /// Whether the key that sealed this much should give way at `now` under `policy`.
    pub(crate) fn spent(&self, policy: &RekeyPolicy, now: Instant) -> bool {
        self.bytes >= policy.after_bytes.max(1)
            || self.records >= RECORD_LIMIT
            || self
                .since
                .is_some_and(|t| now.saturating_duration_since(t) >= policy.after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_spent_by_bytes_records_or_time_whichever_first() {
        let t0 = Instant::now();
        let policy = RekeyPolicy {
            after_bytes: 100,
            after: Duration::from_secs(10),
        };
        let mut b = Budget::default();
        assert!(!b.spent(&policy, t0 + Duration::from_secs(99)), "unused");
        b.charge(t0, 60);
        assert!(!b.spent(&policy, t0));
        b.charge(t0, 40);
        assert!(b.spent(&policy, t0), "bytes");
        let mut b = Budget::default();
        b.charge(t0, 1);
        assert!(!b.spent(&policy, t0 + Duration::from_secs(9)));
        assert!(b.spent(&policy, t0 + Duration::from_secs(10)), "time");
        let mut b = Budget {
            records: RECORD_LIMIT - 1,
            ..Budget::default()
        };
        b.charge(t0, 0);
        assert!(b.spent(&RekeyPolicy::default(), t0), "records");
    }
}
