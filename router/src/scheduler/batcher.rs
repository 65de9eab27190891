//! Building one step: continue every running request (decode or next prompt chunk), then admit
//! waiting requests first come, first served (or most urgent first, `priority.rs`) into what is
//! left of the prefill budget.
//!
//! Pages are taken as each request's step is planned. When they run out (after evicting the
//! radix cache's idle pages), the most recently admitted running requests are preempted until
//! the older one being planned fits. Running requests are planned oldest first, so a victim is
//! never a request already in this plan, and the oldest request can always take the whole pool
//! (submit rejects anything larger): some request always progresses.
//!
//! Overlap: the engine may plan step N+1 while step N is in flight. A request in N is then
//! planned past N (from its `planned_len`): its next prompt chunk, or, when N samples its next
//! input, one token referencing its row of N (`input_prev_row`), which the workers fill in from
//! what they sampled. Requests in flight are never preempted (their pages are being written),
//! and a request whose N may end it for length is not planned ahead.

use std::sync::Arc;

use rayon::prelude::*;

use crate::engine::{GenerateEvent, SubmitError};
use crate::protocol::{BatchPlan, PlannedRequest};

use super::request::{Ending, Request};
use super::Scheduler;

/// A request's mask for a step: `None` for every token; `Err` when its grammar cannot go on.
type MaskOutcome = Result<Option<Vec<u32>>, String>;

/// How many tokens a step may run for a request, and the pages that requires.
struct Take {
    tokens: usize,
    new_pages: usize,
}

impl Scheduler {
    /// Plans the next step; `None` when no request can run.
    pub fn schedule(&mut self, step: u64) -> Option<BatchPlan> {
        let mut plan = BatchPlan {
            step,
            page_size: self.cfg.page_size,
            requests: Vec::with_capacity(self.running.len()),
            released: Vec::new(),
        };
        let mut budget = self.cfg.max_prefill_tokens;
        let mut prefilled = false;
        // (row, slot) of every row that samples under a grammar: its mask is computed last.
        let mut masked = Vec::new();
        let mut preempted = false;
        let victims_max = self.preempt_for_priority();
        let mut admitted_for_victims = false;

        let mut i = 0;
        while i < self.running.len() {
            let slot = self.running[i];
            let r = self.req(slot);
            if !self.plannable(r) {
                i += 1;
                continue;
            }
            let decoding = r.is_decoding();
            let want = if decoding {
                1
            } else {
                self.prefill_take(r.remaining(), budget, prefilled)
            };
            if want == 0 {
                i += 1;
                continue;
            }
            let take = loop {
                if let Some(t) = self.fit(slot, want, !decoding, 0) {
                    break Some(t);
                }
                match self.newest_preemptible_after(i) {
                    Some(j) => {
                        self.preempt(j);
                        preempted = true;
                    }
                    // It is the newest: it waits for older requests to finish or preempt it.
                    None => break None,
                }
            };
            if let Some(t) = take {
                if !decoding {
                    budget = budget.saturating_sub(t.tokens);
                    prefilled = true;
                }
                let row = plan.requests.len();
                plan.requests.push(self.plan_step(slot, t, step, row));
                self.note_masked(&mut plan, slot, &mut masked);
            }
            i += 1;
        }

        // Admitting right after preempting would only thrash: the victims are at the front.
        while !preempted && self.running.len() < self.cfg.max_running_requests {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let outranks = self.outranks_victims(slot, victims_max);
            if admitted_for_victims && !outranks {
                break;
            }
            let Some(t) = self.admit(slot, budget, prefilled) else {
                break;
            };
            admitted_for_victims |= outranks;
            self.waiting.pop_front();
            self.insert_running(slot);
            if !self.req(slot).is_decoding() {
                budget = budget.saturating_sub(t.tokens);
                prefilled = true;
            }
            let row = plan.requests.len();
            plan.requests.push(self.plan_step(slot, t, step, row));
            self.note_masked(&mut plan, slot, &mut masked);
        }
        self.fill_masks(&mut plan, &masked);

        self.last_batch_size = plan.requests.len();
        if plan.requests.is_empty() {
            return None;
        }
        plan.released = self.take_released();
        debug_assert!(
            plan.validate(Some(self.cfg.num_pages)).is_ok(),
            "{:?}",
            plan.validate(Some(self.cfg.num_pages))
        );
        Some(plan)
    }

    /// Whether a running request can be planned now. With no plan of it in flight, always
    /// (unless it is leaving). With one in flight (overlap), only when the next step cannot
    /// change what that plan decides: a known prompt chunk, or one token referencing the
    /// pending one, if that token cannot end the request for length. Penalised requests too:
    /// their history then lacks the pending token, which the worker has on the device and adds
    /// (the plan's history rule, docs/protocol.md). So are requests under a grammar: their
    /// mask follows in a `masks` message once the pending token is known (`late_masks.rs`).
    fn plannable(&self, r: &Request) -> bool {
        if r.retiring.is_some() || r.preempt_requested {
            return false;
        }
        match r.in_flight {
            0 => true,
            1 if r.input_is_pending() => {
                r.generated() + (r.pending_tokens as usize) < r.max_new_tokens as usize
                    && r.tokens.len() + (r.pending_tokens as usize) < self.cfg.max_context as usize
            }
            1 => r.pending_tokens == 0,
            _ => false,
        }
    }

    /// Notes the plan's last row when it samples under a grammar: with its input known, for
    /// `fill_masks`; with its input the token still in flight, as a late row (its mask, and any
    /// `allowed_token_ids`, go in the step's `masks` message).
    fn note_masked(&self, plan: &mut BatchPlan, slot: usize, masked: &mut Vec<(usize, usize)>) {
        let row = plan.requests.len() - 1;
        let Some(c) = self.req(slot).constraint.as_ref() else {
            return;
        };
        let pr = &mut plan.requests[row];
        if !pr.sample {
            return;
        }
        if pr.input_prev_row >= 0 {
            pr.mask_late = true;
            pr.allowed_tokens = None;
        } else if c.is_active() {
            masked.push((row, slot));
        }
    }

    /// Writes the allowed-token mask of each `(row, slot)` (see `masks_of`). A grammar that
    /// cannot go on refuses its request: the row runs unmasked, and what it samples is dropped
    /// when the result is back.
    fn fill_masks(&mut self, plan: &mut BatchPlan, masked: &[(usize, usize)]) {
        for (row, mask) in self.masks_of(masked) {
            plan.requests[row].allowed_tokens = mask.map(Arc::new);
        }
    }

    /// The allowed-token masks of the requests in `slots` (`(key, slot)`), their grammars
    /// computing them in parallel (a mask walks the whole vocabulary's trie: tens to hundreds
    /// of microseconds each), each ANDed with the request's `allowed_token_ids`. A request whose
    /// grammar is not active yet (still thinking) gets its `allowed_token_ids` mask, if any. A
    /// grammar that cannot go on refuses its request (as invalid) and gets `None`.
    pub(super) fn masks_of(&mut self, slots: &[(usize, usize)]) -> Vec<(usize, Option<Vec<u32>>)> {
        if slots.is_empty() {
            return Vec::new();
        }
        let mut key_of = vec![usize::MAX; self.slots.len()];
        for &(key, slot) in slots {
            key_of[slot] = key;
        }
        let masks: Vec<(usize, usize, MaskOutcome)> = self
            .slots
            .iter_mut()
            .enumerate()
            .filter(|(slot, _)| key_of[*slot] != usize::MAX)
            .filter_map(|(slot, r)| {
                let r = r.as_mut()?;
                Some((
                    key_of[slot],
                    slot,
                    r.constraint.as_mut()?,
                    &r.stop_token_ids,
                    r.allowed_tokens.as_deref().map(Vec::as_slice),
                ))
            })
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|(key, slot, c, stops, only)| {
                let mask = if c.is_active() {
                    c.allowed_tokens(stops, only).map(Some)
                } else {
                    Ok(only.map(<[u32]>::to_vec))
                };
                (key, slot, mask)
            })
            .collect();
        masks
            .into_iter()
            .map(|(key, slot, mask)| match mask {
                Ok(words) => (key, words),
                Err(message) => {
                    let r = self.slots[slot].as_mut().expect("live request slot");
                    r.retiring = Some(Ending::Failed);
                    // The request's own constraint cannot be met (say, `allowed_token_ids` and the
                    // grammar share no token): the client's error, a 400, not the server's.
                    self.planning_failures
                        .push((r.id, GenerateEvent::Refused(SubmitError::Invalid(message))));
                    (key, None)
                }
            })
            .collect()
    }

    /// Prompt tokens a request may run now. Chunking cuts prompts to the budget and chunk size;
    /// without it a prompt runs whole, and the first prompt of a step may exceed the budget so
    /// that a prompt longer than the budget still runs (alone).
    pub(super) fn prefill_take(&self, remaining: usize, budget: usize, prefilled: bool) -> usize {
        match self.cfg.chunked_prefill_size {
            Some(chunk) => remaining.min(budget).min(chunk),
            None if remaining <= budget || !prefilled => remaining,
            None => 0,
        }
    }

    /// Reserves pages for `want` tokens of a request (past its `planned_len`), keeping `headroom`
    /// pages free besides. A chunkable prompt step shrinks to the pages there are; `None` when
    /// not even that fits.
    fn fit(&mut self, slot: usize, want: usize, shrinkable: bool, headroom: usize) -> Option<Take> {
        let ps = self.cfg.page_size as usize;
        let (kv_len, have) = {
            let r = self.req(slot);
            (r.planned_len, r.pages.len())
        };
        let need = self.pages_for(kv_len + want).saturating_sub(have);
        if self.ensure_free(need + headroom) {
            return Some(Take {
                tokens: want,
                new_pages: need,
            });
        }
        if !shrinkable || self.cfg.chunked_prefill_size.is_none() {
            return None;
        }
        let avail = self.alloc.free_count().saturating_sub(headroom);
        let tokens = ((have + avail) * ps).saturating_sub(kv_len).min(want);
        (tokens > 0).then(|| Take {
            tokens,
            new_pages: self.pages_for(kv_len + tokens).saturating_sub(have),
        })
    }

    /// The most recently admitted running request after position `i` that is not in flight.
    fn newest_preemptible_after(&self, i: usize) -> Option<usize> {
        (i + 1..self.running.len())
            .rev()
            .find(|&j| self.req(self.running[j]).in_flight == 0)
    }

    /// Moves running request `j` back to the queue: its front (first come, first served), or
    /// its place by priority. Its committed full pages go
    /// into the radix cache first, so recomputing it is mostly a cache hit. Its tokens (prompt
    /// and everything generated) become the prompt it recomputes.
    pub(super) fn preempt(&mut self, j: usize) {
        let slot = self.running.remove(j);
        self.release_pages(slot, true);
        self.slots[slot]
            .as_mut()
            .expect("live request slot")
            .preempt_requested = false;
        self.enqueue_waiting(slot, true);
        self.preemptions_total += 1;
    }

    /// Prompt pages admission may take from the radix cache. At least one token must run so
    /// the request gets logits; prompt logprobs still owed need the prompt computed, not read
    /// from the cache.
    pub(super) fn cacheable_pages(&self, r: &Request) -> usize {
        if self.cfg.disable_radix_cache || r.owes_prompt_logprobs() {
            0
        } else {
            (r.tokens.len() - 1) / self.cfg.page_size as usize
        }
    }

    /// Tries to admit the waiting request at the front: reuse its longest cached prefix, then
    /// fit its first step. On failure nothing changes (matched pages are given back).
    fn admit(&mut self, slot: usize, budget: usize, prefilled: bool) -> Option<Take> {
        let ps = self.cfg.page_size as usize;
        let r = self.req(slot);
        let max_pages = self.cacheable_pages(r);
        let matched = if max_pages > 0 {
            let r = self.slots[slot].as_ref().expect("live request slot");
            self.radix.match_prefix(
                &r.tokens,
                r.cache_salt.as_deref(),
                max_pages,
                &mut self.alloc,
            )
        } else {
            Vec::new()
        };
        let r = self.slots[slot].as_mut().expect("live request slot");
        r.kv_len = matched.len() * ps;
        r.planned_len = r.kv_len;
        r.pages = matched;
        let decoding = r.is_decoding();
        let want = if decoding {
            1
        } else {
            self.prefill_take(self.req(slot).remaining(), budget, prefilled)
        };
        // Keep a page per running request free so admissions do not at once force preemption.
        let take = if want == 0 {
            None
        } else {
            self.fit(slot, want, !decoding, self.running.len())
        };
        if take.is_none() {
            self.release_pages(slot, false);
            return None;
        }
        let r = self.slots[slot].as_mut().expect("live request slot");
        if !r.admitted_once {
            r.admitted_once = true;
            r.cached_tokens = r.kv_len as u32;
            self.prefix_hit_tokens_total += r.kv_len as u64;
            self.prompt_tokens_total += r.prompt_len as u64;
        }
        take
    }

    /// Allocates the step's pages and writes its plan entry (row `row` of step `step`); marks
    /// the request in flight.
    fn plan_step(&mut self, slot: usize, t: Take, step: u64, row: usize) -> PlannedRequest {
        for _ in 0..t.new_pages {
            let p = self.alloc_page();
            self.slots[slot]
                .as_mut()
                .expect("live request slot")
                .pages
                .push(p);
        }
        let ps = self.cfg.page_size as usize;
        let r: &mut Request = self.slots[slot].as_mut().expect("live request slot");
        let (start, end) = (r.planned_len, r.planned_len + t.tokens);
        let pending = r.input_is_pending();
        debug_assert!(!pending || (t.tokens == 1 && r.last_step + 1 == step));
        // A pending input is the last token the request will have before this step samples.
        let known = r.tokens.len() + pending as usize;
        let generated = r.generated() + r.pending_tokens as usize;
        let sample = end == known && generated < r.max_new_tokens as usize;
        // The tokens known here: a pending input is not among them (the worker appends it).
        // The workers keep what earlier plans sent, so only the tokens after those go, unless
        // nothing was sent yet (a reset carries the whole history).
        let wants_history = sample && r.sampling.needs_history();
        let history_reset =
            wants_history && (r.history_sent == 0 || r.history_sent > r.tokens.len());
        let history = if !wants_history {
            Vec::new()
        } else if history_reset {
            r.tokens.clone()
        } else {
            r.tokens[r.history_sent..].to_vec()
        };
        if wants_history {
            r.history_sent = r.tokens.len();
        }
        let prompt_logprobs = r.owes_prompt_logprobs() && start < r.prompt_len;
        let planned = PlannedRequest {
            id: r.id,
            input_ids: if pending {
                vec![-1]
            } else {
                r.tokens[start..end].to_vec()
            },
            input_prev_row: if pending { r.last_row as i32 } else { -1 },
            cached_len: start as i32,
            pages: r.pages.clone(),
            out_slots: (start..end)
                .map(|pos| r.pages[pos / ps] * ps as i32 + (pos % ps) as i32)
                .collect(),
            sample,
            prompt_logprobs,
            // The chunk's last row scores the next chunk's first prompt token.
            next_prompt_token: if prompt_logprobs && end < r.prompt_len {
                r.tokens[end]
            } else {
                -1
            },
            // Before min_new_tokens no stop token may be sampled.
            sampling: if sample && generated < r.min_new_tokens as usize {
                r.sampling.banning(&r.stop_token_ids)
            } else {
                r.sampling.clone()
            },
            history_prompt_len: if wants_history {
                r.prompt_len as i32
            } else {
                0
            },
            history,
            history_reset,
            // A grammar's mask is filled in by `fill_masks` once the whole step is planned.
            allowed_tokens: r.allowed_tokens.clone().filter(|_| sample),
            mask_late: false,
        };
        r.planned_len = end;
        r.in_flight += 1;
        r.pending_tokens += sample as u8;
        r.last_row = row as u32;
        r.last_step = step;
        planned
    }
}
