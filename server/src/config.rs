//! Server configuration: a TOML file and/or command-line shares.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Default number of chunks in flight per connection.
pub const DEFAULT_QUEUE_DEPTH: usize = 8;

/// Largest accepted queue depth (bounds per-connection buffer memory).
pub const MAX_QUEUE_DEPTH: usize = 256;

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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    queue_depth: Option<usize>,
    #[serde(default)]
    share: Vec<ShareConfig>,
}

impl Config {
    /// Builds the configuration from an optional TOML file and command-line values;
    /// command-line values win, and command-line shares are added to the file's.
    pub fn build(
        file: Option<&Path>,
        listen: Option<SocketAddr>,
        queue_depth: Option<usize>,
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
                share: Vec::new(),
            },
        };
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
        let default_listen = SocketAddr::from(([127, 0, 0, 1], ferry_common::DEFAULT_PORT));
        Ok(Config {
            listen: listen.or(parsed.listen).unwrap_or(default_listen),
            queue_depth,
            shares,
        })
    }
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
                read_only: false
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
        let c = Config::build(Some(&f), None, None, &["b=/var".into()]).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.queue_depth, 4);
        assert_eq!(c.shares.len(), 2);
        assert!(c.shares[0].read_only && !c.shares[1].read_only);
        let c = Config::build(Some(&f), None, Some(16), &[]).unwrap();
        assert_eq!(c.queue_depth, 16);
    }

    #[test]
    fn bad_config_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "[[share]]\nname = \"a\"\nbogus = 1\n").unwrap();
        assert!(matches!(
            Config::build(Some(&f), None, None, &[]),
            Err(ConfigError::Parse { .. })
        ));
        assert!(matches!(
            Config::build(None, None, None, &["a/b=/tmp".into()]),
            Err(ConfigError::ShareName(_))
        ));
        assert!(matches!(
            Config::build(None, None, Some(0), &[]),
            Err(ConfigError::QueueDepth(0))
        ));
    }
}
