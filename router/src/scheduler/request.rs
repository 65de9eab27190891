//! One request's scheduling state.
//!
//! A request is a token sequence (prompt, then generated tokens) plus the pages holding the KV
//! of its first `kv_len` tokens. Every step runs `tokens[kv_len..kv_len + n]`: a prompt chunk
//! while `kv_len` is far behind, the last sampled token once it is one behind. Prefill, chunked
//! prefill, decode and recompute after preemption are all this one rule, so no path carries
//! state that another lacks.

use crate::engine::{GenerateRequest, RequestId};
use crate::protocol::SamplingParams;

use super::allocator::PageId;

#[derive(Debug)]
pub struct Request {
    pub id: RequestId,
    pub sampling: SamplingParams,
    pub max_new_tokens: u32,
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
    /// A plan containing this request was emitted and its result has not come back yet.
    pub in_flight: bool,
}

impl Request {
    pub fn new(id: RequestId, req: GenerateRequest) -> Self {
        let prompt_len = req.prompt_ids.len();
        let mut tokens = req.prompt_ids;
        tokens.reserve(req.max_new_tokens as usize);
        Self {
            id,
            sampling: req.sampling,
            max_new_tokens: req.max_new_tokens,
            stop_token_ids: req.stop_token_ids,
            wants_prompt_logprobs: req.prompt_logprobs,
            prompt_len,
            tokens,
            kv_len: 0,
            pages: Vec::new(),
            cached_tokens: 0,
            admitted_once: false,
            prompt_logprobs_next: 1,
            in_flight: false,
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run before the next token can be sampled.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.kv_len
    }

    /// Whether the next step is a decode (one token, free of the prefill budget).
    pub fn is_decoding(&self) -> bool {
        self.remaining() == 1 && self.generated() > 0
    }

    /// Prompt logprobs still owed: the next chunk must ask the workers for them.
    pub fn owes_prompt_logprobs(&self) -> bool {
        self.wants_prompt_logprobs && self.prompt_logprobs_next < self.prompt_len
    }
}
