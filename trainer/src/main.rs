//! The `sluice` command.

use clap::{Parser, Subcommand};
use sluice_kernels::{Device, Error};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Asynchronous agentic RL on hand-written CUDA kernels"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Debug mode (also SLUICE_DEBUG=1): every op output poisoned (NaN bytes) so an unwritten
    /// element is caught, and index inputs (offsets, block tables, token ids, sequence
    /// bounds) copied to the host and checked inside each op, a host sync each. Off by
    /// default: outputs uninitialised, no device-to-host copy inside an op. `sluice kernel`
    /// always runs this way.
    #[arg(long, global = true)]
    debug: bool,
}

#[derive(Subcommand)]
enum TasksCommand {
    /// A task's problems as JSON lines ({"id", "spec", "prompt": {"text"}, "ids"}): held-out
    /// ones are those the run's evaluation draws with the same seed.
    Export {
        /// A task name of the config ([tasks.NAME]; the defaults have sort and tool).
        task: String,
        /// The config (default: the defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override one config key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// train or held_out.
        #[arg(long, default_value = "held_out")]
        split: String,
        /// Distinct problems (fewer when the split has fewer).
        #[arg(long, default_value_t = 64)]
        n: usize,
        /// The run seed (default: run.seed of the config).
        #[arg(long)]
        seed: Option<u64>,
        /// Write to this file instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE on the config's text tasks (their warm-up demonstrations): digits
    /// one per token unless `--digits` says more, the chat's special tokens first; writes a
    /// Hugging Face tokenizer.json for `[tokenizer] kind = "bpe"`, `path = ...`.
    Train {
        /// Where to write the tokenizer.json.
        #[arg(long, default_value = "tokenizer.json")]
        out: PathBuf,
        /// The most ids (specials and 256 bytes included; fewer when the corpus has fewer
        /// merges to make).
        #[arg(long, default_value_t = sluice_trainer::tasks::bpe::DEFAULT_TRAIN_VOCAB)]
        vocab: usize,
        /// The most digits one token may hold: numbers are cut into runs of this many digits
        /// (left to right) that the BPE may merge; 1 keeps every digit its own token.
        #[arg(long, default_value_t = sluice_trainer::tasks::bpe::DEFAULT_TRAIN_DIGITS)]
        digits: usize,
        /// Training problems per task in the corpus.
        #[arg(long, default_value_t = 4096)]
        problems: usize,
        /// The config whose tasks make the corpus (default: the defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override one config key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run one kernel on named tensors from a safetensors file (`--list` shows the ops).
    Kernel {
        /// The op to run (gemm, topk, ...).
        op: Option<String>,
        /// Print every op with its tensors and parameters.
        #[arg(long)]
        list: bool,
        /// Input safetensors file: the op's tensors by name, parameters as string metadata.
        #[arg(long = "in", value_name = "IN.safetensors")]
        input: Option<PathBuf>,
        /// Output safetensors file.
        #[arg(long = "out", value_name = "OUT.safetensors")]
        output: Option<PathBuf>,
        /// cpu, emu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Time every op against the H200 roofline and the ceilings measured in the same run
    /// (CUDA events on cuda, wall clock elsewhere); rows stream to a JSONL file.
    Bench {
        /// cpu, emu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Only ops whose name contains one of these (comma-separated).
        #[arg(long)]
        op: Option<String>,
        /// doc (the doc shapes; the default on cuda), quick (the default elsewhere) or tiny
        /// (the dry run's).
        #[arg(long)]
        preset: Option<String>,
        /// The doc shapes even off a GPU (the same as --preset doc).
        #[arg(long)]
        full: bool,
        /// Timed samples per case (median, min and max reported).
        #[arg(long, default_value_t = 10)]
        samples: usize,
        /// Untimed runs before the samples.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Overwrite this many MiB of scratch before each sample, outside the timing (cold L2;
        /// one run per sample).
        #[arg(long, value_name = "MIB")]
        cold_l2: Option<usize>,
        /// Stream the rows here (one JSON object per line, written as each case finishes).
        #[arg(long)]
        jsonl: Option<PathBuf>,
        /// Also write the rows as one JSON array here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also write the markdown report here.
        #[arg(long)]
        markdown: Option<PathBuf>,
        /// The GPU run's test results (`ok|FAILED BINARY::TEST@MODE` lines): rows whose test
        /// did not pass in this run are marked UNVERIFIED.
        #[arg(long)]
        verified: Option<PathBuf>,
        /// Do not run: print the report built from this rows file (a finished or cut run).
        #[arg(long, value_name = "JSONL")]
        report_from: Option<PathBuf>,
        /// Do not run: print the preset's case table as JSON (what scripts/peers/ reads).
        #[arg(long)]
        list_json: bool,
        /// On emu: add the profiler's counters and the H200 bound (a model) to every row.
        #[arg(long)]
        profile: bool,
    },
    /// Show the devices this machine offers (and GPU telemetry where a driver exists).
    Devices,
    /// The main job: a pipeline of stages (supervised warm-up, then asynchronous RL on the
    /// built-in tasks), leaving a run folder with metrics, summary, trace and checkpoints.
    Train {
        /// The config (TOML); every key not in it takes its default (`sluice config
        /// --print-defaults`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// cpu, emu, cuda or cuda:N (overrides run.device).
        #[arg(long)]
        device: Option<String>,
        /// async or sync (overrides run.mode).
        #[arg(long)]
        mode: Option<String>,
        /// Overrides run.seed.
        #[arg(long)]
        seed: Option<u64>,
        /// The run folder (default runs/NAME, NAME = run.name).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Continue the run in this folder from its last checkpoint.
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Override one config key: --set section.key=value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Answer external environments (kinds external, http) from RUN_DIR's
        /// environments.jsonl instead of starting them; a call the record lacks stops the run
        /// with exit code 2, naming its key.
        #[arg(long, value_name = "RUN_DIR")]
        replay_env: Option<PathBuf>,
    },
    /// Tokenizers: `train` makes a byte-level BPE on the tasks' text.
    Tokenizer {
        #[command(subcommand)]
        command: TokenizerCommand,
    },
    /// The tasks of a config: `export NAME` writes a task's problems as JSON lines.
    Tasks {
        #[command(subcommand)]
        command: TasksCommand,
    },
    /// The design's reproduction checklist: run one experiment's arms (config overrides of
    /// one RL stage, from a shared warm-up) and write its report (report.md, report.json, an
    /// SVG) with the machine, commit, seeds and clock. `--list` names them.
    Experiment {
        /// refresh, tau, clip, crashes, share, is-modes, minibatches, decoupled-ppo,
        /// objectives, dynamic-sampling, over-sampling, regularizers, tito, async-speedup (`--list` says each).
        name: Option<String>,
        /// List the experiments and their arms.
        #[arg(long)]
        list: bool,
        /// One seed and 12 RL steps per arm: minutes on 2 cores.
        #[arg(long)]
        quick: bool,
        /// The base config (default configs/tiny.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override one config key for every arm (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Only these arms (comma-separated names).
        #[arg(long, value_delimiter = ',')]
        arms: Vec<String>,
        /// The seeds (comma-separated; default 0 with --quick, else 0,1,2).
        #[arg(long, value_delimiter = ',')]
        seeds: Vec<u64>,
        /// RL steps per arm (default: the config's, or 12 with --quick).
        #[arg(long)]
        steps: Option<u64>,
        /// The experiment's folder (default runs/experiments/NAME).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// One rollout engine as an HTTP server (docs/runtime.md, "Rollout servers"): token
    /// generation with log-probs and versions, streaming, abort, weight installs, OpenAI-style
    /// endpoints. Prints `listening on http://ADDR` as its first line.
    Serve {
        /// The config (TOML): the model, tokenizer, [rollout] engine and sampling defaults.
        #[arg(long)]
        config: Option<PathBuf>,
        /// A checkpoint to serve (default: the config's model, freshly initialised).
        #[arg(long)]
        weights: Option<PathBuf>,
        /// The weight version the starting weights are served as.
        #[arg(long, default_value_t = 0)]
        weights_version: u64,
        /// host:port to bind (default 127.0.0.1:0, a port from the OS).
        #[arg(long)]
        listen: Option<String>,
        /// Override one config key: --set section.key=value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// The same decode workload through one `sluice serve` process over loopback and through
    /// an in-process engine, side by side (tokens/s on the wall clock), and the server's
    /// resident memory per idle session (docs/perf/serve.md).
    BenchServe {
        /// The config (default: configs/tiny.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override one config key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Concurrent sessions per measurement (comma-separated).
        #[arg(long, default_value = "1,16,64")]
        batches: String,
        /// Prompt tokens per session.
        #[arg(long, default_value_t = 8)]
        prompt: usize,
        /// Generated tokens per session.
        #[arg(long, default_value_t = 512)]
        tokens: u32,
        /// Repetitions per B (the best is reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Idle sessions for the memory measurement.
        #[arg(long, default_value_t = 1000)]
        idle: usize,
    },
    /// A checkpoint's pass rate on a task's held-out problems, greedy and sampled.
    Eval {
        /// The checkpoint (final.safetensors or a checkpoint of a run folder).
        #[arg(long)]
        checkpoint: PathBuf,
        /// The task's name in the config.
        #[arg(long)]
        task: String,
        /// Held-out problems (default: rollout.eval_problems of the config).
        #[arg(long)]
        samples: Option<usize>,
        /// The config defining the task (default: the run folder's config.toml, else the
        /// defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print this many transcripts per mode.
        #[arg(long, default_value_t = 0)]
        show: usize,
        /// auto, f32 or bf16 (default: model.precision of the config).
        #[arg(long)]
        precision: Option<String>,
    },
    /// Config helpers.
    Config {
        /// Print every setting with its default and a comment (configs/default.toml).
        #[arg(long)]
        print_defaults: bool,
    },
    /// Weight-sync deltas between two safetensors files with identical tensor tables.
    Delta {
        #[command(subcommand)]
        command: sluice_trainer::delta_cmd::DeltaCommand,
    },
    /// Determinism: digests of every op and of training, decode and RL steps across runs,
    /// thread counts, seeds, machines and commits; invariance probes; goldens (`run`,
    /// `probe`, `check`, `diff`; docs/determinism.md).
    Determinism {
        #[command(subcommand)]
        command: sluice_trainer::determinism::DeterminismCommand,
    },
    /// The CUDA emulator as a checker (`sluice emu check FILE.cu --kernel NAME ...`) and as a
    /// profiler (`sluice emu profile OP`).
    Emu {
        #[command(subcommand)]
        command: sluice_trainer::emu_cmd::EmuCommand,
    },
    /// Supervised training on the synthetic digit-reversal task with Muon + AdamW: progress,
    /// metrics.jsonl, held-out accuracy and a checkpoint with the optimizer state.
    Sft {
        /// Model config (TOML).
        #[arg(long, default_value = "configs/model/small.toml")]
        model: PathBuf,
        /// cpu, emu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// auto (bf16 on cuda and emu, f32 on cpu), f32 or bf16.
        #[arg(long, default_value = "auto")]
        precision: String,
        #[arg(long, default_value_t = 300)]
        steps: u64,
        /// Sequences per step.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        #[arg(long, default_value_t = 3)]
        min_digits: usize,
        #[arg(long, default_value_t = 6)]
        max_digits: usize,
        /// Seed of the training data stream (the init seed is the model config's).
        #[arg(long, default_value_t = 5)]
        seed: u64,
        #[arg(long, default_value_t = 0.02)]
        muon_lr: f32,
        #[arg(long, default_value_t = 0.01)]
        adamw_lr: f32,
        /// Linear warmup steps before the cosine decay (to a tenth).
        #[arg(long, default_value_t = 20)]
        warmup: u64,
        #[arg(long, default_value_t = 25)]
        log_every: u64,
        /// Folder for metrics.jsonl and model.safetensors.
        #[arg(long, default_value = "runs/sft")]
        out: PathBuf,
    },
}

fn fail(e: &Error) -> ExitCode {
    eprintln!("error: {e}");
    if e.is_bad_input() {
        ExitCode::from(2)
    } else {
        ExitCode::from(1)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The kernel runner checks one op on tensors from a file: always in debug mode (its bad
    // inputs must be named errors, never a kernel reading out of bounds).
    let kernel = matches!(cli.command, Command::Kernel { .. });
    sluice_kernels::debug::set_for_main(cli.debug || kernel);
    match cli.command {
        Command::Kernel {
            op,
            list,
            input,
            output,
            device,
        } => {
            if list {
                print!("{}", sluice_kernels::runner::list());
                return ExitCode::SUCCESS;
            }
            let usage = |what: &str| {
                fail(&Error::Invalid(format!(
                    "{what}; usage: sluice kernel <op> --in IN.safetensors --out OUT.safetensors [--device cpu|emu|cuda[:N]] (or --list)"
                )))
            };
            let Some(op) = op else {
                return usage("no op given");
            };
            let Some(input) = input else {
                return usage("--in is required");
            };
            let Some(output) = output else {
                return usage("--out is required");
            };
            let device: Device = match device.parse() {
                Ok(d) => d,
                Err(e) => return fail(&e),
            };
            match sluice_trainer::kernel_cmd::run_kernel(&op, &input, &output, device) {
                Ok(summary) => {
                    println!("{summary}");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Bench {
            device,
            op,
            preset,
            full,
            samples,
            warmup,
            cold_l2,
            jsonl,
            json,
            markdown,
            verified,
            report_from,
            list_json,
            profile,
        } => {
            let device: Device = match device.parse() {
                Ok(d) => d,
                Err(e) => return fail(&e),
            };
            let preset = match (preset.as_deref(), full) {
                (Some(_), true) => {
                    return fail(&Error::Invalid(
                        "--full and --preset both choose the sizes; give one".into(),
                    ))
                }
                (Some(p), false) => match sluice_kernels::bench_cases::Preset::parse(p) {
                    Ok(p) => p,
                    Err(e) => return fail(&e),
                },
                (None, true) => sluice_kernels::bench_cases::Preset::Doc,
                (None, false) if matches!(device, Device::Cuda(_)) => {
                    sluice_kernels::bench_cases::Preset::Doc
                }
                (None, false) => sluice_kernels::bench_cases::Preset::Quick,
            };
            if list_json {
                return match sluice_trainer::bench_cmd::list_json(preset) {
                    Ok(json) => {
                        println!("{json}");
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                };
            }
            if let Some(rows) = report_from {
                return match sluice_trainer::bench_cmd::report_from(&rows, verified.as_deref()) {
                    Ok(report) => {
                        print!("{report}");
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                };
            }
            let timing = sluice_kernels::bench::TimingConfig {
                warmup,
                samples,
                cold_l2_bytes: cold_l2.map(|m| m << 20),
                ..Default::default()
            };
            let opts = sluice_trainer::bench_cmd::BenchOptions {
                device,
                filter: op.as_deref(),
                preset,
                timing,
                jsonl: jsonl.as_deref(),
                json: json.as_deref(),
                markdown: markdown.as_deref(),
                verified: verified.as_deref(),
                profile,
            };
            match sluice_trainer::bench_cmd::run_bench(&opts) {
                Ok(out) => {
                    print!("{}", out.report);
                    if out.failed > 0 {
                        eprintln!(
                            "error: {} bench case(s) failed to run (their rows say why)",
                            out.failed
                        );
                        ExitCode::from(1)
                    } else {
                        ExitCode::SUCCESS
                    }
                }
                Err(e) => fail(&e),
            }
        }
        Command::Sft {
            model,
            device,
            precision,
            steps,
            batch,
            min_digits,
            max_digits,
            seed,
            muon_lr,
            adamw_lr,
            warmup,
            log_every,
            out,
        } => {
            let device: Device = match device.parse() {
                Ok(d) => d,
                Err(e) => return fail(&e),
            };
            let precision = match precision.as_str() {
                "auto" => None,
                p => match sluice_model::Precision::parse(p) {
                    Ok(p) => Some(p),
                    Err(_) => {
                        eprintln!("error: --precision {p:?}: use auto, f32 or bf16");
                        return ExitCode::from(2);
                    }
                },
            };
            let opts = sluice_trainer::sft_cmd::SftOptions {
                model_config: model,
                device,
                precision,
                steps,
                batch,
                min_digits,
                max_digits,
                data_seed: seed,
                muon_lr,
                adamw_lr,
                warmup,
                log_every,
                out_dir: out,
            };
            match sluice_trainer::sft_cmd::run_sft(&opts, &mut std::io::stdout()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Command::Train {
            config,
            device,
            mode,
            seed,
            out,
            resume,
            sets,
            replay_env,
        } => {
            let opts = sluice_trainer::train_cmd::TrainOptions {
                config,
                sets,
                device,
                mode,
                seed,
                out,
                resume,
                replay_env,
            };
            match sluice_trainer::train_cmd::run_train(&opts, &mut std::io::stdout()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::Experiment {
            name,
            list,
            quick,
            config,
            sets,
            arms,
            seeds,
            steps,
            out,
        } => {
            use sluice_trainer::experiment::{run_experiment, ExperimentOptions, EXPERIMENTS};
            if list || name.is_none() {
                for e in EXPERIMENTS {
                    let arms: Vec<String> = (e.arms)().into_iter().map(|a| a.name).collect();
                    println!("{}: {}", e.name, e.about);
                    match e.unavailable {
                        Some(why) => println!("    unavailable: {why}"),
                        None => println!("    arms: {}", arms.join(", ")),
                    }
                }
                return if list {
                    ExitCode::SUCCESS
                } else {
                    eprintln!("error: name an experiment (sluice experiment NAME [--quick])");
                    ExitCode::from(2)
                };
            }
            let opts = ExperimentOptions {
                name: name.unwrap_or_default(),
                quick,
                config,
                sets,
                arms,
                seeds,
                steps,
                out,
            };
            match run_experiment(&opts, &mut std::io::stdout()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::BenchServe {
            config,
            sets,
            batches,
            prompt,
            tokens,
            reps,
            idle,
        } => {
            let batches: Result<Vec<usize>, _> =
                batches.split(',').map(|b| b.trim().parse()).collect();
            let Ok(batches) = batches else {
                eprintln!("error: --batches: give numbers separated by commas, e.g. 1,16,64");
                return ExitCode::from(2);
            };
            let opts = sluice_trainer::bench_serve::BenchServeOptions {
                serve: sluice_trainer::serve::ServeOptions {
                    config: Some(config.unwrap_or_else(|| PathBuf::from("configs/tiny.toml"))),
                    sets,
                    ..Default::default()
                },
                batches,
                prompt,
                tokens,
                reps,
                idle,
            };
            match sluice_trainer::bench_serve::run(&opts, &mut std::io::stdout()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::Serve {
            config,
            weights,
            weights_version,
            listen,
            sets,
        } => {
            let opts = sluice_trainer::serve::ServeOptions {
                config,
                sets,
                weights,
                weights_version,
                listen,
            };
            match sluice_trainer::serve::run(&opts, &mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::Eval {
            checkpoint,
            task,
            samples,
            config,
            show,
            precision,
        } => {
            let opts = sluice_trainer::eval_cmd::EvalOptions {
                checkpoint,
                task,
                samples,
                config,
                show,
                precision,
            };
            match sluice_trainer::eval_cmd::run_eval(&opts, &mut std::io::stdout()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::Tasks {
            command:
                TasksCommand::Export {
                    task,
                    config,
                    sets,
                    split,
                    n,
                    seed,
                    out,
                },
        } => {
            let opts = sluice_trainer::tasks_cmd::ExportOptions {
                task,
                config,
                sets,
                split,
                n,
                seed,
                out,
            };
            match sluice_trainer::tasks_cmd::run_export(&opts, &mut std::io::stdout()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::Tokenizer {
            command:
                TokenizerCommand::Train {
                    out,
                    vocab,
                    digits,
                    problems,
                    config,
                    sets,
                },
        } => {
            let opts = sluice_trainer::tokenizer_cmd::TrainTokenizerOptions {
                config,
                sets,
                out,
                vocab,
                digits,
                problems,
            };
            match sluice_trainer::tokenizer_cmd::run_train(&opts, &mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
                }
            }
        }
        Command::Config { print_defaults } => {
            if print_defaults {
                print!("{}", sluice_trainer::config::DEFAULTS);
                ExitCode::SUCCESS
            } else {
                eprintln!("error: nothing to do; usage: sluice config --print-defaults");
                ExitCode::from(2)
            }
        }
        Command::Delta { command } => {
            match sluice_trainer::delta_cmd::run(&command, &mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Command::Determinism { command } => {
            let mut stdout = std::io::stdout();
            match sluice_trainer::determinism::run(&command, &mut stdout) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    let _ = std::io::Write::flush(&mut stdout);
                    eprintln!("error: {e}");
                    ExitCode::from(e.exit_code())
                }
            }
        }
        Command::Emu {
            command: sluice_trainer::emu_cmd::EmuCommand::Check(args),
        } => sluice_trainer::emu_cmd::check(&args),
        Command::Emu {
            command: sluice_trainer::emu_cmd::EmuCommand::Profile(args),
        } => sluice_trainer::emu_profile_cmd::profile(&args),
        Command::Devices => {
            println!("cpu: available ({} threads)", rayon_threads());
            println!("emu: available (CUDA kernels on the CPU; SLUICE_EMU_SEED sets the schedule)");
            match sluice_kernels::Backend::open(Device::Cuda(0)) {
                Ok(b) => {
                    let c = b.cuda().expect("opened a cuda backend");
                    let (maj, min) = c.compute_capability();
                    println!("cuda:0: {} (sm_{maj}{min}, PTX {:?})", c.name(), c.arch());
                }
                Err(e) => println!("cuda: unavailable: {e}"),
            }
            match sluice_kernels::cuda::nvml_summary() {
                Ok(s) => println!("{s}"),
                Err(e) => println!("telemetry: {e}"),
            }
            ExitCode::SUCCESS
        }
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
