//! The text round trip at the gateway, for `sluice experiment tito`: the failure mode the
//! action contract (DESIGN 6.1: the learner trains exactly the ids the rollout sampled) exists
//! to prevent, built so that its damage can be measured.
//!
//! A stack that speaks text between its parts (an agent loop on an OpenAI-style endpoint that
//! returns strings, a trainer that tokenizes the final conversation) decodes the ids the engine
//! sampled and encodes the text again before training. With a BPE the two id sequences often
//! differ: a model that samples `s` `o` `r` `t` (four byte tokens) writes the text `sort`, which
//! encodes as one token; a lone byte of a multi-byte character decodes to U+FFFD, which encodes
//! as three other bytes. The learner then trains on ids the policy never sampled.
//!
//! [`RoundTrip`] wraps a text task. For every finished trajectory it decodes each model turn
//! and encodes the text again, and counts the turns whose ids change (always: the hazard is
//! measured in the token-in-token-out arm too). With `retokenize` (config
//! `rollout.retokenize`) it hands the learner the re-encoded ids instead of the sampled ones.
//! The engine itself stays on the sampled ids (its KV cache, the next turn's context): only
//! what the learner trains changes, as when a trainer re-tokenizes a rollout's text (SkyRL
//! issue #123, "Follow token-in-token-out protocol for inference engines"; the agent-loop
//! re-tokenization of rllm PR #272). The next turn's prompt drift of such a loop is not
//! modelled.
//!
//! The behavior log-probs. The engine recorded one per sampled id; the re-encoded ids have
//! none, and the trainers that re-tokenize keep the rollout's log-probs and pair them with the
//! new ids (NeMo RL PR #1337: "the log probs the model produces are different enough for the
//! differently re-tokenized generation result that it causes the training to be off policy";
//! eval-protocol PR #457: re-encoded ids one shorter than the rollout's log-probs, "misaligning
//! every per-token logprob"). Here they are paired as well as text allows, by [`align`]: the
//! turn's text is cut where a sampled token and a re-encoded token end at the same byte, and
//! within each piece the sampled tokens' log-prob mass (their sum: the log-probability of that
//! stretch of text along the sampled path) is spread evenly over the re-encoded tokens. The
//! turn's total behavior log-prob is kept, a piece whose ids did not change keeps its values
//! bit for bit, and each re-encoded token carries the weight version of the newest sampled
//! token in its piece. The other form (fresh behavior log-probs for the re-encoded ids from
//! the same weights, as a trainer that recomputes its "old" log-probs gets) would make the
//! importance ratio exactly 1 at lag 0 and hide the damage from every mismatch measure while
//! still training ids that were never sampled.

use super::text::TextTokenizer;
use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::faults::CallKey;
use sluice_runtime::env::{
    CallError, Demonstration, Problem, Reply, RoundTripCounts, Split, Task, TaskError,
};
use sluice_runtime::trajectory::{ArtifactVersions, Sample, TokenId, WeightVersion};
use std::sync::Arc;

/// A text task whose finished trajectories go through the round trip (see the module docs).
pub struct RoundTrip {
    inner: Arc<dyn Task>,
    tok: Arc<TextTokenizer>,
    /// Hand the learner the re-encoded ids (`rollout.retokenize`); otherwise only count.
    retokenize: bool,
}

impl RoundTrip {
    pub fn wrap(inner: Arc<dyn Task>, tok: Arc<TextTokenizer>, retokenize: bool) -> Arc<dyn Task> {
        Arc::new(RoundTrip {
            inner,
            tok,
            retokenize,
        })
    }
}

impl Task for RoundTrip {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn multi_turn(&self) -> bool {
        self.inner.multi_turn()
    }
    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        self.inner.problem(rng, split)
    }
    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        self.inner.respond(p, turn, generated)
    }
    fn stop(&self) -> StopConfig {
        self.inner.stop()
    }
    fn versions(&self) -> ArtifactVersions {
        self.inner.versions()
    }
    fn demonstration(&self, p: &Problem, rng: &mut Rng) -> Option<Demonstration> {
        self.inner.demonstration(p, rng)
    }
    fn call(
        &self,
        key: CallKey<'_>,
        p: &Problem,
        generated: &[TokenId],
    ) -> Result<Reply, CallError> {
        self.inner.call(key, p, generated)
    }
    fn prefetch(&self, key: CallKey<'_>, p: &Problem, generated: &[TokenId]) {
        self.inner.prefetch(key, p, generated)
    }
    fn round_trip(&self, sample: &mut Sample) -> Option<RoundTripCounts> {
        Some(round_trip(&self.tok, sample, self.retokenize))
    }
}

/// Decodes and re-encodes every model turn of `sample`; with `retokenize`, replaces each turn
/// whose ids change by the re-encoded ids, their behavior log-probs and versions from
/// [`align`], and moves the turn boundaries with them. A turn whose text does not decode or
/// encode (an id outside the vocabulary, which the engine never samples) or encodes to nothing
/// is left as sampled.
pub fn round_trip(tok: &TextTokenizer, sample: &mut Sample, retokenize: bool) -> RoundTripCounts {
    let mut c = RoundTripCounts::default();
    let n = sample.tokens.len();
    let p = sample.prompt_len.min(n);
    // Segment starts: the prompt's end, every turn boundary, every change of the loss mask.
    let mut starts: Vec<usize> = vec![p];
    starts.extend(
        sample
            .turns
            .iter()
            .map(|b| b.start)
            .filter(|&s| s > p && s < n),
    );
    starts.extend((p + 1..n).filter(|&i| sample.loss_mask[i] != sample.loss_mask[i - 1]));
    starts.sort_unstable();
    starts.dedup();
    let mut out = Rebuilt::with_prompt(sample, p);
    // Old segment start -> new start, for the turn boundaries.
    let mut moved: Vec<(usize, usize)> = Vec::with_capacity(starts.len());
    for (k, &a) in starts.iter().enumerate() {
        let b = starts.get(k + 1).copied().unwrap_or(n);
        if a >= b {
            continue;
        }
        moved.push((a, out.tokens.len()));
        if !sample.loss_mask[a] {
            out.copy(sample, a..b);
            continue;
        }
        let sampled = &sample.tokens[a..b];
        c.turns += 1;
        c.tokens_sampled += sampled.len() as u64;
        let text = tok.decode(sampled);
        let again = text.as_ref().ok().and_then(|t| tok.encode(t).ok());
        let (reencoded, aligned) = match (text, again) {
            (Ok(text), Some(ids)) if ids != sampled && !ids.is_empty() => {
                c.turns_changed += 1;
                let aligned = align(
                    tok,
                    &text,
                    sampled,
                    &sample.behavior_logp[a..b],
                    &sample.weight_version[a..b],
                    &ids,
                );
                (ids, aligned)
            }
            _ => (Vec::new(), None),
        };
        match aligned {
            Some((logp, versions)) if retokenize => {
                c.turns_retokenized += 1;
                c.tokens_trained += reencoded.len() as u64;
                out.tokens.extend_from_slice(&reencoded);
                out.loss_mask
                    .extend(std::iter::repeat_n(true, reencoded.len()));
                out.logp.extend(logp);
                out.versions.extend(versions);
            }
            _ => {
                c.tokens_trained += sampled.len() as u64;
                out.copy(sample, a..b);
            }
        }
    }
    if c.turns_retokenized > 0 {
        for t in &mut sample.turns {
            if let Some(&(_, new)) = moved.iter().find(|(old, _)| *old == t.start) {
                t.start = new;
            }
        }
        sample.tokens = out.tokens;
        sample.loss_mask = out.loss_mask;
        sample.behavior_logp = out.logp;
        sample.weight_version = out.versions;
    }
    c
}

/// A trajectory's per-token vectors being rebuilt.
struct Rebuilt {
    tokens: Vec<TokenId>,
    loss_mask: Vec<bool>,
    logp: Vec<f32>,
    versions: Vec<WeightVersion>,
}

impl Rebuilt {
    fn with_prompt(s: &Sample, p: usize) -> Rebuilt {
        let mut r = Rebuilt {
            tokens: Vec::with_capacity(s.tokens.len()),
            loss_mask: Vec::with_capacity(s.tokens.len()),
            logp: Vec::with_capacity(s.tokens.len()),
            versions: Vec::with_capacity(s.tokens.len()),
        };
        r.copy(s, 0..p);
        r
    }

    fn copy(&mut self, s: &Sample, range: std::ops::Range<usize>) {
        self.tokens.extend_from_slice(&s.tokens[range.clone()]);
        self.loss_mask
            .extend_from_slice(&s.loss_mask[range.clone()]);
        self.logp.extend_from_slice(&s.behavior_logp[range.clone()]);
        self.versions.extend_from_slice(&s.weight_version[range]);
    }
}

/// The byte offset in `text` (the decoding of all of `ids`) where each id's text ends: the
/// length of the decoding of `ids[..=k]`, made non-decreasing and at most `text.len()`, the
/// last one exactly `text.len()`. (A prefix that ends inside a multi-byte character decodes to
/// U+FFFD and may run past the whole; the clamp keeps such ids in one piece with the id that
/// completes the character.)
fn byte_ends(tok: &TextTokenizer, ids: &[TokenId], text: &str) -> Option<Vec<usize>> {
    let mut ends = Vec::with_capacity(ids.len());
    let mut reach = 0;
    for k in 0..ids.len() {
        let len = tok.decode(&ids[..=k]).ok()?.len();
        reach = reach.max(len.min(text.len()));
        ends.push(reach);
    }
    if let Some(last) = ends.last_mut() {
        *last = text.len();
    }
    Some(ends)
}

/// The behavior log-probs and weight versions of the re-encoded ids `reencoded` of a turn
/// whose sampled ids `sampled` (with `logp` and `versions`) decode to `text`: the text is cut
/// where a sampled and a re-encoded id end at the same byte; in each piece the sampled log-prob
/// mass (a sum, in f64) is spread evenly over the piece's re-encoded ids, which carry the
/// version of the piece's last sampled id. A piece of one sampled and one re-encoded id keeps
/// the sampled values as they are. None when the ends do not meet (not reached with a
/// tokenizer whose decoding of the re-encoded ids is `text`).
pub fn align(
    tok: &TextTokenizer,
    text: &str,
    sampled: &[TokenId],
    logp: &[f32],
    versions: &[WeightVersion],
    reencoded: &[TokenId],
) -> Option<(Vec<f32>, Vec<WeightVersion>)> {
    let e = byte_ends(tok, sampled, text)?;
    let f = byte_ends(tok, reencoded, text)?;
    let (n, m) = (e.len(), f.len());
    if n == 0 || m == 0 || logp.len() != n || versions.len() != n {
        return None;
    }
    let mut out_logp = Vec::with_capacity(m);
    let mut out_versions = Vec::with_capacity(m);
    let (mut i, mut j) = (0, 0);
    while i < n && j < m {
        let (i0, j0) = (i, j);
        i += 1;
        j += 1;
        // Take ids from the side that ends first until both end at the same byte, then every
        // following id that ends there too (ids whose text is empty at this byte).
        while e[i - 1] != f[j - 1] {
            if e[i - 1] < f[j - 1] {
                if i == n {
                    return None;
                }
                i += 1;
            } else {
                if j == m {
                    return None;
                }
                j += 1;
            }
        }
        let end = e[i - 1];
        while i < n && e[i] == end {
            i += 1;
        }
        while j < m && f[j] == end {
            j += 1;
        }
        let version = versions[i - 1];
        if i - i0 == 1 && j - j0 == 1 {
            out_logp.push(logp[i0]);
        } else {
            let mass: f64 = logp[i0..i].iter().map(|&x| f64::from(x)).sum();
            let each = (mass / (j - j0) as f64) as f32;
            out_logp.extend(std::iter::repeat_n(each, j - j0));
        }
        out_versions.extend(std::iter::repeat_n(version, j - j0));
    }
    (i == n && j == m).then_some((out_logp, out_versions))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_runtime::trajectory::{ClockStamps, SamplingParams, TerminalReason, TurnBoundary};

    /// The trained BPE of configs/bpe.toml (268 ids; `sort` is one token).
    fn bpe() -> TextTokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/tokenizer/tasks-bpe.json");
        TextTokenizer::Bpe(Arc::new(super::super::bpe::Bpe::load(&path).unwrap()))
    }

    /// A trajectory: the prompt, then each (ids, generated?) segment as a turn; generated
    /// tokens get log-probs -0.25, -0.5, ... and versions 3, 3, 4, 4, ...
    fn sample(prompt: &[TokenId], segments: &[(Vec<TokenId>, bool)]) -> Sample {
        let mut s = Sample {
            instance_id: "p#0".into(),
            group_index: 0,
            session_id: "t/0".into(),
            task: "t".into(),
            prompt_len: prompt.len(),
            tokens: prompt.to_vec(),
            loss_mask: vec![false; prompt.len()],
            behavior_logp: vec![0.0; prompt.len()],
            weight_version: vec![WeightVersion(3); prompt.len()],
            reward: 1.0,
            terminal_reason: TerminalReason::Success,
            turns: Vec::new(),
            clocks: ClockStamps::default(),
            versions: ArtifactVersions::default(),
            sampling: SamplingParams::default(),
        };
        let mut g = 0;
        for (ids, generated) in segments {
            s.turns.push(TurnBoundary {
                start: s.tokens.len(),
            });
            for &id in ids {
                s.tokens.push(id);
                s.loss_mask.push(*generated);
                if *generated {
                    g += 1;
                    s.behavior_logp.push(-0.25 * g as f32);
                    s.weight_version.push(WeightVersion(3 + (g as u64 - 1) / 2));
                } else {
                    s.behavior_logp.push(0.0);
                    s.weight_version.push(WeightVersion(3 + g as u64 / 2));
                }
            }
        }
        s.validate().unwrap();
        s
    }

    fn ids(tok: &TextTokenizer, pieces: &[&str]) -> Vec<TokenId> {
        pieces.iter().flat_map(|p| tok.encode(p).unwrap()).collect()
    }

    #[test]
    fn the_character_tokenizer_round_trips_every_turn_unchanged() {
        let tok = TextTokenizer::Char;
        let s0 = sample(
            &ids(&tok, &["<bos><user>sort 8316<eot><assistant>"]),
            &[
                (ids(&tok, &["<call>3*4</call>"]), true),
                (ids(&tok, &["<observation>12<eot><assistant>"]), false),
                (ids(&tok, &["1368<eot>"]), true),
            ],
        );
        let mut s = s0.clone();
        let c = round_trip(&tok, &mut s, true);
        assert_eq!(s, s0, "bits of every field");
        assert_eq!((c.turns, c.turns_changed, c.turns_retokenized), (2, 0, 0));
        // `<call>` `3` `*` `4` `</call>` and `1` `3` `6` `8` `<eot>`.
        assert_eq!(c.tokens_sampled, 10);
        assert_eq!(c.tokens_trained, 10);
    }

    #[test]
    fn byte_tokens_of_a_merged_word_become_the_merged_token_with_their_summed_logp() {
        let tok = bpe();
        let sort = tok.encode("sort").unwrap();
        assert_eq!(
            sort.len(),
            1,
            "configs/tokenizer/tasks-bpe.json merges `sort`"
        );
        // A turn that samples `s` `o` `r` `t` one byte each, then ` 12<eot>`; an observation;
        // a second turn that round-trips unchanged.
        let bytes = ids(&tok, &["s", "o", "r", "t", " ", "1", "2", "<eot>"]);
        let second = ids(&tok, &["7", "<eot>"]);
        let s0 = sample(
            &ids(&tok, &["<bos><user>sort 21<eot><assistant>"]),
            &[
                (bytes.clone(), true),
                (ids(&tok, &["<observation>ok<eot><assistant>"]), false),
                (second.clone(), true),
            ],
        );
        for retokenize in [false, true] {
            let mut s = s0.clone();
            let c = round_trip(&tok, &mut s, retokenize);
            assert_eq!(
                (c.turns, c.turns_changed),
                (2, 1),
                "retokenize {retokenize}"
            );
            assert_eq!(c.tokens_sampled, 10);
            if !retokenize {
                assert_eq!(s, s0, "counted only");
                assert_eq!((c.turns_retokenized, c.tokens_trained), (0, 10));
                continue;
            }
            assert_eq!((c.turns_retokenized, c.tokens_trained), (1, 7));
            s.validate().unwrap();
            let p = s0.prompt_len;
            let want = ids(&tok, &["sort", " ", "1", "2", "<eot>"]);
            assert_eq!(&s.tokens[p..p + 5], want.as_slice());
            // `sort`: the four bytes' mass -0.25 - 0.5 - 0.75 - 1.0; the rest as sampled, bit
            // for bit; the version of the last byte.
            assert_eq!(s.behavior_logp[p], -2.5);
            assert_eq!(
                &s.behavior_logp[p + 1..p + 5],
                &s0.behavior_logp[p + 4..p + 8]
            );
            assert_eq!(s.weight_version[p], WeightVersion(4));
            assert_eq!(
                &s.weight_version[p + 1..p + 5],
                &s0.weight_version[p + 4..p + 8]
            );
            // The observation and the second turn follow unchanged, three tokens earlier.
            let obs = s0.turns[1].start;
            assert_eq!(s.turns[0].start, p);
            assert_eq!(s.turns[1].start, obs - 3);
            assert_eq!(s.turns[2].start, s0.turns[2].start - 3);
            assert_eq!(&s.tokens[obs - 3..], &s0.tokens[obs..]);
            assert_eq!(&s.loss_mask[obs - 3..], &s0.loss_mask[obs..]);
            assert_eq!(&s.behavior_logp[obs - 3..], &s0.behavior_logp[obs..]);
            // The turn's total log-prob is kept.
            let total = |s: &Sample, r: std::ops::Range<usize>| -> f64 {
                s.behavior_logp[r].iter().map(|&x| f64::from(x)).sum()
            };
            assert_eq!(total(&s, p..p + 5), total(&s0, p..p + 8));
            assert_eq!(second, &s.tokens[s.turns[2].start..]);
        }
    }

    #[test]
    fn a_number_sampled_in_other_pieces_is_re_split_as_the_digit_triples_bpe_splits_it() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/tokenizer/tasks-bpe-digits3.json");
        let tok = TextTokenizer::Bpe(Arc::new(super::super::bpe::Bpe::load(&path).unwrap()));
        // `1924` encodes as `192` `4`; sampled one digit per token, then `<eot>`.
        let canonical = ids(&tok, &["192", "4"]);
        assert_eq!(canonical.len(), 2);
        assert_eq!(tok.encode("1924").unwrap(), canonical);
        let bytes = ids(&tok, &["1", "9", "2", "4", "<eot>"]);
        let s0 = sample(
            &ids(&tok, &["<bos><user>37*52<eot><assistant>"]),
            &[(bytes, true)],
        );
        let mut s = s0.clone();
        let c = round_trip(&tok, &mut s, true);
        assert_eq!((c.turns, c.turns_changed, c.turns_retokenized), (1, 1, 1));
        assert_eq!((c.tokens_sampled, c.tokens_trained), (5, 3));
        s.validate().unwrap();
        let p = s0.prompt_len;
        assert_eq!(
            &s.tokens[p..],
            &[canonical.clone(), ids(&tok, &["<eot>"])].concat()[..]
        );
        // `192`: the mass of `1` `9` `2` (-0.25 - 0.5 - 0.75), the version of `2`; `4` and
        // `<eot>` as sampled, bit for bit.
        assert_eq!(s.behavior_logp[p], -1.5);
        assert_eq!(s.weight_version[p], WeightVersion(4));
        assert_eq!(&s.behavior_logp[p + 1..], &s0.behavior_logp[p + 3..]);
        assert_eq!(&s.weight_version[p + 1..], &s0.weight_version[p + 3..]);
        // The same text sampled canonically round-trips unchanged.
        let s1 = sample(
            &ids(&tok, &["<bos><user>37*52<eot><assistant>"]),
            &[(ids(&tok, &["192", "4", "<eot>"]), true)],
        );
        let mut s = s1.clone();
        let c = round_trip(&tok, &mut s, true);
        assert_eq!((c.turns, c.turns_changed), (1, 0));
        assert_eq!(s, s1);
    }

    #[test]
    fn a_lone_byte_becomes_the_replacement_characters_bytes_sharing_its_logp() {
        let tok = bpe();
        // A byte that is not a character on its own (one of 0x80-0xFF) then `5`: the text is
        // U+FFFD `5`, which encodes as U+FFFD's three bytes and `5`.
        let lone = (0..tok.vocab_size() as TokenId)
            .find(|&id| tok.decode(&[id]).is_ok_and(|t| t == "\u{FFFD}"))
            .unwrap();
        let five = tok.encode("5").unwrap();
        let turn = [vec![lone], five.clone()].concat();
        let text = tok.decode(&turn).unwrap();
        assert_eq!(text, "\u{FFFD}5");
        let again = tok.encode(&text).unwrap();
        assert_ne!(again, turn);
        let (logp, versions) = align(
            &tok,
            &text,
            &turn,
            &[-3.0, -0.125],
            &[WeightVersion(1), WeightVersion(2)],
            &again,
        )
        .unwrap();
        let k = again.len() - 1;
        assert!(k >= 1, "{again:?}");
        assert_eq!(&again[k..], five.as_slice());
        // The lone byte's -3 spread over the replacement character's k tokens; `5` as sampled.
        for &x in &logp[..k] {
            assert_eq!(x, (-3.0f64 / k as f64) as f32);
        }
        assert_eq!(logp[k], -0.125);
        assert_eq!(versions[..k], vec![WeightVersion(1); k][..]);
        assert_eq!(versions[k], WeightVersion(2));
    }

    #[test]
    fn pieces_end_where_both_tokenizations_end() {
        let tok = bpe();
        // `so` `r` `t` against `sort`: one piece; then `9` against `9`.
        let sampled = ids(&tok, &["s", "o", "r", "t", "9"]);
        let text = tok.decode(&sampled).unwrap();
        let again = tok.encode(&text).unwrap();
        assert_eq!(again.len(), 2);
        let logp = [-1.0f32, -2.0, -3.0, -4.0, -0.75];
        let v = [1, 1, 2, 2, 3].map(WeightVersion);
        let (l, w) = align(&tok, &text, &sampled, &logp, &v, &again).unwrap();
        assert_eq!(l, vec![-10.0, -0.75]);
        assert_eq!(w, vec![WeightVersion(2), WeightVersion(3)]);
        // Lengths that do not belong together are refused, not misread.
        assert!(align(&tok, &text, &sampled, &logp[..4], &v, &again).is_none());
        assert!(align(&tok, &text, &[], &[], &[], &again).is_none());
    }
}
