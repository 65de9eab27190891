//! The accept loop: every TCP connection served by hyper's HTTP/1.1 with limits that keep slow
//! or hostile clients from tying the server up.
//!
//! - A client must finish its request headers within `header_timeout` (slowloris). hyper's
//!   timer also runs while a keep-alive connection waits for its next request.
//! - A connection with no request in flight is closed after `keep_alive_timeout`.
//! - At most `max_connections` are open. When a new one arrives at the cap (or the process is
//!   out of file descriptors), the connection idle the longest is closed to make room, so a
//!   flood of idle keep-alive connections cannot keep new requests out; only when every
//!   connection is busy does a new one wait in the listen backlog.
//!
//! (The request body's own deadline is enforced where it is read, in `json_body`.)

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub keep_alive_timeout: Duration,
}

/// One open connection as the accept loop sees it.
struct Slot {
    /// Requests whose response has not finished (its body dropped).
    in_flight: AtomicUsize,
    /// When `in_flight` last fell to 0 (or the connection was accepted), in ms since `epoch`.
    idle_since_ms: AtomicU64,
    /// Set by the accept loop to ask an idle connection to close.
    evict: AtomicBool,
    /// Wakes the connection's task: activity changed or eviction was asked.
    wake: Notify,
}

impl Slot {
    fn is_idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }
}

/// Held while a request is in flight; dropping it (with the response body) marks the
/// connection idle again.
struct InFlight {
    slot: Arc<Slot>,
    epoch: Instant,
}

impl InFlight {
    fn begin(slot: &Arc<Slot>, epoch: Instant) -> InFlight {
        slot.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            slot: Arc::clone(slot),
            epoch,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.slot
            .idle_since_ms
            .store(millis_since(self.epoch), Ordering::Release);
        if self.slot.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.slot.wake.notify_one();
        }
    }
}

fn millis_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

/// The open connections, for choosing one to evict.
struct Registry {
    epoch: Instant,
    next_id: AtomicU64,
    slots: Mutex<HashMap<u64, Arc<Slot>>>,
}

impl Registry {
    fn add(&self) -> (u64, Arc<Slot>) {
        let slot = Arc::new(Slot {
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(millis_since(self.epoch)),
            evict: AtomicBool::new(false),
            wake: Notify::new(),
        });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.slots.lock().insert(id, Arc::clone(&slot));
        (id, slot)
    }

    fn remove(&self, id: u64) {
        self.slots.lock().remove(&id);
    }

    /// Asks the connection idle the longest (not already asked) to close. False when every
    /// connection is busy.
    fn evict_oldest_idle(&self) -> bool {
        let slots = self.slots.lock();
        let oldest = slots
            .values()
            .filter(|s| s.is_idle() && !s.evict.load(Ordering::Acquire))
            .min_by_key(|s| s.idle_since_ms.load(Ordering::Acquire));
        match oldest {
            Some(slot) => {
                slot.evict.store(true, Ordering::Release);
                slot.wake.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Out of file descriptors: closing an idle connection frees one.
fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(23 | 24)) // ENFILE, EMFILE
}

/// Serves `app` on `listener` until `shutdown` completes; then stops accepting, lets requests
/// in flight finish, and returns once every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let registry = Arc::new(Registry {
        epoch: Instant::now(),
        next_id: AtomicU64::new(0),
        slots: Mutex::new(HashMap::new()),
    });
    // `acquire_many` below counts in u32.
    let max = limits.max_connections.clamp(1, u32::MAX as usize);
    let permits = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if is_fd_exhaustion(&e) {
                        registry.evict_oldest_idle();
                    }
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let permit = tokio::select! {
            () = &mut shutdown => break,
            p = make_room(&registry, &permits) => p,
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(
            stream,
            app.clone(),
            Arc::clone(&builder),
            Arc::clone(&registry),
            limits.keep_alive_timeout,
            stop_rx.clone(),
            permit,
        ));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection returns its permit when it closes.
    let _ = permits.acquire_many(max as u32).await;
}

/// A permit for one more connection; at the cap, evicts idle connections until one frees.
async fn make_room(registry: &Registry, permits: &Arc<Semaphore>) -> OwnedSemaphorePermit {
    if let Ok(p) = Arc::clone(permits).try_acquire_owned() {
        return p;
    }
    loop {
        registry.evict_oldest_idle();
        tokio::select! {
            p = Arc::clone(permits).acquire_owned() => return p.expect("the semaphore is never closed"),
            // Every connection was busy (or the evicted one is still closing): look again soon.
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    builder: Arc<hyper::server::conn::http1::Builder>,
    registry: Arc<Registry>,
    keep_alive: Duration,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    let (id, slot) = registry.add();
    let epoch = registry.epoch;
    let service_slot = Arc::clone(&slot);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let in_flight = InFlight::begin(&service_slot, epoch);
        let app = app.clone();
        async move {
            let response = app
                .oneshot(request.map(Body::new))
                .await
                .unwrap_or_else(|e: Infallible| match e {});
            // The connection stays busy until the whole response (a stream, say) is sent.
            Ok::<_, Infallible>(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _ = &in_flight;
                    frame
                }))
            }))
        }
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let mut stopping = false;
    loop {
        let idle_deadline = if slot.is_idle() {
            let since = slot.idle_since_ms.load(Ordering::Acquire);
            epoch + Duration::from_millis(since) + keep_alive
        } else {
            Instant::now() + Duration::from_secs(3600)
        };
        tokio::select! {
            _ = connection.as_mut() => break,
            () = slot.wake.notified() => {
                if slot.evict.load(Ordering::Acquire) {
                    if slot.is_idle() {
                        break;
                    }
                    // A request started since: it stays, and may be asked again later.
                    slot.evict.store(false, Ordering::Release);
                }
            }
            () = tokio::time::sleep_until(idle_deadline) => {
                if slot.is_idle() && Instant::now() >= idle_deadline {
                    break;
                }
            }
            changed = stop.changed(), if !stopping => {
                // Server shutdown (or the sender gone): finish what is in flight, then close.
                let _ = changed;
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
    registry.remove(id);
}
