//! GLM-4.5 / 4.7 / 5 tool-call markup, one call per block:
//! `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`.
//! GLM-4.5 puts newlines after the name and between the tags; GLM-4.7 and 5 do not; both
//! are read here. Values are raw text (strings as they are, other types as JSON).

use super::arguments::{RawArgument, RawValue};
use super::tool_calls::RawCall;

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";
pub(super) const KEY_OPEN: &str = "<arg_key>";
pub(super) const KEY_CLOSE: &str = "</arg_key>";
pub(super) const VALUE_OPEN: &str = "<arg_value>";
pub(super) const VALUE_CLOSE: &str = "</arg_value>";

/// The text between `<tool_call>` and `</tool_call>`, or `None` if it is not well formed.
pub fn parse_block(inner: &str) -> Option<Vec<RawCall>> {
    let name_end = inner.find(KEY_OPEN).unwrap_or(inner.len());
    let name = inner[..name_end].trim();
    if name.is_empty() || name.contains(['<', '>']) || name.contains(char::is_whitespace) {
        return None;
    }
    let mut rest = &inner[name_end..];
    let mut arguments = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (key, after_key) = tagged(rest, KEY_OPEN, KEY_CLOSE)?;
        let (value, after_value) = tagged(after_key.trim_start(), VALUE_OPEN, VALUE_CLOSE)?;
        let key = key.trim();
        if key.is_empty() {
            return None;
        }
        arguments.push(RawArgument {
            key: key.to_owned(),
            value: RawValue::Text(value.to_owned()),
        });
        rest = after_value;
    }
    Some(vec![RawCall {
        name: name.to_owned(),
        arguments,
    }])
}

/// `OPEN…CLOSE` at the start of `text`: the text inside, and what follows.
fn tagged<'a>(text: &'a str, open: &str, close: &str) -> Option<(&'a str, &'a str)> {
    let inside = text.strip_prefix(open)?;
    let end = inside.find(close)?;
    Some((&inside[..end], &inside[end + close.len()..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_arg(key: &str, value: &str) -> RawArgument {
        RawArgument {
            key: key.into(),
            value: RawValue::Text(value.into()),
        }
    }

    #[test]
    fn glm47_and_glm45_layouts() {
        let want = vec![RawCall {
            name: "get_weather".into(),
            arguments: vec![text_arg("city", "Beijing"), text_arg("days", "3")],
        }];
        let glm47 = "get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value><arg_key>days</arg_key><arg_value>3</arg_value>";
        assert_eq!(parse_block(glm47), Some(want.clone()));
        let glm45 = "get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n";
        assert_eq!(parse_block(glm45), Some(want));
        assert_eq!(
            parse_block("list_files"),
            Some(vec![RawCall {
                name: "list_files".into(),
                arguments: vec![]
            }])
        );
        // Values are kept exactly, markup-like text and newlines included.
        let odd = parse_block("f<arg_key>s</arg_key><arg_value> a <b>\n</arg_value>").unwrap();
        assert_eq!(odd[0].arguments, vec![text_arg("s", " a <b>\n")]);
    }

    #[test]
    fn malformed_blocks() {
        for bad in [
            "",
            "<arg_key>k</arg_key><arg_value>v</arg_value>",
            "two words",
            "f<arg_key>k</arg_key>",
            "f<arg_key>k</arg_key><arg_value>v",
            "f<arg_key>k<arg_value>v</arg_value>",
            "f<arg_key> </arg_key><arg_value>v</arg_value>",
            "f<arg_key>k</arg_key><arg_value>v</arg_value>junk",
        ] {
            assert_eq!(parse_block(bad), None, "{bad:?}");
        }
    }
}
