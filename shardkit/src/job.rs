//! [`JobControl`]: progress and cancellation of every long job, one shape.
//!
//! The long jobs run chunk by chunk and save their position as they go:
//! [`Gsi::backfill_with`](crate::gsi::Gsi::backfill_with) and
//! [`Gsi::reconcile_with`](crate::gsi::Gsi::reconcile_with),
//! [`RolloutHandle::backfill_with`](crate::RolloutHandle::backfill_with) and
//! [`RolloutHandle::verify_with`](crate::RolloutHandle::verify_with),
//! [`Cluster::verify_shards_with`](crate::Cluster::verify_shards_with), and a
//! bucket move's [`Rebalance::run`](crate::rebalance::Rebalance::run) (given
//! with [`Rebalance::control`](crate::rebalance::Rebalance::control)). Each
//! takes a [`JobControl<P>`], where `P` is what it reports.

use std::fmt;
use std::sync::Arc;

pub use tokio_util::sync::CancellationToken;

/// A progress callback, shared by the clones of a [`JobControl`].
type ProgressFn<P> = Arc<dyn Fn(&P) + Send + Sync>;

/// How a caller watches and stops a long job: a progress callback and a
/// [`CancellationToken`].
///
/// **Progress**: the job calls the [`on_progress`](Self::on_progress)
/// callback with what it has done so far (`P`: a
/// [`BackfillProgress`](crate::gsi::BackfillProgress), a
/// [`RolloutBackfill`](crate::RolloutBackfill), a
/// [`VerifyReport`](crate::VerifyReport), a
/// [`ReconcileReport`](crate::gsi::ReconcileReport), a
/// [`MoveProgress`](crate::rebalance::MoveProgress)) after every chunk, and
/// where it has them after every shard or phase. The callback runs on the
/// job's task, between its statements: keep it short.
///
/// **Cancellation**, the same for every job: once the token given to
/// [`cancel_on`](Self::cancel_on) is cancelled (before the job starts, from
/// the callback, from another task, on Ctrl-C), the job stops at its next
/// chunk boundary (a bucket move: the next chunk of its copy, the next round
/// of its replay, or the next phase, but never in the middle of a cut-over).
/// A chunk under way is finished and its position saved, never cut short.
/// The job then returns `Ok` with its progress so far, marked unfinished
/// (`finished: false`; a move in a phase short of `done`), and leaves its
/// saved position: the next call resumes there. (A
/// [`reconcile`](crate::gsi::Gsi::reconcile_with) pass has no position to
/// save: the next one starts over. A
/// [`verify_shards`](crate::Cluster::verify_shards_with) returns its position
/// in [`VerifyReport::cursor`](crate::VerifyReport::cursor) for
/// [`VerifyOptions::start_at`](crate::VerifyOptions::start_at).)
/// Cancelling is not an error and stops nothing else: a cancelled token stays
/// cancelled, so give the next run a new one.
///
/// Cloning is cheap (the callback and the token are shared), and
/// `JobControl::default()` (or [`new`](Self::new)) reports to no one and is
/// never cancelled.
///
/// ```
/// use shardkit::{CancellationToken, JobControl, RolloutBackfill};
///
/// let stop = CancellationToken::new();
/// let control = JobControl::<RolloutBackfill>::new()
///     .on_progress(|p| println!("{} rows, {}/{} shards", p.rows, p.shards_done, p.shards))
///     .cancel_on(stop.clone());
/// // Elsewhere (a signal handler, a shutdown path): stop at the next chunk.
/// stop.cancel();
/// assert!(control.token().is_cancelled());
/// ```
pub struct JobControl<P> {
    progress: Option<ProgressFn<P>>,
    token: CancellationToken,
}

impl<P> JobControl<P> {
    /// A control that reports to no one and is never cancelled.
    pub fn new() -> Self {
        JobControl {
            progress: None,
            token: CancellationToken::new(),
        }
    }

    /// Calls `f` with the job's progress after every chunk (and, for the
    /// jobs that have them, every shard or phase). Replaces an earlier
    /// callback.
    pub fn on_progress(mut self, f: impl Fn(&P) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Stops the job at its next chunk boundary once `token` is cancelled
    /// (see [`JobControl`] for what stopping leaves). Replaces the control's
    /// own token: cancelling a parent of `token` cancels it too.
    pub fn cancel_on(mut self, token: CancellationToken) -> Self {
        self.token = token;
        self
    }

    /// The token the job watches: cancel it to stop the job.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Hands `progress` to the callback, if there is one.
    pub(crate) fn report(&self, progress: &P) {
        if let Some(f) = &self.progress {
            f(progress);
        }
    }

    /// Whether the job should stop at this boundary.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }
}

impl<P> Default for JobControl<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> Clone for JobControl<P> {
    fn clone(&self) -> Self {
        JobControl {
            progress: self.progress.clone(),
            token: self.token.clone(),
        }
    }
}

impl<P> fmt::Debug for JobControl<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobControl")
            .field("on_progress", &self.progress.is_some())
            .field("cancelled", &self.token.is_cancelled())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn clones_share_the_callback_and_the_token() {
        let seen = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&seen);
        let token = CancellationToken::new();
        let control = JobControl::<u64>::new()
            .on_progress(move |n| {
                counted.fetch_add(*n, Ordering::Relaxed);
            })
            .cancel_on(token.clone());
        let clone = control.clone();
        control.report(&2);
        clone.report(&3);
        assert_eq!(seen.load(Ordering::Relaxed), 5);
        assert!(!clone.is_cancelled());
        token.cancel();
        assert!(control.is_cancelled() && clone.is_cancelled());
    }

    #[test]
    fn the_default_reports_nowhere_and_never_stops() {
        let control = JobControl::<u64>::default();
        control.report(&1);
        assert!(!control.is_cancelled());
        assert!(format!("{control:?}").contains("cancelled: false"));
    }
}
