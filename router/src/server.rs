//! The whole router as `serve` runs it: configuration, the engine thread and the HTTP server on
//! a tokio runtime of its own.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use serde::Deserialize;
use tokio::sync::oneshot;

use crate::engine::{EngineHandle, EngineLimits, Startup, WorkersInfo};
use crate::http::{serve_listener, HttpConfig, SamplingDefaults, SamplingDefaultsSource};
use crate::metrics::Metrics;
use crate::parsers::{ReasoningParserKind, ToolParserKind};
use crate::scheduler::PriorityPolicy;
use crate::tokenizer::TokenizerBundle;
use crate::transport::Endpoints;

/// What `nsaserve serve` passes in (as JSON), flag for flag.
#[derive(Debug, Clone, Deserialize)]
pub struct RouterConfig {
    pub tp: u32,
    pub endpoints: EndpointsConfig,
    pub model_path: PathBuf,
    pub served_model_name: String,
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_running_requests: usize,
    pub max_queued_requests: usize,
    pub max_prefill_tokens: usize,
    pub chunked_prefill_size: Option<usize>,
    pub disable_radix_cache: bool,
    pub heartbeat_timeout_s: f64,
    /// `--disable-overlap-schedule`: plan each step only after the previous one's result.
    #[serde(default)]
    pub disable_overlap_schedule: bool,
    pub log_level: String,
    /// `--reasoning-parser` (SGLang's names); absent or null: thinking stays in `content`.
    #[serde(default)]
    pub reasoning_parser: Option<ReasoningParserKind>,
    /// `--tool-call-parser` (SGLang's names); absent or null: no `tool_calls` are parsed.
    #[serde(default)]
    pub tool_call_parser: Option<ToolParserKind>,
    /// Limits on clients (`--max-request-bytes`, `--max-connections`, the three timeouts);
    /// absent: the defaults of `HttpConfig::new`.
    #[serde(default)]
    pub max_request_bytes: Option<usize>,
    #[serde(default)]
    pub max_connections: Option<usize>,
    #[serde(default)]
    pub header_timeout_s: Option<f64>,
    #[serde(default)]
    pub body_timeout_s: Option<f64>,
    #[serde(default)]
    pub keep_alive_timeout_s: Option<f64>,
    /// `--context-length`: prompt plus completion at most (below the model's own limit).
    #[serde(default)]
    pub context_length: Option<u32>,
    /// `--enable-dp-attention`: attention is data parallel over the `tp` ranks, each with its
    /// own KV pool; the router keeps one scheduler per rank.
    #[serde(default)]
    pub enable_dp_attention: bool,
    /// `--sampling-defaults`: what omitted sampling fields of a request take; absent: `model`
    /// (the model's `generation_config.json`, as vLLM and SGLang do).
    #[serde(default)]
    pub sampling_defaults: SamplingDefaultsSource,
    /// `--enable-priority-scheduling`: requests' `priority` orders admission and preemption.
    #[serde(default)]
    pub enable_priority_scheduling: bool,
    /// `--schedule-low-priority-values-first`: smaller `priority` values go first.
    #[serde(default)]
    pub schedule_low_priority_values_first: bool,
    /// `--priority-scheduling-preemption-threshold`: how much more urgent a waiting request must
    /// be to preempt a running one.
    #[serde(default = "default_preemption_threshold")]
    pub priority_scheduling_preemption_threshold: u32,
}

/// SGLang's default for `--priority-scheduling-preemption-threshold`.
fn default_preemption_threshold() -> u32 {
    10
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum EndpointsConfig {
    Ipc {
        ipc_dir: String,
    },
    Tcp {
        tcp_host: String,
        tcp_base_port: u16,
    },
}

impl RouterConfig {
    pub fn endpoints(&self) -> Endpoints {
        match &self.endpoints {
            EndpointsConfig::Ipc { ipc_dir } => Endpoints::Ipc {
                dir: ipc_dir.clone(),
            },
            EndpointsConfig::Tcp {
                tcp_host,
                tcp_base_port,
            } => Endpoints::Tcp {
                host: tcp_host.clone(),
                base_port: *tcp_base_port,
            },
        }
    }

    /// The defaults `--sampling-defaults` asks for; an invalid value in the model's
    /// `generation_config.json` is an error naming the file and the key.
    pub fn sampling_defaults(&self) -> Result<SamplingDefaults> {
        SamplingDefaults::load(&self.model_path, self.sampling_defaults)
    }

    fn http_config(&self) -> Result<HttpConfig> {
        let defaults = HttpConfig::new(self.served_model_name.clone());
        let seconds = |name: &str, value: Option<f64>, default: Duration| match value {
            None => Ok(default),
            Some(s) => Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| format!("{name} must be a positive number of seconds, got {s}")),
        };
        let sampling_defaults = self.sampling_defaults()?;
        tracing::info!(
            "sampling defaults for fields a request omits ({}): {sampling_defaults}",
            match self.sampling_defaults {
                SamplingDefaultsSource::Model => "--sampling-defaults model",
                SamplingDefaultsSource::Openai => "--sampling-defaults openai",
            }
        );
        Ok(HttpConfig {
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key.clone(),
            reasoning_parser: self.reasoning_parser,
            tool_call_parser: self.tool_call_parser,
            context_length: self.context_length,
            sampling_defaults,
            max_body_bytes: self.max_request_bytes.unwrap_or(defaults.max_body_bytes),
            max_connections: self.max_connections.unwrap_or(defaults.max_connections),
            header_timeout: seconds(
                "--header-timeout",
                self.header_timeout_s,
                defaults.header_timeout,
            )?,
            body_timeout: seconds("--body-timeout", self.body_timeout_s, defaults.body_timeout)?,
            keep_alive_timeout: seconds(
                "--keep-alive-timeout",
                self.keep_alive_timeout_s,
                defaults.keep_alive_timeout,
            )?,
            ..defaults
        })
    }

    fn limits(&self) -> EngineLimits {
        EngineLimits {
            served_model_name: self.served_model_name.clone(),
            max_running_requests: self.max_running_requests,
            max_prefill_tokens: self.max_prefill_tokens,
            chunked_prefill_size: self.chunked_prefill_size,
            disable_radix_cache: self.disable_radix_cache,
            max_waiting: self.max_queued_requests,
            heartbeat_timeout: Duration::from_secs_f64(self.heartbeat_timeout_s),
            disable_overlap_schedule: self.disable_overlap_schedule,
            dp_size: if self.enable_dp_attention {
                self.tp.max(1) as usize
            } else {
                1
            },
            priority: self.enable_priority_scheduling.then_some(PriorityPolicy {
                low_values_first: self.schedule_low_priority_values_first,
                preemption_threshold: self.priority_scheduling_preemption_threshold,
            }),
        }
    }
}

pub fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("nsaserve_router={level}")));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .try_init();
}

pub fn workers_json(info: &WorkersInfo) -> String {
    serde_json::json!({
        "tp_size": info.tp_size,
        "model_id": info.model_id,
        "num_pages": info.num_pages,
        "page_size": info.page_size,
        "max_context": info.max_context,
        "vocab_size": info.vocab_size,
        "pids": info.pids,
    })
    .to_string()
}

pub struct RunningServer {
    pub engine: Arc<EngineHandle>,
    runtime: Option<tokio::runtime::Runtime>,
    http_stop: Option<oneshot::Sender<()>>,
    http_done: Option<oneshot::Receiver<Result<()>>>,
}

impl RunningServer {
    /// Serves on `listener`, the port `bind_http_port` bound when the router was built.
    pub fn start(
        startup: Startup,
        config: &RouterConfig,
        workers: &WorkersInfo,
        listener: std::net::TcpListener,
    ) -> Result<Self> {
        let tokenizer = Arc::new(
            TokenizerBundle::from_model_dir(&config.model_path).with_context(|| {
                format!("loading the tokenizer of {}", config.model_path.display())
            })?,
        );
        // Before the engine starts: a bad flag or generation_config.json leaves nothing running.
        let http_config = config.http_config()?;
        let metrics = Arc::new(Metrics::new());
        let engine = EngineHandle::start(startup, workers, &config.limits(), metrics.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("nsaserve-http")
            .enable_all()
            .build()?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (done_tx, done_rx) = oneshot::channel();
        let listener = {
            let _in_runtime = runtime.enter();
            listener.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(listener)?
        };
        let engine_dyn: Arc<dyn crate::engine::Engine> = engine.clone();
        runtime.spawn(async move {
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            let r = serve_listener(
                listener,
                http_config,
                engine_dyn,
                tokenizer,
                metrics,
                shutdown,
            )
            .await;
            let _ = done_tx.send(r);
        });
        Ok(Self {
            engine,
            runtime: Some(runtime),
            http_stop: Some(stop_tx),
            http_done: Some(done_rx),
        })
    }

    pub fn is_running(&self) -> bool {
        self.engine.is_running()
    }

    pub fn exit_reason(&self) -> Option<String> {
        self.engine.exit_reason()
    }

    /// HTTP stops accepting, the engine fails what is open and tells the workers to exit.
    pub fn shutdown(mut self) {
        if let Some(stop) = self.http_stop.take() {
            let _ = stop.send(());
        }
        self.engine.shutdown();
        if let (Some(rt), Some(done)) = (self.runtime.take(), self.http_done.take()) {
            let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), done).await });
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}
