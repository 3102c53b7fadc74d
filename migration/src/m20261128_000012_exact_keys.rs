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

/// Converts shardkit's key, id and name columns to exact comparison on
/// MySQL/MariaDB.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261128_000012_exact_keys"
    }
}

/// The key, id and name columns converted, per table.
const COLUMNS: [(&str, &[&str]); 6] = [
    ("shardkit_directory", &["group_name", "shard_key"]),
    (
        "shardkit_outbox",
        &["id", "grp", "key_text", "to_grp", "to_key", "kind", "state"],
    ),
    ("shardkit_inbox", &["id", "grp", "key_text"]),
    (
        "shardkit_sagas",
        &["id", "grp", "key_text", "name", "state"],
    ),
    (
        "shardkit_requests",
        &["id", "grp", "key_text", "request_id"],
    ),
    ("shardkit_reference_versions", &["tbl"]),
];

/// The binary NO PAD collation of a MySQL/MariaDB server, if it has one:
/// `utf8mb4_nopad_bin` (MariaDB 10.2+), else `utf8mb4_0900_bin` (MySQL
/// 8.0.17+). Values in it compare byte for byte: `a@x`, `A@X` and `a@x `
/// are three values.
pub async fn mysql_exact_collation<C: ConnectionTrait>(
    db: &C,
) -> Result<Option<&'static str>, DbErr> {
    const CANDIDATES: [&str; 2] = ["utf8mb4_nopad_bin", "utf8mb4_0900_bin"];
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::MySql,
            "SELECT CAST(COLLATION_NAME AS CHAR) AS name FROM information_schema.COLLATIONS \
             WHERE COLLATION_NAME IN (?, ?)",
            CANDIDATES.map(Value::from),
        ))
        .await?;
    let names = rows
        .iter()
        .map(|r| r.try_get::<String>("", "name"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(CANDIDATES
        .into_iter()
        .find(|c| names.iter().any(|n| n == c)))
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DbBackend::MySql {
            return Ok(());
        }
        let db = manager.get_connection();
        // A server without one (MySQL 5.7) keeps the columns as they are.
        let Some(collation) = mysql_exact_collation(db).await? else {
            return Ok(());
        };
        for (table, columns) in COLUMNS {
            let placeholders = vec!["?"; columns.len()].join(", ");
            let mut values = vec![Value::from(table)];
            values.extend(columns.iter().map(|c| Value::from(*c)));
            values.push(Value::from(collation));
            let rows = db
                .query_all_raw(Statement::from_sql_and_values(
                    DbBackend::MySql,
                    format!(
                        "SELECT CAST(COLUMN_NAME AS CHAR) AS col, CAST(COLUMN_TYPE AS CHAR) AS ty, \
                         CAST(IS_NULLABLE AS CHAR) AS nullable FROM information_schema.COLUMNS \
                         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? \
                         AND COLUMN_NAME IN ({placeholders}) AND DATA_TYPE = 'varchar' \
                         AND COLLATION_NAME <> ? ORDER BY ORDINAL_POSITION"
                    ),
                    values,
                ))
                .await?;
            let mut stale = Vec::new();
            for row in rows {
                let column: String = row.try_get("", "col")?;
                let ty: String = row.try_get("", "ty")?;
                let nullable: String = row.try_get("", "nullable")?;
                let null = if nullable == "YES" {
                    "NULL"
                } else {
                    "NOT NULL"
                };
                stale.push(format!(
                    "MODIFY `{column}` {ty} CHARACTER SET utf8mb4 COLLATE {collation} {null}"
                ));
            }
            if stale.is_empty() {
                continue;
            }
            let alter = format!("ALTER TABLE `{table}` {}", stale.join(", "));
            // In place where the server can (MariaDB), so writes go on
            // while a big outbox or inbox converts; else as it must.
            if db
                .execute_unprepared(&format!("{alter}, ALGORITHM=INPLACE, LOCK=NONE"))
                .await
                .is_err()
            {
                db.execute_unprepared(&alter).await?;
            }
        }
        Ok(())
    }

    /// Keeps the exact collation: comparing keys blindly again would merge
    /// rows that are distinct now.
    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        Ok(())
    }
}
