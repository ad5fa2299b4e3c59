//! The trajectory validator: a well-formed sample passes, and each malformed case is rejected
//! with its own typed reason.

use sluice_runtime::trajectory::*;

/// A two-turn trajectory: prompt of 3, generated 2 (v1, v1), observation of 2, generated 2 (v2, v3).
fn good() -> Sample {
    Sample {
        instance_id: "gsm8k/17".into(),
        group_index: 3,
        session_id: "s-42".into(),
        task: "math".into(),
        prompt_len: 3,
        tokens: vec![1, 2, 3, 10, 11, 20, 21, 12, 13],
        loss_mask: vec![false, false, false, true, true, false, false, true, true],
        behavior_logp: vec![0.0, 0.0, 0.0, -0.5, -1.25, 0.0, 0.0, -0.01, -3.0],
        weight_version: [0, 0, 0, 1, 1, 0, 0, 2, 3].map(WeightVersion).to_vec(),
        reward: 1.0,
        terminal_reason: TerminalReason::Success,
        turns: vec![
            TurnBoundary { start: 3 },
            TurnBoundary { start: 5 },
            TurnBoundary { start: 7 },
        ],
        clocks: ClockStamps {
            environment_step: 9,
            behavior_version: WeightVersion(3),
            learner_step: 3,
            inference_refresh: 3,
        },
        versions: ArtifactVersions {
            template: "chatml-1".into(),
            tokenizer: "byte-1".into(),
            environment: "math-0.2".into(),
        },
        sampling: SamplingParams::default(),
    }
}

#[test]
fn well_formed_sample_passes() {
    let s = good();
    assert_eq!(s.validate(), Ok(()));
    assert_eq!(s.oldest_behavior_version(), Some(WeightVersion(1)));
    assert_eq!(s.generated_tokens(), 4);
}

#[test]
fn prompt_only_sample_passes() {
    let mut s = good();
    s.tokens.truncate(3);
    s.loss_mask.truncate(3);
    s.behavior_logp.truncate(3);
    s.weight_version.truncate(3);
    s.turns.clear();
    s.terminal_reason = TerminalReason::Environment;
    assert_eq!(s.validate(), Ok(()));
    assert_eq!(s.oldest_behavior_version(), None);
}

#[test]
fn empty_rejected() {
    let mut s = good();
    s.tokens.clear();
    s.loss_mask.clear();
    s.behavior_logp.clear();
    s.weight_version.clear();
    s.prompt_len = 0;
    s.turns.clear();
    assert_eq!(s.validate(), Err(TrajectoryError::Empty));
}

#[test]
fn prompt_longer_than_tokens_rejected() {
    let mut s = good();
    s.prompt_len = 10;
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::PromptLongerThanTokens {
            prompt_len: 10,
            tokens: 9
        })
    );
}

#[test]
fn loss_mask_length_mismatch_rejected() {
    let mut s = good();
    s.loss_mask.push(true);
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::LengthMismatch {
            field: "loss_mask",
            len: 10,
            tokens: 9
        })
    );
}

#[test]
fn behavior_logp_length_mismatch_rejected() {
    let mut s = good();
    s.behavior_logp.pop();
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::LengthMismatch {
            field: "behavior_logp",
            len: 8,
            tokens: 9
        })
    );
}

#[test]
fn weight_version_length_mismatch_rejected() {
    let mut s = good();
    s.weight_version.pop();
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::LengthMismatch {
            field: "weight_version",
            len: 8,
            tokens: 9
        })
    );
}

#[test]
fn prompt_token_in_loss_rejected() {
    let mut s = good();
    s.loss_mask[1] = true;
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::PromptTokenInLoss { index: 1 })
    );
}

#[test]
fn nonzero_logp_where_masked_rejected() {
    let mut s = good();
    s.behavior_logp[5] = -0.3;
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::MaskedLogpNotZero {
            index: 5,
            value: -0.3
        })
    );
}

#[test]
fn nan_logp_where_masked_rejected() {
    let mut s = good();
    s.behavior_logp[0] = f32::NAN;
    match s.validate() {
        Err(TrajectoryError::MaskedLogpNotZero { index: 0, value }) => assert!(value.is_nan()),
        other => panic!("expected MaskedLogpNotZero at 0, got {other:?}"),
    }
}

#[test]
fn nan_logp_on_generated_token_rejected() {
    let mut s = good();
    s.behavior_logp[4] = f32::NAN;
    match s.validate() {
        Err(TrajectoryError::NonFiniteLogp { index: 4, value }) => assert!(value.is_nan()),
        other => panic!("expected NonFiniteLogp at 4, got {other:?}"),
    }
}

#[test]
fn infinite_logp_on_generated_token_rejected() {
    let mut s = good();
    s.behavior_logp[8] = f32::NEG_INFINITY;
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::NonFiniteLogp {
            index: 8,
            value: f32::NEG_INFINITY
        })
    );
}

#[test]
fn positive_logp_rejected() {
    let mut s = good();
    s.behavior_logp[3] = 0.25;
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::PositiveLogp {
            index: 3,
            value: 0.25
        })
    );
}

#[test]
fn versions_not_monotone_rejected() {
    let mut s = good();
    // Generated tokens carry v1, v1, v2, v0: the last goes back.
    s.weight_version[8] = WeightVersion(0);
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::VersionsNotMonotone {
            index: 8,
            previous: WeightVersion(2),
            got: WeightVersion(0),
        })
    );
}

#[test]
fn versions_on_masked_tokens_do_not_count() {
    let mut s = good();
    // Observation tokens (masked) may carry any version: only generated tokens are checked.
    s.weight_version[5] = WeightVersion(99);
    assert_eq!(s.validate(), Ok(()));
}

#[test]
fn turn_boundary_past_end_rejected() {
    let mut s = good();
    s.turns.push(TurnBoundary { start: 9 });
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::TurnBoundaryOutOfRange {
            turn: 3,
            start: 9,
            prompt_len: 3,
            tokens: 9
        })
    );
}

#[test]
fn turn_boundary_inside_prompt_rejected() {
    let mut s = good();
    s.turns[0] = TurnBoundary { start: 2 };
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::TurnBoundaryOutOfRange {
            turn: 0,
            start: 2,
            prompt_len: 3,
            tokens: 9
        })
    );
}

#[test]
fn turn_boundaries_not_increasing_rejected() {
    let mut s = good();
    s.turns[2] = TurnBoundary { start: 5 };
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::TurnBoundariesNotIncreasing {
            turn: 2,
            previous: 5,
            start: 5
        })
    );
}

#[test]
fn non_finite_reward_rejected() {
    let mut s = good();
    s.reward = f32::INFINITY;
    assert_eq!(
        s.validate(),
        Err(TrajectoryError::NonFiniteReward(f32::INFINITY))
    );
}

#[test]
fn terminal_reason_parses_and_round_trips() {
    for r in [
        TerminalReason::Success,
        TerminalReason::Failure,
        TerminalReason::Budget,
        TerminalReason::Environment,
    ] {
        assert_eq!(r.as_str().parse::<TerminalReason>(), Ok(r));
        assert_eq!(r.to_string(), r.as_str());
    }
}

#[test]
fn unknown_terminal_reason_rejected() {
    assert_eq!(
        "timeout".parse::<TerminalReason>(),
        Err(TrajectoryError::UnknownTerminalReason("timeout".into()))
    );
    // Spelling is exact: no case folding.
    assert_eq!(
        "Success".parse::<TerminalReason>(),
        Err(TrajectoryError::UnknownTerminalReason("Success".into()))
    );
}

#[test]
fn error_messages_name_the_problem() {
    let mut s = good();
    s.behavior_logp.pop();
    let msg = s.validate().unwrap_err().to_string();
    assert!(
        msg.contains("behavior_logp") && msg.contains('8') && msg.contains('9'),
        "{msg}"
    );
}
