//! The run folder's SVG charts: they parse as XML, hold every series, skip lines without their
//! keys, place stages one after another and fail clearly on a bad pass point. Runs in well
//! under a second.

use serde_json::{json, Value};
use sluice_kernels::testing::Rng;
use sluice_trainer::report::plots::{self, PassPoint, FILES};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-plots-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `sft` lines (loss only) then `rl` lines with every key metrics.jsonl documents for two
/// tasks; values are noisy ramps drawn from `rng`.
fn metrics(rng: &mut Rng, sft_steps: u64, rl_steps: u64, tasks: &[&str]) -> Vec<Value> {
    let mut lines = Vec::new();
    for step in 1..=sft_steps {
        lines.push(
            json!({"stage": "sft", "step": step, "time_s": step as f64 * 0.5,
                          "loss": 3.0 / step as f64}),
        );
    }
    let mut lag = vec![0u64; 4];
    for step in 1..=rl_steps {
        let f = step as f64 / rl_steps as f64;
        for (i, n) in lag.iter_mut().enumerate() {
            *n += (200 >> i) + rng.below(50) as u64;
        }
        let mut m = serde_json::Map::new();
        m.insert("stage".into(), json!("rl"));
        m.insert("step".into(), json!(step));
        m.insert("time_s".into(), json!(step as f64 * 1.7));
        m.insert("effective_tokens_per_s".into(), json!(900.0 + 300.0 * f));
        m.insert("raw_tokens_per_s".into(), json!(1400.0 + 200.0 * f));
        m.insert("policy_lag_hist".into(), json!(lag));
        // Every third step without lag-0 tokens (a step after a publication mid-rollout).
        let lag0 = if step % 3 == 0 { 0 } else { 100 + step };
        m.insert("mismatch.lag0.tokens".into(), json!(lag0));
        m.insert("mismatch.lag0.abs_diff_mean".into(), json!(0.0));
        m.insert("mismatch.lag0.k3_kl".into(), json!(0.0));
        m.insert("mismatch.lagpos.tokens".into(), json!(300));
        let d = 0.02 + 0.01 * rng.uniform();
        m.insert("mismatch.lagpos.abs_diff_mean".into(), json!(d));
        m.insert("mismatch.lagpos.k3_kl".into(), json!(d * d / 2.0));
        for (i, t) in tasks.iter().enumerate() {
            let r = (0.2 + 0.7 * f + 0.2 * (rng.uniform() - 0.5)).clamp(0.0, 1.0);
            m.insert(format!("reward_mean_window.{t}"), json!(r));
            m.insert(format!("reward_mean.{t}"), json!(r * 0.9));
            let share = if i == 0 {
                0.5 + 0.2 * (1.0 - f)
            } else {
                0.5 - 0.2 * (1.0 - f)
            };
            m.insert(format!("learner_share.{t}"), json!(share));
        }
        lines.push(Value::Object(m));
    }
    lines
}

fn parse(path: &PathBuf) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text)
        .unwrap_or_else(|e| panic!("{} is not XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    text
}

/// The number of points of each data polyline (the axes' 3-point polyline excluded).
fn polylines(svg: &str) -> Vec<usize> {
    let doc = roxmltree::Document::parse(svg).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") != Some("#333"))
        .map(|n| n.attribute("points").unwrap().split_whitespace().count())
        .collect()
}

fn texts(svg: &str) -> Vec<String> {
    let doc = roxmltree::Document::parse(svg).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").to_string())
        .collect()
}

#[test]
fn every_chart_parses_and_holds_its_series() {
    let mut rng = Rng::new(1);
    let lines = metrics(&mut rng, 17, 127, &["arith", "tool"]);
    let targets = BTreeMap::from([("arith".to_string(), 0.5), ("tool".to_string(), 0.5)]);
    let pass = vec![
        PassPoint {
            task: "tool".into(),
            stage: "rl".into(),
            step: 0,
            pass_rate: 0.3,
        },
        PassPoint {
            task: "tool".into(),
            stage: "rl".into(),
            step: 127,
            pass_rate: 0.9,
        },
        PassPoint {
            task: "arith".into(),
            stage: "rl".into(),
            step: 127,
            pass_rate: 0.6,
        },
    ];
    let dir = temp_dir("all");
    let written = plots::write_all(&dir, &lines, &targets, &pass).unwrap();
    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, FILES.to_vec());
    let svg: BTreeMap<&str, String> = FILES
        .iter()
        .zip(&written)
        .map(|(f, p)| (*f, parse(p)))
        .collect();

    // Reward: per task a raw and a smoothed line over the 127 RL steps, and the pass points.
    let r = &svg["reward.svg"];
    assert_eq!(polylines(r), vec![127; 4]);
    let t = texts(r);
    for label in [
        "arith reward",
        "tool reward",
        "arith held-out pass rate",
        "tool held-out pass rate",
        "sft",
        "rl",
    ] {
        assert!(
            t.iter().any(|x| x == label),
            "reward.svg lacks {label:?}: {t:?}"
        );
    }
    assert_eq!(
        r.matches("<circle").count(),
        3 + 2,
        "3 pass points, 2 legend dots"
    );

    // Throughput: effective and raw over the RL lines (the SFT lines have no such keys).
    let th = &svg["throughput.svg"];
    assert_eq!(polylines(th), vec![127, 127]);
    let t = texts(th);
    assert!(t.iter().any(|x| x.starts_with("effective")), "{t:?}");
    assert!(t.iter().any(|x| x.starts_with("raw")), "{t:?}");

    // Policy lag: one bar per lag of the last line, labelled with its share.
    let lag = &svg["policy_lag.svg"];
    let last = lines.last().unwrap()["policy_lag_hist"]
        .as_array()
        .unwrap()
        .clone();
    let total: f64 = last.iter().map(|v| v.as_f64().unwrap()).sum();
    assert_eq!(
        lag.matches("<rect").count(),
        2 + last.len(),
        "background, clip and bars"
    );
    let t = texts(lag);
    let first = format!("{:.1}%", 100.0 * last[0].as_f64().unwrap() / total);
    assert!(t.contains(&first), "{first} not in {t:?}");

    // Share: a line per task and a dashed target per task.
    let sh = &svg["learner_share.svg"];
    assert_eq!(polylines(sh), vec![127, 127]);
    assert_eq!(sh.matches("stroke-dasharray=\"7 5\"").count(), 2);
    let t = texts(sh);
    for label in ["arith", "tool", "arith target", "tool target"] {
        assert!(
            t.iter().any(|x| x == label),
            "learner_share.svg lacks {label:?}"
        );
    }

    // Mismatch: lag > 0 mean |logp diff| and k3 on every step, the lag-0 ones (dashed) only on
    // the 85 steps that had lag-0 tokens.
    let mm = &svg["mismatch.svg"];
    assert_eq!(polylines(mm), vec![127, 127, 85, 85]);
    let t = texts(mm);
    for label in [
        "lag > 0: mean |logp diff|",
        "lag > 0: k3 KL(behavior || learner)",
        "lag 0: mean |logp diff|",
        "lag 0: k3 KL(behavior || learner)",
    ] {
        assert!(
            t.iter().any(|x| x == label),
            "mismatch.svg lacks {label:?}: {t:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn charts_without_data_are_not_written() {
    let lines = vec![
        json!({"stage": "sft", "step": 1, "loss": 2.0}),
        json!({"step": 2}),
    ];
    let dir = temp_dir("empty");
    // A target alone is a reference level, not data: no share chart either.
    let targets = BTreeMap::from([("tool".to_string(), 0.5)]);
    let written = plots::write_all(&dir, &lines, &targets, &[]).unwrap();
    assert!(written.is_empty(), "{written:?}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_pass_point_of_an_unknown_stage_is_an_error() {
    let mut rng = Rng::new(2);
    let lines = metrics(&mut rng, 0, 5, &["tool"]);
    let pass = [PassPoint {
        task: "tool".into(),
        stage: "rl2".into(),
        step: 3,
        pass_rate: 0.5,
    }];
    let e = plots::write_all(&temp_dir("bad"), &lines, &BTreeMap::new(), &pass).unwrap_err();
    assert!(e.contains("rl2") && e.contains("tool"), "{e}");
}

#[test]
fn repeated_steps_are_drawn_once_and_odd_names_are_escaped() {
    let mut rng = Rng::new(3);
    let name = "a<b>&\"c\"";
    let mut lines = metrics(&mut rng, 0, 17, &[name]);
    // A resumed run that repeated steps 10..=17.
    let again = metrics(&mut rng, 0, 17, &[name]);
    lines.extend(again.into_iter().skip(9));
    let targets = BTreeMap::from([(name.to_string(), 1.0)]);
    let dir = temp_dir("resume");
    let written = plots::write_all(&dir, &lines, &targets, &[]).unwrap();
    assert_eq!(written.len(), 5);
    let share = parse(&written[3]);
    assert_eq!(polylines(&share), vec![17]);
    assert_eq!(share.matches("stroke-dasharray=\"7 5\"").count(), 1);
    assert!(texts(&share).contains(&format!("{name} target")));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn metrics_files_are_read_line_by_line() {
    let dir = temp_dir("read");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("metrics.jsonl");
    std::fs::write(&p, "{\"step\":1}\n\n{\"step\":2}\n").unwrap();
    assert_eq!(plots::read_metrics(&p).unwrap().len(), 2);
    std::fs::write(&p, "{\"step\":1}\n[1]\n").unwrap();
    assert!(plots::read_metrics(&p).unwrap_err().contains("line 2"));
    std::fs::write(&p, "{\"step\":1}\n{oops\n").unwrap();
    assert!(plots::read_metrics(&p).unwrap_err().contains("line 2"));
    std::fs::remove_dir_all(&dir).unwrap();
}
