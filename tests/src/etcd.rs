//! A real etcd for the multi-node harness ([`crate::Cluster`]), in the root network
//! namespace, with its data in the cluster's temp dir.
//!
//! It serves clients on `127.0.0.1:PORT` and on the same port of every extra address
//! it is given (the root side of each node's veth, so that nodes reach it), advertises
//! `http://127.0.0.1:PORT`, and is a one-member cluster on `127.0.0.1:PEER_PORT`. Both
//! ports are picked free (bind port 0, release); a start that loses the race for them
//! is retried on others. It is ready once `GET /health` answers `"health":"true"`.
//!
//! [`Etcd::start_tls`] serves clients over TLS only, requiring a client certificate
//! signed by the test CA (`--client-cert-auth --trusted-ca-file`), and advertises
//! `https://`; its `/health` is then asked on a plain metrics port of its own
//! (`--listen-metrics-urls http://127.0.0.1:M`), a third free port.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::certs::Certs;
use crate::files::unused_local_port;
use crate::server::read_log;

/// How long a start waits for etcd to report itself healthy.
pub const ETCD_STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

/// How often a start polls `/health`.
const HEALTH_POLL: Duration = Duration::from_millis(50);

/// How long one `/health` request may take.
const HEALTH_IO_TIMEOUT: Duration = Duration::from_secs(2);

/// How many port pairs a first start tries.
const PORT_TRIES: usize = 5;

/// The `etcdctl` that restores snapshots: `$FERRY_ETCDCTL`, else `/usr/bin/etcdctl`
/// (Debian's etcd-client).
pub fn etcdctl_program() -> PathBuf {
    std::env::var_os("FERRY_ETCDCTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/etcdctl"))
}

/// Prints why `test` is skipped and returns true where [`etcdctl_program`] is missing;
/// under CI (which installs it, `scripts/setup.sh`) panics instead.
pub fn skip_without_etcdctl(test: &str) -> bool {
    let etcdctl = etcdctl_program();
    if etcdctl.is_file() {
        return false;
    }
    let why = format!("no etcdctl at {} (etcd-client)", etcdctl.display());
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: cannot run under CI: {why}"
    );
    eprintln!("{test}: skipped: {why}");
    true
}

/// The etcd binary: `$FERRY_ETCD` if set, else `etcd` on `$PATH`, else `/usr/bin/etcd`.
pub fn etcd_program() -> PathBuf {
    if let Some(path) = std::env::var_os("FERRY_ETCD") {
        return PathBuf::from(path);
    }
    crate::program_on_path("etcd").unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"))
}

/// Whether the etcd of `127.0.0.1:port` (or `host:port`) answers `GET /health` with
/// `"health":"true"` within [`HEALTH_IO_TIMEOUT`].
pub fn etcd_healthy(host: Ipv4Addr, port: u16) -> bool {
    let addr = SocketAddr::from((host, port));
    let Ok(mut conn) = TcpStream::connect_timeout(&addr, HEALTH_IO_TIMEOUT) else {
        return false;
    };
    let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut answer = String::new();
    conn.set_read_timeout(Some(HEALTH_IO_TIMEOUT)).is_ok()
        && conn.set_write_timeout(Some(HEALTH_IO_TIMEOUT)).is_ok()
        && conn.write_all(request.as_bytes()).is_ok()
        && conn.read_to_string(&mut answer).is_ok()
        && answer.replace(' ', "").contains(r#""health":"true""#)
}

/// A one-member etcd cluster; SIGKILLed (and reaped) on drop.
#[derive(Debug)]
pub struct Etcd {
    name: String,
    data_dir: PathBuf,
    log_path: PathBuf,
    /// Client addresses besides `127.0.0.1`.
    extra_hosts: Vec<Ipv4Addr>,
    client_port: u16,
    peer_port: u16,
    /// With TLS: the plain port `/health` is asked on.
    metrics_port: u16,
    /// Serve clients over TLS with these certificates (client certificates required).
    tls: Option<Certs>,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd named `name` with its data in `dir/etcd` and its log in
    /// `dir/etcd.stderr`, serving clients on `127.0.0.1` and on each of `extra_hosts`,
    /// and waits until it is healthy.
    pub fn start(dir: &Path, name: String, extra_hosts: Vec<Ipv4Addr>) -> Result<Etcd, String> {
        Etcd::start_with(dir, name, extra_hosts, None)
    }

    /// [`Etcd::start`], serving clients over TLS with `certs` (server certificate and
    /// key; client certificates must chain to `certs.ca`).
    pub fn start_tls(
        dir: &Path,
        name: String,
        extra_hosts: Vec<Ipv4Addr>,
        certs: Certs,
    ) -> Result<Etcd, String> {
        Etcd::start_with(dir, name, extra_hosts, Some(certs))
    }

    fn start_with(
        dir: &Path,
        name: String,
        extra_hosts: Vec<Ipv4Addr>,
        tls: Option<Certs>,
    ) -> Result<Etcd, String> {
        let mut etcd = Etcd {
            name,
            data_dir: dir.join("etcd"),
            log_path: dir.join("etcd.stderr"),
            extra_hosts,
            client_port: 0,
            peer_port: 0,
            metrics_port: 0,
            tls,
            child: None,
        };
        let mut last = String::new();
        for _ in 0..PORT_TRIES {
            etcd.client_port = unused_local_port();
            etcd.peer_port = unused_local_port();
            etcd.metrics_port = unused_local_port();
            let ports = [etcd.client_port, etcd.peer_port, etcd.metrics_port];
            if ports[0] == ports[1] || ports[1] == ports[2] || ports[0] == ports[2] {
                continue;
            }
            match etcd.restart() {
                Ok(()) => return Ok(etcd),
                Err(e) if e.contains("address already in use") => {
                    last = e;
                    // A first start that failed may have left a half-made member.
                    let _ = fs::remove_dir_all(&etcd.data_dir);
                }
                Err(e) => return Err(e),
            }
        }
        Err(format!(
            "etcd found no free ports in {PORT_TRIES} tries; the last:\n{last}"
        ))
    }

    /// Starts etcd again on the same data dir and ports (after [`Etcd::kill`]) and
    /// waits until it is healthy; its log is appended to.
    pub(crate) fn restart(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "etcd is already running");
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| format!("cannot open {}: {e}", self.log_path.display()))?;
        // A marker between the runs of one log; a failed write only loses the marker.
        let _ = writeln!(
            log,
            "----- etcd starts on 127.0.0.1:{} -----",
            self.client_port
        );
        let child = self.command(log)?;
        self.child = Some(child);
        self.wait_healthy().inspect_err(|_| self.kill())
    }

    /// SIGKILLs etcd, replaces its data dir by one restored from `snapshot` with
    /// `etcdctl snapshot restore` (as docs/cluster.md tells an administrator: the same
    /// member name, peer URL and cluster token), and starts it again on the same ports.
    /// The old data dir is kept beside it (`etcd.before-restore`).
    pub(crate) fn restore(&mut self, snapshot: &Path) -> Result<(), String> {
        self.kill();
        let old = self.data_dir.with_extension("before-restore");
        fs::rename(&self.data_dir, &old)
            .map_err(|e| format!("cannot move {} aside: {e}", self.data_dir.display()))?;
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let out = Command::new(etcdctl_program())
            .env("ETCDCTL_API", "3")
            .args(["snapshot", "restore"])
            .arg(snapshot)
            .arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--initial-cluster")
            .arg(format!("{}={peer_url}", self.name))
            .arg("--initial-cluster-token")
            .arg(&self.name)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", etcdctl_program().display()))?;
        if !out.status.success() {
            return Err(format!(
                "etcdctl snapshot restore failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        self.restart()
    }

    fn command(&self, log: File) -> Result<Child, String> {
        let client_urls: Vec<String> = std::iter::once(Ipv4Addr::LOCALHOST)
            .chain(self.extra_hosts.iter().copied())
            .map(|h| format!("{}://{h}:{}", self.scheme(), self.client_port))
            .collect();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(etcd_program());
        cmd.arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--listen-client-urls")
            .arg(client_urls.join(","))
            .arg("--advertise-client-urls")
            .arg(&client_urls[0])
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("{}={peer_url}", self.name))
            .arg("--initial-cluster-token")
            .arg(&self.name)
            .arg("--initial-cluster-state")
            .arg("new")
            // Warnings and errors only: the log is printed whole when a test fails.
            .args([
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if let Some(certs) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&certs.server_cert)
                .arg("--key-file")
                .arg(&certs.server_key)
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&certs.ca)
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{}", self.metrics_port));
        }
        cmd.spawn()
            .map_err(|e| format!("cannot start {}: {e}", etcd_program().display()))
    }

    /// `https` when clients are served over TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// Whether etcd answers `/health` healthy (on the metrics port with TLS).
    pub fn healthy(&self) -> bool {
        let port = if self.tls.is_some() {
            self.metrics_port
        } else {
            self.client_port
        };
        etcd_healthy(Ipv4Addr::LOCALHOST, port)
    }

    fn wait_healthy(&mut self) -> Result<(), String> {
        let start = Instant::now();
        loop {
            if self.healthy() {
                return Ok(());
            }
            let child = self.child.as_mut().expect("etcd was started");
            if let Some(status) = child.try_wait().expect("cannot poll etcd") {
                self.child = None;
                return Err(format!(
                    "etcd exited with {status} at start; its log:\n{}",
                    self.log()
                ));
            }
            if start.elapsed() > ETCD_STARTUP_TIMEOUT {
                return Err(format!(
                    "etcd did not report itself healthy within {ETCD_STARTUP_TIMEOUT:?}; its log:\n{}",
                    self.log()
                ));
            }
            thread::sleep(HEALTH_POLL);
        }
    }

    /// SIGKILLs etcd (if it runs) and reaps it.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Ignoring errors: it may have exited already.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The client port (the same on every address).
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// Everything etcd has logged so far, across restarts.
    pub(crate) fn log(&self) -> String {
        read_log(&self.log_path)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
