//! Periodic background tasks that live no longer than their cluster.
//!
//! A task holds only a weak reference (a [`Handle`]'s `Weak`) between passes, and
//! for a pass it borrows a handle that keeps the pools open but is not a
//! *user* of the cluster. User handles (the [`Cluster`]s a program holds, and
//! the reads, transactions and rollout handles made from them) share one
//! [`Users`] guard; when the last of them drops, the [`Stop`] signal closes
//! and every task returns at once, a pass in flight included (its statements
//! run in transactions, which roll back when dropped). Counting passes as
//! users would let tasks whose passes overlap keep each other, and the
//! pools, alive forever.

use std::future::Future;
use std::ops::ControlFlow;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Shared by every user handle of a cluster; dropping the last one closes
/// the cluster's [`Stop`] signal.
#[derive(Debug)]
pub(crate) struct Users {
    _stop: watch::Sender<()>,
}

impl Users {
    /// The guard for a new cluster's user handles, and its signal.
    pub(crate) fn new() -> (Users, Stop) {
        let (tx, rx) = watch::channel(());
        (Users { _stop: tx }, Stop(rx))
    }
}

/// Closed once the cluster has no user left.
#[derive(Debug)]
pub(crate) struct Stop(watch::Receiver<()>);

impl Stop {
    fn subscribe(&self) -> watch::Receiver<()> {
        self.0.clone()
    }
}

/// A claim that a background task holds (a flag set so that one such task
/// runs at a time): made before the task is spawned and moved into it, it
/// runs `release` when dropped armed, however the task ends (its passes
/// done, the cluster gone, or a runtime that shut down dropping the task
/// before it ran). A task that releases the flag itself disarms it first;
/// one that never does (a shard's watch) leaves it armed.
pub(crate) struct Claim {
    armed: std::sync::atomic::AtomicBool,
    release: Box<dyn Fn() + Send + Sync>,
}

impl Claim {
    pub(crate) fn new(release: impl Fn() + Send + Sync + 'static) -> Claim {
        Claim {
            armed: std::sync::atomic::AtomicBool::new(true),
            release: Box::new(release),
        }
    }

    /// Whether dropping the claim releases the flag.
    pub(crate) fn arm(&self, armed: bool) {
        self.armed
            .store(armed, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.armed.load(std::sync::atomic::Ordering::Acquire) {
            (self.release)();
        }
    }
}

/// What a periodic task runs on: the execution layer's [`Shards`] or a
/// feature's handle built on it. Its weak form keeps nothing alive.
///
/// [`Shards`]: crate::exec::Shards
pub(crate) trait Handle: Sized + Send + 'static {
    /// The reference a task keeps between passes.
    type Weak: Send + Sync + 'static;
    /// The reference a task keeps between passes.
    fn downgrade(&self) -> Self::Weak;
    /// A handle for one pass: it keeps the pools open while the pass runs
    /// but is not a user of the cluster.
    fn upgrade(weak: &Self::Weak) -> Option<Self>;
    /// Closed once the cluster has no user left.
    fn stop_signal(&self) -> &Stop;
}

/// When a task's first pass runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FirstPass {
    /// As soon as the task starts.
    Now,
    /// One interval after the task starts.
    AfterInterval,
}

/// Runs `pass` every `interval` (delayed, not bunched up, when a pass
/// overruns) until the cluster's last user handle is dropped, `pass` returns
/// [`ControlFlow::Break`], or the returned handle is aborted. Each pass gets
/// a task handle (see [`Handle::upgrade`]) that it drops when it is done.
pub(crate) fn spawn<H, F, Fut>(
    handle: &H,
    interval: Duration,
    first: FirstPass,
    mut pass: F,
) -> JoinHandle<()>
where
    H: Handle,
    F: FnMut(H) -> Fut + Send + 'static,
    Fut: Future<Output = ControlFlow<()>> + Send,
{
    let weak = handle.downgrade();
    let mut stopped = handle.stop_signal().subscribe();
    // A zero interval would make `interval` panic.
    let interval = interval.max(Duration::from_millis(1));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        if first == FirstPass::AfterInterval {
            tick.tick().await;
        }
        loop {
            // Nothing is ever sent: `changed` completes when the last user
            // handle is gone.
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopped.changed() => return,
            }
            match one_pass(&weak, &mut stopped, &mut pass).await {
                Some(ControlFlow::Continue(())) => {}
                Some(ControlFlow::Break(())) | None => return,
            }
        }
    })
}

/// One pass on a handle for it, unless the cluster has no user left
/// (`None`: the task ends), also while the pass runs.
async fn one_pass<H: Handle, F: FnMut(H) -> Fut, Fut: Future>(
    weak: &H::Weak,
    stopped: &mut watch::Receiver<()>,
    pass: &mut F,
) -> Option<Fut::Output> {
    let handle = H::upgrade(weak)?;
    if stopped.has_changed().is_err() {
        return None;
    }
    tokio::select! {
        out = pass(handle) => Some(out),
        _ = stopped.changed() => None,
    }
}

/// Runs `pass` once, in a task of its own, unless the cluster has no user
/// left (also while it runs: the pass is dropped then, as a periodic
/// task's is).
pub(crate) fn spawn_once<H, F, Fut>(handle: &H, pass: F) -> JoinHandle<()>
where
    H: Handle,
    F: FnOnce(H) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let weak = handle.downgrade();
    let mut stopped = handle.stop_signal().subscribe();
    tokio::spawn(async move {
        let mut pass = Some(pass);
        one_pass(&weak, &mut stopped, &mut |h| {
            (pass.take().expect("one pass"))(h)
        })
        .await;
    })
}

/// Runs `pass` at once, then again after the wait each pass returns
/// ([`ControlFlow::Continue`]), until a pass returns [`ControlFlow::Break`]
/// or the cluster's last user handle is dropped (as [`spawn`]).
pub(crate) fn spawn_paced<H, F, Fut>(handle: &H, mut pass: F) -> JoinHandle<()>
where
    H: Handle,
    F: FnMut(H) -> Fut + Send + 'static,
    Fut: Future<Output = ControlFlow<(), Duration>> + Send,
{
    let weak = handle.downgrade();
    let mut stopped = handle.stop_signal().subscribe();
    tokio::spawn(async move {
        let mut wait = Duration::ZERO;
        loop {
            if wait.is_zero() {
                // Passes that ask for no wait still let the runtime run
                // other tasks in between.
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stopped.changed() => return,
                }
            }
            match one_pass(&weak, &mut stopped, &mut pass).await {
                Some(ControlFlow::Continue(next)) => wait = next,
                Some(ControlFlow::Break(())) | None => return,
            }
        }
    })
}
