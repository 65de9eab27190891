//! Data-parallel attention: one [`Scheduler`] per rank behind the interface of one.
//!
//! With `--enable-dp-attention` every worker rank keeps its own KV pool of `P` pages and runs
//! attention only for its own requests. Each rank here is a whole scheduler (allocator, radix
//! cache, waiting and running lists) over local pages `0..P`; the plan speaks of global pages,
//! rank `r` owning `[r*P, (r+1)*P)`, so a worker tells its requests by their pages.
//!
//! - Admission: a new request goes to the rank holding its longest cached prefix; ties (and no
//!   match) to the rank with the fewest running + waiting requests, then the most free pages
//!   (free or reclaimable from the cache, as /metrics counts them), then the lowest rank. It
//!   stays there (preemption requeues it on the same rank).
//! - Limits: `max_running_requests` and `max_prefill_tokens` are global; each rank gets
//!   `ceil(limit / N)`. `max_waiting` is checked on the total.
//! - A step is every rank's plan for it, concatenated in rank order, with page ids, out slots
//!   and overlap references (`input_prev_row`, a row of the previous step's combined plan)
//!   moved to global numbering. No plan when every rank is idle.
//! - A result is committed rank by rank, each rank taking its own requests' entries.
//!
//! With one rank every call goes straight to that rank's scheduler: the same plans, events and
//! statistics as a plain [`Scheduler`].

use crate::engine::{GenerateEvent, GenerateRequest, RequestId, SubmitError};
use crate::protocol::{BatchPlan, LateMasks, PlannedRequest, StepResult};

use super::results::ResultIndex;
use super::{Scheduler, SchedulerConfig, SchedulerStats};

pub struct DataParallelScheduler {
    /// The global view: `num_pages` is every rank's pages together, limits are global.
    cfg: SchedulerConfig,
    ranks: Vec<Scheduler>,
    /// Pages per rank (`P`).
    rank_pages: u32,
    /// Where each rank's rows start in the last plan returned: a request referencing its row
    /// there (overlap) is planned in the next step, and that plan is always the last returned.
    prev_row_start: Vec<usize>,
}

impl DataParallelScheduler {
    /// `cfg` is global: `num_pages` is the pages of all `dp_size` ranks together (a multiple of
    /// `dp_size`). `dp_size` 1 is a plain scheduler.
    pub fn new(cfg: SchedulerConfig, dp_size: usize) -> Self {
        assert!(dp_size > 0, "dp_size must be positive");
        assert!(
            (cfg.num_pages as usize).is_multiple_of(dp_size),
            "{} pages do not split over {dp_size} ranks",
            cfg.num_pages
        );
        assert!(
            (cfg.num_pages as u64) * (cfg.page_size as u64) <= i32::MAX as u64,
            "num_pages * page_size must fit the plan's i32 slot ids"
        );
        let rank_pages = cfg.num_pages / dp_size as u32;
        let rank_cfg = SchedulerConfig {
            num_pages: rank_pages,
            max_running_requests: cfg.max_running_requests.div_ceil(dp_size),
            max_prefill_tokens: cfg.max_prefill_tokens.div_ceil(dp_size),
            ..cfg.clone()
        };
        Self {
            ranks: (0..dp_size)
                .map(|_| Scheduler::new(rank_cfg.clone()))
                .collect(),
            rank_pages,
            prev_row_start: vec![0; dp_size],
            cfg,
        }
    }

    /// The global configuration (all ranks' pages, global limits).
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn dp_size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s own scheduler (local page ids, per-rank limits).
    pub fn rank(&self, r: usize) -> &Scheduler {
        &self.ranks[r]
    }

    /// The rank holding request `id`, if any does.
    pub fn rank_of(&self, id: RequestId) -> Option<usize> {
        self.ranks.iter().position(|s| s.contains(id))
    }

    /// Queues a request on the rank the admission rule picks. Errors as [`Scheduler::submit`].
    pub fn submit(&mut self, id: RequestId, req: GenerateRequest) -> Result<(), SubmitError> {
        if self.ranks.len() == 1 {
            return self.ranks[0].submit(id, req);
        }
        self.ranks[0].check_request(&req)?;
        if self.rank_of(id).is_some() {
            return Err(SubmitError::Invalid(format!(
                "request id {id} is already in use"
            )));
        }
        let waiting: usize = self.ranks.iter().map(|s| s.stats().waiting).sum();
        if waiting >= self.cfg.max_waiting {
            return Err(SubmitError::Overloaded(format!(
                "{waiting} requests are waiting"
            )));
        }
        let r = self.pick_rank(&req);
        self.ranks[r].submit(id, req)
    }

    /// The admission rule: longest cached prefix, then fewest running + waiting requests, then
    /// most free pages, then lowest rank.
    fn pick_rank(&self, req: &GenerateRequest) -> usize {
        let key = |r: usize| {
            let s = &self.ranks[r];
            let st = s.stats();
            (
                s.cached_prefix_pages(req),
                std::cmp::Reverse(st.running + st.waiting),
                st.pages_free + st.pages_cached,
                std::cmp::Reverse(r),
            )
        };
        (0..self.ranks.len())
            .max_by_key(|&r| key(r))
            .expect("at least one rank")
    }

    /// Aborts a request on whichever rank holds it (see [`Scheduler::abort`]).
    pub fn abort(&mut self, id: RequestId) -> bool {
        match self.rank_of(id) {
            Some(r) => self.ranks[r].abort(id),
            None => false,
        }
    }

    /// The workers died: every rank fails its requests and empties its pool.
    pub fn fail_all(&mut self, message: &str) -> Vec<(RequestId, GenerateEvent)> {
        self.prev_row_start.fill(0);
        self.ranks
            .iter_mut()
            .flat_map(|s| s.fail_all(message))
            .collect()
    }

    /// Every rank's statistics summed (`pages_total` is all ranks' pages).
    pub fn stats(&self) -> SchedulerStats {
        if self.ranks.len() == 1 {
            return self.ranks[0].stats();
        }
        let mut t = SchedulerStats::default();
        for s in &self.ranks {
            let st = s.stats();
            t.waiting += st.waiting;
            t.running += st.running;
            t.pages_total += st.pages_total;
            t.pages_free += st.pages_free;
            t.pages_cached += st.pages_cached;
            t.pages_in_use += st.pages_in_use;
            t.prefix_hit_tokens_total += st.prefix_hit_tokens_total;
            t.prompt_tokens_total += st.prompt_tokens_total;
            t.last_batch_size += st.last_batch_size;
            t.preemptions_total += st.preemptions_total;
            t.requests.submitted += st.requests.submitted;
            t.requests.finished += st.requests.finished;
            t.requests.aborted += st.requests.aborted;
            t.requests.failed += st.requests.failed;
        }
        t
    }

    /// Every rank's invariants.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (r, s) in self.ranks.iter().enumerate() {
            s.check_invariants().map_err(|e| format!("rank {r}: {e}"))?;
        }
        Ok(())
    }

    /// Plans step `step` on every rank and combines the plans; `None` when no rank has
    /// anything to run.
    pub fn schedule(&mut self, step: u64) -> Option<BatchPlan> {
        if self.ranks.len() == 1 {
            return self.ranks[0].schedule(step);
        }
        let mut requests: Vec<PlannedRequest> = Vec::new();
        let mut released: Vec<u64> = Vec::new();
        let mut row_start = vec![0; self.ranks.len()];
        for (r, s) in self.ranks.iter_mut().enumerate() {
            row_start[r] = requests.len();
            let Some(plan) = s.schedule(step) else {
                continue;
            };
            let page_base = r as i32 * self.rank_pages as i32;
            let slot_base = page_base * self.cfg.page_size as i32;
            let row_base = self.prev_row_start[r] as i32;
            released.extend(plan.released);
            requests.extend(plan.requests.into_iter().map(|mut pr| {
                pr.pages.iter_mut().for_each(|p| *p += page_base);
                pr.out_slots.iter_mut().for_each(|s| *s += slot_base);
                if pr.input_prev_row >= 0 {
                    pr.input_prev_row += row_base;
                }
                pr
            }));
        }
        if requests.is_empty() {
            return None;
        }
        // A rank that planned nothing may still have requests that ended: the workers' rank 0
        // holds their histories whichever rank they ran on.
        for s in self.ranks.iter_mut() {
            released.extend(s.take_released());
        }
        self.prev_row_start = row_start;
        let plan = BatchPlan {
            step,
            page_size: self.cfg.page_size,
            requests,
            released,
        };
        debug_assert!(
            plan.validate(Some(self.cfg.num_pages)).is_ok(),
            "{:?}",
            plan.validate(Some(self.cfg.num_pages))
        );
        Some(plan)
    }

    /// The rank a planned request belongs to: the one owning its pages.
    fn owner(&self, pr: &PlannedRequest) -> Option<usize> {
        match pr.pages.first() {
            Some(&p) if p >= 0 => Some(p as usize / self.rank_pages as usize),
            _ => self.rank_of(pr.id),
        }
    }

    /// Commits the result of a combined plan: each rank applies its own requests' entries.
    pub fn on_result(
        &mut self,
        plan: &BatchPlan,
        result: &StepResult,
    ) -> Vec<(RequestId, GenerateEvent)> {
        if self.ranks.len() == 1 {
            return self.ranks[0].on_result(plan, result);
        }
        let index = ResultIndex::new(result);
        let mut by_rank: Vec<Vec<&PlannedRequest>> = vec![Vec::new(); self.ranks.len()];
        for pr in &plan.requests {
            if let Some(r) = self.owner(pr).filter(|&r| r < self.ranks.len()) {
                by_rank[r].push(pr);
            }
        }
        let mut events = Vec::new();
        for (s, mine) in self.ranks.iter_mut().zip(by_rank) {
            if !mine.is_empty() {
                events.extend(s.commit(mine.into_iter(), &index));
            }
        }
        events
    }

    /// The `masks` message for a plan still in flight, once the step before it is committed:
    /// `None` when the plan has no late row (then none is sent); otherwise every rank's late
    /// masks, possibly none (the worker waits for the message all the same).
    pub fn late_masks(&mut self, plan: &BatchPlan) -> Option<LateMasks> {
        if !plan.requests.iter().any(|pr| pr.mask_late) {
            return None;
        }
        let mut masks = Vec::new();
        if self.ranks.len() == 1 {
            masks = self.ranks[0].late_masks(plan.requests.iter());
        } else {
            let mut by_rank: Vec<Vec<&PlannedRequest>> = vec![Vec::new(); self.ranks.len()];
            for pr in plan.requests.iter().filter(|pr| pr.mask_late) {
                if let Some(r) = self.owner(pr).filter(|&r| r < self.ranks.len()) {
                    by_rank[r].push(pr);
                }
            }
            for (s, mine) in self.ranks.iter_mut().zip(by_rank) {
                masks.extend(s.late_masks(mine.into_iter()));
            }
        }
        Some(LateMasks {
            step: plan.step,
            masks,
        })
    }
}
