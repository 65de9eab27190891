//! One request's scheduling state.
//!
//! A request is a token sequence (prompt, then generated tokens) plus the pages holding the KV
//! of its first `kv_len` tokens. Every step runs `tokens[kv_len..kv_len + n]`: a prompt chunk
//! while `kv_len` is far behind, the last sampled token once it is one behind. Prefill, chunked
//! prefill, decode and recompute after preemption are all this one rule, so no path carries
//! state that another lacks.
//!
//! With overlap the next step is planned before the current one's result is back, so a request
//! also carries its *planned* frontier: `planned_len` (its KV length once every plan in flight
//! has run) and `pending_tokens` (tokens those plans sample that are not yet in `tokens`). The
//! same rule then applies from `planned_len`; a token still pending is referenced by its row in
//! the plan that samples it.

use std::sync::Arc;

use crate::engine::{GenerateRequest, RequestId};
use crate::grammar::TokenConstraint;
use crate::protocol::SamplingParams;

use super::allocator::PageId;

#[derive(Debug)]
pub struct Request {
    pub id: RequestId,
    pub sampling: SamplingParams,
    pub max_new_tokens: u32,
    /// Until this many tokens are generated its plans ban `stop_token_ids` (SamplingParams::banning).
    pub min_new_tokens: u32,
    pub stop_token_ids: Vec<i32>,
    pub wants_prompt_logprobs: bool,
    /// Length of the prompt as submitted; `tokens` beyond it were generated.
    pub prompt_len: usize,
    /// Prompt followed by every generated token so far.
    pub tokens: Vec<i32>,
    /// Tokens whose KV the workers have written (committed by a step result).
    pub kv_len: usize,
    /// Pages this request holds a reference to, in position order; they cover at least
    /// `kv_len` tokens (a step extends them before it runs).
    pub pages: Vec<PageId>,
    /// Prompt tokens found in the radix cache at first admission (reported as cached tokens).
    pub cached_tokens: u32,
    /// Whether it was ever admitted (later admissions are recomputes after preemption).
    pub admitted_once: bool,
    /// Prompt positions below this have had their logprobs reported (position 0 has none).
    pub prompt_logprobs_next: usize,
    /// KV length once every plan in flight for it has run (`kv_len` when none is).
    pub planned_len: usize,
    /// Plans sent with this request whose results are not committed yet (at most 2).
    pub in_flight: u8,
    /// Tokens those plans sample that are not in `tokens` yet.
    pub pending_tokens: u8,
    /// Its row in the newest plan it is in, and that plan's step: a next step planned before
    /// that result is back takes its input token from this row.
    pub last_row: u32,
    pub last_step: u64,
    /// It finished, failed or was aborted while a plan with it was in flight: its pages wait
    /// for those plans to come back, then go as `Ending` says.
    pub retiring: Option<Ending>,
    /// How many of `tokens` the workers hold as this request's penalty history (rank 0 keeps
    /// it between steps, so a plan sends only the tokens after these). 0: none yet, the next
    /// plan sends the whole history.
    pub history_sent: usize,
    /// `allowed_token_ids`: the tokens it may sample at every step, whatever came before (so,
    /// unlike a grammar, it does not stop planning ahead).
    pub allowed_tokens: Option<Arc<Vec<u32>>>,
    /// Structured output: the grammar its tokens follow. Each plan that samples for it carries
    /// the mask of the tokens allowed next, so it is never planned before its last token is
    /// known (no overlap for it).
    pub constraint: Option<TokenConstraint>,
    /// Its `priority` as submitted (priority scheduling orders by it, then by `arrival`).
    pub priority: i32,
    /// Its submission number in this scheduler: earlier arrivals go first among equals.
    pub arrival: u64,
    /// Its `cache_salt`: it shares radix-cache pages only with requests of the same salt.
    pub cache_salt: Option<Arc<str>>,
    /// Priority scheduling chose it as a victim while a step with it was in flight: it is not
    /// planned again, and is preempted once that step is back (`priority.rs`).
    pub preempt_requested: bool,
}

/// How a request left: decides whether its committed pages stay in the radix cache and which
/// outcome counter it adds to once its pages are released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Finished,
    Aborted,
    Failed,
}

impl Ending {
    /// Finished and aborted requests computed valid KV worth reusing; a failed one may not have.
    pub fn keeps_cache(self) -> bool {
        !matches!(self, Ending::Failed)
    }
}

impl Request {
    pub fn new(id: RequestId, req: GenerateRequest, arrival: u64) -> Self {
        let prompt_len = req.prompt_ids.len();
        let mut tokens = req.prompt_ids;
        tokens.reserve(req.max_new_tokens as usize);
        Self {
            id,
            sampling: req.sampling,
            max_new_tokens: req.max_new_tokens,
            min_new_tokens: req.min_new_tokens,
            stop_token_ids: req.stop_token_ids,
            wants_prompt_logprobs: req.prompt_logprobs,
            prompt_len,
            tokens,
            kv_len: 0,
            pages: Vec::new(),
            cached_tokens: 0,
            admitted_once: false,
            prompt_logprobs_next: 1,
            planned_len: 0,
            in_flight: 0,
            pending_tokens: 0,
            last_row: 0,
            last_step: 0,
            retiring: None,
            history_sent: 0,
            allowed_tokens: req.allowed_tokens,
            constraint: req.constraint,
            priority: req.priority,
            arrival,
            cache_salt: req.cache_salt,
            preempt_requested: false,
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run, past what is planned, before the next token can be sampled.
    pub fn remaining(&self) -> usize {
        self.tokens.len() + self.pending_tokens as usize - self.planned_len
    }

    /// Whether the next step is a decode (one token, free of the prefill budget).
    pub fn is_decoding(&self) -> bool {
        self.remaining() == 1 && self.generated() + self.pending_tokens as usize > 0
    }

    /// Whether its next input is a token a plan in flight samples (not known yet).
    pub fn input_is_pending(&self) -> bool {
        self.pending_tokens > 0 && self.planned_len == self.tokens.len()
    }

    /// Prompt logprobs still owed: the next chunk must ask the workers for them.
    pub fn owes_prompt_logprobs(&self) -> bool {
        self.wants_prompt_logprobs && self.prompt_logprobs_next < self.prompt_len
    }
}
