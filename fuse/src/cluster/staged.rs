//! One descriptor open for writing through a cluster mount: its staging file, filled
//! stripe by stripe as its writes need them.
//!
//! ```text
//!  open (no O_TRUNC) ──> a staging file of the file's size, every byte a hole; every
//!        stripe unfetched: its bytes are the base's (the version opened)
//!  write ──> each unfetched stripe it touches and does not cover whole is fetched
//!        first (verified against the base's manifest), then the bytes are written
//!  read ──> local stripes from the staging file, unfetched ones from the base's
//!        objects (the mount's verified read path: nothing is fetched)
//!  truncate / ftruncate ──> the stripe the new end cuts (or the old partial last
//!        stripe a growth extends) is fetched first; stripes past the new end are
//!        dropped unread; stripes a growth adds are local (zeros)
//!  close / fsync ──> Cluster::put_staged: unfetched stripes name their objects (only
//!        where the entry there now names the same ones), local ones are hashed and
//!        only the changed ones sent
//! ```
//!
//! Invariant ([`Presence`]): every unfetched stripe has, in the file's current size,
//! the byte range it has in the base, so its bytes are exactly the base's stripe of the
//! same index; any change that would alter that range (a write that does not cover the
//! stripe whole, a size change that moves its end) fetches it first. A stripe that is
//! local holds its true bytes in the staging file. Changes that may fetch, and
//! publications, run one at a time per descriptor (`changing`), so a fetch never
//! overwrites a write.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use ferry_cluster::model::{stripe_count, stripe_range, Entry, EntryKind, Layout};
use ferry_cluster::Cluster;
use fuser::{Errno, TimeOrNow};

use super::stripes::{pieces, ClusterFile, Nodes};
use crate::bufs::BufPool;
use crate::remote::{lock, OpError};

/// Which stripes of a staged file are local (their true bytes in the staging file) and
/// which are unfetched (their bytes the base's stripe of the same index, over the same
/// range). Pure: the plans say what to fetch, the caller fetches, then records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presence {
    stripe_bytes: u64,
    /// The staged file's size.
    size: u64,
    /// Per stripe of a file of `size` bytes: its bytes are in the staging file.
    local: Vec<bool>,
}

impl Presence {
    /// A file of `size` bytes, every stripe local (a new or truncated file).
    pub fn local(size: u64, stripe_bytes: u64) -> Presence {
        Presence {
            stripe_bytes: stripe_bytes.max(1),
            size,
            local: vec![true; stripe_count(size, stripe_bytes.max(1))],
        }
    }

    /// The base itself, `size` bytes in stripes of `stripe_bytes`: nothing local.
    pub fn unfetched(size: u64, stripe_bytes: u64) -> Presence {
        Presence {
            stripe_bytes: stripe_bytes.max(1),
            size,
            local: vec![false; stripe_count(size, stripe_bytes.max(1))],
        }
    }

    /// The stripe size the stripes are counted in.
    pub fn stripe_bytes(&self) -> u64 {
        self.stripe_bytes
    }

    /// True if stripe `index` is local (or past the end).
    pub fn is_local(&self, index: usize) -> bool {
        self.local.get(index).copied().unwrap_or(true)
    }

    /// Per stripe: true where it is unfetched.
    pub fn unfetched_stripes(&self) -> Vec<bool> {
        self.local.iter().map(|l| !l).collect()
    }

    /// The unfetched stripes to fetch before `len` bytes are written at `offset`: those
    /// it touches without covering them whole (in the size after the write), and the
    /// partial last stripe if the write makes the file longer (its range grows).
    pub fn fetch_for_write(&self, offset: u64, len: u64) -> Vec<usize> {
        if len == 0 {
            return Vec::new();
        }
        let end = offset.saturating_add(len);
        let new_size = self.size.max(end);
        let covers = |i: usize| {
            let r = stripe_range(new_size, self.stripe_bytes, i);
            offset <= r.start && end >= r.end
        };
        let first = offset / self.stripe_bytes;
        let last = (end - 1) / self.stripe_bytes;
        let mut out: Vec<usize> = (first..=last)
            .filter_map(|i| usize::try_from(i).ok())
            .take_while(|&i| i < self.local.len())
            .filter(|&i| !self.local[i] && !covers(i))
            .collect();
        if new_size > self.size {
            out.extend(self.moved_end(new_size).filter(|i| !covers(*i)));
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Records `len` bytes written at `offset` (every stripe
    /// [`Presence::fetch_for_write`] named fetched first).
    pub fn wrote(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = offset.saturating_add(len);
        let first = offset / self.stripe_bytes;
        let last = (end - 1) / self.stripe_bytes;
        if end > self.size {
            self.resized(end);
        }
        for i in first..=last {
            if let Some(l) = usize::try_from(i).ok().and_then(|i| self.local.get_mut(i)) {
                *l = true;
            }
        }
    }

    /// The unfetched stripe to fetch before the size becomes `new_size`: the one whose
    /// range that changes (cut by a new end inside it, or the partial last stripe
    /// extended). Stripes wholly past a smaller size are dropped unread.
    pub fn fetch_for_resize(&self, new_size: u64) -> Vec<usize> {
        self.moved_end(new_size).collect()
    }

    /// Records the size changed to `new_size` (the stripe
    /// [`Presence::fetch_for_resize`] named fetched first): stripes past it are gone,
    /// stripes it adds are local (zeros).
    pub fn resized(&mut self, new_size: u64) {
        let keep = stripe_count(new_size, self.stripe_bytes).min(self.local.len());
        for i in 0..keep {
            if self.range_moves(i, new_size) {
                self.local[i] = true;
            }
        }
        self.local
            .resize(stripe_count(new_size, self.stripe_bytes), true);
        self.size = new_size;
    }

    /// Records stripe `index` fetched.
    pub fn fetched(&mut self, index: usize) {
        if let Some(l) = self.local.get_mut(index) {
            *l = true;
        }
    }

    /// The unfetched stripe whose range a size of `new_size` changes, if any.
    fn moved_end(&self, new_size: u64) -> impl Iterator<Item = usize> + '_ {
        let both = stripe_count(new_size, self.stripe_bytes).min(self.local.len());
        (0..both).filter(move |&i| !self.local[i] && self.range_moves(i, new_size))
    }

    fn range_moves(&self, index: usize, new_size: u64) -> bool {
        stripe_range(self.size, self.stripe_bytes, index)
            != stripe_range(new_size, self.stripe_bytes, index)
    }
}

/// The version a staged file was opened at: where its unfetched stripes are.
pub struct Base {
    /// Its entry (layout and size).
    pub entry: Arc<Entry>,
    /// Open for reading the unfetched stripes.
    file: ClusterFile,
}

impl Base {
    /// The base `entry` (a file with a layout) at share path `sp` of `share`.
    pub fn new(share: &str, sp: &str, entry: Arc<Entry>) -> Result<Base, OpError> {
        let file = ClusterFile::new(share, sp, entry.clone())?;
        Ok(Base { entry, file })
    }

    /// Its layout.
    pub fn layout(&self) -> Option<&Layout> {
        self.entry.layout.as_ref()
    }
}

/// Where a staged file's unfetched stripes are fetched from.
#[derive(Clone, Copy)]
pub struct Source<'a> {
    /// The mount's cluster client.
    pub cluster: &'a Cluster,
    /// The share.
    pub share: &'a str,
}

/// One handle open for writing: its staging file.
pub struct Staged {
    /// Mount-relative path: where it is published. A rename of the file through this
    /// mount moves it ([`Staged::move_to`]), so it is never published under a name
    /// it no longer has.
    path: Mutex<String>,
    /// The staging file.
    pub local: PathBuf,
    file: Arc<File>,
    /// Changed since it was last published.
    dirty: AtomicBool,
    /// The process that opened it: its close publishes; another process's (a child
    /// closing the inherited descriptor at exec) does not.
    opener: Option<u32>,
    /// The version opened (`None`: a new or truncated file, every stripe local).
    base: Option<Base>,
    /// Which stripes are local; changed only under `changing`.
    presence: Mutex<Presence>,
    /// Held by every change of the staging file and by a publication: one at a time.
    changing: tokio::sync::Mutex<()>,
}

impl Staged {
    /// A staged file at mount path `path`, in `local` (open read-write as `file`),
    /// opened at `base` (with the matching `presence`).
    pub fn new(
        path: String,
        (local, file): (PathBuf, File),
        base: Option<Base>,
        presence: Presence,
        dirty: bool,
        opener: Option<u32>,
    ) -> Staged {
        Staged {
            path: Mutex::new(path),
            local,
            file: Arc::new(file),
            dirty: AtomicBool::new(dirty),
            opener,
            base,
            presence: Mutex::new(presence),
            changing: tokio::sync::Mutex::new(()),
        }
    }

    /// Mount-relative path it publishes to.
    pub fn path(&self) -> String {
        lock(&self.path).clone()
    }

    /// The file was renamed to mount path `to`.
    pub fn move_to(&self, to: &str) {
        *lock(&self.path) = to.to_owned();
    }

    /// The version opened, if any.
    pub fn base(&self) -> Option<&Base> {
        self.base.as_ref()
    }

    /// The entry this handle would publish now (no layout yet).
    pub fn entry(&self) -> Result<Entry, OpError> {
        let md = self.file.metadata().map_err(|e| self.err(e))?;
        Ok(Entry {
            kind: EntryKind::File,
            mode: md.mode() & 0o7777,
            mtime: ferry_common::attr::attr_of(&md, None).mtime,
            size: md.len(),
            target: None,
            layout: None,
        })
    }

    /// Writes `data` at `offset` now, if that fetches nothing and no other change or
    /// publication is under way: `Ok(true)`. `Ok(false)`: use [`Staged::write`].
    pub fn try_write(&self, offset: u64, data: &[u8]) -> Result<bool, OpError> {
        let Ok(_one) = self.changing.try_lock() else {
            return Ok(false);
        };
        let mut presence = lock(&self.presence);
        if !presence
            .fetch_for_write(offset, data.len() as u64)
            .is_empty()
        {
            return Ok(false);
        }
        self.write_local(&mut presence, offset, data)?;
        Ok(true)
    }

    /// Writes `data` at `offset`, fetching first each unfetched stripe it needs.
    pub async fn write(&self, src: Source<'_>, offset: u64, data: &[u8]) -> Result<(), OpError> {
        let _one = self.changing.lock().await;
        let need = lock(&self.presence).fetch_for_write(offset, data.len() as u64);
        self.fetch(src, &need).await?;
        self.write_local(&mut lock(&self.presence), offset, data)
    }

    fn write_local(
        &self,
        presence: &mut Presence,
        offset: u64,
        data: &[u8],
    ) -> Result<(), OpError> {
        self.dirty.store(true, Ordering::SeqCst);
        self.file
            .write_all_at(data, offset)
            .map_err(|e| self.err(e))?;
        presence.wrote(offset, data.len() as u64);
        Ok(())
    }

    /// Reads up to `len` bytes at `offset` now, if every stripe it touches is local;
    /// `None`: use [`Staged::read`].
    pub fn try_read(&self, offset: u64, len: u32) -> Option<Result<Vec<u8>, OpError>> {
        let presence = lock(&self.presence);
        let wanted = pieces(presence.size, presence.stripe_bytes(), offset, len);
        if !wanted.iter().all(|p| presence.is_local(p.index)) {
            return None;
        }
        Some(self.read_local(offset, len))
    }

    /// Reads up to `len` bytes at `offset`: local stripes from the staging file,
    /// unfetched ones from the base's objects (verified, fetching nothing).
    pub async fn read(
        &self,
        (nodes, bufs): (&Nodes, &BufPool),
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, OpError> {
        let (wanted, sb, unfetched) = {
            let p = lock(&self.presence);
            let wanted = pieces(p.size, p.stripe_bytes(), offset, len);
            let unfetched: Vec<bool> = wanted.iter().map(|w| !p.is_local(w.index)).collect();
            (wanted, p.stripe_bytes(), unfetched)
        };
        let mut out = Vec::with_capacity(wanted.iter().map(|p| p.len as usize).sum());
        for (piece, unfetched) in wanted.into_iter().zip(unfetched) {
            let at = piece.index as u64 * sb + piece.offset;
            match (&self.base, unfetched) {
                (Some(base), true) => {
                    let got = base.file.read(nodes, bufs, at, piece.len).await?;
                    out.extend_from_slice(&got.data);
                    match got.home {
                        Some(reader) => reader.recycle(got.data),
                        None => bufs.give(got.data),
                    }
                }
                _ => out.extend_from_slice(&self.read_local(at, piece.len)?),
            }
        }
        Ok(out)
    }

    fn read_local(&self, offset: u64, len: u32) -> Result<Vec<u8>, OpError> {
        let mut buf = vec![0; len as usize];
        let mut got = 0;
        while got < buf.len() {
            match self.file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.err(e)),
            }
        }
        buf.truncate(got);
        Ok(buf)
    }

    /// True if a close by process `tgid` publishes this handle: the opener's (or
    /// anyone's when the opener is unknown).
    pub fn closed_by_opener(&self, tgid: Option<u32>) -> bool {
        self.opener.is_none() || self.opener == tgid
    }

    /// Changed since it was last published.
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::SeqCst)
    }

    /// Changes size, mode and mtime of the staging file (published at close if
    /// `publish`; else the change was made elsewhere and is only kept in step here). A
    /// size change fetches first the stripe whose range it changes.
    pub async fn set(
        &self,
        src: Source<'_>,
        (mode, size, mtime): (Option<u32>, Option<u64>, Option<TimeOrNow>),
        publish: bool,
    ) -> Result<(), OpError> {
        let _one = self.changing.lock().await;
        if publish {
            self.dirty.store(true, Ordering::SeqCst);
        }
        if let Some(size) = size {
            let need = lock(&self.presence).fetch_for_resize(size);
            self.fetch(src, &need).await?;
            self.file.set_len(size).map_err(|e| self.err(e))?;
            lock(&self.presence).resized(size);
        }
        if let Some(mode) = mode {
            self.file
                .set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))
                .map_err(|e| self.err(e))?;
        }
        if let Some(t) = mtime {
            self.file
                .set_modified(system_time(t))
                .map_err(|e| self.err(e))?;
        } else if size.is_some() {
            self.file
                .set_modified(SystemTime::now())
                .map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    /// Fetches the stripe a size of `size` would change the range of (see
    /// [`Staged::set`]), without changing anything else.
    pub async fn prefetch_resize(&self, src: Source<'_>, size: u64) -> Result<(), OpError> {
        let _one = self.changing.lock().await;
        let need = lock(&self.presence).fetch_for_resize(size);
        self.fetch(src, &need).await
    }

    /// Waits until no change or publication of the file is under way, and holds them
    /// off while the guard lives (a publication holds it).
    pub async fn hold(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changing.lock().await
    }

    /// Whether it changed since it was last published, and marks it published.
    pub fn take_dirty(&self) -> bool {
        self.dirty.swap(false, Ordering::SeqCst)
    }

    /// Marks it changed (a publication failed).
    pub fn set_dirty(&self) {
        self.dirty.store(true, Ordering::SeqCst);
    }

    /// Per stripe: true where it is unfetched now.
    pub fn unfetched(&self) -> Vec<bool> {
        lock(&self.presence).unfetched_stripes()
    }

    /// Records as fetched each stripe that `left` (what [`Staged::unfetched`] said,
    /// cleared where a publication fetched) says is no longer unfetched.
    pub fn fetched_at_publication(&self, left: &[bool]) {
        let mut presence = lock(&self.presence);
        for (i, _) in left.iter().enumerate().filter(|(_, u)| !**u) {
            presence.fetched(i);
        }
    }

    /// Fetches the unfetched stripes `need` of the base into the staging file.
    async fn fetch(&self, src: Source<'_>, need: &[usize]) -> Result<(), OpError> {
        if need.is_empty() {
            return Ok(());
        }
        let Some(base) = &self.base else {
            return Err(OpError::new(
                Errno::EIO,
                format!("{}: stripes {need:?} unfetched without a base", self.path()),
            ));
        };
        let layout = base.layout().ok_or_else(|| {
            OpError::new(
                Errno::EIO,
                format!("{}: a base without a layout", self.path()),
            )
        })?;
        let label = format!("{}/{}", src.share, self.path());
        src.cluster
            .refresh_nodes()
            .await
            .map_err(|e| OpError::new(Errno::EIO, format!("storage nodes: {e}")))?;
        for &i in need {
            let bytes = src
                .cluster
                .fetch_stripe(src.share, (layout, base.entry.size), i, &self.local)
                .await
                .map_err(|e| OpError::new(Errno::EIO, format!("{label}: stripe {i}: {e}")))?;
            lock(&self.presence).fetched(i);
            tracing::debug!(file = %label, stripe = i, bytes, "fetched a stripe to write into");
        }
        Ok(())
    }

    /// Gives back what reading the base holds open. Needs a tokio runtime context.
    pub fn release(&self) {
        if let Some(b) = &self.base {
            b.file.release();
        }
    }

    fn err(&self, e: std::io::Error) -> OpError {
        OpError::new(
            Errno::EIO,
            format!("staging file {}: {e}", self.local.display()),
        )
    }
}

fn system_time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A base of 6 stripes of 1 MiB and 11 bytes: 7 stripes, the last partial.
    fn base() -> Presence {
        Presence::unfetched(6 * MIB + 11, MIB)
    }

    #[test]
    fn a_write_fetches_only_the_stripes_it_touches_and_does_not_cover() {
        let mut p = base();
        // One byte in the middle of stripe 3.
        assert_eq!(p.fetch_for_write(3 * MIB + 5, 1), vec![3]);
        p.fetched(3);
        p.wrote(3 * MIB + 5, 1);
        assert_eq!(p.fetch_for_write(3 * MIB + 7, 100), Vec::<usize>::new());
        // Across the boundary of stripes 1 and 2: both.
        assert_eq!(p.fetch_for_write(2 * MIB - 10, 20), vec![1, 2]);
        // Stripe 4 whole: nothing to fetch, and it is local after.
        assert_eq!(p.fetch_for_write(4 * MIB, MIB), Vec::<usize>::new());
        p.wrote(4 * MIB, MIB);
        assert!(p.is_local(4));
        // Stripe 5 whole and the start of stripe 6: only 6.
        assert_eq!(p.fetch_for_write(5 * MIB, MIB + 3), vec![6]);
        // The partial last stripe covered whole (its 11 bytes): nothing.
        assert_eq!(p.fetch_for_write(6 * MIB, 11), Vec::<usize>::new());
        assert_eq!(
            p.unfetched_stripes(),
            vec![true, true, true, false, false, true, true]
        );
    }

    #[test]
    fn a_write_past_the_end_fetches_the_partial_last_stripe_it_extends() {
        let p = base();
        // Appending: the last stripe's range grows; its 11 bytes are needed.
        assert_eq!(p.fetch_for_write(6 * MIB + 11, 5), vec![6]);
        // Far past the end: the same, and the stripes between are new (local zeros).
        assert_eq!(p.fetch_for_write(9 * MIB, 5), vec![6]);
        let mut q = p.clone();
        q.fetched(6);
        q.wrote(9 * MIB, 5);
        assert_eq!(q.unfetched_stripes().len(), 10);
        assert!((6..10).all(|i| q.is_local(i)));
        assert!((0..6).all(|i| !q.is_local(i)));
        // Covering the old last stripe and more: nothing to fetch.
        assert_eq!(p.fetch_for_write(6 * MIB, MIB + 1), Vec::<usize>::new());
        // A file whose size is a whole number of stripes: appending fetches nothing.
        let whole = Presence::unfetched(4 * MIB, MIB);
        assert_eq!(whole.fetch_for_write(4 * MIB, 10), Vec::<usize>::new());
        assert_eq!(whole.fetch_for_write(4 * MIB - 1, 10), vec![3]);
    }

    #[test]
    fn a_resize_fetches_only_the_stripe_whose_range_moves() {
        let mut p = base();
        // To the middle of stripe 2: stripe 2 is cut (fetched); 3..7 dropped unread.
        assert_eq!(p.fetch_for_resize(2 * MIB + 100), vec![2]);
        p.fetched(2);
        p.resized(2 * MIB + 100);
        assert_eq!(p.unfetched_stripes(), vec![true, true, false]);
        // Then appended to: stripe 2 is local, nothing more to fetch.
        assert_eq!(p.fetch_for_write(2 * MIB + 100, 50), Vec::<usize>::new());
        // Grown past the stripes dropped: they come back local (zeros), not the base's.
        p.resized(5 * MIB);
        assert_eq!(p.unfetched_stripes(), vec![true, true, false, false, false]);
        // To a stripe boundary: nothing cut, nothing fetched.
        let q = base();
        assert_eq!(q.fetch_for_resize(3 * MIB), Vec::<usize>::new());
        assert_eq!(q.fetch_for_resize(0), Vec::<usize>::new());
        // Growing: the partial last stripe's range grows.
        assert_eq!(q.fetch_for_resize(8 * MIB), vec![6]);
        assert_eq!(q.fetch_for_resize(6 * MIB + 11), Vec::<usize>::new());
    }

    #[test]
    fn a_new_file_is_all_local() {
        let mut p = Presence::local(0, MIB);
        assert_eq!(p.fetch_for_write(5 * MIB, 10), Vec::<usize>::new());
        p.wrote(5 * MIB, 10);
        assert!(p.unfetched_stripes().iter().all(|u| !u));
        assert_eq!(p.fetch_for_resize(MIB / 2), Vec::<usize>::new());
    }
}
