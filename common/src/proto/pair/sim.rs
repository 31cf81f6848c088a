//! A server driver and a client's registered memory, in memory, for the [`Pair`]
//! tests: the driver performs what the session admits (the grant names the transfer
//! or mapped file) against an in-memory share, and moves file bytes only by one-sided
//! READs and WRITEs of the client's regions. Every decision stays in the cores: the
//! driver asks `UploadState` whether a pulled chunk verifies and whether an upload may
//! commit, and `check_window` whether a download window is valid.
//!
//! Faults: a one-sided operation can flip one byte on the wire (`Faults`), and a file
//! can change on the server between two manifest pages; each counts when it fires.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use super::Pair;
use crate::chunk::{chunk_count, hash_chunk, hash_chunks, manifest_id};
use crate::msg::*;
use crate::proto::conn::Grant;
use crate::proto::transfer::{check_window, UploadState};

/// The client's registered regions, by rkey (each registered at address 0).
#[derive(Default)]
pub(super) struct Memory {
    regions: HashMap<u32, Vec<u8>>,
    next_rkey: u32,
}

impl Memory {
    /// Registers `bytes` and returns the descriptor a request advertises.
    pub(super) fn register(&mut self, bytes: Vec<u8>) -> RegionDesc {
        self.next_rkey += 1;
        let desc = RegionDesc {
            addr: 0,
            len: bytes.len() as u64,
            rkey: self.next_rkey,
        };
        self.regions.insert(self.next_rkey, bytes);
        desc
    }

    /// Revokes a region and returns its bytes.
    pub(super) fn revoke(&mut self, r: &RegionDesc) -> Vec<u8> {
        self.regions.remove(&r.rkey).unwrap_or_default()
    }

    /// A one-sided READ of `r`, checked against the registration as a NIC would.
    fn read(&self, r: &RegionDesc) -> Result<Vec<u8>, String> {
        let region = self.regions.get(&r.rkey).ok_or("unknown rkey")?;
        let end = r.addr.checked_add(r.len).ok_or("overflow")?;
        region
            .get(r.addr as usize..end as usize)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| "read out of bounds".to_string())
    }

    /// A one-sided WRITE of `bytes` at the start of `r`.
    fn write(&mut self, r: &RegionDesc, bytes: &[u8]) -> Result<(), String> {
        let region = self.regions.get_mut(&r.rkey).ok_or("unknown rkey")?;
        let start = r.addr as usize;
        if bytes.len() as u64 > r.len || start + bytes.len() > region.len() {
            return Err("write out of bounds".into());
        }
        region[start..start + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

/// Faults to inject, and how often each fired.
#[derive(Default)]
pub(super) struct Faults {
    /// Flip a byte of this many of the next one-sided operations (READs and WRITEs).
    pub(super) flip_next: usize,
    /// Flips done.
    pub(super) flipped: usize,
    /// Change the file being listed at every this many manifest pages...
    pub(super) change_every_pages: Option<usize>,
    /// ...this many times.
    pub(super) changes_left: usize,
    /// Manifest pages served since these faults were set.
    pub(super) pages: usize,
    /// Changes done.
    pub(super) changed: usize,
}

enum Open {
    Upload {
        path: String,
        state: UploadState,
        data: Vec<u8>,
    },
    Download {
        data: Vec<u8>,
    },
}

/// The server's driver and its share; see the module docs.
pub(super) struct Sim {
    pub(super) files: BTreeMap<String, Vec<u8>>,
    pub(super) memory: Memory,
    pub(super) faults: Faults,
    /// Bytes the driver moved by one-sided operations.
    pub(super) wire_bytes: u64,
    /// Mapped files by handle: the server memory a client READs.
    pub(super) maps: HashMap<u64, Vec<u8>>,
    open: HashMap<u64, Open>,
    chunk_bytes: u32,
}

/// Most hashes the simulated server puts in one manifest page: small, so listings
/// take several pages.
const PAGE_CHUNKS: usize = 2;

fn err(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error(RemoteError::new(kind, message))
}

impl Sim {
    pub(super) fn new(chunk_bytes: u32) -> Rc<RefCell<Sim>> {
        Rc::new(RefCell::new(Sim {
            files: BTreeMap::new(),
            memory: Memory::default(),
            faults: Faults::default(),
            wire_bytes: 0,
            maps: HashMap::new(),
            open: HashMap::new(),
            chunk_bytes,
        }))
    }

    /// Makes `pair`'s server answer through `sim`.
    pub(super) fn serve(sim: &Rc<RefCell<Sim>>, pair: &mut Pair) {
        let sim = sim.clone();
        pair.responder = Box::new(move |req, grant| Some(sim.borrow_mut().perform(req, grant)));
    }

    /// The file's version as a manifest page reports it.
    pub(super) fn version(&self, data: &[u8]) -> FileVersion {
        let hashes = hash_chunks(HashAlgorithm::Blake3, data, self.chunk_bytes as usize);
        let a = Attr::test_file(data.len() as u64);
        FileVersion {
            algorithm: HashAlgorithm::Blake3,
            size: a.size,
            mtime: a.mtime,
            ctime: a.ctime,
            ino: a.ino,
            chunk_bytes: self.chunk_bytes,
            manifest: manifest_id(HashAlgorithm::Blake3, a.size, self.chunk_bytes, &hashes),
        }
    }

    /// One one-sided operation's bytes on the wire, damaged if a flip is due.
    fn on_wire(&mut self, mut bytes: Vec<u8>) -> Vec<u8> {
        self.wire_bytes += bytes.len() as u64;
        if self.faults.flip_next > 0 && !bytes.is_empty() {
            self.faults.flip_next -= 1;
            self.faults.flipped += 1;
            let at = bytes.len() / 2;
            bytes[at] ^= 0x10;
        }
        bytes
    }

    fn perform(&mut self, req: &Request, grant: Grant) -> Response {
        match (req, grant) {
            (Request::UploadOpen { path, size, .. }, Grant::Transfer(t)) => {
                let state = UploadState::new(
                    HashAlgorithm::Blake3,
                    *size,
                    self.chunk_bytes,
                    MAX_WINDOW_CHUNKS,
                );
                let data = vec![0; *size as usize];
                let path = path.clone();
                self.open.insert(t, Open::Upload { path, state, data });
                Response::UploadOpened {
                    transfer: t,
                    algorithm: HashAlgorithm::Blake3,
                }
            }
            (Request::DownloadOpen { path, .. }, Grant::Transfer(t)) => {
                match self.files.get(path) {
                    Some(data) => {
                        let size = data.len() as u64;
                        let data = data.clone();
                        self.open.insert(t, Open::Download { data });
                        Response::DownloadOpened {
                            algorithm: HashAlgorithm::Blake3,
                            transfer: t,
                            attr: Attr::test_file(size),
                        }
                    }
                    None => err(ErrorKind::NotFound, format!("{path}: no such file")),
                }
            }
            (
                Request::UploadWindow {
                    offset,
                    region,
                    hashes,
                    ..
                },
                Grant::Transfer(t),
            ) => self.pull(t, *offset, region, hashes),
            (Request::DownloadWindow { offset, region, .. }, Grant::Transfer(t)) => {
                self.push(t, *offset, region)
            }
            (Request::UploadCommit { manifest, .. }, Grant::Transfer(t)) => {
                self.commit(t, manifest)
            }
            (Request::Close { .. }, Grant::Transfer(t)) => {
                self.open.remove(&t);
                Response::Ok
            }
            (Request::MapOpen { path, .. }, Grant::Map(handle)) => self.map(handle, path),
            (Request::MapRelease { .. }, Grant::Map(handle)) => {
                self.maps.remove(&handle);
                Response::Ok
            }
            (
                Request::Manifest {
                    path, first_chunk, ..
                },
                _,
            ) => self.manifest_page(path, *first_chunk),
            (Request::UploadBatch { region, files, .. }, _) => self.upload_batch(region, files),
            (Request::DownloadBatch { paths, region, .. }, _) => self.download_batch(paths, region),
            (Request::Stat { path, .. }, _) => match self.files.get(path) {
                Some(d) => Response::Attr(Attr::test_file(d.len() as u64)),
                None => err(ErrorKind::NotFound, format!("{path}: no such file")),
            },
            _ => Response::Ok,
        }
    }

    fn pull(&mut self, t: u64, offset: u64, region: &RegionDesc, hashes: &[Hash256]) -> Response {
        let chunk_bytes = self.chunk_bytes;
        let bytes = match self.memory.read(region) {
            Ok(b) => self.on_wire(b),
            Err(e) => return err(ErrorKind::Io, e),
        };
        let Some(Open::Upload { state, data, .. }) = self.open.get_mut(&t) else {
            return err(ErrorKind::Protocol, "no upload state");
        };
        let w = match state.handle_window(offset, region.len, hashes) {
            Ok(w) => w,
            Err(e) => return err(ErrorKind::Protocol, e.to_string()),
        };
        for c in w.chunks(chunk_bytes) {
            let at = c.window_offset as usize;
            let chunk = &bytes[at..at + c.len as usize];
            // The core decides whether the chunk verifies, before it reaches "disk".
            if let Err(e) =
                state.handle_chunk_pulled(c.index, hash_chunk(HashAlgorithm::Blake3, chunk))
            {
                state.handle_window_failed(w);
                return err(ErrorKind::Integrity, e.to_string());
            }
            let file_at = (w.offset + c.window_offset) as usize;
            data[file_at..file_at + chunk.len()].copy_from_slice(chunk);
        }
        Response::WindowPulled {
            bytes: w.len,
            reused: 0,
        }
    }

    fn commit(&mut self, t: u64, manifest: &Hash256) -> Response {
        let Some(Open::Upload { path, state, data }) = self.open.get(&t) else {
            return err(ErrorKind::Protocol, "no upload state");
        };
        match state.commit(manifest) {
            Ok(_) => {
                let size = data.len() as u64;
                self.files.insert(path.clone(), data.clone());
                self.open.remove(&t);
                Response::Committed { size }
            }
            Err(e) => err(ErrorKind::Protocol, e.to_string()),
        }
    }

    fn push(&mut self, t: u64, offset: u64, region: &RegionDesc) -> Response {
        let Some(Open::Download { data }) = self.open.get(&t) else {
            return err(ErrorKind::Protocol, "no download state");
        };
        let w = match check_window(
            data.len() as u64,
            self.chunk_bytes,
            MAX_WINDOW_CHUNKS,
            offset,
            region.len,
        ) {
            Ok(w) => w,
            Err(e) => return err(ErrorKind::Protocol, e.to_string()),
        };
        let bytes = data[w.offset as usize..(w.offset + w.len) as usize].to_vec();
        let hashes = hash_chunks(HashAlgorithm::Blake3, &bytes, self.chunk_bytes as usize);
        let sent = self.on_wire(bytes);
        match self.memory.write(region, &sent) {
            Ok(()) => Response::WindowPushed { hashes },
            Err(e) => err(ErrorKind::Io, e),
        }
    }

    fn map(&mut self, handle: u64, path: &str) -> Response {
        let Some(data) = self.files.get(path).cloned() else {
            return err(ErrorKind::NotFound, format!("{path}: no such file"));
        };
        let hashes: Vec<u8> =
            hash_chunks(HashAlgorithm::Blake3, &data, self.chunk_bytes as usize).concat();
        let version = self.version(&data);
        let size = data.len() as u64;
        let mapped = MappedFile {
            handle,
            attr: Attr::test_file(size),
            version,
            window_bytes: MAP_WINDOW_BYTES,
            regions: if size == 0 {
                vec![]
            } else {
                vec![RegionDesc {
                    addr: 0,
                    len: size,
                    rkey: 1000 + handle as u32 * 2,
                }]
            },
            manifest: (size > 0).then(|| RegionDesc {
                addr: 0,
                len: hashes.len() as u64,
                rkey: 1001 + handle as u32 * 2,
            }),
        };
        let mut server_memory = data;
        server_memory.extend(hashes);
        self.maps.insert(handle, server_memory);
        Response::Mapped(Box::new(mapped))
    }

    fn manifest_page(&mut self, path: &str, first_chunk: u64) -> Response {
        let f = &mut self.faults;
        f.pages += 1;
        if f.changes_left > 0 && f.change_every_pages.is_some_and(|n| f.pages % n == 0) {
            if let Some(d) = self.files.get_mut(path) {
                d.push(0x5a);
                f.changes_left -= 1;
                f.changed += 1;
            }
        }
        let Some(data) = self.files.get(path) else {
            return err(ErrorKind::NotFound, format!("{path}: no such file"));
        };
        let hashes = hash_chunks(HashAlgorithm::Blake3, data, self.chunk_bytes as usize);
        let count = chunk_count(data.len() as u64, self.chunk_bytes) as usize;
        let first = (first_chunk as usize).min(count);
        let last = (first + PAGE_CHUNKS).min(count);
        Response::Manifest {
            version: self.version(data),
            first_chunk,
            hashes: hashes[first..last].to_vec(),
        }
    }

    fn upload_batch(&mut self, region: &RegionDesc, files: &[BatchFile]) -> Response {
        let bytes = match self.memory.read(region) {
            Ok(b) => self.on_wire(b),
            Err(e) => return err(ErrorKind::Io, e),
        };
        let mut at = 0usize;
        let results = files
            .iter()
            .map(|f| {
                let data = &bytes[at..at + f.size as usize];
                at += f.size as usize;
                if hash_chunk(HashAlgorithm::Blake3, data) != f.hash {
                    return Some(RemoteError::new(
                        ErrorKind::Integrity,
                        format!("{}: failed verification", f.path),
                    ));
                }
                self.files.insert(f.path.clone(), data.to_vec());
                None
            })
            .collect();
        Response::UploadedBatch { results }
    }

    fn download_batch(&mut self, paths: &[String], region: &RegionDesc) -> Response {
        let mut out = Vec::new();
        let files = paths
            .iter()
            .map(|p| match self.files.get(p) {
                Some(d) if (out.len() + d.len()) as u64 <= region.len => {
                    let offset = out.len() as u64;
                    out.extend_from_slice(d);
                    BatchedFile::Ok {
                        algorithm: HashAlgorithm::Blake3,
                        attr: Attr::test_file(d.len() as u64),
                        offset,
                        hash: hash_chunk(HashAlgorithm::Blake3, d),
                    }
                }
                Some(_) => BatchedFile::NotIncluded,
                None => BatchedFile::Err(RemoteError::new(ErrorKind::NotFound, p.clone())),
            })
            .collect();
        let sent = self.on_wire(out);
        match self.memory.write(region, &sent) {
            Ok(()) => Response::DownloadedBatch { files },
            Err(e) => err(ErrorKind::Io, e),
        }
    }
}
