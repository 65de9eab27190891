//! The ceiling for the router benchmark (bench/bench_router.py): a trivial axum server on the
//! same runtime settings that answers POST /v1/completions with a fixed completion of the same
//! shape and size as the real one, without tokenizing, scheduling or any worker.
//!
//! cargo bench --bench http_ceiling -- --port PORT --seconds SECONDS

use std::time::Duration;

use axum::routing::post;
use axum::Router;

const BODY: &str = r#"{"id":"cmpl-00000000000000000000000000000000","object":"text_completion","created":1795956906,"model":"nsaserve-zen","choices":[{"index":0,"text":" ugly.\nExplicit","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}"#;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let port = arg("--port", 30999) as u16;
    let seconds = arg("--seconds", 30);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let app = Router::new().route(
            "/v1/completions",
            post(|_body: axum::body::Bytes| async {
                ([("content-type", "application/json")], BODY)
            }),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        println!("ceiling server on 127.0.0.1:{port} for {seconds} s");
        let stop = tokio::time::sleep(Duration::from_secs(seconds));
        axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await
            .unwrap();
    });
}
