//! ZeroMQ sockets between the router and the workers.
//!
//! - one PUSH socket per rank, bound by the router (`plan-<rank>`): every rank receives every
//!   plan, in order; per-rank sockets avoid PUB/SUB's dropped-message and slow-joiner pitfalls;
//! - one PULL socket bound by the router (`events`) where every rank PUSHes hello, heartbeats,
//!   fatal errors and (rank 0) step results.
//!
//! By default the sockets are `ipc://` files in a private runtime directory (mode 0700, made by
//! the caller); `tcp://` endpoints are used when workers run on other machines.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::protocol::{decode_worker_message, encode_router_message, RouterMessage, WorkerMessage};

/// How long sending a plan may wait for a rank to be connected. With an unlimited queue a send
/// waits only when the rank's worker is gone (a PUSH socket without a peer blocks); then the
/// send fails and the engine stops, instead of hanging before it can notice the death.
const PLAN_SEND_TIMEOUT_MS: i32 = 2000;

/// Where the sockets live.
#[derive(Debug, Clone)]
pub enum Endpoints {
    /// `ipc://<dir>/plan-<rank>` and `ipc://<dir>/events`.
    Ipc { dir: String },
    /// `tcp://<host>:<base_port>` for events, `tcp://<host>:<base_port + 1 + rank>` for plans.
    Tcp { host: String, base_port: u16 },
}

impl Endpoints {
    pub fn events(&self) -> String {
        match self {
            Endpoints::Ipc { dir } => format!("ipc://{}", Path::new(dir).join("events").display()),
            Endpoints::Tcp { host, base_port } => format!("tcp://{host}:{base_port}"),
        }
    }

    pub fn plans(&self, rank: u32) -> String {
        match self {
            Endpoints::Ipc { dir } => format!(
                "ipc://{}",
                Path::new(dir).join(format!("plan-{rank}")).display()
            ),
            Endpoints::Tcp { host, base_port } => {
                format!("tcp://{host}:{}", *base_port as u32 + 1 + rank)
            }
        }
    }
}

/// The router's sending side: one PUSH socket per rank. Owned by the engine thread only
/// (zmq sockets are not thread-safe).
pub struct PlanSender {
    sockets: Vec<zmq::Socket>,
}

impl PlanSender {
    pub fn bind(ctx: &zmq::Context, endpoints: &Endpoints, tp_size: u32) -> Result<Self> {
        let mut sockets = Vec::with_capacity(tp_size as usize);
        for rank in 0..tp_size {
            let s = ctx.socket(zmq::PUSH)?;
            // Never drop or block on a plan: the router sends at most a few per step.
            s.set_sndhwm(0)?;
            s.set_sndtimeo(PLAN_SEND_TIMEOUT_MS)?;
            s.set_linger(0)?;
            let ep = endpoints.plans(rank);
            s.bind(&ep).with_context(|| format!("binding {ep}"))?;
            sockets.push(s);
        }
        Ok(Self { sockets })
    }

    /// Sends the same bytes to every rank.
    pub fn broadcast(&self, bytes: &[u8]) -> Result<()> {
        for s in &self.sockets {
            s.send(bytes, 0)?;
        }
        Ok(())
    }

    /// Sends to rank 0 alone (the only rank that samples): a step's late masks.
    pub fn send_to_rank0(&self, bytes: &[u8]) -> Result<()> {
        self.sockets[0].send(bytes, 0)?;
        Ok(())
    }

    pub fn shutdown_all(&self) {
        if let Ok(bytes) = encode_router_message(&RouterMessage::Shutdown) {
            for s in &self.sockets {
                let _ = s.send(&bytes[..], zmq::DONTWAIT);
            }
        }
    }
}

/// The router's receiving side, read by a dedicated thread.
pub struct EventReceiver {
    socket: zmq::Socket,
}

/// One thing read from the events socket.
pub enum Received {
    Message(WorkerMessage),
    /// Bytes that are not a valid worker message: logged and dropped, never fatal.
    Garbage(String),
    Timeout,
}

impl EventReceiver {
    pub fn bind(ctx: &zmq::Context, endpoints: &Endpoints, poll: Duration) -> Result<Self> {
        let s = ctx.socket(zmq::PULL)?;
        s.set_rcvhwm(0)?;
        s.set_linger(0)?;
        s.set_rcvtimeo(poll.as_millis() as i32)?;
        let ep = endpoints.events();
        s.bind(&ep).with_context(|| format!("binding {ep}"))?;
        Ok(Self { socket: s })
    }

    pub fn recv(&self) -> Result<Received> {
        match self.socket.recv_bytes(0) {
            Ok(bytes) => Ok(match decode_worker_message(&bytes) {
                Ok(m) => Received::Message(m),
                Err(e) => Received::Garbage(e.to_string()),
            }),
            Err(zmq::Error::EAGAIN) => Ok(Received::Timeout),
            Err(e) => Err(e.into()),
        }
    }
}
