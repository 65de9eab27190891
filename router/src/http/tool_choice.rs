//! `tool_choice`: which tools the template sees, which calls count, and for the forced ones
//! the grammar that makes the model call.
//!
//! "required" and a named function are enforced by constrained decoding: after its thinking the
//! model may write only calls, in the markup of the server's `--tool-call-parser`, to the
//! offered functions (a named choice: that one, which is also the only tool rendered into the
//! prompt), each with the parameters its schema requires, values of their types
//! (`parsers::forced_calls_grammar`). `parallel_tool_calls: false` allows one call. "none"
//! keeps the tools in the prompt, as other servers do, but never turns output into calls;
//! "auto" leaves the choice to the model.

use serde_json::Value;

use crate::grammar::OutputConstraint;
use crate::parsers::{forced_calls_grammar, CallCount, ToolParserKind};

use super::errors::ApiError;
use super::structured_output::RequestedConstraint;
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

    /// The constraint that makes a forced choice's output calls; `None` for "auto" and "none".
    /// `from_request` already checked that a forced choice has a parser and tools.
    pub fn forced_constraint(
        &self,
        parser: Option<ToolParserKind>,
        tools: Option<&[Value]>,
        parallel_calls: bool,
    ) -> Result<Option<RequestedConstraint>, ApiError> {
        let only = match self {
            ToolChoice::Auto | ToolChoice::None => return Ok(None),
            ToolChoice::Required => None,
            ToolChoice::Named(name) => Some(name.as_str()),
        };
        let (Some(kind), Some(tools)) = (parser, tools) else {
            return Ok(None);
        };
        let count = if parallel_calls {
            CallCount::OneOrMore
        } else {
            CallCount::One
        };
        let lark = forced_calls_grammar(kind, tools, only, count).ok_or_else(|| {
            ApiError::invalid_param(
                "tools",
                "A forced `tool_choice` needs `tools` of type function, each with a `name`.",
            )
        })?;
        Ok(Some(RequestedConstraint {
            param: "tool_choice",
            spec: OutputConstraint::ToolCalls(lark),
        }))
    }
}
