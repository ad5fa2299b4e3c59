//! Every op of the kernel runner at a fixed set of shapes, with inputs from a fixed seed: the
//! op workloads of `sluice determinism run`.
//!
//! Each case names its inputs and parameters as `sluice kernel` takes them and runs through the
//! runner's own validation and dispatch (`runner::find`, `OpCall`, the op's `run`), so what is
//! digested is exactly what `sluice kernel OP` computes. Float inputs come from the benches'
//! generator ([`sluice_kernels::bench_cases::random`]: element i a hash of the seed and i,
//! uniform in [-4, 4)), seeded by a hash of the op, the case and the tensor's name, so a case's
//! inputs do not depend on which other cases run. Shapes are small (the emulator runs them all
//! in seconds) but cross the places where an op's path changes: K past one 256-chunk and M past
//! the 64-row small-row path (gemm), sequences past one 32-key chunk (attention, paged decode),
//! several cache blocks, continuation chunks of the prefill, more than one 8192-element chunk
//! (sq_norm), ties (topk), greedy and truncated sampling.

use super::workloads::Output;
use sluice_kernels::bench_cases::random;
use sluice_kernels::runner::{self, OpCall};
use sluice_kernels::{Backend, DType, Result, Tensor};
use std::collections::BTreeMap;

/// The named inputs and parameters of one case, built on the backend it runs on.
pub struct Inputs<'a> {
    backend: &'a Backend,
    salt: String,
    tensors: BTreeMap<String, Tensor>,
    params: BTreeMap<String, String>,
}

/// FNV-1a of a string: the seed of one input tensor.
pub fn seed_of(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Host values of [`random`] (uniform in [-4, 4)) for a seed.
pub fn host_values(n: usize, seed: u64) -> Result<Vec<f32>> {
    random(&Backend::Cpu, &[n], DType::F32, seed)?.to_f32_vec()
}

impl<'a> Inputs<'a> {
    fn new(backend: &'a Backend, op: &str, case: &str) -> Inputs<'a> {
        Inputs {
            backend,
            salt: format!("{op}/{case}"),
            tensors: BTreeMap::new(),
            params: BTreeMap::new(),
        }
    }

    fn seed(&self, name: &str) -> u64 {
        seed_of(&format!("{}/{name}", self.salt))
    }

    /// A float tensor of [`random`] values.
    fn float(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<&mut Self> {
        let t = random(self.backend, shape, dtype, self.seed(name))?;
        self.tensors.insert(name.to_string(), t);
        Ok(self)
    }

    /// A float tensor of [`random`] values passed through `f` (on the host).
    fn float_with(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        f: impl Fn(f32) -> f32,
    ) -> Result<&mut Self> {
        let n = shape.iter().product();
        let v: Vec<f32> = host_values(n, self.seed(name))?
            .into_iter()
            .map(f)
            .collect();
        let t = Tensor::from_f32_as(self.backend, shape, dtype, &v)?;
        self.tensors.insert(name.to_string(), t);
        Ok(self)
    }

    /// An integer (I32, U64 or U8) tensor of the given values.
    fn ints<T: sluice_kernels::Element>(
        &mut self,
        name: &str,
        shape: &[usize],
        data: &[T],
    ) -> Result<&mut Self> {
        let t = Tensor::from_slice(self.backend, shape, data)?;
        self.tensors.insert(name.to_string(), t);
        Ok(self)
    }

    /// `n` ids in `0..below`, from this tensor's seed.
    fn ids(&mut self, name: &str, n: usize, below: usize) -> Result<&mut Self> {
        let mut rng = sluice_kernels::testing::Rng::new(self.seed(name));
        let v: Vec<i32> = (0..n).map(|_| rng.below(below) as i32).collect();
        self.ints(name, &[n], &v)
    }

    fn param(&mut self, name: &str, value: &str) -> &mut Self {
        self.params.insert(name.to_string(), value.to_string());
        self
    }
}

type Build = Box<dyn Fn(&mut Inputs) -> Result<()> + Send + Sync>;

/// One op at one shape.
pub struct OpCase {
    pub op: &'static str,
    pub case: String,
    build: Build,
}

fn case(
    op: &'static str,
    case: impl Into<String>,
    build: impl Fn(&mut Inputs) -> Result<()> + Send + Sync + 'static,
) -> OpCase {
    OpCase {
        op,
        case: case.into(),
        build: Box::new(build),
    }
}

fn dname(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

const FLOATS: [DType; 2] = [DType::F32, DType::BF16];

/// A sampling case: logits dtype, label, and its parameters.
type SampleCase = (DType, &'static str, [(&'static str, &'static str); 3]);

/// Every case of every runner op, in `sluice kernel --list` order.
pub fn cases() -> Vec<OpCase> {
    let mut v = Vec::new();
    for dt in FLOATS {
        v.push(case(
            "gemm",
            format!("{} M=17 N=33 K=64", dname(dt)),
            move |i| {
                i.float("a", &[17, 64], dt)?.float("b", &[33, 64], dt)?;
                Ok(())
            },
        ));
    }
    v.push(case("gemm", "f32 M=129 N=40 K=300", |i| {
        i.float("a", &[129, 300], DType::F32)?
            .float("b", &[40, 300], DType::F32)?;
        Ok(())
    }));
    for dt in FLOATS {
        v.push(case(
            "topk",
            format!("{} T=37 E=64 k=4", dname(dt)),
            move |i| {
                i.float("scores", &[37, 64], dt)?.param("k", "4");
                Ok(())
            },
        ));
    }
    v.push(case("topk", "f32 ties T=37 E=64 k=6", |i| {
        // Scores on a grid of 0.5: many equal values, so the lower-index rule decides.
        i.float_with("scores", &[37, 64], DType::F32, |x| (x * 0.5).round())?
            .param("k", "6");
        Ok(())
    }));
    let sample_params: [SampleCase; 3] = [
        (
            DType::F32,
            "t=1",
            [("temperature", "1"), ("top_k", "0"), ("top_p", "1")],
        ),
        (
            DType::BF16,
            "t=0.7 top_k=50 top_p=0.9",
            [("temperature", "0.7"), ("top_k", "50"), ("top_p", "0.9")],
        ),
        (
            DType::F32,
            "greedy",
            [("temperature", "0"), ("top_k", "0"), ("top_p", "1")],
        ),
    ];
    for (dt, label, ps) in sample_params {
        v.push(case(
            "sample",
            format!("{} B=8 V=1000 {label}", dname(dt)),
            move |i| {
                let ids: Vec<u64> = (0..8).map(|r| 1000 + 7 * r).collect();
                let pos: Vec<i32> = (0..8).map(|r| 3 + r).collect();
                i.float("logits", &[8, 1000], dt)?
                    .ints("request_ids", &[8], &ids)?
                    .ints("positions", &[8], &pos)?
                    .param("seed", "7");
                for (k, val) in ps {
                    i.param(k, val);
                }
                Ok(())
            },
        ));
    }
    for (dt, mode) in [(DType::F32, "dis"), (DType::BF16, "icepop")] {
        v.push(case(
            "is_gate_loss",
            format!("{} {mode} N=24 V=300", dname(dt)),
            move |i| {
                let mask: Vec<f32> = (0..24)
                    .map(|r| if r % 5 == 3 { 0.0 } else { 1.0 })
                    .collect();
                i.float("logits", &[24, 300], dt)?
                    .ids("tokens", 24, 300)?
                    .float_with("behavior_logp", &[24], DType::F32, |x| -7.0 + 0.05 * x)?
                    .float_with("advantages", &[24], DType::F32, |x| 0.25 * x)?
                    .ints("mask", &[24], &mask)?
                    .param("mode", mode);
                Ok(())
            },
        ));
    }
    v.push(case(
        "newton_schulz",
        "f32 n=3 [16,40] precision=f32",
        |i| {
            i.float("g", &[3, 16, 40], DType::F32)?;
            Ok(())
        },
    ));
    v.push(case(
        "newton_schulz",
        "bf16 n=2 [24,16] precision=bf16",
        |i| {
            i.float("g", &[2, 24, 16], DType::BF16)?
                .param("precision", "bf16");
            Ok(())
        },
    ));
    let moe_inputs = |i: &mut Inputs, dt: DType| -> Result<()> {
        i.float("x", &[24, 32], dt)?
            .float_with("w_router", &[4, 32], dt, |x| 0.1 * x)?
            .float_with("w1", &[4, 16, 32], dt, |x| 0.1 * x)?
            .float_with("w3", &[4, 16, 32], dt, |x| 0.1 * x)?
            .float_with("w2", &[4, 32, 16], dt, |x| 0.1 * x)?
            .param("k", "2");
        Ok(())
    };
    for (dt, label, score) in [
        (DType::F32, "softmax", "softmax"),
        (DType::BF16, "softmax", "softmax"),
        (DType::F32, "sigmoid renorm=false", "sigmoid"),
    ] {
        let sigmoid = score == "sigmoid";
        v.push(case(
            "moe_forward",
            format!("{} T=24 d=32 E=4 f=16 k=2 {label}", dname(dt)),
            move |i| {
                moe_inputs(i, dt)?;
                if sigmoid {
                    i.param("score_fn", "sigmoid").param("renorm", "false");
                }
                Ok(())
            },
        ));
        v.push(case(
            "moe_backward",
            format!("{} T=24 d=32 E=4 f=16 k=2 {label}", dname(dt)),
            move |i| {
                moe_inputs(i, dt)?;
                i.float("dy", &[24, 32], dt)?;
                if sigmoid {
                    i.param("score_fn", "sigmoid").param("renorm", "false");
                }
                Ok(())
            },
        ));
    }
    // Three sequences of 5, 12 and 40 tokens (the last past one 32-key chunk), GQA 4:2.
    let attn_inputs = |i: &mut Inputs, dt: DType| -> Result<()> {
        i.float("q", &[57, 4, 16], dt)?
            .float("k", &[57, 2, 16], dt)?
            .float("v", &[57, 2, 16], dt)?
            .ints("cu_seqlens", &[4], &[0i32, 5, 17, 57])?;
        Ok(())
    };
    for dt in FLOATS {
        v.push(case(
            "attention_forward",
            format!("{} lens 5,12,40 H=4 Hkv=2 D=16", dname(dt)),
            move |i| attn_inputs(i, dt),
        ));
        v.push(case(
            "attention_backward",
            format!("{} lens 5,12,40 H=4 Hkv=2 D=16", dname(dt)),
            move |i| {
                attn_inputs(i, dt)?;
                i.float("dout", &[57, 4, 16], dt)?;
                Ok(())
            },
        ));
    }
    for dt in FLOATS {
        v.push(case(
            "paged_attention",
            format!("{} ctx 5,33,50 BS=16 H=4 Hkv=2 D=16", dname(dt)),
            move |i| {
                let table = [7i32, 0, 0, 0, 2, 9, 4, 0, 1, 3, 5, 8];
                i.float("q", &[3, 4, 16], dt)?
                    .float("k_cache", &[10, 16, 2, 16], dt)?
                    .float("v_cache", &[10, 16, 2, 16], dt)?
                    .ints("block_table", &[3, 4], &table)?
                    .ints("context_lens", &[3], &[5i32, 33, 50])?;
                Ok(())
            },
        ));
    }
    let rows = |op: &'static str, extra: &'static [(&'static str, bool)]| {
        FLOATS.map(move |dt| {
            case(op, format!("{} [24,48]", dname(dt)), move |i| {
                for &(name, is_vector) in extra {
                    if is_vector {
                        i.float(name, &[48], dt)?;
                    } else {
                        i.float(name, &[24, 48], dt)?;
                    }
                }
                Ok(())
            })
        })
    };
    v.extend(rows("rmsnorm", &[("x", false), ("w", true)]));
    v.extend(rows(
        "rmsnorm_backward",
        &[("x", false), ("w", true), ("dy", false)],
    ));
    let positions: Vec<i32> = (0..24).map(|t| (t * 7) % 19).collect();
    for dt in FLOATS {
        let pos = positions.clone();
        v.push(case("rope", format!("{} [24,4,16]", dname(dt)), move |i| {
            i.float("x", &[24, 4, 16], dt)?
                .ints("positions", &[24], &pos)?;
            Ok(())
        }));
        let pos = positions.clone();
        v.push(case(
            "rope_backward",
            format!("{} [24,4,16]", dname(dt)),
            move |i| {
                i.float("dy", &[24, 4, 16], dt)?
                    .ints("positions", &[24], &pos)?;
                Ok(())
            },
        ));
    }
    let pairs = |op: &'static str, names: &'static [&'static str]| {
        FLOATS.map(move |dt| {
            case(op, format!("{} [24,40]", dname(dt)), move |i| {
                for n in names {
                    i.float(n, &[24, 40], dt)?;
                }
                Ok(())
            })
        })
    };
    v.extend(pairs("swiglu", &["a", "b"]));
    v.extend(pairs("swiglu_backward", &["a", "b", "dh"]));
    for dt in FLOATS {
        v.push(case(
            "embedding",
            format!("{} V=50 d=24 T=30", dname(dt)),
            move |i| {
                i.float("table", &[50, 24], dt)?.ids("tokens", 30, 50)?;
                Ok(())
            },
        ));
        v.push(case(
            "embedding_backward",
            format!("{} V=50 d=24 T=30", dname(dt)),
            move |i| {
                // 30 tokens over 12 ids: repeats, summed in ascending t.
                i.float("dout", &[30, 24], dt)?
                    .ids("tokens", 30, 12)?
                    .param("vocab", "50");
                Ok(())
            },
        ));
    }
    v.extend(pairs("residual_add", &["a", "b"]));
    for dt in FLOATS {
        v.push(case(
            "softmax",
            format!("{} [24,100]", dname(dt)),
            move |i| {
                i.float("x", &[24, 100], dt)?;
                Ok(())
            },
        ));
        v.push(case(
            "softmax_backward",
            format!("{} [24,100]", dname(dt)),
            move |i| {
                i.float_with("y", &[24, 100], dt, |x| (x + 4.0) / 800.0)?
                    .float("dy", &[24, 100], dt)?;
                Ok(())
            },
        ));
        v.push(case(
            "transpose",
            format!("{} [33,17]", dname(dt)),
            move |i| {
                i.float("x", &[33, 17], dt)?;
                Ok(())
            },
        ));
    }
    for dt in FLOATS {
        v.push(case(
            "kv_append",
            format!("{} T=6 into [4,16,2,16]", dname(dt)),
            move |i| {
                i.float("k_new", &[6, 2, 16], dt)?
                    .float("v_new", &[6, 2, 16], dt)?
                    .ints("slot_mapping", &[6], &[3i32, 17, -1, 40, 41, 63])?
                    .float("k_cache", &[4, 16, 2, 16], dt)?
                    .float("v_cache", &[4, 16, 2, 16], dt)?;
                Ok(())
            },
        ));
        // Sequence 0: a first chunk of 5 tokens; sequence 1: 7 tokens after 20 cached ones.
        v.push(case(
            "paged_prefill",
            format!("{} chunks 5 (new), 7 (after 20 cached)", dname(dt)),
            move |i| {
                i.float("q", &[12, 4, 16], dt)?
                    .float("k_cache", &[4, 16, 2, 16], dt)?
                    .float("v_cache", &[4, 16, 2, 16], dt)?
                    .ints("block_table", &[2, 2], &[3i32, 0, 1, 2])?
                    .ints("cu_seqlens", &[3], &[0i32, 5, 12])?
                    .ints("context_lens", &[2], &[5i32, 27])?;
                Ok(())
            },
        ));
    }
    v.push(case("adamw", "f32 N=5000", |i| {
        i.float("p", &[5000], DType::F32)?
            .float("g", &[5000], DType::F32)?
            .float_with("m", &[5000], DType::F32, |x| 0.1 * x)?
            .float_with("v", &[5000], DType::F32, |x| 0.01 * x * x)?
            .param("step", "3");
        Ok(())
    }));
    v.push(case("sq_norm", "f32 N=20000", |i| {
        i.float("x", &[20000], DType::F32)?;
        Ok(())
    }));
    let blocks = |i: &mut Inputs| -> Result<()> {
        i.ints("offsets", &[3], &[0i32, 100, 300])?
            .ints("row_strides", &[3], &[20i32, 12, 10])?;
        Ok(())
    };
    v.push(case("muon_gather", "f32 N=600 3 blocks [4,10]", move |i| {
        i.float("g", &[600], DType::F32)?
            .float("mom", &[600], DType::F32)?
            .param("r", "4")
            .param("c", "10");
        blocks(i)
    }));
    v.push(case("muon_apply", "f32 N=600 3 blocks [4,10]", move |i| {
        i.float("p", &[600], DType::F32)?
            .float("x", &[3, 4, 10], DType::F32)?;
        blocks(i)
    }));
    v.push(case("cast_bf16", "f32 N=1000", |i| {
        i.float("x", &[1000], DType::F32)?;
        Ok(())
    }));
    v
}

/// Runs one case on `backend` through the runner; returns its outputs, digest-ready.
pub fn run_case(backend: &Backend, c: &OpCase) -> Result<Vec<Output>> {
    let spec = runner::find(c.op)?;
    let mut inputs = Inputs::new(backend, c.op, &c.case);
    (c.build)(&mut inputs)?;
    let call = OpCall::new(spec, inputs.tensors, inputs.params)?;
    let outputs = (spec.run)(backend, &call)?;
    outputs
        .into_iter()
        .map(|(name, t)| Output::of_tensor(c.op, &c.case, name, &t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every runner op has at least one case, and every case names a runner op.
    #[test]
    fn every_runner_op_has_a_case() {
        let all = cases();
        for op in runner::ops() {
            assert!(
                all.iter().any(|c| c.op == op.name),
                "no determinism case for `{}`",
                op.name
            );
        }
        let mut keys: Vec<String> = all.iter().map(|c| format!("{} {}", c.op, c.case)).collect();
        let n = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), n, "two cases with one name");
    }
}
