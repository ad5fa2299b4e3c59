//! The tool task's chained problems (`chain_fraction`, `chain_call_fraction`): three-operand
//! problems, the one-operation calculator, the answers they accept, their demonstrations, and
//! the options' errors. A submodule of tests/tasks.rs (its helpers).

use super::{enc, failure, replay, success};
use sluice_kernels::testing::Rng;
use sluice_runtime::env::{Problem, Reply, Split, Task};
use sluice_trainer::tasks::tokenizer::{self, CALL};
use sluice_trainer::tasks::tool::{DemoMix, ToolTask, CHAIN_ENV_VERSION, ENV_VERSION};
use sluice_trainer::tasks::{make, TaskOptions};
use std::collections::BTreeSet;
use std::sync::Arc;

/// The default run's operand sizes (1-2 digits) with chains.
fn chained(chain_fraction: f64, tool_fraction: f64, chain_call_fraction: f64) -> Arc<dyn Task> {
    let o = TaskOptions {
        digits: Some(2),
        min_digits: Some(1),
        tool_fraction: Some(tool_fraction),
        chain_fraction: Some(chain_fraction),
        chain_call_fraction: Some(chain_call_fraction),
        ..TaskOptions::default()
    };
    make("tool", "chain", 64, &o).unwrap()
}

fn operands(p: &Problem) -> Vec<i64> {
    p.spec.split('*').map(|s| s.parse().unwrap()).collect()
}

fn observed(r: Reply) -> String {
    match r {
        Reply::Observe(ids) => tokenizer::decode(&ids).unwrap(),
        other => panic!("expected an observation, got {other:?}"),
    }
}

#[test]
fn chained_problems_mix_two_and_three_operands_and_leave_the_plain_stream_alone() {
    let t = chained(0.5, 0.4, 0.0);
    let mut rng = Rng::new(11);
    let (mut two, mut three) = (0, 0);
    for _ in 0..400 {
        let p = t.problem(&mut rng, Split::Train);
        let ops = operands(&p);
        assert!(ops.iter().all(|x| (1..100).contains(x)), "{}", p.spec);
        match ops.len() {
            2 => two += 1,
            3 => three += 1,
            n => panic!("{n} operands in {}", p.spec),
        }
        assert_eq!(
            p.prompt,
            enc(&format!("<bos><user>{}<eot><assistant>", p.spec))
        );
    }
    // Binomial(400, 0.5): 3 standard deviations are 30.
    assert!(
        (170..=230).contains(&three) && two + three == 400,
        "{two} / {three}"
    );
    // chain_fraction 0 (the option's default) draws exactly the problems of a task without
    // chains, and records the calculator's old version.
    let plain = make(
        "tool",
        "chain",
        64,
        &TaskOptions {
            digits: Some(2),
            min_digits: Some(1),
            ..TaskOptions::default()
        },
    )
    .unwrap();
    let zero = chained(0.0, 1.0, 0.0);
    let (mut a, mut b) = (Rng::new(12), Rng::new(12));
    for _ in 0..100 {
        assert_eq!(
            plain.problem(&mut a, Split::HeldOut),
            zero.problem(&mut b, Split::HeldOut)
        );
    }
    assert_eq!(zero.versions().environment, ENV_VERSION);
    assert_eq!(t.versions().environment, CHAIN_ENV_VERSION);
    // Held-out chained problems never appear in training.
    let (mut a, mut b) = (Rng::new(13), Rng::new(14));
    let only3 = chained(1.0, 0.4, 0.0);
    let train: BTreeSet<String> = (0..600)
        .map(|_| only3.problem(&mut a, Split::Train).spec)
        .collect();
    let held: BTreeSet<String> = (0..600)
        .map(|_| only3.problem(&mut b, Split::HeldOut).spec)
        .collect();
    assert!(train.len() >= 500 && held.len() >= 500);
    assert!(train.is_disjoint(&held));
}

#[test]
fn a_chained_problem_takes_two_calls_of_one_operation_each() {
    let t = chained(1.0, 1.0, 1.0);
    let mut rng = Rng::new(15);
    for _ in 0..50 {
        let p = t.problem(&mut rng, Split::Train);
        let [a, b, c] = operands(&p)[..] else {
            panic!("{}", p.spec)
        };
        let (partial, want) = (a * b, a * b * c);
        let call = |turn: u32, s: &str| observed(t.respond(&p, turn, &enc(s)).unwrap());
        // The whole product in one call is refused; the model may try again.
        assert_eq!(
            call(0, &format!("<call>{a}*{b}*{c}</call>")),
            "<observation>error: one operation per call<eot><assistant>"
        );
        assert_eq!(
            call(0, &format!("<call>({a}*{b})</call>")),
            "<observation>error: one operation per call<eot><assistant>"
        );
        assert_eq!(
            call(0, &format!("<call>{a}*{b}</call>")),
            format!("<observation>{partial}<eot><assistant>")
        );
        assert_eq!(
            call(1, &format!("<call>{partial}*{c}</call>")),
            format!("<observation>{want}<eot><assistant>")
        );
        let r = |turn: u32, s: &str| t.respond(&p, turn, &enc(s)).unwrap();
        // The value alone, or restated from the problem or from its first step.
        assert_eq!(r(2, &format!("{want}<eot>")), success());
        assert_eq!(r(0, &format!("{a}*{b}*{c}={want}<eot>")), success());
        assert_eq!(r(1, &format!("{partial}*{c}={want}<eot>")), success());
        assert_eq!(r(1, &format!("{partial}*{c}={}<eot>", want + 1)), failure());
        if c != 1 {
            assert_eq!(r(1, &format!("{partial}<eot>")), failure());
            // Another expression with the right value is not a restatement of this problem.
            assert_eq!(r(1, &format!("{want}*1={want}<eot>")), failure());
        }
        assert_eq!(r(1, &format!("={want}<eot>")), failure());
    }
    // A two-operand problem of the same task answers as before.
    let p = Problem {
        id: "chain:37*52".into(),
        prompt: enc("<bos><user>37*52<eot><assistant>"),
        spec: "37*52".into(),
    };
    assert_eq!(
        observed(t.respond(&p, 0, &enc("<call>37*52</call>")).unwrap()),
        "<observation>1924<eot><assistant>"
    );
    assert_eq!(t.respond(&p, 1, &enc("1924<eot>")).unwrap(), success());
    assert_eq!(
        t.respond(&p, 0, &enc("37*52=1924<eot>")).unwrap(),
        success()
    );
    // A task without chains refuses a three-operand spec, naming it.
    let plain = chained(0.0, 1.0, 0.0);
    let bad = Problem {
        spec: "2*3*4".into(),
        ..p
    };
    let e = plain.respond(&bad, 0, &enc("24<eot>")).unwrap_err().0;
    assert!(e.contains("2*3*4"), "{e}");
}

#[test]
fn chained_demonstrations_show_a_second_call_at_chain_call_fraction() {
    // (tool_fraction, chain_call_fraction, bounds on one-call and two-call demonstrations
    // among 400 three-operand ones): about 3 standard deviations of the binomials.
    let cases = [
        (0.0, 1.0, (0, 0), (0, 0)),
        (1.0, 0.0, (400, 400), (0, 0)),
        (1.0, 1.0, (0, 0), (400, 400)),
        (0.5, 0.2, (130, 190), (20, 60)),
    ];
    for (tool_fraction, chain_call_fraction, one_in, two_in) in cases {
        let t = ToolTask::with_sizes(
            "chain",
            1,
            2,
            DemoMix {
                tool_fraction,
                wrong_call_fraction: 0.0,
                chain_call_fraction,
            },
        )
        .unwrap()
        .with_chains(1.0)
        .unwrap();
        let mut rng = Rng::new(16);
        let mut calls = [0usize; 3];
        for _ in 0..400 {
            let p = t.problem(&mut rng, Split::Train);
            assert_eq!(operands(&p).len(), 3);
            let d = t.demonstration(&p, &mut rng).unwrap();
            let (turns, reward) = replay(&t, &p, &d);
            assert_eq!(reward, 1.0, "{}", tokenizer::render(&d.tokens));
            let n = d.tokens.iter().filter(|&&x| x == CALL).count();
            assert_eq!(turns, n + 1);
            calls[n] += 1;
            let text = tokenizer::decode(&d.tokens).unwrap();
            let [a, b, c] = operands(&p)[..] else {
                unreachable!()
            };
            let end = match n {
                0 => format!("<assistant>{a}*{b}*{c}={}<eot>", a * b * c),
                1 => format!("<call>{a}*{b}</call>"),
                _ => format!("<call>{}*{c}</call>", a * b),
            };
            assert!(text.contains(&end), "{text}");
        }
        let ok = |n: usize, (lo, hi): (usize, usize)| (lo..=hi).contains(&n);
        assert!(
            ok(calls[1], one_in) && ok(calls[2], two_in),
            "{tool_fraction} / {chain_call_fraction}: {calls:?}"
        );
    }
}

#[test]
fn chain_options_out_of_range_or_on_other_kinds_are_refused() {
    for f in [-0.1, 1.5, f64::NAN] {
        for (key, o) in [
            (
                "chain_fraction",
                TaskOptions {
                    chain_fraction: Some(f),
                    ..TaskOptions::default()
                },
            ),
            (
                "chain_call_fraction",
                TaskOptions {
                    chain_call_fraction: Some(f),
                    ..TaskOptions::default()
                },
            ),
        ] {
            let e = make("tool", "t", 64, &o).err().unwrap();
            assert!(e.contains(key) && e.contains("task t"), "{e}");
        }
    }
    let o = TaskOptions {
        chain_fraction: Some(0.5),
        ..TaskOptions::default()
    };
    let e = make("sort", "s", 64, &o).err().unwrap();
    assert!(e.contains("no option chain_fraction"), "{e}");
}
