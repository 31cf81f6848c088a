//! Gauges: counts of live things (connections, registrations, open transfers) that
//! [`crate::Server::stats`] reports, so a test or an operator can see that what a
//! connection took was given back.
//!
//! Invariant: a gauge's value is the sum of the `n` of its live [`Held`] values. A
//! counted thing carries its [`Held`] and drops it with itself, so the count falls
//! exactly when the thing is gone, on whatever path that happens (a request finishing,
//! an error, a connection's teardown).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A count of live things, shared by everything that holds a part of it.
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<AtomicU64>);

/// `n` things counted in a [`Gauge`] until this is dropped.
#[derive(Debug)]
#[must_use = "the things are counted only while this lives"]
pub struct Held {
    gauge: Arc<AtomicU64>,
    n: u64,
}

impl Gauge {
    /// A gauge at zero.
    pub fn new() -> Gauge {
        Gauge::default()
    }

    /// Counts `n` more things until the returned [`Held`] is dropped.
    pub fn hold(&self, n: u64) -> Held {
        self.0.fetch_add(n, Ordering::SeqCst);
        Held {
            gauge: self.0.clone(),
            n,
        }
    }

    /// Counts `n` more things until the returned [`Held`] is dropped, unless that would
    /// take the count over `max`: then counts nothing and returns `None`. The check and
    /// the count are one atomic step, so concurrent callers never overshoot `max`
    /// together.
    pub fn try_hold(&self, n: u64, max: u64) -> Option<Held> {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                now.checked_add(n).filter(|&after| after <= max)
            })
            .ok()?;
        Some(Held {
            gauge: self.0.clone(),
            n,
        })
    }

    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.fetch_sub(self.n, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_add_up_and_fall_when_dropped() {
        let g = Gauge::new();
        let one = g.hold(1);
        let three = g.clone().hold(3);
        let none = g.hold(0);
        assert_eq!(g.get(), 4);
        drop(three);
        assert_eq!(g.get(), 1);
        drop((one, none));
        assert_eq!(g.get(), 0);
    }

    #[test]
    fn try_hold_stops_at_the_maximum() {
        let g = Gauge::new();
        let two = g.try_hold(2, 3).unwrap();
        assert!(g.try_hold(2, 3).is_none());
        assert_eq!(g.get(), 2);
        let three = g.try_hold(1, 3).unwrap();
        assert!(g.try_hold(1, 3).is_none());
        assert_eq!(g.get(), 3);
        drop(two);
        let again = g.try_hold(2, 3).unwrap();
        assert_eq!(g.get(), 3);
        drop((three, again));
        assert_eq!(g.get(), 0);
    }
}
