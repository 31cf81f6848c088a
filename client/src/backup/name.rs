//! Names of snapshots: the timestamp names snapshots are published under, and the
//! hidden prefix of partial snapshots.
//!
//! A snapshot name is the UTC time of its run as `YYYY-MM-DDTHH-MM-SSZ`: names sort by
//! time, and hold no `:` so they are valid everywhere. [`snapshot_name`] and
//! [`snapshot_time`] are inverses for every time after the epoch, to the second.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Prefix of the hidden name a snapshot is built under (not `.ferry-tmp.`, which
/// ferryd's startup cleaner removes: an interrupted snapshot must survive a restart).
pub const PARTIAL_PREFIX: &str = ".partial-";

/// Seconds in a day.
pub(crate) const DAY_SECS: u64 = 86_400;

/// The snapshot name for `time`: UTC `YYYY-MM-DDTHH-MM-SSZ` (sorts by time; no `:` so
/// it is a valid name everywhere).
pub fn snapshot_name(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let (days, rem) = (secs / DAY_SECS, secs % DAY_SECS);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}-{:02}-{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// True if `name` has the shape [`snapshot_name`] produces.
pub fn is_snapshot_name(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() == 20
        && b.iter().enumerate().all(|(i, &c)| match i {
            4 | 7 | 13 | 16 => c == b'-',
            10 => c == b'T',
            19 => c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

/// Time of the snapshot name `name` (as [`snapshot_name`] writes it), or `None` if it
/// is not one.
pub fn snapshot_time(name: &str) -> Option<SystemTime> {
    if !is_snapshot_name(name) {
        return None;
    }
    let num = |r: std::ops::Range<usize>| name[r].parse::<u64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let days = u64::try_from(days_from_civil(y as i64, mo as i64, d as i64)).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(days * DAY_SECS + h * 3600 + mi * 60 + s))
}

/// Proleptic Gregorian (year, month, day) of `days` since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Days since 1970-01-01 of the proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`, the inverse of [`civil_from_days`]).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn snapshot_names_are_utc_and_sortable() {
        assert_eq!(snapshot_name(UNIX_EPOCH), "1970-01-01T00-00-00Z");
        let t = at(1_795_257_009);
        assert_eq!(snapshot_name(t), "2026-11-21T10-30-09Z");
        let leap = at(951_782_400); // 2000-02-29
        assert_eq!(snapshot_name(leap), "2000-02-29T00-00-00Z");
        assert!(is_snapshot_name(&snapshot_name(t)));
        assert!(snapshot_name(t) < snapshot_name(t + Duration::from_secs(1)));
        assert!(!is_snapshot_name(".partial-2026-11-21T10-30-09Z"));
        assert!(!is_snapshot_name("2026-11-21T10:30:09Z"));
    }

    #[test]
    fn snapshot_times_invert_snapshot_names() {
        for secs in [0, 951_782_400, 1_795_257_009, 4_102_444_799] {
            assert_eq!(snapshot_time(&snapshot_name(at(secs))), Some(at(secs)));
        }
        assert_eq!(snapshot_time(".partial-2026-11-21T10-30-09Z"), None);
        assert_eq!(snapshot_time("2026-13-21T10-30-09Z"), None);
    }
}
