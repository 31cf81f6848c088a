//! Reading a server file's whole chunk manifest, page by page.
//!
//! A manifest longer than one page ([`crate::msg::MAX_MANIFEST_PAGE_CHUNKS`]) is read
//! with one [`Request::Manifest`] per page. [`ManifestReader`] decides which page to ask
//! for next and checks every page: it starts at the chunk asked for, belongs to the
//! same file version as the pages before it, never holds more hashes than the version
//! has chunks, and the hashes of a complete listing add up to the version's manifest
//! hash. A page of another version (the file changed on the server between pages)
//! starts the listing over, at most [`MANIFEST_ATTEMPTS`] times in all.
//!
//! Call order: [`ManifestReader::poll_request`] gives the request to send (`None` once
//! the reader is done); the driver feeds its answer to
//! [`ManifestReader::handle_page`], which returns the manifest when complete.

use crate::chunk::{chunk_count, manifest_id};
use crate::msg::{ErrorKind, FileVersion, Hash256, RemoteError, Request, Response};

use super::ProtoError;

/// How many times a listing starts over when the file changes between pages.
pub const MANIFEST_ATTEMPTS: usize = 3;

/// Why a manifest could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// The server's pages contradict themselves or their manifest hash.
    #[error(transparent)]
    Protocol(#[from] ProtoError),
    /// The file kept changing while it was read (a [`ErrorKind::Changed`] error).
    #[error("{}", .0.message)]
    Changed(RemoteError),
}

/// The listing of one file's manifest; see the module docs.
#[derive(Debug)]
pub struct ManifestReader {
    share: String,
    path: String,
    chunk_bytes: u32,
    attempt: usize,
    version: Option<FileVersion>,
    hashes: Vec<Hash256>,
    done: bool,
}

impl ManifestReader {
    /// A listing of `share`'s file `path` in chunks of `chunk_bytes`.
    pub fn new(share: &str, path: &str, chunk_bytes: u32) -> ManifestReader {
        ManifestReader {
            share: share.into(),
            path: path.into(),
            chunk_bytes,
            attempt: 1,
            version: None,
            hashes: Vec::new(),
            done: false,
        }
    }

    /// The next page to ask for, or `None` once the listing is done (or failed).
    pub fn poll_request(&self) -> Option<Request> {
        (!self.done).then(|| Request::Manifest {
            share: self.share.clone(),
            path: self.path.clone(),
            chunk_bytes: self.chunk_bytes,
            first_chunk: self.hashes.len() as u64,
        })
    }

    fn bad(&mut self, why: &str) -> ManifestError {
        self.done = true;
        ManifestError::Protocol(ProtoError::Transfer(format!(
            "{}: bad manifest from the server: {why}",
            self.path
        )))
    }

    /// Feeds in the answer to the last request. Returns the version and its chunk
    /// hashes once the listing is complete and verified, `Ok(None)` while pages remain.
    ///
    /// Invariant of a result: `hashes.len()` is the chunk count of `version.size` in
    /// chunks of `version.chunk_bytes`, and `manifest_id` of them is `version.manifest`.
    pub fn handle_page(
        &mut self,
        page: Response,
    ) -> Result<Option<(FileVersion, Vec<Hash256>)>, ManifestError> {
        let Response::Manifest {
            version,
            first_chunk,
            hashes,
        } = page
        else {
            self.done = true;
            return Err(ManifestError::Protocol(ProtoError::Transfer(format!(
                "unexpected response {page:?}"
            ))));
        };
        if first_chunk != self.hashes.len() as u64 {
            return Err(self.bad("a page starts at the wrong chunk"));
        }
        if self.version.as_ref().is_some_and(|v| *v != version) {
            return self.restart();
        }
        let chunks = chunk_count(version.size, version.chunk_bytes.max(1));
        if (self.hashes.len() + hashes.len()) as u64 > chunks {
            return Err(self.bad("more hashes than chunks"));
        }
        let last = hashes.is_empty();
        self.hashes.extend(hashes);
        if !last {
            self.version = Some(version);
            return Ok(None);
        }
        self.done = true;
        let hashes = std::mem::take(&mut self.hashes);
        if hashes.len() as u64 != chunks
            || manifest_id(
                version.algorithm,
                version.size,
                version.chunk_bytes,
                &hashes,
            ) != version.manifest
        {
            return Err(self.bad("the hashes do not match the manifest hash"));
        }
        Ok(Some((version, hashes)))
    }

    fn restart(&mut self) -> Result<Option<(FileVersion, Vec<Hash256>)>, ManifestError> {
        if self.attempt >= MANIFEST_ATTEMPTS {
            self.done = true;
            return Err(ManifestError::Changed(RemoteError::new(
                ErrorKind::Changed,
                format!(
                    "{}: the file kept changing while its manifest was read",
                    self.path
                ),
            )));
        }
        self.attempt += 1;
        self.version = None;
        self.hashes.clear();
        Ok(None)
    }
}
