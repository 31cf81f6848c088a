//! Batches of small files: the checks of both sides.
//!
//! A server admits an upload batch only as a whole ([`check_upload_batch`], called by
//! the connection's tables); a client takes a download batch's answer only where it
//! stays inside the region it lent ([`place_downloaded`]). Verifying each file's hash
//! and sending damaged ones again (up to [`crate::proto::retry::WINDOW_ATTEMPTS`]
//! attempts) is the same policy as for windows.

use crate::msg::{
    Attr, BatchFile, BatchedFile, ErrorKind, Hash256, HashAlgorithm, RegionDesc, RemoteError,
    BATCH_MAX_BYTES, SMALL_FILE_MAX_BYTES,
};

use super::ProtoError;

fn protocol(message: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorKind::Protocol, message)
}

/// Most bytes one batch's region may hold on a server with chunk buffers of
/// `chunk_bytes`: the batch must fit one pooled buffer.
pub fn batch_capacity(chunk_bytes: u32) -> u64 {
    BATCH_MAX_BYTES.min(u64::from(chunk_bytes))
}

/// The largest file one batch may carry on a session whose server's chunk buffers
/// hold `chunk_bytes`: [`SMALL_FILE_MAX_BYTES`], or with `medium` batches (the
/// [`crate::proto::caps::BATCH`] capability) any file that fits the batch's capacity.
/// A file of up to one chunk then costs a share of a batch's one READ or WRITE, one
/// scratch file and a share of its group flush, instead of a transfer of its own (three
/// round trips, a staged file, a flush of its own to wait for).
pub fn batch_file_max(medium: bool, chunk_bytes: u32) -> u64 {
    let capacity = batch_capacity(chunk_bytes);
    if medium {
        capacity
    } else {
        SMALL_FILE_MAX_BYTES.min(capacity)
    }
}

/// Checks an upload batch as a whole: at least one file, none over `file_max`
/// ([`batch_file_max`]), sizes adding up to the region's length, which fits
/// `capacity`.
pub fn check_upload_batch(
    files: &[BatchFile],
    region: &RegionDesc,
    capacity: u64,
    file_max: u64,
) -> Result<(), RemoteError> {
    if files.is_empty() {
        return Err(protocol("an upload batch with no file"));
    }
    if let Some(f) = files.iter().find(|f| f.size > file_max) {
        return Err(protocol(format!(
            "a batched file of {} bytes (at most {file_max})",
            f.size
        )));
    }
    // Each size is bounded, and so is their number: no overflow.
    let total: u64 = files.iter().map(|f| f.size).sum();
    if total != region.len {
        return Err(protocol(format!(
            "the batch's files hold {total} bytes but its region {}",
            region.len
        )));
    }
    if region.len > capacity {
        return Err(protocol(format!(
            "a batch region of {} bytes (at most {capacity})",
            region.len
        )));
    }
    Ok(())
}

/// A file of a download batch where the server placed it, inside the region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Its index in the request's paths.
    pub index: usize,
    /// Offset of its first byte in the region.
    pub offset: usize,
    /// Its attributes as the server read it (`attr.size` bytes at `offset`).
    pub attr: Attr,
    /// The hash its bytes must have.
    pub hash: Hash256,
    /// The algorithm of `hash`.
    pub algorithm: HashAlgorithm,
}

/// What the answer to a download batch says of one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Its bytes are in the region; verify them against the hash before use.
    Placed(Placed),
    /// The server could not read it.
    Failed(RemoteError),
    /// Not in the batch: fetch it on the per-file path.
    PerFile,
    /// Placed (partly) outside the `region_bytes` the client lent: a broken answer
    /// for this file, whose bytes must not be read.
    Outside,
}

/// Checks a download batch's answer `files` for a request of `paths` paths into a
/// region of `region_bytes`: one entry per path (else the whole answer is refused), and
/// each placed file inside the region.
pub fn place_downloaded(
    files: Vec<BatchedFile>,
    paths: usize,
    region_bytes: usize,
) -> Result<Vec<Placement>, ProtoError> {
    if files.len() != paths {
        return Err(ProtoError::Transfer(format!(
            "bad batch answer from the server: {} entries for {paths} paths",
            files.len()
        )));
    }
    Ok(files
        .into_iter()
        .enumerate()
        .map(|(index, file)| match file {
            BatchedFile::Ok {
                attr,
                offset,
                hash,
                algorithm,
            } => {
                let end = offset.checked_add(attr.size);
                if end.is_none_or(|end| end > region_bytes as u64) {
                    Placement::Outside
                } else {
                    Placement::Placed(Placed {
                        index,
                        offset: offset as usize,
                        attr,
                        hash,
                        algorithm,
                    })
                }
            }
            BatchedFile::Err(e) => Placement::Failed(e),
            BatchedFile::NotIncluded => Placement::PerFile,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_batches_carry_files_up_to_the_capacity_and_no_further() {
        let mib = 1 << 20;
        assert_eq!(batch_file_max(false, mib), SMALL_FILE_MAX_BYTES);
        assert_eq!(batch_file_max(true, mib), BATCH_MAX_BYTES);
        // Never more than a chunk buffer holds, nor less than a small file on a server
        // with small chunks.
        assert_eq!(batch_file_max(true, 4096), 4096);
        assert_eq!(batch_file_max(false, 4096), 4096);
        let medium = BatchFile {
            path: "m".into(),
            size: 300 << 10,
            mode: 0o644,
            mtime: crate::msg::Timestamp::default(),
            hash: [0; 32],
        };
        let region = RegionDesc {
            addr: 0,
            len: medium.size,
            rkey: 1,
        };
        let files = [medium];
        let capacity = batch_capacity(mib);
        let small_only =
            check_upload_batch(&files, &region, capacity, batch_file_max(false, mib)).unwrap_err();
        assert!(
            small_only.message.contains("a batched file of"),
            "{small_only:?}"
        );
        check_upload_batch(&files, &region, capacity, batch_file_max(true, mib)).unwrap();
    }

    fn ok(offset: u64, size: u64) -> BatchedFile {
        BatchedFile::Ok {
            algorithm: HashAlgorithm::Blake3,
            attr: Attr::test_file(size),
            offset,
            hash: [7; 32],
        }
    }

    #[test]
    fn placements_outside_the_region_are_refused_one_by_one() {
        let files = vec![
            ok(0, 10),
            ok(10, 90),
            ok(95, 10),
            ok(u64::MAX, 2),
            BatchedFile::NotIncluded,
            BatchedFile::Err(protocol("gone")),
        ];
        let got = place_downloaded(files, 6, 100).unwrap();
        assert!(matches!(&got[0], Placement::Placed(p) if p.offset == 0 && p.index == 0));
        assert!(matches!(&got[1], Placement::Placed(p) if p.offset == 10 && p.index == 1));
        assert_eq!(got[2], Placement::Outside);
        assert_eq!(got[3], Placement::Outside);
        assert_eq!(got[4], Placement::PerFile);
        assert!(matches!(&got[5], Placement::Failed(e) if e.message == "gone"));
    }

    #[test]
    fn an_answer_of_the_wrong_length_is_refused() {
        assert!(place_downloaded(vec![ok(0, 1)], 2, 100).is_err());
        assert!(place_downloaded(vec![], 0, 100).unwrap().is_empty());
    }
}
