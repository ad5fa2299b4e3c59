//! Two synthetic tasks on raw token ids, for tests and quick runs on tiny models (the tokenized
//! reasoning and tool tasks of `sluice train` live in the trainer).
//!
//! Token layout (any vocabulary of at least [`MIN_VOCAB`] ids): `BOS` = 0, `SEP` = 1, `EOS` = 2,
//! the ids 3.. are symbols.
//!
//! - `recall` (single turn): the prompt is `BOS s1 .. sn SEP`; the model must answer with `s1`
//!   (then EOS). Reward 1 and `success` when the first generated token is `s1`, else 0 and
//!   `failure`.
//! - `lookup` (two turns, an environment-in-the-loop task): the prompt is `BOS k SEP`. The model
//!   first writes a query ending in `SEP`; the environment answers with the observation
//!   `v SEP`, where `v` is a symbol drawn per problem that the prompt does not contain; the
//!   model must then answer `v` (then EOS). A first turn that does not end in `SEP` ends the
//!   episode as `failure`. Without reading the observation a policy can only guess `v`.
//!
//! Held-out problems are those whose spec hashes odd, training problems those that hash even,
//! so the two streams never share a problem.

use super::{Demonstration, Problem, Reply, Split, Task, TaskError};
use crate::engine::StopConfig;
use crate::hash::hash_str;
use crate::trajectory::{ArtifactVersions, TerminalReason, TokenId};
use sluice_kernels::testing::Rng;

pub const BOS: TokenId = 0;
pub const SEP: TokenId = 1;
pub const EOS: TokenId = 2;
/// The first symbol id.
pub const FIRST_SYMBOL: TokenId = 3;
/// The smallest vocabulary the synthetic tasks accept: three specials and five symbols.
pub const MIN_VOCAB: usize = 8;

fn symbols(vocab: usize) -> usize {
    vocab - FIRST_SYMBOL as usize
}

fn in_split(spec: &str, split: Split) -> bool {
    let odd = hash_str(0x5e1d, spec) & 1 == 1;
    odd == (split == Split::HeldOut)
}

fn versions(name: &str) -> ArtifactVersions {
    ArtifactVersions {
        template: format!("synthetic-{name}-1"),
        tokenizer: "raw-ids".into(),
        environment: format!("synthetic-{name}-1"),
    }
}

fn parse_ids(spec: &str, want: usize) -> Result<Vec<TokenId>, TaskError> {
    let ids: Result<Vec<TokenId>, _> = spec.split(',').map(|s| s.trim().parse()).collect();
    match ids {
        Ok(v) if v.len() == want => Ok(v),
        _ => Err(TaskError(format!(
            "problem spec {spec:?} is not {want} comma-separated token ids"
        ))),
    }
}

fn end(ok: bool) -> Reply {
    Reply::End {
        reward: if ok { 1.0 } else { 0.0 },
        reason: if ok {
            TerminalReason::Success
        } else {
            TerminalReason::Failure
        },
    }
}

/// Single-turn recall of the first prompt symbol.
#[derive(Clone, Debug)]
pub struct Recall {
    name: String,
    vocab: usize,
    items: usize,
}

impl Recall {
    /// `items` symbols per prompt (>= 1) from a vocabulary of `vocab` ids (>= [`MIN_VOCAB`]).
    pub fn new(name: &str, vocab: usize, items: usize) -> Result<Recall, TaskError> {
        if vocab < MIN_VOCAB || items == 0 {
            return Err(TaskError(format!(
                "task {name}: recall needs a vocabulary of at least {MIN_VOCAB} ids and at \
                 least one item (got vocab {vocab}, items {items})"
            )));
        }
        Ok(Recall {
            name: name.into(),
            vocab,
            items,
        })
    }
}

impl Task for Recall {
    fn name(&self) -> &str {
        &self.name
    }

    fn multi_turn(&self) -> bool {
        false
    }

    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        loop {
            let items: Vec<TokenId> = (0..self.items)
                .map(|_| FIRST_SYMBOL + rng.below(symbols(self.vocab)) as TokenId)
                .collect();
            let spec = items
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",");
            if !in_split(&spec, split) {
                continue;
            }
            let mut prompt = vec![BOS];
            prompt.extend(&items);
            prompt.push(SEP);
            return Problem {
                id: format!("{}:{spec}", self.name),
                prompt,
                spec,
            };
        }
    }

    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        let items = parse_ids(&p.spec, self.items)?;
        if turn != 0 {
            return Err(TaskError(format!("recall has one turn, got turn {turn}")));
        }
        Ok(end(generated.first() == Some(&items[0])))
    }

    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: Some(EOS),
            stop_sequences: Vec::new(),
        }
    }

    fn versions(&self) -> ArtifactVersions {
        versions("recall")
    }

    fn demonstration(&self, p: &Problem, _rng: &mut Rng) -> Option<Demonstration> {
        let items = parse_ids(&p.spec, self.items).ok()?;
        let mut tokens = p.prompt.clone();
        let mut loss_mask = vec![false; tokens.len()];
        tokens.extend([items[0], EOS]);
        loss_mask.extend([true, true]);
        Some(Demonstration { tokens, loss_mask })
    }
}

/// Two-turn lookup: the answer comes from the environment's observation.
#[derive(Clone, Debug)]
pub struct Lookup {
    name: String,
    vocab: usize,
}

impl Lookup {
    pub fn new(name: &str, vocab: usize) -> Result<Lookup, TaskError> {
        if vocab < MIN_VOCAB {
            return Err(TaskError(format!(
                "task {name}: lookup needs a vocabulary of at least {MIN_VOCAB} ids (got {vocab})"
            )));
        }
        Ok(Lookup {
            name: name.into(),
            vocab,
        })
    }
}

impl Task for Lookup {
    fn name(&self) -> &str {
        &self.name
    }

    fn multi_turn(&self) -> bool {
        true
    }

    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        let n = symbols(self.vocab);
        loop {
            let key = FIRST_SYMBOL + rng.below(n) as TokenId;
            // The value differs from the key, so echoing the prompt never succeeds.
            let mut value = FIRST_SYMBOL + rng.below(n - 1) as TokenId;
            if value >= key {
                value += 1;
            }
            let spec = format!("{key},{value}");
            if !in_split(&spec, split) {
                continue;
            }
            return Problem {
                id: format!("{}:{spec}", self.name),
                prompt: vec![BOS, key, SEP],
                spec,
            };
        }
    }

    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        let kv = parse_ids(&p.spec, 2)?;
        match turn {
            // The query must end in SEP; the observation carries the value.
            0 if generated.last() == Some(&SEP) => Ok(Reply::Observe(vec![kv[1], SEP])),
            0 => Ok(end(false)),
            1 => Ok(end(generated.first() == Some(&kv[1]))),
            t => Err(TaskError(format!("lookup has two turns, got turn {t}"))),
        }
    }

    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: Some(EOS),
            stop_sequences: vec![vec![SEP]],
        }
    }

    fn versions(&self) -> ArtifactVersions {
        versions("lookup")
    }

    fn demonstration(&self, p: &Problem, _rng: &mut Rng) -> Option<Demonstration> {
        let kv = parse_ids(&p.spec, 2).ok()?;
        let mut tokens = p.prompt.clone();
        let mut loss_mask = vec![false; tokens.len()];
        // Query: the key, then SEP.
        tokens.extend([kv[0], SEP]);
        loss_mask.extend([true, true]);
        // Observation (not trained on).
        tokens.extend([kv[1], SEP]);
        loss_mask.extend([false, false]);
        // Answer.
        tokens.extend([kv[1], EOS]);
        loss_mask.extend([true, true]);
        Some(Demonstration { tokens, loss_mask })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recall_rewards_the_first_symbol() {
        let t = Recall::new("recall", 16, 3).unwrap();
        let mut rng = Rng::new(1);
        let p = t.problem(&mut rng, Split::Train);
        assert_eq!(p.prompt.len(), 5);
        let first = p.prompt[1];
        assert_eq!(t.respond(&p, 0, &[first, EOS]).unwrap(), end(true));
        let wrong = if first == 3 { 4 } else { 3 };
        assert_eq!(t.respond(&p, 0, &[wrong, EOS]).unwrap(), end(false));
        assert_eq!(t.respond(&p, 0, &[]).unwrap(), end(false));
        let d = t.demonstration(&p, &mut rng).unwrap();
        assert_eq!(d.tokens[5], first);
        assert_eq!(d.loss_mask.iter().filter(|&&m| m).count(), 2);
    }

    #[test]
    fn lookup_needs_the_observation() {
        let t = Lookup::new("lookup", 16).unwrap();
        let mut rng = Rng::new(2);
        let p = t.problem(&mut rng, Split::Train);
        let kv = parse_ids(&p.spec, 2).unwrap();
        assert_ne!(kv[0], kv[1]);
        assert!(!p.prompt.contains(&kv[1]));
        let obs = t.respond(&p, 0, &[kv[0], SEP]).unwrap();
        assert_eq!(obs, Reply::Observe(vec![kv[1], SEP]));
        assert_eq!(t.respond(&p, 0, &[kv[0], EOS]).unwrap(), end(false));
        assert_eq!(t.respond(&p, 1, &[kv[1], EOS]).unwrap(), end(true));
        assert_eq!(t.respond(&p, 1, &[kv[0], EOS]).unwrap(), end(false));
        assert!(t.respond(&p, 2, &[]).is_err());
    }

    #[test]
    fn splits_never_share_a_problem() {
        let t = Lookup::new("lookup", 12).unwrap();
        let (mut a, mut b) = (Rng::new(3), Rng::new(4));
        let train: std::collections::BTreeSet<String> = (0..300)
            .map(|_| t.problem(&mut a, Split::Train).spec)
            .collect();
        let held: std::collections::BTreeSet<String> = (0..300)
            .map(|_| t.problem(&mut b, Split::HeldOut).spec)
            .collect();
        assert!(train.len() > 10 && held.len() > 10);
        assert!(train.is_disjoint(&held));
    }

    #[test]
    fn bad_specs_and_sizes_are_errors() {
        assert!(Recall::new("r", 5, 3).is_err());
        assert!(Recall::new("r", 16, 0).is_err());
        assert!(Lookup::new("l", 7).is_err());
        let t = Lookup::new("lookup", 16).unwrap();
        let p = Problem {
            id: "x".into(),
            prompt: vec![BOS],
            spec: "nonsense".into(),
        };
        assert!(t.respond(&p, 0, &[SEP]).unwrap_err().0.contains("nonsense"));
    }
}
