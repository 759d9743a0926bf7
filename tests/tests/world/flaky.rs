//! A Unix-socket proxy in front of Docker's that can be "stopped" (every connection dropped,
//! new ones refused) and "started" again: the daemon as a shim sees it when Docker goes away.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct FlakyDocker {
    path: PathBuf,
    down: Arc<AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
}

impl FlakyDocker {
    /// A proxy listening on `dir/docker.sock`, up, to the default socket (or `DOCKER_HOST`'s).
    pub fn start(dir: &Path) -> FlakyDocker {
        let path = dir.join("docker.sock");
        let upstream_path = std::env::var("DOCKER_HOST")
            .ok()
            .and_then(|h| h.strip_prefix("unix://").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/var/run/docker.sock"));
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let down = Arc::new(AtomicBool::new(false));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (d, c) = (down.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if d.load(Ordering::SeqCst) {
                    continue; // dropped: connection closed
                }
                let mut rx = c.subscribe();
                let upstream_path = upstream_path.clone();
                tokio::spawn(async move {
                    let Ok(mut upstream) = tokio::net::UnixStream::connect(&upstream_path).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        _ = rx.changed() => {}
                    }
                });
            }
        });
        FlakyDocker { path, down, cut }
    }

    /// `unix://<socket>`, for `DOCKER_HOST`.
    pub fn docker_host(&self) -> String {
        format!("unix://{}", self.path.display())
    }

    /// Cuts every connection and refuses new ones (`down`), or lets them through again. The
    /// cut is seen by the proxy's tasks a moment later: callers wait for its effect.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.cut.send_modify(|n| *n += 1);
        }
    }
}
