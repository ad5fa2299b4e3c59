//! The experiments of `sluice experiment`: arms (config overrides), the figures each reports
//! and the chart it draws.

use super::tito::{
    lag0_abs_diff, ratio_spread, round_trip_changed, round_trip_tokens, round_trip_trained,
    sort_pass_after, tito_arms, tool_pass_after, zero_lag_mismatch, zero_lag_mismatch_share,
    zero_lag_tokens,
};
use super::ArmRun;
use serde_json::Value;

/// One arm: a name and its `--set` overrides of the experiment's RL config.
#[derive(Clone, Debug, PartialEq)]
pub struct Arm {
    pub name: String,
    pub sets: Vec<String>,
}

pub(super) fn arm(name: impl Into<String>, sets: &[String]) -> Arm {
    Arm {
        name: name.into(),
        sets: sets.to_vec(),
    }
}

/// A figure of one arm's run (None: the run has no such value).
pub type Metric = fn(&ArmRun) -> Option<f64>;

/// What the chart draws.
#[derive(Clone, Copy)]
pub enum ChartKind {
    /// Bars of column `n` per arm (the mean over seeds).
    Bars(usize),
    /// A line per arm over the RL steps (seed 0's run), with a label for the y axis.
    Steps(fn(&Value) -> Option<f64>, &'static str),
}

pub struct Experiment {
    pub name: &'static str,
    /// What it shows, for the report and `--help`.
    pub about: &'static str,
    /// Overrides for every arm (after `run.replay=true`, before the user's `--set`).
    pub base_sets: &'static [&'static str],
    pub arms: fn() -> Vec<Arm>,
    /// (label, metric) columns of the report's table.
    pub columns: &'static [(&'static str, Metric)],
    pub chart: ChartKind,
    /// Set when the experiment cannot run yet: why (the report says so and nothing runs).
    pub unavailable: Option<&'static str>,
}

pub(super) fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

pub(super) fn task_num(r: &ArmRun, task: &str, key: &str) -> Option<f64> {
    r.summary["tasks"][task].get(key).and_then(Value::as_f64)
}

/// The mean over the RL lines of a per-line value.
fn line_mean(r: &ArmRun, f: impl Fn(&Value) -> Option<f64>) -> Option<f64> {
    let v: Vec<f64> = r.lines.iter().filter_map(f).collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The mean reward of the trained groups over the stage, over every task (each line's
/// `reward_mean.TASK`, weighted equally).
fn reward(r: &ArmRun) -> Option<f64> {
    line_mean(r, |l| {
        let v: Vec<f64> = l
            .as_object()?
            .iter()
            .filter(|(k, _)| k.starts_with("reward_mean.") && !k.contains("window"))
            .filter_map(|(_, v)| v.as_f64())
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    })
}

/// The mean policy lag of the trained tokens (from every line's lag histogram).
fn mean_lag(r: &ArmRun) -> Option<f64> {
    let (mut n, mut sum) = (0u64, 0u64);
    for l in &r.lines {
        if let Some(h) = l["policy_lag_hist"].as_array() {
            for (lag, c) in h.iter().enumerate() {
                let c = c.as_u64().unwrap_or(0);
                n += c;
                sum += c * lag as u64;
            }
        }
    }
    (n > 0).then(|| sum as f64 / n as f64)
}

fn eff(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "effective_tokens_per_s")
}
fn grad(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "gradient_tokens_per_s")
}
fn stale(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "stale_drop_rate")
}
fn env_drop(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "env_drop_rate")
}
/// Trajectories that passed both trajectory gates.
fn traj_accept(r: &ArmRun) -> Option<f64> {
    Some(1.0 - stale(r)? - env_drop(r)?)
}
fn token_accept(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "token_accept_rate")
}
fn is_accept(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "is_accepted_fraction")
}
fn is_clip(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "is_clip_fraction")
}
fn zero_lag_share(r: &ArmRun) -> Option<f64> {
    let z = num(&r.summary, "mismatch.lag0.tokens")?;
    let p = num(&r.summary, "mismatch.lagpos.tokens")?;
    (z + p > 0.0).then(|| z / (z + p))
}
fn lagged_tokens(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "mismatch.lagpos.tokens")
}
fn engine_busy(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "engine_busy")
}
fn learner_busy(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "learner_busy")
}
fn over_sampling(r: &ArmRun, key: &str) -> Option<f64> {
    num(&r.summary["over_sampling"], key)
}
fn groups_aborted(r: &ArmRun) -> Option<f64> {
    over_sampling(r, "groups_aborted")
}
fn discarded_tokens(r: &ArmRun) -> Option<f64> {
    over_sampling(r, "discarded_tokens")
}
fn resumed_tokens(r: &ArmRun) -> Option<f64> {
    over_sampling(r, "resumed_tokens")
}
fn length_bias(r: &ArmRun) -> Option<f64> {
    over_sampling(r, "length_bias")
}
fn rl_time(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "rl_time_s")
}
fn tool_share(r: &ArmRun) -> Option<f64> {
    task_num(r, "tool", "learner_share")
}
fn tool_target(r: &ArmRun) -> Option<f64> {
    task_num(r, "tool", "target_share")
}
/// How far the learner's tool share ended from its target (absolute).
fn share_gap(r: &ArmRun) -> Option<f64> {
    Some((tool_share(r)? - tool_target(r)?).abs())
}
/// The mean over steps of |learner share of tool in the step - target|.
fn share_gap_over_time(r: &ArmRun) -> Option<f64> {
    let target = tool_target(r)?;
    line_mean(r, |l| Some((num(l, "learner_share.tool")? - target).abs()))
}
fn tool_accept(r: &ArmRun) -> Option<f64> {
    task_num(r, "tool", "acceptance_rate")
}
fn sort_accept(r: &ArmRun) -> Option<f64> {
    task_num(r, "sort", "acceptance_rate")
}
/// The stale-drop rate of tool episodes with `turns` model turns (1: answered directly; 2: one
/// call; 3+: more), over the trajectories that reached the buffer.
fn tool_stale_by_turns(r: &ArmRun, lo: u32, hi: u32) -> Option<f64> {
    let m = r.summary["trajectories_by_turns"]["tool"].as_object()?;
    let (mut n, mut stale) = (0.0, 0.0);
    for (k, v) in m {
        let t: u32 = k.parse().ok()?;
        if (lo..=hi).contains(&t) {
            let i = v["trajectories_in"].as_f64()?;
            n += i;
            stale += i * v["stale_drop_rate"].as_f64()?;
        }
    }
    (n > 0.0).then(|| stale / n)
}
fn tool_stale_1(r: &ArmRun) -> Option<f64> {
    tool_stale_by_turns(r, 1, 1)
}
fn tool_stale_2(r: &ArmRun) -> Option<f64> {
    tool_stale_by_turns(r, 2, 2)
}
fn tool_stale_3(r: &ArmRun) -> Option<f64> {
    tool_stale_by_turns(r, 3, u32::MAX)
}

fn env_trained(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "env_trained_rate")
}

fn zero_signal_trained(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "zero_signal_groups_trained")
}

fn zero_signal_dropped(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "zero_signal_groups_dropped")
}

fn ppo_clipped(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "ppo_clipped_fraction")
}

fn optimizer_steps(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "optimizer_steps")
}

pub(super) fn sets(pairs: &[(&str, String)]) -> Vec<String> {
    pairs.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

fn refresh_arms() -> Vec<Arm> {
    let mut v = vec![arm("sync", &sets(&[("run.mode", "\"sync\"".into())]))];
    for k in [1, 2, 4, 8] {
        v.push(arm(
            format!("async-k{k}"),
            &sets(&[
                ("run.mode", "\"async\"".into()),
                ("sync.interval", k.to_string()),
            ]),
        ));
    }
    v
}

fn tau_arms() -> Vec<Arm> {
    [0, 1, 2, 4, 8]
        .iter()
        .map(|t| arm(format!("tau-{t}"), &sets(&[("buffer.tau", t.to_string())])))
        .collect()
}

fn clip_arms() -> Vec<Arm> {
    [(0.02, 0.02), (0.05, 0.05), (0.2, 0.28), (0.5, 0.5)]
        .iter()
        .map(|(lo, hi)| {
            arm(
                format!("eps-{lo}-{hi}"),
                &sets(&[
                    ("loss.eps_low", format!("{lo}")),
                    ("loss.eps_high", format!("{hi}")),
                ]),
            )
        })
        .collect()
}

fn crash_arms() -> Vec<Arm> {
    let mut v = Vec::new();
    for c in [0.0, 0.1, 0.3] {
        for gate in [true, false] {
            let faults = format!("{{ crash = {c}, timeout = 0.0, garbage = 0.0 }}");
            v.push(arm(
                format!(
                    "crash-{}-{}",
                    (c * 100.0) as u32,
                    if gate { "gate" } else { "no-gate" }
                ),
                &sets(&[
                    ("tasks.sort.faults", faults.clone()),
                    ("tasks.tool.faults", faults),
                    ("buffer.env_gate", gate.to_string()),
                ]),
            ));
        }
    }
    v
}

fn share_arms() -> Vec<Arm> {
    [true, false]
        .iter()
        .map(|on| {
            arm(
                if *on { "correction" } else { "no-correction" },
                &sets(&[("rollout.share_correction", on.to_string())]),
            )
        })
        .collect()
}

fn minibatch_arms() -> Vec<Arm> {
    [(1, 1), (2, 1), (4, 1), (2, 2)]
        .iter()
        .map(|(m, e)| {
            arm(
                format!("mb{m}-ep{e}"),
                &sets(&[
                    ("optim.minibatches", m.to_string()),
                    ("optim.epochs", e.to_string()),
                ]),
            )
        })
        .collect()
}

fn decoupled_arms() -> Vec<Arm> {
    [false, true]
        .iter()
        .map(|on| {
            arm(
                if *on { "decoupled" } else { "coupled" },
                &sets(&[("loss.decoupled", on.to_string())]),
            )
        })
        .collect()
}

fn objective_arms() -> Vec<Arm> {
    vec![
        arm("token-two-bounds", &[]),
        arm(
            "four-bounds",
            &sets(&[
                ("loss.four_bounds", "true".into()),
                ("loss.eps_low_neg", "0.02".into()),
                ("loss.eps_high_neg", "0.02".into()),
            ]),
        ),
        arm(
            "prompt-mean",
            &sets(&[("loss.aggregation", "\"prompt\"".into())]),
        ),
    ]
}

fn dynamic_sampling_arms() -> Vec<Arm> {
    [false, true]
        .iter()
        .map(|on| {
            arm(
                if *on { "on" } else { "off" },
                &sets(&[("buffer.dynamic_sampling", on.to_string())]),
            )
        })
        .collect()
}

/// Sync mode without over-sampling, and with 1.5 groups started per group trained, aborts
/// discarded or resumed (partial rollout).
fn over_sampling_arms() -> Vec<Arm> {
    let sync = ("run.mode", "\"sync\"".to_string());
    let over = ("rollout.over_sampling", "1.5".to_string());
    vec![
        arm("off", &sets(std::slice::from_ref(&sync))),
        arm("discard", &sets(&[sync.clone(), over.clone()])),
        arm(
            "partial",
            &sets(&[sync, over, ("rollout.partial_rollout", "true".into())]),
        ),
    ]
}

/// The regularizers' arms: every arm keeps the reference and logs the KL to it
/// (`loss.kl_log` in the experiment's base sets).
fn regularizer_arms() -> Vec<Arm> {
    vec![
        arm("off", &[]),
        arm("entropy", &sets(&[("loss.entropy_coef", "1.0".into())])),
        arm(
            "kl-loss",
            &sets(&[
                ("loss.kl_coef", "3.0".into()),
                ("loss.kl_in", "\"loss\"".into()),
            ]),
        ),
        arm(
            "kl-reward",
            &sets(&[
                ("loss.kl_coef", "10.0".into()),
                ("loss.kl_in", "\"reward\"".into()),
            ]),
        ),
    ]
}

fn entropy(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "entropy_mean")
}

fn kl_ref(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "kl_ref_mean")
}

fn is_arms() -> Vec<Arm> {
    let mut v = Vec::new();
    for mode in ["dis", "icepop", "ppo", "pg"] {
        for eta in [0, 1, 2, 4, 8] {
            v.push(arm(
                format!("{mode}-eta{eta}"),
                &sets(&[
                    ("loss.mode", format!("\"{mode}\"")),
                    ("buffer.eta", eta.to_string()),
                ]),
            ));
        }
    }
    v
}

/// Environment latency of both tasks: none, or lognormal with this median and p99 = 40
/// medians.
fn latency(median_ms: Option<f64>) -> String {
    match median_ms {
        None => "{ dist = \"none\" }".into(),
        Some(m) => format!(
            "{{ dist = \"lognormal\", median_ms = {m:.1}, p99_ms = {:.1} }}",
            40.0 * m
        ),
    }
}

fn speedup_arms() -> Vec<Arm> {
    let mut v = Vec::new();
    for timeout in [1.0, 5.0] {
        for median in [None, Some(5.0), Some(50.0), Some(200.0)] {
            // syncos: sync with over-sampling (2 groups started per group trained, the rest
            // discarded when the step has its groups).
            for mode in ["sync", "syncos", "async"] {
                let lat = latency(median);
                let mut s = vec![
                    (
                        "run.mode",
                        format!("\"{}\"", if mode == "async" { "async" } else { "sync" }),
                    ),
                    ("tasks.sort.latency", lat.clone()),
                    ("tasks.tool.latency", lat),
                    ("tasks.sort.timeout_s", format!("{timeout:.1}")),
                    ("tasks.tool.timeout_s", format!("{timeout:.1}")),
                ];
                if mode == "syncos" {
                    s.push(("rollout.over_sampling", "2.0".into()));
                }
                v.push(arm(
                    format!(
                        "{mode}-lat{}-to{timeout}",
                        median.map_or("none".to_string(), |m| format!("{m}"))
                    ),
                    &sets(&s),
                ));
            }
        }
    }
    // Compute overlap on this machine's wall clock: no latency, no faults, the lanes sharing
    // every core (`wall`) or pinned to one core each (`wallpinned`, run.pin_lanes).
    let none = latency(None);
    let no_faults = "{ crash = 0.0, timeout = 0.0, garbage = 0.0 }".to_string();
    for pinned in [false, true] {
        for mode in ["sync", "async"] {
            let mut s = vec![
                ("run.mode", format!("\"{mode}\"")),
                ("run.replay", "false".into()),
                ("tasks.sort.latency", none.clone()),
                ("tasks.tool.latency", none.clone()),
                ("tasks.sort.faults", no_faults.clone()),
                ("tasks.tool.faults", no_faults.clone()),
            ];
            if pinned {
                s.push(("run.pin_lanes", "true".into()));
            }
            let clock = if pinned { "wallpinned" } else { "wall" };
            v.push(arm(format!("{mode}-{clock}-nofault"), &sets(&s)));
        }
    }
    v
}

/// Every experiment, in the order of DESIGN's reproduction checklist.
pub static EXPERIMENTS: &[Experiment] = &[
    Experiment {
        name: "refresh",
        about: "sync against async with the weights published every K in {1, 2, 4, 8} learner \
                steps: throughput against staleness (tau 8 in every arm: K may be at most tau + \
                1, or the version gate drops every sample before the next publication)",
        base_sets: &["buffer.tau=8"],
        arms: refresh_arms,
        columns: &[
            ("effective tok/s", eff),
            ("gradient tok/s", grad),
            ("mean lag", mean_lag),
            ("zero-lag share", zero_lag_share),
            ("stale drops", stale),
            ("token accept", token_accept),
            ("reward", reward),
        ],
        chart: ChartKind::Bars(0),
        unavailable: None,
    },
    Experiment {
        name: "tau",
        about: "the version gate tau in {0, 1, 2, 4, 8}: how many trajectories it drops, and \
                the reward and accept rates that leaves",
        base_sets: &[],
        arms: tau_arms,
        columns: &[
            ("stale drops", stale),
            ("trajectory accept", traj_accept),
            ("token accept", token_accept),
            ("IS accepted", is_accept),
            ("reward", reward),
            ("effective tok/s", eff),
        ],
        chart: ChartKind::Bars(0),
        unavailable: None,
    },
    Experiment {
        name: "clip",
        about: "the IS gate's bounds (eps_low, eps_high) from tight to loose, with the weights \
                published every 4 steps so that tokens are off-policy: the share of tokens the \
                gate rejects, and the reward",
        base_sets: &["sync.interval=4"],
        arms: clip_arms,
        columns: &[
            ("IS gated", is_clip),
            ("IS accepted", is_accept),
            ("trajectory accept", traj_accept),
            ("token accept", token_accept),
            ("reward", reward),
        ],
        chart: ChartKind::Bars(0),
        unavailable: None,
    },
    Experiment {
        name: "crashes",
        about: "environment crashes at 0, 10 and 30% of calls, with the environment gate (drop \
                environment-ended trajectories) and without it (train them as failures, \
                reward 0): the damage is in the reward and the trained share of crashed \
                episodes",
        base_sets: &["tasks.sort.retries=0", "tasks.tool.retries=0"],
        arms: crash_arms,
        columns: &[
            ("env-ended trained", env_trained),
            ("env drops", env_drop),
            ("trajectory accept", traj_accept),
            ("reward", reward),
            ("effective tok/s", eff),
        ],
        chart: ChartKind::Bars(3),
        unavailable: None,
    },
    Experiment {
        name: "share",
        about: "a short task (sort) and a long one (tool, 400 ms median environment calls with \
                a heavy tail) mixed 50/50: the learner's tool share against its target over \
                the steps, with and without share correction",
        base_sets: &[
            "tasks.tool.latency={ dist = \"lognormal\", median_ms = 400.0, p99_ms = 8000.0 }",
            "tasks.sort.latency={ dist = \"fixed\", median_ms = 5.0 }",
        ],
        arms: share_arms,
        columns: &[
            ("tool share", tool_share),
            ("target", tool_target),
            ("|share - target| at the end", share_gap),
            ("mean |share - target| per step", share_gap_over_time),
            ("tool accept", tool_accept),
            ("sort accept", sort_accept),
            ("stale drops", stale),
        ],
        chart: ChartKind::Steps(|l| num(l, "learner_share.tool"), "learner share of tool"),
        unavailable: None,
    },
    Experiment {
        name: "is-modes",
        about: "the IS-gate modes (dis, icepop, ppo, pg) at eta in {0, 1, 2, 4, 8} steps of \
                rollout ahead of the learner: the off-policy tokens each admits and its reward",
        base_sets: &[],
        arms: is_arms,
        columns: &[
            ("lagged tokens", lagged_tokens),
            ("IS accepted", is_accept),
            ("IS gated", is_clip),
            ("reward", reward),
            ("effective tok/s", eff),
        ],
        chart: ChartKind::Bars(3),
        unavailable: None,
    },
    Experiment {
        name: "minibatches",
        about: "a learner step's groups as 1, 2 or 4 optimizer steps (minibatches), and 2 \
                passes (epochs): later minibatches train on weights past the rollout's, so \
                fewer tokens are zero-lag and the IS gate sees larger ratios",
        base_sets: &[],
        arms: minibatch_arms,
        columns: &[
            ("optimizer steps", optimizer_steps),
            ("zero-lag share", zero_lag_share),
            ("IS gated", is_clip),
            ("reward", reward),
            ("RL time (s)", rl_time),
        ],
        chart: ChartKind::Bars(3),
        unavailable: None,
    },
    Experiment {
        name: "decoupled-ppo",
        about: "PPO with 4 minibatches per learner step, the clip on pi_theta / mu (coupled) \
                against AReaL's decoupled form (the clip on pi_theta / pi_prox, the weights at \
                the step's start, and pi_prox / mu as a stop-gradient weight)",
        base_sets: &["loss.mode=\"ppo\"", "optim.minibatches=4"],
        arms: decoupled_arms,
        columns: &[
            ("PPO clipped", ppo_clipped),
            ("optimizer steps", optimizer_steps),
            ("reward", reward),
            ("RL time (s)", rl_time),
        ],
        chart: ChartKind::Bars(2),
        unavailable: None,
    },
    Experiment {
        name: "objectives",
        about: "the loss's token mean with one pair of clip bounds (the default), four bounds \
                (tokens with a negative advantage gated at 1 -/+ 0.02, positive ones at the \
                default 0.2 / 0.28), and the prompt mean (each group's token mean, then the \
                mean over groups)",
        base_sets: &[],
        arms: objective_arms,
        columns: &[
            ("IS gated", is_clip),
            ("reward", reward),
            ("gradient tok/s", grad),
            ("RL time (s)", rl_time),
        ],
        chart: ChartKind::Bars(1),
        unavailable: None,
    },
    Experiment {
        name: "dynamic-sampling",
        about: "DAPO's dynamic sampling off and on: groups whose rewards are all equal (no \
                GRPO signal) trained or dropped and re-sampled, and what the re-sampling costs \
                in RL time for the reward and gradient-carrying tokens it buys",
        base_sets: &[],
        arms: dynamic_sampling_arms,
        columns: &[
            ("zero-signal groups trained", zero_signal_trained),
            ("zero-signal groups dropped", zero_signal_dropped),
            ("reward", reward),
            ("gradient tok/s", grad),
            ("RL time (s)", rl_time),
        ],
        chart: ChartKind::Bars(2),
        unavailable: None,
    },
    Experiment {
        name: "over-sampling",
        about: "sync mode as is, and over-sampled (APRIL: 1.5 groups started per group \
                trained; when a step has its groups the rest are aborted, discarded or kept and \
                resumed in the next batch): RL time at equal samples, what the aborts cost in \
                tokens, and the length bias of what is trained (trained / started mean length)",
        base_sets: &[],
        arms: over_sampling_arms,
        columns: &[
            ("RL time (s)", rl_time),
            ("effective tok/s", eff),
            ("groups aborted", groups_aborted),
            ("discarded tokens", discarded_tokens),
            ("resumed tokens", resumed_tokens),
            ("length bias", length_bias),
            ("reward", reward),
        ],
        chart: ChartKind::Bars(0),
        unavailable: None,
    },
    Experiment {
        name: "regularizers",
        about: "the entropy bonus (coefficient 1) and the k3 KL to the stage's initial weights \
                in the loss (coefficient 3) or in the reward (coefficient 10), against \
                neither: the mean entropy of the trained tokens and their mean KL to the \
                reference (large coefficients, so a short run shows their direction)",
        base_sets: &["loss.kl_log=true"],
        arms: regularizer_arms,
        columns: &[
            ("entropy", entropy),
            ("KL to reference", kl_ref),
            ("reward", reward),
            ("RL time (s)", rl_time),
        ],
        chart: ChartKind::Bars(1),
        unavailable: None,
    },
    Experiment {
        name: "tito",
        about: "token-in-token-out (the learner trains the ids the engine sampled) against a \
                text round trip (rollout.retokenize: each model turn decoded and encoded \
                again, the learner trained on the re-encoded ids with the sampled log-prob \
                mass spread over them), on a BPE that merges digit pairs and triples \
                (configs/tokenizer/tasks-bpe-digits3.json, 512 ids; configs/bpe.toml's \
                digit-per-token one with --set tokenizer.path=...), in sync mode so that \
                every trained token is zero-lag and any learner-behavior mismatch is the round \
                trip's: the turns it changes, the zero-lag mismatch, the IS gate's drops, the \
                reward and the held-out pass rates after the stage",
        base_sets: &[
            "tokenizer.kind=\"bpe\"",
            "tokenizer.path=\"configs/tokenizer/tasks-bpe-digits3.json\"",
            "run.mode=\"sync\"",
        ],
        arms: tito_arms,
        columns: &[
            ("turns a round trip changes", round_trip_changed),
            ("turns trained re-encoded", round_trip_trained),
            ("trained / sampled tokens", round_trip_tokens),
            ("zero-lag tokens", zero_lag_tokens),
            ("zero-lag mismatch", zero_lag_mismatch),
            ("zero-lag mismatch share", zero_lag_mismatch_share),
            ("lag-0 mean |logp diff|", lag0_abs_diff),
            ("IS ratio max - min", ratio_spread),
            ("IS gated", is_clip),
            ("reward", reward),
            ("sort pass after", sort_pass_after),
            ("tool pass after", tool_pass_after),
        ],
        chart: ChartKind::Bars(5),
        unavailable: None,
    },
    Experiment {
        name: "async-speedup",
        about: "sync, sync with over-sampling (2 groups started per group trained, the rest \
                discarded) and async at an equal sample budget across environment latency (none; \
                lognormal median 5, 50 and 200 ms with p99 = 40 medians) and call timeout (1 s, \
                5 s), and on the wall clock without latency or faults, the lanes sharing the \
                cores or pinned to one each (run.pin_lanes): effective and gradient-carrying tokens/s, engine and learner busy \
                shares, stale drops and accept rates per task, and the tool task's stale drops \
                per number of model turns (the gate's bias against slow, many-call episodes)",
        base_sets: &[],
        arms: speedup_arms,
        columns: &[
            ("effective tok/s", eff),
            ("gradient tok/s", grad),
            ("RL time (s)", rl_time),
            ("engine busy", engine_busy),
            ("learner busy", learner_busy),
            ("stale drops", stale),
            ("sort accept", sort_accept),
            ("tool accept", tool_accept),
            ("tool stale, 1 turn (direct)", tool_stale_1),
            ("tool stale, 2 turns (1 call)", tool_stale_2),
            ("tool stale, 3+ turns", tool_stale_3),
        ],
        chart: ChartKind::Bars(0),
        unavailable: None,
    },
    Experiment {
        name: "opd",
        about: "on-policy distillation from a teacher (the arms' starting point trained 150 \
                more supervised steps, per seed), in sync mode (every token trained at lag 0), \
                the RL learning rate at 1e-3 and 16 groups per step: GRPO alone (off, the gap measured), the teacher's log-ratio per token as \
                the advantage (GLM-5), the same centered on the step's mean, and GRPO plus the \
                k3 KL toward the teacher in the loss: the gap to the teacher (mean behavior - \
                teacher log-prob of the sampled tokens, the k1 estimate of KL(student || \
                teacher)) over the stage and at its end, and the held-out pass rates after",
        base_sets: &[
            "run.mode=\"sync\"",
            "optim.rl_muon_lr=0.001",
            "optim.rl_adamw_lr=0.001",
            "buffer.groups_per_step=16",
        ],
        arms: super::opd::opd_arms,
        columns: &[
            ("KL to teacher", super::opd::kl),
            ("KL to teacher, last quarter", super::opd::kl_end),
            ("teacher-scored tokens", super::opd::scored_tokens),
            ("sort pass after", super::opd::sort_pass_after),
            ("tool pass after", super::opd::tool_pass_after),
            ("reward", reward),
            ("RL time (s)", rl_time),
        ],
        chart: ChartKind::Steps(
            |l| num(l, "opd_reverse_kl_window"),
            "KL to the teacher (mean behavior - teacher logp)",
        ),
        unavailable: None,
    },
];
