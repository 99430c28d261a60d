//! `ping`: one producer connection and one consumer connection on one queue, one message in
//! flight at a time: publish, wait until it is delivered (with `--confirms on` also until its
//! publish is confirmed), ack it, publish the next. Reports round-trip percentiles and the rate
//! this gives, free of the queueing that pipelined runs add to their latencies. Uses the raw
//! client unless `--client lapin`, so the client adds as little as possible to the round trip.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

use super::{Watch, message_total, name, rate, secs_between};
use crate::client::{self, QueueArgs, now_nanos};
use crate::payload::{self, IdTracker, Latencies, Stamp};
use crate::report::Report;
use crate::{ClientKind, Common, raw};

/// A producer and a consumer on the same queue.
enum Pair {
    Raw(Box<RawPair>),
    Lapin(Box<LapinPair>),
}

struct RawPair {
    publisher: raw::Publisher,
    subscriber: raw::Subscriber,
}

struct LapinPair {
    producer: (Connection, Channel),
    consumer_conn: Connection,
    consumer: lapin::Consumer,
    routing_key: lapin::types::ShortString,
    nacked: u64,
}

/// One finished round trip: the body that came back and when the round trip was complete.
struct Returned {
    body: Vec<u8>,
    done_nanos: u64,
}

impl Pair {
    async fn open(c: &Common, kind: ClientKind, queue: &str) -> Result<Pair> {
        let confirms = c.confirms_on();
        match kind {
            ClientKind::Raw => {
                let subscriber =
                    raw::Subscriber::open(&c.url, "ping consumer", queue, c.prefetch).await?;
                let publisher = raw::Publisher::open(
                    &c.url,
                    "ping producer",
                    0,
                    queue,
                    c.size,
                    confirms,
                    c.persistent,
                )
                .await?;
                Ok(Pair::Raw(Box::new(RawPair {
                    publisher,
                    subscriber,
                })))
            }
            ClientKind::Lapin => {
                let (consumer_conn, ch) = client::open_channel(&c.url, "ping consumer").await?;
                ch.basic_qos(c.prefetch, BasicQosOptions::default()).await?;
                let consumer = ch
                    .basic_consume(
                        client::short(queue)?,
                        client::short("ping-consumer")?,
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .with_context(|| format!("basic.consume on {queue}"))?;
                let producer = client::open_channel(&c.url, "ping producer").await?;
                if confirms {
                    producer
                        .1
                        .confirm_select(ConfirmSelectOptions::default())
                        .await?;
                }
                Ok(Pair::Lapin(Box::new(LapinPair {
                    producer,
                    consumer_conn,
                    consumer,
                    routing_key: client::short(queue)?,
                    nacked: 0,
                })))
            }
        }
    }

    /// Publishes message `seq`, waits for its delivery (and confirm), then acks it.
    async fn round_trip(&mut self, seq: u64, size: usize, confirms: bool) -> Result<Returned> {
        match self {
            Pair::Raw(raw_pair) => {
                let RawPair {
                    publisher,
                    subscriber,
                } = raw_pair.as_mut();
                publisher.put_message(seq)?;
                publisher.flush().await?;
                let delivery = if confirms {
                    let (delivery, ()) =
                        tokio::try_join!(subscriber.next_delivery(), publisher.wait_confirms(0))?;
                    delivery
                } else {
                    subscriber.next_delivery().await?
                };
                let done_nanos = now_nanos();
                subscriber.put_ack(delivery.delivery_tag, false)?;
                subscriber.flush().await?;
                Ok(Returned {
                    body: delivery.body,
                    done_nanos,
                })
            }
            Pair::Lapin(lapin_pair) => {
                let LapinPair {
                    producer,
                    consumer,
                    routing_key,
                    nacked,
                    ..
                } = lapin_pair.as_mut();
                let body = payload::encode(
                    Stamp {
                        sent_nanos: now_nanos(),
                        producer: 0,
                        seq,
                    },
                    size,
                );
                let confirm = producer
                    .1
                    .basic_publish(
                        "".into(),
                        routing_key.clone(),
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default(),
                    )
                    .await
                    .context("basic.publish")?;
                let next = if confirms {
                    let (confirmation, next) = tokio::join!(confirm, consumer.next());
                    if confirmation
                        .context("waiting for a publisher confirm")?
                        .is_nack()
                    {
                        *nacked += 1;
                    }
                    next
                } else {
                    consumer.next().await
                };
                let delivery = next
                    .ok_or_else(|| anyhow!("the consumer ended"))?
                    .context("consumer stream")?;
                let done_nanos = now_nanos();
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .context("basic.ack")?;
                Ok(Returned {
                    body: delivery.data,
                    done_nanos,
                })
            }
        }
    }

    fn nacked(&self) -> u64 {
        match self {
            Pair::Raw(raw_pair) => raw_pair.publisher.confirms.as_ref().map_or(0, |c| c.nacked),
            Pair::Lapin(lapin_pair) => lapin_pair.nacked,
        }
    }

    async fn close(self) {
        match self {
            Pair::Raw(raw_pair) => {
                let RawPair {
                    publisher,
                    subscriber,
                } = *raw_pair;
                publisher.close().await;
                subscriber.close().await;
            }
            Pair::Lapin(lapin_pair) => {
                client::close(&lapin_pair.producer.0).await;
                client::close(&lapin_pair.consumer_conn).await;
            }
        }
    }
}

pub async fn run(c: &Common, warmup: u64) -> Result<Report> {
    let kind = c.client_or(ClientKind::Raw);
    let confirms = c.confirms_on();
    let mut report = Report::new("ping", &c.label);
    report.set("producers", 1u64);
    report.set("consumers", 1u64);
    report.set("size_bytes", c.size as u64);
    report.set("confirms", if confirms { "on" } else { "off" });
    report.set("client", kind.name());
    report.set("warmup", warmup);
    let queue = name("ping");
    let setup = client::connect(&c.url, "setup").await?;
    client::fresh_queue(&setup, &queue, &QueueArgs::default()).await?;
    let mut pair = Pair::open(c, kind, &queue).await?;

    let rounds = message_total(c, 10_000);
    let until = match (rounds, c.seconds) {
        (None, Some(s)) => Some(Instant::now() + Duration::from_secs_f64(s.max(0.0))),
        _ => None,
    };
    let mut ids = IdTracker::default();
    let mut rtts = Latencies::default();
    let mut seq = 0u64;
    let mut measured = 0u64;
    let mut watch = None;
    let mut started_nanos = now_nanos();
    let outcome: Result<()> = async {
        loop {
            let measuring = seq >= warmup;
            if measuring && watch.is_none() {
                watch = Some(Watch::start(c.pid));
                started_nanos = now_nanos();
            }
            if measuring
                && (rounds.is_some_and(|n| measured >= n)
                    || until.is_some_and(|t| Instant::now() >= t))
            {
                return Ok(());
            }
            let sent = now_nanos();
            let back = tokio::time::timeout(c.idle(), pair.round_trip(seq, c.size, confirms))
                .await
                .map_err(|_| {
                    anyhow!(
                        "message {seq} did not come back within {:.0}s",
                        c.idle_timeout
                    )
                })??;
            seq += 1;
            let stamp = ids
                .record_body(&back.body)
                .ok_or_else(|| anyhow!("delivery without a benchmark stamp"))?;
            if stamp.seq != seq - 1 {
                bail!(
                    "message {} came back while {} was in flight",
                    stamp.seq,
                    seq - 1
                );
            }
            if measuring {
                rtts.push(back.done_nanos.saturating_sub(sent));
                measured += 1;
            }
        }
    }
    .await;
    let finished_nanos = now_nanos();
    if let Some(w) = &watch {
        w.cpu_into(&mut report, measured);
    }
    if let Err(e) = outcome {
        report.fail(format!("{e:#}"));
    }
    let secs = secs_between(started_nanos, finished_nanos);
    report.set("round_trips", measured);
    report.set("elapsed_secs", secs);
    report.set("rate_msg_s", rate(measured, secs));
    let lat = rtts.summary();
    report.set("rtt_p50_us", lat.p50_us);
    report.set("rtt_p90_us", lat.p90_us);
    report.set("rtt_p99_us", lat.p99_us);
    report.set("rtt_max_us", lat.max_us);
    if confirms {
        let nacked = pair.nacked();
        report.set("nacked", nacked);
        if nacked > 0 {
            report.fail(format!("{nacked} publishes were nacked"));
        }
    }
    let verdict = ids.verdict(&[seq]);
    super::verdict_into(&mut report, &verdict, "delivered");
    pair.close().await;
    client::delete_queue(&setup, &queue).await;
    client::close(&setup).await;
    Ok(report)
}
