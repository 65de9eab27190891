//! The scheduler: KV pages, the radix prefix cache, the waiting queue and the running batch.
//! Every step it builds one complete [`BatchPlan`]; every step result it commits back.
//!
//! It is plain synchronous state (no tokio): the engine loop owns it and calls
//! [`Scheduler::schedule`] and [`Scheduler::on_result`]. Without overlap they alternate. With
//! overlap the engine calls `schedule` for step N+1 while step N is in flight (never with two
//! plans in flight), and results come back in step order. Committed state (`kv_len`, `tokens`)
//! changes only in `on_result`; planning moves a request's planned frontier, and a request
//! that ends while a plan with it is in flight keeps its pages until that plan is back.
//!
//! Files: `allocator` (reference-counted pages), `radix` (prefix cache), `request` (one
//! request's state), `batcher` (building a step: decode, chunked prefill, admission,
//! preemption), `priority` (the orders and preemptions of priority scheduling), `results` (committing a step result into events), `data_parallel` (one
//! scheduler per attention data-parallel rank behind the same interface).

mod allocator;
mod batcher;
mod data_parallel;
mod late_masks;
mod priority;
mod radix;
mod request;
mod results;

use std::collections::{HashMap, VecDeque};

use crate::engine::{GenerateEvent, GenerateRequest, RequestId, SubmitError};

use allocator::{PageAllocator, PageId};
use radix::RadixCache;
use request::{Ending, Request};

pub use crate::protocol::BatchPlan;
pub use data_parallel::DataParallelScheduler;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens per KV page.
    pub page_size: u32,
    /// Pages in the workers' KV pool (from their hello).
    pub num_pages: u32,
    /// Most requests in the running batch at once.
    pub max_running_requests: usize,
    /// Prompt tokens one step may run (decode tokens do not count).
    pub max_prefill_tokens: usize,
    /// Longest prompt chunk; `None` runs every prompt whole.
    pub chunked_prefill_size: Option<usize>,
    pub disable_radix_cache: bool,
    /// Longest sequence (prompt + output) the model supports.
    pub max_context: u32,
    /// Most requests waiting for admission; beyond it `submit` answers `Overloaded`.
    pub max_waiting: usize,
    /// Priority scheduling (`--enable-priority-scheduling`); `None`: first come, first served.
    pub priority: Option<PriorityPolicy>,
}

/// How requests' `priority` values order them (SGLang's priority scheduling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorityPolicy {
    /// Smaller values go first (`--schedule-low-priority-values-first`); by default larger ones.
    pub low_values_first: bool,
    /// A waiting request preempts a running one only when it is at least this much more
    /// urgent (`--priority-scheduling-preemption-threshold`), so near-equal priorities do not
    /// preempt each other back and forth.
    pub preemption_threshold: u32,
}

impl PriorityPolicy {
    /// A request's urgency: larger runs first.
    pub fn urgency(&self, priority: i32) -> i64 {
        if self.low_values_first {
            -(priority as i64)
        } else {
            priority as i64
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            page_size: 64,
            num_pages: 0,
            max_running_requests: 256,
            max_prefill_tokens: 8192,
            chunked_prefill_size: Some(8192),
            disable_radix_cache: false,
            max_context: 131_072,
            max_waiting: 4096,
            priority: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    pub pages_total: usize,
    pub pages_free: usize,
    /// Pages only the radix cache holds (reclaimable by eviction).
    pub pages_cached: usize,
    /// Pages some request holds.
    pub pages_in_use: usize,
    /// Prompt tokens found in the radix cache at first admission, summed.
    pub prefix_hit_tokens_total: u64,
    /// Prompt tokens of admitted requests, summed (first admission only).
    pub prompt_tokens_total: u64,
    /// Requests in the last plan.
    pub last_batch_size: usize,
    pub preemptions_total: u64,
    pub requests: RequestCounts,
}

/// Requests by how they left the scheduler, counted since it was created. Every submitted
/// request is waiting, running, or exactly one of finished, aborted and failed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCounts {
    pub submitted: u64,
    /// Reached a stop token or its length.
    pub finished: u64,
    /// Aborted by the caller (a client that went away, a stop string).
    pub aborted: u64,
    /// Failed by a worker error or by the workers' death.
    pub failed: u64,
}

impl RequestCounts {
    fn count(&mut self, ending: Ending) {
        match ending {
            Ending::Finished => self.finished += 1,
            Ending::Aborted => self.aborted += 1,
            Ending::Failed => self.failed += 1,
        }
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    alloc: PageAllocator,
    radix: RadixCache,
    /// Request storage; running and waiting lists hold indices into it, so building a step
    /// needs no hashing.
    slots: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    index: HashMap<RequestId, usize>,
    /// First come, first served; preempted requests go back to the front. Under priority
    /// scheduling, most urgent first (`priority.rs`).
    waiting: VecDeque<usize>,
    /// In admission order, oldest first; preemption takes from the back. Under priority
    /// scheduling, most urgent first.
    running: Vec<usize>,
    prefix_hit_tokens_total: u64,
    prompt_tokens_total: u64,
    last_batch_size: usize,
    preemptions_total: u64,
    requests: RequestCounts,
    /// Requests that left holding a penalty history on the workers, for the next plan's
    /// `released` (the workers then drop those histories).
    released_histories: Vec<RequestId>,
    /// Failures found while planning (a grammar that cannot go on): the next commit reports
    /// them first. Their requests are retiring and leave once their plan is back.
    planning_failures: Vec<(RequestId, GenerateEvent)>,
}

impl Scheduler {
    /// Panics on a configuration no plan could satisfy (zero page size or budget, or a pool
    /// whose slot ids overflow `i32`): those are startup bugs, not runtime conditions.
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.page_size > 0, "page_size must be positive");
        assert!(
            cfg.max_prefill_tokens > 0,
            "max_prefill_tokens must be positive"
        );
        assert!(
            cfg.max_running_requests > 0,
            "max_running_requests must be positive"
        );
        assert!(
            cfg.chunked_prefill_size != Some(0),
            "chunked_prefill_size must be positive"
        );
        assert!(
            (cfg.num_pages as u64) * (cfg.page_size as u64) <= i32::MAX as u64,
            "num_pages * page_size must fit the plan's i32 slot ids"
        );
        Self {
            alloc: PageAllocator::new(cfg.num_pages),
            radix: RadixCache::new(cfg.page_size, cfg.num_pages),
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix_hit_tokens_total: 0,
            prompt_tokens_total: 0,
            last_batch_size: 0,
            preemptions_total: 0,
            requests: RequestCounts::default(),
            released_histories: Vec::new(),
            planning_failures: Vec::new(),
            cfg,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.page_size as usize)
    }

    /// Queues a request. `Invalid` when it can never run (empty prompt, longer than the
    /// context, more KV than the whole pool, or a reused id); `Overloaded` when the queue is
    /// full.
    pub fn submit(&mut self, id: RequestId, req: GenerateRequest) -> Result<(), SubmitError> {
        self.check_request(&req)?;
        if self.index.contains_key(&id) {
            return Err(SubmitError::Invalid(format!(
                "request id {id} is already in use"
            )));
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(SubmitError::Overloaded(format!(
                "{} requests are waiting",
                self.waiting.len()
            )));
        }
        let slot = self.store(Request::new(id, req, self.requests.submitted));
        self.enqueue_waiting(slot, false);
        self.requests.submitted += 1;
        Ok(())
    }

    /// `Invalid` when a request can never run here: an empty prompt, longer than the context,
    /// or more KV than the whole pool.
    pub(crate) fn check_request(&self, req: &GenerateRequest) -> Result<(), SubmitError> {
        let prompt = req.prompt_ids.len();
        if prompt == 0 {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        let total = prompt as u64 + req.max_new_tokens as u64;
        if total > self.cfg.max_context as u64 {
            return Err(SubmitError::Invalid(format!(
                "prompt ({prompt} tokens) + max_new_tokens ({}) exceeds the context of {} tokens",
                req.max_new_tokens, self.cfg.max_context
            )));
        }
        // The last sampled token is never run, so its KV is never stored.
        let kv_tokens = (prompt + req.max_new_tokens as usize)
            .saturating_sub(1)
            .max(prompt);
        let pages = self.pages_for(kv_tokens);
        if pages > self.cfg.num_pages as usize {
            return Err(SubmitError::Invalid(format!(
                "the request needs {pages} KV pages but the pool has {}",
                self.cfg.num_pages
            )));
        }
        Ok(())
    }

    /// Whether the request is here (waiting, running, or leaving with a plan in flight).
    pub fn contains(&self, id: RequestId) -> bool {
        self.index.contains_key(&id)
    }

    /// Prompt pages the radix cache could give this request at admission now (0 when it
    /// would not use the cache); changes nothing.
    pub fn cached_prefix_pages(&self, req: &GenerateRequest) -> usize {
        if self.cfg.disable_radix_cache || req.prompt_logprobs || req.prompt_ids.is_empty() {
            return 0;
        }
        let ps = self.cfg.page_size as usize;
        self.radix.peek_prefix(
            &req.prompt_ids,
            req.cache_salt.as_deref(),
            (req.prompt_ids.len() - 1) / ps,
        )
    }

    fn store(&mut self, r: Request) -> usize {
        let id = r.id;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(r);
                s
            }
            None => {
                self.slots.push(Some(r));
                self.slots.len() - 1
            }
        };
        self.index.insert(id, slot);
        slot
    }

    /// The requests that left holding a penalty history since the last call, for a plan's
    /// `released` (a plan that goes out carries them; with none to send they wait).
    pub fn take_released(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.released_histories)
    }

    /// Forgets a request (it must already be off the running and waiting lists).
    fn take(&mut self, slot: usize) -> Request {
        let r = self.slots[slot].take().expect("live request slot");
        self.index.remove(&r.id);
        self.free_slots.push(slot);
        if r.history_sent > 0 {
            self.released_histories.push(r.id);
        }
        r
    }

    fn req(&self, slot: usize) -> &Request {
        self.slots[slot].as_ref().expect("live request slot")
    }

    /// Drops a request's page references. With `cache`, its committed full pages are first
    /// indexed in the radix cache so a later request (or its own recompute) can reuse them.
    fn release_pages(&mut self, slot: usize, cache: bool) {
        let ps = self.cfg.page_size as usize;
        let r = self.slots[slot].as_mut().expect("live request slot");
        let mut pages = std::mem::take(&mut r.pages);
        if cache && !self.cfg.disable_radix_cache {
            let full = (r.kv_len / ps).min(pages.len());
            self.radix.insert(
                &r.tokens[..full * ps],
                r.cache_salt.as_deref(),
                &mut pages[..full],
                &mut self.alloc,
            );
        }
        r.kv_len = 0;
        r.planned_len = 0;
        for p in pages {
            self.alloc.release(p);
            self.radix.page_released(p, &self.alloc);
        }
    }

    /// Makes sure `n` pages are free, evicting cached ones if needed.
    fn ensure_free(&mut self, n: usize) -> bool {
        let free = self.alloc.free_count();
        if free < n && !self.cfg.disable_radix_cache {
            self.radix.evict(n - free, &mut self.alloc);
        }
        self.alloc.free_count() >= n
    }

    fn alloc_page(&mut self) -> PageId {
        self.alloc
            .alloc()
            .expect("pages were reserved by ensure_free")
    }

    /// Aborts a waiting or running request; its pages are released now (committed full pages
    /// stay in the radix cache), or, while a plan with it is in flight, when that plan is back.
    /// Returns false when the id is unknown (finished or never submitted) or already leaving.
    /// Emits no event: the caller reports the abort to its client.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(&slot) = self.index.get(&id) else {
            return false;
        };
        let r = self.slots[slot].as_mut().expect("live request slot");
        if r.retiring.is_some() {
            return false;
        }
        if r.in_flight > 0 {
            r.retiring = Some(Ending::Aborted);
            return true;
        }
        if let Some(i) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(i);
            self.release_pages(slot, true);
        } else if let Some(i) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(i);
        }
        self.take(slot);
        self.requests.aborted += 1;
        true
    }

    /// The workers died: every request fails (retryably) and the KV pool, radix cache
    /// included, is empty again.
    pub fn fail_all(&mut self, message: &str) -> Vec<(RequestId, GenerateEvent)> {
        let slots: Vec<usize> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        // Failures found while planning have not been reported yet: their requests are retiring,
        // so the loop below sends nothing more for them.
        let mut events = std::mem::take(&mut self.planning_failures);
        events.reserve(slots.len());
        for slot in slots {
            let ended = self.slots[slot].as_ref().and_then(|r| r.retiring);
            self.release_pages(slot, false);
            let r = self.take(slot);
            if let Some(ending) = ended {
                // It already ended (its last event is out) and only waited for a step in
                // flight: count it as it ended, and send nothing more.
                self.requests.count(ending);
                continue;
            }
            self.requests.failed += 1;
            events.push((
                r.id,
                GenerateEvent::Failed {
                    message: message.to_string(),
                    retryable: true,
                },
            ));
        }
        self.radix.clear(&mut self.alloc);
        // The workers that held those histories are gone.
        self.released_histories.clear();
        events
    }

    pub fn stats(&self) -> SchedulerStats {
        let total = self.alloc.total();
        let free = self.alloc.free_count();
        let cached = self.alloc.idle_cached_count();
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            pages_total: total,
            pages_free: free,
            pages_cached: cached,
            pages_in_use: total - free - cached,
            prefix_hit_tokens_total: self.prefix_hit_tokens_total,
            prompt_tokens_total: self.prompt_tokens_total,
            last_batch_size: self.last_batch_size,
            preemptions_total: self.preemptions_total,
            requests: self.requests,
        }
    }

    /// Checks every internal invariant; for tests and debugging, O(pages + requests).
    /// Page references equal their holders (requests plus the cache), no page is leaked or
    /// free while held, the radix index is consistent, and a page a request may still write
    /// (at or past its committed length) belongs to that request alone.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.alloc.check()?;
        self.radix.check(&self.alloc)?;
        let ps = self.cfg.page_size as usize;
        let mut holders = vec![0u32; self.alloc.total()];
        let mut writer: HashMap<PageId, RequestId> = HashMap::new();
        for &slot in &self.running {
            let r = self.req(slot);
            if r.pages.len() < self.pages_for(r.planned_len) {
                return Err(format!(
                    "request {}: {} pages for {} planned tokens",
                    r.id,
                    r.pages.len(),
                    r.planned_len
                ));
            }
            if r.in_flight == 0
                && (r.planned_len != r.kv_len || r.pending_tokens != 0 || r.retiring.is_some())
            {
                return Err(format!(
                    "request {}: nothing in flight, yet planned {} != committed {} or {} tokens \
                     pending or leaving",
                    r.id, r.planned_len, r.kv_len, r.pending_tokens
                ));
            }
            for (k, &p) in r.pages.iter().enumerate() {
                holders[p as usize] += 1;
                if (k + 1) * ps > r.kv_len {
                    writer.insert(p, r.id);
                }
            }
        }
        for &slot in &self.waiting {
            if !self.req(slot).pages.is_empty() || self.req(slot).in_flight != 0 {
                return Err(format!(
                    "waiting request {} holds pages or is in flight",
                    self.req(slot).id
                ));
            }
        }
        for (p, &h) in holders.iter().enumerate() {
            let expect = h + self.alloc.is_cached(p as PageId) as u32;
            if self.alloc.refs(p as PageId) != expect {
                return Err(format!(
                    "page {p}: {} references for {expect} holders",
                    self.alloc.refs(p as PageId)
                ));
            }
            if h > 1 {
                if let Some(id) = writer.get(&(p as PageId)) {
                    return Err(format!(
                        "page {p} is shared but request {id} may still write it"
                    ));
                }
            }
            if self.alloc.is_cached(p as PageId) && writer.contains_key(&(p as PageId)) {
                return Err(format!(
                    "page {p} is in the radix cache while request {} writes it",
                    writer[&(p as PageId)]
                ));
            }
        }
        if self.index.len() != self.running.len() + self.waiting.len() {
            return Err("request index disagrees with the running and waiting lists".into());
        }
        let c = self.requests;
        if c.submitted != c.finished + c.aborted + c.failed + self.index.len() as u64 {
            return Err(format!(
                "{} submitted requests but {} finished, {} aborted, {} failed and {} live",
                c.submitted,
                c.finished,
                c.aborted,
                c.failed,
                self.index.len()
            ));
        }
        Ok(())
    }
}
