//! Writes the committed seed corpus and runs every seed through its target.
//!
//! ```text
//! cargo run --manifest-path tests/fuzz/Cargo.toml --example seeds           # write
//! cargo run --manifest-path tests/fuzz/Cargo.toml --example seeds -- --check
//! ```
//!
//! `--check` fails if a committed seed differs from what would be written (the
//! protocol changed: write them again and commit the result).

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut stale = 0;
    for seed in ferry_fuzz::seeds::seeds() {
        let dir = corpus.join(seed.target);
        let path = dir.join(seed.name);
        if check {
            if std::fs::read(&path).ok().as_deref() != Some(&seed.bytes[..]) {
                eprintln!("stale or missing seed: {}", path.display());
                stale += 1;
            }
        } else if let Err(e) =
            std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, &seed.bytes))
        {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        match seed.target {
            "codec_decode" => ferry_fuzz::codec_decode(&seed.bytes),
            "tcp_frame" => ferry_fuzz::tcp_frame(&seed.bytes),
            "server_session" => ferry_fuzz::server_session(&seed.bytes),
            "server_requests" => ferry_fuzz::server_requests(&seed.bytes),
            other => {
                eprintln!("seed for unknown target {other}");
                return ExitCode::FAILURE;
            }
        }
        println!(
            "{}/{}: {} bytes, ok",
            seed.target,
            seed.name,
            seed.bytes.len()
        );
    }
    if stale > 0 {
        eprintln!("{stale} seeds are stale; run without --check to write them");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
