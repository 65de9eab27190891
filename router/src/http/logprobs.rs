//! Logprobs in the two OpenAI shapes: the legacy completions one (parallel arrays with
//! character offsets, top-N as a token->logprob map including the chosen token) and the chat
//! one (a list of {token, logprob, bytes, top_logprobs}).

use serde_json::{Map, Value};

use crate::protocol::{PromptLogprobs, TokenLogprobs};
use crate::tokenizer::TokenizerBundle;

use super::generation::GeneratedToken;
use super::openai_types::{ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs};

/// JSON has no -inf (a token the sampler ruled out); report a very negative number instead.
fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

fn top_map(
    tokenizer: &TokenizerBundle,
    chosen: i32,
    lp: &TokenLogprobs,
    top_n: u32,
) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert(
        tokenizer.token_text(chosen),
        Value::from(finite(lp.logprob)),
    );
    for &(id, logprob) in lp.top.iter().take(top_n as usize) {
        map.entry(tokenizer.token_text(id))
            .or_insert_with(|| Value::from(finite(logprob)));
    }
    map
}

/// Appends completions logprobs for tokens, advancing `offset` (characters of text so far).
pub fn extend_completion(
    out: &mut CompletionLogprobs,
    tokenizer: &TokenizerBundle,
    tokens: &[(i32, Option<&TokenLogprobs>)],
    top_n: u32,
    offset: &mut usize,
) {
    for &(id, lp) in tokens {
        let text = tokenizer.token_text(id);
        out.text_offset.push(*offset);
        *offset += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(lp.map(|l| finite(l.logprob)));
        out.top_logprobs
            .push(lp.map(|l| top_map(tokenizer, id, l, top_n)));
    }
}

pub fn generated_completion(
    tokenizer: &TokenizerBundle,
    tokens: &[GeneratedToken],
    top_n: u32,
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let items: Vec<_> = tokens.iter().map(|t| (t.id, t.logprobs.as_ref())).collect();
    extend_completion(&mut out, tokenizer, &items, top_n, offset);
    out
}

/// Logprobs of the prompt tokens (for `echo`): the first token has none (`null`), and so has
/// any position the engine did not report.
pub fn prompt_completion(
    tokenizer: &TokenizerBundle,
    prompt_ids: &[i32],
    reported: &[PromptLogprobs],
    top_n: u32,
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut by_position: Vec<Option<&TokenLogprobs>> = vec![None; prompt_ids.len()];
    for chunk in reported {
        for (k, entry) in chunk.entries.iter().enumerate() {
            let pos = chunk.first_pos as usize + k;
            if pos > 0 && pos < by_position.len() {
                by_position[pos] = Some(entry);
            }
        }
    }
    let items: Vec<_> = prompt_ids.iter().copied().zip(by_position).collect();
    let mut out = CompletionLogprobs::default();
    extend_completion(&mut out, tokenizer, &items, top_n, offset);
    out
}

pub fn append_completion(into: &mut CompletionLogprobs, more: CompletionLogprobs) {
    into.tokens.extend(more.tokens);
    into.token_logprobs.extend(more.token_logprobs);
    into.top_logprobs.extend(more.top_logprobs);
    into.text_offset.extend(more.text_offset);
}

pub fn chat(tokenizer: &TokenizerBundle, tokens: &[GeneratedToken], top_n: u32) -> ChatLogprobs {
    let content = tokens
        .iter()
        .filter_map(|t| {
            let lp = t.logprobs.as_ref()?;
            let top_logprobs = lp
                .top
                .iter()
                .take(top_n as usize)
                .map(|&(id, logprob)| ChatTopLogprob {
                    token: tokenizer.token_text(id),
                    logprob: finite(logprob),
                    bytes: tokenizer.token_bytes(id),
                })
                .collect();
            Some(ChatTokenLogprob {
                token: tokenizer.token_text(t.id),
                logprob: finite(lp.logprob),
                bytes: tokenizer.token_bytes(t.id),
                top_logprobs,
            })
        })
        .collect();
    ChatLogprobs {
        content,
        refusal: None,
    }
}
