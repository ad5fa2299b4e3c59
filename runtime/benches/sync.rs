//! Weight-sync benches (docs/perf/sync.md).
//!
//! First, a table of bytes per publication against the full image, per encoding (every chunk
//! forced to one encoding, and the per-chunk best that the codec chooses), for synthetic
//! updates of a 64 MiB f32 image (16 Mi values ~ N(0, 0.02)) and of its bf16 copy:
//! - a dense step: every value moves by `rel` x 0.02 x N(0, 1) (an optimizer step whose RMS is
//!   `rel` of the weights' RMS), rel = 1e-2, 1e-3, 1e-4;
//! - the bf16 copies (round to nearest even) of the same f32 weights before and after it;
//! - a sparse step: 1% of the f32 values move (rel 1e-3), the rest are untouched;
//! - no change at all.
//!
//! The table is deterministic (fixed seeds); it is printed before the timings.
//!
//! Then criterion timings, in one run so the figures compare: memcpy of the image (one thread
//! and all threads: the machine's memory bandwidth as the codec can use it), blake3 of the
//! image (all threads), `delta::encode` and `delta::apply` (which includes the copy of the
//! base, the decode, and the blake3 of the result and of the delta) per workload, and encode
//! at chunk sizes 64 KiB to 4 MiB; then the stages of one chunk on one thread (scan, byte
//! shuffle, zstd compress and decompress); then the disk path on the small model's weights
//! (`DiskPublisher::publish`: serialise, write, fsync, rename, pointer; `DiskPoller::poll`:
//! read, blake3, parse), in file bytes per second, on the folder of `SLUICE_BENCH_DIR` (default
//! the system temp folder). Throughput is image bytes per second.

use criterion::{BenchmarkId, Criterion, Throughput};
use rayon::prelude::*;
use sluice_kernels::testing::Rng;
use sluice_runtime::sync::chunk::{scan_xor, shuffle, ChunkCodec};
use sluice_runtime::sync::delta::{self, EncodeParams, Image};
use sluice_runtime::sync::{ContentHash, DiskPoller, DiskPublisher, ElemType, Encoding};
use sluice_runtime::trajectory::WeightVersion;
use std::hint::black_box;
use std::time::Duration;

/// f32 values in the image: 64 MiB, far past every cache, so copies run at DRAM speed.
const VALUES: usize = 16 << 20;
const WEIGHT_STD: f64 = 0.02;

struct Workload {
    name: String,
    elem: ElemType,
    base: Vec<u8>,
    new: Vec<u8>,
}

fn weights(seed: u64) -> Vec<f32> {
    // Generated in parallel blocks with their own seeds (a 16 Mi-value serial loop is slow).
    let mut w = vec![0f32; VALUES];
    w.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut rng = Rng::new(seed * 1_000_003 + i as u64);
        for v in c {
            *v = (rng.normal() * WEIGHT_STD) as f32;
        }
    });
    w
}

/// `w` after a step of RMS `rel` x the weights' RMS on the values selected by `every` (1 =
/// all, 100 = one in a hundred).
fn stepped(w: &[f32], rel: f64, every: usize, seed: u64) -> Vec<f32> {
    let mut out = w.to_vec();
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut rng = Rng::new(seed * 7_919 + i as u64);
        for (j, v) in c.iter_mut().enumerate() {
            let step = (rng.normal() * rel * WEIGHT_STD) as f32;
            if ((i << 16) + j) % every == 0 {
                *v += step;
            }
        }
    });
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect()
}

fn workloads() -> Vec<Workload> {
    let w = weights(1);
    let mut out = Vec::new();
    for (k, rel) in [1e-2, 1e-3, 1e-4].into_iter().enumerate() {
        let w2 = stepped(&w, rel, 1, 10 + k as u64);
        out.push(Workload {
            name: format!("f32_dense_{rel:e}"),
            elem: ElemType::F32,
            base: f32_bytes(&w),
            new: f32_bytes(&w2),
        });
        out.push(Workload {
            name: format!("bf16_copy_{rel:e}"),
            elem: ElemType::Bf16,
            base: bf16_bytes(&w),
            new: bf16_bytes(&w2),
        });
    }
    let sparse = stepped(&w, 1e-3, 100, 20);
    out.push(Workload {
        name: "f32_sparse_1pct_1e-3".into(),
        elem: ElemType::F32,
        base: f32_bytes(&w),
        new: f32_bytes(&sparse),
    });
    out.push(Workload {
        name: "f32_unchanged".into(),
        elem: ElemType::F32,
        base: f32_bytes(&w),
        new: f32_bytes(&w),
    });
    out
}

/// Per encoding: the payload bytes if every chunk used it (raw where it is not a candidate),
/// and the chosen per-chunk best; plus the changed-byte count.
struct Sizes {
    forced: [u64; 5],
    best: u64,
    changed: u64,
    chosen: [u64; 5],
}

fn sizes(w: &Workload, chunk: usize, elem: ElemType, level: i32) -> Sizes {
    let per_chunk: Vec<([Option<usize>; 5], usize)> = w
        .base
        .par_chunks(chunk)
        .zip(w.new.par_chunks(chunk))
        .map_init(
            || ChunkCodec::new(level).expect("zstd context"),
            |codec, (b, n)| {
                let changed = b.iter().zip(n).filter(|(x, y)| x != y).count();
                (codec.candidate_sizes(elem, b, n), changed)
            },
        )
        .collect();
    let mut s = Sizes {
        forced: [0; 5],
        best: 0,
        changed: 0,
        chosen: [0; 5],
    };
    for ((cands, changed), b) in per_chunk.iter().zip(w.base.chunks(chunk)) {
        s.changed += *changed as u64;
        let raw = b.len();
        for e in Encoding::ALL {
            s.forced[e.index()] += cands[e.index()].unwrap_or(raw) as u64;
        }
        let (best_e, best) = Encoding::ALL
            .iter()
            .filter_map(|e| cands[e.index()].map(|sz| (*e, sz)))
            .min_by_key(|(e, sz)| (*sz, *e))
            .expect("raw is always a candidate");
        s.best += best as u64;
        s.chosen[best_e.index()] += 1;
    }
    s
}

fn pct(x: u64, full: usize) -> String {
    format!("{:.2}%", 100.0 * x as f64 / full as f64)
}

fn print_size_table(loads: &[Workload]) {
    let chunk = delta::DEFAULT_CHUNK_SIZE;
    println!(
        "\n## Bytes per publication against the full image (chunk {chunk} bytes, zstd level 1)\n"
    );
    println!("| workload | image | bytes changed | pos32 | gap16 | zstd_xor | raw | chosen (per chunk) | chunks chosen |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let row = |name: &str, w: &Workload, chunk: usize, elem: ElemType, level: i32| {
        let s = sizes(w, chunk, elem, level);
        let full = w.new.len();
        let chosen: Vec<String> = Encoding::ALL
            .iter()
            .filter(|e| s.chosen[e.index()] > 0)
            .map(|e| format!("{} {}", e.name(), s.chosen[e.index()]))
            .collect();
        println!(
            "| {name} | {} MiB | {} | {} | {} | {} | {} | {} | {} |",
            full >> 20,
            pct(s.changed, full),
            pct(s.forced[Encoding::Positions32.index()], full),
            pct(s.forced[Encoding::Gaps16.index()], full),
            pct(s.forced[Encoding::ZstdXor.index()], full),
            pct(s.forced[Encoding::Raw.index()], full),
            pct(s.best, full),
            chosen.join(", ")
        );
    };
    for w in loads {
        row(&w.name, w, chunk, w.elem, 1);
    }
    // The choices behind the defaults, on the f32 dense 1e-3 step and its bf16 copy.
    println!("\n## Variants (f32 dense 1e-3 and its bf16 copy)\n");
    println!("| workload | image | bytes changed | pos32 | gap16 | zstd_xor | raw | chosen (per chunk) | chunks chosen |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for name in ["f32_dense_1e-3", "bf16_copy_1e-3"] {
        let w = loads.iter().find(|w| w.name == name).expect("workload");
        row(
            &format!("{name}, no byte shuffle"),
            w,
            chunk,
            ElemType::U8,
            1,
        );
        row(&format!("{name}, zstd level 3"), w, chunk, w.elem, 3);
        for c in [64 << 10, 1 << 20, 4 << 20] {
            row(&format!("{name}, chunk {} KiB", c >> 10), w, c, w.elem, 1);
        }
    }
    println!();
}

fn memory(c: &mut Criterion, image: &[u8]) {
    let mut g = c.benchmark_group("sync_memory");
    g.throughput(Throughput::Bytes(image.len() as u64));
    let mut dst = vec![0u8; image.len()];
    g.bench_function("memcpy_1_thread", |b| {
        b.iter(|| dst.copy_from_slice(black_box(image)))
    });
    g.bench_function("memcpy_all_threads", |b| {
        b.iter(|| {
            dst.par_chunks_mut(1 << 20)
                .zip(black_box(image).par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s))
        })
    });
    g.bench_function("blake3_all_threads", |b| {
        b.iter(|| ContentHash::of(black_box(image)))
    });
    g.finish();
}

fn encode_apply(c: &mut Criterion, loads: &[Workload]) {
    let timed = [
        "f32_dense_1e-3",
        "bf16_copy_1e-3",
        "f32_sparse_1pct_1e-3",
        "f32_unchanged",
    ];
    for w in loads.iter().filter(|w| timed.contains(&w.name.as_str())) {
        let params = EncodeParams {
            elem: w.elem,
            ..EncodeParams::default()
        };
        let (base, new) = (
            Image::new(WeightVersion(1), &w.base),
            Image::new(WeightVersion(2), &w.new),
        );
        let encoded = delta::encode(&params, base, new).expect("encode");
        let mut g = c.benchmark_group("sync_encode");
        g.throughput(Throughput::Bytes(w.new.len() as u64));
        g.bench_function(&w.name, |b| {
            b.iter(|| delta::encode(&params, base, new).expect("encode"))
        });
        g.finish();
        let mut g = c.benchmark_group("sync_apply");
        g.throughput(Throughput::Bytes(w.new.len() as u64));
        let mut out = Vec::new();
        g.bench_function(&w.name, |b| {
            b.iter(|| delta::apply(black_box(&encoded.bytes), base, &mut out).expect("apply"))
        });
        g.finish();
    }
    let w = loads
        .iter()
        .find(|w| w.name == "f32_dense_1e-3")
        .expect("workload");
    let (base, new) = (
        Image::new(WeightVersion(1), &w.base),
        Image::new(WeightVersion(2), &w.new),
    );
    let mut g = c.benchmark_group("sync_encode_chunk_size");
    g.throughput(Throughput::Bytes(w.new.len() as u64));
    for chunk in [64 << 10, 256 << 10, 1 << 20, 4 << 20] {
        let params = EncodeParams {
            chunk_size: chunk,
            ..EncodeParams::default()
        };
        g.bench_with_input(BenchmarkId::from_parameter(chunk >> 10), &params, |b, p| {
            b.iter(|| delta::encode(p, base, new).expect("encode"))
        });
    }
    let params = EncodeParams {
        zstd_level: 3,
        ..EncodeParams::default()
    };
    g.bench_function("256_zstd3", |b| {
        b.iter(|| delta::encode(&params, base, new).expect("encode"))
    });
    g.finish();
}

/// The stages of encoding and applying one chunk, on one thread over the whole f32 dense 1e-3
/// image in default-size chunks: where the encode and apply time goes.
fn stages(c: &mut Criterion, loads: &[Workload]) {
    let w = loads
        .iter()
        .find(|w| w.name == "f32_dense_1e-3")
        .expect("workload");
    let cs = delta::DEFAULT_CHUNK_SIZE;
    let mut xor = vec![0u8; cs];
    let mut planes = vec![0u8; cs];
    let mut frame = vec![0u8; zstd::zstd_safe::compress_bound(cs)];
    let mut g = c.benchmark_group("sync_stages_1_thread");
    g.throughput(Throughput::Bytes(w.new.len() as u64));
    g.bench_function("scan_xor", |b| {
        b.iter(|| {
            for (x, y) in w.base.chunks(cs).zip(w.new.chunks(cs)) {
                black_box(scan_xor(x, y, &mut xor[..x.len()]));
            }
        })
    });
    g.bench_function("shuffle_f32", |b| {
        b.iter(|| {
            for x in w.new.chunks(cs) {
                shuffle(black_box(x), 4, &mut planes[..x.len()]);
            }
        })
    });
    let mut compressor = zstd::bulk::Compressor::new(1).expect("zstd");
    // The shuffled XOR planes of every chunk, compressed once for the decompress bench.
    let mut frames = Vec::new();
    for (x, y) in w.base.chunks(cs).zip(w.new.chunks(cs)) {
        scan_xor(x, y, &mut xor[..x.len()]);
        shuffle(&xor[..x.len()], 4, &mut planes[..x.len()]);
        let n = compressor
            .compress_to_buffer(&planes[..x.len()], &mut frame[..])
            .expect("zstd");
        frames.push(frame[..n].to_vec());
    }
    g.bench_function("zstd1_compress_planes", |b| {
        b.iter(|| {
            for x in w.new.chunks(cs) {
                black_box(
                    compressor
                        .compress_to_buffer(&planes[..x.len()], &mut frame[..])
                        .expect("zstd"),
                );
            }
        })
    });
    let mut decompressor = zstd::bulk::Decompressor::new().expect("zstd");
    g.bench_function("zstd_decompress_planes", |b| {
        b.iter(|| {
            for f in &frames {
                black_box(
                    decompressor
                        .decompress_to_buffer(&f[..], &mut planes[..])
                        .expect("zstd"),
                );
            }
        })
    });
    g.finish();
}

fn disk(c: &mut Criterion) {
    let backend = sluice_kernels::Backend::Cpu;
    let model = sluice_model::Model::new(sluice_model::ModelConfig::small(), &backend).unwrap();
    let dir = std::env::var_os("SLUICE_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("sluice-sync-bench-{}", std::process::id()));
    let mut publisher = DiskPublisher::new(&dir, 2).unwrap();
    let mut version = 0u64;
    let mut publish = || {
        version += 1;
        publisher
            .publish(WeightVersion(version), &model.config, &model.params)
            .unwrap()
    };
    let file = publish().bytes;
    println!(
        "disk: small model, {} parameters, file {} bytes",
        model.params.tensor().numel(),
        file
    );
    let mut g = c.benchmark_group("sync_disk");
    g.throughput(Throughput::Bytes(file));
    g.bench_function("publish_write_fsync", |b| b.iter(|| black_box(publish())));
    g.bench_function("poll_read_verify_parse", |b| {
        b.iter(|| {
            let mut poller = DiskPoller::new(&dir);
            black_box(poller.poll(&backend).unwrap().unwrap())
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    let loads = workloads();
    println!(
        "sync bench: {} rayon threads, image {} MiB f32 / {} MiB bf16",
        rayon::current_num_threads(),
        (VALUES * 4) >> 20,
        (VALUES * 2) >> 20
    );
    print_size_table(&loads);
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    memory(&mut c, &loads[0].base);
    encode_apply(&mut c, &loads);
    stages(&mut c, &loads);
    disk(&mut c);
    c.final_summary();
}
