//! One choice's output parser: the reasoning splitter first, then the tool-call scanner on
//! the answer part. With neither configured, text passes through untouched.

use super::reasoning::Part;
use super::tool_calls::{Call, ToolPart};
use super::{ReasoningMode, ReasoningSplitter, ToolCallScanner};

/// A call as the API returns it.
pub type ParsedToolCall = Call;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputPiece {
    Reasoning(String),
    Content(String),
    ToolCall(ParsedToolCall),
}

pub struct OutputParser {
    reasoning: Option<ReasoningSplitter>,
    tools: Option<ToolCallScanner>,
}

impl OutputParser {
    pub fn new(reasoning: Option<ReasoningMode>, tools: Option<ToolCallScanner>) -> OutputParser {
        OutputParser {
            reasoning: reasoning.map(ReasoningSplitter::new),
            tools,
        }
    }

    /// True when the text is passed through as it is.
    pub fn is_passthrough(&self) -> bool {
        self.reasoning.is_none() && self.tools.is_none()
    }

    pub fn feed(&mut self, text: &str) -> Vec<OutputPiece> {
        let parts = match &mut self.reasoning {
            Some(splitter) => splitter.feed(text),
            None => vec![Part::Content(text.to_owned())],
        };
        self.route(parts, false)
    }

    pub fn finish(&mut self) -> Vec<OutputPiece> {
        let parts = match &mut self.reasoning {
            Some(splitter) => splitter.finish(),
            None => Vec::new(),
        };
        self.route(parts, true)
    }

    /// Malformed tool-call markup passed on as content since the last call.
    pub fn take_fallbacks(&mut self) -> u32 {
        self.tools
            .as_mut()
            .map_or(0, ToolCallScanner::take_fallbacks)
    }

    fn route(&mut self, parts: Vec<Part>, last: bool) -> Vec<OutputPiece> {
        let mut out = Vec::new();
        for part in parts {
            match part {
                Part::Reasoning(text) => out.push(OutputPiece::Reasoning(text)),
                Part::Content(text) => match &mut self.tools {
                    Some(scanner) => out.extend(scanner.feed(&text).into_iter().map(piece)),
                    None => out.push(OutputPiece::Content(text)),
                },
            }
        }
        if last {
            if let Some(scanner) = &mut self.tools {
                out.extend(scanner.finish().into_iter().map(piece));
            }
        }
        out
    }
}

fn piece(part: ToolPart) -> OutputPiece {
    match part {
        ToolPart::Content(text) => OutputPiece::Content(text),
        ToolPart::Call(call) => OutputPiece::ToolCall(call),
    }
}

/// A whole output, parsed at once (non-streaming responses).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    pub fn add(&mut self, pieces: Vec<OutputPiece>) {
        for p in pieces {
            match p {
                OutputPiece::Reasoning(t) => self.reasoning.push_str(&t),
                OutputPiece::Content(t) => self.content.push_str(&t),
                OutputPiece::ToolCall(c) => self.tool_calls.push(c),
            }
        }
    }
}
