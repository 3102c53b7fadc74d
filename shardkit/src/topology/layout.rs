//! The topology: shards, buckets and who owns them, and locating a key.

use crate::entity::{KeyRef, ShardKey};
use crate::error::{Result, ShardError};
use crate::topology::BucketOwners;
use crate::topology::owners::ShardId;
use crate::topology::url::DatabaseUrl;
use crate::topology::{LiveMap, RangeOwners};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

/// Where one key's rows live: computed before any statement runs, printable
/// and testable on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The logical shard.
    pub shard: ShardId,
    /// The bucket, for hash placements; the range's id, for `movable`
    /// range placements (what their fence and moves know it by).
    pub bucket: Option<u32>,
}

/// A logical shard as the topology knows it.
#[derive(Clone, Debug)]
pub struct ShardSpec {
    /// The shard's name.
    pub name: String,
    /// Its database URL (prints redacted).
    pub url: DatabaseUrl,
    /// The `[[hosts]]` entry it lives on, if it was configured through one.
    pub host: Option<String>,
    /// Its read replicas.
    pub replicas: Vec<ReplicaSpec>,
}

/// A shard's read replica as the topology knows it.
#[derive(Clone, Debug)]
pub struct ReplicaSpec {
    /// The replica's name.
    pub name: String,
    /// Its database URL (prints redacted).
    pub url: DatabaseUrl,
}

/// A directory placement's lookup database.
#[derive(Clone, Debug)]
pub struct DirectorySpec {
    /// The group it serves.
    pub group: String,
    /// Its database URL (prints redacted).
    pub url: DatabaseUrl,
    /// The lookup table.
    pub table: String,
}

/// One group's validated placement.
#[derive(Clone, Debug)]
pub enum Placement {
    /// `bucket = partition_hash(key) % buckets`, then `owner.get(bucket)`.
    Hash {
        /// Number of buckets.
        buckets: u32,
        /// Owning shard of each bucket: the configured spread, or, for a
        /// `movable` group, the bucket map as last read from the database.
        owner: Arc<BucketOwners>,
    },
    /// Sorted, contiguous `[from, to)` ranges.
    Range {
        /// The ranges in key order: as configured, or, for a `movable`
        /// group, as last read from the database.
        ranges: Arc<RangeOwners>,
    },
    /// `key mod shards.len()` indexes `shards`.
    Modulo {
        /// The shards, in order.
        shards: Vec<ShardId>,
    },
    /// `key → shard` rows in a lookup table.
    Directory {
        /// Index into [`Topology::directories`].
        directory: usize,
    },
}

/// The result of placing a key without I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Located {
    /// The shard is known.
    Target(Target),
    /// The shard must be read from this directory database.
    Directory(usize),
}

/// The validated cluster layout. Built from a [`ClusterConfig`](crate::ClusterConfig); immutable.
#[derive(Clone, Debug)]
pub struct Topology {
    pub(super) shards: Vec<ShardSpec>,
    pub(super) ticket_servers: Vec<ShardSpec>,
    pub(super) by_name: HashMap<String, ShardId>,
    /// By group name. A `BTreeMap`: a cluster has a few groups, and every
    /// routed request looks its group up, where a couple of string
    /// comparisons cost less than hashing the name.
    pub(super) groups: BTreeMap<String, Placement>,
    /// Every shard each group can have rows on (what a scatter asks).
    pub(super) group_shards: HashMap<String, Vec<ShardId>>,
    /// The `movable` groups.
    pub(super) movable: Vec<String>,
    pub(super) directories: Vec<DirectorySpec>,
}

/// The default number of buckets of a hash placement.
pub const DEFAULT_BUCKETS: u32 = 1024;

/// The most buckets a hash placement may have (its routing table is an array).
pub const MAX_BUCKETS: u32 = 1 << 20;

/// The default directory table name.
pub const DEFAULT_DIRECTORY_TABLE: &str = "shardkit_directory";

impl Topology {
    /// The logical shards, in config order.
    pub fn shards(&self) -> &[ShardSpec] {
        &self.shards
    }

    /// The shard names, in config order.
    pub fn shard_names(&self) -> impl Iterator<Item = &str> {
        self.shards.iter().map(|s| s.name.as_str())
    }

    /// A shard by name.
    pub fn shard_id(&self, name: &str) -> Option<ShardId> {
        self.by_name.get(name).copied()
    }

    /// A shard's spec.
    pub fn shard(&self, id: ShardId) -> &ShardSpec {
        &self.shards[id.index()]
    }

    /// The ticket servers of `[ids]`, in order (server `i` hands out tickets
    /// `≡ i + 1 (mod n)`).
    pub fn ticket_servers(&self) -> &[ShardSpec] {
        &self.ticket_servers
    }

    /// The directory databases of `directory` placements.
    pub fn directories(&self) -> &[DirectorySpec] {
        &self.directories
    }

    /// The configured groups' names.
    pub fn group_names(&self) -> impl Iterator<Item = &str> {
        self.groups.keys().map(String::as_str)
    }

    /// A group's placement.
    pub fn placement(&self, group: &str) -> Result<&Placement> {
        self.groups
            .get(group)
            .ok_or_else(|| ShardError::UnknownGroup {
                group: group.to_owned(),
                configured: {
                    let mut names: Vec<&str> = self.groups.keys().map(String::as_str).collect();
                    names.sort_unstable();
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                },
            })
    }

    /// The shards the config gives `group`, in shard order. They do not
    /// change while the cluster runs, so what is placed over them stays put
    /// when buckets move: the group's global-index rows (by value hash) and
    /// its rollouts' shared rows (on the first).
    pub fn shards_of(&self, group: &str) -> Result<&[ShardId]> {
        self.placement(group)?;
        Ok(self.group_shards.get(group).map_or(&[], Vec::as_slice))
    }

    /// Every shard that can hold rows of `group` now, in shard order: the
    /// shards a scatter read asks. For a `movable` group, the configured
    /// shards and every shard the bucket map names (a shard a move added).
    pub fn scatter_shards(&self, group: &str) -> Result<Vec<ShardId>> {
        let configured = self.shards_of(group)?;
        match self.live_owners(group)? {
            Some(map) if map.epoch() > 0 => {
                let mut ids: Vec<ShardId> =
                    map.snapshot().units().into_iter().map(|(_, s)| s).collect();
                ids.extend_from_slice(configured);
                ids.sort_unstable();
                ids.dedup();
                Ok(ids)
            }
            _ => Ok(configured.to_vec()),
        }
    }

    /// Whether `group`'s buckets can move (`movable = true`).
    pub fn is_movable(&self, group: &str) -> bool {
        self.movable.iter().any(|g| g == group)
    }

    /// The `movable` groups.
    pub fn movable_groups(&self) -> impl Iterator<Item = &str> {
        self.movable.iter().map(String::as_str)
    }

    /// The live map of a hash placement (its bucket owners) or a range
    /// placement (its ranges); `None` for other placements.
    pub fn live_owners(&self, group: &str) -> Result<Option<LiveMap<'_>>> {
        Ok(match self.placement(group)? {
            Placement::Hash { owner, .. } => Some(LiveMap::Buckets(owner)),
            Placement::Range { ranges } => Some(LiveMap::Ranges(ranges)),
            _ => None,
        })
    }

    pub(super) fn compute_shards_of(&self, placement: &Placement) -> Vec<ShardId> {
        let mut ids: Vec<ShardId> = match placement {
            Placement::Hash { owner, .. } => owner.configured().to_vec(),
            Placement::Range { ranges } => ranges.configured().iter().map(|u| u.shard).collect(),
            Placement::Modulo { shards } => shards.clone(),
            // Any shard may appear in the lookup table.
            Placement::Directory { .. } => (0..self.shards.len() as u32).map(ShardId).collect(),
        };
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Places a key without I/O: the target shard, or the directory to ask.
    #[inline]
    pub fn locate<K: ShardKey>(&self, group: &'static str, key: &K) -> Result<Located> {
        match self.placement(group)? {
            Placement::Hash { buckets, owner } => {
                let bucket = (key.partition_hash() % u64::from(*buckets)) as u32;
                Ok(Located::Target(Target {
                    shard: owner.get(bucket),
                    bucket: Some(bucket),
                }))
            }
            Placement::Range { ranges } => {
                let (shard, id) = ranges.locate(group, key)?;
                Ok(Located::Target(Target {
                    shard,
                    bucket: ranges.is_movable().then_some(id),
                }))
            }
            Placement::Modulo { shards } => match key.key_ref() {
                KeyRef::Int(v) => {
                    let index = v.rem_euclid(shards.len() as i128) as usize;
                    Ok(Located::Target(Target {
                        shard: shards[index],
                        bucket: None,
                    }))
                }
                _ => Err(ShardError::Unroutable {
                    group,
                    key: format!("{key:?}"),
                    reason: "a modulo placement needs an integer shard key; use hash for text and UUID keys".to_owned(),
                }),
            },
            Placement::Directory { directory } => Ok(Located::Directory(*directory)),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bucket {
            Some(b) => write!(f, "shard #{} (bucket {b})", self.shard.0),
            None => write!(f, "shard #{}", self.shard.0),
        }
    }
}
