//! How every Ferry program reaches the cluster's etcd: its endpoints, TLS (the CA
//! that signed etcd's certificate, and this program's client certificate and key),
//! and etcd user authentication (a user name and a file holding its password).
//!
//! The settings come from the command line ([`EtcdArgs`], the same options in
//! `ferryd`, `rcp`, `ferry` and `ferry-mount`) over one cluster configuration file
//! (TOML, [`ClusterFile`]): `--cluster-config FILE` or `$FERRY_CLUSTER_CONFIG`, else
//! [`DEFAULT_CLUSTER_CONFIG`] if it exists. Each option given on the command line
//! wins over the file's; relative paths in the file are relative to the file's
//! directory.
//!
//! ```toml
//! endpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]   # used where no endpoint is given
//!
//! [tls]
//! ca = "etcd-ca.pem"          # the CA that signed etcd's server certificate
//! cert = "client.pem"         # this program's certificate (etcd --client-cert-auth)
//! key = "client.key"
//!
//! [user]
//! name = "ferry-client"
//! password_file = "ferry-client.password"
//! ```
//!
//! Invariant of a resolved [`EtcdConfig`]: it has at least one endpoint; a client
//! certificate always comes with its key and a CA; a user always comes with a password
//! file. Files are read when connecting ([`super::Meta::connect`]), so a node that
//! reconnects picks up rotated certificates and passwords.

use std::path::{Path, PathBuf};

use ferry_client::etcd_error::EtcdConfigError;

use serde::Deserialize;

/// The cluster configuration file used when none is named and it exists.
pub const DEFAULT_CLUSTER_CONFIG: &str = "/etc/ferry/cluster.toml";

/// The environment variable naming the cluster configuration file.
pub const CLUSTER_CONFIG_ENV: &str = "FERRY_CLUSTER_CONFIG";

/// TLS settings for etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// PEM file of the CA (or CAs) that etcd's server certificate must chain to.
    pub ca: PathBuf,
    /// This program's client certificate and key, for an etcd that requires one
    /// (`--client-cert-auth`).
    pub identity: Option<ClientIdentity>,
}

/// A client certificate and its private key, both PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The certificate (chain).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// An etcd user (etcd's own authentication, `etcdctl auth enable`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUser {
    /// The user name.
    pub name: String,
    /// A file whose first line is the password (trailing newline ignored).
    pub password_file: PathBuf,
}

/// Everything needed to connect to the cluster's etcd.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `HOST:PORT` or URLs (`http://`, `https://`).
    pub endpoints: Vec<String>,
    /// TLS; `None`: plain HTTP.
    pub tls: Option<EtcdTls>,
    /// etcd user authentication; `None`: none.
    pub user: Option<EtcdUser>,
}

impl EtcdConfig {
    /// Plain endpoints, no TLS and no user (an etcd open to whoever reaches it).
    pub fn plain(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            tls: None,
            user: None,
        }
    }

    /// The same settings with `endpoints` instead.
    pub fn with_endpoints(&self, endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            ..self.clone()
        }
    }

    /// The endpoints as URLs: `https://` in front of those without a scheme when TLS
    /// is configured, `http://` otherwise; comma-separated lists are split.
    pub fn urls(&self) -> Vec<String> {
        self.endpoints
            .iter()
            .flat_map(|e| e.split(','))
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| endpoint_url(e, self.tls.is_some()))
            .collect()
    }
}

/// `https://` (with `tls`) or `http://` in front of an endpoint that has no scheme.
pub fn endpoint_url(endpoint: &str, tls: bool) -> String {
    if endpoint.contains("://") {
        endpoint.to_owned()
    } else if tls {
        format!("https://{endpoint}")
    } else {
        format!("http://{endpoint}")
    }
}

/// The `[tls]` table of a cluster configuration file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTls {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

/// The `[user]` table of a cluster configuration file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileUser {
    name: Option<String>,
    password_file: Option<PathBuf>,
}

/// A cluster configuration file, as written (see the module docs).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    #[serde(default)]
    endpoints: Vec<String>,
    #[serde(default)]
    tls: FileTls,
    #[serde(default)]
    user: FileUser,
}

impl ClusterFile {
    /// Reads and parses `path`; relative paths in it become relative to its directory.
    pub fn load(path: &Path) -> Result<ClusterFile, EtcdConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| EtcdConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut file = ClusterFile::parse(&text).map_err(|message| EtcdConfigError::Parse {
            path: path.to_owned(),
            message,
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        for p in [
            &mut file.tls.ca,
            &mut file.tls.cert,
            &mut file.tls.key,
            &mut file.user.password_file,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        }
        Ok(file)
    }

    /// Parses the text of a cluster configuration file; the error names the line.
    pub fn parse(text: &str) -> Result<ClusterFile, String> {
        toml::from_str::<ClusterFile>(text).map_err(|e| match e.span() {
            Some(span) => format!(
                "line {}: {}",
                text[..span.start].matches('\n').count() + 1,
                e.message()
            ),
            None => e.message().to_string(),
        })
    }
}

/// The etcd options every Ferry program takes (flattened into its arguments).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EtcdArgs {
    /// The cluster configuration file (TOML: `endpoints`, `[tls] ca/cert/key`,
    /// `[user] name/password_file`); its settings apply where no option below is
    /// given [default: /etc/ferry/cluster.toml, if it exists].
    #[arg(long, value_name = "FILE", env = CLUSTER_CONFIG_ENV)]
    pub cluster_config: Option<PathBuf>,
    /// PEM file of the CA that signed etcd's server certificate: etcd is spoken to
    /// over TLS (https://).
    #[arg(long, value_name = "FILE", env = "FERRY_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM file of this program's client certificate, for an etcd started with
    /// --client-cert-auth (needs --etcd-key).
    #[arg(
        long,
        value_name = "FILE",
        env = "FERRY_ETCD_CERT",
        requires = "etcd_key"
    )]
    pub etcd_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key (needs --etcd-cert).
    #[arg(
        long,
        value_name = "FILE",
        env = "FERRY_ETCD_KEY",
        requires = "etcd_cert"
    )]
    pub etcd_key: Option<PathBuf>,
    /// etcd user to authenticate as (etcd with authentication enabled; see
    /// `ferry cluster auth-setup`). Needs --etcd-password-file.
    #[arg(long, value_name = "NAME", env = "FERRY_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (its first line).
    #[arg(long, value_name = "FILE", env = "FERRY_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

impl EtcdArgs {
    /// The configuration file in effect: the one named, else the default if it exists.
    fn file(&self) -> Result<Option<ClusterFile>, EtcdConfigError> {
        match &self.cluster_config {
            Some(path) => ClusterFile::load(path).map(Some),
            None if Path::new(DEFAULT_CLUSTER_CONFIG).exists() => {
                ClusterFile::load(Path::new(DEFAULT_CLUSTER_CONFIG)).map(Some)
            }
            None => Ok(None),
        }
    }

    /// The etcd settings: these options over the configuration file's. `endpoints`
    /// (from `--etcd`, `--cluster` or a `cluster://` URL) win over the file's; with
    /// neither it is an error.
    pub fn resolve(&self, endpoints: Option<Vec<String>>) -> Result<EtcdConfig, EtcdConfigError> {
        let file = self.file()?.unwrap_or_default();
        let endpoints = match endpoints.filter(|e| !e.is_empty()) {
            Some(e) => e,
            None if !file.endpoints.is_empty() => file.endpoints,
            None => {
                return Err(EtcdConfigError::Invalid(
                    "no etcd endpoint given (an option, or `endpoints` in the cluster configuration file)"
                        .into(),
                ))
            }
        };
        let pick = |opt: &Option<PathBuf>, file: Option<PathBuf>| opt.clone().or(file);
        let (cert, key) = match (&self.etcd_cert, &self.etcd_key) {
            (Some(c), Some(k)) => (Some(c.clone()), Some(k.clone())),
            _ => (file.tls.cert, file.tls.key),
        };
        let tls = tls_settings(pick(&self.etcd_ca, file.tls.ca), cert, key)?;
        let user = match (
            self.etcd_user.clone().or(file.user.name),
            pick(&self.etcd_password_file, file.user.password_file),
        ) {
            (Some(name), Some(password_file)) => Some(EtcdUser {
                name,
                password_file,
            }),
            (None, None) => None,
            (Some(name), None) => {
                return Err(EtcdConfigError::Invalid(format!(
                    "etcd user {name} needs a password file (--etcd-password-file, or [user] password_file)"
                )))
            }
            (None, Some(_)) => {
                return Err(EtcdConfigError::Invalid(
                    "an etcd password file needs a user name (--etcd-user, or [user] name)".into(),
                ))
            }
        };
        let config = EtcdConfig {
            endpoints,
            tls,
            user,
        };
        check_schemes(&config)?;
        Ok(config)
    }
}

/// TLS settings from a CA and a certificate/key pair, each maybe given.
fn tls_settings(
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<EtcdTls>, EtcdConfigError> {
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => Some(ClientIdentity { cert, key }),
        (None, None) => None,
        _ => {
            return Err(EtcdConfigError::Invalid(
                "a client certificate needs its key, and a key its certificate (--etcd-cert and --etcd-key, or [tls] cert and key)"
                    .into(),
            ))
        }
    };
    match (ca, identity) {
        (Some(ca), identity) => Ok(Some(EtcdTls { ca, identity })),
        (None, None) => Ok(None),
        (None, Some(_)) => Err(EtcdConfigError::Invalid(
            "a client certificate needs the CA that signed etcd's certificate (--etcd-ca, or [tls] ca)"
                .into(),
        )),
    }
}

/// An `http://` endpoint with TLS settings, or `https://` without, is a mistake that
/// would otherwise show as a confusing connection failure.
fn check_schemes(config: &EtcdConfig) -> Result<(), EtcdConfigError> {
    for url in config.urls() {
        if config.tls.is_some() && url.starts_with("http://") {
            return Err(EtcdConfigError::Invalid(format!(
                "{url}: TLS settings are given, so etcd is spoken to over https:// (write the endpoint without a scheme or as https://)"
            )));
        }
        if config.tls.is_none() && url.starts_with("https://") {
            return Err(EtcdConfigError::Invalid(format!(
                "{url}: https:// needs the CA that signed etcd's certificate (--etcd-ca, or [tls] ca)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> EtcdArgs {
        EtcdArgs::default()
    }

    #[test]
    fn endpoints_get_the_scheme_of_the_settings() {
        let plain = EtcdConfig::plain(vec!["a:1,b:2".into(), "http://c:3".into()]);
        assert_eq!(plain.urls(), ["http://a:1", "http://b:2", "http://c:3"]);
        let tls = EtcdConfig {
            tls: Some(EtcdTls {
                ca: "ca.pem".into(),
                identity: None,
            }),
            ..EtcdConfig::plain(vec!["a:1".into()])
        };
        assert_eq!(tls.urls(), ["https://a:1"]);
    }

    #[test]
    fn options_win_over_the_file_and_file_paths_are_relative_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.toml");
        std::fs::write(
            &path,
            "endpoints = [\"e1:2379\"]\n[tls]\nca = \"ca.pem\"\ncert = \"c.pem\"\nkey = \"c.key\"\n[user]\nname = \"u\"\npassword_file = \"/abs/pw\"\n",
        )
        .unwrap();
        let mut a = args();
        a.cluster_config = Some(path.clone());
        let c = a.resolve(None).unwrap();
        assert_eq!(c.endpoints, ["e1:2379"]);
        let tls = c.tls.unwrap();
        assert_eq!(tls.ca, dir.path().join("ca.pem"));
        assert_eq!(tls.identity.unwrap().key, dir.path().join("c.key"));
        assert_eq!(c.user.unwrap().password_file, PathBuf::from("/abs/pw"));
        a.etcd_user = Some("other".into());
        a.etcd_ca = Some("/x/ca.pem".into());
        let c = a.resolve(Some(vec!["e2:1".into()])).unwrap();
        assert_eq!(c.endpoints, ["e2:1"]);
        assert_eq!(c.tls.unwrap().ca, PathBuf::from("/x/ca.pem"));
        assert_eq!(c.user.unwrap().name, "other");
    }

    #[test]
    fn incomplete_settings_are_refused() {
        let some = Some(vec!["e:1".into()]);
        let mut a = args();
        a.etcd_user = Some("u".into());
        assert!(a.resolve(some.clone()).is_err());
        let mut a = args();
        a.etcd_password_file = Some("pw".into());
        assert!(a.resolve(some.clone()).is_err());
        let mut a = args();
        a.etcd_cert = Some("c".into());
        a.etcd_key = Some("k".into());
        let e = a.resolve(some.clone()).unwrap_err().to_string();
        assert!(e.contains("--etcd-ca"), "{e}");
        let mut a = args();
        a.etcd_ca = Some("ca".into());
        assert!(a.resolve(Some(vec!["http://e:1".into()])).is_err());
        assert!(args().resolve(Some(vec!["https://e:1".into()])).is_err());
        assert!(args().resolve(None).is_err());
    }

    #[test]
    fn file_errors_name_the_line() {
        let e = ClusterFile::parse("endpoints = []\n[tls]\nbogus = 1\n").unwrap_err();
        assert!(e.starts_with("line 3:"), "{e}");
    }
}
