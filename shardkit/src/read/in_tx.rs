//! Reads inside a [`ShardTx`](crate::ShardTx): the transaction's key,
//! its connection.

use crate::boxed::boxed;
use crate::entity::{EntityGroup, Joinable, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::read::keys::{guard_check, join_related, keyed_select, read_err, select_err};
use crate::read::select::RowStream;
use crate::read::{AlsoRelated, KeyOf, ReadGuard, WithRelated, read_from};
use futures::StreamExt;
use futures::future::BoxFuture;
use sea_orm::sea_query::JoinType;
use sea_orm::{
    ConnectionTrait, FromQueryResult, PaginatorTrait, Related, Select, SelectGetableTuple,
    SelectModel, Selector, SelectorTrait, TryGetableMany,
};
use std::sync::OnceLock;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering as AtomicOrdering;

/// A read inside a [`ShardTx`](crate::ShardTx): already pinned to the
/// transaction's key and run on its connection.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct TxFind<'t, E: ShardedEntity, C> {
    pub(super) conn: &'t C,
    pub(super) shard: &'t str,
    pub(super) key: KeyOf<E>,
    pub(super) select: Select<E>,
    /// The transaction's open streams: while one is open it holds the
    /// transaction's connection, and anything else would wait for it.
    pub(super) streams: &'t AtomicUsize,
    /// The transaction's rollback-only state: a read the database aborted
    /// sets it ([`poison_if_aborted`]), and once the database ended the
    /// transaction, reads are refused.
    pub(super) poisoned: &'t Poison,
    /// Why this read may not run (a rollout no longer writes `E`'s table
    /// and cannot serve it from the new one).
    pub(super) refused: Option<ShardError>,
    /// What the features say of reads (for the other side of a relation).
    pub(super) guard: Option<&'t dyn ReadGuard>,
}

/// Why a transaction became rollback-only, and whether the database ended
/// it: then its reads are refused too, since they would run outside it.
#[derive(Default)]
pub(crate) struct Poison {
    /// The first reason.
    reason: OnceLock<String>,
    aborted: std::sync::atomic::AtomicBool,
}

impl Poison {
    /// Makes the transaction rollback-only with `err` as the reason (the
    /// first reason is kept), and marks it ended when `err` is one with
    /// which a database ends a transaction ([`ShardError::ended_transaction`]),
    /// whichever path made it rollback-only (a read's, a write's, a write
    /// stage's: a stage's may come from a side connection, whose deadlock
    /// left the transaction itself alive; its reads are refused too then,
    /// and a new attempt can succeed all the same).
    pub(crate) fn set(&self, err: &ShardError) {
        let _ = self.reason.set(err.to_string());
        if err.ended_transaction() {
            self.aborted.store(true, AtomicOrdering::Release);
        }
    }

    pub(crate) fn reason(&self) -> Option<&String> {
        self.reason.get()
    }

    /// Whether the database ended the transaction.
    pub(crate) fn aborted(&self) -> bool {
        self.aborted.load(AtomicOrdering::Acquire)
    }

    /// The refusal of a read after the database ended the transaction.
    fn refuse_read(&self, group: &'static str, shard: &str) -> Result<()> {
        match self.reason.get() {
            Some(reason) if self.aborted() => Err(ShardError::RollbackOnly {
                group,
                shard: shard.to_owned(),
                reason: reason.clone(),
            }),
            _ => Ok(()),
        }
    }
}

/// `err`, and when the database ended the transaction with it (a deadlock,
/// a serialization failure: [`ShardError::ended_transaction`]) the
/// transaction becomes rollback-only with it as the reason, and its later
/// reads and writes are refused: the database has rolled back everything it
/// did, and on MySQL/MariaDB later statements would run outside it. For a
/// transaction's reads and writes alike.
pub(crate) fn poison_if_aborted(poisoned: &Poison, err: ShardError) -> ShardError {
    if err.ended_transaction() {
        poisoned.set(&err);
    }
    err
}

/// The error for a use of a transaction while one of its streams is open.
pub(crate) fn stream_open(streams: &AtomicUsize, table: &'static str) -> Result<()> {
    if streams.load(AtomicOrdering::Acquire) == 0 {
        return Ok(());
    }
    Err(ShardError::Unsupported {
        table,
        operation: "a statement in a transaction",
        reason: "a stream of this transaction is still open and holds its connection: read the \
                 stream to its end or drop it first (or collect the rows with `all()`)"
            .to_owned(),
    })
}

/// A stream of a transaction's rows that counts itself open until dropped.
struct Counted<'t, S> {
    rows: S,
    streams: &'t AtomicUsize,
}

impl<S: futures::Stream + Unpin> futures::Stream for Counted<'_, S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.rows).poll_next(cx)
    }
}

impl<S> Drop for Counted<'_, S> {
    fn drop(&mut self) {
        self.streams.fetch_sub(1, AtomicOrdering::AcqRel);
    }
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    pub(crate) fn new(
        conn: &'t C,
        shard: &'t str,
        key: &KeyOf<E>,
        (streams, poisoned): (&'t AtomicUsize, &'t Poison),
        guard: Option<&'t dyn ReadGuard>,
    ) -> Self {
        Self::of(conn, shard, key, E::find(), (streams, poisoned), guard)
    }

    /// `select` scoped to `key`.
    pub(crate) fn of(
        conn: &'t C,
        shard: &'t str,
        key: &KeyOf<E>,
        select: Select<E>,
        (streams, poisoned): (&'t AtomicUsize, &'t Poison),
        guard: Option<&'t dyn ReadGuard>,
    ) -> Self {
        let mut select = keyed_select::<E>(select, key, conn.get_database_backend());
        let refused = match guard_check::<E>(guard) {
            Ok(Some(from)) => {
                read_from::<E>(&mut select, &from);
                None
            }
            Ok(None) => None,
            Err(err) => Some(err),
        };
        TxFind {
            conn,
            shard,
            key: key.clone(),
            select,
            streams,
            poisoned,
            refused,
            guard,
        }
    }

    /// Makes the read fail with `err` when it runs.
    pub(crate) fn refuse(&mut self, err: ShardError) {
        self.refused = Some(err);
    }

    fn ready(&mut self) -> Result<()> {
        if let Some(err) = self.refused.take() {
            return Err(err);
        }
        stream_open(self.streams, table_name::<E>())?;
        self.poisoned
            .refuse_read(<E::Group as EntityGroup>::NAME, self.shard)
    }

    /// What a failure of the read's statement becomes (see
    /// [`poison_if_aborted`]).
    fn fail(&self) -> impl Fn(sea_orm::DbErr) -> ShardError + Copy + Send + use<'t, E, C> {
        let (shard, poisoned) = (self.shard, self.poisoned);
        move |e| poison_if_aborted(poisoned, read_err::<E>(shard, e))
    }

    /// The statement left-joined with `R` along `E`'s relation, `R`'s side
    /// scoped to the key (and read from where the guard says), with the
    /// connection and shard to run it on.
    fn joined<R>(
        mut self,
    ) -> Result<(
        Select<E>,
        &'t C,
        impl Fn(sea_orm::DbErr) -> ShardError + Copy + Send + 't,
    )>
    where
        R: Joinable<E::Group>,
        E: Related<R>,
    {
        self.ready()?;
        let fail = self.fail();
        let r_from = guard_check::<R>(self.guard)?;
        let backend = self.conn.get_database_backend();
        let select = join_related::<E, R>(
            self.select,
            JoinType::LeftJoin,
            &self.key,
            backend,
            r_from.as_ref(),
        );
        Ok((select, self.conn, fail))
    }

    /// Each row of the transaction's key with its related rows of `R`
    /// (SeaORM's [`Select::find_with_related`]), the related side scoped to
    /// the key as in [`Find::find_with_related`](crate::read::Find::find_with_related).
    pub fn find_with_related<R>(self, _related: R) -> BoxFuture<'t, Result<WithRelated<E, R>>>
    where
        R: Joinable<E::Group>,
        E: Related<R>,
        C: Sync,
    {
        boxed(move || async move {
            let (select, conn, fail) = self.joined::<R>()?;
            select
                .select_with(R::default())
                .all(conn)
                .await
                .map_err(fail)
        })
    }

    /// Each row of the transaction's key with its related row of `R`, if
    /// any (SeaORM's [`Select::find_also_related`]), the related side scoped
    /// to the key.
    pub fn find_also_related<R>(self, _related: R) -> BoxFuture<'t, Result<AlsoRelated<E, R>>>
    where
        R: Joinable<E::Group>,
        E: Related<R>,
        C: Sync,
    {
        boxed(move || async move {
            let (select, conn, fail) = self.joined::<R>()?;
            select
                .select_also(R::default())
                .all(conn)
                .await
                .map_err(fail)
        })
    }

    /// All matching rows of the transaction's key.
    pub async fn all(mut self) -> Result<Vec<E::Model>> {
        self.ready()?;
        let fail = self.fail();
        crate::exec::statements::all_models(self.select, self.conn)
            .await
            .map_err(fail)
    }

    /// The first matching row of the transaction's key.
    pub async fn one(mut self) -> Result<Option<E::Model>> {
        self.ready()?;
        let fail = self.fail();
        crate::exec::statements::one_model(self.select, self.conn)
            .await
            .map_err(fail)
    }

    /// The matching rows of the transaction's key as a stream (SeaORM's
    /// [`Select::stream`]), read on the transaction's connection. While it
    /// is open it holds that connection: any other statement of the
    /// transaction (a read, a write, another stream) fails at once with
    /// [`ShardError::Unsupported`] instead of waiting for it for ever.
    pub async fn stream(mut self) -> Result<RowStream<'t, E::Model>>
    where
        C: sea_orm::StreamTrait + Send + Sync,
    {
        self.ready()?;
        let fail = self.fail();
        let rows = self.select.stream(self.conn).await.map_err(fail)?;
        self.streams.fetch_add(1, AtomicOrdering::AcqRel);
        Ok(Box::pin(Counted {
            rows: rows.map(move |row| row.map_err(fail)),
            streams: self.streams,
        }))
    }

    /// The number of matching rows of the transaction's key.
    pub async fn count(mut self) -> Result<u64> {
        self.ready()?;
        let fail = self.fail();
        self.select.count(self.conn).await.map_err(fail)
    }
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    /// Decodes each row into `M` (SeaORM's [`Select::into_model`]), inside
    /// the transaction and scoped to its key.
    pub fn into_model<M: FromQueryResult>(self) -> TxSelect<'t, C, SelectModel<M>> {
        self.decoded(Select::into_model::<M>)
    }

    /// Decodes each row into a tuple of its selected columns (SeaORM's
    /// [`Select::into_tuple`]).
    pub fn into_tuple<T: TryGetableMany>(self) -> TxSelect<'t, C, SelectGetableTuple<T>> {
        self.decoded(Select::into_tuple::<T>)
    }

    /// Decodes each row into a JSON object (SeaORM's [`Select::into_json`]).
    pub fn into_json(self) -> TxSelect<'t, C, SelectModel<sea_orm::JsonValue>> {
        self.decoded(Select::into_json)
    }

    /// The read with its rows decoded by `into`'s selector.
    fn decoded<S: SelectorTrait>(
        self,
        into: impl FnOnce(Select<E>) -> Selector<S>,
    ) -> TxSelect<'t, C, S> {
        let TxFind {
            conn,
            shard,
            select,
            streams,
            poisoned,
            refused,
            ..
        } = self;
        TxSelect::new::<E>(conn, shard, into(select), (streams, poisoned), refused)
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
    pub(super) streams: &'t AtomicUsize,
    pub(super) poisoned: &'t Poison,
    pub(super) refused: Option<ShardError>,
}

impl<'t, C: ConnectionTrait, S: SelectorTrait> TxSelect<'t, C, S> {
    fn new<E: ShardedEntity>(
        conn: &'t C,
        shard: &'t str,
        selector: Selector<S>,
        (streams, poisoned): (&'t AtomicUsize, &'t Poison),
        refused: Option<ShardError>,
    ) -> Self {
        TxSelect {
            conn,
            shard,
            table: table_name::<E>(),
            group: <E::Group as EntityGroup>::NAME,
            selector,
            streams,
            poisoned,
            refused,
        }
    }

    /// All matching rows of the transaction's key.
    pub async fn all(self) -> Result<Vec<S::Item>> {
        let (selector, conn, fail) = self.ready()?;
        selector.all(conn).await.map_err(fail)
    }

    /// The first matching row of the transaction's key.
    pub async fn one(self) -> Result<Option<S::Item>> {
        let (selector, conn, fail) = self.ready()?;
        selector.one(conn).await.map_err(fail)
    }

    /// The selector and connection to run it on, unless the read was
    /// refused or a stream holds the connection, with what a failure of
    /// the statement becomes.
    fn ready(
        self,
    ) -> Result<(
        Selector<S>,
        &'t C,
        impl FnOnce(sea_orm::DbErr) -> ShardError,
    )> {
        let TxSelect {
            conn,
            shard,
            table,
            group,
            selector,
            streams,
            poisoned,
            refused,
        } = self;
        if let Some(err) = refused {
            return Err(err);
        }
        stream_open(streams, table)?;
        poisoned.refuse_read(group, shard)?;
        Ok((selector, conn, move |source| {
            poison_if_aborted(poisoned, select_err(group, table, shard, source))
        }))
    }
}
