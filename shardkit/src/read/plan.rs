//! Reads planned as data: [`ReadPlan`], what `.explain()` prints.

use crate::entity::{ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError, ShardFailure};
use crate::read::index::{IndexQuery, exact_eq};
use crate::read::keys::add_key;
use crate::read::merge::count_shards;
use crate::read::request::Read;
use crate::read::route::RouteSpec;
use crate::read::{KeyOf, ReadFrom, read_from};
use crate::topology::{ShardId, Target};
use sea_orm::sea_query::Expr;
use sea_orm::{DbBackend, IdenStatic, IntoSimpleExpr, Order, QueryTrait, Select};
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
/// ([`Find::explain`](crate::read::Find::explain)).
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

impl<E: ShardedEntity> Read<E> {
    /// Plans the read: resolves an index route (once), routes the keys,
    /// builds and shapes each shard's statement. Fails before any I/O of the
    /// read itself when the ordering cannot be merged or a key cannot be
    /// routed.
    pub(super) async fn plan(
        &self,
        select: Box<Select<E>>,
        spec: RouteSpec<KeyOf<E>>,
        op: ReadOp,
    ) -> Result<Plan<E>> {
        let mut select = select;
        let seen_epoch = match &self.consistency {
            crate::exec::Consistency::AtLeast(session) => session.epoch(Self::group()),
            _ => None,
        };
        if let Some(refresh) = self
            .guard
            .as_ref()
            .and_then(|g| g.before_routing(Self::group(), seen_epoch, self.timeout))
        {
            refresh.await?;
        }
        let from = match &self.guard {
            Some(guard) => {
                if let Some((joined, table)) = self.joined {
                    // Its side was joined from the right table when the read
                    // was made; a refusal still stands.
                    guard.check(joined, table)?;
                }
                guard.check(std::any::TypeId::of::<E>(), table_name::<E>())?
            }
            None => None,
        };
        if let Some(from) = &from {
            read_from::<E>(&mut select, from);
        }
        let (mut select, spec, index, lookup_failed) = match spec {
            RouteSpec::Index(..) => self.resolve_index(select, spec, from.as_ref()).await?,
            spec => (select, spec, None, None),
        };
        let indexed = index.is_some();
        let described = |route: PlannedRoute| match &index {
            Some((table, keys)) => PlannedRoute::Index {
                index: table.clone(),
                keys: *keys,
            },
            None => route,
        };
        let offset = self.offset.unwrap_or(0);
        if let RouteSpec::One(key) = &spec {
            // Hash, range and modulo placements route without I/O.
            let target = match self.shards.route_now::<E::Group>(key)? {
                Some(target) => target,
                None => self.shards.route::<E::Group>(key).await?,
            };
            tracing::debug!(key = ?key, shard = self.shards.shard_name(target.shard), "routed read");
            let backend = self.shards.shard_conn(target.shard).get_database_backend();
            add_key::<E>(&mut select, key, backend);
            // One key's shard answers the statement as written.
            if op != ReadOp::Count {
                self.shape(&mut select, self.limit, true);
            }
            return Ok(Plan {
                single: Some((target, select)),
                parts: Vec::new(),
                asked: 1,
                route: described(PlannedRoute::Key {
                    bucket: target.bucket,
                }),
                indexed,
                limit: self.limit,
                offset,
                lookup_failed: None,
                owners: None,
            });
        }
        self.check_mergeable()?;
        let route = described(match &spec {
            RouteSpec::Many(keys) => PlannedRoute::Keys { keys: keys.len() },
            _ => PlannedRoute::Scatter,
        });
        // Taken before the shards are chosen: a shard the map gives a
        // bucket later is asked too, and the rows kept are those of the
        // owners this map names (which keep them until cleaning).
        let owners = match &spec {
            RouteSpec::All => self.map_snapshot(),
            _ => None,
        };
        let mut parts = self.fan_out(*select, spec).await?;
        if let Some(failed) = &lookup_failed {
            // The shard whose index lookup failed is not asked again.
            parts.retain(|(id, _)| self.shards.shard_name(*id) != failed.shard);
        }
        let limit = match op {
            ReadOp::One => Some(1),
            _ => self.limit,
        };
        if op != ReadOp::Count {
            for (_, select) in &mut parts {
                self.shape(select, limit, false);
            }
        }
        Ok(Plan {
            single: None,
            asked: count_shards(&parts),
            parts,
            route,
            indexed,
            limit,
            offset,
            lookup_failed,
            owners,
        })
    }

    /// The printable form of a plan.
    pub(super) fn describe(&self, plan: Plan<E>, partial: bool) -> ReadPlan {
        let single = plan
            .single
            .as_ref()
            .map(|(target, select)| (target.shard, &**select));
        let statements = single
            .into_iter()
            .chain(plan.parts.iter().map(|(id, select)| (*id, select)))
            .map(|(id, select)| PlannedStatement {
                shard: self.shards.shard_name(id).to_owned(),
                sql: self
                    .shards
                    .shard_conn(id)
                    .get_database_backend()
                    .build(QueryTrait::as_query(select))
                    .to_string(),
            })
            .collect();
        let merge = plan.single.is_none().then(|| MergePlan {
            order: self
                .order
                .iter()
                .map(|(c, o)| (c.as_str(), matches!(o, Order::Desc)))
                .collect(),
            limit: plan.limit,
            offset: plan.offset,
        });
        ReadPlan {
            group: Self::group(),
            table: table_name::<E>(),
            route: plan.route,
            statements,
            merge,
            partial,
            timeout: self.timeout,
            max_concurrency: self.concurrency,
        }
    }

    /// Applies ordering and paging. A single shard gets them as written; a
    /// shard of a multi-shard read returns its first `limit + offset` rows and
    /// the merge applies the offset.
    pub(super) fn shape(&self, select: &mut Select<E>, limit: Option<u64>, single: bool) {
        let query = QueryTrait::query(select);
        for (column, order) in &self.order {
            query.order_by_expr(column.into_simple_expr(), order.clone());
        }
        let offset = self.offset.unwrap_or(0);
        match (limit, single) {
            (Some(limit), true) => {
                query.limit(limit);
            }
            (Some(limit), false) => {
                query.limit(limit.saturating_add(offset));
            }
            (None, _) => {}
        }
        if single && offset > 0 {
            query.offset(offset);
        }
    }

    /// Resolves an index read into the keys the index lists (one key takes
    /// the single-shard path) or, while the index fills, a scatter; either
    /// way the statement also filters on the indexed column, so a dangling or
    /// stale index row never yields a wrong row. Other routes pass through.
    /// Returns the index table consulted and how many keys it listed.
    pub(super) async fn resolve_index(
        &self,
        mut select: Box<Select<E>>,
        spec: RouteSpec<KeyOf<E>>,
        from: Option<&ReadFrom>,
    ) -> Result<(
        Box<Select<E>>,
        RouteSpec<KeyOf<E>>,
        Option<(String, Option<usize>)>,
        Option<ShardFailure>,
    )> {
        Ok(match spec {
            RouteSpec::Index(column, value) => {
                // Whatever the index finds, ordering follows multi-shard rules.
                self.check_mergeable()?;
                let (col, unique) = E::GLOBAL_INDEXES
                    .iter()
                    .find(|(c, _)| c.as_str() == column)
                    .ok_or_else(|| {
                        ShardError::config(
                            format!("{}.{column}", table_name::<E>()),
                            "no global index on this column: add `#[shardkit(global_index)]` to the field",
                        )
                    })?;
                let lookup = self.index.as_ref().ok_or_else(|| {
                    ShardError::config(
                        format!("{}.{column}", table_name::<E>()),
                        "index reads need the cluster's global-index service: start them with `cluster.find()`",
                    )
                })?;
                let mut query = IndexQuery {
                    group: Self::group(),
                    entity: table_name::<E>(),
                    column: col.as_str(),
                    unique: *unique,
                };
                // Read from another table: its index on the column is the
                // one kept; without one, every shard is asked (the
                // statement filters on the value).
                let other_index = from.map(|f| {
                    (
                        f.table,
                        f.indexes
                            .iter()
                            .find(|(c, _)| *c == query.column)
                            .map(|(_, u)| *u),
                    )
                });
                if let Some((table, unique)) = other_index {
                    query.entity = table;
                    query.unique = unique.unwrap_or(query.unique);
                }
                let index_table = lookup.table(&query);
                let backend = self
                    .shards
                    .topology()
                    .shards_of(Self::group())?
                    .first()
                    .map_or(DbBackend::Postgres, |id| {
                        self.shards.shard_conn(*id).get_database_backend()
                    });
                QueryTrait::query(&mut *select).cond_where(exact_eq(
                    Expr::col((E::default(), *col)),
                    &value,
                    backend,
                ));
                // The lookup runs under the read's timeout and the index
                // shard's breaker. When it fails, the read asks every other
                // shard (the statement filters on the value) and reports the
                // failed one: strict reads fail with it, `.partial()` returns
                // the healthy shards' rows.
                let shards = self.shards.topology().shards_of(Self::group())?;
                let lookup_shard = match crate::key::value_text(&value) {
                    Some(text) => lookup.index_shard(&self.shards, &query, &text)?,
                    None => shards[0],
                };
                if let Some((_, None)) = other_index {
                    return Ok((select, RouteSpec::All, None, None));
                }
                let found = lookup.lookup(&self.shards, &query, &value);
                let looked = self
                    .shards
                    .bounded(lookup_shard, Self::group(), self.timeout, found)
                    .await
                    .map(|keys| {
                        keys.map(|texts| {
                            let mut keys: Vec<KeyOf<E>> = Vec::with_capacity(texts.len());
                            for key in texts
                                .iter()
                                .filter_map(|t| KeyOf::<E>::from_directory_text(t))
                            {
                                if !keys.contains(&key) {
                                    keys.push(key);
                                }
                            }
                            keys
                        })
                    });
                let mut lookup_failed = None;
                let (spec, found) = match looked {
                    Ok(Some(mut keys)) if keys.len() == 1 => {
                        (RouteSpec::One(keys.remove(0)), Some(1))
                    }
                    Ok(Some(keys)) => {
                        let n = keys.len();
                        (RouteSpec::Many(keys), Some(n))
                    }
                    Ok(None) => (RouteSpec::All, None),
                    Err(error) => {
                        let shard = error
                            .shard()
                            .unwrap_or_else(|| self.shards.shard_name(lookup_shard))
                            .to_owned();
                        lookup_failed = Some(ShardFailure {
                            shard,
                            error: Box::new(error),
                        });
                        (RouteSpec::All, None)
                    }
                };
                (select, spec, Some((index_table, found)), lookup_failed)
            }
            other => (select, other, None, None),
        })
    }

    /// Refuses, before any I/O, an ordering a multi-shard merge cannot apply.
    pub(super) fn check_mergeable(&self) -> Result<()> {
        match self
            .order
            .iter()
            .find(|(_, o)| !matches!(o, Order::Asc | Order::Desc))
        {
            Some((column, _)) => Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: format!(
                    "`{}` is ordered by a custom field list; a multi-shard read merges only Asc and Desc",
                    column.as_str()
                ),
            }),
            None => Ok(()),
        }
    }

    /// How many keys fit in one `IN` list on `backend`, leaving room for the
    /// read's own parameters and its `LIMIT`.
    pub(super) fn key_chunk(&self, select: &Select<E>, backend: DbBackend) -> Result<usize> {
        let limit: usize = match backend {
            DbBackend::Sqlite => 32_766,
            _ => 65_535,
        };
        let used = backend
            .build(QueryTrait::as_query(select))
            .values
            .map_or(0, |v| v.0.len());
        let room = limit.saturating_sub(used + 2);
        if room == 0 {
            return Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: format!("the read already binds {used} parameters, the backend's limit"),
            });
        }
        Ok(room)
    }
}
