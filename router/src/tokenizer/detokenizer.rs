//! Incremental detokenization for streaming. Decoding tokens one at a time is wrong for most
//! tokenizers (SentencePiece drops a word's leading space at the start of a decode; byte-level
//! BPE splits multi-byte characters across tokens), so each step decodes a small window
//! `ids[prefix_offset..]`, compares it with the window's already-emitted part
//! `ids[prefix_offset..read_offset]` and emits only the new suffix. Output that ends in U+FFFD
//! is an incomplete character: it is held back until the next token completes it.

use super::TokenizerBundle;

/// Prompt tokens kept as decoding context, so the first generated token decodes as it would
/// in the middle of the text.
const CONTEXT_TOKENS: usize = 5;

pub struct IncrementalDetokenizer {
    ids: Vec<i32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Special tokens decode to nothing (vLLM's `skip_special_tokens`, on by default).
    skip_special: bool,
}

impl IncrementalDetokenizer {
    /// `prompt_ids`: the request's prompt; only its last few tokens are kept as context.
    pub fn new(prompt_ids: &[i32]) -> IncrementalDetokenizer {
        let context = &prompt_ids[prompt_ids.len().saturating_sub(CONTEXT_TOKENS)..];
        IncrementalDetokenizer {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special: true,
        }
    }

    /// Special tokens show as their text (`skip_special_tokens: false`).
    pub fn showing_special_tokens(mut self, show: bool) -> IncrementalDetokenizer {
        self.skip_special = !show;
        self
    }

    /// Adds one generated token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &TokenizerBundle, id: i32) -> String {
        self.ids.push(id);
        let emitted = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        );
        let window = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special);
        if window.len() <= emitted.len()
            || window.ends_with('\u{FFFD}')
            || !window.is_char_boundary(emitted.len())
        {
            return String::new();
        }
        let new_text = window[emitted.len()..].to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // The window only ever looks back to prefix_offset: drop what lies before it.
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        new_text
    }

    /// At the end of generation: whatever is still held back, even an incomplete character
    /// (the model really ended there).
    pub fn flush(&mut self, tokenizer: &TokenizerBundle) -> String {
        let emitted = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        );
        let window = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if window.len() > emitted.len() && window.is_char_boundary(emitted.len()) {
            window[emitted.len()..].to_owned()
        } else {
            String::new()
        }
    }
}
