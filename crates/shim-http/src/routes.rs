//! The route table: every method and path the API serves, in one static list.
//!
//! The table is public so that tests (and `docs/openapi.json`'s sync test) can enumerate it.
//! Paths use `{id}` for the task-id segment; it matches any one non-empty segment, which the
//! handler then validates with [`shim_task::TaskId::new`] (a segment that is not a valid id
//! names no task: 404, as upstream answers it).

use crate::api::ApiError;

/// Which handler a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteId {
    /// `GET /api/healthcheck`.
    Healthcheck,
    /// `POST /api/shutdown`.
    Shutdown,
    /// `GET /api/instance/health`.
    InstanceHealth,
    /// `GET /api/instance/info`.
    InstanceInfo,
    /// `GET /api/components`.
    ComponentList,
    /// `POST /api/components/install`.
    ComponentInstall,
    /// `GET /api/tasks`.
    TaskList,
    /// `POST /api/tasks`.
    TaskSubmit,
    /// `GET /api/tasks/{id}`.
    TaskInfo,
    /// `POST /api/tasks/{id}/terminate`.
    TaskTerminate,
    /// `POST /api/tasks/{id}/remove`.
    TaskRemove,
    /// `GET /metrics/tasks/{id}`.
    TaskMetrics,
    /// `GET /api/events` (an extension: task changes as Server-Sent Events).
    Events,
    /// `GET /metrics` (an extension: the shim's own metrics).
    Metrics,
    /// `GET /api/ready` (an extension: readiness).
    Ready,
}

/// One entry of the route table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// `GET` or `POST`.
    pub method: &'static str,
    /// The path pattern, `{id}` standing for a task id.
    pub path: &'static str,
    /// The handler.
    pub id: RouteId,
}

const fn r(method: &'static str, path: &'static str, id: RouteId) -> Route {
    Route { method, path, id }
}

/// Every route the server answers.
pub static ROUTES: &[Route] = &[
    r("GET", "/api/healthcheck", RouteId::Healthcheck),
    r("POST", "/api/shutdown", RouteId::Shutdown),
    r("GET", "/api/instance/health", RouteId::InstanceHealth),
    r("GET", "/api/instance/info", RouteId::InstanceInfo),
    r("GET", "/api/components", RouteId::ComponentList),
    r("POST", "/api/components/install", RouteId::ComponentInstall),
    r("GET", "/api/tasks", RouteId::TaskList),
    r("POST", "/api/tasks", RouteId::TaskSubmit),
    r("GET", "/api/tasks/{id}", RouteId::TaskInfo),
    r("POST", "/api/tasks/{id}/terminate", RouteId::TaskTerminate),
    r("POST", "/api/tasks/{id}/remove", RouteId::TaskRemove),
    r("GET", "/metrics/tasks/{id}", RouteId::TaskMetrics),
    r("GET", "/api/events", RouteId::Events),
    r("GET", "/metrics", RouteId::Metrics),
    r("GET", "/api/ready", RouteId::Ready),
];

/// Matches `path` against `pattern`; returns the `{id}` segment (if the pattern has one).
fn matches<'p>(pattern: &str, path: &'p str) -> Option<Option<&'p str>> {
    let mut id = None;
    let mut pat = pattern.split('/');
    let mut got = path.split('/');
    loop {
        match (pat.next(), got.next()) {
            (None, None) => return Some(id),
            (Some("{id}"), Some(seg)) if !seg.is_empty() => id = Some(seg),
            (Some(p), Some(seg)) if p == seg => {}
            _ => return None,
        }
    }
}

/// A resolved request: the handler and the raw `{id}` segment, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved<'p> {
    /// The handler.
    pub route: RouteId,
    /// The raw (not yet validated) task id segment.
    pub id: Option<&'p str>,
}

/// Finds the route for `method` and `path` as Go's `http.ServeMux` does for upstream's
/// patterns: `HEAD` is served by the `GET` route; 404 `404 page not found` when no pattern
/// matches the path, 405 `Method Not Allowed` (the allowed methods, sorted, `HEAD` with
/// `GET`, go into the `Allow` header) when patterns match but none with this method.
pub fn resolve<'p>(method: &str, path: &'p str) -> Result<Resolved<'p>, ApiError> {
    let wanted = if method == "HEAD" { "GET" } else { method };
    let mut allowed: Vec<&'static str> = Vec::new();
    for route in ROUTES {
        if let Some(id) = matches(route.path, path) {
            if route.method == wanted {
                return Ok(Resolved {
                    route: route.id,
                    id,
                });
            }
            allowed.push(route.method);
            if route.method == "GET" {
                allowed.push("HEAD");
            }
        }
    }
    if allowed.is_empty() {
        Err(ApiError::not_found("404 page not found"))
    } else {
        allowed.sort_unstable();
        allowed.dedup();
        Err(MethodNotAllowed { allowed }.into())
    }
}

/// The canonical form of a request path, as Go's `http.ServeMux` computes it before routing
/// (`cleanPath`: `path.Clean`, keeping a trailing slash): `.` and `..` elements and repeated
/// slashes go. A request whose path is not canonical is redirected there.
pub fn clean_path(path: &str) -> String {
    if path.is_empty() {
        return "/".to_owned();
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    let mut clean = String::with_capacity(path.len() + 1);
    for part in &parts {
        clean.push('/');
        clean.push_str(part);
    }
    if clean.is_empty() || (path.ends_with('/') && !parts.is_empty()) {
        clean.push('/');
    }
    clean
}

/// The allowed methods of a path that exists (carried into the 405's `Allow` header).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("method not allowed; allowed: {}", allowed.join(", "))]
pub struct MethodNotAllowed {
    /// The methods the path accepts.
    pub allowed: Vec<&'static str>,
}

impl From<MethodNotAllowed> for ApiError {
    /// Go's answer: `Method Not Allowed` (the methods go into the `Allow` header).
    fn from(e: MethodNotAllowed) -> Self {
        ApiError::new(
            crate::api::ErrorKind::MethodNotAllowed,
            "Method Not Allowed",
        )
        .with_source(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ErrorKind;

    #[test]
    fn resolves_every_route() {
        for route in ROUTES {
            let path = route.path.replace("{id}", "abc");
            let got = resolve(route.method, &path).unwrap();
            assert_eq!(got.route, route.id, "{path}");
            assert_eq!(got.id.is_some(), route.path.contains("{id}"));
        }
    }

    /// Go's `path.Clean` cases (`path/path_test.go`) through `cleanPath`'s trailing slash.
    #[test]
    fn clean_paths_as_go() {
        for (path, clean) in [
            ("", "/"),
            ("/", "/"),
            ("/api/tasks", "/api/tasks"),
            ("/api//tasks", "/api/tasks"),
            ("//api/tasks", "/api/tasks"),
            ("/api/tasks/", "/api/tasks/"),
            ("/api/tasks//", "/api/tasks/"),
            ("/api/./tasks", "/api/tasks"),
            ("/api/tasks/./t1", "/api/tasks/t1"),
            ("/api/x/../tasks", "/api/tasks"),
            ("/..", "/"),
            ("/../api", "/api"),
            ("/api/..", "/"),
            ("/api/../", "/"),
            ("/a/b/../../..", "/"),
            ("api", "/api"),
        ] {
            assert_eq!(clean_path(path), clean, "{path:?}");
        }
    }

    #[test]
    fn unknown_paths_and_methods() {
        assert_eq!(
            resolve("GET", "/api/nope").unwrap_err().kind,
            ErrorKind::NotFound
        );
        assert_eq!(
            resolve("GET", "/api/tasks/").unwrap_err().kind,
            ErrorKind::NotFound
        );
        assert_eq!(
            resolve("GET", "/api/tasks/a/b").unwrap_err().kind,
            ErrorKind::NotFound
        );
        let e = resolve("DELETE", "/api/tasks").unwrap_err();
        assert_eq!(e.kind, ErrorKind::MethodNotAllowed);
        assert_eq!(e.message, "Method Not Allowed");
        let allowed = e
            .source
            .as_deref()
            .unwrap()
            .downcast_ref::<MethodNotAllowed>();
        assert_eq!(allowed.unwrap().allowed, ["GET", "HEAD", "POST"]);
        assert_eq!(
            resolve("HEAD", "/api/tasks/a").unwrap().route,
            RouteId::TaskInfo
        );
        assert_eq!(
            resolve("GET", "/api/tasks/x/remove").unwrap_err().kind,
            ErrorKind::MethodNotAllowed
        );
    }
}
