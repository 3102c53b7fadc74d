//! Reads planned as data: [`ReadPlan`], what `.explain()` prints.

use crate::entity::ShardedEntity;
use crate::error::ShardFailure;
use crate::topology::{ShardId, Target};
use sea_orm::Select;
use std::time::Duration;

/// Which statement shape a read runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReadOp {
    All,
    One,
    Count,
}

/// A read planned before any of its statements runs: the shards, each
/// one's statement (already shaped), and what the merge applies.
pub(super) struct Plan<E: ShardedEntity> {
    /// One key's shard and its statement, when it answers as is (no merge).
    pub(super) single: Option<(Target, Box<Select<E>>)>,
    /// The statements of a multi-shard read, per shard (several per shard
    /// when a key list is chunked under the parameter limit).
    pub(super) parts: Vec<(ShardId, Select<E>)>,
    /// Distinct shards asked.
    pub(super) asked: usize,
    /// How the route was chosen, for [`ReadPlan`].
    pub(super) route: PlannedRoute,
    /// Whether the route came from a global index (a failure of the one
    /// owner shard is then reported like a multi-shard read's).
    pub(super) indexed: bool,
    /// The merged result's limit and offset.
    pub(super) limit: Option<u64>,
    pub(super) offset: u64,
    /// The index lookup's failure, when the read scatters without the
    /// index (reported beside the shards' own failures).
    pub(super) lookup_failed: Option<ShardFailure>,
    /// For a scatter of a `movable` group: the map as it was when the
    /// shards were chosen, which decides the shard each row is read from
    /// (a moving row is on its source and its target). `None`: each key
    /// is read from its owner only.
    pub(super) owners: Option<crate::topology::MapSnapshot>,
}

/// What a read will do, computed before any of its statements runs
/// ([`Find::explain`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadPlan {
    /// The entity group.
    pub group: &'static str,
    /// The table read.
    pub table: &'static str,
    /// How the shards were chosen.
    pub route: PlannedRoute,
    /// Every statement, with the shard it runs on, in shard order.
    pub statements: Vec<PlannedStatement>,
    /// How the shards' rows combine; `None` when one key's shard answers
    /// with the statement as written.
    pub merge: Option<MergePlan>,
    /// Whether a failed shard is reported beside the rows (`.partial()`)
    /// instead of failing the read.
    pub partial: bool,
    /// How long each shard may take.
    pub timeout: Option<Duration>,
    /// How many shards are asked at once.
    pub max_concurrency: usize,
}

/// How a [`ReadPlan`] chose its shards.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlannedRoute {
    /// One shard key (`.key(k)`), in `bucket` when the placement hashes.
    Key {
        /// The key's bucket.
        bucket: Option<u32>,
    },
    /// Several shard keys (`.keys(..)`), distinct ones counted.
    Keys {
        /// Distinct keys.
        keys: usize,
    },
    /// Every shard of the group (`.scatter()`).
    Scatter,
    /// A global index (`.by_index(..)`).
    Index {
        /// The index table consulted.
        index: String,
        /// The shard keys it listed; `None` while the index is `write_only`
        /// (the read scatters).
        keys: Option<usize>,
    },
}

/// One statement of a [`ReadPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedStatement {
    /// The shard it runs on.
    pub shard: String,
    /// The SQL, with its values inlined for reading (it is sent with bound
    /// parameters). Values are as the backend quotes them, so a string
    /// value may hold a newline or an escape byte; the plan's `Display`
    /// shows such characters escaped (`\n`, `\u{1b}`).
    pub sql: String,
}

/// How a multi-shard [`ReadPlan`] merges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergePlan {
    /// Columns the rows are merged by, and whether descending.
    pub order: Vec<(&'static str, bool)>,
    /// Rows kept after the offset.
    pub limit: Option<u64>,
    /// Rows skipped from the merged order.
    pub offset: u64,
}

impl std::fmt::Display for ReadPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "read {} (group {}) ", self.table, self.group)?;
        match &self.route {
            PlannedRoute::Key { bucket: Some(b) } => write!(f, "by key, bucket {b}")?,
            PlannedRoute::Key { bucket: None } => write!(f, "by key")?,
            PlannedRoute::Keys { keys } => write!(f, "by {keys} keys")?,
            PlannedRoute::Scatter => write!(f, "on every shard")?,
            PlannedRoute::Index {
                index,
                keys: Some(n),
            } => write!(f, "through index {} ({n} keys)", escape_controls(index))?,
            PlannedRoute::Index { index, keys: None } => write!(
                f,
                "through index {} (write_only: every shard)",
                escape_controls(index)
            )?,
        }
        let shards: std::collections::BTreeSet<&str> =
            self.statements.iter().map(|s| s.shard.as_str()).collect();
        write!(f, "; {} shard(s)", shards.len())?;
        match self.timeout {
            Some(t) => write!(f, ", timeout {} ms", t.as_millis())?,
            None => write!(f, ", no timeout")?,
        }
        write!(
            f,
            ", {} at once, {}",
            self.max_concurrency,
            if self.partial {
                "failed shards reported"
            } else {
                "any failed shard fails the read"
            }
        )?;
        // One line per statement, whatever its values hold: a key with a
        // newline or a terminal escape must not print a line of its own.
        for statement in &self.statements {
            write!(
                f,
                "\n  {}: {}",
                escape_controls(&statement.shard),
                escape_controls(&statement.sql)
            )?;
        }
        if let Some(merge) = &self.merge {
            write!(f, "\n  merge")?;
            if merge.order.is_empty() {
                write!(f, " in shard order")?;
            }
            for (i, (column, desc)) in merge.order.iter().enumerate() {
                let sep = if i == 0 { " by" } else { "," };
                write!(f, "{sep} {column} {}", if *desc { "DESC" } else { "ASC" })?;
            }
            if merge.offset > 0 {
                write!(f, ", skip {}", merge.offset)?;
            }
            if let Some(limit) = merge.limit {
                write!(f, ", keep {limit}")?;
            }
        }
        Ok(())
    }
}

/// `text` with every control character (newlines, tabs, escape bytes, C1
/// controls) and every character that reorders or breaks lines on a
/// terminal (bidirectional overrides and isolates, line and paragraph
/// separators) written as an escape: `\n`, `\r`, `\t`, otherwise
/// `\u{1b}`. What a plan prints of a value can then not pass for a line of
/// the plan, nor drive the terminal it is printed on. Other text, quotes and
/// backslashes included, is unchanged. Print any text a user typed or a
/// database returned through it to keep it on one line (the operator's
/// command line prints its errors so).
///
/// ```
/// use shardkit::read::escape_controls;
/// assert_eq!(escape_controls("plain 'text'"), "plain 'text'");
/// assert_eq!(escape_controls("a\nb\u{1b}[2J"), "a\\nb\\u{1b}[2J");
/// ```
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    fn hostile(c: char) -> bool {
        c.is_control()
            || matches!(
                c,
                '\u{200e}'
                    | '\u{200f}'
                    | '\u{2028}'
                    | '\u{2029}'
                    | '\u{202a}'..='\u{202e}'
                    | '\u{2066}'..='\u{2069}'
            )
    }
    if !text.chars().any(hostile) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hostile(c) => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}
