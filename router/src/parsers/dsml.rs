//! DeepSeek-V3.2's tool-call markup ("DSML"; the bars are U+FF5C), one block for all calls:
//!
//! ```text
//! <｜DSML｜function_calls>
//! <｜DSML｜invoke name="NAME">
//! <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜function_calls>
//! ```
//!
//! `string="true"` marks a value that is the string itself, `string="false"` one written as
//! JSON. A value that claims JSON but does not parse, or has no `string` attribute, is typed
//! by the schema instead.

use super::arguments::{RawArgument, RawValue};
use super::tool_calls::RawCall;

pub const OPEN: &str = "<｜DSML｜function_calls>";
pub const CLOSE: &str = "</｜DSML｜function_calls>";
pub(super) const INVOKE_OPEN: &str = "<｜DSML｜invoke name=\"";
pub(super) const INVOKE_CLOSE: &str = "</｜DSML｜invoke>";
pub(super) const PARAM_OPEN: &str = "<｜DSML｜parameter name=\"";
pub(super) const PARAM_CLOSE: &str = "</｜DSML｜parameter>";

/// The text between the `function_calls` tags, or `None` if it is not well formed.
pub fn parse_block(inner: &str) -> Option<Vec<RawCall>> {
    let mut calls = Vec::new();
    let mut rest = inner;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix(INVOKE_OPEN)?;
        let (name, after) = after.split_once("\">")?;
        if name.is_empty() || name.contains(['"', '<', '>']) {
            return None;
        }
        let (body, after) = after.split_once(INVOKE_CLOSE)?;
        calls.push(RawCall {
            name: name.to_owned(),
            arguments: parse_parameters(body)?,
        });
        rest = after;
    }
    (!calls.is_empty()).then_some(calls)
}

fn parse_parameters(body: &str) -> Option<Vec<RawArgument>> {
    let mut arguments = Vec::new();
    let mut rest = body;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix(PARAM_OPEN)?;
        let (key, after) = after.split_once('"')?;
        let (attributes, after) = after.split_once('>')?;
        let (value, after) = after.split_once(PARAM_CLOSE)?;
        if key.is_empty() {
            return None;
        }
        let value = match attributes.trim() {
            "string=\"true\"" => RawValue::String(value.to_owned()),
            "string=\"false\"" => match serde_json::from_str(value.trim()) {
                Ok(json) => RawValue::Json(json),
                Err(_) => RawValue::Text(value.to_owned()),
            },
            "" => RawValue::Text(value.to_owned()),
            _ => return None,
        };
        arguments.push(RawArgument {
            key: key.to_owned(),
            value,
        });
        rest = after;
    }
    Some(arguments)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn two_invokes_with_typed_parameters() {
        let inner = "\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" string=\"true\">Hangzhou</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n";
        let calls = parse_block(inner).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            calls[0].arguments,
            vec![
                RawArgument {
                    key: "location".into(),
                    value: RawValue::String("Hangzhou".into())
                },
                RawArgument {
                    key: "days".into(),
                    value: RawValue::Json(json!(3))
                },
            ]
        );
        assert_eq!(calls[1].name, "now");
        assert!(calls[1].arguments.is_empty());
    }

    #[test]
    fn malformed_blocks() {
        for bad in [
            "",
            "\n",
            "<｜DSML｜invoke name=\"f\">",
            "<｜DSML｜invoke name=\"\"></｜DSML｜invoke>",
            "<｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"k\" string=\"true\">v</｜DSML｜invoke>",
            "<｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"k\" kind=\"x\">v</｜DSML｜parameter></｜DSML｜invoke>",
            "text<｜DSML｜invoke name=\"f\"></｜DSML｜invoke>",
        ] {
            assert_eq!(parse_block(bad), None, "{bad:?}");
        }
    }
}
