//! How long the router leaves the GPU idle per step, with and without overlap scheduling.
//!
//! The real engine (scheduler, plan encoding, ZeroMQ sockets, result handling) drives a fake
//! rank-0 worker that takes exactly 10 ms per step (decoding the plan, filling in overlap
//! references, then sleeping out the rest) at 1024 running decode requests with ~2K-token
//! contexts (~32 pages of 64 each). The worker timestamps every step: GPU idle for step N+1 is
//! the time from sending step N's result to receiving plan N+1. The ceiling, measured in the
//! same run, is the worker alone: its 10 ms steps back to back with no router (sleep overshoot
//! included, so it is a little under 100 steps/s on a loaded machine).
//!
//! Run: `cargo bench --bench overlap [-- results.json]`; with a path, the numbers are also
//! written there as JSON.

mod fake_engine;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use fake_engine::percentile;
use nsaserve_router::engine::{Engine, GenerateRequest};
use nsaserve_router::protocol::{BatchPlan, Heartbeat, SamplingParams, StepResult, WorkerMessage};
use nsaserve_router::transport::Endpoints;

const REQUESTS: usize = 1024;
const PROMPT: usize = 1700;
const STEP: Duration = Duration::from_millis(10);
const WARMUP_DECODE_STEPS: usize = 20;
const MEASURED_STEPS: usize = 500;

/// Per measured decode step, as the worker saw it.
struct StepTimes {
    /// Result of the previous step sent -> this plan received.
    idle: Duration,
    /// Plan of the previous step received -> this plan received.
    period: Duration,
}

/// A rank-0 worker that answers every plan after exactly `STEP`, resolving references from
/// the tokens it sampled in the previous step. Sends the decode-step timings on `report`.
fn fake_worker(endpoints: Endpoints, report: mpsc::Sender<StepTimes>) {
    // Room to decode through warm-up and measured steps without preempting anyone.
    let num_pages = (REQUESTS * (PROMPT + 2 * MEASURED_STEPS)).div_ceil(64) as u32;
    let worker = fake_engine::WorkerSockets::connect(&endpoints, num_pages, 50_000);
    let (plans, send) = (&worker.plans, |m| worker.send(m));
    let mut prev: Vec<(u64, i32)> = vec![];
    let (mut last_sent, mut last_recv): (Option<Instant>, Option<Instant>) = (None, None);
    let mut decode_steps = 0usize;
    loop {
        let Ok(bytes) = plans.recv_bytes(0) else {
            return;
        };
        let received = Instant::now();
        let Ok(plan) = BatchPlan::decode(&bytes) else {
            return; // shutdown
        };
        if std::env::var_os("OVERLAP_BENCH_TRACE").is_some() {
            let refs = plan
                .requests
                .iter()
                .filter(|r| r.input_prev_row >= 0)
                .count();
            eprintln!(
                "step {} requests {} tokens {} refs {refs}",
                plan.step,
                plan.requests.len(),
                plan.num_tokens()
            );
        }
        let all_decode =
            plan.requests.len() == REQUESTS && plan.requests.iter().all(|r| r.input_ids.len() == 1);
        if all_decode {
            decode_steps += 1;
            if decode_steps > WARMUP_DECODE_STEPS {
                if let (Some(sent), Some(recv)) = (last_sent, last_recv) {
                    let times = StepTimes {
                        idle: received - sent,
                        period: received - recv,
                    };
                    if report.send(times).is_err() {
                        return;
                    }
                }
            }
        }
        let mut rows = Vec::with_capacity(plan.requests.len());
        let mut sampled = Vec::with_capacity(plan.requests.len());
        for r in &plan.requests {
            let input = if r.input_prev_row >= 0 {
                let (id, t) = prev[r.input_prev_row as usize];
                assert_eq!(id, r.id, "a reference to another request's row");
                t
            } else {
                *r.input_ids.last().unwrap()
            };
            let token = (input * 31 + r.seq_len()) % 50_000;
            rows.push((r.id, token));
            if r.sample {
                sampled.push((r.id, token, None));
            }
        }
        prev = rows;
        let done = received + STEP;
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
        send(WorkerMessage::Result(StepResult {
            step: plan.step,
            sampled,
            ..Default::default()
        }));
        send(WorkerMessage::Heartbeat(Heartbeat {
            rank: 0,
            step: plan.step,
        }));
        last_sent = Some(Instant::now());
        last_recv = Some(received);
    }
}

struct Run {
    overlap: bool,
    idle_us: Vec<f64>,
    period_us: Vec<f64>,
}

fn run(overlap: bool) -> Run {
    eprintln!("overlap {overlap}: prefilling {REQUESTS} requests");
    let (tx, rx) = mpsc::channel();
    let fake = fake_engine::start(overlap, REQUESTS, move |endpoints| {
        fake_worker(endpoints, tx)
    });
    let engine = &fake.engine;
    // Streams are kept: dropping one aborts its request.
    let streams: Vec<_> = (0..REQUESTS as i32)
        .map(|id| {
            let prompt = (0..PROMPT as i32)
                .map(|k| (id * 7919 + k * 31) % 50_000)
                .collect();
            engine
                .submit(GenerateRequest {
                    prompt_ids: prompt,
                    sampling: SamplingParams {
                        temperature: 0.0,
                        ..Default::default()
                    },
                    max_new_tokens: 10_000,
                    min_new_tokens: 0,
                    stop_token_ids: vec![],
                    prompt_logprobs: false,
                    allowed_tokens: None,
                    constraint: None,
                    priority: 0,
                    cache_salt: None,
                })
                .expect("admitted")
        })
        .collect();
    let (mut idle_us, mut period_us) = (vec![], vec![]);
    for _ in 0..MEASURED_STEPS {
        let t = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the worker reports steps");
        idle_us.push(t.idle.as_secs_f64() * 1e6);
        period_us.push(t.period.as_secs_f64() * 1e6);
    }
    engine.shutdown();
    drop(rx);
    drop(streams);
    let _ = fake.worker.join();
    Run {
        overlap,
        idle_us,
        period_us,
    }
}

fn main() {
    let json_path = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let ceiling_steps_per_s = fake_engine::ceiling(MEASURED_STEPS, STEP);
    let mut out = vec![];
    for overlap in [false, true] {
        let mut r = run(overlap);
        r.idle_us.sort_by(|a, b| a.total_cmp(b));
        let mean_period = r.period_us.iter().sum::<f64>() / r.period_us.len() as f64;
        let steps_per_s = 1e6 / mean_period;
        let row = serde_json::json!({
            "overlap": r.overlap,
            "idle_p50_us": percentile(&r.idle_us, 0.5),
            "idle_p99_us": percentile(&r.idle_us, 0.99),
            "idle_mean_us": r.idle_us.iter().sum::<f64>() / r.idle_us.len() as f64,
            "idle_max_us": r.idle_us[r.idle_us.len() - 1],
            "steps_per_s": steps_per_s,
            "fraction_of_ceiling": steps_per_s / ceiling_steps_per_s,
        });
        println!(
            "overlap {:<5}  GPU idle per step p50 {:>8.1} us  p99 {:>8.1} us  |  {:>6.2} steps/s = {:.4} of the {:.2} steps/s ceiling",
            r.overlap,
            row["idle_p50_us"].as_f64().unwrap(),
            row["idle_p99_us"].as_f64().unwrap(),
            steps_per_s,
            steps_per_s / ceiling_steps_per_s,
            ceiling_steps_per_s
        );
        out.push(row);
    }
    if let Some(path) = json_path {
        let obj = serde_json::json!({
            "requests": REQUESTS,
            "prompt_tokens": PROMPT,
            "page_size": 64,
            "worker_step_ms": STEP.as_secs_f64() * 1e3,
            "measured_steps": MEASURED_STEPS,
            "ceiling_steps_per_s": ceiling_steps_per_s,
            "runs": out,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&obj).expect("json"))
            .expect("write results");
        println!("wrote {path}");
    }
}
