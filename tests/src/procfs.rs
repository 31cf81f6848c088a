//! What `/proc` says about a process: its open file descriptors and its memory.

use std::fs;

/// The targets of every open file descriptor of process `pid` (`socket:[123]`,
/// `/path/to/file`, `anon_inode:[eventpoll]`, ...), sorted.
///
/// Panics if `/proc/PID/fd` cannot be listed (the process is gone, or belongs to
/// someone else). A descriptor closed between the listing and its `readlink` is left
/// out.
pub fn open_fds(pid: u32) -> Vec<String> {
    let dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<String> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {dir}: {e}"))
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let target = fs::read_link(entry.path()).ok()?;
            Some(target.to_string_lossy().into_owned())
        })
        .collect();
    fds.sort();
    fds
}

/// A number from `/proc/PID/status`: in bytes for a size field such as `VmHWM` (the
/// peak resident set size) or `VmRSS` (the resident set size now), which the kernel
/// gives in kB; as is for a count such as `Threads`. Panics if the file or the field
/// is missing.
pub fn proc_status(pid: u32, field: &str) -> u64 {
    let path = format!("/proc/{pid}/status");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let prefix = format!("{field}:");
    let value = text
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("{path} has no {field} line"))
        .trim();
    // "123456 kB" or "17".
    let (number, scale) = match value.strip_suffix("kB") {
        Some(kib) => (kib.trim(), 1024),
        None => (value, 1),
    };
    let n: u64 = number
        .parse()
        .unwrap_or_else(|e| panic!("{path}: cannot parse {field}: {value}: {e}"));
    n * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_fds_and_memory() {
        let pid = std::process::id();
        let file = fs::File::open("/proc/self/status").unwrap();
        let fds = open_fds(pid);
        assert!(fds.iter().any(|t| t.ends_with("/status")), "{fds:?}");
        drop(file);
        // The peak, read after the current size, is at least that size.
        let rss = proc_status(pid, "VmRSS");
        assert!(rss > 0 && proc_status(pid, "VmHWM") >= rss);
        assert!(proc_status(pid, "Threads") >= 1);
    }
}
