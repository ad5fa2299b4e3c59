//! Model config: the shipped configs parse, and every bad value is an error naming its key.

use sluice_model::config::{ModelConfig, ScoreFn};
use sluice_model::kernels::Error;
use std::path::PathBuf;

fn config_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../configs/model")
        .join(name)
}

#[test]
fn shipped_configs_match_the_built_in_ones() {
    let small = ModelConfig::from_file(&config_path("small.toml")).unwrap();
    assert_eq!(small, ModelConfig::small());
    let tiny = ModelConfig::from_file(&config_path("tiny.toml")).unwrap();
    assert_eq!(tiny, ModelConfig::tiny());
    assert_eq!(small.dense_ffn_width(), None);
    assert_eq!(tiny.dense_ffn_width(), Some(10));
    assert_eq!(tiny.shared_expert_width(), Some(5));
}

#[test]
fn defaults_fill_optional_keys() {
    let text = "vocab = 64\nd_model = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\n\
                head_dim = 8\nn_experts = 4\ntop_k = 2\nexpert_ffn_dim = 12\n";
    let c = ModelConfig::from_toml_str(text).unwrap();
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.norm_eps, 1e-5);
    assert_eq!(c.score_fn, ScoreFn::Softmax);
    assert!(c.renorm);
    assert!(!c.dense_first_layer && !c.shared_expert);
    assert_eq!(c.seed, 0);
    assert_eq!(c.init_std, 0.02);
    // Defaults of the optional widths.
    let mut d = c.clone();
    d.dense_first_layer = true;
    d.shared_expert = true;
    d.validate().unwrap();
    assert_eq!(d.dense_ffn_width(), Some(24));
    assert_eq!(d.shared_expert_width(), Some(12));
}

#[test]
fn toml_and_json_round_trip() {
    for c in [ModelConfig::small(), ModelConfig::tiny()] {
        let t = c.to_toml_string().unwrap();
        assert_eq!(ModelConfig::from_toml_str(&t).unwrap(), c);
        assert_eq!(ModelConfig::from_json(&c.to_json()).unwrap(), c);
    }
    let mut s = ModelConfig::small();
    s.score_fn = ScoreFn::Sigmoid;
    assert!(s
        .to_toml_string()
        .unwrap()
        .contains("score_fn = \"sigmoid\""));
}

/// Applies `edit` to the small config and checks validation fails naming `model.<key>`.
fn rejects(key: &str, edit: impl FnOnce(&mut ModelConfig)) {
    let mut c = ModelConfig::small();
    edit(&mut c);
    match c.validate() {
        Err(Error::Param { name, message }) => {
            assert_eq!(name, format!("model.{key}"), "message: {message}");
            assert!(!message.is_empty());
            let shown = Error::Param { name, message }.to_string();
            assert!(shown.contains(key), "{shown}");
        }
        other => panic!("editing {key}: expected a Param error naming it, got {other:?}"),
    }
}

#[test]
fn every_bad_value_names_its_key() {
    rejects("vocab", |c| c.vocab = 0);
    rejects("d_model", |c| c.d_model = 0);
    rejects("n_layers", |c| c.n_layers = 0);
    rejects("n_heads", |c| c.n_heads = 0);
    rejects("n_kv_heads", |c| c.n_kv_heads = 0);
    rejects("head_dim", |c| c.head_dim = 0);
    rejects("n_experts", |c| c.n_experts = 0);
    rejects("top_k", |c| c.top_k = 0);
    rejects("expert_ffn_dim", |c| c.expert_ffn_dim = 0);
    rejects("n_kv_heads", |c| c.n_kv_heads = 3);
    rejects("head_dim", |c| c.head_dim = 31);
    rejects("head_dim", |c| c.head_dim = 258);
    rejects("top_k", |c| c.top_k = 9);
    rejects("top_k", |c| {
        c.n_experts = 64;
        c.top_k = 17;
    });
    rejects("n_experts", |c| c.n_experts = 513);
    rejects("vocab", |c| c.vocab = 1 << 40);
    rejects("dense_ffn_dim", |c| c.dense_ffn_dim = Some(64));
    rejects("dense_ffn_dim", |c| {
        c.dense_first_layer = true;
        c.dense_ffn_dim = Some(0);
    });
    rejects("shared_expert_ffn_dim", |c| {
        c.shared_expert_ffn_dim = Some(64)
    });
    rejects("shared_expert_ffn_dim", |c| {
        c.shared_expert = true;
        c.shared_expert_ffn_dim = Some(0);
    });
    rejects("rope_theta", |c| c.rope_theta = 0.5);
    rejects("rope_theta", |c| c.rope_theta = f64::NAN);
    rejects("norm_eps", |c| c.norm_eps = 0.0);
    rejects("norm_eps", |c| c.norm_eps = f64::INFINITY);
    rejects("init_std", |c| c.init_std = -0.02);
}

#[test]
fn limits_themselves_are_accepted() {
    let mut c = ModelConfig::small();
    c.n_experts = 512;
    c.top_k = 16;
    c.d_model = 8;
    c.expert_ffn_dim = 4;
    c.validate().unwrap();
    c.n_experts = 16;
    c.validate().unwrap();
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.validate().unwrap();
}

#[test]
fn absurd_sizes_are_an_error_not_an_overflow() {
    let mut c = ModelConfig::small();
    c.d_model = usize::MAX / 4;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("overflow"), "{e}");
}

fn toml_error(text: &str) -> String {
    match ModelConfig::from_toml_str(text) {
        Err(e) => e.to_string(),
        Ok(c) => panic!("accepted {c:?}"),
    }
}

#[test]
fn unknown_missing_and_mistyped_keys_are_rejected() {
    let good = ModelConfig::small().to_toml_string().unwrap();
    let e = toml_error(&format!("{good}n_expert = 8\n"));
    assert!(e.contains("n_expert"), "{e}");
    let e = toml_error(&good.replace("vocab = 64\n", ""));
    assert!(e.contains("vocab"), "{e}");
    let e = toml_error(&good.replace("n_heads = 4", "n_heads = \"four\""));
    assert!(e.contains("n_heads"), "{e}");
    let e = toml_error(&good.replace("score_fn = \"softmax\"", "score_fn = \"relu\""));
    assert!(e.contains("relu") || e.contains("score_fn"), "{e}");
    // Validation runs after parsing.
    let e = toml_error(&good.replace("top_k = 2", "top_k = 9"));
    assert!(e.contains("model.top_k"), "{e}");
}

#[test]
fn a_file_error_names_the_file() {
    let dir = std::env::temp_dir().join(format!("sluice-model-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("bad.toml");
    let text = ModelConfig::small()
        .to_toml_string()
        .unwrap()
        .replace("head_dim = 32", "head_dim = 33");
    std::fs::write(&p, text).unwrap();
    let e = ModelConfig::from_file(&p).unwrap_err().to_string();
    assert!(
        e.contains("model.head_dim") && e.contains("bad.toml"),
        "{e}"
    );
    let e = ModelConfig::from_file(&dir.join("absent.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.toml"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn architecture_diff_ignores_init_keys_and_names_the_rest() {
    let a = ModelConfig::small();
    let mut b = a.clone();
    b.seed = 7;
    b.init_std = 0.5;
    assert_eq!(a.architecture_diff(&b), None);
    b.n_experts = 16;
    let d = a.architecture_diff(&b).unwrap();
    assert!(d.starts_with("n_experts"), "{d}");
    // An explicit default width is the same architecture as an omitted one.
    let mut t = ModelConfig::tiny();
    t.shared_expert_ffn_dim = None;
    let mut u = t.clone();
    u.shared_expert_ffn_dim = Some(t.expert_ffn_dim);
    assert_eq!(t.architecture_diff(&u), None);
}
