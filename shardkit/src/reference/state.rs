//! What an instance keeps of its reference tables: the newest version it
//! has seen of each, what it knows of every copy's version, the tables it
//! has registered, and the background catch-up of copies that are behind.

use crate::entity::{ReferenceEntity, ReferenceTable, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::read::{ReadFrom, ReadGuard, ReferenceFence};
use crate::topology::ShardId;
use futures::future::BoxFuture;
use sea_orm::{DatabaseConnection, DbErr};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// The shard whose copy every other one follows.
pub(crate) const SOURCE: ShardId = ShardId(0);

/// How often each instance looks for copies behind the source.
const CATCH_UP_EVERY: Duration = Duration::from_secs(1);

/// An instance's reference tables (one per cluster, shared by its handles).
#[derive(Clone)]
pub(crate) struct References {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Shards,
    /// The newest version of each table this instance has read or written.
    seen: Mutex<HashMap<&'static str, i64>>,
    /// A version each copy is known to hold (or be past): `(table, shard)`.
    copies: Mutex<HashMap<(&'static str, u32), i64>>,
    tables: Mutex<Vec<&'static dyn ReferenceTable>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl References {
    pub(crate) fn new(shards: Shards) -> Self {
        References {
            inner: Arc::new(Inner {
                shards,
                seen: Mutex::default(),
                copies: Mutex::default(),
                tables: Mutex::default(),
                task: Mutex::default(),
            }),
        }
    }

    pub(crate) fn shards(&self) -> &Shards {
        &self.inner.shards
    }

    /// The newest version of `table` this instance has seen.
    pub(super) fn seen(&self, table: &'static str) -> i64 {
        lock(&self.inner.seen).get(table).copied().unwrap_or(0)
    }

    /// This instance has seen `version` of `table`.
    pub(super) fn saw(&self, table: &'static str, version: i64) {
        let mut seen = lock(&self.inner.seen);
        let v = seen.entry(table).or_default();
        *v = (*v).max(version);
    }

    /// A version `shard`'s copy of `table` is known to hold or be past.
    pub(super) fn copy(&self, table: &'static str, shard: ShardId) -> i64 {
        lock(&self.inner.copies)
            .get(&(table, shard.0))
            .copied()
            .unwrap_or(0)
    }

    /// `shard`'s copy of `table` holds `version` (or a later one).
    pub(super) fn copy_at(&self, table: &'static str, shard: ShardId, version: i64) {
        let mut copies = lock(&self.inner.copies);
        let v = copies.entry((table, shard.0)).or_default();
        *v = (*v).max(version);
    }

    /// The shard whose own pool `conn` is (not a replica's).
    fn shard_of(&self, conn: &DatabaseConnection) -> Option<ShardId> {
        let shards = &self.inner.shards;
        (0..shards.topology().shards().len() as u32)
            .map(ShardId)
            .find(|id| std::ptr::eq(shards.shard_conn(*id), conn))
    }

    /// Registers `table`: this instance's background task keeps its
    /// copies up to date from now on (started with the first table).
    pub(crate) fn register(&self, table: &'static dyn ReferenceTable) {
        {
            let mut tables = lock(&self.inner.tables);
            if tables.iter().any(|t| t.entity() == table.entity()) {
                return;
            }
            tables.push(table);
        }
        let mut task = lock(&self.inner.task);
        if task.is_some() || self.inner.shards.topology().shards().len() < 2 {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        *task = Some(crate::exec::periodic::spawn(
            &self.inner.shards.for_task(),
            CATCH_UP_EVERY,
            crate::exec::periodic::FirstPass::AfterInterval,
            move |_shards| {
                let weak = weak.clone();
                async move {
                    let Some(inner) = weak.upgrade() else {
                        return ControlFlow::Break(());
                    };
                    References { inner }.pass().await;
                    ControlFlow::Continue(())
                }
            },
        ));
    }

    fn tables(&self) -> Vec<&'static dyn ReferenceTable> {
        lock(&self.inner.tables).clone()
    }

    /// One background pass: every copy behind its table's source version
    /// is caught up (a shard that fails is tried again next pass).
    async fn pass(&self) {
        let shards = self.inner.shards.topology().shards().len() as u32;
        for table in self.tables() {
            let name = table.table();
            let source = match crate::reference::sync::source_version(self, name).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(table = name, error = %e.report(), "reference source not read; catching up later");
                    continue;
                }
            };
            let behind = (1..shards)
                .map(ShardId)
                .filter(|s| self.copy(name, *s) < source);
            let runs = behind.map(|s| async move {
                if let Err(e) = table.catch_up(self, s.0 as usize).await {
                    tracing::debug!(table = name, shard = %self.inner.shards.shard_name(s), error = %e.report(), "reference copy behind; catching up later");
                }
            });
            futures::future::join_all(runs).await;
        }
    }

    /// Brings `shard`'s copy of every registered table up to its source
    /// (a bucket move's target, before it takes buckets).
    pub(crate) async fn catch_up_all(&self, shard: ShardId) -> Result<()> {
        for table in self.tables() {
            table.catch_up(self, shard.0 as usize).await?;
        }
        Ok(())
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
    ) -> BoxFuture<'a, std::result::Result<(), DbErr>> {
        Box::pin(async move {
            self.register(table);
            let name = table.table();
            let need = self.seen(name);
            let shard = self.shard_of(conn);
            if need == 0 || shard.is_some_and(|s| self.copy(name, s) >= need) {
                return Ok(());
            }
            let mut have = crate::reference::sync::version_of(conn, name).await?;
            if have < need
                && let Some(s) = shard
            {
                have = table
                    .catch_up(self, s.0 as usize)
                    .await
                    .map_err(|e| DbErr::Custom(e.report().to_string()))?;
            }
            if let Some(s) = shard {
                self.copy_at(name, s, have);
            }
            if have < need {
                return Err(DbErr::Custom(format!(
                    "the copy of reference table `{name}` here is at version {have}, older than version {need} this instance has read"
                )));
            }
            Ok(())
        })
    }

    fn after<'a>(
        &'a self,
        table: &'static dyn ReferenceTable,
        conn: &'a DatabaseConnection,
    ) -> BoxFuture<'a, std::result::Result<(), DbErr>> {
        Box::pin(async move {
            let name = table.table();
            let have = crate::reference::sync::version_of(conn, name).await?;
            if let Some(s) = self.shard_of(conn) {
                self.copy_at(name, s, have);
            }
            self.saw(name, have);
            Ok(())
        })
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
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let refs = state.downcast_ref::<References>().ok_or_else(|| {
                ShardError::internal("a reference table caught up with another state")
            })?;
            crate::reference::sync::catch_up::<E>(refs, ShardId(shard as u32)).await
        })
    }
}
