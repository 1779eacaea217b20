//! ARCHITECTURE.md cannot drift from the tree: every module file of every crate is named in its
//! crate's part of the module map, every fuzz target is named, every path the page names exists,
//! and each crate's row of the crate map lists exactly the dependencies its Cargo.toml declares.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::rust_files;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn page() -> String {
    std::fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md")
}

/// Every `.rs` file below `dir`, as paths relative to it.
fn rust_files_in(dir: &Path) -> Vec<String> {
    rust_files(&[dir.to_path_buf()])
        .iter()
        .map(|p| {
            p.strip_prefix(dir)
                .expect("below")
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// The crates of the workspace: the folders under `crates/`.
fn crates() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root().join("crates"))
        .expect("crates")
        .flatten()
        .filter(|e| e.path().join("Cargo.toml").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The text between the heading `### crates/NAME/src` and the next heading of that level or
/// above.
fn section<'a>(page: &'a str, name: &str) -> &'a str {
    let head = format!("### crates/{name}/src\n");
    let Some(at) = page.find(&head) else {
        panic!("ARCHITECTURE.md has no section `### crates/{name}/src`");
    };
    let body = &page[at + head.len()..];
    let end = body
        .find("\n### ")
        .into_iter()
        .chain(body.find("\n## "))
        .min()
        .unwrap_or(body.len());
    &body[..end]
}

/// Every span between backticks.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_module_file_is_named_in_its_crates_section() {
    let page = page();
    let mut missing = Vec::new();
    for c in crates() {
        let spans: BTreeSet<&str> = code_spans(section(&page, &c)).into_iter().collect();
        for f in rust_files_in(&root().join("crates").join(&c).join("src")) {
            if !spans.contains(f.as_str()) {
                missing.push(format!("crates/{c}/src/{f}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in ARCHITECTURE.md's module map: {missing:?}"
    );
}

#[test]
fn every_fuzz_target_is_named() {
    let page = page();
    let spans: BTreeSet<&str> = code_spans(&page).into_iter().collect();
    let targets = rust_files_in(&root().join("fuzz/fuzz_targets"));
    assert!(targets.len() >= 5, "{targets:?}");
    for t in targets {
        let name = t.trim_end_matches(".rs");
        assert!(
            spans.contains(name),
            "fuzz target `{name}` is not in ARCHITECTURE.md"
        );
    }
}

/// A code span that names a file or folder: path characters only, ending in a file extension
/// the repository uses or in `/`.
fn names_a_path(s: &str) -> bool {
    let chars = s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._/-".contains(c));
    let ext = [
        ".rs", ".md", ".toml", ".yaml", ".sh", ".sql", ".service", ".py",
    ];
    chars && !s.starts_with('/') && (s.ends_with('/') || ext.iter().any(|e| s.ends_with(e)))
}

#[test]
fn every_path_it_names_exists() {
    let page = page();
    // A path may be named from the repository's root, from `crates/`, from a crate's folder, or
    // from a crate's `src/` (the module map names files that way).
    let mut bases: Vec<PathBuf> = vec![root().to_path_buf(), root().join("crates")];
    for c in crates() {
        bases.push(root().join("crates").join(&c));
        bases.push(root().join("crates").join(&c).join("src"));
    }
    let mut gone = BTreeSet::new();
    let mut named = 0;
    for s in code_spans(&page) {
        if !names_a_path(s) {
            continue;
        }
        named += 1;
        if !bases.iter().any(|b| b.join(s).exists()) {
            gone.insert(s.to_string());
        }
    }
    assert!(
        named > 100,
        "the page names {named} paths: the check reads nothing"
    );
    assert!(
        gone.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {gone:?}"
    );
}

/// The names in a Cargo.toml's `[dependencies]` table.
fn dependencies(toml: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut inside = false;
    for line in toml.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            inside = l == "[dependencies]";
            continue;
        }
        if inside && let Some((name, _)) = l.split_once(['=', '.']) {
            let name = name.trim();
            if !name.is_empty() && !name.starts_with('#') {
                out.insert(name.to_string());
            }
        }
    }
    out
}

#[test]
fn each_crates_row_lists_exactly_its_dependencies() {
    let page = page();
    for c in crates() {
        let path = format!("`crates/{c}`");
        let row = page
            .lines()
            .find(|l| l.starts_with("| ") && l.contains(&path))
            .unwrap_or_else(|| panic!("no crate map row for {path}"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // | crate | path | what it is | depends on |
        let listed: BTreeSet<String> = code_spans(cells[4]).iter().map(|s| s.to_string()).collect();
        let toml = std::fs::read_to_string(root().join("crates").join(&c).join("Cargo.toml"))
            .expect("toml");
        let declared = dependencies(&toml);
        assert_eq!(
            listed, declared,
            "crate map row of {path} against its Cargo.toml"
        );
    }
}
