//! The messages between the orchestrator and the rest of the system: commands for an engine
//! replica and their results, environment calls, and the actions the orchestrator asks for.

use crate::clock::Micros;
use crate::engine::{EngineError, Request, SeqHandle};
use crate::metrics::Span;
use crate::trajectory::{Sample, TerminalReason, TokenId};

/// A member of a group: (group id, group index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemberRef {
    pub group: u64,
    pub index: u32,
}

/// A command for an engine replica.
#[derive(Debug)]
pub enum EngineCmd {
    Submit {
        group: u64,
        request: Request,
    },
    Observe {
        member: MemberRef,
        handle: SeqHandle,
        tokens: Vec<TokenId>,
        max_new_tokens: u32,
    },
    Finish {
        member: MemberRef,
        handle: SeqHandle,
        reward: f32,
        reason: TerminalReason,
    },
    /// Over-sampling: stop a whole group's generation (see [`GroupControl`]), named by its
    /// instance id so members whose handles are still on their way back are reached too.
    Group {
        group: u64,
        instance: String,
        control: GroupControl,
    },
}

/// What an [`EngineCmd::Group`] does to the group's trajectories in the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupControl {
    /// End them all without a sample (discarded).
    Abort,
    /// Stop the generating ones, keeping their tokens (partial rollout).
    Suspend,
    /// Queue the suspended ones again.
    Resume,
}

/// The result of an [`EngineCmd`], in command order.
#[derive(Debug)]
pub enum EngineResult {
    Submitted {
        group: u64,
        handles: Result<Vec<SeqHandle>, String>,
    },
    Observed {
        member: MemberRef,
        result: Result<(), ObserveRefusal>,
    },
    Finished {
        member: MemberRef,
        result: Result<Box<Sample>, String>,
    },
    /// The generated tokens of each trajectory the control reached.
    Group {
        group: u64,
        control: GroupControl,
        generated: Result<Vec<usize>, String>,
    },
}

/// Why the engine refused an observation, and so how the trajectory ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObserveRefusal {
    /// The trajectory would outgrow the engine's KV pool: a length limit, so a `budget` end.
    Capacity(String),
    /// The observation itself is unusable (empty, ids outside the model's vocabulary): the
    /// environment's failure, an `environment` end (never trained as a policy failure).
    Observation(String),
    /// Anything else (an unknown handle, a trajectory still generating, a kernel error) is a
    /// bug or a device failure: the run stops.
    Engine(String),
}

impl From<EngineError> for ObserveRefusal {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Capacity(_) => ObserveRefusal::Capacity(e.to_string()),
            EngineError::Observation(_) => ObserveRefusal::Observation(e.to_string()),
            e => ObserveRefusal::Engine(e.to_string()),
        }
    }
}

/// An environment call that comes due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvCall {
    pub member: MemberRef,
    pub turn: u32,
    pub attempt: u32,
}

/// What the orchestrator asks of the rest of the system.
#[derive(Debug)]
pub enum Action {
    Engine {
        replica: usize,
        cmd: EngineCmd,
    },
    /// Call `on_env(call)` at `at`.
    EnvTimer {
        at: Micros,
        call: EnvCall,
    },
    /// A finished trajectory for the data buffer.
    Finished(Box<Sample>),
    Span(Span),
}
