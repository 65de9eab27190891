//! The running engine as the rest of the router sees it: submit requests, report dead workers,
//! restart with a new worker group, shut down. Implements the `Engine` trait the HTTP layer uses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::core::{EngineCore, Exit, Input};
use super::shared::Shared;
use super::startup::{ReceiverThread, Startup, WorkersInfo};
use super::{Engine, GenerateRequest, ModelInfo, RequestStream, SubmitError};
use crate::metrics::Metrics;
use crate::scheduler::{DataParallelScheduler, SchedulerConfig};

/// Scheduling limits chosen on the command line (the pool size comes from the workers).
#[derive(Debug, Clone)]
pub struct EngineLimits {
    pub served_model_name: String,
    pub max_running_requests: usize,
    pub max_prefill_tokens: usize,
    pub chunked_prefill_size: Option<usize>,
    pub disable_radix_cache: bool,
    pub max_waiting: usize,
    pub heartbeat_timeout: Duration,
    /// Plan each step only after the previous one's result (no overlap).
    pub disable_overlap_schedule: bool,
    /// Attention data-parallel ranks (`--enable-dp-attention`: the worker count); 1 is off.
    /// Each rank has its own pool of the pages the workers report, so the router plans over
    /// `dp_size` times as many.
    pub dp_size: usize,
    /// Priority scheduling; `None`: first come, first served.
    pub priority: Option<crate::scheduler::PriorityPolicy>,
}

pub struct EngineHandle {
    /// The current run's input channel; each restart replaces it (the abort forwarder shares it).
    inputs: Arc<Mutex<Sender<Input>>>,
    abort_tx: mpsc::UnboundedSender<u64>,
    /// Request ids stay unique across restarts, so a late abort never hits a new request.
    next_id: AtomicU64,
    limits: EngineLimits,
    metrics: Arc<Metrics>,
    run: Mutex<Run>,
}

/// One worker group's engine loop: its thread, its sockets and the state it shares with the
/// request handlers. Restarting the workers ends the run and launches a fresh one, with a fresh
/// scheduler: an empty KV pool and radix cache of the size the new workers report.
struct Run {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Exit>>,
    exit_reason: Arc<Mutex<Option<String>>>,
    running: Arc<AtomicBool>,
    /// Closed when the run ends, before a restart binds the same endpoints again.
    receiver: Option<ReceiverThread>,
    ctx: Option<zmq::Context>,
}

impl Run {
    fn launch(
        mut startup: Startup,
        workers: &WorkersInfo,
        limits: &EngineLimits,
        metrics: Arc<Metrics>,
    ) -> (Run, Sender<Input>) {
        let early = startup.take_early();
        let Startup {
            ctx,
            sender,
            inputs_tx,
            inputs_rx,
            receiver,
            ..
        } = startup;
        for input in early {
            let _ = inputs_tx.send(input);
        }
        let info = ModelInfo {
            served_model_name: limits.served_model_name.clone(),
            max_context: workers.max_context,
            vocab_size: workers.vocab_size,
        };
        // One rank's pool (with data-parallel attention a request lives on one rank): the
        // most KV a single request can have.
        let shared = Arc::new(Shared::new(
            info,
            workers.num_pages,
            workers.page_size,
            metrics,
        ));
        let dp_size = limits.dp_size.max(1);
        let scheduler = DataParallelScheduler::new(
            SchedulerConfig {
                page_size: workers.page_size,
                num_pages: workers.num_pages * dp_size as u32,
                max_running_requests: limits.max_running_requests,
                max_prefill_tokens: limits.max_prefill_tokens,
                chunked_prefill_size: limits.chunked_prefill_size,
                disable_radix_cache: limits.disable_radix_cache,
                max_context: workers.max_context,
                max_waiting: limits.max_waiting,
                priority: limits.priority,
            },
            dp_size,
        );
        // /metrics shows the new pool at once, not after the first step.
        shared.set_scheduler_stats(&scheduler.stats());
        let core = EngineCore {
            scheduler,
            sender,
            inputs: inputs_rx,
            shared: shared.clone(),
            heartbeat_timeout: limits.heartbeat_timeout,
            streams: HashMap::new(),
            queued_since: HashMap::new(),
            last_seen: vec![Instant::now(); workers.tp_size as usize],
            step: 1,
            overlap: !limits.disable_overlap_schedule,
            outstanding: Default::default(),
            send_error: None,
            early_results: Default::default(),
        };
        let running = Arc::new(AtomicBool::new(true));
        let exit_reason = Arc::new(Mutex::new(None));
        let (run_flag, reason_slot) = (running.clone(), exit_reason.clone());
        let thread = std::thread::Builder::new()
            .name("nsaserve-engine".into())
            .spawn(move || {
                let exit = core.run();
                if let Exit::WorkersGone(reason) = &exit {
                    tracing::error!("engine stopped: {reason}");
                    *reason_slot.lock() = Some(reason.clone());
                }
                run_flag.store(false, Ordering::SeqCst);
                exit
            })
            .expect("spawn the engine thread");
        let run = Run {
            shared,
            thread: Some(thread),
            exit_reason,
            running,
            receiver: Some(receiver),
            ctx: Some(ctx),
        };
        (run, inputs_tx)
    }
}

impl EngineHandle {
    pub fn start(
        startup: Startup,
        workers: &WorkersInfo,
        limits: &EngineLimits,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let (run, inputs_tx) = Run::launch(startup, workers, limits, metrics.clone());
        let inputs = Arc::new(Mutex::new(inputs_tx));

        // Dropped request streams send their id here; forward them into the current run's
        // channel (an id the run does not know is ignored).
        let (abort_tx, mut abort_rx) = mpsc::unbounded_channel::<u64>();
        let forward = inputs.clone();
        std::thread::Builder::new()
            .name("nsaserve-aborts".into())
            .spawn(move || {
                while let Some(id) = abort_rx.blocking_recv() {
                    let _ = forward.lock().send(Input::Abort(id));
                }
            })
            .expect("spawn the abort forwarder");

        Arc::new(Self {
            inputs,
            abort_tx,
            next_id: AtomicU64::new(1),
            limits: limits.clone(),
            metrics,
            run: Mutex::new(run),
        })
    }

    fn send(&self, input: Input) -> bool {
        self.inputs.lock().send(input).is_ok()
    }

    /// `serve`'s supervisor saw a worker process exit.
    pub fn worker_exited(&self, rank: u32, reason: String) {
        self.send(Input::WorkerGone { rank, reason });
    }

    pub fn is_running(&self) -> bool {
        self.run.lock().running.load(Ordering::SeqCst)
    }

    /// Why the engine stopped, if workers failed.
    pub fn exit_reason(&self) -> Option<String> {
        self.run.lock().exit_reason.lock().clone()
    }

    /// Ends the current run: the loop stops if it still runs (every open request fails with
    /// "shutting down"), tells the workers to exit, and its sockets are closed. Until `restart`
    /// the engine answers `Unavailable`. Idempotent.
    pub fn end_run(&self) {
        let (thread, receiver, ctx) = {
            let mut run = self.run.lock();
            run.shared.healthy.store(false, Ordering::SeqCst);
            (run.thread.take(), run.receiver.take(), run.ctx.take())
        };
        self.send(Input::Shutdown);
        if let Some(t) = thread {
            let _ = t.join();
        }
        // The receiver thread first: its socket must close before the context can.
        drop(receiver);
        drop(ctx);
    }

    /// Serves again with a new worker group (`startup` has every hello): a fresh loop and a
    /// fresh scheduler sized by the new workers. Ends the current run first if needed.
    pub fn restart(&self, startup: Startup, workers: &WorkersInfo) {
        self.end_run();
        let (run, inputs_tx) = Run::launch(startup, workers, &self.limits, self.metrics.clone());
        *self.inputs.lock() = inputs_tx;
        *self.run.lock() = run;
        self.metrics.add_worker_restart();
        tracing::info!(
            "serving again with a new worker group ({} KV pages)",
            workers.num_pages
        );
    }

    /// Stops the loop (every open request fails with "shutting down") and tells workers to exit.
    pub fn shutdown(&self) {
        self.end_run();
    }

    fn shared(&self) -> Arc<Shared> {
        self.run.lock().shared.clone()
    }
}

impl Engine for EngineHandle {
    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError> {
        if !self.healthy() {
            let why = self
                .exit_reason()
                .unwrap_or_else(|| "the engine is not running".into());
            return Err(SubmitError::Unavailable(why));
        }
        let shared = self.shared();
        let info = &shared.info;
        let total = request.prompt_ids.len() as u64 + request.max_new_tokens as u64;
        if total > info.max_context as u64 {
            return Err(SubmitError::Invalid(format!(
                "this model's maximum context length is {} tokens; the prompt ({}) plus max_tokens ({}) is {total}",
                info.max_context,
                request.prompt_ids.len(),
                request.max_new_tokens
            )));
        }
        let pool_tokens = shared.num_pages as u64 * shared.page_size as u64;
        if total > pool_tokens {
            return Err(SubmitError::Invalid(format!(
                "the request needs up to {total} tokens of KV cache, more than the whole pool ({pool_tokens})"
            )));
        }
        if shared.waiting.load(Ordering::Relaxed) >= self.limits.max_waiting {
            return Err(SubmitError::Overloaded(format!(
                "{} requests are already waiting",
                self.limits.max_waiting
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        if !self.send(Input::Submit {
            id,
            request,
            events: tx,
        }) {
            return Err(SubmitError::Unavailable("the engine has stopped".into()));
        }
        // Count it as waiting now, so a burst cannot overshoot the bound before the engine
        // publishes its next statistics.
        shared.waiting.fetch_add(1, Ordering::Relaxed);
        Ok(RequestStream::new(id, rx, self.abort_tx.clone()))
    }

    fn healthy(&self) -> bool {
        let run = self.run.lock();
        run.shared.healthy.load(Ordering::SeqCst) && run.running.load(Ordering::SeqCst)
    }

    fn model_info(&self) -> ModelInfo {
        self.shared().info.clone()
    }
}
