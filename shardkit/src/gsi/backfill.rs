//! Filling an index from the primary tables in keyset chunks, resumably.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity};
use crate::error::Result;
use crate::exec::keyset;
use crate::gsi::{BACKFILL_CURSOR, BackfillProgress, Gsi, IndexDef, IndexState, gsi_err};
use crate::job::JobControl;
use crate::key::{model_pk, value_text};
use sea_orm::ModelTrait;

impl Gsi {
    /// Fills `E`'s index on `column` from the primary tables, shard by shard in
    /// chunks, then marks it `active`. Resumable: progress is saved in the
    /// catalog after every chunk and a rerun continues from it (index writes
    /// are idempotent, so a repeated chunk is harmless).
    pub async fn backfill<E: ShardedEntity>(&self, column: E::Column) -> Result<BackfillProgress> {
        self.backfill_with::<E>(column, 500, JobControl::new())
            .await
    }

    /// [`backfill`](Self::backfill) with a chunk size and a [`JobControl`]:
    /// its progress callback is called after every chunk and every shard, and
    /// once its token is cancelled the backfill stops at the next chunk
    /// boundary and returns what it did (`finished: false`), the index still
    /// `write_only` and its position saved; the next call resumes there.
    pub async fn backfill_with<E: ShardedEntity>(
        &self,
        column: E::Column,
        chunk: u64,
        control: JobControl<BackfillProgress>,
    ) -> Result<BackfillProgress> {
        let index = IndexDef::find::<E>(column)?;
        let shards = self.owner_shards(<E::Group as EntityGroup>::NAME)?;
        let chunk = Ord::max(chunk, 1);
        // Progress: "pk/<shard index>:<last primary key done on it>", a
        // keyset position (see `crate::exec::keyset`). An older "<shard>:<offset>"
        // restarts that shard from its start (index writes are idempotent).
        let (start_shard, mut after) = match self.progress::<E>(&index).await? {
            Some(p) => match p.strip_prefix(BACKFILL_CURSOR) {
                Some(cursor) => keyset::parse_cursor::<E>(Some(cursor)),
                None => (
                    p.split_once(':')
                        .and_then(|(a, _)| a.parse::<usize>().ok())
                        .unwrap_or(0),
                    None,
                ),
            },
            None => (0, None),
        };
        let mut progress = BackfillProgress {
            shards: shards.len(),
            shards_done: start_shard,
            ..Default::default()
        };
        for (i, id) in shards.iter().enumerate().skip(start_shard) {
            let (db, shard) = self.conn(*id);
            if i != start_shard {
                after = None;
            }
            loop {
                if control.is_cancelled() {
                    return Ok(progress);
                }
                let rows = keyset::chunk::<E>(after.as_deref(), chunk)
                    .all(db)
                    .await
                    .map_err(|e| {
                        gsi_err(shard, &index.table, format!("backfill {}", index.table), e)
                    })?;
                let read = rows.len() as u64;
                for row in &rows {
                    let value = row.get(column);
                    let key = E::shard_key(row).to_directory_text();
                    let owner = model_pk::<E>(row);
                    self.write_entry::<E>(&index, &value, &key, &owner).await?;
                    progress.written += u64::from(value_text(&value).is_some());
                }
                progress.rows += read;
                if let Some(last) = rows.last() {
                    after = Some(keyset::model_pk_values::<E>(last));
                }
                let cursor = keyset::format_cursor(i, after.as_deref());
                self.set_state::<E>(
                    &index,
                    IndexState::WriteOnly,
                    Some(format!("{BACKFILL_CURSOR}{cursor}")),
                )
                .await?;
                control.report(&progress);
                if read < chunk {
                    break;
                }
            }
            progress.shards_done = i + 1;
            control.report(&progress);
        }
        self.set_state::<E>(&index, IndexState::Active, None)
            .await?;
        progress.finished = true;
        Ok(progress)
    }
}
