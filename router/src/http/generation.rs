//! From engine events to text: one [`ChoiceEvent`] stream per choice (a prompt's i-th sample),
//! detokenized incrementally, cut at stop strings, timed for the metrics, and merged across
//! choices. The streams own their `RequestStream`s, so dropping a response (a client that went
//! away) aborts every generation behind it.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use futures::stream::{self, BoxStream, StreamExt};

use crate::engine::{Engine, FinishReason, GenerateEvent, GenerateRequest, RequestStream};
use crate::metrics::Metrics;
use crate::protocol::{PromptLogprobs, TokenLogprobs};
use crate::tokenizer::{IncrementalDetokenizer, StopMatcher, StopOutcome, TokenizerBundle};

use super::errors::ApiError;
use super::openai_types::Usage;

/// What every choice of one HTTP request shares.
pub struct GenerationContext {
    pub tokenizer: Arc<TokenizerBundle>,
    pub metrics: Arc<Metrics>,
    pub stops: Vec<String>,
    /// EOS and the request's stop token ids: they end generation but show no text (none with
    /// `include_stop_str_in_output`).
    pub silent_ids: HashSet<i32>,
    pub include_stop: bool,
    pub skip_special_tokens: bool,
    /// Stop strings end the text only from this many generated tokens on (`min_tokens`, as
    /// vLLM counts it: the token that completes one is included).
    pub min_tokens: u32,
    pub arrived: Instant,
}

impl GenerationContext {
    /// The context every choice of one request shares: stop strings, and the token ids (EOS
    /// unless `ignore_eos`, plus `stop_token_ids`) that end generation without showing text.
    pub fn for_request(
        tokenizer: &Arc<TokenizerBundle>,
        metrics: &Arc<Metrics>,
        v: &super::validation::Validated,
        arrived: Instant,
    ) -> Arc<GenerationContext> {
        let mut silent_ids: HashSet<i32> = HashSet::new();
        if !v.include_stop {
            silent_ids.extend(&v.stop_token_ids);
            if !v.ignore_eos {
                silent_ids.extend(tokenizer.eos_token_ids());
            }
        }
        Arc::new(GenerationContext {
            tokenizer: Arc::clone(tokenizer),
            metrics: Arc::clone(metrics),
            stops: v.stops.clone(),
            silent_ids,
            include_stop: v.include_stop,
            skip_special_tokens: v.skip_special_tokens,
            min_tokens: v.min_tokens,
            arrived,
        })
    }
}

#[derive(Debug, Clone)]
pub struct GeneratedToken {
    pub id: i32,
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Debug)]
pub enum ChoiceEvent {
    PromptLogprobs {
        index: u32,
        logprobs: PromptLogprobs,
    },
    /// New text and the tokens it came from. Tokens whose text is still held back (an
    /// incomplete character, a possible stop string) arrive with a later delta.
    Delta {
        index: u32,
        text: String,
        tokens: Vec<GeneratedToken>,
    },
    Finished {
        index: u32,
        reason: &'static str,
        usage: Usage,
        /// The stop string that ended the text, if one did.
        stop: Option<String>,
    },
    /// The response's error: a generation that failed, or a refusal that reached the engine.
    Failed(ApiError),
}

/// Submits every request, in order. If one is refused the ones already accepted are dropped
/// (aborted) and the refusal becomes the response.
pub fn submit_all(
    engine: &dyn Engine,
    requests: Vec<GenerateRequest>,
) -> Result<Vec<RequestStream>, ApiError> {
    requests
        .into_iter()
        .map(|r| engine.submit(r).map_err(ApiError::from))
        .collect()
}

struct ChoiceState {
    ctx: Arc<GenerationContext>,
    index: u32,
    prompt_len: u32,
    stream: Option<RequestStream>,
    detokenizer: IncrementalDetokenizer,
    stop: StopMatcher,
    pending_tokens: Vec<GeneratedToken>,
    queued: VecDeque<ChoiceEvent>,
    generated: u32,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
}

impl ChoiceState {
    async fn next_event(&mut self) -> Option<ChoiceEvent> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            let stream = self.stream.as_mut()?;
            let event = stream.events.recv().await;
            self.handle(event);
        }
    }

    fn emit_text(&mut self, text: String) {
        if !text.is_empty() || !self.pending_tokens.is_empty() {
            let tokens = std::mem::take(&mut self.pending_tokens);
            self.queued.push_back(ChoiceEvent::Delta {
                index: self.index,
                text,
                tokens,
            });
        }
    }

    /// Ends the choice: no more events after the queued ones, and the engine request is
    /// dropped (which aborts it if it is still running).
    fn finish(&mut self, reason: &'static str, usage: Usage) {
        self.stream = None;
        let now = Instant::now();
        let ttft = self
            .first_token_at
            .map(|t| (t - self.ctx.arrived).as_secs_f64());
        self.ctx.metrics.observe_generation(
            (now - self.ctx.arrived).as_secs_f64(),
            ttft,
            u64::from(usage.prompt_tokens),
            u64::from(usage.completion_tokens),
        );
        self.queued.push_back(ChoiceEvent::Finished {
            index: self.index,
            reason,
            usage,
            stop: self.stop.matched().map(str::to_owned),
        });
    }

    fn fail(&mut self, message: String, retryable: bool) {
        self.fail_with(ApiError::generation_failed(&message, retryable));
    }

    fn fail_with(&mut self, error: ApiError) {
        self.stream = None;
        self.queued.push_back(ChoiceEvent::Failed(error));
    }

    fn handle(&mut self, event: Option<GenerateEvent>) {
        match event {
            None => self.fail(
                "The engine ended the request without finishing it.".into(),
                true,
            ),
            Some(GenerateEvent::PromptLogprobs(logprobs)) => {
                self.queued.push_back(ChoiceEvent::PromptLogprobs {
                    index: self.index,
                    logprobs,
                })
            }
            Some(GenerateEvent::Token { id, logprobs }) => self.on_token(id, logprobs),
            Some(GenerateEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let reason = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Abort => {
                        return self.fail("The engine aborted the request.".into(), true)
                    }
                };
                let tail = self.detokenizer.flush(&self.ctx.tokenizer);
                let (text, reason) = match self.stop.push(&tail) {
                    StopOutcome::Continue(text) => (text + &self.stop.flush(), reason),
                    StopOutcome::Stopped(text) => (text, "stop"),
                };
                self.emit_text(text);
                self.finish(
                    reason,
                    Usage::new(prompt_tokens, completion_tokens, cached_tokens),
                );
            }
            Some(GenerateEvent::Failed { message, retryable }) => self.fail(message, retryable),
            Some(GenerateEvent::Refused(e)) => self.fail_with(ApiError::from(e)),
        }
    }

    fn on_token(&mut self, id: i32, logprobs: Option<TokenLogprobs>) {
        let now = Instant::now();
        match self.last_token_at {
            None => {
                self.first_token_at = Some(now);
                self.ctx
                    .metrics
                    .observe_time_to_first_token((now - self.ctx.arrived).as_secs_f64());
            }
            Some(last) => self
                .ctx
                .metrics
                .observe_inter_token_latency((now - last).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        self.generated += 1;
        if self.ctx.silent_ids.contains(&id) {
            return;
        }
        self.pending_tokens.push(GeneratedToken { id, logprobs });
        let text = self.detokenizer.push(&self.ctx.tokenizer, id);
        if self.generated < self.ctx.min_tokens {
            let text = self.stop.push_unmatched(&text);
            if !text.is_empty() {
                self.emit_text(text);
            }
            return;
        }
        match self.stop.push(&text) {
            StopOutcome::Continue(text) => {
                if !text.is_empty() {
                    self.emit_text(text);
                }
            }
            StopOutcome::Stopped(text) => {
                self.emit_text(text);
                // The engine never sees the stop string, so its usage is counted here. The
                // prefix-cache hit count is only known from the engine's final event.
                let usage = Usage::new(self.prompt_len, self.generated, 0);
                self.finish("stop", usage);
            }
        }
    }
}

/// The events of one choice.
pub fn choice_events(
    ctx: Arc<GenerationContext>,
    index: u32,
    prompt_ids: &[i32],
    stream: RequestStream,
) -> BoxStream<'static, ChoiceEvent> {
    let state = ChoiceState {
        index,
        prompt_len: prompt_ids.len() as u32,
        stream: Some(stream),
        detokenizer: IncrementalDetokenizer::new(prompt_ids)
            .showing_special_tokens(!ctx.skip_special_tokens),
        stop: StopMatcher::new(ctx.stops.clone()).including_stops(ctx.include_stop),
        pending_tokens: Vec::new(),
        queued: VecDeque::new(),
        generated: 0,
        first_token_at: None,
        last_token_at: None,
        ctx,
    };
    stream::unfold(state, |mut state| async move {
        state.next_event().await.map(|e| (e, state))
    })
    .boxed()
}

/// All choices' events, interleaved as they come.
pub fn merge(choices: Vec<BoxStream<'static, ChoiceEvent>>) -> BoxStream<'static, ChoiceEvent> {
    stream::select_all(choices).boxed()
}

/// One choice's whole output, for non-streaming responses.
#[derive(Debug, Default)]
pub struct ChoiceOutput {
    pub text: String,
    pub tokens: Vec<GeneratedToken>,
    pub prompt_logprobs: Vec<PromptLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub usage: Option<Usage>,
    /// The stop string that ended the text, if one did.
    pub stop: Option<String>,
}

/// Runs every choice to the end. The first failure fails the whole response (and drops, so
/// aborts, the other choices).
pub async fn collect(
    mut events: BoxStream<'static, ChoiceEvent>,
    choices: usize,
) -> Result<Vec<ChoiceOutput>, ApiError> {
    let mut out: Vec<ChoiceOutput> = (0..choices).map(|_| ChoiceOutput::default()).collect();
    while let Some(event) = events.next().await {
        match event {
            ChoiceEvent::PromptLogprobs { index, logprobs } => {
                out[index as usize].prompt_logprobs.push(logprobs)
            }
            ChoiceEvent::Delta {
                index,
                text,
                tokens,
            } => {
                let o = &mut out[index as usize];
                o.text.push_str(&text);
                o.tokens.extend(tokens);
            }
            ChoiceEvent::Finished {
                index,
                reason,
                usage,
                stop,
            } => {
                let o = &mut out[index as usize];
                o.finish_reason = Some(reason);
                o.usage = Some(usage);
                o.stop = stop;
            }
            ChoiceEvent::Failed(error) => return Err(error),
        }
    }
    Ok(out)
}

/// Usage over all choices: each prompt counts once however many samples it has; the cached
/// count of a prompt is the best any of its samples got.
#[derive(Debug, Default)]
pub struct UsageTally {
    per_prompt: Vec<Option<(u32, u32)>>,
    completion_tokens: u32,
    samples_per_prompt: u32,
}

impl UsageTally {
    pub fn new(prompts: usize, samples_per_prompt: u32) -> UsageTally {
        UsageTally {
            per_prompt: vec![None; prompts],
            completion_tokens: 0,
            samples_per_prompt,
        }
    }

    pub fn add(&mut self, index: u32, usage: &Usage) {
        let slot = &mut self.per_prompt[(index / self.samples_per_prompt) as usize];
        let cached = usage.prompt_tokens_details.cached_tokens;
        *slot = Some(match *slot {
            None => (usage.prompt_tokens, cached),
            Some((p, c)) => (p, c.max(cached)),
        });
        self.completion_tokens += usage.completion_tokens;
    }

    pub fn total(&self) -> Usage {
        let prompt = self.per_prompt.iter().flatten().map(|p| p.0).sum();
        let cached = self.per_prompt.iter().flatten().map(|p| p.1).sum();
        Usage::new(prompt, self.completion_tokens, cached)
    }
}
