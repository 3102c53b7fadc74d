//! Consistency checks between two copies of the same rows: a rollout's old
//! table (converted) and its new table, or one entity's rows on two shards
//! (a bucket before and after a move).
//!
//! The method is Vitess VDiff's and pt-table-checksum's, by chunks of primary
//! keys: each side of a chunk is reduced to a digest — the row count and the
//! 64-bit wrapping sum of a per-row hash — and only chunks whose digests differ
//! are compared row by row. A sum, unlike an XOR of CRC32s, is not fooled by
//! two swapped values (each row's hash changes) or by a duplicated row (the
//! count changes). Where both sides are the same table on the same kind of
//! server (PostgreSQL: `hashtextextended` of the whole row; MySQL/MariaDB: the
//! first 64 bits of `MD5` of the columns), the digest is computed in the
//! database and rows travel only for chunks that differ. Otherwise (a
//! conversion runs in Rust, SQLite has no hash function, or the servers
//! differ) each side's rows are fetched and hashed here.
//!
//! A difference is reported by primary key as *missing* (in the source, not in
//! the target), *extra* (in the target only) or *different*. With
//! [`VerifyOptions::repair`] each one is fixed from the source, re-reading the
//! source row `FOR UPDATE` in the same transaction as the fix so a concurrent
//! write is not overwritten with older data.

use crate::entity::{ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::keyset::pk_condition;
use crate::exec::keyset::{
    after_condition, by_pk, format_cursor, model_pk_values, parse_cursor, upto_condition,
};
use crate::job::JobControl;
use sea_orm::sea_query::{Alias, Expr, Query};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, EntityTrait, IdenStatic,
    IntoActiveModel, Iterable, PrimaryKeyToColumn, PrimaryKeyTrait, QueryFilter, QuerySelect,
    Value, sea_query::IntoValueTuple,
};
use std::collections::HashMap;
use std::hash::Hasher;

/// How a verification runs.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    pub(crate) chunk: u64,
    pub(crate) repair: bool,
    pub(crate) resume: bool,
    pub(crate) from_new: bool,
    pub(crate) in_database: bool,
    pub(crate) max_chunks: Option<u64>,
    pub(crate) start_at: Option<String>,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            chunk: 1_000,
            repair: false,
            resume: false,
            from_new: false,
            in_database: true,
            max_chunks: None,
            start_at: None,
        }
    }
}

impl VerifyOptions {
    /// Primary keys per chunk (default 1,000).
    pub fn chunk(mut self, rows: u64) -> Self {
        self.chunk = rows.max(1);
        self
    }

    /// Fix every difference from the source of truth.
    pub fn repair(mut self) -> Self {
        self.repair = true;
        self
    }

    /// Continue where the previous run of a rollout's verifier stopped (its
    /// position is saved in `shardkit_rollouts` after every chunk).
    pub fn resume(mut self) -> Self {
        self.resume = true;
        self
    }

    /// For a rollout: take the new table as the source of truth and check
    /// (and repair) the old table against it, converted with `to_old`; what a
    /// rollback from `new_only` needs.
    pub fn from_new(mut self) -> Self {
        self.from_new = true;
        self
    }

    /// Compute digests here even where the database could (for measuring).
    pub fn digest_in_rust(mut self) -> Self {
        self.in_database = false;
        self
    }

    /// Stop after this many chunks ([`VerifyReport::cursor`] says where).
    pub fn max_chunks(mut self, chunks: u64) -> Self {
        self.max_chunks = Some(chunks);
        self
    }

    /// Start at a [`VerifyReport::cursor`] of an earlier run.
    pub fn start_at(mut self, cursor: impl Into<String>) -> Self {
        self.start_at = Some(cursor.into());
        self
    }
}

/// One row that differs, by primary key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RowDiff {
    /// The shard (of the target side) it is on.
    pub shard: String,
    /// Its primary key as text (columns joined by U+001F).
    pub pk: String,
}

/// What a verification found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Chunks compared.
    pub chunks: u64,
    /// Chunks whose digests differed.
    pub chunks_differing: u64,
    /// Source rows compared.
    pub rows: u64,
    /// Rows in the source and not in the target.
    pub missing: Vec<RowDiff>,
    /// Rows in the target and not in the source.
    pub extra: Vec<RowDiff>,
    /// Rows in both whose columns differ.
    pub different: Vec<RowDiff>,
    /// Differences fixed (with [`VerifyOptions::repair`]).
    pub repaired: u64,
    /// Whether every chunk was compared.
    pub finished: bool,
    /// Where an unfinished run stopped, for [`VerifyOptions::start_at`].
    pub cursor: Option<String>,
    /// Chunks whose digests were computed in the database.
    pub chunks_in_database: u64,
}

impl VerifyReport {
    /// Whether no difference was found.
    pub fn is_consistent(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.different.is_empty()
    }

    /// Missing, extra and different rows together.
    pub fn differences(&self) -> usize {
        self.missing.len() + self.extra.len() + self.different.len()
    }
}

/// A row's 64-bit hash: SipHash (fixed keys) of its `Debug` form, which
/// names every column and value. Both sides are hashed by the same code, so
/// the hash only has to be stable within one run.
fn row_hash<M: std::fmt::Debug>(model: &M) -> u64 {
    struct W(std::hash::DefaultHasher);
    impl std::fmt::Write for W {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.write(s.as_bytes());
            Ok(())
        }
    }
    let mut w = W(std::hash::DefaultHasher::new());
    let _ = std::fmt::write(&mut w, format_args!("{model:?}"));
    w.0.finish()
}

/// One side of a comparison: the rows of `S` on a shard, seen as `D` models.
pub(crate) struct Source<'a, S: EntityTrait, D: EntityTrait> {
    pub(crate) db: &'a DatabaseConnection,
    pub(crate) shard: &'a str,
    pub(crate) convert: Conversion<'a, S::Model, D::Model>,
    /// Whether `S` and `D` are the same table (so the database can digest both).
    pub(crate) same_table: bool,
}

/// How source rows become target models.
pub(crate) enum Conversion<'a, S, D> {
    /// Row by row.
    Row(&'a (dyn Fn(&S) -> D + Send + Sync)),
    /// A rollout's fold: a chunk of roots and their parts, read with them.
    Fold(&'a dyn FoldRows<S, D>),
}

/// A fold of source rows with what they read on the source's database
/// (see [`crate::rollout`]'s folds).
pub(crate) trait FoldRows<S, D>: Send + Sync {
    fn fold_rows<'a>(
        &'a self,
        db: &'a sea_orm::DatabaseExecutor<'a>,
        rows: &'a [S],
    ) -> futures::future::BoxFuture<'a, std::result::Result<Vec<D>, (&'static str, DbErr)>>;
}

impl<S: EntityTrait, D: EntityTrait> Source<'_, S, D> {
    /// `rows` as target models; a fold reads their parts on `db`.
    async fn convert_rows(
        &self,
        db: &sea_orm::DatabaseExecutor<'_>,
        rows: &[S::Model],
    ) -> Result<Vec<D::Model>> {
        match self.convert {
            Conversion::Row(convert) => Ok(rows.iter().map(convert).collect()),
            Conversion::Fold(fold) => fold.fold_rows(db, rows).await.map_err(|(table, e)| {
                verify_err(
                    self.shard,
                    table,
                    format!("select {table} (to fold into {})", table_name::<D>()),
                    e,
                )
            }),
        }
    }
}

/// The side being checked: entity `D` on a shard.
pub(crate) struct Target<'a> {
    pub(crate) db: &'a DatabaseConnection,
    pub(crate) shard: &'a str,
}

type RowFilter<'a, M> = Option<&'a (dyn Fn(&M) -> bool + Send + Sync)>;

/// `T`'s rows after primary key `after` up to `upto` (both open when
/// `None`), in primary-key order.
async fn rows_between<T: EntityTrait>(
    db: &DatabaseConnection,
    shard: &str,
    after: Option<&[Value]>,
    upto: Option<&[Value]>,
) -> Result<Vec<T::Model>> {
    by_pk(
        T::find()
            .filter(after_condition::<T>(after))
            .filter(upto_condition::<T>(upto)),
    )
    .all(db)
    .await
    .map_err(|e| {
        verify_err(
            shard,
            table_name::<T>(),
            format!("select {}", table_name::<T>()),
            e,
        )
    })
}

fn verify_err(shard: &str, table: &str, what: String, source: DbErr) -> ShardError {
    ShardError::db(
        crate::error::Origin::table(crate::error::Subsystem::Verify, table),
        shard.to_owned(),
        what,
        source,
    )
}

/// The in-database digest of `E`'s rows in `(after, upto]`: row count and
/// the sum of the row hashes as text. `None` on SQLite.
async fn db_digest<E: EntityTrait>(
    db: &DatabaseConnection,
    shard: &str,
    after: Option<&[Value]>,
    upto: Option<&[Value]>,
) -> Result<Option<(i64, String)>> {
    let table = table_name::<E>();
    let hash = match db.get_database_backend() {
        DbBackend::Postgres => format!("hashtextextended(\"{table}\"::text, 0)"),
        DbBackend::MySql => {
            let cols: Vec<String> = <E::Column as Iterable>::iter()
                .map(|c| {
                    let c = c.as_str();
                    format!("ISNULL(`{c}`), COALESCE(CAST(`{c}` AS CHAR), '')")
                })
                .collect();
            format!(
                "CAST(CONV(SUBSTRING(MD5(CONCAT_WS(CHAR(31), {})), 1, 16), 16, 10) AS UNSIGNED)",
                cols.join(", ")
            )
        }
        _ => return Ok(None),
    };
    let sum = match db.get_database_backend() {
        DbBackend::Postgres => format!("COALESCE(SUM({hash}), 0)::text"),
        _ => format!("CAST(COALESCE(SUM({hash}), 0) AS CHAR)"),
    };
    let stmt = Query::select()
        .expr_as(Expr::cust("COUNT(*)"), Alias::new("n"))
        .expr_as(Expr::cust(sum), Alias::new("s"))
        .from(sea_orm::EntityName::table_ref(&E::default()))
        .cond_where(after_condition::<E>(after))
        .cond_where(upto_condition::<E>(upto))
        .to_owned();
    let err = |e| verify_err(shard, table, format!("digest {table}"), e);
    let row = db.query_one(&stmt).await.map_err(err)?;
    let Some(row) = row else { return Ok(None) };
    let n: i64 = row.try_get("", "n").map_err(err)?;
    let s: String = row.try_get("", "s").map_err(err)?;
    Ok(Some((n, s)))
}

/// Compares one chunk: source rows after `after` (at most `opts.chunk`)
/// against the target's rows in the same key range. Returns where the next
/// chunk starts, or `None` after the last.
pub(crate) async fn verify_chunk<S, D>(
    source: &Source<'_, S, D>,
    target: &Target<'_>,
    filter: RowFilter<'_, D::Model>,
    after: Option<&[Value]>,
    opts: &VerifyOptions,
    report: &mut VerifyReport,
) -> Result<Option<Vec<Value>>>
where
    S: EntityTrait,
    D: EntityTrait,
    D::Model: IntoActiveModel<D::ActiveModel>,
{
    report.chunks += 1;
    let in_db = opts.in_database
        && source.same_table
        && filter.is_none()
        && source.db.get_database_backend() == target.db.get_database_backend()
        && source.db.get_database_backend() != DbBackend::Sqlite;
    let mut src_rows = None;
    let upto = if in_db {
        let pks: Vec<<S::PrimaryKey as PrimaryKeyTrait>::ValueType> = by_pk(
            S::find()
                .select_only()
                .columns(<S::PrimaryKey as Iterable>::iter().map(PrimaryKeyToColumn::into_column))
                .filter(after_condition::<S>(after)),
        )
        .limit(opts.chunk)
        .into_tuple()
        .all(source.db)
        .await
        .map_err(|e| {
            verify_err(
                source.shard,
                table_name::<S>(),
                format!("select {}", table_name::<S>()),
                e,
            )
        })?;
        let full = pks.len() as u64 == opts.chunk;
        let upto = pks
            .into_iter()
            .last()
            .filter(|_| full)
            .map(|pk| pk.into_value_tuple().into_iter().collect::<Vec<_>>());
        let a = db_digest::<S>(source.db, source.shard, after, upto.as_deref()).await?;
        let b = db_digest::<D>(target.db, target.shard, after, upto.as_deref()).await?;
        report.chunks_in_database += 1;
        if let (Some(a), Some(b)) = (&a, &b) {
            report.rows += a.0 as u64;
            if a == b {
                return Ok(upto);
            }
        }
        upto
    } else {
        let rows = by_pk(S::find().filter(after_condition::<S>(after)))
            .limit(opts.chunk)
            .all(source.db)
            .await
            .map_err(|e| {
                verify_err(
                    source.shard,
                    table_name::<S>(),
                    format!("select {}", table_name::<S>()),
                    e,
                )
            })?;
        let full = rows.len() as u64 == opts.chunk;
        let upto = rows
            .last()
            .filter(|_| full)
            .map(|r| model_pk_values::<S>(r));
        src_rows = Some(rows);
        upto
    };
    // Row level: the source chunk (converted), the target's rows in range.
    let on_source = sea_orm::DatabaseExecutor::Connection(source.db);
    let src: Vec<D::Model> = match src_rows {
        Some(rows) => source.convert_rows(&on_source, &rows).await?,
        None => {
            let rows = rows_between::<S>(source.db, source.shard, after, upto.as_deref()).await?;
            source.convert_rows(&on_source, &rows).await?
        }
    };
    let dst = rows_between::<D>(target.db, target.shard, after, upto.as_deref()).await?;
    let keep = |m: &D::Model| filter.is_none_or(|f| f(m));
    let digest = |rows: &[D::Model]| {
        rows.iter()
            .filter(|m| keep(m))
            .fold((0u64, 0u64), |(n, s), m| {
                (n + 1, s.wrapping_add(row_hash(m)))
            })
    };
    let (src_digest, dst_digest) = (digest(&src), digest(&dst));
    if !in_db {
        report.rows += src_digest.0;
    }
    if src_digest == dst_digest {
        return Ok(upto);
    }
    report.chunks_differing += 1;
    let mut theirs: HashMap<String, (Vec<Value>, u64)> = dst
        .iter()
        .filter(|m| keep(m))
        .map(|m| {
            let pk = model_pk_values::<D>(m);
            (crate::exec::keyset::tuple_text(&pk), (pk, row_hash(m)))
        })
        .collect();
    let diff = |pk: String| RowDiff {
        shard: target.shard.to_owned(),
        pk,
    };
    let mut fixes: Vec<Vec<Value>> = Vec::new();
    for m in src.iter().filter(|m| keep(m)) {
        let pk = model_pk_values::<D>(m);
        let text = crate::exec::keyset::tuple_text(&pk);
        match theirs.remove(&text) {
            None => report.missing.push(diff(text)),
            Some((_, h)) if h != row_hash(m) => report.different.push(diff(text)),
            Some(_) => continue,
        }
        fixes.push(pk);
    }
    for (text, (pk, _)) in theirs {
        report.extra.push(diff(text));
        fixes.push(pk);
    }
    if opts.repair {
        for pk in fixes {
            repair_row::<S, D>(source, target, &pk).await?;
            report.repaired += 1;
        }
    }
    Ok(upto)
}

/// Makes the target's row `pk` what the source says: the source row is read
/// `FOR UPDATE` on its shard while the fix is written, so a write to it in
/// between waits. When source and target share a database, one transaction
/// holds both.
async fn repair_row<S, D>(
    source: &Source<'_, S, D>,
    target: &Target<'_>,
    pk: &[Value],
) -> Result<()>
where
    S: EntityTrait,
    D: EntityTrait,
    D::Model: IntoActiveModel<D::ActiveModel>,
{
    let serr = |e| {
        verify_err(
            source.shard,
            table_name::<D>(),
            format!("repair {}", table_name::<D>()),
            e,
        )
    };
    let terr = |e| {
        verify_err(
            target.shard,
            table_name::<D>(),
            format!("repair {}", table_name::<D>()),
            e,
        )
    };
    let src_txn = crate::exec::begin_pooled(source.db).await.map_err(serr)?;
    let row = S::find()
        .filter(pk_condition::<S>(pk))
        .lock_exclusive()
        .one(&src_txn)
        .await
        .map_err(serr)?;
    let shared = std::ptr::eq(source.db, target.db);
    let dst_txn = if shared {
        None
    } else {
        Some(crate::exec::begin_pooled(target.db).await.map_err(terr)?)
    };
    {
        let conn: &sea_orm::DatabaseTransaction = dst_txn.as_ref().unwrap_or(&src_txn);
        match row {
            Some(row) => {
                let on_source = sea_orm::DatabaseExecutor::Transaction(&src_txn);
                let mut converted = source
                    .convert_rows(&on_source, std::slice::from_ref(&row))
                    .await?;
                let row = converted.pop().expect("one row, one model");
                crate::exec::keyset::upsert::<D, _>(conn, row)
                    .await
                    .map_err(terr)?
            }
            None => {
                D::delete_many()
                    .filter(pk_condition::<D>(pk))
                    .exec(conn)
                    .await
                    .map_err(terr)?;
            }
        }
    }
    if let Some(txn) = dst_txn {
        txn.commit().await.map_err(terr)?;
    }
    src_txn.commit().await.map_err(serr)
}

/// Refuses a bucket `group` does not have (`entry` names where it was
/// given): checking its rows would compare none and report no difference.
/// A hash placement's buckets are `0..buckets`; a `movable` range group's
/// are its ranges' ids; other placements have none.
///
/// [`Cluster::verify_shards`](crate::Cluster::verify_shards) checks its
/// bucket so itself (as `verify_shards(bucket)`), after the shard names;
/// call this first to refuse a bucket someone typed under the name they
/// typed it as (the operator's `--bucket`), before anything is read.
/// The error is a [`ShardError::Config`] at `entry`.
pub fn check_bucket(
    topology: &crate::topology::Topology,
    group: &str,
    bucket: u32,
    entry: &str,
) -> Result<()> {
    use crate::topology::Placement;
    let message = match topology.placement(group)? {
        Placement::Hash { buckets, .. } if bucket < *buckets => return Ok(()),
        Placement::Hash { buckets, .. } => format!(
            "bucket {bucket} is out of range: group {group} has buckets 0..={} ({buckets} buckets)",
            buckets - 1
        ),
        Placement::Range { ranges } if ranges.is_movable() => {
            let units = ranges.units();
            if units.iter().any(|u| u.id == bucket) {
                return Ok(());
            }
            let ids: Vec<String> = units.iter().map(|u| u.id.to_string()).collect();
            format!(
                "bucket {bucket} is not a range of group {group}: its ranges are {}",
                ids.join(", ")
            )
        }
        _ => format!(
            "group {group} has no buckets (only hash placements and movable range groups do)"
        ),
    };
    Err(ShardError::config(entry, message))
}

/// See [`Cluster::verify_shards`](crate::Cluster::verify_shards).
pub(crate) async fn verify_shards<E: ShardedEntity>(
    shards: &crate::exec::Shards,
    source: &str,
    target: &str,
    bucket: Option<u32>,
    opts: VerifyOptions,
    control: JobControl<VerifyReport>,
) -> Result<VerifyReport> {
    let shard = |name: &str| {
        shards.topology().shard_id(name).ok_or_else(|| {
            ShardError::config(format!("verify_shards({name:?})"), "no shard has this name")
        })
    };
    let (a, b) = (shard(source)?, shard(target)?);
    let group = <E::Group as crate::EntityGroup>::NAME;
    if let Some(bucket) = bucket {
        check_bucket(shards.topology(), group, bucket, "verify_shards(bucket)")?;
    }
    let in_bucket = move |m: &E::Model| {
        let key = E::shard_key(m);
        matches!(shards.topology().locate(group, &key), Ok(crate::topology::Located::Target(t)) if t.bucket == bucket)
    };
    let filter: RowFilter<'_, E::Model> = match bucket {
        Some(_) => Some(&in_bucket),
        None => None,
    };
    let identity = |m: &E::Model| m.clone();
    let src = Source::<E, E> {
        db: shards.shard_conn(a),
        shard: shards.shard_name(a),
        convert: Conversion::Row(&identity),
        same_table: true,
    };
    let dst = Target {
        db: shards.shard_conn(b),
        shard: shards.shard_name(b),
    };
    let mut report = VerifyReport::default();
    let (_, mut after) = parse_cursor::<E>(opts.start_at.as_deref());
    loop {
        if opts.max_chunks.is_some_and(|m| report.chunks >= m) || control.is_cancelled() {
            report.cursor = Some(format_cursor(0, after.as_deref()));
            return Ok(report);
        }
        after = verify_chunk(&src, &dst, filter, after.as_deref(), &opts, &mut report).await?;
        control.report(&report);
        if after.is_none() {
            break;
        }
    }
    report.finished = true;
    Ok(report)
}
