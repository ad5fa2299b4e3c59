//! Checkpoints: bit-exact round trip, readable by the safetensors crate's raw API, and every
//! kind of bad file rejected with an error saying what is wrong, leaving the model untouched.

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sluice_model::checkpoint::{self, CHECKSUMS_KEY, CONFIG_KEY, GROUPS_KEY, VERSION_KEY};
use sluice_model::config::ModelConfig;
use sluice_model::init::fnv1a64;
use sluice_model::kernels::{Backend, DType, Error};
use sluice_model::{Arena, Model};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("sluice-ckpt-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn bits(a: &Arena) -> Vec<u32> {
    a.as_slice().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn model(seed: u64) -> Model {
    let mut cfg = ModelConfig::tiny();
    cfg.seed = seed;
    Model::new(cfg, &Backend::Cpu).unwrap()
}

#[test]
fn round_trip_is_bit_exact() {
    let dir = TempDir::new("roundtrip");
    let p = dir.path("m.safetensors");
    let mut a = model(3);
    // Include values that a lossy path would change: NaN payloads, -0, subnormals, infinities.
    let odd = [
        f32::from_bits(0x7fc0_1234),
        -0.0,
        f32::MIN_POSITIVE / 3.0,
        f32::INFINITY,
    ];
    a.params.view_mut("layers.1.moe.w2").unwrap()[..4].copy_from_slice(&odd);
    a.save(&p).unwrap();
    assert!(!dir.path("m.safetensors.tmp").exists());
    let mut b = model(4);
    assert_ne!(bits(&a.params), bits(&b.params));
    b.load(&p, &Backend::Cpu).unwrap();
    assert_eq!(bits(&a.params), bits(&b.params));
    assert_eq!(b.config, a.config);
    let c = Model::from_checkpoint(&p, &Backend::Cpu).unwrap();
    assert_eq!(bits(&a.params), bits(&c.params));
    assert_eq!(c.config, a.config);
    // Saving the loaded model gives the same file, byte for byte.
    let q = dir.path("again.safetensors");
    c.save(&q).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
}

#[test]
fn standard_readers_see_one_f32_tensor_per_view() {
    let dir = TempDir::new("raw");
    let p = dir.path("m.safetensors");
    let m = model(1);
    m.save(&p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), m.layout().views().len());
    for v in m.layout().views() {
        let t = st.tensor(&v.name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32);
        assert_eq!(t.shape(), v.shape.as_slice());
        let values: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(values.as_slice(), m.params.view(&v.name).unwrap());
    }
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta[VERSION_KEY], "1");
    assert_eq!(meta["sluice.format"], "sluice-checkpoint");
    assert_eq!(ModelConfig::from_json(&meta[CONFIG_KEY]).unwrap(), m.config);
    assert_eq!(checkpoint::read_config(&p).unwrap(), m.config);
}

/// A checkpoint's tensors and metadata, editable, re-serialised with fresh checksums.
struct Parts {
    tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>,
    meta: HashMap<String, String>,
}

fn parts(path: &Path) -> Parts {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    Parts {
        tensors,
        meta: header.metadata().clone().unwrap(),
    }
}

impl Parts {
    fn write(mut self, path: &Path, fresh_checksums: bool) {
        if fresh_checksums {
            let sums: BTreeMap<&String, String> = self
                .tensors
                .iter()
                .map(|(n, (_, _, d))| (n, format!("{:016x}", fnv1a64(d))))
                .collect();
            self.meta
                .insert(CHECKSUMS_KEY.into(), serde_json::to_string(&sums).unwrap());
        }
        let views: Vec<(String, TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(n, (dt, s, d))| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap()))
            .collect();
        std::fs::write(
            path,
            safetensors::serialize(views, Some(self.meta.clone())).unwrap(),
        )
        .unwrap();
    }
}

/// Loads `path` into a fresh tiny model; checks it fails, the message contains every needle,
/// and the model's parameters are unchanged. Returns the error.
fn rejected(path: &Path, needles: &[&str]) -> Error {
    let mut m = model(9);
    let before = bits(&m.params);
    let err = m.load(path, &Backend::Cpu).unwrap_err();
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "error `{msg}` does not mention `{n}`");
    }
    assert_eq!(bits(&m.params), before, "a failed load changed the model");
    assert_eq!(m.config.seed, 9);
    err
}

#[test]
fn truncated_and_corrupt_files_are_rejected() {
    let dir = TempDir::new("corrupt");
    let good = dir.path("good.safetensors");
    model(1).save(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let p = dir.path("bad.safetensors");
    for cut in [0, 4, 8, 40, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        rejected(&p, &["bad.safetensors", "not a valid safetensors file"]);
    }
    // Trailing garbage is not a valid file either.
    let mut long = bytes.clone();
    long.extend_from_slice(&[0; 12]);
    std::fs::write(&p, &long).unwrap();
    rejected(&p, &["not a valid safetensors file"]);
    // A flipped byte in the data: the checksum names the tensor.
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let target =
        st.tensor("layers.0.attn.wk").unwrap().data().as_ptr() as usize - bytes.as_ptr() as usize;
    let mut flipped = bytes.clone();
    flipped[target + 5] ^= 0x10;
    std::fs::write(&p, &flipped).unwrap();
    rejected(&p, &["layers.0.attn.wk", "checksum", "corrupt"]);
    // A flipped byte in the header.
    let mut header = bytes.clone();
    header[10] = b'\x01';
    std::fs::write(&p, &header).unwrap();
    rejected(&p, &["not a valid safetensors file"]);
    // Not a file at all.
    rejected(&dir.path("absent.safetensors"), &["absent.safetensors"]);
}

#[test]
fn mismatched_files_are_rejected_naming_the_problem() {
    let dir = TempDir::new("mismatch");
    let good = dir.path("good.safetensors");
    model(1).save(&good).unwrap();
    let p = dir.path("bad.safetensors");

    // Wrong shape (same element count, so only the shape check can catch it).
    let mut x = parts(&good);
    x.tensors.get_mut("layers.0.attn.wq").unwrap().1 = vec![8, 16];
    x.write(&p, true);
    let e = rejected(&p, &["layers.0.attn.wq", "[16, 8]"]);
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");

    // Missing tensor.
    let mut x = parts(&good);
    x.tensors.remove("final_norm.scale");
    x.write(&p, true);
    let e = rejected(&p, &["final_norm.scale", "missing"]);
    assert!(matches!(e, Error::MissingTensor { .. }), "{e:?}");

    // Unexpected tensor.
    let mut x = parts(&good);
    x.tensors
        .insert("layers.7.attn.wq".into(), (Dtype::F32, vec![1], vec![0; 4]));
    x.write(&p, true);
    rejected(&p, &["layers.7.attn.wq", "unexpected"]);

    // Wrong dtype (BF16 with the F32 byte count halved to a valid BF16 tensor).
    let mut x = parts(&good);
    let (dt, shape, data) = x.tensors.get_mut("lm_head.weight").unwrap();
    *dt = Dtype::BF16;
    data.truncate(shape.iter().product::<usize>() * 2);
    x.write(&p, true);
    let e = rejected(&p, &["lm_head.weight", "F32"]);
    assert!(matches!(e, Error::DType { .. }), "{e:?}");

    // Different config (the architecture differs; the tensors would even fit).
    let mut cfg = ModelConfig::tiny();
    cfg.norm_eps = 1e-6;
    let mut x = parts(&good);
    x.meta.insert(CONFIG_KEY.into(), cfg.to_json());
    x.write(&p, true);
    rejected(&p, &["different model", "norm_eps"]);
    let mut small = Model::new(ModelConfig::small(), &Backend::Cpu).unwrap();
    let before = bits(&small.params);
    let e = small.load(&good, &Backend::Cpu).unwrap_err().to_string();
    assert!(e.contains("different model"), "{e}");
    assert_eq!(bits(&small.params), before);

    // Another format version, or no sluice metadata at all.
    let mut x = parts(&good);
    x.meta.insert(VERSION_KEY.into(), "99".into());
    x.write(&p, true);
    rejected(&p, &["version `99`"]);
    let mut x = parts(&good);
    x.meta.clear();
    x.write(&p, true);
    rejected(&p, &["not a sluice checkpoint"]);
    // A checksum entry missing.
    let mut x = parts(&good);
    x.meta.insert(CHECKSUMS_KEY.into(), "{}".into());
    x.write(&p, false);
    rejected(&p, &[CHECKSUMS_KEY]);
    // A corrupt config in the metadata.
    let mut x = parts(&good);
    x.meta.insert(CONFIG_KEY.into(), "{\"vocab\": 3".into());
    x.write(&p, true);
    rejected(&p, &[CONFIG_KEY]);
}

#[test]
fn a_checkpoint_with_a_different_seed_loads() {
    // seed and init_std are init-only: parameters of one fit a model made with another.
    let dir = TempDir::new("seed");
    let p = dir.path("m.safetensors");
    let mut cfg = ModelConfig::tiny();
    cfg.init_std = 0.05;
    cfg.seed = 11;
    let a = Model::new(cfg, &Backend::Cpu).unwrap();
    a.save(&p).unwrap();
    let mut b = model(0);
    b.load(&p, &Backend::Cpu).unwrap();
    assert_eq!(bits(&a.params), bits(&b.params));
    assert_eq!(b.config.seed, 11);
}

#[test]
fn extra_arenas_round_trip_all_or_nothing() {
    let dir = TempDir::new("extra");
    let p = dir.path("m.safetensors");
    let backend = Backend::Cpu;
    let a = model(2);
    let layout = a.layout().clone();
    let values = |seed: u64| sluice_model::init::initial_values(&layout, seed, 0.02);
    let m1 = Arena::from_f32(&backend, layout.clone(), &values(21)).unwrap();
    let m2 = Arena::from_f32(&backend, layout.clone(), &values(22)).unwrap();
    checkpoint::save_with_extra(
        &p,
        &a.config,
        &a.params,
        &[("adam_m", &m1), ("momentum", &m2)],
    )
    .unwrap();
    let raw = parts(&p);
    assert!(raw.tensors.contains_key("adam_m.layers.0.attn.wq"));
    assert!(raw.tensors.contains_key("momentum.embed.weight"));
    assert_eq!(raw.meta[GROUPS_KEY], "[\"\",\"adam_m\",\"momentum\"]");

    let mut params = Arena::zeros(&backend, layout.clone(), DType::F32).unwrap();
    let mut s1 = Arena::zeros(&backend, layout.clone(), DType::F32).unwrap();
    let mut s2 = Arena::zeros(&backend, layout.clone(), DType::F32).unwrap();
    checkpoint::load_with_extra(
        &p,
        &backend,
        &a.config,
        &mut params,
        &mut [("adam_m", &mut s1), ("momentum", &mut s2)],
    )
    .unwrap();
    assert_eq!(bits(&params), bits(&a.params));
    assert_eq!(bits(&s1), bits(&m1));
    assert_eq!(bits(&s2), bits(&m2));

    // Weights only from a file with optimizer state is fine.
    let mut b = model(5);
    b.load(&p, &backend).unwrap();
    assert_eq!(bits(&b.params), bits(&a.params));

    // A requested group the file lacks is an error; nothing changes.
    let mut fresh = Arena::zeros(&backend, layout.clone(), DType::F32).unwrap();
    let before = bits(&b.params);
    let e = checkpoint::load_with_extra(
        &p,
        &backend,
        &a.config,
        &mut b.params,
        &mut [("adam_v", &mut fresh)],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("adam_v"), "{e}");
    assert_eq!(bits(&b.params), before);

    // A corrupt optimizer-state tensor: params and the other state stay as they were.
    let mut x = parts(&p);
    x.tensors.get_mut("momentum.layers.1.moe.w1").unwrap().2[0] ^= 1;
    let q = dir.path("corrupt.safetensors");
    x.write(&q, false);
    let mut p0 = model(7);
    let (before_p, before_1) = (bits(&p0.params), bits(&s1));
    let e = checkpoint::load_with_extra(
        &q,
        &backend,
        &a.config,
        &mut p0.params,
        &mut [("adam_m", &mut s1), ("momentum", &mut s2)],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("momentum.layers.1.moe.w1") && e.contains("checksum"),
        "{e}"
    );
    assert_eq!(bits(&p0.params), before_p);
    assert_eq!(bits(&s1), before_1);

    // Bad prefixes are refused when saving.
    for bad in ["", "layers", "Adam", "a.b", "embed"] {
        let e = checkpoint::save_with_extra(&q, &a.config, &a.params, &[(bad, &m1)]);
        assert!(e.is_err(), "prefix `{bad}` accepted");
    }
    let e = checkpoint::save_with_extra(&q, &a.config, &a.params, &[("m", &m1), ("m", &m2)]);
    assert!(e.is_err());
}

#[test]
fn caller_metadata_round_trips_and_bad_keys_are_rejected() {
    let dir = TempDir::new("meta");
    let p = dir.path("m.safetensors");
    let backend = Backend::Cpu;
    let a = model(3);
    let meta = [
        ("optim_step", "123456789012".to_string()),
        ("run", "x y".to_string()),
    ];
    checkpoint::save_with_meta(&p, &a.config, &a.params, &[], &meta).unwrap();
    let raw = parts(&p);
    assert_eq!(raw.meta["sluice.meta.optim_step"], "123456789012");
    let mut params = Arena::zeros(&backend, a.layout().clone(), DType::F32).unwrap();
    let (_, got) =
        checkpoint::load_with_meta(&p, &backend, &a.config, &mut params, &mut []).unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got["optim_step"], "123456789012");
    assert_eq!(got["run"], "x y");
    assert_eq!(bits(&params), bits(&a.params));

    for bad in ["", "Step", "a.b", "sluice format"] {
        let q = dir.path("bad.safetensors");
        let e = checkpoint::save_with_meta(&q, &a.config, &a.params, &[], &[(bad, "1".into())])
            .unwrap_err();
        assert!(e.to_string().contains("metadata key"), "{bad}: {e}");
        assert!(!q.exists(), "{bad}: nothing is written");
    }
    let twice = [("k", "1".to_string()), ("k", "2".to_string())];
    let e = checkpoint::save_with_meta(&p, &a.config, &a.params, &[], &twice).unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
}
