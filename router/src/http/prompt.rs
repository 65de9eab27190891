//! Turning request text into token ids, off the async reactor: tokenizing or rendering a long
//! prompt takes milliseconds of CPU, which would stall every other connection on the thread.

use std::sync::Arc;

use crate::tokenizer::TokenizerBundle;

use super::errors::ApiError;
use super::openai_types::PromptInput;
use super::validation::check_token_ids;

/// One prompt: its token ids and its text (for `echo`).
#[derive(Debug, Clone)]
pub struct Prompt {
    pub ids: Vec<i32>,
    pub text: String,
}

/// Runs CPU-heavy text work on the blocking pool.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("tokenization task failed: {e}")))
}

enum Item {
    Text(String),
    Ids(Vec<i64>),
}

/// The prompts of a completions request, tokenized (with the tokenizer's special tokens,
/// e.g. BOS, as for any raw prompt) and checked against the vocabulary.
pub async fn completion_prompts(
    tokenizer: &Arc<TokenizerBundle>,
    input: PromptInput,
    vocab_size: u32,
) -> Result<Vec<Prompt>, ApiError> {
    let items: Vec<Item> = match input {
        PromptInput::Text(s) => vec![Item::Text(s)],
        PromptInput::Tokens(ids) => vec![Item::Ids(ids)],
        PromptInput::Texts(list) => list.into_iter().map(Item::Text).collect(),
        PromptInput::TokenLists(list) => list.into_iter().map(Item::Ids).collect(),
    };
    if items.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "The prompt list is empty.",
        ));
    }
    let tokenizer = Arc::clone(tokenizer);
    blocking(move || {
        items
            .into_iter()
            .map(|item| match item {
                Item::Text(text) if text.is_empty() => {
                    Err(ApiError::invalid_param("prompt", "The prompt is empty."))
                }
                Item::Text(text) => {
                    let ids = tokenizer
                        .encode(&text, true)
                        .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?;
                    Ok(Prompt { ids, text })
                }
                Item::Ids(ids) if ids.is_empty() => {
                    Err(ApiError::invalid_param("prompt", "The prompt is empty."))
                }
                Item::Ids(ids) => {
                    let ids = check_token_ids("prompt", &ids, vocab_size)?;
                    let text = tokenizer.decode(&ids, false);
                    Ok(Prompt { ids, text })
                }
            })
            .collect()
    })
    .await?
}
