//! Session timers: an enum indexing a table of deadlines (quinn's `TimerTable` shape).

use std::time::Instant;

/// The timers a session can arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// The handshake must finish by this deadline.
    Handshake,
    /// Requests are outstanding and the server has been silent this long: probe it.
    Probe,
    /// Requests are outstanding and the server has been silent this long: it is hung
    /// (or the path to it is), and the session ends.
    Silence,
}

impl Timer {
    const ALL: [Timer; 3] = [Timer::Handshake, Timer::Probe, Timer::Silence];

    fn index(self) -> usize {
        self as usize
    }
}

/// One optional deadline per [`Timer`].
#[derive(Debug, Default, Clone)]
pub struct TimerTable {
    deadlines: [Option<Instant>; Timer::ALL.len()],
}

impl TimerTable {
    /// Arms `timer` to fire at `at`, replacing an earlier deadline.
    pub fn set(&mut self, timer: Timer, at: Instant) {
        self.deadlines[timer.index()] = Some(at);
    }

    /// Disarms `timer`.
    pub fn stop(&mut self, timer: Timer) {
        self.deadlines[timer.index()] = None;
    }

    /// The earliest armed deadline.
    pub fn next(&self) -> Option<Instant> {
        self.deadlines.iter().flatten().min().copied()
    }

    /// Disarms and returns the first timer whose deadline is `<= now`.
    pub fn take_expired(&mut self, now: Instant) -> Option<Timer> {
        let t = Timer::ALL
            .into_iter()
            .find(|t| self.deadlines[t.index()].is_some_and(|d| d <= now))?;
        self.stop(t);
        Some(t)
    }
}
