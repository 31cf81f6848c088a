//! The previous release's `ferryd` and `rcp`, for the compatibility tests
//! (`tests/tests/compat.rs`), built by `scripts/build-prev.sh`.

use std::path::{Path, PathBuf};

/// The environment variable naming the directory that holds the previous release's
/// binaries (the last line `scripts/build-prev.sh` prints).
pub const PREV_BIN_DIR_VAR: &str = "FERRY_PREV_BIN_DIR";

/// The previous release's binaries, found in `$FERRY_PREV_BIN_DIR`.
#[derive(Debug, Clone)]
pub struct PrevRelease {
    dir: PathBuf,
}

impl PrevRelease {
    /// The binaries in `$FERRY_PREV_BIN_DIR`, or `None` when it is unset or empty.
    /// Panics if it is set but lacks `ferryd` or `rcp`.
    pub fn from_env() -> Option<PrevRelease> {
        let dir = PathBuf::from(std::env::var_os(PREV_BIN_DIR_VAR).filter(|d| !d.is_empty())?);
        for name in ["ferryd", "rcp"] {
            let path = dir.join(name);
            assert!(
                path.is_file(),
                "{PREV_BIN_DIR_VAR}={}: no {name} there (scripts/build-prev.sh builds them)",
                dir.display()
            );
        }
        Some(PrevRelease { dir })
    }

    /// The directory holding the binaries.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The previous release's `ferryd`.
    pub fn ferryd(&self) -> PathBuf {
        self.dir.join("ferryd")
    }

    /// The previous release's `rcp`.
    pub fn rcp(&self) -> PathBuf {
        self.dir.join("rcp")
    }
}
