//! `X-Request-Id` on every response, as OpenAI's API sends it (the official clients expose it as
//! `_request_id`). A usable id the client sent is kept, so that a gateway can follow one request
//! through its own logs and ours; otherwise the server makes one. Everything logged while the
//! request is handled carries the id (a tracing span).

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";
/// Longest client id kept; a longer one (or one with spaces or control characters) is replaced.
pub const MAX_LEN: usize = 128;

/// The client's id when it is 1..=MAX_LEN visible ASCII characters, else a new `req-<uuid>`.
pub fn choose(sent: Option<&HeaderValue>) -> String {
    sent.and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_LEN && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(
            || format!("req-{}", uuid::Uuid::new_v4().simple()),
            str::to_owned,
        )
}

pub async fn request_id(request: Request, next: Next) -> Response {
    let id = choose(request.headers().get(HEADER));
    let span = tracing::info_span!("request", id = %id, method = %request.method(), path = %request.uri().path());
    let mut response = next.run(request).instrument(span).await;
    // Visible ASCII only (checked above or generated), so always a valid header value.
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(HEADER, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_usable_client_id_and_replaces_others() {
        let keep = HeaderValue::from_static("gw-7f3a:42");
        assert_eq!(choose(Some(&keep)), "gw-7f3a:42");
        let long = HeaderValue::from_str(&"a".repeat(MAX_LEN + 1)).unwrap();
        let spaced = HeaderValue::from_static("two words");
        let empty = HeaderValue::from_static("");
        let opaque = HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap();
        for bad in [
            Some(&long),
            Some(&spaced),
            Some(&empty),
            Some(&opaque),
            None,
        ] {
            let made = choose(bad);
            assert!(made.starts_with("req-") && made.len() == 36, "{made}");
        }
        assert_ne!(choose(None), choose(None));
        let edge = HeaderValue::from_str(&"b".repeat(MAX_LEN)).unwrap();
        assert_eq!(choose(Some(&edge)).len(), MAX_LEN);
    }
}
