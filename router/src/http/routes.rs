//! The small endpoints (models, health, metrics, version), fallbacks, and request counting.

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::errors::ApiError;
use super::openai_types::{ModelCard, ModelList};
use super::AppState;

pub async fn models(State(app): State<AppState>) -> Json<ModelList> {
    let info = app.model_info();
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: app.cfg.served_model_name.clone(),
            object: "model",
            created: app.started_at,
            owned_by: "nsaserve",
            max_model_len: info.max_context,
        }],
    })
}

/// 200 only while the engine can serve; load balancers take the server out otherwise.
pub async fn health(State(app): State<AppState>) -> Response {
    if app.engine.healthy() {
        StatusCode::OK.into_response()
    } else {
        ApiError::unavailable("The engine is not healthy.").into_response()
    }
}

pub async fn metrics(State(app): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

pub async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

pub async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!(
        "No route for {} {}.",
        request.method(),
        request.uri().path()
    ))
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// Counts every response by route (the route pattern, so arbitrary paths cannot create
/// unbounded label values) and status.
pub async fn count_requests(State(app): State<AppState>, request: Request, next: Next) -> Response {
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    app.metrics
        .observe_request(&endpoint, response.status().as_u16());
    response
}
