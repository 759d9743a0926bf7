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

/// Matches the (unescaped) segments of a path against `pattern`; returns the `{id}` segment
/// (if the pattern has one).
fn matches(pattern: &str, segments: &[String]) -> Option<Option<String>> {
    let mut id = None;
    let mut pat = pattern.split('/');
    let mut got = segments.iter();
    loop {
        match (pat.next(), got.next()) {
            (None, None) => return Some(id),
            (Some("{id}"), Some(seg)) if !seg.is_empty() => id = Some(seg.clone()),
            (Some(p), Some(seg)) if p == seg => {}
            _ => return None,
        }
    }
}

/// One path segment with its `%XX` escapes decoded, as Go's ServeMux matches segments
/// (`%2F` stays inside its segment); `None` for an escape that is not one.
fn unescape(segment: &str) -> Option<String> {
    if !segment.contains('%') {
        return Some(segment.to_owned());
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = segment.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// A resolved request: the handler and the (unescaped, not yet validated) `{id}` segment.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Resolved {
    /// The handler.
    pub route: RouteId,
    /// The task id segment, unescaped, not yet validated.
    pub id: Option<String>,
}

/// Finds the route for `method` and `path` as Go's `http.ServeMux` does for upstream's
/// patterns: segments are matched unescaped (`/api/tasks/t%31` is task `t1`); `HEAD` is
/// served by the `GET` route; 404 `404 page not found` when no pattern matches the path, 405
/// `Method Not Allowed` (the allowed methods, sorted, `HEAD` with `GET`, go into the `Allow`
/// header) when patterns match but none with this method; 400 for an escape that is not one
/// (Go refuses such a request before it routes it).
pub fn resolve(method: &str, path: &str) -> Result<Resolved, ApiError> {
    let segments: Vec<String> = path
        .split('/')
        .map(unescape)
        .collect::<Option<_>>()
        .ok_or_else(|| ApiError::bad_request("400 Bad Request"))?;
    let wanted = if method == "HEAD" { "GET" } else { method };
    let mut allowed: Vec<&'static str> = Vec::new();
    for route in ROUTES {
        if let Some(id) = matches(route.path, &segments) {
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
            .cause
            .as_deref()
            .unwrap()
            .downcast_ref::<MethodNotAllowed>();
        assert_eq!(allowed.unwrap().allowed, ["GET", "HEAD", "POST"]);
        assert_eq!(
            resolve("HEAD", "/api/tasks/a").unwrap().route,
            RouteId::TaskInfo
        );
        // Segments are matched unescaped; a bad escape is refused.
        let r = resolve("GET", "/api/%74asks/t%31").unwrap();
        assert_eq!((r.route, r.id.as_deref()), (RouteId::TaskInfo, Some("t1")));
        assert_eq!(
            resolve("GET", "/api/tasks/a%2Fb").unwrap().id.as_deref(),
            Some("a/b")
        );
        assert_eq!(
            resolve("GET", "/api/tasks/%zz").unwrap_err().kind,
            ErrorKind::BadRequest
        );
        assert_eq!(
            resolve("GET", "/api/tasks/x/remove").unwrap_err().kind,
            ErrorKind::MethodNotAllowed
        );
    }
}
