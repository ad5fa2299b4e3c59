//! `sluice tokenizer train [--out F] [--vocab 512] [--digits 1]`: a byte-level BPE trained on
//! the tasks' text ([`crate::tasks::bpe::train`]), written as a Hugging Face tokenizer.json
//! that `[tokenizer] kind = "bpe"`, `path = F` loads. `--digits N` lets it merge runs of up
//! to N digits (the default 1 keeps every digit its own token).
//!
//! The corpus is the supervised warm-up's text: the demonstrations (prompt, tool calls,
//! observations, answers) of `--problems` training problems of each built-in text task of the
//! config (arith, sort, tool), written out by the character tokenizer. External tasks are
//! skipped (training a tokenizer starts no environment).

use crate::config;
use crate::tasks::text::TextTokenizer;
use crate::tasks::{bpe, export};
use crate::train_cmd::{make_task, TrainError};
use sluice_kernels::testing::Rng;
use sluice_runtime::env::Split;
use sluice_runtime::hash::{hash_str, mix64};
use std::io::Write;
use std::path::PathBuf;

/// What `sluice tokenizer train` was asked.
#[derive(Clone, Debug)]
pub struct TrainTokenizerOptions {
    pub config: Option<PathBuf>,
    pub sets: Vec<String>,
    pub out: PathBuf,
    pub vocab: usize,
    /// The most digits one token may hold (1: every digit its own token).
    pub digits: usize,
    /// Training problems per task.
    pub problems: usize,
}

/// The corpus: each text task's demonstrations as text, in task then problem order.
pub fn corpus(cfg: &config::TrainConfig, problems: usize) -> Result<Vec<String>, TrainError> {
    let char_tok = TextTokenizer::char();
    let mut texts = Vec::new();
    for t in &cfg.tasks {
        if !matches!(t.kind.as_str(), "arith" | "sort" | "tool") {
            continue;
        }
        let task = make_task(
            t,
            char_tok.vocab_size(),
            &crate::tasks::external::EnvIo::default(),
            &char_tok,
        )
        .map_err(TrainError::Input)?;
        for (k, p) in export::problems(task.as_ref(), Split::Train, problems, cfg.run.seed)
            .iter()
            .enumerate()
        {
            let mut rng = Rng::new(mix64(hash_str(cfg.run.seed, &p.id) ^ k as u64));
            if let Some(d) = task.demonstration(p, &mut rng) {
                texts.push(char_tok.render(&d.tokens));
            }
        }
    }
    if texts.is_empty() {
        return Err(TrainError::Input(
            "the config has no built-in text task (arith, sort, tool) to train a tokenizer on"
                .into(),
        ));
    }
    Ok(texts)
}

/// Trains, checks that the file loads back with every special, writes it, and reports.
pub fn run_train(o: &TrainTokenizerOptions, out: &mut dyn Write) -> Result<(), TrainError> {
    if o.problems == 0 {
        return Err(TrainError::Input("--problems 0: at least one".into()));
    }
    if o.digits == 0 {
        return Err(TrainError::Input(
            "--digits 0: a token holds at least one digit".into(),
        ));
    }
    let cfg = config::load(o.config.as_deref(), &o.sets)?;
    let texts = corpus(&cfg, o.problems)?;
    let json = bpe::train(&texts, o.vocab, o.digits).map_err(TrainError::Input)?;
    let loaded = bpe::Bpe::from_bytes(json.as_bytes(), &o.out.display().to_string())
        .map_err(|e| TrainError::Run(format!("the trained tokenizer does not load: {e}")))?;
    if let Some(dir) = o.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| TrainError::Input(format!("--out {}: {e}", o.out.display())))?;
    }
    std::fs::write(&o.out, &json)
        .map_err(|e| TrainError::Input(format!("--out {}: {e}", o.out.display())))?;
    let tok = TextTokenizer::Bpe(std::sync::Arc::new(loaded));
    let (mut chars, mut ids) = (0usize, 0usize);
    for t in &texts {
        chars += TextTokenizer::Char
            .encode(t)
            .map_err(TrainError::Run)?
            .len();
        ids += tok.encode(t).map_err(TrainError::Run)?.len();
    }
    let _ = writeln!(
        out,
        "wrote {} ({}): {} ids (--vocab {}, --digits {}), trained on {} demonstrations; {:.2} \
         tokens per demonstration against {:.2} with the character tokenizer",
        o.out.display(),
        tok.version(),
        tok.vocab_size(),
        o.vocab,
        o.digits,
        texts.len(),
        ids as f64 / texts.len() as f64,
        chars as f64 / texts.len() as f64,
    );
    Ok(())
}
