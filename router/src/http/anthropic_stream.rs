//! An Anthropic Messages stream: named server-sent events as Anthropic sends them.
//! `message_start` (the message, empty, with the input tokens) and a `ping` open it; each
//! content block is `content_block_start`, its `content_block_delta`s (`thinking_delta`,
//! `text_delta`, or `input_json_delta` for a tool call's input) and `content_block_stop`;
//! `message_delta` (the stop reason, the usage) and `message_stop` end it (no `[DONE]`).
//!
//! The chat path's incremental parser splits the text into thinking, answer and tool calls; a
//! block is closed when the model moves on to another kind (or another call).

use serde_json::{json, Value};

use super::anthropic::{error_body, stop_reason, tool_use_id, MessagesUsage};
use super::chat_output::StreamingChoice;
use super::errors::ApiError;
use super::generation::ChoiceEvent;
use super::openai_types::{ChatDelta, ToolCallDelta};
use super::sse::{ChunkWriter, SseChunk};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    ToolUse,
}

pub struct MessagesStream {
    id: String,
    model: String,
    prompt_tokens: u32,
    parser: StreamingChoice,
    /// The open block's kind, and how many blocks came before it.
    open: Option<Block>,
    blocks: usize,
    ended: bool,
}

impl MessagesStream {
    pub fn new(
        id: String,
        model: String,
        prompt_tokens: u32,
        parser: StreamingChoice,
    ) -> MessagesStream {
        MessagesStream {
            id,
            model,
            prompt_tokens,
            parser,
            open: None,
            blocks: 0,
            ended: false,
        }
    }

    fn event(kind: &'static str, mut body: Value) -> SseChunk {
        body["type"] = json!(kind);
        SseChunk {
            event: Some(kind),
            data: body.to_string(),
        }
    }

    /// Opens a block of `kind` (closing the open one) unless one of that kind is open and
    /// `fresh` is false.
    fn open(&mut self, kind: Block, start: Value, fresh: bool, out: &mut Vec<SseChunk>) {
        if self.open == Some(kind) && !fresh {
            return;
        }
        self.close(out);
        let body = json!({"index": self.blocks, "content_block": start});
        out.push(Self::event("content_block_start", body));
        self.open = Some(kind);
    }

    fn delta(&self, delta: Value) -> SseChunk {
        Self::event(
            "content_block_delta",
            json!({"index": self.blocks, "delta": delta}),
        )
    }

    fn close(&mut self, out: &mut Vec<SseChunk>) {
        if self.open.take().is_some() {
            out.push(Self::event(
                "content_block_stop",
                json!({"index": self.blocks}),
            ));
            self.blocks += 1;
        }
    }

    fn on_delta(&mut self, delta: ChatDelta, out: &mut Vec<SseChunk>) {
        if let Some(text) = delta.reasoning_content.filter(|t| !t.is_empty()) {
            let start = json!({"type": "thinking", "thinking": "", "signature": ""});
            self.open(Block::Thinking, start, false, out);
            out.push(self.delta(json!({"type": "thinking_delta", "thinking": text})));
        }
        if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
            self.open(Block::Text, json!({"type": "text", "text": ""}), false, out);
            out.push(self.delta(json!({"type": "text_delta", "text": text})));
        }
        for call in delta.tool_calls.unwrap_or_default() {
            self.on_call(call, out);
        }
    }

    /// A call's first delta carries its name (a new block), later ones its arguments (a JSON
    /// object, streamed as `partial_json`).
    fn on_call(&mut self, call: ToolCallDelta, out: &mut Vec<SseChunk>) {
        if call.id.is_some() {
            let name = call.function.name.unwrap_or_default();
            let start = json!({"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}});
            self.open(Block::ToolUse, start, true, out);
        }
        if !call.function.arguments.is_empty() && self.open == Some(Block::ToolUse) {
            let delta =
                json!({"type": "input_json_delta", "partial_json": call.function.arguments});
            out.push(self.delta(delta));
        }
    }
}

impl ChunkWriter for MessagesStream {
    type Chunk = SseChunk;
    const ENDS_WITH_DONE: bool = false;

    fn start(&mut self) -> Vec<SseChunk> {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        });
        vec![
            Self::event("message_start", json!({"message": message})),
            Self::event("ping", json!({})),
        ]
    }

    fn on_event(&mut self, event: ChoiceEvent) -> Vec<SseChunk> {
        let mut out = Vec::new();
        match event {
            ChoiceEvent::Delta { text, .. } => {
                for delta in self.parser.on_text(&text) {
                    self.on_delta(delta, &mut out);
                }
            }
            ChoiceEvent::Finished {
                reason,
                usage,
                stop,
                ..
            } => {
                for delta in self.parser.on_finish() {
                    self.on_delta(delta, &mut out);
                }
                self.close(&mut out);
                let reason = self.parser.finish_reason(reason);
                let delta = json!({"stop_reason": stop_reason(Some(reason), stop.as_deref()), "stop_sequence": stop});
                let usage =
                    serde_json::to_value(MessagesUsage::new(&usage)).expect("usage serializes");
                out.push(Self::event(
                    "message_delta",
                    json!({"delta": delta, "usage": usage}),
                ));
                self.ended = true;
            }
            ChoiceEvent::PromptLogprobs { .. } | ChoiceEvent::Failed(_) => {}
        }
        out
    }

    /// Anthropic's error object as an `error` event.
    fn failed(&mut self, error: &ApiError) -> Vec<SseChunk> {
        vec![SseChunk {
            event: Some("error"),
            data: error_body(error),
        }]
    }

    fn finish(&mut self) -> Vec<SseChunk> {
        if !self.ended {
            return Vec::new();
        }
        vec![Self::event("message_stop", json!({}))]
    }
}
