//! POST /v1/chat/completions: messages rendered through the model's chat template, `n`
//! samples, chat logprobs, streaming or not.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use serde_json::{Map, Value};

use crate::tokenizer::TokenizerBundle;

use super::chat_output::{OutputSetup, StreamingChoice};
use super::errors::ApiError;
use super::generation::{
    self, ChoiceEvent, ChoiceOutput, GeneratedToken, GenerationContext, UsageTally,
};
use super::json_body::read_json;
use super::logprobs;
use super::openai_types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatMessage, ChatRequest, ChatResponse,
    SamplingFields, Usage,
};
use super::prompt::blocking;
use super::sse::{sse_response, to_json, ChunkWriter};
use super::structured_output;
use super::tool_choice::ToolChoice;
use super::validation::{
    check_logprobs, check_model, fit_context, generate_requests, unsupported, validate_sampling,
    Validated,
};
use super::{unix_now, AppState};
use crate::parsers::ToolSet;

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

pub async fn handler(State(app): State<AppState>, request: Request) -> Response {
    match handle(app, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

/// The conversation checked (not empty, each message as `normalize_message` wants it).
pub(super) fn normalize_messages(messages: Vec<Value>) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must not be empty.",
        ));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| normalize_message(i, m))
        .collect()
}

/// Checks one message and flattens its `content`: chat templates expect a string, so a list
/// of text parts becomes their texts joined by newlines. Other keys (`tool_calls`,
/// `tool_call_id`, `name`, ...) pass through to the template untouched.
fn normalize_message(i: usize, message: Value) -> Result<Value, ApiError> {
    let param = format!("messages[{i}]");
    let Value::Object(mut m) = message else {
        return Err(ApiError::invalid_param(
            &param,
            format!("`{param}` must be an object."),
        ));
    };
    match m.get("role").and_then(Value::as_str) {
        Some(role) if ROLES.contains(&role) => {}
        Some(role) => {
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}.role` must be one of {ROLES:?}, got {role:?}."),
            ))
        }
        None => {
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}.role` is required and must be a string."),
            ))
        }
    }
    let content = match m.remove("content") {
        None | Some(Value::Null) => Value::Null,
        Some(Value::String(s)) => Value::String(s),
        Some(Value::Array(parts)) => {
            let texts = parts
                .iter()
                .map(|part| match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => Ok(text),
                    _ => Err(ApiError::invalid_param(
                        &param,
                        format!("`{param}.content` parts must be {{\"type\": \"text\", \"text\": string}}; other part types are not supported."),
                    )),
                })
                .collect::<Result<Vec<&str>, ApiError>>()?;
            Value::String(texts.join("\n"))
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}.content` must be a string or a list of text parts."),
            ))
        }
    };
    // Only an assistant turn carrying tool calls may go without content.
    if content.is_null()
        && !(m.get("role") == Some(&Value::from("assistant")) && m.contains_key("tool_calls"))
    {
        return Err(ApiError::invalid_param(
            &param,
            format!("`{param}.content` is required."),
        ));
    }
    m.insert("content".into(), content);
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        calls.iter_mut().for_each(parse_tool_call_arguments);
    }
    Ok(Value::Object(m))
}

/// OpenAI sends a tool call's `arguments` as a JSON string; Hugging Face chat templates iterate
/// over them as a mapping (`arguments.items()`), so a string that holds a JSON object is
/// parsed (as vLLM does). Anything else is left for the template to print.
fn parse_tool_call_arguments(call: &mut Value) {
    let Some(arguments) = call
        .get_mut("function")
        .and_then(|f| f.get_mut("arguments"))
    else {
        return;
    };
    if let Some(Ok(parsed @ Value::Object(_))) =
        arguments.as_str().map(serde_json::from_str::<Value>)
    {
        *arguments = parsed;
    }
}

/// Renders the conversation and tokenizes it (generation requests add no special tokens: the
/// template writes them). The rendered text comes back too: its end says whether generation
/// starts inside the model's thinking.
pub(super) async fn chat_prompt(
    tokenizer: &Arc<TokenizerBundle>,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    kwargs: Map<String, Value>,
    add_special_tokens: bool,
) -> Result<(Vec<i32>, String), ApiError> {
    let tokenizer = Arc::clone(tokenizer);
    blocking(move || {
        let template = tokenizer.chat_template().ok_or_else(|| {
            ApiError::invalid("This model has no chat template; use /v1/completions.")
        })?;
        let text = template
            .render(&messages, tools.as_deref(), add_generation_prompt, &kwargs)
            .map_err(|e| ApiError::invalid_param("messages", e.0))?;
        let ids = tokenizer
            .encode(&text, add_special_tokens)
            .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
        Ok((ids, text))
    })
    .await?
}

struct Shape {
    id: String,
    created: u64,
    model: String,
    n: u32,
    top_n: Option<u32>,
    include_usage: bool,
}

/// What a chat-shaped request asks (chat completions, and the Responses API in chat terms).
pub(super) struct ChatInputs {
    pub messages: Option<Vec<Value>>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub sampling: SamplingFields,
    /// `max_completion_tokens` (or `max_output_tokens`), else `max_tokens`.
    pub max_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub add_generation_prompt: Option<bool>,
}

/// A chat-shaped request checked, rendered and submitted: its generation's events, and what
/// turns them into an answer.
pub(super) struct ChatRun {
    pub v: Validated,
    pub top_n: Option<u32>,
    /// The rendered conversation's length in tokens.
    pub prompt_tokens: u32,
    pub output: OutputSetup,
    pub events: BoxStream<'static, ChoiceEvent>,
}

async fn handle(app: AppState, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body: ChatRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    let inputs = ChatInputs {
        messages: body.messages,
        tools: body.tools,
        tool_choice: body.tool_choice,
        parallel_tool_calls: body.parallel_tool_calls,
        max_tokens: body.max_completion_tokens.or(body.sampling.max_tokens),
        sampling: body.sampling,
        logprobs: body.logprobs,
        top_logprobs: body.top_logprobs,
        chat_template_kwargs: body.chat_template_kwargs,
        add_generation_prompt: body.add_generation_prompt,
    };
    let ChatRun {
        v,
        top_n,
        output,
        events,
        ..
    } = start(&app, inputs, arrived).await?;
    let shape = Shape {
        id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        created: unix_now(),
        model: app.cfg.served_model_name.clone(),
        n: v.n,
        top_n,
        include_usage: v.include_usage,
    };
    if v.stream {
        let tally = UsageTally::new(1, v.n);
        let choices = (0..v.n)
            .map(|_| StreamedChoice {
                parser: output.streaming(),
                held_tokens: Vec::new(),
            })
            .collect();
        return Ok(sse_response(
            events,
            StreamWriter {
                shape,
                tokenizer: Arc::clone(&app.tokenizer),
                tally,
                choices,
            },
        ));
    }
    let outputs = generation::collect(events, v.n as usize).await?;
    Ok(Json(full_response(&shape, &app.tokenizer, &output, outputs)).into_response())
}

/// Checks a chat-shaped request, renders its conversation through the chat template and submits
/// its samples to the engine.
pub(super) async fn start(
    app: &AppState,
    inputs: ChatInputs,
    arrived: Instant,
) -> Result<ChatRun, ApiError> {
    let info = app.model_info();
    let tool_choice = ToolChoice::from_request(
        inputs.tool_choice.as_ref(),
        inputs.tools.as_deref(),
        app.cfg.tool_call_parser.is_some(),
    )?;
    let top_n = match (inputs.logprobs, inputs.top_logprobs) {
        (Some(true), top) => Some(check_logprobs("top_logprobs", top.unwrap_or(0))?),
        // `top_logprobs: 0` without logprobs asks for nothing; more needs `logprobs: true`.
        (_, Some(top)) if top != 0 => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true.",
            ))
        }
        _ => None,
    };
    let v = validate_sampling(
        &inputs.sampling,
        inputs.max_tokens,
        top_n,
        app.limits(),
        &app.cfg.sampling_defaults,
        &info,
    )?;
    let messages = inputs
        .messages
        .ok_or_else(|| ApiError::invalid_param("messages", "`messages` is required."))?;
    let messages = normalize_messages(messages)?;
    let parallel_calls = inputs.parallel_tool_calls.unwrap_or(true);
    let forced = tool_choice.forced_constraint(
        app.cfg.tool_call_parser,
        inputs.tools.as_deref(),
        parallel_calls,
    )?;
    if let Some(forced) = &forced {
        if let Some(other) = &v.constraint {
            return Err(unsupported(
                forced.param,
                &format!(
                    "A forced `tool_choice` cannot be combined with `{}`.",
                    other.param
                ),
            ));
        }
        if v.min_tokens > 0 {
            // The calls may be complete, allowing only a stop token, before the minimum.
            return Err(unsupported(
                "min_tokens",
                "`min_tokens` cannot be combined with a forced `tool_choice`.",
            ));
        }
    }
    let tool_set = match (app.cfg.tool_call_parser, &inputs.tools, &tool_choice) {
        (Some(kind), Some(tools), choice) if *choice != ToolChoice::None => {
            Some((kind, ToolSet::from_request(tools, choice.only())))
        }
        _ => None,
    };
    let (prompt_ids, rendered) = chat_prompt(
        &app.tokenizer,
        messages,
        tool_choice.rendered_tools(inputs.tools),
        inputs.add_generation_prompt.unwrap_or(true),
        inputs.chat_template_kwargs.unwrap_or_default(),
        false,
    )
    .await?;
    let output = OutputSetup::new(
        app.cfg.reasoning_parser,
        &rendered,
        tool_set,
        parallel_calls,
        Arc::clone(&app.metrics),
    );
    let max_new = fit_context(prompt_ids.len(), v.max_tokens, info.max_context)?;
    let constraint = match v.constraint.clone().or(forced) {
        Some(c) => Some(
            structured_output::compile(&app.grammar, &app.metrics, c, output.starts_thinking())
                .await?,
        ),
        None => None,
    };
    let requests = generate_requests(
        &prompt_ids,
        max_new,
        &v,
        app.tokenizer.eos_token_ids(),
        false,
        constraint.as_ref(),
    );
    let streams = generation::submit_all(app.engine.as_ref(), requests)?;

    let ctx = GenerationContext::for_request(&app.tokenizer, &app.metrics, &v, arrived);
    let choices = streams
        .into_iter()
        .enumerate()
        .map(|(i, s)| generation::choice_events(Arc::clone(&ctx), i as u32, &prompt_ids, s))
        .collect();
    Ok(ChatRun {
        v,
        top_n,
        prompt_tokens: prompt_ids.len() as u32,
        output,
        events: generation::merge(choices),
    })
}

/// A one-sample generation run to its end: its whole output, and the message and finish reason
/// the output parsers read from it.
pub(super) async fn whole_answer(
    events: BoxStream<'static, ChoiceEvent>,
    output: &OutputSetup,
) -> Result<(ChoiceOutput, ChatMessage, Option<&'static str>), ApiError> {
    let out = generation::collect(events, 1)
        .await?
        .pop()
        .expect("one choice was collected");
    let (message, finish_reason) = output.message(&out.text, out.finish_reason);
    Ok((out, message, finish_reason))
}

fn full_response(
    shape: &Shape,
    tokenizer: &TokenizerBundle,
    output: &OutputSetup,
    outputs: Vec<ChoiceOutput>,
) -> ChatResponse {
    let mut tally = UsageTally::new(1, shape.n);
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(i, out)| {
            let index = i as u32;
            if let Some(usage) = &out.usage {
                tally.add(index, usage);
            }
            let (message, finish_reason) = output.message(&out.text, out.finish_reason);
            ChatChoice {
                index,
                message,
                logprobs: shape
                    .top_n
                    .map(|top_n| logprobs::chat(tokenizer, &out.tokens, top_n)),
                finish_reason,
            }
        })
        .collect();
    ChatResponse {
        id: shape.id.clone(),
        object: "chat.completion",
        created: shape.created,
        model: shape.model.clone(),
        choices,
        usage: tally.total(),
    }
}

struct StreamWriter {
    shape: Shape,
    tokenizer: Arc<TokenizerBundle>,
    tally: UsageTally,
    choices: Vec<StreamedChoice>,
}

struct StreamedChoice {
    parser: StreamingChoice,
    /// Tokens whose text the parser is still holding: their logprobs go with the next chunk.
    held_tokens: Vec<GeneratedToken>,
}

impl StreamWriter {
    /// One chunk per delta; the held tokens' logprobs ride on the first.
    fn delta_chunks(
        &mut self,
        index: u32,
        deltas: Vec<ChatDelta>,
        finish_reason: Option<&'static str>,
    ) -> Vec<String> {
        if deltas.is_empty() && finish_reason.is_none() {
            return Vec::new();
        }
        let held = std::mem::take(&mut self.choices[index as usize].held_tokens);
        let mut logprobs = self
            .shape
            .top_n
            .map(|top_n| logprobs::chat(&self.tokenizer, &held, top_n));
        let count = deltas.len();
        let mut chunks: Vec<String> = deltas
            .into_iter()
            .enumerate()
            .map(|(i, delta)| {
                let choice = ChatChunkChoice {
                    index,
                    delta,
                    logprobs: logprobs.take(),
                    finish_reason: if i + 1 == count { finish_reason } else { None },
                };
                self.chunk(vec![choice], None)
            })
            .collect();
        if count == 0 {
            if let Some(reason) = finish_reason {
                let choice = ChatChunkChoice {
                    index,
                    delta: ChatDelta::default(),
                    logprobs: logprobs.take().filter(|l| !l.content.is_empty()),
                    finish_reason: Some(reason),
                };
                chunks.push(self.chunk(vec![choice], None));
            }
        }
        chunks
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> String {
        to_json(&ChatChunk {
            id: self.shape.id.clone(),
            object: "chat.completion.chunk",
            created: self.shape.created,
            model: self.shape.model.clone(),
            choices,
            usage: self.shape.include_usage.then_some(usage),
        })
    }
}

impl ChunkWriter for StreamWriter {
    type Chunk = String;

    /// Every choice opens with the assistant role, as OpenAI streams do.
    fn start(&mut self) -> Vec<String> {
        (0..self.shape.n)
            .map(|index| {
                let delta = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..ChatDelta::default()
                };
                self.chunk(
                    vec![ChatChunkChoice {
                        index,
                        delta,
                        logprobs: None,
                        finish_reason: None,
                    }],
                    None,
                )
            })
            .collect()
    }

    fn on_event(&mut self, event: ChoiceEvent) -> Vec<String> {
        match event {
            ChoiceEvent::Delta {
                index,
                text,
                tokens,
            } => {
                let choice = &mut self.choices[index as usize];
                choice.held_tokens.extend(tokens);
                let deltas = choice.parser.on_text(&text);
                self.delta_chunks(index, deltas, None)
            }
            ChoiceEvent::Finished {
                index,
                reason,
                usage,
                ..
            } => {
                self.tally.add(index, &usage);
                let choice = &mut self.choices[index as usize];
                let deltas = choice.parser.on_finish();
                let reason = choice.parser.finish_reason(reason);
                let mut chunks = self.delta_chunks(index, deltas, None);
                chunks.extend(self.delta_chunks(index, Vec::new(), Some(reason)));
                chunks
            }
            ChoiceEvent::PromptLogprobs { .. } | ChoiceEvent::Failed(_) => Vec::new(),
        }
    }

    fn finish(&mut self) -> Vec<String> {
        if !self.shape.include_usage {
            return Vec::new();
        }
        vec![self.chunk(Vec::new(), Some(self.tally.total()))]
    }
}
