//! Over-sampling with abort (APRIL, Zhou et al. 2025; slime's over-sampling batch), sync mode:
//! a batch starts more groups than a step needs; when the step has its groups, every group
//! still in flight is aborted whole, either discarded (its trajectories never trained) or
//! suspended with its partial trajectories (tokens, behavior log-probs, per-token versions)
//! and resumed first in the next batch, under the weights published in between (partial
//! rollout). A resumed trajectory mixes versions; the staleness gate judges its oldest token,
//! as for any trajectory.
//!
//! The engine is told by instance id ([`EngineCmd::Group`]), so the command reaches members
//! whose handles are still on their way back. Commands to a replica apply in order, so once
//! the engine answers an abort nothing more can come from that group; until then, late
//! answers (a submit's handles, a turn that ended, a finished sample) are ignored, except that
//! a late finished sample's length is counted.
//!
//! Counted ([`crate::metrics::RolloutCounters`]): groups aborted and resumed, the generated
//! tokens the aborts stopped, kept and threw away, and the generated length of every
//! trajectory started (at its end or discard) against every trajectory trained.

use super::*;

/// An aborted group whose engine has not confirmed the abort yet.
#[derive(Debug)]
pub(super) struct Discarding {
    /// Members the engine may still hold (neither ended nor waiting in the orchestrator for
    /// their reward): each one it does not report had generated nothing.
    expected: usize,
    /// Suspended before: its stopped tokens were counted as aborted then.
    was_suspended: bool,
}

impl Orchestrator {
    /// Groups suspended with their partial trajectories, waiting for the next batch.
    pub fn suspended_groups(&self) -> usize {
        self.groups.values().filter(|g| g.suspended).count()
    }

    /// The ids of the groups in flight that are (or are not) suspended, oldest first.
    fn group_ids(&self, suspended: bool) -> Vec<u64> {
        self.groups
            .iter()
            .filter(|(_, g)| g.suspended == suspended)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The step has its groups: every group still in flight is aborted whole, suspended
    /// (`keep_partial`) or discarded. Returns the engine commands.
    pub fn abort_in_flight(&mut self, keep_partial: bool) -> Vec<Action> {
        let ids = self.group_ids(false);
        self.counters.groups_aborted += ids.len() as u64;
        ids.into_iter()
            .filter_map(|id| {
                if keep_partial {
                    self.suspend(id)
                } else {
                    self.discard(id)
                }
            })
            .collect()
    }

    /// Resumes every suspended group, oldest first: the next batch's first groups. Returns
    /// the engine commands and how many groups resumed.
    pub fn resume_suspended(&mut self) -> OrchResult<(Vec<Action>, usize)> {
        let ids = self.group_ids(true);
        let max_new = self.policy.sampling.max_new_tokens;
        let mut actions = Vec::new();
        for &id in &ids {
            let g = self
                .groups
                .get_mut(&id)
                .ok_or_else(|| internal(format!("no group {id}")))?;
            g.suspended = false;
            actions.push(Action::Engine {
                replica: g.replica,
                cmd: EngineCmd::Group {
                    group: id,
                    instance: g.instance.clone(),
                    control: GroupControl::Resume,
                },
            });
            // Observations that came during the suspension, after the resume (the engine
            // takes them in command order).
            for (i, mem) in g.members.iter_mut().enumerate() {
                if let Some(tokens) = mem.held.take() {
                    let handle = mem
                        .handle
                        .ok_or_else(|| internal("an observation held before the submit"))?;
                    actions.push(Action::Engine {
                        replica: g.replica,
                        cmd: EngineCmd::Observe {
                            member: MemberRef {
                                group: id,
                                index: i as u32,
                            },
                            handle,
                            tokens,
                            max_new_tokens: max_new,
                        },
                    });
                }
            }
        }
        self.counters.groups_resumed += ids.len() as u64;
        Ok((actions, ids.len()))
    }

    /// Discards every suspended group (a checkpoint barrier holds nothing in flight). Returns
    /// the engine commands.
    pub fn discard_suspended(&mut self) -> Vec<Action> {
        let ids = self.group_ids(true);
        ids.into_iter().filter_map(|id| self.discard(id)).collect()
    }

    fn suspend(&mut self, id: u64) -> Option<Action> {
        let g = self.groups.get_mut(&id)?;
        g.suspended = true;
        Some(Action::Engine {
            replica: g.replica,
            cmd: EngineCmd::Group {
                group: id,
                instance: g.instance.clone(),
                control: GroupControl::Suspend,
            },
        })
    }

    /// Ends group `id` without training any of it: its members that had not ended are
    /// counted discarded, its environment calls still due are ignored from now on.
    fn discard(&mut self, id: u64) -> Option<Action> {
        let g = self.groups.remove(&id)?;
        self.lost.insert(id);
        let mut expected = 0;
        let mut open = 0;
        for mem in g.members.iter() {
            if matches!(mem.state, MemberState::Done) {
                continue;
            }
            open += 1;
            match &mem.sample {
                // A single-turn trajectory the engine already finished: it is not there.
                Some(s) => {
                    let n = s.generated_tokens();
                    self.counters.started_lengths.add(n);
                    self.counters.discarded_tokens += n as u64;
                    if !g.suspended {
                        self.counters.aborted_tokens += n as u64;
                    }
                }
                None => expected += 1,
            }
        }
        let st = &mut self.stats[g.task];
        st.in_flight = st.in_flight.saturating_sub(open);
        self.counters.trajectories_discarded += open;
        self.discarding.insert(
            id,
            Discarding {
                expected,
                was_suspended: g.suspended,
            },
        );
        Some(Action::Engine {
            replica: g.replica,
            cmd: EngineCmd::Group {
                group: id,
                instance: g.instance,
                control: GroupControl::Abort,
            },
        })
    }

    /// The engine's answer to a suspend or a resume.
    pub(super) fn on_group_control(
        &mut self,
        group: u64,
        control: GroupControl,
        generated: Result<Vec<usize>, String>,
    ) -> OrchResult<Vec<Action>> {
        let generated =
            generated.map_err(|e| internal(format!("{control:?} of group {group} failed: {e}")))?;
        let tokens: u64 = generated.iter().map(|&n| n as u64).sum();
        match control {
            GroupControl::Suspend => self.counters.aborted_tokens += tokens,
            GroupControl::Resume => self.counters.resumed_tokens += tokens,
            GroupControl::Abort => {
                return Err(internal(format!(
                    "the engine aborted group {group}, which is still running"
                )))
            }
        }
        Ok(Vec::new())
    }

    /// An engine answer about a group that ended early (a replica loss or a discard).
    pub(super) fn after_early_end(
        &mut self,
        replica: usize,
        r: EngineResult,
    ) -> OrchResult<Vec<Action>> {
        match r {
            // Handles of a submit the abort overtook: known, so their events are ignored.
            EngineResult::Submitted {
                group,
                handles: Ok(handles),
            } => {
                for (i, h) in handles.into_iter().enumerate() {
                    let m = MemberRef {
                        group,
                        index: i as u32,
                    };
                    self.by_handle.insert((replica, h), m);
                }
            }
            // Finished just before the abort: gone from the engine, so counted here.
            EngineResult::Finished {
                member,
                result: Ok(sample),
            } => {
                if let Some(d) = self.discarding.get_mut(&member.group) {
                    d.expected = d.expected.saturating_sub(1);
                    let n = sample.generated_tokens();
                    self.counters.started_lengths.add(n);
                    self.counters.discarded_tokens += n as u64;
                    if !d.was_suspended {
                        self.counters.aborted_tokens += n as u64;
                    }
                }
            }
            EngineResult::Group {
                group,
                control: GroupControl::Abort,
                generated,
            } => {
                let generated = generated
                    .map_err(|e| internal(format!("abort of group {group} failed: {e}")))?;
                let d = self
                    .discarding
                    .remove(&group)
                    .ok_or_else(|| internal(format!("an abort of group {group} not asked for")))?;
                for &n in &generated {
                    self.counters.started_lengths.add(n);
                    self.counters.discarded_tokens += n as u64;
                    if !d.was_suspended {
                        self.counters.aborted_tokens += n as u64;
                    }
                }
                // Members never forked or never generated.
                for _ in generated.len()..d.expected {
                    self.counters.started_lengths.add(0);
                }
                // Nothing more can come from this group's handles.
                self.by_handle.retain(|_, m| m.group != group);
            }
            _ => {}
        }
        Ok(Vec::new())
    }
}
