//! Renaming a directory with everything below it in one etcd transaction: the plan
//! (sans-IO; [`crate::Meta::read_tree`] reads, [`crate::Meta::apply_tree`]
//! sends it).
//!
//! A directory's children are keys of their own (`/ferry/ns/SHARE/DIR/...`), so a
//! rename moves every key of the subtree: the directory's and each one below it,
//! values unchanged (a layout names its objects by layout id, never by path:
//! [`crate::model::object_path`], so no data moves). The keys are read at
//! one revision `R`, then one transaction
//!
//! ```text
//!  compare  each read key's mod revision == what was read     (N: changed or deleted)
//!           every key under SRC/ has mod revision < R + 1     (1: created since R)
//!           DST's mod revision == what was read (0: absent)   (1)
//!           no key under DST/                                  (1: DST empty or absent)
//!           DST's parent exists (a share's top level: none)   (1)
//!  success  delete SRC, delete the range SRC/                  (2)
//!           put DST + suffix for each read key                (N)
//! ```
//!
//! Invariants: the transaction applies only to the subtree exactly as read (a key
//! changed, deleted or created under the source since `R` fails a compare: a range
//! compare of etcd checks every key in the range, and a deleted key is caught by
//! its own compare), so readers see the whole tree at one place or the other; and
//! the target is replaced only when it is an empty directory. The put of DST over
//! a replaced empty directory overwrites it (etcd refuses a put and a delete of one
//! key in one transaction). etcd limits both lists to `--max-txn-ops` (128 by
//! default): with the layout above a subtree of at most [`MAX_TREE_ENTRIES`] entries
//! (the directory included) fits; a bigger one is refused ([`TreePlanError::TooMany`]),
//! as is a transaction over [`MAX_TXN_BYTES`].

use crate::model::{children_prefix, entry_key, Entry, EntryKind};

/// etcd's default `--max-txn-ops`: compares, and operations, each at most this many.
pub const MAX_TXN_OPS: usize = 128;

/// Compares besides one per key of the subtree (see the module's table).
const OTHER_COMPARES: usize = 4;

/// The most entries (the directory and everything below it) one rename moves.
pub const MAX_TREE_ENTRIES: usize = MAX_TXN_OPS - OTHER_COMPARES;

/// The most bytes of keys and values one rename's transaction carries: below etcd's
/// default request limit (`--max-request-bytes`, 1.5 MiB) with room for framing.
pub const MAX_TXN_BYTES: usize = 1 << 20;

/// Bytes counted per compare or operation besides its keys and value (framing).
const OP_OVERHEAD: usize = 32;

/// One key of the subtree, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeKey {
    /// The key minus the source's key: `""` for the directory, `/a/b` below it.
    pub suffix: String,
    /// Its mod revision.
    pub revision: i64,
    /// Its value, moved unchanged.
    pub value: Vec<u8>,
}

/// The source and target of a directory rename, read at one revision.
#[derive(Debug, Clone)]
pub struct TreeRead {
    /// The revision everything was read at.
    pub revision: i64,
    /// The source's entry (`None`: gone).
    pub source: Option<Entry>,
    /// The source's key first, then every key below it.
    pub keys: Vec<TreeKey>,
    /// The target's entry and mod revision, if there is one.
    pub target: Option<(Entry, i64)>,
    /// How many keys are below the target.
    pub target_below: usize,
}

/// One compare of the transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guard {
    /// The key's mod revision is this one (0: the key is absent).
    Revision {
        /// The key.
        key: String,
        /// Its mod revision as read.
        revision: i64,
    },
    /// No key under the prefix was changed or created after this revision.
    NotChangedSince {
        /// The prefix.
        prefix: String,
        /// The revision everything was read at.
        revision: i64,
    },
    /// No key under the prefix.
    NoneBelow {
        /// The prefix.
        prefix: String,
    },
    /// The key exists.
    Exists {
        /// The key.
        key: String,
    },
}

/// One delete of the transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delete {
    /// One key.
    Key(String),
    /// Every key under the prefix.
    Prefix(String),
}

/// The transaction that renames the subtree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreePlan {
    /// All must hold.
    pub guards: Vec<Guard>,
    /// Then these go...
    pub deletes: Vec<Delete>,
    /// ...and these are put (key, value).
    pub puts: Vec<(String, Vec<u8>)>,
}

/// Why a directory is not renamed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreePlanError {
    /// The target is the source or below it.
    #[error("a directory cannot be moved into itself")]
    IntoItself,
    /// The source is gone.
    #[error("no such directory")]
    SourceMissing,
    /// The source is no longer a directory (changed since it was looked up).
    #[error("no longer a directory")]
    SourceNotDir,
    /// The target exists and the caller asked never to replace.
    #[error("the target exists")]
    TargetExists,
    /// The target exists and is not a directory.
    #[error("the target is not a directory")]
    TargetNotDir,
    /// The target directory has entries below it (or, absent, left-over keys).
    #[error("the target directory is not empty")]
    TargetNotEmpty,
    /// More entries than one etcd transaction takes.
    #[error(
        "{entries} entries to move, more than the {max} one etcd transaction takes \
         (--max-txn-ops {MAX_TXN_OPS})"
    )]
    TooMany {
        /// Entries in the subtree, the directory included.
        entries: usize,
        /// The most that fit.
        max: usize,
    },
    /// More bytes than one etcd request should carry.
    #[error("{bytes} bytes of entries to move, more than {max} for one etcd request")]
    TooBig {
        /// Bytes the transaction would carry.
        bytes: usize,
        /// The most it may.
        max: usize,
    },
}

/// True if share path `to` is `from` or below it.
pub fn is_within(to: &str, from: &str) -> bool {
    to == from || (to.starts_with(from) && to.as_bytes().get(from.len()) == Some(&b'/'))
}

/// The transaction that moves directory `from` of `share`, as `read` found it, to
/// `to` (replacing an empty directory there unless `noreplace`).
pub fn plan_tree_rename(
    share: &str,
    from: &str,
    to: &str,
    read: &TreeRead,
    noreplace: bool,
) -> Result<TreePlan, TreePlanError> {
    if is_within(to, from) {
        return Err(TreePlanError::IntoItself);
    }
    check_ends(read, noreplace)?;
    let entries = read.keys.len();
    if entries > MAX_TREE_ENTRIES {
        return Err(TreePlanError::TooMany {
            entries,
            max: MAX_TREE_ENTRIES,
        });
    }
    let (from_key, to_key) = (entry_key(share, from), entry_key(share, to));
    let mut guards: Vec<Guard> = read
        .keys
        .iter()
        .map(|k| Guard::Revision {
            key: format!("{from_key}{}", k.suffix),
            revision: k.revision,
        })
        .collect();
    guards.push(Guard::NotChangedSince {
        prefix: children_prefix(share, from),
        revision: read.revision,
    });
    guards.push(Guard::Revision {
        key: to_key.clone(),
        revision: read.target.as_ref().map_or(0, |(_, r)| *r),
    });
    guards.push(Guard::NoneBelow {
        prefix: children_prefix(share, to),
    });
    if let Some((parent, _)) = to.rsplit_once('/') {
        guards.push(Guard::Exists {
            key: entry_key(share, parent),
        });
    }
    let plan = TreePlan {
        guards,
        deletes: vec![
            Delete::Key(from_key),
            Delete::Prefix(children_prefix(share, from)),
        ],
        puts: read
            .keys
            .iter()
            .map(|k| (format!("{to_key}{}", k.suffix), k.value.clone()))
            .collect(),
    };
    debug_assert!(plan.guards.len() <= MAX_TXN_OPS);
    debug_assert!(plan.deletes.len() + plan.puts.len() <= MAX_TXN_OPS);
    let bytes = plan.bytes();
    if bytes > MAX_TXN_BYTES {
        return Err(TreePlanError::TooBig {
            bytes,
            max: MAX_TXN_BYTES,
        });
    }
    Ok(plan)
}

/// The source still a directory; the target absent, or an empty directory that may
/// be replaced.
fn check_ends(read: &TreeRead, noreplace: bool) -> Result<(), TreePlanError> {
    match &read.source {
        None => return Err(TreePlanError::SourceMissing),
        Some(e) if e.kind != EntryKind::Dir => return Err(TreePlanError::SourceNotDir),
        Some(_) => {}
    }
    match &read.target {
        Some(_) if noreplace => Err(TreePlanError::TargetExists),
        Some((e, _)) if e.kind != EntryKind::Dir => Err(TreePlanError::TargetNotDir),
        _ if read.target_below > 0 => Err(TreePlanError::TargetNotEmpty),
        _ => Ok(()),
    }
}

impl TreePlan {
    /// The bytes of keys and values the transaction carries, framing estimated.
    pub fn bytes(&self) -> usize {
        let guards: usize = self
            .guards
            .iter()
            .map(|g| match g {
                Guard::Revision { key, .. } | Guard::Exists { key } => key.len(),
                // A range compare carries the key and the range's end.
                Guard::NotChangedSince { prefix, .. } | Guard::NoneBelow { prefix } => {
                    2 * prefix.len()
                }
            })
            .sum();
        let deletes: usize = self
            .deletes
            .iter()
            .map(|d| match d {
                Delete::Key(k) => k.len(),
                Delete::Prefix(p) => 2 * p.len(),
            })
            .sum();
        let puts: usize = self.puts.iter().map(|(k, v)| k.len() + v.len()).sum();
        let ops = self.guards.len() + self.deletes.len() + self.puts.len();
        guards + deletes + puts + ops * OP_OVERHEAD
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::msg::Timestamp;

    fn entry(kind: EntryKind) -> Entry {
        Entry {
            kind,
            mode: 0o755,
            mtime: Timestamp::default(),
            size: 0,
            target: None,
            layout: None,
        }
    }

    /// Directory `d` with `below` files under it, read at revision 100.
    fn read(below: usize) -> TreeRead {
        let mut keys = vec![TreeKey {
            suffix: String::new(),
            revision: 7,
            value: b"dir".to_vec(),
        }];
        keys.extend((0..below).map(|i| TreeKey {
            suffix: format!("/f{i}"),
            revision: 10 + i as i64,
            value: format!("v{i}").into_bytes(),
        }));
        TreeRead {
            revision: 100,
            source: Some(entry(EntryKind::Dir)),
            keys,
            target: None,
            target_below: 0,
        }
    }

    #[test]
    fn a_tree_moves_whole_with_every_key_compared() {
        let plan = plan_tree_rename("s", "a/d", "b/e", &read(2), false).unwrap();
        assert_eq!(
            plan.guards,
            vec![
                Guard::Revision {
                    key: "/ferry/ns/s/a/d".into(),
                    revision: 7
                },
                Guard::Revision {
                    key: "/ferry/ns/s/a/d/f0".into(),
                    revision: 10
                },
                Guard::Revision {
                    key: "/ferry/ns/s/a/d/f1".into(),
                    revision: 11
                },
                Guard::NotChangedSince {
                    prefix: "/ferry/ns/s/a/d/".into(),
                    revision: 100
                },
                Guard::Revision {
                    key: "/ferry/ns/s/b/e".into(),
                    revision: 0
                },
                Guard::NoneBelow {
                    prefix: "/ferry/ns/s/b/e/".into()
                },
                Guard::Exists {
                    key: "/ferry/ns/s/b".into()
                },
            ]
        );
        assert_eq!(
            plan.deletes,
            vec![
                Delete::Key("/ferry/ns/s/a/d".into()),
                Delete::Prefix("/ferry/ns/s/a/d/".into())
            ]
        );
        assert_eq!(
            plan.puts,
            vec![
                ("/ferry/ns/s/b/e".into(), b"dir".to_vec()),
                ("/ferry/ns/s/b/e/f0".into(), b"v0".to_vec()),
                ("/ferry/ns/s/b/e/f1".into(), b"v1".to_vec()),
            ]
        );
    }

    #[test]
    fn a_top_level_target_has_no_parent_to_compare() {
        let plan = plan_tree_rename("s", "a/d", "e", &read(0), false).unwrap();
        assert!(!plan
            .guards
            .iter()
            .any(|g| matches!(g, Guard::Exists { .. })));
        assert_eq!(plan.guards.len(), 4);
    }

    #[test]
    fn the_limit_is_the_most_that_fits_both_lists() {
        // The directory and MAX_TREE_ENTRIES - 1 below it: exactly 128 compares.
        let plan = plan_tree_rename("s", "d", "x/e", &read(MAX_TREE_ENTRIES - 1), false).unwrap();
        assert_eq!(plan.guards.len(), MAX_TXN_OPS);
        assert!(plan.deletes.len() + plan.puts.len() <= MAX_TXN_OPS);
        assert_eq!(MAX_TREE_ENTRIES, 124);
        let over = plan_tree_rename("s", "d", "x/e", &read(MAX_TREE_ENTRIES), false);
        assert_eq!(
            over,
            Err(TreePlanError::TooMany {
                entries: 125,
                max: 124
            })
        );
        assert!(over.unwrap_err().to_string().contains("--max-txn-ops 128"));
    }

    #[test]
    fn a_tree_too_big_for_one_request_is_refused() {
        let mut r = read(1);
        r.keys[1].value = vec![b'x'; MAX_TXN_BYTES];
        assert!(matches!(
            plan_tree_rename("s", "d", "e", &r, false),
            Err(TreePlanError::TooBig { .. })
        ));
    }

    #[test]
    fn into_itself_or_below_is_refused_and_a_like_named_sibling_is_not() {
        for to in ["d", "d/x", "d/x/y"] {
            assert_eq!(
                plan_tree_rename("s", "d", to, &read(1), false),
                Err(TreePlanError::IntoItself),
                "{to}"
            );
        }
        assert!(plan_tree_rename("s", "d", "dx", &read(1), false).is_ok());
        assert!(!is_within("d2/x", "d"));
    }

    #[test]
    fn an_empty_target_directory_is_replaced_and_nothing_else_is() {
        let mut r = read(1);
        r.target = Some((entry(EntryKind::Dir), 42));
        let plan = plan_tree_rename("s", "d", "e", &r, false).unwrap();
        assert!(plan.guards.contains(&Guard::Revision {
            key: "/ferry/ns/s/e".into(),
            revision: 42
        }));
        // Put over, never deleted in the same transaction.
        assert!(!plan.deletes.contains(&Delete::Key("/ferry/ns/s/e".into())));
        assert_eq!(
            plan_tree_rename("s", "d", "e", &r, true),
            Err(TreePlanError::TargetExists)
        );
        r.target_below = 1;
        assert_eq!(
            plan_tree_rename("s", "d", "e", &r, false),
            Err(TreePlanError::TargetNotEmpty)
        );
        r.target = Some((entry(EntryKind::File), 42));
        r.target_below = 0;
        assert_eq!(
            plan_tree_rename("s", "d", "e", &r, false),
            Err(TreePlanError::TargetNotDir)
        );
        r.target = None;
        r.source = Some(entry(EntryKind::File));
        assert_eq!(
            plan_tree_rename("s", "d", "e", &r, false),
            Err(TreePlanError::SourceNotDir)
        );
        r.source = None;
        assert_eq!(
            plan_tree_rename("s", "d", "e", &r, false),
            Err(TreePlanError::SourceMissing)
        );
    }
}
