//! Moving stripe replicas between nodes, with no I/O: the plans of `ferry cluster
//! drain` (every replica off one node) and `ferry cluster rebalance` (replicas from
//! the most loaded nodes to the least, until the counts are within a tolerance).
//!
//! The input is every stripe of every layout ([`Replicas`]) and the nodes that may
//! take new replicas (live, not draining; a full node is still counted, but has no
//! room). A [`Move`] says: copy stripe `stripe` of entry `entry` from `from` to `to`,
//! then put `to` in `from`'s place among the stripe's replicas. Every plan keeps:
//! - a stripe's replicas stay on distinct nodes (`to` never holds the stripe already);
//! - a node gets no more than its room ([`NodeInfo::room`]) in planned moves;
//! - each replica of a stripe moves at most once in a plan;
//! - the same input gives the same plan (node order: the layout's rendezvous order for
//!   a drain, counts then ids for a rebalance).

use std::collections::{BTreeMap, HashSet};

use super::{placement, NodeInfo};

/// One stripe of one layout, as the planners see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    /// The caller's index of the entry (file) the stripe belongs to.
    pub entry: usize,
    /// The layout's id (its rendezvous key).
    pub key: String,
    /// The stripe's index in its layout.
    pub stripe: usize,
    /// The nodes holding it.
    pub replicas: Vec<String>,
    /// Its length in bytes.
    pub len: u64,
}

/// One planned replica move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// The entry, as in [`Replicas::entry`].
    pub entry: usize,
    /// The stripe's index in its layout.
    pub stripe: usize,
    /// The node giving up its replica.
    pub from: String,
    /// The node getting one.
    pub to: String,
    /// Bytes to copy.
    pub len: u64,
}

/// A drain's plan: the moves, and the stripes that have nowhere to go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainPlan {
    /// The moves, in input order.
    pub moves: Vec<Move>,
    /// Stripes on the drained node that no eligible node can take (every one holds
    /// it already or lacks room), as (entry, stripe).
    pub stuck: Vec<(usize, usize)>,
}

/// Plans moving every replica on node `node` to the nodes of `targets` (the nodes
/// that may take new replicas; `node` itself is never one): each stripe to the first
/// node of its layout's placement order that does not hold it and has room left.
pub fn plan_drain(node: &str, stripes: &[Replicas], targets: &[NodeInfo]) -> DrainPlan {
    let mut nodes: Vec<NodeInfo> = targets.iter().filter(|n| n.id != node).cloned().collect();
    let mut plan = DrainPlan::default();
    for s in stripes
        .iter()
        .filter(|s| s.replicas.iter().any(|r| r == node))
    {
        let Some(to) = placement::next_replica(&s.key, &nodes, &s.replicas, s.len) else {
            plan.stuck.push((s.entry, s.stripe));
            continue;
        };
        let to = to.id.clone();
        take_room(&mut nodes, &to, s.len);
        plan.moves.push(Move {
            entry: s.entry,
            stripe: s.stripe,
            from: node.to_owned(),
            to,
            len: s.len,
        });
    }
    plan
}

/// Counts `len` against node `id`'s room in the planner's copy of the nodes.
fn take_room(nodes: &mut [NodeInfo], id: &str, len: u64) {
    if let Some(n) = nodes.iter_mut().find(|n| n.id == id) {
        n.free = n.free.saturating_sub(len);
    }
}

/// The largest spread of replica counts a rebalance leaves: `tolerance_percent` of the
/// mean count per node, and at least one replica.
pub fn allowed_spread(replicas: usize, nodes: usize, tolerance_percent: u32) -> usize {
    let mean = replicas as f64 / nodes.max(1) as f64;
    ((mean * f64::from(tolerance_percent) / 100.0).floor() as usize).max(1)
}

/// Replica counts per node of `nodes`, over `stripes` (replicas on other nodes, dead
/// or draining, are not counted).
pub fn counts(stripes: &[Replicas], nodes: &[NodeInfo]) -> BTreeMap<String, usize> {
    let mut counts: BTreeMap<String, usize> = nodes.iter().map(|n| (n.id.clone(), 0)).collect();
    for r in stripes.iter().flat_map(|s| &s.replicas) {
        if let Some(c) = counts.get_mut(r) {
            *c += 1;
        }
    }
    counts
}

/// Plans moves from the most loaded of `nodes` to the least until the replica counts
/// differ by at most [`allowed_spread`] (or no allowed move is left). Each move goes
/// from a node with the highest count to the node with the lowest count that can
/// take one of its stripes; every move lowers the sum of squared counts, so planning
/// ends.
pub fn plan_rebalance(
    stripes: &[Replicas],
    nodes: &[NodeInfo],
    tolerance_percent: u32,
) -> Vec<Move> {
    let mut counts = counts(stripes, nodes);
    let total: usize = counts.values().sum();
    let spread = allowed_spread(total, nodes.len(), tolerance_percent);
    let mut room: BTreeMap<String, u64> = nodes.iter().map(|n| (n.id.clone(), n.room())).collect();
    let mut moved: HashSet<(usize, usize, String)> = HashSet::new();
    let mut holders: Vec<Vec<String>> = stripes.iter().map(|s| s.replicas.clone()).collect();
    let mut plan = Vec::new();
    while let Some((i, from, to)) = next_move(stripes, &holders, &counts, &room, &moved, spread) {
        let s = &stripes[i];
        for h in holders[i].iter_mut().filter(|h| **h == from) {
            h.clone_from(&to);
        }
        *counts.get_mut(&from).expect("counted") -= 1;
        *counts.get_mut(&to).expect("counted") += 1;
        *room.get_mut(&to).expect("a node") -= s.len;
        moved.insert((s.entry, s.stripe, to.clone()));
        plan.push(Move {
            entry: s.entry,
            stripe: s.stripe,
            from,
            to,
            len: s.len,
        });
    }
    plan
}

/// The next rebalance move, as (stripe index, from, to): from the most loaded node
/// (ties: lowest id) that has a movable stripe, to the least loaded node (ties: lowest
/// id) more than `spread` below it that holds none of that stripe and has room.
fn next_move(
    stripes: &[Replicas],
    holders: &[Vec<String>],
    counts: &BTreeMap<String, usize>,
    room: &BTreeMap<String, u64>,
    moved: &HashSet<(usize, usize, String)>,
    spread: usize,
) -> Option<(usize, String, String)> {
    let mut by_load: Vec<(&String, usize)> = counts.iter().map(|(k, v)| (k, *v)).collect();
    by_load.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    for (from, high) in &by_load {
        for (to, low) in by_load.iter().rev() {
            if high.saturating_sub(*low) <= spread {
                break;
            }
            let found = stripes.iter().enumerate().find(|(i, s)| {
                let h = &holders[*i];
                h.contains(from)
                    && !h.contains(to)
                    && !moved.contains(&(s.entry, s.stripe, (*from).clone()))
                    && room.get(*to).is_some_and(|r| *r >= s.len)
            });
            if let Some((i, _)) = found {
                return Some((i, (*from).clone(), (*to).clone()));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::placement::tests::node;
    use super::*;

    fn stripe(entry: usize, index: usize, replicas: &[&str]) -> Replicas {
        Replicas {
            entry,
            key: format!("layout{entry}"),
            stripe: index,
            replicas: replicas.iter().map(|r| r.to_string()).collect(),
            len: 10,
        }
    }

    fn apply(stripes: &mut [Replicas], moves: &[Move]) {
        for m in moves {
            let s = stripes
                .iter_mut()
                .find(|s| s.entry == m.entry && s.stripe == m.stripe)
                .unwrap();
            assert!(!s.replicas.contains(&m.to), "{m:?} onto a holder");
            let at = s.replicas.iter().position(|r| *r == m.from).unwrap();
            s.replicas[at] = m.to.clone();
        }
    }

    #[test]
    fn drain_moves_every_replica_to_a_node_without_one() {
        let ns = vec![node("a", 1000), node("b", 1000), node("c", 1000)];
        let mut stripes = vec![
            stripe(0, 0, &["a", "b"]),
            stripe(0, 1, &["b", "c"]),
            stripe(1, 0, &["c", "a"]),
        ];
        let plan = plan_drain("a", &stripes, &ns);
        assert!(plan.stuck.is_empty());
        assert_eq!(plan.moves.len(), 2);
        assert_eq!(plan.moves[0].to, "c");
        assert_eq!(plan.moves[1].to, "b");
        assert_eq!(plan, plan_drain("a", &stripes, &ns), "deterministic");
        apply(&mut stripes, &plan.moves);
        assert!(stripes.iter().all(|s| !s.replicas.contains(&"a".into())));
        // Done: a second run plans nothing (a drain is idempotent).
        assert_eq!(plan_drain("a", &stripes, &ns), DrainPlan::default());
    }

    #[test]
    fn drain_without_a_place_is_stuck_and_counts_room() {
        // Two replicas on two nodes: draining one leaves nowhere to go.
        let ns = vec![node("a", 1000), node("b", 1000)];
        let plan = plan_drain("a", &[stripe(0, 0, &["a", "b"])], &ns);
        assert_eq!(plan.stuck, vec![(0, 0)]);
        // c has room for one stripe of 10 bytes only; the second goes to d.
        let ns = vec![
            node("a", 1000),
            node("b", 1000),
            node("c", 15),
            node("d", 10),
        ];
        let plan = plan_drain(
            "a",
            &[stripe(0, 0, &["a", "b"]), stripe(1, 0, &["a", "b"])],
            &ns,
        );
        let mut to: Vec<&str> = plan.moves.iter().map(|m| m.to.as_str()).collect();
        to.sort();
        assert_eq!(to, ["c", "d"]);
        let mut full = node("e", 1000);
        full.reserve = 995;
        let plan = plan_drain("a", &[stripe(0, 0, &["a", "b"])], &[node("b", 1000), full]);
        assert_eq!(plan.stuck, vec![(0, 0)], "a full node takes nothing");
    }

    #[test]
    fn rebalance_evens_out_a_new_node() {
        let ns = vec![
            node("a", 1000),
            node("b", 1000),
            node("c", 1000),
            node("d", 1000),
        ];
        // 12 stripes of 2 replicas on a, b, c; d is new and empty.
        let pairs = [["a", "b"], ["b", "c"], ["c", "a"]];
        let mut stripes: Vec<Replicas> = (0..12).map(|i| stripe(i, 0, &pairs[i % 3])).collect();
        let plan = plan_rebalance(&stripes, &ns, 10);
        assert_eq!(plan, plan_rebalance(&stripes, &ns, 10), "deterministic");
        assert_eq!(plan.len(), 6, "{plan:?}");
        apply(&mut stripes, &plan);
        let after = counts(&stripes, &ns);
        assert!(after.values().all(|c| *c == 6), "{after:?}");
        // Balanced: nothing more to do.
        assert!(plan_rebalance(&stripes, &ns, 10).is_empty());
    }

    #[test]
    fn rebalance_keeps_distinct_replicas_room_and_tolerance() {
        // d has room for two stripes only.
        let ns = vec![node("a", 1000), node("b", 1000), node("d", 25)];
        let mut stripes: Vec<Replicas> = (0..6).map(|i| stripe(i, 0, &["a", "b"])).collect();
        let plan = plan_rebalance(&stripes, &ns, 10);
        assert_eq!(plan.len(), 2);
        apply(&mut stripes, &plan);
        assert_eq!(counts(&stripes, &ns)["d"], 2);
        // A wide tolerance plans nothing.
        assert!(plan_rebalance(
            &stripes,
            &[node("a", 1000), node("b", 1000), node("d", 1000)],
            200
        )
        .is_empty());
        assert_eq!(allowed_spread(24, 4, 10), 1);
        assert_eq!(allowed_spread(400, 4, 10), 10);
    }
}
