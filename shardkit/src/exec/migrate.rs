//! Migrations on every database of a cluster, and their report.

use crate::error::{Result, ShardError};
use crate::exec::shards::Shards;
use crate::topology::DatabaseUrl;
use futures::future::join_all;
use sea_orm::DatabaseConnection;
use sea_orm_migration::MigratorTrait;

impl Shards {
    /// Applies migrator `M` to every shard and every directory database, and
    /// shardkit's own ticket-server migrations
    /// ([`shardkit_migration::TicketMigrator`], never `M`) to every ticket
    /// server, all of them concurrently, then reports each one's status.
    /// Fails with [`ShardError::Migration`] naming a database whose migration
    /// failed, after every other one has had its turn.
    pub(crate) async fn migrate<M: MigratorTrait>(&self) -> Result<MigrationReport> {
        let results = join_all(self.databases().map(|(name, conn, role)| async move {
            match role {
                Role::Data => M::up(conn, None).await,
                Role::Tickets => shardkit_migration::TicketMigrator::up(conn, None).await,
            }
            .map_err(|source| ShardError::Migration {
                shard: name,
                source,
            })
        }))
        .await;
        results.into_iter().collect::<Result<Vec<()>>>()?;
        self.migration_status::<M>().await
    }

    /// The migration status of every shard and directory database (against
    /// `M`) and of every ticket server (against shardkit's ticket-server
    /// migrations), without changing anything (beyond creating SeaORM's
    /// migration table if missing).
    pub(crate) async fn migration_status<M: MigratorTrait>(&self) -> Result<MigrationReport> {
        let statuses = join_all(self.databases().map(|(name, conn, role)| async move {
            match role {
                Role::Data => migration_status_of::<M>(name, conn).await,
                Role::Tickets => {
                    migration_status_of::<shardkit_migration::TicketMigrator>(name, conn).await
                }
            }
        }))
        .await;
        Ok(MigrationReport {
            databases: statuses.into_iter().collect::<Result<Vec<_>>>()?,
        })
    }

    /// Every database of the cluster with its report name and role,
    /// deduplicated by URL (a directory or a ticket server may live in a
    /// shard's database, which then takes the application's migrations):
    /// shards, directory databases, ticket servers. (In-memory SQLite URLs
    /// are never the same database twice.)
    pub(super) fn databases(&self) -> impl Iterator<Item = (String, &DatabaseConnection, Role)> {
        let topology = &self.inner.topology;
        let shards = topology
            .shards()
            .iter()
            .zip(&self.inner.shards)
            .map(|(spec, conn)| (spec.name.clone(), &spec.url, conn, Role::Data));
        let dirs = topology
            .directories()
            .iter()
            .zip(&self.inner.directories)
            .map(|(spec, conn)| {
                (
                    format!("directory:{}", spec.group),
                    &spec.url,
                    conn,
                    Role::Data,
                )
            });
        let tickets = topology
            .ticket_servers()
            .iter()
            .zip(&self.inner.tickets)
            .map(|(spec, conn)| (format!("ids:{}", spec.name), &spec.url, conn, Role::Tickets));
        let mut seen: Vec<&DatabaseUrl> = Vec::new();
        shards
            .chain(dirs)
            .chain(tickets)
            .filter(move |(_, url, _, _)| {
                if seen.contains(url) && !url.is_sqlite_memory() {
                    false
                } else {
                    seen.push(url);
                    true
                }
            })
            .map(|(name, _, conn, role)| (name, conn, role))
    }
}

/// What a database of the cluster holds, and so which migrations it takes.
#[derive(Clone, Copy)]
pub(super) enum Role {
    /// A shard or a directory database: the application's migrator.
    Data,
    /// A ticket server: shardkit's ticket tables only.
    Tickets,
}

pub(super) async fn migration_status_of<M: MigratorTrait>(
    name: String,
    conn: &DatabaseConnection,
) -> Result<DatabaseMigrationStatus> {
    let applied = M::get_applied_migrations(conn).await;
    let pending = M::get_pending_migrations(conn).await;
    match (applied, pending) {
        (Ok(applied), Ok(pending)) => Ok(DatabaseMigrationStatus {
            name,
            applied: applied.iter().map(|m| m.name().to_owned()).collect(),
            pending: pending.iter().map(|m| m.name().to_owned()).collect(),
        }),
        (Err(source), _) | (_, Err(source)) => Err(ShardError::Migration {
            shard: name,
            source,
        }),
    }
}

/// The result of [`Cluster::migrate`](crate::Cluster::migrate) / [`Cluster::migration_status`](crate::Cluster::migration_status).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationReport {
    /// One entry per shard (by name), per directory database
    /// (`directory:<group>`) and per ticket server (`ids:<name>`).
    pub databases: Vec<DatabaseMigrationStatus>,
}

/// One database's migrations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatabaseMigrationStatus {
    /// Shard name, `directory:<group>` or `ids:<server>`.
    pub name: String,
    /// Applied migrations, in order.
    pub applied: Vec<String>,
    /// Migrations not yet applied.
    pub pending: Vec<String>,
}

impl MigrationReport {
    /// Databases with pending migrations: behind the migrator, and so behind
    /// any shard that has them applied.
    pub fn behind(&self) -> Vec<&DatabaseMigrationStatus> {
        self.databases
            .iter()
            .filter(|d| !d.pending.is_empty())
            .collect()
    }

    /// Whether every database has every migration applied.
    pub fn is_current(&self) -> bool {
        self.behind().is_empty()
    }
}

impl std::fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for db in &self.databases {
            writeln!(
                f,
                "{:<24} applied {:>3}  pending {:>3}{}",
                db.name,
                db.applied.len(),
                db.pending.len(),
                if db.pending.is_empty() {
                    ""
                } else {
                    "  <- behind"
                }
            )?;
        }
        Ok(())
    }
}
