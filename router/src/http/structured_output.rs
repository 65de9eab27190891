//! Structured outputs from the request: OpenAI's `response_format`, vLLM's `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, SGLang's
//! `json_schema` and `regex`. At most one may be given; it is compiled here, against the
//! served tokenizer, so a schema or regex that cannot work is a 400 before anything runs.

use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;
use serde_json::Value;

use crate::grammar::{GrammarCompiler, OutputConstraint, TokenConstraint};
use crate::metrics::Metrics;

use super::errors::ApiError;
use super::validation::unsupported;

/// The request fields that constrain the output (flattened into both endpoints' bodies).
#[derive(Debug, Default, Deserialize)]
pub struct StructuredOutputFields {
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`.
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// vLLM's newer form: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
    pub structured_outputs: Option<Value>,
    /// SGLang's: a JSON schema as a string (or an object).
    pub json_schema: Option<Value>,
    pub regex: Option<Value>,
    /// SGLang's EBNF grammars (xgrammar's dialect): not supported, `guided_grammar` takes Lark.
    pub ebnf: Option<Value>,
}

/// A constraint as the request gave it: the field (for error messages) and what it asks.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedConstraint {
    pub param: &'static str,
    pub spec: OutputConstraint,
}

fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

fn string(param: &'static str, v: &Value) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| bad(param, format!("`{param}` must be a string, got {v}.")))
}

/// A JSON schema given as an object (or boolean), or as a string holding one.
fn schema(param: &'static str, v: &Value) -> Result<OutputConstraint, ApiError> {
    let schema = match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(param, format!("`{param}` is not valid JSON: {e}.")))?,
        Value::Object(_) | Value::Bool(_) => v.clone(),
        _ => {
            return Err(bad(
                param,
                format!("`{param}` must be a JSON schema, got {v}."),
            ))
        }
    };
    Ok(OutputConstraint::JsonSchema(schema))
}

fn choices(param: &'static str, v: &Value) -> Result<OutputConstraint, ApiError> {
    let list: Option<Vec<String>> = v
        .as_array()
        .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_owned)).collect());
    match list {
        Some(list) if !list.is_empty() => Ok(OutputConstraint::Choice(list)),
        _ => Err(bad(
            param,
            format!("`{param}` must be a non-empty list of strings, got {v}."),
        )),
    }
}

fn response_format(v: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    const P: &str = "response_format";
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputConstraint::JsonObject)),
        Some("json_schema") => {
            let s = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| {
                    bad(P, "`response_format.json_schema.schema` is required for type \"json_schema\".")
                })?;
            schema(P, s).map(Some)
        }
        Some(other) => Err(unsupported(
            P,
            &format!("`response_format` type {other:?} is not supported (\"text\", \"json_object\", \"json_schema\")."),
        )),
        None => Err(bad(P, "`response_format.type` is required.")),
    }
}

/// vLLM's `structured_outputs`: exactly one of its kinds.
fn structured_outputs(v: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    const P: &str = "structured_outputs";
    let obj = v
        .as_object()
        .ok_or_else(|| bad(P, format!("`{P}` must be an object, got {v}.")))?;
    let mut found = Vec::new();
    for (key, value) in obj {
        if value.is_null() || *value == Value::Bool(false) {
            continue;
        }
        let spec = match key.as_str() {
            "json" => schema(P, value)?,
            "regex" => OutputConstraint::Regex(string(P, value)?),
            "choice" => choices(P, value)?,
            "grammar" => OutputConstraint::Lark(string(P, value)?),
            "json_object" => OutputConstraint::JsonObject,
            // Options that change nothing here.
            "disable_any_whitespace"
            | "disable_additional_properties"
            | "whitespace_pattern"
            | "backend" => continue,
            other => {
                return Err(unsupported(
                    P,
                    &format!("`structured_outputs.{other}` is not supported."),
                ))
            }
        };
        found.push(spec);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(bad(P, "`structured_outputs` may set only one of json, regex, choice, grammar and json_object.")),
    }
}

impl StructuredOutputFields {
    /// The one constraint the request asks for, if any.
    pub fn requested(&self) -> Result<Option<RequestedConstraint>, ApiError> {
        if let Some(v) = self.ebnf.as_ref().filter(|v| !v.is_null()) {
            return Err(unsupported(
                "ebnf",
                &format!("`ebnf` grammars are not supported (got {v}); give a Lark grammar as `guided_grammar`."),
            ));
        }
        type Parse = fn(&'static str, &Value) -> Result<Option<OutputConstraint>, ApiError>;
        let fields: [(&'static str, &Option<Value>, Parse); 8] = [
            ("response_format", &self.response_format, |_, v| {
                response_format(v)
            }),
            ("guided_json", &self.guided_json, |p, v| {
                schema(p, v).map(Some)
            }),
            ("json_schema", &self.json_schema, |p, v| {
                schema(p, v).map(Some)
            }),
            ("guided_regex", &self.guided_regex, |p, v| {
                Ok(Some(OutputConstraint::Regex(string(p, v)?)))
            }),
            ("regex", &self.regex, |p, v| {
                Ok(Some(OutputConstraint::Regex(string(p, v)?)))
            }),
            ("guided_choice", &self.guided_choice, |p, v| {
                choices(p, v).map(Some)
            }),
            ("guided_grammar", &self.guided_grammar, |p, v| {
                Ok(Some(OutputConstraint::Lark(string(p, v)?)))
            }),
            ("structured_outputs", &self.structured_outputs, |_, v| {
                structured_outputs(v)
            }),
        ];
        let mut found: Vec<RequestedConstraint> = Vec::new();
        for (param, value, parse) in fields {
            if let Some(v) = value.as_ref().filter(|v| !v.is_null()) {
                if let Some(spec) = parse(param, v)? {
                    found.push(RequestedConstraint { param, spec });
                }
            }
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|c| c.param).collect();
            return Err(bad(
                found[1].param,
                format!(
                    "Give one output constraint, not several ({}).",
                    names.join(", ")
                ),
            ));
        }
        Ok(found.pop())
    }
}

/// Compiles the constraint off the async runtime (a large schema, or the first constraint the
/// server sees, which builds the vocabulary's token trie, takes milliseconds to a second).
/// `after_thinking`: the model thinks first; the constraint shapes the answer after it.
pub async fn compile(
    compiler: &Arc<GrammarCompiler>,
    metrics: &Metrics,
    requested: RequestedConstraint,
    after_thinking: bool,
) -> Result<TokenConstraint, ApiError> {
    let compiler = Arc::clone(compiler);
    let param = requested.param;
    let kind = requested.spec.kind();
    let started = Instant::now();
    let compiled =
        tokio::task::spawn_blocking(move || compiler.compile(&requested.spec, after_thinking))
            .await
            .map_err(|e| ApiError::internal(format!("compiling `{param}` failed: {e}")))?
            .map_err(|e| bad(param, format!("`{param}` cannot be used: {e}")))?;
    metrics.observe_structured_output(kind, started.elapsed().as_secs_f64());
    Ok(compiled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> StructuredOutputFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn every_field_maps_to_its_constraint() {
        let schema = json!({"type": "object"});
        let cases = [
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                "response_format",
                OutputConstraint::JsonSchema(schema.clone()),
            ),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
                OutputConstraint::JsonObject,
            ),
            (
                json!({"guided_json": schema}),
                "guided_json",
                OutputConstraint::JsonSchema(schema.clone()),
            ),
            (
                json!({"guided_json": "{\"type\": \"object\"}"}),
                "guided_json",
                OutputConstraint::JsonSchema(schema.clone()),
            ),
            (
                json!({"json_schema": "{\"type\": \"object\"}"}),
                "json_schema",
                OutputConstraint::JsonSchema(schema.clone()),
            ),
            (
                json!({"guided_regex": "a+"}),
                "guided_regex",
                OutputConstraint::Regex("a+".into()),
            ),
            (
                json!({"regex": "a+"}),
                "regex",
                OutputConstraint::Regex("a+".into()),
            ),
            (
                json!({"guided_choice": ["a", "b"]}),
                "guided_choice",
                OutputConstraint::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                "guided_grammar",
                OutputConstraint::Lark("start: \"a\"".into()),
            ),
            (
                json!({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": true}}),
                "structured_outputs",
                OutputConstraint::Choice(vec!["a".into()]),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                "structured_outputs",
                OutputConstraint::JsonObject,
            ),
        ];
        for (body, param, spec) in cases {
            let got = fields(body.clone()).requested().unwrap();
            assert_eq!(got, Some(RequestedConstraint { param, spec }), "{body}");
        }
    }

    #[test]
    fn no_op_values_ask_for_nothing() {
        for body in [
            json!({}),
            json!({"response_format": {"type": "text"}}),
            json!({"guided_json": null, "ebnf": null}),
            json!({"structured_outputs": {"json": null}}),
        ] {
            assert_eq!(fields(body.clone()).requested().unwrap(), None, "{body}");
        }
    }

    #[test]
    fn malformed_or_several_constraints_are_400_naming_the_field() {
        let cases = [
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "structural_tag"}}),
                "response_format",
            ),
            (json!({"response_format": {}}), "response_format"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_json": 3}), "guided_json"),
            (json!({"guided_regex": 3}), "guided_regex"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"ebnf": "root ::= \"a\""}), "ebnf"),
            (
                json!({"structured_outputs": {"json": {}, "regex": "a"}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"tag": "x"}}),
                "structured_outputs",
            ),
            (
                json!({"guided_regex": "a", "guided_choice": ["a"]}),
                "guided_choice",
            ),
        ];
        for (body, param) in cases {
            let err = fields(body.clone()).requested().unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err:?}");
        }
    }
}
