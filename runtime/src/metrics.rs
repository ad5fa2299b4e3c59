//! What a run measures (DESIGN 9): counters, one metrics line per learner step, and the spans
//! of the trace (rollout per trajectory, environment calls, learner steps, weight
//! publications), all on the run clock.
//!
//! Definitions (cumulative over the stage unless a key ends in `_window`, which covers the
//! last learner step only):
//! - effective_tokens_per_s: accepted, trainable action tokens (generated tokens of unique,
//!   non-repeated trajectories that the hard gate kept) per second of the run clock; tokens
//!   dropped by any gate or masked do not count;
//! - gradient_tokens_per_s: of those, the tokens of trajectories whose advantage is not 0
//!   (they carry a gradient; a group whose rewards are all equal carries none), per second;
//! - raw_tokens_per_s: every token the rollout engines sampled, per second;
//! - clock: the clock every rate is per second of: `wall`, or `virtual` (a replay: per
//!   virtual second, which says nothing about real throughput);
//! - token_accept_rate: accepted tokens / generated tokens of every trajectory that finished;
//! - stale_drop_rate, env_drop_rate: trajectories removed by the version / environment gate
//!   over trajectories that entered the buffer; group_dup_rate: repeats added by group repair
//!   over trajectories released to the learner;
//! - policy_lag_hist: trained tokens (repeats included) by lag 0, 1, ...;
//! - ratio_mean/min/max: the importance ratio over trained tokens;
//! - zero_lag_tokens / zero_lag_mismatch_tokens: see [`crate::learner`];
//! - mismatch.lag0.* / mismatch.lagpos.* (this step only): the learner-vs-behavior log-prob
//!   mismatch of the trained tokens whose whole context is at the learner's version (lag0,
//!   expected exactly 0) and of the others (lagpos): `tokens`, `abs_diff_mean` and
//!   `abs_diff_max` of |logp_learner - logp_behavior|, and `k3_kl`, the mean k3 estimate of
//!   KL(behavior || learner) (see [`crate::learner::Mismatch`]);
//! - is_clip_fraction, is_gated_low_fraction, is_gated_high_fraction, is_accepted_fraction
//!   (this step only): shares of the trained tokens the IS gate rejected (ratio outside the
//!   gate; below it, above it) and kept;
//! - entropy_mean_window, entropy_mean: the mean softmax entropy (nats) of the trained tokens
//!   (repeats included) under the learner's weights, this step and over the stage;
//! - kl_ref_window, kl_ref_mean: with a KL reference (`loss.kl_coef > 0` or `loss.kl_log`),
//!   the mean per-token KL estimate (the configured k1 or k3) of the behavior policy to the
//!   reference over the trained tokens, this step and over the stage (0 without a reference);
//! - opd_reverse_kl_window, opd_reverse_kl_mean, opd_scored_tokens: with on-policy
//!   distillation's teachers (`opd.form` or `opd.log`), the mean over the tokens they scored of
//!   behavior logp - teacher logp (the k1 estimate of KL(mu || teacher) at the student's own
//!   samples), this step and over the stage, and the tokens scored so far (0 without
//!   teachers); opd_reverse_kl_window.NAME per task, when there are teachers;
//! - reward_mean.NAME: mean reward of the unique trajectories of task NAME trained on;
//!   learner_share.NAME: that task's share of the groups the learner consumed;
//! - sync_bytes, sync_encoding (publication steps only): bytes sent to the replicas for this
//!   step's publication and how (`inprocess`, `delta:...`/`full`, `disk`; see
//!   [`crate::sync::lane`]);
//! - sync_refused, sync_full_resyncs: publications replicas refused, and the full syncs that
//!   answered them; replicas_lost, replica_restarts, trajectories_lost: rollout health.

use crate::buffer::BufferCounters;
use crate::clock::{ClockMode, Micros};
use crate::learner::{Mismatch, StepReport};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Counters kept by the orchestrator and the scheduler (cumulative over a stage).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RolloutCounters {
    /// Tokens sampled by the engines.
    pub sampled_tokens: u64,
    /// Generated tokens of trajectories that finished (whatever their fate afterwards).
    pub finished_generated_tokens: u64,
    pub trajectories_started: u64,
    pub trajectories_finished: u64,
    /// Finished trajectories by terminal reason (success, failure, budget, environment).
    pub by_terminal: BTreeMap<String, u64>,
    pub env_calls: u64,
    /// Failed environment calls by kind (crash, timeout, garbage, malformed, error), prompts
    /// the engine refused (`submit`) and observations it refused (`refused_observation`).
    pub env_faults: BTreeMap<String, u64>,
    pub env_retries: u64,
    /// Trajectories still running when the stage ended (never trained).
    pub abandoned: u64,
    pub engine_steps: u64,
    /// Run-clock time the engine lanes and the learner lane spent computing.
    pub engine_busy: Micros,
    pub learner_busy: Micros,
    pub publications: u64,
    /// Bytes sent to the replicas: every publication, the full syncs after refusals and
    /// restarts.
    pub sync_bytes: u64,
    /// Publications a replica refused (a delta that failed its checks, a disk file that was
    /// short or damaged); each is answered by a full sync.
    #[serde(default)]
    pub sync_refused: u64,
    /// Full syncs sent after a refusal (delta path: the full image; disk path: the file
    /// rewritten whole).
    #[serde(default)]
    pub sync_full_resyncs: u64,
    /// Disk path: publications whose writer died before the pointer moved (never published).
    #[serde(default)]
    pub sync_failed_writes: u64,
    /// Engine replicas declared lost (a heartbeat unanswered for the timeout).
    #[serde(default)]
    pub replicas_lost: u64,
    /// Lost replicas restarted (a fresh engine, a full sync) and back in the router.
    #[serde(default)]
    pub replica_restarts: u64,
    /// Trajectories ended as `environment` because their replica was lost.
    #[serde(default)]
    pub trajectories_lost: u64,
    /// Sessions of lost replicas started again on another replica.
    #[serde(default)]
    pub sessions_restarted: u64,
    /// Over-sampling (sync mode): groups still in flight when a step had its groups, aborted
    /// whole (discarded, or suspended with their partial trajectories).
    #[serde(default)]
    pub groups_aborted: u64,
    /// Generated tokens those groups' unfinished trajectories held at the abort.
    #[serde(default)]
    pub aborted_tokens: u64,
    /// Suspended groups resumed in a later batch, and the generated tokens their unfinished
    /// trajectories carried into it.
    #[serde(default)]
    pub groups_resumed: u64,
    #[serde(default)]
    pub resumed_tokens: u64,
    /// Trajectories of discarded groups that had not ended (never trained), and the tokens
    /// thrown away with them: discarded aborts, and suspended groups dropped at a checkpoint
    /// barrier (a checkpoint holds nothing in flight).
    #[serde(default)]
    pub trajectories_discarded: u64,
    #[serde(default)]
    pub discarded_tokens: u64,
    /// Generated length of every trajectory that started, at its end (or its discard), and of
    /// every trajectory the learner took: aborts favour short trajectories, and these two
    /// distributions show by how much.
    #[serde(default)]
    pub started_lengths: LengthHistogram,
    #[serde(default)]
    pub trained_lengths: LengthHistogram,
    /// Text tasks' round trips of finished trajectories ([`crate::env::Task::round_trip`]).
    #[serde(default)]
    pub round_trip: crate::env::RoundTripCounts,
}

/// Counts of generated lengths in power-of-two buckets: bucket 0 holds length 0, bucket k
/// lengths in [2^(k-1), 2^k), the last one everything longer.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LengthHistogram {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum: u64,
}

impl LengthHistogram {
    const BUCKETS: usize = 18;

    /// Counts one length.
    pub fn add(&mut self, len: usize) {
        if self.buckets.is_empty() {
            self.buckets = vec![0; Self::BUCKETS];
        }
        let k = ((usize::BITS - len.leading_zeros()) as usize).min(Self::BUCKETS - 1);
        self.buckets[k] += 1;
        self.count += 1;
        self.sum += len as u64;
    }

    pub fn merge(&mut self, other: &LengthHistogram) {
        if other.buckets.is_empty() {
            return;
        }
        if self.buckets.is_empty() {
            self.buckets = vec![0; Self::BUCKETS];
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum += other.sum;
    }

    /// The mean length (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    /// The q-quantile to a power of two: the exclusive upper bound of the bucket that holds it
    /// (1 for bucket 0, 2^k for bucket k; 0 when empty).
    pub fn quantile_bound(&self, q: f64) -> u64 {
        let need = (q * self.count as f64).ceil() as u64;
        let mut seen = 0;
        for (k, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= need.max(1) {
                return 1u64 << k;
            }
        }
        0
    }
}

/// Per task, what reached the learner.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskTotals {
    pub groups: u64,
    pub unique_samples: u64,
    pub reward_sum: f64,
    /// See [`crate::learner::TaskStep::opd_gap_sum`].
    #[serde(default)]
    pub opd_gap_sum: f64,
    #[serde(default)]
    pub opd_tokens: u64,
}

/// The learner-side totals of a stage.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LearnerTotals {
    pub steps: u64,
    /// Optimizer steps (more than `steps` with minibatches or epochs).
    #[serde(default)]
    pub optimizer_steps: u64,
    /// Tokens whose PPO surrogate took its clipped branch (see [`StepReport::clipped`]).
    #[serde(default)]
    pub clipped: u64,
    pub samples: u64,
    pub accepted_tokens: u64,
    /// Accepted tokens with a non-zero advantage (see [`StepReport::gradient_unique_tokens`]).
    #[serde(default)]
    pub gradient_tokens: u64,
    pub masked_tokens: u64,
    pub ratio_sum: f64,
    #[serde(with = "crate::trajectory::f32_bit")]
    pub ratio_min: f32,
    #[serde(with = "crate::trajectory::f32_bit")]
    pub ratio_max: f32,
    pub zero_lag_tokens: u64,
    pub zero_lag_mismatch_tokens: u64,
    pub lag_hist: Vec<u64>,
    /// See [`StepReport::mismatch_lag0`].
    #[serde(default)]
    pub mismatch_lag0: Mismatch,
    /// See [`StepReport::mismatch_lagpos`].
    #[serde(default)]
    pub mismatch_lagpos: Mismatch,
    /// See [`StepReport::entropy_sum`] and [`StepReport::kl_sum`].
    #[serde(default)]
    pub entropy_sum: f64,
    #[serde(default)]
    pub entropy_tokens: u64,
    #[serde(default)]
    pub kl_sum: f64,
    #[serde(default)]
    pub kl_tokens: u64,
    /// See [`StepReport::opd_gap_sum`] and [`StepReport::opd_tokens`].
    #[serde(default)]
    pub opd_gap_sum: f64,
    #[serde(default)]
    pub opd_tokens: u64,
    /// Trained tokens the IS gate rejected below / above its range (repeats included).
    #[serde(default)]
    pub gated_low: u64,
    #[serde(default)]
    pub gated_high: u64,
    pub per_task: BTreeMap<String, TaskTotals>,
}

impl LearnerTotals {
    pub fn new() -> LearnerTotals {
        LearnerTotals {
            ratio_min: f32::INFINITY,
            ratio_max: f32::NEG_INFINITY,
            ..LearnerTotals::default()
        }
    }

    /// Adds one step's report.
    pub fn add(&mut self, r: &StepReport) {
        self.steps += 1;
        self.optimizer_steps += r.optimizer_steps;
        self.clipped += r.clipped;
        self.accepted_tokens += r.accepted_unique_tokens;
        self.gradient_tokens += r.gradient_unique_tokens;
        self.masked_tokens += r.masked_tokens;
        self.ratio_sum += r.ratio_sum;
        self.ratio_min = self.ratio_min.min(r.ratio_min);
        self.ratio_max = self.ratio_max.max(r.ratio_max);
        self.zero_lag_tokens += r.zero_lag_tokens;
        self.zero_lag_mismatch_tokens += r.zero_lag_mismatch_tokens;
        self.mismatch_lag0.merge(&r.mismatch_lag0);
        self.mismatch_lagpos.merge(&r.mismatch_lagpos);
        self.gated_low += r.gated_low;
        self.gated_high += r.gated_high;
        self.entropy_sum += r.entropy_sum;
        self.entropy_tokens += r.entropy_tokens;
        self.kl_sum += r.kl_sum;
        self.kl_tokens += r.kl_tokens;
        self.opd_gap_sum += r.opd_gap_sum;
        self.opd_tokens += r.opd_tokens;
        if self.lag_hist.len() < r.lag_hist.len() {
            self.lag_hist.resize(r.lag_hist.len(), 0);
        }
        for (a, b) in self.lag_hist.iter_mut().zip(&r.lag_hist) {
            *a += b;
        }
        for (name, t) in &r.per_task {
            let e = self.per_task.entry(name.clone()).or_default();
            e.groups += t.groups;
            e.unique_samples += t.unique_samples;
            e.reward_sum += t.reward_sum;
            e.opd_gap_sum += t.opd_gap_sum;
            e.opd_tokens += t.opd_tokens;
            self.samples += t.samples;
        }
    }

    /// Each task's share of the groups consumed (0 when none yet).
    pub fn share(&self, task: &str) -> f64 {
        let total: u64 = self.per_task.values().map(|t| t.groups).sum();
        match self.per_task.get(task) {
            Some(t) if total > 0 => t.groups as f64 / total as f64,
            _ => 0.0,
        }
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

fn finite_or_zero(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

/// What one metrics line is built from.
pub struct LineInputs<'a> {
    pub stage: &'a str,
    /// Run-clock seconds since the stage started (virtual in replay mode).
    pub time_s: f64,
    /// The run clock (the line's rates are per second of it).
    pub clock: ClockMode,
    /// Real seconds since the stage started (differs between replays).
    pub wall_s: f64,
    pub step: &'a StepReport,
    pub learner: &'a LearnerTotals,
    pub rollout: &'a RolloutCounters,
    pub buffer: &'a BufferCounters,
    /// Task names, in config order (every task gets its keys, also at 0).
    pub tasks: &'a [String],
    /// On publication steps: bytes sent to the rollout side and how they were encoded.
    pub sync: Option<(u64, &'a str)>,
}

/// One metrics.jsonl object (DESIGN 9 keys). Keys are written in a fixed order, so two runs
/// that agree agree byte for byte (apart from `wall_s`).
pub fn metrics_line(x: &LineInputs<'_>) -> Value {
    let t = x.time_s.max(1e-9);
    let l = x.learner;
    let b = x.buffer;
    let r = x.step;
    let mut m = Map::new();
    m.insert("stage".into(), json!(x.stage));
    m.insert("step".into(), json!(l.steps));
    m.insert("version".into(), json!(r.version.0));
    m.insert("time_s".into(), json!(round6(x.time_s)));
    m.insert("clock".into(), json!(x.clock.as_str()));
    m.insert("wall_s".into(), json!(round6(x.wall_s)));
    m.insert("loss".into(), json!(finite_or_zero(r.loss)));
    m.insert(
        "grad_norm".into(),
        json!(finite_or_zero(r.optim.map_or(0.0, |s| s.grad_norm))),
    );
    m.insert(
        "effective_tokens_per_s".into(),
        json!(round6(l.accepted_tokens as f64 / t)),
    );
    m.insert(
        "gradient_tokens_per_s".into(),
        json!(round6(l.gradient_tokens as f64 / t)),
    );
    m.insert(
        "raw_tokens_per_s".into(),
        json!(round6(x.rollout.sampled_tokens as f64 / t)),
    );
    m.insert(
        "token_accept_rate".into(),
        json!(ratio(
            l.accepted_tokens,
            x.rollout.finished_generated_tokens
        )),
    );
    m.insert(
        "stale_drop_rate".into(),
        json!(ratio(b.stale_dropped, b.trajectories_in)),
    );
    m.insert(
        "env_drop_rate".into(),
        json!(ratio(b.env_dropped, b.trajectories_in)),
    );
    m.insert(
        "group_dup_rate".into(),
        json!(ratio(b.duplicated, b.trajectories_released)),
    );
    m.insert("policy_lag_hist".into(), json!(l.lag_hist));
    let any = l.masked_tokens > 0;
    m.insert(
        "ratio_mean".into(),
        json!(if any {
            l.ratio_sum / l.masked_tokens as f64
        } else {
            0.0
        }),
    );
    m.insert(
        "ratio_min".into(),
        json!(if any { l.ratio_min as f64 } else { 0.0 }),
    );
    m.insert(
        "ratio_max".into(),
        json!(if any { l.ratio_max as f64 } else { 0.0 }),
    );
    m.insert(
        "ratio_mean_window".into(),
        json!(if r.masked_tokens > 0 {
            r.ratio_sum / r.masked_tokens as f64
        } else {
            0.0
        }),
    );
    m.insert("zero_lag_tokens".into(), json!(l.zero_lag_tokens));
    m.insert(
        "zero_lag_mismatch_tokens".into(),
        json!(l.zero_lag_mismatch_tokens),
    );
    let mean = |sum: f64, n: u64| if n > 0 { sum / n as f64 } else { 0.0 };
    m.insert(
        "entropy_mean_window".into(),
        json!(finite_or_zero(mean(r.entropy_sum, r.entropy_tokens))),
    );
    m.insert(
        "entropy_mean".into(),
        json!(finite_or_zero(mean(l.entropy_sum, l.entropy_tokens))),
    );
    m.insert(
        "kl_ref_window".into(),
        json!(finite_or_zero(mean(r.kl_sum, r.kl_tokens))),
    );
    m.insert(
        "kl_ref_mean".into(),
        json!(finite_or_zero(mean(l.kl_sum, l.kl_tokens))),
    );
    m.insert(
        "opd_reverse_kl_window".into(),
        json!(finite_or_zero(mean(r.opd_gap_sum, r.opd_tokens))),
    );
    m.insert(
        "opd_reverse_kl_mean".into(),
        json!(finite_or_zero(mean(l.opd_gap_sum, l.opd_tokens))),
    );
    m.insert("opd_scored_tokens".into(), json!(l.opd_tokens));
    insert_mismatch(&mut m, "mismatch.lag0", &r.mismatch_lag0);
    insert_mismatch(&mut m, "mismatch.lagpos", &r.mismatch_lagpos);
    let gated = r.gated_low + r.gated_high;
    m.insert(
        "is_clip_fraction".into(),
        json!(ratio(gated, r.masked_tokens)),
    );
    m.insert(
        "is_gated_low_fraction".into(),
        json!(ratio(r.gated_low, r.masked_tokens)),
    );
    m.insert(
        "is_gated_high_fraction".into(),
        json!(ratio(r.gated_high, r.masked_tokens)),
    );
    m.insert(
        "is_accepted_fraction".into(),
        json!(ratio(
            r.masked_tokens.saturating_sub(gated),
            r.masked_tokens
        )),
    );
    m.insert("samples_trained".into(), json!(l.samples));
    m.insert("accepted_tokens".into(), json!(l.accepted_tokens));
    m.insert("gradient_tokens".into(), json!(l.gradient_tokens));
    m.insert("sampled_tokens".into(), json!(x.rollout.sampled_tokens));
    for name in x.tasks {
        let tt = l.per_task.get(name).cloned().unwrap_or_default();
        let w = r.per_task.get(name).cloned().unwrap_or_default();
        m.insert(
            format!("reward_mean.{name}"),
            json!(if tt.unique_samples > 0 {
                tt.reward_sum / tt.unique_samples as f64
            } else {
                0.0
            }),
        );
        m.insert(
            format!("reward_mean_window.{name}"),
            json!(if w.unique_samples > 0 {
                w.reward_sum / w.unique_samples as f64
            } else {
                0.0
            }),
        );
        m.insert(format!("learner_share.{name}"), json!(l.share(name)));
        if l.opd_tokens > 0 {
            m.insert(
                format!("opd_reverse_kl_window.{name}"),
                json!(finite_or_zero(mean(w.opd_gap_sum, w.opd_tokens))),
            );
        }
    }
    if let Some((bytes, encoding)) = x.sync {
        m.insert("sync_bytes".into(), json!(bytes));
        m.insert("sync_encoding".into(), json!(encoding));
    }
    let c = x.rollout;
    m.insert("sync_refused".into(), json!(c.sync_refused));
    m.insert("sync_full_resyncs".into(), json!(c.sync_full_resyncs));
    m.insert("replicas_lost".into(), json!(c.replicas_lost));
    m.insert("replica_restarts".into(), json!(c.replica_restarts));
    m.insert("trajectories_lost".into(), json!(c.trajectories_lost));
    Value::Object(m)
}

/// The `PREFIX.tokens`, `.abs_diff_mean`, `.abs_diff_max` and `.k3_kl` keys of one
/// [`Mismatch`] (metrics lines and summary.json).
pub fn insert_mismatch(m: &mut Map<String, Value>, prefix: &str, x: &Mismatch) {
    m.insert(format!("{prefix}.tokens"), json!(x.tokens));
    m.insert(
        format!("{prefix}.abs_diff_mean"),
        json!(finite_or_zero(x.abs_diff_mean())),
    );
    m.insert(
        format!("{prefix}.abs_diff_max"),
        json!(finite_or_zero(x.abs_diff_max)),
    );
    m.insert(format!("{prefix}.k3_kl"), json!(finite_or_zero(x.k3_kl())));
}

/// Rounds to 6 decimals so a line's text does not depend on float formatting noise.
fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Where a span is drawn in the trace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Track {
    /// A trajectory's life on a rollout replica (submit to finish, environment waits included).
    Rollout { replica: usize },
    /// One environment call of a task.
    Env { task: String },
    /// A learner step.
    Learner,
    /// A weight publication (learner to every replica).
    Sync,
    /// Replica health: losses, restarts, refused publications.
    Health,
}

/// One span on the run clock.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Span {
    pub track: Track,
    pub name: String,
    pub start: Micros,
    pub end: Micros,
    pub args: Vec<(String, String)>,
}

/// The spans of a run, in the order they ended.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Trace {
    pub spans: Vec<Span>,
}

impl Trace {
    pub fn push(
        &mut self,
        track: Track,
        name: impl Into<String>,
        start: Micros,
        end: Micros,
        args: Vec<(String, String)>,
    ) {
        self.spans.push(Span {
            track,
            name: name.into(),
            start,
            end: end.max(start),
            args,
        });
    }

    /// The spans as a Chrome trace event file (opens in Perfetto and chrome://tracing):
    /// one process per kind of track, and within it one thread row per replica, task or
    /// learner; overlapping spans of one row (concurrent trajectories, environment calls) are
    /// spread over numbered sub-rows so each row's spans nest properly.
    pub fn to_chrome_json(&self) -> Value {
        // Process ids per kind; thread ids per lane.
        let mut events = Vec::new();
        let mut lanes: BTreeMap<Track, Vec<u64>> = BTreeMap::new(); // end time per sub-row
        let mut order: Vec<&Span> = self.spans.iter().collect();
        order.sort_by_key(|s| (s.start, s.end));
        let mut names: BTreeMap<(u32, u32), String> = BTreeMap::new();
        let mut track_ids: BTreeMap<Track, u32> = BTreeMap::new();
        for s in order {
            let (pid, pname) = match &s.track {
                Track::Rollout { .. } => (1, "rollout"),
                Track::Env { .. } => (2, "environment"),
                Track::Learner => (3, "learner"),
                Track::Sync => (4, "weight sync"),
                Track::Health => (5, "health"),
            };
            let next_id = track_ids.len() as u32;
            let base = *track_ids.entry(s.track.clone()).or_insert(next_id);
            let rows = lanes.entry(s.track.clone()).or_default();
            let row = match rows.iter().position(|&end| end <= s.start.0) {
                Some(i) => {
                    rows[i] = s.end.0;
                    i
                }
                None => {
                    rows.push(s.end.0);
                    rows.len() - 1
                }
            };
            let tid = base * 10_000 + row as u32;
            let label = match &s.track {
                Track::Rollout { replica } => format!("replica {replica} / {row}"),
                Track::Env { task } => format!("env {task} / {row}"),
                Track::Learner => "learner steps".to_string(),
                Track::Sync => "publications".to_string(),
                Track::Health => "replica health".to_string(),
            };
            names.entry((pid, tid)).or_insert(label);
            names.entry((pid, 0)).or_insert_with(|| pname.to_string());
            let args: Map<String, Value> = s
                .args
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            events.push(json!({
                "name": s.name,
                "cat": pname,
                "ph": "X",
                "ts": s.start.0,
                "dur": s.end.0 - s.start.0,
                "pid": pid,
                "tid": tid,
                "args": args,
            }));
        }
        let mut meta = Vec::new();
        for ((pid, tid), name) in names {
            if tid == 0 {
                meta.push(
                    json!({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                                  "args": {"name": name}}),
                );
            } else {
                meta.push(
                    json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                  "args": {"name": name}}),
                );
            }
        }
        meta.extend(events);
        json!({ "traceEvents": meta, "displayTimeUnit": "ms" })
    }
}
