//! The open-files limit. Every API connection, Docker connection, log file and task file is a
//! file descriptor, and the usual soft limit of 1024 is reached by about a thousand idle
//! connections. At start the shim raises its soft limit to the hard limit, as `dockerd` and
//! most services do (and as every Go program, the upstream shim included, does since Go 1.19:
//! its `os` package raises `RLIMIT_NOFILE` at init).

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and logs the outcome (a failure is only
/// logged: the shim works with the limit it has).
pub fn raise_open_files_limit() {
    match raise() {
        Ok((before, after)) if after > before => {
            tracing::info!(
                before,
                after,
                "raised the open-files limit to the hard limit"
            );
        }
        Ok((_, limit)) => tracing::info!(limit, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-files limit"),
    }
}

/// The soft limit before and after.
fn raise() -> nix::Result<(u64, u64)> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft >= hard {
        return Ok((soft, soft));
    }
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    let (after, _) = getrlimit(Resource::RLIMIT_NOFILE)?;
    Ok((soft, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_ends_at_the_hard_limit() {
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        // Lower it first (always allowed), so the raise has something to do.
        setrlimit(Resource::RLIMIT_NOFILE, 256.min(hard), hard).unwrap();
        let (before, after) = raise().unwrap();
        assert_eq!((before, after), (256.min(hard), hard));
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
        // Again: nothing to do.
        assert_eq!(raise().unwrap(), (hard, hard));
    }
}
