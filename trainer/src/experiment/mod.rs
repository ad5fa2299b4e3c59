//! `sluice experiment NAME [--quick]`: the design's reproduction checklist as runnable
//! experiments. Each runs a few arms (config overrides) of the same RL stage from one shared
//! supervised warm-up per seed, and writes a report (report.md, report.json, one SVG per
//! experiment) with the machine, the commit, the seeds and the clock.
//!
//! How a run is laid out (runs/experiments/NAME unless `--out`):
//!
//! ```text
//! warmup-sN/        the warm-up of seed N (the config's sft stages only; its
//!                   final.safetensors is every arm's model.init)
//! ARM-sN/           one RL run folder per arm and seed (the config's rl stages only)
//! teacher-sN/       experiments that distil (opd): the seed's teacher, the arms' starting
//!                   point trained more supervised steps (every arm's opd.teachers)
//! report.md         the table of every arm's figures (mean over seeds, and the range)
//! report.json       the same, with every seed's value, the machine, commit, seeds, clock
//! NAME.svg          the experiment's chart
//! ```
//!
//! The base config is configs/tiny.toml (the mini model) unless `--config` says otherwise;
//! `--quick` keeps one seed and shortens the RL stage, so each experiment finishes in minutes
//! on 2 cores. The clock is the run's: `run.replay = true` (the virtual clock, compute charged
//! by `[cost]`, the default here so that figures do not depend on the machine's load) or
//! `--set run.replay=false` (the wall clock).

mod defs;
mod opd;
mod report;
mod tito;

pub use defs::{Arm, Experiment, EXPERIMENTS};

use crate::config::{self, ConfigError};
use crate::train_cmd::{run_train, TrainError, TrainOptions};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use toml::Table;

/// What `sluice experiment` was asked.
#[derive(Clone, Debug, Default)]
pub struct ExperimentOptions {
    pub name: String,
    pub quick: bool,
    /// The base config (default configs/tiny.toml).
    pub config: Option<PathBuf>,
    /// Overrides for every arm (`section.key=value`).
    pub sets: Vec<String>,
    /// Only these arms (by name).
    pub arms: Vec<String>,
    /// The seeds (default: 0 with --quick, 0, 1, 2 without).
    pub seeds: Vec<u64>,
    /// RL steps per arm (default: the config's, or 12 with --quick).
    pub steps: Option<u64>,
    pub out: Option<PathBuf>,
}

/// RL steps per arm with `--quick` unless `--steps` says otherwise.
pub const QUICK_STEPS: u64 = 12;

fn bad(key: &str, message: impl Into<String>) -> TrainError {
    TrainError::Config(ConfigError {
        key: key.into(),
        message: message.into(),
    })
}

/// One arm's run for one seed: its summary.json and the RL lines of its metrics.jsonl.
#[derive(Clone, Debug)]
pub struct ArmRun {
    pub arm: String,
    pub seed: u64,
    pub summary: Value,
    pub lines: Vec<Value>,
}

/// The tables of a config with only the stages of `kind`.
fn only_stages(table: &Table, kind: &str) -> Table {
    let mut t = table.clone();
    if let Some(toml::Value::Array(stages)) = t.get("stage").cloned() {
        let kept: Vec<toml::Value> = stages
            .into_iter()
            .filter(|s| s.get("kind").and_then(|k| k.as_str()) == Some(kind))
            .collect();
        t.insert("stage".into(), toml::Value::Array(kept));
    }
    t
}

fn set_key(t: &mut Table, section: &str, key: &str, v: toml::Value) {
    if let Some(toml::Value::Table(s)) = t.get_mut(section) {
        s.insert(key.into(), v);
    } else {
        let mut s = Table::new();
        s.insert(key.into(), v);
        t.insert(section.into(), toml::Value::Table(s));
    }
}

fn write_toml(path: &Path, t: &Table) -> Result<(), TrainError> {
    let text = toml::to_string(t).map_err(|e| TrainError::Run(format!("{e}")))?;
    std::fs::write(path, text).map_err(|e| TrainError::Run(format!("{}: {e}", path.display())))
}

/// The commit of the working tree (`git rev-parse HEAD`, with `-dirty` when it has changes),
/// or "unknown" outside a git checkout.
pub fn commit() -> String {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        Some(h) => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{h}-dirty")
            } else {
                h
            }
        }
        None => "unknown".into(),
    }
}

/// The machine: CPU model, logical cores, memory (from /proc where there is one).
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown".to_string(), |s| s.trim().to_string());
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|x| x.parse::<u64>().ok())
        });
    let load = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string();
    serde_json::json!({
        "cpu": model,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "memory_gib": mem_kb.map(|k| (k as f64 / 1048576.0 * 10.0).round() / 10.0),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "load_average_at_start": load,
    })
}

/// Runs experiment `o.name` and writes its report; progress goes to `out`. Returns the
/// report's JSON.
pub fn run_experiment(o: &ExperimentOptions, out: &mut dyn Write) -> Result<Value, TrainError> {
    let Some(exp) = EXPERIMENTS.iter().find(|e| e.name == o.name) else {
        let names: Vec<&str> = EXPERIMENTS.iter().map(|e| e.name).collect();
        return Err(TrainError::Input(format!(
            "no experiment {:?} (experiments: {})",
            o.name,
            names.join(", ")
        )));
    };
    let arms: Vec<Arm> = (exp.arms)()
        .into_iter()
        .filter(|a| o.arms.is_empty() || o.arms.contains(&a.name))
        .collect();
    if let Some(missing) = o.arms.iter().find(|n| !arms.iter().any(|a| &a.name == *n)) {
        let all: Vec<String> = (exp.arms)().into_iter().map(|a| a.name).collect();
        return Err(bad(
            "--arms",
            format!(
                "experiment {} has no arm {missing:?} (its arms: {})",
                exp.name,
                all.join(", ")
            ),
        ));
    }
    let seeds = if !o.seeds.is_empty() {
        o.seeds.clone()
    } else if o.quick {
        vec![0]
    } else {
        vec![0, 1, 2]
    };
    let base_file = o
        .config
        .clone()
        .unwrap_or_else(|| PathBuf::from("configs/tiny.toml"));
    // The base config with every arm's and the user's overrides must load: found before
    // anything is written.
    let mut base_sets = vec!["run.replay=true".to_string()];
    base_sets.extend(exp.base_sets.iter().map(|s| s.to_string()));
    base_sets.extend(o.sets.iter().cloned());
    let base = config::load(Some(&base_file), &base_sets)?;
    // An experiment that distils has no teacher yet: its arms are checked against the seed's
    // RL config once the teacher exists, before any arm runs.
    let teacher_steps = opd::teacher_steps(exp.name);
    for a in arms.iter().filter(|_| teacher_steps.is_none()) {
        let mut sets = base_sets.clone();
        sets.extend(a.sets.iter().cloned());
        config::load(Some(&base_file), &sets)?;
    }
    if !base
        .stages
        .iter()
        .any(|s| s.kind == crate::config::StageKind::Rl)
    {
        return Err(bad("stage", "the experiment's config has no rl stage"));
    }
    if let Some(msg) = exp.unavailable {
        let _ = writeln!(out, "experiment {}: unavailable: {msg}", exp.name);
    }
    let out_dir = o
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs/experiments").join(exp.name));
    std::fs::create_dir_all(&out_dir)
        .map_err(|e| TrainError::Input(format!("--out {}: {e}", out_dir.display())))?;
    let steps = o.steps.or(o.quick.then_some(QUICK_STEPS));
    let mut runs: Vec<ArmRun> = Vec::new();
    let started = std::time::Instant::now();
    let machine = machine();
    if exp.unavailable.is_none() {
        for &seed in &seeds {
            // The shared warm-up of this seed.
            let warm_dir = out_dir.join(format!("warmup-s{seed}"));
            let mut warm = only_stages(&base.table, "sft");
            set_key(&mut warm, "baselines", "ablation", false.into());
            set_key(&mut warm, "baselines", "rft", false.into());
            set_key(&mut warm, "run", "seed", (seed as i64).into());
            let init = if warm
                .get("stage")
                .and_then(|s| s.as_array())
                .is_some_and(|a| !a.is_empty())
            {
                let file = out_dir.join(format!("warmup-s{seed}.toml"));
                write_toml(&file, &warm)?;
                let _ = writeln!(out, "experiment {}: warm-up, seed {seed}", exp.name);
                run_train(
                    &TrainOptions {
                        config: Some(file),
                        out: Some(warm_dir.clone()),
                        ..TrainOptions::default()
                    },
                    &mut std::io::sink(),
                )?;
                Some(warm_dir.join("final.safetensors"))
            } else {
                None
            };
            let mut rl = only_stages(&base.table, "rl");
            set_key(&mut rl, "baselines", "ablation", false.into());
            set_key(&mut rl, "baselines", "rft", false.into());
            set_key(&mut rl, "run", "seed", (seed as i64).into());
            if let Some(init) = &init {
                set_key(
                    &mut rl,
                    "model",
                    "init",
                    init.to_string_lossy().to_string().into(),
                );
            }
            if let (Some(n), Some(toml::Value::Array(stages))) = (steps, rl.get_mut("stage")) {
                for s in stages.iter_mut() {
                    if let Some(t) = s.as_table_mut() {
                        t.insert("steps".into(), (n as i64).into());
                    }
                }
            }
            if let Some(n) = teacher_steps {
                let _ = writeln!(out, "experiment {}: teacher, seed {seed}", exp.name);
                let teachers = opd::train(&rl, n, seed, &out_dir)?;
                set_key(&mut rl, "opd", "teachers", teachers);
            }
            let rl_file = out_dir.join(format!("rl-s{seed}.toml"));
            write_toml(&rl_file, &rl)?;
            if teacher_steps.is_some() {
                for a in &arms {
                    config::load(Some(&rl_file), &a.sets)?;
                }
            }
            for a in &arms {
                let dir = out_dir.join(format!("{}-s{seed}", a.name));
                let t = std::time::Instant::now();
                let s = run_train(
                    &TrainOptions {
                        config: Some(rl_file.clone()),
                        sets: a.sets.clone(),
                        out: Some(dir.clone()),
                        ..TrainOptions::default()
                    },
                    &mut std::io::sink(),
                )?;
                let lines = crate::report::plots::read_metrics(&dir.join("metrics.jsonl"))
                    .map_err(TrainError::Run)?
                    .into_iter()
                    .filter(|l| l["stage"].as_str().is_some_and(|s| s.starts_with("rl#")))
                    .collect();
                let _ = writeln!(
                    out,
                    "experiment {}: arm {} seed {seed} done ({:.1}s wall)",
                    exp.name,
                    a.name,
                    t.elapsed().as_secs_f64()
                );
                runs.push(ArmRun {
                    arm: a.name.clone(),
                    seed,
                    summary: s.summary,
                    lines,
                });
            }
        }
    }
    let ctx = report::Context {
        exp,
        arms: &arms,
        runs: &runs,
        seeds: &seeds,
        machine,
        commit: commit(),
        base_config: base_file.display().to_string(),
        sets: base_sets,
        steps: steps.or_else(|| {
            base.stages
                .iter()
                .filter(|s| s.kind == crate::config::StageKind::Rl)
                .map(|s| s.steps)
                .reduce(|a, b| a + b)
        }),
        clock: if base.run.replay { "virtual" } else { "wall" },
        quick: o.quick,
        wall_s: started.elapsed().as_secs_f64(),
    };
    let json = report::write(&ctx, &out_dir).map_err(TrainError::Run)?;
    let svg = format!("{}.svg", exp.name);
    let _ = writeln!(
        out,
        "experiment {}: report in {} (report.md, report.json{})",
        exp.name,
        out_dir.display(),
        if out_dir.join(&svg).is_file() {
            format!(", {svg}")
        } else {
            String::new()
        }
    );
    Ok(json)
}
