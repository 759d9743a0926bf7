//! The container runtime as the engine uses it: every request counted, with its errors by
//! kind (`dstack_shim_docker_requests`, `dstack_shim_docker_errors`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use shim_runtime::{
    ContainerDetails, ContainerRuntime, ContainerSpec, ContainerSummary, EventStream, GpuSupport,
    ImageDetails, ProgressFn, PullRequest, Result as RtResult,
};
use shim_task::PullProgress;
use tokio_util::sync::CancellationToken;

use crate::counters::Metrics;

/// A [`ContainerRuntime`] that counts every request and its errors.
pub(crate) struct Metered {
    runtime: Arc<dyn ContainerRuntime>,
    metrics: Arc<Metrics>,
}

impl Metered {
    /// `runtime`, counted in `metrics`.
    pub(crate) fn new(runtime: Arc<dyn ContainerRuntime>, metrics: Arc<Metrics>) -> Self {
        Self { runtime, metrics }
    }

    fn count<T>(&self, op: &str, result: RtResult<T>) -> RtResult<T> {
        self.metrics.request(op, &result);
        result
    }
}

#[async_trait]
impl ContainerRuntime for Metered {
    async fn image_present(&self, image: &str) -> RtResult<bool> {
        self.count("image_present", self.runtime.image_present(image).await)
    }

    async fn pull(
        &self,
        request: &PullRequest,
        progress: ProgressFn<'_>,
        cancel: CancellationToken,
    ) -> RtResult<PullProgress> {
        self.count("pull", self.runtime.pull(request, progress, cancel).await)
    }

    async fn create(&self, spec: &ContainerSpec) -> RtResult<String> {
        self.count("create", self.runtime.create(spec).await)
    }

    async fn start(&self, id: &str) -> RtResult<()> {
        self.count("start", self.runtime.start(id).await)
    }

    async fn inspect(&self, id_or_name: &str) -> RtResult<ContainerDetails> {
        self.count("inspect", self.runtime.inspect(id_or_name).await)
    }

    async fn list(&self, labels: &[(String, String)]) -> RtResult<Vec<ContainerSummary>> {
        self.count("list", self.runtime.list(labels).await)
    }

    async fn stop(&self, id: &str, timeout: Duration) -> RtResult<()> {
        self.count("stop", self.runtime.stop(id, timeout).await)
    }

    async fn remove(&self, id: &str) -> RtResult<()> {
        self.count("remove", self.runtime.remove(id).await)
    }

    async fn gpu_support(&self) -> RtResult<GpuSupport> {
        self.count("info", self.runtime.gpu_support().await)
    }

    async fn inspect_image(&self, image: &str) -> RtResult<Option<ImageDetails>> {
        self.count("image_inspect", self.runtime.inspect_image(image).await)
    }

    async fn delete_image(&self, image: &str) -> RtResult<()> {
        self.count("image_remove", self.runtime.delete_image(image).await)
    }

    async fn data_root(&self) -> RtResult<Option<std::path::PathBuf>> {
        self.count("info", self.runtime.data_root().await)
    }

    async fn logs_tail(&self, id: &str, n: usize) -> RtResult<Vec<String>> {
        self.count("logs", self.runtime.logs_tail(id, n).await)
    }

    async fn events(
        &self,
        labels: &[(String, String)],
        since_ns: Option<i64>,
    ) -> RtResult<EventStream> {
        self.count("events", self.runtime.events(labels, since_ns).await)
    }
}
