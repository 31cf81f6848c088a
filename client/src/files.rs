//! The requests of a writable mount (the `write` capability): file handles written
//! by one-sided READs of the client's registered buffers, renames that may replace,
//! attribute changes, a share's access and the server's traffic counters.
//!
//! These are thin: each sends one request and checks the shape of its answer. The
//! caller owns the registered memory a [`RegionDesc`] names and keeps it untouched
//! until the call returns (the server reads or writes it meanwhile).

use ferry_common::msg::{
    Attr, Counters, ErrorKind, Extent, FallocMode, Hash256, HashAlgorithm, Owner, RegionDesc,
    RemoteError, Request, Response, SetAttrs,
};
use ferry_common::proto::caps::WRITE;
use ferry_common::proto::ProtoError;

use crate::client::{expect_ok, unexpected};
use crate::{Client, ClientError};

/// The region of a finish or put that writes nothing.
const NO_REGION: RegionDesc = RegionDesc {
    addr: 0,
    len: 0,
    rkey: 0,
};

/// A file opened for writing ([`Client::file_open`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenedFile {
    /// The handle naming it in later requests.
    pub handle: u64,
    /// Its attributes at open (for a staged file, those of the hidden file that will
    /// take the name: its inode is the final one).
    pub attr: Attr,
    /// The file is staged: it takes its name at the first sync or close.
    pub staged: bool,
}

/// The bytes of a [`Client::file_read`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadData {
    /// Bytes placed at the start of the region.
    pub len: u64,
    /// The algorithm of `hashes`.
    pub algorithm: HashAlgorithm,
    /// The hash of each piece of the server's chunk size, in order.
    pub hashes: Vec<Hash256>,
}

impl Client {
    /// Whether the session negotiated the `write` capability, without which the
    /// requests of this module are refused unsent.
    pub fn can_write(&self) -> bool {
        self.negotiated().is_some_and(|n| n.write)
    }

    fn need_write(&self) -> Result<(), ClientError> {
        if self.can_write() {
            Ok(())
        } else {
            Err(ClientError::Protocol(ProtoError::Transfer(format!(
                "the server at {} does not support writes (no '{WRITE}' capability): it is \
                 an older ferryd",
                self.addr()
            ))))
        }
    }

    async fn call_write(&self, req: Request) -> Result<Response, ClientError> {
        self.need_write()?;
        self.call(req).await
    }

    /// Whether this session may change `share` (it is not exported read-only).
    pub async fn share_access(&self, share: &str) -> Result<bool, ClientError> {
        let req = Request::ShareAccess {
            share: share.into(),
        };
        match self.call_write(req).await? {
            Response::ShareAccess { writable } => Ok(writable),
            other => Err(unexpected(other)),
        }
    }

    /// Opens the regular file `path` of `share` for writing (see
    /// [`Request::FileOpen`]).
    pub async fn file_open(
        &self,
        share: &str,
        path: &str,
        create: Option<u32>,
        exclusive: bool,
        truncate: bool,
    ) -> Result<OpenedFile, ClientError> {
        let req = Request::FileOpen {
            share: share.into(),
            path: path.into(),
            create,
            exclusive,
            truncate,
        };
        match self.call_write(req).await? {
            Response::FileOpened {
                handle,
                attr,
                staged,
            } => Ok(OpenedFile {
                handle,
                attr,
                staged,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Has the server pull `region` (the extents' bytes back to back) with a one-sided
    /// READ, verify each extent against its hash and write it; returns the file's size
    /// after.
    pub async fn file_write(
        &self,
        handle: u64,
        region: RegionDesc,
        algorithm: HashAlgorithm,
        extents: Vec<Extent>,
        hashes: Vec<Hash256>,
    ) -> Result<u64, ClientError> {
        let req = Request::FileWrite {
            handle,
            region,
            algorithm,
            extents,
            hashes,
        };
        match self.call_write(req).await? {
            Response::FileWritten { size } => Ok(size),
            other => Err(unexpected(other)),
        }
    }

    /// Has the server push file bytes `offset..offset + region.len` (fewer at the end)
    /// into `region` with a one-sided WRITE; returns their length and hashes, which
    /// the caller checks before using the bytes.
    pub async fn file_read(
        &self,
        handle: u64,
        offset: u64,
        region: RegionDesc,
    ) -> Result<ReadData, ClientError> {
        let req = Request::FileRead {
            handle,
            offset,
            region,
        };
        match self.call_write(req).await? {
            Response::FileData {
                len,
                algorithm,
                hashes,
            } => {
                if len > region.len {
                    return Err(ClientError::Protocol(ProtoError::Transfer(format!(
                        "the server says it placed {len} bytes in a region of {}",
                        region.len
                    ))));
                }
                self.check_algorithm(algorithm)?;
                Ok(ReadData {
                    len,
                    algorithm,
                    hashes,
                })
            }
            other => Err(unexpected(other)),
        }
    }

    /// Changes attributes through a handle; returns the attributes after.
    pub async fn file_set_attr(&self, handle: u64, attrs: SetAttrs) -> Result<Attr, ClientError> {
        expect_attr(
            self.call_write(Request::FileSetAttr { handle, attrs })
                .await?,
        )
    }

    /// `fallocate` through a handle; returns the attributes after.
    pub async fn file_allocate(
        &self,
        handle: u64,
        offset: u64,
        len: u64,
        keep_size: bool,
    ) -> Result<Attr, ClientError> {
        let req = Request::FileAllocate {
            handle,
            offset,
            len,
            keep_size,
        };
        expect_attr(self.call_write(req).await?)
    }

    /// Whether the session negotiated the `falloc` capability, without which
    /// [`Client::file_fallocate`] fails `Unsupported` unsent.
    pub fn has_falloc(&self) -> bool {
        self.negotiated().is_some_and(|n| n.falloc)
    }

    /// A hole punched or a range zeroed through a handle ([`FallocMode`]); returns the
    /// attributes after.
    pub async fn file_fallocate(
        &self,
        handle: u64,
        offset: u64,
        len: u64,
        mode: FallocMode,
    ) -> Result<Attr, ClientError> {
        if !self.has_falloc() {
            return Err(ClientError::Remote(RemoteError::new(
                ErrorKind::Unsupported,
                "the server cannot punch holes or zero ranges (it is older than the falloc capability)",
            )));
        }
        let req = Request::FileFallocate {
            handle,
            offset,
            len,
            mode,
        };
        expect_attr(self.call_write(req).await?)
    }

    /// Makes what was written through `handle` durable (a staged file takes its
    /// name); returns the attributes after.
    pub async fn file_sync(&self, handle: u64, data_only: bool) -> Result<Attr, ClientError> {
        expect_attr(
            self.call_write(Request::FileSync { handle, data_only })
                .await?,
        )
    }

    /// Gives a staged file its name now, without making it durable; returns the
    /// attributes after.
    pub async fn file_commit(&self, handle: u64) -> Result<Attr, ClientError> {
        expect_attr(self.call_write(Request::FileCommit { handle }).await?)
    }

    /// Finishes a handle in one round trip (the `finish` capability): writes
    /// `write`'s extents (the region holding them, the extents, their hashes in
    /// `algorithm`), then sets `attrs`, then with `commit` gives a staged file its name.
    /// Returns the attributes after.
    pub async fn file_finish(
        &self,
        handle: u64,
        write: Option<(RegionDesc, Vec<Extent>, Vec<Hash256>)>,
        algorithm: HashAlgorithm,
        attrs: SetAttrs,
        commit: bool,
    ) -> Result<Attr, ClientError> {
        let (region, extents, hashes) = write.unwrap_or((NO_REGION, Vec::new(), Vec::new()));
        let req = Request::FileFinish {
            handle,
            region,
            algorithm,
            extents,
            hashes,
            attrs,
            commit,
        };
        expect_attr(self.call_write(req).await?)
    }

    /// Writes a whole new file in one round trip (the `finish` capability): `path` of
    /// `share` is created staged (mode `mode`; with `exclusive`, failing if the name
    /// exists), `write`'s extents written, `attrs` set and the file named; no handle is
    /// left. Returns the attributes after.
    pub async fn file_put(
        &self,
        (share, path, mode, exclusive): (&str, &str, u32, bool),
        write: Option<(RegionDesc, Vec<Extent>, Vec<Hash256>)>,
        algorithm: HashAlgorithm,
        attrs: SetAttrs,
    ) -> Result<Attr, ClientError> {
        let (region, extents, hashes) = write.unwrap_or((NO_REGION, Vec::new(), Vec::new()));
        let req = Request::FilePut {
            share: share.into(),
            path: path.into(),
            mode,
            exclusive,
            region,
            algorithm,
            extents,
            hashes,
            attrs,
        };
        expect_attr(self.call_write(req).await?)
    }

    /// Forgets the handle (a staged file takes its name first, not made durable).
    pub async fn file_close(&self, handle: u64) -> Result<Attr, ClientError> {
        expect_attr(self.call_write(Request::FileClose { handle }).await?)
    }

    /// Forgets `handle` without syncing it: a staged file that has not taken its name
    /// is removed.
    pub async fn file_discard(&self, handle: u64) -> Result<(), ClientError> {
        self.call_write(Request::FileDiscard { handle })
            .await
            .and_then(expect_ok)
    }

    /// `rename(2)` of `from` to `to` in `share`, replacing `to` unless `no_replace`.
    pub async fn move_entry(
        &self,
        share: &str,
        from: &str,
        to: &str,
        no_replace: bool,
    ) -> Result<(), ClientError> {
        let req = Request::Move {
            share: share.into(),
            from: from.into(),
            to: to.into(),
            no_replace,
        };
        self.call_write(req).await.and_then(expect_ok)
    }

    /// Changes the attributes of `path` (its final component never followed);
    /// returns the attributes after.
    pub async fn set_attrs(
        &self,
        share: &str,
        path: &str,
        attrs: SetAttrs,
    ) -> Result<Attr, ClientError> {
        let req = Request::SetAttrs {
            share: share.into(),
            path: path.into(),
            attrs,
        };
        expect_attr(self.call_write(req).await?)
    }

    /// Attributes and owner of `path` (see [`Request::StatMeta`]).
    pub async fn stat_meta(
        &self,
        share: &str,
        path: &str,
        follow: bool,
    ) -> Result<(Attr, Owner), ClientError> {
        let req = Request::StatMeta {
            share: share.into(),
            path: path.into(),
            follow,
        };
        match self.call_write(req).await? {
            Response::AttrMeta { attr, owner } => Ok((attr, owner)),
            other => Err(unexpected(other)),
        }
    }

    /// The server's traffic counters.
    pub async fn counters(&self) -> Result<Counters, ClientError> {
        match self.call_write(Request::Counters).await? {
            Response::Counters(c) => Ok(c),
            other => Err(unexpected(other)),
        }
    }
}

fn expect_attr(r: Response) -> Result<Attr, ClientError> {
    match r {
        Response::Attr(a) => Ok(a),
        other => Err(unexpected(other)),
    }
}
