//! Finding and starting background processes (without `pgrep`, which a fresh machine may lack).

use std::path::Path;
use std::process::Stdio;

use anyhow::{Context as _, Result};

use shim_e2e::harness::open_log;

use crate::cmd;

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
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if !cmdline.contains(part) {
                continue;
            }
        }
        pids.push(pid);
    }
    pids
}

/// Starts `program args..` as a daemon in a new session (`setsid --fork`), stdin from
/// `/dev/null`, stdout and stderr appended to `log`. It outlives this process and is not killed
/// by a terminal hang-up or Ctrl-C of the xtask.
pub fn spawn_daemon(program: &Path, args: &[&str], log: &Path) -> Result<()> {
    let mut command = cmd::cmd(cmd::find_program("setsid"));
    command
        .arg("--fork")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(open_log(log)?)
        .stderr(open_log(log)?);
    let line = cmd::display(&command);
    println!("$ {line} >>{} 2>&1", log.display());
    let status = command
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    anyhow::ensure!(status.success(), "`{line}` failed: {status}");
    Ok(())
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
}
