//! Random walks through compiled constraints over the embedded model's byte-level vocabulary:
//! whatever allowed token a walk picks, the text it ends with must satisfy the constraint.

use std::sync::Arc;

use serde_json::{json, Value};

use super::walk::{allowed_ids, uniform};
use super::*;
use crate::tokenizer::TokenizerBundle;

fn tokenizer() -> Arc<TokenizerBundle> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pyworker/nsaserve/embedded_model");
    Arc::new(TokenizerBundle::from_model_dir(&dir).expect("the embedded model's tokenizer"))
}

fn walk(
    tok: &TokenizerBundle,
    c: &mut TokenConstraint,
    seed: u64,
    max_tokens: usize,
) -> (String, bool) {
    super::walk::walk(tok, c, seed, max_tokens, uniform)
}

#[test]
fn choices_end_as_one_of_them() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let choices = ["yes", "no", "maybe (a.b)"];
    let spec = OutputConstraint::Choice(choices.iter().map(|s| s.to_string()).collect());
    let mut seen = std::collections::HashSet::new();
    for seed in 0..40 {
        let mut c = compiler.compile(&spec, false).unwrap();
        let (text, ended) = walk(&tok, &mut c, seed, 40);
        assert!(ended, "seed {seed}: {text:?} did not end");
        assert!(choices.contains(&text.as_str()), "seed {seed}: {text:?}");
        seen.insert(text);
    }
    assert_eq!(
        seen.len(),
        choices.len(),
        "every choice is reachable: {seen:?}"
    );
}

#[test]
fn regex_walks_match_the_regex() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let spec = OutputConstraint::Regex(r"[a-c]{3}-[0-9]{2}".into());
    for seed in 0..30 {
        let mut c = compiler.compile(&spec, false).unwrap();
        let (text, ended) = walk(&tok, &mut c, seed, 20);
        assert!(ended, "seed {seed}: {text:?}");
        let b = text.as_bytes();
        assert_eq!(b.len(), 6, "{text:?}");
        assert!(
            b[..3].iter().all(|c| (b'a'..=b'c').contains(c)) && b[3] == b'-',
            "{text:?}"
        );
        assert!(b[4..].iter().all(u8::is_ascii_digit), "{text:?}");
    }
}

#[test]
fn json_schema_walks_parse_and_follow_the_schema() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let schema = json!({
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "sure": {"type": "boolean"},
            "count": {"type": "integer", "minimum": 0, "maximum": 99}
        },
        "required": ["answer", "sure", "count"],
        "additionalProperties": false
    });
    let spec = OutputConstraint::JsonSchema(schema);
    for seed in 0..30 {
        let mut c = compiler.compile(&spec, false).unwrap();
        let (text, ended) = walk(&tok, &mut c, seed, 200);
        assert!(ended, "seed {seed}: {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 3, "{text}");
        assert!(
            ["yes", "no"].contains(&obj["answer"].as_str().unwrap()),
            "{text}"
        );
        assert!(obj["sure"].is_boolean(), "{text}");
        assert!((0..=99).contains(&obj["count"].as_i64().unwrap()), "{text}");
        // The fixed separators: no free whitespace.
        assert!(
            text.starts_with("{\"") && !text.contains("  ") && !text.contains('\n'),
            "{text}"
        );
    }
}

#[test]
fn json_object_walks_parse_as_objects() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let mut ended_any = false;
    for seed in 0..20 {
        let mut c = compiler
            .compile(&OutputConstraint::JsonObject, false)
            .unwrap();
        let (text, ended) = walk(&tok, &mut c, seed, 60);
        assert!(text.starts_with('{'), "{text:?}");
        if ended {
            ended_any = true;
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v.is_object(), "{text}");
        }
    }
    assert!(ended_any, "some walk closes its object within 60 tokens");
}

#[test]
fn lark_grammars_compile_and_run() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let spec = OutputConstraint::Lark(
        r#"start: "sum(" NUM ("," NUM)* ")"
NUM: /[0-9]/"#
            .into(),
    );
    for seed in 0..10 {
        let mut c = compiler.compile(&spec, false).unwrap();
        let (text, _) = walk(&tok, &mut c, seed, 30);
        assert!(text.starts_with("sum("), "{text:?}");
    }
}

#[test]
fn bad_constraints_are_errors_that_say_why() {
    let compiler = GrammarCompiler::new(tokenizer());
    for spec in [
        OutputConstraint::Regex("(unclosed".into()),
        OutputConstraint::JsonSchema(json!({"type": "no-such-type"})),
        OutputConstraint::Lark("start: undefined_rule".into()),
    ] {
        let err = compiler.compile(&spec, false).unwrap_err();
        assert!(!err.is_empty(), "{spec:?}");
    }
}

#[test]
fn stop_tokens_are_allowed_only_where_the_output_may_end() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let stops = tok.eos_token_ids().to_vec();
    let mut c = compiler
        .compile(&OutputConstraint::Regex("ab?".into()), false)
        .unwrap();
    let first = allowed_ids(&c.allowed_tokens(&stops, None).unwrap());
    assert!(stops.iter().all(|s| !first.contains(s)), "{first:?}");
    let a = tok.encode("a", false).unwrap();
    assert_eq!(a.len(), 1);
    assert!(first.contains(&a[0]));
    assert!(!c.advance(a[0]).unwrap(), "`b` may still follow");
    let next = allowed_ids(&c.allowed_tokens(&stops, None).unwrap());
    assert!(
        stops.iter().all(|s| next.contains(s)),
        "every EOS id may end it: {next:?}"
    );
    // A token outside the mask breaks the grammar: an error, kept for the request's failure.
    let z = tok.encode("z", false).unwrap()[0];
    assert!(c.advance(z).is_err());
    assert!(c.error().unwrap().contains("structured output"));
}

#[test]
fn a_thinking_model_is_free_until_its_thinking_ends() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone());
    let mut c = compiler
        .compile(&OutputConstraint::Regex("x".into()), false)
        .unwrap();
    let think_end = tok.encode("q", false).unwrap()[0];
    c.starts_after = Some(think_end);
    assert!(!c.is_active());
    let other = tok.encode("z", false).unwrap()[0];
    assert!(!c.advance(other).unwrap(), "free text while thinking");
    assert!(!c.advance(think_end).unwrap());
    assert!(c.is_active());
    let x = tok.encode("x", false).unwrap()[0];
    assert_eq!(allowed_ids(&c.allowed_tokens(&[], None).unwrap()), vec![x]);
    assert!(c.advance(x).unwrap(), "the regex is complete");
}
