//! The task of one vhost's *declare connection*: a second connection of the service identity
//! that only makes the declares client sessions hand it ([`Judge`]). It never publishes.
//!
//! Why a connection of its own: RabbitMQ blocks a connection once it publishes during a
//! memory or disk alarm, and then reads nothing more from it. The service connection publishes
//! dead letters, so during an alarm it can be blocked for as long as the alarm lasts; a
//! declare check queued behind it would wait that long, and the client's queue.declare would
//! end in 320 after `proxy.capture_ready_timeout_secs`. A connection that never publishes is
//! never blocked, so applications can still declare their queues (and consumers start)
//! during an alarm, as they can on RabbitMQ directly.
//!
//! Like the service connection it dials any node ([`open`]), reconnects with backoff after a
//! loss ([`Reconnect`]) and keeps heartbeats ([`Heartbeat`]). A declare in flight when
//! the connection is lost has its answer dropped: the session gives up on it (320, the
//! client reconnects and declares again). Requests queued meanwhile wait for the next
//! connection, each session at most `proxy.capture_ready_timeout_secs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};

use super::Status;
use super::handshake::declare_connection_name;
use super::judge::{DECLARE_CHANNEL, DeclareRequest, Judge};
use super::task::{
    End, Heartbeat, Opened, Reconnect, close_politely, frame_or_end, open, upstream_close,
    write_last,
};
use crate::config::ServiceIdentity;
use crate::proxy::ProxyShared;
use crate::shutdown::Shutdown;

/// Runs the vhost's declare connection until shutdown (or until the registry, which holds
/// the sending end of `declares`, is gone).
pub(super) async fn run(
    shared: Arc<ProxyShared>,
    identity: ServiceIdentity,
    vhost: String,
    status: watch::Sender<Status>,
    mut declares: mpsc::Receiver<DeclareRequest>,
    mut shutdown: Shutdown,
) {
    let mut reconnect = Reconnect::new("declare", "client declares that need it");
    while reconnect.attempt(&shared, &vhost, &shutdown) {
        let name = declare_connection_name(&shared.capture_name, &vhost);
        let end = match open(&shared, &identity, &vhost, name, &mut shutdown).await {
            Ok(opened) => {
                tracing::info!(
                    vhost = %vhost,
                    upstream = %opened.target.address(),
                    "declare connection open"
                );
                declaring(&shared, &vhost, &status, true);
                let end = serve(opened, &mut declares, &mut shutdown).await;
                declaring(&shared, &vhost, &status, false);
                end
            }
            Err(end) => end,
        };
        if !reconnect.after(end, &shared, &vhost, &mut shutdown).await {
            break;
        }
    }
}

/// The declare connection opened (`true`) or ended: its status, gauge and `/readyz` follow.
fn declaring(shared: &ProxyShared, vhost: &str, status: &watch::Sender<Status>, open: bool) {
    status.send_modify(|s| s.declaring = open);
    shared.services.consumer_changed();
    shared.metrics.set_declare_connection(vhost, open);
}

/// One open connection: one declare at a time on [`DECLARE_CHANNEL`], heartbeats, until the
/// connection is lost or shutdown comes.
async fn serve(
    opened: Opened,
    declares: &mut mpsc::Receiver<DeclareRequest>,
    shutdown: &mut Shutdown,
) -> End {
    let Opened {
        mut reader,
        mut write,
        tuned,
        ..
    } = opened;
    let mut judge = Judge::default();
    let mut heartbeat = Heartbeat::new(&tuned, Instant::now());
    let mut out = BytesMut::new();
    loop {
        let writing = !out.is_empty();
        let wake = heartbeat.wake(Instant::now() + Duration::from_secs(60), writing);
        tokio::select! {
            request = declares.recv(), if judge.ready() => {
                let Some(request) = request else {
                    close_politely(&mut reader, &mut write, out).await;
                    return End::Shutdown;
                };
                if let Some(bytes) = judge.start(request) {
                    out.extend_from_slice(&bytes);
                }
            }
            frame = reader.next() => {
                heartbeat.received(Instant::now());
                let frame = match frame_or_end(frame) {
                    Ok(frame) => frame,
                    Err(end) => return end,
                };
                if let Some((close_ok, why)) = upstream_close(&frame) {
                    out.extend_from_slice(&close_ok);
                    write_last(&mut write, &out).await;
                    return End::Lost(why);
                }
                if frame.channel == DECLARE_CHANNEL
                    && let Some(bytes) = judge.on_frame(&frame)
                {
                    out.extend_from_slice(&bytes);
                }
            }
            written = write.write(&out), if writing => {
                match written {
                    Ok(0) | Err(_) => return End::Lost("socket write failed".into()),
                    Ok(n) => {
                        let _ = out.split_to(n);
                        heartbeat.sent(Instant::now());
                    }
                }
            }
            _ = tokio::time::sleep_until(wake.into()) => {
                if let Err(end) = heartbeat.on_timer(Instant::now(), &mut out) {
                    return end;
                }
            }
            _ = shutdown.recv() => {
                close_politely(&mut reader, &mut write, out).await;
                return End::Shutdown;
            }
        }
    }
}
