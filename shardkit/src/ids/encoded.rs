//! Shard-encoded ids: a sequence id with the row's bucket in its low bits,
//! and routing such an id to its shard.

use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::id_spec::BUCKET_BITS;
use crate::ids::handle::Ids;
use crate::topology::{ShardId, Target, Topology};

fn encoded_bucket<G: EntityGroup>(topology: &Topology, key: &G::Key) -> Result<u32> {
    match topology.placement(G::NAME)? {
        crate::topology::Placement::Hash { buckets, .. } if *buckets <= 1 << BUCKET_BITS => {
            Ok((key.partition_hash() % u64::from(*buckets)) as u32)
        }
        _ => Err(ShardError::config(
            format!("groups.{}", G::NAME),
            "shard-encoded ids need a hash placement with at most 8192 buckets",
        )),
    }
}

impl Ids {
    /// See [`Cluster::next_encoded_id`](crate::Cluster::next_encoded_id).
    pub(crate) async fn next_encoded<G: EntityGroup>(
        &self,
        topology: &Topology,
        name: &str,
        key: &G::Key,
    ) -> Result<i64> {
        let bucket = encoded_bucket::<G>(topology, key)?;
        let id = self.next(name).await?;
        let id = u64::try_from(id).unwrap_or_default();
        if id >> (63 - BUCKET_BITS) != 0 {
            return Err(ShardError::config(
                format!("ids.sequences.{name}"),
                "the sequence has outgrown the 50 bits a shard-encoded id leaves it",
            ));
        }
        Ok(((id << BUCKET_BITS) | u64::from(bucket)) as i64)
    }
}

/// See [`Cluster::route_id`](crate::Cluster::route_id).
pub(crate) fn route_id<G: EntityGroup>(topology: &Topology, id: i64) -> Result<Target> {
    match topology.placement(G::NAME)? {
        crate::topology::Placement::Hash { buckets, owner } if *buckets <= 1 << BUCKET_BITS => {
            let bucket = (id as u64 & ((1 << BUCKET_BITS) - 1)) as u32;
            if bucket >= *buckets {
                return Err(ShardError::Unroutable {
                    group: G::NAME,
                    key: format!("id {id}"),
                    reason: format!(
                        "bucket {bucket} is outside the group's {buckets} buckets: not a shard-encoded id of this group"
                    ),
                });
            }
            let shard: ShardId = owner.get(bucket);
            Ok(Target {
                shard,
                bucket: Some(bucket),
            })
        }
        _ => Err(ShardError::config(
            format!("groups.{}", G::NAME),
            "shard-encoded ids need a hash placement with at most 8192 buckets",
        )),
    }
}
