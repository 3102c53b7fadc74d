//! Derive macros for [shardkit](https://docs.rs/shardkit). Use them through the
//! `shardkit` crate, which re-exports them: `#[derive(shardkit::Sharded)]` and
//! `#[derive(shardkit::EntityGroup)]`.
//!
//! The macros follow one shape: parse the item into a small AST (`ast`), collect
//! every attribute problem at once (`ctxt`), then expand. When an attribute is
//! wrong the macro still emits nothing else that could fail, so the user sees the
//! real error rather than a cascade of follow-ups.

mod ast;
mod ctxt;
mod expand;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

/// Declares a transactional entity group and its shard key type.
///
/// ```
/// #[derive(shardkit::EntityGroup)]
/// #[shardkit(key = i64)]
/// pub struct Customer;
///
/// #[derive(shardkit::EntityGroup)]
/// #[shardkit(key = String, name = "tenants")] // `[groups.tenants]` in the config
/// pub struct Tenant;
///
/// use shardkit::EntityGroup as _;
/// assert_eq!(Customer::NAME, "Customer");
/// assert_eq!(Tenant::NAME, "tenants");
/// ```
///
/// Container keys: `key = Type` (required; `i64`, `i32`, `u64`, `String` or
/// `uuid::Uuid`), `name = "..."` (the group's name in the cluster config;
/// defaults to the type's name).
#[proc_macro_derive(EntityGroup, attributes(shardkit))]
pub fn derive_entity_group(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::entity_group(&input)
        .unwrap_or_else(|errors| errors)
        .into()
}

/// Makes a SeaORM entity sharded: names its entity group and its shard key.
///
/// ```
/// # #[derive(shardkit::EntityGroup)]
/// # #[shardkit(key = i64)]
/// # pub struct Customer;
/// pub mod order {
///     use sea_orm::entity::prelude::*;
///
///     #[sea_orm::model]
///     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
///     #[sea_orm(table_name = "orders")]
///     #[shardkit(group = crate::Customer)]
///     pub struct Model {
///         #[sea_orm(primary_key, auto_increment = false)]
///         pub id: i64,
///         #[shardkit(shard_key)]
///         pub customer_id: i64,
///     }
///
///     impl ActiveModelBehavior for ActiveModel {}
/// }
///
/// # fn main() {
/// use shardkit::ShardedEntity;
/// let row = order::Model { id: 1, customer_id: 42 };
/// assert_eq!(order::Entity::shard_key(&row), 42);
/// assert_eq!(order::Entity::SHARD_KEY_FIELD, "customer_id");
/// # }
/// ```
///
/// Attributes:
///
/// | attribute | on | what it does |
/// |---|---|---|
/// | `#[shardkit(group = path::To::Group)]` | the struct | the entity group (a `#[derive(EntityGroup)]` type) the entity belongs to; required |
/// | `#[shardkit(shard_key)]` | exactly one field | the shard key column; its type must be the group's key type (or convert into it), never `Option<_>` |
/// | `#[shardkit(global_index)]` | any field | a global secondary index on the column (`cluster.setup::<Entity>()` makes its table) |
/// | `#[shardkit(global_index(unique))]` | any field | a unique global index |
/// | `#[shardkit(id = "ticket:<sequence>")]` | the primary key | an insert with the key unset takes the next id of the ticket sequence (`cluster.setup::<Entity>()` creates it on the ticket servers) |
/// | `#[shardkit(id = "encoded:<sequence>")]` | the primary key | the same, with the row's bucket in the id's low 13 bits: `cluster.route_id::<Group>(id)` finds the row's shard from the id alone |
/// | `#[shardkit(id = "uuid_v7")]` | the primary key | a UUIDv7 |
/// | `#[shardkit(id = "snowflake")]` | the primary key | this process's next snowflake id |
///
/// ```
/// # #[derive(shardkit::EntityGroup)]
/// # #[shardkit(key = i64)]
/// # pub struct Customer;
/// pub mod receipt {
///     use sea_orm::entity::prelude::*;
///
///     #[sea_orm::model]
///     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
///     #[sea_orm(table_name = "receipts")]
///     #[shardkit(group = crate::Customer)]
///     pub struct Model {
///         #[sea_orm(primary_key, auto_increment = false)]
///         #[shardkit(id = "encoded:receipts")]
///         pub id: i64,
///         #[shardkit(shard_key)]
///         pub customer_id: i64,
///         #[shardkit(global_index(unique))]
///         pub number: String,
///         #[shardkit(global_index)]
///         pub store: String,
///     }
///
///     impl ActiveModelBehavior for ActiveModel {}
/// }
///
/// # fn main() {
/// use shardkit::ShardedEntity;
/// use shardkit::ids::IdStrategy;
/// assert_eq!(
///     receipt::Entity::ID.map(|(_, how)| how),
///     Some(IdStrategy::Encoded("receipts"))
/// );
/// use sea_orm::IdenStatic;
/// let indexes: Vec<(&str, bool)> = receipt::Entity::GLOBAL_INDEXES
///     .iter()
///     .map(|(column, unique)| (column.as_str(), *unique))
///     .collect();
/// assert_eq!(indexes, [("number", true), ("store", false)]);
/// # }
/// ```
///
/// Works on the dense (`#[sea_orm::model]`) and the compact
/// (`#[derive(DeriveEntityModel)]`) entity formats. `#[sea_orm::model]` applies
/// every derive to the generated `ModelEx` as well; the impls are generated once,
/// from `Model`.
#[proc_macro_derive(Sharded, attributes(shardkit))]
pub fn derive_sharded(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::sharded(&input)
        .unwrap_or_else(|errors| errors)
        .into()
}
