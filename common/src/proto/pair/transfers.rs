//! Whole transfers through both cores: uploads and downloads in windows, resume from
//! held chunks, manifest paging, batches and mapped files, with faults on the wire.
//! Every fault test checks that its fault fired as often as it expects.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;

use super::sim::{Faults, Sim};
use super::{error_kind, Pair, CHUNK};
use crate::chunk::{hash_chunk, hash_chunks, manifest_id};
use crate::msg::*;
use crate::proto::manifest::{ManifestError, ManifestReader, MANIFEST_ATTEMPTS};
use crate::proto::mapped::MappedLayout;
use crate::proto::retry::{Verdict, WindowFailure, WindowRetry, WINDOW_ATTEMPTS};
use crate::proto::transfer::{check_window_hashes, Window, WindowPlan};

fn data(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(seed) % 251) as u8)
        .collect()
}

const MTIME: Timestamp = Timestamp { secs: 5, nanos: 0 };

fn slice(data: &[u8], w: Window) -> &[u8] {
    &data[w.offset as usize..(w.offset + w.len) as usize]
}

/// Uploads `data` as `path` the way rcp does: windows planned by [`WindowPlan`], two in
/// flight, each sent again when the retry policy says so; returns the commit's answer
/// or the first failure.
fn upload(p: &mut Pair, sim: &Rc<RefCell<Sim>>, path: &str, data: &[u8]) -> Response {
    let size = data.len() as u64;
    let transfer = match p.call(Request::UploadOpen {
        share: "s".into(),
        path: path.into(),
        size,
        mode: 0o644,
        mtime: MTIME,
    }) {
        Response::UploadOpened { transfer, .. } => transfer,
        other => return other,
    };
    let mut plan = WindowPlan::new(size, CHUNK, 3, 2);
    while !plan.is_complete() {
        let windows: Vec<Window> = std::iter::from_fn(|| plan.poll_window()).collect();
        for (w, answer) in send_windows(p, sim, transfer, data, &windows) {
            match answer {
                Response::WindowPulled { .. } => plan.handle_window_done(w).unwrap(),
                other => return other,
            }
        }
    }
    let manifest = manifest_id(
        HashAlgorithm::Blake3,
        size,
        CHUNK,
        &hash_chunks(HashAlgorithm::Blake3, data, CHUNK as usize),
    );
    p.call(Request::UploadCommit { transfer, manifest })
}

/// Sends `windows` of an upload at once, then each damaged one again while the retry
/// policy allows; returns each window's last answer.
fn send_windows(
    p: &mut Pair,
    sim: &Rc<RefCell<Sim>>,
    transfer: u64,
    data: &[u8],
    windows: &[Window],
) -> Vec<(Window, Response)> {
    let send = |p: &mut Pair, w: Window| {
        let bytes = slice(data, w).to_vec();
        let hashes = hash_chunks(HashAlgorithm::Blake3, &bytes, CHUNK as usize);
        let region = sim.borrow_mut().memory.register(bytes);
        let id = p
            .client
            .request(
                p.now,
                Request::UploadWindow {
                    transfer,
                    offset: w.offset,
                    region,
                    hashes,
                },
            )
            .unwrap();
        (id, region)
    };
    let sent: Vec<_> = windows.iter().map(|&w| (w, send(p, w))).collect();
    p.drive();
    let mut out = Vec::new();
    for (w, (mut id, mut region)) in sent {
        let mut retry = WindowRetry::default();
        loop {
            let answer = p.response(id).expect("window answered");
            sim.borrow_mut().memory.revoke(&region);
            let damaged = error_kind(&answer) == Some(ErrorKind::Integrity);
            if damaged && retry.handle_failure(WindowFailure::Integrity) == Verdict::Retry {
                (id, region) = send(p, w);
                p.drive();
                continue;
            }
            out.push((w, answer));
            break;
        }
    }
    out
}

/// Downloads `path` the way rcp does, leaving out the chunks in `held` (which `out`
/// already holds): windows pushed into registered buffers, checked against the
/// server's hashes, and fetched again when damaged, as the retry policy allows.
fn download(
    p: &mut Pair,
    sim: &Rc<RefCell<Sim>>,
    path: &str,
    out: &mut Vec<u8>,
    held: BTreeSet<u64>,
) -> Result<(), Box<Response>> {
    let (transfer, size) = match p.call(Request::DownloadOpen {
        share: "s".into(),
        path: path.into(),
    }) {
        Response::DownloadOpened { transfer, attr, .. } => (transfer, attr.size),
        other => return Err(Box::new(other)),
    };
    out.resize(size as usize, 0);
    let mut plan = WindowPlan::new(size, CHUNK, 3, 2).skipping(held);
    while let Some(w) = plan.poll_window() {
        let mut retry = WindowRetry::default();
        loop {
            let region = sim.borrow_mut().memory.register(vec![0; w.len as usize]);
            let answer = p.call(Request::DownloadWindow {
                verify: false,
                transfer,
                offset: w.offset,
                region,
            });
            let bytes = sim.borrow_mut().memory.revoke(&region);
            let Response::WindowPushed { hashes } = answer else {
                return Err(Box::new(answer));
            };
            let got = hash_chunks(HashAlgorithm::Blake3, &bytes, CHUNK as usize);
            match check_window_hashes(w, CHUNK, &hashes, &got) {
                Ok(()) => {
                    out[w.offset as usize..][..bytes.len()].copy_from_slice(&bytes);
                    plan.handle_window_done(w).unwrap();
                    break;
                }
                Err(bad) => {
                    if retry.handle_failure(WindowFailure::Integrity) == Verdict::Fail {
                        return Err(Box::new(Response::Error(RemoteError::new(
                            ErrorKind::Integrity,
                            format!("chunk {bad} failed verification"),
                        ))));
                    }
                }
            }
        }
    }
    assert!(plan.is_complete());
    assert_eq!(p.call(Request::Close { transfer }), Response::Ok);
    Ok(())
}

/// Reads `path`'s whole manifest with [`ManifestReader`].
fn read_manifest(p: &mut Pair, path: &str) -> Result<(FileVersion, Vec<Hash256>), ManifestError> {
    let mut reader = ManifestReader::new("s", path, CHUNK);
    while let Some(req) = reader.poll_request() {
        if let Some(m) = reader.handle_page(p.call(req))? {
            return Ok(m);
        }
    }
    panic!("the listing ended without a result");
}

#[test]
fn files_of_every_shape_go_up_and_come_back() {
    let (mut p, sim) = Pair::served();
    for (i, len) in [0usize, 1, 4095, 4096, 4097, 3 * 4096, 50_000]
        .into_iter()
        .enumerate()
    {
        let d = data(len, 13 + i as u32);
        let path = format!("f{len}");
        assert_eq!(
            upload(&mut p, &sim, &path, &d),
            Response::Committed { size: len as u64 }
        );
        assert_eq!(sim.borrow().files[&path], d);
        let mut back = Vec::new();
        download(&mut p, &sim, &path, &mut back, BTreeSet::new()).unwrap();
        assert_eq!(back, d, "{len} bytes");
    }
    // Every transfer was committed or closed: the tables are empty again.
    assert_eq!(p.server.conn().transfers(), 0);
    assert!(p.server_closed().is_none() && p.client_closed().is_none());
}

#[test]
fn a_bit_flipped_on_the_wire_is_caught_by_the_server_core_and_sent_again() {
    let (mut p, sim) = Pair::served();
    let d = data(10 * 4096 + 5, 7);
    sim.borrow_mut().faults.flip_next = 1;
    assert_eq!(
        upload(&mut p, &sim, "f", &d),
        Response::Committed {
            size: d.len() as u64
        }
    );
    assert_eq!(sim.borrow().faults.flipped, 1, "the fault fired");
    assert_eq!(sim.borrow().files["f"], d);
}

#[test]
fn damage_on_every_attempt_fails_the_upload_and_commits_nothing() {
    let (mut p, sim) = Pair::served();
    let d = data(4096, 9);
    sim.borrow_mut().faults.flip_next = usize::MAX;
    let answer = upload(&mut p, &sim, "f", &d);
    assert_eq!(
        error_kind(&answer),
        Some(ErrorKind::Integrity),
        "{answer:?}"
    );
    assert_eq!(sim.borrow().faults.flipped, WINDOW_ATTEMPTS);
    assert!(!sim.borrow().files.contains_key("f"));
    // The upload is still open and incomplete: its commit is refused by the core.
    let manifest = manifest_id(
        HashAlgorithm::Blake3,
        4096,
        CHUNK,
        &[hash_chunk(HashAlgorithm::Blake3, &d)],
    );
    let answer = p.call(Request::UploadCommit {
        transfer: 1,
        manifest,
    });
    assert_eq!(error_kind(&answer), Some(ErrorKind::Protocol), "{answer:?}");
    assert!(!sim.borrow().files.contains_key("f"));
}

#[test]
fn a_download_damaged_in_flight_is_fetched_again() {
    let (mut p, sim) = Pair::served();
    let d = data(7 * 4096, 11);
    sim.borrow_mut().files.insert("f".into(), d.clone());
    sim.borrow_mut().faults.flip_next = 1;
    let mut back = Vec::new();
    download(&mut p, &sim, "f", &mut back, BTreeSet::new()).unwrap();
    assert_eq!(sim.borrow().faults.flipped, 1, "the fault fired");
    assert_eq!(back, d);

    sim.borrow_mut().faults.flip_next = usize::MAX;
    let failed = download(&mut p, &sim, "f", &mut back, BTreeSet::new()).unwrap_err();
    assert_eq!(error_kind(&failed), Some(ErrorKind::Integrity));
    assert_eq!(sim.borrow().faults.flipped, 1 + WINDOW_ATTEMPTS);
}

#[test]
fn a_resumed_download_fetches_only_the_chunks_it_lacks() {
    let (mut p, sim) = Pair::served();
    let d = data(9 * 4096 + 100, 17);
    sim.borrow_mut().files.insert("f".into(), d.clone());
    // A partial copy: chunks 0-3 and 6 are right, the rest are not there.
    let mut partial = vec![0u8; d.len()];
    for i in [0usize, 1, 2, 3, 6] {
        partial[i * 4096..(i + 1) * 4096].copy_from_slice(&d[i * 4096..(i + 1) * 4096]);
    }
    let (version, hashes) = read_manifest(&mut p, "f").unwrap();
    assert_eq!(version.size, d.len() as u64);
    let held: BTreeSet<u64> = hashes
        .iter()
        .enumerate()
        .filter(|(i, h)| {
            let chunk = &partial[i * 4096..((i + 1) * 4096).min(partial.len())];
            hash_chunk(HashAlgorithm::Blake3, chunk) == **h
        })
        .map(|(i, _)| i as u64)
        .collect();
    assert_eq!(held, BTreeSet::from([0, 1, 2, 3, 6]));
    let before = sim.borrow().wire_bytes;
    download(&mut p, &sim, "f", &mut partial, held).unwrap();
    assert_eq!(partial, d);
    assert_eq!(
        sim.borrow().wire_bytes - before,
        (d.len() - 5 * 4096) as u64
    );
}

#[test]
fn a_manifest_is_read_in_pages_and_restarted_when_the_file_changes() {
    let (mut p, sim) = Pair::served();
    let d = data(5 * 4096, 3);
    sim.borrow_mut().files.insert("f".into(), d.clone());
    let (version, hashes) = read_manifest(&mut p, "f").unwrap();
    assert_eq!(hashes, hash_chunks(HashAlgorithm::Blake3, &d, 4096));
    assert_eq!(
        version.manifest,
        manifest_id(HashAlgorithm::Blake3, d.len() as u64, CHUNK, &hashes)
    );

    // The file changes once, at the second page: the listing starts over.
    sim.borrow_mut().faults = Faults {
        change_every_pages: Some(2),
        changes_left: 1,
        ..Faults::default()
    };
    let (version, hashes) = read_manifest(&mut p, "f").unwrap();
    assert_eq!(sim.borrow().faults.changed, 1, "the fault fired once");
    assert_eq!(version.size, d.len() as u64 + 1);
    assert_eq!(hashes.len(), 6);

    // It changes at every page: each attempt sees two versions in its first two
    // pages, and the reader gives up after its attempts.
    sim.borrow_mut().faults = Faults {
        change_every_pages: Some(1),
        changes_left: usize::MAX,
        ..Faults::default()
    };
    match read_manifest(&mut p, "f") {
        Err(ManifestError::Changed(e)) => assert_eq!(e.kind, ErrorKind::Changed),
        other => panic!("{other:?}"),
    }
    assert_eq!(sim.borrow().faults.changed, 2 * MANIFEST_ATTEMPTS);
}

#[test]
fn a_lying_manifest_page_is_refused() {
    let (mut p, sim) = Pair::served();
    sim.borrow_mut().files.insert("f".into(), data(3 * 4096, 5));
    let mut reader = ManifestReader::new("s", "f", CHUNK);
    let mut page = p.call(reader.poll_request().unwrap());
    let Response::Manifest { hashes, .. } = &mut page else {
        panic!("{page:?}");
    };
    hashes[0][0] ^= 1;
    // The first page is taken; the lie shows once the listing is complete.
    assert!(reader.handle_page(page).unwrap().is_none());
    let second = reader.handle_page(p.call(reader.poll_request().unwrap()));
    assert!(second.unwrap().is_none());
    let last = reader.handle_page(p.call(reader.poll_request().unwrap()));
    assert!(matches!(last, Err(ManifestError::Protocol(_))), "{last:?}");
    assert!(reader.poll_request().is_none());
}

#[test]
fn batches_carry_many_files_in_one_operation_each_way() {
    let (mut p, sim) = Pair::served();
    let files: Vec<(String, Vec<u8>)> = (0..10)
        .map(|i| (format!("small/{i}"), data(100 + i * 37, 3 + i as u32)))
        .collect();
    let bytes: Vec<u8> = files.iter().flat_map(|(_, d)| d.clone()).collect();
    let region = sim.borrow_mut().memory.register(bytes);
    let batch: Vec<BatchFile> = files
        .iter()
        .map(|(path, d)| BatchFile {
            path: path.clone(),
            size: d.len() as u64,
            mode: 0o644,
            mtime: MTIME,
            hash: hash_chunk(HashAlgorithm::Blake3, d),
        })
        .collect();
    sim.borrow_mut().faults.flip_next = 1;
    let answer = p.call(Request::UploadBatch {
        algorithm: HashAlgorithm::Blake3,
        share: "s".into(),
        region,
        files: batch,
    });
    assert_eq!(sim.borrow().faults.flipped, 1, "the fault fired");
    let Response::UploadedBatch { results } = answer else {
        panic!("{answer:?}");
    };
    // One file held the flipped byte; only it failed.
    let failed: Vec<usize> = (0..results.len())
        .filter(|&i| results[i].is_some())
        .collect();
    assert_eq!(failed.len(), 1);
    for (i, (path, d)) in files.iter().enumerate() {
        assert_eq!(
            sim.borrow().files.get(path) == Some(d),
            !failed.contains(&i)
        );
    }

    let paths: Vec<String> = files.iter().map(|(p, _)| p.clone()).collect();
    let region = sim.borrow_mut().memory.register(vec![0; 1 << 16]);
    let answer = p.call(Request::DownloadBatch {
        share: "s".into(),
        paths,
        region,
    });
    let back = sim.borrow_mut().memory.revoke(&region);
    let Response::DownloadedBatch { files: got } = answer else {
        panic!("{answer:?}");
    };
    for (i, entry) in got.iter().enumerate() {
        match entry {
            BatchedFile::Ok {
                attr, offset, hash, ..
            } => {
                let bytes = &back[*offset as usize..(*offset + attr.size) as usize];
                assert_eq!(hash_chunk(HashAlgorithm::Blake3, bytes), *hash);
                assert_eq!(bytes, &files[i].1[..]);
            }
            BatchedFile::Err(e) => {
                assert!(failed.contains(&i));
                assert_eq!(e.kind, ErrorKind::NotFound);
            }
            BatchedFile::NotIncluded => panic!("file {i} left out"),
        }
    }
}

#[test]
fn a_mapped_file_is_read_one_sided_and_verified_against_its_manifest() {
    let (mut p, sim) = Pair::served();
    let d = data(6 * 4096 + 10, 23);
    sim.borrow_mut().files.insert("m".into(), d.clone());
    let answer = p.call(Request::MapOpen {
        share: "s".into(),
        path: "m".into(),
        chunk_bytes: CHUNK,
    });
    let Response::Mapped(mapped) = answer else {
        panic!("{answer:?}");
    };
    assert_eq!(p.server.conn().maps(), 1);
    let layout = MappedLayout::new(&mapped, 1 << 20).unwrap();
    // The server's memory holds the file, then its hashes; READs of it need no request.
    let memory = sim.borrow().maps[&mapped.handle].clone();
    let mut fetch = layout.manifest_fetch();
    while let Some(read) = fetch.poll_read() {
        let at = d.len() + read.offset as usize;
        fetch.handle_read(&memory[at..at + read.len as usize]);
    }
    let hashes = fetch.finish().unwrap();
    for i in 0..layout.chunks() {
        let range = layout.chunk_range(i);
        let chunk = &memory[range.start as usize..range.end as usize];
        assert_eq!(hash_chunk(HashAlgorithm::Blake3, chunk), hashes[i as usize]);
        assert_eq!(chunk, &d[range.start as usize..range.end as usize]);
    }
    let requests = p.reached_driver();
    assert_eq!(
        p.call(Request::MapRelease {
            handle: mapped.handle
        }),
        Response::Ok
    );
    assert_eq!(p.reached_driver(), requests + 1);
    assert_eq!(p.server.conn().maps(), 0);
}
