//! The built-in text tasks: tokenizer round trips and errors, the rewards of hand-written
//! answers, held-out splits, demonstrations replayed through the environment, the tool's
//! answers to malformed programs, and the registry's errors. Runs in well under a second.

use sluice_kernels::testing::Rng;
use sluice_runtime::env::{Demonstration, Problem, Reply, Split, Task};
use sluice_runtime::trajectory::{TerminalReason, TokenId};
use sluice_trainer::tasks::calc::CalcError;
use sluice_trainer::tasks::tokenizer::{
    self, Special, TokenizerError, CALL, END_CALL, EOT, USER, VOCAB_SIZE,
};
use sluice_trainer::tasks::tool::{DemoMix, ToolTask, MAX_CALLS, MAX_OBSERVATION_TOKENS};
use sluice_trainer::tasks::{make, TaskOptions, KINDS};
use std::collections::BTreeSet;
use std::sync::Arc;

fn enc(s: &str) -> Vec<TokenId> {
    tokenizer::encode(s).unwrap()
}

fn success() -> Reply {
    Reply::End {
        reward: 1.0,
        reason: TerminalReason::Success,
    }
}

fn failure() -> Reply {
    Reply::End {
        reward: 0.0,
        reason: TerminalReason::Failure,
    }
}

/// The operands of an `A+B` / `A*B` spec.
fn operands(p: &Problem, op: char) -> (i64, i64) {
    let (a, b) = p.spec.split_once(op).unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

fn arith(digits: u32) -> Arc<dyn Task> {
    let o = TaskOptions {
        digits: Some(digits),
        ..TaskOptions::default()
    };
    make("arith", "add", 64, &o).unwrap()
}

fn sort(digits: u32) -> Arc<dyn Task> {
    let o = TaskOptions {
        digits: Some(digits),
        ..TaskOptions::default()
    };
    make("sort", "sorting", 64, &o).unwrap()
}

fn tool(digits: u32, fraction: f64) -> Arc<dyn Task> {
    let o = TaskOptions {
        digits: Some(digits),
        tool_fraction: Some(fraction),
        ..TaskOptions::default()
    };
    make("tool", "calc", 64, &o).unwrap()
}

// ---- tokenizer ----

#[test]
fn tokenizer_round_trips_every_id_sequence() {
    assert_eq!(tokenizer::vocab_size(), 64);
    let mut rng = Rng::new(11);
    for n in [1, 17, 127] {
        let ids: Vec<TokenId> = (0..n).map(|_| rng.below(VOCAB_SIZE) as TokenId).collect();
        let text = tokenizer::decode(&ids).unwrap();
        assert_eq!(tokenizer::encode(&text).unwrap(), ids, "{text}");
        assert_eq!(tokenizer::render(&ids), text);
    }
    // Specials by name, characters by themselves.
    let ids = enc("<bos><user>12*34<eot><assistant><call>12*34</call>");
    assert_eq!(ids[0], Special::Bos.id());
    assert_eq!(ids[1], USER);
    assert_eq!(ids.len(), 2 + 5 + 2 + 1 + 5 + 1);
    assert_eq!(*ids.last().unwrap(), END_CALL);
    assert_eq!(
        tokenizer::decode(&ids).unwrap(),
        "<bos><user>12*34<eot><assistant><call>12*34</call>"
    );
    for s in Special::ALL {
        assert_eq!(enc(s.text()), vec![s.id()]);
    }
    let text = "error: syntax at 3 (x+y)=[1,2]; ok? yes! 2^3_a%b.c/d-e";
    assert_eq!(tokenizer::decode(&enc(text)).unwrap(), text);
}

#[test]
fn tokenizer_errors_name_the_character_or_id() {
    let e = tokenizer::encode("12A4").unwrap_err();
    assert_eq!(e, TokenizerError::UnknownChar { ch: 'A', at: 2 });
    assert!(e.to_string().contains("'A'"), "{e}");
    let e = tokenizer::encode("1é").unwrap_err();
    assert_eq!(e, TokenizerError::UnknownChar { ch: 'é', at: 1 });
    let e = tokenizer::encode("ab<foo>cd").unwrap_err();
    assert_eq!(
        e,
        TokenizerError::UnknownSpecial {
            text: "<foo>".into(),
            at: 2
        }
    );
    assert!(e.to_string().contains("<call>"), "{e}");
    let e = tokenizer::encode("1<").unwrap_err();
    assert!(matches!(e, TokenizerError::UnknownSpecial { at: 1, .. }));
    assert!(tokenizer::encode("3>2").is_err());
    let e = tokenizer::decode(&[CALL, 64, EOT]).unwrap_err();
    assert_eq!(e, TokenizerError::UnknownId { id: 64, at: 1 });
    assert!(e.to_string().contains("64"), "{e}");
    assert_eq!(tokenizer::render(&[CALL, 64, EOT]), "<call><?64><eot>");
    assert_eq!(tokenizer::plain_text(&enc("12+3")), Some("12+3".into()));
    assert_eq!(tokenizer::plain_text(&enc("12<eot>")), None);
    assert_eq!(tokenizer::plain_text(&[20, 99]), None);
}

// ---- arith ----

#[test]
fn arith_rewards_exactly_the_sum() {
    let t = arith(3);
    assert!(!t.multi_turn());
    let mut rng = Rng::new(1);
    for _ in 0..50 {
        let p = t.problem(&mut rng, Split::Train);
        let (a, b) = operands(&p, '+');
        assert!((0..1000).contains(&a) && (0..1000).contains(&b));
        assert_eq!(
            tokenizer::decode(&p.prompt).unwrap(),
            format!("<bos><user>{a}+{b}<eot><assistant>")
        );
        let sum = a + b;
        let r = |s: &str| t.respond(&p, 0, &enc(s)).unwrap();
        assert_eq!(r(&format!("{sum}<eot>")), success());
        assert_eq!(r(&format!("{}<eot>", sum + 1)), failure());
        assert_eq!(r(&format!("0{sum}<eot>")), failure());
        assert_eq!(r(&format!("{sum} <eot>")), failure());
        assert_eq!(r(&format!("{sum}")), failure());
        assert_eq!(r(&format!("{sum}<eot><eot>")), failure());
        assert_eq!(r(&format!("<call>{a}+{b}</call>")), failure());
        assert_eq!(r("<eot>"), failure());
        assert_eq!(t.respond(&p, 0, &[]).unwrap(), failure());
        assert_eq!(t.respond(&p, 0, &[99, EOT]).unwrap(), failure());
        assert!(t.respond(&p, 1, &enc(&format!("{sum}<eot>"))).is_err());
    }
    let bad = Problem {
        id: "x".into(),
        prompt: vec![1],
        spec: "12*4".into(),
    };
    assert!(t.respond(&bad, 0, &[EOT]).unwrap_err().0.contains("12*4"));
    let long = Problem {
        spec: "1234+5".into(),
        ..bad
    };
    assert!(t.respond(&long, 0, &[EOT]).is_err());
}

// ---- sort ----

#[test]
fn sort_rewards_exactly_the_sorted_digits() {
    let t = sort(7);
    assert!(!t.multi_turn());
    let mut rng = Rng::new(4);
    let mut lengths = BTreeSet::new();
    for _ in 0..60 {
        let p = t.problem(&mut rng, Split::HeldOut);
        lengths.insert(p.spec.len());
        assert_eq!(
            tokenizer::decode(&p.prompt).unwrap(),
            format!("<bos><user>sort {}<eot><assistant>", p.spec)
        );
        let mut want: Vec<char> = p.spec.chars().collect();
        want.sort();
        let want: String = want.into_iter().collect();
        let r = |s: &str| t.respond(&p, 0, &enc(s)).unwrap();
        assert_eq!(r(&format!("{want}<eot>")), success());
        let rev: String = want.chars().rev().collect();
        if rev != want {
            assert_eq!(r(&format!("{rev}<eot>")), failure());
        }
        assert_eq!(r(&format!("{want}0<eot>")), failure());
        assert_eq!(r(&format!("{}<eot>", &want[1..])), failure());
        assert_eq!(r(&want), failure());
        assert!(t.respond(&p, 1, &enc(&format!("{want}<eot>"))).is_err());
    }
    assert_eq!(lengths, (2..=7).collect(), "every length 2..=7 drawn");
    let bad = Problem {
        id: "x".into(),
        prompt: vec![1],
        spec: "12345678".into(),
    };
    assert!(t
        .respond(&bad, 0, &[EOT])
        .unwrap_err()
        .0
        .contains("12345678"));
}

// ---- tool ----

#[test]
fn tool_rewards_a_correct_answer_after_a_call() {
    let t = tool(3, 1.0);
    assert!(t.multi_turn());
    let stop = t.stop();
    assert_eq!(stop.eos, Some(EOT));
    assert_eq!(stop.stop_sequences, vec![vec![END_CALL]]);
    let mut rng = Rng::new(2);
    for _ in 0..50 {
        let p = t.problem(&mut rng, Split::Train);
        let (a, b) = operands(&p, '*');
        assert!((100..1000).contains(&a) && (100..1000).contains(&b));
        let prod = a * b;
        let obs = t
            .respond(&p, 0, &enc(&format!("<call>{a}*{b}</call>")))
            .unwrap();
        assert_eq!(
            obs,
            Reply::Observe(enc(&format!("<observation>{prod}<eot><assistant>")))
        );
        // Scratch text before <call> is allowed; only the program counts.
        let obs2 = t
            .respond(&p, 0, &enc(&format!("hm <call>{b} * {a}</call>")))
            .unwrap();
        assert_eq!(obs2, obs);
        let r = |turn: u32, s: &str| t.respond(&p, turn, &enc(s)).unwrap();
        assert_eq!(r(1, &format!("{prod}<eot>")), success());
        assert_eq!(r(1, &format!("{}<eot>", prod - 1)), failure());
        assert_eq!(r(1, &format!("{prod}")), failure());
        // Answering directly is allowed (it just rarely works for a small model).
        assert_eq!(r(0, &format!("{prod}<eot>")), success());
        assert_eq!(r(0, &format!("{}<eot>", prod + 10)), failure());
    }
}

#[test]
fn tool_operands_span_min_digits_to_digits_and_direct_answers_restate_the_problem() {
    let o = TaskOptions {
        digits: Some(2),
        min_digits: Some(1),
        tool_fraction: Some(0.0),
        ..TaskOptions::default()
    };
    let t = make("tool", "calc", 64, &o).unwrap();
    let mut rng = Rng::new(4);
    let mut sizes = BTreeSet::new();
    for _ in 0..200 {
        let p = t.problem(&mut rng, Split::Train);
        let (a, b) = operands(&p, '*');
        assert!((1..100).contains(&a) && (1..100).contains(&b), "{}", p.spec);
        sizes.insert((a.to_string().len(), b.to_string().len()));
        let prod = a * b;
        let r = |s: &str| t.respond(&p, 0, &enc(s)).unwrap();
        // The product alone, or the problem restated with it; never another restatement.
        assert_eq!(r(&format!("{a}*{b}={prod}<eot>")), success());
        assert_eq!(r(&format!("{prod}<eot>")), success());
        assert_eq!(r(&format!("{b}*{a}={}<eot>", prod + 1)), failure());
        if a != b {
            assert_eq!(r(&format!("{}*{b}={prod}<eot>", a + 1)), failure());
        }
        // Every demonstration answers directly (tool_fraction 0), restating the problem.
        let d = t.demonstration(&p, &mut rng).unwrap();
        let text = tokenizer::decode(&d.tokens).unwrap();
        assert!(
            text.ends_with(&format!("<assistant>{a}*{b}={prod}<eot>")),
            "{text}"
        );
    }
    assert_eq!(
        sizes.len(),
        4,
        "every pair of operand lengths occurs: {sizes:?}"
    );
    // min_digits outside 1..=digits is refused, naming the option.
    for bad in [0, 3] {
        let e = make(
            "tool",
            "calc",
            64,
            &TaskOptions {
                digits: Some(2),
                min_digits: Some(bad),
                ..TaskOptions::default()
            },
        )
        .err()
        .unwrap();
        assert!(e.contains("min_digits"), "{e}");
    }
}

fn observed_text(r: Reply) -> String {
    match r {
        Reply::Observe(ids) => {
            let text = tokenizer::decode(&ids).unwrap();
            let body = text
                .strip_prefix("<observation>")
                .and_then(|s| s.strip_suffix("<eot><assistant>"))
                .unwrap_or_else(|| panic!("not an observation: {text}"));
            body.to_string()
        }
        other => panic!("expected an observation, got {other:?}"),
    }
}

#[test]
fn tool_answers_malformed_calls_with_an_error_observation() {
    let t = tool(2, 1.0);
    let mut rng = Rng::new(3);
    let p = t.problem(&mut rng, Split::Train);
    let call = |turn: u32, ids: &[TokenId]| observed_text(t.respond(&p, turn, ids).unwrap());
    assert_eq!(call(0, &enc("<call>12*</call>")), "error: unexpected end");
    assert_eq!(call(0, &enc("<call>1+*2</call>")), "error: syntax at 2");
    assert_eq!(
        call(1, &enc("<call>7/(3-3)</call>")),
        "error: division by zero"
    );
    assert_eq!(call(0, &enc("<call></call>")), "error: empty program");
    assert_eq!(call(0, &enc("<call>   </call>")), "error: empty program");
    assert_eq!(call(0, &enc("12*34</call>")), "error: no call start");
    assert_eq!(call(0, &enc("</call>")), "error: no call start");
    assert_eq!(
        call(0, &enc("<call>1<user>2</call>")),
        "error: bad token in program"
    );
    assert_eq!(
        call(0, &[CALL, 10, 99, END_CALL]),
        "error: bad token in program"
    );
    assert_eq!(
        call(2, &enc("<call>999999999*999999999*999999999</call>")),
        "error: overflow"
    );
    let deep = format!("<call>{}1{}</call>", "(".repeat(50), ")".repeat(50));
    assert_eq!(call(0, &enc(&deep)), "error: nested too deep");
    let long = format!("<call>{}1</call>", "1+".repeat(200));
    assert_eq!(
        call(0, &enc(&long)),
        "error: program of 401 chars is too long"
    );
    // The longest observations still fit the bound the rollout is told about.
    for program in [
        format!("<call>{}</call>", "9".repeat(1_000_000)),
        "<call>-999999999*999999999*9</call>".to_string(),
        "<call>1+<user></call>".to_string(),
    ] {
        match t.respond(&p, 0, &enc(&program)).unwrap() {
            Reply::Observe(obs) => {
                assert!(obs.len() <= MAX_OBSERVATION_TOKENS, "{}", obs.len())
            }
            other => panic!("{other:?}"),
        }
    }
    // The last <call> of the turn opens the program.
    assert_eq!(call(0, &enc("<call>1+<call>2*3</call>")), "6");
    // Past MAX_CALLS a call ends the episode as `budget`.
    assert_eq!(
        t.respond(&p, MAX_CALLS, &enc("<call>1+1</call>")).unwrap(),
        Reply::End {
            reward: 0.0,
            reason: TerminalReason::Budget
        }
    );
    // A turn with an unfinished call that ends at <eot> is a (wrong) final answer.
    assert_eq!(t.respond(&p, 0, &enc("<call>1+1<eot>")).unwrap(), failure());
    let bad = Problem {
        id: "x".into(),
        prompt: vec![1],
        spec: "1234*5678".into(),
    };
    assert!(t
        .respond(&bad, 0, &[EOT])
        .unwrap_err()
        .0
        .contains("1234*5678"));
}

#[test]
fn every_calculator_error_message_encodes() {
    for e in [
        CalcError::Empty,
        CalcError::TooLong(12345),
        CalcError::Syntax(Some(7)),
        CalcError::Syntax(None),
        CalcError::NumberTooLong(3),
        CalcError::DivisionByZero,
        CalcError::Overflow,
        CalcError::TooDeep,
    ] {
        let text = e.to_string();
        assert!(tokenizer::encode(&text).is_ok(), "{text}");
    }
}

// ---- splits, demonstrations, determinism ----

#[test]
fn held_out_problems_never_appear_in_training() {
    for (t, n) in [
        (arith(3), 600),
        (arith(1), 300),
        (tool(3, 0.5), 600),
        (tool(2, 0.5), 600),
    ] {
        let (mut a, mut b) = (Rng::new(5), Rng::new(6));
        let train: BTreeSet<String> = (0..n)
            .map(|_| t.problem(&mut a, Split::Train).spec)
            .collect();
        let held: BTreeSet<String> = (0..n)
            .map(|_| t.problem(&mut b, Split::HeldOut).spec)
            .collect();
        // Both streams are varied (1-digit sums have only 100 problems, ~50 per split).
        assert!(train.len() >= 40 && held.len() >= 40, "{}", t.name());
        assert!(train.is_disjoint(&held), "{}", t.name());
    }
}

#[test]
fn problems_are_a_function_of_the_rng() {
    for t in [arith(4), tool(3, 0.3)] {
        for split in [Split::Train, Split::HeldOut] {
            let p1 = t.problem(&mut Rng::new(9), split);
            let p2 = t.problem(&mut Rng::new(9), split);
            assert_eq!(p1, p2);
            assert_eq!(p1.id, format!("{}:{}", t.name(), p1.spec));
        }
    }
}

/// Replays a demonstration's model turns through `respond`: every observation must be the
/// demonstration's next given tokens, and the episode must end at its last turn. Returns the
/// number of model turns and the reward.
fn replay(t: &dyn Task, p: &Problem, d: &Demonstration) -> (usize, f32) {
    assert_eq!(d.tokens.len(), d.loss_mask.len());
    assert!(d.tokens.starts_with(&p.prompt));
    assert!(d.loss_mask[..p.prompt.len()].iter().all(|&m| !m));
    // Maximal runs of equal mask after the prompt.
    let mut runs: Vec<(bool, Vec<TokenId>)> = Vec::new();
    for (&tok, &m) in d.tokens[p.prompt.len()..]
        .iter()
        .zip(&d.loss_mask[p.prompt.len()..])
    {
        match runs.last_mut() {
            Some((mm, v)) if *mm == m => v.push(tok),
            _ => runs.push((m, vec![tok])),
        }
    }
    let mut turn = 0;
    let mut i = 0;
    while i < runs.len() {
        let (m, gen) = &runs[i];
        assert!(*m, "a demonstration continues with a model turn");
        match t.respond(p, turn, gen).unwrap() {
            Reply::Observe(obs) => {
                let (m2, given) = &runs[i + 1];
                assert!(!m2);
                assert_eq!(&obs, given, "the observation of turn {turn}");
                i += 2;
                turn += 1;
            }
            Reply::End { reward, reason } => {
                let want = if reward == 1.0 {
                    TerminalReason::Success
                } else {
                    TerminalReason::Failure
                };
                assert_eq!(reason, want);
                assert_eq!(i + 1, runs.len(), "the episode ends at the last turn");
                return (turn as usize + 1, reward);
            }
        }
    }
    panic!("the demonstration never ended the episode");
}

#[test]
fn demonstrations_replay_to_reward_one() {
    let opts = TaskOptions::default;
    let tasks: Vec<(Arc<dyn Task>, usize)> = vec![
        (arith(3), 64),
        (arith(9), 64),
        (sort(2), 64),
        (sort(9), 64),
        (tool(3, 1.0), 64),
        (tool(4, 0.5), 64),
        (tool(3, 0.0), 64),
        (make("recall", "r", 17, &opts()).unwrap(), 17),
        (make("lookup", "l", 127, &opts()).unwrap(), 127),
    ];
    for (t, vocab) in tasks {
        let mut rng = Rng::new(7);
        let mut turns = [0usize; 3];
        for _ in 0..40 {
            let p = t.problem(&mut rng, Split::Train);
            let d = t.demonstration(&p, &mut rng).unwrap();
            assert!(d.tokens.iter().all(|&id| (id as usize) < vocab));
            let (n, reward) = replay(t.as_ref(), &p, &d);
            assert_eq!(reward, 1.0, "{}", tokenizer::render(&d.tokens));
            turns[n.min(2)] += 1;
        }
        // Single-turn tasks answer in one turn; the tool and lookup demonstrations call first.
        let name = t.name().to_string();
        match name.as_str() {
            "add" | "sorting" | "r" => assert_eq!(turns[1], 40, "{name}"),
            "l" => assert_eq!(turns[2], 40, "{name}"),
            _ => assert_eq!(turns[1] + turns[2], 40, "{name}"),
        }
    }
}

#[test]
fn the_demonstration_mix_sets_tool_use_and_wrong_calls() {
    // (tool_fraction, wrong_call_fraction, bounds on tool calls, bounds on wrong calls) of
    // 400 demonstrations; random bounds are about 3 standard deviations of Binomial(400, f)
    // (of Binomial(calls, g) for wrong calls).
    let cases = [
        (0.0, 0.0, (0, 0), (0, 0)),
        (1.0, 0.0, (400, 400), (0, 0)),
        (0.25, 0.0, (70, 130), (0, 0)),
        (1.0, 0.6, (400, 400), (210, 270)),
        (0.5, 1.0, (170, 230), (170, 230)),
    ];
    for (tool_fraction, wrong_call_fraction, calls_in, wrong_in) in cases {
        let mix = DemoMix {
            chain_call_fraction: 0.0,
            tool_fraction,
            wrong_call_fraction,
        };
        let t = ToolTask::new("calc", 2, mix).unwrap();
        let mut rng = Rng::new(8);
        let (mut calls, mut wrong) = (0, 0);
        for _ in 0..400 {
            let p = t.problem(&mut rng, Split::Train);
            let d = t.demonstration(&p, &mut rng).unwrap();
            let (turns, reward) = replay(&t, &p, &d);
            let called = d.tokens.contains(&CALL);
            assert_eq!(turns, 1 + usize::from(called));
            calls += usize::from(called);
            // A wrong call is the sum; its demonstration answers what the tool said and fails.
            let sum = d.tokens.contains(&tokenizer::PLUS);
            wrong += usize::from(sum);
            assert_eq!(reward, if sum { 0.0 } else { 1.0 });
        }
        let ok = |n: usize, (lo, hi): (usize, usize)| (lo..=hi).contains(&n);
        assert!(
            ok(calls, calls_in) && ok(wrong, wrong_in),
            "{mix:?}: {calls} calls, {wrong} wrong of 400"
        );
    }
}

// ---- chained problems ----

#[path = "tasks/tool_chain.rs"]
mod tool_chain;

// ---- registry ----

#[test]
fn the_registry_makes_every_kind_and_names_what_is_wrong() {
    for kind in KINDS {
        // External kinds need their endpoint (nothing is started or contacted here).
        let o = match kind {
            "external" => TaskOptions {
                command: Some("python3".into()),
                ..TaskOptions::default()
            },
            "http" => TaskOptions {
                url: Some("http://127.0.0.1:9/env".into()),
                ..TaskOptions::default()
            },
            _ => TaskOptions::default(),
        };
        let t = make(kind, &format!("my-{kind}"), 64, &o).unwrap();
        assert_eq!(t.name(), format!("my-{kind}"));
    }
    let e = make("external", "x", 64, &TaskOptions::default())
        .err()
        .unwrap();
    assert!(e.contains("needs a command"), "{e}");
    let e = make("http", "x", 64, &TaskOptions::default())
        .err()
        .unwrap();
    assert!(e.contains("needs a url"), "{e}");
    let bad_url = TaskOptions {
        url: Some("https://example.invalid/".into()),
        ..TaskOptions::default()
    };
    let e = make("http", "x", 64, &bad_url).err().unwrap();
    assert!(e.contains("only plain http://"), "{e}");
    let url_on_tool = TaskOptions {
        url: Some("http://127.0.0.1:9/".into()),
        ..TaskOptions::default()
    };
    let e = make("tool", "x", 64, &url_on_tool).err().unwrap();
    assert!(e.contains("no option url"), "{e}");
    let v = make("tool", "t", 64, &TaskOptions::default())
        .unwrap()
        .versions();
    assert_eq!(v.tokenizer, tokenizer::VERSION);
    let err = |kind: &str, vocab: usize, o: TaskOptions| make(kind, "x", vocab, &o).err().unwrap();
    let e = err("calculator", 64, TaskOptions::default());
    assert!(
        e.contains("calculator") && e.contains("arith, sort, tool, recall, lookup"),
        "{e}"
    );
    let e = err(
        "lookup",
        64,
        TaskOptions {
            digits: Some(3),
            ..TaskOptions::default()
        },
    );
    assert!(e.contains("digits") && e.contains("none"), "{e}");
    let e = err(
        "arith",
        64,
        TaskOptions {
            tool_fraction: Some(0.5),
            ..TaskOptions::default()
        },
    );
    assert!(e.contains("tool_fraction") && e.contains("digits"), "{e}");
    let e = err("tool", 32, TaskOptions::default());
    assert!(e.contains("64") && e.contains("32"), "{e}");
    for digits in [0, 10] {
        let e = err(
            "tool",
            64,
            TaskOptions {
                digits: Some(digits),
                ..TaskOptions::default()
            },
        );
        assert!(e.contains("digits"), "{e}");
    }
    for f in [-0.1, 1.5, f64::NAN] {
        let e = err(
            "tool",
            64,
            TaskOptions {
                tool_fraction: Some(f),
                ..TaskOptions::default()
            },
        );
        assert!(e.contains("tool_fraction"), "{e}");
        let e = err(
            "tool",
            64,
            TaskOptions {
                wrong_call_fraction: Some(f),
                ..TaskOptions::default()
            },
        );
        assert!(e.contains("wrong_call_fraction"), "{e}");
    }
    let e = err(
        "recall",
        64,
        TaskOptions {
            wrong_call_fraction: Some(0.5),
            ..TaskOptions::default()
        },
    );
    assert!(
        e.contains("wrong_call_fraction") && e.contains("items"),
        "{e}"
    );
    let e = err(
        "recall",
        64,
        TaskOptions {
            items: Some(0),
            ..TaskOptions::default()
        },
    );
    assert!(e.contains("item"), "{e}");
    let e = err(
        "sort",
        64,
        TaskOptions {
            digits: Some(1),
            ..TaskOptions::default()
        },
    );
    assert!(e.contains("digits") && e.contains("2..=9"), "{e}");
    let e = err("lookup", 7, TaskOptions::default());
    assert!(e.contains('7'), "{e}");
}
