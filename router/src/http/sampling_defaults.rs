//! Default values for the sampling fields a request leaves out (`--sampling-defaults`).
//!
//! Model authors put the sampling settings their model is meant to run with (e.g. temperature
//! 0.6, top_p 0.95) in `generation_config.json`, and vLLM and SGLang apply them by default, so
//! clients written for those servers expect it. With `model` (the default) a request's omitted
//! `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` take the file's values
//! where it sets them and OpenAI's otherwise; with `openai` always OpenAI's. A value the request
//! sets always wins (`validation::validate_sampling` applies that order).

use std::fmt;
use std::path::Path;

use anyhow::{anyhow, Context};
use serde::Deserialize;
use serde_json::Value;

use super::openai_types::SamplingFields;
use super::validation::check_sampling_ranges;

/// Where the defaults come from (`--sampling-defaults`, SGLang's flag and names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplingDefaultsSource {
    /// The model directory's `generation_config.json`, OpenAI's for what it does not set.
    #[default]
    Model,
    /// OpenAI's: temperature 1, top_p 1, no top_k, min_p 0, repetition_penalty 1.
    Openai,
}

/// The model's value for each sampling field; `None`: OpenAI's default applies.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// As a request gives it: -1 or 0 mean no limit.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
}

impl SamplingDefaults {
    /// The defaults `source` asks for. With `Openai` the file's sampling values are not even
    /// read, so wrong ones cannot stop a server told to ignore them.
    pub fn load(model_dir: &Path, source: SamplingDefaultsSource) -> anyhow::Result<Self> {
        match source {
            SamplingDefaultsSource::Openai => Ok(Self::default()),
            SamplingDefaultsSource::Model => Self::from_model_dir(model_dir),
        }
    }

    /// The sampling keys of `generation_config.json` (no file: no defaults). A value the HTTP
    /// layer would refuse in a request is a startup error naming the file and the key, rather
    /// than a 400 for every request that leaves the field out.
    fn from_model_dir(model_dir: &Path) -> anyhow::Result<Self> {
        let path = model_dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let config: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_generation_config(&config).with_context(|| {
            format!(
                "invalid sampling default in {} (fix it, or serve with --sampling-defaults openai)",
                path.display()
            )
        })
    }

    /// `do_sample` is ignored, as vLLM ignores it: the sampling keys apply even next to
    /// `do_sample: false` (Hugging Face's `generate` would decode greedily then). A model
    /// meant to be greedy sets `temperature: 0`; a request can always ask for that itself.
    fn from_generation_config(config: &Value) -> anyhow::Result<Self> {
        let defaults = SamplingDefaults {
            temperature: number(config, "temperature")?,
            top_p: number(config, "top_p")?,
            top_k: integer(config, "top_k")?,
            min_p: number(config, "min_p")?,
            repetition_penalty: number(config, "repetition_penalty")?,
        };
        // The very rules a request's values meet; the message names the key.
        let as_request = SamplingFields {
            temperature: defaults.temperature,
            top_p: defaults.top_p,
            top_k: defaults.top_k,
            min_p: defaults.min_p,
            repetition_penalty: defaults.repetition_penalty,
            ..Default::default()
        };
        check_sampling_ranges(&as_request).map_err(|e| anyhow!(e.message))?;
        Ok(defaults)
    }
}

/// A number, integer or not (`1` and `1.0` are the same temperature); `null` counts as absent,
/// as some tools write every key.
fn number(config: &Value, key: &str) -> anyhow::Result<Option<f64>> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| anyhow!("`{key}` must be a number, got {v}.")),
    }
}

/// A whole number, also when written as a float (`40.0`).
fn integer(config: &Value, key: &str) -> anyhow::Result<Option<i64>> {
    let Some(v) = config.get(key).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let whole = v.as_f64().filter(|x| x.fract() == 0.0);
    v.as_i64()
        // Saturates far beyond any valid value; the range check then refuses it.
        .or(whole.map(|x| x as i64))
        .map(Some)
        .ok_or_else(|| anyhow!("`{key}` must be an integer, got {v}."))
}

/// For the startup log: each field's value, marked where it is the model's.
impl fmt::Display for SamplingDefaults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fields = [
            ("temperature", self.temperature, 1.0),
            ("top_p", self.top_p, 1.0),
            ("top_k", self.top_k.map(|k| k as f64), -1.0),
            ("min_p", self.min_p, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ];
        for (i, (name, model, openai)) in fields.into_iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            match model {
                Some(v) => write!(f, "{sep}{name}={v} (model)")?,
                None => write!(f, "{sep}{name}={openai}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(config: Value) -> anyhow::Result<SamplingDefaults> {
        SamplingDefaults::from_generation_config(&config)
    }

    #[test]
    fn present_keys_are_read_as_ints_or_floats_and_absent_ones_stay_unset() {
        let d = parse(
            json!({"temperature": 1, "top_p": 0.95, "top_k": 40.0, "do_sample": false,
                             "eos_token_id": [1, 2], "max_new_tokens": 10}),
        )
        .unwrap();
        let expected = SamplingDefaults {
            temperature: Some(1.0),
            top_p: Some(0.95),
            top_k: Some(40),
            min_p: None,
            repetition_penalty: None,
        };
        assert_eq!(d, expected);
        let all = json!({"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0.05,
                         "repetition_penalty": 1.05});
        let d = parse(all).unwrap();
        assert_eq!(
            (d.temperature, d.top_k, d.min_p),
            (Some(0.0), Some(-1), Some(0.05))
        );
        assert_eq!(d.repetition_penalty, Some(1.05));
        // No sampling keys (the embedded model's file), nulls, or not even an object: none.
        let none = SamplingDefaults::default();
        assert_eq!(
            parse(json!({"do_sample": false, "eos_token_id": 0})).unwrap(),
            none
        );
        assert_eq!(parse(json!({"top_p": null, "top_k": null})).unwrap(), none);
        assert_eq!(parse(json!([])).unwrap(), none);
    }

    #[test]
    fn invalid_values_name_the_key() {
        for (config, key) in [
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"temperature": -0.5}), "temperature"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"top_k": 40.5}), "top_k"),
            (json!({"top_k": 1e12}), "top_k"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"temperature": "0.6"}), "temperature"),
            (json!({"top_k": true}), "top_k"),
        ] {
            let message = parse(config.clone()).unwrap_err().to_string();
            assert!(message.contains(&format!("`{key}`")), "{config}: {message}");
        }
    }

    #[test]
    fn the_file_is_read_only_for_model_defaults_and_errors_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let none = SamplingDefaults::default();
        // No file: no defaults.
        let source = SamplingDefaultsSource::Model;
        assert_eq!(SamplingDefaults::load(dir.path(), source).unwrap(), none);
        let path = dir.path().join("generation_config.json");
        std::fs::write(&path, r#"{"temperature": 0.6, "top_p": 1.5}"#).unwrap();
        let error = SamplingDefaults::load(dir.path(), source).unwrap_err();
        let message = format!("{error:#}");
        assert!(message.contains("generation_config.json"), "{message}");
        assert!(
            message.contains("`top_p` must be in (0, 1], got 1.5"),
            "{message}"
        );
        assert!(message.contains("--sampling-defaults openai"), "{message}");
        // `openai` does not read the file at all.
        std::fs::write(&path, "not json").unwrap();
        let openai = SamplingDefaultsSource::Openai;
        assert_eq!(SamplingDefaults::load(dir.path(), openai).unwrap(), none);
        std::fs::write(&path, r#"{"top_p": 0.95}"#).unwrap();
        let d = SamplingDefaults::load(dir.path(), source).unwrap();
        assert_eq!(d.top_p, Some(0.95));
        assert_eq!(SamplingDefaults::load(dir.path(), openai).unwrap(), none);
    }

    #[test]
    fn source_names_are_the_flag_values_and_model_is_the_default() {
        let parse = |s: &str| serde_json::from_str::<SamplingDefaultsSource>(s);
        assert_eq!(parse(r#""model""#).unwrap(), SamplingDefaultsSource::Model);
        assert_eq!(
            parse(r#""openai""#).unwrap(),
            SamplingDefaultsSource::Openai
        );
        assert!(parse(r#""vllm""#).is_err());
        assert_eq!(
            SamplingDefaultsSource::default(),
            SamplingDefaultsSource::Model
        );
    }

    #[test]
    fn the_log_line_tells_model_values_from_openai_ones() {
        let d = SamplingDefaults {
            temperature: Some(0.6),
            top_k: Some(20),
            ..Default::default()
        };
        assert_eq!(
            d.to_string(),
            "temperature=0.6 (model), top_p=1, top_k=20 (model), min_p=0, repetition_penalty=1"
        );
    }
}
