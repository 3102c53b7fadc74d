//! The lookup tables of directory-placed groups ([`Directory`]).

use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::exec::shards::Shards;
use crate::topology::Target;
use sea_orm::sea_query::{Alias, Expr, OnConflict, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, ExprTrait};
use std::marker::PhantomData;

impl Shards {
    /// The lookup table of a directory-placed group.
    pub(crate) fn directory<G: EntityGroup>(&self) -> Result<Directory<G>> {
        match self.inner.topology.placement(G::NAME)? {
            crate::topology::Placement::Directory { directory } => {
                Ok(self.directory_index(*directory))
            }
            _ => Err(ShardError::config(
                format!("groups.{}", G::NAME),
                "this group is not placed by directory (placement = \"directory\")",
            )),
        }
    }

    pub(super) fn directory_index<G: EntityGroup>(&self, index: usize) -> Directory<G> {
        Directory {
            shards: self.clone(),
            index,
            _group: PhantomData,
        }
    }
}

/// The `key → shard` lookup table of a directory-placed group (see
/// `placement = "directory"`). The table is created by the `shardkit-migration`
/// crate's migrations.
pub struct Directory<G: EntityGroup> {
    shards: Shards,
    index: usize,
    _group: PhantomData<fn() -> G>,
}

impl<G: EntityGroup> Clone for Directory<G> {
    fn clone(&self) -> Self {
        Directory {
            shards: self.shards.clone(),
            index: self.index,
            _group: PhantomData,
        }
    }
}

impl<G: EntityGroup> std::fmt::Debug for Directory<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("group", &G::NAME)
            .finish_non_exhaustive()
    }
}

impl<G: EntityGroup> Directory<G> {
    fn conn(&self) -> &DatabaseConnection {
        &self.shards.inner.directories[self.index]
    }

    fn table(&self) -> Alias {
        Alias::new(
            self.shards.inner.topology.directories()[self.index]
                .table
                .as_str(),
        )
    }

    fn db_err(&self, operation: &str, source: sea_orm::DbErr) -> ShardError {
        ShardError::db(
            crate::error::Origin::Group(G::NAME),
            format!("directory:{}", G::NAME),
            operation,
            source,
        )
    }

    /// Places `key` on `shard` (insert or overwrite).
    pub async fn assign(&self, key: &G::Key, shard: &str) -> Result<()> {
        if self.shards.inner.topology.shard_id(shard).is_none() {
            return Err(ShardError::config(
                format!("directory:{}", G::NAME),
                format!("cannot assign a key to shard `{shard}`: no such shard"),
            ));
        }
        let stmt = Query::insert()
            .into_table(self.table())
            .columns([
                Alias::new("group_name"),
                Alias::new("shard_key"),
                Alias::new("shard"),
            ])
            .values_panic([G::NAME.into(), key.to_directory_text().into(), shard.into()])
            .on_conflict(
                OnConflict::columns([Alias::new("group_name"), Alias::new("shard_key")])
                    .update_column(Alias::new("shard"))
                    .to_owned(),
            )
            .to_owned();
        self.conn()
            .execute(&stmt)
            .await
            .map_err(|e| self.db_err("assign directory entry", e))?;
        Ok(())
    }

    /// The shard `key` is assigned to, if any.
    pub async fn lookup(&self, key: &G::Key) -> Result<Option<String>> {
        let stmt = Query::select()
            .column(Alias::new("shard"))
            .from(self.table())
            .and_where(Expr::col(Alias::new("group_name")).eq(G::NAME))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key.to_directory_text()))
            .to_owned();
        let row = self
            .conn()
            .query_one(&stmt)
            .await
            .map_err(|e| self.db_err("directory lookup", e))?;
        row.map(|row| row.try_get::<String>("", "shard"))
            .transpose()
            .map_err(|e| self.db_err("directory lookup", e))
    }

    /// Removes `key`'s entry; returns whether there was one.
    pub async fn remove(&self, key: &G::Key) -> Result<bool> {
        let stmt = Query::delete()
            .from_table(self.table())
            .and_where(Expr::col(Alias::new("group_name")).eq(G::NAME))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key.to_directory_text()))
            .to_owned();
        let res = self
            .conn()
            .execute(&stmt)
            .await
            .map_err(|e| self.db_err("directory remove", e))?;
        Ok(res.rows_affected() > 0)
    }

    pub(super) async fn lookup_target(&self, key: &G::Key) -> Result<Target> {
        let shard = self
            .lookup(key)
            .await?
            .ok_or_else(|| ShardError::Unroutable {
                group: G::NAME,
                key: format!("{key:?}"),
                reason: "the key has no entry in the directory; assign it with \
                     `cluster.directory::<G>()?.assign(&key, shard)`"
                    .to_owned(),
            })?;
        let id =
            self.shards
                .inner
                .topology
                .shard_id(&shard)
                .ok_or_else(|| ShardError::Unroutable {
                    group: G::NAME,
                    key: format!("{key:?}"),
                    reason: format!(
                        "the directory names shard `{shard}`, which is not in the config"
                    ),
                })?;
        Ok(Target {
            shard: id,
            bucket: None,
        })
    }
}
