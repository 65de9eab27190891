//! POST /v1/completions: raw prompts (strings or token ids, one or many), `n` samples each,
//! `echo`, legacy logprobs, streaming or not.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::protocol::PromptLogprobs;
use crate::tokenizer::TokenizerBundle;

use super::errors::ApiError;
use super::generation::{self, ChoiceEvent, ChoiceOutput, GenerationContext, UsageTally};
use super::json_body::read_json;
use super::logprobs;
use super::openai_types::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage,
};
use super::prompt::{completion_prompts, Prompt};
use super::sse::{sse_response, to_json, ChunkWriter};
use super::structured_output;
use super::validation::{
    check_logprobs, check_model, fit_context, generate_requests, unsupported, validate_sampling,
};
use super::{unix_now, AppState};

pub async fn handler(State(app): State<AppState>, request: Request) -> Response {
    match handle(app, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

/// What the response builders need to know about the request.
struct Shape {
    id: String,
    created: u64,
    model: String,
    n: u32,
    echo: bool,
    top_n: Option<u32>,
    include_usage: bool,
}

async fn handle(app: AppState, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body: CompletionRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    let info = app.model_info();
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    if body
        .best_of
        .is_some_and(|b| b != body.sampling.n.unwrap_or(1))
    {
        return Err(unsupported(
            "best_of",
            "`best_of` is not supported (use `n`).",
        ));
    }
    if body.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "`suffix` is not supported."));
    }
    let top_n = body
        .logprobs
        .map(|n| check_logprobs("logprobs", n))
        .transpose()?;
    let v = validate_sampling(
        &body.sampling,
        body.sampling.max_tokens,
        top_n,
        app.limits(),
        &app.cfg.sampling_defaults,
        &info,
    )?;
    let input = body
        .prompt
        .ok_or_else(|| ApiError::invalid_param("prompt", "`prompt` is required."))?;
    let prompts = completion_prompts(&app.tokenizer, input, info.vocab_size).await?;
    let echo = body.echo.unwrap_or(false);
    let constraint = match v.constraint.clone() {
        Some(c) => Some(structured_output::compile(&app.grammar, &app.metrics, c, false).await?),
        None => None,
    };

    let mut requests = Vec::with_capacity(prompts.len() * v.n as usize);
    for p in &prompts {
        let max_new = fit_context(p.ids.len(), v.max_tokens, info.max_context)?;
        let prompt_logprobs = echo && top_n.is_some();
        requests.extend(generate_requests(
            &p.ids,
            max_new,
            &v,
            app.tokenizer.eos_token_ids(),
            prompt_logprobs,
            constraint.as_ref(),
        ));
    }
    let streams = generation::submit_all(app.engine.as_ref(), requests)?;

    let ctx = GenerationContext::for_request(&app.tokenizer, &app.metrics, &v, arrived);
    let choices = streams
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            generation::choice_events(
                Arc::clone(&ctx),
                i as u32,
                &prompts[i / v.n as usize].ids,
                s,
            )
        })
        .collect();
    let events = generation::merge(choices);
    let shape = Shape {
        id: format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        created: unix_now(),
        model: app.cfg.served_model_name.clone(),
        n: v.n,
        echo,
        top_n,
        include_usage: v.include_usage,
    };
    if v.stream {
        let writer = StreamWriter::new(shape, Arc::clone(&app.tokenizer), prompts);
        return Ok(sse_response(events, writer));
    }
    let outputs = generation::collect(events, prompts.len() * v.n as usize).await?;
    Ok(Json(full_response(&shape, &app.tokenizer, &prompts, outputs)).into_response())
}

/// Logprobs of the echoed prompt, with offsets starting at 0.
fn echo_logprobs(
    tokenizer: &TokenizerBundle,
    prompt: &Prompt,
    reported: &[PromptLogprobs],
    top_n: u32,
    offset: &mut usize,
) -> CompletionLogprobs {
    logprobs::prompt_completion(tokenizer, &prompt.ids, reported, top_n, offset)
}

fn full_response(
    shape: &Shape,
    tokenizer: &TokenizerBundle,
    prompts: &[Prompt],
    outputs: Vec<ChoiceOutput>,
) -> CompletionResponse {
    let mut tally = UsageTally::new(prompts.len(), shape.n);
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(i, out)| {
            let index = i as u32;
            let prompt = &prompts[i / shape.n as usize];
            if let Some(usage) = &out.usage {
                tally.add(index, usage);
            }
            let mut text = if shape.echo {
                prompt.text.clone()
            } else {
                String::new()
            };
            text.push_str(&out.text);
            let logprobs = shape.top_n.map(|top_n| {
                let mut offset = 0;
                let mut lp = if shape.echo {
                    echo_logprobs(tokenizer, prompt, &out.prompt_logprobs, top_n, &mut offset)
                } else {
                    CompletionLogprobs::default()
                };
                logprobs::append_completion(
                    &mut lp,
                    logprobs::generated_completion(tokenizer, &out.tokens, top_n, &mut offset),
                );
                lp
            });
            CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason: out.finish_reason,
            }
        })
        .collect();
    CompletionResponse {
        id: shape.id.clone(),
        object: "text_completion",
        created: shape.created,
        model: shape.model.clone(),
        choices,
        usage: Some(Some(tally.total())),
    }
}

#[derive(Default)]
struct ChoiceProgress {
    echoed: bool,
    prompt_logprobs: Vec<PromptLogprobs>,
    /// Characters sent so far, for `text_offset`.
    offset: usize,
}

struct StreamWriter {
    shape: Shape,
    tokenizer: Arc<TokenizerBundle>,
    prompts: Vec<Prompt>,
    progress: Vec<ChoiceProgress>,
    tally: UsageTally,
}

impl StreamWriter {
    fn new(shape: Shape, tokenizer: Arc<TokenizerBundle>, prompts: Vec<Prompt>) -> StreamWriter {
        let choices = prompts.len() * shape.n as usize;
        let tally = UsageTally::new(prompts.len(), shape.n);
        StreamWriter {
            progress: (0..choices).map(|_| ChoiceProgress::default()).collect(),
            shape,
            tokenizer,
            prompts,
            tally,
        }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> String {
        let usage = match (self.shape.include_usage, usage) {
            (false, _) => None,
            (true, usage) => Some(usage),
        };
        to_json(&CompletionResponse {
            id: self.shape.id.clone(),
            object: "text_completion",
            created: self.shape.created,
            model: self.shape.model.clone(),
            choices,
            usage,
        })
    }

    fn text_chunk(
        &self,
        index: u32,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> String {
        self.chunk(
            vec![CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason,
            }],
            None,
        )
    }

    /// With `echo`, a choice's first chunk is its prompt (sent once its logprobs are in).
    fn echo_chunk(&mut self, index: u32) -> Option<String> {
        let i = index as usize;
        if !self.shape.echo || self.progress[i].echoed {
            return None;
        }
        self.progress[i].echoed = true;
        let prompt = &self.prompts[i / self.shape.n as usize];
        let mut offset = 0;
        let logprobs = self.shape.top_n.map(|top_n| {
            echo_logprobs(
                &self.tokenizer,
                prompt,
                &self.progress[i].prompt_logprobs,
                top_n,
                &mut offset,
            )
        });
        self.progress[i].offset = offset;
        Some(self.text_chunk(index, prompt.text.clone(), logprobs, None))
    }
}

impl ChunkWriter for StreamWriter {
    type Chunk = String;

    fn start(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn on_event(&mut self, event: ChoiceEvent) -> Vec<String> {
        match event {
            ChoiceEvent::PromptLogprobs { index, logprobs } => {
                self.progress[index as usize].prompt_logprobs.push(logprobs);
                Vec::new()
            }
            ChoiceEvent::Delta {
                index,
                text,
                tokens,
            } => {
                let mut chunks: Vec<String> = self.echo_chunk(index).into_iter().collect();
                let logprobs = self.shape.top_n.map(|top_n| {
                    let offset = &mut self.progress[index as usize].offset;
                    logprobs::generated_completion(&self.tokenizer, &tokens, top_n, offset)
                });
                chunks.push(self.text_chunk(index, text, logprobs, None));
                chunks
            }
            ChoiceEvent::Finished {
                index,
                reason,
                usage,
                ..
            } => {
                self.tally.add(index, &usage);
                let mut chunks: Vec<String> = self.echo_chunk(index).into_iter().collect();
                chunks.push(self.text_chunk(index, String::new(), None, Some(reason)));
                chunks
            }
            ChoiceEvent::Failed(_) => Vec::new(),
        }
    }

    fn finish(&mut self) -> Vec<String> {
        if !self.shape.include_usage {
            return Vec::new();
        }
        vec![self.chunk(Vec::new(), Some(self.tally.total()))]
    }
}
