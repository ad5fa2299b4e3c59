//! An experiment's report: report.json (every value), report.md (the table) and NAME.svg.

use super::defs::{Arm, ChartKind, Experiment};
use super::ArmRun;
use crate::report::svg::{color, Chart, Mark, Series};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::Path;

pub struct Context<'a> {
    pub exp: &'a Experiment,
    pub arms: &'a [Arm],
    pub runs: &'a [ArmRun],
    pub seeds: &'a [u64],
    pub machine: Value,
    pub commit: String,
    pub base_config: String,
    pub sets: Vec<String>,
    pub steps: Option<u64>,
    pub clock: &'static str,
    pub quick: bool,
    pub wall_s: f64,
}

/// Mean, min and max of the values an arm's seeds gave for a column.
#[derive(Clone, Debug, Default)]
pub struct Cell {
    pub per_seed: Vec<(u64, f64)>,
}

impl Cell {
    pub fn mean(&self) -> Option<f64> {
        let n = self.per_seed.len();
        (n > 0).then(|| self.per_seed.iter().map(|x| x.1).sum::<f64>() / n as f64)
    }
    fn min(&self) -> Option<f64> {
        self.per_seed.iter().map(|x| x.1).reduce(f64::min)
    }
    fn max(&self) -> Option<f64> {
        self.per_seed.iter().map(|x| x.1).reduce(f64::max)
    }
}

fn cells(ctx: &Context<'_>, arm: &str) -> Vec<Cell> {
    ctx.exp
        .columns
        .iter()
        .map(|(_, metric)| Cell {
            per_seed: ctx
                .runs
                .iter()
                .filter(|r| r.arm == arm)
                .filter_map(|r| metric(r).map(|v| (r.seed, v)))
                .collect(),
        })
        .collect()
}

fn fmt_value(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Seconds since the epoch as `YYYY-MM-DD HH:MM UTC` (civil-from-days, proleptic Gregorian).
fn utc(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let (h, m) = ((secs % 86400) / 3600, (secs % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02} UTC")
}

/// Writes the report files into `dir`; returns report.json's value.
pub fn write(ctx: &Context<'_>, dir: &Path) -> Result<Value, String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut arms_json = Vec::new();
    let mut table: Vec<(String, Vec<Cell>)> = Vec::new();
    for a in ctx.arms {
        let c = cells(ctx, &a.name);
        let mut cols = serde_json::Map::new();
        for ((label, _), cell) in ctx.exp.columns.iter().zip(&c) {
            cols.insert(
                (*label).into(),
                json!({
                    "mean": cell.mean(),
                    "min": cell.min(),
                    "max": cell.max(),
                    "per_seed": cell.per_seed.iter().map(|(s, v)| json!({"seed": s, "value": v})).collect::<Vec<_>>(),
                }),
            );
        }
        arms_json.push(json!({ "name": a.name, "sets": a.sets, "columns": cols }));
        table.push((a.name.clone(), c));
    }
    let speedups = speedup_rows(ctx, &table);
    let report = json!({
        "experiment": ctx.exp.name,
        "about": ctx.exp.about,
        "unavailable": ctx.exp.unavailable,
        "date": utc(now),
        "commit": ctx.commit,
        "machine": ctx.machine,
        "seeds": ctx.seeds,
        "clock": ctx.clock,
        "quick": ctx.quick,
        "rl_steps_per_arm": ctx.steps,
        "base_config": ctx.base_config,
        "sets": ctx.sets,
        "wall_s": ctx.wall_s,
        "arms": arms_json,
        "speedup": speedups.iter().map(|(k, e, g)| json!({"arms": k, "effective": e, "gradient": g})).collect::<Vec<_>>(),
    });
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text)
            .map_err(|e| format!("{}: {e}", dir.join(name).display()))
    };
    write(
        "report.json",
        &serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?,
    )?;
    write("report.md", &markdown(ctx, &table, &speedups, &utc(now)))?;
    if let Some(svg) = chart(ctx, &table).and_then(|c| c.to_svg()) {
        write(&format!("{}.svg", ctx.exp.name), &svg)?;
    }
    Ok(report)
}

/// For arms named `sync-X` and `async-X`: (X, async/sync effective tok/s, the same for
/// gradient tok/s), when the experiment has those columns; and the same against an
/// over-sampled sync arm `syncos-X` where there is one (labelled `X vs syncos`).
fn speedup_rows(ctx: &Context<'_>, table: &[(String, Vec<Cell>)]) -> Vec<(String, f64, f64)> {
    let col = |label: &str| ctx.exp.columns.iter().position(|(l, _)| *l == label);
    let (Some(e), Some(g)) = (col("effective tok/s"), col("gradient tok/s")) else {
        return Vec::new();
    };
    let find = |name: &str| table.iter().find(|(n, _)| n == name).map(|(_, c)| c);
    let mut rows = Vec::new();
    for (name, c) in table {
        let Some(rest) = name.strip_prefix("async-") else {
            continue;
        };
        for (peer, label) in [
            (format!("sync-{rest}"), rest.to_string()),
            (format!("syncos-{rest}"), format!("{rest} vs syncos")),
        ] {
            let Some(s) = find(&peer) else {
                continue;
            };
            let ratio = |i: usize| match (c[i].mean(), s[i].mean()) {
                (Some(a), Some(b)) if b > 0.0 => a / b,
                _ => f64::NAN,
            };
            rows.push((label, ratio(e), ratio(g)));
        }
    }
    rows
}

fn markdown(
    ctx: &Context<'_>,
    table: &[(String, Vec<Cell>)],
    speedups: &[(String, f64, f64)],
    date: &str,
) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "# Experiment `{}`\n", ctx.exp.name);
    let _ = writeln!(t, "{}\n", ctx.exp.about);
    if let Some(why) = ctx.exp.unavailable {
        let _ = writeln!(t, "**Unavailable:** {why}.\n");
    }
    let m = &ctx.machine;
    let _ = writeln!(
        t,
        "- Machine: {} ({} logical cores, {} GiB), {} {}; load average {} at the start.",
        m["cpu"].as_str().unwrap_or("?"),
        m["cores"],
        m["memory_gib"],
        m["os"].as_str().unwrap_or("?"),
        m["arch"].as_str().unwrap_or("?"),
        m["load_average_at_start"].as_str().unwrap_or("?")
    );
    let _ = writeln!(t, "- Commit: {}; {date}.", ctx.commit);
    let _ = writeln!(
        t,
        "- Seeds: {:?}; {} RL steps per arm{}, from one supervised warm-up per seed.",
        ctx.seeds,
        ctx.steps
            .map_or("the config's".to_string(), |s| s.to_string()),
        if ctx.quick { " (--quick)" } else { "" }
    );
    let _ = writeln!(
        t,
        "- Clock: {}{}. Base config {}, with {}.",
        ctx.clock,
        if ctx.clock == "virtual" {
            " (compute charged by the config's [cost], environment latency as timers: every \
             per-second figure is per virtual second, independent of this machine's load)"
        } else {
            " (per-second figures depend on this machine and its load)"
        },
        ctx.base_config,
        if ctx.sets.is_empty() {
            "no overrides".to_string()
        } else {
            format!("`{}`", ctx.sets.join("` `"))
        }
    );
    // Arms that leave the base config's clock say so.
    let other_clock = if ctx.clock == "virtual" {
        "run.replay=false"
    } else {
        "run.replay=true"
    };
    let moved: Vec<&str> = ctx
        .arms
        .iter()
        .filter(|a| a.sets.iter().any(|s| s.replace(' ', "") == other_clock))
        .map(|a| a.name.as_str())
        .collect();
    if !moved.is_empty() {
        let _ = writeln!(
            t,
            "- Arms on the {} clock instead: {} (their per-second figures are per {} second).",
            if ctx.clock == "virtual" {
                "wall"
            } else {
                "virtual"
            },
            moved.join(", "),
            if ctx.clock == "virtual" {
                "wall-clock"
            } else {
                "virtual"
            },
        );
    }
    let _ = writeln!(t, "- Wall time of the experiment: {:.1} s.\n", ctx.wall_s);
    if ctx.exp.unavailable.is_some() {
        return t;
    }
    let _ = write!(t, "| arm |");
    for (label, _) in ctx.exp.columns {
        let _ = write!(t, " {label} |");
    }
    let _ = writeln!(t);
    let _ = writeln!(t, "|---|{}", "---|".repeat(ctx.exp.columns.len()));
    for (name, cells) in table {
        let _ = write!(t, "| {name} |");
        for c in cells {
            let s = match (c.mean(), c.min(), c.max()) {
                (Some(mean), Some(lo), Some(hi)) if c.per_seed.len() > 1 => {
                    format!("{} ({}-{})", fmt_value(mean), fmt_value(lo), fmt_value(hi))
                }
                (Some(mean), _, _) => fmt_value(mean),
                _ => "-".into(),
            };
            let _ = write!(t, " {s} |");
        }
        let _ = writeln!(t);
    }
    if ctx.seeds.len() > 1 {
        let _ = writeln!(t, "\nEach cell: the mean over the seeds (min-max).");
    }
    if !speedups.is_empty() {
        let _ = writeln!(
            t,
            "\n| arms | async / sync, effective tok/s | async / sync, gradient tok/s |"
        );
        let _ = writeln!(t, "|---|---|---|");
        for (k, e, g) in speedups {
            let _ = writeln!(t, "| {k} | {e:.2}x | {g:.2}x |");
        }
    }
    let _ = writeln!(
        t,
        "\nEach arm's run folder is ARM-sSEED/ beside this report (metrics.jsonl, summary.json, \
         trace.json, plots); report.json holds every seed's value."
    );
    t
}

fn chart(ctx: &Context<'_>, table: &[(String, Vec<Cell>)]) -> Option<Chart> {
    match ctx.exp.chart {
        ChartKind::Bars(col) => {
            let (label, _) = ctx.exp.columns.get(col)?;
            let mut series = Vec::new();
            for (i, (name, cells)) in table.iter().enumerate() {
                let v = cells.get(col)?.mean()?;
                series.push(
                    Series::new(name.clone(), color(i), Mark::Bars, vec![(i as f64, v)])
                        .with_labels(vec![fmt_value(v)]),
                );
            }
            Some(Chart {
                title: format!("{}: {label} per arm", ctx.exp.name),
                subtitle: format!("mean over seeds {:?}; {} clock", ctx.seeds, ctx.clock),
                x_label: "arm".into(),
                y_label: (*label).into(),
                series,
                integer_x: true,
                ..Chart::default()
            })
        }
        ChartKind::Steps(f, label) => {
            let seed = *ctx.seeds.first()?;
            let mut series = Vec::new();
            for (i, a) in ctx.arms.iter().enumerate() {
                let run = ctx
                    .runs
                    .iter()
                    .find(|r| r.arm == a.name && r.seed == seed)?;
                let points: Vec<(f64, f64)> = run
                    .lines
                    .iter()
                    .filter_map(|l| Some((l["step"].as_f64()?, f(l)?)))
                    .collect();
                series.push(Series::new(a.name.clone(), color(i), Mark::Line, points));
            }
            // The target, where the runs have one.
            if let Some(target) = ctx
                .runs
                .first()
                .and_then(|r| r.summary["tasks"]["tool"]["target_share"].as_f64())
            {
                series.push(Series::new(
                    "target",
                    "#888888",
                    Mark::HLine,
                    vec![(0.0, target)],
                ));
            }
            Some(Chart {
                title: format!("{}: {label} per step (seed {seed})", ctx.exp.name),
                subtitle: format!("{} clock", ctx.clock),
                x_label: "learner step".into(),
                y_label: label.into(),
                series,
                y_min_range: Some((0.0, 1.0)),
                integer_x: true,
                ..Chart::default()
            })
        }
    }
}
