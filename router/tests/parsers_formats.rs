//! The output parsers on the real markups: GLM-4.5/4.7/5 and DeepSeek-V3.2 tool calls with
//! `<think>` reasoning. Every case is also fed split at every character boundary and one
//! character at a time: streaming must give exactly what parsing the whole text gives.

use serde_json::{json, Value};

use nsaserve_router::parsers::{
    OutputParser, ParsedOutput, ParsedToolCall, ReasoningMode, ReasoningParserKind,
    ToolCallScanner, ToolParserKind, ToolSet,
};

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "options": {"type": "object"}, "zip": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}),
    ]
}

fn parser(prompt: &str, kind: Option<ToolParserKind>) -> OutputParser {
    let mode = ReasoningMode::for_prompt(ReasoningParserKind::Glm45, prompt);
    let scanner = kind.map(|k| ToolCallScanner::new(k, ToolSet::from_request(&tools(), None)));
    OutputParser::new(Some(mode), scanner)
}

/// The whole text at once, then every split of it into two and into single characters; all
/// must agree. Returns the result and the fallback count.
fn parse_all_ways(prompt: &str, kind: Option<ToolParserKind>, text: &str) -> (ParsedOutput, u32) {
    let run = |pieces: Vec<&str>| {
        let mut p = parser(prompt, kind);
        let mut out = ParsedOutput::default();
        for piece in pieces {
            out.add(p.feed(piece));
        }
        out.add(p.finish());
        (out, p.take_fallbacks())
    };
    let whole = run(vec![text]);
    for (at, _) in text.char_indices().skip(1) {
        let split = run(vec![&text[..at], &text[at..]]);
        assert_eq!(split, whole, "split at byte {at} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let one_by_one = run(chars.iter().map(String::as_str).collect());
    assert_eq!(one_by_one, whole, "one character at a time: {text:?}");
    whole
}

fn call(name: &str, arguments: Value) -> ParsedToolCall {
    ParsedToolCall {
        name: name.into(),
        arguments: arguments.to_string(),
    }
}

const GLM_PROMPT: &str = "[gMASK]<sop><|user|>weather?<|assistant|><think>";

#[test]
fn glm47_thinking_then_two_calls() {
    let text = "The user wants weather.</think>Let me check.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value><arg_key>zip</arg_key><arg_value>007</arg_value><arg_key>options</arg_key><arg_value>{\"hourly\": [1, 2]}</arg_value></tool_call>\n<tool_call>now</tool_call>";
    let (out, fallbacks) = parse_all_ways(GLM_PROMPT, Some(ToolParserKind::Glm47), text);
    assert_eq!(out.reasoning, "The user wants weather.");
    assert_eq!(out.content, "Let me check.");
    assert_eq!(
        out.tool_calls,
        vec![
            call(
                "get_weather",
                json!({"city": "Beijing", "days": 3, "metric": true, "zip": "007", "options": {"hourly": [1, 2]}})
            ),
            call("now", json!({})),
        ]
    );
    assert_eq!(fallbacks, 0);
}

#[test]
fn glm45_model_opens_think_and_uses_newlines() {
    let text = "<think>\nNeed weather.\n</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n";
    let (out, fallbacks) =
        parse_all_ways("<|user|>hi<|assistant|>", Some(ToolParserKind::Glm45), text);
    assert_eq!(out.reasoning, "Need weather.");
    assert_eq!(out.content, "");
    assert_eq!(
        out.tool_calls,
        vec![call("get_weather", json!({"city": "Paris"}))]
    );
    assert_eq!(fallbacks, 0);
}

#[test]
fn thinking_disabled_keeps_everything_as_content() {
    let prompt = "<|user|>hi<|assistant|></think>";
    let text = "Plain answer, no <think> here.\n\n";
    let (out, _) = parse_all_ways(prompt, Some(ToolParserKind::Glm47), text);
    assert_eq!(out.reasoning, "");
    assert_eq!(out.content, text);
    assert!(out.tool_calls.is_empty());
}

#[test]
fn deepseek_v32_dsml_calls() {
    let prompt = "<｜begin▁of▁sentence｜><｜User｜>weather?<｜Assistant｜><think>";
    let text = "Check two cities.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"true\">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
    let (out, fallbacks) = parse_all_ways(prompt, Some(ToolParserKind::DeepSeekV32), text);
    assert_eq!(out.reasoning, "Check two cities.");
    assert_eq!(out.content, "");
    assert_eq!(
        out.tool_calls,
        vec![
            call("get_weather", json!({"city": "杭州", "days": 2})),
            // string="true" wins over the schema: the model said it is a string.
            call("get_weather", json!({"city": "Paris", "days": "5"})),
        ]
    );
    assert_eq!(fallbacks, 0);
}

#[test]
fn reasoning_only_parser_passes_markup_through() {
    let text = "hmm</think>answer <tool_call>now</tool_call>";
    let (out, _) = parse_all_ways(GLM_PROMPT, None, text);
    assert_eq!(out.reasoning, "hmm");
    assert_eq!(out.content, "answer <tool_call>now</tool_call>");
}

#[test]
fn malformed_markup_falls_back_to_content() {
    let glm = Some(ToolParserKind::Glm47);
    let cases = [
        // Unclosed at the end of the output.
        ("x</think>Sure <tool_call>get_weather<arg_key>city</arg_key><arg_value>Ro", glm,
         "Sure <tool_call>get_weather<arg_key>city</arg_key><arg_value>Ro"),
        // A value without its key.
        ("x</think><tool_call>get_weather<arg_value>Rome</arg_value></tool_call>", glm,
         "<tool_call>get_weather<arg_value>Rome</arg_value></tool_call>"),
        // A function the request did not offer.
        ("x</think>a\n<tool_call>rm_rf</tool_call>\nb", glm, "a\n<tool_call>rm_rf</tool_call>\nb"),
        // DSML with a broken invoke.
        ("x</think><｜DSML｜function_calls><｜DSML｜invoke name=\"now\"></｜DSML｜function_calls>",
         Some(ToolParserKind::DeepSeekV32),
         "<｜DSML｜function_calls><｜DSML｜invoke name=\"now\"></｜DSML｜function_calls>"),
    ];
    for (text, kind, content) in cases {
        let (out, fallbacks) = parse_all_ways(GLM_PROMPT, kind, text);
        assert_eq!(out.content, content, "{text:?}");
        assert!(out.tool_calls.is_empty(), "{text:?}");
        assert_eq!(fallbacks, 1, "{text:?}");
    }
    // One bad block does not spoil the good one after it.
    let text = "x</think><tool_call>bad<arg_key></tool_call><tool_call>now</tool_call>";
    let (out, fallbacks) = parse_all_ways(GLM_PROMPT, glm, text);
    assert_eq!(out.content, "<tool_call>bad<arg_key></tool_call>");
    assert_eq!(out.tool_calls, vec![call("now", json!({}))]);
    assert_eq!(fallbacks, 1);
}

#[test]
fn partial_tags_at_the_end_are_content() {
    let (out, fallbacks) =
        parse_all_ways(GLM_PROMPT, Some(ToolParserKind::Glm47), "a</think>b <tool_");
    assert_eq!(out.content, "b <tool_");
    assert_eq!(fallbacks, 0);
}

#[test]
fn thinking_disabled_call_right_away() {
    let prompt = "<|user|>hi<|assistant|></think>";
    let text = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>4</arg_value></tool_call>";
    let (out, fallbacks) = parse_all_ways(prompt, Some(ToolParserKind::Glm47), text);
    assert_eq!(out.reasoning, "");
    assert_eq!(out.content, "");
    assert_eq!(
        out.tool_calls,
        vec![call("get_weather", json!({"days": 4}))]
    );
    assert_eq!(fallbacks, 0);
}
