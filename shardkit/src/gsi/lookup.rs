//! Index reads: the keys an active index lists for a value, and the read
//! planner's index step ([`GsiLookup`]).

use crate::error::Result;
use crate::exec::Shards;
use crate::gsi::write::MAX_VALUE_CHARS;
use crate::gsi::{Gsi, GsiState, IndexDef, IndexState, gsi_err, index_of};
use crate::key::value_text;
use crate::read::{IndexLookup, IndexQuery};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, Query};
use sea_orm::{ConnectionTrait, ExprTrait, Value};
use std::sync::Arc;

impl Gsi {
    /// The shard keys an active index lists for `value`, or `None` while the
    /// index is `write_only` (the caller scatters).
    pub(crate) async fn lookup_texts(
        &self,
        group: &'static str,
        index: &IndexDef,
        value: &Value,
    ) -> Result<Option<Vec<String>>> {
        if self.state_of(group, index).await? != IndexState::Active {
            return Ok(None);
        }
        let Some(text) = value_text(value) else {
            return Ok(Some(Vec::new()));
        };
        if text.chars().count() > MAX_VALUE_CHARS {
            return Ok(Some(Vec::new())); // never indexed, so no row holds it
        }
        let id = self.index_shard(group, index, &text)?;
        let (db, shard) = self.conn(id);
        let stmt = Query::select()
            .column(Alias::new("shard_key"))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(text.as_str()))
            .to_owned();
        let rows = db
            .query_all(&stmt)
            .await
            .map_err(|e| gsi_err(shard, &index.table, format!("lookup in {}", index.table), e))?;
        let mut keys = Vec::with_capacity(rows.len());
        for row in rows {
            let text: String = row.try_get("", "shard_key").map_err(|e| {
                gsi_err(shard, &index.table, format!("lookup in {}", index.table), e)
            })?;
            keys.push(text);
        }
        Ok(Some(keys))
    }
}

/// Planning's index step for reads ([`IndexLookup`]): the cluster hands it
/// to the reads it starts.
pub(crate) struct GsiLookup {
    state: Arc<GsiState>,
}

impl GsiLookup {
    pub(crate) fn new(state: Arc<GsiState>) -> Self {
        GsiLookup { state }
    }
}

impl IndexLookup for GsiLookup {
    fn table(&self, query: &IndexQuery) -> String {
        index_of(query).table
    }

    fn index_shard(&self, shards: &Shards, query: &IndexQuery, text: &str) -> Result<ShardId> {
        Gsi::new(shards, &self.state).index_shard(query.group, &index_of(query), text)
    }

    fn lookup<'a>(
        &'a self,
        shards: &'a Shards,
        query: &'a IndexQuery,
        value: &'a Value,
    ) -> futures::future::BoxFuture<'a, Result<Option<Vec<String>>>> {
        Box::pin(async move {
            Gsi::new(shards, &self.state)
                .lookup_texts(query.group, &index_of(query), value)
                .await
        })
    }
}
