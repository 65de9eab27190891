//! What the engine benches share: the real engine started against a fake rank-0 worker thread
//! on private ipc sockets, that worker's sockets and hello, and its step rate alone (the
//! ceiling).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nsaserve_router::engine::{EngineHandle, EngineLimits, Startup};
use nsaserve_router::metrics::Metrics;
use nsaserve_router::protocol::{encode_worker_message, Hello, WorkerMessage, PROTOCOL_VERSION};
use nsaserve_router::transport::Endpoints;

/// A fake rank-0 worker's sockets, connected and its hello sent.
pub struct WorkerSockets {
    pub plans: zmq::Socket,
    events: zmq::Socket,
    _ctx: zmq::Context,
}

impl WorkerSockets {
    /// Connects to the router and says hello: one GPU of `num_pages` 64-token pages and a
    /// vocabulary of `vocab_size`.
    pub fn connect(endpoints: &Endpoints, num_pages: u32, vocab_size: u32) -> WorkerSockets {
        let ctx = zmq::Context::new();
        let plans = ctx.socket(zmq::PULL).unwrap();
        plans.connect(&endpoints.plans(0)).unwrap();
        let events = ctx.socket(zmq::PUSH).unwrap();
        events.connect(&endpoints.events()).unwrap();
        // The engine goes away first: leave nothing unsent behind.
        plans.set_linger(0).unwrap();
        events.set_linger(0).unwrap();
        let sockets = WorkerSockets {
            plans,
            events,
            _ctx: ctx,
        };
        sockets.send(WorkerMessage::Hello(Hello {
            rank: 0,
            tp_size: 1,
            pid: std::process::id(),
            model_id: "fake-10ms".into(),
            num_pages,
            page_size: 64,
            max_context: 16_384,
            vocab_size,
            version: PROTOCOL_VERSION,
        }));
        sockets
    }

    pub fn send(&self, m: WorkerMessage) {
        self.events
            .send(encode_worker_message(&m).unwrap(), 0)
            .unwrap();
    }
}

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
        priority: None,
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
