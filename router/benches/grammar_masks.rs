//! Cost of structured outputs on the router: compiling a constraint, one allowed-token mask,
//! and a whole decode step's planning with every row under a grammar, at GLM-5's vocabulary
//! size (154,880 ids). The vocabulary is synthetic (the 256 byte tokens, chat specials, and
//! seeded random English-like words, numbers, punctuation and JSON fragments), since no real
//! tokenizer ships with the repo; the trie walk a mask costs depends on the vocabulary's size
//! and shape, so the numbers are indicative, not GLM-5's own.
//!
//! The baseline is the same step without grammars, measured in the same run: the difference is
//! what structured outputs add to the router's planning of a step (masks are computed in
//! parallel over the machine's threads).
//!
//! Run: `cargo bench --bench grammar_masks [-- results.json]`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use nsaserve_router::engine::GenerateRequest;
use nsaserve_router::grammar::{GrammarCompiler, OutputConstraint, TokenConstraint};
use nsaserve_router::protocol::{BatchPlan, SamplingParams, StepResult};
use nsaserve_router::scheduler::{Scheduler, SchedulerConfig};
use nsaserve_router::tokenizer::{byte_level_chars, TokenizerBundle};

const VOCAB: usize = 154_880;
const SPECIALS: [&str; 6] = [
    "<|endoftext|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<think>",
    "</think>",
];

/// A random token's text: mostly words (with a leading space half the time), some numbers,
/// punctuation runs and JSON-ish fragments.
fn random_token(rng: &mut StdRng) -> String {
    const LETTERS: &[u8] = b"etaoinshrdlcumwfgypbvkjxqz";
    const PUNCT: &[&str] = &[
        "\"", ",", ":", "{", "}", "[", "]", "\":", "\",", "{\"", "\"}", "},", "],", "\n", "  ",
        ".", "-", "_", "(", ")", "'", "!", "?", ";", "/", "\\n",
    ];
    match rng.random_range(0..10) {
        0..=6 => {
            let len = rng.random_range(2..10);
            let mut w: String = (0..len)
                .map(|_| {
                    LETTERS[rng
                        .random_range(0..LETTERS.len())
                        .min(rng.random_range(0..LETTERS.len()))] as char
                })
                .collect();
            if rng.random_bool(0.15) {
                w[..1].make_ascii_uppercase();
            }
            if rng.random_bool(0.5) {
                w.insert(0, ' ');
            }
            w
        }
        7 => {
            let n = rng.random_range(0..1000);
            if rng.random_bool(0.5) {
                format!(" {n}")
            } else {
                n.to_string()
            }
        }
        _ => (0..rng.random_range(1..4))
            .map(|_| PUNCT[rng.random_range(0..PUNCT.len())])
            .collect(),
    }
}

/// A byte-level BPE tokenizer.json (vocabulary only: masks need no merges) in `dir`.
fn write_tokenizer(dir: &std::path::Path) {
    let chars = byte_level_chars();
    let spell = |s: &str| -> String { s.bytes().map(|b| chars[b as usize]).collect() };
    let mut vocab = serde_json::Map::new();
    let mut seen = HashSet::new();
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
        seen.insert(c.to_string());
    }
    let first_special = 256;
    let mut rng = StdRng::seed_from_u64(5);
    let mut id = first_special + SPECIALS.len();
    while id < VOCAB {
        let t = spell(&random_token(&mut rng));
        if seen.insert(t.clone()) {
            vocab.insert(t, json!(id));
            id += 1;
        }
    }
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(k, s)| json!({"id": first_special + k, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"eos_token": "<|endoftext|>"}).to_string(),
    )
    .unwrap();
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn p50_p90(mut us: Vec<f64>) -> (f64, f64) {
    us.sort_by(f64::total_cmp);
    (percentile(&us, 0.5), percentile(&us, 0.9))
}

fn allowed_ids(words: &[u32]) -> Vec<i32> {
    (0..words.len() * 32)
        .filter(|&t| words[t / 32] >> (t % 32) & 1 == 1)
        .map(|t| t as i32)
        .collect()
}

/// Masks along random walks (each step picks a random allowed token), single-threaded: µs.
fn mask_times(c: &TokenConstraint, stops: &[i32], walks: u64, steps: usize) -> Vec<f64> {
    let mut us = Vec::new();
    for seed in 0..walks {
        let mut c = c.clone();
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..steps {
            let t0 = Instant::now();
            let words = c.allowed_tokens(stops, None).expect("a mask");
            us.push(t0.elapsed().as_secs_f64() * 1e6);
            let allowed = allowed_ids(&words);
            let t = allowed[rng.random_range(0..allowed.len())];
            if stops.contains(&t) || c.advance(t).expect("fits") {
                break;
            }
        }
    }
    us
}

/// A token each row's mask allows, at random, as a sampler would; never the stop token nor one
/// in `closing` (so that a JSON object never closes and the batch stays whole).
fn result_for(plan: &BatchPlan, rng: &mut StdRng, closing: &HashSet<i32>) -> StepResult {
    let sampled = plan
        .requests
        .iter()
        .filter(|r| r.sample)
        .map(|r| {
            let t = match &r.allowed_tokens {
                Some(words) => {
                    let ids: Vec<i32> = allowed_ids(words)
                        .into_iter()
                        .filter(|&t| t != 256 && !closing.contains(&t))
                        .collect();
                    ids[rng.random_range(0..ids.len())]
                }
                None => 1000 + rng.random_range(0..1000),
            };
            (r.id, t, None)
        })
        .collect();
    StepResult {
        step: plan.step,
        sampled,
        ..Default::default()
    }
}

/// p50/p90 µs of `Scheduler::schedule` over decode steps of `batch` requests, all under
/// `constraint` or none.
fn schedule_times(
    batch: usize,
    constraint: Option<&TokenConstraint>,
    closing: &HashSet<i32>,
) -> (f64, f64) {
    let cfg = SchedulerConfig {
        page_size: 64,
        num_pages: (batch * 40) as u32,
        max_running_requests: batch,
        max_prefill_tokens: 1 << 20,
        chunked_prefill_size: None,
        disable_radix_cache: true,
        max_context: 16_384,
        max_waiting: batch,
        priority: None,
    };
    let mut sched = Scheduler::new(cfg);
    for id in 0..batch as u64 {
        let req = GenerateRequest {
            prompt_ids: (0..1000)
                .map(|k| 1000 + ((id as i32 * 31 + k) % 5000))
                .collect(),
            sampling: SamplingParams::default(),
            max_new_tokens: 1000,
            min_new_tokens: 0,
            stop_token_ids: vec![256],
            prompt_logprobs: false,
            allowed_tokens: None,
            constraint: constraint.cloned(),
            priority: 0,
            cache_salt: None,
        };
        sched.submit(id, req).unwrap();
    }
    let mut rng = StdRng::seed_from_u64(1);
    let mut us = Vec::new();
    for step in 0..60u64 {
        let t0 = Instant::now();
        let plan = sched.schedule(step).expect("work");
        let t = t0.elapsed().as_secs_f64() * 1e6;
        if step >= 10 {
            assert_eq!(plan.requests.len(), batch);
            us.push(t);
        }
        sched.on_result(&plan, &result_for(&plan, &mut rng, closing));
    }
    p50_p90(us)
}

fn main() {
    let json_path = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path());
    let tok = Arc::new(TokenizerBundle::from_model_dir(dir.path()).unwrap());
    assert_eq!(tok.vocab_size(), VOCAB);
    let stops = tok.eos_token_ids().to_vec();
    let compiler = GrammarCompiler::new(Arc::clone(&tok));

    let t0 = Instant::now();
    compiler
        .compile(&OutputConstraint::JsonObject, false)
        .unwrap();
    let first_ms = t0.elapsed().as_secs_f64() * 1e3;
    println!(
        "grammar_masks: vocabulary {VOCAB}, {} threads",
        rayon::current_num_threads()
    );
    println!("  first compile (builds the token trie): {first_ms:.0} ms");

    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "kind": {"enum": ["person", "org"]}
        },
        "required": ["name", "age", "tags", "kind"],
        "additionalProperties": false
    });
    let cases = [
        ("json_schema", OutputConstraint::JsonSchema(schema)),
        ("json_object", OutputConstraint::JsonObject),
        (
            "regex",
            OutputConstraint::Regex(r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,3}".into()),
        ),
        (
            "choice",
            OutputConstraint::Choice(vec!["positive".into(), "negative".into(), "neutral".into()]),
        ),
    ];
    let mut out = serde_json::Map::new();
    out.insert("vocab".into(), VOCAB.into());
    out.insert("threads".into(), rayon::current_num_threads().into());
    out.insert("first_compile_ms".into(), first_ms.into());
    let mut compiled = Vec::new();
    for (name, spec) in &cases {
        let t0 = Instant::now();
        let c = compiler.compile(spec, false).unwrap();
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (p50, p90) = p50_p90(mask_times(&c, &stops, 20, 60));
        println!(
            "  {name:<12} compile {compile_ms:>7.2} ms   mask p50 {p50:>7.1} us  p90 {p90:>7.1} us"
        );
        out.insert(
            name.to_string(),
            json!({"compile_ms": compile_ms, "mask_p50_us": p50, "mask_p90_us": p90}),
        );
        compiled.push((*name, c));
    }
    let json_object = &compiled[1].1;
    let closing: HashSet<i32> = (0..VOCAB as i32)
        .filter(|&t| tok.token_bytes(t).contains(&b'}'))
        .collect();
    for batch in [1usize, 64, 256] {
        let (plain50, plain90) = schedule_times(batch, None, &closing);
        let (g50, g90) = schedule_times(batch, Some(json_object), &closing);
        println!(
            "  schedule, {batch:>3} decode rows: plain p50 {plain50:>8.1} us  json_object p50 {g50:>8.1} us (p90 {g90:.1}, plain p90 {plain90:.1})  +{:.2} us a row",
            (g50 - plain50) / batch as f64
        );
        out.insert(
            format!("schedule_{batch}"),
            json!({"plain_p50_us": plain50, "plain_p90_us": plain90, "json_object_p50_us": g50, "json_object_p90_us": g90, "added_us_per_row_p50": (g50 - plain50) / batch as f64}),
        );
    }
    if let Some(path) = json_path {
        std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap()).unwrap();
        println!("wrote {path}");
    }
}
