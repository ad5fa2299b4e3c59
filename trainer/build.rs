//! Build script of sluice-trainer: records what `sluice determinism` writes into every record
//! about the binary itself.
//!
//! - `SLUICE_GIT_COMMIT`: the commit the binary was built from (`git rev-parse HEAD`), with
//!   `-dirty` when tracked files differ from it; `unknown` outside a git checkout.
//! - `SLUICE_RUSTC`: the compiler (`rustc --version`), part of the numerics class.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = match git(&["rev-parse", "HEAD"]) {
        Some(head) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=SLUICE_GIT_COMMIT={commit}");
    // Rebuild when HEAD moves: HEAD itself (a checkout), the branch it names (a commit) and
    // packed-refs (a gc), wherever this worktree keeps them.
    for path in ["HEAD", "packed-refs"] {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(p) = git(&["rev-parse", "--git-path", &branch]) {
            if Path::new(&p).exists() {
                println!("cargo:rerun-if-changed={p}");
            }
        }
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_string());
    let version = Command::new(&rustc)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "rustc (version unknown)".to_string());
    println!("cargo:rustc-env=SLUICE_RUSTC={version}");
}
