//! A session's environment calls: planned with their latency and fate from a key
//! ([`crate::env::faults::plan_call`]), sent early to environments outside the process
//! ([`crate::env::Task::prefetch`]), and answered when due: an observation, the end, a retry,
//! or an `environment` end.

use super::*;

impl Orchestrator {
    /// Plans the next attempt of the member's environment call.
    pub(super) fn call_env(&mut self, m: MemberRef, now: Micros) -> OrchResult<Action> {
        let g = self.group(m.group)?;
        let spec = &self.tasks[g.task];
        let mem = &g.members[m.index as usize];
        let key = format!("{}#{}", g.session, m.index);
        let plan = plan_call(
            self.policy.seed,
            CallKey {
                session: &key,
                turn: mem.turn,
                attempt: mem.attempt,
            },
            &spec.latency,
            &spec.faults,
            spec.timeout.0 as f64 / 1000.0,
        );
        if plan.fault.is_none() {
            // The call will be made: an external environment starts it now.
            spec.task.prefetch(
                CallKey {
                    session: &key,
                    turn: mem.turn,
                    attempt: mem.attempt,
                },
                &g.problem,
                &mem.generated,
            );
        }
        let call = EnvCall {
            member: m,
            turn: mem.turn,
            attempt: mem.attempt,
        };
        self.member_mut(m)?.state = MemberState::InEnv { since: now };
        self.counters.env_calls += 1;
        Ok(Action::EnvTimer {
            at: now.plus(Micros::from_ms(plan.delay_ms)),
            call,
        })
    }

    /// An environment call came due: its reply, a retry, or the end of the trajectory.
    pub fn on_env(&mut self, call: EnvCall, now: Micros) -> OrchResult<Vec<Action>> {
        if self.lost.contains(&call.member.group) {
            // Its group ended with a lost replica; the reply has no trajectory to go to.
            return Ok(Vec::new());
        }
        let g = self.group(call.member.group)?;
        let mem = &g.members[call.member.index as usize];
        let MemberState::InEnv { since } = mem.state else {
            return Err(internal(format!(
                "environment reply for {:?}, which is not waiting on one",
                call.member
            )));
        };
        if mem.turn != call.turn || mem.attempt != call.attempt {
            return Err(internal(format!("stale environment call {call:?}")));
        }
        let spec = &self.tasks[g.task];
        let key = format!("{}#{}", g.session, call.member.index);
        let ckey = CallKey {
            session: &key,
            turn: call.turn,
            attempt: call.attempt,
        };
        let plan = plan_call(
            self.policy.seed,
            ckey,
            &spec.latency,
            &spec.faults,
            spec.timeout.0 as f64 / 1000.0,
        );
        let task_name = spec.task.name().to_string();
        let mut actions = vec![Action::Span(Span {
            track: Track::Env {
                task: task_name.clone(),
            },
            name: format!("{task_name} turn {}", call.turn),
            start: since,
            end: now,
            args: vec![
                ("session".into(), key.clone()),
                ("attempt".into(), call.attempt.to_string()),
                (
                    "outcome".into(),
                    plan.fault.map_or("ok", CallFault::as_str).to_string(),
                ),
            ],
        })];
        let reply = match plan.fault {
            Some(CallFault::Garbage) => Ok(Reply::Observe(garbage_tokens(
                self.policy.seed,
                ckey,
                self.policy.vocab,
            ))),
            Some(fault) => Err(fault.as_str()),
            None => spec
                .task
                .call(ckey, &g.problem, &mem.generated)
                .map_err(|e| e.kind()),
        };
        let multi = spec.task.multi_turn();
        // A reply the run cannot use is a failed call.
        let unusable = match &reply {
            Ok(Reply::Observe(obs)) => {
                !multi
                    || obs.is_empty()
                    || obs.len() > self.policy.max_observation_tokens
                    || obs.iter().any(|&t| t as usize >= self.policy.vocab)
            }
            Ok(Reply::End { reward, .. }) => !reward.is_finite(),
            Err(_) => false,
        };
        let reply = if unusable {
            Err(if plan.fault == Some(CallFault::Garbage) {
                "garbage"
            } else {
                "malformed"
            })
        } else {
            reply
        };
        let retries = spec.retries;
        match reply {
            Err(kind) => {
                *self
                    .counters
                    .env_faults
                    .entry(kind.to_string())
                    .or_default() += 1;
                // Faults of the environment process are retried; a task's own error or a
                // malformed reply would repeat, so it is not.
                let transient = matches!(kind, "crash" | "timeout" | "garbage");
                if transient && call.attempt < retries {
                    self.counters.env_retries += 1;
                    self.member_mut(call.member)?.attempt += 1;
                    actions.push(self.call_env(call.member, now)?);
                } else {
                    actions.extend(self.end(call.member, 0.0, TerminalReason::Environment, now)?);
                }
            }
            Ok(Reply::End { reward, reason }) => {
                let cut = self.member_mut(call.member)?.cut;
                let reason = if cut { TerminalReason::Budget } else { reason };
                actions.extend(self.end(call.member, reward, reason, now)?);
            }
            Ok(Reply::Observe(tokens)) => {
                let max_turns = self.policy.max_turns;
                let max_new = self.policy.sampling.max_new_tokens;
                let suspended = self.group(call.member.group)?.suspended;
                let mem = self.member_mut(call.member)?;
                if mem.cut || mem.turn + 1 >= max_turns {
                    actions.extend(self.end(call.member, 0.0, TerminalReason::Budget, now)?);
                } else {
                    mem.turn += 1;
                    mem.attempt = 0;
                    mem.state = MemberState::Generating;
                    if suspended {
                        // Partial rollout: the group generates again when it resumes.
                        mem.held = Some(tokens);
                        return Ok(actions);
                    }
                    let handle = mem
                        .handle
                        .ok_or_else(|| internal("observe before the submit was applied"))?;
                    let replica = self.group(call.member.group)?.replica;
                    actions.push(Action::Engine {
                        replica,
                        cmd: EngineCmd::Observe {
                            member: call.member,
                            handle,
                            tokens,
                            max_new_tokens: max_new,
                        },
                    });
                }
            }
        }
        Ok(actions)
    }
}
