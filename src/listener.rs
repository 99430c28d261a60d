//! The plain-TCP accept loop shared by both modes (the TLS one is in [`crate::tls`]): accept
//! until `stop`, set TCP_NODELAY, hand each connection to `on_conn`.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

use crate::shutdown::Shutdown;

pub async fn accept_tcp<F>(listener: TcpListener, mut stop: Shutdown, on_conn: F)
where
    F: Fn(TcpStream, SocketAddr),
{
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    on_conn(stream, peer);
                }
                Err(err) => {
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            _ = stop.recv() => return,
        }
    }
}
