//! The Responses API's request in chat terms: `instructions` and `input` items become the chat
//! messages the model's template renders, and `tools`, `tool_choice` and `text.format` their
//! chat-completions forms, so that `/v1/responses` runs the same path as `/v1/chat/completions`.
//!
//! Items: messages (a string or text parts), `function_call` (an assistant turn's tool calls;
//! consecutive calls, and an assistant message before them, make one turn),
//! `function_call_output` (a tool message) and `reasoning` (its text becomes the next assistant
//! turn's `reasoning_content`, which thinking models' templates render). Nothing is stored, so
//! an `item_reference` is refused, as are inputs other than text.

use serde_json::{json, Map, Value};

use super::errors::ApiError;
use super::validation::{required_string, unsupported};

const INPUT_ROLES: &[&str] = &["user", "assistant", "system", "developer"];

/// The chat messages of `instructions` and `input` (not yet checked by the chat path's
/// `normalize_messages`, which the caller runs on them).
pub fn chat_messages(
    instructions: Option<&str>,
    input: Option<&Value>,
) -> Result<Vec<Value>, ApiError> {
    let mut messages = Vec::new();
    if let Some(text) = instructions {
        messages.push(json!({"role": "system", "content": text}));
    }
    match input {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param("input", "`input` is required."));
        }
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            let mut turns = Turns::default();
            for (i, item) in items.iter().enumerate() {
                turns.add(i, item)?;
            }
            messages.extend(turns.messages);
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "input",
                "`input` must be a string or a list of input items.",
            ))
        }
    }
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "input",
            "`input` must not be empty.",
        ));
    }
    Ok(messages)
}

/// Messages built item by item: the open assistant turn collects tool calls, and a reasoning
/// item's text waits for the assistant turn it belongs to.
#[derive(Default)]
struct Turns {
    messages: Vec<Value>,
    /// The last message is an assistant turn that later `function_call` items may join.
    assistant_open: bool,
    reasoning: Option<String>,
}

impl Turns {
    fn add(&mut self, i: usize, item: &Value) -> Result<(), ApiError> {
        let param = format!("input[{i}]");
        let Value::Object(fields) = item else {
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must be an object."),
            ));
        };
        let kind = match fields.get("type") {
            None | Some(Value::Null) if fields.contains_key("role") => "message",
            Some(Value::String(kind)) => kind.as_str(),
            _ => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}.type` is required (or `role`, for a message)."),
                ))
            }
        };
        match kind {
            "message" => self.message(&param, fields),
            "function_call" => self.function_call(&param, item),
            "function_call_output" => {
                let call_id = required_string(&param, item, "call_id")?;
                let output = match fields.get("output") {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(parts)) => text_of_parts(&format!("{param}.output"), parts)?,
                    _ => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("`{param}.output` must be a string or a list of text parts."),
                        ))
                    }
                };
                self.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}), false);
                Ok(())
            }
            "reasoning" => {
                let text = reasoning_text(&param, fields)?;
                match &mut self.reasoning {
                    Some(held) if !text.is_empty() => {
                        held.push('\n');
                        held.push_str(&text);
                    }
                    Some(_) => {}
                    None => self.reasoning = Some(text),
                }
                Ok(())
            }
            "item_reference" => Err(unsupported(
                &param,
                "Item references need stored responses, and this server stores none: send the items themselves.",
            )),
            other => Err(unsupported(
                &param,
                &format!("Input items of type {other:?} are not supported (messages, function_call, function_call_output and reasoning are)."),
            )),
        }
    }

    fn message(&mut self, param: &str, fields: &Map<String, Value>) -> Result<(), ApiError> {
        let role = match fields.get("role").and_then(Value::as_str) {
            Some(role) if INPUT_ROLES.contains(&role) => role,
            _ => {
                return Err(ApiError::invalid_param(
                    param,
                    format!("`{param}.role` must be one of {INPUT_ROLES:?}."),
                ))
            }
        };
        let content = match fields.get("content") {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => text_of_parts(&format!("{param}.content"), parts)?,
            _ => {
                return Err(ApiError::invalid_param(
                    param,
                    format!("`{param}.content` must be a string or a list of text parts."),
                ))
            }
        };
        let mut message = json!({"role": role, "content": content});
        let assistant = role == "assistant";
        if assistant {
            if let Some(reasoning) = self.reasoning.take() {
                message["reasoning_content"] = Value::String(reasoning);
            }
        }
        self.push(message, assistant);
        Ok(())
    }

    fn function_call(&mut self, param: &str, item: &Value) -> Result<(), ApiError> {
        let call = json!({
            "id": required_string(param, item, "call_id")?,
            "type": "function",
            "function": {
                "name": required_string(param, item, "name")?,
                "arguments": required_string(param, item, "arguments")?,
            },
        });
        if !self.assistant_open || self.reasoning.is_some() {
            let mut turn = json!({"role": "assistant", "content": Value::Null, "tool_calls": []});
            if let Some(reasoning) = self.reasoning.take() {
                turn["reasoning_content"] = Value::String(reasoning);
            }
            self.push(turn, true);
        }
        let turn = self.messages.last_mut().expect("an assistant turn is open");
        match turn.get_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.push(call),
            _ => turn["tool_calls"] = json!([call]),
        }
        Ok(())
    }

    fn push(&mut self, message: Value, assistant_open: bool) {
        self.messages.push(message);
        self.assistant_open = assistant_open;
    }
}

/// The texts of a content list, joined by newlines (as chat's text parts are): `input_text`,
/// `output_text` and `text` parts. Images, files and audio are refused.
fn text_of_parts(param: &str, parts: &[Value]) -> Result<String, ApiError> {
    let texts = parts
        .iter()
        .enumerate()
        .map(|(j, part)| {
            let kind = part.get("type").and_then(Value::as_str);
            match (kind, part.get("text").and_then(Value::as_str)) {
                (Some("input_text" | "output_text" | "text"), Some(text)) => Ok(text),
                (Some(kind @ ("input_image" | "input_file" | "input_audio")), _) => Err(unsupported(
                    &format!("{param}[{j}]"),
                    &format!("Content parts of type {kind:?} are not supported: this model reads text."),
                )),
                _ => Err(ApiError::invalid_param(
                    &format!("{param}[{j}]"),
                    format!("`{param}[{j}]` must be a text part ({{\"type\": \"input_text\", \"text\": string}})."),
                )),
            }
        })
        .collect::<Result<Vec<&str>, ApiError>>()?;
    Ok(texts.join("\n"))
}

/// A reasoning item's text: its `reasoning_text` content, else its summary's texts.
fn reasoning_text(param: &str, fields: &Map<String, Value>) -> Result<String, ApiError> {
    let texts = |key: &str, kind: &str| -> Result<Option<String>, ApiError> {
        match fields.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|part| match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some(t), Some(text)) if t == kind => Ok(text),
                    _ => Err(ApiError::invalid_param(
                        param,
                        format!("`{param}.{key}` must be a list of {{\"type\": \"{kind}\", \"text\": string}}."),
                    )),
                })
                .collect::<Result<Vec<&str>, ApiError>>()
                .map(|t| (!t.is_empty()).then(|| t.join("\n"))),
            Some(_) => Err(ApiError::invalid_param(param, format!("`{param}.{key}` must be a list."))),
        }
    };
    let content = texts("content", "reasoning_text")?;
    let summary = texts("summary", "summary_text")?;
    Ok(content.or(summary).unwrap_or_default())
}

/// Function tools in the chat form (`{"type": "function", "function": {...}}`); tools already
/// in that form pass. Built-in tools (web search, files, computers, MCP, ...) are refused.
pub fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let param = format!("tools[{i}]");
            let kind = tool.get("type").and_then(Value::as_str);
            if kind != Some("function") {
                return Err(unsupported(
                    &param,
                    &format!("Only function tools are supported, got type {kind:?}."),
                ));
            }
            if tool.get("function").is_some() {
                return Ok(tool.clone());
            }
            let name = tool.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid_param(&param, format!("`{param}.name` is required."))
            })?;
            let mut function = Map::new();
            function.insert("name".into(), Value::String(name.to_owned()));
            for key in ["description", "parameters", "strict"] {
                if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
                    function.insert(key.into(), v.clone());
                }
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

/// `tool_choice` in the chat form: the strings pass, `{"type": "function", "name": ...}`
/// names a function.
pub fn chat_tool_choice(choice: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(_)) => Ok(choice.cloned()),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("name").and_then(Value::as_str) {
                Some(name) => Ok(Some(json!({"type": "function", "function": {"name": name}}))),
                None if o.contains_key("function") => Ok(choice.cloned()),
                None => Err(ApiError::invalid_param("tool_choice", "`tool_choice.name` is required.")),
            }
        }
        Some(_) => Err(unsupported(
            "tool_choice",
            "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}.",
        )),
    }
}

/// `text.format` as chat's `response_format` (`None` for plain text).
pub fn response_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(key).filter(|v| !v.is_null()) {
                    schema.insert(key.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid_param(
            "text.format",
            "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\".",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(input: Value) -> Vec<Value> {
        chat_messages(Some("Be brief."), Some(&input)).unwrap()
    }

    #[test]
    fn a_string_is_one_user_turn_after_the_instructions() {
        assert_eq!(
            messages(json!("hi")),
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "hi"})
            ]
        );
        assert_eq!(chat_messages(None, Some(&json!("hi"))).unwrap().len(), 1);
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_turns() {
        let got = messages(json!([
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}, {"type": "input_text", "text": "In Paris."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny at noon."}]},
            {"role": "user", "content": "Thanks"},
        ]));
        assert_eq!(got.len(), 7);
        assert_eq!(
            got[1],
            json!({"role": "user", "content": "Weather?\nIn Paris."})
        );
        assert_eq!(got[2]["role"], "assistant");
        assert_eq!(got[2]["reasoning_content"], "Call the tool.");
        assert_eq!(got[2]["content"], Value::Null);
        let calls = got[2]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            calls[0],
            json!({"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})
        );
        assert_eq!(
            got[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
        );
        assert_eq!(
            got[4],
            json!({"role": "tool", "tool_call_id": "call_2", "content": "noon"})
        );
        assert_eq!(
            got[5],
            json!({"role": "assistant", "content": "Sunny at noon."})
        );
        assert_eq!(got[6], json!({"role": "user", "content": "Thanks"}));
    }

    #[test]
    fn calls_join_the_assistant_message_before_them() {
        let got = messages(json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Let me check."},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]));
        assert_eq!(got.len(), 3);
        assert_eq!(got[2]["content"], "Let me check.");
        assert_eq!(got[2]["tool_calls"][0]["id"], "c");
    }

    #[test]
    fn bad_items_are_refused_with_their_index() {
        let cases = [
            (
                json!([{"type": "item_reference", "id": "msg_1"}]),
                "input[0]",
                "stores none",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                "input[0].content[0]",
                "not supported",
            ),
            (
                json!([{"role": "robot", "content": "x"}]),
                "input[0]",
                "role",
            ),
            (
                json!([{"role": "user", "content": "x"}, {"type": "function_call", "name": "f"}]),
                "input[1]",
                "call_id",
            ),
            (
                json!([{"type": "web_search_call"}]),
                "input[0]",
                "not supported",
            ),
            (json!([7]), "input[0]", "object"),
            (json!([]), "input", "empty"),
            (json!(3), "input", "string or a list"),
        ];
        for (input, param, fragment) in cases {
            let err = chat_messages(None, Some(&input)).unwrap_err();
            let body = serde_json::to_value(err.body()).unwrap();
            assert_eq!(body["error"]["param"], param, "{input}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains(fragment),
                "{body}"
            );
        }
        assert!(chat_messages(None, None).is_err());
    }

    #[test]
    fn tools_choice_and_format_take_their_chat_forms() {
        let tools = chat_tools(&[json!({"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": null})]).unwrap();
        assert_eq!(
            tools,
            vec![
                json!({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}})
            ]
        );
        assert!(chat_tools(&[json!({"type": "web_search"})]).is_err());
        assert_eq!(
            chat_tool_choice(Some(&json!({"type": "function", "name": "f"}))).unwrap(),
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        assert_eq!(
            chat_tool_choice(Some(&json!("required"))).unwrap(),
            Some(json!("required"))
        );
        assert!(chat_tool_choice(Some(&json!({"type": "web_search"}))).is_err());
        let schema = json!({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": true}});
        assert_eq!(
            response_format(Some(&schema)).unwrap(),
            Some(
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}})
            )
        );
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "text"}}))).unwrap(),
            None
        );
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "json_object"}}))).unwrap(),
            Some(json!({"type": "json_object"}))
        );
        assert!(response_format(Some(&json!({"format": {"type": "xml"}}))).is_err());
    }
}
