//! Buckets → logical shards → physical hosts.
//!
//! A key is placed by its group's [`Placement`]: with `hash` (the default) it
//! hashes to one of a fixed number of buckets and the bucket maps to a logical
//! shard, so rebalancing moves buckets and never rehashes keys (PayPal's
//! scuttles). Logical shards are databases; several may live on one physical
//! host. Routing is pure data computed before any I/O ([`Target`]), except for
//! `directory` placements, whose lookup table the [`Cluster`](crate::Cluster)
//! reads.

mod build;
mod config;
mod layout;
mod owners;
pub use crate::key::pghash;
mod ranges;
mod url;
mod validate;

pub(crate) use config::DEFAULT_SIDE_CONNECTIONS;
pub use config::{
    BucketRange, ClusterConfig, ConnectionBudget, DirectoryConfig, GroupConfig, HostConfig,
    IdsConfig, KeyRange, PlacementKind, PoolConfig, RangeBound, ReadConfig, RebalanceConfig,
    ReplicaConfig, SequenceConfig, ServerBudget, ShardConfig, SnowflakeConfig,
};
pub use layout::{
    DEFAULT_BUCKETS, DEFAULT_DIRECTORY_TABLE, DirectorySpec, Located, MAX_BUCKETS, Placement,
    ReplicaSpec, ShardSpec, Target, Topology,
};
pub(crate) use owners::MapReads;
pub use owners::{BucketOwners, ShardId};
pub use ranges::{LiveMap, MapSnapshot, RangeOwners, RangeUnit};
pub(crate) use ranges::{find_bound, find_key};
pub use url::DatabaseUrl;
