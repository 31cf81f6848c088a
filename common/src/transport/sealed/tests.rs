use super::*;
use crate::seal::{transcript, KeyShare, RekeyPolicy};
use crate::transport::tcp::Tcp;
use crate::transport::FileWindow;
use std::io::Write;
use tokio::net::TcpListener;

/// A TCP pair on loopback.
async fn tcp_pair() -> (Arc<Tcp>, Arc<Tcp>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = tokio::join!(Tcp::connect(addr), async {
        Tcp::start(l.accept().await.unwrap().0).await
    });
    (Arc::new(a.unwrap()), Arc::new(b.unwrap()))
}

/// Wrappers over `a` (the client side) and `b`, armed with keys from a real exchange,
/// updating keys under `rekey` (`None`: as with an older peer).
fn armed(
    a: SharedTransport,
    b: SharedTransport,
    suite: Suite,
    rekey: Option<RekeyPolicy>,
) -> (Arc<Sealed>, Arc<Sealed>) {
    let (ka, kb) = (KeyShare::generate().unwrap(), KeyShare::generate().unwrap());
    let (pa, pb) = (ka.public(), kb.public());
    let t = transcript(b"hello", b"welcome");
    let (sa, sb) = (Sealed::new(a), Sealed::new(b));
    sa.arm(ka.agree(&pb, &t, suite, true, rekey).unwrap())
        .unwrap();
    sb.arm(kb.agree(&pa, &t, suite, false, rekey).unwrap())
        .unwrap();
    (sa, sb)
}

/// Two armed wrappers over a TCP pair on loopback, and the pair itself.
async fn pair(suite: Suite) -> (Arc<Sealed>, Arc<Sealed>, Arc<Tcp>, Arc<Tcp>) {
    pair_with(suite, Some(RekeyPolicy::default())).await
}

async fn pair_with(
    suite: Suite,
    rekey: Option<RekeyPolicy>,
) -> (Arc<Sealed>, Arc<Sealed>, Arc<Tcp>, Arc<Tcp>) {
    let (a, b) = tcp_pair().await;
    let (sa, sb) = armed(a.clone(), b.clone(), suite, rekey);
    (sa, sb, a, b)
}

/// A policy that updates keys after every `bytes` sealed.
fn every(bytes: u64) -> Option<RekeyPolicy> {
    Some(RekeyPolicy {
        after_bytes: bytes,
        ..RekeyPolicy::default()
    })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn buffer(bytes: &[u8]) -> Arc<Buffer> {
    let b = Buffer::new(bytes.len()).unwrap();
    b.write().await.copy_from_slice(bytes);
    b
}

#[tokio::test]
async fn messages_reads_and_writes_cross_sealed() {
    let policies = [None, Some(RekeyPolicy::default()), every(300 << 10)];
    for (suite, rekey) in Suite::ALL
        .into_iter()
        .flat_map(|s| policies.map(|p| (s, p)))
    {
        let (a, b, _, _) = pair_with(suite, rekey).await;
        a.send(b"request".to_vec()).await.unwrap();
        assert_eq!(b.recv().await.unwrap().unwrap(), b"request");
        b.send(b"response".to_vec()).await.unwrap();
        assert_eq!(a.recv().await.unwrap().unwrap(), b"response");

        // B exposes 3.5 pieces of data read-only; A pulls all of it (several pieces).
        let len = PIECE_BYTES * 3 + PIECE_BYTES / 2;
        let data = pattern(len, 3);
        let exposed = b
            .register(Memory::Buffer(buffer(&data).await), Access::RemoteRead)
            .unwrap();
        let dst_buf = Buffer::new(len + 10).unwrap();
        let dst = a
            .register(Memory::Buffer(dst_buf.clone()), Access::Local)
            .unwrap();
        let src = RemoteSlice::of(&exposed.desc(), 0, len as u32).unwrap();
        a.read(src, &dst, 10).await.unwrap();
        assert_eq!(&dst_buf.read().await[10..], &data[..]);

        // A pushes a slice into B's writable buffer.
        let target_buf = Buffer::new(4096).unwrap();
        let target = b
            .register(Memory::Buffer(target_buf.clone()), Access::RemoteWrite)
            .unwrap();
        let dst_slice = RemoteSlice::of(&target.desc(), 100, 1000).unwrap();
        a.write(&dst, 10 + 5, dst_slice).await.unwrap();
        assert_eq!(&target_buf.read().await[100..1100], &data[5..1005]);
        assert!(target_buf.read().await[..100].iter().all(|&x| x == 0));
    }
}

#[tokio::test]
async fn a_file_window_is_served_by_copy_and_its_truncation_is_a_refusal() {
    let (a, b, _, _) = pair(Suite::Aes256Gcm).await;
    let data = pattern(3 * 4096, 9);
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&data).unwrap();
    let window = FileWindow::map(&f, 0, data.len()).unwrap();
    let exposed = b
        .register(Memory::File(window), Access::RemoteRead)
        .unwrap();
    assert!(b
        .register(
            Memory::File(FileWindow::map(&f, 0, 4096).unwrap()),
            Access::RemoteWrite
        )
        .is_err());
    let dst_buf = Buffer::new(data.len()).unwrap();
    let dst = a
        .register(Memory::Buffer(dst_buf.clone()), Access::Local)
        .unwrap();
    a.read(
        RemoteSlice::of(&exposed.desc(), 0, data.len() as u32).unwrap(),
        &dst,
        0,
    )
    .await
    .unwrap();
    assert_eq!(&dst_buf.read().await[..], &data[..]);
    f.set_len(4096).unwrap();
    let err = a
        .read(
            RemoteSlice::of(&exposed.desc(), 4096, 4096).unwrap(),
            &dst,
            0,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::RemoteAccess {
                fault: AccessFault::Refused,
                ..
            }
        ),
        "{err}"
    );
    // The connection goes on.
    a.send(b"still here".to_vec()).await.unwrap();
    assert_eq!(b.recv().await.unwrap().unwrap(), b"still here");
}

#[tokio::test]
async fn bad_rkeys_bounds_and_access_are_refused_by_the_owner() {
    let (a, b, _, _) = pair(Suite::ChaCha20Poly1305).await;
    let ro = b
        .register(
            Memory::Buffer(buffer(&[1u8; 4096]).await),
            Access::RemoteRead,
        )
        .unwrap();
    let dst_buf = Buffer::new(8192).unwrap();
    let dst = a.register(Memory::Buffer(dst_buf), Access::Local).unwrap();
    let desc = ro.desc();
    let fault = |e: TransportError| match e {
        TransportError::RemoteAccess { fault, .. } => fault,
        other => panic!("{other}"),
    };
    let past = RemoteSlice {
        rkey: desc.rkey,
        addr: desc.addr + 4000,
        len: 200,
    };
    assert_eq!(
        fault(a.read(past, &dst, 0).await.unwrap_err()),
        AccessFault::OutOfBounds
    );
    let wrong = RemoteSlice {
        rkey: desc.rkey + 1000,
        addr: desc.addr,
        len: 10,
    };
    assert_eq!(
        fault(a.read(wrong, &dst, 0).await.unwrap_err()),
        AccessFault::InvalidRkey
    );
    let write = RemoteSlice {
        rkey: desc.rkey,
        addr: desc.addr,
        len: 10,
    };
    assert_eq!(
        fault(a.write(&dst, 0, write).await.unwrap_err()),
        AccessFault::Denied
    );
    // A revoked registration is gone.
    drop(ro);
    assert_eq!(
        fault(a.read(write, &dst, 0).await.unwrap_err()),
        AccessFault::InvalidRkey
    );
    // The peer's plaintext is not reachable through the inner transport: the inner
    // registration of the local buffer is local-only.
    let local_only = b
        .register(
            Memory::Buffer(buffer(&[2u8; 64]).await),
            Access::RemoteWrite,
        )
        .unwrap();
    let inner_local = local_only
        .backend::<Handle>()
        .unwrap()
        .entry
        .local
        .as_ref()
        .unwrap()
        .desc();
    let direct = RemoteSlice {
        rkey: inner_local.rkey,
        addr: inner_local.addr,
        len: 64,
    };
    let inner_a = a.shared.inner.clone();
    let inner_dst = inner_a
        .register(Memory::Buffer(Buffer::new(64).unwrap()), Access::Local)
        .unwrap();
    assert!(inner_a.read(direct, &inner_dst, 0).await.is_err());
}

#[tokio::test]
async fn a_forged_record_ends_the_connection_with_a_clear_error() {
    let (a, b, inner_a, _) = pair(Suite::Aes256Gcm).await;
    // Something on the path injects a frame the sealer did not make.
    inner_a
        .send(b"not a sealed record at all".to_vec())
        .await
        .unwrap();
    let err = b.recv().await.unwrap_err();
    assert!(err.to_string().contains("failed authentication"), "{err}");
    drop(a);
}

/// A's inner transport, flipping one bit of whatever a READ brought in: an attacker
/// on the wire changing ciphertext.
struct Flipping(Arc<Tcp>);

#[async_trait]
impl Transport for Flipping {
    fn kind(&self) -> TransportKind {
        self.0.kind()
    }
    fn peer(&self) -> String {
        self.0.peer()
    }
    fn register(&self, memory: Memory, access: Access) -> Result<Registration, TransportError> {
        self.0.register(memory, access)
    }
    async fn read(
        &self,
        src: RemoteSlice,
        dst: &Registration,
        off: usize,
    ) -> Result<(), TransportError> {
        self.0.read(src, dst, off).await?;
        dst.buffer().unwrap().write().await[off] ^= 0x01;
        Ok(())
    }
    async fn write(
        &self,
        src: &Registration,
        off: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError> {
        self.0.write(src, off, dst).await
    }
    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError> {
        self.0.send(msg).await
    }
    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        self.0.recv().await
    }
    fn close(&self) {
        self.0.close()
    }
}

#[tokio::test]
async fn a_forged_piece_fails_the_read_and_the_connection() {
    // A pair whose A side flips bits in what it reads.
    let (x, y) = tcp_pair().await;
    let (a, b) = armed(Arc::new(Flipping(x)), y, Suite::Aes256Gcm, every(4096));
    let exposed = b
        .register(
            Memory::Buffer(buffer(&pattern(8192, 1)).await),
            Access::RemoteRead,
        )
        .unwrap();
    let dst_buf = Buffer::new(8192).unwrap();
    let dst = a
        .register(Memory::Buffer(dst_buf.clone()), Access::Local)
        .unwrap();
    let src = RemoteSlice::of(&exposed.desc(), 0, 8192).unwrap();
    let err = a.read(src, &dst, 0).await.unwrap_err();
    assert!(err.to_string().contains("failed authentication"), "{err}");
    // The wrapper closed the connection: B sees it end, A's next send fails.
    assert!(b.recv().await.map(|m| m.is_none()).unwrap_or(true));
    assert!(a.send(b"x".to_vec()).await.is_err());
    // And A's application never saw plaintext of the forged piece.
    assert_ne!(&dst_buf.read().await[..], &pattern(8192, 1)[..]);
}

/// The generations `s` sends under now: (control, data).
async fn generations(s: &Sealed) -> (u32, u32) {
    let control = s
        .shared
        .sealer
        .lock()
        .await
        .as_ref()
        .unwrap()
        .sealer
        .generation();
    (control, s.shared.armed().data_send.generation())
}

#[tokio::test]
async fn keys_update_in_both_directions_while_reads_and_writes_run_concurrently() {
    const LEN: usize = 8 << 20;
    let (a, b, _, _) = pair_with(Suite::Aes256Gcm, every(256 << 10)).await;
    let (a_data, b_data) = (pattern(LEN, 1), pattern(LEN, 2));
    let exposed_a = a
        .register(Memory::Buffer(buffer(&a_data).await), Access::RemoteRead)
        .unwrap();
    let exposed_b = b
        .register(Memory::Buffer(buffer(&b_data).await), Access::RemoteRead)
        .unwrap();
    let (into_a, into_b) = (Buffer::new(LEN).unwrap(), Buffer::new(LEN).unwrap());
    let local_a = Arc::new(
        a.register(Memory::Buffer(into_a.clone()), Access::Local)
            .unwrap(),
    );
    let local_b = Arc::new(
        b.register(Memory::Buffer(into_b.clone()), Access::Local)
            .unwrap(),
    );
    // Each side pulls the other's memory in 8 concurrent reads of 1 MiB each, so pieces
    // of several generations are in flight at once in both directions.
    let step = LEN / 8;
    let mut tasks = Vec::new();
    for i in 0..8 {
        for (reader, exposed, local) in [
            (a.clone(), exposed_b.desc(), local_a.clone()),
            (b.clone(), exposed_a.desc(), local_b.clone()),
        ] {
            let src = RemoteSlice::of(&exposed, (i * step) as u64, step as u32).unwrap();
            tasks.push(tokio::spawn(async move {
                reader.read(src, &local, i * step).await
            }));
        }
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(into_a.read().await[..] == b_data[..], "A read B's bytes");
    assert!(into_b.read().await[..] == a_data[..], "B read A's bytes");
    // Both sides sealed eight 1 MiB pieces under 256 KiB budgets: a new data key for
    // each piece after the first, and the control key moved with them.
    for s in [&a, &b] {
        let (control, data) = generations(s).await;
        assert_eq!(data, 7, "data generation");
        assert!(control >= 1, "control generation {control}");
    }
    // Messages still cross after all the updates.
    a.send(b"after".to_vec()).await.unwrap();
    assert_eq!(b.recv().await.unwrap().unwrap(), b"after");
}

#[test]
fn pieces_cover_an_operation_exactly() {
    let all: Vec<_> = pieces(0).collect();
    assert_eq!(all, vec![(0, 0)]);
    let all: Vec<_> = pieces(PIECE_BYTES as u32 * 2 + 5).collect();
    assert_eq!(
        all,
        vec![
            (0, PIECE_BYTES as u32),
            (PIECE_BYTES as u32, PIECE_BYTES as u32),
            (2 * PIECE_BYTES as u32, 5)
        ]
    );
}
