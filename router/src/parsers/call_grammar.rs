//! A forced `tool_choice` ("required", or one named function) as a grammar in the model's own
//! call markup, so that constrained decoding makes the model call a tool instead of hoping it
//! does. The output stays in the markup the model was trained on and goes through the same
//! tool-call parser as any other output; only the choice of tokens is narrowed.
//!
//! The grammar (llguidance's Lark dialect) allows one or more calls (or exactly one, with
//! `parallel_tool_calls: false`) to the offered functions, and nothing else after the model's
//! thinking. Each call lists its parameters in the schema's order, the required ones always
//! and the others optionally. A value's form follows how the parser types it: a string
//! parameter is raw text up to the closing tag (or one of its `enum` strings), anything else
//! is JSON matching the parameter's schema. A function without declared properties takes any
//! keys with text values, unless `additionalProperties` is false.

use serde_json::{Map, Value};

use super::{dsml, glm, ToolParserKind};
use crate::grammar::json_options;

/// How many calls a forced choice allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallCount {
    One,
    OneOrMore,
}

/// The pieces of one markup, as grammar literals are made of them.
struct Markup {
    /// Before the first call and after the last (DSML wraps all calls in one block).
    block_open: &'static str,
    block_close: &'static str,
    /// Whether the newlines a model may write before its calls (one or two, as after text)
    /// come before each call (GLM) or before the block that holds them all (DSML).
    lead_each_call: bool,
    call_open: fn(&str) -> String,
    call_close: &'static str,
    /// A parameter: `key_open` KEY `key_close`, then the value's opening (raw text or JSON),
    /// the value, `value_close` and `after_value`.
    key_open: &'static str,
    key_close: &'static str,
    text_value_open: &'static str,
    json_value_open: &'static str,
    value_close: &'static str,
    after_value: &'static str,
    /// Text a raw value may not contain: the tags where the parser ends a call or block (it
    /// looks for their first occurrence, so a value holding one would cut the call short).
    text_excludes: &'static [&'static str],
}

impl Markup {
    fn param_open(&self, key: &str, text: bool) -> String {
        let open = if text {
            self.text_value_open
        } else {
            self.json_value_open
        };
        format!("{}{key}{}{open}", self.key_open, self.key_close)
    }
}

fn markup(kind: ToolParserKind) -> Markup {
    match kind {
        ToolParserKind::Glm47 => Markup {
            block_open: "",
            block_close: "",
            lead_each_call: true,
            call_open: |name| format!("{}{name}", glm::OPEN),
            call_close: glm::CLOSE,
            key_open: glm::KEY_OPEN,
            key_close: glm::KEY_CLOSE,
            text_value_open: glm::VALUE_OPEN,
            json_value_open: glm::VALUE_OPEN,
            value_close: glm::VALUE_CLOSE,
            after_value: "",
            text_excludes: &[glm::CLOSE],
        },
        // GLM-4.5 writes a newline after the name and after each tag pair.
        ToolParserKind::Glm45 => Markup {
            block_open: "",
            block_close: "",
            lead_each_call: true,
            call_open: |name| format!("{}{name}\n", glm::OPEN),
            call_close: glm::CLOSE,
            key_open: glm::KEY_OPEN,
            key_close: glm::KEY_CLOSE,
            text_value_open: "\n<arg_value>",
            json_value_open: "\n<arg_value>",
            value_close: glm::VALUE_CLOSE,
            after_value: "\n",
            text_excludes: &[glm::CLOSE],
        },
        ToolParserKind::DeepSeekV32 => Markup {
            block_open: "<｜DSML｜function_calls>\n",
            block_close: dsml::CLOSE,
            lead_each_call: false,
            call_open: |name| format!("{}{name}\">\n", dsml::INVOKE_OPEN),
            call_close: "</｜DSML｜invoke>\n",
            key_open: dsml::PARAM_OPEN,
            key_close: "\"",
            text_value_open: " string=\"true\">",
            json_value_open: " string=\"false\">",
            value_close: dsml::PARAM_CLOSE,
            after_value: "\n",
            text_excludes: &[dsml::CLOSE, dsml::INVOKE_CLOSE],
        },
    }
}

/// A grammar string literal (Lark strings use JSON's syntax).
fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// JSON as the model writes it inside a call: the separators structured outputs use.
fn json_value_schema(schema: &Value, root: &Map<String, Value>) -> Value {
    let mut schema = match schema {
        Value::Object(o) => o.clone(),
        // `true` or anything unexpected: any JSON value.
        _ => Map::new(),
    };
    // References point into the parameters' definitions, which the value's grammar needs too.
    if Value::Object(schema.clone())
        .to_string()
        .contains("\"$ref\"")
    {
        for defs in ["$defs", "definitions"] {
            if let Some(d) = root.get(defs) {
                schema.entry(defs).or_insert_with(|| d.clone());
            }
        }
    }
    schema.entry("x-guidance").or_insert_with(json_options);
    Value::Object(schema)
}

enum ValueForm {
    /// Raw text up to the closing tag.
    Text,
    /// One of these strings, raw.
    Strings(Vec<String>),
    /// JSON matching the schema.
    Json,
}

fn schema_types(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

fn value_form(schema: &Value) -> ValueForm {
    let types = schema_types(schema);
    let strings = |vs: &[Value]| -> Option<Vec<String>> {
        vs.iter().map(|v| v.as_str().map(str::to_owned)).collect()
    };
    let string_ok = types.is_empty() || types.contains(&"string");
    if string_ok {
        if let Some(Value::String(c)) = schema.get("const") {
            return ValueForm::Strings(vec![c.clone()]);
        }
        if let Some(values) = schema.get("enum").and_then(Value::as_array) {
            if let Some(values) = strings(values).filter(|v| !v.is_empty()) {
                return ValueForm::Strings(values);
            }
        }
    }
    if types.contains(&"string") {
        return ValueForm::Text;
    }
    let composite = ["anyOf", "oneOf", "allOf", "$ref", "enum", "const"]
        .iter()
        .any(|k| schema.get(*k).is_some());
    if types.is_empty() && !composite {
        // No type at all: the parser keeps JSON that parses and text otherwise; text covers both.
        ValueForm::Text
    } else {
        ValueForm::Json
    }
}

/// The Lark grammar for a forced choice among the request's `tools` (with `only`, just that
/// function), or `None` when none of them is a function with a name.
pub fn forced_calls_grammar(
    kind: ToolParserKind,
    tools: &[Value],
    only: Option<&str>,
    count: CallCount,
) -> Option<String> {
    let m = markup(kind);
    let mut rules = Vec::new();
    let mut calls = Vec::new();
    for tool in tools {
        let Some(function) = tool.get("function") else {
            continue;
        };
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            continue;
        };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let i = calls.len();
        let empty = Map::new();
        let parameters = function
            .get("parameters")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let properties = parameters
            .get("properties")
            .and_then(Value::as_object)
            .filter(|p| !p.is_empty());
        let required: Vec<&str> = parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = vec![lit(&(m.call_open)(name))];
        match properties {
            Some(properties) => {
                for (j, (key, schema)) in properties.iter().enumerate() {
                    let rule = format!("arg_{i}_{j}");
                    let value = match value_form(schema) {
                        ValueForm::Text => {
                            format!("{} text_value", lit(&m.param_open(key, true)))
                        }
                        ValueForm::Strings(values) => {
                            let close = format!("{}{}", m.value_close, m.after_value);
                            let choices: Vec<String> = values.iter().map(|v| lit(v)).collect();
                            format!(
                                "{} ({}) {}",
                                lit(&m.param_open(key, true)),
                                choices.join(" | "),
                                lit(&close)
                            )
                        }
                        ValueForm::Json => format!(
                            "{} %json {} {}",
                            lit(&m.param_open(key, false)),
                            json_value_schema(schema, parameters),
                            lit(&format!("{}{}", m.value_close, m.after_value))
                        ),
                    };
                    rules.push(format!("{rule}: {value}"));
                    let optional = !required.contains(&key.as_str());
                    body.push(if optional { format!("{rule}?") } else { rule });
                }
            }
            None if parameters.get("additionalProperties") != Some(&Value::Bool(false)) => {
                body.push("free_arg*".to_owned());
            }
            None => {}
        }
        body.push(lit(m.call_close));
        rules.push(format!("call_{i}: {}", body.join(" ")));
        calls.push(format!("call_{i}"));
    }
    if calls.is_empty() {
        return None;
    }
    let repeat = match count {
        CallCount::One => "",
        CallCount::OneOrMore => "+",
    };
    let mut start = vec![];
    if !m.lead_each_call {
        start.push("LEAD?".to_owned());
    }
    if !m.block_open.is_empty() {
        start.push(lit(m.block_open));
    }
    start.push(format!("call{repeat}"));
    if !m.block_close.is_empty() {
        start.push(lit(m.block_close));
    }
    let lead = if m.lead_each_call { "LEAD? " } else { "" };
    let mut lines = vec![
        format!("start: {}", start.join(" ")),
        format!("call: {lead}({})", calls.join(" | ")),
        r"LEAD: /\n{1,2}/".to_owned(),
    ];
    lines.extend(rules);
    let text_close = lit(m.value_close);
    let after = if m.after_value.is_empty() {
        String::new()
    } else {
        format!(" {}", lit(m.after_value))
    };
    lines.push(format!("text_value: text_body{after}"));
    // Any text without the excluded tags (the suffix ends it at the first closing tag).
    let excluded: Vec<String> = m
        .text_excludes
        .iter()
        .map(|x| format!(" & ~(/(?s:.*)/ {} /(?s:.*)/)", lit(x)))
        .collect();
    lines.push(format!(
        "text_body[suffix={text_close}]: /(?s:.*)/{}",
        excluded.concat()
    ));
    lines.push(format!(
        "free_arg: {} free_key {} text_value",
        lit(m.key_open),
        lit(m.text_value_open)
    ));
    lines.push(format!(
        "free_key[suffix={}]: /[^<>\"\\n]+/",
        lit(m.key_close)
    ));
    Some(lines.join("\n") + "\n")
}

#[cfg(test)]
mod tests;
