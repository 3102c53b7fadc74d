//! The index catalog: creating index tables and reading and setting an
//! index's state (`write_only` → `active`).

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::gsi::{
    CATALOG_TABLE, Gsi, IndexDef, IndexState, STATE_TTL, convert_to_collation, gsi_err,
    mysql_exact_collation,
};
use sea_orm::sea_query::{Alias, Expr, OnConflict, Query};
use sea_orm::{ConnectionTrait, DbBackend, ExprTrait};
use std::time::Instant;

impl Gsi {
    /// Creates the index tables of `E` on every shard of its group and
    /// registers them in the catalog as `write_only` (unless already there).
    pub async fn create<E: ShardedEntity>(&self) -> Result<()> {
        for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
            let (db, shard) = self.conn(id);
            let collation = match db.get_database_backend() {
                DbBackend::MySql => Some(mysql_exact_collation(db, shard).await?),
                _ => None,
            };
            for (column, unique) in E::GLOBAL_INDEXES {
                let index = IndexDef::of::<E>(*column, *unique);
                db.execute(&shardkit_migration::gsi_table_collated(
                    &index.table,
                    index.unique,
                    collation,
                ))
                .await
                .map_err(|e| gsi_err(shard, &index.table, format!("create {}", index.table), e))?;
                if let Some(collation) = collation {
                    convert_to_collation(db, shard, &index.table, collation).await?;
                }
                let insert = Query::insert()
                    .into_table(Alias::new("shardkit_gsi_catalog"))
                    .columns(
                        [
                            "name",
                            "primary_table",
                            "gsi_table",
                            "secondary_column",
                            "shard_key_column",
                            "is_unique",
                            "state",
                        ]
                        .map(Alias::new),
                    )
                    .values_panic([
                        index.table.clone().into(),
                        table_name::<E>().into(),
                        index.table.clone().into(),
                        index.column.into(),
                        E::SHARD_KEY_FIELD.into(),
                        index.unique.into(),
                        IndexState::WriteOnly.as_str().into(),
                    ])
                    .on_conflict(
                        OnConflict::column(Alias::new("name"))
                            .update_column(Alias::new("primary_table"))
                            .to_owned(),
                    )
                    .to_owned();
                db.execute(&insert).await.map_err(|e| {
                    gsi_err(shard, &index.table, format!("register {}", index.table), e)
                })?;
            }
        }
        Ok(())
    }

    /// The state of `E`'s index on `column`.
    pub async fn state<E: ShardedEntity>(&self, column: E::Column) -> Result<IndexState> {
        let index = IndexDef::find::<E>(column)?;
        self.state_of(<E::Group as EntityGroup>::NAME, &index).await
    }

    pub(crate) async fn state_of(
        &self,
        group: &'static str,
        index: &IndexDef,
    ) -> Result<IndexState> {
        if let Some((state, at)) = self
            .state
            .states
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index.table)
            && at.elapsed() < STATE_TTL
        {
            return Ok(*state);
        }
        let state = match self.catalog(group, index, "state").await? {
            Some(Some(s)) if s == "active" => IndexState::Active,
            Some(_) => IndexState::WriteOnly,
            None => {
                return Err(ShardError::config(
                    index.table.clone(),
                    "the index is not in the catalog: run `cluster.gsi().create::<E>()` (and backfill)",
                ));
            }
        };
        self.state
            .states
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(index.table.clone(), (state, Instant::now()));
        Ok(state)
    }

    pub(super) async fn set_state<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        state: IndexState,
        progress: Option<String>,
    ) -> Result<()> {
        for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
            let (db, shard) = self.conn(id);
            let stmt = Query::update()
                .table(Alias::new("shardkit_gsi_catalog"))
                .value(Alias::new("state"), state.as_str())
                .value(Alias::new("progress"), progress.clone())
                .and_where(Expr::col(Alias::new("name")).eq(index.table.as_str()))
                .to_owned();
            db.execute(&stmt)
                .await
                .map_err(|e| gsi_err(shard, CATALOG_TABLE, "update gsi catalog".into(), e))?;
        }
        self.state
            .states
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&index.table);
        Ok(())
    }

    pub(super) async fn progress<E: ShardedEntity>(
        &self,
        index: &IndexDef,
    ) -> Result<Option<String>> {
        Ok(self
            .catalog(<E::Group as EntityGroup>::NAME, index, "progress")
            .await?
            .flatten())
    }

    /// One column of an index's catalog row: `None` when the index is not
    /// registered, `Some(None)` when the column is NULL.
    pub(super) async fn catalog(
        &self,
        group: &'static str,
        index: &IndexDef,
        column: &str,
    ) -> Result<Option<Option<String>>> {
        let id = self.group_shards(group)?[0];
        let (db, shard) = self.conn(id);
        let stmt = Query::select()
            .column(Alias::new(column))
            .from(Alias::new("shardkit_gsi_catalog"))
            .and_where(Expr::col(Alias::new("name")).eq(index.table.as_str()))
            .to_owned();
        let row = db
            .query_one(&stmt)
            .await
            .map_err(|e| gsi_err(shard, CATALOG_TABLE, "read gsi catalog".into(), e))?;
        row.map(|r| r.try_get::<Option<String>>("", column))
            .transpose()
            .map_err(|e| gsi_err(shard, CATALOG_TABLE, "read gsi catalog".into(), e))
    }
}
