//! Database URLs that never show their password.

use percent_encoding::percent_decode_str;
use std::fmt;

/// A database URL from the cluster config.
///
/// `Debug` and `Display` print it with the password replaced by `***`, so a
/// config, an error or a log line that includes it leaks nothing. The full URL
/// is only handed to the driver when connecting.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    /// Wraps a URL. It is checked when the config is validated.
    pub fn new(url: impl Into<String>) -> Self {
        DatabaseUrl(url.into())
    }

    /// Whether it names a private in-memory SQLite database
    /// (`sqlite::memory:`, or `mode=memory` without `cache=shared`): every
    /// connection to one is a database of its own, so two shards with the
    /// same such URL are two databases.
    pub fn is_sqlite_memory(&self) -> bool {
        self.is_sqlite_in_memory() && !self.0.contains("cache=shared")
    }

    /// Whether it names an in-memory SQLite database, private or shared:
    /// it is gone once its last connection closes.
    pub(crate) fn is_sqlite_in_memory(&self) -> bool {
        self.0.starts_with("sqlite:")
            && (self.0.contains(":memory:") || self.0.contains("mode=memory"))
    }

    /// The URL with its password, for the driver only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact_urls(&self.0)
    }

    /// The server's host name or address (none for SQLite).
    pub fn host(&self) -> Option<String> {
        if self.scheme() == Some("sqlite") {
            return None;
        }
        let parsed = url::Url::parse(&self.0).ok()?;
        let host = parsed.host_str()?.to_owned();
        Some(match parsed.port() {
            Some(port) => format!("{host}:{port}"),
            None => host,
        })
    }

    /// The URL scheme (`postgres`, `mysql`, `sqlite`), if it has one.
    pub fn scheme(&self) -> Option<&str> {
        self.0.split_once(':').map(|(scheme, _)| scheme)
    }

    /// Every form of every secret the URL holds: the userinfo password and
    /// the values of password-like query parameters, each as written and
    /// percent-decoded (used to scrub driver messages).
    pub(crate) fn secrets(&self) -> Vec<String> {
        let Ok(parsed) = url::Url::parse(&self.0) else {
            return Vec::new();
        };
        let mut secrets = Vec::new();
        if let Some(password) = parsed.password() {
            secrets.push(password.to_owned());
            secrets.push(
                percent_decode_str(password)
                    .decode_utf8_lossy()
                    .into_owned(),
            );
        }
        if let Some(query) = parsed.query() {
            for pair in query.split('&') {
                if let Some((key, value)) = pair.split_once('=')
                    && is_secret_key(key)
                {
                    secrets.push(value.to_owned());
                    secrets.push(percent_decode_str(value).decode_utf8_lossy().into_owned());
                    secrets.extend(
                        url::form_urlencoded::parse(pair.as_bytes()).map(|(_, v)| v.into_owned()),
                    );
                }
            }
        }
        secrets.retain(|s| !s.is_empty());
        secrets.sort();
        secrets.dedup();
        // Longest first, so a secret that contains another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets
    }

    /// Scrubs this URL's secrets out of a message produced by a driver.
    pub(crate) fn scrub(&self, message: &str) -> String {
        let mut out = redact_urls(message);
        for secret in self.secrets() {
            out = out.replace(&secret, "***");
        }
        out
    }

    /// The URL to hand SeaORM, without any password, and the password the
    /// driver would have read from it (percent-decoded; for PostgreSQL a
    /// `password=` query parameter overrides the userinfo one, as in sqlx),
    /// to be set on the driver's connect options directly. SeaORM records
    /// the URL in its connect span at TRACE level.
    ///
    /// Other password-like query parameters (`sslpassword=`, ...) are
    /// dropped: the drivers ignore them (PostgreSQL's with a warning that
    /// prints the value).
    /// For a PostgreSQL or MySQL URL naming a database: the URL of the
    /// server's maintenance database (`postgres` on PostgreSQL, none on
    /// MySQL) with the same credentials and options, and the database's
    /// name. `None` for other URLs.
    pub(crate) fn server_and_database(&self) -> Option<(DatabaseUrl, String)> {
        let mut parsed = url::Url::parse(&self.0).ok()?;
        let maintenance = match parsed.scheme() {
            "postgres" | "postgresql" => "/postgres",
            "mysql" => "",
            _ => return None,
        };
        let name = percent_decode_str(parsed.path().trim_start_matches('/'))
            .decode_utf8()
            .ok()?
            .into_owned();
        if name.is_empty() {
            return None;
        }
        parsed.set_path(maintenance);
        Some((DatabaseUrl(parsed.into()), name))
    }

    pub(crate) fn for_driver(&self) -> (String, Option<String>) {
        let as_is = || (self.0.clone(), None);
        let Ok(mut parsed) = url::Url::parse(&self.0) else {
            return as_is();
        };
        let postgres = match parsed.scheme() {
            "postgres" | "postgresql" => true,
            "mysql" => false,
            _ => return as_is(),
        };
        let mut password = match parsed.password() {
            Some(raw) => match percent_decode_str(raw).decode_utf8() {
                Ok(decoded) => Some(decoded.into_owned()),
                // Let the driver refuse it (its message is scrubbed).
                Err(_) => return as_is(),
            },
            None => None,
        };
        if parsed.set_password(None).is_err() {
            return as_is();
        }
        let pairs: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
        if pairs.iter().any(|(key, _)| is_secret_key(key)) {
            for (key, value) in &pairs {
                if postgres && key == "password" {
                    password = Some(value.clone());
                }
            }
            let kept: Vec<&(String, String)> = pairs
                .iter()
                .filter(|(key, _)| !is_secret_key(key))
                .collect();
            if kept.is_empty() {
                parsed.set_query(None);
            } else {
                parsed.query_pairs_mut().clear().extend_pairs(kept);
            }
        }
        (String::from(parsed), password.filter(|p| !p.is_empty()))
    }
}

/// Whether a query parameter (percent-encoded or not) may hold a secret.
fn is_secret_key(key: &str) -> bool {
    let key = percent_decode_str(key)
        .decode_utf8_lossy()
        .to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|word| key.contains(word))
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DatabaseUrl")
            .field(&self.redacted())
            .finish()
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Replaces the secrets of every URL in `text` with `***`: the userinfo
/// password of `scheme://user:password@host` and the values of
/// password-like query parameters (`?password=...`, `&pass%77ord=...`).
/// Works on free text (driver and parser messages), not only on one URL, and
/// on URLs too malformed for a URL parser (a password with an unencoded `/`,
/// `@` or `?`); when unsure it hides more, never less.
pub(crate) fn redact_urls(text: &str) -> String {
    let is_quote = |c: char| matches!(c, '"' | '\'' | '`');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        // A URL in quotes ends at the closing quote (a password may hold
        // spaces); otherwise at whitespace or a quote.
        let scheme_start = rest[..pos]
            .trim_end_matches(|c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        let quote = scheme_start.chars().next_back().filter(|&c| is_quote(c));
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        let end = match quote {
            Some(q) => tail.find(q),
            None => tail.find(|c: char| c.is_whitespace() || is_quote(c)),
        }
        .unwrap_or(tail.len());
        out.push_str(&redact_after_scheme(&tail[..end]));
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// One URL after its `scheme://`.
fn redact_after_scheme(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    // The userinfo ends at the last `@`: a password may hold `@`, `/`, `?`
    // and `#` unencoded. A path or query with an `@` after a `:` is hidden
    // too, which is harmless.
    let after_userinfo = match url.rfind('@') {
        Some(at) if url[..at].contains(':') => {
            let colon = url.find(':').unwrap_or(at);
            out.push_str(&url[..colon]);
            out.push_str(":***@");
            &url[at + 1..]
        }
        _ => url,
    };
    let Some(q) = after_userinfo.find('?') else {
        out.push_str(after_userinfo);
        return out;
    };
    out.push_str(&after_userinfo[..=q]);
    let query = &after_userinfo[q + 1..];
    let (query, fragment) = match query.find('#') {
        Some(h) => query.split_at(h),
        None => (query, ""),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if is_secret_key(key) => format!("{key}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    out.push_str(&pairs.join("&"));
    out.push_str(fragment);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_never_printed() {
        let url = DatabaseUrl::new("postgres://app:s3cr3t@db.internal:5432/orders_0");
        assert_eq!(
            url.redacted(),
            "postgres://app:***@db.internal:5432/orders_0"
        );
        assert!(!format!("{url:?}").contains("s3cr3t"));
        assert!(!format!("{url}").contains("s3cr3t"));
        assert_eq!(url.scheme(), Some("postgres"));
    }

    #[test]
    fn redacts_inside_free_text_and_malformed_urls() {
        let text =
            "error connecting to \"mysql://root:pw@h:3306/db\" and postgres://u:p%40ss@[::1/x";
        let out = redact_urls(text);
        assert!(!out.contains(":pw@"), "{out}");
        assert!(!out.contains("p%40ss"), "{out}");
        assert!(out.contains("mysql://root:***@h:3306/db"), "{out}");
    }

    #[test]
    fn urls_without_password_are_unchanged() {
        for url in [
            "sqlite://data/s0.db?mode=rwc",
            "postgres://postgres@127.0.0.1:5432/x",
            "sqlite::memory:",
        ] {
            assert_eq!(redact_urls(url), url);
        }
    }

    #[test]
    fn redacts_password_parameters_in_every_form() {
        for (text, secret) in [
            ("postgres://u@h/db?password=Qz7a", "Qz7a"),
            (
                "postgres://u@h/db?sslmode=disable&password=Qz7b&x=1",
                "Qz7b",
            ),
            ("postgres://u@h/db?pass%77ord=Qz7c", "Qz7c"),
            ("postgres://u@h/db?PASSWORD=Qz7d#frag", "Qz7d"),
            ("postgres://u:Qz7e%2F%40x@h/db", "Qz7e"),
            // Unencoded `/`, `@`, `?` and spaces in a password, as a TOML
            // parse error quotes it.
            (
                r#"invalid type: string "postgres://u:PwK/0o1@h/db", expected u32"#,
                "PwK",
            ),
            (r#"string "mysql://u:Qz7 f?g@h/db""#, "Qz7"),
            ("mysql://u:Qz7h@x@h/db", "Qz7h"),
        ] {
            let out = redact_urls(text);
            assert!(!out.contains(secret), "{text} -> {out}");
            assert!(out.contains("***"), "{text} -> {out}");
        }
        assert_eq!(
            redact_urls("postgres://u@h/db?sslmode=disable&password=x"),
            "postgres://u@h/db?sslmode=disable&password=***"
        );
    }

    #[test]
    fn the_driver_url_has_no_password() {
        let url = DatabaseUrl::new("postgres://u:p%40ss@h:5/db?sslmode=disable");
        assert_eq!(
            url.for_driver(),
            (
                "postgres://u@h:5/db?sslmode=disable".to_owned(),
                Some("p@ss".to_owned())
            )
        );
        let url = DatabaseUrl::new("postgres://u:a@h/db?password=b%2Fc&application_name=x");
        assert_eq!(
            url.for_driver(),
            (
                "postgres://u@h/db?application_name=x".to_owned(),
                Some("b/c".to_owned())
            )
        );
        // MySQL's driver ignores a `password` parameter: it is dropped, not used.
        let url = DatabaseUrl::new("mysql://u:a@h/db?password=b");
        assert_eq!(
            url.for_driver(),
            ("mysql://u@h/db".to_owned(), Some("a".to_owned()))
        );
        let url = DatabaseUrl::new("sqlite://data/s0.db?mode=rwc");
        assert_eq!(
            url.for_driver(),
            ("sqlite://data/s0.db?mode=rwc".to_owned(), None)
        );
    }

    #[test]
    fn scrub_removes_password_anywhere() {
        let url = DatabaseUrl::new("mysql://root:hunter2@localhost/db");
        assert_eq!(
            url.scrub("Access denied (password hunter2)"),
            "Access denied (password ***)"
        );
        let url = DatabaseUrl::new("postgres://u@h/db?password=p%2Fq");
        assert_eq!(
            url.scrub("bad password p/q or p%2Fq"),
            "bad password *** or ***"
        );
    }
}
