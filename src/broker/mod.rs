//! The embedded broker core: vhosts, exchanges and routing, queues, consumers, users and
//! permissions. Plain data structures driven by the connection tasks in [`crate::server`].
//!
//! All broker state sits behind one mutex (`Broker::state`); a connection task parses a
//! method, takes the lock, runs the operation and releases it. Deliveries are written into the
//! consumer connection's [`write_queue::WriteQueue`] under the lock, so publish → route → enqueue →
//! deliver happens in one step with no hand-off. Messages that die (rejected, expired, over a
//! length or delivery limit) are collected as [`queue::Death`]s and handed to
//! [`dead_letter_routing`], which rewrites and re-routes them. Deliveries held past their
//! consumer timeout ([`ack_timeout`]) are found by the same timer task and handed to their
//! connection task, which closes the channel.

pub mod ack_timeout;
pub mod auth;
pub mod dead_letter_routing;
pub mod delivery;
pub mod message;
pub mod methods;
pub mod paging;
pub mod persistence;
pub mod queue;
pub mod retry_hold;
pub mod routing;
pub mod vhost;
pub mod write_queue;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use crate::deadletter::DeadLetterOptions;
use crate::metrics::Metrics;
use crate::policy::PolicySet;
use message::QueuedMessage;
use vhost::VHost;
use write_queue::WriteQueue;

/// Settings the broker takes from the configuration.
#[derive(Clone, Debug)]
pub struct BrokerOptions {
    pub dead_letter: DeadLetterOptions,
    pub default_delivery_limit: Option<u64>,
    pub max_queues: usize,
    /// `limits.max_exchanges` (declared exchanges per vhost).
    pub max_exchanges: usize,
    /// `limits.max_bindings` (per vhost).
    pub max_bindings: usize,
    /// `limits.max_consumers_per_channel`.
    pub max_consumers_per_channel: usize,
    /// `limits.consumer_timeout` (ms; None = off), lowered per queue by `x-consumer-timeout`
    /// or the policy's `consumer-timeout`.
    pub consumer_timeout: Option<u64>,
    /// `dead_letter.ttl_on_dead_letters = false`: messages with an x-death history do not
    /// expire in the queue they reached.
    pub keep_dead_letters: bool,
}

/// A delivery waiting for ack/reject on a channel.
#[derive(Debug)]
pub struct Unacked {
    /// The queue's name, shared with the queue (no allocation per delivery).
    pub queue: Arc<str>,
    pub queue_id: u64,
    pub entry: QueuedMessage,
    /// The consumer it went to ([`vhost::Consumer::id`]); `None` for a basic.get.
    pub consumer: Option<u64>,
    /// When it times out unacknowledged (its queue or `limits.consumer_timeout` has a
    /// consumer timeout).
    pub deadline: Option<ack_timeout::Deadline>,
}

/// Delivery state of one open channel.
#[derive(Debug)]
pub struct ChannelState {
    pub vhost: String,
    pub next_tag: u64,
    pub unacked: BTreeMap<u64, Unacked>,
    /// basic.qos(global=false): prefetch of consumers created from now on.
    pub consumer_prefetch: u16,
    /// basic.qos(global=true): limit shared by the channel's consumers.
    pub channel_prefetch: u16,
    /// Consumer tag → queue name.
    pub consumers: HashMap<String, String>,
    /// channel.flow from the client.
    pub active: bool,
    /// Deadlines of the unacked deliveries that have a consumer timeout.
    pub ack_deadlines: ack_timeout::AckDeadlines,
    /// The deadline this channel has in the broker's consumer-timeout heap, if any.
    pub ack_timer_at: Option<u64>,
}

/// A connection as the broker sees it.
#[derive(Debug)]
pub struct ConnectionState {
    pub write_queue: Arc<WriteQueue>,
    pub frame_max: usize,
    pub user: String,
    pub vhost: String,
    /// Wakes the connection task when one of its channels may have timed out.
    pub ack_alarm: Arc<Notify>,
    /// Channels the timer found past a consumer timeout, for the connection task to close.
    pub ack_due: Vec<u16>,
    /// The client announced `consumer_cancel_notify`: a consumer whose queue is deleted is
    /// told with basic.cancel (otherwise, as RabbitMQ, it just ends).
    pub cancel_notify: bool,
}

/// Broker milliseconds start here rather than at 0, so that an instant before the start (when
/// a recovered message entered its queue, up to 34 years back) is still a broker time.
const CLOCK_BASE_MS: u64 = 1 << 40;

/// Timer entry: a queue whose head expires (or that may expire itself) at a deadline.
type TimerEntry = Reverse<(u64, String, String, u64)>;

/// Everything under the broker lock.
pub struct State {
    pub vhosts: HashMap<String, VHost>,
    pub connections: HashMap<u64, ConnectionState>,
    pub channels: HashMap<(u64, u16), ChannelState>,
    pub policies: PolicySet,
    pub options: BrokerOptions,
    timers: BinaryHeap<TimerEntry>,
    /// (deadline, connection, channel): channels whose earliest consumer timeout is due then.
    ack_timers: BinaryHeap<Reverse<(u64, u64, u16)>>,
    next_id: u64,
    /// (vhost, queue, cause) → last time a drop was logged (rate limit: once a minute).
    drop_log: HashMap<(String, String, &'static str), u64>,
    /// Durable queues the message being enqueued went into (filled by `enqueue`, taken by
    /// the publish or dead-letter step that writes its storage record).
    pub(crate) persist_targets: Vec<crate::storage::Target>,
    /// The last definitions snapshot handed to storage (rewritten only when it changes).
    pub(crate) stored_definitions: Option<crate::storage::Definitions>,
    /// Stored definitions that could not be restored (their vhost is gone from the config):
    /// kept in every snapshot, with their messages, until they can be.
    pub(crate) unrestored_definitions: crate::storage::Definitions,
    /// Policies set at run time, kept in the definitions snapshot (restored at start).
    pub(crate) runtime_policies: Vec<crate::config::PolicyConfig>,
}

/// The embedded broker.
pub struct Broker {
    state: Mutex<State>,
    epoch: Instant,
    epoch_wall_ms: u64,
    timer_wake: Notify,
    pub metrics: Arc<Metrics>,
    /// Durable storage, once attached (embedded mode with `storage.dir` set).
    storage: std::sync::OnceLock<Arc<crate::storage::Storage>>,
    /// The paging account of the queues that keep messages on disk (with storage).
    paging: std::sync::OnceLock<Arc<paging::Paging>>,
}

impl Broker {
    pub fn new(
        vhosts: &[String],
        policies: PolicySet,
        options: BrokerOptions,
        metrics: Arc<Metrics>,
    ) -> Arc<Broker> {
        let vhosts = vhosts.iter().map(|v| (v.clone(), VHost::new(v))).collect();
        let epoch_wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Arc::new(Broker {
            state: Mutex::new(State {
                vhosts,
                connections: HashMap::new(),
                channels: HashMap::new(),
                policies,
                options,
                timers: BinaryHeap::new(),
                ack_timers: BinaryHeap::new(),
                next_id: 1,
                drop_log: HashMap::new(),
                persist_targets: Vec::new(),
                stored_definitions: None,
                unrestored_definitions: Default::default(),
                runtime_policies: Vec::new(),
            }),
            epoch: Instant::now(),
            epoch_wall_ms,
            timer_wake: Notify::new(),
            metrics,
            storage: std::sync::OnceLock::new(),
            paging: std::sync::OnceLock::new(),
        })
    }

    /// New `limits.max_queues`, `max_exchanges` and `max_bindings` (a reload): later declares
    /// and binds are held to them; nothing that exists goes.
    pub fn set_definition_limits(&self, queues: usize, exchanges: usize, bindings: usize) {
        let mut st = self.lock();
        st.options.max_queues = queues;
        st.options.max_exchanges = exchanges;
        st.options.max_bindings = bindings;
    }

    /// The queues, declared exchanges and bindings of every vhost (the gauges
    /// [`Metrics::set_definitions`] shows when scraped).
    pub fn definition_counts(&self) -> (usize, usize, usize) {
        let st = self.lock();
        st.vhosts.values().fold((0, 0, 0), |(q, x, b), v| {
            (
                q + v.queues.len(),
                x + v.declared_exchanges(),
                b + v.binding_count(),
            )
        })
    }

    /// Takes the broker lock. A panic while holding it cannot leave a half-updated queue
    /// (operations are written to finish or not start), so a poisoned lock is recovered.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Broker milliseconds (monotonic; `CLOCK_BASE_MS` at the start).
    pub fn now(&self) -> u64 {
        CLOCK_BASE_MS + self.epoch.elapsed().as_millis() as u64
    }

    /// Wall-clock Unix milliseconds of broker time `now`.
    pub fn wall_ms(&self, now: u64) -> u64 {
        (self.epoch_wall_ms + now).saturating_sub(CLOCK_BASE_MS)
    }

    /// Wall-clock seconds for x-death `time`.
    pub fn wall_secs(&self, now: u64) -> u64 {
        self.wall_ms(now) / 1000
    }

    /// The broker time of wall-clock Unix milliseconds `wall_ms` (0 when too far back).
    pub fn broker_ms(&self, wall_ms: u64) -> u64 {
        (wall_ms + CLOCK_BASE_MS).saturating_sub(self.epoch_wall_ms)
    }

    /// Runs queue timers (message expiry, queue expiry) due at `now`; returns the next
    /// deadline.
    pub fn run_timers(&self) -> Option<u64> {
        let now = self.now();
        let mut st = self.lock();
        let mut due = Vec::new();
        while let Some(Reverse((at, _, _, _))) = st.timers.peek() {
            if *at > now {
                break;
            }
            if let Some(Reverse((_, vhost, queue, id))) = st.timers.pop() {
                due.push((vhost, queue, id));
            }
        }
        for (vhost, queue, id) in due {
            methods::on_timer(self, &mut st, &vhost, &queue, id, now);
        }
        methods::on_ack_timers(&mut st, now);
        let queues = st.timers.peek().map(|Reverse((at, _, _, _))| *at);
        let acks = st.ack_timers.peek().map(|Reverse((at, _, _))| *at);
        crate::policy::lower(queues, acks)
    }

    /// Background task: wakes for the earliest queue deadline (one timer for the whole
    /// broker, never one per message).
    pub async fn timer_loop(self: Arc<Self>, mut shutdown: crate::shutdown::Shutdown) {
        loop {
            let next = self.run_timers();
            let sleep = match next {
                Some(at) => {
                    let now = self.now();
                    std::time::Duration::from_millis(at.saturating_sub(now).max(1))
                }
                None => std::time::Duration::from_secs(3600),
            };
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                _ = self.timer_wake.notified() => {}
                _ = shutdown.recv() => return,
            }
        }
    }

    fn wake_timers(&self) {
        self.timer_wake.notify_one();
    }
}

impl State {
    /// Queue `queue` of vhost `vhost`, if both exist.
    pub fn queue_mut(&mut self, vhost: &str, queue: &str) -> Option<&mut vhost::Queue> {
        self.vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue))
    }

    pub fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Registers a channel's earliest consumer-timeout deadline unless it already has an
    /// earlier one in the heap; returns true if it is the new earliest deadline of all.
    pub(crate) fn schedule_ack(&mut self, conn: u64, channel: u16) -> bool {
        let Some(ch) = self.channels.get_mut(&(conn, channel)) else {
            return false;
        };
        let Some(at) = ch.ack_deadlines.earliest() else {
            return false;
        };
        if ch.ack_timer_at.is_some_and(|t| t <= at) {
            return false;
        }
        ch.ack_timer_at = Some(at);
        // Entries of closed channels stay until their deadline: when they outnumber the live
        // channels, the heap is rebuilt from the channels' own deadlines (bounded).
        if self.ack_timers.len() > 2 * self.channels.len() + 64 {
            self.ack_timers = self
                .channels
                .iter()
                .filter_map(|(&(c, n), ch)| ch.ack_timer_at.map(|t| Reverse((t, c, n))))
                .filter(|entry| entry.0 != (at, conn, channel))
                .collect();
        }
        let earliest = self
            .timers
            .peek()
            .is_none_or(|Reverse((first, _, _, _))| at < *first)
            && self
                .ack_timers
                .peek()
                .is_none_or(|Reverse((first, _, _))| at < *first);
        self.ack_timers.push(Reverse((at, conn, channel)));
        earliest
    }

    /// Registers a deadline for a queue; returns true if it is the new earliest one.
    pub fn schedule(&mut self, at: u64, vhost: &str, queue: &str, id: u64) -> bool {
        // Entries of deleted queues, and later ones a queue replaced by an earlier deadline,
        // stay until they are due: when they outnumber the live queues, the heap is rebuilt
        // from the queues' own deadlines (bounded whatever a client declares and deletes).
        let live: usize = self.vhosts.values().map(|v| v.queues.len()).sum();
        if self.timers.len() > 2 * live + 64 {
            self.timers = self
                .vhosts
                .iter()
                .flat_map(|(vname, v)| {
                    v.queues.iter().filter_map(move |(qname, q)| {
                        q.timer_at
                            .map(|t| Reverse((t, vname.clone(), qname.clone(), q.id)))
                    })
                })
                .filter(|Reverse((t, v, q, i))| {
                    (*t, v.as_str(), q.as_str(), *i) != (at, vhost, queue, id)
                })
                .collect();
        }
        let earliest = self
            .timers
            .peek()
            .is_none_or(|Reverse((first, _, _, _))| at < *first);
        self.timers
            .push(Reverse((at, vhost.to_string(), queue.to_string(), id)));
        earliest
    }

    /// True when a drop for (vhost, queue, cause) should be logged (once a minute).
    pub fn should_log_drop(
        &mut self,
        vhost: &str,
        queue: &str,
        cause: &'static str,
        now: u64,
    ) -> bool {
        let key = (vhost.to_string(), queue.to_string(), cause);
        match self.drop_log.get(&key) {
            Some(last) if now.saturating_sub(*last) < 60_000 => false,
            _ => {
                if self.drop_log.len() > 10_000 {
                    self.drop_log.clear();
                }
                self.drop_log.insert(key, now);
                true
            }
        }
    }
}
