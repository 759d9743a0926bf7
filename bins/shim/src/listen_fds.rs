//! A listening socket handed to this process by its parent, in systemd's `sd_listen_fds`
//! protocol: `LISTEN_PID` is this process's id, `LISTEN_FDS` the number of descriptors passed
//! from fd 3 on (`LISTEN_FDNAMES` optional). systemd socket activation passes it so; so does
//! the shim itself when it upgrades in place (the PID stays the same across `execve`).
//!
//! This shim takes exactly one: a listening TCP socket (stream) on a loopback address (the
//! loopback check is `shim_http::Listeners::from_tcp`'s).

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use anyhow::{Context, bail};
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::sys::socket::{SockType, getsockopt, sockopt};

/// The first descriptor passed (`SD_LISTEN_FDS_START`).
pub const FIRST_FD: RawFd = 3;
/// The variables of the protocol.
pub const LISTEN_PID: &str = "LISTEN_PID";
/// See [`LISTEN_PID`].
pub const LISTEN_FDS: &str = "LISTEN_FDS";
/// See [`LISTEN_PID`].
pub const LISTEN_FDNAMES: &str = "LISTEN_FDNAMES";
/// The name this shim gives the socket it hands over (`LISTEN_FDNAMES`).
pub const FD_NAME: &str = "dstack-shim-api";

/// The socket passed to this process, if `LISTEN_PID` names it; an error if the variables
/// name it but do not pass exactly one listening TCP stream socket. Call it first thing in
/// `main`, before anything opens a file (the descriptor is claimed by number).
///
/// The variables are left in the environment (removing them is not thread-safe): children
/// have other PIDs, so they ignore them, and the descriptor is marked close-on-exec here.
pub fn take() -> anyhow::Result<Option<std::net::TcpListener>> {
    take_from(
        std::env::var_os(LISTEN_PID),
        std::env::var_os(LISTEN_FDS),
        std::process::id(),
    )
}

fn take_from(
    pid: Option<OsString>,
    fds: Option<OsString>,
    own_pid: u32,
) -> anyhow::Result<Option<std::net::TcpListener>> {
    let Some(pid) = pid else { return Ok(None) };
    if pid.to_str().and_then(|p| p.trim().parse::<u32>().ok()) != Some(own_pid) {
        // Meant for another process (our parent's), as the protocol says.
        return Ok(None);
    }
    let count = fds
        .as_deref()
        .and_then(|n| n.to_str())
        .and_then(|n| n.trim().parse::<u32>().ok())
        .with_context(|| format!("{LISTEN_PID} names this process but {LISTEN_FDS} is {fds:?}"))?;
    match count {
        0 => return Ok(None),
        1 => {}
        n => bail!(
            "{LISTEN_FDS}={n}: this shim serves one socket passed by its parent (its API's TCP \
             socket on a loopback address)"
        ),
    }
    fcntl(FIRST_FD, FcntlArg::F_GETFD)
        .with_context(|| format!("{LISTEN_FDS}=1 but descriptor {FIRST_FD} is not open"))?;
    let fd = adopt(FIRST_FD);
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
        .context("cannot mark the inherited socket close-on-exec")?;
    let kind = getsockopt(&fd, sockopt::SockType)
        .with_context(|| format!("descriptor {FIRST_FD} passed in {LISTEN_FDS} is not a socket"))?;
    if kind != SockType::Stream {
        bail!("the socket passed in {LISTEN_FDS} is {kind:?}, not a stream (TCP) socket");
    }
    if !getsockopt(&fd, sockopt::AcceptConn).context("cannot inspect the inherited socket")? {
        bail!("the socket passed in {LISTEN_FDS} is not listening");
    }
    let listener = std::net::TcpListener::from(fd);
    let addr = listener
        .local_addr()
        .context("the socket passed in LISTEN_FDS is not a TCP socket")?;
    tracing::debug!(%addr, "took the listening socket passed by the parent");
    Ok(Some(listener))
}

/// Claims descriptor `fd` passed by the parent.
#[allow(unsafe_code)]
fn adopt(fd: RawFd) -> OwnedFd {
    // SAFETY: by the sd_listen_fds protocol (LISTEN_PID is this process, LISTEN_FDS=1),
    // descriptor 3 was passed to this process for its use and nothing else owns it: `take`
    // runs first in `main`, before this process opens any file, and the caller checked
    // that it is open. It is claimed once (the variables keep naming it, but `take` is
    // called once).
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_for_another_process_are_ignored() {
        let none = |pid: Option<&str>, fds: Option<&str>| {
            take_from(pid.map(Into::into), fds.map(Into::into), 42)
                .map(|l| l.is_none())
                .unwrap_or(false)
        };
        assert!(none(None, None));
        assert!(none(None, Some("1")));
        assert!(none(Some("41"), Some("1")), "the parent's");
        assert!(none(Some("x"), Some("1")));
        assert!(none(Some("42"), Some("0")));
        let e = take_from(Some("42".into()), Some("2".into()), 42).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("LISTEN_FDS=2: this shim serves one socket"),
            "{e}"
        );
        let e = take_from(Some("42".into()), None, 42).unwrap_err();
        assert!(e.to_string().contains("LISTEN_FDS is None"), "{e}");
    }
}
