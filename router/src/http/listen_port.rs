//! Binding the HTTP port, once, when the router is built.
//!
//! `serve` builds the router before it starts any worker, so binding here means a port in use
//! fails in a second instead of after minutes of weight loading, and the port is held while the
//! workers and their process-group rendezvous pick ephemeral ports of their own (one of which
//! could otherwise be the port asked for). Connections made while the workers load wait in the
//! listen backlog and are answered once serving starts.

use std::net::{TcpListener, ToSocketAddrs};

use anyhow::{Context as _, Result};
use socket2::{Domain, Protocol, Socket, Type};

/// Pending connections the kernel keeps before `accept` (tokio's own default).
const LISTEN_BACKLOG: i32 = 1024;

/// A listening socket on `host:port` (the first of the host's addresses that binds; port 0
/// picks a free one). Address reuse is on, as for tokio's own bind: a restarted server can
/// take its port back while old connections sit in TIME_WAIT.
pub fn bind_port(host: &str, port: u16) -> Result<TcpListener> {
    let addresses: Vec<_> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("binding {host}:{port}: cannot resolve {host}"))?
        .collect();
    let mut last_error = None;
    for address in addresses {
        let bound = (|| {
            let socket = Socket::new(
                Domain::for_address(address),
                Type::STREAM,
                Some(Protocol::TCP),
            )?;
            socket.set_reuse_address(true)?;
            socket.bind(&address.into())?;
            socket.listen(LISTEN_BACKLOG)?;
            Ok::<_, std::io::Error>(TcpListener::from(socket))
        })();
        match bound {
            Ok(listener) => return Ok(listener),
            Err(e) => last_error = Some(e),
        }
    }
    match last_error {
        Some(e) => Err(e).with_context(|| format!("binding {host}:{port}")),
        None => anyhow::bail!("binding {host}:{port}: {host} has no address"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_picks_a_free_port_and_a_held_port_is_refused() {
        let first = bind_port("127.0.0.1", 0).unwrap();
        let port = first.local_addr().unwrap().port();
        assert_ne!(port, 0);
        let err = format!("{:#}", bind_port("127.0.0.1", port).unwrap_err());
        assert!(
            err.starts_with(&format!("binding 127.0.0.1:{port}")),
            "{err}"
        );
        assert!(err.contains("in use"), "{err}");
    }

    #[test]
    fn a_host_name_resolves() {
        let listener = bind_port("localhost", 0).unwrap();
        assert!(listener.local_addr().unwrap().ip().is_loopback());
    }

    #[test]
    fn the_listener_accepts_connections() {
        let listener = bind_port("127.0.0.1", 0).unwrap();
        let address = listener.local_addr().unwrap();
        let _client = std::net::TcpStream::connect(address).unwrap();
        let (_server_side, peer) = listener.accept().unwrap();
        assert!(peer.ip().is_loopback());
    }
}
