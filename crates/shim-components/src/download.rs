//! Downloading a binary into place: the URL checks, and the blocking download streamed into a
//! temporary file (0755) beside the target that replaces it atomically
//! (`shim_fs::write_atomic_with`).

use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::Digest as _;
use tokio_util::sync::CancellationToken;

use crate::{ComponentName, ComponentsConfig, ComponentsError};

/// The URL without query string, fragment and `user:password@`, for logs and messages.
pub fn redact_url(url: &str) -> String {
    let end = url.find(['?', '#']).unwrap_or(url.len());
    let mut shown = url[..end].to_owned();
    // Drop `user:password@` as well.
    if let Some(scheme_end) = shown.find("://") {
        let rest = &shown[scheme_end + 3..];
        let host_end = rest.find('/').unwrap_or(rest.len());
        if let Some(at) = rest[..host_end].rfind('@') {
            shown = format!("{}{}", &shown[..scheme_end + 3], &rest[at + 1..]);
        }
    }
    shown
}

/// Refuses an empty URL before an install starts (upstream answers `400 empty url`).
pub(crate) fn check_url_present(name: ComponentName, url: &str) -> Result<(), ComponentsError> {
    if url.is_empty() {
        return Err(ComponentsError::BadUrl {
            name,
            why: "empty url".into(),
        });
    }
    Ok(())
}

/// Refuses anything but http and https. Checked by the install in the background, as
/// upstream's download fails there (`runner/internal/shim/components/utils.go`, downloadFile:
/// the HTTP client refuses the scheme): the request is accepted and the failure shows in the
/// component's status.
pub(crate) fn check_url_scheme(name: ComponentName, url: &str) -> Result<(), ComponentsError> {
    check_url_present(name, url)?;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(ComponentsError::BadUrl {
            name,
            why: format!("only http and https are supported: {}", redact_url(url)),
        });
    }
    Ok(())
}

/// Downloads `url` over `target` (blocking: run it on the blocking pool). On any failure the
/// target is left as it was and the temporary file is removed.
pub(crate) fn download(
    name: ComponentName,
    url: &str,
    target: &Path,
    config: &ComponentsConfig,
    cancel: &CancellationToken,
) -> Result<(), ComponentsError> {
    check_url_scheme(name, url)?;
    let shown = redact_url(url);
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs_err::create_dir_all(&dir).map_err(|source| ComponentsError::Io {
        op: "create directory",
        path: dir.clone(),
        source,
    })?;

    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(config.download_timeout))
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_per_read(Some(config.stall_timeout))
        .build()
        .into();
    let response = agent
        .get(url)
        .call()
        .map_err(|e| ComponentsError::Download {
            name,
            url: shown.clone(),
            source: Box::new(e),
        })?;
    let mut reader = response.into_body().into_reader();

    // Temp file beside the target (0755 from the start), streamed, fsynced, renamed over the
    // target, directory fsynced: a reader of the path sees the old binary or the new one.
    // The shim's bytes are hashed on the way, for the rollback record's refusal.
    let mut hasher =
        (name == ComponentName::Shim && config.rollback_home.is_some()).then(sha2::Sha256::new);
    shim_fs::write_atomic_with(target, &shim_fs::WriteOptions::new(0o755), |file| {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if cancel.is_cancelled() {
                return Err(ComponentsError::Cancelled { name });
            }
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(ComponentsError::Body {
                        name,
                        url: shown.clone(),
                        source,
                    });
                }
            };
            if file.written() + n as u64 > config.max_download_bytes {
                return Err(ComponentsError::Size {
                    name,
                    url: shown.clone(),
                    why: format!("larger than {} bytes", config.max_download_bytes),
                });
            }
            if let Some(hasher) = hasher.as_mut() {
                hasher.update(&buf[..n]);
            }
            file.write_all(&buf[..n])?;
        }
        if file.written() == 0 {
            return Err(ComponentsError::Size {
                name,
                url: shown.clone(),
                why: "empty".into(),
            });
        }
        if let Some(hasher) = hasher.take() {
            refused(
                name,
                &shown,
                config,
                &crate::upgrade::hex(&hasher.finalize()),
            )?;
        }
        Ok(())
    })
}

/// The error of a shim download whose digest the home's rollback record refuses now: it
/// must not reach the path systemd starts (a restart or a reboot would start it with no
/// watchdog). A record that cannot be read refuses nothing (the shutdown's pre-flight reads
/// it again).
fn refused(
    name: ComponentName,
    shown: &str,
    config: &ComponentsConfig,
    sha256: &str,
) -> Result<(), ComponentsError> {
    let Some(home) = &config.rollback_home else {
        return Ok(());
    };
    match crate::upgrade::RollbackRecord::read(home) {
        Ok(Some(record)) if record.refuses(sha256, crate::upgrade::unix_now()) => {
            Err(ComponentsError::Refused {
                name,
                url: shown.to_owned(),
                failed_at_unix: record.at_unix,
                reason: record.reason,
            })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts() {
        assert_eq!(
            redact_url("https://b.s3.amazonaws.com/r/dstack-runner?X-Amz-Signature=abc"),
            "https://b.s3.amazonaws.com/r/dstack-runner"
        );
        assert_eq!(redact_url("http://u:pw@h:1/p#f"), "http://h:1/p");
        assert_eq!(redact_url("http://h/p@x"), "http://h/p@x");
    }
}
