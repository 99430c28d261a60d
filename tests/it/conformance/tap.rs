//! A TCP relay between one scenario's lapin connections and the server that keeps the raw
//! content-header properties of every delivery (basic.deliver, basic.get-ok), by connection,
//! channel and delivery tag. The observation decodes headers from those bytes, as the Python
//! harness decodes them from the frame: lapin's `FieldTable` keeps one value per key and folds
//! the `U`/`L` tags into `s`/`l`, so a repeated key or a rare tag would go unseen.
//!
//! Bytes are forwarded unchanged. A frame's properties are recorded before the bytes that
//! complete it are passed on, so a delivery lapin hands over is always already recorded.
//! Connections are numbered in the order they are accepted, which is the order the scenario
//! opens them (each connect completes before the next starts).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The largest frame the tap parses (both servers offer 131072); anything larger stops the
/// recording for that connection, not the forwarding.
const FRAME_LIMIT: usize = 1 << 20;

/// (connection number, channel, delivery tag) → raw property bytes (flags and list).
type Recorded = HashMap<(usize, u16, u64), Vec<Vec<u8>>>;

pub struct Tap {
    pub addr: SocketAddr,
    recorded: Arc<Mutex<Recorded>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Tap {
    /// Listens on a free loopback port and relays every connection to `server`.
    pub async fn start(server: SocketAddr) -> std::io::Result<Tap> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let recorded = Arc::new(Mutex::new(Recorded::new()));
        let shared = recorded.clone();
        let task = tokio::spawn(async move {
            let mut number = 0;
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay(client, server, number, shared.clone()));
                number += 1;
            }
        });
        Ok(Tap {
            addr,
            recorded,
            task,
        })
    }

    /// The properties of delivery `tag` on `channel` of connection `conn` (the newest, when a
    /// reopened channel reused the number), taken out of the record.
    pub fn take(&self, conn: usize, channel: u16, tag: u64) -> Option<Vec<u8>> {
        let mut recorded = self.recorded.lock().ok()?;
        recorded.get_mut(&(conn, channel, tag))?.pop()
    }
}

async fn relay(
    client: TcpStream,
    server: SocketAddr,
    number: usize,
    recorded: Arc<Mutex<Recorded>>,
) {
    let Ok(upstream) = TcpStream::connect(server).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = upstream.into_split();
    let to_server = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let to_client = async {
        let mut frames = FrameScanner::default();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            for (channel, tag, properties) in frames.push(&chunk[..n]) {
                if let Ok(mut recorded) = recorded.lock() {
                    recorded
                        .entry((number, channel, tag))
                        .or_default()
                        .push(properties);
                }
            }
            if client_write.write_all(&chunk[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(to_server, to_client);
}

/// Splits the server's byte stream into frames and pairs each delivery's method with its
/// content header.
#[derive(Default)]
struct FrameScanner {
    buffer: Vec<u8>,
    /// The delivery tag waiting for its content header, by channel.
    pending: HashMap<u16, u64>,
    broken: bool,
}

impl FrameScanner {
    /// Takes more bytes; returns (channel, delivery tag, raw properties) per completed delivery
    /// header.
    fn push(&mut self, bytes: &[u8]) -> Vec<(u16, u64, Vec<u8>)> {
        let mut out = Vec::new();
        if self.broken {
            return out;
        }
        self.buffer.extend_from_slice(bytes);
        let mut at = 0;
        while self.buffer.len() - at >= 7 {
            let head = &self.buffer[at..];
            let kind = head[0];
            let channel = u16::from_be_bytes([head[1], head[2]]);
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            if size > FRAME_LIMIT {
                self.broken = true;
                return out;
            }
            if head.len() < 7 + size + 1 {
                break;
            }
            let payload = &head[7..7 + size];
            match kind {
                1 => {
                    if let Some(tag) = delivery_tag(payload) {
                        self.pending.insert(channel, tag);
                    }
                }
                2 => {
                    if let Some(tag) = self.pending.remove(&channel)
                        && payload.len() >= 12
                    {
                        out.push((channel, tag, payload[12..].to_vec()));
                    }
                }
                _ => {}
            }
            at += 7 + size + 1;
        }
        self.buffer.drain(..at);
        out
    }
}

/// The delivery tag of a basic.deliver or basic.get-ok method payload.
fn delivery_tag(payload: &[u8]) -> Option<u64> {
    let ids = (
        u16::from_be_bytes([*payload.first()?, *payload.get(1)?]),
        u16::from_be_bytes([*payload.get(2)?, *payload.get(3)?]),
    );
    let args = payload.get(4..)?;
    let at = match ids {
        // basic.deliver: consumer-tag (shortstr), delivery-tag, ...
        (60, 60) => 1 + usize::from(*args.first()?),
        // basic.get-ok: delivery-tag, ...
        (60, 71) => 0,
        _ => return None,
    };
    let bytes: [u8; 8] = args.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![kind];
        f.extend_from_slice(&channel.to_be_bytes());
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f.push(0xce);
        f
    }

    #[test]
    fn pairs_each_delivery_with_its_header_across_split_reads() {
        let mut deliver = vec![0, 60, 0, 60, 3, b'c', b't', b'g'];
        deliver.extend_from_slice(&7u64.to_be_bytes());
        let mut get_ok = vec![0, 60, 0, 71];
        get_ok.extend_from_slice(&9u64.to_be_bytes());
        let mut header = vec![0, 60, 0, 0];
        header.extend_from_slice(&2u64.to_be_bytes());
        header.extend_from_slice(&[0x20, 0x00, 0xAB]);
        let mut stream = frame(1, 1, &deliver);
        stream.extend(frame(2, 1, &header));
        stream.extend(frame(1, 2, &get_ok));
        stream.extend(frame(2, 2, &header));
        let mut scanner = FrameScanner::default();
        let mut found = Vec::new();
        for piece in stream.chunks(5) {
            found.extend(scanner.push(piece));
        }
        let props = vec![0x20, 0x00, 0xAB];
        assert_eq!(found, vec![(1, 7, props.clone()), (2, 9, props)]);
    }
}
