//! The engine thread: one loop that owns the scheduler and the plan sockets.
//!
//! Each step: take new submissions and aborts, let the scheduler build the step's plan, send it
//! to every rank, wait for rank 0's result (heart-beating ranks keep the wait alive), hand the
//! result to the scheduler and forward the resulting events to each request's stream.
//! Everything arrives on one channel (`Input`), so the loop has a single place where it blocks.
//!
//! Overlap (on unless `--disable-overlap-schedule`): with step N in flight, the loop plans,
//! encodes and sends step N+1 before it waits for N's result, so the workers find N+1 queued
//! the moment they finish N and never wait for the router. At most two plans are outstanding
//! and results come back in step order; the scheduler plans with at most one in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::shared::Shared;
use super::{GenerateEvent, GenerateRequest, RequestId};
use crate::protocol::{encode_router_message, BatchPlan, RouterMessage, StepResult, WorkerMessage};
use crate::scheduler::DataParallelScheduler;
use crate::transport::PlanSender;

pub enum Input {
    Submit {
        id: RequestId,
        request: GenerateRequest,
        events: UnboundedSender<GenerateEvent>,
    },
    Abort(RequestId),
    Worker(WorkerMessage),
    /// Reported by `serve`'s supervisor (process exit) or by the receiver (heartbeat silence).
    WorkerGone {
        rank: u32,
        reason: String,
    },
    Shutdown,
}

pub struct EngineCore {
    /// One scheduler per attention data-parallel rank (one without data parallelism).
    pub scheduler: DataParallelScheduler,
    pub sender: PlanSender,
    pub inputs: Receiver<Input>,
    pub shared: Arc<Shared>,
    pub heartbeat_timeout: Duration,
    pub streams: HashMap<RequestId, UnboundedSender<GenerateEvent>>,
    /// When each request not yet in any plan reached the engine (for the queue-time metric).
    pub queued_since: HashMap<RequestId, Instant>,
    pub last_seen: Vec<Instant>,
    pub step: u64,
    /// Plan step N+1 while step N runs.
    pub overlap: bool,
    /// Plans sent (or failed before sending, with their result) whose results are not
    /// committed yet, oldest first.
    pub outstanding: VecDeque<(BatchPlan, Option<StepResult>)>,
    /// Why the last plan could not be sent (the workers are gone).
    pub send_error: Option<String>,
    /// Results that arrived while the loop was doing something else, oldest first.
    pub early_results: VecDeque<StepResult>,
}

/// Why the loop stopped.
pub enum Exit {
    Shutdown,
    WorkersGone(String),
}

impl EngineCore {
    pub fn run(mut self) -> Exit {
        loop {
            // Block only when there is nothing to run; otherwise just drain what is queued.
            let stats = self.scheduler.stats();
            let idle = stats.waiting + stats.running == 0 && self.outstanding.is_empty();
            let first = if idle {
                match self.inputs.recv_timeout(Duration::from_millis(500)) {
                    Ok(i) => Some(i),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return Exit::Shutdown,
                }
            } else {
                None
            };
            let mut pending: Vec<Input> = first.into_iter().collect();
            pending.extend(self.inputs.try_iter());
            for input in pending {
                if let Some(exit) = self.handle(input) {
                    return self.stop(exit);
                }
            }
            if let Some(reason) = self.silent_rank() {
                return self.stop(Exit::WorkersGone(reason));
            }
            self.publish_stats();
            // Plan the next step now if no plan is in flight, or (overlap) if only one is.
            let depth = if self.overlap { 2 } else { 1 };
            let sent = self.outstanding.len() < depth && self.plan_and_send();
            if let Err(exit) = self.sent_ok() {
                return self.stop(exit);
            }
            // Wait for the oldest step when no more may be queued, or nothing new was.
            if !self.outstanding.is_empty() && (self.outstanding.len() >= depth || !sent) {
                if let Some(exit) = self.complete_oldest() {
                    return self.stop(exit);
                }
            }
        }
    }

    /// Applies one input; `Some` when the loop must stop.
    fn handle(&mut self, input: Input) -> Option<Exit> {
        match input {
            Input::Submit {
                id,
                request,
                events,
            } => match self.scheduler.submit(id, request) {
                Ok(()) => {
                    self.streams.insert(id, events);
                    self.queued_since.insert(id, Instant::now());
                }
                Err(e) => {
                    // The handle checks the queue bound against the last published count, so a
                    // burst can still reach a full queue here: that is an overload (429), not a
                    // server error.
                    let _ = events.send(GenerateEvent::Refused(e));
                }
            },
            Input::Abort(id) => {
                self.queued_since.remove(&id);
                self.scheduler.abort(id);
                self.streams.remove(&id);
            }
            Input::Worker(WorkerMessage::Heartbeat(h)) => self.seen(h.rank),
            Input::Worker(WorkerMessage::Hello(h)) => self.seen(h.rank),
            Input::Worker(WorkerMessage::Fatal(f)) => {
                return Some(Exit::WorkersGone(format!(
                    "worker rank {} failed: {}",
                    f.rank, f.message
                )))
            }
            Input::Worker(WorkerMessage::Result(r)) => {
                // With a step in flight, its result can arrive while the loop drains inputs or
                // plans the next step: keep it for `complete_oldest`. Otherwise it is late or
                // duplicated and nothing waits for it.
                let awaited = self.outstanding.iter().filter(|(_, r)| r.is_none()).count();
                if self.early_results.len() < awaited {
                    self.seen(0);
                    self.early_results.push_back(r);
                }
            }
            Input::WorkerGone { rank, reason } => {
                return Some(Exit::WorkersGone(format!(
                    "worker rank {rank} is gone: {reason}"
                )))
            }
            Input::Shutdown => return Some(Exit::Shutdown),
        }
        None
    }

    fn seen(&mut self, rank: u32) {
        if let Some(t) = self.last_seen.get_mut(rank as usize) {
            *t = Instant::now();
        }
    }

    fn silent_rank(&self) -> Option<String> {
        let limit = self.heartbeat_timeout;
        self.last_seen
            .iter()
            .enumerate()
            .find(|(_, t)| t.elapsed() > limit)
            .map(|(rank, t)| {
                format!(
                    "worker rank {rank} sent nothing for {:.1} s (limit {:.0} s)",
                    t.elapsed().as_secs_f64(),
                    limit.as_secs_f64()
                )
            })
    }

    /// Plans, encodes and sends the next step if the scheduler has one; true if it queued a
    /// plan. A send failure is left for `sent_ok` to report.
    fn plan_and_send(&mut self) -> bool {
        let Some(plan) = self.scheduler.schedule(self.step) else {
            return false;
        };
        self.step += 1;
        self.observe_queue_times(&plan);
        match plan.encode() {
            Ok(bytes) => {
                if let Err(e) = self.sender.broadcast(&bytes) {
                    self.send_error = Some(format!("could not send a plan to the workers: {e}"));
                }
                self.outstanding.push_back((plan, None));
            }
            Err(e) => {
                // A plan we cannot encode is a router bug: fail its requests, keep serving. It
                // still takes its turn, so results are committed in step order.
                let result =
                    fail_everything(&plan, &format!("router could not encode the plan: {e}"));
                self.outstanding.push_back((plan, Some(result)));
            }
        }
        true
    }

    fn sent_ok(&mut self) -> Result<(), Exit> {
        match self.send_error.take() {
            Some(reason) => Err(Exit::WorkersGone(reason)),
            None => Ok(()),
        }
    }

    /// Waits for the oldest outstanding step's result and commits it; `Some` when the loop
    /// must stop.
    fn complete_oldest(&mut self) -> Option<Exit> {
        let (plan, ready) = self.outstanding.pop_front()?;
        let result = match ready {
            Some(r) => r,
            None => match self.await_result(&plan) {
                Ok(r) => r,
                Err(exit) => return Some(exit),
            },
        };
        self.finish_step(&plan, result);
        self.send_late_masks();
        None
    }

    /// Once a step is committed, the masks of the next plan's `mask_late` rows (their grammars
    /// have now seen the tokens they sampled) go to rank 0, which waits for them before that
    /// step's sampling. Sent before anything else goes to rank 0, so they precede the next plan.
    fn send_late_masks(&mut self) {
        let Some((next, None)) = self.outstanding.front() else {
            return;
        };
        let Some(masks) = self.scheduler.late_masks(next) else {
            return;
        };
        let sent = encode_router_message(&RouterMessage::Masks(masks))
            .map_err(|e| e.to_string())
            .and_then(|bytes| self.sender.send_to_rank0(&bytes).map_err(|e| e.to_string()));
        if let Err(e) = sent {
            self.send_error = Some(format!("could not send late masks to rank 0: {e}"));
        }
    }

    /// Waits for rank 0's answer to `plan`, handling everything else that arrives meanwhile.
    fn await_result(&mut self, plan: &BatchPlan) -> Result<StepResult, Exit> {
        loop {
            if let Some(r) = self.early_results.pop_front() {
                return Ok(r);
            }
            match self.inputs.recv_timeout(Duration::from_millis(500)) {
                Ok(Input::Worker(WorkerMessage::Result(r))) => {
                    self.seen(0);
                    return Ok(r);
                }
                Ok(other) => {
                    if let Some(exit) = self.handle(other) {
                        return Err(exit);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(Exit::Shutdown),
            }
            if let Some(reason) = self.silent_rank() {
                return Err(Exit::WorkersGone(format!(
                    "{reason} during step {}",
                    plan.step
                )));
            }
        }
    }

    fn finish_step(&mut self, plan: &BatchPlan, mut result: StepResult) {
        complete_result(plan, &mut result);
        self.shared.observe_step(plan);
        for (id, event) in self.scheduler.on_result(plan, &result) {
            let done = matches!(
                event,
                GenerateEvent::Finished { .. } | GenerateEvent::Failed { .. }
            );
            if let Some(tx) = self.streams.get(&id) {
                // A send error means the client went away; its abort is already queued.
                let _ = tx.send(event);
            }
            if done {
                self.streams.remove(&id);
                self.queued_since.remove(&id);
            }
        }
    }

    /// Each request's first plan ends its wait in the queue (a preempted request's later
    /// re-admission does not count again).
    fn observe_queue_times(&mut self, plan: &BatchPlan) {
        if self.queued_since.is_empty() {
            return;
        }
        let now = Instant::now();
        for r in &plan.requests {
            if let Some(since) = self.queued_since.remove(&r.id) {
                self.shared
                    .metrics
                    .observe_queue_time(now.duration_since(since).as_secs_f64());
            }
        }
    }

    fn publish_stats(&self) {
        self.shared.set_scheduler_stats(&self.scheduler.stats());
    }

    fn stop(mut self, exit: Exit) -> Exit {
        let message = match &exit {
            Exit::Shutdown => "the server is shutting down".to_string(),
            Exit::WorkersGone(reason) => reason.clone(),
        };
        self.shared.healthy.store(false, Ordering::SeqCst);
        for (id, event) in self.scheduler.fail_all(&message) {
            if let Some(tx) = self.streams.get(&id) {
                let _ = tx.send(event);
            }
        }
        self.streams.clear();
        self.publish_stats();
        self.sender.shutdown_all();
        exit
    }
}

/// A worker must answer every request of the plan that samples: with a token or an error.
/// Whatever it left out (an unreadable plan, a worker bug) becomes an error here, so no request
/// ever waits for a token that will not come.
fn complete_result(plan: &BatchPlan, result: &mut StepResult) {
    if result.step != plan.step {
        // The worker could not read the plan (it answers step 0; steps start at 1): nothing of
        // it ran, not even prompt chunks that sample nothing.
        *result = fail_everything(plan, "the worker could not read this step's plan");
        return;
    }
    let answered: std::collections::HashSet<u64> = result
        .sampled
        .iter()
        .map(|s| s.0)
        .chain(result.errors.iter().map(|e| e.0))
        .collect();
    for r in &plan.requests {
        if r.sample && !answered.contains(&r.id) {
            result
                .errors
                .push((r.id, "the worker returned no token for this request".into()));
        }
    }
}

fn fail_everything(plan: &BatchPlan, message: &str) -> StepResult {
    StepResult {
        step: plan.step,
        errors: plan
            .requests
            .iter()
            .map(|r| (r.id, message.to_string()))
            .collect(),
        ..Default::default()
    }
}
