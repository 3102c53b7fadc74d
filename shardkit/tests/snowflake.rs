//! Snowflake ids with an injected clock: no sleeping, every clock behaviour
//! scripted.

use shardkit::ids::{Clock, SNOWFLAKE_EPOCH_MS};
use shardkit::{ShardError, Snowflake, SnowflakeLayout};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Returns the scripted times in order, then keeps returning the last one
/// plus one per read (so a waiting generator always gets somewhere).
struct Script(Mutex<(VecDeque<u64>, u64)>);

impl Script {
    fn new(times: &[u64]) -> Arc<Self> {
        Arc::new(Script(Mutex::new((
            times.iter().map(|t| SNOWFLAKE_EPOCH_MS + t).collect(),
            0,
        ))))
    }
    fn reads(&self) -> usize {
        self.0.lock().unwrap().0.len()
    }
}

impl Clock for Script {
    fn now_millis(&self) -> u64 {
        let mut s = self.0.lock().unwrap();
        match s.0.pop_front() {
            Some(t) => {
                s.1 = t;
                t
            }
            None => {
                s.1 += 1;
                s.1
            }
        }
    }
}

fn generator(clock: Arc<Script>, worker: u64) -> Snowflake {
    Snowflake::new(SnowflakeLayout::default(), worker, clock).unwrap()
}

#[test]
fn layout_is_time_worker_sequence() {
    let g = generator(Script::new(&[1000, 1000, 1001]), 5);
    let a = g.next().unwrap();
    let b = g.next().unwrap();
    let c = g.next().unwrap();
    assert_eq!(a, (1000 << 22) | (5 << 12));
    assert_eq!(b, a + 1, "same millisecond: the sequence counts up");
    assert_eq!(
        c,
        (1001 << 22) | (5 << 12),
        "a new millisecond restarts the sequence"
    );
    assert_eq!(g.decode(b), (SNOWFLAKE_EPOCH_MS + 1000, 5, 1));
}

#[test]
fn a_full_millisecond_waits_for_the_next() {
    // 4,096 ids at t=7, then the generator must move to t=8.
    let clock = Script::new(&vec![7; 4097]);
    let g = generator(Arc::clone(&clock), 1);
    let ids: Vec<i64> = (0..4097).map(|_| g.next().unwrap()).collect();
    let (ms, _, seq) = g.decode(ids[4096]);
    assert_eq!((ms - SNOWFLAKE_EPOCH_MS, seq), (8, 0));
    let mut sorted = ids.clone();
    sorted.dedup();
    assert_eq!(sorted.len(), 4097, "no duplicates");
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn a_small_rollback_is_waited_out() {
    // The clock steps back 3 ms at the third read and recovers.
    let clock = Script::new(&[100, 100, 97, 98, 99, 100, 100]);
    let g = generator(Arc::clone(&clock), 0);
    let a = g.next().unwrap();
    let b = g.next().unwrap();
    let c = g.next().unwrap();
    assert!(a < b && b < c, "{a} {b} {c}");
    // It read 97, 98, 99 and 100, then issued the next id of millisecond 100.
    assert_eq!(g.decode(c), (SNOWFLAKE_EPOCH_MS + 100, 0, 2));
    assert_eq!(clock.reads(), 1, "exactly the catch-up reads were made");
}

#[test]
fn a_large_rollback_is_refused() {
    let clock = Script::new(&[5000, 4000, 5001]);
    let g = generator(clock, 0);
    let a = g.next().unwrap();
    match g.next() {
        Err(ShardError::ClockMovedBackwards { millis }) => assert_eq!(millis, 1000),
        other => panic!("expected ClockMovedBackwards, got {other:?}"),
    }
    // Once the clock is past the last id's time again, ids resume, unique.
    assert!(g.next().unwrap() > a);
}

#[test]
fn the_worker_id_must_fit() {
    let err = Snowflake::new(SnowflakeLayout::default(), 1024, Script::new(&[])).unwrap_err();
    assert!(matches!(err, ShardError::Config { .. }), "{err:?}");
}

#[test]
fn uuid_v7_is_monotonic() {
    let ids: Vec<uuid::Uuid> = (0..10_000).map(|_| shardkit::uuid_v7()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    assert!(ids.iter().all(|u| u.get_version_num() == 7));
}
