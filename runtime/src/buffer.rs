//! The data buffer (DESIGN 6.5): finished trajectories keyed by instance (prompt), released to
//! the learner as whole GRPO groups after the gates.
//!
//! - A group is *complete* when G trajectories of its instance have finished.
//! - Gates, applied when the learner asks for data (so they judge against the learner's
//!   version at that moment), each counted on its own:
//!   - environment gate: a trajectory that ended as `environment` is removed (DESIGN 6.1: never
//!     trained on as a policy failure);
//!   - version gate: a trajectory is removed when learner version - its OLDEST behavior version
//!     exceeds tau (a trajectory that spans weight swaps is judged by its stalest token);
//!   - group repair: a group left with more than G/2 valid trajectories is refilled to G by
//!     repeating its valid ones in order (counted as duplicates); otherwise the whole group is
//!     dropped;
//!   - dynamic sampling (DAPO's filter, off by default, [`BufferConfig::dynamic_sampling`]): a
//!     group whose valid trajectories all have the same reward carries no GRPO signal (every
//!     advantage (r - mean) / (std + eps) is 0), so it is dropped whole, at most `cap` such
//!     groups while the learner is at one version; past the cap they are released (counted
//!     either way). Dropped groups count as discarded in the admission rule, so rollout starts
//!     others in their place: sampling goes on until the step has its groups.
//! - No replay: an instance is released (or dropped) once; a trajectory arriving for it later
//!   is refused and counted.
//! - Backpressure is the admission rule of [`Admission`] (AReaL's): rollout never starts a
//!   trajectory that would put it more than eta learner steps ahead.
//!
//! Gates are final: a trajectory removed, or a group dropped, stays so. A group that passed at
//! one version waits as a *candidate* and is judged again if the learner moves on first.

use crate::trajectory::{Sample, TerminalReason, TrajectoryError, WeightVersion};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BufferConfig {
    /// G: trajectories per group (>= 1).
    pub group_size: u32,
    /// The version gate: the largest allowed learner version - oldest behavior version.
    pub tau: u64,
    /// The environment gate: drop trajectories that ended in an environment failure (crash,
    /// timeout, garbage). false trains them as they ended (reward 0, a failure the policy
    /// did not cause); for experiments that show the damage ([`BufferCounters::env_trained`]).
    #[serde(default = "gate_on")]
    pub env_gate: bool,
    /// Dynamic sampling: `Some(cap)` drops groups without reward variance, at most `cap` of
    /// them per learner version (see the module docs); None releases them (the default).
    #[serde(default)]
    pub dynamic_sampling: Option<u64>,
}

fn gate_on() -> bool {
    true
}

/// A group released to the learner: G trajectories (repaired ones included).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReadyGroup {
    pub instance_id: String,
    pub task: String,
    pub samples: Vec<Sample>,
    /// How many of `samples` are repeats added by group repair.
    pub duplicated: usize,
}

/// Everything the buffer counts (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BufferCounters {
    /// Trajectories accepted into the buffer.
    pub trajectories_in: u64,
    /// Groups that reached G finished trajectories.
    pub groups_complete: u64,
    /// Trajectories removed by the environment gate.
    pub env_dropped: u64,
    /// Environment-ended trajectories released to the learner because the environment gate is
    /// off (each counted once, repeats from group repair not counted).
    #[serde(default)]
    pub env_trained: u64,
    /// Trajectories removed by the version gate.
    pub stale_dropped: u64,
    /// Groups dropped for having at most G/2 valid trajectories.
    pub groups_dropped: u64,
    /// Valid trajectories discarded with their dropped group.
    pub valid_in_dropped_groups: u64,
    /// Repeats added by group repair.
    pub duplicated: u64,
    /// Groups and trajectories (repeats included) released to the learner.
    pub groups_released: u64,
    pub trajectories_released: u64,
    /// Trajectories refused: their instance was already released or dropped (no replay).
    pub replay_refused: u64,
    /// Trajectories refused: a group index already present, or >= G.
    pub duplicate_refused: u64,
    /// Groups dropped by dynamic sampling (every valid trajectory with the same reward).
    #[serde(default)]
    pub zero_signal_dropped: u64,
    /// Groups released to the learner whose valid trajectories all have the same reward (no
    /// GRPO signal): with dynamic sampling off, or past its cap.
    #[serde(default)]
    pub zero_signal_released: u64,
}

impl BufferCounters {
    /// Trajectories that will never reach the learner because their whole group was dropped
    /// (the ones the gates removed plus the valid ones discarded with them), by the validity
    /// rule or by dynamic sampling.
    pub fn discarded_in_dropped_groups(&self, group_size: u32) -> u64 {
        (self.groups_dropped + self.zero_signal_dropped) * group_size as u64
    }
}

/// Whether every trajectory of a group has the same reward (bit for bit): no GRPO signal.
pub fn zero_signal(samples: &[Sample]) -> bool {
    samples
        .windows(2)
        .all(|w| w[0].reward.to_bits() == w[1].reward.to_bits())
}

#[derive(Clone, Debug, PartialEq)]
pub enum BufferError {
    /// The trajectory failed validation.
    Invalid(TrajectoryError),
    /// Its instance was already released or dropped.
    Replay { instance_id: String },
    /// Its group index is >= G or already present.
    DuplicateMember {
        instance_id: String,
        group_index: u32,
    },
}

impl fmt::Display for BufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufferError::Invalid(e) => write!(f, "invalid trajectory: {e}"),
            BufferError::Replay { instance_id } => write!(
                f,
                "instance {instance_id:?} was already released or dropped: the buffer never \
                 replays consumed data"
            ),
            BufferError::DuplicateMember {
                instance_id,
                group_index,
            } => write!(
                f,
                "instance {instance_id:?}: group index {group_index} is out of range or already \
                 present"
            ),
        }
    }
}

impl std::error::Error for BufferError {}

/// A complete group that passed the gates at some version, waiting for the learner: only its
/// valid trajectories (not yet repaired).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Candidate {
    instance_id: String,
    task: String,
    valid: Vec<Sample>,
}

/// What happened to the trajectories of one task with one number of model turns (a tool
/// episode that calls once has 2; one that answers directly has 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TurnCounts {
    /// Accepted into the buffer.
    pub trajectories_in: u64,
    pub stale_dropped: u64,
    pub env_dropped: u64,
}

/// The number of model turns of a trajectory: maximal runs of generated (loss-masked) tokens.
pub fn model_turns(s: &Sample) -> u32 {
    let mut turns = 0;
    let mut prev = false;
    for &m in &s.loss_mask {
        if m && !prev {
            turns += 1;
        }
        prev = m;
    }
    turns
}

/// The counts of `s`'s task and number of model turns.
fn turn_counts<'a>(
    by_turns: &'a mut BTreeMap<String, BTreeMap<u32, TurnCounts>>,
    s: &Sample,
) -> &'a mut TurnCounts {
    by_turns
        .entry(s.task.clone())
        .or_default()
        .entry(model_turns(s))
        .or_default()
}

/// The data buffer. See the module docs.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct DataBuffer {
    cfg: BufferConfig,
    /// Instances with fewer than G finished trajectories, by instance id.
    filling: BTreeMap<String, Vec<Sample>>,
    /// Complete groups not yet gated, in completion order.
    complete: VecDeque<(String, Vec<Sample>)>,
    /// Gated groups waiting for the learner, in completion order.
    candidates: VecDeque<Candidate>,
    /// Instances released or dropped.
    closed: BTreeSet<String>,
    counters: BufferCounters,
    /// Per task and number of model turns (so the bias of the gates against slow, many-turn
    /// episodes shows).
    #[serde(default)]
    by_turns: BTreeMap<String, BTreeMap<u32, TurnCounts>>,
    /// Dynamic sampling's drops at one learner version: (version, groups dropped at it).
    #[serde(default)]
    zero_signal_drops: (u64, u64),
}

impl DataBuffer {
    pub fn new(cfg: BufferConfig) -> DataBuffer {
        DataBuffer {
            cfg,
            filling: BTreeMap::new(),
            complete: VecDeque::new(),
            candidates: VecDeque::new(),
            closed: BTreeSet::new(),
            counters: BufferCounters::default(),
            by_turns: BTreeMap::new(),
            zero_signal_drops: (0, 0),
        }
    }

    pub fn config(&self) -> &BufferConfig {
        &self.cfg
    }

    pub fn counters(&self) -> BufferCounters {
        self.counters
    }

    /// [`TurnCounts`] per task and number of model turns.
    pub fn by_turns(&self) -> &BTreeMap<String, BTreeMap<u32, TurnCounts>> {
        &self.by_turns
    }

    /// Complete groups (gated or not) waiting for the learner.
    pub fn groups_waiting(&self) -> usize {
        self.complete.len() + self.candidates.len()
    }

    /// Complete groups waiting for the learner, by task.
    pub fn waiting_by_task(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (_, members) in &self.complete {
            if let Some(s) = members.first() {
                *out.entry(s.task.clone()).or_default() += 1;
            }
        }
        for c in &self.candidates {
            *out.entry(c.task.clone()).or_default() += 1;
        }
        out
    }

    /// Instances with some but fewer than G finished trajectories.
    pub fn groups_filling(&self) -> usize {
        self.filling.len()
    }

    /// Adds a finished trajectory. Refused (and counted) when invalid, a replay of a released
    /// or dropped instance, or a duplicate group member; the buffer is unchanged then.
    pub fn insert(&mut self, sample: Sample) -> Result<(), BufferError> {
        sample.validate().map_err(BufferError::Invalid)?;
        let id = sample.instance_id.clone();
        if self.closed.contains(&id) {
            self.counters.replay_refused += 1;
            return Err(BufferError::Replay { instance_id: id });
        }
        let g = self.cfg.group_size;
        let members = self.filling.entry(id.clone()).or_default();
        if sample.group_index >= g || members.iter().any(|s| s.group_index == sample.group_index) {
            self.counters.duplicate_refused += 1;
            let group_index = sample.group_index;
            if members.is_empty() {
                self.filling.remove(&id);
            }
            return Err(BufferError::DuplicateMember {
                instance_id: id,
                group_index,
            });
        }
        turn_counts(&mut self.by_turns, &sample).trajectories_in += 1;
        members.push(sample);
        self.counters.trajectories_in += 1;
        if members.len() == g as usize {
            let mut members = self.filling.remove(&id).unwrap_or_default();
            members.sort_by_key(|s| s.group_index);
            self.complete.push_back((id, members));
            self.counters.groups_complete += 1;
        }
        Ok(())
    }

    /// Whether a trajectory passes the environment and version gates at `learner`.
    fn trajectory_gate(&mut self, s: &Sample, learner: WeightVersion) -> bool {
        if s.terminal_reason == TerminalReason::Environment && self.cfg.env_gate {
            self.counters.env_dropped += 1;
            turn_counts(&mut self.by_turns, s).env_dropped += 1;
            return false;
        }
        let oldest = s.oldest_behavior_version().unwrap_or(learner);
        if learner.0.saturating_sub(oldest.0) > self.cfg.tau {
            self.counters.stale_dropped += 1;
            turn_counts(&mut self.by_turns, s).stale_dropped += 1;
            return false;
        }
        true
    }

    /// Applies the trajectory gates to `valid` at `learner`; returns the group as a candidate,
    /// or None after counting it dropped (at most G/2 valid).
    fn gate_group(
        &mut self,
        instance_id: String,
        task: String,
        members: Vec<Sample>,
        learner: WeightVersion,
    ) -> Option<Candidate> {
        let mut valid = Vec::with_capacity(members.len());
        for s in members {
            if self.trajectory_gate(&s, learner) {
                valid.push(s);
            }
        }
        // More than G/2 valid, in integers: 2 * valid > G.
        if 2 * valid.len() <= self.cfg.group_size as usize {
            self.counters.groups_dropped += 1;
            self.counters.valid_in_dropped_groups += valid.len() as u64;
            self.closed.insert(instance_id);
            return None;
        }
        if let Some(cap) = self.cfg.dynamic_sampling {
            if zero_signal(&valid) {
                if self.zero_signal_drops.0 != learner.0 {
                    self.zero_signal_drops = (learner.0, 0);
                }
                if self.zero_signal_drops.1 < cap {
                    self.zero_signal_drops.1 += 1;
                    self.counters.zero_signal_dropped += 1;
                    self.closed.insert(instance_id);
                    return None;
                }
            }
        }
        Some(Candidate {
            instance_id,
            task,
            valid,
        })
    }

    /// Gates every waiting group at `learner`: candidates are judged again (the learner may
    /// have moved on since), then the newly complete groups.
    fn gate_all(&mut self, learner: WeightVersion) {
        let waiting: Vec<Candidate> = self.candidates.drain(..).collect();
        for c in waiting {
            if let Some(c) = self.gate_group(c.instance_id, c.task, c.valid, learner) {
                self.candidates.push_back(c);
            }
        }
        while let Some((id, members)) = self.complete.pop_front() {
            let task = members.first().map(|s| s.task.clone()).unwrap_or_default();
            if let Some(c) = self.gate_group(id, task, members, learner) {
                self.candidates.push_back(c);
            }
        }
    }

    /// Fills a candidate to G by repeating its valid trajectories in order, and closes it.
    fn release(&mut self, c: Candidate) -> ReadyGroup {
        let g = self.cfg.group_size as usize;
        let mut samples = c.valid;
        let valid = samples.len();
        for i in 0..g.saturating_sub(valid) {
            let copy = samples[i % valid].clone();
            samples.push(copy);
        }
        let duplicated = g - valid;
        // Counted here, once per trajectory given to the learner (a candidate may be gated
        // several times before it is released).
        self.counters.env_trained += samples[..valid]
            .iter()
            .filter(|s| s.terminal_reason == TerminalReason::Environment)
            .count() as u64;
        self.counters.duplicated += duplicated as u64;
        self.counters.zero_signal_released += u64::from(zero_signal(&samples[..valid]));
        self.counters.groups_released += 1;
        self.counters.trajectories_released += g as u64;
        self.closed.insert(c.instance_id.clone());
        ReadyGroup {
            instance_id: c.instance_id,
            task: c.task,
            samples,
            duplicated,
        }
    }

    /// The oldest `n` groups that pass the gates at `learner`, repaired, when at least `n`
    /// do; otherwise None (groups that passed wait as candidates).
    pub fn take(&mut self, learner: WeightVersion, n: usize) -> Option<Vec<ReadyGroup>> {
        self.gate_all(learner);
        if n == 0 || self.candidates.len() < n {
            return None;
        }
        let chosen: Vec<Candidate> = self.candidates.drain(..n).collect();
        Some(chosen.into_iter().map(|c| self.release(c)).collect())
    }

    /// Like [`DataBuffer::take`], but chooses which candidates to release: `pick` gets the
    /// candidates' task names in completion order and returns `n` distinct indices to
    /// release, or None to wait (the orchestrator's share correction). None when fewer than
    /// `n` candidates exist or the picker waits.
    pub fn take_by(
        &mut self,
        learner: WeightVersion,
        n: usize,
        pick: impl FnOnce(&[&str], usize) -> Option<Vec<usize>>,
    ) -> Option<Vec<ReadyGroup>> {
        self.gate_all(learner);
        if n == 0 || self.candidates.len() < n {
            return None;
        }
        let tasks: Vec<&str> = self.candidates.iter().map(|c| c.task.as_str()).collect();
        let mut idx = pick(&tasks, n)?;
        idx.sort_unstable();
        idx.dedup();
        idx.retain(|&i| i < self.candidates.len());
        if idx.len() != n {
            return None;
        }
        let mut chosen = Vec::with_capacity(n);
        for (k, i) in idx.into_iter().enumerate() {
            // Earlier removals shift later indices down by k.
            if let Some(c) = self.candidates.remove(i - k) {
                chosen.push(c);
            }
        }
        Some(chosen.into_iter().map(|c| self.release(c)).collect())
    }

    /// Every group waiting that passes the gates at `learner` (sync mode: the whole batch).
    pub fn take_all(&mut self, learner: WeightVersion) -> Vec<ReadyGroup> {
        self.gate_all(learner);
        let chosen: Vec<Candidate> = self.candidates.drain(..).collect();
        chosen.into_iter().map(|c| self.release(c)).collect()
    }
}

/// The rollout admission rule (DESIGN 6.5's backpressure, AReaL's form): a trajectory may start
/// only while
///
///   started - discarded <= (learner steps done + eta + 1) * trajectories per learner step,
///
/// counting the trajectory being started. `discarded` is the trajectories of groups the buffer
/// dropped whole (they will never reach the learner, so they must not hold rollout back
/// forever); with no dropped group it is AReaL's rule exactly. So no trajectory can be more
/// than eta learner steps ahead of the learner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub eta: u64,
    /// Trajectories per learner step: groups per step x G.
    pub per_step: u64,
}

impl Admission {
    /// How many more trajectories may start now.
    pub fn room(&self, started: u64, discarded: u64, learner_steps: u64) -> u64 {
        let limit = (learner_steps + self.eta + 1).saturating_mul(self.per_step);
        limit.saturating_sub(started.saturating_sub(discarded))
    }
}
