#!/usr/bin/env python3
"""pjdfstest, the POSIX file-system conformance suite, built and run against a directory.

    pjdfstest.py build SRC OUT        copy SRC (read-only upstream tree) to OUT and build
                                      OUT/pjdfstest with gcc (no autotools: a config.h of
                                      the HAVE_* macros glibc provides)
    pjdfstest.py run OUT DIR [--jobs N] [--json FILE] [--expect DOC] [--only GLOB]
                                      run every OUT/tests/**/*.t inside DIR (the file
                                      system under test), as root, and count

Each test file runs in a fresh subdirectory of DIR of its own (so files run in
parallel never share a name), under a time limit (FILE_TIMEOUT_S): a file that hangs
is killed and every test it did not report counts as failed. The files that make
paths of PATH_MAX bytes (`dirgen_max`) run one at a time in DIR itself afterwards, as
`prove` runs them: a subdirectory would lengthen their paths from the file system's
root. A test counts as `prove`
counts it: planned tests that did not print `ok N` failed, except `not ok N # TODO`
(upstream's own expected failures on some systems).

With --expect DOC, the remaining failures must be exactly those listed in DOC's table
of known failures (rows `| FILE | TESTS | reason |` between the markers
KNOWN_BEGIN and KNOWN_END; TESTS a space-separated list of test numbers, or `*` for a
file whose every test may fail for the one reason given, which of them depending on
what an earlier step of the file left); a test that fails unlisted, or a listed one
that passes, fails the run. The summary goes to
stdout; --json writes the counts and the failures for the benchmark's table.
"""

import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

FILE_TIMEOUT_S = 300
KNOWN_BEGIN = "<!-- pjdfstest-known-failures: begin -->"
KNOWN_END = "<!-- pjdfstest-known-failures: end -->"

CONFIG_H = """#define _GNU_SOURCE 1
#define HAVE_OPENAT 1
#define HAVE_UNLINKAT 1
#define HAVE_MKDIRAT 1
#define HAVE_LINKAT 1
#define HAVE_SYMLINKAT 1
#define HAVE_RENAMEAT 1
#define HAVE_MKFIFOAT 1
#define HAVE_MKNODAT 1
#define HAVE_FCHMODAT 1
#define HAVE_FCHOWNAT 1
#define HAVE_FSTATAT 1
#define HAVE_FACCESSAT 1
#define HAVE_READLINKAT 1
#define HAVE_POSIX_FALLOCATE 1
#define HAVE_UTIMENSAT 1
#define HAVE_SYS_SYSMACROS_H 1
#define HAVE_STRUCT_STAT_ST_ATIM 1
#define HAVE_STRUCT_STAT_ST_MTIM 1
#define HAVE_STRUCT_STAT_ST_CTIM 1
"""


def build(src, out):
    """Copies the suite to `out` (writable) and builds `out/pjdfstest`."""
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(src, out, symlinks=True)
    for root, dirs, files in os.walk(out):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | 0o200)
    with open(os.path.join(out, "config.h"), "w") as f:
        f.write(CONFIG_H)
    subprocess.run(
        ["gcc", "-O2", "-w", "-o", "pjdfstest", "pjdfstest.c"], cwd=out, check=True
    )


def test_files(suite, only):
    """The suite's test files, as paths relative to `suite/tests`, sorted."""
    base = os.path.join(suite, "tests")
    found = []
    for root, _, files in os.walk(base):
        for name in files:
            if name.endswith(".t"):
                rel = os.path.relpath(os.path.join(root, name), base)
                if only is None or fnmatch.fnmatch(rel, only):
                    found.append(rel)
    return sorted(found)


def parse_tap(text):
    """(planned, failed test numbers) of one file's TAP output."""
    planned = 0
    passed = set()
    todo_failed = set()
    for line in text.splitlines():
        m = re.match(r"^1\.\.(\d+)", line)
        if m:
            planned = int(m.group(1))
            continue
        m = re.match(r"^(not ok|ok) (\d+)(.*)$", line)
        if not m:
            continue
        n = int(m.group(2))
        if m.group(1) == "ok":
            passed.add(n)
        elif "# TODO" in m.group(3):
            todo_failed.add(n)
    failed = [n for n in range(1, planned + 1) if n not in passed and n not in todo_failed]
    return planned, failed


def uses_path_max(suite, rel):
    """Whether the test file makes paths of PATH_MAX bytes."""
    with open(os.path.join(suite, "tests", rel)) as f:
        return "dirgen_max" in f.read()


def run_file(suite, rel, workdir, alone):
    """Runs one test file in a fresh subdirectory of `workdir` or, `alone`, in it."""
    if alone:
        cwd = workdir
    else:
        cwd = tempfile.mkdtemp(prefix="p", dir=workdir)
        # Tests run steps as other uids (65533, 65534), which must reach their files.
        os.chmod(cwd, 0o755)
    script = os.path.join(suite, "tests", rel)
    started = time.monotonic()
    proc = subprocess.Popen(
        ["/bin/sh", script],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=FILE_TIMEOUT_S)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        hung = True
    text = out.decode("utf-8", "replace")
    planned, failed = parse_tap(text)
    if not alone:
        shutil.rmtree(cwd, ignore_errors=True)
    return {
        "file": rel,
        "planned": planned,
        "failed": failed,
        "hung": hung,
        "seconds": round(time.monotonic() - started, 2),
        "output": text if failed or planned == 0 else "",
    }


# A known-failures row whose every test may fail.
ANY = "*"


def known_failures(doc):
    """{file: set of test numbers} from the table between the markers in `doc`."""
    with open(doc) as f:
        text = f.read()
    try:
        table = text.split(KNOWN_BEGIN, 1)[1].split(KNOWN_END, 1)[0]
    except IndexError:
        sys.exit(f"{doc}: no known-failures table between {KNOWN_BEGIN} and {KNOWN_END}")
    known = {}
    for line in table.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].endswith(".t"):
            continue
        known[cells[0]] = ANY if cells[1] == "*" else {int(n) for n in cells[1].split()}
    return known


def compare(results, known):
    """Lines naming each unexpected failure and each listed test that now passes."""
    problems = []
    for r in results:
        got = set(r["failed"])
        want = known.get(r["file"], set())
        if want == ANY:
            continue
        for n in sorted(got - want):
            problems.append(f"{r['file']} test {n} failed (not a known failure)")
        for n in sorted(want - got):
            problems.append(f"{r['file']} test {n} passed but is listed as a known failure")
    ran = {r["file"] for r in results}
    for name in sorted(set(known) - ran):
        problems.append(f"{name} is listed as a known failure but did not run")
    return problems


def summary(results, elapsed):
    tests = sum(r["planned"] for r in results)
    failed = sum(len(r["failed"]) for r in results)
    return {
        "files": len(results),
        "tests": tests,
        "failed": failed,
        "passed": tests - failed,
        "hung_files": [r["file"] for r in results if r["hung"]],
        "seconds": round(elapsed, 1),
    }


def run(args):
    if os.geteuid() != 0:
        sys.exit("pjdfstest must run as root (it tests ownership with other uids)")
    files = test_files(args.suite, args.only)
    if not files:
        sys.exit(f"no test files under {args.suite}/tests match")
    started = time.monotonic()
    alone = [rel for rel in files if uses_path_max(args.suite, rel)]
    shared = [rel for rel in files if rel not in alone]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda rel: run_file(args.suite, rel, args.dir, False), shared))
    results += [run_file(args.suite, rel, args.dir, True) for rel in alone]
    results.sort(key=lambda r: r["file"])
    counts = summary(results, time.monotonic() - started)
    for r in results:
        if r["failed"]:
            nums = " ".join(str(n) for n in r["failed"])
            hung = " (killed: hung)" if r["hung"] else ""
            print(f"FAIL {r['file']}{hung}: {len(r['failed'])}/{r['planned']}: {nums}")
    print(
        f"pjdfstest in {args.dir}: {counts['files']} files, {counts['tests']} tests, "
        f"{counts['failed']} failed, in {counts['seconds']} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "results": results}, f, indent=1)
    if args.expect:
        problems = compare(results, known_failures(args.expect))
        for p in problems:
            print(f"UNEXPECTED: {p}")
        if problems:
            for r in results:
                if r["output"] and any(p.startswith(r["file"] + " ") for p in problems):
                    print(f"--- {r['file']} output ---\n{r['output']}")
            return 1
        print(f"every failure is listed in {args.expect}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("src")
    b.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("suite", help="the built copy (with pjdfstest and tests/)")
    r.add_argument("dir", help="directory on the file system under test")
    r.add_argument("--jobs", type=int, default=4)
    r.add_argument("--json")
    r.add_argument("--expect")
    r.add_argument("--only", help="glob of test files, e.g. 'chmod/*'")
    args = p.parse_args()
    if args.cmd == "build":
        build(args.src, args.out)
        return 0
    args.suite = os.path.abspath(args.suite)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
