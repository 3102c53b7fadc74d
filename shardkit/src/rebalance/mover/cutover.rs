//! The cut-over (fence the sources, replay the last keys, flip the map),
//! cleaning the sources, and aborting a move before its cut-over.

use crate::error::Result;
use crate::rebalance::db_err;
use crate::rebalance::fencing::Token;
use crate::rebalance::map::{BucketState, CHANGES, set_states};
use crate::rebalance::mover::{
    CATCH_UP, CLAIMS, MOVES, MovePhase, MoveProgress, MoveStatus, Rebalance, copy_cursor,
    parse_copy_cursor,
};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection};

impl<G> Rebalance<G> {
    pub(super) async fn cut_over(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        target: ShardId,
        settings: &crate::exec::RebalanceSettings,
    ) -> Result<()> {
        let id = status.id;
        self.failpoint("cutting_over", id, target)?;
        // A migration that reached some shards and not others is waited
        // for here, before any write waits behind the fence.
        self.schemas_agree(token, status, target).await?;
        // A shard that takes buckets holds every reference table its rows
        // join first (the ones this instance registered).
        self.references.catch_up_all(target).await?;
        let sources = self.sources(status)?;
        // Catch up first, so what is replayed behind the fence (while the
        // moving buckets' writes wait) is only what came in since.
        for _ in 0..10 {
            let n = self.replay(token, status, Some(CATCH_UP)).await?;
            if n < 100 {
                break;
            }
        }
        // Fence every source. Each update waits for the transactions that
        // read the bucket's state before it; one that waits too long gives
        // up, the writes it held back go on, and the mover catches up and
        // tries again.
        let mut attempt = 0;
        for (src, buckets) in &sources {
            let (db, name) = self.conn(*src);
            loop {
                match set_states(
                    Some(token),
                    (db, name),
                    self.group,
                    buckets,
                    &[BucketState::Moving, BucketState::Moved],
                    BucketState::Moved,
                    Some(id),
                    Some(settings.cutover_wait),
                )
                .await
                {
                    Ok(n) if n == buckets.len() as u64 => break,
                    Ok(n) => {
                        return Err(self.refuse(
                            Some(id),
                            format!(
                                "only {n} of the {} buckets moving away from `{name}` were in this move's hands there: was the move aborted meanwhile?",
                                buckets.len()
                            ),
                        ));
                    }
                    // A lock wait that ran out (PostgreSQL's lock_timeout,
                    // MySQL's lock wait timeout, SQLite's busy timeout).
                    Err(e) if attempt < 20 && e.kind() == crate::ErrorKind::Database => {
                        attempt += 1;
                        tracing::debug!(group = self.group, id, attempt, error = %e.report(), "fence waited too long; catching up and trying again");
                        // Bounded: the writers go on meanwhile, so the log
                        // never empties under a steady load.
                        self.replay(token, status, Some(CATCH_UP)).await?;
                    }
                    Err(e) => {
                        // Writes of the buckets fenced so far go on until
                        // the move is run again.
                        self.unfence(token, id, &sources).await;
                        return Err(e);
                    }
                }
            }
        }
        self.failpoint("fenced", id, target)?;
        // No write of the moving buckets can commit on a source now.
        self.replay(token, status, None).await?;
        // A migration that landed between the check above and the fence:
        // the writes it let through are replayed, but a column the target
        // lacks (or the entity does not copy) would lose their values.
        if let Err(e) = self.schemas_agree_now(token, status, target).await {
            self.unfence(token, id, &sources).await;
            return Err(e);
        }
        let (db, name) = self.conn(target);
        let all: Vec<u32> = status.buckets.iter().map(|(b, _)| *b).collect();
        // `moved`: the target gave these buckets away in an earlier move.
        let owned = set_states(
            Some(token),
            (db, name),
            self.group,
            &all,
            &[BucketState::None, BucketState::Owned, BucketState::Moved],
            BucketState::Owned,
            None,
            None,
        )
        .await?;
        if owned != all.len() as u64 {
            return Err(self.refuse(
                Some(id),
                format!(
                    "shard `{name}` has state rows for {owned} of the {} moving buckets: connect an instance with this configuration (it seeds them) and run the move again",
                    all.len()
                ),
            ));
        }
        // Flip the map and end the phase in one transaction.
        let (cdb, cname) = self.control_db()?;
        let err = |e| db_err(cname, crate::rebalance::map::MAP, "cut over", e);
        let txn = crate::exec::begin_pooled(cdb).await.map_err(err)?;
        for chunk in all.chunks(500) {
            let stmt = Query::update()
                .table(Alias::new(crate::rebalance::map::MAP))
                .value(Alias::new("shard"), status.target.clone())
                .and_where(Expr::col(Alias::new("grp")).eq(self.group))
                .and_where(Expr::col(Alias::new("bucket")).is_in(chunk.iter().map(|b| *b as i32)))
                .to_owned();
            txn.execute(&stmt).await.map_err(err)?;
        }
        let bump = Query::update()
            .table(Alias::new(crate::rebalance::map::EPOCHS))
            .value(Alias::new("epoch"), Expr::col(Alias::new("epoch")).add(1))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .to_owned();
        txn.execute(&bump).await.map_err(err)?;
        let now = self.shards.now_ms();
        let phase = Query::update()
            .table(Alias::new(MOVES))
            .value(Alias::new("phase"), MovePhase::Cleaning.as_str())
            .value(Alias::new("cutover_ms"), now)
            .value(Alias::new("changes_applied"), status.changes_applied as i64)
            .value(Alias::new("updated_ms"), now)
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .and_where(Expr::col(Alias::new("phase")).eq(MovePhase::CuttingOver.as_str()))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
            .and_where(Expr::col(Alias::new("generation")).eq(token.generation()))
            .to_owned();
        if txn.execute(&phase).await.map_err(err)?.rows_affected() != 1 {
            // Rolled back with the map unchanged.
            return Err(self.refuse(
                Some(id),
                "the move is no longer this mover's to cut over (aborted, or taken over after a lapsed hold)",
            ));
        }
        txn.commit().await.map_err(err)?;
        status.phase = MovePhase::Cleaning;
        status.cutover_ms = Some(now);
        crate::metrics::move_pending(self.group, 0);
        self.control.report(&MoveProgress {
            id,
            phase: MovePhase::Cleaning,
            rows_copied: status.rows_copied,
            rows_per_sec: 0.0,
            rows_estimated: status.rows_copied,
            pending_changes: 0,
            eta: None,
        });
        let epoch = crate::rebalance::map::refresh(&self.shards, self.group).await?;
        tracing::info!(group = self.group, id, epoch, "move cut over");
        Ok(())
    }

    /// Gives the fenced sources' buckets back to their writers (`moving`):
    /// a cut-over that stopped before flipping the map.
    async fn unfence(&self, token: &Token, id: i64, sources: &[(ShardId, Vec<u32>)]) {
        for (src, buckets) in sources {
            if let Err(e) = set_states(
                Some(token),
                self.conn(*src),
                self.group,
                buckets,
                &[BucketState::Moved],
                BucketState::Moving,
                Some(id),
                None,
            )
            .await
            {
                // The buckets stay fenced until the move runs again (its
                // cut-over fences and flips them) or is aborted.
                tracing::error!(group = self.group, id, shard = %self.shards.shard_name(*src), error = %e.report(), "moving buckets left fenced: run or abort the move");
            }
        }
    }

    pub(super) async fn clean(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        cursor: Option<String>,
    ) -> Result<()> {
        let chunk = self.shards.rebalance_settings().chunk();
        let sources = self.sources(status)?;
        let (mut si, mut ei, mut after) = parse_copy_cursor(cursor.as_deref());
        let target = self.shard_id(&status.target)?;
        while si < sources.len() {
            let (src, buckets) = &sources[si];
            let only_here = self.moving(buckets).await?;
            // A table the source shares with the target holds the moved rows
            // themselves (see `tables_apart`): left as it is.
            let shared = self
                .shared_tables(Some(status.id), *src, target)
                .await?
                .map(|(_, tables)| tables)
                .unwrap_or_default();
            while ei < self.entities.len() {
                // Children first (the entities in reverse order).
                let entity = &self.entities[self.entities.len() - 1 - ei];
                if shared.contains(entity.table()) {
                    tracing::warn!(group = self.group, id = status.id, table = %entity.table(), "the moved rows' table is one table on the source and the target: nothing to clean");
                    after = None;
                    ei += 1;
                    continue;
                }
                loop {
                    let done = self
                        .timed(
                            self.shards.shard_name(*src),
                            entity.delete_chunk(
                                token,
                                self.conn(*src),
                                after.as_deref(),
                                chunk,
                                &only_here,
                            ),
                        )
                        .await?;
                    after = done.next;
                    let c = copy_cursor(si, ei, after.as_deref());
                    self.save(token, status, Some(&c), |_| {}).await?;
                    if after.is_none() {
                        break;
                    }
                }
                ei += 1;
            }
            // The log is empty since the cut-over; drop what an abort or
            // crash left.
            let (db, name) = self.conn(*src);
            self.drop_log(token, (db, name), "clean").await?;
            // The source neither owns nor fences these buckets any more in
            // its own name: `none` refuses their writes all the same, and a
            // later move may bring them back.
            set_states(
                Some(token),
                (db, name),
                self.group,
                buckets,
                &[BucketState::Moved],
                BucketState::None,
                None,
                None,
            )
            .await?;
            si += 1;
            ei = 0;
        }
        self.release_buckets(token, status.id).await
    }

    /// Drops the move's change log on one source, under the fence.
    pub(super) async fn drop_log(
        &self,
        token: &Token,
        (db, name): (&DatabaseConnection, &str),
        what: &str,
    ) -> Result<()> {
        let err = |e| db_err(name, CHANGES, what, e);
        let delete = Query::delete()
            .from_table(Alias::new(CHANGES))
            .and_where(Expr::col(Alias::new("move_id")).eq(token.id()))
            .to_owned();
        let txn = token.begin((db, name), "log").await?;
        txn.execute(&delete).await.map_err(err)?;
        txn.commit().await.map_err(err)
    }

    pub(super) async fn release_buckets(&self, token: &Token, id: i64) -> Result<()> {
        let (db, name) = self.control_db()?;
        let err = |e| db_err(name, CLAIMS, "release", e);
        let stmt = Query::delete()
            .from_table(Alias::new(CLAIMS))
            .and_where(Expr::col(Alias::new("move_id")).eq(id))
            .to_owned();
        let txn = token.begin((db, name), "release").await?;
        txn.execute(&stmt).await.map_err(err)?;
        txn.commit().await.map_err(err)
    }

    /// Aborts move `id` before its cut-over: the sources own the buckets
    /// again (their writes stop being logged), the target's copies are
    /// deleted and the buckets are released. Refused from `cleaning` on
    /// (the target owns the buckets: move them back instead). Stop the
    /// move's mover first.
    pub async fn abort(&self, id: i64) -> Result<MoveStatus> {
        self.map()?;
        let Some(token) = self.acquire(id).await? else {
            let (status, _) = self.read(id).await?;
            return match status.phase {
                MovePhase::Aborted => self.status(id).await,
                _ => Err(self.refuse(
                    Some(id),
                    format!("the move is {}: the target owns the buckets; move them back with a new move", status.phase),
                )),
            };
        };
        let result = self.holding(&token, self.abort_held(&token, id)).await;
        self.let_go(id, Some(token.generation())).await;
        result
    }

    pub(super) async fn abort_held(&self, token: &Token, id: i64) -> Result<MoveStatus> {
        let (mut status, _) = self.read(id).await?;
        match status.phase {
            MovePhase::Aborted => return self.status(id).await,
            MovePhase::Cleaning | MovePhase::Done => {
                return Err(self.refuse(
                    Some(id),
                    format!("the move is {}: the target owns the buckets; move them back with a new move", status.phase),
                ));
            }
            _ => {}
        }
        let target = self.shard_id(&status.target)?;
        let all: Vec<u32> = status.buckets.iter().map(|(b, _)| *b).collect();
        {
            let (db, name) = self.conn(target);
            set_states(
                Some(token),
                (db, name),
                self.group,
                &all,
                &[BucketState::Owned],
                BucketState::None,
                None,
                None,
            )
            .await?;
        }
        for (src, buckets) in self.sources(&status)? {
            let (db, name) = self.conn(src);
            set_states(
                Some(token),
                (db, name),
                self.group,
                &buckets,
                &[BucketState::Moving, BucketState::Moved],
                BucketState::Owned,
                None,
                None,
            )
            .await?;
            self.drop_log(token, (db, name), "abort").await?;
        }
        let moving = self.moving(&all).await?;
        let chunk = self.shards.rebalance_settings().chunk();
        // A table the target shares with a source holds the source's rows
        // themselves (see `tables_apart`): left as it is.
        let mut shared = Vec::new();
        for (src, _) in self.sources(&status)? {
            if let Some((_, tables)) = self.shared_tables(Some(id), src, target).await? {
                shared.extend(tables);
            }
        }
        // Children first: a row's foreign keys point at entities listed
        // before it.
        for entity in self.entities.iter().rev() {
            if shared.contains(entity.table()) {
                tracing::warn!(group = self.group, id, table = %entity.table(), "the moving rows' table is one table on the source and the target: nothing to remove from the target");
                continue;
            }
            let mut after: Option<String> = None;
            loop {
                let done = self
                    .timed(
                        self.shards.shard_name(target),
                        entity.delete_chunk(
                            token,
                            self.conn(target),
                            after.as_deref(),
                            chunk,
                            &moving,
                        ),
                    )
                    .await?;
                after = done.next;
                if after.is_none() {
                    break;
                }
            }
        }
        self.release_buckets(token, id).await?;
        self.set_phase(token, &mut status, MovePhase::Aborted)
            .await?;
        tracing::info!(group = self.group, id, "move aborted");
        self.status(id).await
    }
}
