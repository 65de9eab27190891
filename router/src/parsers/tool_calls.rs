//! Finding tool-call blocks in the answer, incrementally. Text outside the markup is content;
//! a block is parsed once its closing tag arrives, so malformed markup can still fall back to
//! plain content (it is never half-sent as a call). Whitespace that only separates text from
//! tool-call markup is dropped; elsewhere content is passed on exactly.

use super::arguments::{RawArgument, ToolSet};
use super::markers::{partial_suffix, resume_at, split_trailing_whitespace};
use super::{dsml, glm, ToolParserKind};

/// One call as the markup wrote it, before typing against the schema.
#[derive(Debug, Clone, PartialEq)]
pub struct RawCall {
    pub name: String,
    pub arguments: Vec<RawArgument>,
}

/// A call ready for the response: its arguments are a JSON object string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolPart {
    Content(String),
    Call(Call),
}

/// Reads the text between a block's tags; `None` when it is malformed.
type BlockParser = fn(&str) -> Option<Vec<RawCall>>;

pub struct ToolCallScanner {
    open: &'static str,
    close: &'static str,
    parse: BlockParser,
    tools: ToolSet,
    /// Unprocessed text: a possible partial opening tag, or an unclosed block.
    pending: String,
    in_block: bool,
    /// How much of `pending` was searched for the closing tag already.
    searched: usize,
    /// Trailing whitespace of the content, held until we know whether markup follows.
    whitespace: String,
    /// Only whitespace since the last call: it is dropped.
    after_call: bool,
    fallbacks: u32,
}

impl ToolCallScanner {
    pub fn new(kind: ToolParserKind, tools: ToolSet) -> ToolCallScanner {
        let (open, close, parse): (_, _, BlockParser) = match kind {
            ToolParserKind::Glm45 | ToolParserKind::Glm47 => {
                (glm::OPEN, glm::CLOSE, glm::parse_block)
            }
            ToolParserKind::DeepSeekV32 => (dsml::OPEN, dsml::CLOSE, dsml::parse_block),
        };
        ToolCallScanner {
            open,
            close,
            parse,
            tools,
            pending: String::new(),
            in_block: false,
            searched: 0,
            whitespace: String::new(),
            after_call: false,
            fallbacks: 0,
        }
    }

    /// Malformed blocks (or calls to functions the request did not offer) seen so far, each
    /// passed on as content. Reading resets the count.
    pub fn take_fallbacks(&mut self) -> u32 {
        std::mem::take(&mut self.fallbacks)
    }

    pub fn feed(&mut self, text: &str) -> Vec<ToolPart> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if !self.in_block {
                if let Some(at) = self.pending.find(self.open) {
                    let before: String = self.pending.drain(..at).collect();
                    self.content(&before, &mut out);
                    self.in_block = true;
                    self.searched = self.open.len();
                    continue;
                }
                let keep = partial_suffix(&self.pending, self.open);
                let text: String = self.pending.drain(..self.pending.len() - keep).collect();
                self.content(&text, &mut out);
                break;
            }
            let from = resume_at(&self.pending, self.searched, self.close);
            let Some(at) = self.pending[from..].find(self.close).map(|i| from + i) else {
                self.searched = self.pending.len();
                break;
            };
            let block: String = self.pending.drain(..at + self.close.len()).collect();
            self.in_block = false;
            self.block(&block, &mut out);
        }
        out
    }

    /// The end of the output: an unclosed block is malformed and becomes content.
    pub fn finish(&mut self) -> Vec<ToolPart> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        if self.in_block {
            self.in_block = false;
            self.fallbacks += 1;
        }
        self.content(&rest, &mut out);
        if !self.after_call {
            let whitespace = std::mem::take(&mut self.whitespace);
            if !whitespace.is_empty() {
                out.push(ToolPart::Content(whitespace));
            }
        }
        out
    }

    /// A whole block, tags included.
    fn block(&mut self, block: &str, out: &mut Vec<ToolPart>) {
        let inner = &block[self.open.len()..block.len() - self.close.len()];
        let calls = (self.parse)(inner).and_then(|raw| {
            raw.into_iter()
                .map(|call| {
                    let arguments = self.tools.arguments_json(&call.name, call.arguments)?;
                    Some(Call {
                        name: call.name,
                        arguments,
                    })
                })
                .collect::<Option<Vec<Call>>>()
        });
        match calls {
            Some(calls) => {
                self.whitespace.clear();
                self.after_call = true;
                out.extend(calls.into_iter().map(ToolPart::Call));
            }
            None => {
                self.fallbacks += 1;
                self.content(block, out);
            }
        }
    }

    /// Content text: whitespace right after a call is dropped, trailing whitespace is held.
    fn content(&mut self, text: &str, out: &mut Vec<ToolPart>) {
        let text = if self.after_call {
            text.trim_start()
        } else {
            text
        };
        if text.is_empty() {
            return;
        }
        self.after_call = false;
        let (body, trailing) = split_trailing_whitespace(text);
        if !body.is_empty() {
            let mut piece = std::mem::take(&mut self.whitespace);
            piece.push_str(body);
            out.push(ToolPart::Content(piece));
        }
        self.whitespace.push_str(trailing);
    }
}
