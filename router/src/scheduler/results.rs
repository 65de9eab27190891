//! Committing a step result: the planned tokens' KV is now written, sampled tokens extend their
//! requests, and finished or failed requests leave (their full pages stay in the radix cache).
//!
//! Events per request come out in the order the engine forwards them: prompt logprobs, then
//! the token, then at most one `Finished` or `Failed`.

use std::collections::HashMap;

use crate::engine::{FinishReason, GenerateEvent, RequestId};
use crate::protocol::{BatchPlan, PlannedRequest, PromptLogprobs, StepResult, TokenLogprobs};

use super::request::Ending;
use super::Scheduler;

/// A step result indexed by request id, built once per result (a data-parallel step commits
/// it rank by rank).
pub(crate) struct ResultIndex<'a> {
    sampled: HashMap<u64, (i32, &'a Option<TokenLogprobs>)>,
    errors: HashMap<u64, &'a str>,
    prompt_lps: HashMap<u64, Vec<&'a PromptLogprobs>>,
}

impl<'a> ResultIndex<'a> {
    pub(crate) fn new(result: &'a StepResult) -> Self {
        let sampled = result
            .sampled
            .iter()
            .map(|(id, tok, lp)| (*id, (*tok, lp)))
            .collect();
        let errors = result
            .errors
            .iter()
            .map(|(id, m)| (*id, m.as_str()))
            .collect();
        let mut prompt_lps: HashMap<u64, Vec<&PromptLogprobs>> = HashMap::new();
        for p in &result.prompt_logprobs {
            prompt_lps.entry(p.req_id).or_default().push(p);
        }
        Self {
            sampled,
            errors,
            prompt_lps,
        }
    }
}

impl Scheduler {
    /// Applies the result of `plan`. Requests aborted since the plan was built are skipped.
    pub fn on_result(
        &mut self,
        plan: &BatchPlan,
        result: &StepResult,
    ) -> Vec<(RequestId, GenerateEvent)> {
        self.commit(plan.requests.iter(), &ResultIndex::new(result))
    }

    /// Applies a step result to `requests`, this scheduler's entries of the step's plan.
    pub(crate) fn commit<'p>(
        &mut self,
        requests: impl ExactSizeIterator<Item = &'p PlannedRequest>,
        result: &ResultIndex<'_>,
    ) -> Vec<(RequestId, GenerateEvent)> {
        let ResultIndex {
            sampled,
            errors,
            prompt_lps,
        } = result;
        let mut events = std::mem::take(&mut self.planning_failures);
        events.reserve(requests.len() + 1);
        let mut left = false;
        for pr in requests {
            let Some(&slot) = self.index.get(&pr.id) else {
                continue;
            };
            let r = self.slots[slot].as_mut().expect("live request slot");
            if r.in_flight == 0 {
                // Not in flight (a plan applied twice): committing would corrupt it.
                continue;
            }
            if let Some(ending) = r.retiring {
                // It ended while this plan was in flight: what the plan produced is dropped,
                // and once no plan with it is in flight its pages go.
                r.in_flight -= 1;
                if r.in_flight == 0 {
                    r.pending_tokens = 0;
                    r.planned_len = r.kv_len;
                    self.finish(slot, ending);
                    left = true;
                }
                continue;
            }
            if r.kv_len != pr.cached_len as usize {
                // Not this plan's request state: committing would corrupt it.
                continue;
            }
            r.in_flight -= 1;
            r.pending_tokens -= pr.sample as u8;
            if let Some(msg) = errors.get(&pr.id) {
                events.push((
                    pr.id,
                    GenerateEvent::Failed {
                        message: msg.to_string(),
                        retryable: false,
                    },
                ));
                // Its KV may be wrong: nothing of it goes into the cache.
                left |= self.retire(slot, Ending::Failed);
                continue;
            }
            for p in prompt_lps.get(&pr.id).into_iter().flatten() {
                if let Some(trimmed) = trim_prompt_logprobs(p, r.prompt_logprobs_next, r.prompt_len)
                {
                    r.prompt_logprobs_next = trimmed.first_pos as usize + trimmed.entries.len();
                    events.push((pr.id, GenerateEvent::PromptLogprobs(trimmed)));
                }
            }
            r.kv_len += pr.input_ids.len();
            if r.in_flight == 0 {
                r.planned_len = r.kv_len;
            }
            let mut reason = None;
            if pr.sample {
                let Some(&(token, lp)) = sampled.get(&pr.id) else {
                    events.push((
                        pr.id,
                        GenerateEvent::Failed {
                            message: "the workers returned no token".into(),
                            retryable: false,
                        },
                    ));
                    left |= self.retire(slot, Ending::Failed);
                    continue;
                };
                let is_stop = r.stop_token_ids.contains(&token);
                // Structured output: the grammar advances by every token but a stop token (the
                // mask allowed those only where the output may end).
                let grammar_done = match r.constraint.as_mut().filter(|_| !is_stop) {
                    Some(c) => match c.advance(token) {
                        Ok(done) => done,
                        Err(message) => {
                            events.push((
                                pr.id,
                                GenerateEvent::Failed {
                                    message,
                                    retryable: false,
                                },
                            ));
                            left |= self.retire(slot, Ending::Failed);
                            continue;
                        }
                    },
                    None => false,
                };
                r.tokens.push(token);
                events.push((
                    pr.id,
                    GenerateEvent::Token {
                        id: token,
                        logprobs: lp.clone(),
                    },
                ));
                // A stop token counts from min_new_tokens on (the plans banned it before).
                reason = if (is_stop && r.generated() > r.min_new_tokens as usize) || grammar_done {
                    Some(FinishReason::Stop)
                } else if r.generated() >= r.max_new_tokens as usize
                    || r.tokens.len() >= self.cfg.max_context as usize
                {
                    Some(FinishReason::Length)
                } else {
                    None
                };
            } else if r.kv_len == r.tokens.len() {
                // The whole prompt ran and nothing is to be generated (max_new_tokens = 0).
                reason = Some(FinishReason::Length);
            }
            if let Some(reason) = reason {
                let (prompt_tokens, completion_tokens, cached_tokens) =
                    (r.prompt_len as u32, r.generated() as u32, r.cached_tokens);
                events.push((
                    pr.id,
                    GenerateEvent::Finished {
                        reason,
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    },
                ));
                left |= self.retire(slot, Ending::Finished);
            } else if pr.input_ids.len() > 1 && !self.cfg.disable_radix_cache {
                // A prompt chunk ran: index its full pages now, so concurrent requests with the
                // same prefix can share them before this one finishes.
                let ps = self.cfg.page_size as usize;
                let full = r.kv_len / ps;
                self.radix.insert(
                    &r.tokens[..full * ps],
                    r.cache_salt.as_deref(),
                    &mut r.pages[..full],
                    &mut self.alloc,
                );
            }
        }
        if left {
            let slots = &self.slots;
            self.running.retain(|&s| slots[s].is_some());
        }
        events
    }

    /// A request ends: released now, or (a later plan with it in flight) once that plan is
    /// back. True when it left the running batch now (the caller prunes `running`).
    fn retire(&mut self, slot: usize, ending: Ending) -> bool {
        let r = self.slots[slot].as_mut().expect("live request slot");
        if r.in_flight > 0 {
            r.retiring = Some(ending);
            return false;
        }
        self.finish(slot, ending);
        true
    }

    /// Releases a request that left the running batch and counts how it ended. The caller
    /// prunes `running`.
    fn finish(&mut self, slot: usize, ending: Ending) {
        self.release_pages(slot, ending.keeps_cache());
        self.take(slot);
        self.requests.count(ending);
    }
}

/// The part of a prompt-logprobs report not yet forwarded: positions from `next` up to the
/// prompt's end. A recompute after preemption re-runs prompt tokens whose logprobs were sent.
fn trim_prompt_logprobs(
    p: &PromptLogprobs,
    next: usize,
    prompt_len: usize,
) -> Option<PromptLogprobs> {
    let first = p.first_pos.max(0) as usize;
    let n = p.entries.len().min(p.tokens.len());
    let from = next.saturating_sub(first).min(n);
    let to = prompt_len.saturating_sub(first).min(n);
    (from < to).then(|| PromptLogprobs {
        req_id: p.req_id,
        first_pos: (first + from) as i32,
        tokens: p.tokens[from..to].to_vec(),
        entries: p.entries[from..to].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(first_pos: i32, n: usize) -> PromptLogprobs {
        PromptLogprobs {
            req_id: 7,
            first_pos,
            tokens: (0..n as i32).collect(),
            entries: (0..n)
                .map(|i| TokenLogprobs {
                    logprob: -(i as f32),
                    top: vec![],
                })
                .collect(),
        }
    }

    #[test]
    fn trim_skips_sent_positions_and_generated_tokens() {
        let t = trim_prompt_logprobs(&report(1, 9), 4, 8).unwrap();
        assert_eq!((t.first_pos, t.tokens.len()), (4, 4));
        assert_eq!(t.tokens, vec![3, 4, 5, 6]);
        assert!(trim_prompt_logprobs(&report(1, 3), 4, 8).is_none());
        assert_eq!(
            trim_prompt_logprobs(&report(1, 3), 1, 8)
                .unwrap()
                .entries
                .len(),
            3
        );
    }
}
