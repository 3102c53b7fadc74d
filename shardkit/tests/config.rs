//! Config validation: every mistake is rejected with an error that names the
//! offending entry, and passwords never show.

use shardkit::topology::{Located, Target};
use shardkit::{ClusterConfig, ShardError, Topology};

fn rejected(toml: &str) -> (String, String) {
    match ClusterConfig::from_toml(toml) {
        Err(ShardError::Config { entry, message }) => (entry, message),
        Err(other) => panic!("expected a config error, got {other:?}"),
        Ok(_) => panic!("config was accepted:\n{toml}"),
    }
}

const FOUR: &str = r#"
[[shards]]
name = "s0"
url = "sqlite://s0.db"
[[shards]]
name = "s1"
url = "sqlite://s1.db"
[[shards]]
name = "s2"
url = "sqlite://s2.db"
[[shards]]
name = "s3"
url = "sqlite://s3.db"
"#;

fn with(groups: &str) -> String {
    format!("{FOUR}\n{groups}")
}

#[test]
fn a_valid_config_builds() {
    let config = ClusterConfig::from_toml(&with(
        r#"
[groups.Customer]
bucket_ranges = [
  { shard = "s1", first = 512, last = 1023 },
  { shard = "s0", first = 0, last = 511 },
]
[groups.Tenant]
placement = "range"
ranges = [{ shard = "s0", to = "m" }, { shard = "s1", from = "m" }]
"#,
    ))
    .unwrap();
    let topology = Topology::build(&config).unwrap();
    assert_eq!(
        topology.shard_names().collect::<Vec<_>>(),
        ["s0", "s1", "s2", "s3"]
    );
}

#[test]
fn overlapping_bucket_ranges() {
    let (entry, message) = rejected(&with(
        r#"
[groups.Customer]
buckets = 8
bucket_ranges = [
  { shard = "s0", first = 0, last = 4 },
  { shard = "s1", first = 4, last = 7 },
]
"#,
    ));
    assert_eq!(entry, "groups.Customer.bucket_ranges[1]");
    assert!(
        message.contains("overlap") && message.contains("bucket 4"),
        "{message}"
    );
}

#[test]
fn missing_bucket_ranges() {
    let (entry, message) = rejected(&with(
        "[groups.Customer]\nbuckets = 8\nbucket_ranges = [{ shard = \"s0\", first = 0, last = 2 }, { shard = \"s1\", first = 5, last = 7 }]\n",
    ));
    assert_eq!(entry, "groups.Customer.bucket_ranges[1]");
    assert!(
        message.contains("buckets 3..=4 are not assigned"),
        "{message}"
    );

    let (entry, message) = rejected(&with(
        "[groups.Customer]\nbuckets = 8\nbucket_ranges = [{ shard = \"s0\", first = 0, last = 5 }]\n",
    ));
    assert_eq!(entry, "groups.Customer.bucket_ranges");
    assert!(
        message.contains("buckets 6..=7 are not assigned"),
        "{message}"
    );

    let (entry, message) = rejected(&with(
        "[groups.Customer]\nbuckets = 8\nbucket_ranges = [{ shard = \"s0\", first = 0, last = 8 }]\n",
    ));
    assert_eq!(entry, "groups.Customer.bucket_ranges[0]");
    assert!(message.contains("out of range"), "{message}");
}

#[test]
fn zero_buckets() {
    let (entry, message) = rejected(&with("[groups.Customer]\nbuckets = 0\n"));
    assert_eq!(entry, "groups.Customer.buckets");
    assert!(message.contains("zero buckets"), "{message}");
}

#[test]
fn key_range_gaps_and_overlaps() {
    let (entry, message) = rejected(&with(
        "[groups.A]\nplacement = \"range\"\nranges = [{ shard = \"s0\", to = 100 }, { shard = \"s1\", from = 150 }]\n",
    ));
    assert_eq!(entry, "groups.A.ranges[0]");
    assert!(
        message.contains("gap") && message.contains("[100, 150)"),
        "{message}"
    );

    let (entry, message) = rejected(&with(
        "[groups.A]\nplacement = \"range\"\nranges = [{ shard = \"s0\", from = 0, to = 100 }, { shard = \"s1\", from = 50, to = 200 }]\n",
    ));
    assert_eq!(entry, "groups.A.ranges[0]");
    assert!(message.contains("overlap"), "{message}");

    let (entry, message) = rejected(&with(
        "[groups.A]\nplacement = \"range\"\nranges = [{ shard = \"s0\", from = 0 }, { shard = \"s1\", from = 50, to = 200 }]\n",
    ));
    assert_eq!(entry, "groups.A.ranges[0]");
    assert!(message.contains("overlap"), "{message}");

    let (entry, message) = rejected(&with(
        "[groups.A]\nplacement = \"range\"\nranges = [{ shard = \"s0\", from = 10, to = 10 }]\n",
    ));
    assert_eq!(entry, "groups.A.ranges[0]");
    assert!(message.contains("empty range"), "{message}");

    let (_, message) = rejected(&with(
        "[groups.A]\nplacement = \"range\"\nranges = [{ shard = \"s0\", to = 10 }, { shard = \"s1\", from = \"a\" }]\n",
    ));
    assert!(message.contains("mix"), "{message}");
}

#[test]
fn shard_referenced_but_not_defined() {
    let (entry, message) = rejected(&with(
        "[groups.M]\nplacement = \"modulo\"\nshards = [\"s0\", \"s9\"]\n",
    ));
    assert_eq!(entry, "groups.M.shards[1]");
    assert!(
        message.contains("`s9` is referenced but not defined"),
        "{message}"
    );

    let (entry, _) = rejected(&with(
        "[groups.C]\nbuckets = 2\nbucket_ranges = [{ shard = \"s0\", first = 0, last = 0 }, { shard = \"nope\", first = 1, last = 1 }]\n",
    ));
    assert_eq!(entry, "groups.C.bucket_ranges[1]");

    let (entry, message) =
        rejected("[[shards]]\nname = \"s0\"\nhost = \"db1\"\ndatabase = \"x\"\n");
    assert_eq!(entry, "shards[0] (\"s0\")");
    assert!(
        message.contains("host `db1` is referenced but not defined"),
        "{message}"
    );
}

#[test]
fn shard_defined_twice() {
    let (entry, message) = rejected(&format!(
        "{FOUR}\n[[shards]]\nname = \"s1\"\nurl = \"sqlite://again.db\"\n"
    ));
    assert_eq!(entry, "shards[4] (\"s1\")");
    assert!(
        message.contains("defined twice (first at shards[1])"),
        "{message}"
    );
}

#[test]
fn one_database_named_twice() {
    let twice = |url: &str| {
        format!(
            "[[shards]]\nname = \"s0\"\nurl = \"{url}\"\n[[shards]]\nname = \"s1\"\nurl = \"{url}\"\n"
        )
    };
    let (entry, message) = rejected(&twice("sqlite://s0.db"));
    assert_eq!(entry, "shards[1] (\"s1\")");
    assert!(
        message.contains("shard `s1` is the same database as shards[0]"),
        "{message}"
    );
    // A named in-memory database shared by every pool is one database too.
    let (entry, _) = rejected(&twice("sqlite:file:x?mode=memory&cache=shared"));
    assert_eq!(entry, "shards[1] (\"s1\")");
    // Private in-memory databases: each pool's own.
    for url in ["sqlite::memory:", "sqlite:file:x?mode=memory"] {
        ClusterConfig::from_toml(&twice(url)).unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}

#[test]
fn malformed_urls() {
    let (entry, message) = rejected("[[shards]]\nname = \"s0\"\nurl = \"not a url\"\n");
    assert_eq!(entry, "shards[0] (\"s0\")");
    assert!(message.contains("malformed database URL"), "{message}");

    let (_, message) = rejected("[[shards]]\nname = \"s0\"\nurl = \"redis://127.0.0.1\"\n");
    assert!(
        message.contains("unsupported database URL scheme `redis`"),
        "{message}"
    );

    let (entry, message) = rejected(
        "[[hosts]]\nname = \"h\"\nurl = \"postgres://u:hunter2@[::1\"\n[[shards]]\nname = \"s0\"\nhost = \"h\"\ndatabase = \"d\"\n",
    );
    assert_eq!(entry, "hosts[0] (\"h\")");
    assert!(!message.contains("hunter2"), "{message}");
}

#[test]
fn a_value_of_the_wrong_type_names_its_key() {
    let (entry, message) = rejected(&with("[groups.Customer]\nbuckets = \"many\"\n"));
    assert!(
        entry.starts_with("groups.Customer.buckets (line "),
        "{entry}: {message}"
    );
    assert!(message.contains("invalid type"), "{message}");
    let (entry, _) = rejected(&with("[pool]\nmax_connections = -1\n"));
    assert!(entry.starts_with("pool.max_connections (line "), "{entry}");
}

#[test]
fn unknown_fields_are_rejected() {
    let (entry, message) =
        rejected("[[shards]]\nname = \"s0\"\nurl = \"sqlite://a.db\"\nweight = 3\n");
    assert_eq!(entry, "shards[0].weight (line 4)");
    assert!(message.contains("unknown field `weight`"), "{message}");

    let (_, message) = rejected(&with("[groups.C]\nplacment = \"hash\"\n"));
    assert!(message.contains("unknown field `placment`"), "{message}");

    let (entry, message) = rejected(&with(
        "[groups.C]\nplacement = \"modulo\"\nbuckets = 4\nshards = [\"s0\"]\n",
    ));
    assert_eq!(entry, "groups.C.buckets");
    assert!(
        message.contains("applies only to placement = \"hash\""),
        "{message}"
    );
}

#[test]
fn passwords_never_appear() {
    let toml = "[[hosts]]\nname = \"pg\"\nurl = \"postgres://app:hunter2@10.0.0.5:5432\"\n\
                [[shards]]\nname = \"s0\"\nhost = \"pg\"\ndatabase = \"orders_0\"\n\
                [[shards]]\nname = \"s1\"\nurl = \"mysql://root:hunter2@10.0.0.6/orders_1\"\n";
    let config = ClusterConfig::from_toml(toml).unwrap();
    let debug = format!("{config:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    let topology = Topology::build(&config).unwrap();
    let debug = format!("{topology:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(
        debug.contains("postgres://app:***@10.0.0.5:5432/orders_0"),
        "{debug}"
    );

    // A URL where another type belongs: the parser quotes the value in its
    // message, and the password is redacted out of it.
    let err = ClusterConfig::from_toml(&with(
        "[groups.C]\nbuckets = \"postgres://app:hunter2@h/db\"\n",
    ))
    .unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(
        text.contains("postgres://app:***@h"),
        "the value is quoted, redacted: {text}"
    );
    // A parse error on a line holding a password does not echo the line.
    let err = ClusterConfig::from_toml(
        "[[shards]]\nname = \"s0\"\nurl = { x = \"postgres://app:hunter2@h/db\" }\n",
    )
    .unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let err = ClusterConfig::from_toml(
        "shards = [{ name = \"s0\", url = \"postgres://app:hunter2@h/db\", bogus = 1 }]\n",
    )
    .unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
    assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
}

#[test]
fn password_parameters_and_unencoded_passwords_never_appear() {
    // A `password=` parameter, a percent-encoded key, a percent-encoded
    // userinfo password: none of them in the Debug of the config or topology.
    let toml = "[[shards]]\nname = \"s0\"\nurl = \"postgres://app@10.0.0.5/a?sslmode=disable&password=Qz7one\"\n\
                [[shards]]\nname = \"s1\"\nurl = \"postgres://app@10.0.0.5/b?pass%77ord=Qz7two\"\n\
                [[shards]]\nname = \"s2\"\nurl = \"mysql://app:Qz7three%2F%40x@10.0.0.6/c\"\n";
    let config = ClusterConfig::from_toml(toml).unwrap();
    let topology = Topology::build(&config).unwrap();
    for debug in [format!("{config:?}"), format!("{topology:?}")] {
        assert!(!debug.contains("Qz7"), "{debug}");
        assert!(debug.contains("sslmode=disable&password=***"), "{debug}");
    }
    // The value of the wrong type is quoted by the parser, with a password
    // holding an unencoded `/` (not even a valid URL).
    let err = ClusterConfig::from_toml(&with(
        "[pool]\nmax_connections = \"postgres://u:PwK/0o1@h/db\"\n",
    ))
    .unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(!text.contains("PwK") && !text.contains("0o1"), "{text}");
}

#[tokio::test]
async fn connect_errors_name_the_shard_without_the_password() {
    // Port 9 (discard) on loopback is closed: the connection is refused.
    let toml = "[[shards]]\nname = \"s0\"\nurl = \"postgres://app:hunter2@127.0.0.1:9/orders\"\n[pool]\nconnect_timeout_secs = 2\nacquire_timeout_secs = 2\n";
    let err = shardkit::Cluster::connect(ClusterConfig::from_toml(toml).unwrap())
        .await
        .unwrap_err();
    match &err {
        ShardError::Connect { shard, url, .. } => {
            assert_eq!(shard, "s0");
            assert_eq!(url, "postgres://app:***@127.0.0.1:9/orders");
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(!err.to_string().contains("hunter2"), "{err}");
    assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
}

#[test]
fn placements_route_without_io() {
    let config = ClusterConfig::from_toml(&with(
        r#"
[groups.Customer]
buckets = 4
bucket_ranges = [{ shard = "s2", first = 0, last = 1 }, { shard = "s3", first = 2, last = 3 }]
[groups.U]
placement = "modulo"
shards = ["s1", "s0"]
[groups.R]
placement = "range"
ranges = [{ shard = "s0", from = "a", to = "n" }, { shard = "s1", from = "n", to = "zz" }]
"#,
    ))
    .unwrap();
    let t = Topology::build(&config).unwrap();
    let hash = |k: i64| shardkit::topology::pghash::partition_hash_i64(k) % 4;
    for k in [-3i64, 0, 7, 1 << 40] {
        let bucket = hash(k) as u32;
        let shard = if bucket < 2 { 2 } else { 3 };
        assert_eq!(
            t.locate("Customer", &k).unwrap(),
            Located::Target(Target {
                shard: shardkit::ShardId(shard),
                bucket: Some(bucket)
            })
        );
    }
    // u64 keys route like any integer.
    // u64::MAX is odd: index 1 of ["s1", "s0"] is s0.
    assert_eq!(
        t.locate("U", &u64::MAX).unwrap(),
        Located::Target(Target {
            shard: shardkit::ShardId(0),
            bucket: None
        })
    );
    assert_eq!(
        t.locate("U", &4u64).unwrap(),
        Located::Target(Target {
            shard: shardkit::ShardId(1),
            bucket: None
        })
    );
    assert!(matches!(
        t.locate("U", &"x".to_string()),
        Err(ShardError::Unroutable { .. })
    ));
    assert_eq!(
        t.locate("R", &"m".to_string()).unwrap(),
        Located::Target(Target {
            shard: shardkit::ShardId(0),
            bucket: None
        })
    );
    assert_eq!(
        t.locate("R", &"n".to_string()).unwrap(),
        Located::Target(Target {
            shard: shardkit::ShardId(1),
            bucket: None
        })
    );
    for outside in ["", "zz", "zzz"] {
        let err = t.locate("R", &outside.to_string()).unwrap_err();
        assert!(
            matches!(err, ShardError::Unroutable { .. }),
            "{outside:?}: {err:?}"
        );
    }
    assert!(matches!(
        t.locate("R", &5i64),
        Err(ShardError::Unroutable { .. })
    ));
    match t.locate("Nope", &1i64) {
        Err(ShardError::UnknownGroup { group, configured }) => {
            assert_eq!(group, "Nope");
            assert_eq!(configured, "Customer, R, U");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn default_hash_spreads_buckets_evenly() {
    let config = ClusterConfig::from_toml(&with("[groups.C]\n")).unwrap();
    let t = Topology::build(&config).unwrap();
    let mut per_shard = [0u32; 4];
    for k in 0..4096i64 {
        let Located::Target(target) = t.locate("C", &k).unwrap() else {
            panic!()
        };
        per_shard[target.shard.index()] += 1;
        let bucket = target.bucket.unwrap();
        assert_eq!(
            target.shard.index() as u32,
            bucket / 256,
            "contiguous runs of 256 buckets"
        );
    }
    assert!(per_shard.iter().all(|&n| n > 800), "{per_shard:?}");
}

#[test]
fn inputs_that_used_to_panic_are_config_errors() {
    let (entry, _) = rejected(&with("[groups.C]\nshards = []\n"));
    assert_eq!(entry, "groups.C.shards");

    let (entry, message) = rejected(&with(
        "[groups.A]\nplacement = \"range\"\nranges = [{ shard = \"s0\", to = 10 }, { shard = \"s1\", to = 20 }]\n",
    ));
    assert!(entry.starts_with("groups.A.ranges["), "{entry}");
    assert!(message.contains("unbounded below"), "{message}");

    let (entry, message) = rejected(&with("[groups.C]\nbuckets = 4000000000\n"));
    assert_eq!(entry, "groups.C.buckets");
    assert!(message.contains("more than"), "{message}");

    // A session's text lists `group=map:epoch;...`.
    let (entry, message) = rejected(&with("[groups.\"a=b\"]\n"));
    assert_eq!(entry, "groups.a=b");
    assert!(message.contains("may not contain"), "{message}");
}

#[test]
fn one_database_cannot_be_two_shards() {
    let (entry, message) = rejected(&format!(
        "{FOUR}\n[[shards]]\nname = \"s4\"\nurl = \"sqlite://s2.db\"\n"
    ));
    assert_eq!(entry, "shards[4] (\"s4\")");
    assert!(message.contains("same database as shards[2]"), "{message}");
}

/// Every setting outside the topology is checked by `validate()` against its
/// documented bounds, with an error naming its key: none of these may reach
/// `Cluster::connect` (where they panicked, or made ids wrap negative).
#[test]
fn every_setting_is_bounded_and_named() {
    let cases: &[(&str, &str)] = &[
        ("[pool]\nmax_connections = 0", "pool.max_connections"),
        (
            "[pool]\nmax_connections = 4000000000",
            "pool.max_connections",
        ),
        (
            "[pool]\nmax_connections = 4\nmin_connections = 5",
            "pool.min_connections",
        ),
        ("[pool]\nmin_connections = 11", "pool.min_connections"),
        ("[pool]\nside_connections = 0", "pool.side_connections"),
        ("[pool]\nside_connections = 10001", "pool.side_connections"),
        (
            "[pool]\nconnect_timeout_secs = 9223372036854775807",
            "pool.connect_timeout_secs",
        ),
        (
            "[pool]\nconnect_timeout_secs = 0",
            "pool.connect_timeout_secs",
        ),
        (
            "[pool]\nacquire_timeout_secs = 9223372036854775807",
            "pool.acquire_timeout_secs",
        ),
        (
            "[pool]\nacquire_timeout_secs = 0",
            "pool.acquire_timeout_secs",
        ),
        ("[read]\ntimeout_ms = 0", "read.timeout_ms"),
        (
            "[read]\ntimeout_ms = 9223372036854775807",
            "read.timeout_ms",
        ),
        ("[read]\nmax_concurrency = 0", "read.max_concurrency"),
        ("[ids]\ntimeout_ms = 0", "ids.timeout_ms"),
        ("[gsi]\ngrace_ms = 0", "gsi.grace_ms"),
        ("[gsi]\ngrace_ms = 999", "gsi.grace_ms"),
        ("[gsi]\ngrace_ms = 18446744073709551615", "gsi.grace_ms"),
        (
            "[ids]\nretry_after_ms = 18446744073709551615",
            "ids.retry_after_ms",
        ),
        (
            "[ids.sequences.orders]\nblock = 0",
            "ids.sequences.orders.block",
        ),
        (
            "[ids.sequences.orders]\nblock = 4611686018427387904",
            "ids.sequences.orders.block",
        ),
        ("[ids.sequences.Orders]\nblock = 10", "ids.sequences.Orders"),
        (
            "[ids.sequences.\"drop table\"]\nblock = 10",
            "ids.sequences.drop table",
        ),
        ("[ids]\nworker_id = 1024", "ids.worker_id"),
        (
            "[ids]\nworker_id = 3\nsnowflake = { time_bits = 41, worker_bits = 1, sequence_bits = 12 }",
            "ids.worker_id",
        ),
        (
            "[ids]\nsnowflake = { time_bits = 41, worker_bits = 20, sequence_bits = 12 }",
            "ids.snowflake",
        ),
        (
            "[ids]\nsnowflake = { time_bits = 20, worker_bits = 10, sequence_bits = 12 }",
            "ids.snowflake",
        ),
        (
            "[ids]\nsnowflake = { time_bits = 41, worker_bits = 10, sequence_bits = 0 }",
            "ids.snowflake",
        ),
        (
            "[ids]\nsnowflake = { time_bits = 255, worker_bits = 255, sequence_bits = 255 }",
            "ids.snowflake",
        ),
    ];
    for (settings, key) in cases {
        let toml = format!("{FOUR}\n{settings}\n");
        let config: ClusterConfig = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}"));
        match config.validate() {
            Err(ShardError::Config { entry, message }) => {
                assert_eq!(&entry, key, "{settings}: {message}");
            }
            other => panic!("{settings}: expected a config error on {key}, got {other:?}"),
        }
        // `from_toml` validates too.
        let (entry, _) = rejected(&toml);
        assert_eq!(&entry, key);
    }

    // The bounds themselves are accepted.
    ClusterConfig::from_toml(&format!(
        "{FOUR}\n[pool]\nmax_connections = 10000\nmin_connections = 10000\nside_connections = 10000\nconnect_timeout_secs = 3600\nacquire_timeout_secs = 3600\n\
         [read]\ntimeout_ms = 86400000\nmax_concurrency = 10000\n[gsi]\ngrace_ms = 1000\n\
         [ids]\ntimeout_ms = 600000\nretry_after_ms = 3600000\nworker_id = 1023\n\
         [ids.sequences.big]\nblock = 1000000000\n[ids.sequences.flickr]\nblock = 1\n"
    ))
    .unwrap();
}

/// The largest settings connect (a cluster over SQLite files) instead of
/// panicking on an `Instant` overflow.
#[tokio::test]
async fn the_largest_settings_connect() {
    let dir = std::env::temp_dir().join(format!("shardkit-config-largest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = format!(
        "[[shards]]\nname = \"s0\"\nurl = \"sqlite://{}/s0.db?mode=rwc\"\n\
         [pool]\nmax_connections = 10000\nconnect_timeout_secs = 3600\nacquire_timeout_secs = 3600\n\
         [read]\ntimeout_ms = 86400000\n[ids]\ntimeout_ms = 600000\nretry_after_ms = 3600000\n",
        dir.display()
    );
    let cluster = shardkit::Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The most connections one instance opens, per server: per shard its pool,
/// its side pool and (on a server) the breaker's probe; per directory and
/// ticket server one pool.
#[test]
fn the_connection_budget_counts_every_pool_per_server() {
    let config = ClusterConfig::from_toml(
        r#"
[[hosts]]
name = "pg"
url = "postgres://app:secret@db1:5432"
[[shards]]
name = "s0"
host = "pg"
database = "shop0"
[[shards]]
name = "s1"
host = "pg"
database = "shop1"
[[shards]]
name = "s2"
url = "mysql://root@db2:3306/shop2"
[[shards]]
name = "s3"
url = "sqlite://s3.db"
[[shards]]
name = "s4"
url = "sqlite::memory:"
[pool]
max_connections = 5
side_connections = 3
[groups.Customer]
shards = ["s0", "s1"]
[groups.Tenant]
placement = "directory"
directory = { host = "pg", database = "dir" }
[[ids.servers]]
name = "t0"
url = "mysql://root@db2:3306/tickets"
[[ids.servers]]
name = "t1"
host = "pg"
database = "tickets"
"#,
    )
    .unwrap();
    let budget = config.connection_budget().unwrap();
    assert_eq!((budget.max_connections, budget.side_connections), (5, 3));
    let servers: Vec<_> = budget
        .servers
        .iter()
        .map(|s| {
            (
                s.server.as_str(),
                s.shards,
                s.directories,
                s.ticket_servers,
                s.connections,
            )
        })
        .collect();
    assert_eq!(
        servers,
        [
            // 2 × (5 + 3 + 1) + directory 5 + tickets 5
            ("db1:5432", 2, 1, 1, 28),
            // 5 + 3 + 1 + tickets 5
            ("db2:3306", 1, 0, 1, 14),
            // a file: 5 + 3; a private in-memory database: 1
            ("sqlite", 2, 0, 0, 9),
        ]
    );
    assert_eq!(budget.total(), 51);

    // The defaults: 10 per pool, 2 per side pool.
    let budget = ClusterConfig::from_toml(FOUR)
        .unwrap()
        .connection_budget()
        .unwrap();
    assert_eq!((budget.max_connections, budget.side_connections), (10, 2));
    assert_eq!(budget.total(), 4 * 12);
}

/// PostgreSQL keeps a name's first 63 bytes and truncates the rest without an
/// error: with `create_databases` a longer name was created truncated and
/// every restart failed ("already exists"), and two names equal in their
/// first 63 bytes were one database. Such names are refused, as are MySQL
/// names over its 64 characters, in every form a database is named.
#[test]
fn database_names_over_the_servers_limit_are_refused() {
    let long = "d".repeat(64);
    let (entry, message) = rejected(&format!(
        "[[hosts]]\nname = \"pg\"\nurl = \"postgres://app:hunter2@127.0.0.1:5432\"\n\
         [[shards]]\nname = \"s0\"\nhost = \"pg\"\ndatabase = \"orders_0\"\n\
         [[shards]]\nname = \"s1\"\nhost = \"pg\"\ndatabase = \"orders_1\"\n\
         [[shards]]\nname = \"s2\"\nhost = \"pg\"\ndatabase = \"{long}\"\n"
    ));
    assert_eq!(entry, "shards[2] (\"s2\")");
    assert_eq!(
        message,
        format!(
            "database name \"{long}\" is 64 bytes long; PostgreSQL keeps at most 63 bytes of a \
             name and would silently truncate it"
        )
    );

    // Bytes, not characters: 32 two-byte characters are 64 bytes. In a
    // full URL the name is read percent-decoded, as the driver reads it.
    let (entry, message) = rejected(&format!(
        "[[shards]]\nname = \"s0\"\nurl = \"postgresql://app@127.0.0.1/{}?sslmode=disable\"\n",
        "%C3%A9".repeat(32)
    ));
    assert_eq!(entry, "shards[0] (\"s0\")");
    assert_eq!(
        message,
        format!(
            "database name \"{}\" is 64 bytes long; PostgreSQL keeps at most 63 bytes of a name \
             and would silently truncate it",
            "é".repeat(32)
        )
    );

    // Ticket servers and directories too.
    let (entry, _) = rejected(&format!(
        "[[shards]]\nname = \"s0\"\nurl = \"sqlite::memory:\"\n\
         [ids]\nservers = [{{ name = \"t0\", url = \"postgres://app@127.0.0.1/{long}\" }}]\n"
    ));
    assert_eq!(entry, "ids.servers[0] (\"t0\")");
    let (entry, _) = rejected(&format!(
        "[[shards]]\nname = \"s0\"\nurl = \"sqlite::memory:\"\n\
         [groups.M]\nplacement = \"directory\"\n\
         directory = {{ url = \"postgres://app@127.0.0.1/{long}\" }}\n"
    ));
    assert_eq!(entry, "groups.M.directory");

    // 63 bytes is fine on PostgreSQL; MySQL takes 64 characters, not 65.
    let ok = |url: String| {
        ClusterConfig::from_toml(&format!("[[shards]]\nname = \"s0\"\nurl = \"{url}\"\n"))
            .unwrap_or_else(|err| panic!("{url}: {err}"));
    };
    ok(format!("postgres://app@127.0.0.1/{}", "d".repeat(63)));
    ok(format!("mysql://root@127.0.0.1/{long}"));
    ok(format!("mysql://root@127.0.0.1/{}", "%C3%A9".repeat(64)));
    let (entry, message) = rejected(&format!(
        "[[hosts]]\nname = \"my\"\nurl = \"mysql://root@127.0.0.1:3306\"\n\
         [[shards]]\nname = \"s0\"\nhost = \"my\"\ndatabase = \"{long}x\"\n"
    ));
    assert_eq!(entry, "shards[0] (\"s0\")");
    assert_eq!(
        message,
        format!(
            "database name \"{long}x\" is 65 characters long; MySQL and MariaDB accept at most 64"
        )
    );
}

/// `database` in the `[[hosts]]` form is a plain name: `x%41` used to be read
/// as percent-encoding and name `xA`. A `%` is refused there; a `url` names
/// any database, percent-encoded.
#[test]
fn a_database_name_is_not_percent_decoded() {
    let (entry, message) = rejected(
        "[[hosts]]\nname = \"pg\"\nurl = \"postgres://app@127.0.0.1:5432\"\n\
         [[shards]]\nname = \"s0\"\nhost = \"pg\"\ndatabase = \"x%41\"\n",
    );
    assert_eq!(entry, "shards[0] (\"s0\")");
    assert_eq!(
        message,
        "invalid database name \"x%41\": `database` takes a plain name and `%` is not allowed \
         in it; for such a name give the shard a `url` with the name percent-encoded (`%25` for \
         `%`)"
    );
    // Other characters are taken as written (a space is encoded in the URL
    // and decoded by the driver).
    ClusterConfig::from_toml(
        "[[hosts]]\nname = \"pg\"\nurl = \"postgres://app@127.0.0.1:5432\"\n\
         [[shards]]\nname = \"s0\"\nhost = \"pg\"\ndatabase = \"orders 0\"\n",
    )
    .unwrap();
}
