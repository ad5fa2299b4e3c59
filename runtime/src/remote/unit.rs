//! One unit of replica work on an engine, shared by the in-process lane
//! (`system::lanes::replica_run`) and `sluice serve`'s `/lane/step`, so both compute the same
//! ids, log-probs and versions from the same commands.

use crate::engine::{Engine, Event};
use crate::orchestrator::{EngineCmd, EngineResult, GroupControl, ObserveRefusal};

/// Applies `cmds` in order; one result per command (a refusal is the command's result, not an
/// error of the unit).
pub fn apply_commands(engine: &mut Engine, cmds: Vec<EngineCmd>) -> Vec<EngineResult> {
    let mut results = Vec::with_capacity(cmds.len());
    for cmd in cmds {
        results.push(match cmd {
            EngineCmd::Submit { group, request } => EngineResult::Submitted {
                group,
                handles: engine.submit(request).map_err(|e| e.to_string()),
            },
            EngineCmd::Observe {
                member,
                handle,
                tokens,
                max_new_tokens,
            } => EngineResult::Observed {
                member,
                result: engine
                    .observe(handle, &tokens, max_new_tokens)
                    .map_err(ObserveRefusal::from),
            },
            EngineCmd::Finish {
                member,
                handle,
                reward,
                reason,
            } => EngineResult::Finished {
                member,
                result: engine
                    .finish(handle, reward, reason)
                    .map(Box::new)
                    .map_err(|e| e.to_string()),
            },
            EngineCmd::Group {
                group,
                instance,
                control,
            } => EngineResult::Group {
                group,
                control,
                generated: match control {
                    GroupControl::Abort => engine.abort_group(&instance),
                    GroupControl::Suspend => engine.suspend_group(&instance),
                    GroupControl::Resume => engine.resume_group(&instance),
                }
                .map_err(|e| e.to_string()),
            },
        });
    }
    results
}

/// What one engine step did.
#[derive(Debug, Default)]
pub struct Stepped {
    pub events: Vec<Event>,
    pub stepped: bool,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub sampled_tokens: u64,
    /// Work is left after the step.
    pub has_work: bool,
    pub error: Option<String>,
}

/// One engine step if the engine has work.
pub fn step_once(engine: &mut Engine) -> Stepped {
    let before = engine.stats();
    let mut out = Stepped::default();
    if engine.has_work() {
        match engine.step() {
            Ok(ev) => {
                out.events = ev;
                out.stepped = true;
            }
            Err(e) => out.error = Some(e.to_string()),
        }
    }
    let after = engine.stats();
    out.prefill_tokens = after.prefill_tokens - before.prefill_tokens;
    out.decode_tokens = after.decode_tokens - before.decode_tokens;
    out.sampled_tokens = after.sampled_tokens - before.sampled_tokens;
    out.has_work = engine.has_work();
    out
}
