//! `-o` mount options in the usual FUSE spelling (`ro,allow_other,attr_timeout=2`).

use std::time::Duration;

use ferry_common::msg::MIN_CHUNK_BYTES;

/// Largest `chunk_size`: one chunk must fit one fetch buffer.
const MAX_MOUNT_CHUNK: u64 = crate::remote::FETCH_BYTES as u64;

/// Who besides the mounting user may use the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Only the mounting user (FUSE's default).
    #[default]
    Owner,
    /// The mounting user and root (`allow_root`).
    OwnerAndRoot,
    /// Everyone (`allow_other`).
    All,
}

/// Whether the mount may write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteMode {
    /// Read-write when the server supports writes and the share is writable, else
    /// read-only (with a notice).
    #[default]
    Auto,
    /// `rw`: read-write, or no mount at all.
    ReadWrite,
    /// `ro`: read-only.
    ReadOnly,
}

/// Everything `-o` can set. Invariant after [`MountOptions::parse_into`]: `chunk_bytes`,
/// if set, is a power of two within the protocol's bounds, `cache_bytes >= 2 * fetch bytes`,
/// `threads >= 1`, `timeout > 0`.
#[derive(Debug, Clone, PartialEq)]
pub struct MountOptions {
    /// Who may use the mount.
    pub access: Access,
    /// Whether it may write.
    pub write: WriteMode,
    /// `close` makes the data durable on the server (`sync_close`), as NFS's COMMIT;
    /// otherwise `fsync` does, as on a local file system.
    pub sync_close: bool,
    /// Bytes written but not yet pulled by the server, at most (`writeback=MIB`): the
    /// registered write-back buffers of each connection.
    pub writeback_bytes: u64,
    /// Let the kernel check permission bits (`default_permissions`).
    pub default_permissions: bool,
    /// How long the kernel (and this client) may trust attributes.
    pub attr_ttl: Duration,
    /// How long the kernel may trust a name-to-inode lookup.
    pub entry_ttl: Duration,
    /// How long a name that does not exist is remembered as missing.
    pub negative_ttl: Duration,
    /// Bytes of verified chunks kept in memory.
    pub cache_bytes: u64,
    /// Chunk size asked of the server: the unit of verification and of one-sided reads.
    /// `None`: chosen per file by its size ([`crate::reader::auto_chunk`]).
    pub chunk_bytes: Option<u32>,
    /// Chunks read ahead of a sequential reader. `None`: as many as make
    /// [`crate::reader::READAHEAD_BYTES`].
    pub readahead_chunks: Option<u32>,
    /// The kernel's readahead for the mount, in KiB (applied when running as root).
    pub max_readahead_kib: u32,
    /// Bound on every server round trip and one-sided read.
    pub timeout: Duration,
    /// Threads reading requests from the kernel.
    pub threads: usize,
    /// Name shown as the mount's source in `mount` and `/proc/mounts`.
    pub fsname: Option<String>,
    /// File holding the share's secret (`secret_file=PATH`).
    pub secret_file: Option<std::path::PathBuf>,
    /// Encryption policy (`encryption=preferred|required|off`), over `--encryption`.
    pub encryption: Option<ferry_common::seal::Encryption>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            access: Access::Owner,
            write: WriteMode::Auto,
            sync_close: false,
            writeback_bytes: 64 << 20,
            default_permissions: false,
            attr_ttl: Duration::from_secs(1),
            entry_ttl: Duration::from_secs(1),
            negative_ttl: Duration::from_secs(1),
            cache_bytes: 256 << 20,
            chunk_bytes: None,
            readahead_chunks: None,
            max_readahead_kib: 1024,
            timeout: Duration::from_secs(20),
            threads: 4,
            fsname: None,
            secret_file: None,
            encryption: None,
        }
    }
}

/// The option names `-o` accepts, for `--help` and error messages.
pub const KNOWN: &str =
    "ro, rw, writeback=MIB, sync_close, encryption=preferred|required|off, allow_other, allow_root, default_permissions, attr_timeout=SECS, \
     entry_timeout=SECS, negative_timeout=SECS, cache_size=MIB, chunk_size=BYTES, \
     readahead=CHUNKS, max_readahead=KIB, timeout=SECS, threads=N, fsname=NAME, \
     secret_file=PATH";

impl MountOptions {
    /// Applies one `-o` argument (comma-separated options) on top of `self`.
    pub fn parse_into(&mut self, arg: &str) -> Result<(), String> {
        for opt in arg.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            let (key, value) = match opt.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (opt, None),
            };
            if !self.set_flag(key, value)? {
                self.set_valued(key, value)?;
            }
        }
        let min_cache = 2 * crate::remote::FETCH_BYTES as u64;
        if self.cache_bytes < min_cache {
            return Err(format!(
                "cache_size must hold at least {} MiB with this chunk size",
                min_cache.div_ceil(1 << 20)
            ));
        }
        Ok(())
    }

    /// Applies `key` if it is an option that takes no value (refused with one):
    /// whether it is one.
    fn set_flag(&mut self, key: &str, value: Option<&str>) -> Result<bool, String> {
        let set: fn(&mut MountOptions) = match key {
            "ro" => |o| o.write = WriteMode::ReadOnly,
            "rw" => |o| o.write = WriteMode::ReadWrite,
            "sync_close" => |o| o.sync_close = true,
            "allow_other" => |o| o.access = Access::All,
            "allow_root" => |o| o.access = Access::OwnerAndRoot,
            "default_permissions" => |o| o.default_permissions = true,
            _ => return Ok(false),
        };
        if value.is_some() {
            return Err(format!("option '{key}' takes no value"));
        }
        set(self);
        Ok(true)
    }

    /// Applies the option `key`, which needs a `value`; an unknown `key` is refused.
    fn set_valued(&mut self, key: &str, value: Option<&str>) -> Result<(), String> {
        let need = || {
            value
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("option '{key}' needs a value ({key}=...)"))
        };
        match key {
            "writeback" => {
                let mib: u64 = number(key, need()?)?;
                if !(1..=65_536).contains(&mib) {
                    return Err("writeback must be from 1 to 65536 (MiB)".into());
                }
                self.writeback_bytes = mib << 20;
            }
            "attr_timeout" => self.attr_ttl = seconds(key, need()?)?,
            "entry_timeout" => self.entry_ttl = seconds(key, need()?)?,
            "negative_timeout" => self.negative_ttl = seconds(key, need()?)?,
            "timeout" => {
                self.timeout = seconds(key, need()?)?;
                if self.timeout.is_zero() {
                    return Err("timeout must be greater than 0".into());
                }
            }
            "cache_size" => {
                let mib: u64 = number(key, need()?)?;
                self.cache_bytes = mib
                    .checked_mul(1 << 20)
                    .ok_or_else(|| format!("cache_size={mib} is too large"))?;
            }
            "chunk_size" => {
                let bytes = size(key, need()?)?;
                let ok = bytes.is_power_of_two()
                    && (u64::from(MIN_CHUNK_BYTES)..=MAX_MOUNT_CHUNK).contains(&bytes);
                if !ok {
                    return Err(format!(
                        "chunk_size must be a power of two from {}K to {}M",
                        MIN_CHUNK_BYTES >> 10,
                        MAX_MOUNT_CHUNK >> 20
                    ));
                }
                self.chunk_bytes = Some(bytes as u32);
            }
            "readahead" => self.readahead_chunks = Some(number(key, need()?)?),
            "max_readahead" => {
                self.max_readahead_kib = number(key, need()?)?;
                if !(4..=65_536).contains(&self.max_readahead_kib) {
                    return Err("max_readahead must be from 4 to 65536 (KiB)".into());
                }
            }
            "threads" => {
                self.threads = number(key, need()?)?;
                if !(1..=64).contains(&self.threads) {
                    return Err("threads must be from 1 to 64".into());
                }
            }
            "fsname" => self.fsname = Some(need()?.to_string()),
            "secret_file" => self.secret_file = Some(need()?.into()),
            "encryption" => self.encryption = Some(need()?.parse()?),
            other => return Err(format!("unknown mount option '{other}' (known: {KNOWN})")),
        }
        Ok(())
    }
}

fn number<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("option {key}={v}: not a whole number"))
}

fn seconds(key: &str, v: &str) -> Result<Duration, String> {
    let s: f64 = v
        .parse()
        .map_err(|_| format!("option {key}={v}: not a number of seconds"))?;
    if !s.is_finite() || !(0.0..=86_400.0 * 365.0).contains(&s) {
        return Err(format!("option {key}={v}: out of range"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// Bytes with an optional K/M suffix (powers of 1024).
fn size(key: &str, v: &str) -> Result<u64, String> {
    let (digits, mult) = match v.as_bytes().last() {
        Some(b'k' | b'K') => (&v[..v.len() - 1], 1 << 10),
        Some(b'm' | b'M') => (&v[..v.len() - 1], 1 << 20),
        _ => (v, 1),
    };
    let n: u64 = number(key, digits)?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("option {key}={v}: too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(arg: &str) -> Result<MountOptions, String> {
        let mut o = MountOptions::default();
        o.parse_into(arg).map(|()| o)
    }

    #[test]
    fn usual_spellings_parse() {
        let o = parse("ro,allow_other,attr_timeout=2.5,entry_timeout=0,chunk_size=128K,threads=2")
            .unwrap();
        assert_eq!(o.access, Access::All);
        assert_eq!(o.attr_ttl, Duration::from_millis(2500));
        assert_eq!(o.entry_ttl, Duration::ZERO);
        assert_eq!(o.chunk_bytes, Some(128 << 10));
        assert_eq!(o.threads, 2);
        assert_eq!(parse("chunk_size=1M").unwrap().chunk_bytes, Some(1 << 20));
        assert_eq!(parse("ro").unwrap().chunk_bytes, None);
        assert_eq!(parse("ro").unwrap().write, WriteMode::ReadOnly);
        assert_eq!(parse("").unwrap().write, WriteMode::Auto);
        let w = parse("rw,sync_close,writeback=16").unwrap();
        assert_eq!(w.write, WriteMode::ReadWrite);
        assert!(w.sync_close && !parse("rw").unwrap().sync_close);
        assert_eq!(w.writeback_bytes, 16 << 20);
        assert_eq!(parse("cache_size=64").unwrap().cache_bytes, 64 << 20);
        assert_eq!(parse("").unwrap(), MountOptions::default());
    }

    #[test]
    fn bad_options_say_why() {
        for (arg, want) in [
            ("rw=1", "takes no value"),
            ("writeback=0", "writeback must be"),
            ("bogus", "unknown mount option 'bogus'"),
            ("attr_timeout", "needs a value"),
            ("attr_timeout=-1", "out of range"),
            ("attr_timeout=abc", "not a number"),
            ("chunk_size=3000", "power of two"),
            ("chunk_size=64M", "power of two"),
            ("ro=1", "takes no value"),
            ("threads=0", "threads must be"),
            ("timeout=0", "greater than 0"),
            ("cache_size=1", "cache_size must hold"),
        ] {
            let err = parse(arg).unwrap_err();
            assert!(err.contains(want), "{arg}: {err}");
        }
    }
}
