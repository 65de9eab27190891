//! A Responses API stream: named server-sent events, each with its `type` and a
//! `sequence_number`, as OpenAI sends them. `response.created` and `response.in_progress`
//! open it; each output item is `response.output_item.added`, its deltas
//! (`response.reasoning_text.delta`; `response.content_part.added` then
//! `response.output_text.delta`; `response.function_call_arguments.delta`), their `.done`
//! events and `response.output_item.done`; `response.completed` (or `.incomplete`, `.failed`)
//! carries the whole response and ends the stream (no `[DONE]`).
//!
//! The chat path's incremental parser splits the text into reasoning, answer and tool calls;
//! an item is closed when the model moves on to another kind (or another call).

use std::sync::Arc;

use serde_json::{json, Value};

use crate::tokenizer::TokenizerBundle;

use super::chat_output::StreamingChoice;
use super::errors::ApiError;
use super::generation::ChoiceEvent;
use super::openai_types::{ChatDelta, ToolCallDelta, Usage};
use super::responses_object::{
    call_item, message_item, new_id, output_text, reasoning_item, Outcome, ResponseObject,
    ResponseUsage,
};
use super::sse::{ChunkWriter, SseChunk};

enum OpenItem {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

pub struct ResponsesStream {
    shape: ResponseObject,
    parser: StreamingChoice,
    tokenizer: Arc<TokenizerBundle>,
    sequence: u64,
    /// Closed output items, by output index.
    items: Vec<Value>,
    open: Option<OpenItem>,
    /// Every reasoning text of the output (its token count goes into the usage).
    reasoning: String,
    ended: Option<(Outcome, Usage)>,
}

impl ResponsesStream {
    pub fn new(
        shape: ResponseObject,
        parser: StreamingChoice,
        tokenizer: Arc<TokenizerBundle>,
    ) -> ResponsesStream {
        ResponsesStream {
            shape,
            parser,
            tokenizer,
            sequence: 0,
            items: Vec::new(),
            open: None,
            reasoning: String::new(),
            ended: None,
        }
    }

    fn event(&mut self, kind: &'static str, mut body: Value) -> SseChunk {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        SseChunk {
            event: Some(kind),
            data: body.to_string(),
        }
    }

    /// The output index of the open item (or of the next one).
    fn index(&self) -> usize {
        self.items.len()
    }

    fn on_delta(&mut self, delta: ChatDelta, out: &mut Vec<SseChunk>) {
        if let Some(text) = delta.reasoning_content.filter(|t| !t.is_empty()) {
            self.reasoning_text(text, out);
        }
        if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
            self.answer_text(text, out);
        }
        for call in delta.tool_calls.unwrap_or_default() {
            self.call_delta(call, out);
        }
    }

    fn reasoning_text(&mut self, text: String, out: &mut Vec<SseChunk>) {
        if !matches!(self.open, Some(OpenItem::Reasoning { .. })) {
            self.close("completed", out);
            let id = new_id("rs");
            let added = json!({"output_index": self.index(), "item": reasoning_item(&id, "", "in_progress")});
            out.push(self.event("response.output_item.added", added));
            self.open = Some(OpenItem::Reasoning {
                id,
                text: String::new(),
            });
        }
        self.reasoning.push_str(&text);
        let index = self.index();
        let Some(OpenItem::Reasoning { id, text: held }) = &mut self.open else {
            unreachable!("a reasoning item is open")
        };
        held.push_str(&text);
        let body = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text});
        out.push(self.event("response.reasoning_text.delta", body));
    }

    fn answer_text(&mut self, text: String, out: &mut Vec<SseChunk>) {
        if !matches!(self.open, Some(OpenItem::Message { .. })) {
            self.close("completed", out);
            let (id, index) = (new_id("msg"), self.index());
            let added =
                json!({"output_index": index, "item": message_item(&id, None, "in_progress")});
            out.push(self.event("response.output_item.added", added));
            let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text("")});
            out.push(self.event("response.content_part.added", part));
            self.open = Some(OpenItem::Message {
                id,
                text: String::new(),
            });
        }
        let index = self.index();
        let Some(OpenItem::Message { id, text: held }) = &mut self.open else {
            unreachable!("a message is open")
        };
        held.push_str(&text);
        let body = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []});
        out.push(self.event("response.output_text.delta", body));
    }

    /// A call's first delta carries its id and name, later ones its arguments.
    fn call_delta(&mut self, call: ToolCallDelta, out: &mut Vec<SseChunk>) {
        if let Some(call_id) = call.id {
            self.close("completed", out);
            let id = new_id("fc");
            let name = call.function.name.unwrap_or_default();
            let added = json!({"output_index": self.index(), "item": call_item(&id, &call_id, &name, "", "in_progress")});
            out.push(self.event("response.output_item.added", added));
            self.open = Some(OpenItem::Call {
                id,
                call_id,
                name,
                arguments: String::new(),
            });
        }
        let delta = call.function.arguments;
        if delta.is_empty() {
            return;
        }
        let index = self.index();
        let Some(OpenItem::Call { id, arguments, .. }) = &mut self.open else {
            return; // arguments without a call: nothing to attach them to
        };
        arguments.push_str(&delta);
        let body = json!({"item_id": id, "output_index": index, "delta": delta});
        out.push(self.event("response.function_call_arguments.delta", body));
    }

    /// Ends the open item with its `.done` events.
    fn close(&mut self, status: &str, out: &mut Vec<SseChunk>) {
        let index = self.index();
        let item = match self.open.take() {
            None => return,
            Some(OpenItem::Reasoning { id, text }) => {
                let done =
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
                out.push(self.event("response.reasoning_text.done", done));
                reasoning_item(&id, &text, status)
            }
            Some(OpenItem::Message { id, text }) => {
                let done = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []});
                out.push(self.event("response.output_text.done", done));
                let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text(&text)});
                out.push(self.event("response.content_part.done", part));
                message_item(&id, Some(&text), status)
            }
            Some(OpenItem::Call {
                id,
                call_id,
                name,
                arguments,
            }) => {
                let done = json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments});
                out.push(self.event("response.function_call_arguments.done", done));
                call_item(&id, &call_id, &name, &arguments, status)
            }
        };
        let done = json!({"output_index": index, "item": item});
        out.push(self.event("response.output_item.done", done));
        self.items.push(item);
    }
}

impl ChunkWriter for ResponsesStream {
    type Chunk = SseChunk;
    const ENDS_WITH_DONE: bool = false;

    fn start(&mut self) -> Vec<SseChunk> {
        let response = serde_json::to_value(&self.shape).expect("responses serialize");
        vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
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
            ChoiceEvent::Finished { reason, usage, .. } => {
                for delta in self.parser.on_finish() {
                    self.on_delta(delta, &mut out);
                }
                let outcome = Outcome::of(Some(self.parser.finish_reason(reason)));
                self.close(outcome.item_status(), &mut out);
                self.ended = Some((outcome, usage));
            }
            ChoiceEvent::PromptLogprobs { .. } | ChoiceEvent::Failed(_) => {}
        }
        out
    }

    /// OpenAI's error object as an `error` event.
    fn failed(&mut self, error: &ApiError) -> Vec<SseChunk> {
        vec![SseChunk {
            event: Some("error"),
            data: serde_json::to_string(&error.body()).expect("error bodies serialize"),
        }]
    }

    fn finish(&mut self) -> Vec<SseChunk> {
        let Some((outcome, usage)) = self.ended else {
            return Vec::new();
        };
        let reasoning_tokens = reasoning_tokens(&self.tokenizer, &self.reasoning);
        let mut items = std::mem::take(&mut self.items);
        if items.is_empty() {
            // Nothing was generated but the end: an empty answer, as a whole response has.
            items.push(message_item(
                &new_id("msg"),
                Some(""),
                outcome.item_status(),
            ));
        }
        let response =
            self.shape
                .ended(outcome, items, ResponseUsage::new(&usage, reasoning_tokens));
        let body = json!({"response": response});
        vec![self.event(outcome.event(), body)]
    }
}

/// The reasoning text's length in tokens, for `output_tokens_details.reasoning_tokens`.
pub fn reasoning_tokens(tokenizer: &TokenizerBundle, text: &str) -> u32 {
    if text.is_empty() {
        return 0;
    }
    tokenizer
        .encode(text, false)
        .map(|ids| ids.len() as u32)
        .unwrap_or(0)
}
