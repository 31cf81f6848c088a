//! Garbage collection of stripe objects, with no I/O: which objects a node may lose.
//!
//! An object (`SHARE/FAN/ID.INDEX` in a node's store share) is **garbage** when both
//! hold:
//!
//! - no layout names it on that node: no entry of any share (visible or not, so the
//!   entries of a snapshot still being built count, and so do the files of every
//!   snapshot) has a layout with that id whose stripe `INDEX` lists the node among its
//!   replicas ([`Named`]);
//! - it is older than the grace period: its last change ([`Found::changed`], its ctime
//!   on the node, which a client cannot set back; its mtime is its source file's) is
//!   at least `grace` before `now`.
//!
//! The grace period is what keeps uploads in flight: their objects exist before the
//! layout that names them is committed. The invariant the writers keep is that a layout
//! is committed within `grace` of the last change of every object it names on each
//! node: a new object is as young as its upload, and a resumed copy that reuses an
//! object from an earlier run refreshes its ctime first (and checks it is still there
//! before committing). The collector lists a node's objects (with their times) before
//! it reads the namespace, and takes `now` before it lists: an object written after
//! the listing is not seen at all, and one committed before the namespace was read is
//! named.

use std::collections::HashSet;
use std::time::Duration;

use super::{Layout, ObjectPath};
use ferry_common::msg::Timestamp;

/// Which (node, object) pairs the namespace names.
#[derive(Debug, Clone, Default)]
pub struct Named {
    pairs: HashSet<(String, String)>,
}

impl Named {
    /// An empty set.
    pub fn new() -> Named {
        Named::default()
    }

    /// Adds every object of `layout` (a file of `share`) on each of its replicas.
    pub fn add(&mut self, share: &str, layout: &Layout) {
        for (i, s) in layout.stripes.iter().enumerate() {
            // A reused stripe names its owner's object ([`Layout::object_path`]).
            let object = layout.object_path(share, i);
            for node in &s.replicas {
                self.pairs.insert((node.clone(), object.clone()));
            }
        }
    }

    /// True if some layout names `object` on `node`.
    pub fn names(&self, node: &str, object: &str) -> bool {
        // The tuple key needs owned strings; the set is read once per object.
        self.pairs.contains(&(node.to_owned(), object.to_owned()))
    }
}

/// One object found in a node's store share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Its path in the store share (`SHARE/FAN/ID.INDEX`).
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its last change on the node: its ctime.
    pub changed: Timestamp,
}

/// What becomes of one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A layout names it: kept.
    Named,
    /// Named by no layout, but changed within the grace period (or in the future of
    /// `now`): kept, it may belong to an upload in flight.
    Young,
    /// Named by no layout and older than the grace period: removed.
    Garbage,
    /// Not an object's path: never touched.
    Foreign,
}

/// The verdict on `found` on node `node`, given what the namespace names, the grace
/// period and the time `now` taken before the node was listed.
pub fn verdict(
    node: &str,
    found: &Found,
    named: &Named,
    grace: Duration,
    now: Timestamp,
) -> Verdict {
    if ObjectPath::parse(&found.path).is_none() {
        return Verdict::Foreign;
    }
    if named.names(node, &found.path) {
        return Verdict::Named;
    }
    if older_than(found.changed, now, grace) {
        Verdict::Garbage
    } else {
        Verdict::Young
    }
}

/// True if `changed` is at least `grace` before `now` (never for a time after `now`).
fn older_than(changed: Timestamp, now: Timestamp, grace: Duration) -> bool {
    let nanos = |t: Timestamp| i128::from(t.secs) * 1_000_000_000 + i128::from(t.nanos);
    let age = nanos(now) - nanos(changed);
    age >= 0 && age as u128 >= grace.as_nanos()
}

/// The objects of `found` (on node `node`) to remove, in the order found.
pub fn garbage<'f>(
    node: &str,
    found: &'f [Found],
    named: &Named,
    grace: Duration,
    now: Timestamp,
) -> Vec<&'f Found> {
    found
        .iter()
        .filter(|f| verdict(node, f, named, grace, now) == Verdict::Garbage)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::object_path;
    use crate::model::{Layout, Stripe};
    use ferry_common::msg::HashAlgorithm;

    const ID: &str = "0123456789abcdef0123456789abcdef";
    const OTHER: &str = "fedcba9876543210fedcba9876543210";

    fn at(secs: i64) -> Timestamp {
        Timestamp { secs, nanos: 0 }
    }

    fn layout(id: &str, replicas: &[&[&str]]) -> Layout {
        Layout {
            id: id.into(),
            algorithm: HashAlgorithm::SUPPORTED[0],
            stripe_bytes: 1 << 20,
            stripes: replicas
                .iter()
                .map(|r| Stripe {
                    replicas: r.iter().map(|n| n.to_string()).collect(),
                    manifest: "00".repeat(32),
                    object: None,
                })
                .collect(),
        }
    }

    fn found(path: String, changed: i64) -> Found {
        Found {
            path,
            size: 10,
            changed: at(changed),
        }
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn named_objects_stay_whatever_their_age() {
        let mut named = Named::new();
        named.add("data", &layout(ID, &[&["n1", "n2"], &["n2", "n3"]]));
        let f = found(object_path("data", ID, 1), 0);
        assert_eq!(
            verdict("n3", &f, &named, HOUR, at(1_000_000)),
            Verdict::Named
        );
        // The same object on a node its stripe does not list is named there by nothing.
        assert_eq!(
            verdict("n1", &f, &named, HOUR, at(1_000_000)),
            Verdict::Garbage
        );
        // A stripe index past the layout's stripes, or another share, is not named.
        let past = found(object_path("data", ID, 2), 0);
        assert_eq!(
            verdict("n2", &past, &named, HOUR, at(10_000)),
            Verdict::Garbage
        );
        let share = found(object_path("other", ID, 0), 0);
        assert_eq!(
            verdict("n1", &share, &named, HOUR, at(10_000)),
            Verdict::Garbage
        );
    }

    #[test]
    fn a_reused_object_stays_while_a_newer_version_names_it() {
        // OTHER is a newer version that reuses ID's stripe 0 and has its own stripe 1;
        // ID itself is gone from the namespace.
        let old = layout(ID, &[&["n1"], &["n1"]]);
        let mut new = layout(OTHER, &[&["n1"], &["n1"]]);
        new.stripes[0] = old.reused_by(0, OTHER).unwrap();
        let mut named = Named::new();
        named.add("data", &new);
        let verdict_of = |path: String| verdict("n1", &found(path, 0), &named, HOUR, at(9999));
        assert_eq!(verdict_of(object_path("data", ID, 0)), Verdict::Named);
        assert_eq!(verdict_of(object_path("data", OTHER, 1)), Verdict::Named);
        // The replaced stripe's object and the reused one's never-written twin go.
        assert_eq!(verdict_of(object_path("data", ID, 1)), Verdict::Garbage);
        assert_eq!(verdict_of(object_path("data", OTHER, 0)), Verdict::Garbage);
    }

    #[test]
    fn unnamed_objects_go_only_after_the_grace_period() {
        let named = Named::new();
        let f = found(object_path("data", OTHER, 0), 1000);
        assert_eq!(
            verdict("n1", &f, &named, HOUR, at(1000 + 3599)),
            Verdict::Young
        );
        assert_eq!(
            verdict("n1", &f, &named, HOUR, at(1000 + 3600)),
            Verdict::Garbage
        );
        // A change in the future of `now` (a node's clock ahead) is young.
        assert_eq!(
            verdict("n1", &f, &named, Duration::ZERO, at(999)),
            Verdict::Young
        );
        // Grace 0: anything unnamed and not from the future goes.
        assert_eq!(
            verdict("n1", &f, &named, Duration::ZERO, at(1000)),
            Verdict::Garbage
        );
        let nanos = Found {
            changed: Timestamp {
                secs: 1000,
                nanos: 5,
            },
            ..f.clone()
        };
        assert_eq!(
            verdict("n1", &nanos, &named, Duration::ZERO, at(1000)),
            Verdict::Young
        );
    }

    #[test]
    fn what_is_not_an_object_is_never_touched() {
        let named = Named::new();
        for path in [
            "data/01/not-an-object",
            "data/ff/0123456789abcdef0123456789abcdef.0", // wrong fan directory
            ".ferry-state/x",
            "data/01/0123456789abcdef0123456789abcdef.01",
        ] {
            let f = found(path.into(), 0);
            assert_eq!(
                verdict("n1", &f, &named, Duration::ZERO, at(9)),
                Verdict::Foreign,
                "{path}"
            );
        }
    }

    #[test]
    fn garbage_picks_the_unnamed_old_objects() {
        let mut named = Named::new();
        named.add("data", &layout(ID, &[&["n1"]]));
        let all = vec![
            found(object_path("data", ID, 0), 0),
            found(object_path("data", OTHER, 0), 0),
            found(object_path("data", OTHER, 1), 5000),
            found("data/zz/junk".into(), 0),
        ];
        let gone: Vec<&str> = garbage("n1", &all, &named, HOUR, at(6000))
            .into_iter()
            .map(|f| f.path.as_str())
            .collect();
        assert_eq!(gone, vec![object_path("data", OTHER, 0)]);
    }
}
