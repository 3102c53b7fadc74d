//! The import rules of `ARCHITECTURE.md`, checked on the source: every
//! module of `shardkit/src` imports only from its own layer or the layers
//! before it, no two files import each other (directly or through others),
//! and no two top-level modules (folders) do.
//!
//! How it reads the source (no dependencies, so it is a small hand-written
//! reader, not a Rust parser):
//!
//! - A lexer drops comments (doc comments included: doc samples are not
//!   imports), string, char and byte literals and lifetimes.
//! - Each file is read as a module (`read/execute.rs` is `read::execute`,
//!   `read/mod.rs` is `read`, `lib.rs` the crate root), with its inline
//!   modules (`mod sealed { .. }`). Items under `#[cfg(test)]` (unit tests'
//!   `mod tests { use super::*; .. }`) are skipped.
//! - Every `use` tree is expanded (`pub use`, `pub(crate) use`, groups at any
//!   depth, `self`, `self::`, `super::super::`, `crate::`, `as`, globs), and
//!   so is every path in code that starts with `crate::`, `self::`, `super::`
//!   or a name of the module (`child::f()`). Paths of other crates (`std`,
//!   `sea_orm`, ..) are not edges.
//! - A path is resolved to the file that defines what it names: it walks the
//!   modules; a name defined in a module (`struct`, `fn`, `mod`, ..) is that
//!   module's file; a name a module imports (`use`, `pub use`) is followed to
//!   where that import leads; a name a module glob-imports is looked up
//!   behind the glob. When the trail ends without a definition, the last
//!   module reached stands for it.
//! - A glob import of a module (`use super::*`) is an edge to that module's
//!   file and, for every name the importing module uses that the glob brings
//!   (from that module, or from the modules it glob-imports in turn), an
//!   edge to the file that defines it. A name counts as used when it appears
//!   in code not after `.` or `::` and not before `:` (fields, bindings).
//!
//! Declaring a module (`mod child;`) is not an import; a parent that
//! re-exports a child (`pub use child::Item`) imports it, and a child that
//! uses an item defined in its parent imports the parent: both together are
//! a cycle. The target is sea-orm's style: a `mod.rs` declares and
//! re-exports, and files import each other by `crate::` paths to the file
//! that defines the item.
//!
//! The checker works on a map of relative path → text, so the tests at the
//! end of this file check it on small trees built in memory.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

/// `ARCHITECTURE.md`'s layers, first to last; a module may import from its
/// own layer and the ones before it.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "core",
        &[
            "entity", "error", "key", "clock", "phase", "id_spec", "trace", "metrics", "boxed",
            "job",
        ],
    ),
    ("topology", &["topology"]),
    ("execution", &["exec"]),
    ("reads and writes", &["read", "pipeline", "tx"]),
    (
        "features",
        &["ids", "gsi", "rollout", "verify", "rebalance", "reference"],
    ),
    ("facade", &["cluster", "testing"]),
    ("cross-key", &["outbox"]),
    ("operator", &["cli"]),
];

fn layer_of(group: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, mods)| mods.contains(&group))
}

/// A source tree: path relative to `src` (`read/execute.rs`) → text.
type Tree = BTreeMap<String, String>;

/// The top-level module (folder) of a file: `read/execute.rs` → `read`,
/// `cluster.rs` → `cluster`, `lib.rs` → `lib`.
fn group_of(file: &str) -> &str {
    let first = file.split('/').next().unwrap_or(file);
    first.strip_suffix(".rs").unwrap_or(first)
}

// ---------------------------------------------------------------------------
// Lexing
// ---------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    /// An identifier or keyword (`r#x` is `x`; `$crate` is `crate`; another
    /// macro variable keeps its `$`).
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
    /// A string, char, byte or number literal, or a lifetime.
    Lit,
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Where the string literal starting at `i` ends (exclusive), if one does:
/// `"..."`, `b"..."`, `c"..."`, `r"..."`, `r#"..."#`, `br#"..."#`, `cr".."`.
fn string_end(c: &[char], i: usize) -> Option<usize> {
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let mut j = i;
    if at(j) == 'b' || at(j) == 'c' {
        j += 1;
    }
    let raw = at(j) == 'r';
    if raw {
        j += 1;
    }
    let mut hashes = 0;
    while raw && at(j) == '#' {
        hashes += 1;
        j += 1;
    }
    if at(j) != '"' {
        return None;
    }
    j += 1;
    while j < c.len() {
        if !raw && c[j] == '\\' {
            j += 2;
            continue;
        }
        if c[j] == '"' && (0..hashes).all(|h| at(j + 1 + h) == '#') {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

/// The source as tokens, without comments and literals.
fn lex(text: &str) -> Vec<Token> {
    let c: Vec<char> = text.chars().collect();
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let newlines = |from: usize, to: usize| {
        c[from..to.min(c.len())]
            .iter()
            .filter(|&&x| x == '\n')
            .count()
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
            continue;
        }
        if ch.is_whitespace() {
            i += 1;
            continue;
        }
        if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if ch == '/' && at(i + 1) == '*' {
            let start = i;
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += newlines(start, i);
            continue;
        }
        if (ch == '"' || ch == 'b' || ch == 'c' || ch == 'r')
            && let Some(end) = string_end(&c, i)
        {
            out.push(Token {
                tok: Tok::Lit,
                line,
            });
            line += newlines(i, end);
            i = end;
            continue;
        }
        if ch == '\'' || (ch == 'b' && at(i + 1) == '\'') {
            let q = if ch == 'b' { i + 1 } else { i };
            if at(q + 1) == '\\' {
                // An escaped char: '\n', '\'', '\u{1F600}'.
                let mut j = q + 3;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if at(q + 2) == '\'' {
                i = q + 3;
            } else {
                // A lifetime or a label.
                let mut j = q + 1;
                while j < c.len() && is_ident_char(c[j]) {
                    j += 1;
                }
                i = j.max(q + 1);
            }
            out.push(Token {
                tok: Tok::Lit,
                line,
            });
            continue;
        }
        if is_ident_start(ch) || (ch == '$' && is_ident_start(at(i + 1))) {
            let mut j = i + 1;
            while j < c.len() && is_ident_char(c[j]) {
                j += 1;
            }
            let mut word: String = c[i..j].iter().collect();
            if word == "r" && at(j) == '#' && is_ident_start(at(j + 1)) {
                let mut k = j + 1;
                while k < c.len() && is_ident_char(c[k]) {
                    k += 1;
                }
                word = c[j + 1..k].iter().collect();
                j = k;
            }
            if word == "$crate" {
                word = "crate".to_owned();
            }
            out.push(Token {
                tok: Tok::Ident(word),
                line,
            });
            i = j;
            continue;
        }
        if ch.is_ascii_digit() {
            let mut j = i + 1;
            while j < c.len()
                && (is_ident_char(c[j]) || (c[j] == '.' && at(j + 1).is_ascii_digit()))
            {
                j += 1;
            }
            out.push(Token {
                tok: Tok::Lit,
                line,
            });
            i = j;
            continue;
        }
        if ch == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::Sep,
                line,
            });
            i += 2;
            continue;
        }
        out.push(Token {
            tok: Tok::Punct(ch),
            line,
        });
        i += 1;
    }
    out
}

// ---------------------------------------------------------------------------
// Reading modules
// ---------------------------------------------------------------------------

/// What a `use` leaf binds.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Binding {
    Name(String),
    /// `as _`: used for its trait methods, binds nothing.
    Underscore,
    Glob,
}

/// One path a file names: a leaf of a `use` tree, or a path in code.
#[derive(Clone, Debug)]
struct Ref {
    /// The module the path is written in (paths are relative to it).
    module: Vec<String>,
    /// As written: `["super", "keys", "read_err"]`, `["::", "std"]`.
    path: Vec<String>,
    /// `None`: a path in code, not a `use`.
    binding: Option<Binding>,
    line: usize,
}

impl Ref {
    fn describe(&self) -> String {
        let path = self.path.join("::").replace("::::", "::");
        match &self.binding {
            None => format!("line {}: {path}", self.line),
            Some(Binding::Glob) => format!("line {}: use {path}::*", self.line),
            Some(_) => format!("line {}: use {path}", self.line),
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Module {
    file: String,
    /// Submodules, in files or inline.
    children: BTreeSet<String>,
    /// Names of the items defined here (`struct`, `fn`, `const`, ..;
    /// submodules are in `children`).
    items: BTreeSet<String>,
    /// Module-level `use` leaves by the name they bind.
    named: BTreeMap<String, Vec<Vec<String>>>,
    /// Module-level glob `use`s.
    globs: Vec<Vec<String>>,
    /// Names used in this module's code that no path qualifies
    /// (`Shards`, not `x::Shards` or `.shards`), with whether a `::` follows.
    uses: BTreeMap<String, bool>,
}

#[derive(Debug, Default)]
struct Crate {
    modules: BTreeMap<Vec<String>, Module>,
    /// Each file's paths.
    refs: BTreeMap<String, Vec<Ref>>,
    /// Modules declared under `#[cfg(test)]` (`#[cfg(test)] mod tests;`).
    test_only: BTreeSet<Vec<String>>,
}

/// `read/execute.rs` → `["read", "execute"]`; `read/mod.rs` → `["read"]`;
/// `lib.rs` → `[]`.
fn module_path_of(file: &str) -> Vec<String> {
    let stem = file.strip_suffix(".rs").unwrap_or(file);
    let mut parts: Vec<String> = stem.split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] {
        parts.pop();
    }
    parts
}

struct Reader<'a> {
    toks: &'a [Token],
    file: &'a str,
    krate: &'a mut Crate,
}

impl Reader<'_> {
    fn ident(&self, i: usize) -> Option<&str> {
        match self.toks.get(i).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => Some(s),
            _ => None,
        }
    }

    fn is(&self, i: usize, c: char) -> bool {
        matches!(self.toks.get(i).map(|t| &t.tok), Some(Tok::Punct(p)) if *p == c)
    }

    fn is_sep(&self, i: usize) -> bool {
        matches!(self.toks.get(i).map(|t| &t.tok), Some(Tok::Sep))
    }

    fn line(&self, i: usize) -> usize {
        self.toks.get(i).or(self.toks.last()).map_or(0, |t| t.line)
    }

    /// The index after the group opened at `i` (`(`, `[` or `{`).
    fn after_group(&self, i: usize) -> usize {
        let mut depth = 0usize;
        let mut j = i;
        while j < self.toks.len() {
            match self.toks[j].tok {
                Tok::Punct('(' | '[' | '{') => depth += 1,
                Tok::Punct(')' | ']' | '}') => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        return j + 1;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        j
    }

    /// Reads the attributes at `i` (`#[..]`, `#![..]`); returns the index
    /// after them and whether one is `#[cfg(test)]` (or `cfg(all(test, ..))`).
    fn attributes(&self, mut i: usize) -> (usize, bool) {
        let mut test = false;
        while self.is(i, '#') {
            let open = if self.is(i + 1, '!') { i + 2 } else { i + 1 };
            if !self.is(open, '[') {
                break;
            }
            let end = self.after_group(open);
            let inner: Vec<&Tok> = self.toks[open + 1..end.saturating_sub(1)]
                .iter()
                .map(|t| &t.tok)
                .collect();
            let word = |k: usize, w: &str| matches!(inner.get(k), Some(Tok::Ident(s)) if s == w);
            let punct = |k: usize, p: char| matches!(inner.get(k), Some(Tok::Punct(c)) if *c == p);
            if word(0, "cfg") && punct(1, '(') {
                if word(2, "test") && punct(3, ')') && inner.len() == 4 {
                    test = true;
                }
                if word(2, "all") && punct(3, '(') {
                    // `cfg(all(.., test, ..))`: `test` as a direct argument.
                    let mut depth = 0;
                    for t in &inner[4..] {
                        match t {
                            Tok::Punct('(') => depth += 1,
                            Tok::Punct(')') => depth -= 1,
                            Tok::Ident(s) if s == "test" && depth == 0 => test = true,
                            _ => {}
                        }
                    }
                }
            }
            i = end;
        }
        (i, test)
    }

    /// The index after the item starting at `i`: after its `;`, or after its
    /// body's closing `}` (unless `semi_only`: `const X: T = T { .. };`).
    /// Stops before a `}` that closes the enclosing block.
    fn item_end(&self, i: usize, semi_only: bool, limit: usize) -> usize {
        let mut depth = 0usize;
        let mut j = i;
        while j < limit {
            match self.toks[j].tok {
                Tok::Punct('(' | '[' | '{') => depth += 1,
                Tok::Punct(c @ (')' | ']' | '}')) => {
                    if depth == 0 {
                        return j;
                    }
                    depth -= 1;
                    if depth == 0 && c == '}' && !semi_only {
                        return j + 1;
                    }
                }
                Tok::Punct(';') if depth == 0 => return j + 1,
                _ => {}
            }
            j += 1;
        }
        limit
    }

    /// Reads one `use` tree at `*i` into `out` (path as written, binding).
    fn use_tree(&self, i: &mut usize, prefix: Vec<String>, out: &mut Vec<(Vec<String>, Binding)>) {
        let mut path = prefix;
        if self.is_sep(*i) {
            if path.is_empty() {
                path.push("::".to_owned());
            }
            *i += 1;
        }
        loop {
            if self.is(*i, '*') {
                *i += 1;
                out.push((path, Binding::Glob));
                return;
            }
            if self.is(*i, '{') {
                *i += 1;
                while *i < self.toks.len() && !self.is(*i, '}') {
                    let before = *i;
                    self.use_tree(i, path.clone(), out);
                    if self.is(*i, ',') {
                        *i += 1;
                    } else if *i == before {
                        *i += 1; // not a tree: step over it
                    }
                }
                *i += 1;
                return;
            }
            let Some(name) = self.ident(*i).map(str::to_owned) else {
                return;
            };
            *i += 1;
            if self.is_sep(*i) {
                path.push(name);
                *i += 1;
                continue;
            }
            let (full, mut binding) = if name == "self" {
                let bound = path.last().cloned().unwrap_or_default();
                (path, Binding::Name(bound))
            } else {
                path.push(name.clone());
                (path, Binding::Name(name))
            };
            if self.ident(*i) == Some("as") {
                binding = match self.ident(*i + 1) {
                    Some("_") => Binding::Underscore,
                    Some(n) => Binding::Name(n.to_owned()),
                    None => binding,
                };
                *i += 2;
            }
            out.push((full, binding));
            return;
        }
    }

    /// Reads the `use` declaration whose tree starts at `i`; returns the
    /// index after its `;`.
    fn use_decl(&mut self, i: usize, module: &[String], module_level: bool) -> usize {
        let line = self.line(i);
        let mut leaves = Vec::new();
        let mut j = i;
        self.use_tree(&mut j, Vec::new(), &mut leaves);
        let end = self.item_end(j, true, self.toks.len());
        for (path, binding) in leaves {
            if module_level {
                let m = self.krate.modules.entry(module.to_vec()).or_default();
                match &binding {
                    Binding::Name(n) => m.named.entry(n.clone()).or_default().push(path.clone()),
                    Binding::Glob => m.globs.push(path.clone()),
                    Binding::Underscore => {}
                }
            }
            self.krate
                .refs
                .entry(self.file.to_owned())
                .or_default()
                .push(Ref {
                    module: module.to_vec(),
                    path,
                    binding: Some(binding),
                    line,
                });
        }
        end
    }

    /// Reads the body of a module from `*i` to its closing `}` (or the end).
    fn module_body(&mut self, i: &mut usize, module: &[String]) {
        self.krate.modules.entry(module.to_vec()).or_default().file = self.file.to_owned();
        while *i < self.toks.len() {
            if self.is(*i, '}') {
                *i += 1;
                return;
            }
            if self.is(*i, ';') {
                *i += 1;
                continue;
            }
            let (mut j, test) = self.attributes(*i);
            if self.ident(j) == Some("pub") {
                j += 1;
                if self.is(j, '(') {
                    j = self.after_group(j);
                }
            }
            match self.ident(j) {
                Some("use") => {
                    *i = if test {
                        self.item_end(j, true, self.toks.len())
                    } else {
                        self.use_decl(j + 1, module, true)
                    };
                    continue;
                }
                Some("mod") => {
                    let name = self.ident(j + 1).unwrap_or("").to_owned();
                    let mut child = module.to_vec();
                    child.push(name.clone());
                    if self.is(j + 2, '{') {
                        if test {
                            *i = self.after_group(j + 2);
                        } else {
                            self.krate
                                .modules
                                .entry(module.to_vec())
                                .or_default()
                                .children
                                .insert(name);
                            *i = j + 3;
                            self.module_body(i, &child);
                        }
                    } else {
                        if test {
                            self.krate.test_only.insert(child);
                        }
                        *i = self.item_end(j, true, self.toks.len());
                    }
                    continue;
                }
                _ => {}
            }
            // Any other item: note the name it defines, read its body.
            let mut k = j;
            loop {
                match self.ident(k) {
                    Some("async" | "unsafe" | "default" | "auto" | "safe") => k += 1,
                    Some("extern") if self.ident(k + 1) != Some("crate") => {
                        k += 1;
                        if matches!(self.toks.get(k).map(|t| &t.tok), Some(Tok::Lit)) {
                            k += 1;
                        }
                    }
                    Some("const")
                        if matches!(
                            self.ident(k + 1),
                            Some("fn" | "async" | "unsafe" | "extern")
                        ) =>
                    {
                        k += 1
                    }
                    _ => break,
                }
            }
            let kw = self.ident(k).unwrap_or("").to_owned();
            let name = match kw.as_str() {
                "fn" | "struct" | "enum" | "trait" | "type" | "const" => self.ident(k + 1),
                "static" if self.ident(k + 1) == Some("mut") => self.ident(k + 2),
                "static" => self.ident(k + 1),
                "union" if self.ident(k + 1).is_some() => self.ident(k + 1),
                "macro_rules" if self.is(k + 1, '!') => self.ident(k + 2),
                _ => None,
            };
            if !test && let Some(name) = name.filter(|n| *n != "_") {
                let name = name.to_owned();
                self.krate
                    .modules
                    .entry(module.to_vec())
                    .or_default()
                    .items
                    .insert(name);
            }
            let semi_only = matches!(kw.as_str(), "const" | "static" | "type");
            let end = self.item_end(k, semi_only, self.toks.len()).max(*i + 1);
            if !test {
                self.code(*i, end, module);
            }
            *i = end;
        }
    }

    /// Reads code (an item's signature and body) for `use` declarations,
    /// paths and the names it uses.
    fn code(&mut self, start: usize, end: usize, module: &[String]) {
        let mut k = start;
        while k < end {
            let (after, test) = self.attributes(k);
            if after != k {
                k = if test {
                    self.item_end(after, false, end)
                } else {
                    after
                };
                continue;
            }
            let Some(word) = self.ident(k).map(str::to_owned) else {
                k += 1;
                continue;
            };
            if word == "use" && !self.is(k + 1, '<') {
                k = self.use_decl(k + 1, module, false).min(end).max(k + 1);
                continue;
            }
            let qualified = k > 0 && (self.is_sep(k - 1) || self.is(k - 1, '.'));
            if qualified {
                k += 1;
                continue;
            }
            let followed = self.is_sep(k + 1) && self.ident(k + 2).is_some();
            // `name: ..` is a field, a binding or a parameter, not a use.
            if self.is(k + 1, ':') {
                k += 1;
                continue;
            }
            self.krate
                .modules
                .entry(module.to_vec())
                .or_default()
                .uses
                .entry(word.clone())
                .and_modify(|f| *f |= followed)
                .or_insert(followed);
            if !followed {
                k += 1;
                continue;
            }
            // A path in code: `crate::a::b`, `super::x`, `child::f`.
            let in_visibility = k >= 2 && self.ident(k - 1) == Some("in") && self.is(k - 2, '(');
            let line = self.line(k);
            let mut path = vec![word];
            let mut j = k + 1;
            while self.is_sep(j)
                && let Some(seg) = self.ident(j + 1)
            {
                path.push(seg.to_owned());
                j += 2;
            }
            if !in_visibility {
                self.krate
                    .refs
                    .entry(self.file.to_owned())
                    .or_default()
                    .push(Ref {
                        module: module.to_vec(),
                        path,
                        binding: None,
                        line,
                    });
            }
            k = j;
        }
    }
}

/// Reads every file of a tree.
fn read_crate(tree: &Tree) -> Crate {
    let mut krate = Crate::default();
    for (file, text) in tree {
        let path = module_path_of(file);
        // Parents know their file children even before (or without) a `mod`.
        for n in 0..path.len() {
            krate
                .modules
                .entry(path[..n].to_vec())
                .or_default()
                .children
                .insert(path[n].clone());
        }
        let toks = lex(text);
        let mut reader = Reader {
            toks: &toks,
            file,
            krate: &mut krate,
        };
        let mut i = 0;
        reader.module_body(&mut i, &path);
    }
    // Parents without a file of their own (`a/b.rs` without `a.rs`).
    let files: BTreeMap<Vec<String>, String> = krate
        .modules
        .iter()
        .map(|(p, m)| (p.clone(), m.file.clone()))
        .collect();
    for (path, m) in krate.modules.iter_mut() {
        if m.file.is_empty() {
            m.file = (0..path.len())
                .rev()
                .find_map(|n| files.get(&path[..n]).filter(|f| !f.is_empty()).cloned())
                .unwrap_or_else(|| "lib.rs".to_owned());
        }
    }
    krate
}

// ---------------------------------------------------------------------------
// Resolving
// ---------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
enum Found {
    /// The file that defines it.
    File(String),
    /// In another crate.
    External,
    /// Not found; the file of the last module reached.
    Missing(String),
}

/// How deep re-exports are followed.
const MAX_DEPTH: usize = 32;

impl Crate {
    fn module(&self, path: &[String]) -> Option<&Module> {
        self.modules.get(path)
    }

    /// Whether `name` is declared in module `path`: a submodule, an item or
    /// a named import.
    fn declares(&self, path: &[String], name: &str) -> bool {
        self.module(path).is_some_and(|m| {
            m.children.contains(name)
                || m.items.contains(name)
                // `pub use sea_orm;` re-exports a crate: not a local name.
                || m.named.get(name).is_some_and(|paths| paths.iter().any(|p| p != &[name]))
        })
    }

    /// A path as written in module `at`, made absolute (segments after
    /// `crate::`); `None` for another crate's path.
    fn absolute(&self, at: &[String], path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        match first.as_str() {
            "::" => None,
            "crate" => Some(path[1..].to_vec()),
            "self" | "super" => {
                let mut base = at.to_vec();
                let mut n = 0;
                while n < path.len() {
                    match path[n].as_str() {
                        "self" => {}
                        "super" => {
                            base.pop()?;
                        }
                        _ => break,
                    }
                    n += 1;
                }
                base.extend_from_slice(&path[n..]);
                Some(base)
            }
            name if self.declares(at, name) => {
                let mut full = at.to_vec();
                full.extend_from_slice(path);
                Some(full)
            }
            _ => None,
        }
    }

    /// The module an absolute path names, following imports of modules.
    fn module_at(&self, abs: &[String], depth: usize) -> Option<Vec<String>> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut cur: Vec<String> = Vec::new();
        for (n, seg) in abs.iter().enumerate() {
            let m = self.module(&cur)?;
            if m.children.contains(seg) {
                cur.push(seg.clone());
                continue;
            }
            for path in m.named.get(seg).into_iter().flatten() {
                if let Some(mut target) = self.absolute(&cur, path) {
                    target.extend_from_slice(&abs[n + 1..]);
                    if let Some(found) = self.module_at(&target, depth + 1) {
                        return Some(found);
                    }
                }
            }
            return None;
        }
        Some(cur)
    }

    /// The file that defines what an absolute path names.
    fn resolve(&self, abs: &[String]) -> Found {
        self.resolve_in(abs, 0, &mut BTreeSet::new())
    }

    fn resolve_in(&self, abs: &[String], depth: usize, seen: &mut BTreeSet<Vec<String>>) -> Found {
        let root = self
            .module(&[])
            .map_or_else(|| "lib.rs".to_owned(), |m| m.file.clone());
        if depth > MAX_DEPTH || !seen.insert(abs.to_vec()) {
            return Found::Missing(root);
        }
        let mut cur: Vec<String> = Vec::new();
        for (n, seg) in abs.iter().enumerate() {
            let Some(m) = self.module(&cur) else {
                return Found::Missing(root);
            };
            if m.children.contains(seg) {
                cur.push(seg.clone());
                continue;
            }
            if m.items.contains(seg) {
                return Found::File(m.file.clone());
            }
            if let Some(paths) = m.named.get(seg) {
                let mut result = Found::Missing(m.file.clone());
                for path in paths {
                    match self.absolute(&cur, path) {
                        None => result = Found::External,
                        Some(mut target) => {
                            target.extend_from_slice(&abs[n + 1..]);
                            match self.resolve_in(&target, depth + 1, seen) {
                                Found::File(f) => return Found::File(f),
                                Found::External => result = Found::External,
                                Found::Missing(f) if result != Found::External => {
                                    result = Found::Missing(f)
                                }
                                Found::Missing(_) => {}
                            }
                        }
                    }
                }
                return result;
            }
            for glob in &m.globs {
                let Some(target) = self.absolute(&cur, glob) else {
                    continue;
                };
                let Some(globbed) = self.module_at(&target, depth + 1) else {
                    continue;
                };
                if globbed == cur {
                    continue;
                }
                let mut target = globbed;
                target.extend_from_slice(&abs[n..]);
                if let Found::File(f) = self.resolve_in(&target, depth + 1, seen) {
                    return Found::File(f);
                }
            }
            return Found::Missing(m.file.clone());
        }
        self.module(&cur)
            .map_or(Found::Missing(root), |m| Found::File(m.file.clone()))
    }

    /// The modules a glob import of `module` brings names from: itself, and
    /// the modules it glob-imports, recursively.
    fn glob_closure(&self, module: &[String], out: &mut BTreeSet<Vec<String>>, depth: usize) {
        if depth > MAX_DEPTH || !out.insert(module.to_vec()) {
            return;
        }
        let Some(m) = self.module(module) else {
            return;
        };
        for glob in &m.globs {
            if let Some(target) = self.absolute(module, glob)
                && let Some(next) = self.module_at(&target, depth + 1)
            {
                self.glob_closure(&next, out, depth + 1);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The graph and the rules
// ---------------------------------------------------------------------------

/// `from` → `to` → why (the paths that made the edge).
type Edges = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn add_edge(edges: &mut Edges, from: &str, to: &str, why: String) {
    if from == to {
        return;
    }
    let reasons = edges
        .entry(from.to_owned())
        .or_default()
        .entry(to.to_owned())
        .or_default();
    if !reasons.contains(&why) {
        reasons.push(why);
    }
}

/// The file graph: which file imports which, resolved to defining files.
fn file_edges(tree: &Tree) -> Edges {
    let krate = read_crate(tree);
    let test_only = |file: &str| {
        let path = module_path_of(file);
        krate.test_only.iter().any(|t| path.starts_with(t))
    };
    let mut edges = Edges::new();
    for file in tree.keys() {
        if !test_only(file) {
            edges.entry(file.clone()).or_default();
        }
    }
    for (file, refs) in &krate.refs {
        if test_only(file) {
            continue;
        }
        for r in refs {
            let Some(abs) = krate.absolute(&r.module, &r.path) else {
                continue;
            };
            if r.binding == Some(Binding::Glob)
                && let Some(globbed) = krate.module_at(&abs, 0)
            {
                if let Some(target) = krate.module(&globbed) {
                    add_edge(
                        &mut edges,
                        file,
                        &target.file,
                        format!("{} (glob)", r.describe()),
                    );
                }
                // What the globbed module glob-imports in turn is an edge
                // only for the names used through it (below).
                let mut modules = BTreeSet::new();
                krate.glob_closure(&globbed, &mut modules, 0);
                // The names this module uses that the glob brings.
                let Some(here) = krate.module(&r.module) else {
                    continue;
                };
                for (name, followed_by_path) in &here.uses {
                    if here.items.contains(name)
                        || here.named.contains_key(name)
                        || here.children.contains(name)
                    {
                        continue; // its own, or imported by name
                    }
                    let provides = modules.iter().any(|m| {
                        krate.module(m).is_some_and(|g| {
                            g.items.contains(name)
                                || g.named.contains_key(name)
                                || (*followed_by_path && g.children.contains(name))
                        })
                    });
                    if !provides {
                        continue;
                    }
                    let mut path = globbed.clone();
                    path.push(name.clone());
                    if let Found::File(target) = krate.resolve(&path) {
                        add_edge(
                            &mut edges,
                            file,
                            &target,
                            format!("{} → {name}", r.describe()),
                        );
                    }
                }
                continue;
            }
            match krate.resolve(&abs) {
                Found::File(target) | Found::Missing(target) => {
                    add_edge(&mut edges, file, &target, r.describe())
                }
                Found::External => {}
            }
        }
    }
    edges
}

/// The graph of top-level modules, each edge with the file edges behind it.
fn folder_edges(files: &Edges) -> Edges {
    let mut edges = Edges::new();
    for (from, to) in files {
        edges.entry(group_of(from).to_owned()).or_default();
        for (target, why) in to {
            let first = why.first().map_or("", String::as_str);
            add_edge(
                &mut edges,
                group_of(from),
                group_of(target),
                format!("{from} -> {target} ({first})"),
            );
        }
    }
    edges
}

/// Strongly connected components (Tarjan).
fn components(edges: &Edges) -> Vec<BTreeSet<String>> {
    struct State<'e> {
        edges: &'e Edges,
        index: BTreeMap<&'e str, usize>,
        low: BTreeMap<&'e str, usize>,
        stack: Vec<&'e str>,
        on_stack: BTreeSet<&'e str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'e>(s: &mut State<'e>, v: &'e str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let edges = s.edges;
        for w in edges.get(v).into_iter().flat_map(|t| t.keys()) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.insert(w.to_owned());
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: BTreeSet<&str> = edges
        .iter()
        .flat_map(|(f, t)| std::iter::once(f.as_str()).chain(t.keys().map(String::as_str)))
        .collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The cycles of a graph: for every edge that lies on a cycle, the shortest
/// cycle through it (so each edge to cut is shown), without repeats, shortest
/// first. Each cycle starts and ends at its smallest node.
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let mut found: BTreeSet<(usize, Vec<String>)> = BTreeSet::new();
    for component in components(edges).into_iter().filter(|c| c.len() > 1) {
        for from in &component {
            for to in edges[from].keys().filter(|t| component.contains(*t)) {
                // Shortest path `to` → `from` inside the component.
                let mut back: BTreeMap<&str, &str> = BTreeMap::new();
                let mut queue = VecDeque::from([to.as_str()]);
                let mut reached = to == from;
                while let Some(v) = queue.pop_front() {
                    if v == from {
                        reached = true;
                        break;
                    }
                    for w in edges.get(v).into_iter().flat_map(|t| t.keys()) {
                        if component.contains(w) && w != to && !back.contains_key(w.as_str()) {
                            back.insert(w, v);
                            queue.push_back(w);
                        }
                    }
                }
                if !reached {
                    continue;
                }
                let mut path = vec![from.clone()];
                let mut v = from.as_str();
                while v != to {
                    v = back[v];
                    path.push(v.to_owned());
                }
                path.reverse(); // to .. from
                let mut cycle = vec![from.clone()];
                cycle.extend(path.into_iter().filter(|n| n != from));
                let min = (0..cycle.len()).min_by_key(|&i| &cycle[i]).unwrap_or(0);
                cycle.rotate_left(min);
                cycle.push(cycle[0].clone());
                found.insert((cycle.len(), cycle));
            }
        }
    }
    found.into_iter().map(|(_, c)| c).collect()
}

/// Everything the checker finds in a tree.
#[derive(Debug)]
struct Report {
    files: Edges,
    file_cycles: Vec<Vec<String>>,
    folders: Edges,
    folder_cycles: Vec<Vec<String>>,
    /// `(from file, to file, why)` where `to`'s layer comes after `from`'s.
    layer_breaches: Vec<(String, String, Vec<String>)>,
    /// Top-level modules that `LAYERS` does not name.
    without_layer: BTreeSet<String>,
}

fn check(tree: &Tree) -> Report {
    let files = file_edges(tree);
    let folders = folder_edges(&files);
    let mut layer_breaches = Vec::new();
    for (from, to) in &files {
        for (target, why) in to {
            if let (Some(a), Some(b)) = (layer_of(group_of(from)), layer_of(group_of(target)))
                && b > a
            {
                layer_breaches.push((from.clone(), target.clone(), why.clone()));
            }
        }
    }
    let without_layer = files
        .keys()
        .map(|f| group_of(f).to_owned())
        .filter(|g| g != "lib" && layer_of(g).is_none())
        .collect();
    Report {
        file_cycles: cycles(&files),
        folder_cycles: cycles(&folders),
        files,
        folders,
        layer_breaches,
        without_layer,
    }
}

/// The cycles' strongly connected groups, then each cycle with why each
/// step is an edge.
fn describe_cycles(cycles: &[Vec<String>], edges: &Edges) -> String {
    let mut out = String::new();
    let tangles: Vec<BTreeSet<String>> = components(edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .collect();
    if !tangles.is_empty() {
        out.push_str(&format!(
            "\n{} groups of nodes that reach each other:\n",
            tangles.len()
        ));
        for t in &tangles {
            let names: Vec<&str> = t.iter().map(String::as_str).collect();
            out.push_str(&format!("  [{}]\n", names.join(", ")));
        }
        out.push_str("cycles:\n");
    }
    for cycle in cycles {
        out.push_str(&format!("\n  {}\n", cycle.join(" -> ")));
        for step in cycle.windows(2) {
            let why = &edges[&step[0]][&step[1]];
            let shown: Vec<&str> = why.iter().take(3).map(String::as_str).collect();
            let more = if why.len() > 3 {
                format!(" (+{} more)", why.len() - 3)
            } else {
                String::new()
            };
            out.push_str(&format!(
                "      {} -> {}: {}{more}\n",
                step[0],
                step[1],
                shown.join("; ")
            ));
        }
    }
    out
}

fn describe_breaches(breaches: &[(String, String, Vec<String>)]) -> String {
    let mut out = String::new();
    for (from, to, why) in breaches {
        let (a, b) = (
            layer_of(group_of(from)).unwrap_or(0),
            layer_of(group_of(to)).unwrap_or(0),
        );
        let shown: Vec<&str> = why.iter().take(3).map(String::as_str).collect();
        out.push_str(&format!(
            "\n  {from} ({}) imports {to} ({}): {}",
            LAYERS[a].0,
            LAYERS[b].0,
            shown.join("; ")
        ));
    }
    out
}

// ---------------------------------------------------------------------------
// The real tree
// ---------------------------------------------------------------------------

/// Every `.rs` file under `shardkit/src`.
/// The checker's report on shardkit/src, made once for every test that
/// reads it.
fn real_report() -> &'static Report {
    static REPORT: std::sync::OnceLock<Report> = std::sync::OnceLock::new();
    REPORT.get_or_init(|| check(&source_tree()))
}

fn source_tree() -> Tree {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .ok()
        .or(option_env!("CARGO_MANIFEST_DIR").map(str::to_owned))
        .expect("CARGO_MANIFEST_DIR (the shardkit crate's directory)");
    let src = Path::new(&dir).join("src");
    let mut tree = Tree::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(&src).expect("under src");
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                tree.insert(
                    rel.join("/"),
                    std::fs::read_to_string(&path).expect("read file"),
                );
            }
        }
    }
    assert!(
        tree.contains_key("lib.rs"),
        "no lib.rs under {}",
        src.display()
    );
    tree
}

#[test]
fn every_module_has_a_layer() {
    let report = real_report();
    assert!(
        report.without_layer.is_empty(),
        "modules without a layer (add them to ARCHITECTURE.md and LAYERS): {:?}",
        report.without_layer
    );
}

#[test]
fn layers_import_one_way() {
    let report = real_report();
    assert!(
        report.layer_breaches.is_empty(),
        "{} imports against the layers:{}\n",
        report.layer_breaches.len(),
        describe_breaches(&report.layer_breaches)
    );
}

#[test]
fn no_import_cycle_between_files() {
    let report = real_report();
    assert!(
        report.file_cycles.is_empty(),
        "{} import cycles between files (the shortest through each edge on a cycle):{}",
        report.file_cycles.len(),
        describe_cycles(&report.file_cycles, &report.files)
    );
}

#[test]
fn no_import_cycle_between_folders() {
    // The file graph folded to top-level modules (`rollout/fold.rs` →
    // `rollout`): a feature may use another feature, never both ways.
    let report = real_report();
    assert!(
        report.folder_cycles.is_empty(),
        "{} import cycles between top-level modules:{}",
        report.folder_cycles.len(),
        describe_cycles(&report.folder_cycles, &report.folders)
    );
}

#[test]
fn the_real_tree_is_read() {
    // The reader finds imports in the real tree (a reader that finds
    // nothing would pass every rule).
    let report = real_report();
    let n: usize = report.files.values().map(BTreeMap::len).sum();
    assert!(n > 100, "only {n} file edges found in shardkit/src");
    assert!(report.files.len() > 20);
    if std::env::var_os("ARCHITECTURE_PRINT").is_some() {
        // `ARCHITECTURE_PRINT=1`: the whole file graph, with reasons.
        for (from, to) in &report.files {
            for (target, why) in to {
                println!("{from} -> {target}: {}", why.join("; "));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The checker on trees built in memory
// ---------------------------------------------------------------------------

fn tree(files: &[(&str, &str)]) -> Tree {
    files
        .iter()
        .map(|(p, t)| (p.to_string(), t.to_string()))
        .collect()
}

fn edge_set(files: &[(&str, &str)]) -> BTreeSet<(String, String)> {
    file_edges(&tree(files))
        .into_iter()
        .flat_map(|(f, to)| to.into_keys().map(move |t| (f.clone(), t)))
        .collect()
}

fn pair(a: &str, b: &str) -> (String, String) {
    (a.to_owned(), b.to_owned())
}

fn cycle(nodes: &[&str]) -> Vec<String> {
    nodes.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_lexer_drops_comments_strings_and_doc_samples() {
    let text = r####"
//! use crate::a::A;
/// ```
/// use crate::b::B;
/// ```
/* use crate::c::C; /* nested */ crate::d::D */
#[doc = "crate::e::E"]
fn f<'a>(x: &'a str) -> char { let _ = r#"crate::g::G "quoted" "#; let _ = b"crate::h"; '"' }
const Q: char = '\'';
use crate::real::Real;
"####;
    let idents: Vec<String> = lex(text)
        .into_iter()
        .filter_map(|t| match t.tok {
            Tok::Ident(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(
        idents,
        [
            "doc", "fn", "f", "x", "str", "char", "let", "_", "let", "_", "const", "Q", "char",
            "use", "crate", "real", "Real"
        ]
    );
    let lines: Vec<usize> = lex(text)
        .iter()
        .filter(|t| t.tok == Tok::Ident("Real".into()))
        .map(|t| t.line)
        .collect();
    assert_eq!(lines, [10]);
}

#[test]
fn the_reader_expands_use_trees() {
    let t = tree(&[(
        "a/b.rs",
        "pub(crate) use crate::x::{y::{C, D as E}, z::*, self};\n\
         pub use {super::s::S, self::t::T};\n\
         use super::super::top::Top;\n\
         use std::sync::{Arc, Mutex};\n\
         use ::other::O;\n\
         use crate::\n    multi::\n    Line;\n\
         fn f() { let _ = crate::inline::path::F::new(); }\n",
    )]);
    let krate = read_crate(&t);
    let got: Vec<(String, Option<Binding>)> = krate.refs["a/b.rs"]
        .iter()
        .map(|r| (r.path.join("::"), r.binding.clone()))
        .collect();
    let name = |n: &str| Some(Binding::Name(n.to_owned()));
    assert_eq!(
        got,
        [
            ("crate::x::y::C".to_owned(), name("C")),
            ("crate::x::y::D".to_owned(), name("E")),
            ("crate::x::z".to_owned(), Some(Binding::Glob)),
            ("crate::x".to_owned(), name("x")),
            ("super::s::S".to_owned(), name("S")),
            ("self::t::T".to_owned(), name("T")),
            ("super::super::top::Top".to_owned(), name("Top")),
            ("std::sync::Arc".to_owned(), name("Arc")),
            ("std::sync::Mutex".to_owned(), name("Mutex")),
            ("::::other::O".to_owned(), name("O")),
            ("crate::multi::Line".to_owned(), name("Line")),
            ("crate::inline::path::F::new".to_owned(), None),
        ]
    );
    let m = &krate.modules[&cycle(&["a", "b"])];
    assert!(m.items.contains("f"));
    assert_eq!(m.named["E"], [cycle(&["crate", "x", "y", "D"])]);
    let abs = |p: &[&str]| krate.absolute(&cycle(&["a", "b"]), &cycle(p));
    assert_eq!(
        abs(&["super", "super", "top", "Top"]),
        Some(cycle(&["top", "Top"]))
    );
    assert_eq!(abs(&["self", "t", "T"]), Some(cycle(&["a", "b", "t", "T"])));
    assert_eq!(abs(&["std", "sync"]), None);
}

#[test]
fn external_crates_comments_and_unit_tests_are_not_edges() {
    let edges = edge_set(&[
        ("lib.rs", "mod a; mod b; mod std_like;"),
        (
            "a.rs",
            "//! See [`crate::b::B`].\n\
             use std::sync::Arc;\n\
             use sea_orm::{EntityTrait, sea_query::Expr};\n\
             /// ```\n/// use crate::b::B;\n/// ```\n\
             pub fn f() { let _ = \"crate::b::B\"; }\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::b::B;\n    fn t() { crate::b::g(); }\n}\n\
             #[cfg(test)]\nfn only_in_tests() { crate::b::g(); }\n",
        ),
        (
            "b.rs",
            "use crate::a::f;\npub struct B;\npub fn g() { f() }",
        ),
    ]);
    assert_eq!(edges, BTreeSet::from([pair("b.rs", "a.rs")]));
}

#[test]
fn paths_resolve_to_the_file_that_defines_the_item() {
    let files = [
        ("lib.rs", "mod exec; mod read; pub use read::Find;"),
        (
            "exec/mod.rs",
            "mod shards;\nmod keyset;\npub(crate) use shards::{Shards, Begun};\npub use keyset::*;\npub(crate) fn begin() {}",
        ),
        ("exec/shards.rs", "pub struct Shards; pub struct Begun;"),
        ("exec/keyset.rs", "pub fn by_pk() {}"),
        (
            "read/mod.rs",
            "mod find;\npub use find::Find;\npub(crate) use crate::exec::Shards as Pools;",
        ),
        ("read/find.rs", "pub struct Find;"),
        ("user.rs", "use crate::exec::Shards;"),
        ("renamed.rs", "use crate::read::Pools;"),
        ("through_glob.rs", "use crate::exec::by_pk;"),
        ("through_root.rs", "use crate::Find;"),
        (
            "inline.rs",
            "fn f() { crate::exec::begin(); let _ = crate::read::find::Find; }",
        ),
        ("module.rs", "use crate::exec::{self, shards};"),
        ("missing.rs", "use crate::exec::NotThere;"),
    ];
    let edges = edge_set(&files);
    for (from, to) in [
        ("user.rs", "exec/shards.rs"),
        ("renamed.rs", "exec/shards.rs"),
        ("through_glob.rs", "exec/keyset.rs"),
        ("through_root.rs", "read/find.rs"),
        ("inline.rs", "exec/mod.rs"),
        ("inline.rs", "read/find.rs"),
        ("module.rs", "exec/mod.rs"),
        ("module.rs", "exec/shards.rs"),
        ("missing.rs", "exec/mod.rs"),
        ("exec/mod.rs", "exec/shards.rs"),
        ("exec/mod.rs", "exec/keyset.rs"),
        ("read/mod.rs", "exec/shards.rs"),
    ] {
        assert!(
            edges.contains(&pair(from, to)),
            "missing {from} -> {to} in {edges:#?}"
        );
    }
    for (from, to) in [
        ("user.rs", "exec/mod.rs"),
        ("renamed.rs", "read/mod.rs"),
        ("through_root.rs", "lib.rs"),
    ] {
        assert!(
            !edges.contains(&pair(from, to)),
            "unexpected {from} -> {to}"
        );
    }
    // Declaring a child is not importing it.
    assert!(!edges.contains(&pair("read/mod.rs", "exec/mod.rs")));
    let report = check(&tree(&files));
    assert!(report.file_cycles.is_empty(), "{:?}", report.file_cycles);
}

#[test]
fn sea_orm_style_has_no_cycle() {
    // A mod.rs that declares and re-exports; files that import each other
    // through `crate::` paths to the defining file.
    let report = check(&tree(&[
        (
            "lib.rs",
            "pub mod read; mod exec; pub use read::{Find, Plan};",
        ),
        ("exec/mod.rs", "mod shards;\npub(crate) use shards::Shards;"),
        ("exec/shards.rs", "pub struct Shards;"),
        (
            "read/mod.rs",
            "mod find;\nmod plan;\npub use find::Find;\npub use plan::Plan;",
        ),
        (
            "read/find.rs",
            "use crate::read::plan::Plan;\nuse crate::exec::shards::Shards;\npub struct Find(Plan, Shards);",
        ),
        (
            "read/plan.rs",
            "pub struct Plan;\nimpl Plan { fn f() -> crate::exec::shards::Shards { todo!() } }",
        ),
    ]));
    assert!(report.file_cycles.is_empty(), "{:?}", report.file_cycles);
    assert!(
        report.folder_cycles.is_empty(),
        "{:?}",
        report.folder_cycles
    );
    assert!(
        report.layer_breaches.is_empty(),
        "{:?}",
        report.layer_breaches
    );
}

#[test]
fn an_injected_two_file_circle_is_found() {
    let report = check(&tree(&[
        ("lib.rs", "mod read;"),
        ("read/mod.rs", "mod a;\nmod b;"),
        ("read/a.rs", "use crate::read::b::B;\npub struct A(B);"),
        (
            "read/b.rs",
            "pub struct B;\nfn f() -> crate::read::a::A { todo!() }",
        ),
    ]));
    assert_eq!(
        report.file_cycles,
        [cycle(&["read/a.rs", "read/b.rs", "read/a.rs"])]
    );
    let text = describe_cycles(&report.file_cycles, &report.files);
    assert!(
        text.contains("read/a.rs -> read/b.rs -> read/a.rs"),
        "{text}"
    );
    assert!(text.contains("line 2: crate::read::a::A"), "{text}");
}

#[test]
fn an_injected_three_file_circle_is_found() {
    let report = check(&tree(&[
        ("lib.rs", "mod gsi;"),
        ("gsi/mod.rs", "mod a;\nmod b;\nmod c;"),
        ("gsi/a.rs", "use crate::gsi::b::B;\npub struct A;"),
        ("gsi/b.rs", "use super::c::C;\npub struct B;"),
        (
            "gsi/c.rs",
            "pub struct C;\nuse self::inner::X;\nmod inner { pub use super::super::a::A as X; }",
        ),
    ]));
    assert_eq!(
        report.file_cycles,
        [cycle(&["gsi/a.rs", "gsi/b.rs", "gsi/c.rs", "gsi/a.rs"])]
    );
}

#[test]
fn a_circle_behind_globs_is_found() {
    // The child takes its parent's names with `use super::*`; the parent
    // re-exports the child with `pub use child::*`.
    let files = [
        ("lib.rs", "pub mod rollout;"),
        (
            "rollout/mod.rs",
            "mod fold;\npub use fold::*;\nuse crate::exec_like::Helper;\npub(crate) fn shared() {}",
        ),
        (
            "rollout/fold.rs",
            "use super::*;\npub struct Parts;\nfn f() { shared(); let _ = Helper; }",
        ),
        ("exec_like.rs", "pub struct Helper;"),
    ];
    let report = check(&tree(&files));
    assert_eq!(
        report.file_cycles,
        [cycle(&[
            "rollout/fold.rs",
            "rollout/mod.rs",
            "rollout/fold.rs"
        ])]
    );
    // The glob also stands for the names used through it.
    let edges = edge_set(&files);
    assert!(
        edges.contains(&pair("rollout/fold.rs", "exec_like.rs")),
        "{edges:#?}"
    );

    // Through the parent's globs of siblings: an edge to a sibling whose
    // names are used, none to one whose names are not (nor for a field or
    // a method that shares a name).
    let edges = edge_set(&[
        ("lib.rs", "pub mod rollout;"),
        (
            "rollout/mod.rs",
            "mod fold;\nmod dual;\nmod watch;\npub use fold::*;\npub use dual::*;\npub use watch::*;",
        ),
        (
            "rollout/fold.rs",
            "use super::*;\npub struct Parts { watch: u8 }\nfn f() { let _ = DualWrite; x.watch_all(); }",
        ),
        ("rollout/dual.rs", "pub struct DualWrite;"),
        (
            "rollout/watch.rs",
            "pub fn watch_all() {}\npub struct Watch;",
        ),
    ]);
    assert!(
        edges.contains(&pair("rollout/fold.rs", "rollout/dual.rs")),
        "{edges:#?}"
    );
    assert!(
        !edges.contains(&pair("rollout/fold.rs", "rollout/watch.rs")),
        "{edges:#?}"
    );

    // A parent that re-exports by name, a child that imports by name an
    // item its parent defines: also a circle.
    let report = check(&tree(&[
        ("lib.rs", "pub mod rollout;"),
        (
            "rollout/mod.rs",
            "mod fold;\npub use fold::Parts;\npub struct Rollout;",
        ),
        (
            "rollout/fold.rs",
            "use super::Rollout;\npub struct Parts(Rollout);",
        ),
    ]));
    assert_eq!(
        report.file_cycles,
        [cycle(&[
            "rollout/fold.rs",
            "rollout/mod.rs",
            "rollout/fold.rs"
        ])]
    );
}

#[test]
fn an_injected_folder_circle_is_found() {
    // No file circle, but `rollout` and `rebalance` use each other.
    let report = check(&tree(&[
        ("lib.rs", "pub mod rollout;\npub mod rebalance;"),
        ("rollout/mod.rs", "mod backfill;\nmod keys;"),
        (
            "rollout/backfill.rs",
            "fn f() { crate::rebalance::unfinished_moves(); }",
        ),
        ("rollout/keys.rs", "pub fn pk_condition() {}"),
        (
            "rebalance/mod.rs",
            "mod entity;\npub fn unfinished_moves() {}",
        ),
        (
            "rebalance/entity.rs",
            "use crate::rollout::keys::pk_condition;",
        ),
    ]));
    assert!(report.file_cycles.is_empty(), "{:?}", report.file_cycles);
    assert_eq!(
        report.folder_cycles,
        [cycle(&["rebalance", "rollout", "rebalance"])]
    );
    let text = describe_cycles(&report.folder_cycles, &report.folders);
    assert!(
        text.contains("rollout/backfill.rs -> rebalance/mod.rs"),
        "{text}"
    );
    assert!(
        text.contains("rebalance/entity.rs -> rollout/keys.rs"),
        "{text}"
    );
}

#[test]
fn an_injected_layer_breach_is_found() {
    let report = check(&tree(&[
        (
            "lib.rs",
            "mod exec;\npub mod cluster;\npub use cluster::Cluster;",
        ),
        ("exec/mod.rs", "mod shards;"),
        (
            "exec/shards.rs",
            "use crate::cluster::Cluster;\npub struct Shards;",
        ),
        (
            "cluster.rs",
            "use crate::exec::shards::Shards;\npub struct Cluster(Shards);",
        ),
    ]));
    assert_eq!(
        report
            .layer_breaches
            .iter()
            .map(|(f, t, _)| pair(f, t))
            .collect::<Vec<_>>(),
        [pair("exec/shards.rs", "cluster.rs")]
    );
    let text = describe_breaches(&report.layer_breaches);
    assert!(
        text.contains("exec/shards.rs (execution) imports cluster.rs (facade)"),
        "{text}"
    );
    // An import through the crate root's re-export is resolved the same way.
    let report = check(&tree(&[
        (
            "lib.rs",
            "mod exec;\npub mod cluster;\npub use cluster::Cluster;",
        ),
        ("exec/mod.rs", "fn f(c: &crate::Cluster) {}"),
        ("cluster.rs", "pub struct Cluster;"),
    ]));
    assert_eq!(report.layer_breaches.len(), 1, "{report:?}");
}
