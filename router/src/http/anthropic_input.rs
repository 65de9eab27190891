//! Anthropic's Messages API request in chat terms: `system` and `messages` (with their content
//! blocks) become the chat messages the model's template renders, and `tools`, `tool_choice`
//! and `thinking` their chat-completions forms, so that `/v1/messages` runs the same path as
//! `/v1/chat/completions`.
//!
//! Blocks: `text`; an assistant's `thinking` (its `reasoning_content`, which thinking models'
//! templates render; `redacted_thinking` cannot be read and is dropped) and `tool_use` (its
//! `tool_calls`); a user's `tool_result` (a tool message each, before the user's own text).
//! Images, documents and server tools are refused, and so is a final assistant turn (a prefill
//! to continue), which chat templates cannot render open.

use serde_json::{json, Map, Value};

use super::errors::ApiError;
use super::validation::{required_string, unsupported};

/// The chat messages of `system` and `messages` (to be checked by the chat path's
/// `normalize_messages`).
pub fn chat_messages(
    system: Option<&Value>,
    messages: Option<&[Value]>,
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => out.push(json!({"role": "system", "content": text})),
        Some(Value::Array(blocks)) => {
            let text = texts("system", blocks)?;
            out.push(json!({"role": "system", "content": text}));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "system",
                "`system` must be a string or a list of text blocks.",
            ))
        }
    }
    let messages =
        messages.ok_or_else(|| ApiError::invalid_param("messages", "`messages` is required."))?;
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must not be empty.",
        ));
    }
    for (i, message) in messages.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = message.get("role").and_then(Value::as_str);
        let content = message.get("content");
        match (role, content) {
            (Some(role @ ("user" | "assistant")), Some(Value::String(text))) => {
                out.push(json!({"role": role, "content": text}))
            }
            (Some("user"), Some(Value::Array(blocks))) => user_turn(&param, blocks, &mut out)?,
            (Some("assistant"), Some(Value::Array(blocks))) => {
                out.push(assistant_turn(&param, blocks)?)
            }
            (Some("user" | "assistant"), _) => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}.content` must be a string or a list of content blocks."),
                ))
            }
            _ => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}.role` must be \"user\" or \"assistant\"."),
                ))
            }
        }
    }
    if messages
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        == Some("assistant")
    {
        return Err(unsupported(
            &format!("messages[{}]", messages.len() - 1),
            "A final assistant turn (a prefill to continue) is not supported: end with a user turn.",
        ));
    }
    Ok(out)
}

fn block_type<'a>(param: &str, block: &'a Value) -> Result<&'a str, ApiError> {
    block
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid_param(param, format!("`{param}.type` is required.")))
}

fn refused_block(param: &str, kind: &str) -> ApiError {
    unsupported(
        param,
        &format!("Content blocks of type {kind:?} are not supported here (text, thinking, tool_use and tool_result are)."),
    )
}

/// The texts of a list of text blocks, joined by newlines.
fn texts(param: &str, blocks: &[Value]) -> Result<String, ApiError> {
    let mut out = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let param = format!("{param}[{j}]");
        match block_type(&param, block)? {
            "text" => out.push(required_string(&param, block, "text")?),
            kind => return Err(refused_block(&param, kind)),
        }
    }
    Ok(out.join("\n"))
}

/// A user turn: its tool results as tool messages, then its text (if any) as a user message.
fn user_turn(param: &str, blocks: &[Value], out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut text = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let param = format!("{param}.content[{j}]");
        match block_type(&param, block)? {
            "text" => text.push(required_string(&param, block, "text")?),
            "tool_result" => {
                let id = required_string(&param, block, "tool_use_id")?;
                let content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => texts(&format!("{param}.content"), parts)?,
                    Some(_) => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("`{param}.content` must be a string or a list of text blocks."),
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            kind => return Err(refused_block(&param, kind)),
        }
    }
    if !text.is_empty() {
        out.push(json!({"role": "user", "content": text.join("\n")}));
    }
    Ok(())
}

/// An assistant turn: its thinking, text and tool calls in one message.
fn assistant_turn(param: &str, blocks: &[Value]) -> Result<Value, ApiError> {
    let (mut thinking, mut text, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let param = format!("{param}.content[{j}]");
        match block_type(&param, block)? {
            "text" => text.push(required_string(&param, block, "text")?),
            "thinking" => thinking.push(required_string(&param, block, "thinking")?),
            "redacted_thinking" => {}
            "tool_use" => {
                let input = match block.get("input") {
                    Some(input @ Value::Object(_)) => input.clone(),
                    _ => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("`{param}.input` must be an object."),
                        ))
                    }
                };
                calls.push(json!({
                    "id": required_string(&param, block, "id")?,
                    "type": "function",
                    "function": {"name": required_string(&param, block, "name")?, "arguments": input},
                }));
            }
            kind => return Err(refused_block(&param, kind)),
        }
    }
    // Only a turn of tool calls goes without content (as chat clients send it).
    let content = if text.is_empty() && !calls.is_empty() {
        Value::Null
    } else {
        json!(text.join(""))
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !thinking.is_empty() {
        message["reasoning_content"] = json!(thinking.join("\n"));
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    Ok(message)
}

/// Custom tools (`name`, `description`, `input_schema`) in the chat form. Anthropic's server
/// tools (web search, code execution, bash, text editor, computer use) are refused.
pub fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let param = format!("tools[{i}]");
            match tool.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(kind) => {
                    return Err(unsupported(
                        &param,
                        &format!(
                        "Only custom tools (name, input_schema) are supported, got type {kind:?}."
                    ),
                    ))
                }
            }
            let name = required_string(&param, tool, "name")?;
            let mut function = Map::new();
            function.insert("name".into(), Value::String(name));
            if let Some(d) = tool.get("description").filter(|d| !d.is_null()) {
                function.insert("description".into(), d.clone());
            }
            let schema = tool
                .get("input_schema")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            function.insert("parameters".into(), schema);
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

/// `tool_choice` in the chat form, and `parallel_tool_calls` (false under
/// `disable_parallel_tool_use`): auto, any (a call is required), tool (that one), none.
pub fn chat_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    let parallel = choice
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .map(|disable| !disable);
    let chat = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = required_string("tool_choice", choice, "name")?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "`tool_choice.type` must be \"auto\", \"any\", \"tool\" or \"none\".",
            ))
        }
    };
    Ok((Some(chat), parallel))
}

/// `thinking` as chat template keyword arguments (`template_thinking`): `{"type": "enabled"}`
/// (or "adaptive") turns thinking on, "disabled" off. `budget_tokens` is not enforced.
pub fn thinking_kwargs(
    thinking: Option<&Value>,
    kwargs: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    let Some(thinking) = thinking.filter(|t| !t.is_null()) else {
        return Ok(());
    };
    let on = match thinking.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => true,
        Some("disabled") => false,
        _ => {
            return Err(ApiError::invalid_param(
                "thinking",
                "`thinking.type` must be \"enabled\", \"adaptive\" or \"disabled\".",
            ))
        }
    };
    template_thinking(kwargs, on);
    Ok(())
}

/// Turns the chat template's thinking on or off: GLM's `enable_thinking` and DeepSeek-V3.2's
/// `thinking` (a template reads the one it knows), unless the request's own
/// `chat_template_kwargs` set them.
pub fn template_thinking(kwargs: &mut Map<String, Value>, on: bool) {
    for key in ["enable_thinking", "thinking"] {
        kwargs.entry(key).or_insert(Value::Bool(on));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_param(e: ApiError) -> String {
        serde_json::to_value(e.body()).unwrap()["error"]["param"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_turns() {
        let messages = [
            json!({"role": "user", "content": "Weather in Paris?"}),
            json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]}),
        ];
        let system = json!([{"type": "text", "text": "Be brief."}]);
        let got = chat_messages(Some(&system), Some(&messages)).unwrap();
        assert_eq!(
            got,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
                       "tool_calls": [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}),
                json!({"role": "user", "content": "And tomorrow?"}),
            ]
        );
    }

    #[test]
    fn a_call_alone_has_null_content() {
        let messages = [
            json!({"role": "user", "content": "x"}),
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}),
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}),
        ];
        let got = chat_messages(None, Some(&messages)).unwrap();
        assert_eq!(got[1]["content"], Value::Null);
        assert_eq!(
            got[2],
            json!({"role": "tool", "tool_call_id": "t", "content": ""})
        );
        assert_eq!(got.len(), 3);
    }

    #[test]
    fn refusals_name_the_field() {
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert_eq!(
            error_param(chat_messages(None, Some(image.as_array().unwrap())).unwrap_err()),
            "messages[0].content[0]"
        );
        let prefill =
            json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure,"}]);
        assert_eq!(
            error_param(chat_messages(None, Some(prefill.as_array().unwrap())).unwrap_err()),
            "messages[1]"
        );
        let role = json!([{"role": "system", "content": "x"}]);
        assert_eq!(
            error_param(chat_messages(None, Some(role.as_array().unwrap())).unwrap_err()),
            "messages[0]"
        );
        assert_eq!(
            error_param(chat_messages(None, Some(&[])).unwrap_err()),
            "messages"
        );
        assert_eq!(
            error_param(chat_messages(None, None).unwrap_err()),
            "messages"
        );
        assert_eq!(
            error_param(
                chat_tools(&[json!({"type": "web_search_20250305", "name": "w"})]).unwrap_err()
            ),
            "tools[0]"
        );
    }

    #[test]
    fn tools_choice_and_thinking_take_their_chat_forms() {
        let tools = chat_tools(&[
            json!({"name": "f", "description": "d", "input_schema": {"type": "object"}}),
        ])
        .unwrap();
        assert_eq!(
            tools,
            vec![
                json!({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}})
            ]
        );
        assert_eq!(
            chat_tool_choice(Some(&json!({"type": "any"}))).unwrap(),
            (Some(json!("required")), None)
        );
        assert_eq!(
            chat_tool_choice(Some(
                &json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true})
            ))
            .unwrap(),
            (
                Some(json!({"type": "function", "function": {"name": "f"}})),
                Some(false)
            )
        );
        assert!(chat_tool_choice(Some(&json!({"type": "sometimes"}))).is_err());
        let mut kwargs = Map::new();
        kwargs.insert("thinking".into(), json!(true));
        thinking_kwargs(Some(&json!({"type": "disabled"})), &mut kwargs).unwrap();
        assert_eq!(
            Value::Object(kwargs),
            json!({"thinking": true, "enable_thinking": false})
        );
        assert!(thinking_kwargs(Some(&json!({"type": "maybe"})), &mut Map::new()).is_err());
    }
}
