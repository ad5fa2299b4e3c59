//! The JSON of `POST /lane/step`: the commands of one unit of replica work, and its results
//! and events, as mirrors of [`EngineCmd`], [`EngineResult`] and [`Event`]. Log-probs and every
//! other f32 travel as bit patterns, so both ends hold the same bits.

use crate::engine::{Event, Request, SeqHandle, StopConfig, StopReason};
use crate::orchestrator::{EngineCmd, EngineResult, GroupControl, MemberRef, ObserveRefusal};
use crate::trajectory::{Sample, SamplingParams, TerminalReason, TokenId};
use serde::{Deserialize, Serialize};

/// The body of `POST /lane/step`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    /// The server's instance id from `/lane/join`: a server that restarted since has another
    /// and answers 409 (its sequences are gone).
    pub instance: String,
    pub cmds: Vec<WireCmd>,
}

/// The answer of `POST /lane/step`: what `replica_run` reports for one unit of work.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepAnswer {
    pub instance: String,
    /// The version the engine runs on and the blake3 of its image.
    pub version: u64,
    pub blake3: String,
    pub results: Vec<WireResult>,
    pub events: Vec<WireEvent>,
    pub stepped: bool,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub sampled_tokens: u64,
    pub has_work: bool,
    /// The engine step failed (a kernel error): the run stops.
    pub error: Option<String>,
}

/// The answer of `POST /lane/join`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinAnswer {
    pub instance: String,
    pub version: u64,
    pub blake3: String,
    /// Sequences of an earlier driver that the join ended.
    pub aborted: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireMember {
    pub group: u64,
    pub index: u32,
}

impl From<MemberRef> for WireMember {
    fn from(m: MemberRef) -> Self {
        WireMember {
            group: m.group,
            index: m.index,
        }
    }
}

impl From<WireMember> for MemberRef {
    fn from(m: WireMember) -> Self {
        MemberRef {
            group: m.group,
            index: m.index,
        }
    }
}

/// [`SamplingParams`] with its floats as bits.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireSampling {
    #[serde(with = "crate::trajectory::f32_bit")]
    pub temperature: f32,
    pub top_k: u32,
    #[serde(with = "crate::trajectory::f32_bit")]
    pub top_p: f32,
    pub max_new_tokens: u32,
    pub seed: u64,
}

impl From<SamplingParams> for WireSampling {
    fn from(s: SamplingParams) -> Self {
        WireSampling {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            max_new_tokens: s.max_new_tokens,
            seed: s.seed,
        }
    }
}

impl From<WireSampling> for SamplingParams {
    fn from(s: WireSampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            max_new_tokens: s.max_new_tokens,
            seed: s.seed,
        }
    }
}

/// An engine [`Request`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireRequest {
    pub session_id: String,
    pub instance_id: String,
    pub task: String,
    pub group_size: u32,
    pub prompt: Vec<TokenId>,
    pub sampling: WireSampling,
    pub eos: Option<TokenId>,
    pub stop_sequences: Vec<Vec<TokenId>>,
    pub multi_turn: bool,
}

impl From<Request> for WireRequest {
    fn from(r: Request) -> Self {
        WireRequest {
            session_id: r.session_id,
            instance_id: r.instance_id,
            task: r.task,
            group_size: r.group_size,
            prompt: r.prompt,
            sampling: r.sampling.into(),
            eos: r.stop.eos,
            stop_sequences: r.stop.stop_sequences,
            multi_turn: r.multi_turn,
        }
    }
}

impl From<WireRequest> for Request {
    fn from(r: WireRequest) -> Self {
        Request {
            session_id: r.session_id,
            instance_id: r.instance_id,
            task: r.task,
            group_size: r.group_size,
            prompt: r.prompt,
            sampling: r.sampling.into(),
            stop: StopConfig {
                eos: r.eos,
                stop_sequences: r.stop_sequences,
            },
            multi_turn: r.multi_turn,
        }
    }
}

/// An [`EngineCmd`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum WireCmd {
    Submit {
        group: u64,
        request: WireRequest,
    },
    Observe {
        member: WireMember,
        handle: u64,
        tokens: Vec<TokenId>,
        max_new_tokens: u32,
    },
    Finish {
        member: WireMember,
        handle: u64,
        #[serde(with = "crate::trajectory::f32_bit")]
        reward: f32,
        reason: TerminalReason,
    },
    Group {
        group: u64,
        instance: String,
        control: GroupControl,
    },
}

impl From<EngineCmd> for WireCmd {
    fn from(c: EngineCmd) -> Self {
        match c {
            EngineCmd::Submit { group, request } => WireCmd::Submit {
                group,
                request: request.into(),
            },
            EngineCmd::Observe {
                member,
                handle,
                tokens,
                max_new_tokens,
            } => WireCmd::Observe {
                member: member.into(),
                handle: handle.0,
                tokens,
                max_new_tokens,
            },
            EngineCmd::Finish {
                member,
                handle,
                reward,
                reason,
            } => WireCmd::Finish {
                member: member.into(),
                handle: handle.0,
                reward,
                reason,
            },
            EngineCmd::Group {
                group,
                instance,
                control,
            } => WireCmd::Group {
                group,
                instance,
                control,
            },
        }
    }
}

impl From<WireCmd> for EngineCmd {
    fn from(c: WireCmd) -> Self {
        match c {
            WireCmd::Submit { group, request } => EngineCmd::Submit {
                group,
                request: request.into(),
            },
            WireCmd::Observe {
                member,
                handle,
                tokens,
                max_new_tokens,
            } => EngineCmd::Observe {
                member: member.into(),
                handle: SeqHandle(handle),
                tokens,
                max_new_tokens,
            },
            WireCmd::Finish {
                member,
                handle,
                reward,
                reason,
            } => EngineCmd::Finish {
                member: member.into(),
                handle: SeqHandle(handle),
                reward,
                reason,
            },
            WireCmd::Group {
                group,
                instance,
                control,
            } => EngineCmd::Group {
                group,
                instance,
                control,
            },
        }
    }
}

/// An [`ObserveRefusal`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WireRefusal {
    Capacity(String),
    Observation(String),
    Engine(String),
}

/// An [`EngineResult`], in command order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WireResult {
    Submitted {
        group: u64,
        handles: Result<Vec<u64>, String>,
    },
    Observed {
        member: WireMember,
        result: Result<(), WireRefusal>,
    },
    Finished {
        member: WireMember,
        result: Result<Box<Sample>, String>,
    },
    Group {
        group: u64,
        control: GroupControl,
        generated: Result<Vec<usize>, String>,
    },
}

impl From<EngineResult> for WireResult {
    fn from(r: EngineResult) -> Self {
        match r {
            EngineResult::Submitted { group, handles } => WireResult::Submitted {
                group,
                handles: handles.map(|h| h.into_iter().map(|h| h.0).collect()),
            },
            EngineResult::Observed { member, result } => WireResult::Observed {
                member: member.into(),
                result: result.map_err(|e| match e {
                    ObserveRefusal::Capacity(m) => WireRefusal::Capacity(m),
                    ObserveRefusal::Observation(m) => WireRefusal::Observation(m),
                    ObserveRefusal::Engine(m) => WireRefusal::Engine(m),
                }),
            },
            EngineResult::Finished { member, result } => WireResult::Finished {
                member: member.into(),
                result,
            },
            EngineResult::Group {
                group,
                control,
                generated,
            } => WireResult::Group {
                group,
                control,
                generated,
            },
        }
    }
}

impl From<WireResult> for EngineResult {
    fn from(r: WireResult) -> Self {
        match r {
            WireResult::Submitted { group, handles } => EngineResult::Submitted {
                group,
                handles: handles.map(|h| h.into_iter().map(SeqHandle).collect()),
            },
            WireResult::Observed { member, result } => EngineResult::Observed {
                member: member.into(),
                result: result.map_err(|e| match e {
                    WireRefusal::Capacity(m) => ObserveRefusal::Capacity(m),
                    WireRefusal::Observation(m) => ObserveRefusal::Observation(m),
                    WireRefusal::Engine(m) => ObserveRefusal::Engine(m),
                }),
            },
            WireResult::Finished { member, result } => EngineResult::Finished {
                member: member.into(),
                result,
            },
            WireResult::Group {
                group,
                control,
                generated,
            } => EngineResult::Group {
                group,
                control,
                generated,
            },
        }
    }
}

/// A [`StopReason`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireStop {
    Eos,
    StopSequence,
    MaxNewTokens,
    Capacity,
}

impl From<StopReason> for WireStop {
    fn from(s: StopReason) -> Self {
        match s {
            StopReason::Eos => WireStop::Eos,
            StopReason::StopSequence => WireStop::StopSequence,
            StopReason::MaxNewTokens => WireStop::MaxNewTokens,
            StopReason::Capacity => WireStop::Capacity,
        }
    }
}

impl From<WireStop> for StopReason {
    fn from(s: WireStop) -> Self {
        match s {
            WireStop::Eos => StopReason::Eos,
            WireStop::StopSequence => StopReason::StopSequence,
            WireStop::MaxNewTokens => StopReason::MaxNewTokens,
            WireStop::Capacity => StopReason::Capacity,
        }
    }
}

/// An engine [`Event`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case", deny_unknown_fields)]
pub enum WireEvent {
    TurnEnded {
        handle: u64,
        session_id: String,
        group_index: u32,
        reason: WireStop,
        generated: Vec<TokenId>,
    },
    Finished {
        handle: u64,
        reason: WireStop,
        sample: Box<Sample>,
    },
}

impl From<Event> for WireEvent {
    fn from(e: Event) -> Self {
        match e {
            Event::TurnEnded {
                handle,
                session_id,
                group_index,
                reason,
                generated,
            } => WireEvent::TurnEnded {
                handle: handle.0,
                session_id,
                group_index,
                reason: reason.into(),
                generated,
            },
            Event::Finished {
                handle,
                reason,
                sample,
            } => WireEvent::Finished {
                handle: handle.0,
                reason: reason.into(),
                sample,
            },
        }
    }
}

impl From<WireEvent> for Event {
    fn from(e: WireEvent) -> Self {
        match e {
            WireEvent::TurnEnded {
                handle,
                session_id,
                group_index,
                reason,
                generated,
            } => Event::TurnEnded {
                handle: SeqHandle(handle),
                session_id,
                group_index,
                reason: reason.into(),
                generated,
            },
            WireEvent::Finished {
                handle,
                reason,
                sample,
            } => Event::Finished {
                handle: SeqHandle(handle),
                reason: reason.into(),
                sample,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trajectory::{ArtifactVersions, ClockStamps, TurnBoundary, WeightVersion};

    fn sample() -> Sample {
        Sample {
            instance_id: "p".into(),
            group_index: 1,
            session_id: "s".into(),
            task: "t".into(),
            prompt_len: 1,
            tokens: vec![3, 4],
            loss_mask: vec![false, true],
            // A log-prob whose shortest decimal would not be needed with bits.
            behavior_logp: vec![0.0, f32::from_bits(0xbf9d_70a4)],
            weight_version: vec![WeightVersion(2), WeightVersion(3)],
            reward: 0.1,
            terminal_reason: TerminalReason::Success,
            turns: vec![TurnBoundary { start: 1 }],
            clocks: ClockStamps::default(),
            versions: ArtifactVersions::default(),
            sampling: SamplingParams::default(),
        }
    }

    #[test]
    fn commands_results_and_events_survive_json_bit_for_bit() {
        let cmd = WireCmd::Finish {
            member: WireMember { group: 7, index: 2 },
            handle: 9,
            reward: f32::from_bits(0x3dcc_cccd),
            reason: TerminalReason::Budget,
        };
        let back: WireCmd = serde_json::from_str(&serde_json::to_string(&cmd).unwrap()).unwrap();
        assert_eq!(back, cmd);
        let res = WireResult::Finished {
            member: WireMember { group: 7, index: 2 },
            result: Ok(Box::new(sample())),
        };
        let back: WireResult = serde_json::from_str(&serde_json::to_string(&res).unwrap()).unwrap();
        assert_eq!(back, res);
        let ev = WireEvent::TurnEnded {
            handle: 1,
            session_id: "s".into(),
            group_index: 0,
            reason: WireStop::StopSequence,
            generated: vec![5, 6],
        };
        let back: WireEvent = serde_json::from_str(&serde_json::to_string(&ev).unwrap()).unwrap();
        assert_eq!(back, ev);
        let WireEvent::TurnEnded { reason, .. } = back else {
            panic!("kind")
        };
        assert_eq!(StopReason::from(reason), StopReason::StopSequence);
        // Over-sampling's group controls.
        let cmd = WireCmd::Group {
            group: 3,
            instance: "sort/3#3".into(),
            control: GroupControl::Suspend,
        };
        let text = serde_json::to_string(&cmd).unwrap();
        assert!(text.contains("\"control\":\"suspend\""), "{text}");
        let back: WireCmd = serde_json::from_str(&text).unwrap();
        assert_eq!(back, cmd);
        let res = WireResult::Group {
            group: 3,
            control: GroupControl::Abort,
            generated: Ok(vec![4, 0, 7]),
        };
        let back: WireResult = serde_json::from_str(&serde_json::to_string(&res).unwrap()).unwrap();
        assert_eq!(back, res);
    }

    #[test]
    fn unknown_fields_and_commands_are_refused() {
        let bad = r#"{"instance":"x","cmds":[{"cmd":"explode"}]}"#;
        assert!(serde_json::from_str::<StepRequest>(bad).is_err());
        let extra = r#"{"instance":"x","cmds":[],"more":1}"#;
        assert!(serde_json::from_str::<StepRequest>(extra).is_err());
    }
}
