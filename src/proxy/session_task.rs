//! The task of one client connection ([`run`]): it reads the protocol header, connects to
//! the upstream, and then only moves bytes. Frames read from either socket go to the
//! connection's state ([`super::client_session::ClientSession`], which owns no socket), what
//! that state queued in its outboxes ([`super::outbox`]) is written to the sockets as they
//! accept it (right after the turn that queued it; the `select!` waits on a write only once a
//! socket refused bytes), and its timers, the service connection's answers and the shutdown
//! signal are waited on in one `select!`.
//!
//! Reads are flow-controlled by the state: a side is read only when the opposite outbox has
//! room (and upstream reads only while kept deliveries and held dead letters are under
//! `proxy.max_inflight_bytes`). Frames already in the read buffers are handled in bursts of
//! up to [`BUFFERED_FRAMES_PER_TURN`] per wake-up. The task never blocks on a socket write,
//! so a slow peer only slows the other side's reads.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{oneshot, watch};

use super::ProxyShared;
use super::busy_poll::BusyPoll;
use super::client_session::ClientSession;
use super::outbox::SocketWriter;
use super::policy_sync::management::ArgumentsListing;
use super::probe::CheckAnswer;
use super::publisher::{OpId, Outcome};
use super::service::Status;
use super::upstream::{UpstreamStream, UpstreamTarget};
use super::wire::{FrameReader, WireFrame, upstream_frame_limit};
use crate::admission::refuse_client_after_header;
use crate::amqp::codec::{FrameError, INITIAL_FRAME_MAX, PROTOCOL_HEADER};
use crate::amqp::reply::{self, AmqpError};
use crate::metrics::REFUSED_UPSTREAM_UNREACHABLE;
use crate::shutdown::Shutdown;

/// Most frames already read that one turn of the connection loop handles before it checks
/// timers, shutdown and the sockets again.
const BUFFERED_FRAMES_PER_TURN: usize = 256;

/// Most frames of one pass-through run.
const RUN_FRAMES: u64 = 256;

/// What woke the connection loop.
enum Event {
    /// Bytes were read (the frames are handled at the top of the loop), or the side ended.
    Client(Option<Result<(), FrameError>>),
    Upstream(Option<Result<(), FrameError>>),
    /// An outbox wrote bytes (or failed).
    Wrote,
    Timer,
    Shutdown,
    /// The vhost's capture objects were declared (a held queue.declare may go on).
    CaptureDeclared,
    /// The declare connection answered a declare (`None`: it was lost before answering).
    ServiceAnswer(Option<CheckAnswer>),
    /// The management API listed a queue's arguments for a read-back (`None`: no answer).
    Listing(Option<ArgumentsListing>),
    /// A dead letter the service connection published for this session ended.
    ServiceOutcome(Option<(OpId, Outcome)>),
    /// Nothing was ready; the task yielded instead of sleeping.
    Polled,
}

/// The frame reader of an upstream connection's reading half.
type UpstreamReader = FrameReader<ReadHalf<UpstreamStream>>;

/// Dials the upstream for a client: a node counts as reached once it answered the protocol
/// header with its first frame (the connection.start the session forwards) before the
/// client's handshake deadline ([`super::upstream::UpstreamPool::connect_then`]).
async fn open_upstream(
    shared: &ProxyShared,
    deadline: Instant,
) -> std::io::Result<(
    UpstreamReader,
    WriteHalf<UpstreamStream>,
    WireFrame,
    Arc<UpstreamTarget>,
)> {
    let frame_max = shared.handshake_frame_max;
    let greet = |stream: UpstreamStream| async move {
        let (read, mut write) = tokio::io::split(stream);
        let mut reader = FrameReader::new(read, frame_max);
        write.write_all(&PROTOCOL_HEADER).await?;
        let within = tokio::time::Instant::from(deadline);
        let closed =
            |why: &str| std::io::Error::new(std::io::ErrorKind::ConnectionAborted, why.to_string());
        match tokio::time::timeout_at(within, reader.next()).await {
            Ok(Some(Ok(frame))) => Ok((reader, write, frame)),
            Ok(Some(Err(err))) => Err(closed(&err.to_string())),
            Ok(None) => Err(closed("closed before its greeting")),
            Err(_) => Err(closed("no greeting before the handshake deadline")),
        }
    };
    let ((reader, write, greeting), target) = shared.upstream.connect_then(greet).await?;
    Ok((reader, write, greeting, target))
}

/// Serves one client connection until both legs are closed.
pub(super) async fn run<S>(
    mut client: S,
    peer: SocketAddr,
    shared: Arc<ProxyShared>,
    mut shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let handshake_timeout = shared.handshake_timeout;
    let handshake_deadline = Instant::now() + handshake_timeout;
    // The protocol header comes first; anything else gets ours back (AMQP 0-9-1 §4.2.2).
    let mut header = [0u8; 8];
    let read = tokio::select! {
        r = tokio::time::timeout(handshake_timeout, client.read_exact(&mut header)) => r,
        _ = shutdown.recv() => return,
    };
    match read {
        Ok(Ok(_)) if header == PROTOCOL_HEADER => {}
        Ok(Ok(_)) => {
            tracing::debug!(%peer, "client sent an unsupported protocol header");
            let _ = client.write_all(&PROTOCOL_HEADER).await;
            let _ = client.shutdown().await;
            return;
        }
        _ => return,
    }
    let (mut upstream_reader, upstream_write, greeting) =
        match open_upstream(&shared, handshake_deadline).await {
            Ok((reader, write, greeting, target)) => {
                tracing::debug!(%peer, upstream = %target.address(), "upstream connected");
                (reader, write, greeting)
            }
            Err(err) => {
                tracing::warn!(%peer, %err, "no upstream reachable: client refused");
                shared
                    .metrics
                    .connection_refused(REFUSED_UPSTREAM_UNREACHABLE);
                let refusal = AmqpError::new(reply::CONNECTION_FORCED, err.to_string());
                refuse_client_after_header(client, &refusal, handshake_timeout).await;
                return;
            }
        };
    let (client_read, client_write) = tokio::io::split(client);
    let mut client_writer: SocketWriter = Box::pin(client_write);
    let mut upstream_writer: SocketWriter = Box::pin(upstream_write);
    // Until the client is tuned its frames are small (RabbitMQ's initial frame_max).
    let initial_frame_max = shared.handshake_frame_max.min(INITIAL_FRAME_MAX);
    let mut client_reader = FrameReader::new(client_read, initial_frame_max);
    let now = Instant::now();
    let mut session = ClientSession::new(shared, peer, now, handshake_deadline);
    // The upstream's connection.start, read while choosing the node.
    session.upstream_read(Some(Ok(greeting)), now);

    let timer = tokio::time::sleep_until((now + Duration::from_secs(60)).into());
    tokio::pin!(timer);
    let mut busy_poll = BusyPoll::new(session.shared.busy_poll, now);
    // One wait for the shutdown signal for the whole connection, registered once: a turn
    // that polls it reads flags only (a new wait per turn would take the token's locks).
    let mut shutdown_signal = shutdown.signal();
    loop {
        handle_buffered(&mut session, &mut client_reader, &mut upstream_reader);
        // What the frames queued is written now, not a turn of the loop later: the select
        // below then waits on a socket only when it refused bytes.
        poll_fn(|cx| {
            let _ = session.client_out.poll_drain(&mut client_writer, cx);
            let _ = session.upstream_out.poll_drain(&mut upstream_writer, cx);
            Poll::Ready(())
        })
        .await;
        session.check_writers();
        if session.is_done() {
            break;
        }
        if let Some(frame_max) = session.new_frame_max.take() {
            client_reader.set_frame_max(frame_max);
            upstream_reader.set_frame_max(upstream_frame_limit(frame_max));
        }
        let read_client = session.wants_client_frames();
        let read_upstream = session.wants_upstream_frames();
        // Heartbeat silence only counts while a side is being read.
        let now = session.now;
        if !read_client {
            session.last_client_rx = now;
        }
        if !read_upstream {
            session.last_upstream_rx = now;
        }
        let write_client = session.client_out.has_work();
        let write_upstream = session.upstream_out.has_work();
        let deadline = tokio::time::Instant::from(
            session
                .next_deadline()
                .unwrap_or_else(|| now + Duration::from_secs(60)),
        );
        // A later deadline leaves the earlier timer armed (an early wake-up only re-checks),
        // so traffic that pushes heartbeat deadlines back does not re-arm the timer per frame.
        if deadline < timer.deadline() || timer.is_elapsed() {
            timer.as_mut().reset(deadline);
        }
        // What the turn counted reaches the shared metrics before the task waits.
        session.report_counts();
        let poll_again = busy_poll.should_poll(now);
        let held = session.held_for_capture.is_some();
        let judging = session.service_answer.is_some();
        let listing = session.listing_answer.is_some();
        // Outcomes come only for dead letters handed over and not yet settled.
        let awaiting = !session.ops.is_empty();
        let event = tokio::select! {
            _ = capture_declared(&mut session.capture_status), if held => Event::CaptureDeclared,
            answer = service_answer(&mut session.service_answer), if judging => {
                Event::ServiceAnswer(answer)
            }
            answer = listing_answer(&mut session.listing_answer), if listing => {
                Event::Listing(answer)
            }
            outcome = session.service_outcomes.1.recv(), if awaiting => {
                Event::ServiceOutcome(outcome)
            }
            read = client_reader.fill(), if read_client => Event::Client(read),
            read = upstream_reader.fill(), if read_upstream => Event::Upstream(read),
            _ = session.client_out.write_some(&mut client_writer), if write_client => Event::Wrote,
            _ = session.upstream_out.write_some(&mut upstream_writer), if write_upstream => Event::Wrote,
            _ = &mut timer => Event::Timer,
            _ = &mut shutdown_signal, if !session.shutdown_seen => Event::Shutdown,
            // Nothing is ready: yield to the runtime (which polls the sockets without
            // sleeping) instead of parking, while traffic is recent (`busy_poll`).
            _ = tokio::task::yield_now(), if poll_again => Event::Polled,
        };
        // One clock read per turn: every frame handled in it is stamped with this time.
        session.now = Instant::now();
        match event {
            Event::Client(read) => {
                busy_poll.traffic(session.now);
                match read {
                    Some(Ok(())) => {}
                    Some(Err(err)) => session.client_read(Some(Err(err)), session.now),
                    None => session.client_read(None, session.now),
                }
            }
            Event::Upstream(read) => {
                busy_poll.traffic(session.now);
                match read {
                    Some(Ok(())) => {}
                    Some(Err(err)) => session.upstream_read(Some(Err(err)), session.now),
                    None => session.upstream_read(None, session.now),
                }
            }
            Event::Wrote => busy_poll.traffic(session.now),
            Event::Timer => session.on_timer(session.now),
            Event::Shutdown => session.on_shutdown(),
            Event::CaptureDeclared => session.resume_held_declare(),
            Event::ServiceAnswer(answer) => session.on_service_answer(answer),
            Event::Listing(answer) => session.on_listing_answer(answer),
            Event::ServiceOutcome(outcome) => {
                // The session holds a sender itself, so the channel never ends.
                if let Some((op, outcome)) = outcome {
                    session.complete_op(op, outcome);
                }
            }
            Event::Polled => {}
        }
    }
    session.finish();
    // What is queued (a final close-ok) is written before the sockets go.
    let grace = Duration::from_secs(2);
    tokio::join!(
        session.client_out.close(&mut client_writer, grace),
        session.upstream_out.close(&mut upstream_writer, grace)
    );
}

/// Resolves once the capture objects are declared; never when there is no service
/// connection, or it stopped (the held declare's deadline ends the wait then).
async fn capture_declared(status: &mut Option<watch::Receiver<Status>>) {
    if let Some(status) = status.as_mut()
        && status.wait_for(|s| s.declared).await.is_ok()
    {
        return;
    }
    std::future::pending::<()>().await
}

/// The management API's listing for a read-back; `None` when the lookup ended without one.
async fn listing_answer(
    answer: &mut Option<oneshot::Receiver<ArgumentsListing>>,
) -> Option<ArgumentsListing> {
    match answer.as_mut() {
        Some(receiver) => receiver.await.ok(),
        None => std::future::pending().await,
    }
}

/// The declare connection's answer to this session's declare; `None` when it was lost first.
async fn service_answer(
    answer: &mut Option<oneshot::Receiver<CheckAnswer>>,
) -> Option<CheckAnswer> {
    match answer.as_mut() {
        Some(receiver) => receiver.await.ok(),
        None => std::future::pending().await,
    }
}

/// Handles frames that are already in the read buffers (a burst read in one go), up to
/// [`BUFFERED_FRAMES_PER_TURN`] turns of a pass-through run ([`super::passthrough`], at most
/// [`RUN_FRAMES`] frames) and one frame handled on its own per side, so a burst costs one
/// wake-up rather than one per frame. The same flow-control checks apply as before a socket
/// read.
fn handle_buffered<C, U>(
    session: &mut ClientSession,
    client: &mut FrameReader<C>,
    upstream: &mut FrameReader<U>,
) where
    C: AsyncRead + Unpin,
    U: AsyncRead + Unpin,
{
    for _ in 0..BUFFERED_FRAMES_PER_TURN {
        if let Some(frame_max) = session.new_frame_max.take() {
            client.set_frame_max(frame_max);
            upstream.set_frame_max(upstream_frame_limit(frame_max));
        }
        let mut handled = false;
        if session.wants_client_frames() {
            let max_frame = client.max_frame();
            if session.client_run(client.unread_mut(), max_frame, RUN_FRAMES) > 0 {
                handled = true;
            }
            if session.wants_client_frames()
                && let Some(frame) = client.buffered()
            {
                session.client_read(Some(frame), session.now);
                handled = true;
            }
        }
        if session.wants_upstream_frames() {
            let max_frame = upstream.max_frame();
            if session.upstream_run(upstream.unread_mut(), max_frame, RUN_FRAMES) > 0 {
                handled = true;
            }
            if session.wants_upstream_frames()
                && let Some(frame) = upstream.buffered()
            {
                session.upstream_read(Some(frame), session.now);
                handled = true;
            }
        }
        if !handled {
            break;
        }
    }
}
