//! Beginning a transaction of a `movable` group: the fence read that a
//! shard no longer owning the key's bucket refuses, the reroute after the
//! refreshed map, and beginning again when the database aborts the fence.

use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::exec::{BeginHook, Begun, Shards};
use std::time::Duration;

/// How many times `Cluster::begin` begins again when the database aborts a
/// movable group's fence read (a deadlock during a move).
const FENCE_ABORTS_RETRIED: u32 = 5;

/// The bucket moves' begin hook: [`begin`] for every transaction.
pub(crate) struct Fenced;

impl BeginHook for Fenced {
    fn begin<G: EntityGroup>(
        &self,
        shards: &Shards,
        key: &G::Key,
    ) -> impl std::future::Future<Output = Result<Begun>> + Send {
        begin::<G>(shards, key)
    }
}

/// [`Cluster::begin`](crate::Cluster::begin), with the fence of a movable group: refused by a shard
/// that no longer owns the bucket, it refreshes the map and begins on
/// the new owner; a fence the database aborted (deadlock, serialization
/// failure) begins again, up to [`FENCE_ABORTS_RETRIED`] times.
async fn begin<G: EntityGroup>(shards: &Shards, key: &G::Key) -> Result<Begun> {
    if !shards.topology().is_movable(G::NAME) {
        return shards.begin::<G>(key).await;
    }
    let key_text = key.to_directory_text();
    let deadline = tokio::time::Instant::now() + crate::rebalance::REROUTE_FOR;
    let mut delay = Duration::from_millis(1);
    let mut aborted = 0;
    loop {
        let begun = shards.begin::<G>(key).await?;
        let shard = begun.target.shard;
        let bucket = begun.target.bucket.unwrap_or_default();
        let name = shards.shard_name(shard);
        let fenced = crate::rebalance::fence(&begun.txn, name, G::NAME, bucket, &key_text).await;
        // Fault injection: the database aborts the fence read of the key
        // the failpoint's argument names (`<key>@<n>`: until `n` of one
        // begin's reads have aborted).
        #[cfg(feature = "failpoints")]
        let fenced = match fenced {
            Ok(_)
                if fail::eval("shardkit::begin::fence_aborted", |arg| {
                    arg.unwrap_or_default()
                })
                .is_some_and(|arg| {
                    arg == key_text
                        || arg.rsplit_once('@').is_some_and(|(key, n)| {
                            key == key_text && n.parse::<u32>().is_ok_and(|n| aborted < n)
                        })
                }) =>
            {
                Err(crate::rebalance::db_err(
                    name,
                    "shardkit_bucket_states",
                    "read",
                    crate::error::Synthetic::aborted("shardkit::begin::fence_aborted"),
                ))
            }
            other => other,
        };
        match fenced {
            Ok(_) => return Ok(begun),
            Err(err @ ShardError::BucketMoved { .. }) => {
                crate::metrics::fenced(G::NAME);
                // Roll back and give up the SQLite write slot before
                // waiting: other writers need it.
                let Begun { txn, writer, .. } = begun;
                let _ = txn.rollback().await;
                drop(writer);
                crate::rebalance::after_refusal(shards, G::NAME, shard).await?;
                // A new shard, or a new range id (a split) on the same
                // shard: begin again at once.
                let now_at = shards.route_now::<G>(key)?;
                if now_at.is_none_or(|t| t.shard != shard || t.bucket != Some(bucket)) {
                    tracing::debug!(
                        group = G::NAME,
                        bucket,
                        from = name,
                        "fenced: rerouted by the refreshed bucket map"
                    );
                    continue;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(err);
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(20));
            }
            // The fence is shardkit's own statement, the transaction's
            // first: when the database aborts it (a deadlock with a
            // mover's state change, MariaDB's 1213), nothing of the
            // caller's is lost, so it begins again instead of handing
            // the caller a transaction to retry.
            Err(err)
                if err.retry() == crate::Retry::Transaction && aborted < FENCE_ABORTS_RETRIED =>
            {
                aborted += 1;
                tracing::debug!(
                    group = G::NAME,
                    bucket,
                    shard = name,
                    error = %err.report(),
                    "fence aborted by the database: beginning again"
                );
                let Begun { txn, writer, .. } = begun;
                let _ = txn.rollback().await;
                drop(writer);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(20));
            }
            Err(err) => return Err(err),
        }
    }
}
