//! Extended attributes through `ferry-mount` (issue 42, point 3): two mounts of one
//! share see each other's changes at once (no sleeps), `XATTR_CREATE` and
//! `XATTR_REPLACE` keep their meaning, the size-0 probe and `ERANGE` work as on a local
//! file system, the kernel's limits hold, `system.*` is refused, and a symlink's own
//! attributes are never its target's.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use ferry_tests::{skip_without_fuse, Env, Mount};
use rustix::fs::{
    lgetxattr, lgetxattr_query, llistxattr, llistxattr_query, lremovexattr, lsetxattr, XattrFlags,
};
use rustix::io::Errno;

/// The value of `name` on `path` (a symlink not followed), or its errno.
fn get(path: &Path, name: &str) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; 65536];
    let len = lgetxattr(path, name, &mut buf[..])?;
    buf.truncate(len);
    Ok(buf)
}

/// The names on `path`, sorted.
fn names(path: &Path) -> Vec<String> {
    let mut buf = vec![0u8; 65536];
    let len = llistxattr(path, &mut buf[..]).unwrap();
    let mut v: Vec<String> = buf[..len]
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    v.sort();
    v
}

fn set(path: &Path, name: &str, value: &[u8], flags: XattrFlags) -> Result<(), Errno> {
    lsetxattr(path, name, value, flags)
}

#[test]
fn two_mounts_see_each_others_extended_attributes_at_once() {
    if skip_without_fuse("two_mounts_see_each_others_extended_attributes_at_once") {
        return;
    }
    let env = Env::new();
    fs::write(env.share("f"), b"data").unwrap();
    fs::create_dir(env.share("d")).unwrap();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));
    let (fa, fb) = (a.join("f"), b.join("f"));

    // Created through one mount: the other and the server see it.
    set(&fa, "user.color", b"blue", XattrFlags::CREATE).unwrap();
    assert_eq!(get(&fb, "user.color").unwrap(), b"blue");
    assert_eq!(
        ferry_common::xattr::get(&env.share("f"), b"user.color").unwrap(),
        b"blue"
    );
    assert_eq!(names(&fb), ["user.color"]);
    // Replaced through the other: the first sees the new value at once.
    set(&fb, "user.color", b"green!", XattrFlags::REPLACE).unwrap();
    assert_eq!(get(&fa, "user.color").unwrap(), b"green!");
    // XATTR_CREATE of one that exists, XATTR_REPLACE of one that does not.
    assert_eq!(
        set(&fa, "user.color", b"x", XattrFlags::CREATE),
        Err(Errno::EXIST)
    );
    assert_eq!(
        set(&fa, "user.none", b"x", XattrFlags::REPLACE),
        Err(Errno::NODATA)
    );
    assert_eq!(get(&fa, "user.none"), Err(Errno::NODATA));

    // The size probe, and a buffer too small for the value or the list.
    assert_eq!(lgetxattr_query(&fa, "user.color").unwrap(), 6);
    let mut small = [0u8; 3];
    assert_eq!(
        lgetxattr(&fa, "user.color", &mut small[..]),
        Err(Errno::RANGE)
    );
    set(&fa, "user.second", b"", XattrFlags::empty()).unwrap();
    assert_eq!(get(&fb, "user.second").unwrap(), b"");
    let listed = "user.color\0user.second\0".len();
    assert_eq!(llistxattr_query(&fb).unwrap(), listed);
    assert_eq!(llistxattr(&fb, &mut small[..]), Err(Errno::RANGE));
    assert_eq!(names(&fb), ["user.color", "user.second"]);

    // Removed through one mount: gone for the other.
    lremovexattr(&fb, "user.color").unwrap();
    assert_eq!(get(&fa, "user.color"), Err(Errno::NODATA));
    assert_eq!(lremovexattr(&fa, "user.color"), Err(Errno::NODATA));
    assert_eq!(names(&fa), ["user.second"]);

    // Directories carry them too; a value of a few KiB arrives whole.
    let value: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    set(&a.join("d"), "user.big", &value, XattrFlags::empty()).unwrap();
    assert_eq!(get(&b.join("d"), "user.big").unwrap(), value);
    assert_eq!(
        ferry_common::xattr::get(&env.share("d"), b"user.big").unwrap(),
        value
    );

    // The limits: names over 255 bytes, values over 64 KiB, and system.* (ACLs).
    let long = format!("user.{}", "n".repeat(251));
    assert_eq!(
        set(&fa, &long, b"x", XattrFlags::empty()),
        Err(Errno::RANGE)
    );
    let huge = vec![0u8; 65537];
    assert_eq!(
        set(&fa, "user.huge", &huge, XattrFlags::empty()),
        Err(Errno::TOOBIG)
    );
    let acl = set(
        &fa,
        "system.posix_acl_access",
        b"\x02\0\0\0",
        XattrFlags::empty(),
    );
    assert_eq!(acl, Err(Errno::OPNOTSUPP));
    a.unmount();
    b.unmount();
}

#[test]
fn trusted_attributes_and_a_symlinks_own_with_ferryd_as_root() {
    if skip_without_fuse("trusted_attributes_and_a_symlinks_own_with_ferryd_as_root") {
        return;
    }
    let env = Env::new();
    fs::write(env.share("target"), b"data").unwrap();
    symlink("target", env.share("link")).unwrap();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));

    // ferryd runs as root here: trusted.* is carried.
    set(&a.join("target"), "trusted.t", b"1", XattrFlags::empty()).unwrap();
    assert_eq!(get(&b.join("target"), "trusted.t").unwrap(), b"1");
    // A symlink's own attribute is set on the link, never on its target.
    set(&a.join("link"), "trusted.l", b"link", XattrFlags::empty()).unwrap();
    assert_eq!(get(&b.join("link"), "trusted.l").unwrap(), b"link");
    assert_eq!(get(&b.join("target"), "trusted.l"), Err(Errno::NODATA));
    let on_server = ferry_common::xattr::get(&env.share("link"), b"trusted.l").unwrap();
    assert_eq!(on_server, b"link");
    assert!(ferry_common::xattr::get(&env.share("target"), b"trusted.l").is_err());
    // The kernel allows no user.* attribute on a symlink, through the mount as here.
    assert_eq!(
        set(&a.join("link"), "user.u", b"x", XattrFlags::empty()),
        Err(Errno::PERM)
    );
    a.unmount();
    b.unmount();
}

#[test]
fn writes_and_rewrites_keep_attributes() {
    if skip_without_fuse("writes_and_rewrites_keep_attributes") {
        return;
    }
    let env = Env::new();
    let a = Mount::start(env.remote(""));
    let b = Mount::start(env.remote(""));
    // A file created through the mount, given an attribute while open, then written:
    // the attribute and the bytes are both there for the other mount after close.
    let path = a.join("new");
    let mut f = fs::File::create(&path).unwrap();
    set(&path, "user.k", b"v", XattrFlags::empty()).unwrap();
    std::io::Write::write_all(&mut f, b"written after").unwrap();
    drop(f);
    assert_eq!(fs::read(b.join("new")).unwrap(), b"written after");
    assert_eq!(get(&b.join("new"), "user.k").unwrap(), b"v");
    // A truncating rewrite through the other mount (a new file staged under a hidden
    // name, then renamed over the old one) keeps the file's attributes.
    fs::write(b.join("new"), b"rewritten").unwrap();
    assert_eq!(fs::read(a.join("new")).unwrap(), b"rewritten");
    assert_eq!(get(&a.join("new"), "user.k").unwrap(), b"v");
    a.unmount();
    b.unmount();
}

/// The value of `name` on local `path`, if any.
fn local(path: &Path, name: &str) -> Option<Vec<u8>> {
    get(path, name).ok()
}

/// A tree with attributes on a file, a directory, the top directory and a symlink.
fn tree_with_attributes(top: &Path) {
    fs::create_dir_all(top.join("sub")).unwrap();
    fs::write(top.join("sub/f"), b"file").unwrap();
    fs::write(top.join("plain"), b"no attributes").unwrap();
    symlink("sub/f", top.join("link")).unwrap();
    set(
        &top.join("sub/f"),
        "user.f",
        b"on the file",
        XattrFlags::empty(),
    )
    .unwrap();
    set(
        &top.join("sub/f"),
        "trusted.f",
        b"trusted",
        XattrFlags::empty(),
    )
    .unwrap();
    set(
        &top.join("sub"),
        "user.d",
        b"on the dir",
        XattrFlags::empty(),
    )
    .unwrap();
    set(top, "user.top", b"on the top", XattrFlags::empty()).unwrap();
    set(
        &top.join("link"),
        "trusted.l",
        b"on the link",
        XattrFlags::empty(),
    )
    .unwrap();
}

/// Checks the attributes [`tree_with_attributes`] made, under `top`.
#[track_caller]
fn assert_attributes(top: &Path) {
    let v = |p: &str, n: &str| local(&top.join(p), n);
    assert_eq!(v("sub/f", "user.f").as_deref(), Some(&b"on the file"[..]));
    assert_eq!(v("sub/f", "trusted.f").as_deref(), Some(&b"trusted"[..]));
    assert_eq!(v("sub", "user.d").as_deref(), Some(&b"on the dir"[..]));
    assert_eq!(v("", "user.top").as_deref(), Some(&b"on the top"[..]));
    assert_eq!(v("link", "trusted.l").as_deref(), Some(&b"on the link"[..]));
    // The link's own attribute stayed the link's.
    assert_eq!(v("sub/f", "trusted.l"), None);
    assert!(names(&top.join("plain")).is_empty());
}

#[test]
fn rcp_x_carries_attributes_both_ways_and_only_with_x() {
    let env = Env::new();
    let src = env.local("src");
    tree_with_attributes(&src);

    // Without -X nothing is carried.
    env.rcp(ferry_tests::rcp_args!["-r", &src, env.remote("plain-copy")])
        .assert_success();
    assert_eq!(local(&env.share("plain-copy/sub/f"), "user.f"), None);

    env.rcp(ferry_tests::rcp_args!["-r", "-X", &src, env.remote("up")])
        .assert_success();
    assert_attributes(&env.share("up"));
    assert_eq!(fs::read(env.share("up/sub/f")).unwrap(), b"file");

    let back = env.local("back");
    env.rcp(ferry_tests::rcp_args!["-r", "-X", env.remote("up"), &back])
        .assert_success();
    assert_attributes(&back);

    // A single file, both ways.
    let one = env.local("one");
    env.rcp(ferry_tests::rcp_args!["-X", env.remote("up/sub/f"), &one])
        .assert_success();
    assert_eq!(local(&one, "user.f").as_deref(), Some(&b"on the file"[..]));
    env.rcp(ferry_tests::rcp_args!["-X", &one, env.remote("one")])
        .assert_success();
    assert_eq!(
        local(&env.share("one"), "user.f").as_deref(),
        Some(&b"on the file"[..])
    );
}
