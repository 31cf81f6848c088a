//! Admission of connections that have not authenticated yet ("startups", as sshd calls
//! them), and the rate limit on failed authentications, as a sans-IO policy: no
//! sockets, no clock reads and no randomness of its own. The accept loop
//! ([`crate::Server`]) asks [`Gate::connect`] about each new connection, with the time
//! and a random roll; the connection's driver (`conn`) drops the [`Startup`] it got
//! once its session authenticates, and reports a wrong proof with
//! [`Gate::auth_failed`].
//!
//! Invariants of [`Admission`]:
//! - `startups` is the number of live [`Startup`]s, and `by_source[a]` the number of
//!   them from address `a`; an address with none has no entry (the table holds at
//!   most `startups` entries). Likewise `refusing[a]` counts the refusals being sent
//!   to `a` ([`Refusing`]), at most [`MAX_REFUSING_PER_SOURCE`], so that one address
//!   cannot hold every refusal the server sends at once and leave others' refusals
//!   unsaid.
//! - A new startup is refused when its address already has `per_source` of them, or
//!   when `full` are running; from `start` on, it is refused with a probability that
//!   rises linearly from `rate` % to 100 % at `full` (sshd's `MaxStartups`). `full` and
//!   `start` are capped at the server's connection limit.
//! - Failed authentications fill a token bucket per address (the generic cell rate
//!   algorithm: `tat` is when the bucket is empty again): `failures` of them at once
//!   empty it, and it refills one failure per `window / failures`. An address whose
//!   bucket holds less than one failure is refused at accept until it does; the
//!   refusal is logged once per `window`. At most [`MAX_TRACKED_ADDRESSES`] addresses
//!   are remembered; beyond that, addresses whose buckets have refilled are forgotten,
//!   and failures of new addresses are not counted until there is room.

use std::collections::HashMap;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_common::msg::{ErrorKind, RemoteError};

/// Default `--max-startups`: refusals start at 128 unauthenticated connections (30 %
/// of them), all are refused at 256, leaving 768 of the default 1,024 connection slots
/// to authenticated sessions.
pub const DEFAULT_MAX_STARTUPS: MaxStartups = MaxStartups {
    start: 128,
    rate_percent: 30,
    full: 256,
};

/// Default `--max-startups-per-source`: below `DEFAULT_MAX_STARTUPS.start`, so one
/// host alone never makes others' connections be refused at random.
pub const DEFAULT_MAX_STARTUPS_PER_SOURCE: u32 = 64;

/// Default `--startup-timeout`: how long after accept a connection must have
/// authenticated.
pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Default `--max-auth-failures`: ten failures at once, then one per 6 s.
pub const DEFAULT_MAX_AUTH_FAILURES: FailureLimit = FailureLimit {
    failures: 10,
    window: Duration::from_secs(60),
};

/// Most refusals being sent to one address at once; beyond, its connections are closed
/// at accept without a word.
pub const MAX_REFUSING_PER_SOURCE: u32 = 4;

/// Most addresses whose failed authentications are remembered at once.
pub const MAX_TRACKED_ADDRESSES: usize = 16_384;

/// A malformed admission setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// `--max-startups` is not `START:RATE:FULL` (or `FULL`).
    #[error("invalid max startups '{0}': expected START:RATE:FULL (e.g. 128:30:256: refuse RATE % of new unauthenticated connections from START of them on, all at FULL), with 1 <= START <= FULL and RATE at most 100, or FULL alone")]
    MaxStartups(String),
    /// `--max-auth-failures` is not `N/DURATION`.
    #[error("invalid max auth failures '{0}': expected N/DURATION with N at least 1 and DURATION at least 1s (e.g. 10/60s, 5/10m)")]
    AuthFailures(String),
    /// `--max-startups-per-source` is zero.
    #[error("max startups per source must be at least 1")]
    PerSource,
    /// `--startup-timeout` is not a duration of at least one second.
    #[error("invalid startup timeout '{0}': expected at least 1s (seconds, or with an s, m or h suffix)")]
    StartupTimeout(String),
}

/// sshd's `MaxStartups` triple.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxStartups {
    /// Unauthenticated connections running before any new one is refused.
    pub start: u32,
    /// Percentage of new ones refused at `start`.
    pub rate_percent: u32,
    /// Unauthenticated connections at which every new one is refused.
    pub full: u32,
}

impl MaxStartups {
    /// The chance, in percent, that a new unauthenticated connection is refused while
    /// `startups` others are running.
    pub fn drop_percent(&self, startups: u64) -> u32 {
        let (start, full) = (u64::from(self.start), u64::from(self.full));
        if startups >= full {
            return 100;
        }
        if startups < start {
            return 0;
        }
        let rate = u64::from(self.rate_percent);
        // start <= startups < full here, so full - start > 0.
        (rate + (100 - rate) * (startups - start) / (full - start)) as u32
    }

    /// These limits with `full` (and then `start`) at most `max`.
    fn capped(self, max: u64) -> MaxStartups {
        let full = u64::from(self.full).min(max) as u32;
        MaxStartups {
            start: self.start.min(full),
            rate_percent: self.rate_percent,
            full,
        }
    }
}

impl FromStr for MaxStartups {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<MaxStartups, SpecError> {
        let bad = || SpecError::MaxStartups(s.to_string());
        let numbers: Vec<u32> = s
            .split(':')
            .map(|n| n.trim().parse().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        let limits = match numbers[..] {
            [full] => MaxStartups {
                start: full,
                rate_percent: 100,
                full,
            },
            [start, rate_percent, full] => MaxStartups {
                start,
                rate_percent,
                full,
            },
            _ => return Err(bad()),
        };
        if limits.start == 0 || limits.start > limits.full || limits.rate_percent > 100 {
            return Err(bad());
        }
        Ok(limits)
    }
}

impl std::fmt::Display for MaxStartups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}", self.start, self.rate_percent, self.full)
    }
}

/// How many failed authentications an address may have in a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureLimit {
    /// Failures at once that make the address be refused.
    pub failures: u32,
    /// The time in which the bucket refills completely.
    pub window: Duration,
}

impl FailureLimit {
    /// The time one failure takes to refill.
    fn interval(&self) -> Duration {
        self.window / self.failures
    }
}

impl FromStr for FailureLimit {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<FailureLimit, SpecError> {
        let bad = || SpecError::AuthFailures(s.to_string());
        let (n, window) = s.split_once('/').ok_or_else(bad)?;
        let failures: u32 = n.trim().parse().map_err(|_| bad())?;
        let window = ferry_common::units::parse_duration(window).ok_or_else(bad)?;
        if failures == 0 || window < Duration::from_secs(1) {
            return Err(bad());
        }
        Ok(FailureLimit { failures, window })
    }
}

impl std::fmt::Display for FailureLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}s", self.failures, self.window.as_secs())
    }
}

/// Parses `--startup-timeout`: a duration of at least one second.
pub fn parse_startup_timeout(s: &str) -> Result<Duration, SpecError> {
    ferry_common::units::parse_duration(s)
        .filter(|d| *d >= Duration::from_secs(1))
        .ok_or_else(|| SpecError::StartupTimeout(s.to_string()))
}

/// Parses `--max-startups-per-source`: at least one.
pub fn parse_per_source(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(SpecError::PerSource.to_string()),
    }
}

/// The admission settings of a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Limits on unauthenticated connections over all addresses.
    pub max_startups: MaxStartups,
    /// Most unauthenticated connections from one address at once (at least 1).
    pub per_source: u32,
    /// How long after accept a connection must have authenticated.
    pub startup_timeout: Duration,
    /// The rate limit on failed authentications per address.
    pub auth_failures: FailureLimit,
}

impl Default for AdmissionConfig {
    fn default() -> AdmissionConfig {
        AdmissionConfig {
            max_startups: DEFAULT_MAX_STARTUPS,
            per_source: DEFAULT_MAX_STARTUPS_PER_SOURCE,
            startup_timeout: DEFAULT_STARTUP_TIMEOUT,
            auth_failures: DEFAULT_MAX_AUTH_FAILURES,
        }
    }
}

/// Why a new connection is refused before it authenticates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its address failed to authenticate too often lately.
    Penalized {
        /// The address.
        addr: IpAddr,
        /// When it may try again.
        retry_after: Duration,
        /// Whether this refusal is the first of its window (to be logged).
        log: bool,
    },
    /// Its address has as many unauthenticated connections as it may.
    PerSource {
        /// The address.
        addr: IpAddr,
        /// The limit.
        limit: u32,
    },
    /// Too many unauthenticated connections over all addresses (it lost the roll).
    Startups {
        /// Unauthenticated connections running.
        startups: u64,
    },
}

impl Refusal {
    /// Whether the refusal should be logged (a penalized address's only once per
    /// window; the others each time).
    pub fn log(&self) -> bool {
        match self {
            Refusal::Penalized { log, .. } => *log,
            _ => true,
        }
    }

    /// What the peer is told.
    pub fn to_remote(&self) -> RemoteError {
        match self {
            Refusal::Penalized {
                addr, retry_after, ..
            } => RemoteError::new(
                ErrorKind::AuthFailed,
                format!(
                    "too many failed authentications from {addr}, retry in {} s",
                    ceil_secs(*retry_after)
                ),
            ),
            Refusal::PerSource { addr, limit } => RemoteError::new(
                ErrorKind::Busy,
                format!(
                    "too many unauthenticated connections from {addr} (at most {limit} at once)"
                ),
            ),
            Refusal::Startups { startups } => RemoteError::new(
                ErrorKind::Busy,
                format!(
                    "server busy: {startups} connections have not authenticated yet; try again"
                ),
            ),
        }
    }
}

/// Whole seconds in `d`, rounded up.
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// One address's failed authentications.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// When the bucket is full again (no failure counted): each failure moves it one
    /// interval later, from now at the latest.
    tat: Instant,
    /// When a refusal of this address was last logged.
    logged: Option<Instant>,
}

/// The admission state of a server (see the module docs for its invariants).
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    startups: u64,
    by_source: HashMap<IpAddr, u32>,
    refusing: HashMap<IpAddr, u32>,
    failures: HashMap<IpAddr, Bucket>,
}

impl Admission {
    /// No connection running, no failure counted; startup limits capped at
    /// `max_connections`.
    pub fn new(mut config: AdmissionConfig, max_connections: u64) -> Admission {
        config.max_startups = config.max_startups.capped(max_connections);
        Admission {
            config,
            startups: 0,
            by_source: HashMap::new(),
            refusing: HashMap::new(),
            failures: HashMap::new(),
        }
    }

    /// Unauthenticated connections running.
    pub fn startups(&self) -> u64 {
        self.startups
    }

    /// A new connection from `addr` at `now`: counted as a startup, or refused.
    /// `roll` gives a number in `0..100`; it is called only when the connection may be
    /// refused at random, and it is refused if the number is below the chance.
    pub fn handle_connect(
        &mut self,
        now: Instant,
        addr: IpAddr,
        roll: impl FnOnce() -> u32,
    ) -> Result<(), Refusal> {
        if let Some(refusal) = self.penalty(now, addr) {
            return Err(refusal);
        }
        let from_addr = self.by_source.get(&addr).copied().unwrap_or(0);
        if from_addr >= self.config.per_source {
            return Err(Refusal::PerSource {
                addr,
                limit: self.config.per_source,
            });
        }
        let percent = self.config.max_startups.drop_percent(self.startups);
        if percent >= 100 || (percent > 0 && roll() < percent) {
            return Err(Refusal::Startups {
                startups: self.startups,
            });
        }
        self.startups += 1;
        *self.by_source.entry(addr).or_insert(0) += 1;
        Ok(())
    }

    /// A startup from `addr` authenticated or ended.
    pub fn handle_startup_end(&mut self, addr: IpAddr) {
        if uncount(&mut self.by_source, addr) {
            self.startups -= 1;
        }
    }

    /// Whether a refusal may be sent to `addr` (then counted until
    /// [`Admission::handle_refusal_end`]).
    pub fn handle_refusal_start(&mut self, addr: IpAddr) -> bool {
        let n = self.refusing.entry(addr).or_insert(0);
        if *n >= MAX_REFUSING_PER_SOURCE {
            return false;
        }
        *n += 1;
        true
    }

    /// A refusal sent to `addr` is over.
    pub fn handle_refusal_end(&mut self, addr: IpAddr) {
        uncount(&mut self.refusing, addr);
    }

    /// A failed authentication from `addr` at `now`. Returns how long the address is
    /// refused for if this failure emptied its bucket.
    pub fn handle_auth_failure(&mut self, now: Instant, addr: IpAddr) -> Option<Duration> {
        if !self.failures.contains_key(&addr) && self.failures.len() >= MAX_TRACKED_ADDRESSES {
            self.failures.retain(|_, b| b.tat > now);
            if self.failures.len() >= MAX_TRACKED_ADDRESSES {
                return None;
            }
        }
        let interval = self.config.auth_failures.interval();
        let bucket = self.failures.entry(addr).or_insert(Bucket {
            tat: now,
            logged: None,
        });
        let was_open = Self::retry_after(bucket, now, &self.config.auth_failures).is_none();
        bucket.tat = bucket.tat.max(now) + interval;
        let retry = Self::retry_after(bucket, now, &self.config.auth_failures);
        if was_open && retry.is_some() {
            // The address's refusals are logged from now on, once per window.
            bucket.logged = Some(now);
        }
        retry.filter(|_| was_open)
    }

    /// How long `addr` is refused for at `now` for its failed authentications, if it
    /// is.
    fn penalty(&mut self, now: Instant, addr: IpAddr) -> Option<Refusal> {
        let limit = self.config.auth_failures;
        let bucket = self.failures.get_mut(&addr)?;
        let retry_after = Self::retry_after(bucket, now, &limit)?;
        let log = bucket
            .logged
            .is_none_or(|at| now.saturating_duration_since(at) >= limit.window);
        if log {
            bucket.logged = Some(now);
        }
        Some(Refusal::Penalized {
            addr,
            retry_after,
            log,
        })
    }

    /// How long until `bucket` holds one failure again at `now`, if it holds less.
    fn retry_after(bucket: &Bucket, now: Instant, limit: &FailureLimit) -> Option<Duration> {
        // Holding less than one failure: more than `window - interval` of failures
        // still to refill.
        let owed = bucket.tat.saturating_duration_since(now);
        let room = limit.window - limit.interval();
        (owed > room).then(|| owed - room)
    }
}

/// Takes one off `addr`'s count in `counts`, removing the entry at zero; false if it
/// had none.
fn uncount(counts: &mut HashMap<IpAddr, u32>, addr: IpAddr) -> bool {
    let Some(n) = counts.get_mut(&addr) else {
        return false;
    };
    *n -= 1;
    if *n == 0 {
        counts.remove(&addr);
    }
    true
}

/// A server's [`Admission`], shared by its accept loops and connections.
#[derive(Debug, Clone)]
pub(crate) struct Gate(Arc<Mutex<Admission>>);

/// A connection counted as a startup, or a refusal being sent, until this is dropped.
#[derive(Debug)]
#[must_use = "the connection is counted only while this lives"]
pub(crate) struct Counted {
    gate: Gate,
    addr: IpAddr,
    refusal: bool,
}

/// A connection counted as a startup of its address.
pub(crate) type Startup = Counted;

/// A refusal being sent, counted against its address.
pub(crate) type Refusing = Counted;

impl Gate {
    pub(crate) fn new(admission: Admission) -> Gate {
        Gate(Arc::new(Mutex::new(admission)))
    }

    fn lock(&self) -> MutexGuard<'_, Admission> {
        // Admission's methods do not panic; a poisoned state is still consistent.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// See [`Admission::handle_connect`]; the startup is counted until the returned
    /// [`Startup`] is dropped.
    pub(crate) fn connect(
        &self,
        now: Instant,
        addr: IpAddr,
        roll: impl FnOnce() -> u32,
    ) -> Result<Startup, Refusal> {
        self.lock().handle_connect(now, addr, roll)?;
        Ok(Counted {
            gate: self.clone(),
            addr,
            refusal: false,
        })
    }

    /// See [`Admission::handle_refusal_start`]; the refusal is counted until the
    /// returned [`Refusing`] is dropped.
    pub(crate) fn refusing(&self, addr: IpAddr) -> Option<Refusing> {
        self.lock().handle_refusal_start(addr).then(|| Counted {
            gate: self.clone(),
            addr,
            refusal: true,
        })
    }

    /// The settings admission runs with (startup limits capped).
    pub(crate) fn limits(&self) -> AdmissionConfig {
        self.lock().config
    }

    /// See [`Admission::handle_auth_failure`].
    pub(crate) fn auth_failed(&self, now: Instant, addr: IpAddr) -> Option<Duration> {
        self.lock().handle_auth_failure(now, addr)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut admission = self.gate.lock();
        match self.refusal {
            true => admission.handle_refusal_end(self.addr),
            false => admission.handle_startup_end(self.addr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    fn config(max_startups: &str, per_source: u32, failures: &str) -> AdmissionConfig {
        AdmissionConfig {
            max_startups: max_startups.parse().unwrap(),
            per_source,
            startup_timeout: DEFAULT_STARTUP_TIMEOUT,
            auth_failures: failures.parse().unwrap(),
        }
    }

    fn never() -> u32 {
        panic!("rolled where no roll was needed")
    }

    #[test]
    fn specs_parse_and_bad_ones_are_refused() {
        let m: MaxStartups = "10:30:100".parse().unwrap();
        assert_eq!((m.start, m.rate_percent, m.full), (10, 30, 100));
        assert_eq!(m.to_string(), "10:30:100");
        let m: MaxStartups = "8".parse().unwrap();
        assert_eq!((m.start, m.rate_percent, m.full), (8, 100, 8));
        for bad in [
            "",
            "0",
            "10:30",
            "20:30:10",
            "10:101:20",
            "a:b:c",
            "1:2:3:4",
        ] {
            assert!(bad.parse::<MaxStartups>().is_err(), "{bad}");
        }
        let f: FailureLimit = "5/2m".parse().unwrap();
        assert_eq!((f.failures, f.window), (5, Duration::from_secs(120)));
        assert_eq!(f.to_string(), "5/120s");
        for bad in ["5", "0/60s", "5/0", "5/x", "/60"] {
            assert!(bad.parse::<FailureLimit>().is_err(), "{bad}");
        }
        assert_eq!(parse_startup_timeout("3s"), Ok(Duration::from_secs(3)));
        assert!(parse_startup_timeout("0").is_err());
        assert_eq!(parse_per_source("4"), Ok(4));
        assert!(parse_per_source("0").is_err());
    }

    #[test]
    fn drop_chance_rises_linearly_from_start_to_full() {
        let m: MaxStartups = "10:30:100".parse().unwrap();
        assert_eq!(m.drop_percent(0), 0);
        assert_eq!(m.drop_percent(9), 0);
        assert_eq!(m.drop_percent(10), 30);
        assert_eq!(m.drop_percent(55), 65);
        assert_eq!(m.drop_percent(99), 99);
        assert_eq!(m.drop_percent(100), 100);
        assert_eq!(m.drop_percent(1000), 100);
        let hard: MaxStartups = "4".parse().unwrap();
        assert_eq!((hard.drop_percent(3), hard.drop_percent(4)), (0, 100));
    }

    #[test]
    fn startups_are_capped_per_source_and_counted_until_they_end() {
        let now = Instant::now();
        let mut a = Admission::new(config("100:30:200", 2, "10/60s"), 1024);
        a.handle_connect(now, ip(2), never).unwrap();
        a.handle_connect(now, ip(2), never).unwrap();
        assert_eq!(
            a.handle_connect(now, ip(2), never),
            Err(Refusal::PerSource {
                addr: ip(2),
                limit: 2
            })
        );
        // Another address is not held back by the first.
        a.handle_connect(now, ip(1), never).unwrap();
        assert_eq!(a.startups(), 3);
        a.handle_startup_end(ip(2));
        a.handle_connect(now, ip(2), never).unwrap();
        for addr in [ip(1), ip(2), ip(2)] {
            a.handle_startup_end(addr);
        }
        assert_eq!(a.startups(), 0);
        assert!(a.by_source.is_empty());
        // Ending one never counted changes nothing.
        a.handle_startup_end(ip(9));
        assert_eq!(a.startups(), 0);
    }

    #[test]
    fn refusals_are_bounded_per_source() {
        let mut a = Admission::new(AdmissionConfig::default(), 1024);
        for _ in 0..MAX_REFUSING_PER_SOURCE {
            assert!(a.handle_refusal_start(ip(2)));
        }
        assert!(!a.handle_refusal_start(ip(2)));
        assert!(a.handle_refusal_start(ip(1)));
        a.handle_refusal_end(ip(2));
        assert!(a.handle_refusal_start(ip(2)));
        for addr in [ip(1), ip(2), ip(2), ip(2), ip(2)] {
            a.handle_refusal_end(addr);
        }
        assert!(a.refusing.is_empty());
    }

    #[test]
    fn startups_beyond_start_are_dropped_by_the_roll_and_all_at_full() {
        let now = Instant::now();
        let mut a = Admission::new(config("2:50:4", 10, "10/60s"), 1024);
        a.handle_connect(now, ip(1), never).unwrap();
        a.handle_connect(now, ip(2), never).unwrap();
        // At start: 50 %; a roll of 49 loses, 50 wins.
        assert_eq!(
            a.handle_connect(now, ip(3), || 49),
            Err(Refusal::Startups { startups: 2 })
        );
        a.handle_connect(now, ip(3), || 50).unwrap();
        // 3 of 4: 75 %.
        assert!(a.handle_connect(now, ip(4), || 74).is_err());
        a.handle_connect(now, ip(4), || 75).unwrap();
        // Full: refused without a roll.
        assert_eq!(
            a.handle_connect(now, ip(5), never),
            Err(Refusal::Startups { startups: 4 })
        );
    }

    #[test]
    fn startup_limits_are_capped_at_the_connection_limit() {
        let now = Instant::now();
        let mut a = Admission::new(config("128:30:256", 64, "10/60s"), 3);
        for _ in 0..3 {
            a.handle_connect(now, ip(1), never).unwrap();
        }
        assert!(a.handle_connect(now, ip(2), never).is_err());
    }

    #[test]
    fn failures_empty_the_bucket_and_refill_one_per_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // 3 at once, then one per 10 s.
        let mut a = Admission::new(config("100:30:200", 10, "3/30s"), 1024);
        assert_eq!(a.handle_auth_failure(t0, ip(2)), None);
        assert_eq!(a.handle_auth_failure(t0, ip(2)), None);
        assert_eq!(a.handle_auth_failure(t0, ip(2)), Some(s(10)));
        // Refused with the time left, logged once per window.
        let at = |a: &mut Admission, t| a.handle_connect(t, ip(2), never);
        assert_eq!(
            at(&mut a, t0 + s(4)),
            Err(Refusal::Penalized {
                addr: ip(2),
                retry_after: s(6),
                log: false
            })
        );
        // Another address is served.
        a.handle_connect(t0, ip(1), never).unwrap();
        // One failure's worth refilled at 10 s.
        a.handle_connect(t0 + s(10), ip(2), never).unwrap();
        // A failure then empties it again, for another 10 s.
        assert_eq!(a.handle_auth_failure(t0 + s(10), ip(2)), Some(s(10)));
        assert!(matches!(
            at(&mut a, t0 + s(19)),
            Err(Refusal::Penalized { log: false, .. })
        ));
        // Failures of sessions admitted before keep coming: 3 + 6 at once owe 90 s,
        // so ip(3) is refused until 70 s, and the refusals are logged once per window
        // (the first time with the failure that emptied the bucket).
        for n in 0..9 {
            let blocked = a.handle_auth_failure(t0, ip(3));
            assert_eq!(blocked.is_some(), n == 2, "failure {n}");
        }
        let logged = |a: &mut Admission, t| match a.handle_connect(t, ip(3), never) {
            Err(Refusal::Penalized { log, .. }) => log,
            other => panic!("{other:?}"),
        };
        assert!(!logged(&mut a, t0 + s(1)));
        assert!(!logged(&mut a, t0 + s(29)));
        assert!(logged(&mut a, t0 + s(30)));
        assert!(!logged(&mut a, t0 + s(31)));
        assert!(logged(&mut a, t0 + s(60)));
        a.handle_connect(t0 + s(70), ip(3), never).unwrap();
        // Fully refilled after the window: three failures again before refusal.
        let later = t0 + s(200);
        assert_eq!(a.handle_auth_failure(later, ip(2)), None);
        assert_eq!(a.handle_auth_failure(later, ip(2)), None);
        assert!(a.handle_auth_failure(later, ip(2)).is_some());
    }

    #[test]
    fn refusals_say_why() {
        let r = Refusal::Penalized {
            addr: ip(2),
            retry_after: Duration::from_millis(5_200),
            log: true,
        };
        let e = r.to_remote();
        assert_eq!(e.kind, ErrorKind::AuthFailed);
        assert_eq!(
            e.message,
            "too many failed authentications from 127.0.0.2, retry in 6 s"
        );
        let e = Refusal::PerSource {
            addr: ip(2),
            limit: 4,
        }
        .to_remote();
        assert_eq!(e.kind, ErrorKind::Busy);
        assert!(e.message.contains("from 127.0.0.2 (at most 4 at once)"));
    }

    #[test]
    fn tracked_addresses_are_bounded() {
        let now = Instant::now();
        let mut a = Admission::new(config("100:30:200", 10, "1/60s"), 1024);
        for i in 0..MAX_TRACKED_ADDRESSES as u32 {
            let addr = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
            assert!(a.handle_auth_failure(now, addr).is_some());
        }
        // Full, none refilled: a new address is not tracked.
        assert_eq!(a.handle_auth_failure(now, ip(1)), None);
        assert!(a.handle_connect(now, ip(1), never).is_ok());
        // Once they have refilled, they are forgotten to make room.
        let later = now + Duration::from_secs(61);
        assert!(a.handle_auth_failure(later, ip(1)).is_some());
        assert_eq!(a.failures.len(), 1);
    }
}
