//! What `sluice emu profile` prints and writes: a table per kernel, the ten worst source lines
//! (most L1 wavefronts), the op's FLOPs against the tensor cores' and the bound; and the JSON
//! record (docs/emulator.md, "Profiling", has its keys).

use super::bound::{self, Bound};
use super::OpProfile;
use crate::emu::profile::{Counters, KernelProfile};
use serde_json::{json, Map, Value};

/// A count as JSON: integers stay integers; unknown (NaN) is null.
fn number(v: f64) -> Value {
    if !v.is_finite() {
        Value::Null
    } else if v.fract() == 0.0 && v.abs() < 9.0e15 {
        json!(v as i64)
    } else {
        json!(v)
    }
}

fn counters_json(c: &Counters) -> Map<String, Value> {
    let mut m = Map::new();
    for (k, v) in &c.values {
        m.insert((*k).to_string(), number(*v));
    }
    let tensor: Map<String, Value> = c
        .tensor_instructions
        .iter()
        .map(|(k, v)| (k.clone(), number(*v)))
        .collect();
    m.insert("tensor_instructions".into(), Value::Object(tensor));
    m
}

/// The op's totals over its kernels.
pub fn op_totals(p: &OpProfile) -> Counters {
    let mut c = Counters::default();
    for k in &p.kernels {
        c.add(&k.totals);
    }
    c
}

/// Tensor FLOPs, the share of the op's useful FLOPs they cover, and the FLOPs issued beyond the
/// op's math (masked tiles, padding).
pub fn tensor_share(p: &OpProfile) -> (f64, f64, f64) {
    let tensor = op_totals(p).get("tensor_flops");
    if p.op_flops.is_nan() {
        // The op's math is unknown (inputs from a file, one kernel of `emu check`).
        return (tensor, f64::NAN, f64::NAN);
    }
    if p.op_flops <= 0.0 {
        return (tensor, 0.0, tensor);
    }
    let share = (tensor / p.op_flops).min(1.0);
    let wasted = (tensor - p.op_flops).max(0.0);
    (tensor, share, wasted)
}

fn kernel_json(k: &KernelProfile) -> Value {
    let mut lines: Vec<(&String, &Counters)> = k.lines.iter().collect();
    lines.sort_by(|a, b| a.0.cmp(b.0));
    let lines: Vec<Value> = lines
        .into_iter()
        .map(|(site, c)| {
            let mut m = counters_json(c);
            m.insert("site".into(), json!(site));
            Value::Object(m)
        })
        .collect();
    let occupancy = bound::occupancy(k).map(|o| {
        json!({
            "model": "sm_90a limits and ptx/RESOURCES.txt (registers, static shared memory); a model",
            "blocks_per_sm": o.blocks_per_sm,
            "warps_per_sm": o.warps_per_sm,
            "limit": o.limit,
            "registers": o.regs,
            "shared_bytes_per_block": o.shared_bytes_per_block,
            "waves": number(o.waves),
        })
    });
    json!({
        "name": k.name,
        "grid": k.grid,
        "block": k.block,
        "shared_bytes": k.shared_bytes,
        "blocks_total": k.blocks_total,
        "blocks_profiled": k.blocks_profiled,
        "totals": Value::Object(counters_json(&k.totals)),
        "lines": lines,
        "buffers": k.buffers.iter().map(|b| json!({
            "param": b.param, "bytes": b.bytes,
            "unique_read": b.unique_read, "unique_written": b.unique_written,
        })).collect::<Vec<_>>(),
        "occupancy": occupancy.unwrap_or(Value::Null),
    })
}

fn bound_json(b: &Bound) -> Value {
    json!({
        "model": format!(
            "a lower bound on H200 time, the largest of: DRAM bytes / {:.1} TB/s; mma.sync FLOPs / {:.0} TFLOP/s + wgmma FLOPs / {:.0} TFLOP/s; special-function calls / (132 SMs x {} per clock); L1 wavefronts / (132 SMs x {} per clock); at {:.2} GHz",
            bound::DRAM_BYTES_PER_S / 1e12,
            bound::MMA_SYNC_FLOPS / 1e12,
            bound::WGMMA_FLOPS / 1e12,
            bound::SFU_PER_CLOCK_PER_SM,
            bound::L1_WAVEFRONTS_PER_CLOCK_PER_SM,
            bound::CLOCK_HZ / 1e9
        ),
        "seconds": b.seconds,
        "binding": b.binding,
        "terms": {
            "dram_s": b.dram_s,
            "dram_bytes": number(b.dram_bytes),
            "dram_basis": b.dram_basis,
            "tensor_s": b.tensor_s,
            "special_functions_s": b.sfu_s,
            "l1_wavefronts_s": b.l1_s,
        },
    })
}

/// The JSON record of one op's profile.
pub fn to_json(p: &OpProfile) -> Value {
    let (tensor, share, wasted) = tensor_share(p);
    let b = bound::bound(&p.kernels, p.compulsory_bytes);
    json!({
        "op": p.op,
        "preset": p.preset,
        "shape": p.shape,
        "kernels": p.kernels.iter().map(kernel_json).collect::<Vec<_>>(),
        "op_flops": number(p.op_flops),
        "tensor_flops": number(tensor),
        "tensor_share": share,
        "wasted_tensor_flops": number(wasted),
        "compulsory_bytes": number(p.compulsory_bytes),
        "totals": Value::Object(counters_json(&op_totals(p))),
        "bound": bound_json(&b),
    })
}

/// A count for the table: exact integers as they are, estimates rounded, big ones in SI.
fn fmt(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 1e12 {
        format!("{:.2}T", v / 1e12)
    } else if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

fn secs(s: f64) -> String {
    if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.2} us", s * 1e6)
    }
}

/// The text report.
pub fn to_text(p: &OpProfile) -> String {
    let mut o = String::new();
    o.push_str(&format!("{} ({} preset: {})\n", p.op, p.preset, p.shape));
    for k in &p.kernels {
        let c = &k.totals;
        let sampled = if k.is_full() {
            "all blocks".to_string()
        } else {
            format!(
                "{} of {} blocks sampled, counts scaled",
                k.blocks_profiled, k.blocks_total
            )
        };
        o.push_str(&format!(
            "\n  kernel {}  grid ({},{},{})  block ({},{},{})  smem {} B  [{sampled}]\n",
            k.name,
            k.grid[0],
            k.grid[1],
            k.grid[2],
            k.block[0],
            k.block[1],
            k.block[2],
            k.shared_bytes
        ));
        o.push_str(&format!(
            "    {:<14} {:>10} {:>10} {:>10} {:>10} {:>12}\n",
            "", "requests", "bytes", "sectors", "lines", "vs ideal"
        ));
        for (name, pre) in [
            ("global load", "global_load_"),
            ("global store", "global_store_"),
        ] {
            o.push_str(&format!(
                "    {:<14} {:>10} {:>10} {:>10} {:>10} {:>12}\n",
                name,
                fmt(c.get(&format!("{pre}requests"))),
                fmt(c.get(&format!("{pre}bytes"))),
                fmt(c.get(&format!("{pre}sectors"))),
                fmt(c.get(&format!("{pre}lines"))),
                ratio(
                    c.get(&format!("{pre}sectors")),
                    c.get(&format!("{pre}ideal_sectors"))
                )
            ));
        }
        o.push_str(&format!(
            "    {:<14} {:>10} {:>10} {:>10} {:>10} {:>12}\n",
            "", "requests", "wavefronts", "ideal", "", "vs ideal"
        ));
        for (name, pre) in [
            ("shared load", "shared_load_"),
            ("shared store", "shared_store_"),
        ] {
            o.push_str(&format!(
                "    {:<14} {:>10} {:>10} {:>10} {:>10} {:>12}\n",
                name,
                fmt(c.get(&format!("{pre}requests"))),
                fmt(c.get(&format!("{pre}wavefronts"))),
                fmt(c.get(&format!("{pre}ideal_wavefronts"))),
                "",
                ratio(
                    c.get(&format!("{pre}wavefronts")),
                    c.get(&format!("{pre}ideal_wavefronts"))
                )
            ));
        }
        let tensor: Vec<String> = c
            .tensor_instructions
            .iter()
            .map(|(s, n)| format!("{} x {s}", fmt(*n)))
            .collect();
        o.push_str(&format!(
            "    tensor: {} ({} FLOPs)  ldmatrix {}  sfu {}  barriers {}  shuffles {}  votes {}  atomics {}  async copies {} ({} B)\n",
            if tensor.is_empty() { "none".to_string() } else { tensor.join(", ") },
            fmt(c.get("tensor_flops")),
            fmt(c.get("ldmatrix_instructions")),
            fmt(c.get("special_function_calls")),
            fmt(c.get("barriers")),
            fmt(c.get("shuffles")),
            fmt(c.get("warp_votes")),
            fmt(c.get("atomics")),
            fmt(c.get("async_copy_instructions")),
            fmt(c.get("async_copy_bytes")),
        ));
        if k.is_full() {
            o.push_str(&format!(
                "    unique bytes: read {}  written {}\n",
                fmt(c.get("unique_bytes_read")),
                fmt(c.get("unique_bytes_written"))
            ));
        }
        if let Some(occ) = bound::occupancy(k) {
            o.push_str(&format!(
                "    occupancy (model, sm_90a): {} blocks / {} warps per SM, limited by {} ({} registers, {} B shared per block), {:.2} waves\n",
                occ.blocks_per_sm, occ.warps_per_sm, occ.limit, occ.regs, occ.shared_bytes_per_block, occ.waves
            ));
        }
    }
    // The ten worst lines over all kernels, by L1 wavefronts.
    let mut worst: Vec<(String, &Counters)> = p
        .kernels
        .iter()
        .flat_map(|k| {
            k.lines
                .iter()
                .map(move |(s, c)| (format!("{s} [{}]", k.name), c))
        })
        .filter(|(_, c)| c.l1_wavefronts() > 0.0)
        .collect();
    worst.sort_by(|a, b| {
        b.1.l1_wavefronts()
            .total_cmp(&a.1.l1_wavefronts())
            .then(a.0.cmp(&b.0))
    });
    if !worst.is_empty() {
        o.push_str("\n  worst lines (L1 wavefronts: global lines + shared wavefronts)\n");
        for (site, c) in worst.iter().take(10) {
            let global = c.get("global_load_lines") + c.get("global_store_lines");
            let ideal_global =
                c.get("global_load_ideal_sectors") + c.get("global_store_ideal_sectors");
            let shared = c.get("shared_load_wavefronts") + c.get("shared_store_wavefronts");
            let ideal_shared =
                c.get("shared_load_ideal_wavefronts") + c.get("shared_store_ideal_wavefronts");
            o.push_str(&format!(
                "    {:>10}  global lines {:>9} (ideal sectors {:>9})  shared {:>9} (ideal {:>9})  {site}\n",
                fmt(c.l1_wavefronts()),
                fmt(global),
                fmt(ideal_global),
                fmt(shared),
                fmt(ideal_shared)
            ));
        }
    }
    let (tensor, share, wasted) = tensor_share(p);
    let b = bound::bound(&p.kernels, p.compulsory_bytes);
    o.push_str(&format!(
        "\n  op FLOPs {}  tensor-core FLOPs {} (share {}, issued beyond the math {})  compulsory bytes {}\n",
        fmt(p.op_flops),
        fmt(tensor),
        if share.is_nan() { "n/a".to_string() } else { format!("{:.1}%", share * 100.0) },
        fmt(wasted),
        fmt(p.compulsory_bytes)
    ));
    o.push_str(&format!(
        "  H200 bound (a model): {}  bound by {}  [dram {} ({} {}), tensor {}, sfu {}, l1 {}]\n",
        secs(b.seconds),
        b.binding,
        secs(b.dram_s),
        b.dram_basis,
        fmt(b.dram_bytes),
        secs(b.tensor_s),
        secs(b.sfu_s),
        secs(b.l1_s)
    ));
    o
}
