//! Include/exclude rules for `rcp backup` (rsync-like).
//!
//! Rules are tried in the order given; the first whose pattern matches an entry
//! decides (include or exclude); an entry no rule matches is included. A pattern is a
//! glob (`*` and `?` never match `/`, `**` matches across directories, `[...]` and
//! `{a,b}` as usual):
//! - without a `/` (a trailing one aside) it matches the entry's name, at any depth;
//! - with a `/` it matches the entry's path relative to the source directory (a leading
//!   `/` is allowed and means the same: anchored at the source directory);
//! - with a trailing `/` it matches directories only.
//!
//! An excluded directory is not descended into, so nothing below it is backed up
//! whatever later rules say.

use globset::{GlobBuilder, GlobMatcher};

/// Whether a rule keeps or drops what it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind {
    /// `--include`: the entry is backed up.
    Include,
    /// `--exclude`: the entry is left out.
    Exclude,
}

/// One include or exclude rule.
#[derive(Debug, Clone)]
pub struct Rule {
    kind: RuleKind,
    pattern: String,
    matcher: GlobMatcher,
    /// The pattern names a path (it had a `/` other than a trailing one), not a name.
    anchored: bool,
    /// The pattern ended with `/`: directories only.
    dirs_only: bool,
}

/// A pattern that is not a valid glob.
#[derive(Debug, thiserror::Error)]
#[error("invalid pattern {pattern:?}: {source}")]
pub struct PatternError {
    pattern: String,
    #[source]
    source: globset::Error,
}

impl Rule {
    /// Parses `pattern` (see the module docs).
    pub fn new(kind: RuleKind, pattern: &str) -> Result<Rule, PatternError> {
        let dirs_only = pattern.ends_with('/');
        let body = pattern.trim_end_matches('/');
        let anchored = body.contains('/');
        let body = body.trim_start_matches('/');
        let matcher = GlobBuilder::new(body)
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|source| PatternError {
                pattern: pattern.to_string(),
                source,
            })?
            .compile_matcher();
        Ok(Rule {
            kind,
            pattern: pattern.to_string(),
            matcher,
            anchored,
            dirs_only,
        })
    }

    /// The pattern as given.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Include or exclude.
    pub fn kind(&self) -> RuleKind {
        self.kind
    }

    fn matches(&self, rel: &str, is_dir: bool) -> bool {
        if self.dirs_only && !is_dir {
            return false;
        }
        if self.anchored {
            self.matcher.is_match(rel)
        } else {
            let name = rel.rsplit('/').next().unwrap_or(rel);
            self.matcher.is_match(name)
        }
    }
}

/// An ordered list of rules; the empty filter includes everything.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    rules: Vec<Rule>,
}

impl Filter {
    /// A filter of `rules`, tried in this order.
    pub fn new(rules: Vec<Rule>) -> Filter {
        Filter { rules }
    }

    /// True if the entry at `rel` (its path relative to the source directory, `/`
    /// separated, no leading `/`) is left out: the first rule that matches it is an
    /// exclude.
    pub fn excludes(&self, rel: &str, is_dir: bool) -> bool {
        self.rules
            .iter()
            .find(|r| r.matches(rel, is_dir))
            .is_some_and(|r| r.kind == RuleKind::Exclude)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(rules: &[(RuleKind, &str)]) -> Filter {
        Filter::new(
            rules
                .iter()
                .map(|(k, p)| Rule::new(*k, p).unwrap())
                .collect(),
        )
    }

    use RuleKind::{Exclude, Include};

    #[test]
    fn a_name_pattern_matches_at_any_depth() {
        let f = filter(&[(Exclude, "*.tmp")]);
        assert!(f.excludes("a.tmp", false));
        assert!(f.excludes("x/y/a.tmp", false));
        assert!(!f.excludes("x/a.tmp.keep", false));
        assert!(!f.excludes("a.tmp/b", false));
    }

    #[test]
    fn a_path_pattern_is_anchored_and_star_stops_at_slashes() {
        let f = filter(&[(Exclude, "cache/*")]);
        assert!(f.excludes("cache/x", false));
        assert!(!f.excludes("cache/x/y", false));
        assert!(!f.excludes("home/cache/x", false));
        let f = filter(&[(Exclude, "/build")]);
        assert!(f.excludes("build", true));
        assert!(!f.excludes("src/build", true));
        let f = filter(&[(Exclude, "**/node_modules/**")]);
        assert!(f.excludes("a/node_modules/b", false));
    }

    #[test]
    fn a_trailing_slash_matches_directories_only() {
        let f = filter(&[(Exclude, "logs/")]);
        assert!(f.excludes("logs", true));
        assert!(f.excludes("srv/logs", true));
        assert!(!f.excludes("logs", false));
    }

    #[test]
    fn the_first_matching_rule_wins() {
        let f = filter(&[(Include, "keep.log"), (Exclude, "*.log")]);
        assert!(!f.excludes("d/keep.log", false));
        assert!(f.excludes("d/other.log", false));
        assert!(!f.excludes("d/other.txt", false));
        let f = filter(&[(Exclude, "*.log"), (Include, "keep.log")]);
        assert!(f.excludes("keep.log", false));
    }

    #[test]
    fn a_bad_pattern_is_an_error() {
        let e = Rule::new(Exclude, "a[").unwrap_err();
        assert!(e.to_string().contains("a["), "{e}");
    }
}
