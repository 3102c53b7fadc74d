//! The import rules of `ARCHITECTURE.md`, checked on the source: every
//! module of `shardkit/src` imports only from its own layer or the layers
//! above it, and no two files import each other, directly or through others.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `ARCHITECTURE.md`'s layers, first to last; a module may import from its
/// own layer and the ones before it.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "core",
        &[
            "entity", "error", "key", "clock", "phase", "id_spec", "trace", "metrics", "boxed",
        ],
    ),
    ("topology", &["topology"]),
    ("execution", &["exec"]),
    ("reads and writes", &["read", "pipeline", "tx"]),
    (
        "features",
        &["ids", "gsi", "rollout", "verify", "rebalance"],
    ),
    ("facade", &["cluster", "testing"]),
    ("operator", &["cli"]),
];

fn layer_of(module: &str) -> Option<usize> {
    let top = module.split("::").next().unwrap_or(module);
    LAYERS.iter().position(|(_, mods)| mods.contains(&top))
}

/// Every `.rs` file under `src`, by module path (`exec::shards`).
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .expect("under src")
                .with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts == ["lib"] {
                continue;
            }
            found.insert(parts.join("::"), path);
        }
    }
    found
}

/// The source without comments (doc links are not imports).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths a file names after `crate::`, with `{a, b::c}` groups expanded
/// one level (`crate::x::{a, b}` names `x::a` and `x::b`).
fn crate_paths(code: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let mut prefix = String::new();
        let mut chars = rest.char_indices().peekable();
        let mut end = 0;
        while let Some((i, c)) = chars.next() {
            if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                prefix.push(c);
                end = i + 1;
                continue;
            }
            if c == '{' {
                let mut depth = 1;
                let mut inner = String::new();
                for (_, c) in chars.by_ref() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    if depth == 0 {
                        break;
                    }
                    inner.push(c);
                }
                let mut depth = 0;
                let mut item = String::new();
                for c in inner.chars().chain(std::iter::once(',')) {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            let name = item.trim().split(" as ").next().unwrap_or("").trim();
                            paths.push(format!("{prefix}{name}"));
                            item.clear();
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
                prefix.clear();
            }
            break;
        }
        if !prefix.is_empty() {
            paths.push(prefix.trim_end_matches(':').to_owned());
        }
        rest = &rest[end..];
    }
    paths
}

/// The module a path lands in: its longest prefix that is a module.
fn module_of<'m>(path: &str, modules: &'m BTreeMap<String, PathBuf>) -> Option<&'m str> {
    let parts: Vec<&str> = path.split("::").map(str::trim).collect();
    (1..=parts.len())
        .rev()
        .find_map(|n| modules.get_key_value(&parts[..n].join("::")))
        .map(|(k, _)| k.as_str())
}

fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let mut edges = BTreeMap::new();
    for (module, path) in &modules {
        let text = code(&std::fs::read_to_string(path).expect("read module"));
        let mut to = BTreeSet::new();
        // `super::x` in `a::b` names `a::x`; in a top-level module, `x`.
        let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
        let relative = text.replace("super::", &format!("crate::{parent}::"));
        let relative = relative.replace("crate::::", "crate::");
        for path in crate_paths(&relative) {
            if let Some(target) = module_of(&path, &modules)
                && target != module
                && !module.starts_with(&format!("{target}::"))
            {
                to.insert(target.to_owned());
            }
        }
        edges.insert(module.clone(), to);
    }
    edges
}

#[test]
fn the_parser_finds_grouped_and_plain_imports() {
    let found = crate_paths(
        "use crate::exec::{Begun, Shards};\nlet x = crate::key::value_text(v);\nuse crate::{a, b::c as d};",
    );
    assert_eq!(
        found,
        [
            "exec::Begun",
            "exec::Shards",
            "key::value_text",
            "a",
            "b::c"
        ]
    );
}

#[test]
fn every_module_has_a_layer() {
    let missing: Vec<String> = imports()
        .into_keys()
        .filter(|m| layer_of(m).is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "modules without a layer (add them to ARCHITECTURE.md and LAYERS): {missing:?}"
    );
}

#[test]
fn layers_import_one_way() {
    let mut wrong = Vec::new();
    for (module, to) in imports() {
        let Some(from) = layer_of(&module) else {
            continue;
        };
        for target in to {
            if layer_of(&target).is_some_and(|layer| layer > from) {
                wrong.push(format!(
                    "{module} ({}) imports {target} ({})",
                    LAYERS[from].0,
                    LAYERS[layer_of(&target).unwrap_or(0)].0
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the layers: {wrong:#?}");
}

#[test]
fn no_import_cycle_between_files() {
    let edges = imports();
    // Depth-first search for a back edge; reports one cycle.
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_owned(), 1);
        stack.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            match state.get(next.as_str()) {
                Some(1) => {
                    let at = stack.iter().position(|n| n == next).unwrap_or(0);
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(cycle) = visit(next, edges, state, stack) {
                        return Some(cycle);
                    }
                }
            }
        }
        stack.pop();
        state.insert(node.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        if !state.contains_key(node.as_str())
            && let Some(cycle) = visit(node, &edges, &mut state, &mut Vec::new())
        {
            panic!("import cycle: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn top_level_modules_import_one_way() {
    // The file graph folded to top-level modules (`rollout::fold` →
    // `rollout`): a feature may use another feature, never both ways.
    let mut folded: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, to) in imports() {
        let top = |m: &str| m.split("::").next().unwrap_or(m).to_owned();
        let entry = folded.entry(top(&module)).or_default();
        for target in to {
            if top(&target) != top(&module) {
                entry.insert(top(&target));
            }
        }
    }
    let mut both = Vec::new();
    for (a, to) in &folded {
        for b in to {
            if a < b && folded.get(b).is_some_and(|back| back.contains(a)) {
                both.push(format!("{a} ⇄ {b}"));
            }
        }
    }
    assert!(
        both.is_empty(),
        "top-level modules that import each other: {both:?}"
    );
}
