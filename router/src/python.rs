//! The thin PyO3 entry: `nsaserve._router.Router`, driven by `nsaserve serve`'s supervisor.
//! Every blocking call releases the GIL; the router's own threads never touch Python.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::engine::Startup;
use crate::server::{RouterConfig, RunningServer};

/// What `start` needs, gathered before the workers say hello.
struct Prepared {
    startup: Box<Startup>,
    config: RouterConfig,
    /// The HTTP port, bound in `new`: held from before the first worker starts.
    listener: std::net::TcpListener,
}

enum State {
    Starting(Prepared),
    Ready(Prepared, crate::engine::WorkersInfo),
    Running(RunningServer),
    Stopped,
}

#[pyclass(module = "nsaserve._router")]
pub struct Router {
    state: Arc<Mutex<State>>,
    /// Where restarted workers connect: the same endpoints, bound afresh.
    endpoints: crate::transport::Endpoints,
    tp: u32,
    /// The HTTP port bound (the one asked for, or the one picked for `--port 0`).
    #[pyo3(get)]
    http_port: u16,
    /// A replacement worker group's sockets, between `begin_restart` and its last hello.
    restarting: Arc<Mutex<Option<Box<Startup>>>>,
}

fn err(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

#[pymethods]
impl Router {
    /// Parses the JSON configuration and binds the worker sockets and the HTTP port.
    #[new]
    fn new(config_json: &str) -> PyResult<Self> {
        let config: RouterConfig = serde_json::from_str(config_json).map_err(err)?;
        crate::server::init_logging(&config.log_level);
        // A bad generation_config.json fails here, before the workers spend minutes loading
        // weights; the HTTP server reads it again when it starts.
        config
            .sampling_defaults()
            .map_err(|e| err(format!("{e:#}")))?;
        let listener =
            crate::http::bind_port(&config.host, config.port).map_err(|e| err(format!("{e:#}")))?;
        let http_port = listener.local_addr().map_err(err)?.port();
        let (endpoints, tp) = (config.endpoints(), config.tp);
        let startup = Box::new(Startup::bind(&endpoints, tp).map_err(err)?);
        let prepared = Prepared {
            startup,
            config,
            listener,
        };
        Ok(Self {
            state: Arc::new(Mutex::new(State::Starting(prepared))),
            endpoints,
            tp,
            http_port,
            restarting: Arc::new(Mutex::new(None)),
        })
    }

    /// Waits up to `timeout_s` for every worker's hello. Returns the workers' facts as JSON
    /// when all are there, None otherwise; raises with the worker's own message on failure.
    fn poll_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<String>> {
        let state = self.state.clone();
        py.detach(move || {
            let mut guard = state.lock();
            let taken = std::mem::replace(&mut *guard, State::Stopped);
            match taken {
                State::Starting(mut prepared) => {
                    match prepared
                        .startup
                        .poll_ready(Duration::from_secs_f64(timeout_s))
                    {
                        Ok(Some(info)) => {
                            let json = crate::server::workers_json(&info);
                            *guard = State::Ready(prepared, info);
                            Ok(Some(json))
                        }
                        Ok(None) => {
                            *guard = State::Starting(prepared);
                            Ok(None)
                        }
                        Err(e) => Err(err(format!("{e:#}"))),
                    }
                }
                State::Ready(prepared, info) => {
                    let json = crate::server::workers_json(&info);
                    *guard = State::Ready(prepared, info);
                    Ok(Some(json))
                }
                other => {
                    *guard = other;
                    Err(err("the router is already running"))
                }
            }
        })
    }

    /// Starts the engine loop and the HTTP server (after `poll_ready` returned the workers).
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let state = self.state.clone();
        py.detach(move || {
            let mut guard = state.lock();
            match std::mem::replace(&mut *guard, State::Stopped) {
                State::Ready(prepared, info) => {
                    let Prepared {
                        startup,
                        config,
                        listener,
                    } = prepared;
                    let server = RunningServer::start(*startup, &config, &info, listener)
                        .map_err(|e| err(format!("{e:#}")))?;
                    *guard = State::Running(server);
                    Ok(())
                }
                other => {
                    *guard = other;
                    Err(err("start() needs every worker's hello first (poll_ready)"))
                }
            }
        })
    }

    /// The supervisor saw worker `rank` exit: every open request fails, /health turns 503.
    fn worker_exited(&self, rank: u32, reason: String) {
        if let State::Running(s) = &*self.state.lock() {
            s.engine.worker_exited(rank, reason);
        }
    }

    /// Starts replacing the worker group after a failure; call it once the old workers are
    /// gone. The engine run ends (open requests fail; /health and new requests get 503), its
    /// sockets close, and the same endpoints are bound again for the new workers' hellos.
    fn begin_restart(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.engine()?;
        let (restarting, endpoints, tp) =
            (self.restarting.clone(), self.endpoints.clone(), self.tp);
        py.detach(move || {
            let mut slot = restarting.lock();
            // A failed attempt's sockets close before the endpoints are bound again.
            drop(slot.take());
            engine.end_run();
            let startup = Startup::bind(&endpoints, tp).map_err(|e| err(format!("{e:#}")))?;
            *slot = Some(Box::new(startup));
            Ok(())
        })
    }

    /// Waits up to `timeout_s` for the new workers' hellos (after `begin_restart`). When all
    /// are there the engine serves again, with an empty KV pool of the size they report, and
    /// their facts come back as JSON; None: not all there yet; raises on a worker's failure.
    fn poll_restarted(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<String>> {
        let engine = self.engine()?;
        let restarting = self.restarting.clone();
        py.detach(move || {
            let mut slot = restarting.lock();
            let Some(startup) = slot.as_mut() else {
                return Err(err("no restart is in progress (begin_restart)"));
            };
            match startup.poll_ready(Duration::from_secs_f64(timeout_s)) {
                Ok(Some(info)) => {
                    let startup = slot.take().expect("a restart in progress");
                    engine.restart(*startup, &info);
                    Ok(Some(crate::server::workers_json(&info)))
                }
                Ok(None) => Ok(None),
                Err(e) => {
                    drop(slot.take());
                    Err(err(format!("{e:#}")))
                }
            }
        })
    }

    fn is_running(&self) -> bool {
        matches!(&*self.state.lock(), State::Running(s) if s.is_running())
    }

    fn exit_reason(&self) -> Option<String> {
        match &*self.state.lock() {
            State::Running(s) => s.exit_reason(),
            _ => None,
        }
    }

    /// Stops HTTP and the engine and tells the workers to exit. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        let (state, restarting) = (self.state.clone(), self.restarting.clone());
        py.detach(move || {
            if let Some(startup) = restarting.lock().take() {
                startup.shutdown_workers();
            }
            match std::mem::replace(&mut *state.lock(), State::Stopped) {
                State::Running(server) => server.shutdown(),
                State::Starting(prepared) | State::Ready(prepared, _) => {
                    prepared.startup.shutdown_workers()
                }
                State::Stopped => {}
            }
        });
    }
}

impl Router {
    fn engine(&self) -> PyResult<Arc<crate::engine::EngineHandle>> {
        match &*self.state.lock() {
            State::Running(s) => Ok(s.engine.clone()),
            _ => Err(err("the router is not serving (start)")),
        }
    }
}

#[pymodule]
fn _router(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Router>()?;
    m.add("PROTOCOL_VERSION", crate::protocol::PROTOCOL_VERSION)?;
    Ok(())
}
