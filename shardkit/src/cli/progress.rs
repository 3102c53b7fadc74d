//! Progress of long commands, and Ctrl-C as a request to stop at the next
//! chunk boundary: the Ctrl-C listener cancels the [`JobControl`]'s token.

use crate::job::{CancellationToken, JobControl};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a line is printed when the output is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// A progress bar on a terminal, a line every few seconds (to stderr)
/// otherwise, nothing with `--json`; and the token Ctrl-C cancels.
pub(super) struct Progress {
    bar: Bar,
    token: CancellationToken,
    listener: tokio::task::JoinHandle<()>,
}

/// What is shown, shared with the progress callbacks of the jobs.
#[derive(Clone)]
pub(super) struct Bar {
    shown: Arc<Mutex<Shown>>,
    started: Instant,
}

struct Shown {
    bar: Option<ProgressBar>,
    lines: bool,
    last_line: Option<Instant>,
    what: String,
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
        let token = CancellationToken::new();
        let cancel = token.clone();
        // Ctrl-C asks the work to stop after its current chunk; a second
        // one is the terminal's default (the process ends).
        let listener = tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                cancel.cancel();
            }
        });
        Progress {
            bar: Bar {
                shown: Arc::new(Mutex::new(Shown {
                    bar,
                    lines: !terminal && !json,
                    last_line: None,
                    what,
                })),
                started: Instant::now(),
            },
            token,
            listener,
        }
    }

    /// A job's control: `show` puts each report of the job on the bar, and
    /// Ctrl-C cancels the job at its next chunk boundary.
    pub(super) fn control<P>(
        &self,
        show: impl Fn(&Bar, &P) + Send + Sync + 'static,
    ) -> JobControl<P> {
        let bar = self.bar.clone();
        JobControl::new()
            .on_progress(move |p| show(&bar, p))
            .cancel_on(self.token.clone())
    }

    /// Reports `done` of `total` units and `detail`.
    pub(super) fn report(&self, done: u64, total: Option<u64>, detail: &str) {
        self.bar.report(done, total, detail);
    }

    /// Whether Ctrl-C asked to stop.
    pub(super) fn stopped(&self) -> bool {
        self.token.is_cancelled()
    }
}

impl Bar {
    /// Reports `done` of `total` units and `detail` (rows, rate).
    pub(super) fn report(&self, done: u64, total: Option<u64>, detail: &str) {
        let mut shown = self.shown.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bar) = &shown.bar {
            if let Some(total) = total {
                bar.set_length(total);
            }
            bar.set_position(done);
            bar.set_message(format!("{} {detail}", shown.what));
        } else if shown.lines && shown.last_line.is_none_or(|at| at.elapsed() >= LINE_EVERY) {
            shown.last_line = Some(Instant::now());
            let of = total.map(|t| format!("/{t}")).unwrap_or_default();
            eprintln!(
                "{}: {done}{of} {detail} after {:.0?}",
                shown.what,
                self.started.elapsed()
            );
        }
    }

    /// Rows per second so far.
    pub(super) fn rate(&self, rows: u64) -> f64 {
        rows as f64 / self.started.elapsed().as_secs_f64().max(1e-3)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.listener.abort();
        let shown = self.bar.shown.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bar) = &shown.bar {
            bar.finish_and_clear();
        }
    }
}
