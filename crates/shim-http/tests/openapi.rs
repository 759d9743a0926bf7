//! `docs/openapi.json` and `docs/API.md` describe exactly the router's route table.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::collections::BTreeSet;
use std::path::PathBuf;

use shim_http::routes::ROUTES;

fn docs() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

fn router_routes() -> BTreeSet<(String, String)> {
    ROUTES
        .iter()
        .map(|r| (r.method.to_owned(), r.path.to_owned()))
        .collect()
}

#[test]
fn openapi_paths_match_the_router() {
    let text = fs_err::read_to_string(docs().join("openapi.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (key, op) in item.as_object().unwrap() {
            if key == "parameters" {
                continue;
            }
            assert!(
                op["responses"]["200"].is_object(),
                "{key} {path} documents no 200"
            );
            if path.contains("{id}") {
                // An id that cannot be one names no task: 404, as upstream answers it.
                assert!(
                    item["parameters"][0]["name"] == "id" && op["responses"]["404"].is_object(),
                    "{key} {path}: the id parameter and its 404 must be documented"
                );
            }
            documented.insert((key.to_ascii_uppercase(), path.clone()));
        }
    }
    assert_eq!(documented, router_routes());
}

#[test]
fn api_md_documents_every_route() {
    let text = fs_err::read_to_string(docs().join("API.md")).unwrap();
    for (method, path) in router_routes() {
        let heading = format!("### `{method} {path}`");
        assert!(text.contains(&heading), "docs/API.md lacks {heading:?}");
    }
    let headings = text.lines().filter(|l| l.starts_with("### `")).count();
    assert_eq!(
        headings,
        ROUTES.len(),
        "docs/API.md documents routes the router lacks"
    );
}
