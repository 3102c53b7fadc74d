//! Online bucket moves of `movable` hash groups, and range splits and moves
//! of `movable` range groups.
//!
//! **The live map.** A movable group's bucket → shard map lives on its
//! control database (its first configured shard) in `shardkit_bucket_map`,
//! versioned by `shardkit_bucket_epochs`; the first instance to connect
//! seeds it from the config. Every instance reads it at connect, every
//! `[rebalance] refresh_ms`, and when a shard's fence refuses a write;
//! routing reads the map it holds without a lock
//! ([`BucketOwners`](crate::topology::BucketOwners)).
//!
//! **The fence.** Each shard holds a state per bucket
//! (`shardkit_bucket_states`: `owned`, `moving`, `moved`, `none`). Every
//! write transaction of a movable group reads its bucket's state on its
//! shard first, under a shared row lock kept to its end: a shard that does
//! not own the bucket refuses the transaction ([`ShardError::BucketMoved`](crate::ShardError::BucketMoved)),
//! whatever map the instance holds, and [`Cluster::begin`](crate::Cluster::begin) refreshes the map
//! and begins again on the owner. While the bucket moves away (`moving`),
//! the transaction logs its key in `shardkit_move_changes` on the same
//! shard, so the log commits exactly when the write does.
//!
//! **A move** ([`Rebalance`]): registered → copying (primary-key chunks of
//! every entity, the moving buckets' rows) → catching up (replaying the
//! logged keys: each key's rows on the target are made what the source
//! holds now) → verified (every row of the moving buckets compared; a key
//! that differs without a pending log entry is re-copied and compared again)
//! → cutting over (the sources' states become `moved`, which waits at most
//! `cutover_wait_ms` for the transactions holding their locks; the last
//! logged keys are replayed; the target's states become `owned`; the map
//! flips and its epoch is bumped) → cleaning (after `cleanup_grace_ms`, the
//! sources' rows of the moved buckets are deleted, a key's rows in one
//! statement) → done. Each phase and the copy's position are stored in
//! `shardkit_moves`, so another process resumes a move
//! ([`Rebalance::run`]) or aborts it ([`Rebalance::abort`], before the map
//! flips: the sources own the buckets again and the target's copies are
//! deleted). A bucket is held by one move at a time
//! (`shardkit_move_buckets`).
//!
//! **Fencing tokens.** Every take-over of a move raises its generation, which
//! the new mover installs on every shard the move writes before it writes
//! there; each of a mover's writes checks it in the write's own transaction,
//! so a mover paused past its hold that goes on is refused where its writes
//! land.
//!
//! **Range groups.** Each range has an id fixed for its life, which plays
//! the bucket's part in the map, the fence and the mover.
//! [`Rebalance::split_at`] replaces a range by two halves on the same shard
//! under new ids (no row is copied) and fences the old id there, so an
//! instance still routing by it is refused and rerouted;
//! [`Rebalance::plan_range`] plans the move of the range holding a key.

mod begin;
mod entity;
mod errors;
mod fencing;
mod keyed_rows;
mod live;
mod map;
mod mover;
mod pg_copy;
mod reads;

pub(crate) use begin::Fenced;
pub(crate) use errors::{db_err, missing_table};
pub(crate) use live::{REROUTE_FOR, load_maps, refresh_all, unfinished_moves};
pub(crate) use map::{after_refusal, fence, refresh, seed_states};
pub use mover::{AnyGroup, MovePhase, MovePlan, MoveProgress, MoveStatus, RangeSplit, Rebalance};
pub(crate) use reads::MoveReads;
