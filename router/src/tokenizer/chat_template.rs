//! Chat templates rendered with minijinja the way Hugging Face `apply_chat_template` renders
//! them with Jinja2: `trim_blocks` and `lstrip_blocks`, Python string/dict methods (pycompat),
//! `raise_exception`, `strftime_now`, Python-style `tojson`, the special token strings, and the
//! request's `chat_template_kwargs` as extra variables.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use super::model_files::SpecialTokens;
use super::python_json::{dumps, DumpOptions};

const TEMPLATE_NAME: &str = "chat_template";

/// A template that could not render: a `raise_exception` in the template (usually a message
/// order the model does not support) or an error evaluating it. Either way the request is bad.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ChatTemplateError(pub String);

pub struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let options = DumpOptions {
        indent: kwargs.get::<Option<usize>>("indent")?,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    // `separators` is accepted for compatibility; Python's defaults are what templates use.
    let _ = kwargs.get::<Option<Value>>("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson cannot serialize: {e}"),
        )
    })?;
    Ok(Value::from_safe_string(dumps(&json, &options)))
}

/// Days since 1970-01-01 to a (year, month, day) civil date (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// Python's `strftime` for the directives chat templates use (dates in system prompts), in UTC.
fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = WEEKDAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                out.push_str(&day.to_string());
            }
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn strftime_now(format: String) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, now)
}

impl ChatTemplate {
    pub fn new(source: &str, special: SpecialTokens) -> Result<ChatTemplate, Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())?;
        Ok(ChatTemplate { env, special })
    }

    /// Renders `messages` (OpenAI message objects, `content` already flattened to a string)
    /// into the prompt text. `extra` (the request's `chat_template_kwargs`) adds variables
    /// such as `enable_thinking`; it cannot replace `messages` or `tools`.
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String, ChatTemplateError> {
        let mut ctx = Map::new();
        let special = [
            ("bos_token", &self.special.bos_token),
            ("eos_token", &self.special.eos_token),
            ("unk_token", &self.special.unk_token),
            ("pad_token", &self.special.pad_token),
        ];
        for (name, value) in special {
            if let Some(v) = value {
                ctx.insert(name.into(), Json::String(v.clone()));
            }
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        for (key, value) in extra {
            if key != "messages" && key != "tools" {
                ctx.insert(key.clone(), value.clone());
            }
        }
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert(
            "tools".into(),
            tools.map_or(Json::Null, |t| Json::Array(t.to_vec())),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError(e.to_string()))?;
        template.render(Value::from_serialize(&ctx)).map_err(|e| {
            // A raise_exception message is the template author's words for what is wrong.
            if e.kind() == ErrorKind::InvalidOperation {
                if let Some(detail) = e.detail() {
                    return ChatTemplateError(detail.to_owned());
                }
            }
            ChatTemplateError(format!("the chat template failed to render: {e}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn special() -> SpecialTokens {
        SpecialTokens {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            ..Default::default()
        }
    }

    #[test]
    fn renders_with_hugging_face_semantics() {
        let source = "{{ bos_token }}{% for m in messages %}\n{{ m['role'] }}: {{ m.content.strip() }}\n  {% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}assistant:{% endif %}{% if thinking %}+think{% endif %}";
        let t = ChatTemplate::new(source, special()).unwrap();
        let messages = [json!({"role": "user", "content": " hi "})];
        let tools = [
            json!({"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": "<&>"}}}),
        ];
        let mut extra = Map::new();
        extra.insert("thinking".into(), json!(true));
        let out = t.render(&messages, Some(&tools), true, &extra).unwrap();
        assert_eq!(
            out,
            "<s>user: hi\n[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"z\": 1, \"a\": \"<&>\"}}}]assistant:+think"
        );
        let out = t.render(&messages, None, false, &Map::new()).unwrap();
        assert_eq!(out, "<s>user: hi\n");
    }

    #[test]
    fn raise_exception_message_reaches_the_caller() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok";
        let t = ChatTemplate::new(source, special()).unwrap();
        let err = t
            .render(
                &[json!({"role": "assistant", "content": "x"})],
                None,
                true,
                &Map::new(),
            )
            .unwrap_err();
        assert_eq!(err.0, "Conversations must start with a user message");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %B %-d %%", t),
            "29 Feb 2024 13:05:09 Thursday February 29 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
    }
}
