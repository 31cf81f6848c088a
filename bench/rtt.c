/*
 * rtt: the round-trip floor under every network file system on this machine.
 *
 * Two processes on 127.0.0.1, one TCP connection (TCP_NODELAY), queue depth 1: the
 * client sends a 64-byte request, the server answers with RESP bytes (16 KiB by
 * default: the chunk a ferry-mount miss fetches). No disk, no hashing, no FUSE and no
 * runtime: only the wake-ups and the loopback stack, in plain blocking C.
 *
 * Measured twice: with both processes free to run on any CPU (as every tool in
 * bench/run runs), and with both pinned to the first CPU this process may use (so no
 * wake-up crosses CPUs). On a VM whose idle vCPUs halt without polling, each wake-up
 * that crosses vCPUs costs the hypervisor's wake-up of the halted one; the difference
 * of the two figures shows it.
 *
 * usage: rtt [COUNT [RESP_BYTES]]   (defaults 20000 and 16384)
 * prints: any_p50_us any_p99_us one_p50_us one_p99_us   (one line, for bench/run)
 * Build: cc -O2 -o rtt bench/rtt.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define REQ 64

static void die(const char *what) {
    fprintf(stderr, "rtt: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Reads (rd) or writes exactly n bytes; exits on an error or an early end. */
static void full(int fd, char *b, size_t n, int rd) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = rd ? read(fd, b + done, n - done) : write(fd, b + done, n - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            if (r == 0)
                errno = EPIPE;
            die(rd ? "read" : "write");
        }
        done += (size_t)r;
    }
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0)
        die("sched_setaffinity");
}

static void nodelay(int fd) {
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
        die("setsockopt TCP_NODELAY");
}

/* COUNT round trips; fills t (µs each). cpu < 0: not pinned. */
static void run(int count, size_t resp, int cpu, double *t, char *buf) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0)
        die("socket");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (bind(ls, (void *)&a, sizeof a) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, (void *)&a, &len) != 0)
        die("listen on 127.0.0.1");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        if (cpu >= 0)
            pin(cpu);
        int c = accept(ls, NULL, NULL);
        if (c < 0)
            die("accept");
        nodelay(c);
        for (int i = 0; i < count; i++) {
            full(c, buf, REQ, 1);
            full(c, buf, resp, 0);
        }
        _exit(0);
    }
    close(ls);
    cpu_set_t before;
    if (cpu >= 0) {
        if (sched_getaffinity(0, sizeof before, &before) != 0)
            die("sched_getaffinity");
        pin(cpu);
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (void *)&a, sizeof a) != 0) {
        kill(pid, SIGKILL);
        die("connect");
    }
    nodelay(s);
    for (int i = 0; i < count; i++) {
        double t0 = now_us();
        full(s, buf, REQ, 0);
        full(s, buf, resp, 1);
        t[i] = now_us() - t0;
    }
    close(s);
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "rtt: the server process failed\n");
        exit(1);
    }
    if (cpu >= 0 && sched_setaffinity(0, sizeof before, &before) != 0)
        die("sched_setaffinity");
}

/* p50 and p99 of t[skip..count) (the first tenth is warm-up: connection set-up, cold caches). */
static void percentiles(double *t, int count, double *p50, double *p99) {
    int skip = count / 10, n = count - skip;
    qsort(t + skip, n, sizeof *t, by_value);
    *p50 = t[skip + n / 2];
    *p99 = t[skip + (int)(n * 0.99)];
}

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 20000;
    long resp = argc > 2 ? atol(argv[2]) : 16384;
    if (argc > 3 || count < 100 || resp < 1 || resp > (1 << 20)) {
        fprintf(stderr, "usage: rtt [COUNT >= 100 [RESP_BYTES 1..1048576]]\n");
        return 2;
    }
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) != 0)
        die("sched_getaffinity");
    int first = 0;
    while (first < CPU_SETSIZE && !CPU_ISSET(first, &mine))
        first++;
    double *t = malloc(sizeof *t * (size_t)count);
    char *buf = malloc((size_t)resp > REQ ? (size_t)resp : REQ);
    if (!t || !buf)
        die("malloc");
    double any50, any99, one50, one99;
    run(count, (size_t)resp, -1, t, buf);
    percentiles(t, count, &any50, &any99);
    run(count, (size_t)resp, first, t, buf);
    percentiles(t, count, &one50, &one99);
    printf("%.1f %.1f %.1f %.1f\n", any50, any99, one50, one99);
    return 0;
}
