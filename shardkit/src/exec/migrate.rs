//! Migrations on every database of a cluster, a few at a time, and their
//! report: what ran where, what failed, and which database is behind.

use crate::error::{DriverCause, ShardError};
use crate::exec::shards::Shards;
use crate::job::JobControl;
use crate::topology::DatabaseUrl;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use sea_orm::DatabaseConnection;
use sea_orm_migration::MigratorTrait;

/// How [`Cluster::migrate_with`](crate::Cluster::migrate_with) runs: how many
/// databases at a time, and its [`JobControl`] (progress after every
/// database; cancelled, no further database is started).
#[derive(Clone, Default)]
pub struct MigrateOptions {
    concurrency: Option<usize>,
    control: JobControl<MigrationProgress>,
}

impl MigrateOptions {
    /// Every database at once, reporting to no one.
    pub fn new() -> Self {
        Self::default()
    }

    /// At most `n` databases migrating at a time (at least 1; by default
    /// all of them at once).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }

    /// Progress after every database, and cancellation between databases.
    pub fn control(mut self, control: JobControl<MigrationProgress>) -> Self {
        self.control = control;
        self
    }

    /// Whether the run was cancelled.
    pub(crate) fn cancelled(&self) -> bool {
        self.control.is_cancelled()
    }
}

impl std::fmt::Debug for MigrateOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigrateOptions")
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

/// Where a fleet migration stands, reported after every database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationProgress {
    /// Databases finished (migrated or failed).
    pub done: usize,
    /// Databases in all.
    pub total: usize,
    /// Databases whose migration failed so far.
    pub failed: usize,
    /// The database that just finished.
    pub last: String,
}

impl Shards {
    /// Applies migrator `M` to every shard and every directory database, and
    /// shardkit's own ticket-server migrations
    /// ([`shardkit_migration::TicketMigrator`], never `M`) to every ticket
    /// server, `options`' concurrency at a time. A database that fails does
    /// not stop the others: the report names it with its error, and what ran
    /// on each database. A database's migrations are SeaORM's: those already
    /// applied there are never run again, so the next call resumes where a
    /// failure stopped.
    /// Also returns the failure of the first database (in the config's
    /// order) that failed, with SeaORM's error.
    pub(crate) async fn migrate_with<M: MigratorTrait>(
        &self,
        options: &MigrateOptions,
    ) -> (MigrationReport, Option<ShardError>) {
        let databases: Vec<_> = self.databases().collect();
        let total = databases.len();
        let control = &options.control;
        let mut progress = MigrationProgress {
            done: 0,
            total,
            failed: 0,
            last: String::new(),
        };
        let mut statuses: Vec<Option<DatabaseMigrationStatus>> = vec![None; total];
        let mut errors: Vec<Option<sea_orm::DbErr>> = (0..total).map(|_| None).collect();
        let limit = options.concurrency.unwrap_or(total).max(1);
        let mut queue = databases.into_iter().enumerate();
        type Run<'a> = futures::future::BoxFuture<
            'a,
            (usize, (DatabaseMigrationStatus, Option<sea_orm::DbErr>)),
        >;
        let mut runs: FuturesUnordered<Run<'_>> = FuturesUnordered::new();
        loop {
            while runs.len() < limit && !control.is_cancelled() {
                let Some((i, (name, conn, role))) = queue.next() else {
                    break;
                };
                runs.push(Box::pin(async move {
                    let outcome = match role {
                        Role::Data => migrate_one::<M>(name, conn).await,
                        Role::Tickets => {
                            migrate_one::<shardkit_migration::TicketMigrator>(name, conn).await
                        }
                    };
                    (i, outcome)
                }));
            }
            let Some((i, (status, error))) = runs.next().await else {
                break;
            };
            progress.done += 1;
            progress.failed += usize::from(status.error.is_some());
            progress.last.clone_from(&status.name);
            statuses[i] = Some(status);
            errors[i] = error;
            control.report(&progress);
        }
        // Cancelled: the databases never started are reported as they are.
        let mut databases = Vec::with_capacity(total);
        for ((name, conn, role), status) in self.databases().zip(statuses) {
            databases.push(match status {
                Some(status) => status,
                None => status_of::<M>(name, conn, role).await,
            });
        }
        let first = databases
            .iter()
            .zip(errors)
            .find_map(|(d, e)| e.map(|source| (d.name.clone(), source)))
            .map(|(shard, source)| ShardError::Migration { shard, source });
        (MigrationReport { databases }, first)
    }

    /// The migration status of every shard and directory database (against
    /// `M`) and of every ticket server (against shardkit's ticket-server
    /// migrations), without changing anything (beyond creating SeaORM's
    /// migration table if missing). A database that cannot be read is in
    /// the report with its error.
    pub(crate) async fn migration_status<M: MigratorTrait>(&self) -> MigrationReport {
        let statuses = futures::future::join_all(
            self.databases()
                .map(|(name, conn, role)| status_of::<M>(name, conn, role)),
        )
        .await;
        MigrationReport {
            databases: statuses,
        }
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

/// Runs `M` on one database: what was applied before, what ran, and the
/// error if it failed (with what it had applied by then).
async fn migrate_one<M: MigratorTrait>(
    name: String,
    conn: &DatabaseConnection,
) -> (DatabaseMigrationStatus, Option<sea_orm::DbErr>) {
    let before = match M::get_applied_migrations(conn).await {
        Ok(applied) => names(&applied),
        Err(source) => return (failed(name, &source), Some(source)),
    };
    let outcome = M::up(conn, None).await;
    let mut status = read_status::<M>(name, conn).await;
    status.ran = status
        .applied
        .iter()
        .filter(|m| !before.contains(m))
        .cloned()
        .collect();
    match outcome {
        Err(source) => {
            status.error = Some(DriverCause(&source).to_string());
            (status, Some(source))
        }
        Ok(()) => (status, None),
    }
}

async fn status_of<M: MigratorTrait>(
    name: String,
    conn: &DatabaseConnection,
    role: Role,
) -> DatabaseMigrationStatus {
    match role {
        Role::Data => read_status::<M>(name, conn).await,
        Role::Tickets => read_status::<shardkit_migration::TicketMigrator>(name, conn).await,
    }
}

async fn read_status<M: MigratorTrait>(
    name: String,
    conn: &DatabaseConnection,
) -> DatabaseMigrationStatus {
    let applied = M::get_applied_migrations(conn).await;
    let pending = M::get_pending_migrations(conn).await;
    match (applied, pending) {
        (Ok(applied), Ok(pending)) => DatabaseMigrationStatus {
            name,
            applied: names(&applied),
            pending: names(&pending),
            ran: Vec::new(),
            error: None,
        },
        (Err(source), _) | (_, Err(source)) => failed(name, &source),
    }
}

fn names(migrations: &[sea_orm_migration::Migration]) -> Vec<String> {
    migrations.iter().map(|m| m.name().to_owned()).collect()
}

fn failed(name: String, source: &sea_orm::DbErr) -> DatabaseMigrationStatus {
    DatabaseMigrationStatus {
        name,
        applied: Vec::new(),
        pending: Vec::new(),
        ran: Vec::new(),
        error: Some(DriverCause(source).to_string()),
    }
}

/// The result of [`Cluster::migrate`](crate::Cluster::migrate),
/// [`Cluster::migrate_with`](crate::Cluster::migrate_with) and
/// [`Cluster::migration_status`](crate::Cluster::migration_status).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationReport {
    /// One entry per shard (by name), per directory database
    /// (`directory:<group>`) and per ticket server (`ids:<name>`), in the
    /// config's order.
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
    /// The migrations this call applied here (a status read applies none).
    pub ran: Vec<String>,
    /// Why this database's migration (or its status read) failed, with its
    /// driver's cause. Its `applied` and `pending` are what it holds after
    /// the failure (both empty when it could not be read at all).
    pub error: Option<String>,
}

impl MigrationReport {
    /// Databases with pending migrations, or whose status could not be
    /// read: behind the migrator, and so behind any shard that has them
    /// applied.
    pub fn behind(&self) -> Vec<&DatabaseMigrationStatus> {
        self.databases
            .iter()
            .filter(|d| !d.pending.is_empty() || d.error.is_some())
            .collect()
    }

    /// Databases whose migration or status read failed.
    pub fn failed(&self) -> Vec<&DatabaseMigrationStatus> {
        self.databases
            .iter()
            .filter(|d| d.error.is_some())
            .collect()
    }

    /// Whether every database has every migration applied.
    pub fn is_current(&self) -> bool {
        self.behind().is_empty()
    }

    /// Which databases are on which migration: each distinct last applied
    /// migration with the databases there (more than one entry is drift).
    /// Databases that could not be read are left out.
    pub fn versions(&self) -> Vec<(Option<&str>, Vec<&str>)> {
        let mut out: Vec<(Option<&str>, Vec<&str>)> = Vec::new();
        for d in self.databases.iter().filter(|d| d.error.is_none()) {
            let last = d.applied.last().map(String::as_str);
            match out.iter_mut().find(|(v, _)| *v == last) {
                Some((_, dbs)) => dbs.push(&d.name),
                None => out.push((last, vec![&d.name])),
            }
        }
        out
    }
}

impl std::fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for db in &self.databases {
            write!(
                f,
                "{:<24} applied {:>3}  pending {:>3}  ran {:>3}",
                db.name,
                db.applied.len(),
                db.pending.len(),
                db.ran.len(),
            )?;
            match &db.error {
                Some(error) => writeln!(f, "  <- failed: {error}")?,
                None if !db.pending.is_empty() => writeln!(f, "  <- behind")?,
                None => writeln!(f)?,
            }
        }
        Ok(())
    }
}
