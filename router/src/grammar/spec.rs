//! What a request constrains its output to, and the llguidance grammar for it.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// A request's output constraint, whichever API field gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// Text matching this JSON schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this Lark grammar (llguidance's dialect: `start: ...`, `%json {...}` allowed).
    Lark(String),
    /// Calls to the offered tools in the model's markup, for a forced `tool_choice`: a Lark
    /// grammar the router builds (`parsers::forced_calls_grammar`).
    ToolCalls(String),
}

/// JSON as the model writes it here: `", "` between items, `": "` after keys, and no other
/// whitespace. A free whitespace rule lets a model pad forever (newlines until `max_tokens`);
/// fixed separators keep the output bounded and read like ordinary JSON. A schema's own
/// `x-guidance` options override these.
pub fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `s` as a regex matching exactly itself.
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl OutputConstraint {
    /// The kind, as metrics label it.
    pub fn kind(&self) -> &'static str {
        match self {
            OutputConstraint::JsonSchema(_) => "json_schema",
            OutputConstraint::JsonObject => "json_object",
            OutputConstraint::Regex(_) => "regex",
            OutputConstraint::Choice(_) => "choice",
            OutputConstraint::Lark(_) => "grammar",
            OutputConstraint::ToolCalls(_) => "tool_call",
        }
    }

    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            OutputConstraint::JsonSchema(schema) => {
                let mut schema = schema.clone();
                if let Some(obj) = schema.as_object_mut() {
                    obj.entry("x-guidance").or_insert_with(json_options);
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            OutputConstraint::JsonObject => TopLevelGrammar::from_json_schema(
                json!({"type": "object", "x-guidance": json_options()}),
            ),
            OutputConstraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            OutputConstraint::Choice(choices) => {
                let alternatives: Vec<String> = choices.iter().map(|c| regex_literal(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            OutputConstraint::Lark(source) | OutputConstraint::ToolCalls(source) => {
                TopLevelGrammar::from_lark(source.clone())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_escape_every_regex_operator() {
        assert_eq!(regex_literal("a.b"), "a\\.b");
        assert_eq!(regex_literal("(x|y)*"), "\\(x\\|y\\)\\*");
        assert_eq!(regex_literal("plain text"), "plain text");
    }

    #[test]
    fn schema_options_are_added_unless_given() {
        let given = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        let g = OutputConstraint::JsonSchema(given.clone()).grammar();
        let schema = g.grammars[0].json_schema.as_ref().unwrap();
        assert_eq!(schema["x-guidance"], given["x-guidance"]);
        let g = OutputConstraint::JsonSchema(json!({"type": "integer"})).grammar();
        let schema = g.grammars[0].json_schema.as_ref().unwrap();
        assert_eq!(schema["x-guidance"], json_options());
    }
}
