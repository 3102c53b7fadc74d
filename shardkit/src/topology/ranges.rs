//! A range placement's ranges, and the live map of a `movable` group (its
//! buckets or its ranges) as routing, reads and the mover see it.

use crate::entity::{KeyRef, ShardKey};
use crate::topology::config::RangeBound;
use crate::topology::owners::MapReads;
use crate::topology::{BucketOwners, ShardId};
use std::cmp::Ordering;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::{Arc, Mutex, RwLock};

/// One range of a range placement: keys in `[from, to)` (an absent bound is
/// unbounded) live on `shard`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeUnit {
    /// The range's id, fixed for its life: a split retires it and gives
    /// each half a new id. A `movable` group's fence and moves know a range
    /// by it (where a hash group has its bucket).
    pub id: u32,
    /// Lower bound, inclusive.
    pub from: Option<RangeBound>,
    /// Upper bound, exclusive.
    pub to: Option<RangeBound>,
    /// The owning shard.
    pub shard: ShardId,
}

impl RangeUnit {
    /// Whether `key` falls in this range.
    pub fn holds<K: ShardKey>(&self, key: &K) -> bool {
        let above_from = self
            .from
            .as_ref()
            .is_none_or(|b| key_vs_bound(key, b).is_ok_and(|o| o != Ordering::Less));
        let below_to = self
            .to
            .as_ref()
            .is_none_or(|b| key_vs_bound(key, b).is_ok_and(|o| o == Ordering::Less));
        above_from && below_to
    }
}

impl fmt::Display for RangeUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |b: &Option<RangeBound>, none: &str| {
            b.as_ref().map_or(none.to_owned(), |b| b.to_string())
        };
        write!(
            f,
            "range {} [{}, {})",
            self.id,
            show(&self.from, "-inf"),
            show(&self.to, "+inf")
        )
    }
}

/// The ranges of a range placement, in key order, and the epoch of the map
/// they came from. A `movable` group's ranges change when the cluster reads
/// a newer map (a split, or a range that moved).
pub struct RangeOwners {
    movable: bool,
    epoch: AtomicU64,
    table: RwLock<Arc<[RangeUnit]>>,
    configured: Arc<[RangeUnit]>,
    /// One install at a time (see [`BucketOwners`]).
    installing: Mutex<()>,
    /// When the map was last read, and last tried.
    reads: MapReads,
}

impl RangeOwners {
    pub(super) fn new(units: Vec<RangeUnit>, movable: bool) -> Self {
        let units: Arc<[RangeUnit]> = units.into();
        RangeOwners {
            movable,
            epoch: AtomicU64::new(0),
            table: RwLock::new(Arc::clone(&units)),
            configured: units,
            installing: Mutex::new(()),
            reads: MapReads::default(),
        }
    }

    /// The ranges now, in key order.
    pub fn units(&self) -> Arc<[RangeUnit]> {
        Arc::clone(&self.table.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The ranges as configured (what a `movable` group's map is seeded
    /// from; ids `0..n` in key order).
    pub fn configured(&self) -> &[RangeUnit] {
        &self.configured
    }

    /// Whether the group's ranges can split and move.
    pub fn is_movable(&self) -> bool {
        self.movable
    }

    /// The epoch of the map these ranges came from: 0 for the configured
    /// ranges, then the database's epoch for a `movable` group.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(AtomicOrdering::Acquire)
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
    pub(crate) fn install(&self, epoch: u64, units: Vec<RangeUnit>) -> bool {
        let _one = self.installing.lock().unwrap_or_else(|p| p.into_inner());
        if epoch <= self.epoch() {
            return false;
        }
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = units.into();
        self.epoch.store(epoch, AtomicOrdering::Release);
        true
    }

    /// The shard and range id of `key`. A `movable` group routes only by
    /// ranges read from its map: a range's id is its position in the config
    /// only until the first split, so the configured ranges could pass a
    /// fence they should not.
    #[inline]
    pub(super) fn locate<K: ShardKey>(
        &self,
        group: &'static str,
        key: &K,
    ) -> crate::Result<(ShardId, u32)> {
        let unroutable = |reason: String| crate::ShardError::Unroutable {
            group,
            key: format!("{key:?}"),
            reason,
        };
        let lookup = |units: &[RangeUnit]| {
            find(units, |b| key_vs_bound(key, b))
                .map(|i| (units[i].shard, units[i].id))
                .map_err(unroutable)
        };
        if !self.movable {
            return lookup(&self.configured);
        }
        if self.epoch() == 0 {
            return Err(unroutable(
                "the group's ranges have not been read from its control database yet (it is down, or not migrated): a movable range group routes only by its map".to_owned(),
            ));
        }
        lookup(&self.table.read().unwrap_or_else(|p| p.into_inner()))
    }
}

impl fmt::Debug for RangeOwners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RangeOwners")
            .field("epoch", &self.epoch())
            .field("ranges", &self.units().len())
            .field("movable", &self.movable)
            .finish()
    }
}

/// How a key orders against a bound (an error when their kinds differ).
pub(crate) fn key_vs_bound<K: ShardKey>(key: &K, bound: &RangeBound) -> Result<Ordering, String> {
    match (key.key_ref(), bound) {
        (KeyRef::Int(k), RangeBound::Int(b)) => Ok(k.cmp(&i128::from(*b))),
        (KeyRef::Text(k), RangeBound::Text(b)) => Ok(k.cmp(b.as_str())),
        (KeyRef::Uuid(u), RangeBound::Text(b)) => {
            let mut buf = uuid::Uuid::encode_buffer();
            Ok((*u.hyphenated().encode_lower(&mut buf)).cmp(b.as_str()))
        }
        (_, RangeBound::Int(_)) => {
            Err("the range bounds are integers but the key is not".to_owned())
        }
        (_, RangeBound::Text(_)) => {
            Err("the range bounds are strings but the key is an integer".to_owned())
        }
    }
}

/// The index of the range holding the value `compare` describes (how it
/// orders against a bound). Ranges are sorted and contiguous: the owner is
/// the last range whose `from` <= key, provided the key is below its `to`.
pub(crate) fn find(
    units: &[RangeUnit],
    compare: impl Fn(&RangeBound) -> Result<Ordering, String>,
) -> Result<usize, String> {
    let mut lo = 0usize;
    let mut hi = units.len();
    while lo < hi {
        let mid = (lo + hi) / 2;
        let starts_after_key = match &units[mid].from {
            None => false,
            Some(from) => compare(from)? == Ordering::Less,
        };
        if starts_after_key {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let Some(i) = lo.checked_sub(1) else {
        return Err("below the group's first range".to_owned());
    };
    if let Some(to) = &units[i].to
        && compare(to)? != Ordering::Less
    {
        return Err(format!("at or above {to}, past the group's last range"));
    }
    Ok(i)
}

/// The index of the range holding `key`.
pub(crate) fn find_key<K: ShardKey>(units: &[RangeUnit], key: &K) -> Result<usize, String> {
    find(units, |b| key_vs_bound(key, b))
}

/// The index of the range holding `at` (a split point).
pub(crate) fn find_bound(units: &[RangeUnit], at: &RangeBound) -> Result<usize, String> {
    find(units, |b| match (at, b) {
        (RangeBound::Int(a), RangeBound::Int(b)) => Ok(a.cmp(b)),
        (RangeBound::Text(a), RangeBound::Text(b)) => Ok(a.cmp(b)),
        (RangeBound::Int(_), RangeBound::Text(_)) => {
            Err("the ranges' bounds are strings but the split point is an integer".to_owned())
        }
        (RangeBound::Text(_), RangeBound::Int(_)) => {
            Err("the ranges' bounds are integers but the split point is a string".to_owned())
        }
    })
}

impl RangeBound {
    /// The bound as the bucket map stores it: `i:<integer>`, or `t:` and
    /// the text's UTF-8 bytes in hex (whatever the column's character set,
    /// the bound comes back byte for byte).
    pub(crate) fn encode(&self) -> String {
        match self {
            RangeBound::Int(v) => format!("i:{v}"),
            RangeBound::Text(v) => {
                let mut out = String::with_capacity(2 + 2 * v.len());
                out.push_str("t:");
                for b in v.as_bytes() {
                    out.push_str(&format!("{b:02x}"));
                }
                out
            }
        }
    }

    /// Reads a bound the bucket map stores.
    pub(crate) fn decode(text: &str) -> Option<RangeBound> {
        match text.split_at_checked(2)? {
            ("i:", v) => v.parse().ok().map(RangeBound::Int),
            ("t:", v) if v.len() % 2 == 0 => {
                let bytes = (0..v.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(v.get(i..i + 2)?, 16).ok())
                    .collect::<Option<Vec<u8>>>()?;
                String::from_utf8(bytes).ok().map(RangeBound::Text)
            }
            _ => None,
        }
    }

    /// Whether two bounds are of one kind (both integers, or both text).
    pub(crate) fn same_kind(&self, other: &RangeBound) -> bool {
        matches!(
            (self, other),
            (RangeBound::Int(_), RangeBound::Int(_)) | (RangeBound::Text(_), RangeBound::Text(_))
        )
    }

    /// The bound at `key` (a split point): integers for integer keys (which
    /// must fit `i64`), text for text and UUID keys.
    pub fn at_key<K: ShardKey>(key: &K) -> Option<RangeBound> {
        match key.key_ref() {
            KeyRef::Int(v) => i64::try_from(v).ok().map(RangeBound::Int),
            KeyRef::Text(v) => Some(RangeBound::Text(v.to_owned())),
            KeyRef::Uuid(u) => Some(RangeBound::Text(u.hyphenated().to_string())),
        }
    }
}

/// A `movable` group's live map: its buckets' owners (hash) or its ranges.
#[derive(Clone, Copy, Debug)]
pub enum LiveMap<'a> {
    /// A hash group's bucket owners.
    Buckets(&'a Arc<BucketOwners>),
    /// A range group's ranges.
    Ranges(&'a Arc<RangeOwners>),
}

impl LiveMap<'_> {
    /// The epoch of the map in use (0: the configured one).
    pub fn epoch(&self) -> u64 {
        match self {
            LiveMap::Buckets(o) => o.epoch(),
            LiveMap::Ranges(r) => r.epoch(),
        }
    }

    /// When the map was last read from the database (the start of the
    /// last read that succeeded), clock ms.
    pub fn read_at_ms(&self) -> i64 {
        self.reads().read_at_ms()
    }

    /// When the map was last read, and last tried.
    pub(crate) fn reads(&self) -> &MapReads {
        match self {
            LiveMap::Buckets(o) => o.reads(),
            LiveMap::Ranges(r) => r.reads(),
        }
    }

    /// One reading of the map, for decisions over many rows.
    pub fn snapshot(&self) -> MapSnapshot {
        match self {
            LiveMap::Buckets(o) => MapSnapshot::Buckets(o.to_vec()),
            LiveMap::Ranges(r) => MapSnapshot::Ranges(r.units()),
        }
    }
}

/// One reading of a live map.
#[derive(Clone, Debug)]
pub enum MapSnapshot {
    /// Each bucket's owner, in bucket order.
    Buckets(Vec<ShardId>),
    /// The ranges, in key order.
    Ranges(Arc<[RangeUnit]>),
}

impl MapSnapshot {
    /// The shard that owns `key`'s rows (`None`: the key is outside every
    /// range).
    pub fn owner_of<K: ShardKey>(&self, key: &K) -> Option<ShardId> {
        match self {
            MapSnapshot::Buckets(map) => {
                let bucket = key.partition_hash() % map.len().max(1) as u64;
                map.get(bucket as usize).copied()
            }
            MapSnapshot::Ranges(units) => find(units, |b| key_vs_bound(key, b))
                .ok()
                .map(|i| units[i].shard),
        }
    }

    /// Each unit (a bucket, or a range's id) and its owner.
    pub fn units(&self) -> Vec<(u32, ShardId)> {
        match self {
            MapSnapshot::Buckets(map) => map
                .iter()
                .enumerate()
                .map(|(b, s)| (b as u32, *s))
                .collect(),
            MapSnapshot::Ranges(units) => units.iter().map(|u| (u.id, u.shard)).collect(),
        }
    }

    /// The owner of a unit (`None`: no such bucket, or no live range).
    pub fn owner(&self, unit: u32) -> Option<ShardId> {
        match self {
            MapSnapshot::Buckets(map) => map.get(unit as usize).copied(),
            MapSnapshot::Ranges(units) => units.iter().find(|u| u.id == unit).map(|u| u.shard),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(id: u32, from: Option<RangeBound>, to: Option<RangeBound>) -> RangeUnit {
        RangeUnit {
            id,
            from,
            to,
            shard: ShardId(id),
        }
    }

    #[test]
    fn bounds_round_trip_byte_for_byte() {
        for b in [
            RangeBound::Int(i64::MIN),
            RangeBound::Int(0),
            RangeBound::Int(i64::MAX),
            RangeBound::Text(String::new()),
            RangeBound::Text("t:i:\u{0}é😀 ".to_owned()),
        ] {
            let text = b.encode();
            assert!(text.is_ascii(), "{text}");
            assert_eq!(RangeBound::decode(&text), Some(b));
        }
        for bad in ["", "i:", "i:x", "t:0", "t:zz", "t:ff", "x:1"] {
            assert_eq!(RangeBound::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn keys_at_bounds_belong_to_the_range_they_start() {
        let int = |v| Some(RangeBound::Int(v));
        let units = [
            unit(0, None, int(10)),
            unit(1, int(10), int(20)),
            unit(2, int(20), None),
        ];
        for (key, at) in [
            (i64::MIN, 0),
            (9, 0),
            (10, 1),
            (19, 1),
            (20, 2),
            (i64::MAX, 2),
        ] {
            assert_eq!(find_key(&units, &key), Ok(at), "{key}");
            assert!(units[at].holds(&key));
            assert!(!units[(at + 1) % 3].holds(&key));
        }
        assert_eq!(find_bound(&units, &RangeBound::Int(10)), Ok(1));
        // A u64 above i64::MAX is still a key of the last range.
        assert_eq!(find_key(&units, &u64::MAX), Ok(2));
        let bounded = [unit(0, int(0), int(10))];
        assert!(find_key(&bounded, &-1i64).unwrap_err().contains("below"));
        assert!(
            find_key(&bounded, &10i64)
                .unwrap_err()
                .contains("at or above 10")
        );
    }

    #[test]
    fn a_bound_of_the_other_kind_is_an_error_not_a_range() {
        let text = |v: &str| Some(RangeBound::Text(v.to_owned()));
        let units = [unit(0, None, text("m")), unit(1, text("m"), None)];
        assert_eq!(find_key(&units, &"apple".to_owned()), Ok(0));
        assert_eq!(find_key(&units, &"m".to_owned()), Ok(1));
        let uuid = uuid::Uuid::from_u128(u128::MAX);
        assert_eq!(find_key(&units, &uuid), Ok(0), "ffffffff-… sorts below m");
        assert!(find_key(&units, &5i64).unwrap_err().contains("integer"));
        assert!(find_bound(&units, &RangeBound::Int(5)).is_err());
        assert!(!RangeBound::Int(1).same_kind(&RangeBound::Text("1".to_owned())));
    }
}
