//! Server configuration: a TOML file and/or command-line shares.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::admission::{self, AdmissionConfig, SpecError};
use crate::owners::{OwnerPolicy, Owners};
use ferry_common::msg::HashAlgorithm;
use ferry_common::seal::{Encryption, RekeyPolicy};
use serde::Deserialize;

/// Default number of chunks in flight per connection.
pub const DEFAULT_QUEUE_DEPTH: usize = 16;

/// Largest accepted queue depth (bounds per-connection buffer memory).
pub const MAX_QUEUE_DEPTH: usize = 256;

/// Default budget of file bytes registered for mapped files, over all connections.
pub const DEFAULT_MAX_MAPPED_BYTES: u64 = 64 << 30;

/// Default age beyond which the startup cleanup removes a resumable partial upload.
pub const DEFAULT_PARTIAL_TTL: Duration = Duration::from_secs(24 * 3600);
/// The encryption policy of a share that sets none, unless the configuration file
/// or `--encryption` says otherwise.
pub const DEFAULT_ENCRYPTION: Encryption = Encryption::Required;

/// Default most connections served at once (TCP and RDMA together).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// Configuration errors, reported before the server starts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML for this schema.
    #[error("invalid config file {}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A `--share` flag is malformed.
    #[error("invalid share '{0}': expected NAME=PATH or NAME=PATH:ro")]
    ShareSpec(String),
    /// A share name is not a single safe path component.
    #[error("invalid share name '{0}': use letters, digits, '.', '_' or '-' (at most 255 bytes)")]
    ShareName(String),
    /// A share's root is unusable.
    #[error("share '{name}': {path}: {reason}")]
    ShareRoot {
        /// Share name.
        name: String,
        /// Configured root.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// Two shares have the same name.
    #[error("share '{0}' is defined twice")]
    DuplicateShare(String),
    /// No share is configured.
    #[error(
        "no shares configured: give --share NAME=PATH or a --config file with [[share]] entries"
    )]
    NoShares,
    /// The queue depth is out of range.
    #[error("queue depth must be between 1 and {MAX_QUEUE_DEPTH}, not {0}")]
    QueueDepth(usize),
    /// A `--secret-file` flag is malformed.
    #[error("invalid secret file '{0}': expected FILE or NAME=FILE")]
    SecretSpec(String),
    /// A `--secret-file NAME=FILE` names no configured share.
    #[error("--secret-file names share '{0}', which is not configured")]
    SecretForUnknownShare(String),
    /// A share's secret cannot be loaded.
    #[error("share '{share}': {source}")]
    Secret {
        /// Share name.
        share: String,
        /// Why.
        #[source]
        source: ferry_common::auth::SecretError,
    },
    /// A share has no secret, and serving without one was not asked for.
    #[error(
        "share '{0}' has no secret: give --secret-file {0}=FILE (or --secret-file FILE for \
         every share, or secret_file in the config, or $FERRYD_SECRET), or --insecure-no-auth \
         to serve it to anyone who can connect"
    )]
    NoSecret(String),
    /// The connection limit is zero.
    #[error("max connections must be at least 1")]
    MaxConnections,
    /// A byte size is not a number with an optional K, M, G or T suffix.
    #[error("invalid size '{0}': expected bytes, optionally with a K, M, G or T suffix (powers of 1024)")]
    Size(String),
    /// An `--owners` value is not `client` or `server` with known options.
    #[error("invalid --owners '{0}': expected NAME=client or NAME=server for a served share NAME, then any of no_root_squash, allow_devices, allow_setid (comma-separated)")]
    Owners(String),
    /// A duration is not a number with an optional s, m, h or d suffix.
    #[error("invalid duration '{0}': expected seconds, or a number with an s, m, h or d suffix (e.g. 90m, 24h)")]
    Duration(String),
    /// An admission setting (`max_startups` and the like) is malformed.
    #[error(transparent)]
    Admission(#[from] SpecError),
}

/// One exported share.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ShareConfig {
    /// The name clients use (`HOST:SHARE/PATH`).
    pub name: String,
    /// The directory exported.
    pub path: PathBuf,
    /// Refuse every write.
    #[serde(default)]
    pub read_only: bool,
    /// File holding the share's secret (mode 0600 or stricter).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Environment variable holding the share's secret.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// The chunk-hash algorithm the share's new data is recorded in (`hash = "sha256"`
    /// for sites that require SHA-256); unset: the session's (BLAKE3 where the client
    /// supports it). Files recorded in another algorithm are still read with their
    /// recorded hashes.
    #[serde(default, deserialize_with = "hash_name")]
    pub hash: Option<HashAlgorithm>,
    /// Whether sessions using the share must be encrypted (`encryption = "required"`,
    /// `"preferred"` or `"off"`); unset: the server's default ([`Config::encryption`]).
    #[serde(default)]
    pub encryption: Option<Encryption>,
    /// Whose files the share's new entries are (`owners = "client"`: the calling
    /// users', ferryd running as root; see [`crate::owners`]).
    #[serde(default)]
    pub owners: Owners,
    /// With client owners, uid 0 acts as nobody (default on, as NFS).
    #[serde(default = "on")]
    pub root_squash: bool,
    /// With client owners, callers may make device nodes where the share's file
    /// system is mounted `nodev`.
    #[serde(default)]
    pub allow_devices: bool,
    /// With client owners, callers may set set-ID bits on files where the share's
    /// file system is mounted `nosuid`.
    #[serde(default)]
    pub allow_setid: bool,
}

fn on() -> bool {
    true
}

impl ShareConfig {
    /// The share's owner policy.
    pub fn owner_policy(&self) -> OwnerPolicy {
        OwnerPolicy {
            owners: self.owners,
            root_squash: self.root_squash,
            allow_devices: self.allow_devices,
            allow_setid: self.allow_setid,
        }
    }

    /// Applies an `--owners` option's value: `client` or `server`, then any of
    /// `no_root_squash`, `allow_devices`, `allow_setid`, comma-separated.
    pub fn set_owners(&mut self, value: &str) -> Result<(), ConfigError> {
        let mut words = value.split(',');
        self.owners = match words.next() {
            Some("client") => Owners::Client,
            Some("server") => Owners::Server,
            _ => return Err(ConfigError::Owners(value.into())),
        };
        for w in words {
            match w {
                "no_root_squash" => self.root_squash = false,
                "allow_devices" => self.allow_devices = true,
                "allow_setid" => self.allow_setid = true,
                _ => return Err(ConfigError::Owners(value.into())),
            }
        }
        Ok(())
    }
}

/// Reads a hash algorithm's name (`"blake3"`, `"sha256"`).
fn hash_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<HashAlgorithm>, D::Error> {
    let name = String::deserialize(d)?;
    name.parse().map(Some).map_err(serde::de::Error::custom)
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Chunks in flight per connection.
    pub queue_depth: usize,
    /// Exported shares.
    pub shares: Vec<ShareConfig>,
    /// Most file bytes registered for mapped files at once, over all connections;
    /// `MapOpen` beyond it fails with `Busy`.
    pub max_mapped_bytes: u64,
    /// Serve shares that have no secret to anyone who can connect (otherwise such a
    /// share is a configuration error).
    pub insecure_no_auth: bool,
    /// At start, resumable partial uploads not written to for this long are removed
    /// (zero: all of them).
    pub partial_ttl: Duration,
    /// Most connections served at once, TCP and RDMA together, counted from accept
    /// (a connection still in its handshake counts); one more is refused as busy.
    pub max_connections: usize,
    /// Limits on connections that have not authenticated yet, and on failed
    /// authentications (see [`crate::admission`]).
    pub admission: AdmissionConfig,
    /// The encryption policy of shares that set none (`encryption = ...` at the top
    /// of the file, or `--encryption`; default [`DEFAULT_ENCRYPTION`]).
    pub encryption: Encryption,
    /// The cluster this ferryd is a storage node of (`--cluster`), if any.
    pub cluster: Option<ClusterNode>,
    /// When an encrypted session's keys for what ferryd sends are updated
    /// (`rekey_after`, `rekey_interval`, `--rekey-after`, `--rekey-interval`; default
    /// 64 GiB or one hour), with clients that support it.
    pub rekey: RekeyPolicy,
}

/// What a cluster storage node needs to serve [`ferry_common::msg::Request::Replicate`]:
/// where etcd is (to check that the node it fetches from is a live member) and how to
/// reach other nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    /// etcd's endpoints, TLS and user (`--cluster` and the etcd options).
    #[cfg(feature = "cluster")]
    pub etcd: ferry_cluster::EtcdConfig,
    /// The transport to other nodes.
    pub transport: ferry_common::transport::TransportChoice,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    queue_depth: Option<usize>,
    max_mapped_bytes: Option<u64>,
    partial_ttl: Option<String>,
    max_connections: Option<usize>,
    max_startups: Option<String>,
    max_startups_per_source: Option<u32>,
    startup_timeout: Option<String>,
    max_auth_failures: Option<String>,
    encryption: Option<Encryption>,
    rekey_after: Option<String>,
    rekey_interval: Option<String>,
    #[serde(default)]
    share: Vec<ShareConfig>,
}

impl FileConfig {
    /// The admission settings this file gives, the defaults for the others.
    fn admission(&self) -> Result<AdmissionConfig, SpecError> {
        let mut a = AdmissionConfig::default();
        if let Some(m) = &self.max_startups {
            a.max_startups = m.parse()?;
        }
        if let Some(n) = self.max_startups_per_source {
            a.per_source = (n >= 1).then_some(n).ok_or(SpecError::PerSource)?;
        }
        if let Some(t) = &self.startup_timeout {
            a.startup_timeout = admission::parse_startup_timeout(t)?;
        }
        if let Some(f) = &self.max_auth_failures {
            a.auth_failures = f.parse()?;
        }
        Ok(a)
    }
}

impl Config {
    /// Builds the configuration from an optional TOML file and command-line values;
    /// command-line values win, and command-line shares are added to the file's.
    pub fn build(
        file: Option<&Path>,
        listen: Option<SocketAddr>,
        queue_depth: Option<usize>,
        max_mapped_bytes: Option<u64>,
        partial_ttl: Option<Duration>,
        max_connections: Option<usize>,
        share_specs: &[String],
    ) -> Result<Config, ConfigError> {
        let parsed = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                toml::from_str::<FileConfig>(&text).map_err(|e| ConfigError::Parse {
                    path: path.to_owned(),
                    message: match e.span() {
                        Some(span) => format!(
                            "line {}: {}",
                            text[..span.start].matches('\n').count() + 1,
                            e.message()
                        ),
                        None => e.message().to_string(),
                    },
                })?
            }
            None => FileConfig {
                listen: None,
                queue_depth: None,
                max_mapped_bytes: None,
                partial_ttl: None,
                max_connections: None,
                max_startups: None,
                max_startups_per_source: None,
                startup_timeout: None,
                max_auth_failures: None,
                encryption: None,
                rekey_after: None,
                rekey_interval: None,
                share: Vec::new(),
            },
        };
        let admission = parsed.admission()?;
        let mut shares = parsed.share;
        for spec in share_specs {
            shares.push(parse_share_spec(spec)?);
        }
        for s in &shares {
            check_share_name(&s.name)?;
        }
        let queue_depth = queue_depth
            .or(parsed.queue_depth)
            .unwrap_or(DEFAULT_QUEUE_DEPTH);
        if !(1..=MAX_QUEUE_DEPTH).contains(&queue_depth) {
            return Err(ConfigError::QueueDepth(queue_depth));
        }
        let max_connections = max_connections
            .or(parsed.max_connections)
            .unwrap_or(DEFAULT_MAX_CONNECTIONS);
        if max_connections == 0 {
            return Err(ConfigError::MaxConnections);
        }
        let default_listen = SocketAddr::from(([127, 0, 0, 1], ferry_common::DEFAULT_PORT));
        let partial_ttl = match (partial_ttl, parsed.partial_ttl) {
            (Some(d), _) => d,
            (None, Some(text)) => parse_duration(&text)?,
            (None, None) => DEFAULT_PARTIAL_TTL,
        };
        let mut rekey = RekeyPolicy::default();
        if let Some(size) = &parsed.rekey_after {
            rekey.after_bytes = parse_size(size)?;
        }
        if let Some(interval) = &parsed.rekey_interval {
            rekey.after = parse_duration(interval)?;
        }
        Ok(Config {
            listen: listen.or(parsed.listen).unwrap_or(default_listen),
            queue_depth,
            shares,
            max_mapped_bytes: max_mapped_bytes
                .or(parsed.max_mapped_bytes)
                .unwrap_or(DEFAULT_MAX_MAPPED_BYTES),
            insecure_no_auth: false,
            partial_ttl,
            max_connections,
            admission,
            encryption: parsed.encryption.unwrap_or(DEFAULT_ENCRYPTION),
            cluster: None,
            rekey,
        })
    }

    /// Applies `--owners NAME=VALUE` options (see [`ShareConfig::set_owners`]).
    pub fn apply_owners(&mut self, specs: &[String]) -> Result<(), ConfigError> {
        for spec in specs {
            let (name, value) = spec
                .split_once('=')
                .ok_or_else(|| ConfigError::Owners(spec.clone()))?;
            let share = self
                .shares
                .iter_mut()
                .find(|s| s.name == name)
                .ok_or_else(|| ConfigError::Owners(spec.clone()))?;
            share.set_owners(value)?;
        }
        Ok(())
    }

    /// Applies `--secret-file` flags: `NAME=FILE` sets share NAME's secret file (it wins
    /// over the config file's), a bare `FILE` becomes the secret file of every share
    /// that has no secret yet. Then `default_env`, if given, becomes the secret
    /// variable of every share that still has none.
    pub fn apply_secrets(
        &mut self,
        specs: &[String],
        default_env: Option<&str>,
    ) -> Result<(), ConfigError> {
        let mut default_file = None;
        for spec in specs {
            if spec.is_empty() {
                return Err(ConfigError::SecretSpec(spec.clone()));
            }
            match spec.split_once('=') {
                Some((name, file)) if check_share_name(name).is_ok() => {
                    if file.is_empty() {
                        return Err(ConfigError::SecretSpec(spec.clone()));
                    }
                    let share = self
                        .shares
                        .iter_mut()
                        .find(|s| s.name == name)
                        .ok_or_else(|| ConfigError::SecretForUnknownShare(name.to_string()))?;
                    share.secret_file = Some(PathBuf::from(file));
                    share.secret_env = None;
                }
                _ => default_file = Some(PathBuf::from(spec)),
            }
        }
        for share in &mut self.shares {
            if share.secret_file.is_none() && share.secret_env.is_none() {
                share.secret_file = default_file.clone();
                if share.secret_file.is_none() {
                    share.secret_env = default_env.map(str::to_string);
                }
            }
        }
        Ok(())
    }

    /// A configuration serving `shares` on `listen` with every other setting at its
    /// default.
    pub fn with_shares(listen: SocketAddr, shares: Vec<ShareConfig>) -> Config {
        Config {
            listen,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            shares,
            max_mapped_bytes: DEFAULT_MAX_MAPPED_BYTES,
            insecure_no_auth: false,
            partial_ttl: DEFAULT_PARTIAL_TTL,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            admission: AdmissionConfig::default(),
            encryption: DEFAULT_ENCRYPTION,
            cluster: None,
            rekey: RekeyPolicy::default(),
        }
    }
}

/// Parses a duration: a number of seconds, optionally followed by `s`, `m`, `h` or `d`
/// (`0`, `90m`, `24h`, `7d`).
pub fn parse_duration(arg: &str) -> Result<Duration, ConfigError> {
    ferry_common::units::parse_duration(arg).ok_or_else(|| ConfigError::Duration(arg.to_string()))
}

/// Parses a byte size: a number, optionally followed by `K`, `M`, `G` or `T` (powers
/// of 1024, an optional trailing `B` or `iB` allowed: `64G`, `512MiB`).
pub fn parse_size(arg: &str) -> Result<u64, ConfigError> {
    ferry_common::units::parse_size(arg).ok_or_else(|| ConfigError::Size(arg.to_string()))
}

/// Parses `NAME=PATH` or `NAME=PATH:ro`.
pub fn parse_share_spec(spec: &str) -> Result<ShareConfig, ConfigError> {
    let (name, path) = spec
        .split_once('=')
        .ok_or_else(|| ConfigError::ShareSpec(spec.to_string()))?;
    let (path, read_only) = match path.strip_suffix(":ro") {
        Some(p) => (p, true),
        None => (path, false),
    };
    if name.is_empty() || path.is_empty() {
        return Err(ConfigError::ShareSpec(spec.to_string()));
    }
    Ok(ShareConfig {
        name: name.to_string(),
        path: PathBuf::from(path),
        read_only,
        secret_file: None,
        secret_env: None,
        hash: None,
        encryption: None,
        owners: Owners::Server,
        root_squash: true,
        allow_devices: false,
        allow_setid: false,
    })
}

fn check_share_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::ShareName(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_specs() {
        assert_eq!(
            parse_share_spec("data=/srv/d").unwrap(),
            ShareConfig {
                name: "data".into(),
                path: "/srv/d".into(),
                read_only: false,
                secret_file: None,
                secret_env: None,
                hash: None,
                encryption: None,
                owners: Owners::Server,
                root_squash: true,
                allow_devices: false,
                allow_setid: false,
            }
        );
        assert!(parse_share_spec("ro=/srv/x:ro").unwrap().read_only);
        assert!(parse_share_spec("nopath").is_err());
        assert!(parse_share_spec("=/x").is_err());
        assert!(parse_share_spec("x=").is_err());
    }

    #[test]
    fn file_and_flags_merge() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ferryd.toml");
        std::fs::write(
            &f,
            "listen = \"127.0.0.1:9000\"\nqueue_depth = 4\n[[share]]\nname = \"a\"\npath = \"/tmp\"\nread_only = true\n",
        )
        .unwrap();
        let c = Config::build(Some(&f), None, None, None, None, None, &["b=/var".into()]).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.queue_depth, 4);
        assert_eq!(c.max_mapped_bytes, DEFAULT_MAX_MAPPED_BYTES);
        assert_eq!(c.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(c.shares.len(), 2);
        assert!(c.shares[0].read_only && !c.shares[1].read_only);
        let c = Config::build(Some(&f), None, Some(16), Some(1 << 20), None, Some(3), &[]).unwrap();
        assert_eq!(c.queue_depth, 16);
        assert_eq!(c.max_mapped_bytes, 1 << 20);
        assert_eq!(c.max_connections, 3);
        assert_eq!(c.rekey, RekeyPolicy::default());
        std::fs::write(&f, "rekey_after = \"4M\"\nrekey_interval = \"10m\"\n").unwrap();
        let c = Config::build(Some(&f), None, None, None, None, None, &["b=/var".into()]).unwrap();
        assert_eq!(c.rekey.after_bytes, 4 << 20);
        assert_eq!(c.rekey.after, Duration::from_secs(600));
        std::fs::write(&f, "rekey_after = \"lots\"\n").unwrap();
        assert!(Config::build(Some(&f), None, None, None, None, None, &["b=/var".into()]).is_err());
    }

    #[test]
    fn secret_flags() {
        let mut c = Config::build(
            None,
            None,
            None,
            None,
            None,
            None,
            &["a=/x".into(), "b=/y".into()],
        )
        .unwrap();
        c.apply_secrets(
            &["b=/etc/b.secret".into(), "/etc/all.secret".into()],
            Some("V"),
        )
        .unwrap();
        assert_eq!(
            c.shares[0].secret_file.as_deref(),
            Some(Path::new("/etc/all.secret"))
        );
        assert_eq!(
            c.shares[1].secret_file.as_deref(),
            Some(Path::new("/etc/b.secret"))
        );
        let mut c = Config::build(None, None, None, None, None, None, &["a=/x".into()]).unwrap();
        c.apply_secrets(&[], Some("V")).unwrap();
        assert_eq!(c.shares[0].secret_env.as_deref(), Some("V"));
        assert!(matches!(
            c.apply_secrets(&["zz=/f".into()], None),
            Err(ConfigError::SecretForUnknownShare(_))
        ));
        assert!(matches!(
            c.apply_secrets(&["a=".into()], None),
            Err(ConfigError::SecretSpec(_))
        ));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64G").unwrap(), 64 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2k").unwrap(), 2048);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("7B").unwrap(), 7);
        for bad in ["", "G", "1X", "-1", "1.5G", "99999999999T"] {
            assert!(
                matches!(parse_size(bad), Err(ConfigError::Size(_))),
                "{bad}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("m.toml");
        std::fs::write(&f, "max_mapped_bytes = 1024\n").unwrap();
        let c = Config::build(Some(&f), None, None, None, None, None, &["a=/tmp".into()]).unwrap();
        assert_eq!(c.max_mapped_bytes, 1024);
        assert_eq!(c.partial_ttl, DEFAULT_PARTIAL_TTL);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("45").unwrap(), Duration::from_secs(45));
        assert_eq!(parse_duration("45s").unwrap(), Duration::from_secs(45));
        assert_eq!(parse_duration("90m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("24H").unwrap(), DEFAULT_PARTIAL_TTL);
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        for bad in ["", "h", "1w", "-1", "1.5h", "99999999999999999999d"] {
            assert!(
                matches!(parse_duration(bad), Err(ConfigError::Duration(_))),
                "{bad}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t.toml");
        std::fs::write(&f, "partial_ttl = \"2h\"\n").unwrap();
        let c = Config::build(Some(&f), None, None, None, None, None, &["a=/tmp".into()]).unwrap();
        assert_eq!(c.partial_ttl, Duration::from_secs(7200));
        let c = Config::build(
            Some(&f),
            None,
            None,
            None,
            Some(Duration::ZERO),
            None,
            &["a=/tmp".into()],
        )
        .unwrap();
        assert_eq!(c.partial_ttl, Duration::ZERO);
        std::fs::write(&f, "partial_ttl = \"soon\"\n").unwrap();
        assert!(matches!(
            Config::build(Some(&f), None, None, None, None, None, &["a=/tmp".into()]),
            Err(ConfigError::Duration(_))
        ));
    }

    #[test]
    fn bad_config_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "[[share]]\nname = \"a\"\nbogus = 1\n").unwrap();
        assert!(matches!(
            Config::build(Some(&f), None, None, None, None, None, &[]),
            Err(ConfigError::Parse { .. })
        ));
        assert!(matches!(
            Config::build(None, None, None, None, None, None, &["a/b=/tmp".into()]),
            Err(ConfigError::ShareName(_))
        ));
        assert!(matches!(
            Config::build(None, None, Some(0), None, None, None, &[]),
            Err(ConfigError::QueueDepth(0))
        ));
        assert!(matches!(
            Config::build(None, None, None, None, None, Some(0), &["a=/tmp".into()]),
            Err(ConfigError::MaxConnections)
        ));
        std::fs::write(&f, "max_connections = 0\n").unwrap();
        assert!(matches!(
            Config::build(Some(&f), None, None, None, None, None, &["a=/tmp".into()]),
            Err(ConfigError::MaxConnections)
        ));
        std::fs::write(&f, "max_connections = 7\n").unwrap();
        let c = Config::build(Some(&f), None, None, None, None, None, &["a=/tmp".into()]).unwrap();
        assert_eq!(c.max_connections, 7);
        assert_eq!(c.admission, AdmissionConfig::default());
    }

    #[test]
    fn admission_keys() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let build = |text: &str| {
            std::fs::write(&f, text).unwrap();
            Config::build(Some(&f), None, None, None, None, None, &["a=/tmp".into()])
        };
        let c = build(
            "max_startups = \"10:30:100\"\nmax_startups_per_source = 4\n\
             startup_timeout = \"3s\"\nmax_auth_failures = \"5/2m\"\n",
        )
        .unwrap();
        let a = c.admission;
        assert_eq!(a.max_startups.to_string(), "10:30:100");
        assert_eq!(a.per_source, 4);
        assert_eq!(a.startup_timeout, Duration::from_secs(3));
        assert_eq!(a.auth_failures.to_string(), "5/120s");
        for bad in [
            "max_startups = \"30:10:10\"\n",
            "max_startups_per_source = 0\n",
            "startup_timeout = \"0\"\n",
            "max_auth_failures = \"5\"\n",
        ] {
            assert!(
                matches!(build(bad), Err(ConfigError::Admission(_))),
                "{bad}"
            );
        }
    }
}
