//! From a choice's generated text to chat message fields, through the configured output
//! parsers: whole messages for plain responses, deltas for streams. Both run the same
//! incremental parser, so they agree.

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::parsers::{
    OutputParser, OutputPiece, ParsedOutput, ParsedToolCall, ReasoningMode, ReasoningParserKind,
    ToolCallScanner, ToolParserKind, ToolSet,
};

use super::openai_types::{
    ChatDelta, ChatMessage, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
};

/// How every choice of one chat request parses its output.
pub struct OutputSetup {
    reasoning: Option<ReasoningMode>,
    tools: Option<(ToolParserKind, ToolSet)>,
    /// `parallel_tool_calls`: false keeps only a choice's first call.
    parallel_calls: bool,
    metrics: Arc<Metrics>,
}

impl OutputSetup {
    /// `rendered_prompt` decides whether generation starts inside `<think>`; `tools` is `None`
    /// when no calls should be parsed (no tools offered, or `tool_choice` "none").
    pub fn new(
        reasoning: Option<ReasoningParserKind>,
        rendered_prompt: &str,
        tools: Option<(ToolParserKind, ToolSet)>,
        parallel_calls: bool,
        metrics: Arc<Metrics>,
    ) -> OutputSetup {
        OutputSetup {
            reasoning: reasoning.map(|kind| ReasoningMode::for_prompt(kind, rendered_prompt)),
            tools: tools.filter(|(_, set)| !set.is_empty()),
            parallel_calls,
            metrics,
        }
    }

    /// Whether generation starts inside the model's thinking (a structured output then shapes
    /// only the answer after it).
    pub fn starts_thinking(&self) -> bool {
        self.reasoning == Some(ReasoningMode::Reasoning)
    }

    fn parser(&self) -> ChoiceParser {
        let scanner = self
            .tools
            .as_ref()
            .map(|(kind, set)| ToolCallScanner::new(*kind, set.clone()));
        ChoiceParser {
            parser: OutputParser::new(self.reasoning, scanner),
            tool_parser: self.tools.as_ref().map(|(kind, _)| kind.name()),
            metrics: Arc::clone(&self.metrics),
            calls: 0,
            max_calls: if self.parallel_calls { u32::MAX } else { 1 },
        }
    }

    /// A whole output as the response message, and the finish reason to report.
    pub fn message(
        &self,
        text: &str,
        reason: Option<&'static str>,
    ) -> (ChatMessage, Option<&'static str>) {
        let mut parser = self.parser();
        if parser.parser.is_passthrough() {
            return (message(Some(text.to_owned()), None, Vec::new()), reason);
        }
        let mut out = ParsedOutput::default();
        let pieces = parser.feed(text);
        out.add(pieces);
        let pieces = parser.finish();
        out.add(pieces);
        let calls: Vec<ToolCall> = out.tool_calls.into_iter().map(tool_call).collect();
        let reason = parser.finish_reason(reason);
        let content = (!out.content.is_empty() || calls.is_empty()).then_some(out.content);
        let reasoning = (!out.reasoning.is_empty()).then_some(out.reasoning);
        (message(content, reasoning, calls), reason)
    }

    pub fn streaming(&self) -> StreamingChoice {
        StreamingChoice {
            parser: self.parser(),
        }
    }
}

fn message(
    content: Option<String>,
    reasoning_content: Option<String>,
    calls: Vec<ToolCall>,
) -> ChatMessage {
    ChatMessage {
        role: "assistant",
        content,
        reasoning_content,
        tool_calls: (!calls.is_empty()).then_some(calls),
    }
}

fn call_id() -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    format!("call_{}", &hex[..24])
}

fn tool_call(call: ParsedToolCall) -> ToolCall {
    ToolCall {
        id: call_id(),
        kind: "function",
        function: FunctionCall {
            name: call.name,
            arguments: call.arguments,
        },
    }
}

struct ChoiceParser {
    parser: OutputParser,
    tool_parser: Option<&'static str>,
    metrics: Arc<Metrics>,
    calls: u32,
    /// Calls past this many are dropped (`parallel_tool_calls: false`).
    max_calls: u32,
}

impl ChoiceParser {
    fn feed(&mut self, text: &str) -> Vec<OutputPiece> {
        let pieces = self.parser.feed(text);
        self.count(pieces)
    }

    fn finish(&mut self) -> Vec<OutputPiece> {
        let pieces = self.parser.finish();
        self.count(pieces)
    }

    /// Counts the calls, dropping those past `max_calls`, and the parser's fallbacks.
    fn count(&mut self, mut pieces: Vec<OutputPiece>) -> Vec<OutputPiece> {
        let (calls, max) = (&mut self.calls, self.max_calls);
        pieces.retain(|p| {
            if !matches!(p, OutputPiece::ToolCall(_)) {
                return true;
            }
            *calls += 1;
            *calls <= max
        });
        self.calls = self.calls.min(max);
        if let Some(name) = self.tool_parser {
            self.metrics
                .add_parser_fallbacks(name, u64::from(self.parser.take_fallbacks()));
        }
        pieces
    }

    /// "tool_calls" when the model stopped after calling tools; a length cut stays "length".
    fn finish_reason(&self, reason: Option<&'static str>) -> Option<&'static str> {
        match reason {
            Some("stop") if self.calls > 0 => Some("tool_calls"),
            other => other,
        }
    }
}

/// One streamed choice: text in, deltas out.
pub struct StreamingChoice {
    parser: ChoiceParser,
}

impl StreamingChoice {
    /// Deltas for newly generated text. Without parsers every piece of text is one content
    /// delta (even an empty one, which carries logprobs of tokens still held back).
    pub fn on_text(&mut self, text: &str) -> Vec<ChatDelta> {
        if self.parser.parser.is_passthrough() {
            return vec![content_delta(text.to_owned())];
        }
        let first_call = self.parser.calls;
        let pieces = self.parser.feed(text);
        deltas(pieces, first_call)
    }

    /// Deltas for whatever the parsers held back, at the end of generation.
    pub fn on_finish(&mut self) -> Vec<ChatDelta> {
        let first_call = self.parser.calls;
        let pieces = self.parser.finish();
        deltas(pieces, first_call)
    }

    pub fn finish_reason(&self, reason: &'static str) -> &'static str {
        self.parser.finish_reason(Some(reason)).unwrap_or(reason)
    }
}

fn content_delta(text: String) -> ChatDelta {
    ChatDelta {
        content: Some(text),
        ..ChatDelta::default()
    }
}

/// Each call becomes two deltas, as OpenAI streams them: id, type and name with empty
/// arguments, then the arguments.
fn deltas(pieces: Vec<OutputPiece>, mut next_call: u32) -> Vec<ChatDelta> {
    let mut out = Vec::new();
    for piece in pieces {
        match piece {
            OutputPiece::Content(text) => out.push(content_delta(text)),
            OutputPiece::Reasoning(text) => out.push(ChatDelta {
                reasoning_content: Some(text),
                ..ChatDelta::default()
            }),
            OutputPiece::ToolCall(call) => {
                let index = next_call;
                next_call += 1;
                out.push(ChatDelta {
                    tool_calls: Some(vec![ToolCallDelta {
                        index,
                        id: Some(call_id()),
                        kind: Some("function"),
                        function: FunctionCallDelta {
                            name: Some(call.name),
                            arguments: String::new(),
                        },
                    }]),
                    ..ChatDelta::default()
                });
                out.push(ChatDelta {
                    tool_calls: Some(vec![ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionCallDelta {
                            name: None,
                            arguments: call.arguments,
                        },
                    }]),
                    ..ChatDelta::default()
                });
            }
        }
    }
    out
}
