//! The thin PyO3 entry: `nsaserve._router.Router`, driven by `nsaserve serve`'s supervisor.
//! Every blocking call releases the GIL; the router's own threads never touch Python.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::engine::Startup;
use crate::server::{RouterConfig, RunningServer};

enum State {
    Starting(Box<Startup>, RouterConfig),
    Ready(Box<Startup>, RouterConfig, crate::engine::WorkersInfo),
    Running(RunningServer),
    Stopped,
}

#[pyclass(module = "nsaserve._router")]
pub struct Router {
    state: Arc<Mutex<State>>,
}

fn err(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

#[pymethods]
impl Router {
    /// Parses the JSON configuration and binds the worker sockets.
    #[new]
    fn new(config_json: &str) -> PyResult<Self> {
        let config: RouterConfig = serde_json::from_str(config_json).map_err(err)?;
        crate::server::init_logging(&config.log_level);
        let startup = Startup::bind(&config.endpoints(), config.tp).map_err(err)?;
        Ok(Self {
            state: Arc::new(Mutex::new(State::Starting(Box::new(startup), config))),
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
                State::Starting(mut startup, config) => {
                    match startup.poll_ready(Duration::from_secs_f64(timeout_s)) {
                        Ok(Some(info)) => {
                            let json = crate::server::workers_json(&info);
                            *guard = State::Ready(startup, config, info);
                            Ok(Some(json))
                        }
                        Ok(None) => {
                            *guard = State::Starting(startup, config);
                            Ok(None)
                        }
                        Err(e) => Err(err(format!("{e:#}"))),
                    }
                }
                State::Ready(s, c, info) => {
                    let json = crate::server::workers_json(&info);
                    *guard = State::Ready(s, c, info);
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
                State::Ready(startup, config, info) => {
                    let server = RunningServer::start(*startup, &config, &info)
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
        let state = self.state.clone();
        py.detach(
            move || match std::mem::replace(&mut *state.lock(), State::Stopped) {
                State::Running(server) => server.shutdown(),
                State::Starting(startup, _) | State::Ready(startup, _, _) => {
                    startup.shutdown_workers()
                }
                State::Stopped => {}
            },
        );
    }
}

#[pymodule]
fn _router(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Router>()?;
    m.add("PROTOCOL_VERSION", crate::protocol::PROTOCOL_VERSION)?;
    Ok(())
}
