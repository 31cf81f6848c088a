#!/usr/bin/env python3
"""Scaling measurements for docs/performance.md: how rcp's throughput and CPU cost per
GB grow with file size, file count, ferryd's queue depth and the number of clients.

Everything runs on 127.0.0.1 with one ferryd per sweep point (so a queue depth is the
server's), data under --dir (default /dev/shm: the network path and the CPU are
measured, not the disk). CPU is measured, not estimated: rcp's user+system time from
wait4(2), ferryd's from /proc/PID/stat, each divided by the bytes moved. On a shared
2-core machine the wall-clock figures move by tens of percent between runs; the CPU
figures much less, which is why both are printed.

    bench/scaling.py                        # release build, 3 repetitions
    bench/scaling.py --quick --bin-dir target/debug
    bench/scaling.py --only size,clients --reps 5

Prints a markdown report on stdout (and to --out FILE if given).
"""

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def log(msg):
    print(f"[scaling] {msg}", file=sys.stderr, flush=True)


def proc_cpu(pid):
    """User+system CPU seconds of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Ferryd:
    """One ferryd serving `share` on 127.0.0.1, stopped by PID."""

    def __init__(self, bin_dir, work, share, queue_depth=None):
        self.port_file = os.path.join(work, "port")
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        args = [
            os.path.join(bin_dir, "ferryd"),
            "--share", f"bench={share}",
            "--secret-file", os.path.join(work, "secret"),
            "--listen", "127.0.0.1:0",
            "--port-file", self.port_file,
            "--transport", "tcp",
        ]
        if queue_depth:
            args += ["--queue-depth", str(queue_depth)]
        self.log = open(os.path.join(work, "ferryd.log"), "ab")
        self.proc = subprocess.Popen(args, stderr=self.log, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not (os.path.exists(self.port_file) and os.path.getsize(self.port_file)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("[scaling] ERROR: ferryd did not start (see its log)")
            time.sleep(0.02)
        with open(self.port_file) as f:
            self.addr = f.read().strip()

    def cpu(self):
        return proc_cpu(self.proc.pid)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_rcps(bin_dir, jobs):
    """Runs the rcp argument lists in `jobs` at once; returns (wall s, their CPU s)."""
    rcp = os.path.join(bin_dir, "rcp")
    t0 = time.monotonic()
    procs = [subprocess.Popen([rcp, "-q", *j], stdout=subprocess.DEVNULL) for j in jobs]
    cpu = 0.0
    for p in procs:
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            sys.exit(f"[scaling] ERROR: rcp exited {p.returncode}: {' '.join(p.args)}")
        cpu += ru.ru_utime + ru.ru_stime
    return time.monotonic() - t0, cpu


def write_random(path, size):
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MIB)
            f.write(os.urandom(n))
            left -= n


def clear(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


class Bench:
    def __init__(self, args):
        self.args = args
        self.bin = args.bin_dir
        self.work = tempfile.mkdtemp(prefix="ferry-scaling.", dir=args.dir)
        self.share = os.path.join(self.work, "share")
        self.local = os.path.join(self.work, "local")
        os.makedirs(self.share)
        os.makedirs(self.local)
        subprocess.run(
            [os.path.join(self.bin, "ferryd"), "--generate-secret",
             os.path.join(self.work, "secret")],
            check=True, stderr=subprocess.DEVNULL,
        )
        os.environ["FERRY_SECRET_FILE"] = os.path.join(self.work, "secret")
        self.rows = {}

    def close(self):
        shutil.rmtree(self.work, ignore_errors=True)

    def measure(self, server, make_jobs, cleanup, size):
        """Median over the repetitions of (wall s, client CPU s, server CPU s)."""
        samples = []
        for _ in range(self.args.reps):
            cleanup()
            c0 = server.cpu()
            wall, ccpu = run_rcps(self.bin, make_jobs())
            samples.append((wall, ccpu, server.cpu() - c0))
        med = lambda i: statistics.median(s[i] for s in samples)  # noqa: E731
        return med(0), med(1), med(2)

    def transfer_row(self, label, wall, ccpu, scpu, nbytes):
        gb = nbytes / 1e9
        return (f"| {label} | {wall:.3f} | {gb / wall:.3f} | {ccpu / gb:.2f} | "
                f"{scpu / gb:.2f} | {(ccpu + scpu) / gb:.2f} |")

    # --- sweeps ---------------------------------------------------------------

    def sweep_size(self):
        sizes = [1, 16, 256] if self.args.quick else [1, 16, 256, 1024]
        rows = []
        srv = Ferryd(self.bin, self.work, self.share)
        try:
            for mib in sizes:
                src = os.path.join(self.local, f"f{mib}.bin")
                write_random(src, mib * MIB)
                remote = f"{srv.addr}:bench/f{mib}.bin"
                back = os.path.join(self.local, "back.bin")
                for way, jobs, dst in (
                    ("up", lambda: [[src, remote]], os.path.join(self.share, f"f{mib}.bin")),
                    ("down", lambda: [[remote, back]], back),
                ):
                    log(f"size {mib} MiB {way}")
                    # The download needs the uploaded copy: only the upload clears.
                    res = self.measure(srv, jobs, lambda d=dst: clear(d), mib * MIB)
                    rows.append(self.transfer_row(f"{mib} MiB {way}", *res, mib * MIB))
                clear(src)
                clear(back)
        finally:
            srv.stop()
        self.rows["size"] = (
            "One file, upload (server RDMA-READs) and download (server RDMA-WRITEs)",
            "| file | seconds | GB/s | rcp CPU s/GB | ferryd CPU s/GB | total CPU s/GB |",
            rows,
        )

    def sweep_count(self):
        counts = [100, 1000] if self.args.quick else [100, 1000, 10000]
        rows = []
        srv = Ferryd(self.bin, self.work, self.share)
        try:
            for n in counts:
                tree = os.path.join(self.local, f"t{n}")
                for i in range(n):
                    d = os.path.join(tree, f"d{i // 100:03}")
                    os.makedirs(d, exist_ok=True)
                    with open(os.path.join(d, f"f{i:05}"), "wb") as f:
                        f.write(os.urandom(4096))
                remote = f"{srv.addr}:bench/t{n}"
                back = os.path.join(self.local, "back")
                for way, jobs, dst, pre in (
                    ("up", lambda: [["-r", tree, f"{srv.addr}:bench/"]],
                     os.path.join(self.share, f"t{n}"), None),
                    ("down", lambda: [["-r", remote, back]], back, back),
                ):
                    log(f"count {n} x 4 KiB {way}")

                    def cleanup(d=dst, p=pre):
                        clear(d)
                        if p:
                            os.makedirs(p)

                    wall, ccpu, scpu = self.measure(srv, jobs, cleanup, n * 4096)
                    rows.append(
                        f"| {n} x 4 KiB {way} | {wall:.3f} | {n / wall:.0f} | "
                        f"{ccpu / n * 1e6:.0f} | {scpu / n * 1e6:.0f} |"
                    )
                clear(back)
                clear(os.path.join(self.share, f"t{n}"))
                clear(tree)
        finally:
            srv.stop()
        self.rows["count"] = (
            "Many 4 KiB files in directories of 100 (`rcp -r`)",
            "| tree | seconds | files/s | rcp CPU µs/file | ferryd CPU µs/file |",
            rows,
        )

    def sweep_depth(self):
        mib = 64 if self.args.quick else 512
        depths = [1, 4, 16] if self.args.quick else [1, 2, 4, 8, 16, 32]
        src = os.path.join(self.local, "qd.bin")
        write_random(src, mib * MIB)
        back = os.path.join(self.local, "back.bin")
        rows = []
        for qd in depths:
            srv = Ferryd(self.bin, self.work, self.share, queue_depth=qd)
            try:
                remote = f"{srv.addr}:bench/qd.bin"
                for way, jobs, dst in (
                    ("up", lambda: [[src, remote]], os.path.join(self.share, "qd.bin")),
                    ("down", lambda: [[remote, back]], back),
                ):
                    log(f"queue depth {qd} {way}")
                    res = self.measure(srv, jobs, lambda d=dst: clear(d), mib * MIB)
                    rows.append(self.transfer_row(f"{qd} ({way})", *res, mib * MIB))
            finally:
                srv.stop()
            clear(os.path.join(self.share, "qd.bin"))
        clear(src)
        clear(back)
        self.rows["depth"] = (
            f"ferryd `--queue-depth` (1 MiB chunks in flight per connection), one {mib} MiB file",
            "| queue depth | seconds | GB/s | rcp CPU s/GB | ferryd CPU s/GB | total CPU s/GB |",
            rows,
        )

    def sweep_clients(self):
        mib = 32 if self.args.quick else 256
        counts = [1, 2, 4] if self.args.quick else [1, 2, 4, 8]
        srcs = []
        for i in range(max(counts)):
            p = os.path.join(self.local, f"c{i}.bin")
            write_random(p, mib * MIB)
            srcs.append(p)
        rows = []
        srv = Ferryd(self.bin, self.work, self.share)
        try:
            for n in counts:
                log(f"{n} clients")

                def cleanup(n=n):
                    for i in range(n):
                        clear(os.path.join(self.share, f"c{i}.bin"))

                res = self.measure(
                    srv,
                    lambda n=n: [[srcs[i], f"{srv.addr}:bench/c{i}.bin"] for i in range(n)],
                    cleanup,
                    n * mib * MIB,
                )
                rows.append(self.transfer_row(f"{n}", *res, n * mib * MIB))
                cleanup()
        finally:
            srv.stop()
        for p in srcs:
            clear(p)
        self.rows["clients"] = (
            f"Concurrent clients, each uploading its own {mib} MiB file (aggregate)",
            "| clients | seconds | GB/s | rcp CPU s/GB | ferryd CPU s/GB | total CPU s/GB |",
            rows,
        )

    def report(self):
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True
        ).stdout.strip()
        cpu = "?"
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        fs = subprocess.run(
            ["df", "-PT", self.work], capture_output=True, text=True
        ).stdout.splitlines()[-1].split()[1]
        out = [
            f"# Ferry scaling run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- {os.cpu_count()} CPUs ({cpu}), Linux {os.uname().release}; data on {fs} "
            f"({self.args.dir}); transport tcp on 127.0.0.1; revision {rev}",
            f"- median of {self.args.reps} run(s); GB = 10^9 bytes; CPU = user + system "
            "time of every rcp (wait4) and of ferryd (/proc), per GB moved or per file",
            "",
        ]
        for key in ("size", "count", "depth", "clients"):
            if key in self.rows:
                title, head, rows = self.rows[key]
                sep = "|" + "---|" + "---:|" * (head.count("|") - 2)
                out += [f"## {title}", "", head, sep, *rows, ""]
        return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 repetition")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (median; default 3)")
    ap.add_argument("--bin-dir", default=None, help="ferryd and rcp from DIR (default: build target/release)")
    ap.add_argument("--dir", default="/dev/shm", help="where data and the share live (default /dev/shm)")
    ap.add_argument("--only", default="size,count,depth,clients", help="comma list of sweeps")
    ap.add_argument("--out", default=None, help="also write the report to FILE")
    args = ap.parse_args()
    args.reps = args.reps or (1 if args.quick else 3)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.bin_dir is None:
        log("building release binaries (cargo build --release --workspace --bins)")
        subprocess.run(["cargo", "build", "--release", "--workspace", "--bins", "--quiet"],
                       cwd=root, check=True)
        args.bin_dir = os.path.join(root, "target", "release")
    args.bin_dir = os.path.abspath(args.bin_dir)
    bench = Bench(args)
    try:
        for key in args.only.split(","):
            getattr(bench, f"sweep_{key.strip()}")()
        text = bench.report()
    finally:
        bench.close()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
