//! shardkit's own tables whose rows belong to a key (the outbox, the inbox,
//! sagas, idempotent requests): their columns, as data, so that code that
//! is not typed by an entity (a bucket move) can read and write them.
//!
//! Each has one text primary key `id`, then `grp` and `key_text` (the
//! owning key's directory text); a row lives on its key's shard.

/// The type of a column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Col {
    Text,
    OptText,
    Big,
    Int,
}

/// One of the keyed tables.
#[derive(Debug)]
pub(crate) struct KeyedTable {
    pub(crate) name: &'static str,
    /// Every column, `id`, `grp` and `key_text` first.
    pub(crate) columns: &'static [(&'static str, Col)],
}

const HEAD: [(&str, Col); 3] = [
    ("id", Col::Text),
    ("grp", Col::Text),
    ("key_text", Col::Text),
];

macro_rules! columns {
    ($($name:literal: $col:ident),*) => {
        &[HEAD[0], HEAD[1], HEAD[2], $(($name, Col::$col)),*]
    };
}

pub(crate) const OUTBOX: KeyedTable = KeyedTable {
    name: "shardkit_outbox",
    columns: columns!("seq": Big, "to_grp": Text, "to_key": Text, "kind": Text, "payload": Text,
        "state": Text, "attempts": Int, "next_at": Big, "created_at": Big, "last_error": OptText),
};

pub(crate) const INBOX: KeyedTable = KeyedTable {
    name: "shardkit_inbox",
    columns: columns!("received_at": Big),
};

pub(crate) const SAGAS: KeyedTable = KeyedTable {
    name: "shardkit_sagas",
    columns: columns!("name": Text, "step": Int, "state": Text, "data": Text, "attempts": Int,
        "next_at": Big, "created_at": Big, "updated_at": Big, "error": OptText),
};

pub(crate) const REQUESTS: KeyedTable = KeyedTable {
    name: "shardkit_requests",
    columns: columns!("request_id": Text, "outcome": OptText, "created_at": Big),
};

/// Every keyed table, in the order a move copies them.
pub(crate) const ALL: [&KeyedTable; 4] = [&OUTBOX, &INBOX, &SAGAS, &REQUESTS];

impl KeyedTable {
    /// A row's values in column order, read from a query result.
    pub(crate) fn read(
        &self,
        row: &sea_orm::QueryResult,
    ) -> Result<Vec<sea_orm::Value>, sea_orm::DbErr> {
        use sea_orm::Value;
        self.columns
            .iter()
            .map(|&(name, col)| {
                Ok(match col {
                    Col::Text => Value::String(Some(row.try_get::<String>("", name)?)),
                    Col::OptText => Value::String(row.try_get::<Option<String>>("", name)?),
                    Col::Big => Value::BigInt(Some(row.try_get::<i64>("", name)?)),
                    Col::Int => Value::Int(Some(row.try_get::<i32>("", name)?)),
                })
            })
            .collect()
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = sea_orm::sea_query::Alias> + '_ {
        self.columns
            .iter()
            .map(|(n, _)| sea_orm::sea_query::Alias::new(*n))
    }
}

/// A row's text at column `i` (`id` is 0, `key_text` is 2).
pub(crate) fn text_at(row: &[sea_orm::Value], i: usize) -> &str {
    match row.get(i) {
        Some(sea_orm::Value::String(Some(s))) => s.as_str(),
        _ => "",
    }
}
