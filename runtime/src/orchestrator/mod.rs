//! The multi-task orchestrator (DESIGN 6.4): the task registry, admission (concurrency
//! budgets, backpressure room, share correction), and every session's life: its engine
//! requests, its environment calls with latency, faults, timeouts and retries, and its end.
//!
//! It talks only in messages: it returns [`Action`]s (engine commands, environment timers,
//! finished trajectories, trace spans) and reacts to engine events, command results and
//! environment timers. It keeps no thread and no clock of its own; a thousand sessions are a
//! thousand small records, and a session waiting on its environment is one timer.
//!
//! Every random choice is keyed, never drawn from a shared stream: the problem of group k of a
//! task from (seed, task, k), an environment call's latency and fate from (seed, session, turn,
//! attempt), the sampler's noise from (seed, request id, position). So the order in which
//! things happen never changes what they are.
//!
//! A group's trajectories go to the data buffer together, when the last of them ends (the
//! buffer could not release the group earlier anyway). So when an engine replica is lost
//! ([`Orchestrator::on_replica_lost`]), every group it was running ends whole as `environment`
//! (infrastructure) failures: the trajectories that lived in its engine are gone, and the ones
//! that had already finished belong to a group that can no longer be judged as one; none of
//! them is trained. The session then continues on another replica: a replacement group of the
//! same problem and session id starts wherever the router now sends that session.
//!
//! Share correction. A task's flow into the learner is bounded by min(lambda, c/T) * q (arrival
//! rate, concurrency over completion time, acceptance rate): left alone, fast tasks crowd out
//! slow ones. With `share_correction` the orchestrator (1) gives the backpressure room to the
//! task with the least supply (groups in flight or waiting) against target share x completion
//! time, Little's law, so a slow task keeps enough groups in flight to deliver its share, and
//! (2) chooses which ready groups the learner takes so that each task's consumed share follows
//! its target ([`Orchestrator::pick`]). Without it, it fills the task with the most free
//! concurrency first and the learner takes groups in completion order; the report shows the
//! resulting skew.
//!
//! One file per job: this one (the registry, a session's start and end, checkpoints),
//! [`admission`] (which task starts next, which ready groups the learner takes), [`env_calls`]
//! (environment calls, retries, replies) and [`replica_loss`] (a lost engine replica).

use crate::clock::Micros;
use crate::engine::{Event, Request, SeqHandle};
use crate::env::faults::{garbage_tokens, plan_call, CallFault, CallKey, FaultRates};
use crate::env::latency::LatencyModel;
use crate::env::{Problem, Reply, Split, Task};
use crate::hash::{hash_str, mix64};
use crate::metrics::{RolloutCounters, Span, Track};
use crate::trajectory::{
    ClockStamps, Sample, SamplingParams, TerminalReason, TokenId, WeightVersion,
};
use sluice_kernels::testing::Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

mod admission;
mod env_calls;
mod messages;
mod over_sampling;
mod replica_loss;

pub use messages::{
    Action, EngineCmd, EngineResult, EnvCall, GroupControl, MemberRef, ObserveRefusal,
};

/// One registered task type.
#[derive(Clone)]
pub struct TaskSpec {
    pub task: Arc<dyn Task>,
    /// Trajectories of this task in flight at most (a group of G counts G).
    pub concurrency: u64,
    /// One environment call's timeout.
    pub timeout: Micros,
    /// Retries of a failed environment call (crash, timeout, garbage) before the trajectory
    /// ends as `environment`.
    pub retries: u32,
    /// Target share of the groups the learner consumes.
    pub target_share: f64,
    pub latency: LatencyModel,
    pub faults: FaultRates,
}

impl fmt::Debug for TaskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskSpec")
            .field("task", &self.task.name())
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .field("target_share", &self.target_share)
            .field("latency", &self.latency)
            .field("faults", &self.faults)
            .finish()
    }
}

/// How sessions are run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RolloutPolicy {
    /// G trajectories per group (one prompt, prefilled once).
    pub group_size: u32,
    /// Temperature, top-k, top-p, max new tokens per turn, sampler seed.
    pub sampling: SamplingParams,
    /// Model turns per episode at most; an environment that wants more ends it as `budget`.
    pub max_turns: u32,
    pub share_correction: bool,
    /// The run seed (problems and environment calls are keyed by it).
    pub seed: u64,
    /// The model's vocabulary (observations outside it are garbage).
    pub vocab: usize,
    /// The longest observation accepted (longer is malformed).
    pub max_observation_tokens: usize,
}

/// Per task: what the orchestrator saw.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskStats {
    pub groups_started: u64,
    pub trajectories_started: u64,
    pub in_flight: u64,
    pub trajectories_finished: u64,
    /// Trajectories that ended as `environment`.
    pub env_failures: u64,
    /// Sum over finished trajectories of their completion time (group start to end).
    pub completion_sum: Micros,
    /// Groups the learner consumed.
    pub groups_consumed: u64,
}

impl TaskStats {
    pub fn mean_completion_s(&self) -> f64 {
        if self.trajectories_finished == 0 {
            0.0
        } else {
            self.completion_sum.secs() / self.trajectories_finished as f64
        }
    }
}

/// What a checkpoint keeps of the orchestrator (see [`Orchestrator::state`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OrchestratorState {
    pub next_group: u64,
    pub stats: Vec<TaskStats>,
    pub counters: RolloutCounters,
}

/// How fast the learner consumes groups (for admission's share correction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    /// Recent seconds per learner step.
    pub step_s: f64,
    /// Groups per learner step.
    pub groups_per_step: usize,
}

/// What a replica loss ended (see [`Orchestrator::on_replica_lost`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LostSessions {
    /// Trajectories ended as `environment` (every member of every group the replica ran).
    pub trajectories: u64,
    /// (instance id, group index) of each of them.
    pub members: Vec<(String, u32)>,
    /// The sessions that start again on another replica.
    pub sessions: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct OrchestratorError(pub String);

impl fmt::Display for OrchestratorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "orchestrator: {}", self.0)
    }
}

impl std::error::Error for OrchestratorError {}

type OrchResult<T> = std::result::Result<T, OrchestratorError>;

fn internal(msg: impl Into<String>) -> OrchestratorError {
    OrchestratorError(msg.into())
}

#[derive(Debug)]
enum MemberState {
    /// In the engine, generating (or waiting for its submit/observe to be applied).
    Generating,
    /// Waiting on an environment call that started at `since`.
    InEnv {
        since: Micros,
    },
    /// A finish command is on its way to the engine.
    Finishing,
    Done,
}

#[derive(Debug)]
struct Member {
    handle: Option<SeqHandle>,
    turn: u32,
    attempt: u32,
    /// The tokens of the turn the environment is answering.
    generated: Vec<TokenId>,
    /// A single-turn trajectory the engine already finished, waiting for its reward.
    sample: Option<Sample>,
    /// The turn the environment is answering was cut by a length limit: the episode ends
    /// after this call as `budget`.
    cut: bool,
    /// An observation that came while the member's group was suspended (partial rollout):
    /// it goes to the engine when the group resumes.
    held: Option<Vec<TokenId>>,
    state: MemberState,
}

#[derive(Debug)]
struct Group {
    task: usize,
    replica: usize,
    problem: Problem,
    session: String,
    /// The buffer's key of this group's trajectories.
    instance: String,
    started: Micros,
    members: Vec<Member>,
    /// Members that ended, waiting for the rest of the group.
    ended: Vec<Sample>,
    /// Aborted by over-sampling with its partial trajectories kept: nothing generates until
    /// the next batch resumes it ([`over_sampling`]).
    suspended: bool,
}

/// The orchestrator. See the module docs.
pub struct Orchestrator {
    tasks: Vec<TaskSpec>,
    policy: RolloutPolicy,
    stats: Vec<TaskStats>,
    groups: BTreeMap<u64, Group>,
    by_handle: BTreeMap<(usize, SeqHandle), MemberRef>,
    next_group: u64,
    counters: RolloutCounters,
    /// Groups ended early (a replica loss, an over-sampling abort); their environment calls
    /// still due and the engine's late answers about them are ignored.
    lost: BTreeSet<u64>,
    /// Aborted groups whose engine has not confirmed the abort yet (see [`over_sampling`]).
    discarding: BTreeMap<u64, over_sampling::Discarding>,
    /// The learner's step count (stamped on trajectories as they end).
    learner_step: u64,
}

impl fmt::Debug for Orchestrator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Orchestrator({} tasks, {} groups in flight)",
            self.tasks.len(),
            self.groups.len()
        )
    }
}

impl Orchestrator {
    /// Registers `tasks`; group numbering continues from `next_group` (a resumed stage).
    pub fn new(tasks: Vec<TaskSpec>, policy: RolloutPolicy, next_group: u64) -> OrchResult<Self> {
        if tasks.is_empty() {
            return Err(internal("no task registered"));
        }
        if policy.group_size == 0 {
            return Err(internal("group_size must be >= 1"));
        }
        for t in &tasks {
            let name = t.task.name();
            if t.concurrency < policy.group_size as u64 {
                return Err(internal(format!(
                    "task {name}: concurrency {} cannot hold one group of {}",
                    t.concurrency, policy.group_size
                )));
            }
            if !(t.target_share.is_finite() && t.target_share >= 0.0) {
                return Err(internal(format!(
                    "task {name}: target_share {} must be >= 0",
                    t.target_share
                )));
            }
            t.latency
                .validate()
                .map_err(|e| internal(format!("task {name}: latency: {e}")))?;
            t.faults
                .validate()
                .map_err(|e| internal(format!("task {name}: {e}")))?;
        }
        let n = tasks.len();
        Ok(Orchestrator {
            tasks,
            policy,
            stats: vec![TaskStats::default(); n],
            groups: BTreeMap::new(),
            by_handle: BTreeMap::new(),
            next_group,
            counters: RolloutCounters::default(),
            lost: BTreeSet::new(),
            discarding: BTreeMap::new(),
            learner_step: 0,
        })
    }

    /// The learner's step count from now on (stamped on trajectories as they end).
    pub fn set_learner_step(&mut self, steps: u64) {
        self.learner_step = steps;
    }

    pub fn tasks(&self) -> &[TaskSpec] {
        &self.tasks
    }

    pub fn task_names(&self) -> Vec<String> {
        self.tasks
            .iter()
            .map(|t| t.task.name().to_string())
            .collect()
    }

    pub fn stats(&self) -> &[TaskStats] {
        &self.stats
    }

    pub fn counters(&self) -> &RolloutCounters {
        &self.counters
    }

    pub fn counters_mut(&mut self) -> &mut RolloutCounters {
        &mut self.counters
    }

    pub fn next_group(&self) -> u64 {
        self.next_group
    }

    /// Trajectories in flight (started, not yet handed to the buffer).
    pub fn in_flight(&self) -> u64 {
        self.stats.iter().map(|s| s.in_flight).sum()
    }

    /// Groups in flight.
    pub fn groups_in_flight(&self) -> usize {
        self.groups.len()
    }

    fn start_group(
        &mut self,
        t: usize,
        now: Micros,
        route: &mut dyn FnMut(&str) -> usize,
    ) -> Action {
        let id = self.next_group;
        let name = self.tasks[t].task.name().to_string();
        // Keyed draw: group k of a task gets the same problem whatever happened before.
        let mut rng = Rng::new(mix64(hash_str(self.policy.seed, &name) ^ mix64(id)));
        let problem = self.tasks[t].task.problem(&mut rng, Split::Train);
        let session = format!("{name}/{id}");
        self.launch(t, problem, session, now, route)
    }

    /// Starts group `next_group` of task `t` on `problem` in `session`, on the replica
    /// `route` names.
    fn launch(
        &mut self,
        t: usize,
        problem: Problem,
        session: String,
        now: Micros,
        route: &mut dyn FnMut(&str) -> usize,
    ) -> Action {
        let id = self.next_group;
        self.next_group += 1;
        let spec = &self.tasks[t];
        let name = spec.task.name().to_string();
        let replica = route(&session);
        let g = self.policy.group_size;
        let instance = format!("{}#{id}", problem.id);
        let request = Request {
            session_id: session.clone(),
            instance_id: instance.clone(),
            task: name,
            group_size: g,
            prompt: problem.prompt.clone(),
            sampling: self.policy.sampling,
            stop: spec.task.stop(),
            multi_turn: spec.task.multi_turn(),
        };
        let members = (0..g)
            .map(|_| Member {
                handle: None,
                turn: 0,
                attempt: 0,
                generated: Vec::new(),
                sample: None,
                cut: false,
                held: None,
                state: MemberState::Generating,
            })
            .collect();
        self.groups.insert(
            id,
            Group {
                task: t,
                replica,
                problem,
                session,
                instance,
                started: now,
                members,
                ended: Vec::new(),
                suspended: false,
            },
        );
        let s = &mut self.stats[t];
        s.groups_started += 1;
        s.trajectories_started += g as u64;
        s.in_flight += g as u64;
        self.counters.trajectories_started += g as u64;
        Action::Engine {
            replica,
            cmd: EngineCmd::Submit { group: id, request },
        }
    }

    fn group(&self, id: u64) -> OrchResult<&Group> {
        self.groups
            .get(&id)
            .ok_or_else(|| internal(format!("no group {id}")))
    }

    fn member_mut(&mut self, m: MemberRef) -> OrchResult<&mut Member> {
        self.groups
            .get_mut(&m.group)
            .and_then(|g| g.members.get_mut(m.index as usize))
            .ok_or_else(|| internal(format!("no member {}/{}", m.group, m.index)))
    }

    /// The result of one engine command.
    pub fn on_result(
        &mut self,
        replica: usize,
        r: EngineResult,
        now: Micros,
    ) -> OrchResult<Vec<Action>> {
        let group = match &r {
            EngineResult::Submitted { group, .. } | EngineResult::Group { group, .. } => *group,
            EngineResult::Observed { member, .. } | EngineResult::Finished { member, .. } => {
                member.group
            }
        };
        if self.lost.contains(&group) {
            return self.after_early_end(replica, r);
        }
        match r {
            EngineResult::Group {
                group,
                control,
                generated,
            } => self.on_group_control(group, control, generated),
            EngineResult::Submitted { group, handles } => {
                let handles = match handles {
                    Ok(h) => h,
                    // The engine refused the task's problem (a prompt outside the vocabulary or
                    // longer than the KV pool): the environment's failure, not the run's.
                    Err(e) => return self.submit_failed(group, &e, now),
                };
                let g = self.group(group)?;
                if handles.len() != g.members.len() {
                    return Err(internal(format!(
                        "group {group}: {} handles for {} members",
                        handles.len(),
                        g.members.len()
                    )));
                }
                for (i, h) in handles.into_iter().enumerate() {
                    let m = MemberRef {
                        group,
                        index: i as u32,
                    };
                    self.member_mut(m)?.handle = Some(h);
                    self.by_handle.insert((replica, h), m);
                }
                Ok(Vec::new())
            }
            EngineResult::Observed { member, result } => match result {
                Ok(()) => Ok(Vec::new()),
                // The observation would outgrow the engine's KV pool: a length limit.
                Err(ObserveRefusal::Capacity(_)) => {
                    self.finish_in_engine(member, 0.0, TerminalReason::Budget)
                }
                // The environment's reply was unusable after all: its failure, never trained.
                Err(ObserveRefusal::Observation(_)) => {
                    *self
                        .counters
                        .env_faults
                        .entry("refused_observation".to_string())
                        .or_default() += 1;
                    self.finish_in_engine(member, 0.0, TerminalReason::Environment)
                }
                Err(ObserveRefusal::Engine(e)) => Err(internal(format!(
                    "observe failed for {}/{} on replica {replica}: {e}",
                    member.group, member.index
                ))),
            },
            EngineResult::Finished { member, result } => {
                let sample = result.map_err(|e| internal(format!("finish failed: {e}")))?;
                self.complete(member, *sample, now)
            }
        }
    }

    /// An engine event (a turn ended, or a single-turn trajectory finished).
    pub fn on_event(&mut self, replica: usize, ev: Event, now: Micros) -> OrchResult<Vec<Action>> {
        let turn = ev.into_ended_turn();
        let m = *self.by_handle.get(&(replica, turn.handle)).ok_or_else(|| {
            internal(format!(
                "event for unknown handle {} on replica {replica}",
                turn.handle.0
            ))
        })?;
        if self.lost.contains(&m.group) {
            // Generated before the group's abort reached the engine.
            return Ok(Vec::new());
        }
        // A turn cut by a length limit still goes to the environment (its verifier scores
        // what was written, and a crash there is still an `environment` end), but the episode
        // ends with it as `budget`.
        let mem = self.member_mut(m)?;
        mem.generated = turn.generated;
        mem.sample = turn.sample;
        mem.cut = turn.cut;
        Ok(vec![self.call_env(m, now)?])
    }

    /// Ends a member's episode with `reward` and `reason`.
    fn end(
        &mut self,
        m: MemberRef,
        reward: f32,
        reason: TerminalReason,
        now: Micros,
    ) -> OrchResult<Vec<Action>> {
        let single = self.member_mut(m)?.sample.is_some();
        if single {
            self.end_single(m, reward, reason, now)
        } else {
            self.finish_in_engine(m, reward, reason)
        }
    }

    fn end_single(
        &mut self,
        m: MemberRef,
        reward: f32,
        reason: TerminalReason,
        now: Micros,
    ) -> OrchResult<Vec<Action>> {
        let mem = self.member_mut(m)?;
        let mut sample = mem
            .sample
            .take()
            .ok_or_else(|| internal("single-turn member without its sample"))?;
        sample.reward = reward;
        sample.terminal_reason = reason;
        self.complete(m, sample, now)
    }

    fn finish_in_engine(
        &mut self,
        m: MemberRef,
        reward: f32,
        reason: TerminalReason,
    ) -> OrchResult<Vec<Action>> {
        let replica = self.group(m.group)?.replica;
        let mem = self.member_mut(m)?;
        mem.state = MemberState::Finishing;
        let handle = mem
            .handle
            .ok_or_else(|| internal("finish before the submit was applied"))?;
        Ok(vec![Action::Engine {
            replica,
            cmd: EngineCmd::Finish {
                member: m,
                handle,
                reward,
                reason,
            },
        }])
    }

    /// A trajectory is over: stamp it, count it, and hand its group to the buffer if it was
    /// the group's last.
    fn complete(
        &mut self,
        m: MemberRef,
        mut sample: Sample,
        now: Micros,
    ) -> OrchResult<Vec<Action>> {
        let g = self
            .groups
            .get_mut(&m.group)
            .ok_or_else(|| internal(format!("no group {}", m.group)))?;
        let t = g.task;
        let replica = g.replica;
        let started = g.started;
        let mem = g
            .members
            .get_mut(m.index as usize)
            .ok_or_else(|| internal("no such member"))?;
        mem.state = MemberState::Done;
        if let Some(h) = mem.handle {
            self.by_handle.remove(&(replica, h));
        }
        let session = g.session.clone();
        let spec = &self.tasks[t];
        sample.versions = spec.task.versions();
        sample.clocks.environment_step = self.counters.env_calls;
        sample.clocks.learner_step = self.learner_step;
        let task_name = spec.task.name().to_string();
        self.count_end(t, &sample, started, now);
        // The gateway's last word before the buffer: the ids as sampled, unless the task
        // round-trips them through text (`sluice experiment tito`).
        if let Some(c) = self.tasks[t].task.round_trip(&mut sample) {
            self.counters.round_trip.add(&c);
        }
        let span = Span {
            track: Track::Rollout { replica },
            name: format!("{session}#{}", m.index),
            start: started,
            end: now,
            args: vec![
                ("task".into(), task_name),
                ("terminal".into(), sample.terminal_reason.to_string()),
                ("reward".into(), sample.reward.to_string()),
                ("tokens".into(), sample.tokens.len().to_string()),
            ],
        };
        let mut out = vec![Action::Span(span)];
        let g = self
            .groups
            .get_mut(&m.group)
            .ok_or_else(|| internal(format!("no group {}", m.group)))?;
        g.ended.push(sample);
        if g.members
            .iter()
            .all(|x| matches!(x.state, MemberState::Done))
        {
            out.extend(self.hand_over(m.group));
        }
        Ok(out)
    }

    /// The group's trajectories to the buffer (in group-index order); the group is over.
    fn hand_over(&mut self, group: u64) -> Vec<Action> {
        let Some(mut g) = self.groups.remove(&group) else {
            return Vec::new();
        };
        g.ended.sort_by_key(|s| s.group_index);
        g.ended
            .into_iter()
            .map(|s| Action::Finished(Box::new(s)))
            .collect()
    }

    /// A trajectory that ended without an engine sample (its engine refused it or was lost):
    /// the prompt alone, ended as `environment` with reward 0.
    fn prompt_only(&self, g: &Group, index: u32) -> Sample {
        let n = g.problem.prompt.len();
        Sample {
            instance_id: g.instance.clone(),
            group_index: index,
            session_id: g.session.clone(),
            task: self.tasks[g.task].task.name().to_string(),
            prompt_len: n,
            tokens: g.problem.prompt.clone(),
            loss_mask: vec![false; n],
            behavior_logp: vec![0.0; n],
            weight_version: vec![WeightVersion(self.learner_step); n],
            reward: 0.0,
            terminal_reason: TerminalReason::Environment,
            turns: Vec::new(),
            clocks: ClockStamps {
                environment_step: self.counters.env_calls,
                learner_step: self.learner_step,
                ..ClockStamps::default()
            },
            versions: self.tasks[g.task].task.versions(),
            sampling: self.policy.sampling,
        }
    }

    /// Counts the end of one trajectory of task `t` (what [`Orchestrator::complete`] counts).
    fn count_end(&mut self, t: usize, sample: &Sample, started: Micros, now: Micros) {
        let st = &mut self.stats[t];
        st.in_flight = st.in_flight.saturating_sub(1);
        st.trajectories_finished += 1;
        st.completion_sum = st.completion_sum.plus(now.since(started));
        if sample.terminal_reason == TerminalReason::Environment {
            st.env_failures += 1;
        }
        self.counters.trajectories_finished += 1;
        self.counters.finished_generated_tokens += sample.generated_tokens() as u64;
        self.counters.started_lengths.add(sample.generated_tokens());
        *self
            .counters
            .by_terminal
            .entry(sample.terminal_reason.as_str().to_string())
            .or_default() += 1;
    }

    /// The engine refused a group's submit: every member ends as `environment`.
    fn submit_failed(&mut self, group: u64, error: &str, now: Micros) -> OrchResult<Vec<Action>> {
        let g = self.group(group)?;
        if g.problem.prompt.is_empty() {
            // Nothing can stand for these trajectories in the buffer (a trajectory needs a
            // token); a task that makes empty prompts is a bug in the task.
            return Err(internal(format!(
                "task {} made an empty prompt (group {group}); the engine refused it: {error}",
                self.tasks[g.task].task.name()
            )));
        }
        let (t, started) = (g.task, g.started);
        let samples: Vec<Sample> = (0..g.members.len() as u32)
            .map(|i| self.prompt_only(g, i))
            .collect();
        *self
            .counters
            .env_faults
            .entry("submit".to_string())
            .or_default() += 1;
        for s in &samples {
            self.count_end(t, s, started, now);
        }
        self.groups.remove(&group);
        Ok(samples
            .into_iter()
            .map(|s| Action::Finished(Box::new(s)))
            .collect())
    }

    /// What a checkpoint keeps of the orchestrator; only at a barrier (nothing in flight).
    pub fn state(&self) -> OrchResult<OrchestratorState> {
        if !self.groups.is_empty() {
            return Err(internal(format!(
                "{} groups are in flight: the orchestrator's state is saved at barriers only",
                self.groups.len()
            )));
        }
        Ok(OrchestratorState {
            next_group: self.next_group,
            stats: self.stats.clone(),
            counters: self.counters.clone(),
        })
    }

    /// Restores a saved state into an orchestrator with the same tasks and nothing in flight.
    pub fn restore(&mut self, st: OrchestratorState) -> OrchResult<()> {
        if st.stats.len() != self.tasks.len() {
            return Err(internal(format!(
                "the saved state has {} tasks, the stage {}",
                st.stats.len(),
                self.tasks.len()
            )));
        }
        if !self.groups.is_empty() {
            return Err(internal(
                "restore into an orchestrator with groups in flight",
            ));
        }
        self.next_group = st.next_group;
        self.stats = st.stats;
        self.counters = st.counters;
        Ok(())
    }

    /// Ends the stage: every trajectory still in flight is abandoned (never trained) and
    /// counted, and so are the ended trajectories of unfinished groups (they were never handed
    /// to the buffer). Returns how many were in flight.
    pub fn abandon_all(&mut self) -> u64 {
        let n = self.in_flight();
        for s in &mut self.stats {
            s.in_flight = 0;
        }
        self.groups.clear();
        self.by_handle.clear();
        self.lost.clear();
        self.discarding.clear();
        self.counters.abandoned += n;
        n
    }
}
