//! A lost engine replica: its groups end whole as `environment` failures and start again
//! on another replica (see the module docs of [`super`]).

use super::*;

impl Orchestrator {
    /// Engine replica `replica` is gone (it stopped answering or died). Every group it was
    /// running ends: its trajectories, finished or not, go to the buffer as `environment`
    /// failures with reward 0 (never trained), and the group's session starts again, as a new
    /// group of the same problem, on the replica `route` now gives it (the caller has removed
    /// the lost one from the router). Returns the actions and what was lost.
    pub fn on_replica_lost(
        &mut self,
        replica: usize,
        now: Micros,
        route: &mut dyn FnMut(&str) -> usize,
    ) -> OrchResult<(Vec<Action>, LostSessions)> {
        let ids: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| g.replica == replica)
            .map(|(&id, _)| id)
            .collect();
        self.by_handle.retain(|(r, _), _| *r != replica);
        let mut actions = Vec::new();
        let mut lost = LostSessions::default();
        for id in ids {
            let Some(mut g) = self.groups.remove(&id) else {
                continue;
            };
            self.lost.insert(id);
            let t = g.task;
            let mut samples = std::mem::take(&mut g.ended);
            // Trajectories that had ended: counted already; relabelled.
            for s in &mut samples {
                self.relabel_lost(t, s);
            }
            let members = std::mem::take(&mut g.members);
            for (i, mem) in members.into_iter().enumerate() {
                if matches!(mem.state, MemberState::Done) {
                    continue;
                }
                let sample = match mem.sample {
                    // Single-turn: generated, waiting for its reward.
                    Some(mut s) => {
                        s.reward = 0.0;
                        s.terminal_reason = TerminalReason::Environment;
                        s.versions = self.tasks[t].task.versions();
                        s.clocks.environment_step = self.counters.env_calls;
                        s.clocks.learner_step = self.learner_step;
                        s
                    }
                    // Its tokens lived in the lost engine.
                    None => self.prompt_only(&g, i as u32),
                };
                self.count_end(t, &sample, g.started, now);
                samples.push(sample);
            }
            samples.sort_by_key(|s| s.group_index);
            lost.trajectories += samples.len() as u64;
            for s in &samples {
                lost.members.push((s.instance_id.clone(), s.group_index));
            }
            actions.push(Action::Span(Span {
                track: Track::Rollout { replica },
                name: format!("{} lost", g.session),
                start: g.started,
                end: now,
                args: vec![
                    ("task".into(), self.tasks[t].task.name().to_string()),
                    ("terminal".into(), "environment".into()),
                    ("cause".into(), format!("replica {replica} lost")),
                ],
            }));
            actions.extend(samples.into_iter().map(|s| Action::Finished(Box::new(s))));
            // The session continues elsewhere: the same problem, a new group (counted as
            // started like any other).
            self.counters.sessions_restarted += 1;
            lost.sessions.push(g.session.clone());
            actions.push(self.launch(t, g.problem, g.session, now, route));
        }
        self.counters.trajectories_lost += lost.trajectories;
        Ok((actions, lost))
    }

    /// A trajectory that had ended before its group was lost becomes an `environment` end.
    fn relabel_lost(&mut self, t: usize, s: &mut Sample) {
        if s.terminal_reason != TerminalReason::Environment {
            if let Some(c) = self
                .counters
                .by_terminal
                .get_mut(s.terminal_reason.as_str())
            {
                *c = c.saturating_sub(1);
            }
            *self
                .counters
                .by_terminal
                .entry(TerminalReason::Environment.as_str().to_string())
                .or_default() += 1;
            self.stats[t].env_failures += 1;
        }
        s.reward = 0.0;
        s.terminal_reason = TerminalReason::Environment;
    }
}
