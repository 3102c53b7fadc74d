//! Copying old rows into the new table in keyset chunks, resumably.

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, Retry, ShardError};
use crate::exec::keyset::{after_condition, by_pk, format_cursor, model_pk_values, parse_cursor};
use crate::job::JobControl;
use crate::phase::Phase;
use crate::rollout::state::{
    BACKFILL_DONE, STATE_TABLE, StateRow, read_state, state_db, state_err,
};
use crate::rollout::{DualCtx, RolloutBackfill, RolloutHandle, pk_names};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, QueryFilter, Value};
use std::time::Duration;

impl<Old, New> RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    /// Copies every old row to the new table (see [`backfill_with`](Self::backfill_with)).
    pub async fn backfill(&self) -> Result<RolloutBackfill> {
        self.backfill_with(500, JobControl::new()).await
    }

    /// [`backfill`](Self::backfill) once it may run, and through the errors
    /// that say to retry: in `dual_write` it first waits out the rollout's
    /// gap on the cluster's clock (as
    /// [`advance_when_ready`](Self::advance_when_ready) does) instead of
    /// returning [`ShardError::RolloutTooSoon`]; a chunk that fails with an
    /// error whose [`retry`](ShardError::retry) is not `Never` (a lost
    /// connection, a shard that stopped answering, a busy database, an
    /// aborted transaction) is run again, from the saved position, after
    /// the wait the error asks for (100 ms otherwise), at most 5 times in a
    /// row. Any other error comes back as it is.
    pub async fn backfill_when_ready(&self) -> Result<RolloutBackfill> {
        let clock = self.shards.clock();
        let mut failures = 0;
        loop {
            match self.backfill().await {
                Err(ShardError::RolloutTooSoon { wait_ms, .. }) => {
                    let until = clock.now_millis().saturating_add(wait_ms);
                    clock.sleep_until(until).await;
                }
                Err(e) if failures < 5 && e.retry() != Retry::Never => {
                    failures += 1;
                    let wait = match e.retry() {
                        Retry::After(wait) => wait,
                        _ => Duration::from_millis(100),
                    };
                    tracing::warn!(rollout = %self.name(), attempt = failures, error = %e.report(), ?wait, "rollout backfill failed; resuming after a wait");
                    tokio::time::sleep(wait).await;
                }
                done => return done,
            }
        }
    }

    /// Copies old rows to the new table, shard by shard, `chunk` rows per
    /// transaction (at most 100 on SQLite, whose transaction holds the
    /// file's write lock), in primary-key order. Each chunk's old rows are read
    /// `FOR UPDATE` (PostgreSQL, MySQL) so a dual write to them waits for the
    /// copy instead of being overwritten by it. Progress is saved after every
    /// chunk and a rerun resumes there. `control`'s progress callback is
    /// called after every chunk and every shard; once its token is
    /// cancelled the backfill stops at the next chunk boundary and returns
    /// what it did (`finished: false`), its position saved for the next
    /// call. Only in `dual_write` and `read_new`: earlier, writes after the
    /// copy would be missing; later, the old table is stale.
    ///
    /// In `dual_write` it starts only once the rollout's gap has passed since
    /// the phase changed ([`ShardError::RolloutTooSoon`] with the wait,
    /// `from == to == dual_write`): until then an instance may still act on
    /// `cache_both` and update old rows after the copy took them. It reads
    /// the shared phase before every chunk and stops
    /// ([`ShardError::Rollout`]) once the phase has changed on any instance;
    /// its progress (and `done`) is recorded only while the phase is still
    /// the one it began in, so a retreat below `dual_write` (which voids the
    /// progress) can never be followed by a record of this run's.
    pub async fn backfill_with(
        &self,
        chunk: u64,
        control: JobControl<RolloutBackfill>,
    ) -> Result<RolloutBackfill> {
        let start_state = self.state().await?;
        if !matches!(start_state.phase, Phase::DualWrite | Phase::ReadNew) {
            return Err(self.shared.refused_err(
                "backfill runs in dual_write or read_new: before, later writes would be missed; after, the old table is stale",
            ));
        }
        // Its upserts of the new table are not write transactions: a bucket
        // move would neither log nor fence them.
        let moves =
            crate::rebalance::unfinished_moves(&self.shards, <Old::Group as EntityGroup>::NAME)
                .await?;
        if moves > 0 {
            return Err(self.shared.refused_err(format!(
                "{moves} bucket move(s) of group `{}` are not finished: backfill after they end (a move would miss the backfill's writes)",
                <Old::Group as EntityGroup>::NAME
            )));
        }
        let shards = self
            .shards
            .topology()
            .scatter_shards(<Old::Group as EntityGroup>::NAME)?;
        let mut progress = RolloutBackfill {
            shards: shards.len(),
            ..Default::default()
        };
        if start_state.backfill.as_deref() == Some(BACKFILL_DONE) {
            progress.shards_done = shards.len();
            progress.finished = true;
            return Ok(progress);
        }
        // Until every instance must have seen dual_write, one may still act
        // on cache_both and write old rows only, after the copy took them.
        if start_state.phase == Phase::DualWrite {
            self.check_gap(&start_state, Phase::DualWrite)?;
        }
        let (start, mut after) = parse_cursor::<Old>(start_state.backfill.as_deref());
        progress.shards_done = start;
        let mut saved = start_state.backfill.clone();
        let chunk = std::cmp::max(chunk, 1);
        for (i, id) in shards.iter().enumerate().skip(start) {
            let db = self.shards.shard_conn(*id);
            let shard = self.shards.shard_name(*id);
            // On SQLite a chunk's transaction holds the file's write lock
            // (and the cluster's write slot): short ones, so writers of
            // every instance wait far less than the busy timeout.
            let chunk = if db.get_database_backend() == sea_orm::DbBackend::Sqlite {
                Ord::min(chunk, crate::exec::sqlite::LONG_JOB_CHUNK)
            } else {
                chunk
            };
            loop {
                if control.is_cancelled() {
                    return Ok(progress);
                }
                // The phase may have moved on any instance since the last
                // chunk: copying on after a retreat below dual_write would
                // miss the writes made meanwhile.
                self.backfill_still_valid(&start_state).await?;
                // Fault injection: the shard stops answering for this chunk
                // (when the failpoint's argument is part of its URL).
                #[cfg(feature = "failpoints")]
                if fail::eval("shardkit::rollout::backfill_chunk", |arg| {
                    arg.unwrap_or_default()
                })
                .is_some_and(|arg| {
                    self.shards
                        .topology()
                        .shard(*id)
                        .url
                        .expose()
                        .contains(arg.as_str())
                }) {
                    return Err(ShardError::Timeout {
                        group: <Old::Group as EntityGroup>::NAME,
                        shard: shard.to_owned(),
                        after: Duration::ZERO,
                    });
                }
                let copied = self
                    .backfill_chunk(*id, db, shard, after.as_deref(), chunk)
                    .await?;
                let done = (copied.len() as u64) < chunk;
                progress.rows += copied.len() as u64;
                if let Some(last) = copied.last() {
                    after = Some(model_pk_values::<Old>(last));
                }
                let cursor = if done {
                    format_cursor(i + 1, None)
                } else {
                    format_cursor(i, after.as_deref())
                };
                self.save_backfill(&start_state, saved.as_deref(), &cursor)
                    .await?;
                saved = Some(cursor);
                if done {
                    break;
                }
                control.report(&progress);
            }
            after = None;
            progress.shards_done = i + 1;
            control.report(&progress);
        }
        self.save_backfill(&start_state, saved.as_deref(), BACKFILL_DONE)
            .await?;
        progress.finished = true;
        Ok(progress)
    }

    /// The refusal of a backfill that began in `start`'s phase when the
    /// shared phase has changed since.
    pub(super) async fn backfill_overtaken(&self, start: &StateRow) -> ShardError {
        let (now, next) = match self.state().await {
            Ok(state) if state.phase < Phase::DualWrite => (
                state.phase.to_string(),
                "its progress is void (the new table missed the writes made since): advance to \
                 dual_write and back-fill from the start",
            ),
            Ok(state) => (
                state.phase.to_string(),
                "run it again in dual_write or read_new; it resumes where it stopped",
            ),
            Err(_) => (
                "an unreadable phase".to_owned(),
                "run it again in dual_write or read_new",
            ),
        };
        self.shared.refused_err(format!(
            "the phase changed from {} to {now} while the backfill ran, so it stopped; {next}",
            start.phase
        ))
    }

    /// Errors when the shared phase is no longer the one the backfill
    /// began in.
    pub(super) async fn backfill_still_valid(&self, start: &StateRow) -> Result<()> {
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let now = read_state(db, shard, &self.shared.name).await?;
        match now {
            Some(now) if now.phase == start.phase && now.changed_ms == start.changed_ms => Ok(()),
            _ => Err(self.backfill_overtaken(start).await),
        }
    }

    /// Records backfill progress `value` only if the phase is still the one
    /// the backfill began in and nothing else changed the progress since it
    /// last wrote `previous` (a compare-and-set: a retreat between the
    /// check and this write voids it).
    pub(super) async fn save_backfill(
        &self,
        start: &StateRow,
        previous: Option<&str>,
        value: &str,
    ) -> Result<()> {
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let progress = match previous {
            Some(previous) => Expr::col(Alias::new("backfill")).eq(previous),
            None => Expr::col(Alias::new("backfill")).is_null(),
        };
        let stmt = Query::update()
            .table(Alias::new(STATE_TABLE))
            .value(Alias::new("backfill"), value)
            .and_where(Expr::col(Alias::new("name")).eq(self.shared.name.as_str()))
            .and_where(Expr::col(Alias::new("phase")).eq(start.phase.as_str()))
            .and_where(Expr::col(Alias::new("changed_ms")).eq(start.changed_ms))
            .and_where(progress)
            .to_owned();
        let res = db
            .execute(&stmt)
            .await
            .map_err(|e| state_err(shard, "update", e))?;
        if res.rows_affected() == 0 {
            return Err(self.backfill_overtaken(start).await);
        }
        Ok(())
    }

    pub(super) async fn backfill_chunk(
        &self,
        id: ShardId,
        db: &DatabaseConnection,
        shard: &str,
        after: Option<&[Value]>,
        chunk: u64,
    ) -> Result<Vec<Old::Model>> {
        use sea_orm::QuerySelect;
        let err = |e| {
            self.shared
                .db_err(shard, format!("backfill {}", table_name::<New>()), e)
        };
        // Its index rows may need another SQLite file's lock: the cluster's
        // write slot first, as every SQLite write transaction that may.
        let _writer = self.shards.sqlite_write_slot(id).await.map_err(err)?;
        let txn = crate::exec::begin_pooled(db).await.map_err(err)?;
        let rows = by_pk(Old::find().filter(after_condition::<Old>(after)))
            .limit(chunk)
            .lock_exclusive()
            .all(&txn)
            .await
            .map_err(err)?;
        let ctx = DualCtx {
            shards: &self.shards,
            gsi: &self.gsi,
            txn: &txn,
            shard,
            shard_id: id,
        };
        let news = self
            .shared
            .fold_rows(&sea_orm::DatabaseExecutor::Transaction(&txn), &rows, true)
            .await
            .map_err(|e| self.shared.part_err(shard, e))?;
        for (row, new) in rows.iter().zip(news) {
            // Dropping the transaction rolls the whole chunk back.
            self.shared
                .write_new(&ctx, row, new, false)
                .await
                .map_err(|e| match e {
                    ShardError::CrossShardWrite { .. } => self.shared.refused_err(format!(
                        "backfill stopped at `{}` row {} = {} on shard {shard}: {e}; nothing of \
                         its chunk was copied. The conversion must keep the shard key; fix it \
                         and run the backfill again",
                        table_name::<Old>(),
                        pk_names::<Old>(),
                        crate::key::model_pk::<Old>(row),
                    )),
                    other => other,
                })?;
        }
        txn.commit().await.map_err(err)?;
        Ok(rows)
    }
}
