//! Looking at the snapshots of a cluster backup prefix: `rcp backup --list` (each
//! snapshot's files and bytes, from etcd) and `rcp backup --verify` (every copy of
//! every stripe of every file re-read by the node that holds it, and checked against
//! the manifest its layout names).
//!
//! Verify asks each node two things of each object it holds: `Verify` (the node
//! re-reads the object past its page cache and compares every chunk with the
//! manifest it recorded at upload: a damaged chunk is named by its index in the
//! stripe), then `Manifest` (the node's manifest of the object, now read from that
//! record or hashed anew) compared with the layout's: so a copy with other bytes is
//! found even where the node holds no record. Both run on the node; the client hashes
//! nothing. The reports are the single-node ones ([`SnapshotInfo`], [`VerifyOutcome`]).

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::model::{Entry, EntryKind, Layout, STORE_SHARE};
use ferry_common::msg::{DiskUsage, ErrorKind, RemoteError, VerifyReport};

use super::backup::top_dirs;
use super::copy::below_offset;
use super::health::Progress;
use super::Cluster;
use ferry_client::backup::admin::SnapshotInfo;
use ferry_client::backup::is_snapshot_name;
use ferry_client::backup::verify::{Damaged, Replica, VerifyOutcome, VERIFY_IN_FLIGHT};
use ferry_client::error::ClientError;
use ferry_client::schedule::run_lanes;
use ferry_client::walk::join;

/// Every snapshot under `prefix` of `share`, oldest first, with what it holds; a
/// subtree an interrupted run left unpublished is listed as partial.
pub async fn list(
    cluster: &Cluster,
    share: &str,
    prefix: &str,
) -> Result<Vec<SnapshotInfo>, ClientError> {
    let all = cluster.meta().below_all(share, "").await?;
    let entries: Vec<(String, Entry)> = all.into_iter().map(|(p, v)| (p, v.entry)).collect();
    Ok(snapshot_infos(&entries, prefix.trim_matches('/')))
}

/// The snapshots under `prefix` among every entry of a share (`all`, by path). A
/// snapshot's `unique_bytes` is what its layouts hold on the nodes (every replica of
/// every stripe object) that no entry outside it names: counted per object, since a
/// newer version of a file may reuse an older one's objects (copy-on-write). Pure.
pub(super) fn snapshot_infos(all: &[(String, Entry)], prefix: &str) -> Vec<SnapshotInfo> {
    let depth = below_offset(prefix);
    let under = |p: &str| prefix.is_empty() || p.starts_with(&format!("{prefix}/"));
    // Snapshot name -> its entries (root excluded), and whether its root exists.
    let mut snaps: BTreeMap<String, (Vec<&Entry>, bool)> = BTreeMap::new();
    // (owning layout id, stripe index) -> the snapshots naming that object ("": an
    // entry outside every snapshot).
    let mut outside: HashMap<(&str, usize), HashSet<String>> = HashMap::new();
    for (path, entry) in all {
        let top = under(path).then(|| path[depth..].split('/').next().unwrap_or(""));
        match top.filter(|t| is_snapshot_name(t)) {
            Some(name) => {
                let s = snaps.entry(name.to_owned()).or_default();
                match path.len() == depth + name.len() {
                    true => s.1 = entry.kind == EntryKind::Dir,
                    false => s.0.push(entry),
                }
                if let Some(l) = &entry.layout {
                    for i in 0..l.stripes.len() {
                        let holders = outside.entry((l.owner(i), i)).or_default();
                        holders.insert(name.to_owned());
                    }
                }
            }
            None => {
                if let Some(l) = &entry.layout {
                    for i in 0..l.stripes.len() {
                        outside
                            .entry((l.owner(i), i))
                            .or_default()
                            .insert(String::new());
                    }
                }
            }
        }
    }
    snaps
        .into_iter()
        .map(|(name, (entries, published))| {
            let mut usage = DiskUsage {
                dirs: u64::from(published),
                ..DiskUsage::default()
            };
            let mut counted = HashSet::new();
            for e in entries {
                if e.kind == EntryKind::Dir {
                    usage.dirs += 1;
                    continue;
                }
                usage.files += 1;
                usage.bytes += e.size;
                let Some(l) = e.layout.as_ref() else {
                    continue;
                };
                for i in 0..l.stripes.len() {
                    let key = (l.owner(i), i);
                    if outside[&key].len() == 1 && counted.insert(key) {
                        usage.unique_bytes += stored_bytes(l, e.size, i);
                    }
                }
            }
            SnapshotInfo {
                path: join(prefix, &name),
                name,
                partial: !published,
                usage,
            }
        })
        .collect()
}

/// The bytes the object of stripe `i` of `layout` (of a file of `size` bytes) takes
/// on the nodes, every replica.
fn stored_bytes(layout: &Layout, size: u64, i: usize) -> u64 {
    let r = layout.stripe_range(size, i);
    (r.end - r.start) * layout.stripes[i].replicas.len() as u64
}

/// The snapshot `path` names in `share`: `path` itself if its last component is a
/// snapshot name (and it is published), else the newest published snapshot directly
/// under `path` (a prefix).
pub async fn resolve_snapshot(
    cluster: &Cluster,
    share: &str,
    path: &str,
) -> Result<String, ClientError> {
    let path = path.trim_matches('/');
    let last = path.rsplit('/').next().unwrap_or("");
    let not_found = |message: String| {
        ClientError::Remote(RemoteError {
            kind: ErrorKind::NotFound,
            message,
        })
    };
    if is_snapshot_name(last) {
        return match cluster.meta().entry(share, path).await? {
            Some(v) if v.entry.kind == EntryKind::Dir => Ok(path.to_owned()),
            _ => Err(not_found(format!("{share}/{path}: no such snapshot"))),
        };
    }
    let below = cluster.meta().below(share, path).await?;
    let newest = top_dirs(&below, path).filter(|n| is_snapshot_name(n)).max();
    newest
        .map(|name| join(path, &name))
        .ok_or_else(|| not_found(format!("{share}/{path}: no snapshot to verify")))
}

/// One copy of one stripe to check: (path inside the snapshot, layout, stripe, node).
type Copy = (String, Layout, usize, String);

/// Has every node holding a copy of a stripe of a file of `snapshot` check it
/// ([`VERIFY_IN_FLIGHT`] at once). A file is verified when every copy of every stripe
/// is; a damaged copy is one [`Damaged`] of the outcome (with its [`Replica`]); a copy
/// that could not be checked (its node down, the object missing) is an error of the
/// outcome, not of the call.
pub async fn verify(cluster: &Cluster, share: &str, snapshot: &str) -> VerifyOutcome {
    let mut out = VerifyOutcome {
        snapshot: snapshot.to_owned(),
        ..VerifyOutcome::default()
    };
    let entries = match cluster.meta().below(share, snapshot).await {
        Ok(e) => e,
        Err(e) => {
            out.errors.push((String::new(), e));
            return out;
        }
    };
    let base = below_offset(snapshot);
    let mut copies: Vec<Copy> = Vec::new();
    let mut files = Vec::new();
    for (path, v) in entries
        .iter()
        .filter(|(_, v)| v.entry.kind == EntryKind::File)
    {
        let rel = path[base..].to_owned();
        out.files += 1;
        out.bytes += v.entry.size;
        if let Some(layout) = &v.entry.layout {
            for (i, stripe) in layout.stripes.iter().enumerate() {
                let copy = |n: &String| (rel.clone(), layout.clone(), i, n.clone());
                copies.extend(stripe.replicas.iter().map(copy));
            }
        }
        files.push(rel);
    }
    let checked = run_lanes(
        vec![(copies, VERIFY_IN_FLIGHT)],
        |(rel, layout, i, node)| {
            let (cluster, share) = (cluster.clone(), share.to_owned());
            async move {
                let r = check_copy(&cluster, &share, &layout, i, &node).await;
                Ok((rel, i, node, r))
            }
        },
    )
    .await;
    let mut bad: HashSet<String> = HashSet::new();
    let checked = checked.unwrap_or_else(|e| {
        out.errors.push((String::new(), e));
        Vec::new()
    });
    for (rel, i, node, r) in checked {
        match r {
            Ok(None) => {}
            Ok(Some(d)) => {
                bad.insert(rel.clone());
                out.damaged.push(Damaged { path: rel, ..d });
            }
            Err(e) => {
                bad.insert(rel.clone());
                out.errors
                    .push((format!("{rel} (stripe {i} on node {node})"), e));
            }
        }
    }
    out.verified = files.iter().filter(|f| !bad.contains(*f)).count() as u64;
    out.damaged
        .sort_by(|a, b| (&a.path, &a.replica).cmp(&(&b.path, &b.replica)));
    out.errors.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Has `node` check its copy of stripe `index` of `layout`: `None` if it is sound, the
/// damage (path left empty) if not. Under the progress deadline ([`Cluster::watched`]):
/// a node that answers nothing, not even probes, fails the check.
async fn check_copy(
    cluster: &Cluster,
    share: &str,
    layout: &Layout,
    index: usize,
    node: &str,
) -> Result<Option<Damaged>, ClientError> {
    let object = layout.object_path(share, index);
    let want = layout.manifest(index).ok_or_else(|| {
        ClientError::Cluster(format!("stripe {index}: bad manifest in the layout"))
    })?;
    let ask = |p: Progress| {
        let object = &object;
        async move {
            let c = cluster.session(node).await?;
            p.attach(&c);
            let report: VerifyReport = c.verify(STORE_SHARE, object).await?;
            let chunk_bytes = c.welcome().chunk_bytes;
            let (version, _) = c.manifest(STORE_SHARE, object, chunk_bytes).await?;
            Ok::<_, ClientError>((report, version))
        }
    };
    let (report, version) = cluster.watched(node, ask).await?;
    // A manifest in another algorithm than the layout's cannot be compared with it;
    // the node's own check of every chunk then stands alone.
    let other_bytes = version.algorithm == layout.algorithm && version.manifest != want;
    if report.bad_count == 0 && !other_bytes {
        return Ok(None);
    }
    Ok(Some(Damaged {
        path: String::new(),
        report,
        replica: Some(Replica {
            node: node.to_owned(),
            stripe: index,
            object,
            other_bytes,
        }),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Stripe;
    use ferry_common::msg::{HashAlgorithm, Timestamp};

    fn entry(kind: EntryKind, size: u64, layout: Option<&str>) -> Entry {
        Entry {
            kind,
            mode: 0o644,
            mtime: Timestamp { secs: 1, nanos: 0 },
            size,
            target: None,
            layout: layout.map(|id| Layout {
                id: id.repeat(16),
                algorithm: HashAlgorithm::Blake3,
                stripe_bytes: 1 << 20,
                stripes: vec![Stripe {
                    replicas: vec!["n1".into(), "n2".into()],
                    manifest: "00".repeat(32),
                    object: None,
                }],
            }),
        }
    }

    #[test]
    fn snapshots_count_their_entries_and_the_bytes_only_they_name() {
        let (a, b) = ("2026-01-01T00-00-00Z", "2026-01-02T00-00-00Z");
        let all: Vec<(String, Entry)> = [
            ("bk".to_owned(), entry(EntryKind::Dir, 0, None)),
            (format!("bk/{a}"), entry(EntryKind::Dir, 0, None)),
            (format!("bk/{a}/d"), entry(EntryKind::Dir, 0, None)),
            (
                format!("bk/{a}/d/kept"),
                entry(EntryKind::File, 10, Some("aa")),
            ),
            (
                format!("bk/{a}/only"),
                entry(EntryKind::File, 20, Some("bb")),
            ),
            (format!("bk/{a}/link"), entry(EntryKind::Symlink, 3, None)),
            // b is unpublished (no root entry) and names a's kept file.
            (
                format!("bk/{b}/d/kept"),
                entry(EntryKind::File, 10, Some("aa")),
            ),
            (
                "bk/not-a-snapshot".to_owned(),
                entry(EntryKind::Dir, 0, None),
            ),
            ("other/f".to_owned(), entry(EntryKind::File, 5, Some("cc"))),
        ]
        .into_iter()
        .collect();
        let infos = snapshot_infos(&all, "bk");
        assert_eq!(infos.len(), 2);
        let (sa, sb) = (&infos[0], &infos[1]);
        assert_eq!(
            (sa.name.as_str(), sa.path.as_str()),
            (a, &*format!("bk/{a}"))
        );
        assert!(!sa.partial && sb.partial);
        let u = sa.usage;
        assert_eq!((u.files, u.dirs, u.bytes), (3, 2, 33));
        assert_eq!(u.unique_bytes, 2 * 20, "the kept file is named by b too");
        assert_eq!((sb.usage.files, sb.usage.unique_bytes), (1, 0));
    }

    #[test]
    fn an_object_a_newer_version_reuses_is_not_unique_to_the_snapshot() {
        let a = "2026-01-01T00-00-00Z";
        let mib = 1u64 << 20;
        let two_stripes = |id: &str| {
            let mut e = entry(EntryKind::File, mib + 7, Some(id));
            let l = e.layout.as_mut().unwrap();
            l.stripes.push(l.stripes[0].clone());
            e
        };
        let old = two_stripes("aa");
        // The live file's newer version: stripe 0 is the old version's object.
        let mut new = two_stripes("bb");
        let reused = old.layout.as_ref().unwrap().reused_by(0, &"bb".repeat(16));
        new.layout.as_mut().unwrap().stripes[0] = reused.unwrap();
        let all: Vec<(String, Entry)> = vec![
            ("bk".to_owned(), entry(EntryKind::Dir, 0, None)),
            (format!("bk/{a}"), entry(EntryKind::Dir, 0, None)),
            (format!("bk/{a}/f"), old),
            ("f".to_owned(), new),
        ];
        let infos = snapshot_infos(&all, "bk");
        // Only stripe 1 (7 bytes, two replicas) is the snapshot's alone.
        assert_eq!(infos[0].usage.unique_bytes, 2 * 7);
    }
}
