//! shardkit's own tables whose rows belong to a key (the outbox, the inbox,
//! sagas, idempotent requests): their columns, as data, so that code that
//! is not typed by an entity (a bucket move) can read and write them.
//!
//! Each has one text primary key `id`, then `grp` and `key_text` (the
//! owning key's directory text); a row lives on its key's shard.

use sea_orm::Value;
use sea_orm::sea_query::{Alias, Condition, Expr, ExprTrait};
use std::time::Duration;

/// How long the inbox keeps a message id: 7 days. A message older than
/// this is parked instead of delivered (its id may be gone from the inbox,
/// so it could be applied twice); `retry` delivers it anyway.
pub const INBOX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long [`Cluster::transaction_once`](crate::Cluster::transaction_once)
/// keeps a request's outcome: a retry within this time (24 hours) gets the
/// stored outcome; after it, the request id is forgotten and a retry runs
/// the work again. The relay ([`Outbox::run`](crate::Outbox::run)) deletes
/// older outcomes.
pub const REQUEST_TTL: Duration = Duration::from_secs(24 * 3600);

/// Which rows of a keyed table go by age: the running relay deletes them
/// (about once a minute, on every shard), and a bucket move's verify
/// leaves them out (a relay's prune deletes them on one side of a move
/// with no change-log entry, and an expired row is as good as gone).
#[derive(Debug)]
pub(crate) struct Expiry {
    /// The row's time column (milliseconds since the epoch).
    pub(crate) at: &'static str,
    pub(crate) ttl: Duration,
    /// Which rows go by age; the others stay however old.
    pub(crate) only: Only,
}

/// The rows an [`Expiry`] applies to.
#[derive(Debug)]
pub(crate) enum Only {
    Every,
    /// Rows whose column does not start with the prefix.
    NotPrefixed(&'static str, &'static str),
    /// Rows whose column holds one of the values.
    OneOf(&'static str, &'static [&'static str]),
}

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
    /// Which rows go by age, if any.
    pub(crate) expiry: Option<Expiry>,
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
    // A message goes when it is applied or discarded, never by age.
    expiry: None,
};

pub(crate) const INBOX: KeyedTable = KeyedTable {
    name: "shardkit_inbox",
    columns: columns!("received_at": Big),
    // Saga step markers stay: an unfinished saga's compensation reads them,
    // however long it waited.
    expiry: Some(Expiry {
        at: "received_at",
        ttl: INBOX_TTL,
        only: Only::NotPrefixed("id", "saga:"),
    }),
};

pub(crate) const SAGAS: KeyedTable = KeyedTable {
    name: "shardkit_sagas",
    columns: columns!("name": Text, "step": Int, "state": Text, "data": Text, "attempts": Int,
        "next_at": Big, "created_at": Big, "updated_at": Big, "error": OptText),
    // Finished sagas, kept as long as inbox ids.
    expiry: Some(Expiry {
        at: "updated_at",
        ttl: INBOX_TTL,
        only: Only::OneOf("state", &["done", "compensated"]),
    }),
};

pub(crate) const REQUESTS: KeyedTable = KeyedTable {
    name: "shardkit_requests",
    columns: columns!("request_id": Text, "outcome": OptText, "created_at": Big),
    expiry: Some(Expiry {
        at: "created_at",
        ttl: REQUEST_TTL,
        only: Only::Every,
    }),
};

/// Every keyed table, in the order a move copies them.
pub(crate) const ALL: [&KeyedTable; 4] = [&OUTBOX, &INBOX, &SAGAS, &REQUESTS];

impl KeyedTable {
    /// A row's values in column order, read from a query result.
    pub(crate) fn read(
        &self,
        row: &sea_orm::QueryResult,
    ) -> Result<Vec<sea_orm::Value>, sea_orm::DbErr> {
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

    /// The rows that have gone by age at `now_ms` (see [`Expiry`]), as a
    /// `WHERE` condition; `None` when none go by age.
    pub(crate) fn expired_where(&self, now_ms: i64) -> Option<Condition> {
        let e = self.expiry.as_ref()?;
        let before = now_ms - e.ttl.as_millis() as i64;
        let old = Condition::all().add(Expr::col(Alias::new(e.at)).lt(before));
        Some(match e.only {
            Only::Every => old,
            Only::NotPrefixed(col, prefix) => {
                old.add(Expr::col(Alias::new(col)).not_like(format!("{prefix}%")))
            }
            Only::OneOf(col, values) => {
                old.add(Expr::col(Alias::new(col)).is_in(values.iter().copied()))
            }
        })
    }

    /// Whether `row` (its values in column order) has gone by age at
    /// `now_ms`, or goes within `margin` after it.
    pub(crate) fn expires(&self, row: &[Value], now_ms: i64, margin: Duration) -> bool {
        let Some(e) = &self.expiry else {
            return false;
        };
        let at = match self.index(e.at).and_then(|i| row.get(i)) {
            Some(Value::BigInt(Some(at))) => *at,
            _ => return false,
        };
        if at >= now_ms - e.ttl.as_millis() as i64 + margin.as_millis() as i64 {
            return false;
        }
        let text = |col| self.index(col).map_or("", |i| text_at(row, i));
        match e.only {
            Only::Every => true,
            Only::NotPrefixed(col, prefix) => !text(col).starts_with(prefix),
            Only::OneOf(col, values) => values.contains(&text(col)),
        }
    }

    fn index(&self, column: &str) -> Option<usize> {
        self.columns.iter().position(|(name, _)| *name == column)
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

#[cfg(test)]
mod tests {
    use super::{INBOX, INBOX_TTL, OUTBOX, REQUESTS, SAGAS};
    use sea_orm::Value;
    use std::time::Duration;

    fn text(s: &str) -> Value {
        Value::String(Some(s.to_owned()))
    }

    #[test]
    fn rows_go_by_age_as_the_prune_deletes_them() {
        let day = 24 * 3_600_000_i64;
        let now = 100 * day;
        let hour = Duration::from_secs(3600);
        let inbox =
            |id: &str, at: i64| vec![text(id), text("G"), text("1"), Value::BigInt(Some(at))];
        // Inbox ids older than a week go, saga markers never.
        let week = INBOX_TTL.as_millis() as i64;
        assert!(INBOX.expires(&inbox("m1", now - week - 1), now, Duration::ZERO));
        assert!(!INBOX.expires(&inbox("m1", now - week + 1), now, Duration::ZERO));
        assert!(INBOX.expires(&inbox("m1", now - week + 1), now, hour));
        assert!(!INBOX.expires(&inbox("saga:1:0:run", 0), now, hour));
        // Finished sagas only.
        let saga = |state: &str| {
            let mut row = vec![
                text("s1"),
                text("G"),
                text("1"),
                text("pay"),
                Value::Int(Some(0)),
            ];
            row.extend([
                text(state),
                text("{}"),
                Value::Int(Some(0)),
                Value::BigInt(Some(0)),
            ]);
            row.extend([
                Value::BigInt(Some(0)),
                Value::BigInt(Some(0)),
                Value::String(None),
            ]);
            row
        };
        assert!(SAGAS.expires(&saga("done"), now, Duration::ZERO));
        assert!(SAGAS.expires(&saga("compensated"), now, Duration::ZERO));
        assert!(!SAGAS.expires(&saga("running"), now, Duration::ZERO));
        let request = vec![
            text("r"),
            text("G"),
            text("1"),
            text("req"),
            text("1"),
            Value::BigInt(Some(now - day - 1)),
        ];
        assert!(REQUESTS.expires(&request, now, Duration::ZERO));
        // Messages never go by age; the prune has nothing to delete there.
        assert!(OUTBOX.expired_where(now).is_none());
        assert!(REQUESTS.expired_where(now).is_some());
    }
}
