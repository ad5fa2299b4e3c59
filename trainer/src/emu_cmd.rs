//! `sluice emu check FILE.cu --kernel NAME --grid X[,Y,Z] --block X[,Y,Z] [--smem BYTES]
//! --arg NAME=SPEC ... [--seeds N] [--out F.safetensors]` (DESIGN.md section 7, docs/emulator.md).
//!
//! Compiles any CUDA file with an `extern "C" __global__` kernel for the emulator
//! (sluice_kernels::emu::compile), runs the kernel under N schedule seeds with every check
//! (bounds, races, barriers, warp masks, asynchronous ordering) and compares the buffers between
//! seeds. Prints one line per finding, then `ok` or `failed`. Exit status: 0 clean, 1 findings,
//! 2 bad usage or a file that cannot be checked (it does not compile, no compiler).

use clap::{Args, Parser, Subcommand};
use sluice_kernels::emu::compile::{compile, CompileError, EmuModule};
use sluice_kernels::emu::rewrite::{kernel_declarations, parse_params, KernelParam};
use sluice_kernels::emu::{Checks, EmuBuffer, EmuFinding, LaunchOptions};
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum EmuCommand {
    /// Compile a CUDA file with the emulator and run one kernel under every check: out-of-bounds
    /// accesses, races, divergent barriers, bad warp masks, asynchronous results read before
    /// their wait, and outputs that change with the schedule seed. Exit 0 clean, 1 findings,
    /// 2 bad usage.
    Check(CheckArgs),
    /// Profile one op of the kernel runner on the emulator: memory requests, sectors and
    /// shared-memory wavefronts against their ideal, tensor-core instructions, special
    /// functions, barriers and shuffles, per kernel and per source line, with occupancy and a
    /// lower bound on H200 time (models). Exit 2 on bad usage.
    Profile(crate::emu_profile_cmd::ProfileArgs),
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The CUDA source: any file with an `extern "C" __global__ void NAME(...)` kernel.
    pub file: PathBuf,
    /// The kernel to run.
    #[arg(long)]
    pub kernel: String,
    /// Grid size in blocks.
    #[arg(long, value_name = "X[,Y,Z]")]
    pub grid: String,
    /// Block size in threads.
    #[arg(long, value_name = "X[,Y,Z]")]
    pub block: String,
    /// Dynamic shared memory per block, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    pub smem: usize,
    /// One per kernel parameter, in order: NAME=f32[N], bf16[N], i32[N], u32[N] or u8[N]
    /// (optionally :zeros, :ones, :iota or :random; zeros by default) for a buffer;
    /// NAME=i32:V, u32:V, f32:V (also i64:V, u64:V, f64:V) for a scalar.
    #[arg(long = "arg", value_name = "NAME=SPEC")]
    pub args: Vec<String>,
    /// Schedule seeds to run (1..=N); the buffers must come out identical under all of them.
    #[arg(long, default_value_t = 4)]
    pub seeds: u64,
    /// Write every buffer after the run with seed 1 to this safetensors file.
    #[arg(long, value_name = "F.safetensors")]
    pub out: Option<PathBuf>,
    /// Also profile the run with seed 1 (docs/emulator.md, "Profiling"): requests, sectors and
    /// wavefronts against their ideal, per source line; printed after the findings.
    #[arg(long)]
    pub profile: bool,
    /// With --profile: write the profile as JSON to this file.
    #[arg(long, value_name = "F", requires = "profile")]
    pub json: Option<PathBuf>,
}

/// Element types of buffer arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    Bf16,
    I32,
    U32,
    U8,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 | Elem::I32 | Elem::U32 => 4,
            Elem::Bf16 => 2,
            Elem::U8 => 1,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
            Elem::I32 => "i32",
            Elem::U32 => "u32",
            Elem::U8 => "u8",
        }
    }
    /// The element type a C++ pointee type stands for, where it is one of these.
    fn of_cpp(pointee: &str) -> Option<Elem> {
        let t = pointee
            .split_whitespace()
            .filter(|w| *w != "const" && *w != "volatile")
            .collect::<Vec<_>>()
            .join(" ");
        Some(match t.as_str() {
            "float" => Elem::F32,
            "__nv_bfloat16" | "nv_bfloat16" => Elem::Bf16,
            "int" | "int32_t" | "signed" | "signed int" => Elem::I32,
            "unsigned" | "unsigned int" | "uint32_t" => Elem::U32,
            "unsigned char" | "uint8_t" | "char" | "signed char" | "int8_t" | "bool" => Elem::U8,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Init {
    Zeros,
    Ones,
    Iota,
    Random,
}

#[derive(Debug, Clone, PartialEq)]
enum Spec {
    Buffer { elem: Elem, len: usize, init: Init },
    I32(i32),
    U32(u32),
    F32(f32),
    I64(i64),
    U64(u64),
    F64(f64),
}

impl Spec {
    /// The signature character (emu_api.h) this spec fits.
    fn signature(&self) -> char {
        match self {
            Spec::Buffer { .. } => 'p',
            Spec::I32(_) => 'i',
            Spec::U32(_) => 'u',
            Spec::F32(_) => 'f',
            Spec::I64(_) => 'l',
            Spec::U64(_) => 'L',
            Spec::F64(_) => 'd',
        }
    }
}

fn parse_spec(s: &str) -> Result<Spec, String> {
    if let Some((ty, rest)) = s.split_once('[') {
        let elem = match ty {
            "f32" => Elem::F32,
            "bf16" => Elem::Bf16,
            "i32" => Elem::I32,
            "u32" => Elem::U32,
            "u8" => Elem::U8,
            _ => {
                return Err(format!(
                    "`{ty}` is not a buffer type (f32, bf16, i32, u32, u8)"
                ))
            }
        };
        let (len, init) = rest
            .split_once(']')
            .ok_or_else(|| format!("`{s}`: missing `]`"))?;
        let len: usize = len
            .trim()
            .parse()
            .map_err(|_| format!("`{s}`: the length `{len}` is not a number of elements"))?;
        let init = match init {
            "" | ":zeros" => Init::Zeros,
            ":ones" => Init::Ones,
            ":iota" => Init::Iota,
            ":random" => Init::Random,
            other => {
                return Err(format!(
                    "`{s}`: `{other}` is not :zeros, :ones, :iota or :random"
                ))
            }
        };
        return Ok(Spec::Buffer { elem, len, init });
    }
    let (ty, v) = s.split_once(':').ok_or_else(|| {
        format!("`{s}` is neither a buffer (f32[N], ...) nor a scalar (i32:V, u32:V, f32:V)")
    })?;
    let bad = |what: &str| format!("`{s}`: `{v}` is not {what}");
    Ok(match ty {
        "i32" => Spec::I32(v.parse().map_err(|_| bad("an i32"))?),
        "u32" => Spec::U32(v.parse().map_err(|_| bad("a u32"))?),
        "f32" => Spec::F32(v.parse().map_err(|_| bad("an f32"))?),
        "i64" => Spec::I64(v.parse().map_err(|_| bad("an i64"))?),
        "u64" => Spec::U64(v.parse().map_err(|_| bad("a u64"))?),
        "f64" => Spec::F64(v.parse().map_err(|_| bad("an f64"))?),
        _ => {
            return Err(format!(
                "`{ty}` is not a scalar type (i32, u32, f32, i64, u64, f64)"
            ))
        }
    })
}

fn parse_dim(flag: &str, s: &str) -> Result<[u32; 3], String> {
    let parts: Vec<&str> = s.split(',').collect();
    if parts.is_empty() || parts.len() > 3 {
        return Err(format!("--{flag} {s}: give X, X,Y or X,Y,Z"));
    }
    let mut d = [1u32; 3];
    for (i, p) in parts.iter().enumerate() {
        d[i] = p
            .trim()
            .parse()
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("--{flag} {s}: `{p}` is not a positive integer"))?;
    }
    Ok(d)
}

/// Rounds to the nearest bf16 (ties to even), as CUDA's __float2bfloat16.
fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The initial bytes of a buffer argument (argument `index`, for the random stream).
fn initial_bytes(elem: Elem, len: usize, init: Init, index: usize) -> Vec<u8> {
    let mut state = (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = Vec::with_capacity(len * elem.size());
    for i in 0..len {
        let (f, n): (f32, u64) = match init {
            Init::Zeros => (0.0, 0),
            Init::Ones => (1.0, 1),
            Init::Iota => (i as f32, i as u64),
            Init::Random => {
                let r = next();
                (
                    ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0,
                    r >> 48,
                )
            }
        };
        match elem {
            Elem::F32 => out.extend_from_slice(&f.to_le_bytes()),
            Elem::Bf16 => out.extend_from_slice(&bf16_bits(f).to_le_bytes()),
            Elem::I32 => out.extend_from_slice(&(n as i32).to_le_bytes()),
            Elem::U32 => out.extend_from_slice(&(n as u32).to_le_bytes()),
            Elem::U8 => out.push(n as u8),
        }
    }
    out
}

fn element_text(elem: Elem, bytes: &[u8], i: usize) -> String {
    let b = &bytes[i * elem.size()..(i + 1) * elem.size()];
    match elem {
        Elem::F32 => format!("{}", f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Elem::Bf16 => format!(
            "{}",
            f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
        ),
        Elem::I32 => format!("{}", i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Elem::U32 => format!("{}", u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Elem::U8 => format!("{}", b[0]),
    }
}

/// A usage error: printed, exit status 2.
struct Usage(String);

/// The checked arguments, matched with the kernel's parameters.
struct Plan {
    names: Vec<String>,
    specs: Vec<Spec>,
    grid: [u32; 3],
    block: [u32; 3],
}

fn plan(args: &CheckArgs, params: Option<&[KernelParam]>, signature: &str) -> Result<Plan, Usage> {
    let grid = parse_dim("grid", &args.grid).map_err(Usage)?;
    let block = parse_dim("block", &args.block).map_err(Usage)?;
    if args.seeds == 0 {
        return Err(Usage("--seeds must be at least 1".into()));
    }
    let kernel = &args.kernel;
    let described = match params {
        Some(p) => p
            .iter()
            .map(|p| format!("{} {}", p.ty, p.name))
            .collect::<Vec<_>>()
            .join(", "),
        None => signature.to_string(),
    };
    if args.args.len() != signature.len() {
        return Err(Usage(format!(
            "kernel {kernel} takes {} parameters ({described}); {} --arg given",
            signature.len(),
            args.args.len()
        )));
    }
    let mut names = Vec::new();
    let mut specs = Vec::new();
    for (i, (a, sig)) in args.args.iter().zip(signature.chars()).enumerate() {
        let (name, spec) = a
            .split_once('=')
            .ok_or_else(|| Usage(format!("--arg {a}: expected NAME=SPEC")))?;
        if let Some(p) = params.and_then(|p| p.get(i)) {
            if p.name != name {
                return Err(Usage(format!(
                    "--arg {a}: parameter {} of {kernel} is `{}` (--arg values go in the kernel's parameter order: {described})",
                    i + 1,
                    p.name
                )));
            }
        }
        let spec = parse_spec(spec).map_err(|e| Usage(format!("--arg {name}: {e}")))?;
        if sig == '?' {
            return Err(Usage(format!(
                "parameter `{name}` of {kernel} has a type `sluice emu check` cannot pass (pointers, int, unsigned, float, long long, unsigned long long and double can be)"
            )));
        }
        if spec.signature() != sig {
            let want = match sig {
                'p' => "a buffer (f32[N], bf16[N], i32[N], u32[N], u8[N])",
                'i' => "i32:V",
                'u' => "u32:V",
                'f' => "f32:V",
                'l' => "i64:V",
                'L' => "u64:V",
                _ => "f64:V",
            };
            let ty = params
                .and_then(|p| p.get(i))
                .map_or(String::new(), |p| format!(" is `{}`:", p.ty));
            return Err(Usage(format!(
                "--arg {a}: parameter `{name}` of {kernel}{ty} give {want}"
            )));
        }
        if let (Spec::Buffer { elem, .. }, Some(p)) = (&spec, params.and_then(|p| p.get(i))) {
            let pointee = p.ty.trim_end_matches('*');
            if let Some(want) = Elem::of_cpp(pointee) {
                if want != *elem {
                    return Err(Usage(format!(
                        "--arg {a}: parameter `{name}` is `{}`, so its buffer holds {} elements, not {}",
                        p.ty,
                        want.name(),
                        elem.name()
                    )));
                }
            }
        }
        names.push(name.to_string());
        specs.push(spec);
    }
    Ok(Plan {
        names,
        specs,
        grid,
        block,
    })
}

/// One run of the kernel: its findings and the buffers afterwards (None for scalars).
struct RunResult {
    findings: Vec<EmuFinding>,
    profile: Option<sluice_kernels::emu::profile::KernelProfile>,
    buffers: Vec<Option<Vec<u8>>>,
}

fn run_once(
    module: &EmuModule,
    args: &CheckArgs,
    plan: &Plan,
    seed: u64,
) -> Result<RunResult, Usage> {
    let mut buffers: Vec<Option<EmuBuffer>> = Vec::new();
    for (i, spec) in plan.specs.iter().enumerate() {
        buffers.push(match spec {
            Spec::Buffer { elem, len, init } => {
                let bytes = initial_bytes(*elem, *len, *init, i);
                let mut b = module.alloc(bytes.len()).map_err(Usage)?;
                b.as_bytes_mut().copy_from_slice(&bytes);
                Some(b)
            }
            _ => None,
        });
    }
    let mut slots: Vec<u64> = plan
        .specs
        .iter()
        .zip(&buffers)
        .map(|(spec, buf)| match (spec, buf) {
            (_, Some(b)) => b.as_ptr() as u64,
            (Spec::I32(v), None) => *v as u32 as u64,
            (Spec::U32(v), None) => u64::from(*v),
            (Spec::F32(v), None) => u64::from(v.to_bits()),
            (Spec::I64(v), None) => *v as u64,
            (Spec::U64(v), None) => *v,
            (Spec::F64(v), None) => v.to_bits(),
            (Spec::Buffer { .. }, None) => unreachable!("every buffer spec has a buffer"),
        })
        .collect();
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| s as *mut u64 as *mut c_void)
        .collect();
    let opts = LaunchOptions {
        checks: Checks::Full,
        race: Some(true),
        param_names: Some(plan.names.clone()),
    };
    // SAFETY: plan() matched every argument with the kernel's compiled signature: each slot holds
    // a value of the parameter's type in its low bytes (little-endian: an i32/u32/f32 in the low
    // 4 bytes of the 8-byte slot), and every pointer is a buffer of this module, alive until
    // after the launch.
    let (findings, profile) = if args.profile && seed == 1 {
        // SAFETY: as for the plain launch below (same arguments).
        unsafe {
            module.launch_profiled(
                &args.kernel,
                plan.grid,
                plan.block,
                args.smem,
                &mut params,
                seed,
                &opts,
            )
        }
        .map_err(Usage)?
    } else {
        // SAFETY: see the note above `let (findings, profile)`.
        let found = unsafe {
            module.launch(
                &args.kernel,
                plan.grid,
                plan.block,
                args.smem,
                &mut params,
                seed,
                &opts,
            )
        }
        .map_err(Usage)?;
        (found, None)
    };
    Ok(RunResult {
        findings,
        profile,
        buffers: buffers
            .iter()
            .map(|b| b.as_ref().map(|b| b.as_bytes().to_vec()))
            .collect(),
    })
}

fn write_out(path: &Path, plan: &Plan, buffers: &[Option<Vec<u8>>]) -> Result<(), String> {
    use safetensors::tensor::{Dtype, TensorView};
    let mut views = Vec::new();
    for ((name, spec), bytes) in plan.names.iter().zip(&plan.specs).zip(buffers) {
        let (Spec::Buffer { elem, len, .. }, Some(bytes)) = (spec, bytes) else {
            continue;
        };
        let dtype = match elem {
            Elem::F32 => Dtype::F32,
            Elem::Bf16 => Dtype::BF16,
            Elem::I32 => Dtype::I32,
            Elem::U32 => Dtype::U32,
            Elem::U8 => Dtype::U8,
        };
        let view = TensorView::new(dtype, vec![*len], bytes)
            .map_err(|e| format!("buffer `{name}`: {e}"))?;
        views.push((name.clone(), view));
    }
    let data = safetensors::serialize(views, None).map_err(|e| e.to_string())?;
    std::fs::write(path, data).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The first difference between two runs' buffers, as a `nondeterministic` finding line.
fn compare(plan: &Plan, base: &RunResult, other: &RunResult, seed: u64) -> Vec<String> {
    let mut lines = Vec::new();
    for ((name, spec), (a, b)) in plan
        .names
        .iter()
        .zip(&plan.specs)
        .zip(base.buffers.iter().zip(&other.buffers))
    {
        let (Spec::Buffer { elem, len, .. }, Some(a), Some(b)) = (spec, a, b) else {
            continue;
        };
        let size = elem.size();
        let differing: Vec<usize> = (0..*len)
            .filter(|&i| a[i * size..(i + 1) * size] != b[i * size..(i + 1) * size])
            .collect();
        if let Some(&i) = differing.first() {
            lines.push(format!(
                "nondeterministic: buffer `{name}` differs between seed 1 and seed {seed}: element {i} is {} and {} ({} of {len} elements differ)",
                element_text(*elem, a, i),
                element_text(*elem, b, i),
                differing.len()
            ));
        }
    }
    lines
}

/// What `sluice emu check` prints and its exit status.
#[derive(Debug)]
pub struct CheckReport {
    /// Standard output: one line per finding, then `ok` or `failed` (empty on a usage error).
    pub lines: Vec<String>,
    /// The usage error, printed to standard error as `error: ...` (status 2).
    pub error: Option<String>,
    /// 0 clean, 1 findings, 2 bad usage or a file that cannot be checked.
    pub status: u8,
}

/// The arguments of `sluice emu check` (without the `sluice emu check` words), as the command
/// line parses them.
pub fn parse_check_args<I, T>(argv: I) -> Result<CheckArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    #[derive(Parser)]
    #[command(name = "sluice emu check")]
    struct CheckCli {
        #[command(flatten)]
        args: CheckArgs,
    }
    let argv = std::iter::once(std::ffi::OsString::from("sluice emu check"))
        .chain(argv.into_iter().map(Into::into));
    CheckCli::try_parse_from(argv).map(|c| c.args)
}

/// Runs the check and returns what the command prints.
pub fn run_check(args: &CheckArgs) -> CheckReport {
    let mut lines = Vec::new();
    match check_inner(args, &mut lines) {
        Ok(clean) => CheckReport {
            lines,
            error: None,
            status: if clean { 0 } else { 1 },
        },
        Err(Usage(m)) => CheckReport {
            lines: Vec::new(),
            error: Some(m),
            status: 2,
        },
    }
}

/// Runs `sluice emu check`.
pub fn check(args: &CheckArgs) -> ExitCode {
    let report = run_check(args);
    for l in &report.lines {
        println!("{l}");
    }
    if let Some(e) = &report.error {
        eprintln!("error: {e}");
    }
    ExitCode::from(report.status)
}

fn check_inner(args: &CheckArgs, out: &mut Vec<String>) -> Result<bool, Usage> {
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| Usage(format!("cannot read {}: {e}", args.file.display())))?;
    let decls = kernel_declarations(&text);
    let Some((_, list)) = decls.iter().find(|(n, _)| *n == args.kernel) else {
        let names: Vec<&str> = decls.iter().map(|(n, _)| n.as_str()).collect();
        return Err(Usage(if names.is_empty() {
            format!(
                "{} declares no `extern \"C\" __global__ void NAME(...)` kernel",
                args.file.display()
            )
        } else {
            format!(
                "{} has no kernel `{}` (its kernels: {})",
                args.file.display(),
                args.kernel,
                names.join(", ")
            )
        }));
    };
    let params = parse_params(list);
    let module_path = compile(&args.file).map_err(|e| match e {
        CompileError::Compiler(m) => Usage(format!(
            "{} does not compile for the emulator ({m}; the compiler's messages are above)",
            args.file.display()
        )),
        other => Usage(other.to_string()),
    })?;
    let module = EmuModule::load(&module_path).map_err(Usage)?;
    let signature = module.kernel_signature(&args.kernel).ok_or_else(|| {
        Usage(format!(
            "the compiled module has no kernel `{}` (its kernels: {})",
            args.kernel,
            module.kernel_names().join(", ")
        ))
    })?;
    let plan = plan(args, params.as_deref(), &signature)?;

    // Findings of every seed, the same finding once (with the seeds that met it).
    let mut lines: Vec<(String, Vec<u64>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut base: Option<RunResult> = None;
    for seed in 1..=args.seeds {
        let result = run_once(&module, args, &plan, seed)?;
        for f in &result.findings {
            let place = |l: &Option<sluice_kernels::emu::CodeLocation>| {
                l.as_ref().map_or(String::new(), |l| l.to_string())
            };
            let key = if f.location.is_some() {
                format!("{}|{}|{}", f.kind, place(&f.location), place(&f.other))
            } else {
                format!("{}|{}", f.kind, f.message)
            };
            match index.get(&key) {
                Some(&i) => lines[i].1.push(seed),
                None => {
                    index.insert(key, lines.len());
                    lines.push((f.to_string(), vec![seed]));
                }
            }
        }
        match &base {
            None => {
                if let Some(out) = &args.out {
                    write_out(out, &plan, &result.buffers).map_err(Usage)?;
                }
                base = Some(result);
            }
            Some(b) => {
                for l in compare(&plan, b, &result, seed) {
                    lines.push((l, vec![seed]));
                }
            }
        }
    }
    for (line, seeds) in &lines {
        let seeds: Vec<String> = seeds.iter().map(|s| s.to_string()).collect();
        out.push(format!("{line} (seed {})", seeds.join(", ")));
    }
    let clean = lines.is_empty();
    out.push(if clean { "ok" } else { "failed" }.to_string());
    if let Some(kernel) = base.and_then(|b| b.profile) {
        let profile = sluice_kernels::profiler::OpProfile {
            op: args.kernel.clone(),
            shape: format!(
                "{} grid {} block {}",
                args.file.display(),
                args.grid,
                args.block
            ),
            preset: "emu check".into(),
            op_flops: f64::NAN,
            compulsory_bytes: f64::NAN,
            kernels: vec![kernel],
        };
        if let Some(path) = &args.json {
            crate::emu_profile_cmd::write_json(
                path,
                &sluice_kernels::profiler::report::to_json(&profile),
            )
            .map_err(Usage)?;
        }
        out.push(sluice_kernels::profiler::report::to_text(&profile));
    }
    Ok(clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_reject_with_a_reason() {
        assert_eq!(
            parse_spec("f32[17]:random").unwrap(),
            Spec::Buffer {
                elem: Elem::F32,
                len: 17,
                init: Init::Random
            }
        );
        assert_eq!(
            parse_spec("u8[3]").unwrap(),
            Spec::Buffer {
                elem: Elem::U8,
                len: 3,
                init: Init::Zeros
            }
        );
        assert_eq!(parse_spec("i32:-5").unwrap(), Spec::I32(-5));
        assert_eq!(parse_spec("f32:0.5").unwrap(), Spec::F32(0.5));
        assert!(parse_spec("f16[4]")
            .unwrap_err()
            .contains("not a buffer type"));
        assert!(parse_spec("f32[4]:twos").unwrap_err().contains(":zeros"));
        assert!(parse_spec("i32:x").unwrap_err().contains("not an i32"));
        assert!(parse_spec("7").unwrap_err().contains("neither a buffer"));
        assert_eq!(parse_dim("grid", "4,2").unwrap(), [4, 2, 1]);
        assert!(parse_dim("block", "0").is_err());
    }

    #[test]
    fn initial_buffers_follow_their_spec() {
        assert_eq!(initial_bytes(Elem::U8, 3, Init::Iota, 0), [0, 1, 2]);
        assert_eq!(
            initial_bytes(Elem::Bf16, 2, Init::Ones, 0),
            [0x80, 0x3f, 0x80, 0x3f]
        );
        let r = initial_bytes(Elem::F32, 64, Init::Random, 1);
        let v: Vec<f32> = r
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(v.windows(2).any(|w| w[0] != w[1]));
        assert_eq!(
            r,
            initial_bytes(Elem::F32, 64, Init::Random, 1),
            "deterministic"
        );
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80, "ties to even");
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
    }
}
