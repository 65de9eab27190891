//! Optional API key: `Authorization: Bearer <key>` on the /v1 routes, or `x-api-key: <key>` as
//! Anthropic's clients send it.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use super::AppState;

/// Compares without stopping at the first differing byte, so the response time does not tell
/// an attacker how much of a guess was right. (The length is not secret.)
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

pub async fn require_api_key(
    State(app): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &app.cfg.api_key {
        let headers = request.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn equality() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
