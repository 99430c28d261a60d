//! TLS with tokio-rustls: the client-facing amqps listener (certificate, key, optional client
//! certificate verification) and the connector for amqps upstreams, both reloadable.
//!
//! - `pem`: reads the PEM files (rustls-pki-types), errors naming the key and the file;
//! - `server` / `client`: build the rustls configurations from the settings;
//! - `material`: [`Reloadable`], the configuration in force, swapped on a successful
//!   rebuild; each new connection takes the current one;
//! - `rotation`: rebuilds them when their files change (Kubernetes Secret updates) or on
//!   SIGHUP, and counts `tls_reloads_total`.
//!
//! Everything uses the aws-lc-rs crypto provider explicitly, so the result does not depend on
//! which providers other crates happen to enable.

mod client;
mod material;
mod pem;
mod rotation;
mod server;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::anyhow;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::admission::{Admission, ConnectionSlots};
use crate::config::TlsConfig;
use crate::shutdown::Shutdown;

pub use client::{client_config, upstream_material};
pub use material::Reloadable;
pub use rotation::{Material, TlsRotation};
pub use server::{server_config, server_material};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider())
}

/// The amqps acceptor from `[tls]`, as the files are now.
pub fn acceptor(cfg: &TlsConfig) -> anyhow::Result<TlsAcceptor> {
    Ok(TlsAcceptor::from(server_config(cfg)?))
}

/// A connector for amqps upstreams, as the CA file is now (see [`client_config`]).
pub fn connector(ca_file: &str, verify: bool) -> anyhow::Result<TlsConnector> {
    Ok(TlsConnector::from(client_config(ca_file, verify)?))
}

/// Runs the TLS handshake for `server_name` on `stream`.
pub async fn connect(
    connector: &TlsConnector,
    stream: TcpStream,
    server_name: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = ServerName::try_from(server_name.to_string())
        .map_err(|e| anyhow!("upstream.tls_server_name: {e}"))?;
    Ok(connector.connect(name, stream).await?)
}

/// Accepts TLS connections until `stop`; each completed handshake is handed to `on_conn`
/// with the admission `slots` gave the connection when it arrived. The slot (or the bounded
/// refusal) is taken before the handshake, so handshakes in progress count against
/// `limits.max_connections` as plain connections do: peers that open sockets and never finish
/// a handshake cannot grow the tasks and sockets without a limit. Each handshake uses the
/// configuration `server` holds when the connection arrives.
pub async fn serve<F>(
    listener: TcpListener,
    server: Arc<Reloadable<ServerConfig>>,
    slots: Arc<ConnectionSlots>,
    mut stop: Shutdown,
    on_conn: F,
) where
    F: Fn(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr, Admission)
        + Send
        + Sync
        + 'static,
{
    let on_conn = Arc::new(on_conn);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                let admission = slots.reserve(peer);
                if admission.is_dropped() {
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let acceptor = TlsAcceptor::from(server.current());
                let on_conn = on_conn.clone();
                stop.spawn(async move {
                    let handshake = tokio::time::timeout(
                        std::time::Duration::from_secs(10),
                        acceptor.accept(stream),
                    )
                    .await;
                    match handshake {
                        Ok(Ok(tls)) => on_conn(tls, peer, admission),
                        Ok(Err(err)) => tracing::info!(%peer, %err, "TLS handshake failed"),
                        Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                    }
                });
            }
            _ = stop.recv() => return,
        }
    }
}
