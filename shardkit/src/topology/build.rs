//! Building a [`Topology`] from a config: validating shard, host and group
//! entries, placements, bucket owners and key ranges.

use crate::error::{Result, ShardError};
use crate::topology::config::{ClusterConfig, check_database_name, check_url};
use crate::topology::layout::{
    DEFAULT_BUCKETS, DEFAULT_DIRECTORY_TABLE, DirectorySpec, MAX_BUCKETS, Placement, ReplicaSpec,
    ShardSpec, Topology,
};
use crate::topology::owners::ShardId;
use crate::topology::url::DatabaseUrl;
use crate::topology::{
    BucketOwners, BucketRange, GroupConfig, KeyRange, PlacementKind, RangeBound, RangeOwners,
    RangeUnit,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

impl Topology {
    /// Validates a config and builds the routing tables.
    pub fn build(config: &ClusterConfig) -> Result<Self> {
        config.check_settings()?;
        let mut hosts: HashMap<&str, &DatabaseUrl> = HashMap::new();
        for (i, host) in config.hosts.iter().enumerate() {
            let entry = format!("hosts[{i}] ({:?})", host.name);
            if host.name.is_empty() {
                return Err(ShardError::config(entry, "a host needs a non-empty `name`"));
            }
            check_url(&entry, &host.url)?;
            if hosts.insert(&host.name, &host.url).is_some() {
                return Err(ShardError::config(
                    entry,
                    format!("host `{}` is defined twice", host.name),
                ));
            }
        }

        if config.shards.is_empty() {
            return Err(ShardError::config(
                "shards",
                "define at least one `[[shards]]` entry",
            ));
        }
        if config.shards.len() > u32::MAX as usize {
            return Err(ShardError::config("shards", "too many shards"));
        }
        let mut shards = Vec::with_capacity(config.shards.len());
        let mut by_name = HashMap::new();
        for (i, shard) in config.shards.iter().enumerate() {
            let entry = format!("shards[{i}] ({:?})", shard.name);
            if shard.name.is_empty() {
                return Err(ShardError::config(
                    entry,
                    "a shard needs a non-empty `name`",
                ));
            }
            if shard.name.contains(['=', ';']) {
                // A session's text lists `shard=position;...`.
                return Err(ShardError::config(
                    entry,
                    "a shard's name may not contain `=` or `;`",
                ));
            }
            if let Some(&ShardId(first)) = by_name.get(&shard.name) {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "shard `{}` is defined twice (first at shards[{first}])",
                        shard.name
                    ),
                ));
            }
            let url = locate_database(&entry, &hosts, &shard.url, &shard.host, &shard.database)?;
            // Two names for one database would make every scatter read it twice,
            // and a bucket move between them would delete the rows it moved.
            // (Each `sqlite::memory:` pool is a database of its own; a named
            // in-memory database with `cache=shared` is one for every pool.)
            let in_memory = url.is_sqlite_memory();
            if let Some(other) = shards
                .iter()
                .position(|s: &ShardSpec| s.url == url)
                .filter(|_| !in_memory)
            {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "shard `{}` is the same database as shards[{other}]",
                        shard.name
                    ),
                ));
            }
            by_name.insert(shard.name.clone(), ShardId(i as u32));
            let replicas = replica_specs(&entry, &shard.name, &url, &shard.replicas)?;
            shards.push(ShardSpec {
                name: shard.name.clone(),
                url,
                host: shard.host.clone(),
                replicas,
            });
        }

        let mut ticket_servers: Vec<ShardSpec> = Vec::new();
        for (i, server) in config.ids.servers.iter().enumerate() {
            let entry = format!("ids.servers[{i}] ({:?})", server.name);
            if server.name.is_empty() {
                return Err(ShardError::config(
                    entry,
                    "a ticket server needs a non-empty `name`",
                ));
            }
            if ticket_servers.iter().any(|s| s.name == server.name) {
                return Err(ShardError::config(
                    entry,
                    format!("ticket server `{}` is defined twice", server.name),
                ));
            }
            let url = locate_database(&entry, &hosts, &server.url, &server.host, &server.database)?;
            ticket_servers.push(ShardSpec {
                name: server.name.clone(),
                url,
                host: server.host.clone(),
                replicas: Vec::new(),
            });
        }
        check_replica_names(&shards)?;

        for (index, shard) in &config.gsi.pin {
            if !by_name.contains_key(shard) {
                return Err(ShardError::config(
                    format!("gsi.pin.{index}"),
                    format!("shard `{shard}` is referenced but not defined"),
                ));
            }
        }

        let mut topology = Topology {
            shards,
            ticket_servers,
            by_name,
            groups: BTreeMap::new(),
            group_shards: HashMap::new(),
            movable: Vec::new(),
            directories: Vec::new(),
        };
        for (name, group) in &config.groups {
            if name.contains(['=', ';']) {
                // A session's text lists `group=map:epoch;...`.
                return Err(ShardError::config(
                    format!("groups.{name}"),
                    "a group's name may not contain `=` or `;`",
                ));
            }
            let placement = topology.build_placement(name, group, &hosts)?;
            let shards = topology.compute_shards_of(&placement);
            topology.groups.insert(name.clone(), placement);
            topology.group_shards.insert(name.clone(), shards);
            if group.movable {
                topology.movable.push(name.clone());
            }
        }
        Ok(topology)
    }

    fn shard_ref(&self, entry: &str, name: &str) -> Result<ShardId> {
        self.by_name.get(name).copied().ok_or_else(|| {
            ShardError::config(
                entry,
                format!(
                    "shard `{name}` is referenced but not defined; defined shards: {}",
                    self.shard_names().collect::<Vec<_>>().join(", ")
                ),
            )
        })
    }

    fn build_placement(
        &mut self,
        name: &str,
        group: &GroupConfig,
        hosts: &HashMap<&str, &DatabaseUrl>,
    ) -> Result<Placement> {
        let base = format!("groups.{name}");
        let only = |field: &str, present: bool, kinds: &str| -> Result<()> {
            if present {
                Err(ShardError::config(
                    format!("{base}.{field}"),
                    format!("`{field}` applies only to placement = {kinds}"),
                ))
            } else {
                Ok(())
            }
        };
        let kind = group.placement;
        only(
            "buckets",
            group.buckets.is_some() && kind != PlacementKind::Hash,
            "\"hash\"",
        )?;
        only(
            "bucket_ranges",
            group.bucket_ranges.is_some() && kind != PlacementKind::Hash,
            "\"hash\"",
        )?;
        only(
            "ranges",
            group.ranges.is_some() && kind != PlacementKind::Range,
            "\"range\"",
        )?;
        only(
            "shards",
            group.shards.is_some() && !matches!(kind, PlacementKind::Hash | PlacementKind::Modulo),
            "\"hash\" or \"modulo\"",
        )?;
        only(
            "directory",
            group.directory.is_some() && kind != PlacementKind::Directory,
            "\"directory\"",
        )?;
        only(
            "movable",
            group.movable && !matches!(kind, PlacementKind::Hash | PlacementKind::Range),
            "\"hash\" or \"range\"",
        )?;

        match kind {
            PlacementKind::Hash => {
                let buckets = group.buckets.unwrap_or(DEFAULT_BUCKETS);
                if buckets == 0 {
                    return Err(ShardError::config(
                        format!("{base}.buckets"),
                        "zero buckets: a hash placement needs at least one bucket (default 1024)",
                    ));
                }
                if buckets > MAX_BUCKETS {
                    return Err(ShardError::config(
                        format!("{base}.buckets"),
                        format!(
                            "{buckets} buckets is more than the {MAX_BUCKETS} shardkit keeps in its routing table"
                        ),
                    ));
                }
                let owner = match &group.bucket_ranges {
                    Some(ranges) => {
                        if group.shards.is_some() {
                            return Err(ShardError::config(
                                format!("{base}.shards"),
                                "give either `bucket_ranges` or `shards`, not both",
                            ));
                        }
                        self.bucket_owners(&base, buckets, ranges)?
                    }
                    None => {
                        let ids = match &group.shards {
                            Some(names) if names.is_empty() => {
                                return Err(ShardError::config(
                                    format!("{base}.shards"),
                                    "an empty shard list places no bucket; list shards or omit `shards`",
                                ));
                            }
                            Some(names) => self.shard_list(&format!("{base}.shards"), names)?,
                            None => (0..self.shards.len() as u32).map(ShardId).collect(),
                        };
                        spread(buckets, &ids)
                    }
                };
                Ok(Placement::Hash {
                    buckets,
                    owner: Arc::new(BucketOwners::new(owner)),
                })
            }
            PlacementKind::Range => {
                let ranges = group.ranges.as_ref().filter(|r| !r.is_empty()).ok_or_else(|| {
                    ShardError::config(
                        format!("{base}.ranges"),
                        "a range placement needs `ranges = [{ shard = \"...\", from = ..., to = ... }, ...]`",
                    )
                })?;
                self.key_ranges(&base, ranges, group.movable)
            }
            PlacementKind::Modulo => {
                let names = group
                    .shards
                    .as_ref()
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| {
                        ShardError::config(
                            format!("{base}.shards"),
                            "a modulo placement needs `shards = [\"s0\", \"s1\", ...]`",
                        )
                    })?;
                let shards = self.shard_list(&format!("{base}.shards"), names)?;
                Ok(Placement::Modulo { shards })
            }
            PlacementKind::Directory => {
                let entry = format!("{base}.directory");
                let dir = group.directory.as_ref().ok_or_else(|| {
                    ShardError::config(
                        &entry,
                        "a directory placement needs `directory = { url = \"...\" }` (or `host` and `database`)",
                    )
                })?;
                let url = locate_database(&entry, hosts, &dir.url, &dir.host, &dir.database)?;
                let table = dir
                    .table
                    .clone()
                    .unwrap_or_else(|| DEFAULT_DIRECTORY_TABLE.to_owned());
                if table.is_empty() || !table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    return Err(ShardError::config(
                        format!("{entry}.table"),
                        "the directory table name may contain only ASCII letters, digits and `_`",
                    ));
                }
                self.directories.push(DirectorySpec {
                    group: name.to_owned(),
                    url,
                    table,
                });
                Ok(Placement::Directory {
                    directory: self.directories.len() - 1,
                })
            }
        }
    }

    fn shard_list(&self, entry: &str, names: &[String]) -> Result<Vec<ShardId>> {
        let mut seen = BTreeMap::new();
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                if let Some(first) = seen.insert(name.as_str(), i) {
                    return Err(ShardError::config(
                        format!("{entry}[{i}]"),
                        format!("shard `{name}` is listed twice (also at [{first}])"),
                    ));
                }
                self.shard_ref(&format!("{entry}[{i}]"), name)
            })
            .collect()
    }

    fn bucket_owners(
        &self,
        base: &str,
        buckets: u32,
        ranges: &[BucketRange],
    ) -> Result<Box<[ShardId]>> {
        let mut sorted: Vec<(usize, &BucketRange)> = ranges.iter().enumerate().collect();
        sorted.sort_by_key(|(_, r)| (r.first, r.last));
        let mut owner = Vec::with_capacity(buckets as usize);
        let mut next = 0u32;
        let mut previous: Option<usize> = None;
        for (i, range) in sorted {
            let entry = format!("{base}.bucket_ranges[{i}]");
            let shard = self.shard_ref(&entry, &range.shard)?;
            if range.last < range.first {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "`last` ({}) is before `first` ({})",
                        range.last, range.first
                    ),
                ));
            }
            if range.last >= buckets {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "bucket {} is out of range: the group has {buckets} buckets (0..={})",
                        range.last,
                        buckets - 1
                    ),
                ));
            }
            if range.first < next {
                let other = previous.map_or(String::new(), |p| format!(" and bucket_ranges[{p}]"));
                return Err(ShardError::config(
                    entry,
                    format!(
                        "buckets {}..={} overlap{other}: bucket {} is assigned twice",
                        range.first, range.last, range.first
                    ),
                ));
            }
            if range.first > next {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "buckets {next}..={} are not assigned to any shard",
                        range.first - 1
                    ),
                ));
            }
            owner.extend(std::iter::repeat_n(
                shard,
                (range.last - range.first + 1) as usize,
            ));
            next = range.last + 1;
            previous = Some(i);
        }
        if next < buckets {
            return Err(ShardError::config(
                format!("{base}.bucket_ranges"),
                format!(
                    "buckets {next}..={} are not assigned to any shard",
                    buckets - 1
                ),
            ));
        }
        Ok(owner.into_boxed_slice())
    }

    fn key_ranges(&self, base: &str, ranges: &[KeyRange], movable: bool) -> Result<Placement> {
        let mut out = Vec::with_capacity(ranges.len());
        let int_bounds = ranges
            .iter()
            .flat_map(|r| [&r.from, &r.to])
            .flatten()
            .map(|b| matches!(b, RangeBound::Int(_)))
            .collect::<Vec<_>>();
        if int_bounds.iter().any(|&b| b) && int_bounds.iter().any(|&b| !b) {
            return Err(ShardError::config(
                format!("{base}.ranges"),
                "range bounds mix integers and strings; use one kind for the whole group",
            ));
        }
        let mut sorted: Vec<(usize, &KeyRange)> = ranges.iter().enumerate().collect();
        // Unbounded-below sorts first (None < Some).
        sorted.sort_by(|a, b| a.1.from.cmp(&b.1.from));
        let last = sorted.len() - 1;
        for (pos, &(i, range)) in sorted.iter().enumerate() {
            let entry = format!("{base}.ranges[{i}]");
            let shard = self.shard_ref(&entry, &range.shard)?;
            if let (Some(from), Some(to)) = (&range.from, &range.to)
                && from >= to
            {
                return Err(ShardError::config(
                    entry,
                    format!("empty range: `from` ({from}) must be below `to` ({to})"),
                ));
            }
            if range.from.is_none() && pos != 0 {
                return Err(ShardError::config(
                    entry,
                    "only one range may be unbounded below (omit `from`)",
                ));
            }
            if range.to.is_none() && pos != last {
                let (j, next) = sorted[pos + 1];
                return Err(ShardError::config(
                    entry,
                    format!(
                        "unbounded above (no `to`) but ranges[{j}] starts at {} after it: the ranges overlap",
                        next.from
                            .as_ref()
                            .map_or("-inf".to_owned(), |b| b.to_string())
                    ),
                ));
            }
            if pos < last {
                let (j, next) = sorted[pos + 1];
                let (Some(to), Some(next_from)) = (&range.to, &next.from) else {
                    // `to` is present (checked above); a later range without
                    // `from` overlaps everything below it.
                    return Err(ShardError::config(
                        format!("{base}.ranges[{j}]"),
                        "only one range may be unbounded below (omit `from`)",
                    ));
                };
                if to < next_from {
                    return Err(ShardError::config(
                        entry,
                        format!(
                            "gap between ranges: keys in [{to}, {next_from}) belong to no range (next is ranges[{j}])"
                        ),
                    ));
                }
                if to > next_from {
                    return Err(ShardError::config(
                        entry,
                        format!(
                            "ranges overlap: this range ends at {to} but ranges[{j}] starts at {next_from}"
                        ),
                    ));
                }
            }
            out.push(RangeUnit {
                id: pos as u32,
                from: range.from.clone(),
                to: range.to.clone(),
                shard,
            });
        }
        Ok(Placement::Range {
            ranges: Arc::new(RangeOwners::new(out, movable)),
        })
    }
}

/// Shard `shard`'s replicas (`entry` is its config entry), checked: a
/// SQLite shard has none, and a replica speaks its shard's protocol.
fn replica_specs(
    entry: &str,
    shard: &str,
    url: &DatabaseUrl,
    replicas: &[crate::topology::ReplicaConfig],
) -> Result<Vec<ReplicaSpec>> {
    let mut specs = Vec::with_capacity(replicas.len());
    for (j, replica) in replicas.iter().enumerate() {
        let entry = format!("{entry}.replicas[{j}]");
        if url.scheme() == Some("sqlite") {
            return Err(ShardError::config(
                entry,
                format!(
                    "shard `{shard}` is a SQLite database, which has no replicas: remove \
                     `replicas` from it (replicas are PostgreSQL or MySQL/MariaDB servers)"
                ),
            ));
        }
        if replica.name.is_empty() {
            return Err(ShardError::config(
                entry,
                "a replica needs a non-empty `name`",
            ));
        }
        check_url(&entry, &replica.url)?;
        fn same(scheme: Option<&str>) -> Option<&str> {
            match scheme {
                Some("postgresql") => Some("postgres"),
                Some("mariadb") => Some("mysql"),
                other => other,
            }
        }
        if same(replica.url.scheme()) != same(url.scheme()) {
            return Err(ShardError::config(
                entry,
                format!(
                    "replica `{}` is a {} URL but shard `{shard}` is {}: a replica serves \
                     its shard's database",
                    replica.name,
                    replica.url.scheme().unwrap_or("schemeless"),
                    url.scheme().unwrap_or("schemeless"),
                ),
            ));
        }
        // Physical replication copies the whole server: the replica's
        // database of the shard's name is the shard's.
        if let (Some(theirs), Some(ours)) = (database_of(&replica.url), database_of(url))
            && theirs != ours
        {
            return Err(ShardError::config(
                entry,
                format!(
                    "replica `{}` names database `{theirs}`, and shard `{shard}` is database \
                     `{ours}`: a replica serves its shard's database (the same name on the \
                     replica's server)",
                    replica.name
                ),
            ));
        }
        specs.push(ReplicaSpec {
            name: replica.name.clone(),
            url: replica.url.clone(),
        });
    }
    Ok(specs)
}

/// The database a server URL names (its path), if any.
fn database_of(url: &DatabaseUrl) -> Option<String> {
    let parsed = url::Url::parse(url.expose()).ok()?;
    let name = parsed.path().trim_start_matches('/');
    (!name.is_empty()).then(|| name.to_owned())
}

/// The server and database a URL points at, to tell two entries that are
/// one database apart.
fn server_database(url: &DatabaseUrl) -> Option<(String, String)> {
    Some((url.host()?, database_of(url)?))
}

/// Every replica's name is its own: no shard and no other replica has it.
fn check_replica_names(shards: &[ShardSpec]) -> Result<()> {
    let mut seen: HashMap<&str, String> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), format!("shards[{i}]")))
        .collect();
    // The databases shards and replicas point at: a replica that is a
    // shard, or another shard's replica too, would answer for rows that
    // are not its shard's.
    let mut databases: HashMap<(String, String), String> = shards
        .iter()
        .filter_map(|s| Some((server_database(&s.url)?, format!("shard `{}`", s.name))))
        .collect();
    for (i, shard) in shards.iter().enumerate() {
        for (j, replica) in shard.replicas.iter().enumerate() {
            let entry = format!("shards[{i}].replicas[{j}]");
            if let Some(first) = seen.get(replica.name.as_str()) {
                return Err(ShardError::config(
                    entry,
                    format!("the name `{}` is taken (by {first})", replica.name),
                ));
            }
            seen.insert(&replica.name, entry.clone());
            if let Some(at) = server_database(&replica.url) {
                if let Some(other) = databases.get(&at) {
                    return Err(ShardError::config(
                        entry,
                        format!(
                            "replica `{}` of shard `{}` is the database {other} is \
                             (server {}, database `{}`): a replica is a server of its own that \
                             replays its shard",
                            replica.name, shard.name, at.0, at.1
                        ),
                    ));
                }
                databases.insert(at, format!("replica `{}`", replica.name));
            }
        }
    }
    Ok(())
}

/// Builds a shard URL from either `url` or `host` + `database`.
pub(super) fn locate_database(
    entry: &str,
    hosts: &HashMap<&str, &DatabaseUrl>,
    url: &Option<DatabaseUrl>,
    host: &Option<String>,
    database: &Option<String>,
) -> Result<DatabaseUrl> {
    let url = locate_url(entry, hosts, url, host, database)?;
    check_database_name(entry, &url)?;
    Ok(url)
}

pub(super) fn locate_url(
    entry: &str,
    hosts: &HashMap<&str, &DatabaseUrl>,
    url: &Option<DatabaseUrl>,
    host: &Option<String>,
    database: &Option<String>,
) -> Result<DatabaseUrl> {
    match (url, host, database) {
        (Some(url), None, None) => {
            check_url(entry, url)?;
            Ok(url.clone())
        }
        (None, Some(host), Some(database)) => {
            let base = hosts.get(host.as_str()).ok_or_else(|| {
                ShardError::config(
                    entry,
                    format!("host `{host}` is referenced but not defined in `[[hosts]]`"),
                )
            })?;
            if database.is_empty() || database.contains(['/', '?', '#']) {
                return Err(ShardError::config(
                    entry,
                    format!("invalid database name {database:?}"),
                ));
            }
            // `database` is a name, not a piece of URL: a `%` would be read
            // as percent-encoding (`x%41` naming `xA`).
            if database.contains('%') {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "invalid database name {database:?}: `database` takes a plain name and \
                         `%` is not allowed in it; for such a name give the shard a `url` with \
                         the name percent-encoded (`%25` for `%`)"
                    ),
                ));
            }
            let mut parsed = ::url::Url::parse(base.expose())
                .map_err(|err| ShardError::config(entry, format!("malformed host URL ({err})")))?;
            if parsed.scheme() == "sqlite" {
                return Err(ShardError::config(
                    entry,
                    "a sqlite database has no server: give the shard its own `url`",
                ));
            }
            parsed.set_path(database);
            Ok(DatabaseUrl::new(String::from(parsed)))
        }
        (Some(_), _, _) => Err(ShardError::config(
            entry,
            "give either `url`, or `host` and `database`, not both",
        )),
        (None, Some(_), None) => Err(ShardError::config(
            entry,
            "`host` needs a `database` name too",
        )),
        (None, None, Some(_)) => Err(ShardError::config(entry, "`database` needs a `host` too")),
        (None, None, None) => Err(ShardError::config(
            entry,
            "missing location: give `url`, or `host` and `database`",
        )),
    }
}

/// Spreads `buckets` evenly over `shards` in contiguous runs.
pub(super) fn spread(buckets: u32, shards: &[ShardId]) -> Box<[ShardId]> {
    let n = shards.len() as u64;
    (0..u64::from(buckets))
        .map(|b| shards[(b * n / u64::from(buckets)) as usize])
        .collect()
}
