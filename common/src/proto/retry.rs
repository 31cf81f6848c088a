//! The client's retry policy for transfer windows.
//!
//! A window whose chunks fail verification (damaged in flight: the server's hash check
//! of an upload, the client's of a download) is sent again, up to [`WINDOW_ATTEMPTS`]
//! attempts in all; any other failure fails the file at once. An upload's window is
//! re-read and re-hashed before it is sent again: if the source changed, that is the
//! error, not the damage.

/// Attempts per window before a verification failure fails the file.
pub const WINDOW_ATTEMPTS: usize = 2;

/// How a window attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowFailure {
    /// A chunk did not match its hash.
    Integrity,
    /// An upload's source no longer hashes as it did when the window was sent.
    SourceChanged,
    /// Anything else (I/O, the transport, a refusal).
    Other,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Send the window again.
    Retry,
    /// Fail the file with this attempt's error.
    Fail,
}

/// The attempts of one window.
#[derive(Debug, Clone)]
pub struct WindowRetry {
    attempt: usize,
}

impl Default for WindowRetry {
    fn default() -> WindowRetry {
        WindowRetry { attempt: 1 }
    }
}

impl WindowRetry {
    /// Decides after the current attempt failed with `failure`.
    pub fn handle_failure(&mut self, failure: WindowFailure) -> Verdict {
        match failure {
            WindowFailure::Integrity if self.attempt < WINDOW_ATTEMPTS => {
                self.attempt += 1;
                Verdict::Retry
            }
            _ => Verdict::Fail,
        }
    }

    /// The attempt running now, from 1.
    pub fn attempt(&self) -> usize {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_damage_is_retried_and_only_so_often() {
        let mut r = WindowRetry::default();
        assert_eq!(r.handle_failure(WindowFailure::Integrity), Verdict::Retry);
        assert_eq!(r.attempt(), 2);
        assert_eq!(r.handle_failure(WindowFailure::Integrity), Verdict::Fail);
        for f in [WindowFailure::SourceChanged, WindowFailure::Other] {
            assert_eq!(WindowRetry::default().handle_failure(f), Verdict::Fail);
        }
    }
}
