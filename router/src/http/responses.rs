//! POST /v1/responses: OpenAI's Responses API over the chat path. The request's `instructions`
//! and `input` items become chat messages (`responses_input`), generation and parsing are chat
//! completions' own (`chat::start`), and the parsed reasoning, answer and tool calls come back
//! as output items (`responses_object`), whole or streamed (`responses_stream`).
//!
//! Stateless: nothing is stored, so `store` is answered false, and `previous_response_id` and
//! item references (which need stored responses) are refused with 400, as are background
//! runs, built-in tools and non-text inputs. `reasoning.effort` "none" turns the chat template's
//! thinking off (any other effort on); `chat_template_kwargs` work as in chat completions.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::anthropic_input::template_thinking;
use super::chat::{self, ChatInputs, ChatRun};
use super::errors::ApiError;
use super::json_body::read_json;
use super::openai_types::SamplingFields;
use super::responses_input::{chat_messages, chat_tool_choice, chat_tools, response_format};
use super::responses_object::{
    call_item, message_item, new_id, reasoning_item, Outcome, ResponseObject, ResponseUsage,
};
use super::responses_stream::{reasoning_tokens, ResponsesStream};
use super::sse::sse_response;
use super::validation::{check_model, unsupported};
use super::{unix_now, AppState};

/// `include` values accepted: encrypted reasoning is never produced (reasoning comes back in
/// clear, as `reasoning_text` content), so asking for it changes nothing.
const INCLUDABLE: &[&str] = &["reasoning.encrypted_content"];

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<Value>,
    /// `{"effort": ..., "summary": ...}`: effort "none" turns the chat template's thinking off,
    /// any other effort on (`anthropic_input::template_thinking`); echoed back.
    pub reasoning: Option<Value>,
    /// Accepted; nothing is stored whatever it says.
    #[allow(dead_code)]
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    pub conversation: Option<Value>,
    pub prompt: Option<Value>,
    pub background: Option<bool>,
    pub truncation: Option<String>,
    pub include: Option<Vec<String>>,
    pub top_logprobs: Option<i64>,
    pub metadata: Option<Map<String, Value>>,
    /// Extension (as in chat completions): keyword arguments of the chat template.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `temperature`, `top_p`, `stream`, `user`, and the sampling extensions chat completions
    /// take (`top_k`, `seed`, `stop`, penalties, structured-output fields, ...).
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

pub async fn handler(State(app): State<AppState>, request: Request) -> Response {
    match handle(app, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

/// Refuses what this server cannot do rather than ignoring it.
fn refuse_unsupported(body: &ResponsesRequest) -> Result<(), ApiError> {
    if body.previous_response_id.is_some() || body.conversation.is_some() {
        let param = if body.conversation.is_some() {
            "conversation"
        } else {
            "previous_response_id"
        };
        return Err(unsupported(
            param,
            "This server stores no responses or conversations: send the whole conversation in `input`.",
        ));
    }
    if body.prompt.is_some() {
        return Err(unsupported(
            "prompt",
            "Stored prompt templates are not supported.",
        ));
    }
    if body.background == Some(true) {
        return Err(unsupported(
            "background",
            "Background responses are not supported.",
        ));
    }
    if body.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(unsupported(
            "truncation",
            "Only `truncation: \"disabled\"` is supported: a conversation longer than the context is refused.",
        ));
    }
    if body.top_logprobs.is_some_and(|n| n != 0) {
        return Err(unsupported(
            "top_logprobs",
            "Logprobs are not supported on /v1/responses yet; use /v1/chat/completions.",
        ));
    }
    if let Some(other) = body
        .include
        .iter()
        .flatten()
        .find(|i| !INCLUDABLE.contains(&i.as_str()))
    {
        return Err(unsupported(
            "include",
            &format!("`include` value {other:?} is not supported."),
        ));
    }
    if body.sampling.n.is_some_and(|n| n != 1) {
        return Err(unsupported(
            "n",
            "A response has one output: `n` must be 1.",
        ));
    }
    if body.sampling.structured.response_format.is_some() {
        return Err(ApiError::invalid_param(
            "response_format",
            "`response_format` is chat completions' field: use `text.format` here.",
        ));
    }
    if let Some(m) = body.max_output_tokens.filter(|&m| m < 1) {
        return Err(ApiError::invalid_param(
            "max_output_tokens",
            format!("`max_output_tokens` must be at least 1, got {m}."),
        ));
    }
    Ok(())
}

/// The chat template's keyword arguments with `reasoning.effort`'s thinking switch.
fn thinking_kwargs(
    reasoning: Option<&Value>,
    kwargs: Option<Map<String, Value>>,
) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = kwargs.unwrap_or_default();
    match reasoning.and_then(|r| r.get("effort")) {
        None | Some(Value::Null) => {}
        Some(Value::String(effort)) => template_thinking(&mut kwargs, effort != "none"),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "reasoning.effort",
                "`reasoning.effort` must be a string.",
            ))
        }
    }
    Ok(kwargs)
}

async fn handle(app: AppState, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut body: ResponsesRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    refuse_unsupported(&body)?;
    let messages = chat_messages(body.instructions.as_deref(), body.input.as_ref())?;
    let tools = body.tools.as_deref().map(chat_tools).transpose()?;
    body.sampling.structured.response_format = response_format(body.text.as_ref())?;
    let parallel_calls = body.parallel_tool_calls.unwrap_or(true);
    let user = body.sampling.user.take();
    let inputs = ChatInputs {
        messages: Some(messages),
        tools,
        tool_choice: chat_tool_choice(body.tool_choice.as_ref())?,
        parallel_tool_calls: Some(parallel_calls),
        max_tokens: body.max_output_tokens.or(body.sampling.max_tokens),
        sampling: std::mem::take(&mut body.sampling),
        logprobs: None,
        top_logprobs: None,
        chat_template_kwargs: Some(thinking_kwargs(
            body.reasoning.as_ref(),
            body.chat_template_kwargs.take(),
        )?),
        add_generation_prompt: None,
    };
    let ChatRun {
        v, output, events, ..
    } = chat::start(&app, inputs, arrived).await?;
    let shape = ResponseObject {
        id: new_id("resp"),
        object: "response",
        created_at: unix_now(),
        status: "in_progress",
        background: false,
        error: None,
        incomplete_details: None,
        instructions: body.instructions,
        max_output_tokens: v.max_tokens,
        model: app.cfg.served_model_name.clone(),
        output: Vec::new(),
        parallel_tool_calls: parallel_calls,
        previous_response_id: None,
        reasoning: json!({
            "effort": body.reasoning.as_ref().and_then(|r| r.get("effort")).cloned().unwrap_or(Value::Null),
            "summary": Value::Null,
        }),
        store: false,
        temperature: v.sampling.temperature,
        text: json!({"format": body.text.as_ref().and_then(|t| t.get("format")).cloned().unwrap_or(json!({"type": "text"}))}),
        tool_choice: body.tool_choice.unwrap_or_else(|| json!("auto")),
        tools: body.tools.unwrap_or_default(),
        top_p: v.sampling.top_p,
        truncation: "disabled",
        usage: None,
        user,
        metadata: body.metadata.unwrap_or_default(),
    };
    if v.stream {
        let writer = ResponsesStream::new(shape, output.streaming(), Arc::clone(&app.tokenizer));
        return Ok(sse_response(events, writer));
    }
    let (out, message, finish_reason) = chat::whole_answer(events, &output).await?;
    let outcome = Outcome::of(finish_reason);
    let mut items = Vec::new();
    let reasoning = message.reasoning_content.unwrap_or_default();
    if !reasoning.is_empty() {
        items.push(reasoning_item(&new_id("rs"), &reasoning, "completed"));
    }
    let calls = message.tool_calls.unwrap_or_default();
    let answer = message.content.unwrap_or_default();
    if !answer.is_empty() || (items.is_empty() && calls.is_empty()) {
        items.push(message_item(&new_id("msg"), Some(&answer), "completed"));
    }
    for call in &calls {
        items.push(call_item(
            &new_id("fc"),
            &call.id,
            &call.function.name,
            &call.function.arguments,
            "completed",
        ));
    }
    if let Some(last) = items.last_mut() {
        last["status"] = json!(outcome.item_status());
    }
    let usage = out
        .usage
        .unwrap_or_else(|| super::openai_types::Usage::new(0, 0, 0));
    let usage = ResponseUsage::new(&usage, reasoning_tokens(&app.tokenizer, &reasoning));
    Ok(Json(shape.ended(outcome, items, usage)).into_response())
}
