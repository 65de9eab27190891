//! `tool_choice`: which tools the template sees and which calls count.
//!
//! No constrained decoding backs "required" or a named function. They are enforced by what
//! the model is shown and by validating its output: a named choice renders only that tool
//! into the prompt and accepts only calls to it; "required" accepts calls to any offered
//! tool. If the model still answers without a call, the answer is returned as it is, with
//! finish_reason "stop" (the client sees no `tool_calls` rather than an error). "none" keeps
//! the tools in the prompt, as other servers do, but never turns output into calls.

use serde_json::Value;

use super::errors::ApiError;
use super::validation::unsupported;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

impl ToolChoice {
    /// Reads and checks `tool_choice` against the request's `tools`. The forced choices need a
    /// tool-call parser: without one no output could ever satisfy them.
    pub fn from_request(
        choice: Option<&Value>,
        tools: Option<&[Value]>,
        parser_configured: bool,
    ) -> Result<ToolChoice, ApiError> {
        let tools = tools.unwrap_or_default();
        let choice = match choice {
            None | Some(Value::Null) => return Ok(ToolChoice::Auto),
            Some(Value::String(s)) if s == "auto" => return Ok(ToolChoice::Auto),
            Some(Value::String(s)) if s == "none" => return Ok(ToolChoice::None),
            Some(Value::String(s)) if s == "required" => ToolChoice::Required,
            Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "tool_choice",
                            "`tool_choice.function.name` is required.",
                        )
                    })?;
                ToolChoice::Named(name.to_owned())
            }
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                ))
            }
        };
        if !parser_configured {
            return Err(unsupported(
                "tool_choice",
                "A forced `tool_choice` needs the server started with --tool-call-parser.",
            ));
        }
        if tools.is_empty() {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "A forced `tool_choice` needs `tools`.",
            ));
        }
        if let ToolChoice::Named(name) = &choice {
            let offered = tools.iter().any(|t| {
                t.get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    == Some(name.as_str())
            });
            if !offered {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not in `tools`."),
                ));
            }
        }
        Ok(choice)
    }

    /// The tools the chat template renders.
    pub fn rendered_tools(&self, tools: Option<Vec<Value>>) -> Option<Vec<Value>> {
        match self {
            ToolChoice::Named(name) => tools.map(|ts| {
                ts.into_iter()
                    .filter(|t| {
                        t.get("function")
                            .and_then(|f| f.get("name"))
                            .and_then(Value::as_str)
                            == Some(name.as_str())
                    })
                    .collect()
            }),
            _ => tools,
        }
    }

    /// The function calls are restricted to, if any.
    pub fn only(&self) -> Option<&str> {
        match self {
            ToolChoice::Named(name) => Some(name),
            _ => None,
        }
    }
}
