//! The context one scenario runs in: unique names (`<local>.dlxh<10 hex>`), its own
//! connections, the topology and policies it created (deleted afterwards from a fresh
//! connection), and the harness's primitives: publish and wait for the confirm, bounded
//! `basic.get` polling with a quiet window, consume until n deliveries, passive-declare counts,
//! error capture (the receiving side is in [`super::receive`]). What a scenario observes goes
//! into `obs`; `info` keeps notes for a failure message (full reply texts, policy hook output).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use amq_protocol::types::{AMQPValue, FieldTable};
use lapin::message::Delivery;
use lapin::options::*;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::observe;
use super::tap::Tap;
use super::target::Target;

/// How a scenario step failed when it was not expecting to: a lapin error, or a step that
/// could not go on (a delivery missing, a policy hook failing). Recorded as
/// `unexpected_error`, which the recording never contains.
#[derive(Debug)]
pub enum Failure {
    Amqp(lapin::Error),
    Other(String),
}

impl From<lapin::Error> for Failure {
    fn from(e: lapin::Error) -> Self {
        Failure::Amqp(e)
    }
}

impl Failure {
    pub fn observation(&self) -> Value {
        match self {
            Failure::Amqp(e) => observe::error(e),
            Failure::Other(what) => json!({"error": "exception", "type": what}),
        }
    }
}

pub type Outcome = Result<(), Failure>;

/// Seconds as a `Duration`.
pub(super) fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// The poll step of `basic.get` loops.
pub(super) const POLL_STEP: Duration = Duration::from_millis(10);
/// How long a poll waits for the expected messages.
pub const POLL_LIMIT: f64 = 3.0;

/// How long a scenario has spent in the policy hook, and whether it is in it now.
#[derive(Default)]
pub struct HookClock {
    pub spent_millis: AtomicU64,
    pub busy: AtomicBool,
}

/// A channel and the number of the scenario's connection it is on (the tap records
/// deliveries by connection and channel). Derefs to the lapin channel.
#[derive(Clone)]
pub struct Ch {
    channel: Channel,
    conn: usize,
}

impl std::ops::Deref for Ch {
    type Target = Channel;
    fn deref(&self) -> &Channel {
        &self.channel
    }
}

/// A delivery and its content header's raw properties (from the tap). Derefs to the delivery.
pub struct Msg {
    delivery: Delivery,
    raw: Option<Vec<u8>>,
}

impl std::ops::Deref for Msg {
    type Target = Delivery;
    fn deref(&self) -> &Delivery {
        &self.delivery
    }
}

pub struct Ctx {
    pub target: Arc<Target>,
    /// The relay the scenario's connections go through.
    tap: Tap,
    /// The random part of every name, `dlxh` + 10 hex digits.
    pub rand: String,
    queues: Vec<String>,
    exchanges: Vec<String>,
    policies: Vec<String>,
    conns: Vec<Connection>,
    main: Option<usize>,
    pub(super) consumer_tags: u32,
    /// Time spent in the policy hook: not counted toward the scenario's time limit, which is
    /// there to stop a hung server (`rabbitmqctl` starts a VM per call).
    pub hook: Arc<HookClock>,
    pub obs: Map<String, Value>,
    pub info: Vec<String>,
}

/// A fresh random suffix (no two scenarios of any run share one).
fn random_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = format!(
        "{}-{}-{:?}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
    );
    format!("dlxh{}", &observe::sha256_hex(seed.as_bytes())[..10])
}

impl Ctx {
    /// A context whose connections go through `tap` (its own: connections are numbered in
    /// the order the tap accepts them).
    pub fn new(target: Arc<Target>, tap: Tap) -> Ctx {
        Ctx {
            target,
            tap,
            rand: random_suffix(),
            queues: Vec::new(),
            exchanges: Vec::new(),
            policies: Vec::new(),
            conns: Vec::new(),
            main: None,
            consumer_tags: 0,
            hook: Arc::new(HookClock::default()),
            obs: Map::new(),
            info: Vec::new(),
        }
    }

    // ---- naming and observations --------------------------------------------------------

    /// The scenario's name for a local name: `local.dlxh…`.
    pub fn n(&self, local: &str) -> String {
        format!("{local}.{}", self.rand)
    }

    /// Records an observation.
    pub fn set(&mut self, key: &str, value: impl Into<Value>) {
        self.obs.insert(key.to_string(), value.into());
    }

    /// A delivery as the recording shows it (properties and headers decoded from the wire).
    pub fn msg(&self, m: &Msg) -> Result<Value, Failure> {
        let raw = m.raw.as_deref().ok_or_else(|| {
            Failure::Other(format!(
                "the tap recorded no content header for delivery {}",
                m.delivery_tag
            ))
        })?;
        observe::message(m, raw, &self.target.username).map_err(Failure::Other)
    }

    /// The same with `"from": queue` (which queue a hop was read from).
    pub fn msg_from(&self, m: &Msg, queue: &str) -> Result<Value, Failure> {
        let mut v = self.msg(m)?;
        v["from"] = json!(queue);
        Ok(v)
    }

    /// [`Ctx::msg`] of a delivery that may not have come (`null` then).
    pub fn msg_or_null(&self, m: Option<&Msg>) -> Result<Value, Failure> {
        m.map(|m| self.msg(m)).unwrap_or(Ok(Value::Null))
    }

    /// Pairs a delivery on `ch` with its raw properties.
    pub(super) fn with_raw(&self, ch: &Ch, delivery: Delivery) -> Msg {
        let raw = self.tap.take(ch.conn, ch.id(), delivery.delivery_tag);
        Msg { delivery, raw }
    }

    fn note_error(&mut self, e: &lapin::Error) {
        self.info.push(format!("{e}"));
    }

    /// `"ok"` on success, else the error observation (noted).
    pub fn outcome(&mut self, result: Result<(), Failure>) -> Value {
        match result {
            Ok(()) => json!("ok"),
            Err(Failure::Amqp(e)) => {
                self.note_error(&e);
                observe::error(&e)
            }
            Err(other) => {
                self.info.push(format!("{other:?}"));
                other.observation()
            }
        }
    }

    // ---- connections and channels -------------------------------------------------------

    /// A new connection of this scenario (closed when it ends); returns its index.
    pub async fn connect(&mut self) -> Result<usize, Failure> {
        let uri = format!("amqp://guest:guest@{}/%2f", self.tap.addr);
        let conn = Connection::connect(&uri, ConnectionProperties::default()).await?;
        self.conns.push(conn);
        Ok(self.conns.len() - 1)
    }

    pub fn connection(&self, index: usize) -> &Connection {
        &self.conns[index]
    }

    /// The scenario's main connection (reopened when it was closed).
    pub async fn main_conn(&mut self) -> Result<usize, Failure> {
        match self.main {
            Some(i) if self.conns[i].status().connected() => Ok(i),
            _ => {
                let i = self.connect().await?;
                self.main = Some(i);
                Ok(i)
            }
        }
    }

    /// A channel on the main connection in confirm mode.
    pub async fn channel(&mut self) -> Result<Ch, Failure> {
        let i = self.main_conn().await?;
        self.channel_on(i, true).await
    }

    /// A channel on the main connection without confirms.
    pub async fn plain_channel(&mut self) -> Result<Ch, Failure> {
        let i = self.main_conn().await?;
        self.channel_on(i, false).await
    }

    /// A channel on connection `conn`, in confirm mode when `confirm`.
    pub async fn channel_on(&mut self, conn: usize, confirm: bool) -> Result<Ch, Failure> {
        let channel = self.conns[conn].create_channel().await?;
        if confirm {
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
        }
        Ok(Ch { channel, conn })
    }

    // ---- topology (tracked for cleanup) -------------------------------------------------

    /// Declares queue `local.dlxh…` (non-durable) with `args`.
    pub async fn queue(
        &mut self,
        ch: &Channel,
        local: &str,
        args: FieldTable,
    ) -> Result<String, Failure> {
        self.queue_with(ch, local, args, QueueDeclareOptions::default())
            .await
    }

    pub async fn queue_with(
        &mut self,
        ch: &Channel,
        local: &str,
        args: FieldTable,
        options: QueueDeclareOptions,
    ) -> Result<String, Failure> {
        let name = self.n(local);
        if !self.queues.contains(&name) {
            self.queues.push(name.clone());
        }
        ch.queue_declare(name.as_str().into(), options, args)
            .await?;
        Ok(name)
    }

    /// A quorum queue (durable, `x-queue-type = quorum` plus `args`).
    pub async fn qq(
        &mut self,
        ch: &Channel,
        local: &str,
        args: FieldTable,
    ) -> Result<String, Failure> {
        let mut all = FieldTable::default();
        all.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        for (k, v) in args.inner() {
            all.insert(k.clone(), v.clone());
        }
        let options = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        self.queue_with(ch, local, all, options).await
    }

    /// Declares exchange `local.dlxh…`.
    pub async fn exchange(
        &mut self,
        ch: &Channel,
        local: &str,
        kind: ExchangeKind,
    ) -> Result<String, Failure> {
        let name = self.n(local);
        if !self.exchanges.contains(&name) {
            self.exchanges.push(name.clone());
        }
        ch.exchange_declare(
            name.as_str().into(),
            kind,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
        Ok(name)
    }

    pub async fn bind(&mut self, ch: &Channel, queue: &str, exchange: &str, key: &str) -> Outcome {
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        Ok(())
    }

    // ---- publishing ---------------------------------------------------------------------

    /// Publishes on a confirm channel: `"ack"`, `"nack"`, `"returned"` or an error observation.
    pub async fn publish(&mut self, ch: &Channel, exchange: &str, key: &str, body: &str) -> Value {
        self.publish_with(
            ch,
            exchange,
            key,
            body.as_bytes(),
            BasicProperties::default(),
        )
        .await
    }

    /// The same with properties.
    pub async fn publish_with(
        &mut self,
        ch: &Channel,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Value {
        self.publish_full(ch, exchange, key, body, props, false)
            .await
            .0
    }

    /// The same, optionally mandatory; also returns the routing keys of returned messages.
    pub async fn publish_full(
        &mut self,
        ch: &Channel,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
        mandatory: bool,
    ) -> (Value, Vec<String>) {
        let options = BasicPublishOptions {
            mandatory,
            immediate: false,
        };
        let confirmed = async {
            ch.basic_publish(exchange.into(), key.into(), options, body, props)
                .await?
                .await
        }
        .await;
        match confirmed {
            Ok(Confirmation::Nack(returned)) => {
                let keys = returned.iter().map(|r| r.routing_key.to_string()).collect();
                (json!("nack"), keys)
            }
            Ok(Confirmation::Ack(Some(returned))) => {
                (json!("returned"), vec![returned.routing_key.to_string()])
            }
            Ok(Confirmation::Ack(None) | Confirmation::NotRequested) => (json!("ack"), Vec::new()),
            Err(e) => {
                self.note_error(&e);
                (observe::error(&e), Vec::new())
            }
        }
    }

    /// Publishes and records the outcome as `publish`.
    pub async fn record_publish(&mut self, ch: &Channel, exchange: &str, key: &str, body: &str) {
        let p = self.publish(ch, exchange, key, body).await;
        self.set("publish", p);
    }

    /// Publishes each body to `exchange` with key `rk`; records the list as `publish`.
    pub async fn record_publishes(&mut self, ch: &Channel, exchange: &str, bodies: &[&str]) {
        let mut out = Vec::new();
        for b in bodies {
            out.push(self.publish(ch, exchange, "rk", b).await);
        }
        self.set("publish", out);
    }

    // ---- policies -----------------------------------------------------------------------

    /// Sets policy `pol-<local>.dlxh…` (priority 100, queues) through the target's own means.
    pub async fn policy(
        &mut self,
        local: &str,
        pattern: &str,
        definition: Value,
    ) -> Result<String, Failure> {
        let name = self.n(&format!("pol-{local}"));
        if !self.policies.contains(&name) {
            self.policies.push(name.clone());
        }
        let started = Instant::now();
        self.hook.busy.store(true, Ordering::SeqCst);
        let result = self.target.set_policy(&name, pattern, definition).await;
        let spent = started.elapsed().as_millis() as u64;
        self.hook.spent_millis.fetch_add(spent, Ordering::SeqCst);
        self.hook.busy.store(false, Ordering::SeqCst);
        let note = result.map_err(Failure::Other)?;
        self.info.push(format!("policy set: {note}"));
        Ok(name)
    }

    // ---- teardown -----------------------------------------------------------------------

    /// Closes the scenario's connections, then deletes its queues and exchanges from a fresh
    /// connection and clears its policies. Returns what could not be cleaned up.
    pub async fn finish(&mut self) -> Vec<String> {
        for conn in self.conns.drain(..) {
            if conn.status().connected() {
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), conn.close(200, "done".into()))
                        .await;
            }
        }
        self.main = None;
        let mut errors = Vec::new();
        let cleanup =
            tokio::time::timeout(Duration::from_secs(5), self.delete_topology(&mut errors)).await;
        if cleanup.is_err() {
            errors.push("cleanup connection: timed out".into());
        }
        for name in std::mem::take(&mut self.policies) {
            if let Err(e) = self.target.clear_policy(&name).await {
                errors.push(format!("policy {name}: {e}"));
            }
        }
        errors
    }

    async fn delete_topology(&self, errors: &mut Vec<String>) {
        let conn =
            match Connection::connect(&self.target.uri, ConnectionProperties::default()).await {
                Ok(conn) => conn,
                Err(e) => return errors.push(format!("cleanup connection: {e}")),
            };
        let mut ch = match conn.create_channel().await {
            Ok(ch) => ch,
            Err(e) => return errors.push(format!("cleanup channel: {e}")),
        };
        let queues = self.queues.iter().map(|q| ("queue", q));
        let exchanges = self.exchanges.iter().map(|x| ("exchange", x));
        for (kind, name) in queues.chain(exchanges) {
            let deleted = if kind == "queue" {
                ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .map(drop)
            } else {
                ch.exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                    .await
            };
            if let Err(e) = deleted {
                errors.push(format!("{kind} {name}: {e}"));
                match conn.create_channel().await {
                    Ok(c) => ch = c,
                    Err(_) => return,
                }
            }
        }
        let _ = conn.close(200, "done".into()).await;
    }
}

/// The `i`-th item, or a failure naming what is missing (a delivery that did not come).
pub fn nth<'a, T>(items: &'a [T], i: usize, what: &str) -> Result<&'a T, Failure> {
    items
        .get(i)
        .ok_or_else(|| Failure::Other(format!("IndexError: {what}[{i}] of {}", items.len())))
}
