//! `json.dumps` as Python writes it. Chat templates were written (and models trained) against
//! Jinja's `tojson`, which Hugging Face defines with Python's `json.dumps`: `", "` and `": "`
//! separators, no HTML escaping and non-ASCII kept as is. Tool schemas rendered any other way
//! would give prompts the model never saw.

use serde_json::Value;

pub struct DumpOptions {
    pub indent: Option<usize>,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

pub fn dumps(value: &Value, options: &DumpOptions) -> String {
    let mut out = String::new();
    write_value(&mut out, value, options, 0);
    out
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    // serde_json escapes exactly what Python does (quote, backslash, control characters).
    let quoted = serde_json::to_string(s).expect("strings always serialize");
    if !ensure_ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}

fn newline(out: &mut String, options: &DumpOptions, depth: usize) {
    if let Some(indent) = options.indent {
        out.push('\n');
        out.push_str(&" ".repeat(indent * depth));
    }
}

fn write_value(out: &mut String, value: &Value, options: &DumpOptions, depth: usize) {
    // Python uses "," between items when indenting (the newline separates them) and ", " otherwise.
    let item_separator = if options.indent.is_some() { "," } else { ", " };
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(out, s, options.ensure_ascii),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, options, depth + 1);
                write_value(out, item, options, depth + 1);
            }
            newline(out, options, depth);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, options, depth + 1);
                write_string(out, key, options.ensure_ascii);
                out.push_str(": ");
                write_value(out, item, options, depth + 1);
            }
            newline(out, options, depth);
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plain() -> DumpOptions {
        DumpOptions {
            indent: None,
            sort_keys: false,
            ensure_ascii: false,
        }
    }

    #[test]
    fn matches_python_default_separators_and_key_order() {
        let v = json!({"b": [1, 2.5, null], "a": {"x": "é\n"}, "e": {}, "f": []});
        assert_eq!(
            dumps(&v, &plain()),
            r#"{"b": [1, 2.5, null], "a": {"x": "é\n"}, "e": {}, "f": []}"#
        );
    }

    #[test]
    fn indent_sort_keys_and_ascii() {
        let v = json!({"b": 1, "a": ["ü😀"]});
        let options = DumpOptions {
            indent: Some(2),
            sort_keys: true,
            ensure_ascii: true,
        };
        assert_eq!(
            dumps(&v, &options),
            "{\n  \"a\": [\n    \"\\u00fc\\ud83d\\ude00\"\n  ],\n  \"b\": 1\n}"
        );
    }
}
