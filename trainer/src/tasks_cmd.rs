//! `sluice tasks export NAME`: the problems of the config's task NAME as JSON lines
//! ([`crate::tasks::export`]), to stdout or a file.

use crate::config;
use crate::tasks::export;
use crate::train_cmd::{make_task, TrainError};
use sluice_model::ModelConfig;
use std::io::Write;
use std::path::PathBuf;

/// What `sluice tasks export` was asked.
#[derive(Clone, Debug, Default)]
pub struct ExportOptions {
    pub task: String,
    pub config: Option<PathBuf>,
    pub sets: Vec<String>,
    pub split: String,
    pub n: usize,
    /// The run seed (default: the config's run.seed, which the run's evaluation uses).
    pub seed: Option<u64>,
    pub out: Option<PathBuf>,
}

/// Writes the problems; bad input (an unknown task, a bad split) is [`TrainError::Input`] or
/// [`TrainError::Config`] (exit 2).
pub fn run_export(o: &ExportOptions, stdout: &mut dyn Write) -> Result<usize, TrainError> {
    let split = export::parse_split(&o.split).map_err(TrainError::Input)?;
    if o.n == 0 {
        return Err(TrainError::Input("--n 0: at least one problem".into()));
    }
    let cfg = config::load(o.config.as_deref(), &o.sets)?;
    let section = cfg.task(&o.task).ok_or_else(|| {
        let known: Vec<&str> = cfg.tasks.iter().map(|t| t.name.as_str()).collect();
        TrainError::Input(format!(
            "no task {:?} in the config (tasks: {})",
            o.task,
            known.join(", ")
        ))
    })?;
    let model = ModelConfig::from_file(&cfg.model.config)
        .map_err(|e| TrainError::Input(format!("{}: {e}", cfg.model.config.display())))?;
    let tok = cfg.tokenizer.load()?;
    let task = make_task(
        section,
        cfg.tokenizer.model_vocab(&tok, model.vocab),
        &crate::tasks::external::EnvIo::default(),
        &tok,
    )
    .map_err(TrainError::Input)?;
    let problems = export::problems(task.as_ref(), split, o.n, o.seed.unwrap_or(cfg.run.seed));
    let mut text = String::new();
    for p in &problems {
        text.push_str(&export::line(&tok, p).to_string());
        text.push('\n');
    }
    match &o.out {
        Some(path) => std::fs::write(path, text)
            .map_err(|e| TrainError::Run(format!("{}: {e}", path.display())))?,
        None => stdout
            .write_all(text.as_bytes())
            .map_err(|e| TrainError::Run(format!("stdout: {e}")))?,
    }
    Ok(problems.len())
}
