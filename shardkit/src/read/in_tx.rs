//! Reads inside a [`ShardTx`](crate::ShardTx): the transaction's key,
//! its connection.

use super::*;

/// A read inside a [`ShardTx`](crate::ShardTx): already pinned to the
/// transaction's key and run on its connection.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct TxFind<'t, E: ShardedEntity, C> {
    pub(super) conn: &'t C,
    pub(super) shard: &'t str,
    pub(super) key: KeyOf<E>,
    pub(super) select: Select<E>,
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    pub(crate) fn new(conn: &'t C, shard: &'t str, key: &KeyOf<E>) -> Self {
        Self::of(conn, shard, key, E::find())
    }

    /// `select` scoped to `key`.
    pub(crate) fn of(conn: &'t C, shard: &'t str, key: &KeyOf<E>, select: Select<E>) -> Self {
        TxFind {
            conn,
            shard,
            key: key.clone(),
            select: keyed_select::<E>(select, key, conn.get_database_backend()),
        }
    }

    /// Each row of the transaction's key with its related rows of `R`
    /// (SeaORM's [`Select::find_with_related`]), the related side scoped to
    /// the key as in [`Find::find_with_related`].
    pub async fn find_with_related<R>(self, _related: R) -> Result<Vec<(E::Model, Vec<R::Model>)>>
    where
        R: ShardedEntity<Group = E::Group>,
        E: Related<R>,
    {
        let backend = self.conn.get_database_backend();
        join_related::<E, R>(self.select, JoinType::LeftJoin, &self.key, backend)
            .select_with(R::default())
            .all(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// Each row of the transaction's key with its related row of `R`, if
    /// any (SeaORM's [`Select::find_also_related`]), the related side scoped
    /// to the key.
    pub async fn find_also_related<R>(
        self,
        _related: R,
    ) -> Result<Vec<(E::Model, Option<R::Model>)>>
    where
        R: ShardedEntity<Group = E::Group>,
        E: Related<R>,
    {
        let backend = self.conn.get_database_backend();
        join_related::<E, R>(self.select, JoinType::LeftJoin, &self.key, backend)
            .select_also(R::default())
            .all(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// All matching rows of the transaction's key.
    pub async fn all(self) -> Result<Vec<E::Model>> {
        self.select
            .all(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// The first matching row of the transaction's key.
    pub async fn one(self) -> Result<Option<E::Model>> {
        self.select
            .one(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// The matching rows of the transaction's key as a stream (SeaORM's
    /// [`Select::stream`]), read on the transaction's connection.
    pub async fn stream(self) -> Result<RowStream<'t, E::Model>>
    where
        C: sea_orm::StreamTrait + Send + Sync,
    {
        let shard = self.shard;
        let rows = self
            .select
            .stream(self.conn)
            .await
            .map_err(|e| read_err::<E>(shard, e))?;
        Ok(Box::pin(
            rows.map(move |row| row.map_err(|e| read_err::<E>(shard, e))),
        ))
    }

    /// The number of matching rows of the transaction's key.
    pub async fn count(self) -> Result<u64>
    where
        E::Model: Sync,
    {
        self.select
            .count(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    /// Decodes each row into `M` (SeaORM's [`Select::into_model`]), inside
    /// the transaction and scoped to its key.
    pub fn into_model<M: FromQueryResult>(self) -> TxSelect<'t, C, SelectModel<M>> {
        let TxFind {
            conn,
            shard,
            select,
            ..
        } = self;
        TxSelect::new::<E>(conn, shard, select.into_model::<M>())
    }

    /// Decodes each row into a tuple of its selected columns (SeaORM's
    /// [`Select::into_tuple`]).
    pub fn into_tuple<T: TryGetableMany>(self) -> TxSelect<'t, C, SelectGetableTuple<T>> {
        let TxFind {
            conn,
            shard,
            select,
            ..
        } = self;
        TxSelect::new::<E>(conn, shard, select.into_tuple::<T>())
    }

    /// Decodes each row into a JSON object (SeaORM's [`Select::into_json`]).
    pub fn into_json(self) -> TxSelect<'t, C, SelectModel<sea_orm::JsonValue>> {
        let TxFind {
            conn,
            shard,
            select,
            ..
        } = self;
        TxSelect::new::<E>(conn, shard, select.into_json())
    }
}

/// A read inside a transaction decoded into another shape
/// ([`TxFind::into_model`], [`TxFind::into_tuple`], [`TxFind::into_json`]).
#[must_use = "a read does nothing until `.all()` or `.one()` runs it"]
pub struct TxSelect<'t, C, S: SelectorTrait> {
    pub(super) conn: &'t C,
    pub(super) shard: &'t str,
    pub(super) table: &'static str,
    pub(super) group: &'static str,
    pub(super) selector: Selector<S>,
}

impl<'t, C: ConnectionTrait, S: SelectorTrait> TxSelect<'t, C, S> {
    fn new<E: ShardedEntity>(conn: &'t C, shard: &'t str, selector: Selector<S>) -> Self {
        TxSelect {
            conn,
            shard,
            table: table_name::<E>(),
            group: <E::Group as EntityGroup>::NAME,
            selector,
        }
    }

    /// All matching rows of the transaction's key.
    pub async fn all(self) -> Result<Vec<S::Item>> {
        let TxSelect {
            conn,
            shard,
            table,
            group,
            selector,
        } = self;
        selector
            .all(conn)
            .await
            .map_err(|source| select_err(group, table, shard, source))
    }

    /// The first matching row of the transaction's key.
    pub async fn one(self) -> Result<Option<S::Item>> {
        let TxSelect {
            conn,
            shard,
            table,
            group,
            selector,
        } = self;
        selector
            .one(conn)
            .await
            .map_err(|source| select_err(group, table, shard, source))
    }
}
