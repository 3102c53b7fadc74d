//! Database URLs that never show their password.

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

    /// The URL with its password, for the driver only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact_urls(&self.0)
    }

    /// The URL scheme (`postgres`, `mysql`, `sqlite`), if it has one.
    pub fn scheme(&self) -> Option<&str> {
        self.0.split_once(':').map(|(scheme, _)| scheme)
    }

    /// The password, if the URL has one (used to scrub driver messages).
    pub(crate) fn password(&self) -> Option<String> {
        url::Url::parse(&self.0)
            .ok()
            .and_then(|u| u.password().map(|p| p.to_owned()))
            .filter(|p| !p.is_empty())
    }

    /// Scrubs this URL's password out of a message produced by a driver.
    pub(crate) fn scrub(&self, message: &str) -> String {
        let redacted = redact_urls(message);
        match self.password() {
            Some(password) => redacted.replace(&password, "***"),
            None => redacted,
        }
    }
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

/// Replaces the password of every `scheme://user:password@host` in `text` with
/// `***`. Works on free text (driver and parser messages), not only on one URL,
/// and on URLs too malformed for a URL parser.
pub(crate) fn redact_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        // The authority ends at the first '/', whitespace or quote; the userinfo
        // at its last '@'.
        let end = tail
            .find(|c: char| c == '/' || c.is_whitespace() || c == '"' || c == '\'' || c == '?')
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon]);
                        out.push_str(":***");
                        out.push_str(&authority[at..]);
                    }
                    None => out.push_str(authority),
                }
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
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
    fn scrub_removes_password_anywhere() {
        let url = DatabaseUrl::new("mysql://root:hunter2@localhost/db");
        assert_eq!(
            url.scrub("Access denied (password hunter2)"),
            "Access denied (password ***)"
        );
    }
}
