//! Forced-call grammars run through the grammar engine over a byte-level vocabulary with the
//! markup's tags as added tokens (as GLM's and DeepSeek's tokenizers have them): random walks
//! must end in text that the tool-call parser reads as calls to the offered functions with
//! arguments of the schema's types, and the canonical markup must be accepted token by token.

use std::path::Path;
use std::sync::Arc;

use rand::Rng;
use serde_json::{json, Value};

use super::*;
use crate::grammar::walk::allowed_ids;
use crate::grammar::{GrammarCompiler, OutputConstraint, TokenConstraint};
use crate::parsers::tool_calls::{ToolCallScanner, ToolPart};
use crate::parsers::ToolSet;
use crate::tokenizer::TokenizerBundle;

const MARKUP: [&str; 10] = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<｜DSML｜function_calls>",
    "</｜DSML｜function_calls>",
    "</｜DSML｜invoke>",
    "</｜DSML｜parameter>",
];

/// The embedded model's tokenizer with the markup added (not special); the first added id.
fn markup_tokenizer() -> (Arc<TokenizerBundle>, i32, tempfile::TempDir) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pyworker/nsaserve/embedded_model");
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab_max = tok["model"]["vocab"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(Value::as_i64)
        .max()
        .unwrap();
    let added = tok["added_tokens"].as_array_mut().unwrap();
    let first = 1 + added
        .iter()
        .filter_map(|t| t["id"].as_i64())
        .max()
        .unwrap()
        .max(vocab_max);
    for (i, content) in MARKUP.iter().enumerate() {
        added.push(
            json!({"id": first + i as i64, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": false}),
        );
    }
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    let bundle = TokenizerBundle::from_model_dir(dir.path()).unwrap();
    (Arc::new(bundle), first as i32, dir)
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "metric": {"type": "boolean"},
                "where": {"$ref": "#/$defs/point"}
            },
            "required": ["city", "days"],
            "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
                                "required": ["lat"], "additionalProperties": false}}
        }}}),
        json!({"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "note"}}),
    ]
}

/// A random walk that leans towards the markup's tags and the end (a uniform pick would take
/// hundreds of tokens to close a free-text value); the text, and whether the grammar ended.
fn walk(
    tok: &TokenizerBundle,
    c: &mut TokenConstraint,
    first_markup: i32,
    seed: u64,
) -> (String, bool) {
    crate::grammar::walk::walk(tok, c, seed, 2000, |allowed, stops, rng| {
        let favoured: Vec<i32> = allowed
            .iter()
            .copied()
            .filter(|t| *t >= first_markup || stops.contains(t))
            .collect();
        if !favoured.is_empty() && rng.random_bool(0.5) {
            favoured[rng.random_range(0..favoured.len())]
        } else {
            allowed[rng.random_range(0..allowed.len())]
        }
    })
}

fn parse_calls(kind: ToolParserKind, tools: &[Value], text: &str) -> Vec<(String, Value)> {
    let mut scanner = ToolCallScanner::new(kind, ToolSet::from_request(tools, None));
    let mut parts = scanner.feed(text);
    parts.extend(scanner.finish());
    parts
        .into_iter()
        .map(|p| match p {
            ToolPart::Call(c) => (c.name, serde_json::from_str(&c.arguments).unwrap()),
            ToolPart::Content(s) => panic!("content {s:?} in {text:?}"),
        })
        .collect()
}

fn check_arguments(name: &str, args: &Value, text: &str) {
    let obj = args.as_object().unwrap();
    match name {
        "get_weather" => {
            assert!(obj["city"].is_string(), "{text}");
            let days = obj["days"].as_i64().unwrap_or_else(|| panic!("{text}"));
            assert!((1..=14).contains(&days), "{text}");
            if let Some(u) = obj.get("unit") {
                assert!(u == "C" || u == "F", "{text}");
            }
            if let Some(m) = obj.get("metric") {
                assert!(m.is_boolean(), "{text}");
            }
            if let Some(w) = obj.get("where") {
                assert!(w["lat"].is_number(), "{text}");
            }
            let known = ["city", "days", "unit", "metric", "where"];
            assert!(obj.keys().all(|k| known.contains(&k.as_str())), "{text}");
        }
        "now" => assert!(obj.is_empty(), "{text}"),
        "note" => assert!(obj.values().all(Value::is_string), "{text}"),
        other => panic!("call to {other} in {text}"),
    }
}

fn constraint(
    compiler: &GrammarCompiler,
    kind: ToolParserKind,
    only: Option<&str>,
    count: CallCount,
) -> TokenConstraint {
    let lark = forced_calls_grammar(kind, &tools(), only, count).unwrap();
    compiler
        .compile(&OutputConstraint::ToolCalls(lark.clone()), false)
        .unwrap_or_else(|e| panic!("{e}\n{lark}"))
}

#[test]
fn walks_end_in_calls_the_parser_reads() {
    let (tok, first, _dir) = markup_tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    for kind in [
        ToolParserKind::Glm47,
        ToolParserKind::Glm45,
        ToolParserKind::DeepSeekV32,
    ] {
        let mut names = std::collections::HashSet::new();
        for seed in 0..40 {
            let mut c = constraint(&compiler, kind, None, CallCount::OneOrMore);
            let (text, ended) = walk(&tok, &mut c, first, seed);
            assert!(ended, "{kind:?} seed {seed}: {text:?}");
            let calls = parse_calls(kind, &tools(), &text);
            assert!(!calls.is_empty(), "{kind:?}: {text:?}");
            for (name, args) in &calls {
                check_arguments(name, args, &text);
                names.insert(name.clone());
            }
        }
        assert_eq!(
            names.len(),
            3,
            "{kind:?}: every tool is reachable: {names:?}"
        );
    }
}

#[test]
fn a_named_choice_with_one_call_makes_exactly_that_call() {
    let (tok, first, _dir) = markup_tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    for kind in [ToolParserKind::Glm47, ToolParserKind::DeepSeekV32] {
        for seed in 0..20 {
            let mut c = constraint(&compiler, kind, Some("get_weather"), CallCount::One);
            let (text, ended) = walk(&tok, &mut c, first, 100 + seed);
            assert!(ended, "{text:?}");
            let calls = parse_calls(kind, &tools(), &text);
            assert_eq!(calls.len(), 1, "{text:?}");
            assert_eq!(calls[0].0, "get_weather");
            check_arguments("get_weather", &calls[0].1, &text);
        }
    }
}

/// Feeds `text`'s tokens; the index of the first one the grammar refuses, if any.
fn first_refused(tok: &TokenizerBundle, c: &mut TokenConstraint, text: &str) -> Option<usize> {
    let stops = tok.eos_token_ids().to_vec();
    let ids = tok.encode(text, false).unwrap();
    for (i, &t) in ids.iter().enumerate() {
        let allowed = allowed_ids(&c.allowed_tokens(&stops, None).unwrap());
        if !allowed.contains(&t) {
            return Some(i);
        }
        if c.advance(t).unwrap() {
            // The grammar is complete: the output ends here.
            return (i + 1 < ids.len()).then_some(i + 1);
        }
    }
    None
}

#[test]
fn the_models_own_markup_is_accepted_and_other_calls_are_not() {
    let (tok, _, _dir) = markup_tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let glm = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>New York</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>unit</arg_key><arg_value>F</arg_value><arg_key>where</arg_key><arg_value>{\"lat\": 40.7}</arg_value></tool_call>\n<tool_call>now</tool_call>";
    let mut c = constraint(&compiler, ToolParserKind::Glm47, None, CallCount::OneOrMore);
    assert_eq!(first_refused(&tok, &mut c, glm), None);
    let stops = tok.eos_token_ids().to_vec();
    let end = allowed_ids(&c.allowed_tokens(&stops, None).unwrap());
    assert!(
        stops.iter().all(|s| end.contains(s)),
        "the output may end after the calls"
    );
    let dsml = "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"note\">\n<｜DSML｜parameter name=\"text\" string=\"true\">buy milk</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
    let mut c = constraint(&compiler, ToolParserKind::DeepSeekV32, None, CallCount::One);
    assert_eq!(first_refused(&tok, &mut c, dsml), None);
    // Refused: text before the call, a function not offered, a missing required argument, a
    // value of the wrong type, a second call where one is allowed.
    let refused = [
        (ToolParserKind::Glm47, None, CallCount::OneOrMore, "Sure!<tool_call>now</tool_call>"),
        (ToolParserKind::Glm47, None, CallCount::OneOrMore, "<tool_call>delete_all</tool_call>"),
        (ToolParserKind::Glm47, Some("now"), CallCount::OneOrMore, "<tool_call>note</tool_call>"),
        (ToolParserKind::Glm47, None, CallCount::OneOrMore, "<tool_call>get_weather<arg_key>days</arg_key>"),
        (ToolParserKind::Glm47, None, CallCount::OneOrMore, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value><arg_key>days</arg_key><arg_value>three"),
        (ToolParserKind::Glm47, None, CallCount::One, "<tool_call>now</tool_call><tool_call>now</tool_call>"),
        (ToolParserKind::Glm47, None, CallCount::OneOrMore, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</tool_call>"),
    ];
    for (kind, only, count, text) in refused {
        let mut c = constraint(&compiler, kind, only, count);
        assert!(first_refused(&tok, &mut c, text).is_some(), "{text}");
    }
}

#[test]
fn no_function_no_grammar() {
    assert_eq!(
        forced_calls_grammar(
            ToolParserKind::Glm47,
            &[json!({"type": "function"})],
            None,
            CallCount::One
        ),
        None
    );
    assert_eq!(
        forced_calls_grammar(
            ToolParserKind::Glm47,
            &tools(),
            Some("missing"),
            CallCount::One
        ),
        None
    );
}
