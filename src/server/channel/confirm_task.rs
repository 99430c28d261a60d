//! Where a channel's publisher confirms are written from: its confirm gate (the
//! [`ConfirmTracker`] and whether the channel is still open, under one lock) and, once the
//! channel publishes persistent messages, one completion task that awaits their storage
//! answers.
//!
//! The channel handler records each publish under the gate ([`settle_now`] for one settled at
//! once, [`Completions::wait`] for one waiting for storage). The completion task gathers every
//! storage answer that is ready when it wakes (a group commit answers hundreds at once),
//! settles them in the tracker and writes the coalesced confirms with one push to the write
//! queue. Confirms are written under the gate's lock, so they keep sequence order whichever
//! side writes them, and none is written once the channel closed (the gate is closed before
//! the channel's close or close-ok is written), so none reaches a closed channel or a new one
//! with the same number.

use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::FutureExt;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc;

use super::confirms::{ConfirmFrame, ConfirmTracker};
use crate::amqp::codec::{put_basic_ack, put_basic_nack};
use crate::broker::write_queue::WriteQueue;
use crate::storage::Durable;

/// A channel's confirms: open while they may still be written.
#[derive(Debug)]
pub(crate) struct ConfirmState {
    open: bool,
    tracker: ConfirmTracker,
    frames: Vec<ConfirmFrame>,
}

/// See [`ConfirmState`].
pub(crate) type ConfirmGate = Arc<Mutex<ConfirmState>>;

/// The gate of a new channel (open, nothing recorded).
pub(super) fn new_gate() -> ConfirmGate {
    Arc::new(Mutex::new(ConfirmState {
        open: true,
        tracker: ConfirmTracker::default(),
        frames: Vec::new(),
    }))
}

fn lock(gate: &ConfirmGate) -> MutexGuard<'_, ConfirmState> {
    gate.lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes a channel's confirm gate (before its channel.close or close-ok is written): nothing
/// recorded is confirmed any more.
pub(super) fn close_gate(gate: &ConfirmGate) {
    let mut state = lock(gate);
    state.open = false;
    state.tracker.clear();
}

/// Records publish `seq` as settled now (acked when `ok`) and writes what may be told.
pub(super) fn settle_now(gate: &ConfirmGate, out: &WriteQueue, ch: u16, seq: u64, ok: bool) {
    let mut state = lock(gate);
    if state.open {
        state.tracker.settled(seq, ok);
        write_ready(&mut state, out, ch);
    }
}

/// Takes the confirms the tracker can tell and writes them in one push (under the gate lock).
fn write_ready(state: &mut ConfirmState, out: &WriteQueue, ch: u16) {
    let ConfirmState {
        tracker, frames, ..
    } = state;
    tracker.take_ready(frames);
    if frames.is_empty() {
        return;
    }
    out.push(|o| {
        for frame in frames.iter() {
            match *frame {
                ConfirmFrame::Ack { tag, multiple } => put_basic_ack(o, ch, tag, multiple),
                ConfirmFrame::Nack { tag } => put_basic_nack(o, ch, tag, false, false),
            }
        }
    });
    frames.clear();
}

/// The sending side of a channel's completion task (the task ends once this is dropped and
/// every storage answer it was given has come, or once the channel closed).
#[derive(Debug)]
pub(super) struct Completions {
    tx: mpsc::UnboundedSender<(u64, Durable)>,
}

impl Completions {
    /// Starts the completion task of channel `ch`.
    pub(super) fn start(gate: ConfirmGate, out: Arc<WriteQueue>, ch: u16) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(gate, out, ch, rx));
        Completions { tx }
    }

    /// Records publish `seq` as waiting for `durable` (confirmed once it answers).
    pub(super) fn wait(&self, gate: &ConfirmGate, seq: u64, durable: Durable) {
        let mut state = lock(gate);
        if !state.open {
            return;
        }
        state.tracker.pending(seq);
        // Sent under the lock, so the task cannot see an answer before the publish is recorded.
        let _ = self.tx.send((seq, durable));
    }
}

/// The storage answer for publish `seq` (a dropped answer is a failed write).
async fn answer(seq: u64, durable: Durable) -> (u64, bool) {
    (seq, durable.await.unwrap_or(false))
}

async fn run(
    gate: ConfirmGate,
    out: Arc<WriteQueue>,
    ch: u16,
    mut rx: mpsc::UnboundedReceiver<(u64, Durable)>,
) {
    let mut waiting = FuturesUnordered::new();
    let mut answered: Vec<(u64, bool)> = Vec::new();
    let mut receiving = true;
    loop {
        if !receiving && waiting.is_empty() {
            return;
        }
        tokio::select! {
            Some(answer) = waiting.next(), if !waiting.is_empty() => answered.push(answer),
            next = rx.recv(), if receiving => match next {
                Some((seq, durable)) => {
                    waiting.push(answer(seq, durable));
                    continue;
                }
                None => {
                    receiving = false;
                    continue;
                }
            },
        }
        // Everything else already answered joins this write.
        while let Ok((seq, durable)) = rx.try_recv() {
            waiting.push(answer(seq, durable));
        }
        while let Some(Some(answer)) = waiting.next().now_or_never() {
            answered.push(answer);
        }
        let mut state = lock(&gate);
        if !state.open {
            return;
        }
        for (seq, stored) in answered.drain(..) {
            state.tracker.complete(seq, stored);
        }
        write_ready(&mut state, &out, ch);
    }
}
