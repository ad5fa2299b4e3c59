//! The BPE tokenizer at the token gateway (issue 27 item 3): training one on the tasks' text,
//! loading tokenizer.json files (and the errors for bad ones), and the re-tokenization hazard:
//! texts whose decode-then-encode round trip gives other ids than the engine sampled, with the
//! learner training on the sampled ids all the same.

use sluice_kernels::Backend;
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig, Precision};
use sluice_runtime::buffer::{BufferConfig, DataBuffer, ReadyGroup};
use sluice_runtime::clock::{ClockMode, CostModel, Micros};
use sluice_runtime::engine::StopConfig;
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::env::faults::CallKey;
use sluice_runtime::env::faults::FaultRates;
use sluice_runtime::env::latency::LatencyModel;
use sluice_runtime::env::{CallError, Demonstration, Problem, Reply, Split, Task, TaskError};
use sluice_runtime::health::HealthConfig;
use sluice_runtime::learner::{Learner, LearnerConfig, StepReport};
use sluice_runtime::metrics::LearnerTotals;
use sluice_runtime::orchestrator::{Orchestrator, RolloutPolicy, TaskSpec};
use sluice_runtime::sync::SyncOptions;
use sluice_runtime::system::{run_stage, Mode, Parts, StageConfig, StageObserver, StageStart};
use sluice_runtime::trajectory::{ArtifactVersions, SamplingParams, TokenId, WeightVersion};
use sluice_trainer::config;
use sluice_trainer::tasks::bpe::{self, Bpe};
use sluice_trainer::tasks::sort::Sort;
use sluice_trainer::tasks::text::{Specials, TextTokenizer};
use sluice_trainer::tasks::tokenizer::Special;
use sluice_trainer::tokenizer_cmd;
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::sync::{Arc, OnceLock};

/// The default config's corpus (128 problems per task), trained once per test binary.
fn trained() -> &'static (String, Arc<TextTokenizer>) {
    static T: OnceLock<(String, Arc<TextTokenizer>)> = OnceLock::new();
    T.get_or_init(|| {
        let cfg = config::load(None, &[]).unwrap();
        let texts = tokenizer_cmd::corpus(&cfg, 128).unwrap();
        let json = bpe::train(&texts, 512, 1).unwrap();
        let b = Bpe::from_bytes(json.as_bytes(), "trained").unwrap();
        (json, Arc::new(TextTokenizer::Bpe(Arc::new(b))))
    })
}

/// The `sluice` binary, run from the workspace root (where configs/ is).
fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    c
}

#[test]
fn a_trained_bpe_keeps_the_specials_first_splits_digits_and_is_deterministic() {
    let (json, tok) = trained();
    // The specials at the character tokenizer's ids, the 256 bytes, some merges.
    assert_eq!(tok.specials(), Specials::CHAR);
    for s in Special::ALL {
        assert_eq!(tok.encode(s.text()).unwrap(), vec![s.id()], "{}", s.text());
    }
    let n = tok.vocab_size();
    assert!(n > 9 + 256 && n <= 512, "vocab {n}");
    // Digits one per token, whatever surrounds them.
    for text in ["83169", "sort 1234567890", "37*52=1924"] {
        let ids = tok.encode(text).unwrap();
        let digits: Vec<&TokenId> = ids
            .iter()
            .filter(|&&id| {
                tok.decode(&[id])
                    .unwrap()
                    .chars()
                    .any(|c| c.is_ascii_digit())
            })
            .collect();
        let want = text.chars().filter(char::is_ascii_digit).count();
        assert_eq!(digits.len(), want, "{text}: {ids:?}");
        for &&id in &digits {
            assert_eq!(tok.decode(&[id]).unwrap().len(), 1, "{text}");
        }
    }
    // A word of every sort prompt is merged into one token.
    assert_eq!(tok.encode("sort").unwrap().len(), 1);
    // The same corpus gives the same file.
    let cfg = config::load(None, &[]).unwrap();
    let again = bpe::train(&tokenizer_cmd::corpus(&cfg, 128).unwrap(), 512, 1).unwrap();
    assert_eq!(&again, json);
    // Every text of the corpus round-trips, specials included.
    for t in tokenizer_cmd::corpus(&cfg, 16).unwrap() {
        assert_eq!(tok.decode(&tok.encode(&t).unwrap()).unwrap(), t);
    }
    // Text tasks on it: a demonstration decodes to the character tokenizer's text.
    let sort = Sort::new("sort", 5).unwrap();
    let on_bpe = Sort::new("sort", 5)
        .unwrap()
        .with_tokenizer(Arc::clone(tok));
    let mut rng = sluice_kernels::testing::Rng::new(3);
    let p = sort.problem(&mut rng, sluice_runtime::env::Split::Train);
    let mut rng = sluice_kernels::testing::Rng::new(3);
    let q = on_bpe.problem(&mut rng, sluice_runtime::env::Split::Train);
    assert_eq!(p.spec, q.spec);
    assert!(q.prompt.len() < p.prompt.len(), "{:?}", q.prompt);
    let char_text = TextTokenizer::Char.decode(&p.prompt).unwrap();
    assert_eq!(tok.decode(&q.prompt).unwrap(), char_text);
    assert_eq!(on_bpe.versions().tokenizer, tok.version());
    assert!(tok.version().starts_with("bpe-"));
}

/// configs/tokenizer/tasks-bpe-digits3.json, the tito experiment's tokenizer, is what its
/// command writes (`sluice tokenizer train --config configs/tiny.toml --digits 3`), and merges
/// numbers in runs of at most three digits.
#[test]
fn the_digit_triples_bpe_is_its_commands_output_and_merges_numbers_in_threes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let committed =
        std::fs::read_to_string(root.join("configs/tokenizer/tasks-bpe-digits3.json")).unwrap();
    let cfg = config::load(Some(&root.join("configs/tiny.toml")), &[]).unwrap();
    let texts = tokenizer_cmd::corpus(&cfg, 4096).unwrap();
    let json = bpe::train(&texts, bpe::DEFAULT_TRAIN_VOCAB, 3).unwrap();
    assert!(
        json == committed,
        "the committed file is not the command's output"
    );
    let tok = TextTokenizer::Bpe(Arc::new(Bpe::from_bytes(json.as_bytes(), "d3").unwrap()));
    assert_eq!(tok.vocab_size(), bpe::DEFAULT_TRAIN_VOCAB);
    assert_eq!(tok.specials(), Specials::CHAR);
    let digit_tokens = |n: usize| {
        (0..tok.vocab_size() as TokenId)
            .filter(|&id| {
                let t = tok.decode(&[id]).unwrap();
                t.len() == n && t.bytes().all(|b| b.is_ascii_digit())
            })
            .count()
    };
    // Every digit and most pairs and triples are tokens; nothing longer.
    assert_eq!(digit_tokens(1), 10);
    assert!(digit_tokens(2) >= 80, "{} pairs", digit_tokens(2));
    assert!(digit_tokens(3) >= 100, "{} triples", digit_tokens(3));
    assert_eq!(digit_tokens(4), 0);
    // Numbers are cut in threes from the left, each run encoded on its own; text around them
    // never joins a digit; every text round-trips.
    for (text, runs) in [
        ("13689", vec!["136", "89"]),
        ("sort 1234567", vec!["123", "456", "7"]),
        ("37*52=1924", vec!["37", "52", "192", "4"]),
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let mut digits = Vec::new();
        for &id in &ids {
            let t = tok.decode(&[id]).unwrap();
            if t.bytes().any(|b| b.is_ascii_digit()) {
                assert!(t.bytes().all(|b| b.is_ascii_digit()), "{text}: {t:?}");
                digits.push(t);
            }
        }
        let want: Vec<TokenId> = runs.iter().flat_map(|r| tok.encode(r).unwrap()).collect();
        let got: Vec<TokenId> = ids
            .iter()
            .copied()
            .filter(|&id| {
                tok.decode(&[id])
                    .unwrap()
                    .bytes()
                    .any(|b| b.is_ascii_digit())
            })
            .collect();
        assert_eq!(got, want, "{text}: {digits:?}");
        assert!(
            got.len() < text.bytes().filter(u8::is_ascii_digit).count(),
            "{text}"
        );
    }
    // The hazard the tito experiment measures: the digits of a number sampled one per token
    // decode to the same text, which encodes to fewer, merged ids.
    let one_by_one: Vec<TokenId> = "1924"
        .chars()
        .flat_map(|c| tok.encode(&c.to_string()).unwrap())
        .collect();
    assert_eq!(one_by_one.len(), 4);
    let again = tok.encode(&tok.decode(&one_by_one).unwrap()).unwrap();
    assert!(again.len() < 4, "{again:?}");
    // `--digits 0` is refused, naming the flag.
    let err = bpe::train(&texts[..8], 300, 0).unwrap_err();
    assert!(err.contains("--digits 0"), "{err}");
}

/// The learner's inputs of every step.
#[derive(Default)]
struct Batches(Vec<ReadyGroup>, Vec<serde_json::Value>);

impl StageObserver for Batches {
    fn on_step(&mut self, line: &serde_json::Value, _r: &StepReport) -> Result<(), String> {
        self.1.push(line.clone());
        Ok(())
    }
    fn on_learner_batch(&mut self, groups: &[ReadyGroup]) {
        self.0.extend_from_slice(groups);
    }
}

/// A task that records the ids the engine sampled, as the environment receives them.
struct Witness {
    inner: Sort,
    seen: Mutex<HashMap<String, Vec<TokenId>>>,
}

impl Task for Witness {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn multi_turn(&self) -> bool {
        self.inner.multi_turn()
    }
    fn problem(&self, rng: &mut sluice_kernels::testing::Rng, split: Split) -> Problem {
        self.inner.problem(rng, split)
    }
    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        self.inner.respond(p, turn, generated)
    }
    fn call(
        &self,
        key: CallKey<'_>,
        p: &Problem,
        generated: &[TokenId],
    ) -> Result<Reply, CallError> {
        self.seen
            .lock()
            .unwrap()
            .insert(key.session.to_string(), generated.to_vec());
        self.respond(p, key.turn, generated)
            .map_err(CallError::Task)
    }
    fn stop(&self) -> StopConfig {
        self.inner.stop()
    }
    fn versions(&self) -> ArtifactVersions {
        self.inner.versions()
    }
    fn demonstration(
        &self,
        p: &Problem,
        rng: &mut sluice_kernels::testing::Rng,
    ) -> Option<Demonstration> {
        self.inner.demonstration(p, rng)
    }
}

#[test]
fn sampled_ids_that_do_not_survive_a_round_trip_are_trained_as_sampled() {
    let (_, tok) = trained();
    // By construction: "sort" is one token; its four byte tokens decode to the same text and
    // re-encode to the one token.
    let bytes: Vec<TokenId> = "sort"
        .chars()
        .map(|c| tok.encode(&c.to_string()).unwrap()[0])
        .collect();
    assert_eq!(bytes.len(), 4);
    assert_eq!(tok.decode(&bytes).unwrap(), "sort");
    assert_ne!(tok.encode("sort").unwrap(), bytes);

    // A tiny model on the BPE's vocabulary samples turns on the sort task; two learner steps.
    let vocab = tok.vocab_size();
    let mut cfg = ModelConfig::tiny();
    cfg.vocab = vocab;
    let be = Backend::Cpu;
    let model = Model::new(cfg.clone(), &be).unwrap();
    let engine = Engine::new(
        Backend::Cpu,
        &cfg,
        &model.params,
        WeightVersion(0),
        EngineConfig {
            kv_bytes: EngineConfig::kv_bytes_for_blocks(&cfg, Precision::F32, 16, 512),
            max_seqs: 32,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let learner = Learner::new(
        be,
        model,
        OptimConfig::default(),
        LearnerConfig::default(),
        0,
    )
    .unwrap();
    let witness = Arc::new(Witness {
        inner: Sort::new("sort", 5)
            .unwrap()
            .with_tokenizer(Arc::clone(tok)),
        seen: Mutex::new(HashMap::new()),
    });
    let task: Arc<dyn Task> = Arc::clone(&witness) as Arc<dyn Task>;
    let policy = RolloutPolicy {
        group_size: 4,
        sampling: SamplingParams {
            temperature: 1.0,
            max_new_tokens: 8,
            seed: 5,
            ..SamplingParams::default()
        },
        max_turns: 1,
        share_correction: false,
        seed: 5,
        vocab,
        max_observation_tokens: 8,
    };
    let spec = TaskSpec {
        task,
        concurrency: 64,
        timeout: Micros::from_secs(10.0),
        retries: 0,
        target_share: 1.0,
        latency: LatencyModel::None,
        faults: FaultRates::default(),
    };
    let orch = Orchestrator::new(vec![spec], policy, 0).unwrap();
    let buffer = DataBuffer::new(BufferConfig {
        group_size: 4,
        tau: 4,
        env_gate: true,
        dynamic_sampling: None,
    });
    let stage = StageConfig {
        name: "rl".into(),
        mode: Mode::Sync,
        clock: ClockMode::Virtual,
        steps: 2,
        groups_per_step: 4,
        eta: 1,
        sync_interval: 1,
        reset_optimizer: false,
        cost: CostModel::default(),
        barrier_every: None,
        sync: SyncOptions::default(),
        health: HealthConfig::default(),
        over_sampling: None,
        servers: Vec::new(),
        pin_lanes: false,
    };
    let start = StageStart {
        clock: Micros(0),
        stage_began: Micros(0),
        totals: LearnerTotals::new(),
        engine_weights: Arc::new(learner.publish().unwrap()),
    };
    let mut seen = Batches::default();
    run_stage(
        &stage,
        Parts {
            learner,
            engines: vec![engine],
        },
        orch,
        buffer,
        start,
        &mut seen,
    )
    .unwrap();
    assert_eq!(seen.1.len(), 2);
    assert_eq!(seen.0.len(), 8);

    // The model's turns (as the engine sampled them and the environment received them) whose
    // round trip changes the ids.
    let sampled = witness.seen.lock().unwrap();
    let mut hazards = 0;
    for s in seen.0.iter().flat_map(|g| &g.samples) {
        // The environment's key of a trajectory: SESSION#MEMBER.
        let turn = &sampled[&format!("{}#{}", s.session_id, s.group_index)];
        let text = tok.decode(turn).unwrap();
        let again = tok.encode(&text).unwrap();
        // What the learner trains on: the sampled turn, every id of it in the loss.
        let trained = &s.tokens[s.prompt_len..];
        assert_eq!(
            trained,
            turn.as_slice(),
            "{}#{}",
            s.session_id,
            s.group_index
        );
        assert!(s.loss_mask[s.prompt_len..].iter().all(|&m| m));
        if &again != turn {
            hazards += 1;
            assert_ne!(trained, again.as_slice());
        }
    }
    assert!(hazards > 0, "no sampled turn changes in a round trip");
    // The learner scored exactly the sampled ids: at lag 0 its log-probs equal the engine's
    // bit for bit (a re-encoded sequence has other ids and other log-probs).
    for line in &seen.1 {
        assert_eq!(
            line["mismatch.lag0.abs_diff_max"].as_f64(),
            Some(0.0),
            "{line}"
        );
        assert!(
            line["mismatch.lag0.tokens"].as_f64().unwrap() > 0.0,
            "{line}"
        );
    }
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn bad_tokenizers_are_named_errors_with_exit_code_2() {
    let dir = std::env::temp_dir().join(format!("sluice-bpe-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, _) = trained();
    let good = write(&dir, "good.json", json);
    let missing = dir.join("none.json");
    let malformed = write(&dir, "malformed.json", "{\"model\": 3");
    let no_eot = write(&dir, "no_eot.json", &json.replace("\"<eot>\"", "\"<end>\""));
    let cases: [(Vec<String>, &[&str]); 5] = [
        (
            vec![format!("tokenizer.path=\"{}\"", missing.display())],
            &["tokenizer.path", "none.json"],
        ),
        (
            vec![format!("tokenizer.path=\"{}\"", malformed.display())],
            &["tokenizer.path", "malformed.json", "not a valid"],
        ),
        (
            vec![format!("tokenizer.path=\"{}\"", no_eot.display())],
            &["tokenizer.path", "no_eot.json", "<eot>", "missing"],
        ),
        (
            vec![
                format!("tokenizer.path=\"{}\"", good.display()),
                "tokenizer.max_vocab=265".into(),
            ],
            &["tokenizer.max_vocab", "good.json", "over the model's limit"],
        ),
        (vec![], &["tokenizer.path", "needs the path"]),
    ];
    for (sets, want) in cases {
        let mut cmd = bin();
        cmd.args(["train", "--out"])
            .arg(dir.join("run"))
            .args(["--set", "tokenizer.kind=bpe"]);
        for s in &sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{sets:?}: {err}");
        for w in want {
            assert!(err.contains(w), "{sets:?}: {w:?} not in {err}");
        }
        assert!(!dir.join("run").exists(), "{sets:?}: a run folder was made");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tokenizer_train_writes_a_file_that_a_run_loads() {
    let dir = std::env::temp_dir().join(format!("sluice-bpe-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tok.json");
    let out = bin()
        .args([
            "tokenizer",
            "train",
            "--problems",
            "64",
            "--vocab",
            "300",
            "--out",
        ])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b = Bpe::load(&file).unwrap();
    assert!(b.vocab_size() <= 300 && b.vocab_size() > 265);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&format!("{} ids", b.vocab_size())), "{said}");
    // Too small a vocabulary for the bytes and specials.
    let out = bin()
        .args(["tokenizer", "train", "--vocab", "100", "--out"])
        .arg(dir.join("small.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--vocab 100"));
    // No digits per token.
    let out = bin()
        .args(["tokenizer", "train", "--digits", "0", "--out"])
        .arg(dir.join("none.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--digits 0"));
    assert!(!dir.join("none.json").exists());
    // A checkpoint of a model on the character vocabulary does not fit the BPE: a named error.
    let mut cfg = ModelConfig::tiny();
    cfg.vocab = 64;
    let model = Model::new(cfg, &Backend::Cpu).unwrap();
    let ck = dir.join("char.safetensors");
    sluice_model::checkpoint::save(&ck, &model.config, &model.params).unwrap();
    let out = bin()
        .args(["train", "--out"])
        .arg(dir.join("run"))
        .args(["--set", "tokenizer.kind=bpe", "--set"])
        .arg(format!("tokenizer.path=\"{}\"", file.display()))
        .arg("--set")
        .arg(format!("model.init=\"{}\"", ck.display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for w in [
        "model.init",
        "char.safetensors",
        "64 ids",
        &format!("gives {}", b.vocab_size()),
    ] {
        assert!(err.contains(w), "{w:?} not in {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
