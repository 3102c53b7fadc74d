//! A mover's hold on a move: taking it (a new generation, installed on
//! every shard the move writes), renewing it while the mover works, saving
//! steps only while it holds, letting go.

use crate::error::Result;
use crate::rebalance::db_err;
use crate::rebalance::fencing::Token;
use crate::rebalance::map::control;
use crate::rebalance::mover::{LEASE_MS, MOVES, MovePhase, MoveProgress, MoveStatus, Rebalance};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{Condition, ConnectionTrait};
use std::time::Duration;

impl<G> Rebalance<G> {
    pub(super) async fn save(
        &self,
        token: &Token,
        status: &MoveStatus,
        cursor: Option<&str>,
        extra: impl FnOnce(&mut sea_orm::sea_query::UpdateStatement),
    ) -> Result<()> {
        let (db, name) = self.control_db()?;
        let mut stmt = Query::update();
        stmt.table(Alias::new(MOVES))
            .value(Alias::new("phase"), status.phase.as_str())
            .value(Alias::new("cursor"), cursor.map(str::to_owned))
            .value(Alias::new("rows_copied"), status.rows_copied as i64)
            .value(Alias::new("changes_applied"), status.changes_applied as i64)
            .value(Alias::new("updated_ms"), self.shards.now_ms())
            .value(Alias::new("error"), status.error.clone())
            .value(Alias::new("lease_ms"), self.shards.now_ms() + LEASE_MS)
            .and_where(Expr::col(Alias::new("id")).eq(status.id))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
            .and_where(Expr::col(Alias::new("generation")).eq(token.generation()));
        extra(&mut stmt);
        let saved = db
            .execute(&stmt)
            .await
            .map_err(|e| db_err(name, MOVES, "update", e))?
            .rows_affected();
        if saved != 1 {
            return Err(self.refuse(
                Some(status.id),
                "another process took the move over (this mover was silent past its hold); this mover stops",
            ));
        }
        Ok(())
    }

    /// The entities' tables as the move stores them: their names, without
    /// a schema (as every build has stored them, so that a move registered
    /// by one build runs in another).
    pub(super) fn tables(&self) -> String {
        self.entities
            .iter()
            .filter(|e| !e.implicit())
            .map(|e| e.table().name)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Takes move `id` for this mover: refused while another runner's hold
    /// lasts. Raises the move's generation and installs it on every shard
    /// the move touches before anything is written there, so a mover that
    /// held the move before is refused from then on. Returns `None` when the
    /// move is finished.
    pub(super) async fn acquire(&self, id: i64) -> Result<Option<Token>> {
        let (db, name) = self.control_db()?;
        let now = self.shards.now_ms();
        let stmt = Query::update()
            .table(Alias::new(MOVES))
            .value(Alias::new("runner"), self.token.as_str())
            .value(Alias::new("lease_ms"), now + LEASE_MS)
            .value(
                Alias::new("generation"),
                Expr::col(Alias::new("generation")).add(1),
            )
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .and_where(
                Expr::col(Alias::new("phase"))
                    .is_not_in([MovePhase::Done.as_str(), MovePhase::Aborted.as_str()]),
            )
            .cond_where(
                Condition::any()
                    .add(Expr::col(Alias::new("runner")).is_null())
                    .add(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
                    .add(Expr::col(Alias::new("lease_ms")).lt(now)),
            )
            .to_owned();
        let took = db
            .execute(&stmt)
            .await
            .map_err(|e| db_err(name, MOVES, "take", e))?
            .rows_affected();
        if took != 1 {
            let (status, _) = self.read(id).await?;
            if status.phase.is_finished() {
                return Ok(None);
            }
            return Err(self.refuse(
                Some(id),
                format!(
                    "another process is running the move (it is {}); it stops with Ctrl-C, or its hold lapses {} s after its last step if it died",
                    status.phase,
                    LEASE_MS / 1000
                ),
            ));
        }
        match self.fence_shards(id).await {
            Ok(token) => Ok(Some(token)),
            Err(e) => {
                self.let_go(id, None).await;
                Err(e)
            }
        }
    }

    /// Installs the generation this mover took move `id` at on every shard
    /// the move writes.
    pub(super) async fn fence_shards(&self, id: i64) -> Result<Token> {
        let (status, _) = self.read(id).await?;
        let target = self.shard_id(&status.target)?;
        let token = Token::new(
            &self.shards,
            self.group,
            id,
            status.generation,
            target,
            Duration::from_millis(LEASE_MS as u64),
        );
        // Every shard the move writes: the sources, the target, and the
        // control database (its claims).
        let mut shards: Vec<ShardId> = self.sources(&status)?.into_iter().map(|(s, _)| s).collect();
        shards.push(target);
        shards.push(control(&self.shards, self.group)?);
        shards.sort();
        shards.dedup();
        // A paused mover's open transaction ends by the server's idle
        // timeout, which is the hold's length.
        let wait = Duration::from_millis(LEASE_MS as u64) + Duration::from_secs(5);
        for shard in shards {
            let (db, name) = self.conn(shard);
            self.timed(name, token.install((db, name), wait)).await?;
        }
        tracing::debug!(
            group = self.group,
            id,
            generation = token.generation(),
            "move taken"
        );
        Ok(token)
    }

    /// Runs `work` while renewing this mover's hold every third of the
    /// hold's length; stops it when the hold was lost (another process took
    /// the move over).
    pub(super) async fn holding<T>(
        &self,
        token: &Token,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let beat = async {
            loop {
                tokio::time::sleep(Duration::from_millis(LEASE_MS as u64 / 3)).await;
                if token.parked() {
                    // A paused process renews nothing.
                    continue;
                }
                match self.renew(token).await {
                    Ok(true) => {}
                    Ok(false) => {
                        return self.refuse(
                            Some(token.id()),
                            "another process took the move over (this mover was silent past its hold); this mover stops",
                        );
                    }
                    Err(e) => {
                        tracing::warn!(group = self.group, id = token.id(), error = %e.report(), "could not renew the hold on the move; trying again");
                    }
                }
            }
        };
        tokio::pin!(work);
        tokio::select! {
            biased;
            done = &mut work => done,
            lost = beat => Err(lost),
        }
    }

    /// Renews this mover's hold; `false` when another process holds the
    /// move now.
    pub(super) async fn renew(&self, token: &Token) -> Result<bool> {
        let (db, name) = self.control_db()?;
        let stmt = Query::update()
            .table(Alias::new(MOVES))
            .value(Alias::new("lease_ms"), self.shards.now_ms() + LEASE_MS)
            .and_where(Expr::col(Alias::new("id")).eq(token.id()))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
            .and_where(Expr::col(Alias::new("generation")).eq(token.generation()))
            .to_owned();
        let renewed = db
            .execute(&stmt)
            .await
            .map_err(|e| db_err(name, MOVES, "renew", e))?
            .rows_affected();
        Ok(renewed == 1)
    }

    /// Lets go of move `id` (held at `generation`, when known).
    pub(super) async fn let_go(&self, id: i64, generation: Option<i64>) {
        let Ok((db, _)) = self.control_db() else {
            return;
        };
        let mut stmt = Query::update();
        stmt.table(Alias::new(MOVES))
            .value(Alias::new("runner"), Option::<String>::None)
            .value(Alias::new("lease_ms"), Option::<i64>::None)
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()));
        if let Some(g) = generation {
            stmt.and_where(Expr::col(Alias::new("generation")).eq(g));
        }
        if let Err(e) = db.execute(&stmt).await {
            tracing::warn!(group = self.group, id, error = %e, "could not let go of the move (its hold lapses by itself)");
        }
    }

    pub(super) async fn set_phase(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        phase: MovePhase,
    ) -> Result<()> {
        status.phase = phase;
        self.save(token, status, None, |_| {}).await?;
        crate::metrics::move_phase(
            self.group,
            MovePhase::ALL.iter().position(|p| *p == phase).unwrap_or(0) as u8,
        );
        tracing::info!(group = self.group, id = status.id, phase = %phase, "move phase");
        self.control.report(&MoveProgress {
            id: status.id,
            phase,
            rows_copied: status.rows_copied,
            rows_per_sec: 0.0,
            rows_estimated: status.rows_copied,
            pending_changes: status.pending_changes,
            eta: None,
        });
        Ok(())
    }
}
