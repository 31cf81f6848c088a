use super::*;
use crate::transport::{AccessFault, FileWindow, Op};
use tokio::net::TcpListener;

async fn pair() -> (Tcp, Tcp) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = tokio::join!(Tcp::connect(addr), async {
        Tcp::start(l.accept().await.unwrap().0).await
    });
    (a.unwrap(), b.unwrap())
}

async fn filled(len: usize, seed: u8) -> Arc<Buffer> {
    let b = Buffer::new(len).unwrap();
    let mut g = b.write().await;
    for (i, x) in g.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    drop(g);
    b
}

#[tokio::test]
async fn control_messages_arrive_in_order() {
    let (a, b) = pair().await;
    for i in 0..100u8 {
        a.send(vec![i; i as usize]).await.unwrap();
    }
    for i in 0..100u8 {
        assert_eq!(b.recv().await.unwrap().unwrap(), vec![i; i as usize]);
    }
    drop(a);
    assert!(b.recv().await.unwrap().is_none());
}

#[tokio::test]
async fn read_pulls_peer_memory_without_peer_code() {
    let (a, b) = pair().await;
    let src = filled(3 << 20, 1).await;
    let reg = b
        .register(Memory::Buffer(src.clone()), Access::RemoteRead)
        .unwrap();
    let dst = a
        .register(Memory::Buffer(Buffer::new(1 << 20).unwrap()), Access::Local)
        .unwrap();
    let slice = RemoteSlice::of(&reg.desc(), 2 << 20, 1 << 20).unwrap();
    a.read(slice, &dst, 0).await.unwrap();
    assert_eq!(
        &dst.buffer().unwrap().read().await[..],
        &src.read().await[2 << 20..]
    );
}

#[tokio::test]
async fn write_pushes_into_peer_buffer() {
    let (a, b) = pair().await;
    let target = Buffer::new(8192).unwrap();
    let reg = b
        .register(Memory::Buffer(target.clone()), Access::RemoteWrite)
        .unwrap();
    let src = a
        .register(Memory::Buffer(filled(4096, 9).await), Access::Local)
        .unwrap();
    let slice = RemoteSlice::of(&reg.desc(), 100, 4000).unwrap();
    a.write(&src, 96, slice).await.unwrap();
    let t = target.read().await;
    assert!(t[..100].iter().all(|&x| x == 0));
    assert_eq!(&t[100..4100], &src.buffer().unwrap().read().await[96..4096]);
    assert!(t[4100..].iter().all(|&x| x == 0));
}

fn fault(e: TransportError) -> (Op, AccessFault) {
    match e {
        TransportError::RemoteAccess { op, fault, .. } => (op, fault),
        other => panic!("expected a remote access error, got {other}"),
    }
}

#[tokio::test]
async fn refused_accesses_leave_memory_untouched() {
    let (a, b) = pair().await;
    let target = Buffer::new(4096).unwrap();
    let rw = b
        .register(Memory::Buffer(target.clone()), Access::RemoteWrite)
        .unwrap();
    let ro = b
        .register(Memory::Buffer(target.clone()), Access::RemoteRead)
        .unwrap();
    let src = a
        .register(Memory::Buffer(filled(8192, 3).await), Access::Local)
        .unwrap();
    let desc = rw.desc();

    // Past the end.
    let oob = RemoteSlice {
        rkey: desc.rkey,
        addr: desc.addr + 4000,
        len: 200,
    };
    assert_eq!(
        fault(a.write(&src, 0, oob).await.unwrap_err()),
        (Op::Write, AccessFault::OutOfBounds)
    );
    assert_eq!(
        fault(a.read(oob, &src, 0).await.unwrap_err()),
        (Op::Read, AccessFault::OutOfBounds)
    );
    // Before the start.
    let before = RemoteSlice {
        rkey: desc.rkey,
        addr: desc.addr - 1,
        len: 2,
    };
    assert_eq!(
        fault(a.write(&src, 0, before).await.unwrap_err()).1,
        AccessFault::OutOfBounds
    );
    // Read-only region.
    let ro_slice = RemoteSlice::of(&ro.desc(), 0, 10).unwrap();
    assert_eq!(
        fault(a.write(&src, 0, ro_slice).await.unwrap_err()),
        (Op::Write, AccessFault::Denied)
    );
    // Revoked rkey.
    let slice = RemoteSlice::of(&desc, 0, 10).unwrap();
    drop(rw);
    assert_eq!(
        fault(a.write(&src, 0, slice).await.unwrap_err()).1,
        AccessFault::InvalidRkey
    );
    assert!(target.read().await.iter().all(|&x| x == 0));

    // The connection still works after refusals.
    a.read(ro_slice, &src, 0).await.unwrap();
    a.send(b"still here".to_vec()).await.unwrap();
    assert_eq!(b.recv().await.unwrap().unwrap(), b"still here");
}

#[tokio::test]
async fn file_windows_cannot_be_registered_writable() {
    use std::io::Write;
    let (a, _b) = pair().await;
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&[1; 4096]).unwrap();
    let w = FileWindow::map(&f, 0, 4096).unwrap();
    assert!(matches!(
        a.register(Memory::File(w.clone()), Access::RemoteWrite),
        Err(TransportError::Local(_))
    ));
    assert!(a.register(Memory::File(w), Access::RemoteRead).is_ok());
}

#[tokio::test]
async fn file_windows_are_served_by_pread() {
    use std::io::Write;
    let (a, b) = pair().await;
    let mut f = tempfile::tempfile().unwrap();
    let data: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 253) as u8).collect();
    f.write_all(&data).unwrap();
    let window = FileWindow::map(&f, 4096, 8192).unwrap();
    let reg = b
        .register(Memory::File(window.clone()), Access::RemoteRead)
        .unwrap();
    let dst = a
        .register(Memory::Buffer(Buffer::new(8192).unwrap()), Access::Local)
        .unwrap();
    a.read(RemoteSlice::of(&reg.desc(), 0, 8192).unwrap(), &dst, 0)
        .await
        .unwrap();
    assert_eq!(&dst.buffer().unwrap().read().await[..], &data[4096..]);

    // Our own WRITE out of a file window.
    let target = Buffer::new(8192).unwrap();
    let peer_buf = b
        .register(Memory::Buffer(target.clone()), Access::RemoteWrite)
        .unwrap();
    let src = a.register(Memory::File(window), Access::Local).unwrap();
    a.write(
        &src,
        100,
        RemoteSlice::of(&peer_buf.desc(), 0, 8000).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(&target.read().await[..8000], &data[4196..12196]);
}

#[tokio::test]
async fn a_truncated_file_window_fails_the_operation_not_the_process() {
    use std::io::Write;
    let (a, b) = pair().await;
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&[5; 3 * 4096]).unwrap();
    let window = FileWindow::map(&f, 0, 3 * 4096).unwrap();
    let reg = b
        .register(Memory::File(window.clone()), Access::RemoteRead)
        .unwrap();
    f.set_len(4096).unwrap();
    let dst = a
        .register(
            Memory::Buffer(Buffer::new(3 * 4096).unwrap()),
            Access::Local,
        )
        .unwrap();
    // Touching the vanished pages through the mapping would raise SIGBUS here.
    let past_end = RemoteSlice::of(&reg.desc(), 4096, 4096).unwrap();
    assert_eq!(
        fault(a.read(past_end, &dst, 0).await.unwrap_err()),
        (Op::Read, AccessFault::Refused)
    );
    // The part still backed by the file reads fine on the same connection.
    a.read(RemoteSlice::of(&reg.desc(), 0, 4096).unwrap(), &dst, 0)
        .await
        .unwrap();
    assert!(dst.buffer().unwrap().read().await[..4096]
        .iter()
        .all(|&x| x == 5));

    // Our own WRITE from the truncated window fails locally with an I/O error and
    // sends nothing.
    let target = Buffer::new(4096).unwrap();
    let peer_buf = b
        .register(Memory::Buffer(target.clone()), Access::RemoteWrite)
        .unwrap();
    let src = b.register(Memory::File(window), Access::Local).unwrap();
    let theirs = a
        .register(
            Memory::Buffer(Buffer::new(4096).unwrap()),
            Access::RemoteWrite,
        )
        .unwrap();
    assert!(matches!(
        b.write(
            &src,
            8192,
            RemoteSlice::of(&theirs.desc(), 0, 4096).unwrap()
        )
        .await,
        Err(TransportError::Io { .. })
    ));
    drop(peer_buf);
    a.send(b"still here".to_vec()).await.unwrap();
    assert_eq!(b.recv().await.unwrap().unwrap(), b"still here");
}

#[tokio::test]
async fn local_bounds_are_checked_before_sending() {
    let (a, b) = pair().await;
    let reg = b
        .register(
            Memory::Buffer(Buffer::new(4096).unwrap()),
            Access::RemoteWrite,
        )
        .unwrap();
    let small = a
        .register(Memory::Buffer(Buffer::new(10).unwrap()), Access::Local)
        .unwrap();
    let slice = RemoteSlice::of(&reg.desc(), 0, 100).unwrap();
    assert!(matches!(
        a.read(slice, &small, 0).await,
        Err(TransportError::Local(_))
    ));
    assert!(matches!(
        a.write(&small, 5, slice).await,
        Err(TransportError::Local(_))
    ));
    assert!(RemoteSlice::of(&reg.desc(), 4000, 100).is_none());
}

#[tokio::test]
async fn registrations_are_revoked_on_drop() {
    let (a, _b) = pair().await;
    let regs: Vec<_> = (0..10)
        .map(|_| {
            a.register(Memory::Buffer(Buffer::new(1).unwrap()), Access::RemoteRead)
                .unwrap()
        })
        .collect();
    assert_eq!(a.registrations(), 10);
    drop(regs);
    assert_eq!(a.registrations(), 0);
}

#[tokio::test]
async fn pending_operations_fail_when_the_peer_dies() {
    let (a, b) = pair().await;
    let reg = b
        .register(
            Memory::Buffer(Buffer::new(4096).unwrap()),
            Access::RemoteRead,
        )
        .unwrap();
    let slice = RemoteSlice::of(&reg.desc(), 0, 4096).unwrap();
    drop(b);
    let dst = a
        .register(Memory::Buffer(Buffer::new(4096).unwrap()), Access::Local)
        .unwrap();
    // Either the READ raced the close and failed, or it was refused at submission.
    let r = a.read(slice, &dst, 0).await;
    assert!(r.is_err());
    assert!(a.recv().await.unwrap().is_none());
    assert!(matches!(a.send(vec![1]).await, Err(TransportError::Closed)));
}

async fn raw_peer(frames: &[u8]) -> Tcp {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let frames = frames.to_vec();
    tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&wire::GREETING).await.unwrap();
        s.write_all(&frames).await.unwrap();
        s.shutdown().await.unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    });
    Tcp::start(l.accept().await.unwrap().0).await.unwrap()
}

#[tokio::test]
async fn oversized_control_frame_is_a_protocol_error() {
    let mut f = vec![wire::CTRL];
    f.extend_from_slice(&u32::MAX.to_le_bytes());
    let t = raw_peer(&f).await;
    assert!(matches!(t.recv().await, Err(TransportError::Protocol(_))));
}

#[tokio::test]
async fn unknown_frame_kind_is_a_protocol_error() {
    let t = raw_peer(&[0x7f, 1, 2, 3]).await;
    assert!(matches!(t.recv().await, Err(TransportError::Protocol(_))));
}

#[tokio::test]
async fn response_to_unknown_operation_is_a_protocol_error() {
    let mut f = vec![wire::WRITE_RESP];
    f.extend_from_slice(&99u64.to_le_bytes());
    f.push(0);
    let t = raw_peer(&f).await;
    assert!(matches!(t.recv().await, Err(TransportError::Protocol(_))));
}

#[tokio::test]
async fn truncated_frame_is_an_error_not_a_clean_close() {
    let t = raw_peer(&[wire::CTRL, 10, 0, 0, 0, 1, 2]).await;
    assert!(t.recv().await.is_err());
}

#[tokio::test]
async fn wrong_greeting_is_refused() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"SSH-2.0-").await.unwrap();
        let mut sink = [0u8; 8];
        let _ = s.read_exact(&mut sink).await;
    });
    let r = Tcp::start(l.accept().await.unwrap().0).await;
    assert!(matches!(r, Err(TransportError::Protocol(_))));
}

/// A connected transport whose peer greets it and then never reads; the peer's socket
/// is returned so it stays open.
async fn peer_that_never_reads() -> (Arc<Tcp>, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let peer = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&wire::GREETING).await.unwrap();
        s
    });
    let t = Tcp::start(l.accept().await.unwrap().0).await.unwrap();
    (Arc::new(t), peer.await.unwrap())
}

#[tokio::test]
async fn send_waits_once_the_queue_is_full_and_close_fails_the_waiter() {
    let (t, _peer) = peer_that_never_reads().await;
    let msg = vec![7u8; crate::codec::MAX_CTRL_FRAME_BYTES];
    // The socket buffers take some messages, the queue MAX_QUEUED_CTRL_BYTES more;
    // then a send must wait.
    let mut sent = 0;
    while tokio::time::timeout(Duration::from_millis(300), t.send(msg.clone()))
        .await
        .is_ok()
    {
        sent += 1;
        assert!(
            sent < 256,
            "{sent} MiB queued for a peer that reads nothing"
        );
    }
    let waiting = tokio::spawn({
        let t = t.clone();
        async move { t.send(vec![1]).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !waiting.is_finished(),
        "a send waits while the queue is full"
    );
    t.close();
    let r = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("close ends a waiting send")
        .unwrap();
    assert!(matches!(r, Err(TransportError::Closed)), "{r:?}");
}

#[tokio::test]
async fn file_window_operations_larger_than_a_staging_piece_arrive_whole() {
    use std::io::Write;
    let (a, b) = pair().await;
    let len = 2 * engine::STAGE_PIECE_BYTES + 4096 + 123;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&data).unwrap();
    let window = FileWindow::map(&f, 0, len).unwrap();
    let reg = b
        .register(Memory::File(window.clone()), Access::RemoteRead)
        .unwrap();
    let dst = a
        .register(Memory::Buffer(Buffer::new(len).unwrap()), Access::Local)
        .unwrap();
    a.read(
        RemoteSlice::of(&reg.desc(), 0, len as u32).unwrap(),
        &dst,
        0,
    )
    .await
    .unwrap();
    assert!(dst.buffer().unwrap().read().await[..] == data[..]);

    // Our own WRITE out of a file window, in pieces too.
    let target = Buffer::new(len).unwrap();
    let theirs = a
        .register(Memory::Buffer(target.clone()), Access::RemoteWrite)
        .unwrap();
    let src = b.register(Memory::File(window), Access::Local).unwrap();
    let n = len as u32 - 1;
    b.write(&src, 1, RemoteSlice::of(&theirs.desc(), 0, n).unwrap())
        .await
        .unwrap();
    assert!(target.read().await[..len - 1] == data[1..]);
}

#[tokio::test]
async fn a_peer_that_sends_more_messages_than_may_wait_is_cut_off() {
    let frames: Vec<u8> = (0..=CTRL_QUEUE)
        .flat_map(|_| [wire::CTRL, 1, 0, 0, 0, 7])
        .collect();
    let t = raw_peer(&frames).await;
    // The engine does not stop reading for the application: it ends the connection.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..CTRL_QUEUE {
        assert_eq!(t.recv().await.unwrap(), Some(vec![7]));
    }
    assert!(matches!(t.recv().await, Err(TransportError::Protocol(_))));
}

#[tokio::test]
async fn a_side_refuses_control_frames_over_its_own_limit() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let peer = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&wire::GREETING).await.unwrap();
        for len in [64u32, 65] {
            let mut f = vec![wire::CTRL];
            f.extend_from_slice(&len.to_le_bytes());
            f.resize(5 + len as usize, 1);
            // The second may find the connection closed already.
            let _ = s.write_all(&f).await;
        }
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    });
    let t = Tcp::start_with_limit(l.accept().await.unwrap().0, 64)
        .await
        .unwrap();
    assert_eq!(t.recv().await.unwrap(), Some(vec![1; 64]));
    assert!(matches!(t.recv().await, Err(TransportError::Protocol(_))));
    peer.await.unwrap();
}

/// A message of `len` bytes that names its place `i` in the sequence.
fn numbered(i: u32, len: usize) -> Vec<u8> {
    let mut m = vec![(i % 251) as u8; len.max(4)];
    m[..4].copy_from_slice(&i.to_le_bytes());
    m
}

#[tokio::test]
async fn direct_and_queued_frames_keep_their_order_through_a_full_socket() {
    // Small messages are written by the sender itself, large ones by the writer task;
    // while the peer reads nothing the socket fills, direct writes stop part-way and
    // their rest is queued. Every message must still arrive whole and in order.
    let (a, b) = pair().await;
    let a = Arc::new(a);
    let big = engine::DIRECT_BYTES * 3;
    let count = 120u32;
    let sender = tokio::spawn({
        let a = a.clone();
        async move {
            for i in 0..count {
                let len = if i % 3 == 1 { big } else { 10 + i as usize };
                a.send(numbered(i, len)).await.unwrap();
            }
        }
    });
    // Let the socket buffers fill before anything is read.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for i in 0..count {
        let len = if i % 3 == 1 { big } else { 10 + i as usize };
        let got = b.recv().await.unwrap().unwrap();
        assert!(
            got == numbered(i, len),
            "message {i} arrived out of order or torn"
        );
    }
    sender.await.unwrap();
    assert_eq!(
        a.shared.gate().queued,
        0,
        "the writer counted every frame out"
    );
}

#[tokio::test]
async fn small_reads_of_an_uncached_file_window_are_served_from_the_blocking_pool() {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let (a, b) = pair().await;
    // Not tmpfs: its pages cannot be dropped from the cache.
    let mut f = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 241) as u8).collect();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    posix_fadvise(f.as_raw_fd(), 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED).unwrap();
    let window = FileWindow::map(&f, 0, 1 << 20).unwrap();
    let reg = b
        .register(Memory::File(window), Access::RemoteRead)
        .unwrap();
    // More READs at once than BLOCKING_READS: the rest take the writer's path.
    let reads = 64usize;
    let piece = 16 << 10;
    let dst = Arc::new(
        a.register(
            Memory::Buffer(Buffer::new(reads * piece).unwrap()),
            Access::Local,
        )
        .unwrap(),
    );
    let a = Arc::new(a);
    let mut all = tokio::task::JoinSet::new();
    for i in 0..reads {
        let src = RemoteSlice::of(&reg.desc(), (i * piece) as u64, piece as u32).unwrap();
        let (a, dst) = (a.clone(), dst.clone());
        all.spawn(async move { a.read(src, &dst, i * piece).await });
    }
    while let Some(r) = all.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(
        &dst.buffer().unwrap().read().await[..],
        &data[..reads * piece]
    );
    assert_eq!(b.shared.blocking_reads.load(Ordering::SeqCst), 0);
    // A blocking-pool thread counts its answer out just after the socket took it, so
    // the count may still be settling when the last answer has arrived.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while b.shared.served_inflight.load(Ordering::SeqCst) != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "served READs never counted out"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
