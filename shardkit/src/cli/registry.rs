//! The typed things the commands act on, behind objects the command line
//! can call by name.

use crate::cluster::{Cluster, MigrateOptions, MigrationReport};
use crate::entity::{EntityGroup, ShardedEntity};
use crate::error::{Result, ShardError};
use crate::gsi::{BackfillProgress, IndexState, ReconcileReport};
use crate::job::JobControl;
use crate::read::ReadPlan;
use crate::rebalance::{AnyGroup, Rebalance};
use crate::rollout::{Phase, Rollout, RolloutBackfill, RolloutHandle, RolloutStatus};
use crate::topology::Target;
use crate::verify::{VerifyOptions, VerifyReport};
use futures::future::BoxFuture;
use std::str::FromStr;
use std::time::Duration;

type KeyOf<E> = <<E as ShardedEntity>::Group as EntityGroup>::Key;

/// What `shardctl` knows of the application: its migrator, entities and
/// rollouts. Build it once in the admin binary and hand it to
/// [`run`](super::run).
#[derive(Default)]
pub struct Registry {
    pub(super) migrator: Option<Box<dyn AdminMigrator>>,
    pub(super) entities: Vec<Box<dyn AdminEntity>>,
    pub(super) rollouts: Vec<Box<dyn AdminRolloutDecl>>,
    /// Sets up the outbox the `outbox` commands use: its handlers and
    /// message types.
    pub(super) outbox: Option<OutboxSetup>,
    pub(super) references: Vec<Box<dyn AdminReference>>,
}

type OutboxSetup = Box<dyn Fn(crate::outbox::Outbox) -> crate::outbox::Outbox + Send + Sync>;

impl Registry {
    /// Nothing registered yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The migrator `migrate up|status` and `status` run (usually the
    /// application's, which includes shardkit's own migrations).
    pub fn migrator<M: sea_orm_migration::MigratorTrait + 'static>(mut self) -> Self {
        self.migrator = Some(Box::new(MigratorOf::<M>(std::marker::PhantomData)));
        self
    }

    /// An entity the commands may name by its table (`explain`, `gsi`,
    /// `verify shards`), and whose group `route` may name.
    pub fn entity<E>(mut self) -> Self
    where
        E: ShardedEntity,
        KeyOf<E>: FromStr,
    {
        self.entities
            .push(Box::new(EntityOf::<E>(std::marker::PhantomData)));
        self
    }

    /// A rollout the `rollout` commands may name; registered on the cluster
    /// (as an instance named `shardctl` unless it names one) when a command
    /// needs it.
    pub fn rollout<Old, New>(mut self, rollout: Rollout<Old, New>) -> Self
    where
        Old: ShardedEntity,
        New: ShardedEntity<Group = Old::Group>,
    {
        self.rollouts.push(Box::new(RolloutDecl {
            name: rollout.name().to_owned(),
            rollout: std::sync::Mutex::new(Some(rollout)),
        }));
        self
    }

    /// The message types (`.message::<M>()`) and handlers
    /// (`.handle::<M, ..>(..)`) the `outbox` commands know: `status` lists
    /// every message, `retry` and `discard` need its type, `run` applies
    /// the types with a handler.
    pub fn outbox(
        mut self,
        setup: impl Fn(crate::outbox::Outbox) -> crate::outbox::Outbox + Send + Sync + 'static,
    ) -> Self {
        self.outbox = Some(Box::new(setup));
        self
    }

    /// A reference table the `reference` commands know; every command's
    /// cluster registers it, so `rebalance run` brings it to a move's
    /// target before the move copies rows.
    pub fn reference<E: crate::ReferenceEntity + 'static>(mut self) -> Self {
        self.references
            .push(Box::new(ReferenceOf::<E>(std::marker::PhantomData)));
        self
    }

    pub(super) fn entity_named(&self, table: &str) -> Result<&dyn AdminEntity> {
        self.entities
            .iter()
            .find(|e| e.table() == table)
            .map(|e| &**e)
            .ok_or_else(|| {
                let known: Vec<&str> = self.entities.iter().map(|e| e.table()).collect();
                ShardError::config(
                    "shardctl",
                    format!(
                        "no registered entity has the table `{table}` (registered: {}); add it \
                         with Registry::entity",
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                )
            })
    }
}

/// A migrator, by type.
pub(super) trait AdminMigrator: Send + Sync {
    fn up<'a>(
        &'a self,
        cluster: &'a Cluster,
        options: MigrateOptions,
    ) -> BoxFuture<'a, Result<MigrationReport>>;
    fn status<'a>(&'a self, cluster: &'a Cluster) -> BoxFuture<'a, Result<MigrationReport>>;
}

struct MigratorOf<M>(std::marker::PhantomData<fn() -> M>);

impl<M: sea_orm_migration::MigratorTrait + 'static> AdminMigrator for MigratorOf<M> {
    fn up<'a>(
        &'a self,
        cluster: &'a Cluster,
        options: MigrateOptions,
    ) -> BoxFuture<'a, Result<MigrationReport>> {
        Box::pin(cluster.migrate_with::<M>(options))
    }

    fn status<'a>(&'a self, cluster: &'a Cluster) -> BoxFuture<'a, Result<MigrationReport>> {
        Box::pin(cluster.migration_status::<M>())
    }
}

/// An entity, by table name.
pub(super) trait AdminEntity: Send + Sync {
    fn table(&self) -> &'static str;
    fn group(&self) -> &'static str;
    /// Moves of its group carrying it.
    fn moves(&self, cluster: &Cluster) -> Result<Rebalance<AnyGroup>>;
    /// `moves` (of its group) carrying it too, after the entities they
    /// carry already.
    fn carried_by(&self, moves: Rebalance<AnyGroup>) -> Result<Rebalance<AnyGroup>>;
    /// Its global indexes: column and whether unique.
    fn indexes(&self) -> Vec<(&'static str, bool)>;
    /// Where `key` (as text) of the entity's group lives.
    fn route<'a>(&'a self, cluster: &'a Cluster, key: &'a str) -> BoxFuture<'a, Result<Target>>;
    fn explain<'a>(
        &'a self,
        cluster: &'a Cluster,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<ReadPlan>>;
    fn index_state<'a>(
        &'a self,
        cluster: &'a Cluster,
        column: &'a str,
    ) -> BoxFuture<'a, Result<IndexState>>;
    fn index_create<'a>(&'a self, cluster: &'a Cluster) -> BoxFuture<'a, Result<()>>;
    fn index_backfill<'a>(
        &'a self,
        cluster: &'a Cluster,
        column: &'a str,
        chunk: u64,
        control: JobControl<BackfillProgress>,
    ) -> BoxFuture<'a, Result<BackfillProgress>>;
    fn index_reconcile<'a>(
        &'a self,
        cluster: &'a Cluster,
        control: JobControl<ReconcileReport>,
    ) -> BoxFuture<'a, Result<ReconcileReport>>;
    fn verify_shards<'a>(
        &'a self,
        cluster: &'a Cluster,
        source: &'a str,
        target: &'a str,
        bucket: Option<u32>,
        opts: VerifyOptions,
    ) -> BoxFuture<'a, Result<VerifyReport>>;
}

struct EntityOf<E>(std::marker::PhantomData<fn() -> E>);

impl<E> EntityOf<E>
where
    E: ShardedEntity,
    KeyOf<E>: FromStr,
{
    fn key(text: &str) -> Result<KeyOf<E>> {
        text.parse().map_err(|_| {
            ShardError::config(
                "shardctl",
                format!(
                    "`{text}` is not a shard key of group {} ({})",
                    <E::Group as EntityGroup>::NAME,
                    std::any::type_name::<KeyOf<E>>()
                ),
            )
        })
    }

    fn column(name: &str) -> Result<E::Column> {
        E::GLOBAL_INDEXES
            .iter()
            .map(|(c, _)| *c)
            .find(|c| sea_orm::IdenStatic::as_str(c) == name)
            .ok_or_else(|| {
                ShardError::config(
                    "shardctl",
                    format!(
                        "`{}` has no global index on `{name}` (indexed: {})",
                        E::default().table_name(),
                        E::GLOBAL_INDEXES
                            .iter()
                            .map(|(c, _)| sea_orm::IdenStatic::as_str(c))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    }
}

impl<E> AdminEntity for EntityOf<E>
where
    E: ShardedEntity,
    KeyOf<E>: FromStr,
{
    fn table(&self) -> &'static str {
        E::default().table_name()
    }

    fn moves(&self, cluster: &Cluster) -> Result<Rebalance<AnyGroup>> {
        Ok(cluster.rebalance::<E::Group>()?.entity::<E>().into_any())
    }

    fn carried_by(&self, moves: Rebalance<AnyGroup>) -> Result<Rebalance<AnyGroup>> {
        moves.try_entity::<E>()
    }

    fn group(&self) -> &'static str {
        <E::Group as EntityGroup>::NAME
    }

    fn indexes(&self) -> Vec<(&'static str, bool)> {
        E::GLOBAL_INDEXES
            .iter()
            .map(|(c, unique)| (sea_orm::IdenStatic::as_str(c), *unique))
            .collect()
    }

    fn route<'a>(&'a self, cluster: &'a Cluster, key: &'a str) -> BoxFuture<'a, Result<Target>> {
        Box::pin(async move {
            let key = Self::key(key)?;
            cluster.route::<E::Group>(&key).await
        })
    }

    fn explain<'a>(
        &'a self,
        cluster: &'a Cluster,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<ReadPlan>> {
        Box::pin(async move {
            let plan = match keys {
                [] => cluster.find::<E>().scatter().explain().await?,
                [key] => cluster.find::<E>().key(Self::key(key)?).explain().await?,
                keys => {
                    let keys = keys
                        .iter()
                        .map(|k| Self::key(k))
                        .collect::<Result<Vec<_>>>()?;
                    cluster.find::<E>().keys(keys).explain().await?
                }
            };
            Ok(plan)
        })
    }

    fn index_state<'a>(
        &'a self,
        cluster: &'a Cluster,
        column: &'a str,
    ) -> BoxFuture<'a, Result<IndexState>> {
        Box::pin(async move { cluster.gsi().state::<E>(Self::column(column)?).await })
    }

    fn index_create<'a>(&'a self, cluster: &'a Cluster) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { cluster.gsi().create::<E>().await })
    }

    fn index_backfill<'a>(
        &'a self,
        cluster: &'a Cluster,
        column: &'a str,
        chunk: u64,
        control: JobControl<BackfillProgress>,
    ) -> BoxFuture<'a, Result<BackfillProgress>> {
        Box::pin(async move {
            cluster
                .gsi()
                .backfill_with::<E>(Self::column(column)?, chunk, control)
                .await
        })
    }

    fn index_reconcile<'a>(
        &'a self,
        cluster: &'a Cluster,
        control: JobControl<ReconcileReport>,
    ) -> BoxFuture<'a, Result<ReconcileReport>> {
        Box::pin(async move { cluster.gsi().reconcile_with::<E>(control).await })
    }

    fn verify_shards<'a>(
        &'a self,
        cluster: &'a Cluster,
        source: &'a str,
        target: &'a str,
        bucket: Option<u32>,
        opts: VerifyOptions,
    ) -> BoxFuture<'a, Result<VerifyReport>> {
        Box::pin(cluster.verify_shards::<E>(source, target, bucket, opts))
    }
}

/// A rollout declaration, registered on the cluster when a command needs it.
pub(super) trait AdminRolloutDecl: Send + Sync {
    fn name(&self) -> &str;
    fn register<'a>(&'a self, cluster: &'a Cluster)
    -> BoxFuture<'a, Result<Box<dyn AdminRollout>>>;
}

struct RolloutDecl<Old: ShardedEntity, New: ShardedEntity> {
    name: String,
    rollout: std::sync::Mutex<Option<Rollout<Old, New>>>,
}

impl<Old, New> AdminRolloutDecl for RolloutDecl<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn register<'a>(
        &'a self,
        cluster: &'a Cluster,
    ) -> BoxFuture<'a, Result<Box<dyn AdminRollout>>> {
        Box::pin(async move {
            let rollout = self
                .rollout
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .ok_or_else(|| {
                    ShardError::config(
                        format!("rollout {:?}", self.name),
                        "already registered by this command line",
                    )
                })?;
            let rollout = if rollout.instance_name().is_some() {
                rollout
            } else {
                rollout.instance("shardctl")
            };
            let handle = cluster.register_rollout(rollout).await?;
            Ok(Box::new(handle) as Box<dyn AdminRollout>)
        })
    }
}

/// A registered rollout, by name.
pub(super) trait AdminRollout: Send + Sync {
    fn status(&self) -> BoxFuture<'_, Result<RolloutStatus>>;
    fn advance<'a>(
        &'a self,
        on_wait: &'a mut (dyn FnMut(Phase, Duration) + Send),
    ) -> BoxFuture<'a, Result<Phase>>;
    fn retreat(&self) -> BoxFuture<'_, Result<Phase>>;
    fn backfill(
        &self,
        chunk: u64,
        control: JobControl<RolloutBackfill>,
    ) -> BoxFuture<'_, Result<RolloutBackfill>>;
    fn verify(
        &self,
        opts: VerifyOptions,
        control: JobControl<VerifyReport>,
    ) -> BoxFuture<'_, Result<VerifyReport>>;
}

impl<Old, New> AdminRollout for RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    fn status(&self) -> BoxFuture<'_, Result<RolloutStatus>> {
        Box::pin(RolloutHandle::status(self))
    }

    fn advance<'a>(
        &'a self,
        on_wait: &'a mut (dyn FnMut(Phase, Duration) + Send),
    ) -> BoxFuture<'a, Result<Phase>> {
        Box::pin(self.advance_when_ready_with(on_wait))
    }

    fn retreat(&self) -> BoxFuture<'_, Result<Phase>> {
        Box::pin(RolloutHandle::retreat(self))
    }

    fn backfill(
        &self,
        chunk: u64,
        control: JobControl<RolloutBackfill>,
    ) -> BoxFuture<'_, Result<RolloutBackfill>> {
        Box::pin(self.backfill_with(chunk, control))
    }

    fn verify(
        &self,
        opts: VerifyOptions,
        control: JobControl<VerifyReport>,
    ) -> BoxFuture<'_, Result<VerifyReport>> {
        Box::pin(self.verify_with(opts, control))
    }
}

/// A reference table, by table name.
pub(super) trait AdminReference: Send + Sync {
    fn table(&self) -> &'static str;
    /// Registers the table with the cluster (its catch-up, and moves
    /// bringing it to their target).
    fn register(&self, cluster: &Cluster);
    fn status<'a>(
        &'a self,
        cluster: &'a Cluster,
    ) -> BoxFuture<'a, Result<crate::reference::ReferenceStatus>>;
    fn verify<'a>(
        &'a self,
        cluster: &'a Cluster,
        repair: bool,
    ) -> BoxFuture<'a, Result<crate::reference::ReferenceReport>>;
}

struct ReferenceOf<E>(std::marker::PhantomData<fn() -> E>);

impl<E: crate::ReferenceEntity + 'static> AdminReference for ReferenceOf<E> {
    fn table(&self) -> &'static str {
        crate::entity::table_name::<E>()
    }

    fn register(&self, cluster: &Cluster) {
        let _ = cluster.reference::<E>();
    }

    fn status<'a>(
        &'a self,
        cluster: &'a Cluster,
    ) -> BoxFuture<'a, Result<crate::reference::ReferenceStatus>> {
        Box::pin(async move { cluster.reference::<E>().status().await })
    }

    fn verify<'a>(
        &'a self,
        cluster: &'a Cluster,
        repair: bool,
    ) -> BoxFuture<'a, Result<crate::reference::ReferenceReport>> {
        Box::pin(async move { cluster.reference::<E>().verify(repair).await })
    }
}
