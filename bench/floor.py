#!/usr/bin/env python3
"""The floor a receiver of many small files hits on this disk, with no network and no
hashing: how many files per second a process can create, write and name,

  plain:   create .tmp, write, rename (what rsync does: nothing is made durable)
  durable: per batch of 256: create .tmp and write each, start the writeback of each
           (sync_file_range), fsync each, rename each, fsync each directory
           (what ferryd does for a batch of small files, so that no crash can leave
           a file under its final name with less than its bytes)
  syncfs:  per batch of 256: create .tmp and write each, syncfs, rename each, syncfs
           (the same guarantee with two flushes of the whole filesystem per batch)

Usage: bench/floor.py [--files N] [--size BYTES] [--dir DIR] [--reps N]
DIR defaults to $TMPDIR or /tmp (the filesystem bench/run writes to). Prints one line
per mode with the median files/s of the repetitions, and a JSON object with --json.
"""

import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import statistics
import tempfile
import time

BATCH = 256
SYNC_FILE_RANGE_WRITE = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_libc.syncfs.argtypes = [ctypes.c_int]


def syncfs(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
    finally:
        os.close(fd)


def start_writeback(fd):
    if _libc.sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "sync_file_range")


def names(root, n):
    """n files over 100 directories, as bench/run's tree."""
    dirs = [os.path.join(root, f"d{i}") for i in range(100)]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    return dirs, [os.path.join(dirs[i % 100], f"f{i}") for i in range(n)]


def plain(root, n, data):
    _, files = names(root, n)
    for p in files:
        tmp = p + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)
        os.rename(tmp, p)


def durable(root, n, data):
    dirs, files = names(root, n)
    for start in range(0, n, BATCH):
        batch = files[start:start + BATCH]
        fds = []
        for p in batch:
            fd = os.open(p + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            start_writeback(fd)
            fds.append(fd)
        for fd in fds:
            os.fsync(fd)
            os.close(fd)
        touched = set()
        for p in batch:
            os.rename(p + ".tmp", p)
            touched.add(os.path.dirname(p))
        for d in touched:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(fd)
            os.close(fd)


def by_syncfs(root, n, data):
    _, files = names(root, n)
    for start in range(0, n, BATCH):
        batch = files[start:start + BATCH]
        for p in batch:
            fd = os.open(p + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
        syncfs(root)
        for p in batch:
            os.rename(p + ".tmp", p)
        syncfs(root)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    data = os.urandom(a.size)
    out = {}
    for mode, fn in (("plain", plain), ("durable", durable), ("syncfs", by_syncfs)):
        rates = []
        for _ in range(a.reps):
            root = tempfile.mkdtemp(prefix="ferry-floor.", dir=a.dir)
            try:
                os.sync()
                t0 = time.monotonic()
                fn(root, a.files, data)
                rates.append(a.files / (time.monotonic() - t0))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        out[mode] = statistics.median(rates)
        if not a.json:
            print(f"{mode:8} {out[mode]:9.0f} files/s  (median of {a.reps}: "
                  + ", ".join(f"{r:.0f}" for r in rates) + ")")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
