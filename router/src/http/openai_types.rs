//! The OpenAI request and response bodies, field for field. Requests keep numbers wide
//! (i64/f64) so that out-of-range values reach validation and get a clear message instead of
//! a deserializer error.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::structured_output::StructuredOutputFields;

/// `prompt`: a string, token ids, or a list of either (one choice group per prompt).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<i64>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<i64>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields shared by completions and chat completions.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Any integer; wide seeds from clients wrap into u64.
    pub seed: Option<serde_json::Number>,
    pub stop: Option<StopInput>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Accepted for compatibility; it identifies the end user in OpenAI's logs.
    #[allow(dead_code)]
    pub user: Option<String>,
    /// Token id (as a string) -> bias added to its logit, from -100 to 100.
    pub logit_bias: Option<Map<String, Value>>,
    /// vLLM's: no stop token (EOS or `stop_token_ids`) is sampled, and no stop string ends the
    /// text, before this many tokens are generated.
    pub min_tokens: Option<i64>,
    /// SGLang's name for `min_tokens`.
    pub min_new_tokens: Option<i64>,
    /// vLLM's: only these token ids may be sampled.
    pub allowed_token_ids: Option<Vec<i64>>,
    /// vLLM's: a stop string (or stop token's text) stays at the end of the output.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: false shows special tokens (chat markers, EOS) in the text. Default true.
    pub skip_special_tokens: Option<bool>,
    /// vLLM's / SGLang's scheduling priority (an integer, default 0); ordered only under
    /// `--enable-priority-scheduling`, ignored otherwise (as SGLang does).
    pub priority: Option<i64>,
    /// vLLM's: the prompt's cached KV is shared only with requests carrying the same salt
    /// (keeps tenants from probing each other's prompts through prefix-cache timing).
    pub cache_salt: Option<String>,
    /// vLLM / SGLang request extras that would change the output and are not implemented:
    /// refused with a 400 when set to anything but their no-op value, never silently ignored.
    #[serde(flatten)]
    pub unimplemented_extras: UnimplementedExtras,
    /// `response_format` and vLLM's / SGLang's structured-output fields (http::structured_output).
    #[serde(flatten)]
    pub structured: StructuredOutputFields,
}

/// See `SamplingFields::unimplemented_extras`; `validation::refuse_unimplemented_extras`
/// knows each one's no-op value.
#[derive(Debug, Default, Deserialize)]
pub struct UnimplementedExtras {
    pub bad_words: Option<Value>,
    pub use_beam_search: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<PromptInput>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Top-N logprobs per token (0 = only the chosen token's).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    /// Not supported beyond `best_of == n` (no server-side ranking of samples).
    pub best_of: Option<i64>,
    /// Not supported (no fill-in-the-middle).
    pub suffix: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<Value>>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Extension (as in vLLM): render without the assistant header, e.g. to continue a turn.
    pub add_generation_prompt: Option<bool>,
    /// "auto", "none", "required" or `{"type": "function", "function": {"name": …}}`; see
    /// `http::tool_choice` for how the forced ones are enforced.
    pub tool_choice: Option<Value>,
    /// false: at most one tool call (see `http::tool_choice`).
    pub parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// Legacy completions logprobs: parallel arrays, `None` for the first prompt token.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Both the response and each stream chunk (`object` is "text_completion" for both).
#[derive(Debug, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Absent in chunks unless usage was asked for; `Some(None)` serializes as `null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

/// `content` is null when the answer is only tool calls, as OpenAI sends it.
#[derive(Debug, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON object, as a string.
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

/// A streamed piece of a tool call: the first carries id, type and name, later ones only
/// argument text, all under the call's `index`.
#[derive(Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Serialize)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct ChatResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
