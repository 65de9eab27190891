//! Binding the sockets and waiting for every worker's hello.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::core::Input;
use crate::protocol::{Hello, WorkerMessage, PROTOCOL_VERSION};
use crate::transport::{Endpoints, EventReceiver, PlanSender, Received};

/// What the workers told us in their hellos, checked for agreement.
#[derive(Debug, Clone)]
pub struct WorkersInfo {
    pub tp_size: u32,
    pub model_id: String,
    pub num_pages: u32,
    pub page_size: u32,
    pub max_context: u32,
    pub vocab_size: u32,
    pub pids: Vec<u32>,
}

/// Sockets bound, waiting for hellos. Becomes the running engine with `EngineHandle::start`.
pub struct Startup {
    pub(super) ctx: zmq::Context,
    pub(super) sender: PlanSender,
    pub(super) inputs_tx: Sender<Input>,
    pub(super) inputs_rx: Receiver<Input>,
    pub(super) receiver: ReceiverThread,
    hellos: Vec<Option<Hello>>,
    early: Vec<Input>,
}

impl Startup {
    pub fn bind(endpoints: &Endpoints, tp_size: u32) -> Result<Self> {
        let ctx = zmq::Context::new();
        let sender = PlanSender::bind(&ctx, endpoints, tp_size)?;
        let events = EventReceiver::bind(&ctx, endpoints, Duration::from_millis(100))?;
        let (inputs_tx, inputs_rx) = channel();
        let receiver = ReceiverThread::spawn(events, inputs_tx.clone());
        Ok(Self {
            ctx,
            sender,
            inputs_tx,
            inputs_rx,
            receiver,
            hellos: vec![None; tp_size as usize],
            early: Vec::new(),
        })
    }

    /// Waits up to `timeout` for the remaining hellos. `Ok(None)`: not all there yet.
    /// `Err`: a worker reported a fatal error, spoke another protocol version, or disagreed
    /// with rank 0 about the model.
    pub fn poll_ready(&mut self, timeout: Duration) -> Result<Option<WorkersInfo>> {
        let deadline = Instant::now() + timeout;
        while self.hellos.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inputs_rx.recv_timeout(left) {
                Ok(Input::Worker(WorkerMessage::Hello(h))) => self.accept_hello(h)?,
                Ok(Input::Worker(WorkerMessage::Fatal(f))) => {
                    bail!("worker rank {} failed to start: {}", f.rank, f.message)
                }
                Ok(Input::WorkerGone { rank, reason }) => {
                    bail!("worker rank {rank} exited during startup: {reason}")
                }
                Ok(other) => self.early.push(other),
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => bail!("the event receiver stopped"),
            }
        }
        Ok(Some(self.info()))
    }

    fn accept_hello(&mut self, h: Hello) -> Result<()> {
        if h.version != PROTOCOL_VERSION {
            bail!(
                "worker rank {} speaks protocol version {}, this router speaks {PROTOCOL_VERSION}; install the same nsaserve build everywhere",
                h.rank,
                h.version
            );
        }
        let tp = self.hellos.len() as u32;
        if h.rank >= tp || h.tp_size != tp {
            bail!(
                "worker rank {} says tp_size {}, the router started {tp}",
                h.rank,
                h.tp_size
            );
        }
        let rank = h.rank as usize;
        self.hellos[rank] = Some(h);
        Ok(())
    }

    fn info(&self) -> WorkersInfo {
        let hellos: Vec<&Hello> = self
            .hellos
            .iter()
            .map(|h| h.as_ref().expect("all hellos"))
            .collect();
        let r0 = hellos[0];
        WorkersInfo {
            tp_size: hellos.len() as u32,
            model_id: r0.model_id.clone(),
            // Ranks may differ slightly in free memory; the pool is what every rank can hold.
            num_pages: hellos.iter().map(|h| h.num_pages).min().unwrap_or(0),
            page_size: r0.page_size,
            max_context: r0.max_context,
            vocab_size: r0.vocab_size,
            pids: hellos.iter().map(|h| h.pid).collect(),
        }
    }

    /// Inputs that arrived during startup but belong to the running engine (heartbeats).
    pub(super) fn take_early(&mut self) -> Vec<Input> {
        std::mem::take(&mut self.early)
    }

    /// Tells every worker to exit (startup abandoned).
    pub fn shutdown_workers(&self) {
        self.sender.shutdown_all();
    }
}

/// The thread that reads the events socket and feeds the engine's input channel; stopped and
/// joined when dropped.
pub struct ReceiverThread {
    handle: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

impl ReceiverThread {
    fn spawn(events: EventReceiver, tx: Sender<Input>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("nsaserve-events".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    match events.recv() {
                        Ok(Received::Message(m)) => {
                            if tx.send(Input::Worker(m)).is_err() {
                                return;
                            }
                        }
                        Ok(Received::Garbage(why)) => {
                            tracing::warn!("dropped an unreadable worker message: {why}")
                        }
                        Ok(Received::Timeout) => {}
                        Err(e) => {
                            tracing::error!("worker event socket failed: {e}");
                            let reason = format!("event socket failed: {e}");
                            let _ = tx.send(Input::WorkerGone { rank: 0, reason });
                            return;
                        }
                    }
                }
            })
            .expect("spawn the event receiver thread");
        Self {
            handle: Some(handle),
            stop,
        }
    }
}

impl Drop for ReceiverThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.handle.take() {
            let _ = t.join();
        }
    }
}
