//! Parsing of `rcp` operands: local paths and `HOST[:PORT]:SHARE[/PATH]`.

use std::path::PathBuf;

use crate::error::ClientError;

/// A file or directory on a Ferry server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    /// Host name or address (without IPv6 brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Share name.
    pub share: String,
    /// Path inside the share, without leading or trailing `/` ("" for the root).
    pub path: String,
    /// The operand ended in `/`: as a destination it must be an existing directory.
    pub dir_hint: bool,
}

impl Remote {
    /// `host:port` (IPv6 in brackets), for connecting and messages.
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// `host:port:share/path`, for messages.
    pub fn display(&self) -> String {
        format!("{}:{}", self.addr(), self.share_path())
    }

    /// `share/path`.
    pub fn share_path(&self) -> String {
        if self.path.is_empty() {
            self.share.clone()
        } else {
            format!("{}/{}", self.share, self.path)
        }
    }

    /// The last component of the path, or the share name for the share root.
    pub fn base_name(&self) -> &str {
        self.path
            .rsplit('/')
            .next()
            .filter(|s| !s.is_empty())
            .unwrap_or(&self.share)
    }

    /// The same server and share, another path.
    pub fn with_path(&self, path: String) -> Remote {
        Remote {
            path,
            dir_hint: false,
            ..self.clone()
        }
    }

    /// `path/name` inside the same share.
    pub fn join(&self, name: &str) -> Remote {
        if self.path.is_empty() {
            self.with_path(name.to_string())
        } else {
            self.with_path(format!("{}/{name}", self.path))
        }
    }
}

/// One `rcp` operand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local path.
    Local(PathBuf),
    /// A remote path.
    Remote(Remote),
}

/// Parses an operand. It is remote if it has a `:` before any `/` (as in scp), or
/// starts with `[` (an IPv6 host).
pub fn parse(arg: &str, default_port: u16) -> Result<Location, ClientError> {
    let usage = |why: &str| ClientError::Usage(format!("{arg}: {why}"));
    let (host, rest) = if let Some(v6) = arg.strip_prefix('[') {
        let (host, rest) = v6
            .split_once(']')
            .ok_or_else(|| usage("unclosed '[' in IPv6 address"))?;
        let rest = rest
            .strip_prefix(':')
            .ok_or_else(|| usage("expected ':' after ']'"))?;
        (host, rest)
    } else {
        match arg.find(':') {
            Some(colon) if !arg[..colon].contains('/') => (&arg[..colon], &arg[colon + 1..]),
            _ => return Ok(Location::Local(PathBuf::from(arg))),
        }
    };
    if host.is_empty() {
        return Err(usage("empty host name"));
    }
    // An optional port: digits followed by ':'.
    let (port, rest) = match rest.split_once(':') {
        Some((p, r)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
            let port = p.parse::<u16>().map_err(|_| usage("port out of range"))?;
            (port, r)
        }
        _ => (default_port, rest),
    };
    let rest = rest.trim_start_matches('/');
    let (share, path) = rest.split_once('/').unwrap_or((rest, ""));
    if share.is_empty() {
        return Err(usage("missing share name (HOST[:PORT]:SHARE[/PATH])"));
    }
    Ok(Location::Remote(Remote {
        host: host.to_string(),
        port,
        share: share.to_string(),
        path: path.trim_matches('/').to_string(),
        dir_hint: rest.ends_with('/'),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(arg: &str) -> Remote {
        match parse(arg, 7447).unwrap() {
            Location::Remote(r) => r,
            other => panic!("{arg} parsed as {other:?}"),
        }
    }

    #[test]
    fn remote_forms() {
        let r = remote("host:data/a/b");
        assert_eq!(
            (r.host.as_str(), r.port, r.share.as_str(), r.path.as_str()),
            ("host", 7447, "data", "a/b")
        );
        let r = remote("127.0.0.1:9000:data/x/");
        assert_eq!((r.port, r.path.as_str(), r.dir_hint), (9000, "x", true));
        assert!(!remote("h:data/x").dir_hint);
        let r = remote("h:data");
        assert_eq!((r.share.as_str(), r.path.as_str()), ("data", ""));
        let r = remote("[::1]:9000:s/p");
        assert_eq!(
            (r.host.as_str(), r.port, r.addr()),
            ("::1", 9000, "[::1]:9000".to_string())
        );
        let r = remote("[::1]:s/p");
        assert_eq!(r.port, 7447);
        assert_eq!(remote("h:1:s/a/b").base_name(), "b");
        assert_eq!(remote("h:1:s").base_name(), "s");
        assert_eq!(remote("h:1:s/../x").path, "../x");
    }

    #[test]
    fn local_forms() {
        for a in ["file", "./a:b", "/abs/x:y", "dir/file", "a/b:c"] {
            assert_eq!(parse(a, 1).unwrap(), Location::Local(a.into()), "{a}");
        }
    }

    #[test]
    fn bad_forms() {
        for a in [":share/x", "h:", "h:1:", "[::1", "[::1]x", "h:99999:s"] {
            assert!(parse(a, 1).is_err(), "{a}");
        }
    }
}
