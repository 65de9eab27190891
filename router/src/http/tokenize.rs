//! POST /tokenize and /detokenize (the shape vLLM serves them in): a gateway or client counts a
//! prompt's tokens, or reads ids back as text, with the server's own tokenizer and chat
//! template, without generating anything.
//!
//! /tokenize takes either `prompt` (a string, tokenized as /v1/completions tokenizes it: with
//! the tokenizer's special tokens unless `add_special_tokens` is false) or `messages` (rendered
//! as /v1/chat/completions renders them, `tools`, `add_generation_prompt` and
//! `chat_template_kwargs` included; no special tokens added unless asked, since the template
//! writes them). So `count` is the prompt length a generation request would see.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::chat::{chat_prompt, normalize_messages};
use super::errors::ApiError;
use super::json_body::read_json;
use super::prompt::blocking;
use super::validation::{check_model, check_token_ids};
use super::AppState;

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Value>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub tools: Option<Vec<Value>>,
    /// Also return each token as the text it decodes to on its own.
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Option<Vec<i64>>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub async fn tokenize(State(app): State<AppState>, request: Request) -> Response {
    match handle_tokenize(app, request).await {
        Ok(body) => Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn detokenize(State(app): State<AppState>, request: Request) -> Response {
    match handle_detokenize(app, request).await {
        Ok(body) => Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn handle_tokenize(app: AppState, request: Request) -> Result<TokenizeResponse, ApiError> {
    let body: TokenizeRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    let tokens = match (body.prompt, body.messages) {
        (Some(text), None) => {
            let add_special = body.add_special_tokens.unwrap_or(true);
            let tokenizer = Arc::clone(&app.tokenizer);
            blocking(move || tokenizer.encode(&text, add_special))
                .await?
                .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?
        }
        (None, Some(messages)) => {
            let (ids, _) = chat_prompt(
                &app.tokenizer,
                normalize_messages(messages)?,
                body.tools,
                body.add_generation_prompt.unwrap_or(true),
                body.chat_template_kwargs.unwrap_or_default(),
                body.add_special_tokens.unwrap_or(false),
            )
            .await?;
            ids
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "Give either `prompt` or `messages`, not both.",
            ))
        }
        (None, None) => return Err(ApiError::invalid("`prompt` or `messages` is required.")),
    };
    let token_strs = if body.return_token_strs.unwrap_or(false) {
        let tokenizer = Arc::clone(&app.tokenizer);
        let ids = tokens.clone();
        Some(
            blocking(move || {
                ids.iter()
                    .map(|&id| tokenizer.decode(&[id], false))
                    .collect()
            })
            .await?,
        )
    } else {
        None
    };
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: app.model_info().max_context,
        tokens,
        token_strs,
    })
}

async fn handle_detokenize(
    app: AppState,
    request: Request,
) -> Result<DetokenizeResponse, ApiError> {
    let body: DetokenizeRequest =
        read_json(request, app.cfg.max_body_bytes, app.cfg.body_timeout).await?;
    check_model(body.model.as_deref(), &app.cfg.served_model_name)?;
    let tokens = body
        .tokens
        .ok_or_else(|| ApiError::invalid_param("tokens", "`tokens` is required."))?;
    let ids = check_token_ids("tokens", &tokens, app.model_info().vocab_size)?;
    let tokenizer = Arc::clone(&app.tokenizer);
    let prompt = blocking(move || tokenizer.decode(&ids, false)).await?;
    Ok(DetokenizeResponse { prompt })
}
