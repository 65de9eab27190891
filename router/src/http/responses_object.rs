//! The Responses API's response object and its output items, shared by whole responses and
//! streams: a `reasoning` item (the model's thinking, as `reasoning_text` content), a `message`
//! item (the answer, one `output_text` part) and a `function_call` item per tool call, in the
//! order the model wrote them.

use serde::Serialize;
use serde_json::{json, Map, Value};

use super::openai_types::Usage;

pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

pub fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "reasoning_text", "text": text}])
    };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

pub fn message_item(id: &str, text: Option<&str>, status: &str) -> Value {
    let content = match text {
        Some(text) => json!([output_text(text)]),
        None => json!([]),
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

pub fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({
        "type": "function_call", "id": id, "call_id": call_id, "name": name,
        "arguments": arguments, "status": status,
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct InputTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct OutputTokensDetails {
    /// The reasoning text's length in tokens (its tags excluded).
    pub reasoning_tokens: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResponseUsage {
    pub input_tokens: u32,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u32,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u32,
}

impl ResponseUsage {
    pub fn new(usage: &Usage, reasoning_tokens: u32) -> ResponseUsage {
        ResponseUsage {
            input_tokens: usage.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: usage.prompt_tokens_details.cached_tokens,
            },
            output_tokens: usage.completion_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: reasoning_tokens.min(usage.completion_tokens),
            },
            total_tokens: usage.total_tokens,
        }
    }
}

/// How a generation ended, as the response reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// Cut at `max_output_tokens` (or the context).
    Incomplete,
    /// The engine aborted it.
    Failed,
}

impl Outcome {
    pub fn of(finish_reason: Option<&str>) -> Outcome {
        match finish_reason {
            Some("length") => Outcome::Incomplete,
            Some("abort") => Outcome::Failed,
            _ => Outcome::Completed,
        }
    }

    pub fn status(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Incomplete => "incomplete",
            Outcome::Failed => "failed",
        }
    }

    /// The status of the output item the generation ended in.
    pub fn item_status(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            _ => "incomplete",
        }
    }

    /// The stream's last event.
    pub fn event(self) -> &'static str {
        match self {
            Outcome::Completed => "response.completed",
            Outcome::Incomplete => "response.incomplete",
            Outcome::Failed => "response.failed",
        }
    }
}

/// The response object. The request's settings are echoed as they took effect (the sampling
/// defaults filled in); nothing is stored (`store` is always false).
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    pub status: &'static str,
    pub background: bool,
    pub error: Option<Value>,
    pub incomplete_details: Option<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub model: String,
    pub output: Vec<Value>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub reasoning: Value,
    pub store: bool,
    pub temperature: f32,
    pub text: Value,
    pub tool_choice: Value,
    pub tools: Vec<Value>,
    pub top_p: f32,
    pub truncation: &'static str,
    pub usage: Option<ResponseUsage>,
    pub user: Option<String>,
    pub metadata: Map<String, Value>,
}

impl ResponseObject {
    /// This response as it ended: its status, output and usage.
    pub fn ended(
        &self,
        outcome: Outcome,
        output: Vec<Value>,
        usage: ResponseUsage,
    ) -> ResponseObject {
        let mut done = self.clone();
        done.status = outcome.status();
        done.incomplete_details =
            (outcome == Outcome::Incomplete).then(|| json!({"reason": "max_output_tokens"}));
        done.error = (outcome == Outcome::Failed)
            .then(|| json!({"code": "server_error", "message": "The generation was aborted."}));
        done.output = output;
        done.usage = Some(usage);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_by_finish_reason() {
        assert_eq!(Outcome::of(Some("stop")), Outcome::Completed);
        assert_eq!(Outcome::of(Some("tool_calls")), Outcome::Completed);
        assert_eq!(Outcome::of(Some("length")).status(), "incomplete");
        assert_eq!(Outcome::of(Some("abort")).event(), "response.failed");
    }

    #[test]
    fn usage_in_the_responses_shape() {
        let usage = ResponseUsage::new(&Usage::new(10, 4, 3), 9);
        let v = serde_json::to_value(usage).unwrap();
        assert_eq!(
            v,
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 4,
                   "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 14})
        );
    }
}
