//! The server's per-connection request state: which transfers and mapped files a
//! connection has open, their limits, and whether each request may run now.
//!
//! [`ConnState::admit`] decides every request before the driver touches a file or a
//! region: an open gets the id it will be known by (its slot is reserved, so a refused
//! open costs no I/O), a request naming a transfer or a mapped file is checked against
//! the table (it exists, is open, and is of the right kind), and a batch is checked as
//! a whole. [`ConnState::handle_response`] then settles the request from the answer the
//! driver gives: a successful open becomes an open entry, a failed one gives its slot
//! back, a committed upload leaves the table.
//!
//! Invariant: the ids in the table are exactly those the driver holds I/O state for,
//! once each request is answered; an id is never reused on a connection. `Close` and
//! `MapRelease` take their entry out of the table when admitted, so no request admitted
//! after them can name it.

use std::collections::HashMap;

use super::batch::{batch_capacity, batch_file_max, check_upload_batch};
use crate::msg::{
    ErrorKind, Extent, Hash256, RegionDesc, RemoteError, Request, Response, MAX_FILE_IO_BYTES,
    MAX_OPEN_FILES, MAX_WINDOW_CHUNKS, MAX_WRITE_EXTENTS,
};

/// Most transfers one connection may have open (or opening) at once.
pub const MAX_OPEN_TRANSFERS: usize = 1024;

/// Most mapped files one connection may have open (or opening) at once.
pub const MAX_OPEN_MAPS: usize = 1024;

/// The kind of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// The client sends a file; the server pulls it.
    Upload,
    /// The server sends a file; it pushes it into the client's memory.
    Download,
}

impl TransferKind {
    fn article(self) -> &'static str {
        match self {
            TransferKind::Upload => "an upload",
            TransferKind::Download => "a download",
        }
    }
}

/// The family of a request: which module of a server's connection driver performs it.
/// Adding a request means adding it here (the match has no catch-all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// The session itself (authentication): answered by the session, never a driver.
    Session,
    /// Windowed uploads and downloads: open, window, commit, close.
    Transfer,
    /// Batches of small files.
    Batch,
    /// Mapped files and manifests, for one-sided reads of server memory.
    Map,
    /// Files open for writing through handles (a writable mount).
    File,
    /// The share's namespace: attributes (owners included), listings, directories,
    /// links, renames.
    Namespace,
    /// The server's counters and on-disk verification.
    Admin,
    /// File locks held by the server for every session ([`crate::locks`]).
    Lock,
}

impl Family {
    /// The family of `req`.
    pub fn of(req: &Request) -> Family {
        match req {
            Request::Auth { .. } => Family::Session,
            Request::UploadOpen { .. }
            | Request::UploadOpenBase { .. }
            | Request::UploadWindow { .. }
            | Request::UploadCommit { .. }
            | Request::DownloadOpen { .. }
            | Request::DownloadWindow { .. }
            | Request::Close { .. } => Family::Transfer,
            Request::UploadBatch { .. } | Request::DownloadBatch { .. } => Family::Batch,
            Request::MapOpen { .. } | Request::MapRelease { .. } | Request::Manifest { .. } => {
                Family::Map
            }
            Request::Stat { .. }
            | Request::ListDir { .. }
            | Request::Mkdir { .. }
            | Request::Symlink { .. }
            | Request::SetAttr { .. }
            | Request::Link { .. }
            | Request::LinkBatch { .. }
            | Request::Rename { .. }
            | Request::Remove { .. }
            | Request::StatFs { .. }
            | Request::DiskUsage { .. }
            | Request::SetMeta { .. }
            | Request::ListDirMeta { .. }
            | Request::ShareInfo { .. }
            | Request::Move { .. }
            | Request::SetAttrs { .. }
            | Request::ShareAccess { .. }
            | Request::StatMeta { .. }
            | Request::MakeDirs { .. }
            | Request::SetAttrBatch { .. }
            | Request::XattrGet { .. }
            | Request::XattrList { .. }
            | Request::XattrSet { .. }
            | Request::XattrRemove { .. }
            | Request::MakeNode { .. }
            | Request::SetTimes { .. } => Family::Namespace,
            Request::AsCaller { request, .. } => Family::of(request),
            Request::FileOpen { .. }
            | Request::FileWrite { .. }
            | Request::FileRead { .. }
            | Request::FileSetAttr { .. }
            | Request::FileAllocate { .. }
            | Request::FileFallocate { .. }
            | Request::FileSync { .. }
            | Request::FileClose { .. }
            | Request::FileDiscard { .. }
            | Request::FileCommit { .. }
            | Request::FileFinish { .. }
            | Request::FilePut { .. } => Family::File,
            Request::Stats
            | Request::Verify { .. }
            | Request::Counters
            | Request::Replicate { .. } => Family::Admin,
            Request::Lock { .. } | Request::LockTest { .. } | Request::LockRelease { .. } => {
                Family::Lock
            }
        }
    }
}

/// What an admitted request may act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Nothing of the connection's tables.
    None,
    /// The transfer with this id: a new one for an open, else an open one of the kind
    /// the request needs (for `Close`, already out of the table).
    Transfer(u64),
    /// The mapped file with this handle: a new one for `MapOpen`, else the one being
    /// released.
    Map(u64),
    /// The file handle with this id: a new one for `FileOpen`, else an open one (for
    /// `FileClose`, already out of the table).
    File(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Opening(TransferKind),
    Open(TransferKind),
}

/// How an admitted request changes the tables once it is answered.
#[derive(Debug, Clone, Copy)]
enum Pending {
    OpenTransfer(u64),
    Commit(u64),
    OpenMap(u64),
    OpenFile(u64),
}

/// A connection's tables; see the module docs.
#[derive(Debug)]
pub struct ConnState {
    chunk_bytes: u32,
    /// The session negotiated batches of medium files ([`super::caps::BATCH`]).
    medium_batches: bool,
    transfers: HashMap<u64, Slot>,
    next_transfer: u64,
    /// Mapped files.
    maps: Handles,
    /// File handles.
    files: Handles,
    pending: HashMap<u64, Pending>,
}

fn protocol(message: String) -> RemoteError {
    RemoteError::new(ErrorKind::Protocol, message)
}

/// A table of handles (mapped files, file handles): `false` while opening, `true`
/// once open. An id is never reused.
#[derive(Debug)]
struct Handles {
    open: HashMap<u64, bool>,
    next: u64,
    /// Most handles open or opening at once.
    most: usize,
    /// What a refusal at `most` says after "more than `most`".
    busy: &'static str,
}

impl Handles {
    fn new(most: usize, busy: &'static str) -> Handles {
        Handles {
            open: HashMap::new(),
            next: 1,
            most,
            busy,
        }
    }

    /// Reserves the next handle (opening), unless `most` are open or opening already:
    /// that is refused as busy.
    fn reserve(&mut self) -> Result<u64, RemoteError> {
        if self.open.len() >= self.most {
            return Err(RemoteError::new(
                ErrorKind::Busy,
                format!("more than {} {}", self.most, self.busy),
            ));
        }
        let handle = self.next;
        self.next += 1;
        self.open.insert(handle, false);
        Ok(handle)
    }

    /// Whether `handle` is open (not just opening).
    fn is_open(&self, handle: u64) -> bool {
        self.open.get(&handle) == Some(&true)
    }

    /// Settles the open of `handle`: open if it succeeded (`ok`), else gone.
    fn settle(&mut self, handle: u64, ok: bool) {
        if ok {
            self.open.insert(handle, true);
        } else {
            self.open.remove(&handle);
        }
    }

    fn remove(&mut self, handle: u64) {
        self.open.remove(&handle);
    }

    fn len(&self) -> usize {
        self.open.len()
    }
}

impl ConnState {
    /// Takes the session's agreement on batches into account (at the handshake).
    pub fn set_medium_batches(&mut self, on: bool) {
        self.medium_batches = on;
    }

    /// The largest file a batch of this connection may carry ([`batch_file_max`]).
    pub fn batch_file_max(&self) -> u64 {
        batch_file_max(self.medium_batches, self.chunk_bytes)
    }

    /// Empty tables of a connection to a server whose chunk buffers hold `chunk_bytes`.
    pub fn new(chunk_bytes: u32) -> ConnState {
        ConnState {
            chunk_bytes,
            medium_batches: false,
            transfers: HashMap::new(),
            next_transfer: 1,
            maps: Handles::new(
                MAX_OPEN_MAPS,
                "mapped files open on one connection: release some first",
            ),
            files: Handles::new(
                MAX_OPEN_FILES,
                "files open for writing on one connection: close some first",
            ),
            pending: HashMap::new(),
        }
    }

    /// Decides whether request `id` may run now, and on what. A refusal is the answer
    /// to send; the request then changes nothing.
    pub fn admit(&mut self, id: u64, body: &Request) -> Result<Grant, RemoteError> {
        match body {
            // The codec bounds the caller's groups.
            Request::AsCaller { request, .. } => self.admit(id, request),
            Request::UploadBatch { region, files, .. } => {
                check_upload_batch(
                    files,
                    region,
                    batch_capacity(self.chunk_bytes),
                    self.batch_file_max(),
                )?;
                Ok(Grant::None)
            }
            _ => match Family::of(body) {
                Family::Transfer => self.admit_transfer(id, body),
                Family::Map => self.admit_map(id, body),
                Family::File => self.admit_file(id, body),
                _ => Ok(Grant::None),
            },
        }
    }

    /// [`Self::admit`] for a transfer request: an open reserves a new transfer, the
    /// others name an open one of the right kind (`Close` takes it out of the table).
    fn admit_transfer(&mut self, id: u64, body: &Request) -> Result<Grant, RemoteError> {
        match body {
            Request::UploadOpen { .. } | Request::UploadOpenBase { .. } => {
                self.open_transfer(id, TransferKind::Upload)
            }
            Request::DownloadOpen { .. } => self.open_transfer(id, TransferKind::Download),
            Request::UploadWindow { transfer, .. } => self.open_of(*transfer, TransferKind::Upload),
            Request::UploadCommit { transfer, .. } => {
                let grant = self.open_of(*transfer, TransferKind::Upload)?;
                self.pending.insert(id, Pending::Commit(*transfer));
                Ok(grant)
            }
            Request::DownloadWindow { transfer, .. } => {
                self.open_of(*transfer, TransferKind::Download)
            }
            Request::Close { transfer } => match self.transfers.get(transfer) {
                Some(Slot::Open(_)) => {
                    self.transfers.remove(transfer);
                    Ok(Grant::Transfer(*transfer))
                }
                _ => Err(no_transfer(*transfer)),
            },
            _ => Ok(Grant::None),
        }
    }

    /// [`Self::admit`] for a mapped-file request: `MapOpen` reserves a new handle,
    /// `MapRelease` takes an open one out of the table.
    fn admit_map(&mut self, id: u64, body: &Request) -> Result<Grant, RemoteError> {
        match body {
            Request::MapOpen { .. } => {
                let handle = self.maps.reserve()?;
                self.pending.insert(id, Pending::OpenMap(handle));
                Ok(Grant::Map(handle))
            }
            Request::MapRelease { handle } if self.maps.is_open(*handle) => {
                self.maps.remove(*handle);
                Ok(Grant::Map(*handle))
            }
            Request::MapRelease { handle } => Err(protocol(format!("no mapped file {handle}"))),
            _ => Ok(Grant::None),
        }
    }

    /// [`Self::admit`] for a file-handle request: `FileOpen` reserves a new handle,
    /// the others name an open one (`FileClose` and `FileDiscard` take it out of the
    /// table), and a write or read is checked against this connection's limits.
    fn admit_file(&mut self, id: u64, body: &Request) -> Result<Grant, RemoteError> {
        match body {
            Request::FileOpen { .. } => {
                let handle = self.files.reserve()?;
                self.pending.insert(id, Pending::OpenFile(handle));
                Ok(Grant::File(handle))
            }
            Request::FilePut {
                region,
                extents,
                hashes,
                ..
            } => {
                // No handle: the file is opened, written and closed within the request.
                check_finish_write(region, extents, hashes, self.chunk_bytes)?;
                Ok(Grant::None)
            }
            Request::FileWrite {
                handle,
                region,
                extents,
                hashes,
                ..
            } => {
                let grant = self.open_file(*handle)?;
                check_file_write(region, extents, hashes, self.chunk_bytes)?;
                Ok(grant)
            }
            Request::FileFinish {
                handle,
                region,
                extents,
                hashes,
                ..
            } => {
                let grant = self.open_file(*handle)?;
                check_finish_write(region, extents, hashes, self.chunk_bytes)?;
                Ok(grant)
            }
            Request::FileRead { handle, region, .. } => {
                let grant = self.open_file(*handle)?;
                let most = file_io_max(self.chunk_bytes);
                if region.len == 0 || region.len > most {
                    return Err(protocol(format!(
                        "a file read of {} bytes: it must move 1 to {most}",
                        region.len
                    )));
                }
                Ok(grant)
            }
            Request::FileSetAttr { handle, .. }
            | Request::FileAllocate { handle, .. }
            | Request::FileFallocate { handle, .. }
            | Request::FileSync { handle, .. }
            | Request::FileCommit { handle } => self.open_file(*handle),
            Request::FileClose { handle } | Request::FileDiscard { handle } => {
                let grant = self.open_file(*handle)?;
                self.files.remove(*handle);
                Ok(grant)
            }
            _ => Ok(Grant::None),
        }
    }

    fn open_file(&self, handle: u64) -> Result<Grant, RemoteError> {
        if self.files.is_open(handle) {
            Ok(Grant::File(handle))
        } else {
            Err(protocol(format!("no open file handle {handle}")))
        }
    }

    fn open_transfer(&mut self, id: u64, kind: TransferKind) -> Result<Grant, RemoteError> {
        if self.transfers.len() >= MAX_OPEN_TRANSFERS {
            return Err(protocol(format!(
                "more than {MAX_OPEN_TRANSFERS} transfers open on one connection"
            )));
        }
        let transfer = self.next_transfer;
        self.next_transfer += 1;
        self.transfers.insert(transfer, Slot::Opening(kind));
        self.pending.insert(id, Pending::OpenTransfer(transfer));
        Ok(Grant::Transfer(transfer))
    }

    fn open_of(&self, transfer: u64, kind: TransferKind) -> Result<Grant, RemoteError> {
        match self.transfers.get(&transfer) {
            Some(Slot::Open(k)) if *k == kind => Ok(Grant::Transfer(transfer)),
            Some(Slot::Open(_)) => Err(protocol(format!(
                "transfer {transfer} is not {}",
                kind.article()
            ))),
            _ => Err(no_transfer(transfer)),
        }
    }

    /// Settles request `id` from its answer `body`: a successful open becomes an open
    /// entry, a failed one frees its slot, a successful commit closes its upload.
    pub fn handle_response(&mut self, id: u64, body: &Response) {
        let ok = !matches!(body, Response::Error(_));
        match self.pending.remove(&id) {
            Some(Pending::OpenTransfer(t)) => {
                if let (true, Some(Slot::Opening(kind))) = (ok, self.transfers.get(&t)) {
                    let kind = *kind;
                    self.transfers.insert(t, Slot::Open(kind));
                } else {
                    self.transfers.remove(&t);
                }
            }
            Some(Pending::Commit(t)) if ok => {
                self.transfers.remove(&t);
            }
            Some(Pending::OpenMap(handle)) => self.maps.settle(handle, ok),
            Some(Pending::OpenFile(handle)) => self.files.settle(handle, ok),
            Some(Pending::Commit(_)) | None => {}
        }
    }

    /// Forgets every request not yet answered (the session closed): the tables keep
    /// only what is open.
    pub fn handle_closed(&mut self) {
        for (_, p) in self.pending.drain() {
            match p {
                Pending::OpenTransfer(t) => {
                    self.transfers.remove(&t);
                }
                Pending::OpenMap(h) => self.maps.remove(h),
                Pending::OpenFile(h) => self.files.remove(h),
                Pending::Commit(_) => {}
            }
        }
    }

    /// Transfers open or opening.
    pub fn transfers(&self) -> usize {
        self.transfers.len()
    }

    /// Mapped files open or opening.
    pub fn maps(&self) -> usize {
        self.maps.len()
    }

    /// File handles open or opening.
    pub fn files(&self) -> usize {
        self.files.len()
    }
}

/// Most bytes one `FileWrite` or `FileRead` of a connection whose chunk buffers hold
/// `chunk_bytes` may move.
pub fn file_io_max(chunk_bytes: u32) -> u64 {
    (MAX_WINDOW_CHUNKS as u64 * u64::from(chunk_bytes)).min(MAX_FILE_IO_BYTES)
}

/// Checks the write of a `FileFinish` or `FilePut`: none (no extents, an empty region,
/// no hashes), or a `FileWrite`'s ([`check_file_write`]).
pub fn check_finish_write(
    region: &RegionDesc,
    extents: &[Extent],
    hashes: &[Hash256],
    chunk_bytes: u32,
) -> Result<(), RemoteError> {
    if !extents.is_empty() {
        return check_file_write(region, extents, hashes, chunk_bytes);
    }
    if region.len != 0 || !hashes.is_empty() {
        return Err(protocol(format!(
            "a write of no extents names a region of {} bytes and {} hashes",
            region.len,
            hashes.len()
        )));
    }
    Ok(())
}

/// Checks a `FileWrite`'s shape: 1 to [`MAX_WRITE_EXTENTS`] extents, each of 1 to
/// `chunk_bytes` bytes ending at most at `i64::MAX`, one hash each, their lengths adding
/// up to the region's, which is at most [`file_io_max`].
pub fn check_file_write(
    region: &RegionDesc,
    extents: &[Extent],
    hashes: &[Hash256],
    chunk_bytes: u32,
) -> Result<(), RemoteError> {
    if extents.is_empty() || extents.len() > MAX_WRITE_EXTENTS {
        return Err(protocol(format!(
            "a file write of {} extents: it must have 1 to {MAX_WRITE_EXTENTS}",
            extents.len()
        )));
    }
    if hashes.len() != extents.len() {
        return Err(protocol(format!(
            "a file write of {} extents carries {} hashes",
            extents.len(),
            hashes.len()
        )));
    }
    let mut sum = 0u64;
    for e in extents {
        if e.len == 0 || e.len > chunk_bytes {
            return Err(protocol(format!(
                "a write extent of {} bytes: extents hold 1 to {chunk_bytes} bytes",
                e.len
            )));
        }
        if e.offset
            .checked_add(u64::from(e.len))
            .is_none_or(|end| end > i64::MAX as u64)
        {
            return Err(protocol(format!(
                "a write extent at offset {} ends past the largest file offset",
                e.offset
            )));
        }
        sum += u64::from(e.len);
    }
    if sum != region.len {
        return Err(protocol(format!(
            "a file write's extents hold {sum} bytes but its region {}",
            region.len
        )));
    }
    let most = file_io_max(chunk_bytes);
    if sum > most {
        return Err(protocol(format!(
            "a file write of {sum} bytes: at most {most} move at once"
        )));
    }
    Ok(())
}

fn no_transfer(transfer: u64) -> RemoteError {
    protocol(format!("no open transfer {transfer}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{Attr, HashAlgorithm};

    const CHUNK: u32 = 1 << 20;

    fn open_req() -> Request {
        Request::FileOpen {
            share: "s".into(),
            path: "f".into(),
            create: Some(0o644),
            exclusive: false,
            truncate: false,
        }
    }

    fn region_of(len: u64) -> RegionDesc {
        RegionDesc {
            addr: 0x1000,
            len,
            rkey: 7,
        }
    }

    fn write_req(handle: u64, extents: Vec<Extent>) -> Request {
        let len = extents.iter().map(|e| u64::from(e.len)).sum();
        Request::FileWrite {
            handle,
            region: region_of(len),
            algorithm: HashAlgorithm::Blake3,
            hashes: vec![[0; 32]; extents.len()],
            extents,
        }
    }

    fn opened(handle: u64) -> Response {
        Response::FileOpened {
            handle,
            attr: Attr::test_file(0),
            staged: true,
        }
    }

    /// Opens a file handle as request `id`; returns its handle.
    fn open(c: &mut ConnState, id: u64) -> u64 {
        let Ok(Grant::File(h)) = c.admit(id, &open_req()) else {
            panic!("FileOpen refused");
        };
        c.handle_response(id, &opened(h));
        h
    }

    fn one(offset: u64, len: u32) -> Vec<Extent> {
        vec![Extent { offset, len }]
    }

    #[test]
    fn an_open_handle_admits_its_requests_until_it_is_closed() {
        let mut c = ConnState::new(CHUNK);
        let h = open(&mut c, 1);
        assert_eq!(c.files(), 1);
        assert_eq!(c.admit(2, &write_req(h, one(0, 10))), Ok(Grant::File(h)));
        let read = Request::FileRead {
            handle: h,
            offset: 0,
            region: region_of(10),
        };
        assert_eq!(c.admit(3, &read), Ok(Grant::File(h)));
        let sync = Request::FileSync {
            handle: h,
            data_only: true,
        };
        assert_eq!(c.admit(4, &sync), Ok(Grant::File(h)));
        // An unknown handle is refused.
        let e = c.admit(5, &write_req(h + 1, one(0, 10))).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Protocol);
        // Close takes it out of the table at once: a later write is refused.
        assert_eq!(
            c.admit(6, &Request::FileClose { handle: h }),
            Ok(Grant::File(h))
        );
        assert_eq!(c.files(), 0);
        let e = c.admit(7, &write_req(h, one(0, 10))).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Protocol);
        let e = c.admit(8, &Request::FileClose { handle: h }).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Protocol);
    }

    #[test]
    fn a_handle_being_opened_admits_nothing_and_a_failed_open_frees_it() {
        let mut c = ConnState::new(CHUNK);
        let Ok(Grant::File(h)) = c.admit(1, &open_req()) else {
            panic!("FileOpen refused");
        };
        assert!(c.admit(2, &write_req(h, one(0, 1))).is_err());
        c.handle_response(
            1,
            &Response::Error(RemoteError::new(ErrorKind::NotFound, "s/f: no")),
        );
        assert_eq!(c.files(), 0);
        // A fresh handle, never the failed one again.
        assert_ne!(open(&mut c, 3), h);
    }

    #[test]
    fn file_writes_of_the_wrong_shape_are_refused() {
        let mut c = ConnState::new(CHUNK);
        let h = open(&mut c, 1);
        let refused = |c: &mut ConnState, req: Request| {
            let e = c.admit(9, &req).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Protocol, "{req:?}");
            e.message
        };
        // Empty.
        refused(&mut c, write_req(h, vec![]));
        // Too many extents.
        let many = (0..=MAX_WRITE_EXTENTS as u64)
            .map(|i| Extent { offset: i, len: 1 })
            .collect();
        refused(&mut c, write_req(h, many));
        // A hash count that does not match.
        let Request::FileWrite {
            region, extents, ..
        } = write_req(h, one(0, 4))
        else {
            unreachable!()
        };
        let m = refused(
            &mut c,
            Request::FileWrite {
                handle: h,
                region,
                algorithm: HashAlgorithm::Blake3,
                extents,
                hashes: vec![[0; 32]; 2],
            },
        );
        assert!(m.contains("2 hashes"), "{m}");
        // An extent larger than a chunk, or empty.
        refused(&mut c, write_req(h, one(0, CHUNK + 1)));
        refused(&mut c, write_req(h, one(0, 0)));
        // Extents that do not add up to the region.
        let Request::FileWrite {
            extents, hashes, ..
        } = write_req(h, one(0, 4))
        else {
            unreachable!()
        };
        refused(
            &mut c,
            Request::FileWrite {
                handle: h,
                region: region_of(5),
                algorithm: HashAlgorithm::Blake3,
                extents,
                hashes,
            },
        );
        // An extent ending past the largest file offset.
        refused(&mut c, write_req(h, one(i64::MAX as u64 - 1, 2)));
        refused(&mut c, write_req(h, one(u64::MAX, 2)));
        // More than a request may move.
        let most = file_io_max(CHUNK);
        let over = (0..=most / u64::from(CHUNK))
            .map(|i| Extent {
                offset: i * u64::from(CHUNK),
                len: CHUNK,
            })
            .collect();
        refused(&mut c, write_req(h, over));
        // Reads of nothing or of too much.
        for len in [0, most + 1] {
            refused(
                &mut c,
                Request::FileRead {
                    handle: h,
                    offset: 0,
                    region: region_of(len),
                },
            );
        }
        // And the right shape passes.
        assert!(c
            .admit(10, &write_req(h, one(i64::MAX as u64 - 2, 2)))
            .is_ok());
    }

    #[test]
    fn opening_slots_are_bounded_and_freed_when_the_session_closes() {
        let mut c = ConnState::new(CHUNK);
        for id in 0..MAX_OPEN_FILES as u64 {
            assert!(c.admit(id, &open_req()).is_ok());
        }
        let e = c.admit(u64::MAX, &open_req()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Busy);
        c.handle_closed();
        assert_eq!(c.files(), 0);
        assert!(c.admit(1, &open_req()).is_ok());
    }
}
