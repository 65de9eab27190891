//! Slow and hostile clients against the real accept loop (`serve_listener` on a loopback
//! port), with limits shrunk to milliseconds: slowloris headers and bodies, oversized bodies,
//! idle keep-alive connections, and a flood of idle connections beyond the cap. Also the
//! OpenAPI document's routes against the router. The engine refuses every generation: none of
//! this needs one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tower::ServiceExt;

use nsaserve_router::engine::{Engine, GenerateRequest, ModelInfo, RequestStream, SubmitError};
use nsaserve_router::http::{router, serve_listener, HttpConfig};
use nsaserve_router::metrics::Metrics;
use nsaserve_router::tokenizer::TokenizerBundle;

struct NoEngine;

impl Engine for NoEngine {
    fn submit(&self, _: GenerateRequest) -> Result<RequestStream, SubmitError> {
        Err(SubmitError::Unavailable("no engine in this test".into()))
    }
    fn healthy(&self) -> bool {
        true
    }
    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            served_model_name: "tiny".into(),
            max_context: 64,
            vocab_size: 8,
        }
    }
}

/// A word-level tokenizer of eight words: enough to load a `TokenizerBundle`.
fn tokenizer() -> Arc<TokenizerBundle> {
    let dir = tempfile::tempdir().unwrap();
    let vocab: serde_json::Map<String, Value> = ["[UNK]", "a", "b", "c", "d", "e", "f", "g"]
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    Arc::new(TokenizerBundle::from_model_dir(dir.path()).unwrap())
}

fn config() -> HttpConfig {
    HttpConfig {
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(10),
        ..HttpConfig::new("tiny")
    }
}

struct Server {
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Server {
    async fn start(cfg: HttpConfig) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_listener(
            listener,
            cfg,
            Arc::new(NoEngine),
            tokenizer(),
            Arc::new(Metrics::new()),
            async move {
                let _ = stopped.await;
            },
        ));
        Server {
            addr,
            stop: Some(stop),
            task,
        }
    }

    /// Shuts down and requires every connection to be closed within 5 s.
    async fn stop(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the server did not stop")
            .unwrap()
            .unwrap();
    }
}

/// Reads until the peer closes (or `limit` passes, which fails the test); returns what came.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    match tokio::time::timeout(limit, stream.read_to_end(&mut out)).await {
        Ok(_) => String::from_utf8_lossy(&out).into_owned(),
        Err(_) => panic!(
            "the connection was still open after {limit:?}; got {:?}",
            String::from_utf8_lossy(&out)
        ),
    }
}

/// Reads one response with a Content-Length body, leaving the connection open.
async fn read_response(stream: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk))
            .await
            .expect("no response within 5 s")
            .unwrap();
        assert!(n > 0, "closed before a whole response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        let Some(head_end) = text.find("\r\n\r\n") else {
            continue;
        };
        let length: usize = text[..head_end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap_or(0);
        if buf.len() >= head_end + 4 + length {
            let status = text[9..12].parse().unwrap();
            return (status, text[head_end + 4..head_end + 4 + length].to_owned());
        }
    }
}

const HEALTH: &str = "GET /health HTTP/1.1\r\nHost: t\r\n\r\n";

fn error_code(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    v["error"]["code"].clone()
}

#[tokio::test]
async fn slowloris_headers_are_cut_off_after_the_header_timeout() {
    let server = Server::start(HttpConfig {
        header_timeout: Duration::from_millis(300),
        ..config()
    })
    .await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let started = Instant::now();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        .await
        .unwrap();
    // A header line every 100 ms never finishes the request.
    let drip = async {
        for i in 0.. {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if stream
                .write_all(format!("X-{i}: y\r\n").as_bytes())
                .await
                .is_err()
            {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(3), drip).await;
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(2), "open for {elapsed:?}");
    server.stop().await;
}

#[tokio::test]
async fn a_slow_body_gets_408_and_the_connection_closes() {
    let server = Server::start(HttpConfig {
        body_timeout: Duration::from_millis(300),
        ..config()
    })
    .await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        .await
        .unwrap();
    let started = Instant::now();
    let response = read_until_closed(&mut stream, Duration::from_secs(3)).await;
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    assert!(
        response.contains("\"code\":\"request_timeout\""),
        "{response}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    server.stop().await;
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413_before_it_is_sent() {
    let server = Server::start(HttpConfig {
        max_body_bytes: 1000,
        ..config()
    })
    .await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
        .await
        .unwrap();
    let (status, body) = read_response(&mut stream).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(error_code(&body), "request_too_large");
    server.stop().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_closes_after_the_keep_alive_timeout() {
    let server = Server::start(HttpConfig {
        keep_alive_timeout: Duration::from_millis(300),
        ..config()
    })
    .await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    for _ in 0..3 {
        // Requests sooner than the timeout keep it open.
        stream.write_all(HEALTH.as_bytes()).await.unwrap();
        assert_eq!(read_response(&mut stream).await.0, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = Instant::now();
    assert_eq!(
        read_until_closed(&mut stream, Duration::from_secs(3)).await,
        ""
    );
    assert!(started.elapsed() >= Duration::from_millis(150));
    server.stop().await;
}

#[tokio::test]
async fn an_idle_flood_beyond_the_cap_cannot_keep_new_requests_out() {
    let cap = 16;
    let server = Server::start(HttpConfig {
        max_connections: cap,
        ..config()
    })
    .await;
    // A request in flight (its body half sent) is busy: eviction must pass it over.
    let mut busy = TcpStream::connect(server.addr).await.unwrap();
    busy.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 14\r\n\r\n{\"prompt\":",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // 400 idle connections, some with half a request head, against a cap of 16.
    let mut idle = Vec::new();
    for i in 0..400 {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        if i % 2 == 0 {
            let _ = s.write_all(b"GET /health HTTP/1.1\r\n").await;
        }
        idle.push(s);
    }
    for _ in 0..5 {
        let started = Instant::now();
        let mut fresh = TcpStream::connect(server.addr).await.unwrap();
        fresh.write_all(HEALTH.as_bytes()).await.unwrap();
        assert_eq!(read_response(&mut fresh).await.0, 200);
        assert!(started.elapsed() < Duration::from_secs(2));
    }
    // The busy connection survived the flood and finishes its request.
    busy.write_all(b"\"a\"}").await.unwrap();
    let (status, body) = read_response(&mut busy).await;
    assert_eq!(status, 503, "{body}");
    drop(idle);
    server.stop().await;
}

#[tokio::test]
async fn every_documented_operation_is_routed() {
    let app = router(
        config(),
        Arc::new(NoEngine),
        tokenizer(),
        Arc::new(Metrics::new()),
    );
    let response = app
        .clone()
        .oneshot(Request::get("/openapi.json").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let doc: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(doc["components"]["schemas"]["TokenId"]["maximum"], 7);
    let mut operations = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        // A path parameter takes a value the route answers (the served model's name).
        let uri = path.replace("{model}", "tiny");
        assert!(
            !uri.contains('{'),
            "a path parameter this test does not fill: {path}"
        );
        for method in item.as_object().unwrap().keys() {
            let request = Request::builder()
                .method(method.to_uppercase().as_str())
                .uri(uri.as_str())
                .header("content-type", "application/json")
                .body(Body::from("{}"))
                .unwrap();
            let status = app.clone().oneshot(request).await.unwrap().status();
            assert!(
                status != StatusCode::NOT_FOUND && status != StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}: {status}"
            );
            operations += 1;
        }
    }
    assert_eq!(operations, 13);
}
