//! Certificates for a test etcd served over TLS, made with the `openssl` command
//! (Debian's `openssl`, installed by scripts/setup.sh): a CA, etcd's server
//! certificate for the addresses it serves, and a client certificate, all ECDSA P-256,
//! valid for two days. A second, unrelated CA with its own client certificate stands
//! for a client that holds a certificate etcd does not trust.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The files [`make_certs`] writes, all PEM.
#[derive(Debug, Clone)]
pub struct Certs {
    /// The CA that signed etcd's certificate and the client's.
    pub ca: PathBuf,
    /// etcd's server certificate (subjectAltName: every address given).
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate signed by [`Certs::ca`].
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A client certificate signed by another CA, which etcd does not trust.
    pub rogue_cert: PathBuf,
    /// Its key.
    pub rogue_key: PathBuf,
}

/// The common name of the test client certificate: not an etcd user, so that etcd
/// (which takes a certificate's CN as the user where no password was given) does not
/// grant it anything.
pub const CLIENT_CN: &str = "ferry-test-client";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (scripts/setup.sh installs it): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA `name` (`name.pem`, `name.key` in `dir`).
fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate `name` (`name.pem`, `name.key`) for `cn`, signed by CA `ca`, with
/// the extensions `ext` (an openssl extension file's lines).
fn make_leaf(dir: &Path, ca: &str, name: &str, cn: &str, ext: &str, serial: u32) {
    let ext_file = format!("{name}.ext");
    std::fs::write(dir.join(&ext_file), ext).expect("cannot write an extension file");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-set_serial",
            &serial.to_string(),
            "-days",
            "2",
            "-out",
            &format!("{name}.pem"),
            "-extfile",
            &ext_file,
        ],
    );
}

/// Makes the certificates in `dir` (which must exist): etcd's names `127.0.0.1` and
/// every address of `hosts`.
pub fn make_certs(dir: &Path, hosts: &[Ipv4Addr]) -> Certs {
    make_ca(dir, "ca");
    make_ca(dir, "rogue-ca");
    let sans: Vec<String> = std::iter::once(Ipv4Addr::LOCALHOST)
        .chain(hosts.iter().copied())
        .map(|h| format!("IP:{h}"))
        .collect();
    let leaf = |usage: &str| {
        format!("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n")
    };
    let server_ext = format!(
        "{}subjectAltName={}\n",
        leaf("serverAuth,clientAuth"),
        sans.join(",")
    );
    make_leaf(dir, "ca", "server", "etcd", &server_ext, 2);
    make_leaf(dir, "ca", "client", CLIENT_CN, &leaf("clientAuth"), 3);
    make_leaf(dir, "rogue-ca", "rogue", CLIENT_CN, &leaf("clientAuth"), 4);
    Certs {
        ca: dir.join("ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
        rogue_cert: dir.join("rogue.pem"),
        rogue_key: dir.join("rogue.key"),
    }
}
