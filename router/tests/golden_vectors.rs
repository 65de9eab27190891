//! The golden protocol vectors in tests/golden/ (written by make_golden.py): for each message,
//! build it from its JSON description, encode it and require the exact bytes, and decode the
//! bytes back to the same message. pytest runs the same checks from Python.

use std::path::PathBuf;
use std::sync::Arc;

use nsaserve_router::protocol::{
    decode_router_message, decode_worker_message, encode_router_message, encode_worker_message,
    BatchPlan, Fatal, Heartbeat, Hello, LateMasks, PlannedRequest, PromptLogprobs, RouterMessage,
    SamplingParams, StepResult, TokenLogprobs, WorkerMessage,
};
use serde_json::Value;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden")
}

fn load(name: &str) -> (Value, Vec<u8>) {
    let dir = golden_dir();
    let json = std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("golden json");
    let bytes = std::fs::read(dir.join(format!("{name}.msgpack"))).expect("golden msgpack");
    (serde_json::from_str(&json).unwrap(), bytes)
}

fn ints<T: TryFrom<i64>>(v: &Value) -> Vec<T>
where
    T::Error: std::fmt::Debug,
{
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| T::try_from(x.as_i64().unwrap()).unwrap())
        .collect()
}

fn f32_of(v: &Value) -> f32 {
    v.as_f64().unwrap() as f32
}

fn plan_from_json(c: &Value) -> BatchPlan {
    let requests = c["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            let s = &q["sampling"];
            PlannedRequest {
                id: q["id"].as_u64().unwrap(),
                input_ids: ints(&q["input_ids"]),
                cached_len: q["cached_len"].as_i64().unwrap() as i32,
                pages: ints(&q["pages"]),
                out_slots: ints(&q["out_slots"]),
                sample: q["sample"].as_bool().unwrap(),
                prompt_logprobs: q["prompt_logprobs"].as_bool().unwrap(),
                next_prompt_token: q["next_prompt_token"].as_i64().unwrap() as i32,
                input_prev_row: q["input_prev_row"].as_i64().unwrap() as i32,
                sampling: SamplingParams {
                    temperature: f32_of(&s["temperature"]),
                    top_p: f32_of(&s["top_p"]),
                    top_k: s["top_k"].as_i64().unwrap() as i32,
                    min_p: f32_of(&s["min_p"]),
                    repetition_penalty: f32_of(&s["repetition_penalty"]),
                    frequency_penalty: f32_of(&s["frequency_penalty"]),
                    presence_penalty: f32_of(&s["presence_penalty"]),
                    seed: s["seed"].as_u64(),
                    top_logprobs: s["top_logprobs"].as_u64().map(|n| n as u32),
                    logit_bias: s["logit_bias"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| (p[0].as_i64().unwrap() as i32, f32_of(&p[1])))
                        .collect(),
                },
                history: ints(&q["history"]),
                history_prompt_len: q["history_prompt_len"].as_i64().unwrap() as i32,
                history_reset: q["history_reset"].as_bool().unwrap(),
                allowed_tokens: q["allowed_tokens"].as_array().map(|words| {
                    Arc::new(words.iter().map(|w| w.as_u64().unwrap() as u32).collect())
                }),
                mask_late: q["mask_late"].as_bool().unwrap(),
            }
        })
        .collect();
    BatchPlan {
        step: c["step"].as_u64().unwrap(),
        page_size: c["page_size"].as_u64().unwrap() as u32,
        requests,
        released: c["released"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect(),
    }
}

fn top_of(v: &Value) -> Vec<(i32, f32)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_i64().unwrap() as i32, f32_of(&p[1])))
        .collect()
}

fn result_from_json(c: &Value) -> StepResult {
    StepResult {
        step: c["step"].as_u64().unwrap(),
        sampled: c["sampled"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let lp = s["logprob"].as_f64().map(|lp| TokenLogprobs {
                    logprob: lp as f32,
                    top: top_of(&s["top"]),
                });
                (
                    s["req_id"].as_u64().unwrap(),
                    s["token"].as_i64().unwrap() as i32,
                    lp,
                )
            })
            .collect(),
        prompt_logprobs: c["prompt_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| PromptLogprobs {
                req_id: p["req_id"].as_u64().unwrap(),
                first_pos: p["first_pos"].as_i64().unwrap() as i32,
                tokens: ints(&p["tokens"]),
                entries: p["entries"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| TokenLogprobs {
                        logprob: f32_of(&e[0]),
                        top: top_of(&e[1]),
                    })
                    .collect(),
            })
            .collect(),
        errors: c["errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap(), e[1].as_str().unwrap().to_string()))
            .collect(),
        forward_ms: c["forward_ms"].as_f64().unwrap(),
    }
}

fn worker_message_from_json(c: &Value) -> WorkerMessage {
    let c2 = c.clone();
    match c["kind"].as_str().unwrap() {
        "result" => WorkerMessage::Result(result_from_json(c)),
        "hello" => WorkerMessage::Hello(serde_json::from_value::<Hello>(c2).unwrap()),
        "heartbeat" => WorkerMessage::Heartbeat(serde_json::from_value::<Heartbeat>(c2).unwrap()),
        "fatal" => WorkerMessage::Fatal(serde_json::from_value::<Fatal>(c2).unwrap()),
        k => panic!("not a worker message: {k}"),
    }
}

#[test]
fn plans_encode_to_the_golden_bytes_and_decode_back() {
    for name in ["plan_idle", "plan_decode", "plan_mixed"] {
        let (json, bytes) = load(name);
        let plan = plan_from_json(&json);
        plan.validate(None)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            plan.encode().unwrap(),
            bytes,
            "{name}: encoder drifted from the golden bytes"
        );
        assert_eq!(
            BatchPlan::decode(&bytes).unwrap(),
            plan,
            "{name}: decoder drifted"
        );
    }
}

#[test]
fn worker_messages_encode_to_the_golden_bytes_and_decode_back() {
    for name in ["result", "result_empty", "hello", "heartbeat", "fatal"] {
        let (json, bytes) = load(name);
        let msg = worker_message_from_json(&json);
        assert_eq!(
            encode_worker_message(&msg).unwrap(),
            bytes,
            "{name}: encoder drifted from the golden bytes"
        );
        assert_eq!(
            decode_worker_message(&bytes).unwrap(),
            msg,
            "{name}: decoder drifted"
        );
    }
}

#[test]
fn router_messages_encode_to_the_golden_bytes_and_decode_back() {
    let (_, bytes) = load("shutdown");
    assert_eq!(
        encode_router_message(&RouterMessage::Shutdown).unwrap(),
        bytes
    );
    assert_eq!(
        decode_router_message(&bytes).unwrap(),
        RouterMessage::Shutdown
    );
    let (json, bytes) = load("masks");
    let masks = RouterMessage::Masks(LateMasks {
        step: json["step"].as_u64().unwrap(),
        masks: json["masks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m[0].as_u64().unwrap(), ints(&m[1])))
            .collect(),
    });
    assert_eq!(encode_router_message(&masks).unwrap(), bytes);
    assert_eq!(decode_router_message(&bytes).unwrap(), masks);
}

#[test]
fn the_mixed_plan_has_every_field_even_without_a_cached_prefix() {
    // A fresh prefill (cached_len 0) in the same batch as cached ones: cached_lens and the
    // page table are still full arrays, never absent.
    let (_, bytes) = load("plan_mixed");
    let map: rmpv::Value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let keys: Vec<String> = map
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap().to_string())
        .collect();
    for required in [
        "cached_lens",
        "page_table",
        "page_start",
        "out_slots",
        "query_start",
        "positions",
        "mode",
    ] {
        assert!(keys.iter().any(|k| k == required), "missing {required}");
    }
}
