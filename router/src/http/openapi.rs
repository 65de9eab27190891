//! GET /openapi.json: the API described in OpenAPI 3.0 (`openapi.json` beside this file),
//! with the limits of the running server filled in (the model name, the vocabulary, the
//! context, `n`, stop strings, whether a forced `tool_choice` is possible) so that a client or
//! a fuzzer generating from it produces requests this server accepts, and every refusal it
//! documents is a real one.

use std::sync::OnceLock;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::AppState;

const DOCUMENT: &str = include_str!("openapi.json");

fn base() -> &'static Value {
    static PARSED: OnceLock<Value> = OnceLock::new();
    PARSED.get_or_init(|| serde_json::from_str(DOCUMENT).expect("openapi.json is valid JSON"))
}

/// What the document says about the running server.
pub struct ServerLimits<'a> {
    pub model: &'a str,
    pub vocab_size: u32,
    pub max_context: u32,
    pub max_n: u32,
    pub max_stop_strings: usize,
    /// A tool-call parser is configured: `tool_choice` may force a call.
    pub forced_tool_choice: bool,
}

/// The document with this server's limits.
pub fn document(limits: &ServerLimits) -> Value {
    let mut doc = base().clone();
    let schemas = &mut doc["components"]["schemas"];
    schemas["TokenId"]["maximum"] = json!(limits.vocab_size.saturating_sub(1));
    schemas["N"]["maximum"] = json!(limits.max_n);
    schemas["StopList"]["maxItems"] = json!(limits.max_stop_strings);
    // The prompt takes at least one token of the context.
    let max_new = json!(limits.max_context.saturating_sub(1).max(1));
    schemas["CompletionRequest"]["properties"]["max_tokens"]["maximum"] = max_new.clone();
    let chat = &mut schemas["ChatCompletionRequest"]["properties"];
    chat["max_tokens"]["maximum"] = max_new.clone();
    chat["max_completion_tokens"]["maximum"] = max_new.clone();
    if !limits.forced_tool_choice {
        chat["tool_choice"] = json!({"type": "string", "enum": ["auto", "none"]});
    }
    let responses = &mut schemas["ResponsesRequest"]["properties"];
    responses["max_output_tokens"]["maximum"] = max_new.clone();
    if !limits.forced_tool_choice {
        responses["tool_choice"] = json!({"type": "string", "enum": ["auto", "none"]});
    }
    let messages = &mut schemas["MessagesRequest"]["properties"];
    messages["max_tokens"]["maximum"] = max_new;
    for request in ["MessagesRequest", "MessagesCountRequest"] {
        if !limits.forced_tool_choice {
            let choice = &mut schemas[request]["properties"]["tool_choice"];
            choice["properties"]["type"]["enum"] = json!(["auto", "none"]);
        }
    }
    for request in [
        "CompletionRequest",
        "ChatCompletionRequest",
        "ResponsesRequest",
        "MessagesRequest",
        "MessagesCountRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
    ] {
        schemas[request]["properties"]["model"]["enum"] = json!([limits.model]);
    }
    doc
}

pub async fn handler(State(app): State<AppState>) -> Json<Value> {
    let info = app.model_info();
    Json(document(&ServerLimits {
        model: &app.cfg.served_model_name,
        vocab_size: info.vocab_size,
        max_context: info.max_context,
        max_n: app.cfg.max_n,
        max_stop_strings: app.cfg.max_stop_strings,
        forced_tool_choice: app.cfg.tool_call_parser.is_some(),
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The paths `router()` registers, read from its source: a route added there without a
    /// path here fails this test. A catch-all parameter (`{*model}`) is `{model}` in OpenAPI.
    fn routed_paths() -> BTreeSet<String> {
        let source = include_str!("mod.rs");
        source
            .split(".route(\"")
            .skip(1)
            .map(|rest| rest.split('"').next().unwrap().replace("{*", "{"))
            .collect()
    }

    fn limits(forced_tool_choice: bool) -> ServerLimits<'static> {
        ServerLimits {
            model: "served",
            vocab_size: 640,
            max_context: 48,
            max_n: 8,
            max_stop_strings: 4,
            forced_tool_choice,
        }
    }

    #[test]
    fn every_route_is_documented_and_nothing_else() {
        let doc = document(&limits(false));
        let documented: BTreeSet<String> =
            doc["paths"].as_object().unwrap().keys().cloned().collect();
        let routed = routed_paths();
        assert!(routed.len() >= 7, "routes not found in mod.rs: {routed:?}");
        assert_eq!(documented, routed);
    }

    #[test]
    fn limits_are_filled_in() {
        let doc = document(&limits(false));
        let schemas = &doc["components"]["schemas"];
        assert_eq!(schemas["TokenId"]["maximum"], 639);
        assert_eq!(schemas["N"]["maximum"], 8);
        assert_eq!(schemas["StopList"]["maxItems"], 4);
        let chat = &schemas["ChatCompletionRequest"]["properties"];
        assert_eq!(chat["model"]["enum"], json!(["served"]));
        assert_eq!(chat["max_completion_tokens"]["maximum"], 47);
        assert_eq!(chat["tool_choice"]["enum"], json!(["auto", "none"]));
        let responses = &schemas["ResponsesRequest"]["properties"];
        assert_eq!(responses["model"]["enum"], json!(["served"]));
        assert_eq!(responses["max_output_tokens"]["maximum"], 47);
        assert_eq!(responses["tool_choice"]["enum"], json!(["auto", "none"]));
        let forced = document(&limits(true));
        for request in ["ChatCompletionRequest", "ResponsesRequest"] {
            let props = &forced["components"]["schemas"][request]["properties"];
            assert_eq!(props["tool_choice"]["oneOf"].as_array().unwrap().len(), 2);
        }
        let messages = &schemas["MessagesRequest"]["properties"];
        assert_eq!(messages["model"]["enum"], json!(["served"]));
        assert_eq!(messages["max_tokens"]["maximum"], 47);
        assert_eq!(
            messages["tool_choice"]["properties"]["type"]["enum"],
            json!(["auto", "none"])
        );
        let forced_messages = &forced["components"]["schemas"]["MessagesRequest"]["properties"];
        assert_eq!(
            forced_messages["tool_choice"]["properties"]["type"]["enum"]
                .as_array()
                .unwrap()
                .len(),
            4
        );
        // Every reference resolves.
        let text = doc.to_string();
        for reference in text.split("\"$ref\":\"#/").skip(1) {
            let pointer = format!("/{}", reference.split('"').next().unwrap());
            assert!(doc.pointer(&pointer).is_some(), "dangling $ref {pointer}");
        }
    }
}
