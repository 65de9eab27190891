//! The JSON and Jinja files of a Hugging Face model directory that matter for text handling.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;

/// Special token strings the chat template sees as `bos_token`, `eos_token`, ...
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

pub(super) struct ModelFiles {
    pub chat_template: Option<String>,
    pub special: SpecialTokens,
    /// Ids named by `generation_config.json` and `config.json`.
    pub eos_token_ids: Vec<i32>,
}

fn read_json(path: &Path) -> anyhow::Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok(Some(value))
}

/// A special token is either a plain string or an added-token object with a `content` field.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` may be one integer or a list of them.
fn token_ids(value: Option<&Value>) -> Vec<i32> {
    match value {
        Some(Value::Number(n)) => n.as_i64().map(|id| vec![id as i32]).unwrap_or_default(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_i64)
            .map(|id| id as i32)
            .collect(),
        _ => Vec::new(),
    }
}

/// `chat_template` is either one template or a list of named ones; the one named "default"
/// (else the first) is the template used without an explicit choice.
fn template_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let named = |name: &str| {
                items
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                    .cloned()
            };
            let chosen = named("default").or_else(|| items.first().cloned())?;
            chosen
                .get("template")
                .and_then(Value::as_str)
                .map(str::to_owned)
        }
        _ => None,
    }
}

impl ModelFiles {
    pub fn read(dir: &Path) -> anyhow::Result<ModelFiles> {
        let tokenizer_config =
            read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let special = SpecialTokens {
            bos_token: token_string(tokenizer_config.get("bos_token")),
            eos_token: token_string(tokenizer_config.get("eos_token")),
            unk_token: token_string(tokenizer_config.get("unk_token")),
            pad_token: token_string(tokenizer_config.get("pad_token")),
        };

        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = if jinja_path.exists() {
            Some(
                std::fs::read_to_string(&jinja_path)
                    .with_context(|| format!("cannot read {}", jinja_path.display()))?,
            )
        } else if let Some(v) = read_json(&dir.join("chat_template.json"))? {
            template_string(v.get("chat_template"))
        } else {
            template_string(tokenizer_config.get("chat_template"))
        };

        let mut eos_token_ids = Vec::new();
        for file in ["generation_config.json", "config.json"] {
            if let Some(v) = read_json(&dir.join(file))? {
                eos_token_ids.extend(token_ids(v.get("eos_token_id")));
            }
        }
        Ok(ModelFiles {
            chat_template,
            special,
            eos_token_ids,
        })
    }
}
