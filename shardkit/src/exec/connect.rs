//! Connecting a cluster's databases: validated config → one pool per
//! shard, a side pool per shard, directory and ticket-server pools.

use crate::clock::Clock;
use crate::error::{DriverError, Result, ShardError};
use crate::exec::replicas::{Replica, ReplicaSet};
use crate::exec::shards::{
    Inner, ReadSettings, RebalanceSettings, Shards, StatementEvent, StatementObserver,
};
use crate::exec::sqlite::{BUSY_TIMEOUT, WriterSlot};
use crate::topology::{ClusterConfig, DatabaseUrl, PoolConfig, Topology};
use futures::future::join_all;
use sea_orm::{ConnectOptions, Database, DatabaseConnection};
use std::sync::Arc;
use std::time::Duration;

impl Shards {
    /// Validates `config` and connects every database it names (see
    /// [`Cluster::connect`](crate::Cluster::connect)).
    pub(crate) async fn connect(
        config: &ClusterConfig,
        observer: Option<StatementObserver>,
        clock: Arc<dyn Clock>,
    ) -> Result<Shards> {
        let topology = Topology::build(config)?;
        let pool = &config.pool;
        let probe_timeout = Duration::from_secs(pool.connect_timeout_secs.unwrap_or(5));
        let health: Vec<_> = topology
            .shards()
            .iter()
            .map(|s| Arc::new(crate::exec::health::ShardHealth::new(&s.url, probe_timeout)))
            .collect();
        if pool.create_databases.unwrap_or(false) {
            create_databases(&topology, pool, probe_timeout).await?;
        }
        if !pool.connect_lazy.unwrap_or(false) {
            // One direct connection per shard first: it fails within the
            // connect timeout with the driver's cause, where the pool would
            // retry a refused connection until its acquire timeout and then
            // say only "pool timed out".
            // A server at its connection limit fails here too: the pool
            // would retry it (PostgreSQL) until its acquire timeout.
            let probes = join_all(health.iter().map(|h| h.connect_once())).await;
            for (spec, probe) in topology.shards().iter().zip(probes) {
                if let Err(failure) = probe {
                    return Err(ShardError::Connect {
                        shard: spec.name.clone(),
                        url: spec.url.redacted(),
                        cause: DriverError::new(failure.into_cause()),
                    });
                }
            }
        }
        let kept_observer = observer.clone();
        let observer = observer.as_ref();
        let shard_conns = join_all(
            topology
                .shards()
                .iter()
                .map(|s| connect_one(s.name.clone(), &s.url, pool, observer, None, false)),
        );
        let side_pool = side_pool_config(pool);
        let side_conns = join_all(topology.shards().iter().map(|s| {
            connect_one(
                s.name.clone(),
                &s.url,
                &side_pool,
                observer,
                Some(SIDE_MYSQL_SESSION.to_owned()),
                true,
            )
        }));
        let count = topology.ticket_servers().len();
        // Ticket servers back each other up: a process starts while one is
        // down (or hung) and draws from the others, so their pools open on
        // first use (an in-memory SQLite server excepted: it would be gone).
        let lazy_tickets = PoolConfig {
            connect_lazy: Some(true),
            ..pool.clone()
        };
        let ticket_conns = join_all(topology.ticket_servers().iter().enumerate().map(|(i, s)| {
            connect_one(
                s.name.clone(),
                &s.url,
                if s.url.is_sqlite_in_memory() {
                    pool
                } else {
                    &lazy_tickets
                },
                observer,
                Some(crate::id_spec::mysql_session_sql(i, count)),
                false,
            )
        }));
        let dir_conns = join_all(topology.directories().iter().map(|d| {
            connect_one(
                format!("directory:{}", d.group),
                &d.url,
                pool,
                observer,
                None,
                false,
            )
        }));
        // Replicas' pools open on first use: a replica that is down at
        // start leaves the rotation, it does not stop the cluster.
        let lazy_replicas = PoolConfig {
            connect_lazy: Some(true),
            ..pool.clone()
        };
        let replica_conns = join_all(topology.shards().iter().map(|s| {
            join_all(s.replicas.iter().map(|r| {
                connect_one(
                    r.name.clone(),
                    &r.url,
                    &lazy_replicas,
                    observer,
                    None,
                    false,
                )
            }))
        }));
        let (shards, directories, tickets, replicas) =
            futures::join!(shard_conns, dir_conns, ticket_conns, replica_conns);
        let replicas = replicas
            .into_iter()
            .zip(topology.shards())
            .map(|(conns, spec)| {
                let replicas = conns
                    .into_iter()
                    .zip(&spec.replicas)
                    .map(|(conn, r)| {
                        let conn = conn?;
                        let slots = pool_size(&conn);
                        Ok(Replica::new(r.name.clone(), r.url.clone(), conn, slots))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(ReplicaSet::new(replicas))
            })
            .collect::<Result<Vec<_>>>()?;
        // After the main pools: opening a SQLite file while another
        // connection switches it to WAL fails with `database is locked`.
        let side = side_conns.await;
        let tickets = tickets
            .into_iter()
            .zip(topology.ticket_servers())
            .map(|(conn, spec)| match conn {
                // SeaORM opens a SQLite file at connect (to read its version)
                // even for a lazy pool: a ticket server's file that cannot be
                // opened now is opened on first use, like any ticket server.
                Err(err)
                    if spec.url.scheme() == Some("sqlite") && !spec.url.is_sqlite_in_memory() =>
                {
                    tracing::warn!(
                        server = %spec.name,
                        error = %err.report(),
                        "ticket server not opened; it is tried again on first use"
                    );
                    lazy_sqlite(spec.name.clone(), &spec.url, pool, observer)
                }
                other => other,
            })
            .collect::<Result<Vec<_>>>()?;
        let shards = shards.into_iter().collect::<Result<Vec<_>>>()?;
        let side = side
            .into_iter()
            .zip(&shards)
            .zip(topology.shards())
            .map(|((side, main), spec)| {
                // Each connection to an in-memory SQLite database is a
                // database of its own: index rows must use the main pool.
                if spec.url.is_sqlite_memory() {
                    Ok(main.clone())
                } else {
                    side
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let sqlite_shards = shards
            .iter()
            .filter(|c| c.get_database_backend() == sea_orm::DbBackend::Sqlite)
            .count();
        // Shared with every instance on the same files: the lock file sits
        // beside the first file-backed SQLite shard (opened above, so it
        // exists).
        let sqlite_writer = (sqlite_shards > 1).then(|| {
            let first = topology
                .shards()
                .iter()
                .find_map(|s| super::sqlite::database_file(&s.url));
            Arc::new(WriterSlot::new(first.as_deref(), BUSY_TIMEOUT))
        });
        let directories = directories.into_iter().collect::<Result<Vec<_>>>()?;
        let read = ReadSettings {
            timeout: config.read.timeout_ms.map(Duration::from_millis),
            max_concurrency: config.read.max_concurrency.unwrap_or(16),
            replica_wait: Duration::from_millis(config.read.replica_wait_ms.unwrap_or(500)),
            replica_timeout: Duration::from_millis(config.read.replica_timeout_ms.unwrap_or(1_000)),
            replica_probe: Duration::from_millis(config.read.replica_probe_ms.unwrap_or(1_000)),
        };
        let servers = shards.iter().map(|_| Default::default()).collect();
        let (users, stop) = crate::exec::periodic::Users::new();
        Ok(Shards {
            _user: Some(Arc::new(users)),
            inner: Arc::new(Inner {
                topology,
                shards,
                side,
                sqlite_writer,
                health,
                replicas,
                directories,
                read,
                rebalance: RebalanceSettings {
                    refresh: Duration::from_millis(config.rebalance.refresh_ms.unwrap_or(5_000)),
                    cutover_wait: Duration::from_millis(
                        config.rebalance.cutover_wait_ms.unwrap_or(200),
                    ),
                    cleanup_grace: Duration::from_millis(
                        config.rebalance.cleanup_grace_ms.unwrap_or(60_000),
                    ),
                    chunk_setting: config.rebalance.chunk,
                    step_timeout: Duration::from_millis(
                        config.rebalance.step_timeout_ms.unwrap_or(60_000),
                    ),
                    schema_wait: Duration::from_millis(
                        config.rebalance.schema_wait_ms.unwrap_or(60_000),
                    ),
                },
                tickets,
                servers,
                observer: kept_observer,
                clock,
                stop,
            }),
        })
    }
}

/// Connections per shard in the side pool ([`Cluster::side_conn`]) unless
/// `[pool] side_connections` says otherwise.
pub(crate) const SIDE_POOL_SIZE: u32 = crate::topology::DEFAULT_SIDE_CONNECTIONS;

/// How long a side-pool statement waits for a row lock, in seconds.
pub(crate) const SIDE_LOCK_WAIT_SECS: u64 = 5;

/// The MySQL session setting of side-pool connections.
pub(crate) const SIDE_MYSQL_SESSION: &str = "SET SESSION innodb_lock_wait_timeout = 5";

/// The side pool's settings: the shards' timeouts, `side_connections`
/// (default [`SIDE_POOL_SIZE`]) opened on first use.
pub(super) fn side_pool_config(pool: &PoolConfig) -> PoolConfig {
    PoolConfig {
        max_connections: Some(pool.side_connections.unwrap_or(SIDE_POOL_SIZE)),
        min_connections: None,
        connect_lazy: Some(true),
        ..pool.clone()
    }
}

/// `[pool] create_databases`: every PostgreSQL and MySQL/MariaDB database
/// of the topology (shards, directories, ticket servers) that does not
/// exist yet is created, through the server's maintenance database.
///
/// Every server is first reached with one direct connection, all at once
/// and each within `timeout` (a pool would retry a refused connection until
/// its acquire timeout and say only "pool timed out"). One that cannot be
/// reached fails the connect, except where its pool would open on first
/// use anyway (`connect_lazy`, and ticket servers always): that database
/// is left unchecked with a warning, and its requests fail until it
/// answers.
async fn create_databases(topology: &Topology, pool: &PoolConfig, timeout: Duration) -> Result<()> {
    let lazy = pool.connect_lazy.unwrap_or(false);
    let shards = topology
        .shards()
        .iter()
        .map(|s| (s.name.clone(), &s.url, lazy));
    let directories = topology
        .directories()
        .iter()
        .map(|d| (format!("directory:{}", d.group), &d.url, lazy));
    let tickets = topology
        .ticket_servers()
        .iter()
        .map(|t| (format!("ids:{}", t.name), &t.url, true));
    let mut done: Vec<&DatabaseUrl> = Vec::new();
    let mut todo = Vec::new();
    for (name, url, lazy) in shards.chain(directories).chain(tickets) {
        if done.contains(&url) {
            continue;
        }
        done.push(url);
        if let Some((server, database)) = url.server_and_database() {
            todo.push((name, url, server, database, lazy));
        }
    }
    let reached = join_all(todo.iter().map(|(_, _, server, _, _)| async move {
        crate::exec::health::ShardHealth::new(server, timeout)
            .connect_once()
            .await
    }))
    .await;
    // One connection, opened now: the server was just reached.
    let direct = PoolConfig {
        max_connections: Some(1),
        min_connections: None,
        connect_lazy: Some(false),
        ..pool.clone()
    };
    for ((name, url, server, database, lazy), reached) in todo.into_iter().zip(reached) {
        if let Err(failure) = reached {
            let cause = failure.into_cause();
            if lazy {
                tracing::warn!(
                    shard = %name,
                    url = %server.redacted(),
                    %cause,
                    "server unreachable: database {database:?} not checked or created; \
                     its pool opens on first use"
                );
                continue;
            }
            return Err(ShardError::Connect {
                shard: name,
                url: server.redacted(),
                cause: DriverError::new(cause),
            });
        }
        let conn = connect_one(name.clone(), &server, &direct, None, None, false)
            .await
            .map_err(|err| match err {
                ShardError::Db { source, .. } => ShardError::Connect {
                    shard: name.clone(),
                    url: server.redacted(),
                    cause: DriverError::of(&source, |m| server.scrub(m)),
                },
                other => other,
            })?;
        let created = create_database(&conn, &database).await;
        let _ = conn.close().await;
        created.map_err(|source| ShardError::Connect {
            shard: name.clone(),
            url: url.redacted(),
            cause: DriverError::of(&source, |m| {
                format!(
                    "database does not exist and could not be created: {}",
                    server.scrub(m)
                )
            }),
        })?;
    }
    Ok(())
}

/// Creates `database` unless it exists (another instance may create it at
/// the same moment: that is not an error).
async fn create_database(
    conn: &DatabaseConnection,
    database: &str,
) -> std::result::Result<(), sea_orm::DbErr> {
    use sea_orm::{ConnectionTrait, DbBackend};
    match conn.get_database_backend() {
        DbBackend::Postgres => {
            if pg_database_exists(conn, database).await? {
                return Ok(());
            }
            let quoted = format!("\"{}\"", database.replace('"', "\"\""));
            match conn
                .execute_unprepared(&format!("CREATE DATABASE {quoted}"))
                .await
            {
                Ok(_) => Ok(()),
                // Created meanwhile by another instance.
                Err(_) if pg_database_exists(conn, database).await? => Ok(()),
                Err(err) => Err(err),
            }
        }
        DbBackend::MySql => {
            let quoted = format!("`{}`", database.replace('`', "``"));
            conn.execute_unprepared(&format!("CREATE DATABASE IF NOT EXISTS {quoted}"))
                .await
                .map(drop)
        }
        _ => Ok(()),
    }
}

async fn pg_database_exists(
    conn: &DatabaseConnection,
    database: &str,
) -> std::result::Result<bool, sea_orm::DbErr> {
    use sea_orm::{ConnectionTrait, DbBackend, Statement};
    let stmt = Statement::from_sql_and_values(
        DbBackend::Postgres,
        "SELECT 1 AS one FROM pg_database WHERE datname = $1",
        [database.into()],
    );
    Ok(conn.query_one_raw(stmt).await?.is_some())
}

pub(super) async fn connect_one(
    name: String,
    url: &DatabaseUrl,
    pool: &PoolConfig,
    observer: Option<&StatementObserver>,
    mysql_session: Option<String>,
    side: bool,
) -> Result<DatabaseConnection> {
    // The password travels in the driver's options, not in the URL: SeaORM
    // records the URL in its connect span (TRACE).
    let (driver_url, password) = url.for_driver();
    let mut options = ConnectOptions::new(driver_url);
    // A side pool's statements wait at most this long for a row lock.
    let lock_timeout = side.then(|| format!("{SIDE_LOCK_WAIT_SECS}s"));
    if password.is_some() || lock_timeout.is_some() {
        // One closure per driver: SeaORM keeps only the last one set.
        let for_mysql = password.clone();
        options.map_sqlx_postgres_opts(move |mut opts| {
            if let Some(password) = &password {
                opts = opts.password(password);
            }
            if let Some(timeout) = &lock_timeout {
                opts = opts.options([("lock_timeout", timeout)]);
            }
            opts
        });
        if let Some(password) = for_mysql {
            options.map_sqlx_mysql_opts(move |opts| opts.password(&password));
        }
    }
    // Statements are logged by shardkit's own spans; keep the driver's
    // per-statement log below info.
    options.sqlx_logging_level(log::LevelFilter::Debug);
    if let Some(n) = pool.max_connections {
        options.max_connections(n);
    }
    if let Some(n) = pool.min_connections {
        options.min_connections(n);
    }
    if let Some(secs) = pool.connect_timeout_secs {
        options.connect_timeout(Duration::from_secs(secs));
    }
    let raw = url.expose();
    let sqlite = raw.starts_with("sqlite:");
    match pool.acquire_timeout_secs {
        Some(secs) => {
            options.acquire_timeout(Duration::from_secs(secs));
        }
        // A SQLite connection is busy only while its holder works: waiting
        // for one is waiting for a writer, bounded like SQLite's own waits.
        None if sqlite => {
            options.acquire_timeout(BUSY_TIMEOUT);
        }
        None => {}
    }
    if let Some(test) = pool.test_before_acquire {
        options.test_before_acquire(test);
    }
    if let Some(lazy) = pool.connect_lazy {
        options.connect_lazy(lazy);
    }
    if url.is_sqlite_in_memory() {
        // An in-memory database is gone once its last connection closes:
        // keep one for the pool's life, whatever `[pool]` says.
        options
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None);
    }
    if url.is_sqlite_memory() {
        // Each connection to a private one is a database of its own.
        options.max_connections(1);
    }
    if sqlite {
        // One closure (SeaORM keeps only the last one set): every connection
        // waits out another's lock for the busy timeout, this process's or
        // another's, and a file is in WAL mode, which lets readers run
        // beside the one writer (a URL that names its own journal mode
        // keeps it).
        let wal = !raw.contains("journal_mode") && !url.is_sqlite_in_memory();
        options.map_sqlx_sqlite_opts(move |opts| {
            let opts = opts.busy_timeout(BUSY_TIMEOUT);
            if wal {
                opts.journal_mode(sea_orm::sqlx::sqlite::SqliteJournalMode::Wal)
            } else {
                opts
            }
        });
    }
    // The pool tests a returned connection with a ping that first reads
    // what a cancelled statement left unread, without bound; a statement
    // cancelled part-way (a timeout, an aborted task) can leave a
    // connection waiting for bytes that never come (on MySQL/MariaDB even
    // from a healthy server), and the pool, its permit and its other
    // connections held open forever. Checked first within a bound, such a
    // connection is closed instead. (A server that stops answering on that
    // connection still holds it: sqlx's ping after the check, and its close
    // over TLS, wait without bound.)
    let shard = Arc::new(name.clone());
    options.map_sqlx_postgres_pool_opts({
        let shard = Arc::clone(&shard);
        move |opts| with_release_check(opts, &shard)
    });
    // Session variables live per connection: set them on every connection
    // the pool opens, not once. One closure (SeaORM keeps only the last
    // one set).
    let session = mysql_session.map(Arc::new);
    options.map_sqlx_mysql_pool_opts(move |opts| {
        let opts = with_release_check(opts, &shard);
        let Some(sql) = &session else {
            return opts;
        };
        let sql = Arc::clone(sql);
        opts.after_connect(move |conn, _meta| {
            let sql = Arc::clone(&sql);
            Box::pin(async move {
                use sea_orm::sqlx::{AssertSqlSafe, Executor, raw_sql};
                // The statement is built from two integers, not user input.
                conn.execute(raw_sql(AssertSqlSafe(sql.to_string())))
                    .await
                    .map(|_| ())
            })
        })
    });
    let mut conn = Database::connect(options)
        .await
        .map_err(|err| ShardError::Connect {
            shard: name.clone(),
            url: url.redacted(),
            cause: DriverError::of(&err, |m| url.scrub(m)),
        })?;
    observe(&mut conn, name, observer);
    Ok(conn)
}

/// How long a connection returned to its pool may wait for what a
/// cancelled statement left unread before it is closed instead of kept.
const RELEASE_CHECK: Duration = Duration::from_secs(5);

/// `opts` with [`release_check`] run on every connection returned to the
/// pool.
fn with_release_check<DB: sea_orm::sqlx::Database>(
    opts: sea_orm::sqlx::pool::PoolOptions<DB>,
    shard: &Arc<String>,
) -> sea_orm::sqlx::pool::PoolOptions<DB> {
    let shard = Arc::clone(shard);
    opts.after_release(move |conn, _meta| Box::pin(release_check(conn, Arc::clone(&shard))))
}

/// Whether a connection returned to its pool is fit to keep: what a
/// statement cancelled part-way left unread arrives within
/// [`RELEASE_CHECK`] (a connection with nothing pending passes at once,
/// without a round trip). One that does not is closed, and its pool can
/// open another; the pool's own ping follows on a connection kept.
async fn release_check<C: sea_orm::sqlx::Connection>(
    conn: &mut C,
    shard: Arc<String>,
) -> std::result::Result<bool, sea_orm::sqlx::Error> {
    use futures::FutureExt as _;
    let mut pending = std::pin::pin!(conn.flush());
    // Nothing pending, the usual case: done at the first poll, without
    // reading the clock for a deadline.
    if let Some(answer) = pending.as_mut().now_or_never() {
        return answer.map(|()| true);
    }
    match tokio::time::timeout(RELEASE_CHECK, pending).await {
        Ok(answer) => answer.map(|()| true),
        Err(_) => {
            tracing::warn!(
                shard = %shard,
                "a connection returned to its pool still waited for an answer after {} s \
                 (a statement cancelled part-way): closed",
                RELEASE_CHECK.as_secs()
            );
            Ok(false)
        }
    }
}

/// A pool on a SQLite file that opens it on first use: what
/// [`connect_one`] builds for a lazy pool (the same URL, WAL unless the URL
/// names a journal mode, the busy timeout, pool size and acquire timeout),
/// without SeaORM's connect, which opens the file to read its version.
fn lazy_sqlite(
    name: String,
    url: &DatabaseUrl,
    pool: &PoolConfig,
    observer: Option<&StatementObserver>,
) -> Result<DatabaseConnection> {
    use sea_orm::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    use std::str::FromStr;
    let raw = url.expose();
    let mut options = SqliteConnectOptions::from_str(raw).map_err(|err| ShardError::Connect {
        shard: name.clone(),
        url: url.redacted(),
        cause: DriverError::new(url.scrub(&err.to_string())),
    })?;
    options = options.busy_timeout(BUSY_TIMEOUT);
    if !raw.contains("journal_mode") {
        options = options.journal_mode(SqliteJournalMode::Wal);
    }
    // SeaORM's default for SQLite: one connection.
    let mut pool_options = SqlitePoolOptions::new()
        .max_connections(pool.max_connections.unwrap_or(1))
        .min_connections(0);
    pool_options = pool_options.acquire_timeout(
        pool.acquire_timeout_secs
            .map_or(BUSY_TIMEOUT, Duration::from_secs),
    );
    if let Some(test) = pool.test_before_acquire {
        pool_options = pool_options.test_before_acquire(test);
    }
    let mut conn = sea_orm::SqlxSqliteConnector::from_sqlx_sqlite_pool(
        pool_options.connect_lazy_with(options),
    );
    observe(&mut conn, name, observer);
    Ok(conn)
}

/// Every statement on `conn` reaches the `metrics` recorder (see
/// `crate::metrics`) and the application's observer, if it set one.
fn observe(conn: &mut DatabaseConnection, name: String, observer: Option<&StatementObserver>) {
    let metrics = crate::metrics::ShardMetrics::new(&name);
    let observer = observer.map(Arc::clone);
    conn.set_metric_callback(move |info| {
        metrics.record(&info.statement.sql, info.elapsed, info.failed);
        if let Some(observer) = &observer {
            observer(&StatementEvent {
                shard: &name,
                statement: info.statement,
                elapsed: info.elapsed,
                failed: info.failed,
            })
        }
    });
}

/// How many connections `conn`'s pool opens at most.
fn pool_size(conn: &DatabaseConnection) -> u32 {
    match conn.get_database_backend() {
        sea_orm::DbBackend::Postgres => conn
            .get_postgres_connection_pool()
            .options()
            .get_max_connections(),
        sea_orm::DbBackend::MySql => conn
            .get_mysql_connection_pool()
            .options()
            .get_max_connections(),
        _ => conn
            .get_sqlite_connection_pool()
            .options()
            .get_max_connections(),
    }
}
