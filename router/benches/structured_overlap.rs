//! Decode steps of requests under a grammar, with and without overlap scheduling.
//!
//! The real engine (scheduler, grammar masks, plan encoding, late masks, ZeroMQ) drives a fake
//! rank-0 worker whose steps take exactly 10 ms: it takes a plan, "runs the forward" for 9 ms,
//! then (for rows marked `mask_late`) waits for the step's `masks` message, samples a token each
//! mask allows, and answers at 10 ms. 256 requests decode under a regex (two, one per run pair)
//! over the embedded model's tokenizer. Reported per run: decode steps per second against the worker alone (the
//! ceiling, measured in the same run), tokens each constrained request gets per step (1.0 when
//! it runs every step; it was 0.5 under overlap before late masks), and how long the worker
//! waited for late masks after its forward (the part of the router's mask work the forward did
//! not hide).
//!
//! Run: `cargo bench --bench structured_overlap [-- results.json]`.

mod fake_engine;

use std::collections::HashMap;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_engine::percentile;
use nsaserve_router::engine::{Engine, GenerateRequest};
use nsaserve_router::grammar::{GrammarCompiler, OutputConstraint};
use nsaserve_router::protocol::{
    decode_router_message, BatchPlan, Heartbeat, RouterMessage, SamplingParams, StepResult,
    WorkerMessage,
};
use nsaserve_router::tokenizer::TokenizerBundle;
use nsaserve_router::transport::Endpoints;

const REQUESTS: usize = 256;
const STEP: Duration = Duration::from_millis(10);
const FORWARD: Duration = Duration::from_millis(9);
const WARMUP_STEPS: usize = 20;
const MEASURED_STEPS: usize = 200;
/// A cheap grammar, and one whose counted repetition makes each mask cost more.
const PATTERNS: [&str; 2] = ["[a-z ]+", "[a-z ]{1,2000}"];

/// One measured decode step, as the worker saw it.
struct StepTimes {
    period: Duration,
    /// Sampled tokens over rows.
    tokens_per_request: f64,
    /// Waiting for the step's late masks after the forward (zero without late rows).
    mask_wait: Duration,
}

/// The allowed token nearest above `token` that is not a stop token (wrapping), or `token`.
fn obey(mask: Option<&[u32]>, token: i32, stops: &[i32]) -> i32 {
    let Some(words) = mask else {
        return token;
    };
    let allowed = |t: usize| words.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
    let n = words.len() * 32;
    (0..n)
        .map(|k| (token as usize + k) % n)
        .find(|&t| allowed(t) && !stops.contains(&(t as i32)))
        .or_else(|| (0..n).find(|&t| allowed(t)))
        .expect("a mask allows some token") as i32
}

fn fake_worker(endpoints: Endpoints, vocab: u32, stops: Vec<i32>, report: mpsc::Sender<StepTimes>) {
    let worker = fake_engine::WorkerSockets::connect(&endpoints, 4096, vocab);
    let (plans, send) = (&worker.plans, |m| worker.send(m));
    let mut prev: Vec<(u64, i32)> = vec![];
    let mut last_recv: Option<Instant> = None;
    let mut decode_steps = 0usize;
    loop {
        let Ok(bytes) = plans.recv_bytes(0) else {
            return;
        };
        let received = Instant::now();
        let Ok(plan) = BatchPlan::decode(&bytes) else {
            return; // shutdown
        };
        std::thread::sleep((received + FORWARD).saturating_duration_since(Instant::now()));
        let mut late = HashMap::new();
        let waited = Instant::now();
        if plan.requests.iter().any(|r| r.mask_late) {
            loop {
                let Ok(bytes) = plans.recv_bytes(0) else {
                    return;
                };
                match decode_router_message(&bytes) {
                    Ok(RouterMessage::Masks(m)) if m.step == plan.step => {
                        late.extend(m.masks);
                        break;
                    }
                    Ok(RouterMessage::Masks(_)) => continue,
                    _ => return,
                }
            }
        }
        let mask_wait = waited.elapsed();
        let mut rows = Vec::with_capacity(plan.requests.len());
        let mut sampled = Vec::with_capacity(plan.requests.len());
        for r in &plan.requests {
            let input = if r.input_prev_row >= 0 {
                prev[r.input_prev_row as usize].1
            } else {
                *r.input_ids.last().unwrap()
            };
            let mask = r
                .allowed_tokens
                .as_deref()
                .or_else(|| late.get(&r.id))
                .map(Vec::as_slice);
            let token = obey(mask, (input * 31 + r.seq_len()) % vocab as i32, &stops);
            rows.push((r.id, token));
            if r.sample {
                sampled.push((r.id, token, None));
            }
        }
        let decode = plan.requests.iter().all(|r| r.input_ids.len() == 1);
        if decode {
            decode_steps += 1;
            if let Some(recv) = last_recv.filter(|_| decode_steps > WARMUP_STEPS) {
                let times = StepTimes {
                    period: received - recv,
                    tokens_per_request: sampled.len() as f64 / REQUESTS as f64,
                    mask_wait,
                };
                if report.send(times).is_err() {
                    return;
                }
            }
        }
        prev = rows;
        std::thread::sleep((received + STEP).saturating_duration_since(Instant::now()));
        send(WorkerMessage::Result(StepResult {
            step: plan.step,
            sampled,
            ..Default::default()
        }));
        send(WorkerMessage::Heartbeat(Heartbeat {
            rank: 0,
            step: plan.step,
        }));
        last_recv = Some(received);
    }
}

struct Run {
    period_us: Vec<f64>,
    tokens_per_request: Vec<f64>,
    mask_wait_us: Vec<f64>,
}

fn run(
    overlap: bool,
    pattern: &str,
    tok: &Arc<TokenizerBundle>,
    compiler: &GrammarCompiler,
) -> Run {
    let (tx, rx) = mpsc::channel();
    let vocab = (tok.vocab_size() as u32).div_ceil(64) * 64;
    let stops = tok.eos_token_ids().to_vec();
    let worker_stops = stops.clone();
    let fake = fake_engine::start(overlap, REQUESTS, move |endpoints| {
        fake_worker(endpoints, vocab, worker_stops, tx)
    });
    let engine = &fake.engine;
    let spec = OutputConstraint::Regex(pattern.into());
    // Streams are kept: dropping one aborts its request.
    let streams: Vec<_> = (0..REQUESTS as i32)
        .map(|id| {
            let prompt = (0..32).map(|k| 6 + (id * 7919 + k * 31) % 600).collect();
            engine
                .submit(GenerateRequest {
                    prompt_ids: prompt,
                    sampling: SamplingParams {
                        temperature: 0.0,
                        ..Default::default()
                    },
                    max_new_tokens: 1_000,
                    min_new_tokens: 0,
                    stop_token_ids: stops.clone(),
                    prompt_logprobs: false,
                    allowed_tokens: None,
                    constraint: Some(compiler.compile(&spec, false).unwrap()),
                    priority: 0,
                    cache_salt: None,
                })
                .expect("admitted")
        })
        .collect();
    let mut r = Run {
        period_us: vec![],
        tokens_per_request: vec![],
        mask_wait_us: vec![],
    };
    for _ in 0..MEASURED_STEPS {
        let t = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the worker reports steps");
        r.period_us.push(t.period.as_secs_f64() * 1e6);
        r.tokens_per_request.push(t.tokens_per_request);
        r.mask_wait_us.push(t.mask_wait.as_secs_f64() * 1e6);
    }
    engine.shutdown();
    drop(rx);
    drop(streams);
    let _ = fake.worker.join();
    r
}

/// (p50, p99) of the values.
fn p50_p99(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (percentile(v, 0.5), percentile(v, 0.99))
}

fn main() {
    let json_path = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pyworker/nsaserve/embedded_model");
    let tok = Arc::new(TokenizerBundle::from_model_dir(&dir).expect("the embedded tokenizer"));
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let ceiling_steps_per_s = fake_engine::ceiling(MEASURED_STEPS, STEP);
    let mut out = vec![];
    for pattern in PATTERNS {
        for overlap in [false, true] {
            let mut r = run(overlap, pattern, &tok, &compiler);
            let steps_per_s = 1e6 / (r.period_us.iter().sum::<f64>() / r.period_us.len() as f64);
            let tokens =
                r.tokens_per_request.iter().sum::<f64>() / r.tokens_per_request.len() as f64;
            let row = serde_json::json!({
                "pattern": pattern,
                "overlap": overlap,
                "steps_per_s": steps_per_s,
                "fraction_of_ceiling": steps_per_s / ceiling_steps_per_s,
                "tokens_per_request_per_step": tokens,
                "tokens_per_request_per_s": tokens * steps_per_s,
                "step_period_p50_us": p50_p99(&mut r.period_us).0,
                "mask_wait_p50_us": p50_p99(&mut r.mask_wait_us).0,
                "mask_wait_p99_us": p50_p99(&mut r.mask_wait_us).1,
            });
            println!(
                "{pattern:<16} overlap {overlap:<5}  {steps_per_s:>6.2} steps/s ({:.4} of {ceiling_steps_per_s:.2})  {tokens:.3} tokens/request/step  late-mask wait p50 {:>6.1} us p99 {:>6.1} us",
                steps_per_s / ceiling_steps_per_s,
                row["mask_wait_p50_us"].as_f64().unwrap(),
                row["mask_wait_p99_us"].as_f64().unwrap(),
            );
            out.push(row);
        }
    }
    if let Some(path) = json_path {
        let obj = serde_json::json!({
            "requests": REQUESTS,
            "patterns": PATTERNS,
            "vocab": tok.vocab_size(),
            "worker_step_ms": STEP.as_secs_f64() * 1e3,
            "worker_forward_ms": FORWARD.as_secs_f64() * 1e3,
            "measured_steps": MEASURED_STEPS,
            "ceiling_steps_per_s": ceiling_steps_per_s,
            "runs": out,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&obj).expect("json"))
            .expect("write results");
        println!("wrote {path}");
    }
}
