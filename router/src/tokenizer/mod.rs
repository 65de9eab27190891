//! Everything text: the model's tokenizer, its chat template, incremental detokenization and
//! stop strings. Loaded once from the model directory and shared (read-only) by all requests.

mod chat_template;
mod detokenizer;
mod model_files;
mod python_json;
mod stop;
mod token_bytes;

use std::path::Path;

use anyhow::Context;
use tokenizers::Tokenizer;

pub use chat_template::{ChatTemplate, ChatTemplateError};
pub use detokenizer::IncrementalDetokenizer;
pub use model_files::SpecialTokens;
pub use stop::{StopMatcher, StopOutcome};
pub use token_bytes::byte_level_chars;

/// The tokenizer, chat template and special tokens of one model.
pub struct TokenizerBundle {
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    special: SpecialTokens,
    eos_token_ids: Vec<i32>,
    /// Raw bytes of every token id, for the `bytes` field of chat logprobs.
    token_bytes: token_bytes::TokenBytes,
}

impl TokenizerBundle {
    /// Loads `tokenizer.json`, the chat template (`chat_template.jinja`, `chat_template.json`
    /// or `tokenizer_config.json`, in that order, as Hugging Face does) and the EOS ids
    /// (`generation_config.json`, `config.json` and the tokenizer's `eos_token`, all of them).
    pub fn from_model_dir(dir: &Path) -> anyhow::Result<TokenizerBundle> {
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tokenizer_path.display()))?;
        let files = model_files::ModelFiles::read(dir)?;
        let chat_template = match &files.chat_template {
            Some(source) => Some(
                ChatTemplate::new(source, files.special.clone()).with_context(|| {
                    format!("the chat template in {} does not compile", dir.display())
                })?,
            ),
            None => None,
        };
        let mut eos_token_ids = files.eos_token_ids.clone();
        if let Some(eos) = &files.special.eos_token {
            if let Some(id) = tokenizer.token_to_id(eos) {
                eos_token_ids.push(id as i32);
            }
        }
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        let token_bytes = token_bytes::TokenBytes::new(&tokenizer);
        Ok(TokenizerBundle {
            tokenizer,
            chat_template,
            special: files.special,
            eos_token_ids,
            token_bytes,
        })
    }

    /// Token ids of `text`. `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (typically BOS): true for raw completions prompts, false for rendered chat templates,
    /// which carry their own special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<Vec<i32>> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
        Ok(encoding.get_ids().iter().map(|&id| id as i32).collect())
    }

    /// Text of `ids`. Ids the tokenizer does not know (a model vocabulary padded beyond the
    /// tokenizer's) decode to nothing. Bytes of an incomplete UTF-8 sequence become U+FFFD.
    pub fn decode(&self, ids: &[i32], skip_special_tokens: bool) -> String {
        let ids: Vec<u32> = ids
            .iter()
            .filter(|&&id| id >= 0)
            .map(|&id| id as u32)
            .collect();
        self.tokenizer
            .decode(&ids, skip_special_tokens)
            .unwrap_or_default()
    }

    /// One token's text as the logprobs fields show it (special tokens included).
    pub fn token_text(&self, id: i32) -> String {
        self.decode(&[id], false)
    }

    /// One token's raw bytes (a token may hold part of a multi-byte character).
    pub fn token_bytes(&self, id: i32) -> Vec<u8> {
        match self.token_bytes.get(id) {
            Some(bytes) => bytes.to_vec(),
            None => self.token_text(id).into_bytes(),
        }
    }

    /// Ids that end generation unless the request sets `ignore_eos`.
    pub fn eos_token_ids(&self) -> &[i32] {
        &self.eos_token_ids
    }

    /// The id of a token spelled exactly `token` (an added token such as `</think>`).
    pub fn token_id(&self, token: &str) -> Option<i32> {
        self.tokenizer.token_to_id(token).map(|id| id as i32)
    }

    /// Ids of the added tokens marked special (chat markers, EOS): a grammar never spells text
    /// with them.
    pub fn special_token_ids(&self) -> Vec<i32> {
        let mut ids: Vec<i32> = self
            .tokenizer
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id as i32)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Number of token ids the tokenizer knows, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }
}
