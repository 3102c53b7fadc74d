//! Keyed reads. A read names its shard key before it can run; the key picks
//! the shard and is also added to the `WHERE` clause, so a read never returns
//! another key's rows even when two keys share a shard.

use crate::cluster::Cluster;
use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::topology::Target;
use sea_orm::sea_query::SelectStatement;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect,
    QueryTrait, Select,
};
use tracing::Instrument;

/// The shard key type of entity `E`.
pub type KeyOf<E> = <<E as ShardedEntity>::Group as EntityGroup>::Key;

/// A read that has no shard key yet. Add one with [`Find::key`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Unkeyed;

/// A read pinned to one shard key.
#[derive(Clone, Debug)]
pub struct Keyed<K>(K);

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Unkeyed {}
    impl<K> Sealed for super::Keyed<K> {}
}

/// The routing states a read can run in. `Unkeyed` is not one of them, so an
/// unkeyed read does not compile.
#[diagnostic::on_unimplemented(
    message = "this shardkit read has no shard key, so it cannot run",
    label = "add `.key(k)` before running the read",
    note = "shardkit never guesses which shards to read: use `.key(k)` to read one shard key's rows"
)]
pub trait Routed<E: ShardedEntity>: sealed::Sealed {
    /// The key the read is pinned to.
    fn shard_key(&self) -> &KeyOf<E>;
}

impl<E: ShardedEntity> Routed<E> for Keyed<KeyOf<E>> {
    fn shard_key(&self) -> &KeyOf<E> {
        &self.0
    }
}

/// A read of entity `E` through the cluster: a SeaORM [`Select`] plus routing.
///
/// `filter`, `order_by_*`, `limit`, `offset`, `columns` and the other
/// [`QueryFilter`], [`QueryOrder`] and [`QuerySelect`] methods work as on a
/// `Select<E>`.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct Find<E: ShardedEntity, R = Unkeyed> {
    cluster: Cluster,
    select: Select<E>,
    route: R,
}

impl<E: ShardedEntity> Find<E, Unkeyed> {
    pub(crate) fn new(cluster: Cluster, select: Select<E>) -> Self {
        Find {
            cluster,
            select,
            route: Unkeyed,
        }
    }

    /// Pins the read to one shard key: it runs on that key's shard only, with
    /// `shard_key = key` added to its `WHERE` clause.
    pub fn key(self, key: KeyOf<E>) -> Find<E, Keyed<KeyOf<E>>> {
        Find {
            cluster: self.cluster,
            select: self.select,
            route: Keyed(key),
        }
    }
}

/// A read whose shard is known: everything but the I/O.
struct Planned<E: ShardedEntity> {
    cluster: Cluster,
    target: Target,
    select: Select<E>,
    span: tracing::Span,
}

// The `Routed` bound sits on each method rather than on the impl so that an
// unkeyed read reports the bound's own message, not "method not found".
impl<E: ShardedEntity, R> Find<E, R> {
    async fn plan(self, op: &'static str) -> Result<Planned<E>>
    where
        R: Routed<E>,
    {
        let key = self.route.shard_key();
        let target = self.cluster.route::<E::Group>(key).await?;
        let span = read_span::<E>(self.cluster.shard_name(target.shard), target.bucket, op);
        tracing::debug!(parent: &span, key = ?key, "routed read");
        Ok(Planned {
            select: keyed_select::<E>(self.select, key),
            cluster: self.cluster,
            target,
            span,
        })
    }

    /// All matching rows.
    pub async fn all(self) -> Result<Vec<E::Model>>
    where
        R: Routed<E>,
    {
        let Planned {
            cluster,
            target,
            select,
            span,
        } = self.plan("all").await?;
        select
            .all(cluster.shard_conn(target.shard))
            .instrument(span)
            .await
            .map_err(|e| read_err::<E>(cluster.shard_name(target.shard), e))
    }

    /// The first matching row.
    pub async fn one(self) -> Result<Option<E::Model>>
    where
        R: Routed<E>,
    {
        let Planned {
            cluster,
            target,
            select,
            span,
        } = self.plan("one").await?;
        select
            .one(cluster.shard_conn(target.shard))
            .instrument(span)
            .await
            .map_err(|e| read_err::<E>(cluster.shard_name(target.shard), e))
    }

    /// The number of matching rows.
    pub async fn count(self) -> Result<u64>
    where
        R: Routed<E>,
        E::Model: Sync,
    {
        let Planned {
            cluster,
            target,
            select,
            span,
        } = self.plan("count").await?;
        select
            .count(cluster.shard_conn(target.shard))
            .instrument(span)
            .await
            .map_err(|e| read_err::<E>(cluster.shard_name(target.shard), e))
    }
}

/// A read inside a [`ShardTx`](crate::ShardTx): already pinned to the
/// transaction's key and run on its connection.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct TxFind<'t, E: ShardedEntity, C> {
    conn: &'t C,
    shard: &'t str,
    select: Select<E>,
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    pub(crate) fn new(conn: &'t C, shard: &'t str, key: &KeyOf<E>) -> Self {
        TxFind {
            conn,
            shard,
            select: keyed_select::<E>(E::find(), key),
        }
    }

    /// All matching rows of the transaction's key.
    pub async fn all(self) -> Result<Vec<E::Model>> {
        self.select
            .all(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// The first matching row of the transaction's key.
    pub async fn one(self) -> Result<Option<E::Model>> {
        self.select
            .one(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// The number of matching rows of the transaction's key.
    pub async fn count(self) -> Result<u64>
    where
        E::Model: Sync,
    {
        self.select
            .count(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }
}

/// The one place a shard-key predicate is added to a read.
fn keyed_select<E: ShardedEntity>(select: Select<E>, key: &KeyOf<E>) -> Select<E> {
    select.filter(E::shard_key_column().eq(key.clone()))
}

fn read_span<E: ShardedEntity>(
    shard: &str,
    bucket: Option<u32>,
    op: &'static str,
) -> tracing::Span {
    let span = tracing::info_span!(
        "shardkit.read",
        group = <E::Group as EntityGroup>::NAME,
        table = table_name::<E>(),
        shard = shard,
        bucket = tracing::field::Empty,
        op = op,
    );
    if let Some(bucket) = bucket {
        span.record("bucket", bucket);
    }
    span
}

fn read_err<E: ShardedEntity>(shard: &str, source: DbErr) -> ShardError {
    ShardError::Db {
        group: <E::Group as EntityGroup>::NAME,
        shard: shard.to_owned(),
        operation: format!("select {}", table_name::<E>()),
        source,
    }
}

macro_rules! select_traits {
    ($ty:ty, [$($generics:tt)*]) => {
        impl<$($generics)*> QueryFilter for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(&mut self.select)
            }
        }
        impl<$($generics)*> QueryOrder for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(&mut self.select)
            }
        }
        impl<$($generics)*> QuerySelect for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(&mut self.select)
            }
        }
    };
}

select_traits!(Find<E, R>, [E: ShardedEntity, R]);
select_traits!(TxFind<'t, E, C>, ['t, E: ShardedEntity, C]);
