//! Quantities as administrators type them: durations (`90m`, `24h`, `7d`) and the
//! number-and-unit split under them and under byte sizes.

use std::time::Duration;

/// Parses a duration: a number of seconds, optionally followed by `s`, `m`, `h` or `d`
/// (`0`, `90m`, `24h`, `7d`); `None` for anything else or an overflow.
pub fn parse_duration(arg: &str) -> Option<Duration> {
    let (n, unit) = number_and_unit(arg)?;
    let seconds: u64 = match unit {
        None | Some('s') => 1,
        Some('m') => 60,
        Some('h') => 3600,
        Some('d') => 86_400,
        Some(_) => return None,
    };
    n.checked_mul(seconds).map(Duration::from_secs)
}

/// Parses a byte size: a number, optionally followed by `K`, `M`, `G` or `T` (powers
/// of 1024, an optional trailing `B` or `iB` allowed: `64G`, `512MiB`); `None` for
/// anything else or an overflow.
pub fn parse_size(arg: &str) -> Option<u64> {
    let s = arg.trim();
    let s = s
        .strip_suffix("iB")
        .or_else(|| s.strip_suffix('B'))
        .unwrap_or(s);
    let (n, unit) = number_and_unit(s)?;
    let shift = match unit {
        None => 0,
        Some('k') => 10,
        Some('m') => 20,
        Some('g') => 30,
        Some('t') => 40,
        Some(_) => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// Splits `s` into a number and an optional one-letter unit after it (lowercased):
/// `"64G"` is `(64, Some('g'))`, `"7"` is `(7, None)`; `None` if there is no number.
pub fn number_and_unit(s: &str) -> Option<(u64, Option<char>)> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], Some(c.to_ascii_lowercase())),
        _ => (s, None),
    };
    Some((digits.trim().parse().ok()?, unit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration("45s"), Some(Duration::from_secs(45)));
        assert_eq!(parse_duration("24H"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("2d"), Some(Duration::from_secs(172_800)));
        for bad in ["", "h", "1w", "-1h", "1.5h", "99999999999999999999d"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn numbers_and_units() {
        assert_eq!(number_and_unit("64G"), Some((64, Some('g'))));
        assert_eq!(number_and_unit(" 7 "), Some((7, None)));
        assert_eq!(number_and_unit("G"), None);
    }
}
