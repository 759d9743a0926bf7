//! No circle of imports inside `shim-engine` or `shim-task`: the rooms of the engine (driver,
//! effects, table, reconciler, restore, metrics; docs/ARCHITECTURE.md) and the files of the
//! machine each point only down. A module is a source file (`a/mod.rs` is `a`, `a/b.rs` is
//! `a::b`); an edge is a path to another module of the crate outside comments and
//! `#[cfg(test)] mod tests` (`crate::x::…`, `super::x::…`, `super::{…}`, and `use x::…` of a
//! child module).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of the crate whose sources are in `src`, with the modules it refers to.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs_err::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let rel = rel.to_string_lossy();
            let name = rel.strip_suffix("/mod").unwrap_or(&rel).replace('/', "::");
            if name != "lib" && name != "main" && path.extension().is_some_and(|e| e == "rs") {
                files.insert(name, fs_err::read_to_string(&path).unwrap());
            }
        }
    }
    let known: BTreeSet<String> = files.keys().cloned().collect();
    // The deepest module a path names.
    let resolve = |segs: &[&str]| {
        (1..=segs.len())
            .rev()
            .map(|i| segs[..i].join("::"))
            .find(|m| known.contains(m))
    };
    let mut graph = BTreeMap::new();
    for (name, text) in &files {
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let code: Vec<&str> = code
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect();
        let code = code.join("\n");
        let me: Vec<&str> = name.split("::").collect();
        let mut edges = BTreeSet::new();
        for (prefix, base) in [("crate::", &[][..]), ("super::", &me[..me.len() - 1])] {
            for (i, _) in code.match_indices(prefix) {
                let before = code[..i].chars().next_back();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                let path: String = code[i + prefix.len()..]
                    .chars()
                    .take_while(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == ':'
                    })
                    .collect();
                let mut segs: Vec<&str> = base.to_vec();
                segs.extend(path.split("::").filter(|s| !s.is_empty()));
                if let Some(m) = resolve(&segs) {
                    edges.insert(m);
                }
            }
        }
        for line in code.lines() {
            let line = line.trim_start();
            let used = ["use ", "pub use ", "pub(crate) use "]
                .iter()
                .find_map(|p| line.strip_prefix(p));
            if let Some(child) = used.and_then(|u| u.split("::").next()) {
                let mut segs = me.clone();
                segs.push(child);
                if let Some(m) = resolve(&segs).filter(|m| m.starts_with(&format!("{name}::"))) {
                    edges.insert(m);
                }
            }
        }
        edges.remove(name);
        graph.insert(name.clone(), edges);
    }
    graph
}

/// A circle of the graph, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if !done.insert(node.to_owned()) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

fn check(crate_dir: &Path, expected: &[(&str, &str)]) {
    let graph = module_graph(&crate_dir.join("src"));
    // The graph is real: edges the sources are known to have are in it.
    for (from, to) in expected {
        assert!(
            graph.get(*from).is_some_and(|e| e.contains(*to)),
            "{from} -> {to} not found in {graph:#?}"
        );
    }
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import circle: {}\n{graph:#?}", cycle.join(" -> "));
    }
}

#[test]
fn the_engines_modules_import_each_other_in_no_circle() {
    check(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &[
            ("engine", "driver"),
            ("driver", "driver::effects"),
            ("driver", "records"),
            ("driver::effects", "records"),
            ("table", "records"),
            ("metrics", "table"),
            ("reconcile", "driver"),
        ],
    );
}

#[test]
fn the_task_crates_modules_import_each_other_in_no_circle() {
    check(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../shim-task"),
        &[
            ("machine", "machine::transition"),
            ("machine::transition", "machine::task"),
            ("machine::task", "machine::event"),
            ("restore", "machine"),
        ],
    );
}

/// The check sees a circle: a parent module and a child that import each other.
#[test]
fn a_circle_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs_err::create_dir_all(src.join("a")).unwrap();
    for (file, text) in [
        ("a/mod.rs", "mod b;\npub use b::f;\npub struct T;\n"),
        ("a/b.rs", "use super::T;\npub fn f(_: T) {}\n"),
        ("c.rs", "use crate::a::T; // crate::d\n"),
    ] {
        fs_err::write(src.join(file), text).unwrap();
    }
    let graph = module_graph(&src);
    assert_eq!(graph["c"], BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".to_owned(), "a::b".to_owned(), "a".to_owned()])
    );
}
