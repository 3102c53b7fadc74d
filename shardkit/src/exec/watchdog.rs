//! The requests waiting on one shard, for its breaker's watch
//! ([`crate::exec::health`]).
//!
//! A request that is still waiting after [`SUSPECT_AFTER`] makes the breaker
//! ask whether its shard is down. Giving each request a timer of its own
//! costs a registration and a removal in the runtime's timer wheel per
//! request, although almost every request ends long before. Instead a
//! request that has to wait registers here (its start and its waker; a
//! request answered on its first poll never does), and one task per shard
//! sleeps until the oldest registered request is due. When the shard is
//! found down, the task marks the requests that were overdue and wakes
//! them; they fail with the cause.
//!
//! [`SUSPECT_AFTER`]: crate::exec::health::SUSPECT_AFTER

use slab::Slab;
use std::sync::{Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;
use tokio::time::Instant;

/// The requests waiting on one shard, and whether its watch task runs.
#[derive(Default)]
pub(crate) struct Watchdog {
    state: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    /// The waiting requests.
    slots: Slab<Entry>,
    /// The watch task that runs, by its number (see [`Ticker`]).
    ticker: Option<u64>,
    /// The last watch task's number.
    tickers: u64,
}

struct Entry {
    since: Instant,
    waker: Waker,
    /// Set when the shard was found down while the request waited.
    failed: Option<String>,
}

/// What the watch task does next ([`Watchdog::due`]).
pub(crate) enum Due {
    /// Nothing waits.
    Idle,
    /// The oldest request is due at this instant.
    At(Instant),
    /// Requests that started at or before this instant are overdue.
    Now(Instant),
}

/// A request's place in a [`Watchdog`] while it waits; dropping it (the
/// request ended or was dropped) removes it.
pub(crate) struct Registration<'a> {
    dog: &'a Watchdog,
    slot: Option<usize>,
}

/// A watch task's number: the task that holds it is the one that runs
/// until it stops when idle or [`Watchdog::release`]s it (a task may be
/// dropped without running to its end, when its runtime shuts down).
#[derive(Clone, Copy)]
pub(crate) struct Ticker {
    number: u64,
}

impl Watchdog {
    fn state(&self) -> MutexGuard<'_, Waiting> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request about to wait on the shard; it registers on its first
    /// [`Registration::poll`].
    pub(crate) fn registration(&self) -> Registration<'_> {
        Registration {
            dog: self,
            slot: None,
        }
    }

    /// When the watch task has to look again, for requests due `after`
    /// their start.
    pub(crate) fn due(&self, after: Duration) -> Due {
        let state = self.state();
        let oldest = state
            .slots
            .iter()
            .map(|(_, e)| e)
            .filter(|e| e.failed.is_none());
        match oldest.map(|e| e.since).min() {
            None => Due::Idle,
            Some(since) => {
                let at = since + after;
                let now = Instant::now();
                if at <= now {
                    Due::Now(now - after)
                } else {
                    Due::At(at)
                }
            }
        }
    }

    /// When the first request that started after `cutoff` (and has not
    /// failed) is due, `after` its start.
    pub(crate) fn due_after(&self, cutoff: Instant, after: Duration) -> Option<Instant> {
        let state = self.state();
        let newer = state.slots.iter().map(|(_, e)| e);
        newer
            .filter(|e| e.failed.is_none() && e.since > cutoff)
            .map(|e| e.since + after)
            .min()
    }

    /// The shard was found down with `cause`: fails and wakes the requests
    /// that started at or before `cutoff`.
    pub(crate) fn fail_since(&self, cutoff: Instant, cause: &str) {
        let mut woken = Vec::new();
        {
            let mut state = self.state();
            for (_, entry) in state.slots.iter_mut() {
                if entry.since <= cutoff && entry.failed.is_none() {
                    entry.failed = Some(cause.to_owned());
                    woken.push(entry.waker.clone());
                }
            }
        }
        // Woken with the lock released: a waker may run code that
        // registers or drops a request of this shard.
        woken.into_iter().for_each(Waker::wake);
    }

    /// Ends the watch task `ticker` if no request waits that it still has
    /// to watch (a failed one is woken already and leaves on its next
    /// poll; a request that registers later starts a new task).
    pub(crate) fn stop_if_idle(&self, ticker: Ticker) -> bool {
        let mut state = self.state();
        if state.slots.iter().any(|(_, e)| e.failed.is_none()) {
            return false;
        }
        if state.ticker == Some(ticker.number) {
            state.ticker = None;
        }
        true
    }

    /// The watch task `ticker` is gone. If it ended without stopping (its
    /// runtime shut down) while requests wait, one of them is woken: its
    /// next poll starts another task, on its own runtime. (A request
    /// waiting on a server that never answers is not polled otherwise.)
    pub(crate) fn release(&self, ticker: Ticker) {
        let waker = {
            let mut state = self.state();
            if state.ticker != Some(ticker.number) {
                return;
            }
            state.ticker = None;
            let mut watched = state.slots.iter().map(|(_, e)| e);
            watched
                .find(|e| e.failed.is_none())
                .map(|e| e.waker.clone())
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl Registration<'_> {
    /// Called when the request's own future is pending: registers it (with
    /// a new watch task's claim when none runs, for the caller to start),
    /// keeps its waker current, and gives the cause once the shard was
    /// found down while it waited.
    pub(crate) fn poll(&mut self, waker: &Waker) -> Poll {
        let mut state = self.dog.state();
        let Some(slot) = self.slot else {
            let entry = Entry {
                since: Instant::now(),
                waker: waker.clone(),
                failed: None,
            };
            self.slot = Some(state.slots.insert(entry));
            return Poll::Waiting(state.claim());
        };
        let Some(entry) = state.slots.get_mut(slot) else {
            return Poll::Waiting(None);
        };
        // (Kept: a failed entry is not due again until the request drops it.)
        if let Some(cause) = &entry.failed {
            return Poll::Down(cause.clone());
        }
        if !entry.waker.will_wake(waker) {
            entry.waker = waker.clone();
        }
        // The watch task may have ended without stopping (its runtime
        // shut down): a request still waiting starts another.
        Poll::Waiting(state.claim())
    }
}

impl Waiting {
    /// A new watch task's claim, when none runs.
    fn claim(&mut self) -> Option<Ticker> {
        if self.ticker.is_some() {
            return None;
        }
        self.tickers += 1;
        self.ticker = Some(self.tickers);
        Some(Ticker {
            number: self.tickers,
        })
    }
}

/// A registered request's state ([`Registration::poll`]).
pub(crate) enum Poll {
    /// Waiting; with the claim of a watch task to start, when none runs.
    Waiting(Option<Ticker>),
    /// The shard was found down: the cause.
    Down(String),
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            self.dog.state().slots.remove(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waiting(poll: Poll) -> Option<Ticker> {
        match poll {
            Poll::Waiting(ticker) => ticker,
            Poll::Down(cause) => panic!("down: {cause}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_overdue_requests_fail_and_the_watch_ends_when_none_waits() {
        let dog = Watchdog::default();
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&woken));
        let after = Duration::from_millis(150);
        assert!(matches!(dog.due(after), Due::Idle));

        let mut old = dog.registration();
        let ticker = waiting(old.poll(&waker)).expect("the first waiting request starts the watch");
        let started = Instant::now();
        tokio::time::advance(Duration::from_millis(100)).await;
        let mut new = dog.registration();
        assert!(waiting(new.poll(&waker)).is_none(), "one watch at a time");
        assert!(matches!(dog.due(after), Due::At(at) if at == started + after));
        assert!(!dog.stop_if_idle(ticker), "requests wait");

        tokio::time::advance(Duration::from_millis(60)).await;
        let Due::Now(cutoff) = dog.due(after) else {
            panic!("the first request is overdue")
        };
        // Found up instead: the next look is when the newer one is due.
        assert_eq!(
            dog.due_after(cutoff, after).map(|at| at - started),
            Some(Duration::from_millis(250))
        );
        dog.fail_since(cutoff, "refused");
        assert_eq!(
            woken.0.load(Ordering::SeqCst),
            1,
            "only the overdue one is woken"
        );
        assert!(matches!(old.poll(&waker), Poll::Down(cause) if cause == "refused"));
        assert!(
            waiting(new.poll(&waker)).is_none(),
            "the newer one waits on"
        );
        // Failed requests are not due again; the newer one is, 150 ms after its start.
        match dog.due(after) {
            Due::At(at) => assert_eq!(at - started, Duration::from_millis(250)),
            _ => panic!("the newer request is not due yet"),
        }

        assert!(!dog.stop_if_idle(ticker), "the newer one is still watched");

        // The watch task ended without stopping (its runtime shut down): a
        // request still waiting is woken, and starts another on its poll.
        dog.release(ticker);
        assert_eq!(
            woken.0.load(Ordering::SeqCst),
            2,
            "the waiting one is woken"
        );
        let ticker = waiting(new.poll(&waker)).expect("a waiting request restarts the watch");
        assert!(waiting(new.poll(&waker)).is_none());

        drop(new);
        // Only a failed request is left, woken already: nothing to watch,
        // so the task stops (it must not go round for it until it leaves).
        assert!(matches!(dog.due(after), Due::Idle));
        assert!(dog.stop_if_idle(ticker));
        drop(old);
        assert!(matches!(dog.due(after), Due::Idle));
        let mut next = dog.registration();
        assert!(
            waiting(next.poll(&waker)).is_some(),
            "after the watch ended, the next waiting request starts one"
        );
    }
}
