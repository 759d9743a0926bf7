//! The registry's HTTP API (Docker Registry v2, OCI distribution) spoken directly, with basic
//! auth: what a test needs to put an image into the test registry without a Docker daemon
//! ever holding its layers.
//!
//! A daemon on the containerd image store keeps the content of a removed image until
//! containerd's garbage collection, so an image built and pushed through the daemon and then
//! removed is pulled back without downloading anything ("Already exists").
//! [`Registry::push_with_layer`] makes the image in the registry alone: a base image of the
//! registry with one more layer ([`Layer`], made here with `tar` and `gzip -n`), the base
//! layers mounted from the base repository.
//!
//! That alone does not make the pull *report* bytes there: the containerd store copies a layer
//! into its content store in 1 MiB blocks and reports a download only by polling its ongoing
//! copies every 100 ms (moby v28 `daemon/containerd/progress.go`), so a layer under 1 MiB, or
//! one fetched between two polls (anything, from a registry on loopback), shows no byte count
//! at all, only `Download complete`. [`SlowProxy`] in front of the registry makes a layer of a
//! few MiB take long enough to be seen.
//!
//! [`FreshImage`] does both for a test: a fresh random layer pushed to the test's repository,
//! pulled through its own slow proxy, removed from the registry and the daemon when dropped.

use std::io::{self, Read as _, Write as _};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use super::http::{Request, Response};

/// Docker's image manifest (v2 schema 2).
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// The OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// A gzip-compressed layer in a Docker manifest.
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// A gzip-compressed layer in an OCI manifest.
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// How long one answer of the registry may take.
const TIMEOUT: Duration = Duration::from_secs(60);

fn error(message: String) -> io::Error {
    io::Error::other(message)
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    let hex: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// A layer to push: its gzip-compressed tar and the digest of the uncompressed tar (its
/// `diff_id` in an image config).
#[derive(Debug, Clone)]
pub struct Layer {
    /// The layer as pushed (gzip).
    pub gzip: Vec<u8>,
    /// `sha256:` of the uncompressed tar.
    pub diff_id: String,
}

impl Layer {
    /// The entries at the top of `dir` (and all below them) as a layer: `tar` writes
    /// `<scratch>/layer.tar` with root-owned entries named relative to `dir` (no `./` entry,
    /// which would set the mode of the image's root), and `gzip -n` compresses it.
    pub fn from_dir(dir: &Path, scratch: &Path) -> io::Result<Self> {
        let mut names: Vec<_> = fs_err::read_dir(dir)?
            .map(|entry| entry.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        if names.is_empty() {
            return Err(error(format!(
                "{} is empty: no layer to make",
                dir.display()
            )));
        }
        let tar_path = scratch.join("layer.tar");
        let tar = Command::new("tar")
            .arg("-C")
            .arg(dir)
            .args(["--numeric-owner", "--owner=0", "--group=0", "-cf"])
            .arg(&tar_path)
            .arg("--")
            .args(&names)
            .stdin(Stdio::null())
            .output()?;
        if !tar.status.success() {
            return Err(error(format!(
                "tar of {}: {}",
                dir.display(),
                String::from_utf8_lossy(&tar.stderr)
            )));
        }
        let gzip = Command::new("gzip")
            .args(["-n", "-c"])
            .arg(&tar_path)
            .stdin(Stdio::null())
            .output()?;
        if !gzip.status.success() {
            return Err(error(format!(
                "gzip -n of {}: {}",
                tar_path.display(),
                String::from_utf8_lossy(&gzip.stderr)
            )));
        }
        let diff_id = sha256_digest(&fs_err::read(&tar_path)?);
        fs_err::remove_file(&tar_path)?;
        Ok(Self {
            gzip: gzip.stdout,
            diff_id,
        })
    }
}

/// A registry on plain HTTP at `addr`, spoken to with basic auth.
#[derive(Debug, Clone)]
pub struct Registry {
    addr: SocketAddr,
    authorization: String,
}

impl Registry {
    /// The registry at `addr` with the credentials `user` / `password`.
    pub fn new(addr: SocketAddr, user: &str, password: &str) -> Self {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        Self {
            addr,
            authorization: format!("Basic {token}"),
        }
    }

    /// The test registry ([`crate::registry`]) with the fixture credentials.
    pub fn fixture() -> io::Result<Self> {
        let host = crate::registry();
        let addr = host
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| error(format!("{host} resolves to no address")))?;
        Ok(Self::new(
            addr,
            &crate::registry_user(),
            &crate::registry_password(),
        ))
    }

    /// The registry's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `request` with the credentials; fails unless the answer's status is one of `expected`.
    fn send(&self, request: Request, what: &str, expected: &[u16]) -> io::Result<Response> {
        let response = request
            .header("Authorization", self.authorization.clone())
            .timeout(TIMEOUT)
            .send(self.addr)?;
        if expected.contains(&response.status) {
            Ok(response)
        } else {
            Err(error(format!(
                "{what} on {}: {} {}",
                self.addr, response.status, response.body
            )))
        }
    }

    /// The manifest `repo:reference` (Docker v2 schema 2 or OCI) and its media type.
    pub fn manifest(&self, repo: &str, reference: &str) -> io::Result<(String, Value)> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let response = self.send(
            Request::get(&path).header("Accept", format!("{DOCKER_MANIFEST}, {OCI_MANIFEST}")),
            &format!("GET {path}"),
            &[200],
        )?;
        let manifest = response.json()?;
        let media_type = manifest["mediaType"]
            .as_str()
            .or_else(|| response.header("content-type"))
            .unwrap_or_default()
            .to_owned();
        if media_type != DOCKER_MANIFEST && media_type != OCI_MANIFEST {
            return Err(error(format!(
                "GET {path}: a manifest of type {media_type:?}, not an image manifest"
            )));
        }
        Ok((media_type, manifest))
    }

    /// The blob `digest` of `repo`.
    pub fn blob(&self, repo: &str, digest: &str) -> io::Result<Vec<u8>> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        let mut answer = Request::get(&path)
            .header("Authorization", self.authorization.clone())
            .timeout(TIMEOUT)
            .open(self.addr)?;
        let mut bytes = Vec::new();
        answer.body.read_to_end(&mut bytes)?;
        if answer.status != 200 {
            return Err(error(format!(
                "GET {path} on {}: {} {}",
                self.addr,
                answer.status,
                String::from_utf8_lossy(&bytes)
            )));
        }
        let got = sha256_digest(&bytes);
        if got != digest {
            return Err(error(format!("GET {path}: the bytes' digest is {got}")));
        }
        Ok(bytes)
    }

    /// Mounts the blob `digest` of `from` into `repo` (`POST
    /// /v2/<repo>/blobs/uploads/?mount=<digest>&from=<from>`). `None`: mounted (201);
    /// `Some(location)`: the registry did not mount it and started an upload instead (202),
    /// to be finished with [`Registry::finish_upload`].
    pub fn mount_blob(&self, repo: &str, from: &str, digest: &str) -> io::Result<Option<String>> {
        let path = format!("/v2/{repo}/blobs/uploads/?mount={digest}&from={from}");
        let what = format!("POST {path}");
        let response = self.send(Request::post(&path), &what, &[201, 202])?;
        if response.status == 201 {
            return Ok(None);
        }
        location(&response, &what).map(Some)
    }

    /// Uploads `bytes` as a blob of `repo` (`POST` starts the upload, one `PUT` sends it all);
    /// returns its digest.
    pub fn upload_blob(&self, repo: &str, bytes: &[u8]) -> io::Result<String> {
        let path = format!("/v2/{repo}/blobs/uploads/");
        let what = format!("POST {path}");
        let response = self.send(Request::post(&path), &what, &[202])?;
        let digest = sha256_digest(bytes);
        self.finish_upload(&location(&response, &what)?, &digest, bytes)?;
        Ok(digest)
    }

    /// Sends the whole blob `bytes` (of `digest`) to the upload started at `location` (the
    /// `Location` of the answer that started it) and closes it.
    pub fn finish_upload(&self, location: &str, digest: &str, bytes: &[u8]) -> io::Result<()> {
        let separator = if location.contains('?') { '&' } else { '?' };
        let digest_param = digest.replace(':', "%3A");
        let path = format!("{location}{separator}digest={digest_param}");
        self.send(
            Request::new("PUT", &path).body(Some("application/octet-stream"), bytes),
            &format!("PUT {location} ({digest})"),
            &[201],
        )?;
        Ok(())
    }

    /// Puts `manifest` (of `media_type`) as `repo:reference`; returns its digest.
    pub fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        manifest: &Value,
    ) -> io::Result<String> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let bytes = manifest.to_string().into_bytes();
        let digest = sha256_digest(&bytes);
        self.send(
            Request::new("PUT", &path).body(Some(media_type), bytes),
            &format!("PUT {path}"),
            &[201],
        )?;
        Ok(digest)
    }

    /// Deletes the manifest `digest` of `repo` (and so every tag naming it): `DELETE
    /// /v2/<repo>/manifests/<digest>`, which needs the registry's `storage.delete.enabled`
    /// (the test registry has it). The blobs stay until the registry's garbage collection.
    pub fn delete_manifest(&self, repo: &str, digest: &str) -> io::Result<()> {
        let path = format!("/v2/{repo}/manifests/{digest}");
        self.send(
            Request::new("DELETE", &path),
            &format!("DELETE {path}"),
            &[202],
        )?;
        Ok(())
    }

    /// Makes `repo:tag` the image `base_repo:base_tag` of this registry with `layer` on top:
    /// the base layers are mounted from `base_repo` (uploaded from it where the registry does
    /// not mount), `layer` is uploaded, the config is the base config with the layer's
    /// `diff_id` appended (and a history entry `created_by`, if the base config has a
    /// history), and the manifest, of the base manifest's kind, is put last. Returns the
    /// manifest's digest.
    pub fn push_with_layer(
        &self,
        (base_repo, base_tag): (&str, &str),
        (repo, tag): (&str, &str),
        layer: &Layer,
        created_by: &str,
    ) -> io::Result<String> {
        let (media_type, mut manifest) = self.manifest(base_repo, base_tag)?;
        let config_digest = manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| error(format!("{base_repo}:{base_tag}: no config digest")))?
            .to_owned();
        let mut config: Value = serde_json::from_slice(&self.blob(base_repo, &config_digest)?)
            .map_err(|e| error(format!("the config of {base_repo}:{base_tag}: {e}")))?;

        let base_layers = manifest["layers"]
            .as_array()
            .ok_or_else(|| error(format!("{base_repo}:{base_tag}: no layers")))?
            .clone();
        for base_layer in &base_layers {
            let digest = base_layer["digest"]
                .as_str()
                .ok_or_else(|| error(format!("{base_repo}:{base_tag}: a layer without digest")))?;
            if let Some(location) = self.mount_blob(repo, base_repo, digest)? {
                let bytes = self.blob(base_repo, digest)?;
                self.finish_upload(&location, digest, &bytes)?;
            }
        }

        let layer_digest = self.upload_blob(repo, &layer.gzip)?;
        let diff_ids = config["rootfs"]["diff_ids"]
            .as_array_mut()
            .ok_or_else(|| error(format!("the config of {base_repo}:{base_tag}: no diff_ids")))?;
        diff_ids.push(json!(layer.diff_id));
        if let Some(history) = config.get_mut("history").and_then(Value::as_array_mut) {
            history.push(json!({ "created_by": created_by, "comment": "shim-e2e" }));
        }
        let config_bytes = config.to_string().into_bytes();
        let new_config_digest = self.upload_blob(repo, &config_bytes)?;

        manifest["config"]["digest"] = json!(new_config_digest);
        manifest["config"]["size"] = json!(config_bytes.len());
        let layer_type = if media_type == OCI_MANIFEST {
            OCI_LAYER_GZIP
        } else {
            DOCKER_LAYER_GZIP
        };
        let mut layers = base_layers;
        layers.push(json!({
            "mediaType": layer_type,
            "digest": layer_digest,
            "size": layer.gzip.len(),
        }));
        manifest["layers"] = Value::Array(layers);
        self.put_manifest(repo, tag, &media_type, &manifest)
    }
}

/// The rate of a [`FreshImage`]'s proxy: [`FRESH_CHUNK`] bytes, then [`FRESH_PAUSE`] (at most
/// 2 MiB/s: a layer of a few MiB spans many of the containerd store's 100 ms progress polls).
pub const FRESH_CHUNK: usize = 64 * 1024;
/// See [`FRESH_CHUNK`].
pub const FRESH_PAUSE: Duration = Duration::from_millis(32);

/// An image in the test registry that no engine can hold, pulled slowly: the registry's small
/// image ([`crate::REGISTRY_SMALL_REPO`], whose layers the local test image shares) with one
/// more layer of fresh random bytes (`/payload`), pushed through the registry's API
/// ([`Registry::push_with_layer`]) as `<repo>:<tag unique to this process>`, and referred to
/// through its own [`SlowProxy`] ([`FRESH_CHUNK`] / [`FRESH_PAUSE`]). Its pull downloads the
/// new layer on every engine and store, whatever an earlier run left in a content store (the
/// containerd store keeps a removed image's content, and a cancelled pull's partial content,
/// so an image pulled before comes back at once), and reports its bytes as it goes.
///
/// When dropped: the local image is removed (`docker rmi -f`), the manifest is deleted from
/// the registry, and the proxy stops. Drop it after the containers that use the image.
#[derive(Debug)]
pub struct FreshImage {
    reference: String,
    registry: Registry,
    repo: String,
    digest: String,
    layer_bytes: u64,
    /// Kept for the pulls; stops when the image is dropped.
    proxy: SlowProxy,
}

impl FreshImage {
    /// Pushes a fresh image with `payload_bytes` random bytes to `repo` of the test registry
    /// (a repository of the calling test's own) and starts its proxy.
    pub fn push(repo: &str, payload_bytes: usize) -> io::Result<Self> {
        static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let tag = format!(
            "{}-{}",
            super::task::run_tag(),
            COUNT.fetch_add(1, Ordering::SeqCst)
        );
        Self::push_as(
            repo,
            &tag,
            (crate::REGISTRY_SMALL_REPO, crate::REGISTRY_TAG),
            payload_bytes,
        )
    }

    /// Pushes a fresh image to `<repo>-<run tag>-<n>:latest` (a repository of this process's
    /// own, so its `latest` is too): an image the shim pulls again at every start, whose tag
    /// [`FreshImage::repush`] moves.
    pub fn push_latest(repo: &str, payload_bytes: usize) -> io::Result<Self> {
        static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let repo = format!(
            "{repo}-{}-{}",
            super::task::run_tag(),
            COUNT.fetch_add(1, Ordering::SeqCst)
        );
        Self::push_as(
            &repo,
            "latest",
            (crate::REGISTRY_SMALL_REPO, crate::REGISTRY_TAG),
            payload_bytes,
        )
    }

    /// Pushes a fresh image on top of `base` (all of `base`'s layers, then a fresh one of
    /// `payload_bytes`) to `repo`: two images sharing layers, as many share a CUDA base.
    pub fn push_on(base: &FreshImage, repo: &str, payload_bytes: usize) -> io::Result<Self> {
        static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let tag = format!(
            "{}-on-{}",
            super::task::run_tag(),
            COUNT.fetch_add(1, Ordering::SeqCst)
        );
        let base_tag = base.tag().to_owned();
        Self::push_as(repo, &tag, (&base.repo, &base_tag), payload_bytes)
    }

    fn push_as(
        repo: &str,
        tag: &str,
        base: (&str, &str),
        payload_bytes: usize,
    ) -> io::Result<Self> {
        let registry = Registry::fixture()?;
        let (digest, layer_bytes) = Self::push_layer(&registry, base, (repo, tag), payload_bytes)?;
        let proxy = SlowProxy::start(registry.addr(), FRESH_CHUNK, FRESH_PAUSE)?;
        Ok(Self {
            reference: format!("{}/{repo}:{tag}", proxy.host()),
            registry,
            repo: repo.to_owned(),
            digest,
            layer_bytes,
            proxy,
        })
    }

    /// Pushes `base` plus a layer of `payload_bytes` random bytes as `target`; the manifest's
    /// digest and the layer's size.
    fn push_layer(
        registry: &Registry,
        base: (&str, &str),
        target: (&str, &str),
        payload_bytes: usize,
    ) -> io::Result<(String, u64)> {
        let scratch = tempfile::tempdir()?;
        let files = scratch.path().join("layer");
        fs_err::create_dir(&files)?;
        let mut payload = vec![0u8; payload_bytes];
        fs_err::File::open("/dev/urandom")?.read_exact(&mut payload)?;
        fs_err::write(files.join("payload"), &payload)?;
        drop(payload);
        let layer = Layer::from_dir(&files, scratch.path())?;
        let digest = registry.push_with_layer(base, target, &layer, "COPY payload /payload")?;
        Ok((digest, u64::try_from(layer.gzip.len()).unwrap_or(u64::MAX)))
    }

    /// Pushes other fresh content (`payload_bytes` random bytes on the registry's small image)
    /// under the same name: the tag moves in the registry, as a `latest` does when its image
    /// is rebuilt. The old manifest is deleted from the registry.
    pub fn repush(&mut self, payload_bytes: usize) -> io::Result<()> {
        let tag = self.tag().to_owned();
        let (digest, layer_bytes) = Self::push_layer(
            &self.registry,
            (crate::REGISTRY_SMALL_REPO, crate::REGISTRY_TAG),
            (&self.repo, &tag),
            payload_bytes,
        )?;
        let old = std::mem::replace(&mut self.digest, digest);
        self.layer_bytes = layer_bytes;
        let _ = self.registry.delete_manifest(&self.repo, &old);
        Ok(())
    }

    /// The image's tag.
    pub fn tag(&self) -> &str {
        self.reference.rsplit_once(':').map_or("", |(_, tag)| tag)
    }

    /// The image as pulled, through the proxy: `127.0.0.1:<port>/<repo>:<tag>`.
    pub fn reference(&self) -> &str {
        &self.reference
    }

    /// The image straight from the registry, at full speed (no proxy):
    /// `<registry>/<repo>:<tag>`. A second name of the same image: pulled by either, it is
    /// removed under the name it was pulled by.
    pub fn direct_reference(&self) -> String {
        let (_, tag) = self
            .reference
            .rsplit_once(':')
            .unwrap_or((&self.reference, ""));
        format!("{}/{}:{tag}", self.registry.addr(), self.repo)
    }

    /// The size of the fresh layer as pulled (gzip), in bytes.
    pub fn layer_bytes(&self) -> u64 {
        self.layer_bytes
    }

    /// The proxy the image is pulled through.
    pub fn proxy(&self) -> &SlowProxy {
        &self.proxy
    }
}

impl Drop for FreshImage {
    fn drop(&mut self) {
        let _ = super::docker::try_docker_within(
            &["rmi", "-f", &self.reference],
            super::docker::DOCKER_BOUND,
        );
        let _ = self.registry.delete_manifest(&self.repo, &self.digest);
    }
}

/// A TCP proxy on 127.0.0.1 in front of a registry whose answers flow at a bounded rate: at
/// most `chunk` bytes, then a `pause`; requests pass unhindered. Pulled through it (as
/// `<proxy host>/<repo>:<tag>`: Docker takes any loopback registry for an insecure one), a
/// layer of a few MiB downloads slowly enough for the containerd image store to report its
/// bytes (see the module docs). Stops accepting and closes its connections when dropped.
#[derive(Debug)]
pub struct SlowProxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
    /// Bytes of answers still to forward, over all connections ([`u64::MAX`]: no limit); at
    /// 0 the proxy stalls (see [`SlowProxy::stall_after`]).
    budget: Arc<AtomicU64>,
}

impl SlowProxy {
    /// Listens on a free port of 127.0.0.1 in front of `upstream`.
    pub fn start(upstream: SocketAddr, chunk: usize, pause: Duration) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(Mutex::new(Vec::new()));
        let budget = Arc::new(AtomicU64::new(u64::MAX));
        let (stopped, open, left) = (stop.clone(), connections.clone(), budget.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                if let Ok(clone) = client.try_clone() {
                    open.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(clone);
                }
                let (stopped, left) = (stopped.clone(), left.clone());
                std::thread::spawn(move || {
                    let rate = Rate {
                        chunk: chunk.max(1),
                        pause,
                        budget: &left,
                        stop: &stopped,
                    };
                    // An error ends this connection only (the client sees it closed).
                    let _ = relay(client, upstream, &rate);
                });
            }
        });
        Ok(Self {
            addr,
            stop,
            connections,
            budget,
        })
    }

    /// Forwards `bytes` more bytes of answers (over all connections), then stalls: the
    /// connections stay open and nothing more comes through them until [`SlowProxy::resume`]
    /// (or the proxy is dropped, which closes them). A registry that stops sending
    /// mid-body, as a dead link or a hung CDN does.
    pub fn stall_after(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::SeqCst);
    }

    /// Stalls now: [`SlowProxy::stall_after`] with no more bytes.
    pub fn stall(&self) {
        self.stall_after(0);
    }

    /// Forwards again without a limit, after a stall.
    pub fn resume(&self) {
        self.budget.store(u64::MAX, Ordering::SeqCst);
    }

    /// `127.0.0.1:<port>`, the registry host of image references pulled through the proxy.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the stop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for connection in self
            .connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            let _ = connection.shutdown(Shutdown::Both);
        }
    }
}

/// How a [`SlowProxy`] forwards answers: at most `chunk` bytes, then a `pause`, and nothing
/// while the shared `budget` is spent.
struct Rate<'a> {
    chunk: usize,
    pause: Duration,
    budget: &'a AtomicU64,
    stop: &'a AtomicBool,
}

impl Rate<'_> {
    /// Takes up to `want` bytes from the budget, waiting while it is spent; `None` once the
    /// proxy stops.
    fn take(&self, want: usize) -> Option<usize> {
        let want = u64::try_from(want).unwrap_or(u64::MAX);
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            let granted = self
                .budget
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| match left {
                    0 => None,
                    u64::MAX => Some(u64::MAX),
                    left => Some(left - left.min(want)),
                });
            match granted {
                Ok(left) => return usize::try_from(left.min(want)).ok(),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Relays one client connection to `upstream`: the client's bytes as they come, the
/// upstream's at `rate`.
fn relay(client: TcpStream, upstream: SocketAddr, rate: &Rate<'_>) -> io::Result<()> {
    let server = TcpStream::connect_timeout(&upstream, Duration::from_secs(5))?;
    let (mut from_client, mut to_server) = (client.try_clone()?, server.try_clone()?);
    std::thread::spawn(move || {
        let _ = io::copy(&mut from_client, &mut to_server);
        let _ = to_server.shutdown(Shutdown::Write);
    });
    let (mut from_server, mut to_client) = (server, client);
    let mut buffer = vec![0u8; rate.chunk];
    loop {
        let n = from_server.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        let mut sent = 0;
        while sent < n {
            let Some(take) = rate.take(n - sent) else {
                return Ok(());
            };
            to_client.write_all(&buffer[sent..sent + take])?;
            sent += take;
        }
        std::thread::sleep(rate.pause);
    }
    to_client.shutdown(Shutdown::Write)
}

/// The path (and query) of the `Location` of `response`, which may be an absolute URL.
fn location(response: &Response, what: &str) -> io::Result<String> {
    let location = response
        .header("location")
        .ok_or_else(|| error(format!("{what}: no Location in {response:?}")))?;
    let path = match location.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => location,
    };
    Ok(path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_is_a_path() {
        let response = |value: &str| Response {
            status: 202,
            headers: vec![("location".to_owned(), value.to_owned())],
            body: String::new(),
        };
        assert_eq!(
            location(
                &response("http://127.0.0.1:5799/v2/r/blobs/uploads/u?_state=x"),
                ""
            )
            .unwrap(),
            "/v2/r/blobs/uploads/u?_state=x"
        );
        assert_eq!(
            location(&response("/v2/r/blobs/uploads/u"), "").unwrap(),
            "/v2/r/blobs/uploads/u"
        );
    }

    #[test]
    fn digest_of_nothing() {
        assert_eq!(
            sha256_digest(b""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
