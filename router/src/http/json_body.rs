//! Reading a JSON request body ourselves rather than with axum's `Json` extractor, whose
//! rejections are plain text with status 422 or 413: clients of an OpenAI-compatible server
//! expect a 400 (or 413) carrying an OpenAI error object.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;

use super::errors::ApiError;

/// Reads the body within `limit` bytes and `timeout` (a client trickling its body slowly would
/// otherwise hold a connection and a task for as long as it likes).
pub async fn read_json<T: DeserializeOwned>(
    request: Request,
    limit: usize,
    timeout: Duration,
) -> Result<T, ApiError> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::body_too_large(limit));
    }
    let body: Body = request.into_body();
    let collected = tokio::time::timeout(timeout, Limited::new(body, limit).collect())
        .await
        .map_err(|_| ApiError::body_timeout(timeout))?;
    let bytes = match collected {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return Err(ApiError::body_too_large(limit))
        }
        Err(e) => {
            return Err(ApiError::invalid(format!(
                "Could not read the request body: {e}"
            )))
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("Invalid JSON body: {e}")))
}
