//! Progress of a stage: a bar (step, message, ETA) when stdout is a terminal, plain lines every
//! `every` steps otherwise (logs, CI, pipes).

use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::time::Instant;

pub struct Progress {
    name: String,
    total: u64,
    every: u64,
    bar: Option<ProgressBar>,
    start: Instant,
}

impl Progress {
    /// A progress display for `total` steps of stage `name`.
    pub fn new(name: &str, total: u64, every: u64) -> Progress {
        let bar = std::io::stdout().is_terminal().then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template(
                    "{prefix:>8} [{bar:30}] {pos}/{len} {msg} (ETA {eta})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_prefix(name.to_string());
            b
        });
        Progress {
            name: name.to_string(),
            total,
            every: every.max(1),
            bar,
            start: Instant::now(),
        }
    }

    /// Step `step` is done; `msg` says how it went.
    pub fn update(&mut self, out: &mut dyn Write, step: u64, msg: &str) {
        match &self.bar {
            Some(b) => {
                b.set_position(step);
                b.set_message(msg.to_string());
            }
            None => {
                if step == 1 || step.is_multiple_of(self.every) || step == self.total {
                    let secs = self.start.elapsed().as_secs_f64();
                    let eta = if step > 0 {
                        secs / step as f64 * (self.total.saturating_sub(step)) as f64
                    } else {
                        0.0
                    };
                    // Progress is best effort: a closed stdout must not stop the run.
                    let _ = writeln!(
                        out,
                        "{:>8} step {step:>5}/{}  {msg}  {secs:.1}s (ETA {eta:.0}s)",
                        self.name, self.total
                    );
                }
            }
        }
    }

    /// The stage is over.
    pub fn finish(&mut self, out: &mut dyn Write, msg: &str) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        let _ = writeln!(out, "{:>8} done: {msg}", self.name);
    }
}
