"""Helpers of bench/run: timing, test data, parsers, and the report.

Subcommands (python3 bench/lib/bench.py CMD ARGS...):

  run LIMIT_S OUT_FILE ERR_FILE [--syncfs DIR] [--cpu-pid PID] -- CMD...
      run CMD (stdout to OUT_FILE, stderr to ERR_FILE) within LIMIT_S seconds; print
      "SECONDS SECONDS_WITH_SYNC CPU_CMD CPU_PID" (monotonic clock; the second also
      covers a syncfs(2) of DIR's file system right after CMD, or a sync(2) without
      --syncfs: the destination durable; CPU_CMD is the user + system CPU-seconds of
      CMD and every process it waited for (its rusage); CPU_PID those of the running
      server PID and of the children it reaped (/proc/PID/stat utime + stime + cutime
      + cstime), from just before CMD started to just after the sync, or "-" without
      --cpu-pid). On failure print a one-line reason and exit 3.
  hashspeed FILE COPIES      single-core hash speed, GB per CPU-second: blake3 (b3sum
                            --num-threads 1 over COPIES passes of FILE, in the page
                            cache) and sha256 (openssl speed -evp sha256, 1 MiB
                            blocks, 1 s); one JSON line
  plaincopy SRC DEST LIMIT_S  SRC copied to DEST over loopback TCP with no hash, 1 MiB
                            at a time, read and written direct (O_DIRECT), then a
                            syncfs(2) of DEST's file system; print "BYTES SECONDS
                            CPU_SENDER CPU_RECEIVER" (each end's user + system
                            CPU-seconds over its copy loop)
  port                      a TCP port on 127.0.0.1 that is free now
  mktree DIR DIRS FILES SIZE  DIRS directories of FILES random files of SIZE bytes
  mkmixed DIR FILES SEED    a mixed-size tree of about FILES files (see MIXED_SIZES)
  change DIR                change one byte of every 100th file (1 %), keeping sizes
  treesum DIR               SHA-256 over the relative names and contents of the tree
  fio JSON [read|write]     "p50_us p99_us iops" of fio's single job, of its reads
                            (the default) or writes
  iperf JSON                bytes/s the iperf3 receiver got
  field JSON KEY...         a value of rcp's --json output (KEY path into the object)
  live JSON                 how many nodes `ferry cluster status --json` reports live
  hung LIMIT_S DELAY_S PID OUT ERR -- CMD...
                            run CMD (stdout to OUT, stderr to ERR), SIGSTOP process PID
                            DELAY_S seconds in (SIGCONT when CMD ends, whatever
                            happens); print CMD's wall seconds, or a one-line reason
                            and exit 3 if it failed, ended before the stop or ran past
                            LIMIT_S
  readlat FILE              read FILE 1 MiB at a time; print "SECONDS LONGEST_READ_S"
  report WORK OUT_BASE README  the markdown table, JSON and PNG chart of a run

bench/run records every measurement as one line of WORK/results.tsv:
ROW<TAB>TOOL<TAB>KIND<TAB>VALUE, KIND one of v (a value, in the row's unit), fail
(VALUE is the reason), skip (VALUE is why it was not run); and the run's facts as
KEY<TAB>VALUE lines of WORK/meta.tsv. report reads both.
"""

import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time


def syncfs(fd):
    """syncfs(2) of the file system that fd is on."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def proc_cpu(pid):
    """CPU-seconds of PID and of its reaped children (utime + stime + cutime + cstime of
    /proc/PID/stat), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is field 3 (state); utime, stime, cutime, cstime are fields 14-17.
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def run_timed(argv):
    limit, out, err = float(argv[0]), argv[1], argv[2]
    rest = argv[3:]
    sync_dir = cpu_pid = None
    while rest[0] in ("--syncfs", "--cpu-pid"):
        if rest[0] == "--syncfs":
            sync_dir = rest[1]
        else:
            cpu_pid = int(rest[1])
        rest = rest[2:]
    sep, cmd = rest[0], rest[1:]
    assert sep == "--" and cmd
    # Opened before the clock starts: the destination's file system, flushed after CMD.
    dfd = os.open(sync_dir, os.O_RDONLY | os.O_DIRECTORY) if sync_dir else None
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    srv0 = proc_cpu(cpu_pid) if cpu_pid else None
    with open(out, "wb") as fo, open(err, "wb") as fe:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            print(f"timed out after {limit:.0f} s")
            sys.exit(3)
        except KeyboardInterrupt:
            # Its own session does not get the terminal's SIGINT: stop it here, so that
            # nothing is left writing into a destination being unmounted.
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
        t1 = time.monotonic()
        if dfd is None:
            os.sync()
        else:
            syncfs(dfd)
        t2 = time.monotonic()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_cmd = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    cpu_srv = "-"
    if srv0 is not None:
        # A server's worker may end a moment after the client (an rsync daemon's child
        # is counted once the daemon reaped it): a short grace, outside the times.
        time.sleep(0.1)
        srv1 = proc_cpu(cpu_pid)
        if srv1 is not None:
            cpu_srv = f"{srv1 - srv0:.3f}"
    if dfd is not None:
        os.close(dfd)
    if rc != 0:
        with open(err, "rb") as f:
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()]
        last = next((ln for ln in reversed(lines) if ln), "")
        why = f"exit {rc}" + (f": {last}" if last else "")
        print(why.replace("\t", " ")[:160])
        sys.exit(3)
    print(f"{t1 - t0:.6f} {t2 - t0:.6f} {cpu_cmd:.3f} {cpu_srv}")


def hashspeed(argv):
    """hashspeed FILE COPIES: what one core hashes here, in GB (1e9 bytes) per
    CPU-second: blake3 by b3sum on one thread over COPIES passes of FILE (the user CPU
    of b3sum, its rusage: b3sum maps the file, and its page faults are left out), sha256
    by openssl speed over 1 MiB blocks (SHA-NI where the CPU has it; a buffer in memory,
    no reads). A tool that is not installed gets null and a note."""
    path, copies = argv[0], int(argv[1])
    out = {}

    def version(cmd):
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = (p.stdout or p.stderr).strip().splitlines()
        return lines[0] if lines else "?"

    if shutil.which("b3sum") is None:
        out["blake3"], out["blake3_note"] = None, "b3sum not installed (Debian package b3sum)"
    else:
        size = os.path.getsize(path) * copies
        with open(path, "rb") as f:  # into the page cache first
            while f.read(1 << 24):
                pass
        os.sync()  # no write-back of the just-written file beside the timing
        cmd = ["b3sum", "--num-threads", "1", "--no-names"]
        cpu = None
        for _ in range(2):  # the faster of two passes, like openssl speed's steady state
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            p = subprocess.run(cmd + [path] * copies, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            if p.returncode != 0:
                break
            # User CPU only: the hashing, not the page faults of b3sum's mapping of the
            # file (openssl speed hashes a buffer in memory: no faults either).
            c = ru1.ru_utime - ru0.ru_utime
            cpu = c if cpu is None else min(cpu, c)
        if p.returncode != 0 or not cpu:
            out["blake3"], out["blake3_note"] = None, f"b3sum failed (exit {p.returncode})"
        else:
            out["blake3"] = round(size / 1e9 / cpu, 3)
            out["blake3_tool"] = f"{' '.join(cmd)} over {size / 2**30:.2f} GiB in the page cache, user CPU, the faster of 2 ({version(['b3sum', '--version'])})"
    if shutil.which("openssl") is None:
        out["sha256"], out["sha256_note"] = None, "openssl not installed"
    else:
        cmd = ["openssl", "speed", "-evp", "sha256", "-bytes", "1048576", "-seconds", "1"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        rate = None
        for line in p.stdout.splitlines():
            f = line.split()
            if len(f) >= 2 and f[0] == "sha256":
                try:
                    rate = float(f[-1].rstrip("k")) * 1000  # in 1000s of bytes per second
                except ValueError:
                    pass
        if rate is None:
            out["sha256"], out["sha256_note"] = None, f"{' '.join(cmd)} printed no rate"
        else:
            out["sha256"] = round(rate / 1e9, 3)
            out["sha256_tool"] = f"{' '.join(cmd)} ({version(['openssl', 'version'])})"
    print(json.dumps(out))


PLAIN_BLOCK = 1 << 20  # what plaincopy reads, sends and writes at a time


def plain_direct(fd, on):
    """Turns O_DIRECT on or off for FD; False where the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:
        return False
    return True


def plain_receive(conn, dest, report):
    """plaincopy's receiving end (a child process): DEST written from CONN, 1 MiB at a
    time, direct; its own CPU-seconds for the copy written to the pipe REPORT."""
    cpu0 = os.times()
    buf = mmap.mmap(-1, PLAIN_BLOCK)  # page-aligned, as O_DIRECT wants
    mv = memoryview(buf)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = plain_direct(fd, True)
    while True:
        got = 0
        while got < PLAIN_BLOCK:
            n = conn.recv_into(mv[got:])
            if n == 0:
                break
            got += n
        if got == 0:
            break
        if got % 4096 and direct:
            # The file's tail: not a whole block, so not direct.
            direct = not plain_direct(fd, False)
        os.write(fd, mv[:got])
        if got < PLAIN_BLOCK:
            break
    os.close(fd)
    cpu1 = os.times()
    os.write(report, f"{cpu1.user + cpu1.system - cpu0.user - cpu0.system:.3f}".encode())
    os._exit(0)


def plaincopy(argv):
    """The floor under the hash-cost ratio: what moving the bytes costs with no hash at
    all, done the cheapest way a copy over TCP has: SRC read direct (O_DIRECT, as
    ferryd and rcp read a file the page cache does not hold) into one reused 1 MiB
    buffer and sent; a child process receives into its own 1 MiB buffer and writes DEST
    direct; over loopback TCP, then DEST's file system synced. Each end's CPU is its
    own, counted from its copy loop (not the interpreter's start)."""
    src, dest, limit = argv[0], argv[1], float(argv[2])
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rd)
            conn, _ = lsock.accept()
            plain_receive(conn, dest, wr)
        finally:
            os._exit(1)
    os.close(wr)
    signal.alarm(max(1, int(limit)))
    dfd = os.open(os.path.dirname(dest) or ".", os.O_RDONLY | os.O_DIRECTORY)
    t0 = time.monotonic()
    sock = socket.create_connection(lsock.getsockname())
    lsock.close()
    cpu0 = os.times()
    buf = mmap.mmap(-1, PLAIN_BLOCK)
    mv = memoryview(buf)
    fd = os.open(src, os.O_RDONLY)
    plain_direct(fd, True)
    off = 0
    while True:
        n = os.preadv(fd, [buf], off)
        if n == 0:
            break
        sock.sendall(mv[:n])
        off += n
    os.close(fd)
    cpu1 = os.times()
    sock.close()
    _, status = os.waitpid(pid, 0)
    receiver = os.read(rd, 64).decode()
    syncfs(dfd)
    t1 = time.monotonic()
    signal.alarm(0)
    os.close(dfd)
    if os.waitstatus_to_exitcode(status) != 0 or not receiver:
        sys.exit("the receiving process failed")
    size = os.path.getsize(dest)
    if size != off or size != os.path.getsize(src):
        sys.exit(f"the plain copy wrote {size} bytes of {os.path.getsize(src)}")
    print(f"{size} {t1 - t0:.6f} {cpu1.user + cpu1.system - cpu0.user - cpu0.system:.3f} {receiver}")


def free_port(_argv):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])
    s.close()


def mktree(argv):
    root, dirs, files, size = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    rng = random.Random(7)
    for d in range(dirs):
        p = os.path.join(root, f"d{d:03}")
        os.makedirs(p, exist_ok=True)
        for i in range(files):
            with open(os.path.join(p, f"f{i:04}"), "wb") as f:
                f.write(rng.randbytes(size))


# A mixed tree like real source, documentation and home directories (issue 20): most
# files small, a long tail up to tens of MiB, empty files, symlinks (to files, to
# directories, a few dangling), executables, deep and wide directories, and varied
# mtimes (directories' set last, after their contents). The same seed gives the same
# tree, byte for byte.
# Size classes: (share of the files, low bytes, high bytes), log-uniform inside a class.
MIXED_SIZES = [
    (0.02, 0, 0),                    # empty
    (0.22, 1, 1 << 10),              # under 1 KiB
    (0.28, 1 << 10, 4 << 10),
    (0.26, 4 << 10, 16 << 10),
    (0.18, 16 << 10, 64 << 10),
    (0.036, 64 << 10, 768 << 10),    # over the small-file threshold: about 4 %
    (0.002, 768 << 10, 6 << 20),
]
MIXED_HUGE = [20 << 20]              # the tail: one file of tens of MiB
MIXED_EPOCH = 1_500_000_000          # 2017-07-14; mtimes spread over the 5 years after


def mixed_size(rng):
    x = rng.random()
    for share, lo, hi in MIXED_SIZES:
        if x < share:
            if hi == 0:
                return 0
            return int(round(lo * (hi / lo) ** rng.random())) if lo else rng.randint(1, hi)
        x -= share
    return rng.randint(1 << 10, 4 << 10)


def mkmixed(argv):
    """mkmixed DIR FILES SEED: a mixed tree of about FILES regular files under DIR (which
    must not exist); prints what it holds as one JSON line."""
    root, n, seed = argv[0], int(argv[1]), int(argv[2])
    rng = random.Random(seed)
    os.makedirs(root)
    dirs = [""]
    # Directory shapes: a few wide ones (hundreds of files), many ordinary ones, and one
    # deep chain, like include/, doc/ and a project's src/a/b/c/....
    ndirs = max(1, n // 25)
    for i in range(1, ndirs):
        parent = dirs[rng.randrange(len(dirs))] if rng.random() < 0.7 else ""
        name = f"d{i:04}"
        dirs.append(f"{parent}/{name}" if parent else name)
    chain = ""
    for depth in range(12):
        chain = f"{chain}/deep{depth}" if chain else "deep0"
        dirs.append(chain)
    for d in dirs[1:]:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    wide = set(rng.sample(dirs, min(3, len(dirs))))
    weights = [40 if d in wide else 1 for d in dirs]
    files, total, big = [], 0, 0
    sizes = [mixed_size(rng) for _ in range(max(0, n - len(MIXED_HUGE)))] + MIXED_HUGE[: n]
    exts = [".c", ".h", ".txt", ".html", ".md", ".py", ".json", ".png", ".gz", ""]
    for i, size in enumerate(sizes):
        d = rng.choices(dirs, weights)[0]
        rel = os.path.join(d, f"f{i:05}{rng.choice(exts)}")
        path = os.path.join(root, rel)
        with open(path, "wb") as f:
            left = size
            while left:
                k = min(left, 1 << 20)
                f.write(rng.randbytes(k))
                left -= k
        r = rng.random()
        os.chmod(path, 0o755 if r < 0.05 else 0o600 if r < 0.08 else 0o644)
        os.utime(path, ns=(MIXED_EPOCH * 10**9, (MIXED_EPOCH + rng.randrange(5 * 365 * 86400)) * 10**9
                           + rng.randrange(10**9)))
        files.append(rel)
        total += size
        big += size > (64 << 10)
    links = 0
    for i in range(max(3, n // 150)):
        d = rng.choice(dirs)
        link = os.path.join(root, d, f"l{i:04}")
        r = rng.random()
        if r < 0.1:
            target = f"missing-{i}"                       # dangling
        elif r < 0.3:
            target = os.path.relpath(os.path.join(root, rng.choice(dirs)), os.path.join(root, d))
        else:
            target = os.path.relpath(os.path.join(root, rng.choice(files)), os.path.join(root, d))
        os.symlink(target, link)
        os.utime(link, ns=(MIXED_EPOCH * 10**9, (MIXED_EPOCH + rng.randrange(5 * 365 * 86400)) * 10**9),
                 follow_symlinks=False)
        links += 1
    # Directories last, deepest first: creating an entry changes its parent's mtime.
    for d in sorted(dirs, key=lambda x: -x.count("/") if x else 1):
        path = os.path.join(root, d) if d else root
        os.chmod(path, 0o700 if rng.random() < 0.05 else 0o755)
        t = (MIXED_EPOCH + rng.randrange(5 * 365 * 86400)) * 10**9
        os.utime(path, ns=(t, t))
    print(json.dumps({"files": len(files), "bytes": total, "over_64k": big, "symlinks": links,
                      "dirs": len(dirs)}))


def all_files(root):
    return sorted(os.path.join(r, n) for r, _, ns in os.walk(root) for n in ns)


def change(argv):
    for p in all_files(argv[0])[::100]:
        with open(p, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]) if b else b"x")


def treesum(argv):
    root = argv[0]
    h = hashlib.sha256()
    for r, ds, ns in os.walk(root):
        ds.sort()
        for n in sorted(ds + ns):
            p = os.path.join(r, n)
            h.update(os.path.relpath(p, root).encode() + b"\0")
            if os.path.islink(p):
                h.update(b"L" + os.readlink(p).encode() + b"\0")
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    print(h.hexdigest())


def load_json(path):
    with open(path) as f:
        text = f.read()
    return json.loads(text[text.index("{"):])  # tools may print warnings first


def fio(argv):
    job = load_json(argv[0])["jobs"][0]
    what = argv[1] if len(argv) > 1 else "read"
    if job.get("error", 0):
        sys.exit(f"fio job error {job['error']}")
    rd = job[what]
    if rd["total_ios"] <= 0:
        sys.exit(f"fio completed no {what}s")
    # lat = submission + completion; for psync, the whole pread() or pwrite(). iops is
    # over the job's runtime, which includes an --end_fsync.
    lat = rd.get("lat_ns", {}).get("percentile") or rd["clat_ns"]["percentile"]
    p = {float(k): v for k, v in lat.items()}
    print(f"{p[50.0] / 1e3:.3f} {p[99.0] / 1e3:.3f} {rd['iops']:.3f}")


def iperf(argv):
    doc = load_json(argv[0])
    if "error" in doc:
        sys.exit(f"iperf3: {doc['error']}")
    s = doc["end"]["sum_received"]
    print(f"{s['bytes'] / s['seconds']:.1f}")


def live(argv):
    doc = load_json(argv[0])
    print(sum(1 for n in doc.get("nodes", []) if n.get("live") is True))


def field(argv):
    v = load_json(argv[0])
    for k in argv[1:]:
        v = v[int(k)] if isinstance(v, list) else v[k]
    print(v)


# --- the report ---------------------------------------------------------------

PEERS = [("rsync", "rsync daemon"), ("scp", "scp"), ("sshfs", "sshfs"),
         ("ceiling", "ceiling (iperf3 / perftest / local disk)")]
# What the ceiling column holds in each row (the JSON's "ceiling_source"): the raw
# transport where the network binds, the local disk where it does not.
LOCAL_FIO = "local disk: the mounts' fio job on the file itself"
LOCAL_TAR = "local disk: tar | tar of the same tree"
CEILING_SOURCE = {
    "upload": "iperf3 -l 1M (raw TCP)", "download": "iperf3 -l 1M -R (raw TCP)",
    "small_up": LOCAL_TAR, "small_down": LOCAL_TAR, "mixed_up": LOCAL_TAR, "mixed_down": LOCAL_TAR,
    "fuse_seq": "local disk: dd bs=1M of the file itself",
    "fuse_iops": LOCAL_FIO, "fuse_p50": LOCAL_FIO, "fuse_p99": LOCAL_FIO,
    "rdma_up": "ib_read_bw (perftest)", "rdma_down": "ib_write_bw (perftest)",
    "fusew_seq": "local disk: the same dd onto the destination file system",
    "fusew_tar": "local disk: the same tar x and sync -f on the destination file system",
    "fusew_qd1": "local disk: the same fio job on the destination file system",
    "fusew_qd16": "local disk: the same fio job on the destination file system",
    "conf_failed": "local disk: the same suite on the temp dir's file system",
}
TOOL_NAMES = dict(PEERS, ferry="Ferry")
HIGHER, LOWER = "higher", "lower"


def small_label(meta):
    return f"{int(meta['small_n']):,} files of 4 KiB"


def mixed_label(meta):
    return f"a mixed tree of {int(meta.get('mixed_n') or 0):,} files"


def rows(meta):
    size, small, mixed = meta["size_label"], small_label(meta), mixed_label(meta)
    g = "≥ {:g}× {}".format
    both = ("both", ("rsync", 1.5), ("ceiling", 1.0))
    return [
        # id, job, unit, better, target: (peer, factor; None: no target, ratio shown),
        # ("abs", "le", limit): an absolute limit, ratio against sshfs, or ("both",
        # (peer, factor), ...): every one of them, each ratio shown
        ("upload", f"upload one {size} file", "GB/s", HIGHER, ("rsync", 2.0), g(2, "rsync daemon")),
        ("download", f"download one {size} file", "GB/s", HIGHER, ("rsync", 2.0), g(2, "rsync daemon")),
        ("small_up", f"upload {small}", "files/s", HIGHER, ("rsync", 3.0), g(3, "rsync daemon")),
        ("small_down", f"download {small}", "files/s", HIGHER, ("rsync", 3.0), g(3, "rsync daemon")),
        ("mixed_up", f"upload {mixed}", "files/s", HIGHER, both, g(1.5, "rsync daemon") + " and ≥ tar | tar"),
        ("mixed_down", f"download {mixed}", "files/s", HIGHER, both, g(1.5, "rsync daemon") + " and ≥ tar | tar"),
        ("fuse_seq", f"FUSE sequential read, {size}", "MB/s", HIGHER, ("sshfs", 5.0), g(5, "sshfs")),
        ("fuse_iops", "FUSE 4 KiB random read QD1", "IOPS", HIGHER, ("sshfs", 3.0), g(3, "sshfs")),
        ("fuse_p50", "FUSE 4 KiB random read QD1, p50", "µs", LOWER, ("abs", "le", 60.0), "≤ 60 µs"),
        ("fuse_p99", "FUSE 4 KiB random read QD1, p99", "µs", LOWER, ("sshfs", None), "—"),
        ("backup_inc", f"incremental backup, {small}, 1 % changed", "s", LOWER,
         ("rsync", 1.0), "faster than rsync"),
        ("backup_full", f"full backup, {small}", "s", LOWER, ("rsync", None), "—"),
        ("rdma_up", "rcp upload over Soft-RoCE (server RDMA READ)", "MiB/s", HIGHER,
         ("ceiling", 0.8), "≥ 80% of ib_read_bw"),
        ("rdma_down", "rcp download over Soft-RoCE (server RDMA WRITE)", "MiB/s", HIGHER,
         ("ceiling", 0.8), "≥ 80% of ib_write_bw"),
        # Issue 21: writes through the mount; ("disk", peer, factor): the target against
        # peer, with the fraction of the local disk's speed shown beside it.
        ("fusew_seq", f"FUSE sequential write, {size} (dd bs=1M conv=fsync)", "MB/s", HIGHER,
         ("disk", "sshfs", 2.0), g(2, "sshfs")),
        ("fusew_tar", f"FUSE tar x of {small}, then sync -f", "files/s", HIGHER,
         ("disk", "sshfs", 2.0), g(2, "sshfs")),
        ("fusew_qd1", "FUSE 4 KiB random write QD1 (fio, end fsync)", "IOPS", HIGHER,
         ("disk", "sshfs", 2.0), g(2, "sshfs")),
        ("fusew_qd16", "FUSE 4 KiB random write QD16 (fio, end fsync)", "IOPS", HIGHER,
         ("disk", "sshfs", 2.0), g(2, "sshfs")),
        # Issue 42: tests of pjdfstest failed (of conf_tests_TOOL run; the report's note).
        ("conf_failed", "pjdfstest (POSIX conformance) tests failed, as root", "tests", LOWER,
         ("abs", "le", 0.0), "0 failed"),
    ]


# The copy rows: each run also timed until its destination's file system was synced
# (ROW.sync), the headline; the tool alone (ROW) is the second table.
SYNC_ROWS = ["upload", "download", "small_up", "small_down", "mixed_up", "mixed_down",
             "backup_inc", "backup_full", "crypt_up", "crypt_down", "crypt_small_up",
             "crypt_small_down"]


def fmt(v, unit):
    if v is None:
        return "—"
    if unit in ("files/s", "IOPS", "tests"):
        return f"{v:,.0f}"
    if unit == "GB/s":
        return f"{v:.3f}"
    if unit == "s":
        return f"{v:.2f}"
    return f"{v:,.1f}"


def load(work):
    meta, res = {}, {}
    with open(os.path.join(work, "meta.tsv")) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("\t")
            meta[k] = v
    path = os.path.join(work, "results.tsv")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row, tool, kind, value = line.rstrip("\n").split("\t", 3)
                cell = res.setdefault(row, {}).setdefault(tool, {"values": []})
                if kind == "v":
                    cell["values"].append(float(value))
                else:
                    cell[kind] = value
    for tools in res.values():
        for cell in tools.values():
            vals = cell["values"]
            cell["median"] = statistics.median(vals) if vals else None
    return meta, res


def better(a, b, direction):
    """a / b as a speed-up of a over b (> 1: a is better)."""
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return a / b if direction == HIGHER else b / a


def durable(res):
    """res with each copy row's cells replaced by its runs timed with the sync (ROW.sync;
    a tool without those, the iperf3 ceiling or a failure, keeps its own cell)."""
    out = dict(res)
    for rid in SYNC_ROWS:
        merged = dict(res.get(rid, {}))
        merged.update(res.get(rid + ".sync", {}))
        if merged:
            out[rid] = merged
        for suffix in (".mb",):
            if rid + ".sync" + suffix in res:
                out[rid + suffix] = res[rid + ".sync" + suffix]
    return out


def cell_of(tools, tool, unit, reps):
    """(text, median) of TOOL's cell among a row's tools: the median (with n= where fewer
    runs than reps), "failed: ...", or why it was skipped."""
    c = tools.get(tool)
    if c is None:
        return "—", None
    if c["median"] is not None:
        n = len(c["values"])
        return fmt(c["median"], unit) + (f" (n={n})" if n < reps else ""), c["median"]
    if "fail" in c:
        return "failed: " + c["fail"].replace("|", "/"), None
    return c.get("skip", "—"), None


def evaluate(meta, res, only=None):
    """One dict per table row (of the rows in only, if given): the cells and the verdict."""
    out = []
    for rid, job, unit, direction, target, target_text in rows(meta):
        tools = res.get(rid, {})
        if not tools or (only is not None and rid not in only):
            continue
        reps = int(meta.get("mixed_reps") or meta["reps"]) if rid.startswith("mixed_") else int(meta["reps"])

        def cell(tool):
            return cell_of(tools, tool, unit, reps)

        ferry_text, ferry = cell("ferry")
        cells = {t: cell(t) for t, _ in PEERS}
        best = None
        for t in ("rsync", "scp", "sshfs"):
            v = cells[t][1]
            if v is not None and (best is None or (better(v, best[1], direction) or 0) > 1):
                best = (t, v)
        ratio, met, ratio_text = None, None, "—"
        if target and target[0] == "both":
            texts, mets = [], []
            for peer, factor in target[1:]:
                r = better(ferry, cells[peer][1], direction)
                ratio = r if ratio is None and peer != "ceiling" else ratio
                name = "tar | tar" if peer == "ceiling" else TOOL_NAMES[peer].split()[0]
                texts.append("—" if r is None else f"{r:.2f}× {name}")
                mets.append(None if r is None else r >= factor)
            ratio_text = ", ".join(texts)
            met = None if None in mets else all(mets)
        elif target and target[0] == "disk":
            _, peer, factor = target
            ratio = better(ferry, cells[peer][1], direction)
            disk = better(ferry, cells["ceiling"][1], direction)
            texts = []
            if ratio is not None:
                met = ratio >= factor
                texts.append(f"{ratio:.2f}× {TOOL_NAMES[peer].split()[0]}")
            if disk is not None:
                texts.append(f"{disk:.0%} of local disk")
            ratio_text = ", ".join(texts) or "—"
        elif target and target[0] == "abs":
            met = None if ferry is None else ferry <= target[2]
            ratio = better(ferry, cells["sshfs"][1], direction)
            if ratio is not None:
                ratio_text = f"{ratio:.2f}× sshfs"
        elif target:
            peer, factor = target
            ratio = better(ferry, cells[peer][1], direction)
            if ratio is not None:
                if factor is not None:
                    met = ratio > factor if factor == 1.0 else ratio >= factor
                ratio_text = f"{ratio:.0%}" if peer == "ceiling" else f"{ratio:.2f}×"
        out.append({
            "id": rid, "job": job, "unit": unit, "better": direction, "target": target_text,
            "ferry": ferry, "ferry_text": ferry_text,
            "peers": {t: {"text": cells[t][0], "median": cells[t][1]} for t, _ in PEERS},
            "ceiling_source": CEILING_SOURCE.get(rid),
            "best_peer": None if best is None else TOOL_NAMES[best[0]],
            "best_text": "—" if best is None else f"{TOOL_NAMES[best[0]]} {fmt(best[1], unit)}",
            "ratio": ratio, "ratio_text": ratio_text,
            "vs_ceiling": better(ferry, cells["ceiling"][1], direction),
            "met": met, "met_text": {True: "yes", False: "**no**", None: "—"}[met],
        })
        mb = res.get(rid + ".mb")
        if mb:
            out[-1]["mb_s"] = {t: c["median"] for t, c in mb.items()}
    return out


def markdown_table(table):
    head = ["job", "unit", "Ferry"] + [name for _, name in PEERS] + \
        ["best peer", "Ferry vs target", "target", "met?"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (1 + len(PEERS)) + "---|---:|---|---|"]
    for r in table:
        cells = [r["job"], r["unit"], r["ferry_text"]] + [r["peers"][t]["text"] for t, _ in PEERS] + \
            [r["best_text"], r["ratio_text"], r["target"], r["met_text"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def alone_table(table):
    """The copy rows timed to the tool's exit alone (no sync after it)."""
    if not table:
        return ""
    lines = ["| job | unit | Ferry | rsync daemon | scp | local disk (tar \\| tar) | Ferry vs rsync daemon |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in table:
        ceiling = r["peers"]["ceiling"]["text"] if r["ceiling_source"] == LOCAL_TAR else "—"
        vs = better(r["ferry"], r["peers"]["rsync"]["median"], r["better"])
        cells = [r["job"], r["unit"], r["ferry_text"], r["peers"]["rsync"]["text"],
                 r["peers"]["scp"]["text"], ceiling, "—" if vs is None else f"{vs:.2f}×"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def mixed_reps_note(meta):
    """' (N for the mixed tree)' where the mixed job ran more times than the others
    (bench/run --mixed-reps); results from before that option have no such key."""
    n = meta.get("mixed_reps")
    if not n or n == meta["reps"]:
        return ""
    return f" ({n} for the mixed tree)"


def header(meta):
    m = meta
    return "\n".join([
        f"# Ferry benchmark, {m['date']}",
        "",
        f"- command: `{m['command']}` ({m['mode']}); median of {m['reps']} run(s) per job"
        f"{mixed_reps_note(m)};"
        f" took {m['elapsed_s']} s of its {m['budget_s']} s budget",
        f"- host: {m['cpu']}, {m['cores']} cores, {m['ram']} RAM; kernel {m['kernel']};"
        f" temp dir on {m['fs']}",
        f"- ferry {m['ferry_version']} ({m['bin_dir']}), transport tcp on 127.0.0.1;"
        f" {m['rsync_version']}; {m['ssh_version']}; sshfs {m['sshfs_version']};"
        f" iperf3 {m['iperf3_version']}; fio {m['fio_version']}",
        f"- data: one {m['size_label']} file of random bytes, the same file for every tool"
        f" (all servers export one directory); {small_label(m)} in {m['small_dirs']} directories;"
        + (f" a mixed tree (`bench.py mkmixed`) of {m['mixed_desc']};" if m.get("mixed_desc") else "")
        + f" fio {m['fio_s']} s per run",
        f"- page cache: {m['cache']}",
        (f"- destinations (every copy and backup, every tool, the local-disk ceiling too): {m['dstfs']}:"
         " no tool pays for another's deleted inodes or journal; uploads reach it as `dst/` in"
         " ferryd's share and the rsync daemon's module"
         if m.get("dstfs") else
         "- destinations: a directory on the temp dir's file system (no loop device here: see"
         " the notes); before each run the previous destination goes away (a file is deleted;"
         " a tree is moved into a trash directory, deleted at the end: on an ext4 without a"
         " journal the inode allocator skips each inode deleted in the last minutes one by one,"
         " a cost that would fall on whichever tool runs after a deletion)")
        + "; every copy is compared with its source (cmp, or SHA-256 of the tree) in the first"
        " run, sizes in the others",
        "- the first table times each copy until its destination is durable: the tool's"
        " command, then a syncfs(2) of the destination's file system (`sync -f DEST`) once it"
        " returned. Ferry makes each file durable before renaming it into place (an fsync per"
        " big file, one syncfs per batch of small files), rsync, scp and tar do not, so the"
        " syncfs is where their write-back is paid. The second table has the same runs timed"
        " to the tool's exit alone. iperf3 and the FUSE reads have no destination: their"
        " cells are their own times",
        "- peers: rsync daemon (`rsync -W` for one file, `-a` for trees, `--link-dest` for"
        " backups) on 127.0.0.1, scp and sshfs to a private sshd on 127.0.0.1 (cipher "
        f"{m['cipher']}), iperf3 `-l 1M` (`-R` for download) as the raw TCP ceiling;"
        " best peer leaves out the ceiling",
        "- local-disk ceiling (the ceiling column of the small-file, mixed-tree and FUSE rows): what the"
        " local disk does with the same data and cache state; no network tool can beat it."
        " Each row's job measures it in every run, after the tools, with the same settle and"
        " median: `tar -C SRC -cf - . | tar -C DST -xf -` of the same tree into that row's"
        " destination on the same fresh file system (files/s; timed with the syncfs in the"
        " first table and alone in the second, and checked like the others), a `dd bs=1M`"
        " of the big file itself (MB/s), and the"
        " mounts' fio job (4 KiB psync reads at QD1) on the file itself (the disk's own 4 KiB"
        " reads: a FUSE client that fetches bigger chunks into its cache can undercut its"
        " latency on a small file)",
        "- Ferry vs target: Ferry's speed-up over the issue's target peer (> 1× is faster;"
        " for times and latencies the peer's value / Ferry's); the mixed tree's rows show it"
        " over the rsync daemon and over tar | tar (both targets must be met). Their MB/s are"
        " in the JSON (`mb_s` of each row)",
    ] + ([f"- encryption: {m['ferry_encryption']}"] if m.get("ferry_encryption") else [])
        + ([fusew_bullet(m)] if m.get("fusew_mib") else [])
        + ([conformance_bullet(m)] if m.get("conf_tests_ceiling") else [])
        + [f"- {n}" for n in m.get("notes", "").split("\x1f") if n])


def fusew_bullet(m):
    """The header's account of the FUSE write rows (issue 21)."""
    return (
        "- FUSE writes (issue 21): ferry-mount mounted read-write, sshfs (writable, through"
        " the same sshd) and, as the ceiling, the local disk: the same command on the"
        " destination file system itself. Each run writes onto a fresh destination file"
        " system (`dst/` in each mount) with the client freshly mounted, is timed until that"
        " file system (the server's disk) is synced after the command (syncfs), and what it"
        " wrote is read back from that disk, not through the mount, before the client is"
        " unmounted (cmp or the tree's SHA-256 in the first run, sizes in the others)."
        f" `dd if=BIG of=DIR/wseq.bin bs=1M conv=fsync` of the {m['size_label']} file, read"
        " from the page cache (MB/s); `mkdir DIR/wtar && tar --no-same-owner -C DIR/wtar -xf"
        f" small.tar && sync -f DIR/wtar`, a tar of the {small_label(m)} made once and read"
        " from the page cache (files/s: every tool's write-back, on the server's disk, is"
        " paid in the timed syncs; ferry-mount publishes each file atomically at close);"
        " fio 4 KiB buffered"
        f" (`--direct=0`) random writes into a file of {m['fusew_mib']} MiB written beforehand,"
        f" {m['fio_s']} s, `--end_fsync=1`, at QD1 (psync) and QD16 ({m.get('fusew_engine')}),"
        " IOPS over fio's runtime, which includes the end fsync. Ferry vs target: the"
        " speed-up over sshfs, then the fraction of the local disk's speed"
    )


def conformance_bullet(m):
    """The header's account of the conformance row (issue 42): the tests each tool ran."""
    ran = ", ".join(f"{name} {int(m[k]):,}" for k, name in
                    (("conf_tests_ferry", "ferry-mount"), ("conf_tests_sshfs", "sshfs"),
                     ("conf_tests_ceiling", "local disk")) if m.get(k))
    return (
        "- POSIX conformance (issue 42): pjdfstest (upstream commit 85a8aea, from"
        " `../shared/pjdfstest`), every test file run as root by `scripts/lib/pjdfstest.py`"
        " (each in a directory of its own, 4 at a time, counted as `prove` counts) in"
        " ferry-mount (`scripts/pjdfstest.sh`: a share with `owners = \"client\"`), in"
        " sshfs (as root through the same sshd) and on the local disk, both ferry-mount"
        " and sshfs with `-o allow_other,default_permissions`. Tests run: " + ran +
        "; the cell is the number that failed. Each remaining ferry-mount failure is listed"
        " with its reason in docs/conformance.md"
    )


def write_note(meta, res):
    """The FUSE write rows' details under the table: tar x's seconds and the random
    writes' latencies (medians); None if the run has none."""
    names = [("ferry", "ferry-mount"), ("sshfs", "sshfs"), ("ceiling", "local disk")]
    parts = []
    secs = [f"{n} {v:.2f} s" for t, n in names if (v := med(res, "fusew_tar.s", t)) is not None]
    if secs:
        parts.append(f"tar x of {small_label(meta)} and its syncs took " + ", ".join(secs))
    for rid, q in (("fusew_qd1", "QD1 (psync)"), ("fusew_qd16", f"QD16 ({meta.get('fusew_engine')})")):
        lat = [f"{n} {p50:,.1f} / {p99:,.1f} µs" for t, n in names
               if (p50 := med(res, rid + ".p50", t)) is not None
               and (p99 := med(res, rid + ".p99", t)) is not None]
        if lat:
            parts.append(f"a 4 KiB random write at {q} took at p50 / p99 " + ", ".join(lat))
        rt = [f"{n} {v:.1f} s" for t, n in names if (v := med(res, rid + ".runtime_s", t)) is not None]
        if rt:
            parts.append(f"fio's runtime at {q.split()[0]}, its end fsync included, was"
                         f" {', '.join(rt)} for {meta.get('fio_s')} s of writes")
    if not parts:
        return None
    return "FUSE writes (medians of the runs): " + "; ".join(parts) + "."


def chart(work, out_png, meta, table):
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        return "gnuplot not installed: no chart"
    short = {"upload": "upload", "download": "download", "small_up": "small files\\nupload",
             "small_down": "small files\\ndownload", "mixed_up": "mixed tree\\nupload",
             "mixed_down": "mixed tree\\ndownload", "fuse_seq": "FUSE\\nsequential read",
             "fuse_iops": "FUSE 4 KiB\\nrandom read", "backup_inc": "incremental\\nbackup",
             "backup_full": "full\\nbackup", "rdma_up": "Soft-RoCE\\nupload",
             "rdma_down": "Soft-RoCE\\ndownload", "fusew_seq": "FUSE\\nsequential write",
             "fusew_tar": "FUSE\\ntar x", "fusew_qd1": "FUSE 4 KiB\\nrandom write QD1",
             "fusew_qd16": "FUSE 4 KiB\\nrandom write QD16"}
    thr = [r for r in table if r["id"] in short and r["ferry"] is not None]
    series = ["ferry", "rsync", "scp", "sshfs", "ceiling"]
    dat = os.path.join(work, "throughput.dat")
    with open(dat, "w") as f:
        f.write("# job " + " ".join(series) + " target\n")
        for r in thr:
            ref_tool = {"fuse_seq": "sshfs", "fuse_iops": "sshfs", "fusew_seq": "sshfs",
                        "fusew_tar": "sshfs", "fusew_qd1": "sshfs", "fusew_qd16": "sshfs",
                        "rdma_up": "ceiling", "rdma_down": "ceiling"}.get(r["id"], "rsync")
            ref = r["peers"][ref_tool]["median"]
            vals = [r["ferry"]] + [r["peers"][t]["median"] for t in series[1:]]
            norm = [better(v, ref, r["better"]) if v is not None else None for v in vals]
            if ref_tool == "ceiling":
                norm = [None if v is None or not ref else v / ref for v in vals]
            factor = {"upload": 2, "download": 2, "small_up": 3, "small_down": 3, "mixed_up": 1.5,
                      "mixed_down": 1.5, "fuse_seq": 5,
                      "fuse_iops": 3, "backup_inc": 1, "rdma_up": 0.8, "rdma_down": 0.8,
                      "fusew_seq": 2, "fusew_tar": 2, "fusew_qd1": 2, "fusew_qd16": 2}.get(r["id"])
            label = f"{short[r['id']]}\\nFerry {fmt(r['ferry'], r['unit'])} {r['unit']}"
            cells = ["NaN" if v is None else f"{v:.4f}" for v in norm]
            f.write(f'"{label}" ' + " ".join(cells) + f" {factor if factor else 'NaN'}\n")
    lat = os.path.join(work, "latency.dat")
    lat_rows = 0
    with open(lat, "w") as f:
        f.write("# percentile ferry sshfs local-disk\n")
        for rid, name in (("fuse_p50", "p50"), ("fuse_p99", "p99")):
            r = next((x for x in table if x["id"] == rid), None)
            if r is None:
                continue
            v = [r["ferry"], r["peers"]["sshfs"]["median"], r["peers"]["ceiling"]["median"]]
            f.write(f"{name} " + " ".join("NaN" if x is None else f"{x:.2f}" for x in v) + "\n")
            lat_rows += 1
    # The latency panel only where the run has the FUSE read latencies (the mount job);
    # without them the speed panel takes the whole width.
    latency_panel = f"""
set size 0.3,1
set origin 0.7,0
set title "FUSE 4 KiB random read QD1 latency, µs; lower is better"
set yrange [1:*]
set arrow 1 from graph 0, first 60 to graph 1, first 60 nohead dt 2 lc rgb "#2ca02c" lw 2
set label 1 "p50 target 60 µs" at graph 0.02, first 48 tc rgb "#2ca02c" front
plot "{lat}" using 2:xtic(1) title "ferry-mount" lc rgb "#1f77b4", \\
     "" using 3 title "sshfs" lc rgb "#9467bd", \\
     "" using 4 title "local disk" lc rgb "#7f7f7f"
""" if lat_rows else ""
    gp = os.path.join(work, "chart.gp")
    with open(gp, "w") as f:
        f.write(f"""
set terminal pngcairo size 1800,760 font "sans,10"
set output "{out_png}"
set datafile missing "NaN"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set key top left
set grid ytics
set tmargin 4
set multiplot layout 1,2 title "Ferry vs its peers on loopback, {meta['date']} ({meta['cores']} cores, {meta['mode']})"
set size {0.7 if lat_rows else 1},1
set origin 0,0
set title "speed relative to the issue's target peer (= 1; rsync daemon, sshfs, or the verbs ceiling for RDMA); higher is better"
set logscale y
set yrange [0.05:50]
set bmargin 5
set xtics font "sans,9"
plot "{dat}" using 2:xtic(1) title "Ferry" lc rgb "#1f77b4", \\
     "" using 7 title "target" fs pattern 4 lc rgb "#2ca02c", \\
     "" using 3 title "rsync daemon" lc rgb "#ff7f0e", \\
     "" using 4 title "scp" lc rgb "#d62728", \\
     "" using 5 title "sshfs" lc rgb "#9467bd", \\
     "" using 6 title "ceiling (iperf3 / perftest / local disk)" lc rgb "#7f7f7f"
{latency_panel}unset multiplot
""")
    p = subprocess.run([gnuplot, gp], capture_output=True, text=True)
    if p.returncode != 0:
        return "gnuplot failed: " + p.stderr.strip()[-300:]
    return None


def replace_block(readme, block):
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    with open(readme) as f:
        text = f.read()
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        return f"{readme} has no {begin} ... {end} markers"
    with open(readme, "w") as f:
        f.write(text[:i + len(begin)] + "\n" + block + "\n" + text[j:])
    return None


# --- CPU per GB and the cost of the chunk hash (issue 22) ------------------------------

# The copy rows whose Ferry and rsync runs record CPU-seconds per GB (bench/lib/jobs.sh
# copy_run): ROW.cpu_client (rcp, the rsync client), ROW.cpu_server (ferryd, the rsync
# daemon's children), ROW.cpu_sum; and ROW.hash, the chunk hash rcp --json named.
CPU_ROWS = ["upload", "download", "small_up", "small_down", "mixed_up", "mixed_down"]
# The big file's Ferry runs: rcp as it comes (tool ferry: blake3 by default) and
# rcp --hash sha256 (tool ferry_sha256).
HASH_RUNS = [("ferry", "blake3"), ("ferry_sha256", "sha256")]
NIC_GBS = 12.5  # a 100 Gb/s NIC, in GB/s
SHA_OVER_BLAKE3 = 1.8  # issue 22: CPU-s/GB of both processes at least 1.8x lower with blake3
BLAKE3_VS_RSYNC = 2.0  # issue 22: >= 2x the rsync daemon with blake3, both directions


def med(res, row, tool):
    c = res.get(row, {}).get(tool)
    return None if c is None else c.get("median")


def hash_of(res, row, tool):
    return res.get(row + ".hash", {}).get(tool, {}).get("hash")


def f2(v, spec=".2f", suffix=""):
    return "—" if v is None else format(v, spec) + suffix


def hash_speeds(meta):
    """bench.py hashspeed's JSON of this run (one core's GB per CPU-second of each hash),
    or {} where it was not measured."""
    try:
        return json.loads(meta.get("hash_speed") or "{}")
    except ValueError:
        return {}


def cpu_report(meta, res):
    """CPU per GB of every copy row (Ferry and the rsync daemon), the hash-cost rows of
    the big file (both hashes) with the cores a 12.5 GB/s stream would need, and the
    verdicts of issue 22's targets; as JSON-able dicts."""
    labels = {r[0]: r[1] for r in rows(meta)}
    cpu = []
    for rid in CPU_ROWS:
        for tool in ("ferry", "ferry_sha256", "rsync", "plain"):
            c, s_, b = (med(res, f"{rid}.cpu_{k}", tool) for k in ("client", "server", "sum"))
            if c is None and s_ is None:
                continue
            cpu.append({"id": rid, "job": labels.get(rid, rid), "tool": tool,
                        "hash": hash_of(res, rid, tool), "client": c, "server": s_, "sum": b,
                        "n": len(res.get(f"{rid}.cpu_client", {}).get(tool, {}).get("values", []))})
    cost, targets = [], []
    hs = hash_speeds(meta)
    for rid in ("upload", "download"):
        rsync = med(res, rid + ".sync", "rsync")
        by = {}
        for tool, want in HASH_RUNS:
            gbs = med(res, rid + ".sync", tool)
            if gbs is None and med(res, rid + ".cpu_client", tool) is None:
                fail = res.get(rid + ".sync", {}).get(tool, {}).get("fail") or \
                    res.get(rid, {}).get(tool, {}).get("fail")
                if fail:
                    cost.append({"id": rid, "tool": tool, "hash": want, "fail": fail})
                continue
            c, s_, b = (med(res, f"{rid}.cpu_{k}", tool) for k in ("client", "server", "sum"))
            h = hash_of(res, rid, tool)
            row = {"id": rid, "job": labels.get(rid, rid), "tool": tool, "hash": h,
                   "mb_s": None if gbs is None else gbs * 1000,
                   "vs_rsync": better(gbs, rsync, HIGHER),
                   "rcp_cpu_s_per_gb": c, "ferryd_cpu_s_per_gb": s_, "sum_cpu_s_per_gb": b,
                   "rcp_cores_for_12_5_gb_s": None if c is None else c * NIC_GBS,
                   "ferryd_cores_for_12_5_gb_s": None if s_ is None else s_ * NIC_GBS}
            cost.append(row)
            if h == want:
                by[want] = row
        b3, sha = by.get("blake3"), by.get("sha256")
        ratio = None
        if b3 and sha and b3["sum_cpu_s_per_gb"] and sha["sum_cpu_s_per_gb"]:
            ratio = sha["sum_cpu_s_per_gb"] / b3["sum_cpu_s_per_gb"]
        vs = b3["vs_rsync"] if b3 else None
        # The floor: a copy's CPU is what moving the bytes costs (at least the plain
        # copy's, bench.py plaincopy) plus its hashing: each byte once on each side
        # that hashes, at one core's speed (hashspeed). An upload hashes on both sides
        # (rcp, and ferryd verifying); a download of a recorded file on rcp's alone.
        # So no copy that moves the bytes as cheaply as the plain one can show more
        # than (plain + k / sha256) / (plain + k / blake3).
        plain = med(res, rid + ".cpu_sum", "plain")
        k = 2 if rid == "upload" else 1
        bound = beside = None
        if hs.get("blake3") and hs.get("sha256"):
            if plain:
                bound = (plain + k / hs["sha256"]) / (plain + k / hs["blake3"])
            if b3 and b3["sum_cpu_s_per_gb"]:
                beside = b3["sum_cpu_s_per_gb"] - k / hs["blake3"]
        if b3 or sha:
            targets.append({"id": rid, "job": labels.get(rid, rid),
                            "sha256_over_blake3_cpu": ratio,
                            "cpu_target_held": None if ratio is None else ratio >= SHA_OVER_BLAKE3,
                            "sides_hashing": k, "plain_copy_cpu_s_per_gb": plain,
                            "ferry_cpu_s_per_gb_besides_blake3": beside,
                            "best_ratio_over_plain_copy": bound,
                            "target_above_plain_copy_bound": None if bound is None else bound < SHA_OVER_BLAKE3,
                            "blake3_vs_rsync": vs,
                            "rsync_target_held": None if vs is None else vs >= BLAKE3_VS_RSYNC})
    return {"cpu": cpu, "hash_cost": cost, "hash_targets": targets}


def held(v):
    return {True: "held", False: "**not held**", None: "—"}[v]


def cpu_markdown(meta, rep, parts=("cpu", "hash")):
    """The report's CPU section: a table of CPU-s/GB per copy row ("cpu"), then the hash
    cost ("hash")."""
    out = []
    names = {"ferry": "Ferry (rcp, ferryd)", "ferry_sha256": "Ferry, rcp --hash sha256",
             "rsync": "rsync (client, daemon)",
             "plain": "plain copy, no hash (direct I/O, bench.py plaincopy)"}
    if rep["cpu"] and "cpu" in parts:
        out += ["CPU-seconds per GB copied (GB = 1e9 bytes of file data; median of the runs"
                " of the first table): the client is the command's own rusage (rcp, the rsync"
                " client), the server is ferryd's utime + stime (`/proc/PID/stat`), or what"
                " the rsync daemon's children used (the daemon's cutime + cstime once it"
                " reaped them), from just before the command to just after the destination's"
                " sync; kernel threads (the loop device, jbd2, softirq on other CPUs) are in"
                " neither. Each process's CPU is counted in clock ticks of"
                f" {1 / os.sysconf('SC_CLK_TCK') * 1000:.0f} ms: ±"
                f"{1 / os.sysconf('SC_CLK_TCK') / (int(meta.get('size_bytes') or 0) / 1e9 or 1):.3f}"
                " CPU-s/GB on the big file, more on the smaller trees:", "",
                "| job | tool | chunk hash | client CPU-s/GB | server CPU-s/GB | both |",
                "|---|---|---|---:|---:|---:|"]
        for r in rep["cpu"]:
            out.append("| " + " | ".join([r["job"], names[r["tool"]], r["hash"] or "—",
                                          f2(r["client"], ".3f"), f2(r["server"], ".3f"),
                                          f2(r["sum"], ".3f")]) + " |")
    cost = rep["hash_cost"] if "hash" in parts else []
    if cost:
        hs = hash_speeds(meta)
        out += ["Hash cost and a 100 Gb/s NIC: the big file with each chunk hash, in the"
                " same run, from the same cache state onto the same fresh file system (MB/s"
                " and the ratio to the rsync daemon as in the first table, until durable;"
                f" cores for {NIC_GBS:g} GB/s = CPU-s/GB × {NIC_GBS:g}: what each side"
                " would keep busy at this machine's per-core speed to fill a 100 Gb/s link,"
                " if the work spread over that many cores):", "",
                f"| job | chunk hash | MB/s | vs rsync daemon | rcp CPU-s/GB | ferryd CPU-s/GB"
                f" | both | rcp cores for {NIC_GBS:g} GB/s | ferryd cores for {NIC_GBS:g} GB/s |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in cost:
            if "fail" in r:
                out.append(f"| {r['id']} | {r['hash']} | failed: {r['fail'].replace('|', '/')}"
                           " | | | | | | |")
                continue
            out.append("| " + " | ".join([
                r["job"], r["hash"] or "—", f2(r["mb_s"], ",.0f"), f2(r["vs_rsync"], ".2f", "×"),
                f2(r["rcp_cpu_s_per_gb"], ".3f"), f2(r["ferryd_cpu_s_per_gb"], ".3f"),
                f2(r["sum_cpu_s_per_gb"], ".3f"), f2(r["rcp_cores_for_12_5_gb_s"], ".1f"),
                f2(r["ferryd_cores_for_12_5_gb_s"], ".1f")]) + " |")
        if rep["hash_targets"]:
            out += ["", f"| job | CPU-s/GB of both, sha256 / blake3 | ≥ {SHA_OVER_BLAKE3:g}×"
                    " | sides hashing | plain copy CPU-s/GB | Ferry's CPU-s/GB besides blake3"
                    " | best ratio over the plain copy"
                    f" | blake3 vs rsync daemon | ≥ {BLAKE3_VS_RSYNC:g}× |",
                    "|---|---:|---|---:|---:|---:|---:|---:|---|"]
            for t in rep["hash_targets"]:
                bound = f2(t.get("best_ratio_over_plain_copy"), ".2f", "×")
                if t.get("target_above_plain_copy_bound"):
                    bound += " (target above it)"
                out.append("| " + " | ".join([
                    t["job"], f2(t["sha256_over_blake3_cpu"], ".2f", "×"), held(t["cpu_target_held"]),
                    str(t.get("sides_hashing", "—")), f2(t.get("plain_copy_cpu_s_per_gb"), ".3f"),
                    f2(t.get("ferry_cpu_s_per_gb_besides_blake3"), ".3f"), bound,
                    f2(t["blake3_vs_rsync"], ".2f", "×"), held(t["rsync_target_held"])]) + " |")
            out += ["", "The ratio's ceiling: a copy costs what moving the bytes costs plus"
                    " its hashing, each byte once on each side that hashes (an upload: rcp and"
                    " ferryd, which verifies; a download of a file ferryd holds a record of:"
                    " rcp alone), at one core's speed below. The plain copy moves the same"
                    " file, from the same cache state onto the same fresh file system, over"
                    " loopback TCP with no hash at all, read and written direct 1 MiB at a time"
                    " by two processes (`bench.py plaincopy`; its CPU-s/GB in the table above); no copy that moves the bytes as cheaply can show"
                    " more than (plain + sides / sha256 speed) / (plain + sides / blake3"
                    " speed). Ferry's CPU besides blake3 is its blake3 row less that hashing."]
        speeds = []
        for name in ("blake3", "sha256"):
            if hs.get(name):
                speeds.append(f"{name} {hs[name]:.2f} GB/s (`{hs[name + '_tool']}`)")
            elif hs.get(name + "_note"):
                speeds.append(f"{name}: not measured ({hs[name + '_note']})")
        if speeds:
            out += ["", "One core's raw hash speed here, GB per CPU-second: " + "; ".join(speeds) + "."]
    return "\n".join(out).strip("\n")


# --- encryption: its cost and encrypted Ferry against scp (issue point 6) ------------------

# The crypt job's rows (bench/lib/jobs.sh job_crypt): tools ferry_enc (rcp --encryption
# required), ferry_off (--encryption off) and scp; ROW.suite names the suite of each
# Ferry run, ROW.cpu_* its CPU-seconds per GB.
CRYPT_ROWS = [("crypt_up", "upload", True), ("crypt_down", "download", True),
              ("crypt_small_up", "small_up", False), ("crypt_small_down", "small_down", False)]
CRYPT_MAX_COST = 0.15  # encryption costs at most 15 % of the big file's throughput (with AES)
CRYPT_VS_SCP = 3.0  # encrypted Ferry at least 3x scp


def crypt_report(meta, res, alone):
    """The crypt rows as JSON-able dicts: each tool's durable median (res, durable()) and
    cell text, the suite, encrypted / unencrypted (and the cost, 1 - that; also of the
    tool-alone times, alone), encrypted Ferry / scp, the verdicts, and the big file's
    CPU-seconds per GB."""
    labels = {r[0]: (r[1], r[2]) for r in rows(meta)}
    reps, aes = int(meta["reps"]), meta.get("aes") == "yes"
    out = []
    for rid, base, big in CRYPT_ROWS:
        tools = res.get(rid, {})
        if not tools:
            continue
        job, unit = labels[base]
        cells = {t: cell_of(tools, t, unit, reps) for t in ("ferry_enc", "ferry_off", "scp")}
        enc, off, scp = (cells[t][1] for t in ("ferry_enc", "ferry_off", "scp"))
        ratio = better(enc, off, HIGHER)
        ratio_alone = better(med(alone, rid, "ferry_enc"), med(alone, rid, "ferry_off"), HIGHER)
        vs_scp = better(enc, scp, HIGHER)
        suites = {t: res.get(rid + ".suite", {}).get(t, {}).get("suite") for t in ("ferry_enc", "ferry_off")}
        cost_met = None
        if big and aes and ratio is not None:
            cost_met = 1 - ratio <= CRYPT_MAX_COST
        row = {"id": rid, "job": job, "unit": unit, "big_file": big,
               "text": {t: c[0] for t, c in cells.items()},
               "encrypted": enc, "unencrypted": off, "scp": scp,
               "suite": suites["ferry_enc"], "suite_off": suites["ferry_off"],
               "enc_over_off": ratio, "cost": None if ratio is None else 1 - ratio,
               "cost_tool_alone": None if ratio_alone is None else 1 - ratio_alone,
               "cost_target_met": cost_met,
               "enc_vs_scp": vs_scp,
               "scp_target_met": None if vs_scp is None else vs_scp >= CRYPT_VS_SCP}
        if big:
            for k in ("client", "server", "sum"):
                for t, name in (("ferry_enc", "enc"), ("ferry_off", "off")):
                    row[f"cpu_{k}_{name}"] = med(res, f"{rid}.cpu_{k}", t)
        out.append(row)
    return out


def met(v):
    return {True: "met", False: "**not met**", None: "—"}[v]


def crypt_markdown(meta, crypt):
    """The report's encryption section: the throughput table with both targets, then the
    big file's CPU-seconds per GB encrypted and not."""
    if not crypt:
        return ""
    aes = meta.get("aes") == "yes"
    out = ["Encryption (`bench/run --only crypt`): the big file and the small files with"
           " `rcp --encryption required` (encrypted) and `rcp --encryption off` (unencrypted)"
           " against the same ferryd (`--encryption preferred`), in the same run, from the"
           " same cache state onto the same fresh file system, each timed until durable like"
           " the first table, beside scp (encrypted too: cipher"
           f" {meta.get('cipher') or 'its default'}). The first table's Ferry rows are"
           " unencrypted, like the rsync daemon. This CPU "
           + ("has AES instructions (`aes` in /proc/cpuinfo)." if aes else
              "has no AES instructions (no `aes` in /proc/cpuinfo): the cost target, set for"
              " CPUs with them, is not judged.")
           + f" Cost = 1 − encrypted / unencrypted (target ≤ {CRYPT_MAX_COST:.0%} on the big"
           " file; in brackets, of the tools' times alone, without the sync); encrypted"
           f" Ferry / scp target ≥ {CRYPT_VS_SCP:g}×:", "",
           "| job | unit | Ferry encrypted | suite | Ferry unencrypted | scp | encrypted /"
           f" unencrypted | cost | ≤ {CRYPT_MAX_COST:.0%}? | encrypted vs scp | ≥ {CRYPT_VS_SCP:g}×? |",
           "|---|---|---:|---|---:|---:|---:|---:|---|---:|---|"]
    for r in crypt:
        cost = f2(r["cost"], ".1%")
        if r["cost_tool_alone"] is not None:
            cost += f" ({r['cost_tool_alone']:.1%})"
        verdict = met(r["cost_target_met"]) if r["big_file"] and aes else "—"
        suite = r["suite"] or "—"
        if r["suite_off"] not in (None, "none"):
            suite += f"; **unencrypted run: {r['suite_off']}**"
        cells = [r["job"], r["unit"], r["text"]["ferry_enc"], suite, r["text"]["ferry_off"],
                 r["text"]["scp"], f2(r["enc_over_off"], ".2f"), cost, verdict,
                 f2(r["enc_vs_scp"], ".2f", "×"), met(r["scp_target_met"])]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    big = [r for r in crypt if r["big_file"] and r.get("cpu_client_enc") is not None]
    if big:
        out += ["", "CPU-seconds per GB of the big file (counted as in the CPU table: rcp's"
                " rusage, ferryd's utime + stime), encrypted / unencrypted:", "",
                "| job | rcp | ferryd | both | both, added by encryption |",
                "|---|---:|---:|---:|---:|"]
        for r in big:
            pair = [f"{f2(r[f'cpu_{k}_enc'], '.3f')} / {f2(r[f'cpu_{k}_off'], '.3f')}"
                    for k in ("client", "server", "sum")]
            added = None
            if r["cpu_sum_enc"] is not None and r["cpu_sum_off"] is not None:
                added = r["cpu_sum_enc"] - r["cpu_sum_off"]
            out.append("| " + " | ".join([r["job"]] + pair + [f2(added, "+.3f")]) + " |")
    return "\n".join(out)


# --- cluster: one big file over 1, 2 and 4 storage nodes -------------------------------------

# The cluster job's configurations (bench/lib/jobs.sh job_cluster): nodes, replicas, the
# rows' suffix; each has rows cluster_up_SFX and cluster_down_SFX (MB/s of the tool
# alone; .sync: until durable, the headline), tool ferry.
CLUSTER_CONFIGS = [(1, 1, "n1"), (2, 1, "n2"), (4, 1, "n4"), (4, 2, "n4r2")]
CLUSTER_TARGETS = {2: 1.8, 4: 3.2}  # speed-up over 1 node, replicas 1


def cluster_report(meta, res):
    """The cluster rows as JSON-able dicts: per configuration and direction the durable
    and tool-alone medians, the speed-up over 1 node, the ceiling (the nodes' links:
    N x RATE; an upload with R replicas moves R copies into the nodes, N x RATE / R) and
    the target's verdict; then the iperf3 rates of one shaped link."""
    if not any(k.startswith("cluster_") for k in res):
        return None
    rate, reps = float(meta.get("cluster_rate_mbs") or 0), int(meta["reps"])
    base = {d: med(res, f"cluster_{d}_n1.sync", "ferry") for d in ("up", "down")}
    configs = []
    for nodes, replicas, sfx in CLUSTER_CONFIGS:
        row = {"nodes": nodes, "replicas": replicas}
        for d in ("up", "down"):
            rid = f"cluster_{d}_{sfx}"
            merged = dict(res.get(rid, {}))
            merged.update(res.get(rid + ".sync", {}))
            text, v = cell_of(merged, "ferry", "MB/s", reps)
            ceiling = nodes * rate / (replicas if d == "up" else 1)
            ratio = better(v, base[d], HIGHER) if replicas == 1 else None
            target = CLUSTER_TARGETS.get(nodes) if replicas == 1 else None
            row[d] = {"mb_s": v, "text": text, "mb_s_tool_alone": med(res, rid, "ferry"),
                      "vs_1_node": ratio, "ceiling_mb_s": ceiling,
                      "of_ceiling": None if v is None or not ceiling else v / ceiling,
                      "target": target,
                      "target_met": None if target is None or ratio is None else ratio >= target}
        configs.append(row)
    link = {d: med(res, f"cluster_link_{d}", "ceiling") for d in ("up", "down")}
    link_text = {d: cell_of(res.get(f"cluster_link_{d}", {}), "ceiling", "MB/s", reps)[0]
                 for d in ("up", "down")}
    return {"rate_mb_s": rate, "configs": configs, "link_mb_s": link, "link_text": link_text}


# The hung-node rows (bench/lib/jobs.sh cluster_hung), seconds of the tool alone:
# cluster_hung_{up,down}_ok healthy, cluster_hung_{up,down} with node 1 SIGSTOPped part-way,
# cluster_hung_mount (a read through ferry-mount with node 1 stopped) and
# cluster_hung_mount_stall (its longest single read). Targets: each hung copy within
# 2x its healthy time plus 3 s; no mount read stalls more than 3 s.
HUNG_FACTOR, HUNG_SLACK_S, HUNG_STALL_S = 2.0, 3.0, 3.0


def hung_report(meta, res):
    """The hung-node rows as a JSON-able dict: per direction the healthy and hung
    medians, their ratio, the target time and its verdict; the mount's read and longest
    stall against theirs."""
    if not any(k.startswith("cluster_hung_") for k in res):
        return None
    reps = int(meta["reps"])

    def text(row):
        return cell_of(res.get(row, {}), "ferry", "s", reps)[0]

    out = {}
    for d in ("up", "down"):
        ok, hung = med(res, f"cluster_hung_{d}_ok", "ferry"), med(res, f"cluster_hung_{d}", "ferry")
        target = None if ok is None else HUNG_FACTOR * ok + HUNG_SLACK_S
        out[d] = {"healthy_s": ok, "hung_s": hung, "healthy_text": text(f"cluster_hung_{d}_ok"),
                  "hung_text": text(f"cluster_hung_{d}"),
                  "ratio": None if ok is None or hung is None else hung / ok,
                  "target_s": target,
                  "target_met": None if target is None or hung is None else hung <= target}
    stall = med(res, "cluster_hung_mount_stall", "ferry")
    out["mount"] = {"read_s": med(res, "cluster_hung_mount", "ferry"),
                    "read_text": text("cluster_hung_mount"), "longest_read_s": stall,
                    "target_s": HUNG_STALL_S,
                    "target_met": None if stall is None else stall <= HUNG_STALL_S}
    return out


def hung_markdown(meta, h):
    """The report's hung-node section."""
    if not h:
        return ""
    out = [f"Hung node (`bench/run --only cluster`): one {meta['size_label']} file to and from"
           " a fresh cluster of 3 nodes (share `bench`, 2 replicas, links shaped as above),"
           " healthy and then with node 1 stopped by SIGSTOP a third of the healthy time into"
           " the copy (alive, its connections open, answering nothing; SIGCONT after); seconds"
           " of the tool alone. Target: each within 2× its healthy time plus 3 s. Then the"
           " file read through `ferry-mount -o ro` with node 1 stopped before the read: the"
           " longest single 1 MiB read (target: at most 3 s).",
           "",
           "| direction | healthy | node 1 hung | ratio | target | met? |",
           "|---|---:|---:|---:|---:|---|"]
    for d, name in (("up", "upload"), ("down", "download")):
        r = h[d]
        out.append(f"| {name} | {r['healthy_text']} s | {r['hung_text']} s | {f2(r['ratio'], '.2f', '×')}"
                   f" | ≤ {f2(r['target_s'], '.2f', ' s')} | {met(r['target_met'])} |")
    m = h["mount"]
    out.append(f"| mount read (longest read) | — | {m['read_text']} s ({f2(m['longest_read_s'], '.2f', ' s')})"
               f" | — | ≤ {m['target_s']:g} s | {met(m['target_met'])} |")
    return "\n".join(out)


def cluster_markdown(meta, cl):
    """The report's cluster section: one line per configuration, both directions."""
    if not cl:
        return ""
    rate = cl["rate_mb_s"]

    def link(d):
        v = cl["link_mb_s"][d]
        return f"{v:,.1f} MB/s" if v is not None else cl["link_text"][d]

    out = [f"Cluster scaling (`bench/run --only cluster`): one {meta['size_label']} file with"
           " `rcp --replicas R` to the share `bench` of a fresh cluster and back (compared with"
           " cmp): a real etcd and N ferryd storage nodes, each in its own network namespace"
           f" behind a veth shaped with tc tbf to {rate:g} MB/s each way, stores on the local"
           " disk; each copy timed until synced (in brackets: the tool alone). MB/s = 10^6"
           " bytes/s. × 1 node: against the same direction on one node (targets "
           + ", ".join(f"≥ {t:g}× at {n} nodes" for n, t in CLUSTER_TARGETS.items())
           + "); ceiling: what the nodes' links carry, N × RATE (an upload with 2 replicas"
           " moves two copies: half). One shaped link measured by iperf3 `-l 1M`: "
           f"{link('up')} to the node, {link('down')} from it.",
           "",
           "| nodes | replicas | direction | MB/s | × 1 node | ceiling | of ceiling | target | met? |",
           "|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for c in cl["configs"]:
        for d, name in (("up", "upload"), ("down", "download")):
            r = c[d]
            cell = r["text"]
            if r["mb_s_tool_alone"] is not None and r["mb_s"] is not None:
                cell += f" ({r['mb_s_tool_alone']:,.1f})"
            target = f"≥ {r['target']:g}×" if r["target"] else "—"
            cells = [str(c["nodes"]), str(c["replicas"]), name, cell.replace("|", "/"),
                     f2(r["vs_1_node"], ".2f", "×"), f2(r["ceiling_mb_s"], ",.0f"),
                     f2(r["of_ceiling"], ".0%"), target,
                     met(r["target_met"]) if r["target"] else "—"]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def floor_note(meta, res):
    """The round-trip floor of a FUSE miss (bench/rtt.c), with what it bounds; None if
    the run did not measure it."""
    rtt = res.get("rtt", {})

    def med(tool, row=None):
        c = (res.get(row, {}) if row else rtt).get(tool)
        return None if c is None else c["median"]

    any50, one50 = med("any"), med("one")
    if any50 is None or one50 is None:
        why = rtt.get("any", {}).get("fail")
        return f"Round-trip floor: not measured ({why})." if why else None
    text = (
        f"Round-trip floor (`bench/rtt.c`, median of {len(rtt['any']['values'])}): a 64-byte"
        " request and a 16 KiB answer between two processes on 127.0.0.1 over one TCP"
        " connection at queue depth 1, in plain blocking C, take"
        f" {any50:.1f} µs at p50 with the processes wherever the scheduler puts them and"
        f" {one50:.1f} µs with both pinned to one CPU (a wake-up of an idle vCPU costs the"
        " difference)."
    )
    disk50 = med("ceiling", "fuse_p50")
    sshfs = med("sshfs", "fuse_iops")
    if disk50 is not None:
        best, placed = one50 + disk50, any50 + disk50

        def bound(us):
            iops = 1e6 / us
            return f"{iops:,.0f} IOPS" + (f" ({iops / sshfs:.2f}× sshfs)" if sshfs else "")

        text += (
            " A 4 KiB read that misses every cache of a network file system pays at least one"
            f" such round trip and the disk's own read (the p50 row's ceiling, {disk50:.1f} µs),"
            f" before FUSE's own round trip: {best:.0f} µs with no wake-up crossing CPUs,"
            f" {placed:.0f} µs as placed here; at QD1 that is at most {bound(best)} and"
            f" {bound(placed)}."
        )
    return text


def report(argv):
    work, out_base, readme = argv[0], argv[1], argv[2]
    meta, res = load(work)
    table = evaluate(meta, durable(res))
    alone = evaluate(meta, res, only=SYNC_ROWS)
    md = [header(meta), "", "Each copy timed until its destination is durable (the tool, then"
          " `sync -f` of the destination's file system):", "", markdown_table(table)]
    floor = floor_note(meta, res)
    if floor:
        md += ["", floor]
    wnote = write_note(meta, res)
    if wnote:
        md += ["", wnote]
    cpu = cpu_report(meta, res)
    for part in ("hash", "cpu"):
        text = cpu_markdown(meta, cpu, (part,))
        if text:
            md += ["", text]
    crypt = crypt_report(meta, durable(res), res)
    crypt_md = crypt_markdown(meta, crypt)
    if crypt_md:
        md += ["", crypt_md]
    cluster = cluster_report(meta, res)
    cluster_md = cluster_markdown(meta, cluster)
    if cluster_md:
        md += ["", cluster_md]
    hung_rows = hung_report(meta, res)
    hung_md = hung_markdown(meta, hung_rows)
    if hung_md:
        md += ["", hung_md]
    st = alone_table(alone)
    if st:
        md += ["", "The copy jobs again, each run timed to the tool's exit alone (no sync after"
               " it: what rsync, scp and tar leave in the page cache is not yet on the disk):",
               "", st]
    md_text = "\n".join(md) + "\n"
    print(md_text)
    if out_base == "-":
        return
    with open(out_base + ".md", "w") as f:
        f.write(md_text)
    with open(out_base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": table, "rows_tool_alone": alone, **cpu, "crypt": crypt, "cluster": cluster,
                   "hung": hung_rows,
                   "raw": res}, f,
                  indent=1, ensure_ascii=False)
        f.write("\n")
    problem = chart(work, out_base + ".png", meta, table)
    if problem:
        print(f"[bench] warning: {problem}", file=sys.stderr)
    if readme != "-":
        name = os.path.basename(out_base)
        block = "\n".join([
            f"Measured by `bench/run` on {meta['date']}: {meta['cpu']}, {meta['cores']} cores,"
            f" kernel {meta['kernel']}; median of {meta['reps']} runs{mixed_reps_note(meta)}, everything on 127.0.0.1,"
            f" page cache {meta['cache'].split(':')[0]}; each copy timed until its destination"
            + (" (a fresh journaled ext4)" if meta.get("dstfs") else "")
            + " is durable (the tool, then `sync -f` of that file system). Full report with"
            " versions, notes and the times of the tools alone:"
            f" [bench/results/{name}.md](bench/results/{name}.md).",
            "",
            markdown_table(table),
            "",
        ] + ([floor, ""] if floor else []) + ([wnote, ""] if wnote else []) + (
            [hash_md, ""] if (hash_md := cpu_markdown(meta, cpu, ("hash",))) else []) + (
            [crypt_md, ""] if crypt_md else []) + [
            "![Ferry vs its peers](bench/results/latest.png)" if not problem else "",
        ])
        why = replace_block(readme, block)
        if why:
            sys.exit(f"[bench] ERROR: {why}")


def hung(args):
    """See the module docs: a command timed with a process SIGSTOPped part-way."""
    limit, delay, pid, out, err = float(args[0]), float(args[1]), int(args[2]), args[3], args[4]
    cmd = args[args.index("--") + 1:]
    t0 = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e)
    stopped = False
    try:
        try:
            p.wait(timeout=delay)
            print(f"ended before the node was stopped ({time.monotonic() - t0:.2f} s in)")
            sys.exit(3)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGSTOP)
            stopped = True
        try:
            code = p.wait(timeout=max(limit - delay, 1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            print(f"ran past {limit:g} s with the node stopped")
            sys.exit(3)
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - t0
    if code != 0:
        tail = open(err, errors="replace").read().strip().splitlines()[-1:] or [""]
        print(f"exit {code}: {tail[0][:120]}")
        sys.exit(3)
    print(f"{took:.3f}")


def readlat(args):
    """See the module docs: a whole-file read and its longest single read(2)."""
    worst, t0 = 0.0, time.monotonic()
    with open(args[0], "rb", buffering=0) as f:
        while True:
            t = time.monotonic()
            chunk = f.read(1 << 20)
            worst = max(worst, time.monotonic() - t)
            if not chunk:
                break
    print(f"{time.monotonic() - t0:.3f} {worst:.3f}")


if __name__ == "__main__":
    {"run": run_timed, "hung": hung, "readlat": readlat, "port": free_port, "hashspeed": hashspeed, "mktree": mktree, "mkmixed": mkmixed, "change": change,
     "treesum": treesum, "plaincopy": plaincopy, "fio": fio, "iperf": iperf, "field": field, "live": live,
     "report": report}[sys.argv[1]](sys.argv[2:])
