//! Prometheus metrics, written by hand in the text exposition format (version 0.0.4): a few
//! counters, gauges and fixed-bucket histograms do not need a metrics framework. The HTTP
//! layer records requests and latencies; the engine loop sets the scheduler gauges.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::scheduler::RequestCounts;

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
];
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

/// An f64 kept in an AtomicU64 (bit pattern), for histogram sums.
struct AtomicF64(AtomicU64);

impl AtomicF64 {
    fn add(&self, v: f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
    }
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

struct Histogram {
    name: &'static str,
    help: &'static str,
    bounds: &'static [f64],
    /// Per-bucket counts (not cumulative); the last one is the +Inf bucket.
    counts: Vec<AtomicU64>,
    sum: AtomicF64,
}

impl Histogram {
    fn new(name: &'static str, help: &'static str, bounds: &'static [f64]) -> Histogram {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram {
            name,
            help,
            bounds,
            counts,
            sum: AtomicF64(AtomicU64::new(0f64.to_bits())),
        }
    }

    fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let bucket = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum.add(v);
    }

    fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} histogram",
            self.name, self.help, self.name
        );
        let mut cumulative = 0u64;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let _ = writeln!(out, "{}_bucket{{le=\"{le}\"}} {cumulative}", self.name);
        }
        let _ = writeln!(
            out,
            "{}_sum {}\n{}_count {cumulative}",
            self.name,
            self.sum.get(),
            self.name
        );
    }
}

/// What the scheduler reports after each step.
#[derive(Debug, Clone, Copy, Default)]
pub struct SchedulerGauges {
    /// Requests waiting to be admitted.
    pub waiting: u64,
    /// Requests admitted and not finished.
    pub running: u64,
    pub kv_pages_used: u64,
    /// Free or held only by the prefix cache (reclaimable).
    pub kv_pages_free: u64,
    pub kv_pages_total: u64,
}

pub struct Metrics {
    /// (endpoint, HTTP status) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Tool-call parser name -> outputs whose markup was malformed and passed on as content.
    parser_fallbacks: Mutex<BTreeMap<String, u64>>,
    /// Structured-output kind (json_schema, regex, ...) -> requests that asked for one.
    structured_outputs: Mutex<BTreeMap<&'static str, u64>>,
    grammar_compile: Histogram,
    ttft: Histogram,
    time_per_output_token: Histogram,
    inter_token: Histogram,
    e2e: Histogram,
    queue_time: Histogram,
    batch_size: Histogram,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    prefix_hit_tokens: AtomicU64,
    preemptions: AtomicU64,
    waiting: AtomicU64,
    running: AtomicU64,
    kv_pages_used: AtomicU64,
    kv_pages_free: AtomicU64,
    kv_pages_total: AtomicU64,
    /// Requests the engine accepted, and how they left it (across worker restarts).
    engine_requests: Mutex<RequestCounts>,
    worker_restarts: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            parser_fallbacks: Mutex::new(BTreeMap::new()),
            structured_outputs: Mutex::new(BTreeMap::new()),
            grammar_compile: Histogram::new(
                "nsaserve_grammar_compile_seconds",
                "Time to compile a request's structured-output constraint (the first one also builds the vocabulary's token trie).",
                LATENCY_BUCKETS,
            ),
            ttft: Histogram::new(
                "nsaserve_time_to_first_token_seconds",
                "Time from request arrival to its first generated token.",
                LATENCY_BUCKETS,
            ),
            time_per_output_token: Histogram::new(
                "nsaserve_time_per_output_token_seconds",
                "Per request: (end-to-end time - time to first token) / (generated tokens - 1).",
                LATENCY_BUCKETS,
            ),
            inter_token: Histogram::new(
                "nsaserve_inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
                LATENCY_BUCKETS,
            ),
            e2e: Histogram::new(
                "nsaserve_e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                E2E_BUCKETS,
            ),
            queue_time: Histogram::new(
                "nsaserve_request_queue_time_seconds",
                "Time from a request's arrival at the engine (after tokenization) to its first step.",
                E2E_BUCKETS,
            ),
            batch_size: Histogram::new(
                "nsaserve_batch_size",
                "Requests in each engine step.",
                BATCH_BUCKETS,
            ),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_pages_used: AtomicU64::new(0),
            kv_pages_free: AtomicU64::new(0),
            kv_pages_total: AtomicU64::new(0),
            engine_requests: Mutex::new(RequestCounts::default()),
            worker_restarts: AtomicU64::new(0),
        }
    }

    // --- Called by the engine loop. ---

    /// The engine's scheduler gauges and its request counts since its last report, as one
    /// update: /metrics reads both under the same lock, so a scrape that sees the engine drained
    /// (no request running, waiting or holding a page) also sees every request that left it.
    pub fn publish_engine(&self, g: SchedulerGauges, delta: RequestCounts) {
        let mut c = self.engine_requests.lock();
        c.submitted += delta.submitted;
        c.finished += delta.finished;
        c.aborted += delta.aborted;
        c.failed += delta.failed;
        self.store_gauges(g);
    }

    pub fn set_scheduler_gauges(&self, g: SchedulerGauges) {
        let _engine = self.engine_requests.lock();
        self.store_gauges(g);
    }

    fn store_gauges(&self, g: SchedulerGauges) {
        self.waiting.store(g.waiting, Ordering::Relaxed);
        self.running.store(g.running, Ordering::Relaxed);
        self.kv_pages_used.store(g.kv_pages_used, Ordering::Relaxed);
        self.kv_pages_free.store(g.kv_pages_free, Ordering::Relaxed);
        self.kv_pages_total
            .store(g.kv_pages_total, Ordering::Relaxed);
    }

    /// The worker group was restarted after a failure and serves again.
    pub fn add_worker_restart(&self) {
        self.worker_restarts.fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_batch_size(&self, requests: usize) {
        self.batch_size.observe(requests as f64);
    }

    /// One request's wait between reaching the engine and its first planned step.
    pub fn observe_queue_time(&self, seconds: f64) {
        self.queue_time.observe(seconds);
    }

    /// Prompt tokens served from the prefix cache instead of being computed.
    pub fn add_prefix_hit_tokens(&self, tokens: u64) {
        self.prefix_hit_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    pub fn add_preemptions(&self, count: u64) {
        self.preemptions.fetch_add(count, Ordering::Relaxed);
    }

    // --- Called by the HTTP layer. ---

    pub fn observe_request(&self, endpoint: &str, status: u16) {
        *self
            .requests
            .lock()
            .entry((endpoint.to_owned(), status))
            .or_insert(0) += 1;
    }

    /// Malformed markup from the model that `parser` passed on as plain content.
    pub fn add_parser_fallbacks(&self, parser: &str, count: u64) {
        if count > 0 {
            *self
                .parser_fallbacks
                .lock()
                .entry(parser.to_owned())
                .or_insert(0) += count;
        }
    }

    /// A request whose output is constrained (`kind`: json_schema, json_object, regex, choice,
    /// grammar), and how long its constraint took to compile.
    pub fn observe_structured_output(&self, kind: &'static str, compile_seconds: f64) {
        *self.structured_outputs.lock().entry(kind).or_insert(0) += 1;
        self.grammar_compile.observe(compile_seconds);
    }

    pub fn observe_time_to_first_token(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn observe_inter_token_latency(&self, seconds: f64) {
        self.inter_token.observe(seconds);
    }

    /// One finished generation: its end-to-end time, time to first token and token count.
    pub fn observe_generation(
        &self,
        e2e_seconds: f64,
        ttft_seconds: Option<f64>,
        prompt_tokens: u64,
        generated: u64,
    ) {
        self.e2e.observe(e2e_seconds);
        if let (Some(ttft), true) = (ttft_seconds, generated > 1) {
            self.time_per_output_token
                .observe((e2e_seconds - ttft) / (generated - 1) as f64);
        }
        self.prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(generated, Ordering::Relaxed);
    }

    /// The Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP nsaserve_requests_total HTTP requests by endpoint and status code.\n");
        out.push_str("# TYPE nsaserve_requests_total counter\n");
        for ((endpoint, status), count) in self.requests.lock().iter() {
            let _ = writeln!(
                out,
                "nsaserve_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {count}",
                escape_label(endpoint)
            );
        }
        out.push_str("# HELP nsaserve_parser_fallbacks_total Malformed tool-call markup from the model, returned as plain content, by parser.\n");
        out.push_str("# TYPE nsaserve_parser_fallbacks_total counter\n");
        for (parser, count) in self.parser_fallbacks.lock().iter() {
            let _ = writeln!(
                out,
                "nsaserve_parser_fallbacks_total{{parser=\"{}\"}} {count}",
                escape_label(parser)
            );
        }
        out.push_str("# HELP nsaserve_structured_output_requests_total Requests whose output is constrained, by kind of constraint.\n");
        out.push_str("# TYPE nsaserve_structured_output_requests_total counter\n");
        for (kind, count) in self.structured_outputs.lock().iter() {
            let _ = writeln!(
                out,
                "nsaserve_structured_output_requests_total{{kind=\"{kind}\"}} {count}"
            );
        }
        // The engine's counts and gauges as one snapshot (see publish_engine).
        let (engine, gauge_values) = {
            let c = self.engine_requests.lock();
            let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let values = [
                load(&self.waiting),
                load(&self.running),
                load(&self.kv_pages_used),
                load(&self.kv_pages_free),
                load(&self.kv_pages_total),
            ];
            (*c, values)
        };
        let _ = writeln!(
            out,
            "# HELP nsaserve_engine_requests_submitted_total Generations the engine accepted (one per choice).\n\
             # TYPE nsaserve_engine_requests_submitted_total counter\n\
             nsaserve_engine_requests_submitted_total {}",
            engine.submitted
        );
        out.push_str("# HELP nsaserve_engine_requests_ended_total Generations that left the engine: finished (stop or length), aborted (client gone, stop string) or failed (worker error or death).\n");
        out.push_str("# TYPE nsaserve_engine_requests_ended_total counter\n");
        for (outcome, count) in [
            ("finished", engine.finished),
            ("aborted", engine.aborted),
            ("failed", engine.failed),
        ] {
            let _ = writeln!(
                out,
                "nsaserve_engine_requests_ended_total{{outcome=\"{outcome}\"}} {count}"
            );
        }
        let counters = [
            (
                "nsaserve_worker_restarts_total",
                "Times the worker group was restarted after a failure.",
                &self.worker_restarts,
            ),
            (
                "nsaserve_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                &self.prompt_tokens,
            ),
            (
                "nsaserve_generation_tokens_total",
                "Tokens generated by finished generations.",
                &self.generation_tokens,
            ),
            (
                "nsaserve_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &self.prefix_hit_tokens,
            ),
            (
                "nsaserve_preemptions_total",
                "Running requests preempted for KV pages (they recompute, mostly from the prefix cache).",
                &self.preemptions,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        let gauges = [
            (
                "nsaserve_requests_waiting",
                "Requests waiting to be scheduled.",
            ),
            ("nsaserve_requests_running", "Requests being generated."),
            ("nsaserve_kv_pages_used", "KV cache pages in use."),
            (
                "nsaserve_kv_pages_free",
                "KV cache pages free, counting those only the prefix cache holds (reclaimable).",
            ),
            ("nsaserve_kv_pages_total", "KV cache pages in the pool."),
        ];
        for ((name, help), value) in gauges.into_iter().zip(gauge_values) {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        for h in [
            &self.ttft,
            &self.time_per_output_token,
            &self.inter_token,
            &self.e2e,
            &self.queue_time,
            &self.batch_size,
            &self.grammar_compile,
        ] {
            h.render(&mut out);
        }
        out
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_cumulative_buckets() {
        let m = Metrics::new();
        m.observe_request("/v1/completions", 200);
        m.observe_request("/v1/completions", 200);
        m.observe_request("/v1/chat/completions", 400);
        let gauges = SchedulerGauges {
            waiting: 3,
            running: 2,
            kv_pages_used: 10,
            kv_pages_free: 90,
            kv_pages_total: 100,
        };
        m.publish_engine(
            gauges,
            RequestCounts {
                submitted: 5,
                finished: 2,
                aborted: 1,
                failed: 0,
            },
        );
        m.publish_engine(
            gauges,
            RequestCounts {
                submitted: 1,
                failed: 2,
                ..Default::default()
            },
        );
        m.add_worker_restart();
        m.observe_batch_size(3);
        m.observe_batch_size(100);
        m.add_prefix_hit_tokens(64);
        m.add_preemptions(2);
        m.observe_queue_time(0.3);
        m.add_preemptions(1);
        m.observe_time_to_first_token(0.05);
        m.observe_generation(1.25, Some(0.25), 7, 11);
        m.add_parser_fallbacks("glm47", 2);
        m.add_parser_fallbacks("glm47", 1);
        m.add_parser_fallbacks("deepseekv32", 0);
        let text = m.render();
        assert!(text.contains("nsaserve_parser_fallbacks_total{parser=\"glm47\"} 3\n"));
        assert!(!text.contains("parser=\"deepseekv32\""));
        assert!(text
            .contains("nsaserve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2\n"));
        assert!(text.contains(
            "nsaserve_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n"
        ));
        assert!(text.contains("nsaserve_requests_waiting 3\n"));
        assert!(text.contains("nsaserve_kv_pages_free 90\n"));
        assert!(text.contains("nsaserve_kv_pages_total 100\n"));
        assert!(text.contains("nsaserve_engine_requests_submitted_total 6\n"));
        assert!(text.contains("nsaserve_engine_requests_ended_total{outcome=\"finished\"} 2\n"));
        assert!(text.contains("nsaserve_engine_requests_ended_total{outcome=\"aborted\"} 1\n"));
        assert!(text.contains("nsaserve_engine_requests_ended_total{outcome=\"failed\"} 2\n"));
        assert!(text.contains("nsaserve_worker_restarts_total 1\n"));
        assert!(text.contains("nsaserve_prefix_cache_hit_tokens_total 64\n"));
        assert!(text
            .contains("# TYPE nsaserve_preemptions_total counter\nnsaserve_preemptions_total 3\n"));
        assert!(text.contains("nsaserve_batch_size_bucket{le=\"2\"} 0\n"));
        assert!(text.contains("nsaserve_batch_size_bucket{le=\"4\"} 1\n"));
        assert!(text.contains("nsaserve_batch_size_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("nsaserve_batch_size_sum 103\n"));
        assert!(text.contains("nsaserve_time_to_first_token_seconds_bucket{le=\"0.06\"} 1\n"));
        assert!(text.contains("nsaserve_time_to_first_token_seconds_bucket{le=\"0.04\"} 0\n"));
        // TPOT = (1.25 - 0.25) / 10 = 0.1
        assert!(text.contains("nsaserve_time_per_output_token_seconds_bucket{le=\"0.1\"} 1\n"));
        assert!(text.contains("nsaserve_time_per_output_token_seconds_bucket{le=\"0.08\"} 0\n"));
        assert!(text.contains("nsaserve_generation_tokens_total 11\n"));
    }

    fn value(text: &str, name: &str) -> u64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("{name} missing"));
        line[name.len() + 1..].parse().unwrap()
    }

    /// A scrape never sees the engine drained (nothing running) without every request that left
    /// it: the engine publishes gauges and counts as one update, and /metrics reads them as one.
    #[test]
    fn a_scrape_sees_gauges_and_request_counts_of_the_same_update() {
        use std::sync::atomic::AtomicBool;
        let m = std::sync::Arc::new(Metrics::new());
        // The writer runs until the reader has checked enough scrapes of both states (a fixed
        // number of writes could end before a loaded machine schedules the reader at all).
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let writer = {
            let (m, stop) = (m.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // One request in, running; then out, drained.
                    let gauges = |running| SchedulerGauges {
                        running,
                        kv_pages_total: 8,
                        kv_pages_free: 8 - running,
                        kv_pages_used: running,
                        waiting: 0,
                    };
                    let submitted = RequestCounts {
                        submitted: 1,
                        ..Default::default()
                    };
                    m.publish_engine(gauges(1), submitted);
                    let finished = RequestCounts {
                        finished: 1,
                        ..Default::default()
                    };
                    m.publish_engine(gauges(0), finished);
                }
            })
        };
        let (mut drained, mut busy) = (0u32, 0u32);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while drained < 200 || busy < 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "only {drained} drained and {busy} busy scrapes in 60 s"
            );
            let text = m.render();
            let running = value(&text, "nsaserve_requests_running");
            let submitted = value(&text, "nsaserve_engine_requests_submitted_total");
            let finished = value(
                &text,
                "nsaserve_engine_requests_ended_total{outcome=\"finished\"}",
            );
            assert_eq!(submitted, finished + running, "{text}");
            if running == 0 {
                drained += 1;
            } else {
                busy += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    }
}
