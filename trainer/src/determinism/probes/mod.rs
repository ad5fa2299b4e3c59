//! `sluice determinism probe`: the invariances beyond run-to-run identity, each a named yes/no
//! with the first counterexample (docs/determinism.md lists them with what each promises).

mod batch;
mod engine;
mod model;
mod process;

use super::{record, DetError, Resolved};
use serde::Serialize;
use sluice_kernels::Backend;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// A probe's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail,
    /// Does not apply to the device (said why).
    Skipped,
}

/// What a probe found: for a pass, what was checked; for a failure, the first counterexample.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub outcome: Outcome,
    pub detail: String,
}

impl Verdict {
    pub fn pass(detail: String) -> Verdict {
        Verdict {
            outcome: Outcome::Pass,
            detail,
        }
    }

    pub fn fail(counterexample: String) -> Verdict {
        Verdict {
            outcome: Outcome::Fail,
            detail: counterexample,
        }
    }

    pub fn skipped(why: String) -> Verdict {
        Verdict {
            outcome: Outcome::Skipped,
            detail: why,
        }
    }
}

/// A probe: its name, what it checks, and how.
struct Probe {
    name: &'static str,
    what: &'static str,
    run: fn(&Backend, &Resolved) -> Result<Verdict, DetError>,
}

const PROBES: &[Probe] = &[
    Probe {
        name: "batch_invariance",
        what: "a row's (or sequence's) bits do not depend on the batch: batches of 1, 7, 64, 129 \
               and 1000, the probed row at tile and thread-panel edges, across the few-row packed \
               GEMM, the 8-row panels and the by-sequence attention backward",
        run: |b, _| batch::probe(b),
    },
    Probe {
        name: "chunked_prefill",
        what: "a prompt prefilled in chunks gives the logits and KV cache of one prefill",
        run: |b, s| model::chunked_prefill(b, s.preset),
    },
    Probe {
        name: "decode_equals_training",
        what: "decoding token by token gives the training forward's bits, layer by layer",
        run: |b, s| model::decode_equals_training(b, s.preset),
    },
    Probe {
        name: "prefix_shared",
        what: "sequences sharing a prompt's blocks (group fork, prefix cache, copy-on-write) \
               equal fresh runs",
        run: |b, s| engine::prefix_shared(b, s.preset),
    },
    Probe {
        name: "preempted_recompute",
        what: "sequences preempted and recomputed under a short KV pool equal fresh runs",
        run: |b, s| engine::preempted_recompute(b, s.preset),
    },
    Probe {
        name: "thread_count",
        what: "every workload's digests are the same with 1, 2 and all cores' threads (separate \
               processes)",
        run: |_, s| process::thread_count(s),
    },
    Probe {
        name: "schedule_seed",
        what: "emu: every workload's digests are the same under schedule seeds 1, 2 and 3 \
               (separate processes)",
        run: |_, s| process::schedule_seed(s),
    },
];

/// The `--list` text.
pub fn list() -> String {
    PROBES
        .iter()
        .map(|p| format!("{:<24} {}\n", p.name, p.what))
        .collect()
}

#[derive(Serialize)]
struct ProbeReport {
    format: &'static str,
    kind: &'static str,
    version: u64,
    device: String,
    preset: String,
    probes: Vec<NamedVerdict>,
}

#[derive(Serialize)]
struct NamedVerdict {
    name: &'static str,
    #[serde(flatten)]
    verdict: Verdict,
    seconds: f64,
}

/// Runs the probes named in `only` (all when empty); exit 1 (Err Failed) when one fails.
pub fn run_command(
    sel: &Resolved,
    only: &[String],
    json: Option<&Path>,
    out: &mut dyn Write,
) -> Result<(), DetError> {
    for name in only {
        if !PROBES.iter().any(|p| p.name == name) {
            let names: Vec<&str> = PROBES.iter().map(|p| p.name).collect();
            return Err(DetError::Input(format!(
                "unknown probe `{name}`; the probes are: {}",
                names.join(", ")
            )));
        }
    }
    let backend = Backend::open(sel.device).map_err(|e| DetError::Run(e.to_string()))?;
    let _ = writeln!(
        out,
        "determinism probe on {} (preset {})",
        sel.device, sel.preset
    );
    let mut verdicts = Vec::new();
    for p in PROBES
        .iter()
        .filter(|p| only.is_empty() || only.iter().any(|o| o == p.name))
    {
        let t = Instant::now();
        let v = (p.run)(&backend, sel)?;
        let secs = t.elapsed().as_secs_f64();
        let tag = match v.outcome {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skipped => "SKIP",
        };
        let _ = writeln!(out, "{tag} {} ({secs:.1} s): {}", p.name, v.detail);
        verdicts.push(NamedVerdict {
            name: p.name,
            verdict: v,
            seconds: secs,
        });
    }
    if let Some(path) = json {
        record::write_json(
            path,
            &ProbeReport {
                format: record::FORMAT,
                kind: "probes",
                version: record::VERSION,
                device: sel.device.to_string(),
                preset: sel.preset.to_string(),
                probes: verdicts
                    .iter()
                    .map(|v| NamedVerdict {
                        name: v.name,
                        verdict: v.verdict.clone(),
                        seconds: v.seconds,
                    })
                    .collect(),
            },
        )?;
    }
    let failed: Vec<&str> = verdicts
        .iter()
        .filter(|v| v.verdict.outcome == Outcome::Fail)
        .map(|v| v.name)
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(DetError::Failed(format!(
            "probes failed: {}",
            failed.join(", ")
        )))
    }
}
