//! The request's tools, and argument values typed by their JSON schema. Both markups write
//! argument values as text: a string as it is, anything else as JSON. The schema says which
//! was meant, so "007" stays a string where the parameter is a string and 7 becomes a number
//! where it is an integer.

use serde_json::{Map, Value};

/// The functions a request offers the model, by name, with their parameter schemas.
#[derive(Debug, Clone, Default)]
pub struct ToolSet {
    tools: Vec<(String, Map<String, Value>)>,
}

impl ToolSet {
    /// From the request's `tools` (`{"type": "function", "function": {"name", "parameters"}}`);
    /// with `only`, just that function (a named `tool_choice`).
    pub fn from_request(tools: &[Value], only: Option<&str>) -> ToolSet {
        let tools = tools
            .iter()
            .filter_map(|tool| {
                let function = tool.get("function")?;
                let name = function.get("name")?.as_str()?;
                if only.is_some_and(|o| o != name) {
                    return None;
                }
                let properties = function
                    .get("parameters")
                    .and_then(|p| p.get("properties"))
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                Some((name.to_owned(), properties))
            })
            .collect();
        ToolSet { tools }
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    fn properties(&self, name: &str) -> Option<&Map<String, Value>> {
        self.tools
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, properties)| properties)
    }

    /// The arguments of a call to `name` as a JSON object string, or `None` when the request
    /// offers no such function.
    pub fn arguments_json(&self, name: &str, arguments: Vec<RawArgument>) -> Option<String> {
        let properties = self.properties(name)?;
        let mut object = Map::new();
        for argument in arguments {
            let value = match argument.value {
                RawValue::Text(text) => typed_value(&text, properties.get(&argument.key)),
                RawValue::String(text) => Value::String(text),
                RawValue::Json(value) => value,
            };
            object.insert(argument.key, value);
        }
        Some(Value::Object(object).to_string())
    }
}

/// One argument as the markup wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct RawArgument {
    pub key: String,
    pub value: RawValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RawValue {
    /// Text whose type the schema decides.
    Text(String),
    /// A string, whatever the schema says (DSML's `string="true"`).
    String(String),
    /// Already known to be JSON (DSML's `string="false"`).
    Json(Value),
}

/// The schema's `type`, as a list (it may be one name or several).
fn schema_types(schema: Option<&Value>) -> Vec<&str> {
    match schema.and_then(|s| s.get("type")) {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

fn json_type_matches(value: &Value, ty: &str) -> bool {
    match ty {
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "null" => value.is_null(),
        _ => false,
    }
}

/// A text value typed by its parameter's schema: strings are kept exactly; other declared
/// types are parsed as JSON and kept as text when they do not parse into one of them. Without
/// a declared type, JSON that parses is taken as such.
pub fn typed_value(text: &str, schema: Option<&Value>) -> Value {
    let types = schema_types(schema);
    let parsed = serde_json::from_str::<Value>(text.trim()).ok();
    if types.is_empty() {
        return parsed.unwrap_or_else(|| Value::String(text.to_owned()));
    }
    match parsed {
        Some(value) if types.iter().any(|t| json_type_matches(&value, t)) => value,
        _ => Value::String(text.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_follow_the_schema() {
        let s = |t: Value| json!({ "type": t });
        assert_eq!(typed_value("007", Some(&s(json!("string")))), json!("007"));
        assert_eq!(typed_value("7", Some(&s(json!("integer")))), json!(7));
        assert_eq!(typed_value(" 2.5\n", Some(&s(json!("number")))), json!(2.5));
        assert_eq!(typed_value("true", Some(&s(json!("boolean")))), json!(true));
        assert_eq!(
            typed_value("{\"a\": [1]}", Some(&s(json!("object")))),
            json!({"a": [1]})
        );
        assert_eq!(
            typed_value("[1,2]", Some(&s(json!("array")))),
            json!([1, 2])
        );
        // Not what the schema says: kept as the text the model wrote.
        assert_eq!(
            typed_value("seven", Some(&s(json!("integer")))),
            json!("seven")
        );
        assert_eq!(typed_value("2.5", Some(&s(json!("integer")))), json!("2.5"));
        assert_eq!(
            typed_value("null", Some(&s(json!(["string", "null"])))),
            json!(null)
        );
        assert_eq!(
            typed_value("none", Some(&s(json!(["string", "null"])))),
            json!("none")
        );
        // No schema: JSON if it parses.
        assert_eq!(typed_value("3", None), json!(3));
        assert_eq!(typed_value("Paris", None), json!("Paris"));
    }

    #[test]
    fn tool_set_and_named_choice() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}),
            json!({"type": "function", "function": {"name": "b"}}),
        ];
        let all = ToolSet::from_request(&tools, None);
        let arg = |k: &str, v: &str| RawArgument {
            key: k.into(),
            value: RawValue::Text(v.into()),
        };
        assert_eq!(
            all.arguments_json("a", vec![arg("n", "5"), arg("x", "y")])
                .unwrap(),
            r#"{"n":5,"x":"y"}"#
        );
        assert_eq!(all.arguments_json("b", vec![]).unwrap(), "{}");
        assert_eq!(all.arguments_json("c", vec![]), None);
        let only_b = ToolSet::from_request(&tools, Some("b"));
        assert_eq!(only_b.arguments_json("a", vec![]), None);
        assert!(ToolSet::from_request(&tools, Some("zz")).is_empty());
    }
}
