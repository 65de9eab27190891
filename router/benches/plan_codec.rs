//! Benchmark: encode + send one decode plan for 1024 running requests (~2K tokens of context
//! each, 32 pages of 64) to 8 worker sockets, as the engine does every step.
//! Ceiling measured in the same run: a plain memcpy of the same number of bytes.
//!
//! cargo bench --bench plan_codec -- [--json PATH] [--history N]
//!
//! `--history N`: every request has a repetition penalty and its plan carries N tokens of history:
//! its whole history on its first sampling step (N = its context), one token on a decode step
//! after that (N = 1; the workers keep the rest since protocol version 4).

use std::time::Instant;

use nsaserve_router::protocol::{BatchPlan, PlannedRequest, SamplingParams};
use nsaserve_router::transport::{Endpoints, PlanSender};

const REQUESTS: usize = 1024;
const PAGES_PER_REQUEST: usize = 32;
const PAGE: u32 = 64;
const RANKS: u32 = 8;
const ITERS: usize = 2000;

fn decode_plan(history: usize) -> BatchPlan {
    let mut next_page = 0i32;
    let requests = (0..REQUESTS)
        .map(|i| {
            let pages: Vec<i32> = (0..PAGES_PER_REQUEST as i32)
                .map(|k| (next_page + k * 7919) % 40_000)
                .collect();
            next_page += PAGES_PER_REQUEST as i32;
            let cached_len = (PAGES_PER_REQUEST as i32 - 1) * PAGE as i32 + (i as i32 % 60);
            let slot =
                pages[(cached_len / PAGE as i32) as usize] * PAGE as i32 + cached_len % PAGE as i32;
            PlannedRequest {
                id: i as u64,
                input_ids: vec![(i * 31 % 150_000) as i32],
                cached_len,
                pages,
                out_slots: vec![slot],
                sample: true,
                prompt_logprobs: false,
                next_prompt_token: -1,
                input_prev_row: -1,
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_p: 0.95,
                    repetition_penalty: if history > 0 { 1.1 } else { 1.0 },
                    ..Default::default()
                },
                history: (0..history as i32)
                    .map(|t| (t * 7 + i as i32) % 150_000)
                    .collect(),
                history_prompt_len: (history / 2) as i32,
                // The whole history, as on a request's first sampling step; later plans carry
                // only the tokens since (one a decode step).
                history_reset: history > 0,
                allowed_tokens: None,
                mask_late: false,
            }
        })
        .collect();
    BatchPlan {
        step: 1,
        page_size: PAGE,
        requests,
        released: Vec::new(),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn time_us(mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..50 {
        f();
    }
    let mut samples: Vec<f64> = (0..ITERS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn main() {
    let arg = |name: &str| std::env::args().skip_while(|a| a != name).nth(1);
    let json_path = arg("--json");
    let history: usize = arg("--history").map_or(0, |n| n.parse().expect("--history N"));
    let plan = decode_plan(history);
    let bytes = plan.encode().unwrap();

    let (encode_p50, encode_p99) = time_us(|| {
        std::hint::black_box(plan.encode().unwrap());
    });

    let dir = std::env::temp_dir().join(format!("nsaserve-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let endpoints = Endpoints::Ipc {
        dir: dir.display().to_string(),
    };
    let ctx = zmq::Context::new();
    let sender = PlanSender::bind(&ctx, &endpoints, RANKS).unwrap();
    let receivers: Vec<_> = (0..RANKS)
        .map(|r| {
            let s = ctx.socket(zmq::PULL).unwrap();
            s.connect(&endpoints.plans(r)).unwrap();
            std::thread::spawn(move || {
                let mut n = 0usize;
                while let Ok(msg) = s.recv_bytes(0) {
                    if msg.is_empty() {
                        break;
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let (send_p50, send_p99) = time_us(|| {
        let b = plan.encode().unwrap();
        sender.broadcast(&b).unwrap();
    });
    sender.broadcast(&[]).unwrap();
    for r in receivers {
        r.join().unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);

    let mut dst = vec![0u8; bytes.len()];
    let (memcpy_p50, _) = time_us(|| {
        dst.copy_from_slice(std::hint::black_box(&bytes));
        std::hint::black_box(&dst);
    });

    let report = serde_json::json!({
        "benchmark": "plan_codec",
        "requests": REQUESTS,
        "pages_per_request": PAGES_PER_REQUEST,
        "history_tokens_per_request": history,
        "ranks": RANKS,
        "plan_bytes": bytes.len(),
        "iterations": ITERS,
        "encode_us": {"p50": encode_p50, "p99": encode_p99},
        "encode_and_send_to_all_ranks_us": {"p50": send_p50, "p99": send_p99},
        "ceiling_memcpy_same_bytes_us": {"p50": memcpy_p50},
        "encode_p50_over_memcpy": encode_p50 / memcpy_p50,
        "target_encode_and_send_p50_us": 100.0,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    if let Some(path) = json_path {
        std::fs::write(path, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    }
}
