//! Priority scheduling (`--enable-priority-scheduling`, SGLang's semantics): requests carry a
//! `priority`; the more urgent go first, arrival order breaks ties.
//!
//! - The waiting queue is kept in (urgency, arrival) order, so admission takes the most urgent
//!   request first; a preempted request goes back to its own place in that order.
//! - The running list is kept in the same order, so preemption for pages (which takes from the
//!   back) takes the least urgent, newest request, and a request is only ever preempted for one
//!   ahead of it (as in first-come-first-served, where the order is admission).
//! - A waiting request that cannot be admitted (the batch is full or its first step's pages are
//!   short) preempts running requests that are less urgent by at least the threshold. A victim
//!   with a step in flight cannot give its pages back yet: it is marked, not planned again, and
//!   preempted at the next step, once that step's result is committed.
//!
//! Without the flag none of this runs: the queue is first come, first served and `priority` is
//! ignored, as in SGLang.

use super::Scheduler;

impl Scheduler {
    /// The order key of a request under priority scheduling: smaller goes first.
    fn priority_key(&self, slot: usize) -> (i64, u64) {
        let r = self.req(slot);
        let urgency = self.cfg.priority.map_or(0, |p| p.urgency(r.priority));
        (-urgency, r.arrival)
    }

    fn urgency(&self, slot: usize) -> i64 {
        -self.priority_key(slot).0
    }

    /// Queues a new (`preempted` false) or preempted request for admission.
    pub(super) fn enqueue_waiting(&mut self, slot: usize, preempted: bool) {
        let at = match self.cfg.priority {
            // First come, first served: a preempted request is older than every waiting one.
            None if preempted => 0,
            None => self.waiting.len(),
            Some(_) => self.waiting.partition_point(self.goes_before(slot)),
        };
        self.waiting.insert(at, slot);
    }

    /// Adds an admitted request to the running list (after the older ones, or in priority
    /// order).
    pub(super) fn insert_running(&mut self, slot: usize) {
        let at = match self.cfg.priority {
            None => self.running.len(),
            Some(_) => self.running.partition_point(self.goes_before(slot)),
        };
        self.running.insert(at, slot);
    }

    /// Whether a listed request stays ahead of `slot` in the priority order.
    fn goes_before(&self, slot: usize) -> impl Fn(&usize) -> bool + '_ {
        let key = self.priority_key(slot);
        move |&s| self.priority_key(s) <= key
    }

    /// Before a step is planned: preempts the running requests marked at the previous step
    /// (their step is back now), then marks or preempts less urgent running requests for the
    /// waiting ones that cannot be admitted. Returns the highest urgency among this step's
    /// victims: once a request they made room for is admitted, admission stops before that
    /// urgency, so no victim comes straight back. (If none is admitted, say the one they were
    /// preempted for was aborted meanwhile, the victims are admitted as any request.)
    pub(super) fn preempt_for_priority(&mut self) -> Option<i64> {
        let policy = self.cfg.priority?;
        let mut victims_max: Option<i64> = None;
        let mut note_victim = |urgency: i64| {
            victims_max = Some(victims_max.map_or(urgency, |m: i64| m.max(urgency)));
        };
        let mut j = self.running.len();
        while j > 0 {
            j -= 1;
            let r = self.req(self.running[j]);
            if r.preempt_requested && r.in_flight == 0 && r.retiring.is_none() {
                note_victim(self.urgency(self.running[j]));
                self.preempt(j);
            }
        }

        let marked = |s: &Self, slot: usize| s.req(slot).preempt_requested;
        let leaving = self.running.iter().filter(|&&s| marked(self, s)).count();
        let mut free_rows =
            (self.cfg.max_running_requests + leaving).saturating_sub(self.running.len());
        // Admission keeps a page per running request free (`admit`'s headroom): one page per
        // running request is spoken for, and each admitted one adds its own.
        let mut free_pages = (self.alloc.free_count() + self.alloc.idle_cached_count()) as i64
            - self.running.len() as i64;
        let mut budget = self.cfg.max_prefill_tokens as i64;
        let mut next_victim = self.running.len();
        // The queue as it is now (victims join it behind these); admission cannot take more
        // than the free rows plus one per running request.
        let queue: Vec<usize> = self
            .waiting
            .iter()
            .take(free_rows + self.running.len())
            .copied()
            .collect();
        for slot in queue {
            // Requests past this step's prefill budget are not admitted now whatever is freed.
            if budget <= 0 {
                break;
            }
            let urgency = self.urgency(slot);
            let (tokens, pages) = self.first_step(slot);
            while free_rows == 0 || free_pages < pages as i64 {
                // The least urgent running request not already leaving or marked.
                let victim = (0..next_victim).rev().find(|&j| {
                    let r = self.req(self.running[j]);
                    r.retiring.is_none() && !r.preempt_requested
                });
                let Some(v) = victim else {
                    return victims_max;
                };
                next_victim = v;
                let vslot = self.running[v];
                let v_urgency = self.urgency(vslot);
                // Only a request after it in the order: preemption then only ever goes one
                // way, so two requests never take turns preempting each other (with a
                // threshold of 0 an older request of equal priority may preempt a newer one).
                let after = self.priority_key(vslot) > self.priority_key(slot);
                if !after || urgency - v_urgency < policy.preemption_threshold as i64 {
                    return victims_max;
                }
                note_victim(v_urgency);
                free_rows += 1;
                // Its pages (shared prefix pages free nothing; close enough) and its headroom.
                free_pages += self.req(vslot).pages.len() as i64 + 1;
                if self.req(vslot).in_flight == 0 {
                    self.preempt(v);
                } else {
                    self.slots[vslot]
                        .as_mut()
                        .expect("live request slot")
                        .preempt_requested = true;
                }
            }
            free_rows -= 1;
            free_pages -= pages as i64 + 1;
            budget -= tokens as i64;
        }
        victims_max
    }

    /// A waiting request's first step: its prompt tokens, and the pages they take beyond what
    /// the radix cache gives it.
    fn first_step(&self, slot: usize) -> (usize, usize) {
        let ps = self.cfg.page_size as usize;
        let r = self.req(slot);
        let cached =
            self.radix
                .peek_prefix(&r.tokens, r.cache_salt.as_deref(), self.cacheable_pages(r));
        // As `admit` takes it, with the whole budget and nothing prefilled yet.
        let first = self.prefill_take(
            r.tokens.len() - cached * ps,
            self.cfg.max_prefill_tokens,
            false,
        );
        (first, self.pages_for(cached * ps + first) - cached)
    }

    /// Whether this step's victims were preempted for `slot` (it is more urgent than all).
    pub(super) fn outranks_victims(&self, slot: usize, victims_max: Option<i64>) -> bool {
        victims_max.is_some_and(|m| self.urgency(slot) > m)
    }
}
