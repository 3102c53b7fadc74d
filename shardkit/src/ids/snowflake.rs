//! The ids made without a database: snowflakes and UUIDv7.

use crate::clock::Clock;
use crate::error::{Result, ShardError};
use crate::id_spec::{SNOWFLAKE_EPOCH_MS, SnowflakeLayout};
use crate::ids::lock::lock;
use std::sync::{Arc, Mutex};

/// A time-ordered UUID (version 7): index-friendly like COMB GUIDs, and
/// monotonic within this process (the `uuid` crate's v7 context). Store it as
/// 16 bytes (`uuid` on PostgreSQL, `BINARY(16)`/`BLOB` elsewhere).
pub fn uuid_v7() -> uuid::Uuid {
    uuid::Uuid::now_v7()
}

/// Snowflake ids: `(ms since 2026-01-01 UTC) << (worker_bits + sequence_bits)
/// | worker << sequence_bits | sequence`.
///
/// Clock rollback: if the clock steps back by at most 5 ms the generator
/// waits it out; a larger step is refused with
/// [`ShardError::ClockMovedBackwards`]. It never returns a duplicate.
pub struct Snowflake {
    layout: SnowflakeLayout,
    worker: u64,
    clock: Arc<dyn Clock>,
    max_backward: u64,
    state: Mutex<(u64, u64)>,
}

impl std::fmt::Debug for Snowflake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snowflake")
            .field("layout", &self.layout)
            .field("worker", &self.worker)
            .finish()
    }
}

impl Snowflake {
    /// A generator for `worker` with `clock`.
    pub fn new(layout: SnowflakeLayout, worker: u64, clock: Arc<dyn Clock>) -> Result<Self> {
        layout.check()?;
        layout.check_worker(worker)?;
        Ok(Snowflake {
            layout,
            worker,
            clock,
            max_backward: 5,
            state: Mutex::new((0, 0)),
        })
    }

    /// How far back (ms) the clock may step before ids are refused.
    pub fn with_max_backward_ms(mut self, ms: u64) -> Self {
        self.max_backward = ms;
        self
    }

    /// The next id.
    pub fn next(&self) -> Result<i64> {
        let seq_mask = (1u64 << self.layout.sequence_bits) - 1;
        let mut st = lock(&self.state);
        let (last, seq) = *st;
        let mut now = self.elapsed_ms()?;
        if now < last {
            if last - now > self.max_backward {
                return Err(ShardError::ClockMovedBackwards { millis: last - now });
            }
            while now < last {
                std::hint::spin_loop();
                now = self.elapsed_ms()?;
            }
        }
        let seq = if now == last {
            let next = (seq + 1) & seq_mask;
            if next == 0 {
                // 2^sequence_bits ids this millisecond: wait for the next one.
                while now <= last {
                    std::hint::spin_loop();
                    now = self.elapsed_ms()?;
                }
            }
            next
        } else {
            0
        };
        if now >> self.layout.time_bits != 0 {
            return Err(ShardError::config(
                "ids.snowflake",
                "the time bits are exhausted",
            ));
        }
        *st = (now, seq);
        let id = (now << (self.layout.worker_bits + self.layout.sequence_bits))
            | (self.worker << self.layout.sequence_bits)
            | seq;
        Ok(id as i64)
    }

    fn elapsed_ms(&self) -> Result<u64> {
        let now = self.clock.now_millis();
        now.checked_sub(SNOWFLAKE_EPOCH_MS)
            .ok_or_else(|| ShardError::ClockMovedBackwards {
                millis: SNOWFLAKE_EPOCH_MS - now,
            })
    }

    /// Splits an id into (Unix ms, worker, sequence).
    pub fn decode(&self, id: i64) -> (u64, u64, u64) {
        let id = id as u64;
        let seq = id & ((1 << self.layout.sequence_bits) - 1);
        let worker = (id >> self.layout.sequence_bits) & ((1 << self.layout.worker_bits) - 1);
        let ms = id >> (self.layout.worker_bits + self.layout.sequence_bits);
        (ms + SNOWFLAKE_EPOCH_MS, worker, seq)
    }
}
