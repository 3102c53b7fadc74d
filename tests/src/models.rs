//! Entities the scenarios share: one group per key type and placement, in
//! both SeaORM entity formats.

use sea_orm_migration::prelude::*;
use shardkit::EntityGroup;

/// i64 key, hash placement.
#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

/// String key, hash placement.
#[derive(EntityGroup)]
#[shardkit(key = String)]
pub struct Tenant;

/// UUID key, hash placement.
#[derive(EntityGroup)]
#[shardkit(key = uuid::Uuid)]
pub struct Device;

/// i32 key, range placement.
#[derive(EntityGroup)]
#[shardkit(key = i32)]
pub struct Account;

/// i64 key, modulo placement; named explicitly in the config. (A `u64` key
/// routes the same way, but SeaORM stores `u64` only on MySQL/MariaDB.)
#[derive(EntityGroup)]
#[shardkit(key = i64, name = "meters")]
pub struct Meter;

/// i64 key, directory placement.
#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Member;

/// Customers (dense format); the id is the shard key.
pub mod customer {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "customers")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub name: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Orders (dense format), sharded by customer.
pub mod order {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub total_cents: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// A Customer-group entity whose table is never created: a write that reaches
/// the database fails with "no such table", so a refusal proves no SQL ran.
pub mod ghost {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "ghosts_never_created")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// A statement that makes the database abort the transaction the way a
/// deadlock does (SQLSTATE 40001 / MySQL 1213); SQLite has no way to raise
/// one, so it is a plain failure there.
pub fn deadlock_sql(backend: sea_orm::DbBackend) -> &'static str {
    match backend {
        sea_orm::DbBackend::Postgres => {
            "DO $$ BEGIN RAISE EXCEPTION 'chosen as deadlock victim' USING ERRCODE = '40001'; END $$"
        }
        sea_orm::DbBackend::MySql => {
            "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'Deadlock found'"
        }
        _ => "SELECT * FROM no_such_table",
    }
}

/// Creates `aborts()` on `conn`: a function that makes the database abort
/// the transaction the way a deadlock does ([`deadlock_sql`]), for a read
/// that filters on it (`Expr::cust("aborts() = 1")`). PostgreSQL and
/// MySQL/MariaDB only.
pub async fn create_aborting_function(conn: &sea_orm::DatabaseConnection) {
    use sea_orm::ConnectionTrait;
    let create = match conn.get_database_backend() {
        sea_orm::DbBackend::Postgres => {
            "CREATE FUNCTION aborts() RETURNS integer AS $$ BEGIN RAISE EXCEPTION \
             'chosen as deadlock victim' USING ERRCODE = '40001'; END $$ LANGUAGE plpgsql"
        }
        _ => {
            "CREATE FUNCTION aborts() RETURNS INT NOT DETERMINISTIC NO SQL BEGIN \
             SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = \
             'Deadlock found'; RETURN 0; END"
        }
    };
    conn.execute_unprepared(create)
        .await
        .expect("create the function aborts()");
}

/// A Customer-group entity whose `before_save` and `before_delete` hooks move
/// the row to customer 999 when asked to (`note == "move"`), or fail with
/// the database's abort of the transaction (`note == "abort"`, see
/// [`deadlock_sql`]); its table is never created, so a refusal proves no SQL
/// ran.
pub mod mover {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "movers_never_created")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub note: String,
    }

    impl ActiveModel {
        /// What both hooks do (see the module's docs).
        async fn hook<C: ConnectionTrait>(mut self, db: &C) -> Result<Self, DbErr> {
            match self.note.as_ref().as_str() {
                "move" => self.customer_id = sea_orm::ActiveValue::Set(999),
                "abort" => {
                    let sql = crate::models::deadlock_sql(db.get_database_backend());
                    db.execute_unprepared(sql).await?;
                }
                _ => {}
            }
            Ok(self)
        }
    }

    #[async_trait::async_trait]
    impl ActiveModelBehavior for ActiveModel {
        async fn before_save<C>(self, db: &C, _insert: bool) -> Result<Self, DbErr>
        where
            C: ConnectionTrait,
        {
            self.hook(db).await
        }

        async fn before_delete<C>(self, db: &C) -> Result<Self, DbErr>
        where
            C: ConnectionTrait,
        {
            self.hook(db).await
        }
    }
}

/// Notes (compact format: `DeriveEntityModel` with a `Relation` enum), keyed
/// by tenant name.
pub mod note {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "notes")]
    #[shardkit(group = crate::models::Tenant)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub tenant: String,
        pub body: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// Customer-group notes under `schema_name = "shardkit_shared_test"`: on
/// MySQL/MariaDB a database of the server (one table for every shard on
/// that server); on PostgreSQL a schema of the shard's database, not in its
/// search path. The scenarios that use it create (and on MySQL drop) it
/// themselves.
pub mod server_note {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(schema_name = "shardkit_shared_test", table_name = "notes")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub body: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Sensor readings keyed by device UUID.
pub mod reading {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "readings")]
    #[shardkit(group = crate::models::Device)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub device_id: Uuid,
        pub value: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Ledger entries keyed by an i32 account number (range placement).
pub mod ledger {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "ledger")]
    #[shardkit(group = crate::models::Account)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub account: i32,
        pub amount: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Meter samples keyed by meter id (modulo placement).
pub mod sample {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "samples")]
    #[shardkit(group = crate::models::Meter)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub meter: i64,
        pub kwh: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Member profiles placed by directory.
pub mod profile {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "profiles")]
    #[shardkit(group = crate::models::Member)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub member_id: i64,
        pub bio: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Invoices: the primary key comes from the `invoices` ticket sequence when
/// unset.
pub mod invoice {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "invoices")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "ticket:invoices")]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Receipts: shard-encoded primary keys (the `receipts` sequence with the
/// row's bucket in the low bits), so a receipt is found from its id alone.
pub mod receipt {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "receipts")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "encoded:receipts")]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Audit events: UUIDv7 primary keys.
pub mod event {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "events")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "uuid_v7")]
        pub id: Uuid,
        #[shardkit(shard_key)]
        pub customer_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Clicks: snowflake primary keys.
pub mod click {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "clicks")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "snowflake")]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Contacts: a unique global index on email, a non-unique one on phone (a
/// family shares a number across customers).
pub mod contact {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "contacts")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
        #[shardkit(global_index)]
        pub phone: String,
    }

    impl ActiveModelBehavior for ActiveModel {}

    /// A contact to insert.
    pub fn row(id: i64, customer: i64, email: &str, phone: &str) -> ActiveModel {
        ActiveModel {
            id: sea_orm::ActiveValue::Set(id),
            customer_id: sea_orm::ActiveValue::Set(customer),
            email: sea_orm::ActiveValue::Set(email.to_owned()),
            phone: sea_orm::ActiveValue::Set(phone.to_owned()),
        }
    }
}

/// A rollout's old model: a person's name in two columns.
pub mod person_v1 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "people")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub first_name: String,
        pub last_name: String,
        pub city: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The rollout's new, denormalised model: the display name is stored (and
/// unique, so a test can make a dual write fail on the new table only).
pub mod person_v2 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "people_v2")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub first_name: String,
        pub last_name: String,
        #[sea_orm(unique)]
        pub display_name: String,
        pub city: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Carts (dense format, with a relation): each has many items, of the
/// same customer.
pub mod cart {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "carts")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[sea_orm(column_type = "Text")]
        pub label: String,
        #[sea_orm(has_many)]
        pub items: HasMany<super::cart_item::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Cart items (dense format): belong to a cart.
pub mod cart_item {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "cart_items")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub cart_id: i64,
        pub sku: String,
        pub quantity: i32,
        #[sea_orm(belongs_to, from = "cart_id", to = "id")]
        pub cart: BelongsTo<super::cart::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// A rollout's old model with a unique global index (for reads that
/// follow the phase through the new model's index).
pub mod login_v1 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "logins")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The new model: the email's domain stored beside it.
pub mod login_v2 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "logins_v2")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
        pub domain: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// old → new for the `people` rollout.
pub fn person_to_v2(old: &person_v1::Model) -> person_v2::Model {
    person_v2::Model {
        id: old.id,
        customer_id: old.customer_id,
        first_name: old.first_name.clone(),
        last_name: old.last_name.clone(),
        display_name: format!("{} {}", old.first_name, old.last_name),
        city: old.city.clone(),
    }
}

/// new → old for the `people` rollout.
pub fn person_to_v1(new: &person_v2::Model) -> person_v1::Model {
    person_v1::Model {
        id: new.id,
        customer_id: new.customer_id,
        first_name: new.first_name.clone(),
        last_name: new.last_name.clone(),
        city: new.city.clone(),
    }
}

/// Creates one entity's table.
pub struct CreateTable<E>(pub &'static str, pub E);

impl<E: sea_orm::EntityTrait> MigrationName for CreateTable<E> {
    fn name(&self) -> &str {
        self.0
    }
}

#[async_trait::async_trait]
impl<E: sea_orm::EntityTrait + Sync> MigrationTrait for CreateTable<E> {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let schema = sea_orm::Schema::new(manager.get_database_backend());
        manager
            .create_table(
                schema
                    .create_table_from_entity(self.1)
                    .if_not_exists()
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(self.1).to_owned())
            .await
    }
}

/// shardkit's tables and every test table.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = OldMigrator::migrations();
        all.extend::<[Box<dyn MigrationTrait>; 22]>([
            Box::new(CreateTable("m20261122_000102_orders", order::Entity)),
            Box::new(CreateTable("m20261122_000103_notes", note::Entity)),
            Box::new(CreateTable("m20261122_000104_readings", reading::Entity)),
            Box::new(CreateTable("m20261122_000105_ledger", ledger::Entity)),
            Box::new(CreateTable("m20261122_000106_samples", sample::Entity)),
            Box::new(CreateTable("m20261122_000107_profiles", profile::Entity)),
            Box::new(CreateTable("m20261122_000108_invoices", invoice::Entity)),
            Box::new(CreateTable("m20261122_000109_events", event::Entity)),
            Box::new(CreateTable("m20261122_000110_clicks", click::Entity)),
            Box::new(CreateTable("m20261122_000111_contacts", contact::Entity)),
            Box::new(CreateTable("m20261122_000112_people", person_v1::Entity)),
            Box::new(CreateTable("m20261122_000113_people_v2", person_v2::Entity)),
            Box::new(CreateTable("m20261123_000114_receipts", receipt::Entity)),
            Box::new(CreateTable("m20261123_000115_carts", cart::Entity)),
            Box::new(CreateTable(
                "m20261123_000116_cart_items",
                cart_item::Entity,
            )),
            Box::new(CreateTable("m20261123_000117_logins", login_v1::Entity)),
            Box::new(CreateTable("m20261123_000118_logins_v2", login_v2::Entity)),
            Box::new(CreateTable("m20261123_000119_users", user::Entity)),
            Box::new(CreateTable(
                "m20261123_000120_user_profiles",
                user_profile::Entity,
            )),
            Box::new(CreateTable("m20261123_000121_users_v2", user_v2::Entity)),
            Box::new(CreateTable(
                "m20261123_000122_order_lines",
                order_line::Entity,
            )),
            Box::new(CreateTable("m20261123_000123_orders_v2", order_v2::Entity)),
        ]);
        all
    }
}

/// An older release of the schema: shardkit's tables and customers only.
pub struct OldMigrator;

#[async_trait::async_trait]
impl MigratorTrait for OldMigrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = shardkit_migration::migrations();
        all.push(Box::new(CreateTable(
            "m20261122_000101_customers",
            customer::Entity,
        )));
        all
    }
}

/// A fold's root: users (with a unique global index on the email).
pub mod user {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "users")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Folded one to one into the user: its profile.
pub mod user_profile {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "user_profiles")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub user_id: i64,
        pub phone: String,
        pub city: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The folded user: the profile's columns in the user row, the phone
/// with a global index of its own.
pub mod user_v2 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "users_v2")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
        pub profile_id: Option<i64>,
        #[shardkit(global_index)]
        pub phone: Option<String>,
        pub city: Option<String>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Folded one to many into an order (`orders`, [`order`]): its lines.
pub mod order_line {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "order_lines")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub order_id: i64,
        pub sku: String,
        pub cents: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The folded order: its lines' count and sum stored, and the lines
/// themselves (as `id:sku:cents` joined by `;`), so the split back is exact.
pub mod order_v2 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders_v2")]
    #[shardkit(group = crate::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub total_cents: i64,
        pub line_count: i32,
        pub lines_cents: i64,
        #[sea_orm(column_type = "Text")]
        pub lines: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// users + user_profiles → users_v2.
pub fn user_fold(user: &user::Model, parts: &shardkit::Parts) -> user_v2::Model {
    let profile = parts.one::<user_profile::Entity>();
    user_v2::Model {
        id: user.id,
        customer_id: user.customer_id,
        email: user.email.clone(),
        profile_id: profile.map(|p| p.id),
        phone: profile.map(|p| p.phone.clone()),
        city: profile.map(|p| p.city.clone()),
    }
}

/// users_v2 → users.
pub fn user_unfold(new: &user_v2::Model) -> user::Model {
    user::Model {
        id: new.id,
        customer_id: new.customer_id,
        email: new.email.clone(),
    }
}

/// users_v2 → its profile.
pub fn user_parts(new: &user_v2::Model) -> shardkit::Parts {
    let profile = new.profile_id.map(|id| user_profile::Model {
        id,
        customer_id: new.customer_id,
        user_id: new.id,
        phone: new.phone.clone().unwrap_or_default(),
        city: new.city.clone().unwrap_or_default(),
    });
    shardkit::Parts::new().with::<user_profile::Entity>(profile.into_iter().collect())
}

/// orders + order_lines → orders_v2.
pub fn order_fold(order: &order::Model, parts: &shardkit::Parts) -> order_v2::Model {
    let lines = parts.many::<order_line::Entity>();
    order_v2::Model {
        id: order.id,
        customer_id: order.customer_id,
        total_cents: order.total_cents,
        line_count: lines.len() as i32,
        lines_cents: lines.iter().map(|l| l.cents).sum(),
        lines: lines
            .iter()
            .map(|l| format!("{}:{}:{}", l.id, l.sku, l.cents))
            .collect::<Vec<_>>()
            .join(";"),
    }
}

/// orders_v2 → orders.
pub fn order_unfold(new: &order_v2::Model) -> order::Model {
    order::Model {
        id: new.id,
        customer_id: new.customer_id,
        total_cents: new.total_cents,
    }
}

/// orders_v2 → its lines.
pub fn order_parts(new: &order_v2::Model) -> shardkit::Parts {
    let lines = new
        .lines
        .split(';')
        .filter(|l| !l.is_empty())
        .map(|l| {
            let mut f = l.splitn(3, ':');
            let (id, sku, cents) = (f.next(), f.next(), f.next());
            order_line::Model {
                id: id.and_then(|v| v.parse().ok()).unwrap_or_default(),
                customer_id: new.customer_id,
                order_id: new.id,
                sku: sku.unwrap_or_default().to_owned(),
                cents: cents.and_then(|v| v.parse().ok()).unwrap_or_default(),
            }
        })
        .collect();
    shardkit::Parts::new().with::<order_line::Entity>(lines)
}
