//! docs/architecture.md is the page a newcomer reads first: its file map must name every
//! source file, and name none that is gone.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_architecture_page_names_every_source_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/architecture.md")).expect("read the page");
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let missing: Vec<String> = files
        .iter()
        .map(|f| {
            f.strip_prefix(root)
                .expect("under the root")
                .display()
                .to_string()
        })
        .filter(|rel| !page.contains(&format!("`{rel}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md's file map lacks: {missing:?}"
    );
    let listed: Vec<&str> = page
        .split('`')
        .filter(|s| s.starts_with("src/") && s.ends_with(".rs"))
        .collect();
    let gone: Vec<&&str> = listed
        .iter()
        .filter(|rel| !root.join(rel).exists())
        .collect();
    assert!(
        gone.is_empty(),
        "docs/architecture.md names files that are gone: {gone:?}"
    );
}
