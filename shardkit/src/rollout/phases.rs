//! Moving a rollout between phases, one step at a time, after the gap.

use crate::entity::ShardedEntity;
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::phase::Phase;
use crate::rollout::state::{
    BACKFILL_DONE, STATE_TABLE, StateRow, read_instances, read_state, state_db, state_err,
};
use crate::rollout::{RolloutHandle, RolloutStatus, Shared};
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

impl<Old, New> RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    pub(crate) fn shared(&self) -> &Shared<Old, New> {
        &self.shared
    }

    /// Runs `pass` every `interval` on this rollout (see [`crate::exec::periodic`])
    /// until the cluster is dropped or `pass` breaks. Between passes the task
    /// holds neither the rollout nor the cluster.
    pub(crate) fn spawn_every<F, Fut>(
        &self,
        interval: Duration,
        first: crate::exec::periodic::FirstPass,
        mut pass: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: FnMut(RolloutHandle<Old, New>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ControlFlow<()>> + Send + 'static,
    {
        let shared = Arc::downgrade(&self.shared);
        let gsi = Arc::clone(&self.gsi);
        let moves = Arc::clone(&self.moves);
        crate::exec::periodic::spawn(&self.shards, interval, first, move |shards| {
            let run = shared.upgrade().map(|shared| {
                pass(RolloutHandle {
                    shared,
                    shards,
                    gsi: Arc::clone(&gsi),
                    moves: Arc::clone(&moves),
                })
            });
            async move {
                match run {
                    Some(run) => run.await,
                    None => ControlFlow::Break(()),
                }
            }
        })
    }

    pub(crate) fn shards(&self) -> &Shards {
        &self.shards
    }

    /// The rollout's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The phase this instance acts on (re-read every `refresh_interval`).
    pub fn phase(&self) -> Phase {
        self.shared.phase()
    }

    /// The least time between two phase changes this instance asks for
    /// (cache TTL + refresh interval); the stored gap is the longest of all
    /// instances'.
    pub fn gap(&self) -> Duration {
        self.shared.gap
    }

    /// The shared state and every instance that registered the rollout
    /// (name, cache TTL, refresh interval, when it last re-read the phase):
    /// an instance whose `seen_ms` stopped moving has stopped, or lost the
    /// state database.
    pub async fn status(&self) -> Result<RolloutStatus> {
        let state = self.state().await?;
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let instances = read_instances(db, shard, &self.shared.name, &self.shared.instance).await?;
        Ok(RolloutStatus {
            name: self.shared.name.clone(),
            phase: state.phase,
            changed_ms: state.changed_ms,
            gap: Duration::from_millis(u64::try_from(state.gap_ms).unwrap_or(0)),
            backfilled: state.backfill.as_deref() == Some(BACKFILL_DONE),
            instances,
        })
    }

    /// Re-reads the shared phase now.
    pub async fn refresh(&self) -> Result<Phase> {
        Ok(self.state().await?.phase)
    }

    pub(super) async fn state(&self) -> Result<StateRow> {
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let epoch = self.shared.phase_epoch();
        let state = read_state(db, shard, &self.shared.name)
            .await?
            .ok_or_else(|| {
                self.shared
                    .refused_err(format!("its row in {STATE_TABLE} is gone"))
            })?;
        self.shared.set_read_phase(state.phase, epoch);
        Ok(state)
    }

    /// Moves to the next phase, for every instance. Refused
    /// ([`ShardError::RolloutTooSoon`]) until the gap has passed since the
    /// previous change; refused ([`ShardError::Rollout`]) into `read_new`
    /// without a new → old conversion or before a finished
    /// [`backfill`](Self::backfill), and when another instance changed the
    /// phase in between.
    pub async fn advance(&self) -> Result<Phase> {
        self.step(true).await
    }

    /// [`advance`](Self::advance) once the gap allows: waits out
    /// [`ShardError::RolloutTooSoon`] on the cluster's clock and tries again,
    /// so operators need no retry loop. Other refusals (no backfill yet, no
    /// `to_old`) are returned as they are, and so is a move of the phase by
    /// another instance while this one waited: it advances one step from the
    /// phase it started in, never further.
    pub async fn advance_when_ready(&self) -> Result<Phase> {
        self.advance_when_ready_with(|_, _| {}).await
    }

    /// [`advance_when_ready`](Self::advance_when_ready), calling
    /// `waiting(next_phase, time_left)` before each wait (for a progress
    /// line).
    pub async fn advance_when_ready_with(
        &self,
        mut waiting: impl FnMut(Phase, Duration),
    ) -> Result<Phase> {
        // The phase this call advances from: if another instance moves it
        // while this one waits, the decision is the operator's again.
        let from = self.state().await?.phase;
        loop {
            match self.step_from(true, Some(from)).await {
                Err(ShardError::RolloutTooSoon { to, wait_ms, .. }) => {
                    // The deadline first: whatever moves the clock once
                    // `waiting` has been told counts towards it.
                    let clock = self.shards.clock();
                    let until = clock.now_millis().saturating_add(wait_ms);
                    waiting(to, Duration::from_millis(wait_ms));
                    clock.sleep_until(until).await;
                }
                done => return done,
            }
        }
    }

    /// Moves back one phase, at once (no gap: rolling back is what one does
    /// when something is wrong). Going back below `dual_write` forgets the
    /// backfill, since the new table stops being written. Going back from
    /// `new_only` leaves the old table without the writes made in
    /// `new_only`: repair it first with
    /// [`verify`](Self::verify) and [`VerifyOptions::from_new`](crate::verify::VerifyOptions::from_new).
    ///
    /// It goes back from the phase this instance acts on
    /// ([`phase`](Self::phase)) when it is called, and only from there:
    /// refused ([`ShardError::Rollout`]) when the shared phase is no longer
    /// that one (another instance, or another call on this one, moved it
    /// meanwhile), the same refusal an [`advance`](Self::advance) racing
    /// another gets. So two retreats at once go back one phase, not two;
    /// the refused caller refreshes and decides again.
    pub fn retreat(&self) -> impl std::future::Future<Output = Result<Phase>> + Send + '_ {
        // Taken when called, not when first polled: a call racing this one
        // cannot move it first.
        let from = self.shared.phase();
        self.step_from(false, Some(from))
    }

    /// Refuses ([`ShardError::RolloutTooSoon`]) what needs every instance
    /// to act on `state`'s phase (a move to `to`, or a backfill when `to` is
    /// the phase itself) until the gap has passed since the phase changed.
    pub(super) fn check_gap(&self, state: &StateRow, to: Phase) -> Result<()> {
        let elapsed = std::cmp::max(self.shards.now_ms() - state.changed_ms, 0);
        if elapsed < state.gap_ms {
            return Err(ShardError::RolloutTooSoon {
                rollout: self.shared.name.clone(),
                from: state.phase,
                to,
                elapsed_ms: elapsed as u64,
                gap_ms: state.gap_ms as u64,
                wait_ms: (state.gap_ms - elapsed) as u64,
            });
        }
        Ok(())
    }

    pub(super) async fn step(&self, forward: bool) -> Result<Phase> {
        self.step_from(forward, None).await
    }

    /// [`step`](Self::step), refused when the shared phase is no longer
    /// `expected`.
    async fn step_from(&self, forward: bool, expected: Option<Phase>) -> Result<Phase> {
        let state = self.state().await?;
        let from = state.phase;
        if let Some(expected) = expected
            && expected != from
        {
            return Err(self.shared.refused_err(format!(
                "another instance moved the phase from {expected} to {from} meanwhile; refresh \
                 and decide again"
            )));
        }
        let to = if forward {
            from.next()
        } else {
            from.previous()
        }
        .ok_or_else(|| {
            self.shared.refused_err(format!(
                "there is no phase {} {from}",
                if forward { "after" } else { "before" }
            ))
        })?;
        if forward {
            if to >= Phase::ReadNew && self.shared.to_old.is_none() {
                return Err(self.shared.refused_err(format!(
                    "{to} serves old-model reads from the new table: register a new → old conversion (Rollout::to_old)"
                )));
            }
            if to >= Phase::ReadNew && self.shared.folds() && self.shared.to_old_parts.is_none() {
                return Err(self.shared.refused_err(format!(
                    "{to} reads the folded parts from the new table (get_parts) and, from new_only \
                     on, applies part writes to it: register the split (Rollout::to_old_parts)"
                )));
            }
            if to == Phase::ReadNew && state.backfill.as_deref() != Some(BACKFILL_DONE) {
                return Err(self.shared.refused_err(
                    "the new table is not backfilled: run backfill() while dual writing, then advance",
                ));
            }
            self.check_gap(&state, to)?;
        }
        let mut stmt = Query::update();
        stmt.table(Alias::new(STATE_TABLE))
            .value(Alias::new("phase"), to.as_str())
            .value(Alias::new("changed_ms"), self.shards.now_ms())
            .and_where(Expr::col(Alias::new("name")).eq(self.shared.name.as_str()))
            .and_where(Expr::col(Alias::new("phase")).eq(from.as_str()))
            .and_where(Expr::col(Alias::new("changed_ms")).eq(state.changed_ms));
        if to < Phase::DualWrite {
            stmt.value(Alias::new("backfill"), Option::<String>::None);
        }
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let res = db
            .execute(&stmt)
            .await
            .map_err(|e| state_err(shard, "update", e))?;
        if res.rows_affected() == 0 {
            return Err(self.shared.refused_err(
                "another instance changed the phase first; refresh and decide again",
            ));
        }
        tracing::info!(rollout = %self.shared.name, %from, %to, "rollout phase changed");
        self.shared.set_local_phase(to);
        Ok(to)
    }
}
