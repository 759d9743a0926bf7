//! The raw fleet's Docker client: bollard, as any Rust program that drives Docker directly
//! would use it (one create and one start per container, an inspect, a list, a remove, the
//! `/events` stream), behind a blocking facade because the bench is synchronous and runs its
//! clients on threads ([`super::parallel`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use bollard::errors::Error as BollardError;
use bollard::models::{ContainerCreateBody, ContainerInspectResponse, EventMessage};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, EventsOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder,
};
use futures_util::StreamExt as _;

use super::clock::parse_rfc3339_utc;
use super::stream::Events;

/// The daemon's socket.
pub const SOCKET: &str = "/var/run/docker.sock";
/// How long a request may wait for its answer to begin (a bound against a frozen daemon; the
/// `/events` stream's body has none).
const REQUEST_TIMEOUT_S: u64 = 120;
/// Worker threads of the client's runtime: they drive the connections and the `/events`
/// reader while the bench's threads wait in `block_on`; two are enough on the 2-core machines
/// the bench runs on, and more would only compete with dockerd for them.
const WORKERS: usize = 2;

/// The daemon's socket: `DOCKER_HOST` if it is `unix://PATH`, else [`SOCKET`].
pub fn socket_path() -> PathBuf {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|host| host.strip_prefix("unix://").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(SOCKET))
}

/// Whether `DOCKER_HOST` names another daemon than the default one.
pub fn private_daemon() -> bool {
    socket_path() != Path::new(SOCKET)
}

/// A blocking client of the daemon at [`socket_path`]: bollard on a runtime of its own, one
/// `block_on` per call (from as many threads as the bench runs at once).
pub struct Docker {
    client: bollard::Docker,
    runtime: tokio::runtime::Runtime,
}

impl Docker {
    /// Connects to the daemon at [`socket_path`] and negotiates the API version (the old
    /// daemons the bench also runs on answer only versions up to their own).
    pub fn connect() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKERS)
            .thread_name("bench-docker")
            .enable_all()
            .build()
            .context("could not start the Docker client's runtime")?;
        let socket = socket_path();
        let path = socket
            .to_str()
            .with_context(|| format!("the socket path {} is not UTF-8", socket.display()))?;
        let client = runtime
            .block_on(async {
                bollard::Docker::connect_with_unix(
                    path,
                    REQUEST_TIMEOUT_S,
                    bollard::API_DEFAULT_VERSION,
                )?
                .negotiate_version()
                .await
            })
            .with_context(|| format!("could not connect to Docker at {}", socket.display()))?;
        Ok(Self { client, runtime })
    }

    /// Whether the daemon has the image `reference`.
    pub fn has_image(&self, reference: &str) -> Result<bool> {
        match self.runtime.block_on(self.client.inspect_image(reference)) {
            Ok(_) => Ok(true),
            Err(e) if status(&e) == Some(404) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("inspect image {reference}")),
        }
    }

    /// `GET /_ping`.
    pub fn ping(&self) -> Result<()> {
        self.runtime
            .block_on(self.client.ping())
            .map(drop)
            .context("ping Docker")
    }

    /// Creates a container named `name` from `body`; its id.
    pub fn create(&self, name: &str, body: ContainerCreateBody) -> Result<String> {
        let options = CreateContainerOptionsBuilder::new().name(name).build();
        let created = self
            .runtime
            .block_on(self.client.create_container(Some(options), body))
            .with_context(|| format!("create container {name}"))?;
        Ok(created.id)
    }

    /// Starts a created container (one already running is fine: Docker answers 304).
    pub fn start(&self, id: &str) -> Result<()> {
        self.runtime
            .block_on(self.client.start_container(id, None))
            .with_context(|| format!("start container {id}"))
    }

    /// `GET /containers/{id}/json`.
    pub fn inspect(&self, id: &str) -> Result<ContainerInspectResponse> {
        self.runtime
            .block_on(self.client.inspect_container(id, None))
            .with_context(|| format!("inspect container {id}"))
    }

    /// When the container stopped (`State.FinishedAt`).
    pub fn finished_at(&self, id: &str) -> Result<SystemTime> {
        let info = self.inspect(id)?;
        let text = info.state.and_then(|s| s.finished_at).unwrap_or_default();
        parse_rfc3339_utc(&text).with_context(|| format!("{id}: bad FinishedAt {text:?}"))
    }

    /// The ids of the containers (running or not) labelled `key=value`.
    pub fn list(&self, key: &str, value: &str) -> Result<Vec<String>> {
        Ok(self
            .labelled(key, value)?
            .into_iter()
            .filter_map(|c| c.id)
            .collect())
    }

    /// The ids of the running containers labelled `key=value` (one list request).
    pub fn running(&self, key: &str, value: &str) -> Result<Vec<String>> {
        Ok(self
            .labelled(key, value)?
            .into_iter()
            .filter(|c| c.state == Some(bollard::models::ContainerSummaryStateEnum::RUNNING))
            .filter_map(|c| c.id)
            .collect())
    }

    /// One list of the containers (running or not) labelled `key=value`.
    fn labelled(&self, key: &str, value: &str) -> Result<Vec<bollard::models::ContainerSummary>> {
        let filters = filters(&[("label", &format!("{key}={value}"))]);
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        self.runtime
            .block_on(self.client.list_containers(Some(options)))
            .with_context(|| format!("list containers labelled {key}={value}"))
    }

    /// Force-removes a container (and its anonymous volumes); a missing one is fine.
    pub fn remove(&self, id: &str) -> Result<()> {
        self.runtime.block_on(self.remove_async(id))
    }

    async fn remove_async(&self, id: &str) -> Result<()> {
        let options = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        match self.client.remove_container(id, Some(options)).await {
            Ok(()) => Ok(()),
            Err(e) if status(&e) == Some(404) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("remove container {id}")),
        }
    }

    /// Force-removes every container labelled `key=value`, `at_once` at a time; how many.
    pub fn remove_all(&self, key: &str, value: &str, at_once: usize) -> Result<usize> {
        let ids = self.list(key, value)?;
        let removals = futures_util::stream::iter(ids.iter().map(|id| self.remove_async(id)))
            .buffer_unordered(at_once.max(1))
            .collect::<Vec<Result<()>>>();
        self.runtime
            .block_on(removals)
            .into_iter()
            .collect::<Result<Vec<()>>>()?;
        Ok(ids.len())
    }

    /// Subscribes to `/events` with `filter` pairs (e.g. `("type","container")`,
    /// `("event","die")`); the events arrive on the returned channel, each stamped with when
    /// the client received it.
    pub fn events(&self, filter: &[(&str, &str)]) -> Result<Events<EventMessage>> {
        // bollard's stream connects only when first read, by the task below, maybe after this
        // returns: asking for the events since now loses none of a container the caller stops
        // in between.
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .context("the clock is before 1970")?;
        let options = EventsOptionsBuilder::new()
            .since(&since_param(since))
            .filters(&filters(filter))
            .build();
        let client = self.client.clone();
        let (tx, rx) = mpsc::channel();
        let reader = self.runtime.spawn(async move {
            let mut stream = std::pin::pin!(client.events(Some(options)));
            // An error ends the stream (the receiver then reads "the event stream ended").
            while let Some(Ok(event)) = stream.next().await {
                // Stamped as soon as bollard has decoded it: the figure compares this instant
                // with the shim's, taken as its event arrives too.
                if tx.send((event, SystemTime::now())).is_err() {
                    return;
                }
            }
        });
        let reader = reader.abort_handle();
        Ok(Events::new(rx, move || reader.abort()))
    }
}

impl Events<EventMessage> {
    /// The next event of container `id` (others are skipped), within `limit`.
    pub fn wait_for(&self, id: &str, limit: Duration) -> Result<(EventMessage, SystemTime)> {
        self.wait_until(limit, |event| {
            event.actor.as_ref().and_then(|a| a.id.as_deref()) == Some(id)
        })
        .with_context(|| format!("no event for container {id}"))
    }
}

/// The HTTP status of an answer bollard turned into an error, if it was one.
fn status(error: &BollardError) -> Option<u16> {
    match error {
        BollardError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// `filter` pairs as the Engine API's `filters` map (`{"label":["key=value"]}`).
fn filters(pairs: &[(&str, &str)]) -> HashMap<String, Vec<String>> {
    let mut map: HashMap<String, Vec<String>> = HashMap::new();
    for (key, value) in pairs {
        map.entry((*key).to_owned())
            .or_default()
            .push((*value).to_owned());
    }
    map
}

/// A time since the epoch as Docker's `since` reads it (seconds, a dot, nanoseconds).
fn since_param(since: Duration) -> String {
    format!("{}.{:09}", since.as_secs(), since.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_group_values_by_key() {
        let f = filters(&[("type", "container"), ("event", "die"), ("event", "start")]);
        assert_eq!(f["type"], ["container"]);
        assert_eq!(f["event"], ["die", "start"]);
        assert_eq!(f.len(), 2);
    }

    #[test]
    fn since_has_nanoseconds() {
        let since = since_param(Duration::new(1_700_000_000, 1_500));
        assert_eq!(since, "1700000000.000001500");
    }
}
