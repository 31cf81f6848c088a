//! `fallocate` through `ferry-mount` (issue 42, point 3): punching holes and zeroing
//! ranges (capability `falloc`) in a file with buffered writes pending before and
//! after, compared byte for byte with a local file given the same operations, through
//! the same descriptor, after close on the same mount, on a second mount and on the
//! server.

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use ferry_tests::{skip_without_fuse, Env, Mount};
use nix::fcntl::{fallocate, FallocateFlags};

const MIB: u64 = 1 << 20;

/// The same operation on the local file and the mount's.
struct Twin {
    local: File,
    mounted: File,
}

impl Twin {
    fn open(local: &Path, mounted: &Path) -> Twin {
        let open = |p: &Path| OpenOptions::new().read(true).write(true).open(p).unwrap();
        Twin {
            local: open(local),
            mounted: open(mounted),
        }
    }

    fn write(&self, at: u64, data: &[u8]) {
        self.local.write_all_at(data, at).unwrap();
        self.mounted.write_all_at(data, at).unwrap();
    }

    fn fallocate(&self, flags: FallocateFlags, at: u64, len: u64) {
        for f in [&self.local, &self.mounted] {
            fallocate(f.as_raw_fd(), flags, at as i64, len as i64)
                .unwrap_or_else(|e| panic!("fallocate {flags:?} {at} {len}: {e}"));
        }
    }

    /// Both files read whole through their descriptors: the same bytes.
    #[track_caller]
    fn assert_same(&self, what: &str) {
        let read = |f: &File| {
            let len = f.metadata().unwrap().len();
            let mut buf = vec![0u8; len as usize];
            f.read_exact_at(&mut buf, 0).unwrap();
            buf
        };
        let (l, m) = (read(&self.local), read(&self.mounted));
        assert_eq!(l.len(), m.len(), "{what}: size");
        assert!(l == m, "{what}: bytes differ");
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

#[test]
fn punch_hole_and_zero_range_match_a_local_file_on_every_view() {
    if skip_without_fuse("punch_hole_and_zero_range_match_a_local_file_on_every_view") {
        return;
    }
    let env = Env::new();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));
    let local = env.local("f");
    fs::create_dir_all(local.parent().unwrap()).unwrap();
    let data = pattern(3 * MIB as usize, 7);
    fs::write(&local, &data).unwrap();
    fs::write(a.join("f"), &data).unwrap();

    let twin = Twin::open(&local, &a.join("f"));
    let keep = FallocateFlags::FALLOC_FL_KEEP_SIZE;
    let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | keep;
    let zero = FallocateFlags::FALLOC_FL_ZERO_RANGE;
    // Buffered writes inside the range, pending when the hole is punched.
    twin.write(MIB + 123, &pattern(100_000, 1));
    twin.write(MIB - 10, &pattern(20, 2));
    twin.fallocate(punch, MIB, 512 * 1024);
    // A write into the hole after it.
    twin.write(MIB + 1000, &pattern(10, 3));
    twin.assert_same("after the punch");
    // Zeroing across a chunk boundary, with writes pending on both sides.
    twin.write(2 * MIB - 50, &pattern(100, 4));
    twin.fallocate(zero, 2 * MIB - 7, 300_000);
    twin.write(2 * MIB + 100_000, &pattern(5, 5));
    // Past the end: with KEEP_SIZE the size stays, without it it grows.
    twin.fallocate(zero | keep, 3 * MIB + 100, 4096);
    twin.assert_same("zeroed past the end, size kept");
    twin.fallocate(zero, 3 * MIB + 8192, 100);
    twin.assert_same("zeroed past the end");
    drop(twin);
    let want = fs::read(&local).unwrap();
    assert_eq!(want.len() as u64, 3 * MIB + 8292);
    assert!(
        fs::read(a.join("f")).unwrap() == want,
        "mount a after close"
    );
    assert!(fs::read(b.join("f")).unwrap() == want, "mount b");
    assert!(
        fs::read(env.share("f")).unwrap() == want,
        "the server's file"
    );
    a.unmount();
    b.unmount();
}
