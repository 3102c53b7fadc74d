//! A rollout's verifier: the old table, converted (folded), compared with
//! the new one on every shard, chunk by chunk, with its position saved in
//! the rollout's state row; the comparison itself is `crate::verify`'s.

use crate::entity::ShardedEntity;
use crate::error::Result;
use crate::exec::keyset::{format_cursor, parse_cursor};
use crate::job::JobControl;
use crate::rollout::RolloutHandle;
use crate::rollout::state::{read_state, save_progress, state_db};
use crate::verify::{Conversion, Source, Target, VerifyOptions, VerifyReport, verify_chunk};
use std::time::Duration;

impl<Old, New> RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    /// Compares the old table, converted, with the new table on every shard
    /// of the group (or, with [`VerifyOptions::from_new`], the new table
    /// converted back with the old), chunk by chunk, and reports every row
    /// that differs. With [`VerifyOptions::repair`] it fixes them from the
    /// source. Its position is saved in `shardkit_rollouts` after each chunk;
    /// [`VerifyOptions::resume`] continues from there.
    pub async fn verify(&self, opts: VerifyOptions) -> Result<VerifyReport> {
        self.verify_with(opts, JobControl::new()).await
    }

    /// [`verify`](Self::verify) with a [`JobControl`], as
    /// [`backfill_with`](Self::backfill_with) takes one: its progress callback
    /// is called with the report so far after every chunk, and once its
    /// token is cancelled the verifier stops at the next chunk boundary and
    /// returns the report so far (`finished: false`), its position saved (for
    /// [`VerifyOptions::resume`]) and in [`VerifyReport::cursor`].
    pub async fn verify_with(
        &self,
        opts: VerifyOptions,
        control: JobControl<VerifyReport>,
    ) -> Result<VerifyReport> {
        let shared = self.shared();
        let (state_conn, state_shard) = state_db::<Old>(self.shards())?;
        let saved = if opts.resume {
            read_state(state_conn, state_shard, self.name())
                .await?
                .and_then(|s| s.verify)
        } else {
            opts.start_at.clone()
        };
        let shards = self
            .shards()
            .topology()
            .scatter_shards(<Old::Group as crate::EntityGroup>::NAME)?;
        let mut report = VerifyReport::default();
        let (start, mut after) = if opts.from_new {
            parse_cursor::<New>(saved.as_deref())
        } else {
            parse_cursor::<Old>(saved.as_deref())
        };
        let to_old = shared.to_old_fn();
        if opts.from_new && to_old.is_none() {
            return Err(shared.refused_err("verifying from the new table needs Rollout::to_old"));
        }
        if opts.from_new && shared.folds() {
            // Only the root would be compared and repaired: the parts
            // written since new_only would stay missing from their tables.
            return Err(shared.refused_err(
                "verifying (and repairing) the old tables from a folded new table is not                  supported: it would compare the root table only, and the part tables would                  miss what was written since new_only. To go back from new_only, repair the                  old tables from get_old / get_parts before retreating",
            ));
        }
        for (i, id) in shards.iter().enumerate().skip(start) {
            let db = self.shards().shard_conn(*id);
            let shard = self.shards().shard_name(*id);
            let target = Target { db, shard };
            loop {
                if opts.max_chunks.is_some_and(|m| report.chunks >= m) || control.is_cancelled() {
                    let cursor = format_cursor(i, after.as_deref());
                    save_progress(
                        state_conn,
                        state_shard,
                        self.name(),
                        "verify",
                        Some(cursor.clone()),
                    )
                    .await?;
                    report.cursor = Some(cursor);
                    return Ok(report);
                }
                let next = if let Some(to_old) = to_old.filter(|_| opts.from_new) {
                    let source = Source::<New, Old> {
                        db,
                        shard,
                        convert: Conversion::Row(to_old),
                        same_table: false,
                    };
                    verify_chunk(&source, &target, None, after.as_deref(), &opts, &mut report)
                        .await?
                } else {
                    let source = Source::<Old, New> {
                        db,
                        shard,
                        convert: Conversion::Fold(shared),
                        same_table: false,
                    };
                    verify_chunk(&source, &target, None, after.as_deref(), &opts, &mut report)
                        .await?
                };
                after = next;
                let cursor = match &after {
                    Some(pk) => format_cursor(i, Some(pk)),
                    None => format_cursor(i + 1, None),
                };
                save_progress(state_conn, state_shard, self.name(), "verify", Some(cursor)).await?;
                control.report(&report);
                if after.is_none() {
                    break;
                }
            }
        }
        save_progress(state_conn, state_shard, self.name(), "verify", None).await?;
        report.finished = true;
        Ok(report)
    }

    /// Runs [`verify`](Self::verify) every `interval` (the first pass at
    /// once) until the handle is aborted or the cluster is dropped (the task
    /// does not keep the cluster alive; PayPal's consistency daemon); each
    /// pass's counts are logged, differences at `warn`.
    pub fn verify_every(
        &self,
        interval: Duration,
        opts: VerifyOptions,
    ) -> tokio::task::JoinHandle<()> {
        self.spawn_every(
            interval,
            crate::exec::periodic::FirstPass::Now,
            move |this| {
                let opts = opts.clone();
                async move {
                    match this.verify(opts).await {
                        Ok(r) if r.is_consistent() => {
                            tracing::info!(rollout = %this.name(), rows = r.rows, chunks = r.chunks, "rollout verify: consistent")
                        }
                        Ok(r) => tracing::warn!(
                            rollout = %this.name(),
                            missing = r.missing.len(),
                            extra = r.extra.len(),
                            different = r.different.len(),
                            repaired = r.repaired,
                            "rollout verify: differences"
                        ),
                        Err(err) => {
                            tracing::warn!(rollout = %this.name(), error = %err.report(), "rollout verify failed")
                        }
                    }
                    std::ops::ControlFlow::Continue(())
                }
            },
        )
    }
}
