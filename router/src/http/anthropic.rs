//! POST /v1/messages: Anthropic's Messages API over the chat path (as vLLM serves it), for
//! clients built on Anthropic's SDKs (coding agents among them). `system` and `messages`
//! become chat messages (`anthropic_input`), generation and parsing are chat completions' own
//! (`chat::start`), and the parsed thinking, answer and tool calls come back as `thinking`,
//! `text` and `tool_use` content blocks, whole or streamed (`anthropic_stream`). Errors take
//! Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the same statuses
//! as the other endpoints; the API key may come as `x-api-key` (see `auth`).
//! POST /v1/messages/count_tokens counts the prompt such a request renders.

use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::anthropic_input::{chat_messages, chat_tool_choice, chat_tools, thinking_kwargs};
use super::anthropic_stream::MessagesStream;
use super::chat::{self, ChatInputs, ChatRun};
use super::errors::ApiError;
use super::json_body::read_json;
use super::openai_types::{SamplingFields, StopInput, ToolCall, Usage};
use super::responses_object::new_id;
use super::sse::sse_response;
use super::tool_choice::ToolChoice;
use super::validation::{check_model, unsupported};
use super::AppState;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<Value>>,
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled" | "disabled", "budget_tokens": n}`: the chat template's thinking
    /// switch (`anthropic_input::thinking_kwargs`).
    pub thinking: Option<Value>,
    /// `{"user_id": ...}`: accepted, not used.
    #[allow(dead_code)]
    pub metadata: Option<Value>,
    /// Extension (as in chat completions): keyword arguments of the chat template.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `max_tokens`, `temperature`, `top_p`, `top_k`, `stream`, and the sampling extensions
    /// chat completions take.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Anthropic's error object.
#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

/// An error as Anthropic's body, by status.
pub fn error_body(e: &ApiError) -> String {
    let kind = match e.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::REQUEST_TIMEOUT => "timeout_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    };
    let message = match &e.param {
        Some(param) if !e.message.contains(param.as_str()) => format!("{param}: {}", e.message),
        _ => e.message.clone(),
    };
    let body = ErrorBody {
        kind: "error",
        error: ErrorDetail {
            kind,
            message: &message,
        },
    };
    serde_json::to_string(&body).expect("error bodies serialize")
}

/// A handler's result, errors in Anthropic's shape.
fn respond(result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(response) => response,
        Err(e) => {
            // The status and headers (Retry-After) of the OpenAI-shaped error, Anthropic's body.
            let body = error_body(&e);
            let mut response = e.into_response();
            *response.body_mut() = axum::body::Body::from(body);
            response
        }
    }
}

pub async fn handler(State(app): State<AppState>, request: Request) -> Response {
    respond(handle(app, request).await)
}

/// POST /v1/messages/count_tokens: `{"input_tokens": n}`, the length of the prompt a
/// /v1/messages request with the same system, messages, tools and thinking would render.
pub async fn count_tokens(State(app): State<AppState>, request: Request) -> Response {
    respond(handle_count(app, request).await)
}

async fn handle_count(app: AppState, request: Request) -> Result<Response, ApiError> {
    let body: MessagesRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    let messages = chat_messages(body.system.as_ref(), body.messages.as_deref())?;
    let messages = chat::normalize_messages(messages)?;
    let tools = body.tools.as_deref().map(chat_tools).transpose()?;
    let (choice, _) = chat_tool_choice(body.tool_choice.as_ref())?;
    let choice = ToolChoice::from_request(
        choice.as_ref(),
        tools.as_deref(),
        app.cfg.tool_call_parser.is_some(),
    )?;
    let mut kwargs = body.chat_template_kwargs.unwrap_or_default();
    thinking_kwargs(body.thinking.as_ref(), &mut kwargs)?;
    let rendered_tools = choice.rendered_tools(tools);
    let (ids, _) = chat::chat_prompt(
        &app.tokenizer,
        messages,
        rendered_tools,
        true,
        kwargs,
        false,
    )
    .await?;
    Ok(Json(json!({"input_tokens": ids.len()})).into_response())
}

#[derive(Debug, Serialize)]
pub struct MessagesUsage {
    /// Prompt tokens not read from the prefix cache.
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub cache_read_input_tokens: u32,
    pub cache_creation_input_tokens: u32,
}

impl MessagesUsage {
    pub fn new(usage: &Usage) -> MessagesUsage {
        let cached = usage.prompt_tokens_details.cached_tokens;
        MessagesUsage {
            input_tokens: usage.prompt_tokens - cached.min(usage.prompt_tokens),
            output_tokens: usage.completion_tokens,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
        }
    }
}

#[derive(Debug, Serialize)]
struct MessageResponse {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: String,
    content: Vec<Value>,
    stop_reason: &'static str,
    stop_sequence: Option<String>,
    usage: MessagesUsage,
}

/// Anthropic's stop reason for a finish reason (after the tool parser's "tool_calls").
pub fn stop_reason(finish_reason: Option<&str>, stop: Option<&str>) -> &'static str {
    match finish_reason {
        Some("tool_calls") => "tool_use",
        Some("length") => "max_tokens",
        _ if stop.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// A tool call as a `tool_use` block; its arguments (a JSON object, as the tool parser writes
/// them) become `input`.
pub fn tool_use_block(id: &str, name: &str, arguments: &str) -> Value {
    let input = match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    };
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

/// An id in Anthropic's style for a tool call.
pub fn tool_use_id() -> String {
    let id = new_id("toolu");
    id[..30].to_owned()
}

async fn handle(app: AppState, request: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut body: MessagesRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    if body.sampling.max_tokens.is_none() {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "`max_tokens` is required.",
        ));
    }
    if body.sampling.n.is_some_and(|n| n != 1) {
        return Err(unsupported("n", "A message has one answer: `n` must be 1."));
    }
    let messages = chat_messages(body.system.as_ref(), body.messages.as_deref())?;
    let tools = body.tools.as_deref().map(chat_tools).transpose()?;
    let (tool_choice, parallel) = chat_tool_choice(body.tool_choice.as_ref())?;
    let mut kwargs = body.chat_template_kwargs.take().unwrap_or_default();
    thinking_kwargs(body.thinking.as_ref(), &mut kwargs)?;
    if let Some(stops) = body.stop_sequences.take() {
        if body.sampling.stop.is_some() {
            return Err(ApiError::invalid_param(
                "stop",
                "Send `stop_sequences` or `stop`, not both.",
            ));
        }
        body.sampling.stop = Some(StopInput::Many(stops));
    }
    let inputs = ChatInputs {
        messages: Some(messages),
        tools,
        tool_choice,
        parallel_tool_calls: parallel,
        max_tokens: body.sampling.max_tokens,
        sampling: body.sampling,
        logprobs: None,
        top_logprobs: None,
        chat_template_kwargs: Some(kwargs),
        add_generation_prompt: None,
    };
    let ChatRun {
        v,
        prompt_tokens,
        output,
        events,
        ..
    } = chat::start(&app, inputs, arrived).await?;
    let id = new_id("msg");
    let model = app.cfg.served_model_name.clone();
    if v.stream {
        let writer = MessagesStream::new(id, model, prompt_tokens, output.streaming());
        return Ok(sse_response(events, writer));
    }
    let (out, message, finish_reason) = chat::whole_answer(events, &output).await?;
    let mut content = Vec::new();
    if let Some(thinking) = message.reasoning_content.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
    if let Some(text) = message.content.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for ToolCall { function, .. } in message.tool_calls.unwrap_or_default() {
        content.push(tool_use_block(
            &tool_use_id(),
            &function.name,
            &function.arguments,
        ));
    }
    let usage = out.usage.unwrap_or_else(|| Usage::new(prompt_tokens, 0, 0));
    let response = MessageResponse {
        id,
        kind: "message",
        role: "assistant",
        model,
        content,
        stop_reason: stop_reason(finish_reason, out.stop.as_deref()),
        stop_sequence: out.stop,
        usage: MessagesUsage::new(&usage),
    };
    Ok(Json(response).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_in_anthropics_shape() {
        let body: Value = serde_json::from_str(&error_body(&ApiError::invalid_param(
            "max_tokens",
            "`max_tokens` is required.",
        )))
        .unwrap();
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "`max_tokens` is required."}})
        );
        let body: Value = serde_json::from_str(&error_body(&ApiError::overloaded("busy"))).unwrap();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        let body: Value =
            serde_json::from_str(&error_body(&ApiError::invalid_param("tools[0]", "bad"))).unwrap();
        assert_eq!(body["error"]["message"], "tools[0]: bad");
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop_reason(Some("tool_calls"), None), "tool_use");
        assert_eq!(stop_reason(Some("length"), None), "max_tokens");
        assert_eq!(stop_reason(Some("stop"), Some("END")), "stop_sequence");
        assert_eq!(stop_reason(Some("stop"), None), "end_turn");
        assert_eq!(MessagesUsage::new(&Usage::new(10, 3, 4)).input_tokens, 6);
        let id = tool_use_id();
        assert!(id.starts_with("toolu_") && id.len() == 30);
    }
}
