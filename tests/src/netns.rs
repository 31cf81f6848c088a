//! Network namespaces for the multi-node harness ([`crate::Cluster`]): one per node,
//! joined to the root namespace by a veth pair, on a `10.A.0.0/16` of its own.
//!
//! ```text
//! root namespace                          namespace NS (node K)
//! HOST_IF 10.A.K.1/24  <--- veth --->  NS_IF 10.A.K.2/24, lo up
//!                                      route 10.A.0.0/16 via 10.A.K.1
//! ```
//!
//! The root namespace forwards between the host sides (per-interface
//! `net.ipv4.conf.HOST_IF.forwarding`, not the global switch), so nodes reach each other
//! as well as the root namespace; `tc` shapes each link at both ends.
//!
//! The `A` of a cluster is claimed with [`Subnet::claim`]: an exclusive `flock` of
//! `/run/ferry-test-nets/10.A.lock` (held for the cluster's life and released by the
//! kernel when the process dies, so a killed test leaves no stale claim) on an `A` that
//! no interface uses yet (`ip -o -4 addr`). `bench/lib/cluster.sh` claims the same way.
//! Names carry the process id and a per-process counter, so concurrent tests and test
//! binaries never share one; [`reap_stale`] kills what a test process that is gone left
//! running (a SIGKILLed test binary cannot clean up) and deletes its namespaces.

use std::fs::{self, File, OpenOptions};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};

/// Where [`Subnet::claim`] keeps its lock files (shared with the bench).
const LOCK_DIR: &str = "/run/ferry-test-nets";

/// The prefix of every namespace the harness makes: `ferrytest-PID-CLUSTER-nK`.
pub(crate) const NS_PREFIX: &str = "ferrytest-";

/// The second octet of the `10.A.0.0/16` subnets a cluster may claim.
const SUBNET_RANGE: std::ops::RangeInclusive<u8> = 100..=250;

/// The longest interface name Linux takes (`IFNAMSIZ` - 1).
const IFNAME_MAX: usize = 15;

/// A claimed `10.A.0.0/16`: the lock is held until this is dropped.
#[derive(Debug)]
pub(crate) struct Subnet {
    a: u8,
    _lock: Flock<File>,
}

impl Subnet {
    /// Claims a `10.A.0.0/16` that no other cluster (of any process) holds and that no
    /// interface of the root namespace has an address in. The search starts at an
    /// offset derived from `seed` so that concurrent claims rarely contend.
    pub(crate) fn claim(seed: u32) -> Result<Subnet, String> {
        fs::create_dir_all(LOCK_DIR).map_err(|e| format!("cannot create {LOCK_DIR}: {e}"))?;
        let (lo, hi) = (*SUBNET_RANGE.start(), *SUBNET_RANGE.end());
        let span = u32::from(hi - lo) + 1;
        for i in 0..span {
            let a = lo + u8::try_from((seed + i) % span).expect("the span fits a u8");
            let path = Path::new(LOCK_DIR).join(format!("10.{a}.lock"));
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
                continue;
            };
            if !subnet_in_use(a)? {
                return Ok(Subnet { a, _lock: lock });
            }
        }
        Err(format!(
            "no free 10.A.0.0/16 with A in {lo}..={hi}: every one is locked in {LOCK_DIR} or in use"
        ))
    }

    /// The subnet's second octet.
    pub(crate) fn a(&self) -> u8 {
        self.a
    }
}

/// Whether an interface of the root namespace has an IPv4 address in `10.a.0.0/16`.
fn subnet_in_use(a: u8) -> Result<bool, String> {
    let out = ip(&["-o", "-4", "addr", "show"])?;
    let needle = format!(" 10.{a}.");
    Ok(out.lines().any(|l| l.contains(&needle)))
}

/// The test process of a harness name (`ferrytest-PID-...`), if it is one.
fn owner_pid(name: &str) -> Option<u32> {
    name.strip_prefix(NS_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Whether process `pid` is gone.
fn gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

/// Cleans up after test processes that died without their drops (SIGKILLed): kills
/// what still runs in their namespaces (`ferrytest-PID-...`) and their etcd (`--name
/// ferrytest-PID-...`, in the root namespace), then deletes the namespaces.
pub(crate) fn reap_stale() {
    let kill = |pid: &str| {
        if let Ok(pid) = pid.trim().parse::<i32>() {
            // Ignoring errors: it may have exited since.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    };
    if let Ok(procs) = fs::read_dir("/proc") {
        for entry in procs.flatten() {
            let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let mut args = cmdline.split(|b| *b == 0).map(String::from_utf8_lossy);
            let is_stale_etcd = args.next().is_some_and(|p| p.ends_with("etcd"))
                && args
                    .skip_while(|a| a != "--name")
                    .nth(1)
                    .and_then(|name| owner_pid(&name))
                    .is_some_and(gone);
            if is_stale_etcd {
                kill(&entry.file_name().to_string_lossy());
            }
        }
    }
    let Ok(list) = ip(&["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        if owner_pid(name).is_some_and(gone) {
            if let Ok(pids) = ip(&["netns", "pids", name]) {
                pids.lines().for_each(kill);
            }
            // Ignoring errors: another process may be reaping the same namespace.
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Runs `ip ARGS...`; its stdout, or its stderr as the error.
fn ip(args: &[&str]) -> Result<String, String> {
    run(Command::new("ip").args(args))
}

/// Runs `cmd` to completion (the `ip` and `tc` calls here return at once); its stdout,
/// or the command and its stderr as the error.
fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One network namespace joined to the root namespace by a veth pair; deleted (with
/// the pair) on drop. Whatever runs in it must be stopped before.
#[derive(Debug)]
pub(crate) struct NetNs {
    name: String,
    host_if: String,
    ns_if: String,
    host_ip: Ipv4Addr,
    ns_ip: Ipv4Addr,
}

impl NetNs {
    /// Makes namespace `name` with the pair `host_if` (root side, `10.a.k.1/24`) and
    /// `ns_if` (inside, `10.a.k.2/24`), `lo` up and a route to the rest of
    /// `10.a.0.0/16` through the root namespace. What was made is removed again on
    /// failure.
    pub(crate) fn create(
        name: String,
        host_if: String,
        ns_if: String,
        a: u8,
        k: u8,
    ) -> Result<NetNs, String> {
        for ifname in [&host_if, &ns_if] {
            if ifname.len() > IFNAME_MAX {
                return Err(format!(
                    "interface name {ifname} is over {IFNAME_MAX} bytes"
                ));
            }
        }
        ip(&["netns", "add", &name])?;
        let ns = NetNs {
            name,
            host_if,
            ns_if,
            host_ip: Ipv4Addr::new(10, a, k, 1),
            ns_ip: Ipv4Addr::new(10, a, k, 2),
        };
        let (n, h, i) = (ns.name.as_str(), ns.host_if.as_str(), ns.ns_if.as_str());
        let host_cidr = format!("{}/24", ns.host_ip);
        let ns_cidr = format!("{}/24", ns.ns_ip);
        let net = format!("10.{a}.0.0/16");
        let host_ip = ns.host_ip.to_string();
        ip(&[
            "link", "add", h, "type", "veth", "peer", "name", i, "netns", n,
        ])?;
        ip(&["addr", "add", &host_cidr, "dev", h])?;
        ip(&["link", "set", h, "up"])?;
        let forwarding = format!("/proc/sys/net/ipv4/conf/{h}/forwarding");
        fs::write(&forwarding, "1").map_err(|e| format!("cannot write {forwarding}: {e}"))?;
        ip(&["-n", n, "addr", "add", &ns_cidr, "dev", i])?;
        ip(&["-n", n, "link", "set", i, "up"])?;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "route", "add", &net, "via", &host_ip])?;
        Ok(ns)
    }

    /// The root side's address, `10.a.k.1`.
    pub(crate) fn host_ip(&self) -> Ipv4Addr {
        self.host_ip
    }

    /// The address inside the namespace, `10.a.k.2`.
    pub(crate) fn ns_ip(&self) -> Ipv4Addr {
        self.ns_ip
    }

    /// `ip netns exec NAME PROGRAM`: a command that runs `program` in the namespace
    /// (`ip` execs it, so the child's pid is the program's).
    pub(crate) fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Shapes the link to `bytes_per_sec` in both directions with a token bucket
    /// filter (`tc qdisc replace ... root tbf`) at both ends: the root side's egress
    /// is the traffic to the namespace, the namespace side's the traffic from it.
    pub(crate) fn limit_rate(&self, bytes_per_sec: u64) -> Result<(), String> {
        let tbf = tbf_args(bytes_per_sec);
        let mut host = Command::new("tc");
        host.args(["qdisc", "replace", "dev", &self.host_if, "root"])
            .args(&tbf);
        run(&mut host)?;
        let mut inside = self.command("tc");
        inside
            .args(["qdisc", "replace", "dev", &self.ns_if, "root"])
            .args(&tbf);
        run(&mut inside).map(drop)
    }
}

/// The `tbf` arguments for `bytes_per_sec`. The bucket holds 2 ms at the rate (at least
/// 64 KiB, one GSO segment of the veth, which tbf would otherwise have to split), small
/// beside a 1 MiB transfer, so such a flow runs at the rate and not at the bucket's
/// burst; the queue holds 50 ms, enough that TCP does not see losses at the rate.
pub(crate) fn tbf_args(bytes_per_sec: u64) -> Vec<String> {
    let burst_bytes = (bytes_per_sec / 500).max(64 * 1024);
    let latency = Duration::from_millis(50);
    vec![
        "tbf".into(),
        "rate".into(),
        format!("{}bit", bytes_per_sec * 8),
        "burst".into(),
        burst_bytes.to_string(),
        "latency".into(),
        format!("{}ms", latency.as_millis()),
    ]
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Ignoring errors: a drop cannot fail, and the pair goes with the namespace
        // anyway. Deleting the root side first makes the pair's removal synchronous, so
        // its address is gone before the subnet is released.
        let _ = ip(&["link", "del", &self.host_if]);
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!(
                "cluster: cannot delete network namespace {}: {e}",
                self.name
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tbf_bucket_is_small_beside_a_mebibyte() {
        let args = tbf_args(100_000_000);
        assert_eq!(args[2], "800000000bit");
        assert_eq!(args[4], "200000");
        assert_eq!(tbf_args(1_000_000)[4], "65536");
    }
}
