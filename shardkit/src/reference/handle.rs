//! [`Reference`]: writes, reads, status and verification of one reference
//! table ([`Cluster::reference`](crate::Cluster::reference)).

use crate::entity::{ReferenceEntity, ReferenceTable, table_name};
use crate::error::{Result, ShardError};
use crate::key::model_pk_values;
use crate::read::ReferenceFence;
use crate::reference::state::{References, SOURCE};
use crate::reference::sync::{
    Change, Rows, Snapshot, apply_version, catch_up, db_err, push, read_source, texts, version_of,
    write_source,
};
use crate::reference::watch::{Typed, register};
use crate::topology::ShardId;
use sea_orm::{QueryTrait, Select};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One reference table: its writes (versioned, on every shard), its reads
/// (served by any shard, never older than what this instance has seen),
/// its status and its verification. Cheap to clone.
///
/// Made by [`Cluster::reference`](crate::Cluster::reference), which also
/// registers the table with the instance: its background task catches up
/// copies that are behind, and its bucket moves bring the table to their
/// target before the cut-over.
pub struct Reference<E> {
    refs: References,
    next: Arc<AtomicUsize>,
    _entity: std::marker::PhantomData<fn() -> E>,
}

impl<E> Clone for Reference<E> {
    fn clone(&self) -> Self {
        Reference {
            refs: self.refs.clone(),
            next: self.next.clone(),
            _entity: std::marker::PhantomData,
        }
    }
}

impl<E> std::fmt::Debug for Reference<E>
where
    E: ReferenceEntity,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reference")
            .field("table", &table_name::<E>())
            .finish_non_exhaustive()
    }
}

/// What a reference write did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReferenceWrite {
    /// The table's version the write made (on the source, durable).
    pub version: i64,
    /// The shards whose copies have it now (the source included).
    pub applied: Vec<String>,
    /// The shards whose copies do not have it yet, each with why: the
    /// background catch-up (or the next read there) brings it.
    pub behind: Vec<(String, String)>,
}

/// Each copy's version ([`Reference::status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReferenceStatus {
    /// The table.
    pub table: &'static str,
    /// The source's version (`None`: the source could not be read).
    pub source: Option<i64>,
    /// Every shard's copy, the source first.
    pub copies: Vec<CopyStatus>,
}

/// One copy's version.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CopyStatus {
    /// The shard.
    pub shard: String,
    /// Its copy's version, or why it could not be read.
    pub version: std::result::Result<i64, String>,
    /// Why [`Reference::catch_up`] could not bring this copy to the
    /// source's version (a constraint on the shard, a step out of time,
    /// the shard down); `None` when it did, and from
    /// [`Reference::status`].
    pub catch_up_failed: Option<String>,
}

impl ReferenceStatus {
    /// The shards whose copies are behind the source (or unreadable).
    pub fn behind(&self) -> Vec<&str> {
        self.copies
            .iter()
            .filter(|c| match (&c.version, self.source) {
                (Ok(v), Some(s)) => *v < s,
                _ => true,
            })
            .map(|c| c.shard.as_str())
            .collect()
    }
}

/// What [`Reference::verify`] found, copy by copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReferenceReport {
    /// The table.
    pub table: &'static str,
    /// The source's version when it was read.
    pub version: i64,
    /// The source's rows.
    pub rows: usize,
    /// Every other shard's copy.
    pub copies: Vec<CopyReport>,
}

/// One copy compared with the source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyReport {
    /// The shard.
    pub shard: String,
    /// The copy's version when it was read.
    pub version: i64,
    /// Whether its rows are the source's, value for value.
    pub matches: bool,
    /// Primary keys (as text) of rows the source has and the copy lacks.
    pub missing: Vec<String>,
    /// Primary keys of rows the copy has and the source does not.
    pub extra: Vec<String>,
    /// Primary keys of rows whose values differ.
    pub differing: Vec<String>,
    /// Whether the copy was repaired (its rows and version set from the
    /// source).
    pub repaired: bool,
    /// Why the copy could not be read or repaired.
    pub error: Option<String>,
}

impl CopyReport {
    /// Whether the copy differs from the source (or could not be read).
    pub fn differs(&self) -> bool {
        !self.missing.is_empty()
            || !self.extra.is_empty()
            || !self.differing.is_empty()
            || self.error.is_some()
    }
}

impl ReferenceReport {
    /// Whether every copy held the source's rows (before any repair).
    pub fn is_consistent(&self) -> bool {
        self.copies.iter().all(|c| !c.differs())
    }
}

impl<E> Reference<E>
where
    E: ReferenceEntity + 'static,
{
    pub(crate) fn new(refs: References) -> Self {
        register(&refs, &Typed::<E>::NEW);
        Reference {
            refs,
            next: Arc::default(),
            _entity: std::marker::PhantomData,
        }
    }

    fn table() -> &'static str {
        table_name::<E>()
    }

    async fn write(&self, changes: Vec<Change<E>>) -> Result<ReferenceWrite> {
        if changes.is_empty() {
            return Err(ShardError::Reference {
                table: Self::table(),
                reason: "a write of no rows".to_owned(),
            });
        }
        let version = write_source::<E>(&self.refs, &changes).await?;
        // The process dying here leaves the copies to the catch-up.
        if self
            .refs
            .shards()
            .failpoint("shardkit::reference::after_source")
            .is_some()
        {
            return Err(ShardError::internal(
                "failpoint shardkit::reference::after_source",
            ));
        }
        let shards = self.refs.shards();
        let count = shards.topology().shards().len() as u32;
        let pushes = (1..count).map(ShardId).map(|s| {
            let changes = &changes;
            async move { (s, push::<E>(&self.refs, s, version, changes).await) }
        });
        let mut out = ReferenceWrite {
            version,
            applied: vec![shards.shard_name(SOURCE).to_owned()],
            behind: Vec::new(),
        };
        for (s, result) in futures::future::join_all(pushes).await {
            let name = shards.shard_name(s).to_owned();
            match result {
                Ok(v) if v >= version => out.applied.push(name),
                Ok(v) => out
                    .behind
                    .push((name, format!("its copy is at version {v}"))),
                Err(e) => {
                    tracing::debug!(table = Self::table(), shard = %name, error = %e.report(), "reference copy not written; it is caught up later");
                    out.behind.push((name, e.report().to_string()));
                }
            }
        }
        crate::metrics::reference_version(Self::table(), version);
        Ok(out)
    }

    /// Inserts `rows` as one version; refused (nothing written) when one's
    /// primary key is in the table.
    pub async fn insert_many(
        &self,
        rows: impl IntoIterator<Item = E::Model>,
    ) -> Result<ReferenceWrite> {
        self.write(rows.into_iter().map(Change::Insert).collect())
            .await
    }

    /// Updates `rows` (every column, by primary key) as one version;
    /// refused (nothing written) when one's primary key is not in the table.
    pub async fn update_many(
        &self,
        rows: impl IntoIterator<Item = E::Model>,
    ) -> Result<ReferenceWrite> {
        self.write(rows.into_iter().map(Change::Update).collect())
            .await
    }

    /// Inserts or updates `rows` as one version.
    pub async fn upsert_many(
        &self,
        rows: impl IntoIterator<Item = E::Model>,
    ) -> Result<ReferenceWrite> {
        self.write(rows.into_iter().map(Change::Upsert).collect())
            .await
    }

    /// Deletes the rows with the primary keys of `rows` as one version;
    /// refused (nothing written) when one is not in the table.
    pub async fn delete_many(
        &self,
        rows: impl IntoIterator<Item = E::Model>,
    ) -> Result<ReferenceWrite> {
        self.write(
            rows.into_iter()
                .map(|r| Change::Delete(model_pk_values::<E>(&r)))
                .collect(),
        )
        .await
    }

    /// [`insert_many`](Self::insert_many) of one row.
    pub async fn insert(&self, row: E::Model) -> Result<ReferenceWrite> {
        self.insert_many([row]).await
    }

    /// [`update_many`](Self::update_many) of one row.
    pub async fn update(&self, row: E::Model) -> Result<ReferenceWrite> {
        self.update_many([row]).await
    }

    /// [`upsert_many`](Self::upsert_many) of one row.
    pub async fn upsert(&self, row: E::Model) -> Result<ReferenceWrite> {
        self.upsert_many([row]).await
    }

    /// [`delete_many`](Self::delete_many) of one row.
    pub async fn delete(&self, row: E::Model) -> Result<ReferenceWrite> {
        self.delete_many([row]).await
    }

    /// The shard the next read outside a key goes to (in turn over every
    /// shard whose breaker lets requests through).
    fn next_shard(&self) -> ShardId {
        let shards = self.refs.shards();
        let n = shards.topology().shards().len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| ShardId(((start + i) % n) as u32))
            .find(|s| shards.health(*s).down_cause().is_none())
            .unwrap_or(SOURCE)
    }

    /// Runs `select` (SeaORM's `E::find()` with filters, order, limit) on
    /// one shard's copy, never older than what this instance has read or
    /// written of the table (a copy behind is caught up first). Shards take
    /// turns; one that fails hands the read to the next.
    pub async fn read(&self, select: Select<E>) -> Result<Vec<E::Model>> {
        let shards = self.refs.shards();
        let n = shards.topology().shards().len();
        let table: &'static dyn ReferenceTable = &Typed::<E>::NEW;
        let mut last = None;
        let first = self.next_shard();
        for i in 0..n {
            let s = ShardId(((first.0 as usize + i) % n) as u32);
            let name = shards.shard_name(s);
            let conn = shards.shard_conn(s);
            let select = select.clone();
            let read = async {
                let fence: &dyn ReferenceFence = &self.refs;
                let need = fence.before(table, conn).await?;
                let rows = select
                    .all(conn)
                    .await
                    .map_err(|e| db_err(name, Self::table(), "read", e))?;
                fence.after(table, conn, need).await?;
                Ok(rows)
            };
            match shards
                .bounded(s, "reference", shards.read_settings().timeout, read)
                .await
            {
                Ok(rows) => return Ok(rows),
                Err(e) => {
                    tracing::debug!(table = Self::table(), shard = %name, error = %e.report(), "reference read failed; the next shard answers");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| ShardError::internal("a cluster without shards")))
    }

    /// Every row, from one shard's copy (see [`read`](Self::read)).
    pub async fn all(&self) -> Result<Vec<E::Model>> {
        self.read(E::find()).await
    }

    /// Which shard the next [`read`](Self::read) of `select` goes to, and
    /// its statement.
    pub fn explain(&self, select: &Select<E>) -> String {
        let shards = self.refs.shards();
        let n = shards.topology().shards().len();
        let s = ShardId((self.next.load(Ordering::Relaxed) % n) as u32);
        let conn = shards.shard_conn(s);
        format!(
            "reference `{}` on shard `{}` (any shard; at least version {} for this instance): {}",
            Self::table(),
            shards.shard_name(s),
            self.refs.seen(Self::table()),
            crate::read::escape_controls(&select.build(conn.get_database_backend()).to_string())
        )
    }

    /// The source's version of the table (the newest written).
    pub async fn version(&self) -> Result<i64> {
        crate::reference::sync::source_version(&self.refs, Self::table()).await
    }

    /// Every copy's version, read now.
    pub async fn status(&self) -> Result<ReferenceStatus> {
        let shards = self.refs.shards();
        let count = shards.topology().shards().len() as u32;
        let reads = (0..count).map(ShardId).map(|s| async move {
            let name = shards.shard_name(s);
            let read = async {
                version_of(shards.shard_conn(s), Self::table())
                    .await
                    .map_err(|e| db_err(name, crate::reference::sync::VERSIONS, "read", e))
            };
            let version = shards
                .bounded(s, "reference", shards.read_settings().timeout, read)
                .await;
            if let Ok(v) = &version {
                self.refs.copy_is(Self::table(), s, *v);
            }
            CopyStatus {
                shard: name.to_owned(),
                version: version.map_err(|e| e.report().to_string()),
                catch_up_failed: None,
            }
        });
        let copies = futures::future::join_all(reads).await;
        Ok(ReferenceStatus {
            table: Self::table(),
            source: copies.first().and_then(|c| c.version.clone().ok()),
            copies,
        })
    }

    /// Brings every copy to the source's version now (what the background
    /// task does every second), then reports every copy's version, and for
    /// a copy it could not bring up, why
    /// ([`CopyStatus::catch_up_failed`]).
    pub async fn catch_up(&self) -> Result<ReferenceStatus> {
        let shards = self.refs.shards();
        let count = shards.topology().shards().len() as u32;
        let runs = (1..count)
            .map(ShardId)
            .map(|s| async move { catch_up::<E>(&self.refs, s, self.refs.bulk_bound()).await });
        let results = futures::future::join_all(runs).await;
        let mut status = self.status().await?;
        // Copy 0 is the source's; the runs are the others', in order.
        for (copy, result) in status.copies.iter_mut().skip(1).zip(results) {
            if let Err(e) = result {
                tracing::debug!(table = Self::table(), error = %e.report(), "reference copy not caught up");
                copy.catch_up_failed = Some(e.report().to_string());
            }
        }
        Ok(status)
    }

    /// Compares every copy with the source (one snapshot of it), row by row
    /// by primary key, every value as text; with
    /// `repair`, a copy that differs gets the source's rows and version in
    /// one transaction (a copy whose version moved past the source's
    /// snapshot meanwhile is left for the next run, and says so).
    pub async fn verify(&self, repair: bool) -> Result<ReferenceReport> {
        let shards = self.refs.shards();
        let table = Self::table();
        let bulk = self.refs.bulk_bound();
        let Snapshot { version, rows } = read_source::<E>(&self.refs, None, bulk).await?;
        let source = texts::<E>(&rows);
        let count = shards.topology().shards().len() as u32;
        let mut copies = Vec::new();
        for s in (1..count).map(ShardId) {
            let name = shards.shard_name(s);
            let db = shards.shard_conn(s);
            let mut report = CopyReport {
                shard: name.to_owned(),
                version: 0,
                matches: false,
                missing: Vec::new(),
                extra: Vec::new(),
                differing: Vec::new(),
                repaired: false,
                error: None,
            };
            let read = async {
                let err = |e| db_err(name, table, "verify", e);
                let v = version_of(db, table).await.map_err(err)?;
                let rows = E::find().all(db).await.map_err(err)?;
                Ok((v, rows))
            };
            let (v, copy) = match shards.bounded(s, "reference", bulk, read).await {
                Ok(read) => read,
                Err(e) => {
                    report.error = Some(e.report().to_string());
                    copies.push(report);
                    continue;
                }
            };
            report.version = v;
            let copy = texts::<E>(&copy);
            report.matches = copy == source;
            if !report.matches {
                for (pk, values) in &source {
                    match copy.get(pk) {
                        None => report.missing.push(pk.clone()),
                        Some(other) if other != values => report.differing.push(pk.clone()),
                        Some(_) => {}
                    }
                }
                report.extra = copy
                    .keys()
                    .filter(|pk| !source.contains_key(*pk))
                    .cloned()
                    .collect();
            }
            crate::metrics::reference_drift(table, name, report.differs());
            if repair && (report.differs() || v < version) {
                if v > version {
                    report.error = Some(format!(
                        "the copy moved to version {v}, past the source's snapshot ({version}), while it was compared: run verify again"
                    ));
                } else {
                    let rows = Rows::Snapshot(&rows);
                    match apply_version::<E>(&self.refs, s, v, version, rows, bulk).await {
                        Ok(true) => report.repaired = true,
                        Ok(false) => report.error = Some(
                            "the copy's version changed while it was repaired: run verify again"
                                .to_owned(),
                        ),
                        Err(e) => report.error = Some(e.report().to_string()),
                    }
                }
            }
            copies.push(report);
        }
        Ok(ReferenceReport {
            table,
            version,
            rows: rows.len(),
            copies,
        })
    }
}
