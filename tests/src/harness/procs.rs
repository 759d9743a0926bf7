//! The host's processes as `xtask` and the bench see them: running programs found by name
//! (without `pgrep`, which a fresh machine may lack), the `dockerd` that serves the default
//! socket, programs found on the `PATH` or in the system directories, and a command's line and
//! output with errors that name it.

use std::io;
use std::process::{Command, Stdio};

/// Pids of running processes whose name (`/proc/<pid>/comm`, at most 15 bytes) is `name` and,
/// if given, whose command line contains `cmdline_part`. Zombies are not counted.
pub fn find(name: &str, cmdline_part: Option<&str>) -> Vec<u32> {
    let Ok(entries) = fs_err::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        let Ok(comm) = fs_err::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end() != name {
            continue;
        }
        // Field 3 of stat is the state; skip zombies (Z) and dead (X) processes.
        if let Ok(stat) = fs_err::read_to_string(dir.join("stat")) {
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().next());
            if matches!(state, Some("Z" | "X")) {
                continue;
            }
        }
        if let Some(part) = cmdline_part {
            let Ok(cmdline) = fs_err::read(dir.join("cmdline")) else {
                continue;
            };
            if !String::from_utf8_lossy(&cmdline)
                .replace('\0', " ")
                .contains(part)
            {
                continue;
            }
        }
        pids.push(pid);
    }
    pids
}

/// Pids of the `dockerd`s that serve the default socket (`/var/run/docker.sock`): the
/// conformance engines and the private daemons of tests name a socket or a pid file of their
/// own.
pub fn default_dockerds() -> Vec<u32> {
    find("dockerd", None)
        .into_iter()
        .filter(|pid| {
            serves_the_default_socket(
                &fs_err::read(format!("/proc/{pid}/cmdline")).unwrap_or_default(),
            )
        })
        .collect()
}

/// Whether a `dockerd` with this command line (`/proc/<pid>/cmdline`: NUL-separated) serves
/// the default socket: it names no socket (`-H`, `--host`) and no pid file of its own.
fn serves_the_default_socket(cmdline: &[u8]) -> bool {
    !cmdline.split(|b| *b == 0).any(|arg| {
        matches!(arg, b"-H" | b"--host" | b"--pidfile")
            || arg.starts_with(b"-H=")
            || arg.starts_with(b"-Hunix")
            || arg.starts_with(b"--host=")
            || arg.starts_with(b"--pidfile=")
    })
}

/// The command line of `command` as a shell would read it back, for messages.
pub fn command_line(command: &Command) -> String {
    let mut line = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        line.push(' ');
        let arg = arg.to_string_lossy();
        if arg.is_empty() || arg.contains([' ', '"', '\'', '$', '\\']) {
            line.push('\'');
            line.push_str(&arg.replace('\'', r"'\''"));
            line.push('\'');
        } else {
            line.push_str(&arg);
        }
    }
    line
}

/// Runs `command` quietly (no stdin) and returns its stdout; the error of a failure names the
/// command and carries its stderr.
pub fn output(command: &mut Command) -> io::Result<String> {
    let line = command_line(command);
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("could not start `{line}`: {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "`{line}` failed: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    String::from_utf8(out.stdout).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("`{line}` printed invalid UTF-8"),
        )
    })
}

/// The system directories where programs live (daemons in `/usr/sbin`, which a non-login root
/// `PATH` may lack).
const SYSTEM_DIRS: [&str; 6] = [
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// `name` found on the `PATH` or in the system directories.
pub fn which_program(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let system = SYSTEM_DIRS.map(std::path::PathBuf::from);
    let dirs = std::env::split_paths(&path).chain(system);
    which::which_in(name, std::env::join_paths(dirs).ok(), "/").ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_sees_this_process_and_filters_by_command_line() {
        let comm = fs_err::read_to_string("/proc/self/comm").unwrap();
        let me = std::process::id();
        assert!(find(comm.trim_end(), None).contains(&me));
        let exe = std::env::args().next().unwrap();
        assert!(find(comm.trim_end(), Some(&exe)).contains(&me));
        assert!(!find(comm.trim_end(), Some("no-such-argument-anywhere-42")).contains(&me));
        assert!(find("no-such-process-name", None).is_empty());
    }

    #[test]
    fn private_daemons_are_not_the_default_one() {
        assert!(serves_the_default_socket(b"/usr/sbin/dockerd\0"));
        assert!(serves_the_default_socket(
            b"dockerd\0--data-root\0/var/lib/other\0"
        ));
        for private in [
            &b"dockerd\0--pidfile\0/r/docker.pid\0-H\0unix:///r/docker.sock\0"[..],
            b"dockerd\0--host=unix:///r.sock\0",
            b"dockerd\0-Hunix:///r.sock\0",
            b"dockerd\0--pidfile=/r.pid\0",
        ] {
            assert!(!serves_the_default_socket(private), "{private:?}");
        }
    }

    #[test]
    fn command_line_quotes_what_a_shell_would_split() {
        let mut command = Command::new("docker");
        command.args(["import", "--change", "CMD [\"/bin/sh\"]", "", "it's"]);
        assert_eq!(
            command_line(&command),
            r#"docker import --change 'CMD ["/bin/sh"]' '' 'it'\''s'"#
        );
    }

    #[test]
    fn output_reports_the_failing_command_and_its_stderr() {
        let err = output(Command::new("sh").args(["-c", "echo boom >&2; exit 3"])).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("sh -c"), "{message}");
        assert!(message.contains("boom"), "{message}");
        assert_eq!(
            output(Command::new("sh").args(["-c", "echo hi"])).unwrap(),
            "hi\n"
        );
    }
}
