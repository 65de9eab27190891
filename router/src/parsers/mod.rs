//! Turning a chat model's raw output into OpenAI's message fields: the thinking between
//! `<think>` and `</think>` becomes `reasoning_content`, tool-call markup becomes `tool_calls`,
//! and everything else stays `content`.
//!
//! One incremental state machine serves both streaming and whole responses (a whole response
//! is one `feed` and a `finish`), so a stream split anywhere gives the same result. Malformed
//! markup never fails a request: it is passed on as content and counted as a fallback.
//!
//! The parsers read detokenized text. The tags (`<think>`, `<tool_call>`, `<arg_key>`, …) are
//! added tokens that GLM's and DeepSeek's tokenizers do not mark special, so decoding, which
//! skips special tokens, keeps them. A tokenizer that marked them special would hide them.

mod arguments;
mod call_grammar;
mod dsml;
mod glm;
mod markers;
mod output;
mod reasoning;
mod tool_calls;

use serde::Deserialize;

pub use arguments::ToolSet;
pub use call_grammar::{forced_calls_grammar, CallCount};
pub use output::{OutputParser, OutputPiece, ParsedOutput, ParsedToolCall};
pub use reasoning::{ReasoningMode, ReasoningSplitter};
pub use tool_calls::ToolCallScanner;

/// `--reasoning-parser`, with SGLang's names. All three use `<think>`…`</think>`; they differ
/// in where generation starts when the rendered prompt does not say (see [`ReasoningMode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ReasoningParserKind {
    /// GLM-4.5 / 4.7 / 5.
    #[serde(rename = "glm45")]
    Glm45,
    /// DeepSeek-R1: always thinks, and older templates put `<think>` in the prompt.
    #[serde(rename = "deepseek-r1")]
    DeepSeekR1,
    /// DeepSeek-V3.1 / V3.2: thinks only when the template opened `<think>`.
    #[serde(rename = "deepseek-v3")]
    DeepSeekV3,
}

impl ReasoningParserKind {
    pub fn name(self) -> &'static str {
        match self {
            ReasoningParserKind::Glm45 => "glm45",
            ReasoningParserKind::DeepSeekR1 => "deepseek-r1",
            ReasoningParserKind::DeepSeekV3 => "deepseek-v3",
        }
    }
}

/// `--tool-call-parser`, with SGLang's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ToolParserKind {
    /// GLM-4.5: `<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>`.
    #[serde(rename = "glm45")]
    Glm45,
    /// GLM-4.7 / 5: the same markup without the newlines.
    #[serde(rename = "glm47")]
    Glm47,
    /// DeepSeek-V3.2: `<｜DSML｜function_calls>` around `<｜DSML｜invoke name="…">` blocks.
    #[serde(rename = "deepseekv32")]
    DeepSeekV32,
}

impl ToolParserKind {
    pub fn name(self) -> &'static str {
        match self {
            ToolParserKind::Glm45 => "glm45",
            ToolParserKind::Glm47 => "glm47",
            ToolParserKind::DeepSeekV32 => "deepseekv32",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flag values `serve` passes through are SGLang's names.
    #[test]
    fn kinds_read_sglang_names() {
        let reasoning = |s: &str| serde_json::from_str::<ReasoningParserKind>(s).ok();
        let tools = |s: &str| serde_json::from_str::<ToolParserKind>(s).ok();
        for kind in [
            ReasoningParserKind::Glm45,
            ReasoningParserKind::DeepSeekR1,
            ReasoningParserKind::DeepSeekV3,
        ] {
            assert_eq!(reasoning(&format!("\"{}\"", kind.name())), Some(kind));
        }
        for kind in [
            ToolParserKind::Glm45,
            ToolParserKind::Glm47,
            ToolParserKind::DeepSeekV32,
        ] {
            assert_eq!(tools(&format!("\"{}\"", kind.name())), Some(kind));
        }
        assert_eq!(reasoning("\"qwen3\""), None);
        assert_eq!(tools("\"glm4\""), None);
    }
}
