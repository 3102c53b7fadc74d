//! The columns a table has on a database, as the database names them: what
//! a bucket move and a reference table's catch-up compare with their
//! entities' columns before they copy rows.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement};
use std::collections::BTreeSet;

/// The columns of table `name` on `db` (none when it does not exist), in
/// `schema` when given, else the table an unqualified name in a statement
/// finds (the search path, the connection's database, SQLite's temp, main
/// and attached databases); named as [`named`] names them. A MySQL
/// invisible column (a generated invisible primary key) is not one the
/// application writes, and is left out.
pub(crate) async fn table_columns<C: ConnectionTrait>(
    db: &C,
    schema: Option<&str>,
    name: &str,
) -> Result<BTreeSet<String>, DbErr> {
    let backend = db.get_database_backend();
    let sql = match backend {
        DbBackend::Sqlite => "SELECT name FROM pragma_table_info(?2, ?1)",
        DbBackend::Postgres => {
            "SELECT attname::text AS name FROM pg_attribute \
             WHERE attrelid = to_regclass(COALESCE(quote_ident($1) || '.', '') || quote_ident($2)) \
             AND attnum > 0 AND NOT attisdropped"
        }
        _ => {
            "SELECT CAST(column_name AS CHAR) AS name FROM information_schema.columns \
             WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? \
             AND COALESCE(extra, '') NOT LIKE '%INVISIBLE%'"
        }
    };
    let values = [schema.map(str::to_owned).into(), name.into()];
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(backend, sql, values))
        .await?;
    rows.iter()
        .map(|row| {
            row.try_get::<String>("", "name")
                .map(|name| named(backend, &name))
        })
        .collect()
}

/// Column `name` as `backend` compares it: lower-cased where the database
/// compares names without case (MySQL, MariaDB, SQLite).
pub(crate) fn named(backend: DbBackend, name: &str) -> String {
    match backend {
        DbBackend::Postgres => name.to_owned(),
        _ => name.to_lowercase(),
    }
}
