//! `deadletter --kind reject|nack|expiry|overflow|delivery-limit`: messages die in a source
//! queue and are dead-lettered through a fanout exchange into a DLQ that consumers drain.
//! Reports the rate at which messages reach the DLQ and the latency from each death's cause to
//! the dead letter's arrival: the consumer's reject or nack (delivery-limit: its last requeue),
//! the expiry deadline (publish + TTL); overflow: the message's own publish (so it includes the
//! time it spent among the x-max-length newest). Checks that each message reached the DLQ
//! exactly once (overflow: or is still among the x-max-length survivors).

use std::sync::atomic::Ordering;

use anyhow::{Result, bail};
use tokio::sync::watch;

use super::{Watch, describe, message_total, name, publish_all, rate, secs_between};
use crate::client::{self, ConsumeSpec, EventTimes, Progress, QueueArgs, Settle};
use crate::report::Report;
use crate::{Common, DeadLetterKind, QueueType};

/// The source queue's limits and dead-letter strategy.
pub struct Limits {
    pub ttl_ms: u32,
    pub max_length: u32,
    pub delivery_limit: u32,
    pub at_least_once: bool,
}

pub async fn run(c: &Common, kind: DeadLetterKind, limits: Limits) -> Result<Report> {
    let Limits {
        ttl_ms,
        max_length,
        delivery_limit,
        at_least_once,
    } = limits;
    if at_least_once && c.queue_type != QueueType::Quorum {
        bail!("--at-least-once needs --queue-type quorum (RabbitMQ has it for quorum queues only)");
    }
    if at_least_once && kind == DeadLetterKind::Overflow {
        bail!("--at-least-once needs x-overflow reject-publish, which dead-letters nothing");
    }
    let kind_name = match kind {
        DeadLetterKind::Reject => "reject",
        DeadLetterKind::Nack => "nack",
        DeadLetterKind::Expiry => "expiry",
        DeadLetterKind::Overflow => "overflow",
        DeadLetterKind::DeliveryLimit => "delivery-limit",
    };
    let mut report = Report::new(&format!("deadletter-{kind_name}"), &c.label);
    let confirms = c.confirms_on();
    describe(&mut report, c, confirms);
    let dlx = name("dlx");
    let dlq = name("dlq");
    let source = name("src");
    let setup = client::connect(&c.url, "setup").await?;
    client::fanout_with_queue(&setup, &dlx, &dlq).await?;
    let mut args = QueueArgs {
        dead_letter_exchange: Some(dlx.clone()),
        at_least_once,
        ..QueueArgs::of_type(c.queue_type)
    };
    if at_least_once {
        report.set("dead_letter_strategy", "at-least-once");
    }
    let mut after_publish_ns = 0;
    let settle = match kind {
        DeadLetterKind::Nack => Some(Settle::Nack { requeue: false }),
        DeadLetterKind::DeliveryLimit => Some(Settle::Nack { requeue: true }),
        DeadLetterKind::Reject => Some(Settle::Reject),
        _ => None,
    };
    match kind {
        DeadLetterKind::Reject | DeadLetterKind::Nack => {}
        DeadLetterKind::DeliveryLimit => {
            args.quorum = true;
            args.delivery_limit = Some(delivery_limit);
            report.set("delivery_limit", delivery_limit);
        }
        DeadLetterKind::Expiry => {
            after_publish_ns = u64::from(ttl_ms) * 1_000_000;
            args.message_ttl_ms = Some(ttl_ms);
            report.set("ttl_ms", ttl_ms);
        }
        DeadLetterKind::Overflow => {
            args.max_length = Some(max_length);
            args.overflow_drop_head = true;
            report.set("max_length", max_length);
        }
    }
    client::fresh_queue(&setup, &source, &args).await?;

    let events = EventTimes::new(after_publish_ns);
    let (stop, stop_rx) = watch::channel(false);
    let dlq_progress = Progress::new();
    let mut dlq_consumers = Vec::new();
    for i in 0..c.consumers.max(1) {
        let spec = ConsumeSpec {
            url: c.url.clone(),
            name: format!("dlq consumer {i}"),
            queue: dlq.clone(),
            prefetch: c.prefetch,
            settle: Settle::Ack,
            ack_every: c.ack_every,
            record: true,
            events: Some(events.clone()),
        };
        dlq_consumers
            .push(super::start_consumer(c, spec, dlq_progress.clone(), stop_rx.clone()).await?);
    }
    let reject_progress = Progress::new();
    let mut rejecters = Vec::new();
    if let Some(settle) = settle {
        for i in 0..c.consumers.max(1) {
            let spec = ConsumeSpec {
                url: c.url.clone(),
                name: format!("rejecter {i}"),
                queue: source.clone(),
                prefetch: c.prefetch,
                settle,
                ack_every: 1,
                record: false,
                events: Some(events.clone()),
            };
            rejecters.push(
                super::start_consumer(c, spec, reject_progress.clone(), stop_rx.clone()).await?,
            );
        }
    }

    let watch = Watch::start(c.pid);
    let published = publish_all(c, &source, message_total(c, 100_000), confirms).await?;
    let total = published.total();
    let survivors = match kind {
        DeadLetterKind::Overflow => total.min(u64::from(max_length)),
        _ => 0,
    };
    let expected_dead = total - survivors;
    let all_arrived = dlq_progress.wait_for(expected_dead, c.idle()).await;
    let last = dlq_progress.last_nanos.load(Ordering::Relaxed);
    let mut seen = client::stop_consumers(&stop, dlq_consumers).await?;
    let rejected = client::stop_consumers(&stop, rejecters).await?;
    watch.cpu_into(&mut report, total);

    published.add_to(&mut report, confirms);
    let secs = secs_between(published.started_nanos(), last);
    report.set("dead_lettered", seen.ids.received);
    report.set("elapsed_secs", secs);
    report.set("dead_letter_rate_msg_s", rate(seen.ids.distinct(), secs));
    let lat = seen.latencies.summary();
    report.set("latency_p50_us", lat.p50_us);
    report.set("latency_p99_us", lat.p99_us);
    report.set("latency_max_us", lat.max_us);
    if settle.is_some() {
        report.set("rejected", reject_progress.received());
        if rejected.settle_errors > 0 {
            report.fail(format!("{} rejects failed", rejected.settle_errors));
        }
    }
    if kind == DeadLetterKind::Overflow {
        // The newest max-length messages stay in the source queue: they complete the set.
        let ch = setup.create_channel().await?;
        let mut remaining = crate::payload::IdTracker::default();
        let left = client::drain_with_get(&ch, &source, &mut remaining).await?;
        report.set("left_in_source", left);
        if left != survivors {
            report.fail(format!(
                "{left} messages left in the source queue, expected {survivors}"
            ));
        }
        seen.ids.merge(&remaining);
    }
    let verdict = seen.ids.verdict(&published.per_producer());
    super::verdict_into(&mut report, &verdict, "dead-lettered");
    if !all_arrived {
        report.note(format!(
            "stopped waiting after {:.0}s without a dead letter",
            c.idle_timeout
        ));
    }
    if seen.settle_errors > 0 {
        report.fail(format!("{} acks failed", seen.settle_errors));
    }
    client::delete_queue(&setup, &source).await;
    client::delete_queue(&setup, &dlq).await;
    client::delete_exchange(&setup, &dlx).await;
    client::close(&setup).await;
    Ok(report)
}
