//! What a [`Find`] turns into: projections of a multi-shard read
//! ([`MultiSelect`]), a keyed read's SeaORM selects ([`KeyedSelect`]) and
//! pages ([`KeyedPages`]), and the streams they return ([`RowStream`]).

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::read::KeyOf;
use crate::read::find::Find;
use crate::read::plan::ReadOp;
use crate::read::route::{AllowPartial, ByIndex, Keyed, Keys, Routed, Scatter};
use sea_orm::{
    FromQueryResult, IdenStatic, QuerySelect, Select, SelectGetableTuple, SelectModel, Selector,
    SelectorTrait, TryGetableMany,
};

/// A keyed read's pages, stream and projections: SeaORM's own shapes,
/// on the key's shard.
impl<E: ShardedEntity> Find<E, Keyed<KeyOf<E>>> {
    /// Pages of `page_size` rows (at least 1), like SeaORM's
    /// [`PaginatorTrait::paginate`](sea_orm::PaginatorTrait::paginate): each page is a keyed read on the key's
    /// shard (`LIMIT`/`OFFSET` after this read's ordering), so order the read
    /// for pages to be stable.
    pub fn paginate(self, page_size: u64) -> KeyedPages<E> {
        KeyedPages {
            find: self,
            page_size: Ord::max(page_size, 1),
        }
    }

    /// The rows of the key as a stream, like SeaORM's [`Select::stream`]:
    /// rows are decoded as the shard sends them, so a large key's rows need
    /// not fit in memory. The statement has started (and its first row
    /// arrived, or its error) when this returns; each later row is awaited
    /// under the read's timeout and the shard's breaker. The stream holds one
    /// of the shard's pooled connections until it ends or is dropped.
    pub async fn stream(self) -> Result<RowStream<'static, E::Model>> {
        self.into_stream(|s| s.into_model::<E::Model>()).await
    }

    /// Decodes each row into `M` instead of `E::Model`, as SeaORM's
    /// [`Select::into_model`] does: for `select_only().column(..)` reads and
    /// partial models. The read stays on the key's shard, scoped to the key.
    pub fn into_model<M: FromQueryResult>(self) -> KeyedSelect<E, SelectModel<M>> {
        KeyedSelect {
            find: self,
            into: |select| select.into_model::<M>(),
        }
    }

    /// Decodes each row into a tuple of its selected columns, as SeaORM's
    /// [`Select::into_tuple`] does (`select_only().column(a).column(b)` →
    /// `(A, B)`).
    pub fn into_tuple<T: TryGetableMany>(self) -> KeyedSelect<E, SelectGetableTuple<T>> {
        KeyedSelect {
            find: self,
            into: |select| select.into_tuple::<T>(),
        }
    }

    /// Decodes each row into a JSON object, as SeaORM's [`Select::into_json`].
    pub fn into_json(self) -> KeyedSelect<E, SelectModel<sea_orm::JsonValue>> {
        KeyedSelect {
            find: self,
            into: |select| select.into_json(),
        }
    }

    async fn into_stream<S>(
        self,
        into: fn(Select<E>) -> Selector<S>,
    ) -> Result<RowStream<'static, S::Item>>
    where
        S: SelectorTrait + Send + 'static,
        S::Item: Send + 'static,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::All).await?;
        read.stream(plan, into).await
    }
}

/// The rows of a streamed read ([`Find::stream`], [`KeyedSelect::stream`],
/// [`TxFind::stream`](crate::read::TxFind::stream)): SeaORM's `PinBoxStream` with shardkit's errors.
pub type RowStream<'a, T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T>> + Send + 'a>>;

/// The routes that read several shards: [`Keys`], [`Scatter`], [`ByIndex`]
/// and their [`AllowPartial`] forms.
pub trait MultiShard: sealed_multi::Sealed {}
impl<K> MultiShard for Keys<K> {}
impl MultiShard for Scatter {}
impl MultiShard for ByIndex {}
impl<R: MultiShard> MultiShard for AllowPartial<R> {}

mod sealed_multi {
    pub trait Sealed {}
    impl<K> Sealed for crate::read::Keys<K> {}
    impl Sealed for crate::read::Scatter {}
    impl Sealed for crate::read::ByIndex {}
    impl<R: Sealed> Sealed for crate::read::AllowPartial<R> {}
}

/// Projections of a multi-shard read. Rows of several shards are one
/// result when nothing orders them: they come shard by shard, and `limit`
/// and `offset` apply to the whole (each shard returns at most `limit +
/// offset`). `order_by` needs the order columns of whole rows to merge, so
/// an ordered projection is refused before any I/O with
/// [`ShardError::Unmergeable`]; read whole rows with `all()` instead.
impl<E: ShardedEntity, R: MultiShard + Routed<E>> Find<E, R> {
    /// Selects no column yet (SeaORM's `QuerySelect::select_only`); add
    /// them with [`column`](Self::column).
    pub fn select_only(mut self) -> Self {
        self.select = Box::new(QuerySelect::select_only(*self.select));
        self
    }

    /// Selects one column (SeaORM's `QuerySelect::column`).
    pub fn column(mut self, column: E::Column) -> Self {
        self.select = Box::new(QuerySelect::column(*self.select, column));
        self
    }

    /// Decodes each row into `M` (SeaORM's [`Select::into_model`]).
    pub fn into_model<M: FromQueryResult>(self) -> MultiSelect<E, R, SelectModel<M>> {
        MultiSelect {
            find: self,
            into: |select| select.into_model::<M>(),
        }
    }

    /// Decodes each row into a tuple of its selected columns (SeaORM's
    /// [`Select::into_tuple`]).
    pub fn into_tuple<T: TryGetableMany>(self) -> MultiSelect<E, R, SelectGetableTuple<T>> {
        MultiSelect {
            find: self,
            into: |select| select.into_tuple::<T>(),
        }
    }

    /// Decodes each row into a JSON object (SeaORM's [`Select::into_json`]).
    pub fn into_json(self) -> MultiSelect<E, R, SelectModel<sea_orm::JsonValue>> {
        MultiSelect {
            find: self,
            into: |select| select.into_json(),
        }
    }
}

/// A multi-shard read decoded into another shape ([`Find::into_tuple`] and
/// friends on [`Keys`], [`Scatter`] and [`ByIndex`] reads).
#[must_use = "a read does nothing until `.all()` runs it"]
pub struct MultiSelect<E: ShardedEntity, R, S: SelectorTrait> {
    find: Find<E, R>,
    into: fn(Select<E>) -> Selector<S>,
}

impl<E: ShardedEntity, R: MultiShard + Routed<E>, S: SelectorTrait> MultiSelect<E, R, S>
where
    S::Item: Send,
{
    /// Every matching row of every shard asked, shard by shard.
    pub async fn all(self) -> Result<R::Output<Vec<S::Item>>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        if let Some((column, _)) = read.order.first() {
            return Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: format!(
                    "a projection of several shards ordered by `{}`: shards are merged by the \
                     order columns of whole rows; read whole rows with `all()`, or project each \
                     key's rows with a keyed read",
                    column.as_str()
                ),
            });
        }
        let plan = read.plan(select, spec, ReadOp::All).await?;
        if plan.single.is_some() {
            return read
                .single::<R, _, _, _>(plan, "all", |s, conn| into(s).all(conn))
                .await;
        }
        // A scatter of a movable group projects only when no move of the
        // group ran before or while it read: a moving row is on two shards
        // and a projection keeps no key to tell the copies apart.
        let scatters_movable = plan.owners.is_some();
        let before = read.move_mark(scatters_movable).await;
        if let Some(mark) = before
            && !matches!(mark, Some((0, _)))
        {
            return Err(moving_projection::<E>(mark.is_some()));
        }
        let asked = plan.asked;
        let (mut ok, mut failed, span) = read
            .gather(plan.parts, asked, "all", |s, conn| into(s).all(conn))
            .await;
        if scatters_movable && read.move_mark(true).await != before {
            return Err(moving_projection::<E>(true));
        }
        let asked = asked + usize::from(plan.lookup_failed.is_some());
        failed.extend(plan.lookup_failed);
        ok.sort_by_key(|(id, _)| *id);
        let rows: Vec<S::Item> = ok
            .into_iter()
            .flat_map(|(_, rows)| rows)
            .skip(plan.offset as usize)
            .take(plan.limit.map_or(usize::MAX, |l| l as usize))
            .collect();
        span.record("rows", rows.len());
        R::finish(rows, read.gathered(asked, failed))
    }
}

/// The pages of a keyed read ([`Find::paginate`]).
#[must_use = "pages are read by `fetch_page`, `num_items` or `num_pages`"]
pub struct KeyedPages<E: ShardedEntity> {
    find: Find<E, Keyed<KeyOf<E>>>,
    page_size: u64,
}

impl<E: ShardedEntity> KeyedPages<E> {
    /// Page `page` (from 0): at most `page_size` rows.
    pub async fn fetch_page(&self, page: u64) -> Result<Vec<E::Model>> {
        let mut find = self.find.clone();
        find.limit = Some(self.page_size);
        find.offset = Some(page.saturating_mul(self.page_size));
        find.all().await
    }

    /// How many rows the read has (within its key).
    pub async fn num_items(&self) -> Result<u64> {
        let mut find = self.find.clone();
        find.limit = None;
        find.offset = None;
        find.count().await
    }

    /// How many pages those rows fill.
    pub async fn num_pages(&self) -> Result<u64> {
        Ok(self.num_items().await?.div_ceil(self.page_size))
    }

    /// The rows per page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }
}

/// A keyed read decoded into another shape ([`Find::into_model`],
/// [`Find::into_tuple`], [`Find::into_json`]). Runs like the keyed read it
/// came from: the key's shard, the key's predicate, the read's timeout.
#[must_use = "a read does nothing until `.all()` or `.one()` runs it"]
pub struct KeyedSelect<E: ShardedEntity, S: SelectorTrait> {
    pub(super) find: Find<E, Keyed<KeyOf<E>>>,
    pub(super) into: fn(Select<E>) -> Selector<S>,
}

impl<E: ShardedEntity, S: SelectorTrait> KeyedSelect<E, S> {
    /// All matching rows of the key.
    pub async fn all(self) -> Result<Vec<S::Item>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        let plan = read.plan(select, spec, ReadOp::All).await?;
        read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "all", |s, conn| into(s).all(conn))
            .await
    }

    /// The rows of the key as a stream (see [`Find::stream`]).
    pub async fn stream(self) -> Result<RowStream<'static, S::Item>>
    where
        S: Send + 'static,
        S::Item: Send + 'static,
    {
        self.find.into_stream(self.into).await
    }

    /// The first matching row of the key.
    pub async fn one(self) -> Result<Option<S::Item>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        let plan = read.plan(select, spec, ReadOp::One).await?;
        read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "one", |s, conn| into(s).one(conn))
            .await
    }
}

/// The refusal of a projection of several shards of a `movable` group
/// while a move of it runs (`known`), or while its control database
/// cannot say whether one does.
fn moving_projection<E: ShardedEntity>(known: bool) -> ShardError {
    let group = <E::Group as EntityGroup>::NAME;
    let why = if known {
        format!("a move of group `{group}` is not finished (or started while the read ran)")
    } else {
        format!("the control database of group `{group}` cannot say whether a move of it runs")
    };
    ShardError::Unmergeable {
        table: table_name::<E>(),
        reason: format!(
            "a projection of several shards while {why}: the moving buckets' rows are on two \
             shards until the move is cleaned, and a projection keeps no key to tell the copies \
             apart; read whole rows with `all()` (each is read once), project each key's rows \
             with a keyed read, or project after the move"
        ),
    }
}
