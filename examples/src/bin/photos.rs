//! A small photo site on 4 SQLite shards, everything sharded by **user id**:
//! a user's photos live on the user's shard; a comment lives with its photo
//! (its shard key is the photo owner's id, not the commenter's), so a photo and
//! its comments are one join on one shard; a favorite lives with the user who
//! faved, so "my favorites" is one keyed read. Photo and comment ids come from
//! ticket sequences on two ticket servers (two more SQLite files): unique on
//! every shard, filled in by `tx.insert` when left unset. Prints are priced
//! in a currency: `currencies` is a reference table, with a copy on every
//! shard, so a photo is joined with its currency on the owner's shard.
//!
//! `cargo run -p shardkit-examples --bin photos` (files in `$SHARDKIT_DATA_DIR`,
//! default `data/photos`)

use sea_orm::EntityTrait;
use shardkit::prelude::*;
use std::collections::{BTreeSet, HashMap};

/// The entity group: every table below is sharded by a user id.
#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct User;

mod user {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "users")]
    #[shardkit(group = crate::User)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)] // a user's own id is their shard key
        pub id: i64,
        pub name: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

mod currency {
    use sea_orm::entity::prelude::*;

    /// A reference table: every shard has a copy, written through
    /// `cluster.reference::<currency::Entity>()`, versioned.
    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "currencies")]
    #[shardkit(reference)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub code: String,
        pub name: String,
        pub symbol: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

mod photo {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "photos")]
    #[shardkit(group = crate::User)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "ticket:photos")] // filled from the "photos" sequence when unset
        pub id: i64,
        #[shardkit(shard_key)] // the owner
        pub user_id: i64,
        pub title: String,
        pub print_cents: i64,
        pub currency_code: String, // prints are priced in the owner's currency
        #[sea_orm(belongs_to, from = "currency_code", to = "code")]
        pub currency: BelongsTo<super::currency::Entity>,
        #[sea_orm(has_many)]
        pub comments: HasMany<super::comment::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

mod comment {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "comments")]
    #[shardkit(group = crate::User)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "ticket:comments")]
        pub id: i64,
        #[shardkit(shard_key)] // the photo's owner: the comment lives with the photo
        pub owner_id: i64,
        pub photo_id: i64,
        pub author_id: i64, // may be on any shard: not a relation
        pub body: String,
        #[sea_orm(belongs_to, from = "photo_id", to = "id")]
        pub photo: BelongsTo<super::photo::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

mod favorite {
    use sea_orm::entity::prelude::*;

    /// The photo may be on another shard: no relation (no foreign key) to it.
    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "favorites")]
    #[shardkit(group = crate::User)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)] // the user who faved
        pub user_id: i64,
        #[sea_orm(primary_key, auto_increment = false)]
        pub photo_id: i64,
        pub owner_id: i64, // the photo's shard key, to read the photo later
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// (id, name, photo titles, currency of their prints).
const USERS: [(i64, &str, &[&str], &str); 4] = [
    (
        1,
        "ada",
        &["loom", "engine", "notes", "cards", "analyst"],
        "GBP",
    ),
    (2, "grace", &["mark I", "moth"], "USD"),
    (3, "linus", &["penguin"], "EUR"),
    (4, "margaret", &["apollo", "listings"], "USD"),
];
/// (code, name, symbol).
const CURRENCIES: [(&str, &str, &str); 3] = [
    ("EUR", "euro", "€"),
    ("GBP", "pound sterling", "£"),
    ("USD", "US dollar", "$"),
];
/// (author id, photo title, body).
const COMMENTS: [(i64, &str, &str); 5] = [
    (1, "moth", "the first actual bug!"),
    (3, "moth", "patch it"),
    (4, "mark I", "nice relays"),
    (2, "engine", "it computes"),
    (1, "apollo", "to the moon"),
];
const ADA: i64 = 1;
const GRACE: i64 = 2;

fn name(user: i64) -> &'static str {
    USERS.iter().find(|u| u.0 == user).map_or("?", |u| u.1)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dir, mut toml) = shardkit_examples::sqlite_shards("photos", 4)?;
    let fresh = |db: &str| {
        let file = dir.join(format!("{db}.db"));
        let _ = std::fs::remove_file(&file);
        format!("sqlite://{}?mode=rwc", file.display())
    };
    toml.push_str(&format!(
        r#"[groups.User]
[ids]     # Flickr's ticket servers: server i of n hands out tickets ≡ i+1 (mod n)
servers = [{{ name = "tickets_a", url = "{}" }}, {{ name = "tickets_b", url = "{}" }}]
[ids.sequences.photos]
block = 100   # ticket t reserves ids [t·100, (t+1)·100)
[ids.sequences.comments]
block = 1     # one ticket per id
"#,
        fresh("tickets_a"),
        fresh("tickets_b")
    ));
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml)?).await?;
    // shardkit's tables on every database, and on both ticket servers the table
    // of each sequence [ids.sequences] lists; then ours on every shard (an
    // application adds them to its own Migrator, as the quickstart does).
    let report = cluster.migrate::<shardkit_migration::Migrator>().await?;
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).expect("configured shard");
        db.get_schema_builder() // SeaORM 2's entity-first schema, in foreign-key order
            .register(currency::Entity)
            .register(user::Entity)
            .register(photo::Entity)
            .register(comment::Entity)
            .register(favorite::Entity)
            .apply(db)
            .await?;
    }
    let names: Vec<&str> = report.databases.iter().map(|d| d.name.as_str()).collect();
    println!("== migrated {names:?} in {}", dir.display());

    println!("\n== currencies: a reference table, one write to every shard");
    let currencies = cluster.reference::<currency::Entity>();
    let written = currencies
        .insert_many(CURRENCIES.map(|(code, name, symbol)| currency::Model {
            code: code.into(),
            name: name.into(),
            symbol: symbol.into(),
        }))
        .await?;
    println!("version {} on {:?}", written.version, written.applied);
    assert_eq!(written.applied.len(), 4, "every shard has the currencies");

    println!("\n== users and photos: a transaction closure per user, photos in a batch");
    let mut photos: HashMap<&str, photo::Model> = HashMap::new();
    for (id, name, titles, currency) in USERS {
        // Commits on Ok, rolls back on Err; reruns if the database aborted it.
        let (shard, rows) = cluster
            .transaction::<User, _, _>(id, |tx| async move {
                let user = user::ActiveModel {
                    id: Set(id),
                    name: Set(name.into()),
                };
                tx.insert(user).await?;
                // Every row's key is checked before any is written; unset ids
                // are filled from the "photos" sequence.
                let rows = tx
                    .insert_many(titles.iter().map(|title| photo::ActiveModel {
                        user_id: Set(id),
                        title: Set(title.to_string()),
                        print_cents: Set(2_500),
                        currency_code: Set(currency.into()),
                        ..Default::default()
                    }))
                    .await?;
                Ok((tx.shard().to_owned(), rows))
            })
            .await?;
        let ids: Vec<i64> = rows.iter().map(|p| p.id).collect();
        println!("{name} (user {id}) -> {shard}: photos {ids:?}");
        photos.extend(titles.iter().copied().zip(rows));
    }

    println!("\n== comments: on the photo owner's shard, whoever writes them");
    for (author, title, body) in COMMENTS {
        let photo = &photos[title];
        let tx = cluster.begin::<User>(photo.user_id).await?; // the owner's key
        let row = tx
            .insert(comment::ActiveModel {
                owner_id: Set(photo.user_id),
                photo_id: Set(photo.id),
                author_id: Set(author),
                body: Set(body.into()),
                ..Default::default()
            })
            .await?;
        let shard = tx.shard().to_owned();
        tx.commit().await?;
        let (id, by, of) = (row.id, name(author), name(photo.user_id));
        let home = cluster.shard_of::<User>(&author).await?;
        println!("comment {id} by {by} ({home}) on {of}'s \"{title}\" -> {shard}");
    }

    println!("\n== where the rows are (read straight from each shard's database)");
    let (mut photo_ids, mut comment_ids) = (BTreeSet::new(), BTreeSet::new());
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).expect("configured shard");
        let users = user::Entity::find().all(db).await?;
        let here = photo::Entity::find().all(db).await?;
        let comments = comment::Entity::find().all(db).await?;
        let users: Vec<&str> = users.iter().map(|u| u.name.as_str()).collect();
        let (p, c) = (here.len(), comments.len());
        println!("{shard}: users {users:?}, {p} photos, {c} comments");
        for p in &here {
            assert_eq!(cluster.shard_of::<User>(&p.user_id).await?, shard);
        }
        let away = comments
            .iter()
            .find(|c| !here.iter().any(|p| p.id == c.photo_id));
        assert!(away.is_none(), "{away:?} is not with its photo");
        photo_ids.extend(here.iter().map(|p| p.id));
        comment_ids.extend(comments.iter().map(|c| c.id));
    }
    // A set keeps one of each id: an id used twice (on any shard) would be lost.
    let (p, c) = (photo_ids.len(), comment_ids.len());
    assert_eq!((p, c), (photos.len(), COMMENTS.len()));
    println!("{p} photos and {c} comments, every id unique across shards");

    println!("\n== grace's photos with their comments: one join on one shard");
    let with_comments = cluster
        .find::<photo::Entity>()
        .key(GRACE)
        .find_with_related(comment::Entity)
        .await?;
    for (p, comments) in &with_comments {
        let bodies: Vec<&str> = comments.iter().map(|c| c.body.as_str()).collect();
        println!("\"{}\" (photo {}): {bodies:?}", p.title, p.id);
        let written = COMMENTS.iter().filter(|c| c.1 == p.title).count();
        assert_eq!(comments.len(), written, "comments of {p:?}");
    }
    assert_eq!(with_comments.len(), 2, "grace has 2 photos");
    let from = cluster.shard_of::<User>(&GRACE).await?;
    println!("(read from {from} only)");

    println!("\n== ada's photos, 2 per page");
    let pages = cluster
        .find::<photo::Entity>()
        .key(ADA)
        .order_by_asc(photo::Column::Id) // order a paginated read: stable pages
        .paginate(2);
    let num_pages = pages.num_pages().await?;
    assert_eq!(num_pages, 3, "5 photos in pages of 2");
    let mut paged = Vec::new();
    for page in 0..num_pages {
        let rows = pages.fetch_page(page).await?;
        let titles: Vec<&str> = rows.iter().map(|p| p.title.as_str()).collect();
        println!("page {page} of {num_pages}: {titles:?}");
        assert_eq!(rows.len(), [2, 2, 1][page as usize]);
        paged.extend(rows.into_iter().map(|p| p.title));
    }
    assert_eq!(paged, USERS[0].2, "each photo once, in id order");

    println!("\n== favorites: on the shard of the user who faves");
    let faves = ["moth", "penguin", "apollo"].map(|title| favorite::ActiveModel {
        user_id: Set(ADA),
        photo_id: Set(photos[title].id),
        owner_id: Set(photos[title].user_id),
    });
    let tx = cluster.begin::<User>(ADA).await?;
    tx.insert_many(faves).await?;
    tx.commit().await?;
    // One keyed read for the list; the photos are on their owners' shards:
    // one multi-key read, one query per shard holding some of the owners.
    let mine = cluster.find::<favorite::Entity>().key(ADA).all().await?;
    let faved = cluster
        .find::<photo::Entity>()
        .keys(mine.iter().map(|f| f.owner_id))
        .filter(photo::Column::Id.is_in(mine.iter().map(|f| f.photo_id)))
        .order_by_asc(photo::Column::Id)
        .all()
        .await?;
    let from = cluster.shard_of::<User>(&ADA).await?;
    println!("ada's {} favorites, listed from {from}:", mine.len());
    for p in &faved {
        let shard = cluster.shard_of::<User>(&p.user_id).await?;
        println!("  {}'s \"{}\" from {shard}", name(p.user_id), p.title);
    }
    assert_eq!((mine.len(), faved.len()), (3, 3));

    println!("\n== grace's prints with their currency: joined on grace's shard");
    let priced = cluster
        .find::<photo::Entity>()
        .key(GRACE)
        .find_also_related(currency::Entity)
        .await?;
    for (p, c) in &priced {
        let c = c.as_ref().expect("every shard has every currency");
        println!(
            "\"{}\": {}{:.2} ({})",
            p.title,
            c.symbol,
            p.print_cents as f64 / 100.0,
            c.name
        );
        assert_eq!(c.code, "USD");
    }
    // A change to a reference table is one version, on every shard.
    let renamed = currencies
        .update(currency::Model {
            code: "USD".into(),
            name: "United States dollar".into(),
            symbol: "US$".into(),
        })
        .await?;
    let status = currencies.status().await?;
    let versions: Vec<String> = status
        .copies
        .iter()
        .map(|c| format!("{} v{}", c.shard, c.version.as_ref().map_or(0, |v| *v)))
        .collect();
    println!(
        "renamed USD: version {}; copies {versions:?}",
        renamed.version
    );
    assert!(status.behind().is_empty());
    let again = cluster
        .find::<photo::Entity>()
        .key(GRACE)
        .find_also_related(currency::Entity)
        .await?;
    assert!(
        again
            .iter()
            .all(|(_, c)| c.as_ref().is_some_and(|c| c.symbol == "US$"))
    );
    println!(
        "grace's prints now read {}25.00",
        again[0].1.as_ref().map_or("", |c| c.symbol.as_str())
    );
    Ok(())
}
