//! Shared test harness for the scheduler tests: a fake executor that keeps a real KV pool
//! (which token each slot holds) and samples from what it reads back through the plan's page
//! table, plus a driver that runs the scheduler against it and checks every plan.
//!
//! Because the executor reads the sequence back from the slots, a wrong page list, a shared
//! page overwritten, or a stale cached prefix changes the sampled tokens, and the outputs no
//! longer match the reference computed straight from the prompt.
//!
//! The executor also resolves overlap references (`input_prev_row`) from what it sampled in
//! the previous step, as the workers do, and `step_overlap` drives the scheduler the way the
//! engine does with overlap on: step N+1 is planned before step N's result is committed.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use nsaserve_router::engine::{FinishReason, GenerateEvent, GenerateRequest, RequestId};
use nsaserve_router::protocol::{
    BatchPlan, PlannedRequest, PromptLogprobs, SamplingParams, StepResult, TokenLogprobs, BAN_BIAS,
};
use nsaserve_router::scheduler::{Scheduler, SchedulerConfig};

pub const VOCAB: u64 = 1000;

/// The fake model: the next token is a hash of the whole sequence so far.
pub fn next_token(seq: &[i32]) -> i32 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &t in seq {
        h = (h ^ t as u64)
            .wrapping_mul(0x1000_0000_01b3)
            .rotate_left(17);
    }
    (h % VOCAB) as i32
}

/// The fake model's pick: `next_token`, or the next id up that is not banned (as a sampler
/// gives a banned token no probability).
pub fn sample_token(seq: &[i32], banned: impl Fn(i32) -> bool) -> i32 {
    let mut t = next_token(seq);
    while banned(t) {
        t = (t + 1) % VOCAB as i32;
    }
    t
}

/// Whether an allowed-token mask (bit `t % 32` of word `t / 32`) allows token `t`.
pub fn mask_allows(words: &[u32], t: i32) -> bool {
    let t = t as usize;
    words.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// What a correct engine generates for a request: tokens until a stop token or the limit.
pub fn reference(req: &GenerateRequest, max_context: u32) -> (Vec<i32>, FinishReason) {
    let mut seq = req.prompt_ids.clone();
    let mut out = Vec::new();
    while out.len() < req.max_new_tokens as usize {
        // Before min_new_tokens the stop tokens are banned.
        let early = out.len() < req.min_new_tokens as usize;
        let t = sample_token(&seq, |t| early && req.stop_token_ids.contains(&t));
        seq.push(t);
        out.push(t);
        if req.stop_token_ids.contains(&t) {
            return (out, FinishReason::Stop);
        }
        if seq.len() >= max_context as usize {
            break;
        }
    }
    (out, FinishReason::Length)
}

/// Executes plans against a KV pool of `(token, position)` per slot.
pub struct FakeExecutor {
    kv: Vec<Option<(i32, i32)>>,
    /// Requests to fail with an error at their next step.
    pub fail_next: HashSet<u64>,
    /// Requests whose allowed-token masks it ignores (a sampler that breaks the grammar).
    pub ignore_masks: HashSet<u64>,
    /// (request id, sampled token) of each row of the previous plan, and its step.
    prev: Vec<(u64, Option<i32>)>,
    prev_step: Option<u64>,
}

impl FakeExecutor {
    pub fn new(cfg: &SchedulerConfig) -> Self {
        Self {
            kv: vec![None; (cfg.num_pages * cfg.page_size) as usize],
            fail_next: HashSet::new(),
            ignore_masks: HashSet::new(),
            prev: Vec::new(),
            prev_step: None,
        }
    }

    /// The workers restarted: nothing of the previous step is remembered.
    pub fn forget_previous_step(&mut self) {
        self.prev.clear();
        self.prev_step = None;
    }

    /// The input tokens of a planned request, a reference filled in from the previous step;
    /// `None` when the reference is not to a token that step sampled for this request.
    fn inputs(&self, plan: &BatchPlan, r: &PlannedRequest) -> Option<Vec<i32>> {
        if r.input_prev_row < 0 {
            return Some(r.input_ids.clone());
        }
        match self.prev.get(r.input_prev_row as usize) {
            Some(&(id, Some(t))) if id == r.id && self.prev_step? + 1 == plan.step => Some(vec![t]),
            _ => None,
        }
    }

    pub fn run(&mut self, plan: &BatchPlan) -> StepResult {
        let ps = plan.page_size as i32;
        let mut result = StepResult {
            step: plan.step,
            ..Default::default()
        };
        let mut rows: Vec<(u64, Option<i32>)> =
            plan.requests.iter().map(|r| (r.id, None)).collect();
        let mut bad = HashSet::new();
        // A step writes all its new KV, then every request attends over its page table.
        for r in &plan.requests {
            let Some(inputs) = self.inputs(plan, r) else {
                result
                    .errors
                    .push((r.id, "input_prev_row names no token it sampled".into()));
                bad.insert(r.id);
                continue;
            };
            for (k, (&tok, &slot)) in inputs.iter().zip(&r.out_slots).enumerate() {
                self.kv[slot as usize] = Some((tok, r.cached_len + k as i32));
            }
        }
        for (row, r) in plan.requests.iter().enumerate() {
            if bad.contains(&r.id) {
                continue;
            }
            if self.fail_next.remove(&r.id) {
                result.errors.push((r.id, "injected failure".into()));
                continue;
            }
            let seq: Vec<i32> = (0..r.seq_len())
                .map(|pos| {
                    let slot = r.pages[(pos / ps) as usize] * ps + pos % ps;
                    let (tok, p) = self.kv[slot as usize].unwrap_or_else(|| {
                        panic!(
                            "request {}: slot {slot} (position {pos}) never written",
                            r.id
                        )
                    });
                    assert_eq!(
                        p, pos,
                        "request {}: slot {slot} holds position {p}, read as {pos}",
                        r.id
                    );
                    tok
                })
                .collect();
            if r.prompt_logprobs {
                let first = r.cached_len.max(1);
                let tokens: Vec<i32> = seq[first as usize..].to_vec();
                let entries = (first..r.seq_len())
                    .map(|p| TokenLogprobs {
                        logprob: -(p as f32),
                        top: vec![],
                    })
                    .collect();
                result.prompt_logprobs.push(PromptLogprobs {
                    req_id: r.id,
                    first_pos: first,
                    tokens,
                    entries,
                });
            }
            if r.sample {
                let lp = r.sampling.top_logprobs.map(|_| TokenLogprobs {
                    logprob: -0.5,
                    top: vec![],
                });
                let bans = &r.sampling.logit_bias;
                let mask = r
                    .allowed_tokens
                    .as_ref()
                    .filter(|_| !self.ignore_masks.contains(&r.id));
                let t = sample_token(&seq, |t| {
                    bans.iter().any(|&(id, b)| id == t && b == BAN_BIAS)
                        || mask.is_some_and(|m| !mask_allows(m, t))
                });
                rows[row].1 = Some(t);
                result.sampled.push((r.id, t, lp));
            }
        }
        self.prev = rows;
        self.prev_step = Some(plan.step);
        result
    }
}

/// Everything one request produced.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub tokens: Vec<i32>,
    pub finish: Option<(FinishReason, u32, u32, u32)>,
    pub failed: Option<(String, bool)>,
    /// Prompt positions whose logprobs arrived, in arrival order.
    pub prompt_lp_positions: Vec<i32>,
}

/// Checks a plan against the rules and against aliasing: a page a request writes this step
/// appears in no other request's page list.
pub fn check_plan(plan: &BatchPlan, num_pages: u32) {
    plan.validate(Some(num_pages)).expect("plan is valid");
    let ps = plan.page_size as i32;
    let mut owner: HashMap<i32, u64> = HashMap::new();
    for r in &plan.requests {
        for &s in &r.out_slots {
            owner.insert(s / ps, r.id);
        }
    }
    for r in &plan.requests {
        for p in &r.pages {
            if let Some(&w) = owner.get(p) {
                assert_eq!(
                    w, r.id,
                    "page {p} written by request {w} is also in request {}'s page table",
                    r.id
                );
            }
        }
        let mut seen = HashSet::new();
        assert!(
            r.pages.iter().all(|p| seen.insert(*p)),
            "request {} lists a page twice",
            r.id
        );
    }
}

pub fn record(outcomes: &mut HashMap<RequestId, Outcome>, events: Vec<(RequestId, GenerateEvent)>) {
    for (id, ev) in events {
        let o = outcomes.entry(id).or_default();
        assert!(
            o.finish.is_none() && o.failed.is_none(),
            "request {id}: event after the last one"
        );
        match ev {
            GenerateEvent::Token { id: t, .. } => o.tokens.push(t),
            GenerateEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => o.finish = Some((reason, prompt_tokens, completion_tokens, cached_tokens)),
            GenerateEvent::Failed { message, retryable } => o.failed = Some((message, retryable)),
            // Only a structured output that can no longer be met is refused mid-generation.
            GenerateEvent::Refused(e) => o.failed = Some((format!("refused: {e}"), false)),
            GenerateEvent::PromptLogprobs(p) => {
                assert!(
                    o.tokens.is_empty(),
                    "request {id}: prompt logprobs after a token"
                );
                assert_eq!(p.tokens.len(), p.entries.len());
                o.prompt_lp_positions
                    .extend(p.first_pos..p.first_pos + p.entries.len() as i32);
            }
        }
    }
}

/// One scheduler step against the executor, with every check on. Returns false when the
/// scheduler had nothing to run.
pub fn step(
    sched: &mut Scheduler,
    exec: &mut FakeExecutor,
    step: u64,
    outcomes: &mut HashMap<RequestId, Outcome>,
) -> bool {
    let Some(plan) = sched.schedule(step) else {
        sched.check_invariants().expect("invariants");
        return false;
    };
    check_plan(&plan, sched.config().num_pages);
    sched.check_invariants().expect("invariants after schedule");
    let result = exec.run(&plan);
    let events = sched.on_result(&plan, &result);
    record(outcomes, events);
    sched.check_invariants().expect("invariants after result");
    true
}

/// One engine iteration with overlap on: plan the next step while `in_flight` (the previous
/// one, if any) has not been committed, then commit `in_flight`; the new plan becomes the one
/// in flight. Checks that the new plan reuses no page the step in flight writes for another
/// request (a page freed too early). Returns false when nothing was planned or committed.
pub fn step_overlap(
    sched: &mut Scheduler,
    exec: &mut FakeExecutor,
    step: u64,
    outcomes: &mut HashMap<RequestId, Outcome>,
    in_flight: &mut Option<BatchPlan>,
) -> bool {
    let next = sched.schedule(step);
    sched.check_invariants().expect("invariants after schedule");
    if let Some(plan) = &next {
        check_plan(plan, sched.config().num_pages);
        if let Some(prev) = in_flight.as_ref() {
            check_no_reuse_in_flight(prev, plan);
        }
    }
    let had = in_flight.is_some();
    let mut next = next;
    if let Some(prev) = in_flight.take() {
        let result = exec.run(&prev);
        record(outcomes, sched.on_result(&prev, &result));
        sched.check_invariants().expect("invariants after result");
        if let Some(plan) = next.as_mut() {
            merge_late_masks(sched, plan);
        }
    }
    *in_flight = next;
    had || in_flight.is_some()
}

/// What the engine and rank 0 do once the step before `plan` is committed: the scheduler's late
/// masks go into `plan`'s `mask_late` rows (a row they leave out samples unmasked).
pub fn merge_late_masks(sched: &mut Scheduler, plan: &mut BatchPlan) {
    let masks: HashMap<u64, Vec<u32>> =
        sched.late_masks(plan.requests.iter()).into_iter().collect();
    for r in plan.requests.iter_mut().filter(|r| r.mask_late) {
        r.mask_late = false;
        r.allowed_tokens = masks.get(&r.id).cloned().map(Arc::new);
    }
}

/// Drives a scheduler the way the engine does, with overlap on or off.
pub struct Driver {
    pub overlap: bool,
    in_flight: Option<BatchPlan>,
    /// Planned requests whose input was a reference to the step in flight.
    pub references: u64,
}

impl Driver {
    pub fn new(overlap: bool) -> Self {
        Self {
            overlap,
            in_flight: None,
            references: 0,
        }
    }

    /// One engine iteration; false when there was nothing to plan or commit.
    pub fn step(
        &mut self,
        sched: &mut Scheduler,
        exec: &mut FakeExecutor,
        n: u64,
        outcomes: &mut HashMap<RequestId, Outcome>,
    ) -> bool {
        if self.overlap {
            let progress = step_overlap(sched, exec, n, outcomes, &mut self.in_flight);
            if let Some(p) = &self.in_flight {
                self.references +=
                    p.requests.iter().filter(|r| r.input_prev_row >= 0).count() as u64;
            }
            progress
        } else {
            step(sched, exec, n, outcomes)
        }
    }

    /// Whether a step is in flight (its result not committed yet).
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The workers died: the step in flight never comes back, and they forget it.
    pub fn workers_died(&mut self, exec: &mut FakeExecutor) {
        self.in_flight = None;
        exec.forget_previous_step();
    }
}

/// A page step N writes for one request appears in no other request of step N+1.
pub fn check_no_reuse_in_flight(in_flight: &BatchPlan, next: &BatchPlan) {
    let ps = in_flight.page_size as i32;
    let mut writer: HashMap<i32, u64> = HashMap::new();
    for r in &in_flight.requests {
        for &s in &r.out_slots {
            writer.insert(s / ps, r.id);
        }
    }
    for r in &next.requests {
        for p in &r.pages {
            if let Some(&w) = writer.get(p) {
                assert_eq!(
                    w, r.id,
                    "page {p}, written by request {w} in step {}, is given to request {} in step {}",
                    in_flight.step, r.id, next.step
                );
            }
        }
    }
}

/// Asserts that every finished request produced exactly its reference output.
pub fn check_outcome(id: RequestId, req: &GenerateRequest, o: &Outcome, max_context: u32) {
    let (want, reason) = reference(req, max_context);
    let (got_reason, prompt_tokens, completion_tokens, _) = o.finish.expect("finished");
    assert_eq!(
        o.tokens, want,
        "request {id}: output differs from the reference"
    );
    assert_eq!(got_reason, reason, "request {id}: finish reason");
    assert_eq!(
        prompt_tokens as usize,
        req.prompt_ids.len(),
        "request {id}: prompt_tokens"
    );
    assert_eq!(
        completion_tokens as usize,
        want.len(),
        "request {id}: completion_tokens"
    );
    if req.prompt_logprobs {
        let all: Vec<i32> = (1..req.prompt_ids.len() as i32).collect();
        assert_eq!(
            o.prompt_lp_positions, all,
            "request {id}: prompt logprobs positions"
        );
    } else {
        assert!(o.prompt_lp_positions.is_empty());
    }
}

pub fn request(prompt: Vec<i32>, max_new_tokens: u32, stop: Vec<i32>) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        sampling: SamplingParams::default(),
        max_new_tokens,
        min_new_tokens: 0,
        stop_token_ids: stop,
        prompt_logprobs: false,
        allowed_tokens: None,
        constraint: None,
        priority: 0,
        cache_salt: None,
    }
}

pub fn config(page_size: u32, num_pages: u32) -> SchedulerConfig {
    SchedulerConfig {
        page_size,
        num_pages,
        max_running_requests: 64,
        max_prefill_tokens: 256,
        chunked_prefill_size: Some(128),
        disable_radix_cache: false,
        max_context: 4096,
        max_waiting: 100_000,
        priority: None,
    }
}

/// Small deterministic PRNG so the simulation needs no extra dependency and is reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What rank 0 holds as penalty histories, rebuilt from plans as the worker does
/// (worker/penalty_history.py): `released` drops, a reset replaces, anything else extends.
#[derive(Default)]
pub struct HeldHistories(pub HashMap<u64, Vec<i32>>);

impl HeldHistories {
    pub fn apply(&mut self, plan: &BatchPlan) {
        for id in &plan.released {
            assert!(
                self.0.remove(id).is_some(),
                "request {id} released but not held"
            );
        }
        for r in &plan.requests {
            if r.history_reset {
                self.0.insert(r.id, r.history.clone());
            } else if !r.history.is_empty() {
                self.0
                    .get_mut(&r.id)
                    .expect("a history extended without a reset first")
                    .extend(&r.history);
            }
        }
    }
}
