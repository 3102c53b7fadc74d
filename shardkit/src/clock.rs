//! The one clock shardkit reads: snowflake ids, the GSI grace period, the
//! rollout phase gap and rollout cache lifetimes all take the time from the
//! [`Clock`] a cluster was built with ([`ClusterBuilder::clock`](crate::ClusterBuilder::clock)),
//! so tests can drive time-dependent behaviour with a [`ManualClock`]
//! instead of sleeping.

use futures::future::BoxFuture;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where shardkit reads the time (Unix milliseconds).
///
/// Times shardkit stores (GSI index rows' `created_ms`, a rollout's
/// `changed_ms`) come from the same clock they are later compared with, so
/// a cluster whose clock is not the system clock stays consistent with
/// itself; instances that share databases should read clocks that agree.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_millis(&self) -> u64;

    /// Completes once the clock reads `unix_ms` or later: shardkit's waits
    /// (a rollout's gap) sleep on the clock they are measured by. The
    /// default sleeps on tokio's timer for the time left now.
    fn sleep_until(&self, unix_ms: u64) -> BoxFuture<'static, ()> {
        let left = unix_ms.saturating_sub(self.now_millis());
        Box::pin(tokio::time::sleep(Duration::from_millis(left)))
    }
}

/// The system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to: for tests of grace periods, phase
/// gaps and cache lifetimes without sleeping. Share it (`Arc`) between the
/// clusters of one test so they agree on the time.
#[derive(Debug)]
pub struct ManualClock {
    now: AtomicU64,
    /// Tells waiters ([`Clock::sleep_until`]) that the clock moved.
    moved: tokio::sync::watch::Sender<u64>,
}

impl ManualClock {
    /// A clock standing at `unix_ms`.
    pub fn new(unix_ms: u64) -> Self {
        ManualClock {
            now: AtomicU64::new(unix_ms),
            moved: tokio::sync::watch::Sender::new(unix_ms),
        }
    }

    /// A clock standing at the system clock's current time.
    pub fn starting_now() -> Self {
        ManualClock::new(SystemClock.now_millis())
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        // Under the channel's lock, so the value sleepers see is never older
        // than the clock (two movers at once publish in order).
        self.moved.send_modify(|seen| {
            let before = self
                .now
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                    Some(t.saturating_add(ms))
                })
                .unwrap_or_else(|t| t);
            *seen = before.saturating_add(ms);
        });
    }

    /// Sets the clock to `unix_ms` (backwards too: for clock-rollback tests).
    pub fn set(&self, unix_ms: u64) {
        self.moved.send_modify(|seen| {
            self.now.store(unix_ms, Ordering::Release);
            *seen = unix_ms;
        });
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> u64 {
        self.now.load(Ordering::Acquire)
    }

    /// Completes once the clock has been moved to `unix_ms` or later.
    fn sleep_until(&self, unix_ms: u64) -> BoxFuture<'static, ()> {
        let mut moved = self.moved.subscribe();
        Box::pin(async move {
            // The sender lives as long as the clock; a clock dropped while
            // someone waits on it will never reach the time: wait for ever.
            if moved.wait_for(|now| *now >= unix_ms).await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

/// `clock`'s time as the signed milliseconds shardkit stores in its tables.
pub(crate) fn now_ms(clock: &dyn Clock) -> i64 {
    i64::try_from(clock.now_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(1_000);
        assert_eq!(clock.now_millis(), 1_000);
        clock.advance(Duration::from_millis(250));
        assert_eq!(clock.now_millis(), 1_250);
        clock.set(10);
        assert_eq!(now_ms(&clock), 10);
        clock.advance(Duration::MAX);
        assert_eq!(clock.now_millis(), u64::MAX);
        assert_eq!(now_ms(&clock), i64::MAX);
    }
}
