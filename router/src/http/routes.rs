//! The small endpoints (models, one model, health, metrics, version), fallbacks, and request counting.

use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::errors::ApiError;
use super::openai_types::{ModelCard, ModelList};
use super::AppState;

fn model_card(app: &AppState) -> ModelCard {
    ModelCard {
        id: app.cfg.served_model_name.clone(),
        object: "model",
        created: app.started_at,
        owned_by: "nsaserve",
        max_model_len: app.model_info().max_context,
    }
}

pub async fn models(State(app): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&app)],
    })
}

/// GET /v1/models/{model} (the OpenAI client's `models.retrieve`): the served model, or a 404
/// naming the model asked for. The name may hold slashes ("org/name").
pub async fn model(State(app): State<AppState>, Path(model): Path<String>) -> Response {
    if model == app.cfg.served_model_name {
        Json(model_card(&app)).into_response()
    } else {
        ApiError::model_not_found(&model).into_response()
    }
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
