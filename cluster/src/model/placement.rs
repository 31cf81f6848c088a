//! Where stripes go: weighted rendezvous hashing over the live nodes.
//!
//! For a file version (its layout id), every live node gets a score from a hash of
//! (node id, layout id), weighted by the node's free space; sorting by score gives the
//! file's node order. Stripe `i` goes to the `R` nodes starting at position `i` of
//! that order (wrapping), so:
//! - consecutive stripes start on distinct nodes, and a big file's stripes are spread
//!   evenly over every node (bandwidth adds up);
//! - a stripe's replicas are on distinct nodes;
//! - the choice depends only on the id and the node set: adding or losing a node moves
//!   only the files whose order it was part of (the rendezvous property), and two
//!   clients with the same view choose the same nodes;
//! - a node with more free space comes first more often (the weight).
//!
//! Nodes without room for a stripe are left out: a node's room is its free space above
//! the reserve it keeps ([`NodeInfo::room`], `ferryd --min-free`), so a full node gets
//! no new stripes, and the error when no node is left names the full ones.

use sha2::{Digest, Sha256};

use super::NodeInfo;

/// Why no placement could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// No node is registered and alive.
    #[error("no storage node is alive")]
    NoNodes,
    /// Every live node is too full.
    #[error(
        "no space: no live storage node has room for a stripe of {need} bytes{}",
        full_list(full)
    )]
    NoSpace {
        /// Bytes a stripe needs.
        need: u64,
        /// The live nodes that are full (no room above their reserve).
        full: Vec<String>,
    },
}

/// `" (full: a, b)"`, or nothing.
fn full_list(full: &[String]) -> String {
    if full.is_empty() {
        String::new()
    } else {
        format!(" (full: {})", full.join(", "))
    }
}

/// A uniform number in (0, 1) from `node` and `key`.
fn unit(node: &str, key: &str) -> f64 {
    let mut h = Sha256::new();
    h.update(node.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let d = h.finalize();
    let x = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
    // (x + 1) / (2^64 + 1): never 0, never 1.
    (x as f64 + 1.0) / (u64::MAX as f64 + 2.0)
}

/// The live nodes with at least `need` bytes free, in `key`'s rendezvous order
/// (highest weighted score first; ties by id, so the order is total).
pub fn order<'a>(
    key: &str,
    nodes: &'a [NodeInfo],
    need: u64,
) -> Result<Vec<&'a NodeInfo>, PlacementError> {
    if nodes.is_empty() {
        return Err(PlacementError::NoNodes);
    }
    let mut scored: Vec<(f64, &NodeInfo)> = nodes
        .iter()
        .filter(|n| n.room() >= need.max(1))
        .map(|n| {
            // Weighted rendezvous (Schindelhauer & Schomaker): w / -ln(u).
            let w = n.room().max(1) as f64;
            (w / -unit(&n.id, key).ln(), n)
        })
        .collect();
    if scored.is_empty() {
        let full = nodes
            .iter()
            .filter(|n| n.is_full())
            .map(|n| n.id.clone())
            .collect();
        return Err(PlacementError::NoSpace { need, full });
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
    Ok(scored.into_iter().map(|(_, n)| n).collect())
}

/// The replica sets of `stripes` stripes of layout `key`: `replicas` distinct nodes
/// each (fewer when fewer nodes are alive), node ids in preference order.
pub fn place(
    key: &str,
    stripes: usize,
    replicas: usize,
    nodes: &[NodeInfo],
    stripe_bytes: u64,
) -> Result<Vec<Vec<String>>, PlacementError> {
    let ordered = order(key, nodes, stripe_bytes)?;
    let r = replicas.clamp(1, ordered.len());
    Ok((0..stripes)
        .map(|i| {
            (0..r)
                .map(|k| ordered[(i + k) % ordered.len()].id.clone())
                .collect()
        })
        .collect())
}

/// A node to hold one more replica of a stripe of layout `key`: the first node in the
/// layout's order that holds none yet and has room.
pub fn next_replica<'a>(
    key: &str,
    nodes: &'a [NodeInfo],
    holding: &[String],
    need: u64,
) -> Option<&'a NodeInfo> {
    order(key, nodes, need)
        .ok()?
        .into_iter()
        .find(|n| !holding.contains(&n.id))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A node of `free` bytes, all free, reserving none (for the planners' tests too).
    pub(in crate::model) fn node(id: &str, free: u64) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            addr: format!("{id}:7447"),
            transports: vec!["tcp".into()],
            capacity: free,
            free,
            started: 0,
            reserve: 0,
        }
    }

    fn nodes(n: usize) -> Vec<NodeInfo> {
        (0..n).map(|i| node(&format!("n{i}"), 1 << 40)).collect()
    }

    #[test]
    fn deterministic_distinct_and_spread() {
        let ns = nodes(4);
        let a = place("file-1", 8, 2, &ns, 1 << 20).unwrap();
        assert_eq!(a, place("file-1", 8, 2, &ns, 1 << 20).unwrap());
        for r in &a {
            assert_eq!(r.len(), 2);
            assert_ne!(r[0], r[1]);
        }
        // Every node is the first replica of exactly two of the eight stripes.
        for n in &ns {
            assert_eq!(a.iter().filter(|r| r[0] == n.id).count(), 2);
        }
    }

    #[test]
    fn input_order_does_not_matter() {
        let mut ns = nodes(5);
        let a = place("k", 3, 3, &ns, 1).unwrap();
        ns.reverse();
        assert_eq!(a, place("k", 3, 3, &ns, 1).unwrap());
    }

    #[test]
    fn fewer_nodes_than_replicas() {
        let ns = nodes(1);
        assert_eq!(place("k", 2, 3, &ns, 1).unwrap(), vec![vec!["n0"]; 2]);
        assert_eq!(place("k", 1, 2, &[], 1), Err(PlacementError::NoNodes));
    }

    #[test]
    fn full_nodes_are_skipped() {
        let ns = vec![node("a", 10), node("b", 1000)];
        assert_eq!(place("k", 2, 2, &ns, 100).unwrap(), vec![vec!["b"]; 2]);
        assert_eq!(
            place("k", 1, 1, &ns, 5000),
            Err(PlacementError::NoSpace {
                need: 5000,
                full: vec![]
            })
        );
    }

    #[test]
    fn nodes_at_their_reserve_are_full_and_named() {
        let mut full = node("a", 1000);
        full.reserve = 1000;
        let mut low = node("b", 1000);
        low.reserve = 950;
        assert!(full.is_full() && !low.is_full());
        let ns = vec![full, low, node("c", 1000)];
        assert_eq!(place("k", 3, 2, &ns, 100).unwrap(), vec![vec!["c"]; 3]);
        let e = place("k", 1, 1, &ns[..2], 100).unwrap_err();
        assert_eq!(
            e,
            PlacementError::NoSpace {
                need: 100,
                full: vec!["a".into()]
            }
        );
        assert_eq!(
            e.to_string(),
            "no space: no live storage node has room for a stripe of 100 bytes (full: a)"
        );
    }

    #[test]
    fn losing_a_node_moves_only_its_share() {
        // Rendezvous: the first choice of a key changes only where it was the lost node.
        let ns = nodes(4);
        let less: Vec<NodeInfo> = ns.iter().filter(|n| n.id != "n2").cloned().collect();
        for i in 0..200 {
            let key = format!("f{i}");
            let before = order(&key, &ns, 1).unwrap()[0].id.clone();
            let after = order(&key, &less, 1).unwrap()[0].id.clone();
            if before != "n2" {
                assert_eq!(before, after, "{key}");
            }
        }
    }

    #[test]
    fn first_choices_are_balanced() {
        let ns = nodes(4);
        let mut counts = [0usize; 4];
        for i in 0..4000 {
            let first = &order(&format!("f{i}"), &ns, 1).unwrap()[0].id;
            counts[first[1..].parse::<usize>().unwrap()] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn next_replica_skips_holders() {
        let ns = nodes(3);
        let order_ids: Vec<String> = order("k", &ns, 1)
            .unwrap()
            .iter()
            .map(|n| n.id.clone())
            .collect();
        let next = next_replica("k", &ns, &order_ids[..1], 1).unwrap();
        assert_eq!(next.id, order_ids[1]);
        assert!(next_replica("k", &ns, &order_ids, 1).is_none());
    }
}
