//! What the engine benches share: the real engine started against a fake rank-0 worker thread
//! on private ipc sockets, and the worker's step rate alone (the ceiling).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nsaserve_router::engine::{EngineHandle, EngineLimits, Startup};
use nsaserve_router::metrics::Metrics;
use nsaserve_router::transport::Endpoints;

/// A running engine and its fake worker; the sockets' directory lives as long as it does.
pub struct FakeEngine {
    pub engine: Arc<EngineHandle>,
    pub worker: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// Binds the router's sockets, starts `worker` on them (it must say hello), and starts the
/// engine for `requests` running requests once the worker is ready.
pub fn start(
    overlap: bool,
    requests: usize,
    worker: impl FnOnce(Endpoints) + Send + 'static,
) -> FakeEngine {
    let dir = tempfile::tempdir().unwrap();
    let endpoints = Endpoints::Ipc {
        dir: dir.path().display().to_string(),
    };
    let mut startup = Startup::bind(&endpoints, 1).unwrap();
    let worker_endpoints = endpoints.clone();
    let worker = std::thread::spawn(move || worker(worker_endpoints));
    let workers = loop {
        if let Some(w) = startup.poll_ready(Duration::from_secs(5)).unwrap() {
            break w;
        }
    };
    let limits = EngineLimits {
        served_model_name: "fake".into(),
        max_running_requests: requests,
        max_prefill_tokens: 65_536,
        chunked_prefill_size: Some(65_536),
        disable_radix_cache: false,
        max_waiting: 4 * requests,
        heartbeat_timeout: Duration::from_secs(60),
        disable_overlap_schedule: !overlap,
        dp_size: 1,
    };
    let engine = EngineHandle::start(startup, &workers, &limits, Arc::new(Metrics::new()));
    FakeEngine {
        engine,
        worker,
        _dir: dir,
    }
}

/// Steps per second of a worker that sleeps until `step` has passed, back to back, no router.
pub fn ceiling(steps: usize, step: Duration) -> f64 {
    let start = Instant::now();
    for _ in 0..steps {
        let done = Instant::now() + step;
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
    }
    steps as f64 / start.elapsed().as_secs_f64()
}

/// The `q` quantile of sorted values (nearest rank).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}
