//! `sluice experiment tito`'s arms and figures: token-in-token-out against the text round trip
//! of crate::tasks::round_trip (`rollout.retokenize`), read from each arm's summary.json
//! (`round_trip`, the zero-lag audit, the IS gate, the pass rates) and metrics lines (the
//! importance ratio's range).

use super::defs::{arm, num, sets, task_num, Arm};
use super::ArmRun;

/// Token-in-token-out, and the text round trip (crate::tasks::round_trip).
pub(super) fn tito_arms() -> Vec<Arm> {
    vec![
        arm("tito", &[]),
        arm("roundtrip", &sets(&[("rollout.retokenize", "true".into())])),
    ]
}

/// A share of summary.json's `round_trip` counts (None without model turns counted: a run
/// on the character tokenizer).
fn round_trip_share(r: &ArmRun, part: &str, whole: &str) -> Option<f64> {
    let rt = &r.summary["round_trip"];
    let w = num(rt, whole)?;
    (w > 0.0).then(|| num(rt, part).map(|p| p / w))?
}
pub(super) fn round_trip_changed(r: &ArmRun) -> Option<f64> {
    round_trip_share(r, "turns_changed", "turns")
}
pub(super) fn round_trip_trained(r: &ArmRun) -> Option<f64> {
    round_trip_share(r, "turns_retokenized", "turns")
}
pub(super) fn round_trip_tokens(r: &ArmRun) -> Option<f64> {
    round_trip_share(r, "tokens_trained", "tokens_sampled")
}
pub(super) fn zero_lag_tokens(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "zero_lag_tokens")
}
pub(super) fn zero_lag_mismatch(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "zero_lag_mismatch_tokens")
}
pub(super) fn zero_lag_mismatch_share(r: &ArmRun) -> Option<f64> {
    let n = zero_lag_tokens(r)?;
    (n > 0.0).then(|| zero_lag_mismatch(r).map(|m| m / n))?
}
pub(super) fn lag0_abs_diff(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "mismatch.lag0.abs_diff_mean")
}
/// The widest importance ratio minus the narrowest over the stage's trained tokens.
pub(super) fn ratio_spread(r: &ArmRun) -> Option<f64> {
    let hi = r
        .lines
        .iter()
        .filter_map(|l| num(l, "ratio_max"))
        .reduce(f64::max)?;
    let lo = r
        .lines
        .iter()
        .filter_map(|l| num(l, "ratio_min"))
        .reduce(f64::min)?;
    Some(hi - lo)
}
pub(super) fn sort_pass_after(r: &ArmRun) -> Option<f64> {
    task_num(r, "sort", "pass_rate_after")
}
pub(super) fn tool_pass_after(r: &ArmRun) -> Option<f64> {
    task_num(r, "tool", "pass_rate_after")
}
