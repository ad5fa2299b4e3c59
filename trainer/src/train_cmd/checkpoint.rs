//! Checkpoint folders of `sluice train`: written atomically, found, read back; metrics.jsonl
//! cut back to a checkpoint on resume.

use super::*;

pub(super) const STATE_FORMAT: u32 = 1;

/// Writes a checkpoint folder atomically: everything goes to a temporary folder first, which
/// is renamed into place only when complete (a run killed mid-write leaves the previous
/// checkpoints intact and the temporary folder ignored).
pub(super) fn write_checkpoint(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&Path) -> Result<(), String>,
    state: &RunState,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tmp = dir.join(format!(".tmp-{name}"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    write(&tmp)?;
    let text = serde_json::to_string(state).map_err(|e| format!("state.json: {e}"))?;
    sluice_model::checkpoint::write_atomic(&tmp.join("state.json"), text.as_bytes())
        .map_err(|e| format!("state.json: {e}"))?;
    let fin = dir.join(name);
    let _ = std::fs::remove_dir_all(&fin);
    std::fs::rename(&tmp, &fin).map_err(|e| format!("{}: {e}", fin.display()))?;
    // The rename is durable once the folder's entry is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The newest complete checkpoint of a run folder (names sort in run order).
pub(super) fn latest_checkpoint(out: &Path) -> Result<Option<PathBuf>, TrainError> {
    let dir = out.join("checkpoints");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(None);
    };
    let mut names: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'))
                && p.join("state.json").is_file()
        })
        .collect();
    names.sort();
    Ok(names.pop())
}

pub(super) fn read_state(ck: &Path) -> Result<RunState, TrainError> {
    let p = ck.join("state.json");
    let text = std::fs::read_to_string(&p)
        .map_err(|e| TrainError::Input(format!("{}: {e}", p.display())))?;
    let st: RunState = serde_json::from_str(&text)
        .map_err(|e| TrainError::Input(format!("{}: not a run state: {e}", p.display())))?;
    if st.format != STATE_FORMAT {
        return Err(TrainError::Input(format!(
            "{}: state format {} (this build reads {STATE_FORMAT})",
            p.display(),
            st.format
        )));
    }
    Ok(st)
}

/// Cuts metrics.jsonl back to its first `lines` lines (a resumed run rewrites the rest).
pub(super) fn truncate_lines(path: &Path, lines: u64) -> Result<std::fs::File, TrainError> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kept: String = text
        .lines()
        .take(lines as usize)
        .map(|l| format!("{l}\n"))
        .collect();
    if (kept.lines().count() as u64) < lines {
        return Err(TrainError::Input(format!(
            "{}: has fewer lines than its checkpoint recorded ({lines}); the run folder was \
             changed by hand",
            path.display()
        )));
    }
    std::fs::write(path, kept).map_err(|e| run_err(format!("{}: {e}", path.display())))?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| run_err(format!("{}: {e}", path.display())))
}
