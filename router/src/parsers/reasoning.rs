//! Splitting `<think>…</think>` from the answer, incrementally.
//!
//! Templates differ in who writes the opening tag: GLM-4.7/5 and DeepSeek-R1/V3.2 templates end
//! the prompt with `<think>` (generation starts inside the thinking) or, with thinking turned
//! off, with `</think>`; GLM-4.5 lets the model write `<think>` itself. So the starting mode
//! comes from the end of the rendered prompt, and a `<think>` at the very start of the output
//! is accepted either way. Leading whitespace of each part and whitespace just before
//! `</think>` are dropped.

use super::markers::{partial_suffix, split_trailing_whitespace};
use super::ReasoningParserKind;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningMode {
    Reasoning,
    Content,
}

impl ReasoningMode {
    /// Where generation starts, from the rendered prompt: inside thinking when the prompt
    /// opened `<think>`, in the answer when it closed it (thinking disabled), otherwise as the
    /// parser assumes (DeepSeek-R1 always thinks; the others start in the answer and switch
    /// if the model opens `<think>`).
    pub fn for_prompt(kind: ReasoningParserKind, rendered_prompt: &str) -> ReasoningMode {
        let tail = rendered_prompt.trim_end();
        if tail.ends_with(OPEN) {
            ReasoningMode::Reasoning
        } else if tail.ends_with(CLOSE) {
            ReasoningMode::Content
        } else if kind == ReasoningParserKind::DeepSeekR1 {
            ReasoningMode::Reasoning
        } else {
            ReasoningMode::Content
        }
    }
}

/// A piece of output: thinking or answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Reasoning(String),
    Content(String),
}

pub struct ReasoningSplitter {
    mode: ReasoningMode,
    /// Nothing but whitespace seen since the output or the answer began.
    at_start: bool,
    /// A `<think>` may still open the output (only at its very beginning).
    may_open: bool,
    /// Text not yet passed on: a possible partial tag, or whitespace that may precede `</think>`.
    pending: String,
}

impl ReasoningSplitter {
    pub fn new(mode: ReasoningMode) -> ReasoningSplitter {
        ReasoningSplitter {
            mode,
            at_start: true,
            may_open: true,
            pending: String::new(),
        }
    }

    pub fn feed(&mut self, text: &str) -> Vec<Part> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.at_start {
                let trimmed = self.pending.trim_start();
                if trimmed.is_empty() {
                    self.pending.clear();
                    break;
                }
                if self.may_open && trimmed.starts_with(OPEN) {
                    self.pending = trimmed[OPEN.len()..].to_owned();
                    self.mode = ReasoningMode::Reasoning;
                    self.may_open = false;
                    continue;
                }
                if self.may_open && OPEN.starts_with(trimmed) {
                    self.pending = trimmed.to_owned();
                    break;
                }
                self.pending = trimmed.to_owned();
                self.at_start = false;
                self.may_open = false;
            }
            match self.mode {
                ReasoningMode::Reasoning => {
                    if let Some(at) = self.pending.find(CLOSE) {
                        let thinking = self.pending[..at].trim_end().to_owned();
                        push(&mut out, Part::Reasoning(thinking));
                        self.pending.drain(..at + CLOSE.len());
                        self.mode = ReasoningMode::Content;
                        self.at_start = true;
                        continue;
                    }
                    // Hold a possible partial `</think>` and the whitespace before it.
                    let keep = partial_suffix(&self.pending, CLOSE);
                    let (body, _) =
                        split_trailing_whitespace(&self.pending[..self.pending.len() - keep]);
                    let body_len = body.len();
                    let thinking = self.pending[..body_len].to_owned();
                    self.pending.drain(..body_len);
                    push(&mut out, Part::Reasoning(thinking));
                    break;
                }
                ReasoningMode::Content => {
                    push(&mut out, Part::Content(std::mem::take(&mut self.pending)));
                    break;
                }
            }
        }
        out
    }

    /// The end of the output: whatever was held back is passed on (an unclosed `<think>`
    /// leaves everything in the thinking, as the model never got to its answer).
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match self.mode {
            ReasoningMode::Reasoning => push(&mut out, Part::Reasoning(rest.trim_end().to_owned())),
            ReasoningMode::Content => push(&mut out, Part::Content(rest)),
        }
        out
    }
}

fn push(out: &mut Vec<Part>, part: Part) {
    let empty = match &part {
        Part::Reasoning(t) | Part::Content(t) => t.is_empty(),
    };
    if !empty {
        out.push(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(mode: ReasoningMode, text: &str) -> (String, String) {
        let mut s = ReasoningSplitter::new(mode);
        let mut parts = s.feed(text);
        parts.extend(s.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => r.push_str(&t),
                Part::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    #[test]
    fn prompt_decides_the_start() {
        use ReasoningParserKind::*;
        let m = ReasoningMode::for_prompt;
        assert_eq!(m(Glm45, "<|assistant|><think>"), ReasoningMode::Reasoning);
        assert_eq!(m(Glm45, "<|assistant|></think>"), ReasoningMode::Content);
        assert_eq!(
            m(Glm45, "<|assistant|>\n<think></think>"),
            ReasoningMode::Content
        );
        assert_eq!(m(Glm45, "<|assistant|>"), ReasoningMode::Content);
        assert_eq!(
            m(DeepSeekR1, "<｜Assistant｜><think>\n"),
            ReasoningMode::Reasoning
        );
        assert_eq!(m(DeepSeekR1, "<｜Assistant｜>"), ReasoningMode::Reasoning);
        assert_eq!(
            m(DeepSeekV3, "<｜Assistant｜></think>"),
            ReasoningMode::Content
        );
        assert_eq!(m(DeepSeekV3, "<｜Assistant｜>"), ReasoningMode::Content);
    }

    #[test]
    fn splits_thinking_from_the_answer() {
        let r = ReasoningMode::Reasoning;
        let c = ReasoningMode::Content;
        let s = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            split(r, "plan it\n</think>\n\nThe answer."),
            s("plan it", "The answer.")
        );
        assert_eq!(split(c, "<think>plan</think>Answer"), s("plan", "Answer"));
        assert_eq!(
            split(c, "\n<think>\nplan\n</think>Answer"),
            s("plan", "Answer")
        );
        assert_eq!(split(r, "<think>plan</think>Answer"), s("plan", "Answer"));
        // Thinking disabled: nothing is taken from the answer, even a later `</think>`.
        assert_eq!(
            split(c, "Answer with </think> inside"),
            s("", "Answer with </think> inside")
        );
        assert_eq!(
            split(c, "Not <think> at the start"),
            s("", "Not <think> at the start")
        );
        // Cut off while thinking.
        assert_eq!(split(r, "still thinking  "), s("still thinking", ""));
        assert_eq!(split(c, "<thin"), s("", "<thin"));
        assert_eq!(split(r, "a </thi"), s("a </thi", ""));
        assert_eq!(split(r, "</think>"), s("", ""));
    }
}
