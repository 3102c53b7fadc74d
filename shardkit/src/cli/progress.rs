//! Progress of long commands, and Ctrl-C as a request to stop at the next
//! chunk boundary.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often a line is printed when the output is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// A progress bar on a terminal, a line every few seconds (to stderr)
/// otherwise, nothing with `--json`.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    lines: bool,
    last_line: Option<Instant>,
    what: String,
    stop: Arc<AtomicBool>,
    listener: tokio::task::JoinHandle<()>,
    started: Instant,
}

impl Progress {
    /// Progress of `what` (`rollout people_v2 backfill`); `total` units if
    /// known (shards, say).
    pub(super) fn new(what: impl Into<String>, total: Option<u64>, json: bool) -> Self {
        let what = what.into();
        let terminal = !json && std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let bar = match total {
                Some(total) => ProgressBar::new(total),
                None => ProgressBar::new_spinner(),
            };
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} {msg} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_message(what.clone());
            bar
        });
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        // Ctrl-C asks the work to stop after its current chunk; a second
        // one is the terminal's default (the process ends).
        let listener = tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                flag.store(true, Ordering::Release);
            }
        });
        Progress {
            bar,
            lines: !terminal && !json,
            last_line: None,
            what,
            stop,
            listener,
            started: Instant::now(),
        }
    }

    /// Reports `done` of `total` units and `detail` (rows, rate); whether to
    /// go on.
    pub(super) fn report(
        &mut self,
        done: u64,
        total: Option<u64>,
        detail: &str,
    ) -> ControlFlow<()> {
        if let Some(bar) = &self.bar {
            if let Some(total) = total {
                bar.set_length(total);
            }
            bar.set_position(done);
            bar.set_message(format!("{} {detail}", self.what));
        } else if self.lines && self.last_line.is_none_or(|at| at.elapsed() >= LINE_EVERY) {
            self.last_line = Some(Instant::now());
            let of = total.map(|t| format!("/{t}")).unwrap_or_default();
            eprintln!(
                "{}: {done}{of} {detail} after {:.0?}",
                self.what,
                self.started.elapsed()
            );
        }
        if self.stop.load(Ordering::Acquire) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    /// Whether Ctrl-C asked to stop.
    pub(super) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The flag Ctrl-C sets, for work that checks it itself.
    pub(super) fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// Rows per second so far.
    pub(super) fn rate(&self, rows: u64) -> f64 {
        rows as f64 / self.started.elapsed().as_secs_f64().max(1e-3)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.listener.abort();
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
