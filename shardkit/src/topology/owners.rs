//! Who owns what: shard ids and the owner of every bucket of a hash group.

use std::fmt;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// The owner of each bucket of a hash placement, and the epoch of the map
/// they came from. Routing reads it without a lock; a `movable` group's
/// owners change when the cluster reads a newer map from the database.
pub struct BucketOwners {
    epoch: AtomicU64,
    owner: Box<[AtomicU32]>,
    /// The owners as configured (what the map is seeded from).
    configured: Box<[ShardId]>,
    /// One install at a time, so a map is never a mix of two epochs' and
    /// the epoch never goes back.
    installing: std::sync::Mutex<()>,
    /// When the map was last read, and last tried.
    reads: MapReads,
}

/// When a `movable` group's map was last read from the control database
/// (the start of the last read that succeeded) and last tried (the start of
/// the last attempt, failed or not), in clock ms; 0 before the first time.
/// A read is safe by a map as long as the buckets it routes to cannot have
/// been cleaned since it was read: cleaning waits `cleanup_grace_ms` after a
/// move's flip, and a flip after the read's start is what the map may miss.
#[derive(Default)]
pub(crate) struct MapReads {
    read_ms: std::sync::atomic::AtomicI64,
    tried_ms: std::sync::atomic::AtomicI64,
    /// A background read of the map is under way (see
    /// [`claim_try`](Self::claim_try)).
    trying: std::sync::atomic::AtomicBool,
    /// When a control database found behind this instance was last logged.
    warned_ms: std::sync::atomic::AtomicI64,
    /// This process's cleanup grace is recorded on the control database
    /// (or being recorded).
    grace_recorded: std::sync::atomic::AtomicBool,
}

impl MapReads {
    /// The start of the last map read that succeeded.
    pub(crate) fn read_at_ms(&self) -> i64 {
        self.read_ms.load(AtomicOrdering::Acquire)
    }

    /// A map read that began at `started_ms` succeeded, at `now_ms` (a
    /// later one's time is kept when two overlap, unless the clock has gone
    /// back past it).
    pub(crate) fn mark_read(&self, started_ms: i64, now_ms: i64) {
        let _ =
            self.read_ms
                .fetch_update(AtomicOrdering::AcqRel, AtomicOrdering::Acquire, |kept| {
                    Some(if kept > now_ms {
                        started_ms
                    } else {
                        kept.max(started_ms)
                    })
                });
    }

    /// A map read begins at `now_ms`.
    pub(crate) fn mark_tried(&self, now_ms: i64) {
        self.tried_ms.fetch_max(now_ms, AtomicOrdering::AcqRel);
    }

    /// Claims a background read of the map at `now_ms` when none is under
    /// way and none began in the last `every_ms`: of the reads that find the
    /// map stale at once, one starts it. The claimant calls
    /// [`done_trying`](Self::done_trying) when it ends.
    /// The claim counts as a try (a read the breaker refuses at once never
    /// reaches the map's statements).
    pub(crate) fn claim_try(&self, now_ms: i64, every_ms: i64) -> bool {
        let last = self.tried_ms.load(AtomicOrdering::Acquire);
        let claimed = (now_ms - last >= every_ms || last > now_ms)
            && self
                .trying
                .compare_exchange(false, true, AtomicOrdering::AcqRel, AtomicOrdering::Acquire)
                .is_ok();
        if claimed {
            self.tried_ms.store(now_ms, AtomicOrdering::Release);
        }
        claimed
    }

    /// Whether a control database found behind this instance at `now_ms`
    /// is to be logged: once a minute at most (reads, writes' reroutes and
    /// the refreshes find it on every map read until it is mended).
    pub(crate) fn warn_behind(&self, now_ms: i64) -> bool {
        let last = self.warned_ms.load(AtomicOrdering::Acquire);
        (now_ms - last >= 60_000 || last > now_ms)
            && self
                .warned_ms
                .compare_exchange(
                    last,
                    now_ms,
                    AtomicOrdering::AcqRel,
                    AtomicOrdering::Acquire,
                )
                .is_ok()
    }

    /// Claims the recording of this process's cleanup grace on the control
    /// database: `false` when it is recorded or being recorded.
    pub(crate) fn claim_grace(&self) -> bool {
        self.grace_recorded
            .compare_exchange(false, true, AtomicOrdering::AcqRel, AtomicOrdering::Acquire)
            .is_ok()
    }

    /// Whether the grace is recorded (`false`: to be recorded again).
    pub(crate) fn set_grace_recorded(&self, recorded: bool) {
        self.grace_recorded.store(recorded, AtomicOrdering::Release);
    }

    /// The background read claimed with [`claim_try`](Self::claim_try) ended.
    pub(crate) fn done_trying(&self) {
        self.trying.store(false, AtomicOrdering::Release);
    }
}

impl BucketOwners {
    pub(super) fn new(owner: Box<[ShardId]>) -> Self {
        BucketOwners {
            epoch: AtomicU64::new(0),
            owner: owner.iter().map(|s| AtomicU32::new(s.0)).collect(),
            configured: owner,
            installing: std::sync::Mutex::new(()),
            reads: MapReads::default(),
        }
    }

    /// The shard that owns `bucket` now.
    #[inline]
    pub fn get(&self, bucket: u32) -> ShardId {
        ShardId(self.owner[bucket as usize].load(AtomicOrdering::Acquire))
    }

    /// The number of buckets.
    pub fn len(&self) -> usize {
        self.owner.len()
    }

    /// Whether there are no buckets (never, for a validated placement).
    pub fn is_empty(&self) -> bool {
        self.owner.is_empty()
    }

    /// The epoch of the bucket map these owners came from: 0 for the
    /// configured spread, then the database's epoch for a `movable` group.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(AtomicOrdering::Acquire)
    }

    /// Every bucket's owner, in bucket order.
    pub fn to_vec(&self) -> Vec<ShardId> {
        (0..self.owner.len() as u32).map(|b| self.get(b)).collect()
    }

    /// The owners the config file gives (the map's seed).
    pub fn configured(&self) -> &[ShardId] {
        &self.configured
    }

    /// When the map's epoch was last read from the database (the start of
    /// the last read that succeeded), in clock ms; 0 before the first time.
    pub fn read_at_ms(&self) -> i64 {
        self.reads.read_at_ms()
    }

    pub(crate) fn reads(&self) -> &MapReads {
        &self.reads
    }

    /// Installs a newer map; an older or equal epoch changes nothing.
    /// Returns whether it was installed.
    pub(crate) fn install(&self, epoch: u64, owners: &[ShardId]) -> bool {
        let _one = self.installing.lock().unwrap_or_else(|p| p.into_inner());
        if owners.len() != self.owner.len() || epoch <= self.epoch() {
            return false;
        }
        for (slot, shard) in self.owner.iter().zip(owners) {
            slot.store(shard.0, AtomicOrdering::Release);
        }
        self.epoch.store(epoch, AtomicOrdering::Release);
        true
    }
}

impl fmt::Debug for BucketOwners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BucketOwners")
            .field("epoch", &self.epoch())
            .field("buckets", &self.owner.len())
            .finish()
    }
}

/// Index of a logical shard in the cluster (its position in `[[shards]]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardId(pub u32);

impl ShardId {
    /// The index as `usize`.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
