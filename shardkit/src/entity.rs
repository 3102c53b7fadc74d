//! What the derives implement: [`EntityGroup`], [`ShardedEntity`], and the
//! [`ShardKey`] types a group can be keyed by.

use crate::key::pghash;
use sea_orm::{EntityTrait, Value};
use std::fmt::Debug;
use std::hash::Hash;

/// A value that can be a shard key.
///
/// Implemented for `i64`, `i32`, `u64`, `String` and `uuid::Uuid`. The hash is
/// PostgreSQL's hash-partitioning hash for the matching SQL type, so a key lands
/// in the same bucket that `PARTITION BY HASH (key) MODULUS buckets` puts it in:
/// integers hash as `bigint` (`hashint8extended`; `i32` agrees with `integer`
/// because PostgreSQL makes the two agree, and `u64` hashes as the `bigint` with
/// the same 64 bits), strings as `text` (`hashtextextended`) and UUIDs as `uuid`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a shard key",
    label = "not a supported shard key type",
    note = "shardkit shard keys are one of: i64, i32, u64, String, uuid::Uuid (never `Option<_>`)"
)]
pub trait ShardKey: Clone + Eq + Hash + Debug + Send + Sync + 'static + Into<Value> {
    /// `hash_combine64(0, hash_extended(key, HASH_PARTITION_SEED))`: the 64-bit
    /// row hash PostgreSQL's hash partitioning computes for this key.
    fn partition_hash(&self) -> u64;

    /// The key as range and modulo placements see it.
    fn key_ref(&self) -> KeyRef<'_>;

    /// The canonical text stored in a directory or index table.
    fn to_directory_text(&self) -> String;

    /// Parses [`to_directory_text`](Self::to_directory_text)'s output.
    fn from_directory_text(text: &str) -> Option<Self>;

    /// Whether the key can be bound on a backend without unsigned integers
    /// (PostgreSQL, SQLite): false only for a `u64` above `i64::MAX`, which
    /// only MySQL/MariaDB's `BIGINT UNSIGNED` stores.
    #[inline]
    fn fits_signed_64(&self) -> bool {
        true
    }
}

/// A borrowed view of a shard key, for placements that compare or divide keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRef<'a> {
    /// Any integer key, widened.
    Int(i128),
    /// A string key.
    Text(&'a str),
    /// A UUID key.
    Uuid(&'a uuid::Uuid),
}

macro_rules! int_key {
    ($($t:ty => $as_i64:expr, $fits:expr);* $(;)?) => {$(
        impl ShardKey for $t {
            #[inline]
            fn partition_hash(&self) -> u64 {
                let f: fn($t) -> i64 = $as_i64;
                pghash::partition_hash_i64(f(*self))
            }
            #[inline]
            fn key_ref(&self) -> KeyRef<'_> {
                KeyRef::Int(i128::from(*self))
            }
            fn to_directory_text(&self) -> String {
                self.to_string()
            }
            fn from_directory_text(text: &str) -> Option<Self> {
                text.parse().ok()
            }
            #[inline]
            fn fits_signed_64(&self) -> bool {
                let f: fn($t) -> bool = $fits;
                f(*self)
            }
        }
    )*};
}

int_key! {
    i64 => |v| v, |_| true;
    i32 => i64::from, |_| true;
    // PostgreSQL has no unsigned type: a u64 key is hashed as the bigint with the
    // same 64 bits (so the hash is defined for every u64), but only MySQL/MariaDB
    // can store one above i64::MAX; see `fits_signed_64`.
    u64 => |v| v as i64, |v| i64::try_from(v).is_ok();
}

impl ShardKey for String {
    #[inline]
    fn partition_hash(&self) -> u64 {
        pghash::partition_hash_bytes(self.as_bytes())
    }
    #[inline]
    fn key_ref(&self) -> KeyRef<'_> {
        KeyRef::Text(self)
    }
    fn to_directory_text(&self) -> String {
        self.clone()
    }
    fn from_directory_text(text: &str) -> Option<Self> {
        Some(text.to_owned())
    }
}

impl ShardKey for uuid::Uuid {
    #[inline]
    fn partition_hash(&self) -> u64 {
        pghash::partition_hash_bytes(self.as_bytes())
    }
    #[inline]
    fn key_ref(&self) -> KeyRef<'_> {
        KeyRef::Uuid(self)
    }
    fn to_directory_text(&self) -> String {
        self.hyphenated().to_string()
    }
    fn from_directory_text(text: &str) -> Option<Self> {
        uuid::Uuid::parse_str(text).ok()
    }
}

/// A transactional entity group: tables sharded by the same key and written
/// together (PayPal's "entity group"). Derive it:
///
/// ```
/// #[derive(shardkit::EntityGroup)]
/// #[shardkit(key = i64)]
/// pub struct Customer;
/// ```
pub trait EntityGroup: Send + Sync + 'static {
    /// The shard key type every member entity uses.
    type Key: ShardKey;
    /// The group's name in the cluster config (`[groups.<NAME>]`).
    const NAME: &'static str;
}

/// Ties a shard key field's type to its group's key type. The `EntityGroup`
/// derive implements it for exactly the declared key type, so a field of any
/// other type is a compile error that names both.
#[diagnostic::on_unimplemented(
    message = "the shard key type `{Self}` does not match the key type of entity group `{G}`",
    label = "this shard key must have the group's key type",
    note = "every entity of a group is sharded by the same key type; use the type given in \
            `#[shardkit(key = ...)]` on `{G}` (supported: i64, i32, u64, String, uuid::Uuid)"
)]
pub trait GroupKey<G: EntityGroup> {
    /// Identity conversion, typed through the group.
    fn into_group_key(self) -> G::Key;
}

/// A SeaORM entity whose rows live on shards. Derive it on the `Model` with
/// `#[derive(shardkit::Sharded)]`.
///
/// Its models and active models can be shared between threads (as every
/// SeaORM model of plain fields can), so a write's future is `Send`; and a
/// model converts to its active model and back (what SeaORM's
/// `DeriveEntityModel` always generates), so code generic over sharded
/// entities needs no `where` clause for either.
pub trait ShardedEntity:
    EntityTrait<
        Model: Sync + sea_orm::IntoActiveModel<<Self as EntityTrait>::ActiveModel>,
        ActiveModel: Send + Sync + sea_orm::TryIntoModel<<Self as EntityTrait>::Model>,
    >
{
    /// The transactional entity group the entity belongs to.
    type Group: EntityGroup;
    /// The Rust field name of the shard key.
    const SHARD_KEY_FIELD: &'static str;
    /// The primary key column shardkit fills on insert when it is unset, and
    /// how (`#[shardkit(id = "...")]`).
    const ID: Option<(Self::Column, crate::id_spec::IdStrategy)> = None;
    /// Columns with a global secondary index (`#[shardkit(global_index)]`),
    /// and whether each is unique.
    const GLOBAL_INDEXES: &'static [(Self::Column, bool)] = &[];
    /// The shard key column.
    fn shard_key_column() -> Self::Column;
    /// The shard key of a model.
    fn shard_key(model: &Self::Model) -> <Self::Group as EntityGroup>::Key;
    /// The shard key of an ActiveModel, or `None` when it is `NotSet`.
    fn active_shard_key(
        model: &<Self as EntityTrait>::ActiveModel,
    ) -> Option<<Self::Group as EntityGroup>::Key>;
    /// `model` as a `Model` when every column is set (SeaORM's
    /// `TryIntoModel`, which the derive knows the entity implements).
    #[doc(hidden)]
    fn __try_into_model(
        model: <Self as EntityTrait>::ActiveModel,
    ) -> Result<Self::Model, sea_orm::DbErr>;
}

/// "`Self` is an entity of group `G`": the bound [`ShardTx<G>`](crate::ShardTx)
/// puts on what it writes and reads, and relation reads on their related
/// entity, so using another group's entity fails to compile with a message
/// that says so. `#[derive(Sharded)]` implements it for the
/// entity's own group only (a blanket impl would turn the error into a bare
/// type mismatch). A marker: its supertrait's `Group = G` makes the
/// entity's key `G::Key` and keeps a hand-written impl for another group
/// from compiling.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an entity of group `{G}`, so it cannot be read or written inside a key of `{G}`",
    label = "belongs to another entity group",
    note = "shardkit works inside one group's key at a time (a `ShardTx<{G}>`, a keyed read, a \
            relation read); write the entity in a transaction of its own group \
            (`cluster.begin::<ItsGroup>(key)`) and read it with a keyed read of its own key; \
            a reference table (`#[shardkit(reference)]`) is written through \
            `cluster.reference::<Entity>()` and joined with `find_also_related`"
)]
pub trait InGroup<G: EntityGroup>: ShardedEntity<Group = G> {}

/// Support code for the derives; not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use super::ReferenceTable;
    use sea_orm::ActiveValue;

    /// The value of a set (or unchanged) active field.
    #[inline]
    pub fn active_value<T: Clone + Into<sea_orm::Value>>(value: &ActiveValue<T>) -> Option<T> {
        match value {
            ActiveValue::Set(v) | ActiveValue::Unchanged(v) => Some(v.clone()),
            ActiveValue::NotSet => None,
        }
    }
}

/// The table name of an entity, for messages and spans.
pub(crate) fn table_name<E: EntityTrait>() -> &'static str {
    E::default().table_name()
}

/// A reference table: a SeaORM entity with a copy on every shard (currencies,
/// countries, plans and prices), so that a key's reads join it on the key's
/// own shard. Derive it with `#[derive(shardkit::Sharded)]` and
/// `#[shardkit(reference)]`; write it through
/// [`Cluster::reference`](crate::Cluster::reference), never through a
/// [`ShardTx`](crate::ShardTx) (it is in no group, so a transaction's writes
/// refuse it at compile time).
pub trait ReferenceEntity:
    EntityTrait<
        Model: Sync + sea_orm::IntoActiveModel<<Self as EntityTrait>::ActiveModel>,
        ActiveModel: Send + Sync + sea_orm::TryIntoModel<<Self as EntityTrait>::Model>,
    >
{
}

/// "`Self` can be joined inside a key of group `G`": an entity of `G`
/// (its side of the join scoped to the key), or a reference entity (whose
/// copy on the key's shard is the one joined). The bound of relation reads
/// (`find_with_related`, `find_also_related`); `#[derive(Sharded)]`
/// implements it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an entity of group `{G}` nor a reference table, so it cannot be joined inside a key of `{G}`",
    label = "belongs to another entity group",
    note = "shardkit works inside one group's key at a time (a `ShardTx<{G}>`, a keyed read, a \
            relation read); read the entity with a keyed read of its own key, or mark a table \
            that every shard should hold with `#[shardkit(reference)]`"
)]
pub trait Joinable<G: EntityGroup>: EntityTrait {
    /// The reference table behind the entity, if it is one.
    #[doc(hidden)]
    const __REFERENCE: Option<&'static dyn ReferenceTable> = None;

    /// The column that holds `G`'s key (`None`: a reference table).
    #[doc(hidden)]
    fn __key_column() -> Option<Self::Column>;
}

/// A reference entity's table as an object, for reads that join it and for
/// the work that brings a shard's copy up to date. Implemented by shardkit
/// (`#[derive(Sharded)]` names it); not part of the public API.
#[doc(hidden)]
pub trait ReferenceTable: Send + Sync + 'static {
    /// The table's name.
    fn table(&self) -> &'static str;

    /// The entity's type.
    fn entity(&self) -> std::any::TypeId;

    /// Brings shard `shard`'s copy up to the source's version, each step
    /// within `bound`; `state` is shardkit's reference state (anything else
    /// is an internal error).
    fn catch_up<'a>(
        &'a self,
        state: &'a (dyn std::any::Any + Send + Sync),
        shard: usize,
        bound: Option<std::time::Duration>,
    ) -> futures::future::BoxFuture<'a, crate::error::Result<i64>>;
}
