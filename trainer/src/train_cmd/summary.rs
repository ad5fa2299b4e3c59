//! summary.json and the summary table `sluice train` prints at the end.

use super::*;

impl RunContext<'_> {
    /// The RL stages' run clock.
    pub(super) fn clock(&self) -> ClockMode {
        if self.cfg.run.replay {
            ClockMode::Virtual
        } else {
            ClockMode::Wall
        }
    }

    pub(super) fn summary(&self, sha: &str, wall_s: f64) -> Value {
        let t = self.state.rl_totals.as_ref();
        let none = RlTotals::default();
        let tt = t.unwrap_or(&none);
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let total_groups: u64 = t.map_or(0, |t| t.shares.values().map(|s| s.1).sum());
        let mut tasks = serde_json::Map::new();
        let names: Vec<String> = self
            .state
            .pass_before
            .keys()
            .chain(t.map(|t| t.shares.keys()).into_iter().flatten())
            .cloned()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for name in names {
            let (target, groups) = t
                .and_then(|t| t.shares.get(&name).copied())
                .unwrap_or((0.0, 0));
            let (finished, consumed, completion) = t
                .and_then(|t| t.flow.get(&name).copied())
                .unwrap_or((0, 0, 0.0));
            tasks.insert(
                name.clone(),
                json!({
                    "target_share": target,
                    "learner_share": ratio(groups, total_groups),
                    // q: the share of the task's finished trajectories the learner trained on.
                    "acceptance_rate": ratio(consumed, finished),
                    // Every trajectory of the task that finished (the rejection-sampling
                    // arm's sample budget, crate::arms).
                    "trajectories_finished": finished,
                    "mean_completion_s": if finished > 0 { completion / finished as f64 } else { 0.0 },
                    "pass_rate_before": self.state.pass_before.get(&name).map(PassRate::rate),
                    "pass_rate_after": self.pass_after.get(&name).map(PassRate::rate),
                    // Distinct held-out problems each pass rate is over (drawn without
                    // replacement).
                    "held_out_problems": self.pass_after.get(&name).or(self.state.pass_before.get(&name)).map(|r| r.problems),
                }),
            );
        }
        let elapsed = t.map_or(0.0, |t| t.elapsed_s).max(1e-9);
        // Over the whole run: token-weighted means and the max (the metrics lines' keys).
        let mut mismatch = serde_json::Map::new();
        insert_mismatch(&mut mismatch, "mismatch.lag0", &tt.mismatch_lag0);
        insert_mismatch(&mut mismatch, "mismatch.lagpos", &tt.mismatch_lagpos);
        let gated = tt.gated_low + tt.gated_high;
        for (key, n) in [
            ("is_clip_fraction", gated),
            ("is_gated_low_fraction", tt.gated_low),
            ("is_gated_high_fraction", tt.gated_high),
            (
                "is_accepted_fraction",
                tt.masked_tokens.saturating_sub(gated),
            ),
        ] {
            mismatch.insert(key.into(), json!(ratio(n, tt.masked_tokens)));
        }
        let mut s = json!({
            // Every rate per second below is per second of this clock.
            "clock": self.clock().as_str(),
            "final_weights_sha256": sha,
            "learner_steps": self.state.learner_steps,
            // RL optimizer steps: learner steps x optim.minibatches x optim.epochs.
            "optimizer_steps": t.map_or(0, |t| t.optimizer_steps),
            // Trained tokens (repeats included) on the clipped branch of the ppo/icepop surrogate.
            "ppo_clipped_fraction": t.map_or(0.0, |t| ratio(t.clipped, t.masked_tokens)),
            "samples_trained": t.map_or(0, |t| t.samples),
            // Mean softmax entropy of the trained tokens (nats), and with a KL reference the
            // mean per-token KL estimate (loss.kl_estimator) of the behavior policy to it.
            "entropy_mean": t.map_or(0.0, |t| mean_of(t.entropy_sum, t.entropy_tokens)),
            "kl_ref_mean": t.map_or(0.0, |t| mean_of(t.kl_sum, t.kl_tokens)),
            // With OPD's teachers: the mean over the tokens they scored of behavior logp -
            // teacher logp (k1 estimate of KL(mu || teacher)), and how many they scored.
            "opd_reverse_kl_mean": t.map_or(0.0, |t| mean_of(t.opd_gap_sum, t.opd_tokens)),
            "opd_scored_tokens": t.map_or(0, |t| t.opd_tokens),
            "wall_s": wall_s,
            "rl_time_s": t.map_or(0.0, |t| t.elapsed_s),
            "effective_tokens_per_s": t.map_or(0.0, |t| t.accepted_tokens as f64 / elapsed),
            "gradient_tokens_per_s": t.map_or(0.0, |t| t.gradient_tokens as f64 / elapsed),
            "raw_tokens_per_s": t.map_or(0.0, |t| t.sampled_tokens as f64 / elapsed),
            "token_accept_rate": t.map_or(0.0, |t| ratio(t.accepted_tokens, t.finished_generated)),
            "stale_drop_rate": t.map_or(0.0, |t| ratio(t.stale, t.buffer_in)),
            "env_drop_rate": t.map_or(0.0, |t| ratio(t.env, t.buffer_in)),
            // Environment-ended trajectories trained as failures (buffer.env_gate = false).
            "env_trained_rate": t.map_or(0.0, |t| ratio(t.env_trained, t.buffer_in)),
            // Groups whose rewards were all equal (no GRPO signal): dropped by dynamic
            // sampling (buffer.dynamic_sampling), and trained.
            "zero_signal_groups_dropped": t.map_or(0, |t| t.zero_signal_dropped),
            "zero_signal_groups_trained": t.map_or(0, |t| t.zero_signal_trained),
            // Over-sampling with abort (rollout.over_sampling): aborted, resumed and discarded
            // groups and tokens, and the length bias of what was trained.
            "over_sampling": tt.aborts.summary(),
            // RL's environment calls, the failed ones by kind, and trajectories by how they
            // ended.
            "env_calls": tt.env_calls,
            "env_faults": tt.env_faults,
            "trajectories_by_terminal": tt.by_terminal,
            // With a BPE: the text tasks' model turns, those a decode-then-encode round trip
            // changes, those trained re-encoded (rollout.retokenize), and their tokens.
            "round_trip": tt.round_trip,
            "group_dup_rate": t.map_or(0.0, |t| ratio(t.dup, t.released)),
            "zero_lag_tokens": t.map_or(0, |t| t.zero_lag),
            "zero_lag_mismatch_tokens": t.map_or(0, |t| t.zero_lag_mismatch),
            "engine_busy": t.map_or(0.0, |t| t.engine_busy_s / elapsed / self.cfg.rollout.replicas as f64),
            "learner_busy": t.map_or(0.0, |t| t.learner_busy_s / elapsed),
            "stage_seconds": self.state.stage_times.iter().map(|(n, s)| (n.clone(), json!(s))).collect::<serde_json::Map<_, _>>(),
            "tasks": tasks,
        });
        if let Some(m) = s.as_object_mut() {
            m.extend(mismatch);
            // The gates' bias by episode length: per task and number of model turns.
            let by_turns: serde_json::Map<String, Value> = tt
                .by_turns
                .iter()
                .map(|(task, m)| {
                    let per: serde_json::Map<String, Value> = m
                        .iter()
                        .map(|(turns, &(n, stale, env))| {
                            (
                                turns.to_string(),
                                json!({
                                    "trajectories_in": n,
                                    "stale_drop_rate": ratio(stale, n),
                                    "env_drop_rate": ratio(env, n),
                                }),
                            )
                        })
                        .collect();
                    (task.clone(), Value::Object(per))
                })
                .collect();
            m.insert("trajectories_by_turns".into(), Value::Object(by_turns));
        }
        s
    }

    pub(super) fn summary_table(&self, s: &Value) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let pct = |v: &Value| {
            v.as_f64()
                .map_or("-".to_string(), |x| format!("{:.1}%", 100.0 * x))
        };
        let _ = writeln!(
            t,
            "\n| task | pass rate before RL | after RL | target share | learner share | \
             trajectories trained | mean completion |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|---|---|");
        if let Some(tasks) = s["tasks"].as_object() {
            for (name, v) in tasks {
                let _ = writeln!(
                    t,
                    "| {name} | {} | {} | {} | {} | {} | {:.2}s |",
                    pct(&v["pass_rate_before"]),
                    pct(&v["pass_rate_after"]),
                    pct(&v["target_share"]),
                    pct(&v["learner_share"]),
                    pct(&v["acceptance_rate"]),
                    v["mean_completion_s"].as_f64().unwrap_or(0.0)
                );
            }
        }
        let _ = writeln!(
            t,
            "\n| accepted tokens | stale drops | env drops | group repeats | effective tok/s | gradient tok/s | raw tok/s | zero-lag mismatch |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} of {} |",
            pct(&s["token_accept_rate"]),
            pct(&s["stale_drop_rate"]),
            pct(&s["env_drop_rate"]),
            pct(&s["group_dup_rate"]),
            s["effective_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["gradient_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["raw_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["zero_lag_mismatch_tokens"],
            s["zero_lag_tokens"],
        );
        let _ = write!(
            t,
            "{}",
            match s["clock"].as_str() {
                Some("virtual") => {
                    "tok/s: per second of the virtual clock (run.replay = true), not of wall time\n"
                }
                _ => "tok/s: per second of the wall clock\n",
            }
        );
        t.push_str(&crate::arms::table(&s["arms"]));
        let _ = write!(t, "\ntime per stage:");
        for (n, secs) in &self.state.stage_times {
            let _ = write!(t, "  {n} {secs:.1}s");
        }
        let _ = write!(
            t,
            "\nrun folder: {} (metrics.jsonl, summary.json, trace.json, final.safetensors)",
            self.out_dir.display()
        );
        t
    }
}

/// `sum / n`, 0 with no tokens.
fn mean_of(sum: f64, n: u64) -> f64 {
    if n > 0 {
        sum / n as f64
    } else {
        0.0
    }
}
