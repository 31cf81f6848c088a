//! Validation of share-relative paths, before anything touches the disk.
//!
//! A valid path is a `/`-separated list of components relative to a share root: no
//! NUL byte, not absolute, no `..`, each component at most [`MAX_NAME_BYTES`] and the
//! whole at most [`MAX_PATH_BYTES`]. Empty components and `.` are dropped, so `""`,
//! `"."` and `"a//b/./c"` are the root, and `a/b/c`. Symlinks are the server's concern:
//! it resolves them and refuses any that lead outside the share.

use crate::msg::{MAX_NAME_BYTES, MAX_PATH_BYTES};

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    /// The path contains a NUL byte.
    #[error("path contains a NUL byte")]
    Nul,
    /// The path starts with `/`.
    #[error("absolute paths are not allowed; paths are relative to the share")]
    Absolute,
    /// A component is `..`.
    #[error("'..' is not allowed in share paths (it could escape the share)")]
    DotDot,
    /// A component is too long.
    #[error("path component longer than {MAX_NAME_BYTES} bytes")]
    NameTooLong,
    /// The whole path is too long.
    #[error("path longer than {MAX_PATH_BYTES} bytes")]
    TooLong,
}

/// Splits `path` into its components after checking the rules above.
pub fn components(path: &str) -> Result<Vec<&str>, PathError> {
    if path.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    if path.contains('\0') {
        return Err(PathError::Nul);
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute);
    }
    let mut out = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(PathError::DotDot),
            c if c.len() > MAX_NAME_BYTES => return Err(PathError::NameTooLong),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// True for a name a peer's directory listing may hold: one path component (no `/`,
/// no NUL), not empty, not `.` or `..`. A client joins listed names onto local paths
/// and hands them to the kernel, so it drops every other name the peer sends.
pub fn valid_name(name: &str) -> bool {
    !(name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_normalises() {
        assert_eq!(components("").unwrap(), Vec::<&str>::new());
        assert_eq!(components(".").unwrap(), Vec::<&str>::new());
        assert_eq!(components("a//b/./c/").unwrap(), vec!["a", "b", "c"]);
        assert_eq!(components("..a/b..").unwrap(), vec!["..a", "b.."]);
    }

    #[test]
    fn listed_names_are_one_component() {
        assert!(valid_name("a.b") && valid_name("..a") && valid_name("a b"));
        for bad in ["", ".", "..", "a/b", "/", "a\0b"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn refuses_hostile_paths() {
        assert_eq!(components("../x"), Err(PathError::DotDot));
        assert_eq!(components("a/../../x"), Err(PathError::DotDot));
        assert_eq!(components("a/.."), Err(PathError::DotDot));
        assert_eq!(components("/etc/passwd"), Err(PathError::Absolute));
        assert_eq!(components("a\0b"), Err(PathError::Nul));
        assert_eq!(components(&"n".repeat(256)), Err(PathError::NameTooLong));
        let long = vec!["d"; 2049].join("/");
        assert_eq!(components(&long), Err(PathError::TooLong));
    }
}
