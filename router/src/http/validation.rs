//! Checks every request field against its range and the model, and turns the request into
//! the engine's `GenerateRequest`s. Each failure names the field (OpenAI's `param`).

use std::sync::Arc;

use serde_json::Value;

use crate::engine::{GenerateRequest, ModelInfo};
use crate::grammar::TokenConstraint;
use crate::protocol::SamplingParams;

use super::errors::ApiError;
use super::openai_types::{SamplingFields, StopInput, UnimplementedExtras};
use super::sampling_defaults::SamplingDefaults;
use super::structured_output::RequestedConstraint;

/// The most logprobs a request may ask for per token.
pub const MAX_LOGPROBS: i64 = 20;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_stop_strings: usize,
    pub max_n: u32,
}

/// The request fields both endpoints share, checked.
#[derive(Debug, Clone)]
pub struct Validated {
    /// Sampling parameters of sample 0 (sample i uses seed + i).
    pub sampling: SamplingParams,
    /// `None`: fill the context.
    pub max_tokens: Option<u32>,
    pub n: u32,
    pub stops: Vec<String>,
    /// The request's own stop token ids (EOS ids are added unless `ignore_eos`).
    pub stop_token_ids: Vec<i32>,
    pub ignore_eos: bool,
    /// `min_tokens` (or SGLang's `min_new_tokens`): no stop before this many tokens.
    pub min_tokens: u32,
    /// vLLM's `include_stop_str_in_output`: stop strings and stop tokens' text stay in the output.
    pub include_stop: bool,
    /// vLLM's `skip_special_tokens` (default true): special tokens decode to nothing.
    pub skip_special_tokens: bool,
    /// vLLM's `allowed_token_ids`, as the bitmask every sampling step of the request carries.
    pub allowed_tokens: Option<Arc<Vec<u32>>>,
    /// The structured output asked for (compiled by the endpoint, which knows the prompt).
    pub constraint: Option<RequestedConstraint>,
    /// `priority` (0 when not given).
    pub priority: i32,
    /// `cache_salt` (non-empty when given).
    pub cache_salt: Option<Arc<str>>,
    pub stream: bool,
    pub include_usage: bool,
}

fn in_range(
    param: &str,
    value: Option<f64>,
    ok: impl Fn(f64) -> bool,
    rule: &str,
) -> Result<(), ApiError> {
    match value {
        Some(v) if !v.is_finite() || !ok(v) => Err(ApiError::invalid_param(
            param,
            format!("`{param}` {rule}, got {v}."),
        )),
        _ => Ok(()),
    }
}

/// `model` may be left out (one model is served); otherwise it must name the served model.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ApiError> {
    match requested {
        Some(m) if m != served => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// Token ids given by the client, checked against the model's vocabulary.
pub fn check_token_ids(param: &str, ids: &[i64], vocab_size: u32) -> Result<Vec<i32>, ApiError> {
    ids.iter()
        .map(|&id| {
            if id < 0 || id >= i64::from(vocab_size) {
                Err(ApiError::invalid_param(
                    param,
                    format!("Token id {id} is outside the vocabulary (0..{vocab_size})."),
                ))
            } else {
                Ok(id as i32)
            }
        })
        .collect()
}

/// The most `logit_bias` entries a request may carry: each travels in every plan of its request.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// OpenAI's `logit_bias` map (token id as a string -> bias in [-100, 100]) as (id, bias) pairs
/// in ascending id order, each id inside the vocabulary and named once.
pub fn check_logit_bias(
    bias: Option<&serde_json::Map<String, serde_json::Value>>,
    vocab_size: u32,
) -> Result<Vec<(i32, f32)>, ApiError> {
    let Some(bias) = bias else {
        return Ok(Vec::new());
    };
    let err = |m: String| ApiError::invalid_param("logit_bias", m);
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(err(format!(
            "`logit_bias` may hold at most {MAX_LOGIT_BIAS} entries, got {}.",
            bias.len()
        )));
    }
    let mut pairs = Vec::with_capacity(bias.len());
    for (key, value) in bias {
        let id = key
            .trim()
            .parse::<i64>()
            .ok()
            .filter(|&id| id >= 0 && id < i64::from(vocab_size))
            .ok_or_else(|| {
                err(format!(
                    "`logit_bias` keys must be token ids in 0..{vocab_size}, got {key:?}."
                ))
            })?;
        let b = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                err(format!(
                    "`logit_bias` values must be numbers from -100 to 100, got {value} for token {id}."
                ))
            })?;
        pairs.push((id as i32, b as f32));
    }
    pairs.sort_by_key(|&(id, _)| id);
    if let Some(p) = pairs.windows(2).find(|p| p[0].0 == p[1].0) {
        return Err(err(format!("`logit_bias` names token {} twice.", p[0].0)));
    }
    Ok(pairs)
}

/// The range of every sampling number: requests are checked with it, and so are the model's
/// defaults from `generation_config.json` (`SamplingDefaults`) at startup.
pub(super) fn check_sampling_ranges(f: &SamplingFields) -> Result<(), ApiError> {
    in_range(
        "temperature",
        f.temperature,
        |v| v >= 0.0,
        "must be at least 0",
    )?;
    in_range(
        "top_p",
        f.top_p,
        |v| v > 0.0 && v <= 1.0,
        "must be in (0, 1]",
    )?;
    in_range(
        "min_p",
        f.min_p,
        |v| (0.0..=1.0).contains(&v),
        "must be in [0, 1]",
    )?;
    in_range(
        "presence_penalty",
        f.presence_penalty,
        |v| (-2.0..=2.0).contains(&v),
        "must be in [-2, 2]",
    )?;
    in_range(
        "frequency_penalty",
        f.frequency_penalty,
        |v| (-2.0..=2.0).contains(&v),
        "must be in [-2, 2]",
    )?;
    in_range(
        "repetition_penalty",
        f.repetition_penalty,
        |v| v > 0.0,
        "must be greater than 0",
    )?;
    top_k_limit(f.top_k).map(drop)
}

/// The sampler's top-k: 0 for no limit.
fn top_k_limit(top_k: Option<i64>) -> Result<i32, ApiError> {
    match top_k {
        // 0 and -1 both mean "no top-k limit" (OpenAI has no top_k; vLLM uses -1).
        None | Some(-1) | Some(0) => Ok(0),
        Some(k) if k > 0 && k <= i64::from(i32::MAX) => Ok(k as i32),
        Some(k) => Err(ApiError::invalid_param(
            "top_k",
            format!("`top_k` must be -1 (no limit) or positive, got {k}."),
        )),
    }
}

/// `max_tokens_field`: the value of `max_tokens` (or chat's `max_completion_tokens`).
/// `top_logprobs`: the endpoint's logprobs request, already checked.
/// `defaults`: the values of the sampling fields the request leaves out (already checked).
pub fn validate_sampling(
    f: &SamplingFields,
    max_tokens_field: Option<i64>,
    top_logprobs: Option<u32>,
    limits: Limits,
    defaults: &SamplingDefaults,
    model: &ModelInfo,
) -> Result<Validated, ApiError> {
    check_sampling_ranges(f)?;
    // A field the request sets wins; else the model's default, else OpenAI's (below).
    let top_k = top_k_limit(f.top_k.or(defaults.top_k))?;
    let n = f.n.unwrap_or(1);
    if n < 1 || n > i64::from(limits.max_n) {
        return Err(ApiError::invalid_param(
            "n",
            format!("`n` must be between 1 and {}, got {n}.", limits.max_n),
        ));
    }
    let max_tokens = match max_tokens_field {
        None => None,
        Some(m) if m >= 1 && m <= i64::from(u32::MAX) => Some(m as u32),
        Some(m) => {
            return Err(ApiError::invalid_param(
                "max_tokens",
                format!("`max_tokens` must be at least 1, got {m}."),
            ))
        }
    };
    let stops = match &f.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(list)) => list.clone(),
    };
    if stops.len() > limits.max_stop_strings {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "At most {} stop strings are allowed, got {}.",
                limits.max_stop_strings,
                stops.len()
            ),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param(
            "stop",
            "Stop strings must not be empty.",
        ));
    }
    let stop_token_ids = check_token_ids(
        "stop_token_ids",
        f.stop_token_ids.as_deref().unwrap_or(&[]),
        model.vocab_size,
    )?;
    let logit_bias = check_logit_bias(f.logit_bias.as_ref(), model.vocab_size)?;
    let allowed_tokens = match &f.allowed_token_ids {
        None => None,
        Some(ids) if ids.is_empty() => {
            return Err(ApiError::invalid_param(
                "allowed_token_ids",
                "`allowed_token_ids` must name at least one token.",
            ))
        }
        Some(ids) => {
            let ids = check_token_ids("allowed_token_ids", ids, model.vocab_size)?;
            Some(Arc::new(crate::protocol::token_mask(&ids)))
        }
    };
    let min_tokens = check_min_tokens(f, max_tokens)?;
    let priority = match f.priority {
        None => 0,
        Some(p) => i32::try_from(p).map_err(|_| {
            ApiError::invalid_param(
                "priority",
                format!("`priority` must be a 32-bit integer, got {p}."),
            )
        })?,
    };
    let cache_salt = match f.cache_salt.as_deref() {
        None => None,
        Some("") => {
            return Err(ApiError::invalid_param(
                "cache_salt",
                "`cache_salt` must be a non-empty string.",
            ))
        }
        Some(salt) => Some(Arc::from(salt)),
    };
    refuse_unimplemented_extras(&f.unimplemented_extras)?;
    let constraint = f.structured.requested()?;
    if let Some(c) = constraint.as_ref().filter(|_| min_tokens > 0) {
        // A grammar may end the output, by allowing only a stop token, before the minimum.
        return Err(unsupported(
            "min_tokens",
            &format!("`min_tokens` cannot be combined with `{}`.", c.param),
        ));
    }
    let stream = f.stream.unwrap_or(false);
    if f.stream_options.is_some() && !stream {
        return Err(ApiError::invalid_param(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true.",
        ));
    }
    let seed = f.seed.as_ref().map(|s| match (s.as_u64(), s.as_i64()) {
        (Some(u), _) => Ok(u),
        // Negative seeds are still distinct seeds.
        (None, Some(i)) => Ok(i as u64),
        _ => Err(ApiError::invalid_param(
            "seed",
            format!("`seed` must be an integer, got {s}."),
        )),
    });
    let seed = seed.transpose()?;
    let sampling = SamplingParams {
        temperature: f.temperature.or(defaults.temperature).unwrap_or(1.0) as f32,
        top_p: f.top_p.or(defaults.top_p).unwrap_or(1.0) as f32,
        top_k,
        min_p: f.min_p.or(defaults.min_p).unwrap_or(0.0) as f32,
        repetition_penalty: f
            .repetition_penalty
            .or(defaults.repetition_penalty)
            .unwrap_or(1.0) as f32,
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0) as f32,
        presence_penalty: f.presence_penalty.unwrap_or(0.0) as f32,
        seed,
        top_logprobs,
        logit_bias,
    };
    Ok(Validated {
        sampling,
        max_tokens,
        n: n as u32,
        stops,
        stop_token_ids,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        min_tokens,
        allowed_tokens,
        include_stop: f.include_stop_str_in_output.unwrap_or(false),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        constraint,
        priority,
        cache_salt,
        stream,
        include_usage: f
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// `min_tokens` (vLLM) or `min_new_tokens` (SGLang; both may be given if they agree): from 0
/// up to `max_tokens` (when given; a longer minimum than the context allows ends at the context).
fn check_min_tokens(f: &SamplingFields, max_tokens: Option<u32>) -> Result<u32, ApiError> {
    let (param, value) = match (f.min_tokens, f.min_new_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid_param(
                "min_new_tokens",
                format!("`min_tokens` ({a}) and `min_new_tokens` ({b}) disagree; give one."),
            ))
        }
        (Some(a), _) => ("min_tokens", a),
        (None, Some(b)) => ("min_new_tokens", b),
        (None, None) => return Ok(0),
    };
    if value < 0 || value > i64::from(u32::MAX) {
        return Err(ApiError::invalid_param(
            param,
            format!("`{param}` must be at least 0, got {value}."),
        ));
    }
    match max_tokens {
        Some(m) if value > i64::from(m) => Err(ApiError::invalid_param(
            param,
            format!("`{param}` ({value}) must not exceed `max_tokens` ({m})."),
        )),
        _ => Ok(value as u32),
    }
}

/// vLLM / SGLang extras this server does not implement: a 400 naming the field when one is set
/// to anything that would change the output (absent, null and each one's no-op value pass).
fn refuse_unimplemented_extras(x: &UnimplementedExtras) -> Result<(), ApiError> {
    use serde_json::Value;
    use serde_json::Value::{Array, Bool, Null};
    let empty = |v: &Value| matches!(v, Array(a) if a.is_empty());
    type NoOp<'a> = &'a dyn Fn(&Value) -> bool;
    let checks: [(&str, &Option<Value>, NoOp); 2] = [
        ("bad_words", &x.bad_words, &empty),
        ("use_beam_search", &x.use_beam_search, &|v| {
            *v == Bool(false)
        }),
    ];
    for (name, value, no_op) in checks {
        if let Some(v) = value.as_ref().filter(|v| **v != Null && !no_op(v)) {
            return Err(unsupported(
                name,
                &format!("`{name}` is not supported (got {v}); leave it out."),
            ));
        }
    }
    Ok(())
}

/// 400 for a feature this server does not implement: refusing beats silently ignoring it.
/// `object[name]` as a string, or a 400 naming `param.name`.
pub fn required_string(param: &str, object: &Value, name: &str) -> Result<String, ApiError> {
    object
        .get(name)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| {
            ApiError::invalid_param(
                param,
                format!("`{param}.{name}` is required and must be a string."),
            )
        })
}

pub fn unsupported(param: &str, message: &str) -> ApiError {
    ApiError {
        code: Some("unsupported_parameter"),
        ..ApiError::invalid_param(param, message)
    }
}

/// Checks a logprobs count (completions `logprobs`, chat `top_logprobs`).
pub fn check_logprobs(param: &str, value: i64) -> Result<u32, ApiError> {
    if (0..=MAX_LOGPROBS).contains(&value) {
        Ok(value as u32)
    } else {
        Err(ApiError::invalid_param(
            param,
            format!("`{param}` must be between 0 and {MAX_LOGPROBS}, got {value}."),
        ))
    }
}

/// The number of new tokens a prompt of `prompt_len` tokens may generate: `max_tokens`, or
/// the rest of the context when it is not set (as vLLM does).
pub fn fit_context(
    prompt_len: usize,
    max_tokens: Option<u32>,
    max_context: u32,
) -> Result<u32, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid_param("prompt", "The prompt is empty."));
    }
    let context = max_context as usize;
    if prompt_len >= context {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "This model's maximum context length is {context} tokens. However, your prompt has {prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt."
            ),
        ));
    }
    match max_tokens {
        None => Ok((context - prompt_len) as u32),
        Some(m) if prompt_len + m as usize <= context => Ok(m),
        Some(m) => Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {m} for the completion). Please reduce the length of the prompt or of the completion.",
                prompt_len + m as usize
            ),
        )),
    }
}

/// The `n` engine requests of one prompt; with a seed, sample i uses seed + i so the samples
/// differ yet the whole response is reproducible.
pub fn generate_requests(
    prompt_ids: &[i32],
    max_new_tokens: u32,
    v: &Validated,
    eos_token_ids: &[i32],
    prompt_logprobs: bool,
    constraint: Option<&TokenConstraint>,
) -> Vec<GenerateRequest> {
    let mut stop_token_ids = v.stop_token_ids.clone();
    if !v.ignore_eos {
        stop_token_ids.extend_from_slice(eos_token_ids);
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    (0..v.n)
        .map(|i| {
            let mut sampling = v.sampling.clone();
            sampling.seed = v.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            GenerateRequest {
                prompt_ids: prompt_ids.to_vec(),
                sampling,
                max_new_tokens,
                min_new_tokens: v.min_tokens.min(max_new_tokens),
                stop_token_ids: stop_token_ids.clone(),
                prompt_logprobs,
                allowed_tokens: v.allowed_tokens.clone(),
                // Each sample advances its own copy of the grammar.
                constraint: constraint.cloned(),
                priority: v.priority,
                cache_salt: v.cache_salt.clone(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(f: &SamplingFields, defaults: &SamplingDefaults) -> Result<Validated, ApiError> {
        let model = ModelInfo {
            served_model_name: "m".into(),
            max_context: 100,
            vocab_size: 10,
        };
        let limits = Limits {
            max_stop_strings: 4,
            max_n: 8,
        };
        validate_sampling(f, None, None, limits, defaults, &model)
    }

    #[test]
    fn context_fitting() {
        assert_eq!(fit_context(10, None, 100).unwrap(), 90);
        assert_eq!(fit_context(10, Some(90), 100).unwrap(), 90);
        assert!(fit_context(10, Some(91), 100).is_err());
        assert!(fit_context(100, None, 100).is_err());
        assert!(fit_context(0, Some(1), 100).is_err());
    }

    /// (temperature, top_p, top_k, min_p, repetition_penalty) as the sampler gets them.
    fn sampled(v: &Validated) -> (f32, f32, i32, f32, f32) {
        let s = &v.sampling;
        (
            s.temperature,
            s.top_p,
            s.top_k,
            s.min_p,
            s.repetition_penalty,
        )
    }

    #[test]
    fn request_values_beat_model_defaults_which_beat_openai_defaults() {
        let openai = SamplingDefaults::default();
        let model = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(40),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
        };
        let omitted = SamplingFields::default();
        let given = SamplingFields {
            temperature: Some(0.0),
            top_p: Some(0.5),
            top_k: Some(-1),
            min_p: Some(0.0),
            repetition_penalty: Some(1.0),
            ..Default::default()
        };
        let v = |f, d| sampled(&validate(f, d).unwrap());
        assert_eq!(v(&omitted, &openai), (1.0, 1.0, 0, 0.0, 1.0));
        assert_eq!(v(&omitted, &model), (0.6, 0.95, 40, 0.05, 1.1));
        // Explicit values win, even those equal to OpenAI's defaults (top_k -1: no limit).
        assert_eq!(v(&given, &model), (0.0, 0.5, 0, 0.0, 1.0));
        // Fields are independent: the model's top_p with the request's temperature.
        let one = SamplingFields {
            temperature: Some(0.2),
            ..Default::default()
        };
        assert_eq!(v(&one, &model), (0.2, 0.95, 40, 0.05, 1.1));
        // A model default never excuses an invalid request value.
        let bad = SamplingFields {
            top_p: Some(1.5),
            ..Default::default()
        };
        assert_eq!(
            validate(&bad, &model).unwrap_err().param.as_deref(),
            Some("top_p")
        );
    }

    #[test]
    fn seeds_advance_per_sample_and_eos_is_added() {
        let f = SamplingFields {
            seed: Some(7.into()),
            n: Some(3),
            stop_token_ids: Some(vec![5]),
            ..Default::default()
        };
        let v = validate(&f, &SamplingDefaults::default()).unwrap();
        let reqs = generate_requests(&[1, 2], 5, &v, &[9], false, None);
        let seeds: Vec<_> = reqs.iter().map(|r| r.sampling.seed).collect();
        assert_eq!(seeds, vec![Some(7), Some(8), Some(9)]);
        assert_eq!(reqs[0].stop_token_ids, vec![5, 9]);
        let v = Validated {
            ignore_eos: true,
            ..v
        };
        assert_eq!(
            generate_requests(&[1], 5, &v, &[9], false, None)[0].stop_token_ids,
            vec![5]
        );
    }
}
