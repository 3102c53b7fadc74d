//! Exact keys on MySQL/MariaDB: the text columns of shardkit's own tables
//! that hold keys, ids and names compare byte for byte.
//!
//! The directory was made in the database's default collation, which on
//! MySQL/MariaDB ignores case (`utf8mb4_general_ci`): a directory-placed
//! group's keys `Acme` and `acme` shared one entry, so assigning one moved
//! the other. The cross-key and reference tables were made `utf8mb4_bin`,
//! which still pads: `'pay-1'` and `'pay-1 '` were one value. This converts
//! those columns to the server's binary NO PAD collation
//! (`utf8mb4_nopad_bin` on MariaDB 10.2+, `utf8mb4_0900_bin` on MySQL 8), as
//! global index tables already are; a server with neither keeps them as
//! they are. Converting keeps every row: values equal before are still
//! distinct rows, and no two rows become equal.
//!
//! Only columns not yet in that collation are altered, so the migration is
//! cheap on tables made exact already, and does nothing on PostgreSQL and
//! SQLite, which compare text byte for byte.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend, Statement, Value};
use std::collections::BTreeMap;

/// Converts shardkit's key, id and name columns to exact comparison on
/// MySQL/MariaDB.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261128_000012_exact_keys"
    }
}

/// The tables whose text columns are converted.
const TABLES: [&str; 6] = [
    "shardkit_directory",
    "shardkit_outbox",
    "shardkit_inbox",
    "shardkit_sagas",
    "shardkit_requests",
    "shardkit_reference_versions",
];

/// The server's binary NO PAD collation, if it has one.
async fn exact_collation(db: &SchemaManagerConnection<'_>) -> Result<Option<String>, DbErr> {
    const CANDIDATES: [&str; 2] = ["utf8mb4_nopad_bin", "utf8mb4_0900_bin"];
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::MySql,
            "SELECT COLLATION_NAME AS name FROM information_schema.COLLATIONS \
             WHERE COLLATION_NAME IN (?, ?)",
            CANDIDATES.map(Value::from),
        ))
        .await?;
    let names: Vec<String> = rows
        .iter()
        .filter_map(|r| r.try_get::<String>("", "name").ok())
        .collect();
    Ok(CANDIDATES
        .into_iter()
        .find(|c| names.iter().any(|n| n == c))
        .map(str::to_owned))
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DbBackend::MySql {
            return Ok(());
        }
        let db = manager.get_connection();
        let Some(collation) = exact_collation(db).await? else {
            return Ok(());
        };
        let placeholders = vec!["?"; TABLES.len()].join(", ");
        let mut values: Vec<Value> = TABLES.iter().map(|t| Value::from(*t)).collect();
        values.push(Value::from(collation.as_str()));
        let rows = db
            .query_all_raw(Statement::from_sql_and_values(
                DbBackend::MySql,
                format!(
                    "SELECT TABLE_NAME AS tbl, COLUMN_NAME AS col, COLUMN_TYPE AS ty, \
                     IS_NULLABLE AS nullable FROM information_schema.COLUMNS \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME IN ({placeholders}) \
                     AND DATA_TYPE = 'varchar' AND COLLATION_NAME <> ? \
                     ORDER BY TABLE_NAME, ORDINAL_POSITION"
                ),
                values,
            ))
            .await?;
        let mut stale: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for row in rows {
            let table: String = row.try_get("", "tbl")?;
            let column: String = row.try_get("", "col")?;
            let ty: String = row.try_get("", "ty")?;
            let nullable: String = row.try_get("", "nullable")?;
            let null = if nullable == "YES" {
                "NULL"
            } else {
                "NOT NULL"
            };
            stale.entry(table).or_default().push(format!(
                "MODIFY `{column}` {ty} CHARACTER SET utf8mb4 COLLATE {collation} {null}"
            ));
        }
        for (table, columns) in stale {
            db.execute_unprepared(&format!("ALTER TABLE `{table}` {}", columns.join(", ")))
                .await?;
        }
        Ok(())
    }

    /// Keeps the exact collation: comparing keys blindly again would merge
    /// rows that are distinct now.
    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        Ok(())
    }
}
