//! What runs on its own: the background catch-up of copies that are
//! behind, the fence around reads that join a reference table, and the
//! table object a derive names.

use crate::entity::{ReferenceEntity, ReferenceTable, table_name};
use crate::error::{Result, ShardError};
use crate::read::{ReadFrom, ReadGuard, ReferenceFence};
use crate::reference::state::{References, SOURCE};
use crate::reference::sync::{catch_up, db_err, source_version, version_of};
use crate::topology::ShardId;
use futures::future::BoxFuture;
use sea_orm::DatabaseConnection;
use std::any::{Any, TypeId};
use std::ops::ControlFlow;
use std::time::Duration;

/// How often each instance looks for copies behind the source.
const CATCH_UP_EVERY: Duration = Duration::from_secs(1);

/// Registers `table`: this instance's background task keeps its copies up
/// to date from now on (started with the first table).
pub(crate) fn register(refs: &References, table: &'static dyn ReferenceTable) {
    if !refs.add_table(table) {
        return;
    }
    refs.start_task(|weak| {
        crate::exec::periodic::spawn(
            &refs.shards().for_task(),
            CATCH_UP_EVERY,
            crate::exec::periodic::FirstPass::AfterInterval,
            move |_shards| {
                let refs = weak.upgrade();
                async move {
                    let Some(refs) = refs else {
                        return ControlFlow::Break(());
                    };
                    pass(&refs).await;
                    ControlFlow::Continue(())
                }
            },
        )
    });
}

/// One background pass: every copy's version read, and every copy not at
/// its table's source version caught up (a shard that fails is tried again
/// next pass).
async fn pass(refs: &References) {
    // Fault injection: no background pass (a copy set back stays so).
    #[cfg(feature = "failpoints")]
    if refs
        .shards()
        .failpoint("shardkit::reference::no_pass")
        .is_some()
    {
        return;
    }
    let shards = refs.shards();
    let count = shards.topology().shards().len() as u32;
    let timeout = shards.read_settings().timeout;
    for table in refs.tables() {
        let name = table.table();
        let source = match source_version(refs, name).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(table = name, error = %e.report(), "reference source not read; catching up later");
                continue;
            }
        };
        let runs = (1..count).map(ShardId).map(|s| async move {
            let read = async {
                version_of(shards.shard_conn(s), name)
                    .await
                    .map_err(|e| db_err(shards.shard_name(s), name, "read the version of", e))
            };
            match shards.bounded(s, "reference", timeout, read).await {
                Ok(v) if v == source => {
                    refs.copy_is(name, s, v);
                    return;
                }
                Ok(v) => refs.copy_is(name, s, v),
                Err(e) => {
                    tracing::debug!(table = name, shard = %shards.shard_name(s), error = %e.report(), "reference copy not read; catching up later");
                    return;
                }
            }
            if let Err(e) = refs.catch_up(table, s, None).await {
                tracing::debug!(table = name, shard = %shards.shard_name(s), error = %e.report(), "reference copy behind; catching up later");
            }
        });
        futures::future::join_all(runs).await;
    }
}

/// Reads consult the reference tables only when they join one.
impl ReadGuard for References {
    fn check(&self, _entity: TypeId, _table: &'static str) -> Result<Option<ReadFrom>> {
        Ok(None)
    }

    fn reference_fence(&self) -> Option<&dyn ReferenceFence> {
        Some(self)
    }
}

impl ReferenceFence for References {
    fn before<'a>(
        &'a self,
        table: &'static dyn ReferenceTable,
        conn: &'a DatabaseConnection,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            register(self, table);
            let name = table.table();
            let mut need = self.seen(name);
            let shard = self.shard_of(conn);
            // Having seen no version, a read still needs the copy to have
            // one (below): known, or read once per copy.
            if shard.is_some_and(|s| self.copy(name, s) >= need.max(1)) {
                return Ok(need);
            }
            let mut have = self.version_here(conn, shard, name).await?;
            if need == 0 {
                if have > 0 {
                    if let Some(s) = shard {
                        self.copy_is(name, s, have);
                    }
                    return Ok(0);
                }
                need = self.first_version(name).await;
                if need == 0 {
                    return Ok(0);
                }
            }
            if have < need
                && let Some(s) = shard
            {
                // Its own error: the source or this shard not answering
                // is said as such. A copy whose catch-up failed just now
                // is behind without another try.
                if let Some(caught_up) = self.catch_up(table, s, Some(need)).await? {
                    have = caught_up;
                }
            }
            if let Some(s) = shard {
                self.copy_is(name, s, have);
            }
            if have < need {
                return Err(self.older(shard, name, have, need));
            }
            Ok(need)
        })
    }

    fn after<'a>(
        &'a self,
        table: &'static dyn ReferenceTable,
        conn: &'a DatabaseConnection,
        need: i64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let name = table.table();
            let shard = self.shard_of(conn);
            let have = self.version_here(conn, shard, name).await?;
            if let Some(s) = shard {
                self.copy_is(name, s, have);
            }
            // `before` may have taken the instance's word for the copy: a
            // copy set back since (a restore, another instance following
            // the source back) shows here, and its rows are not returned.
            if have < need {
                return Err(self.older(shard, name, have, need));
            }
            self.saw(name, have);
            Ok(())
        })
    }
}

impl References {
    /// The version of `table`'s copy on `conn` (shard `shard`, or one of
    /// its replicas when `None`).
    async fn version_here(
        &self,
        conn: &DatabaseConnection,
        shard: Option<ShardId>,
        table: &'static str,
    ) -> Result<i64> {
        version_of(conn, table)
            .await
            .map_err(|e| db_err(self.where_is(shard), table, "read the version of", e))
    }

    /// What a read needs of a copy that has no version, when this instance
    /// has seen none of `table`: one version (none while the source has
    /// none), so that a copy that never had one (a shard just added, not
    /// yet caught up) is not read as the table. One read of the source's
    /// version, within half the read timeout (the read's own error, not
    /// the source's, if it had to wait longer); a source that cannot be
    /// read asks nothing of the copy, which is read as it is.
    async fn first_version(&self, table: &'static str) -> i64 {
        let shards = self.shards();
        let within = shards.read_settings().timeout.map(|t| t / 2);
        let read = async {
            version_of(shards.shard_conn(SOURCE), table)
                .await
                .map_err(|e| db_err(shards.shard_name(SOURCE), table, "read the version of", e))
        };
        let source = shards.bounded(SOURCE, "reference", within, read).await;
        match source {
            Ok(0) => 0,
            Ok(_) => {
                self.saw(table, 1);
                1
            }
            Err(e) => {
                tracing::debug!(table, error = %e.report(), "reference source not read; the copy is read as it is");
                0
            }
        }
    }

    /// The refusal of a read whose copy is older than it needs.
    fn older(
        &self,
        shard: Option<ShardId>,
        table: &'static str,
        have: i64,
        need: i64,
    ) -> ShardError {
        ShardError::ReferenceBehind {
            table,
            shard: self.where_is(shard).to_owned(),
            have,
            need,
        }
    }

    /// A shard's name; `a replica` for a connection that is none.
    fn where_is(&self, shard: Option<ShardId>) -> &str {
        shard.map_or("a replica", |s| self.shards().shard_name(s))
    }
}

/// A reference entity's table as the object reads and catch-ups call
/// (`#[derive(Sharded)]` names it); not part of the public API.
#[doc(hidden)]
pub struct Typed<E>(std::marker::PhantomData<fn() -> E>);

impl<E> Typed<E> {
    /// The object.
    pub const NEW: Self = Typed(std::marker::PhantomData);
}

impl<E: ReferenceEntity + 'static> ReferenceTable for Typed<E> {
    fn table(&self) -> &'static str {
        table_name::<E>()
    }

    fn entity(&self) -> TypeId {
        TypeId::of::<E>()
    }

    fn catch_up<'a>(
        &'a self,
        state: &'a (dyn Any + Send + Sync),
        shard: usize,
        bound: Option<std::time::Duration>,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let refs = state.downcast_ref::<References>().ok_or_else(|| {
                ShardError::internal("a reference table caught up with another state")
            })?;
            catch_up::<E>(refs, ShardId(shard as u32), bound).await
        })
    }
}
