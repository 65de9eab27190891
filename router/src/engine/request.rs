//! What the HTTP layer hands the engine and what it gets back. The HTTP layer owns text
//! (tokenization, detokenization, stop strings); the engine owns token ids, pages and steps.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::grammar::TokenConstraint;
use crate::protocol::{PromptLogprobs, SamplingParams, TokenLogprobs};

pub type RequestId = u64;

/// One generation request, already tokenized and validated.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<i32>,
    pub sampling: SamplingParams,
    /// Generation stops after this many new tokens (finish reason "length").
    pub max_new_tokens: u32,
    /// None of `stop_token_ids` is sampled before this many new tokens (vLLM's `min_tokens`).
    pub min_new_tokens: u32,
    /// Generation stops after any of these tokens (finish reason "stop"); the HTTP layer puts
    /// the model's EOS ids here unless the request set `ignore_eos`.
    pub stop_token_ids: Vec<i32>,
    /// Return the logprobs of the prompt tokens (for `echo` with `logprobs`).
    pub prompt_logprobs: bool,
    /// vLLM's `allowed_token_ids`: the bitmask of the only tokens it may sample (every step).
    pub allowed_tokens: Option<Arc<Vec<u32>>>,
    /// Structured output: the grammar the generated tokens must follow, compiled.
    pub constraint: Option<TokenConstraint>,
    /// The request's `priority` (0 when it sets none). Used only under priority scheduling,
    /// where the policy says whether larger or smaller values go first.
    pub priority: i32,
    /// vLLM's `cache_salt`: prefix-cache pages are shared only among requests with the same
    /// salt (`None`: among all unsalted requests).
    pub cache_salt: Option<Arc<str>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token (or, decided by the HTTP layer, a stop string).
    Stop,
    /// `max_new_tokens` reached, or the context is full.
    Length,
    /// The client went away or the HTTP layer aborted it.
    Abort,
}

impl FinishReason {
    pub fn as_openai(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Events of one request, in order: prompt logprobs (if asked, possibly in several chunks),
/// then tokens, then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone)]
pub enum GenerateEvent {
    PromptLogprobs(PromptLogprobs),
    Token {
        id: i32,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_tokens: u32,
    },
    /// The request failed (a worker error or a dead worker); `retryable` maps to 503.
    Failed {
        message: String,
        retryable: bool,
    },
    /// The engine refused the request when it arrived there (after the handle's own checks):
    /// the same refusal, and HTTP status, as if the handle had refused it (429 when the queue
    /// filled up meanwhile, 400, 503). Also sent mid-generation, as `Invalid` (400), when the
    /// request's structured output can no longer be met (its grammar allows no token, or none
    /// that `allowed_token_ids` allows).
    Refused(SubmitError),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SubmitError {
    /// The waiting queue is full: HTTP 429 with Retry-After.
    #[error("the server is overloaded: {0}")]
    Overloaded(String),
    /// The request can never fit (context or KV pool): HTTP 400.
    #[error("{0}")]
    Invalid(String),
    /// No healthy workers (starting, dead or restarting): HTTP 503.
    #[error("the model workers are not available: {0}")]
    Unavailable(String),
}

/// A submitted request's event stream. Dropping it aborts the request (a client that went
/// away) and frees its pages at the next step; aborting a finished request is a no-op.
pub struct RequestStream {
    pub id: RequestId,
    pub events: mpsc::UnboundedReceiver<GenerateEvent>,
    abort: mpsc::UnboundedSender<RequestId>,
}

impl RequestStream {
    pub fn new(
        id: RequestId,
        events: mpsc::UnboundedReceiver<GenerateEvent>,
        abort: mpsc::UnboundedSender<RequestId>,
    ) -> Self {
        Self { id, events, abort }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        let _ = self.abort.send(self.id);
    }
}

/// Facts about the served model that the HTTP layer validates against.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub served_model_name: String,
    pub max_context: u32,
    pub vocab_size: u32,
}

/// The engine as the HTTP layer sees it. The real one drives the workers; tests may use a
/// scripted one.
pub trait Engine: Send + Sync + 'static {
    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError>;
    /// True while every worker is alive and the engine loop runs.
    fn healthy(&self) -> bool;
    fn model_info(&self) -> ModelInfo;
}
