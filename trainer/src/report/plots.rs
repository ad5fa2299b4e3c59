//! The run folder's charts, from its metrics.jsonl lines (DESIGN 7.1, 9):
//!
//! | file                | what                                                              |
//! |---------------------|-------------------------------------------------------------------|
//! | `reward.svg`        | `reward_mean_window.NAME` per task over learner steps, smoothed (a trailing mean), the raw values faint behind; held-out pass rates as dots |
//! | `throughput.svg`    | `effective_tokens_per_s` and `raw_tokens_per_s` over `time_s`      |
//! | `policy_lag.svg`    | the last line's `policy_lag_hist`: trained tokens by policy lag    |
//! | `learner_share.svg` | `learner_share.NAME` per task over steps, its target dashed         |
//! | `mismatch.svg`      | per step, `mismatch.lagpos.abs_diff_mean` and `.k3_kl` (policy drift), the lag-0 ones dashed (expected 0) |
//!
//! Stages. `step` and `time_s` restart with every stage, so a chart's x axis runs over all
//! stages in the order they first appear: a stage's x is its own step (or time) plus the last
//! step (time) of the stages before it, and a dotted marker labelled with the stage's name shows
//! where it starts. A (stage, step) that appears twice (a resumed run that repeated steps) is
//! drawn once, from its last line. Lines without a chart's keys are skipped by that chart, and
//! a chart with nothing to draw is not written.

use super::svg::{color, Chart, Mark, Series};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A held-out pass rate measured at `step` of `stage` (0: before its first step).
#[derive(Clone, Debug, PartialEq)]
pub struct PassPoint {
    pub task: String,
    pub stage: String,
    pub step: u64,
    pub pass_rate: f64,
}

/// The chart files [`write_all`] may write.
pub const FILES: [&str; 5] = [
    "reward.svg",
    "throughput.svg",
    "policy_lag.svg",
    "learner_share.svg",
    "mismatch.svg",
];

/// Reads a metrics.jsonl file: one JSON object per non-empty line.
pub fn read_metrics(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l)
                .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
            if v.is_object() {
                Ok(v)
            } else {
                Err(format!(
                    "{} line {}: not a JSON object",
                    path.display(),
                    i + 1
                ))
            }
        })
        .collect()
}

/// Writes every chart that has data into `dir` (created if missing) and returns their paths.
/// `targets`: each task's target learner share; `pass`: held-out pass rates to mark on the
/// reward chart.
pub fn write_all(
    dir: &Path,
    lines: &[Value],
    targets: &BTreeMap<String, f64>,
    pass: &[PassPoint],
) -> Result<Vec<PathBuf>, String> {
    let charts = [
        reward_chart(lines, pass)?,
        throughput_chart(lines),
        lag_chart(lines),
        share_chart(lines, targets),
        mismatch_chart(lines),
    ];
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut written = Vec::new();
    for (file, chart) in FILES.iter().zip(charts) {
        let Some(svg) = chart.and_then(|c| c.to_svg()) else {
            continue;
        };
        let path = dir.join(file);
        std::fs::write(&path, svg).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// The metrics lines in stage order, deduplicated, with each stage's x offsets.
struct Timeline<'a> {
    /// (stage, step, line), stages in order of first appearance, steps ascending.
    rows: Vec<(&'a str, u64, &'a Value)>,
    /// Per stage: (step offset, time offset).
    offsets: BTreeMap<&'a str, (f64, f64)>,
    /// Where each stage starts on the step axis and on the time axis, with its name.
    starts: Vec<(f64, f64, &'a str)>,
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64).filter(|x| x.is_finite())
}

impl<'a> Timeline<'a> {
    fn new(lines: &'a [Value]) -> Timeline<'a> {
        let mut order: Vec<&str> = Vec::new();
        let mut by_stage: BTreeMap<&str, BTreeMap<u64, &Value>> = BTreeMap::new();
        for line in lines {
            let stage = line.get("stage").and_then(Value::as_str).unwrap_or("");
            let Some(step) = line.get("step").and_then(Value::as_u64) else {
                continue;
            };
            if !by_stage.contains_key(stage) {
                order.push(stage);
            }
            by_stage.entry(stage).or_default().insert(step, line);
        }
        let (mut step_off, mut time_off) = (0.0, 0.0);
        let mut rows = Vec::new();
        let mut offsets = BTreeMap::new();
        let mut starts = Vec::new();
        for stage in order {
            let steps = &by_stage[stage];
            offsets.insert(stage, (step_off, time_off));
            starts.push((step_off, time_off, stage));
            let (mut last_step, mut last_time) = (0.0, 0.0f64);
            for (&step, &line) in steps {
                rows.push((stage, step, line));
                last_step = step as f64;
                last_time = last_time.max(num(line, "time_s").unwrap_or(0.0));
            }
            step_off += last_step;
            time_off += last_time;
        }
        Timeline {
            rows,
            offsets,
            starts,
        }
    }

    /// (global step, value of `key`) for every line that has it.
    fn by_step(&self, key: &str) -> Vec<(f64, f64)> {
        self.rows
            .iter()
            .filter_map(|(stage, step, line)| {
                Some((self.offsets[stage].0 + *step as f64, num(line, key)?))
            })
            .collect()
    }

    /// (global step, value of `key`) for every line that has it and whose `count` key is
    /// above 0.
    fn by_step_where(&self, key: &str, count: &str) -> Vec<(f64, f64)> {
        self.rows
            .iter()
            .filter(|(_, _, line)| num(line, count).is_some_and(|n| n > 0.0))
            .filter_map(|(stage, step, line)| {
                Some((self.offsets[stage].0 + *step as f64, num(line, key)?))
            })
            .collect()
    }

    /// (global time, value of `key`) for every line that has both.
    fn by_time(&self, key: &str) -> Vec<(f64, f64)> {
        self.rows
            .iter()
            .filter_map(|(stage, _, line)| {
                Some((
                    self.offsets[stage].1 + num(line, "time_s")?,
                    num(line, key)?,
                ))
            })
            .collect()
    }

    /// Stage-start markers when there is more than one stage (on the step or time axis).
    fn markers(&self, time: bool) -> Vec<(f64, String)> {
        if self.starts.len() < 2 {
            return Vec::new();
        }
        self.starts
            .iter()
            .map(|&(s, t, name)| (if time { t } else { s }, name.to_string()))
            .collect()
    }
}

/// The task names of keys `PREFIX.NAME`, sorted.
fn tasks_with(lines: &[Value], prefix: &str) -> BTreeSet<String> {
    lines
        .iter()
        .filter_map(Value::as_object)
        .flat_map(|m| m.keys())
        .filter_map(|k| k.strip_prefix(prefix))
        .map(str::to_string)
        .collect()
}

/// One colour per task name across all charts: the names of every chart, sorted.
fn palette(
    lines: &[Value],
    targets: &BTreeMap<String, f64>,
    pass: &[PassPoint],
) -> BTreeMap<String, &'static str> {
    let mut names = tasks_with(lines, "reward_mean_window.");
    names.extend(tasks_with(lines, "learner_share."));
    names.extend(targets.keys().cloned());
    names.extend(pass.iter().map(|p| p.task.clone()));
    names
        .into_iter()
        .enumerate()
        .map(|(i, n)| (n, color(i)))
        .collect()
}

/// Trailing mean over `window` points.
pub fn smooth(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let w = window.max(1);
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= w {
                sum -= points[i - w].1;
            }
            (x, sum / (i + 1).min(w) as f64)
        })
        .collect()
}

/// The smoothing window for `n` points: about a twentieth of them, 1 to 50.
fn window_for(n: usize) -> usize {
    (n / 20).clamp(1, 50)
}

/// Reward per task over steps, with held-out pass rates. Err when a pass point names a stage
/// no line has.
pub fn reward_chart(lines: &[Value], pass: &[PassPoint]) -> Result<Option<Chart>, String> {
    let tl = Timeline::new(lines);
    let colors = palette(lines, &BTreeMap::new(), pass);
    let rewards: Vec<(String, Vec<(f64, f64)>)> = tasks_with(lines, "reward_mean_window.")
        .into_iter()
        .map(|name| {
            let pts = tl.by_step(&format!("reward_mean_window.{name}"));
            (name, pts)
        })
        .collect();
    // One window for all tasks, so their curves are comparable.
    let window = window_for(rewards.iter().map(|(_, p)| p.len()).max().unwrap_or(0));
    let mut series = Vec::new();
    for (name, raw) in rewards {
        let c = colors[&name];
        let smoothed = smooth(&raw, window);
        series.push(Series::new("", c, Mark::Line, raw).faint());
        series.push(Series::new(
            format!("{name} reward"),
            c,
            Mark::Line,
            smoothed,
        ));
    }
    let mut by_task: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for p in pass {
        let Some(&(off, _)) = tl.offsets.get(p.stage.as_str()) else {
            return Err(format!(
                "pass rate of task {} at stage {:?} step {}: no metrics line has that stage",
                p.task, p.stage, p.step
            ));
        };
        by_task
            .entry(&p.task)
            .or_default()
            .push((off + p.step as f64, p.pass_rate));
    }
    for (name, pts) in by_task {
        series.push(Series::new(
            format!("{name} held-out pass rate"),
            colors[name],
            Mark::Points,
            pts,
        ));
    }
    let chart = Chart {
        title: "Reward per task".into(),
        subtitle: format!(
            "mean reward of each learner step's trajectories, trailing mean over {window} \
             step{} (faint: unsmoothed); dots: held-out pass rate (greedy)",
            if window == 1 { "" } else { "s" }
        ),
        x_label: "learner step".into(),
        y_label: "reward / pass rate".into(),
        series,
        y_min_range: Some((0.0, 1.0)),
        x_min_range: Some((0.0, 1.0)),
        integer_x: true,
        markers: tl.markers(false),
    };
    Ok(chart.has_data().then_some(chart))
}

/// Effective and raw tokens per second over the run clock.
pub fn throughput_chart(lines: &[Value]) -> Option<Chart> {
    let tl = Timeline::new(lines);
    let series = vec![
        Series::new(
            "effective (accepted, trained)",
            color(0),
            Mark::Line,
            tl.by_time("effective_tokens_per_s"),
        ),
        Series::new(
            "raw (sampled)",
            color(1),
            Mark::Line,
            tl.by_time("raw_tokens_per_s"),
        ),
    ];
    let chart = Chart {
        title: "Throughput".into(),
        subtitle: "tokens per second of the run clock, running mean since the stage started".into(),
        x_label: "run time (s)".into(),
        y_label: "tokens / s".into(),
        series,
        y_min_range: None,
        x_min_range: Some((0.0, 0.0)),
        integer_x: false,
        markers: tl.markers(true),
    };
    chart.has_data().then_some(chart)
}

/// The policy-lag histogram of the last line that has one.
pub fn lag_chart(lines: &[Value]) -> Option<Chart> {
    let tl = Timeline::new(lines);
    let (stage, step, hist) = tl.rows.iter().rev().find_map(|(stage, step, line)| {
        let h: Vec<f64> = line
            .get("policy_lag_hist")?
            .as_array()?
            .iter()
            .map(|v| v.as_f64().unwrap_or(0.0))
            .collect();
        (h.iter().sum::<f64>() > 0.0).then_some((*stage, *step, h))
    })?;
    let total: f64 = hist.iter().sum();
    let points: Vec<(f64, f64)> = hist
        .iter()
        .enumerate()
        .map(|(lag, &n)| (lag as f64, n))
        .collect();
    // Percentages above the bars while they fit.
    let labels = if hist.len() <= 16 {
        hist.iter()
            .map(|&n| format!("{:.1}%", 100.0 * n / total))
            .collect()
    } else {
        Vec::new()
    };
    let stage_text = if stage.is_empty() {
        String::new()
    } else {
        format!("stage {stage}, ")
    };
    // One series: its colour says nothing a legend would add.
    let mut bars = Series::new("tokens", color(0), Mark::Bars, points).with_labels(labels);
    bars.in_legend = false;
    let chart = Chart {
        title: "Policy lag of trained tokens".into(),
        subtitle: format!(
            "{stage_text}cumulative at step {step}: {total:.0} tokens; lag = learner version - \
             behavior version"
        ),
        x_label: "policy lag (versions)".into(),
        y_label: "trained tokens".into(),
        series: vec![bars],
        y_min_range: None,
        x_min_range: None,
        integer_x: true,
        markers: Vec::new(),
    };
    chart.has_data().then_some(chart)
}

/// Learner-vs-behavior log-prob mismatch per learner step: for the tokens at lag > 0 (policy
/// drift) and, dashed, at lag 0 (expected exactly 0); steps without such tokens are skipped.
pub fn mismatch_chart(lines: &[Value]) -> Option<Chart> {
    let tl = Timeline::new(lines);
    let mut series = Vec::new();
    for (set, label, mark) in [
        ("lagpos", "lag > 0", Mark::Line),
        ("lag0", "lag 0", Mark::Dashed),
    ] {
        let count = format!("mismatch.{set}.tokens");
        series.push(Series::new(
            format!("{label}: mean |logp diff|"),
            color(0),
            mark,
            tl.by_step_where(&format!("mismatch.{set}.abs_diff_mean"), &count),
        ));
        series.push(Series::new(
            format!("{label}: k3 KL(behavior || learner)"),
            color(1),
            mark,
            tl.by_step_where(&format!("mismatch.{set}.k3_kl"), &count),
        ));
    }
    let chart = Chart {
        title: "Learner vs behavior log-probs".into(),
        subtitle: "per learner step over trained tokens: mean |logp_learner - logp_behavior| \
                   and the k3 KL estimate; lag 0 dashed (expected 0)"
            .into(),
        x_label: "learner step".into(),
        y_label: "nats per token".into(),
        series,
        y_min_range: None,
        x_min_range: Some((0.0, 1.0)),
        integer_x: true,
        markers: tl.markers(false),
    };
    chart.has_data().then_some(chart)
}

/// Each task's share of the groups the learner consumed, against its target.
pub fn share_chart(lines: &[Value], targets: &BTreeMap<String, f64>) -> Option<Chart> {
    let tl = Timeline::new(lines);
    let colors = palette(lines, targets, &[]);
    let mut series = Vec::new();
    for name in tasks_with(lines, "learner_share.") {
        let pts = tl.by_step(&format!("learner_share.{name}"));
        series.push(Series::new(name.clone(), colors[&name], Mark::Line, pts));
    }
    for (name, &t) in targets {
        series.push(Series::new(
            format!("{name} target"),
            colors[name],
            Mark::HLine,
            vec![(0.0, t)],
        ));
    }
    let chart = Chart {
        title: "Learner share per task".into(),
        subtitle: "share of the groups the learner consumed (cumulative); dashed: target share"
            .into(),
        x_label: "learner step".into(),
        y_label: "share of groups".into(),
        series,
        y_min_range: Some((0.0, 1.0)),
        x_min_range: Some((0.0, 1.0)),
        integer_x: true,
        markers: tl.markers(false),
    };
    chart.has_data().then_some(chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let p = [(0.0, 1.0), (1.0, 3.0), (2.0, 5.0), (3.0, 7.0)];
        let s = smooth(&p, 2);
        assert_eq!(s, vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]);
        assert_eq!(smooth(&p, 1), p.to_vec());
    }
}
