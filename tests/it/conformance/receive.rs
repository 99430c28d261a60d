//! The receiving side of a scenario's context, as the harness does it: one `basic.get`,
//! `basic.get` polling until the expected messages came and then on for a quiet window
//! (`collect`), a manual-ack get with a bound (`get1`), consuming until n deliveries, and
//! ready counts by passive declare. Every delivery comes paired with its raw header.

use amq_protocol::types::FieldTable;
use futures_util::{FutureExt, StreamExt};
use lapin::options::*;
use serde_json::{Value, json};
use tokio::time::{Duration, Instant};

use super::ctx::{Ch, Ctx, Failure, Msg, Outcome, POLL_LIMIT, POLL_STEP, secs};

impl Ctx {
    /// One `basic.get`.
    pub async fn get(&self, ch: &Ch, queue: &str, no_ack: bool) -> Result<Option<Msg>, Failure> {
        let got = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack })
            .await?;
        Ok(got.map(|m| self.with_raw(ch, m.delivery)))
    }

    /// `basic.get` (auto-ack) until `expect` messages arrived or 3 s passed, then on for a
    /// quiet window (0.15 s, 0.5 s when nothing is expected) to catch extra messages.
    pub async fn collect(&self, ch: &Ch, queue: &str, expect: usize) -> Result<Value, Failure> {
        self.collect_with(ch, queue, expect, POLL_LIMIT, None).await
    }

    /// The same with its own quiet window.
    pub async fn collect_quiet(
        &self,
        ch: &Ch,
        queue: &str,
        expect: usize,
        quiet: f64,
    ) -> Result<Value, Failure> {
        self.collect_with(ch, queue, expect, POLL_LIMIT, Some(quiet))
            .await
    }

    pub async fn collect_with(
        &self,
        ch: &Ch,
        queue: &str,
        expect: usize,
        timeout: f64,
        quiet: Option<f64>,
    ) -> Result<Value, Failure> {
        let quiet = quiet.unwrap_or(if expect == 0 { 0.5 } else { 0.15 });
        let start = Instant::now();
        let mut quiet_until: Option<Instant> = None;
        let mut msgs = Vec::new();
        loop {
            if let Some(m) = self.get(ch, queue, true).await? {
                msgs.push(self.msg(&m)?);
                continue;
            }
            let now = Instant::now();
            if msgs.len() >= expect {
                let until = *quiet_until.get_or_insert(now + secs(quiet));
                if now >= until {
                    break;
                }
            } else if now - start >= secs(timeout) {
                break;
            }
            tokio::time::sleep(POLL_STEP).await;
        }
        Ok(Value::Array(msgs))
    }

    /// [`Ctx::collect`], recorded as `key`.
    pub async fn record(&mut self, key: &str, ch: &Ch, queue: &str, expect: usize) -> Outcome {
        let v = self.collect(ch, queue, expect).await?;
        self.set(key, v);
        Ok(())
    }

    /// [`Ctx::collect_quiet`], recorded as `key`.
    pub async fn record_quiet(
        &mut self,
        key: &str,
        ch: &Ch,
        queue: &str,
        expect: usize,
        quiet: f64,
    ) -> Outcome {
        let v = self.collect_quiet(ch, queue, expect, quiet).await?;
        self.set(key, v);
        Ok(())
    }

    /// `basic.get` with manual ack, polling up to 3 s.
    pub async fn get1(&self, ch: &Ch, queue: &str) -> Result<Option<Msg>, Failure> {
        let end = Instant::now() + secs(POLL_LIMIT);
        loop {
            if let Some(m) = self.get(ch, queue, false).await? {
                return Ok(Some(m));
            }
            if Instant::now() >= end {
                return Ok(None);
            }
            tokio::time::sleep(POLL_STEP).await;
        }
    }

    /// `basic.consume` until `n` deliveries arrived (3 s at most), then `basic.cancel`; what
    /// arrived before the cancel-ok is included.
    pub async fn consume(
        &mut self,
        ch: &Ch,
        queue: &str,
        n: usize,
        no_ack: bool,
    ) -> Result<Vec<Msg>, Failure> {
        let (mut got, mut consumer) = self.consume_open(ch, queue, n, no_ack).await?;
        ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await?;
        while let Some(Some(d)) = consumer.next().now_or_never() {
            got.push(self.with_raw(ch, d?));
        }
        Ok(got)
    }

    /// The same without cancelling: the consumer stays (its deliveries unsettled).
    pub async fn consume_open(
        &mut self,
        ch: &Ch,
        queue: &str,
        n: usize,
        no_ack: bool,
    ) -> Result<(Vec<Msg>, lapin::Consumer), Failure> {
        self.consumer_tags += 1;
        let tag = format!("conformance-{}", self.consumer_tags);
        let options = BasicConsumeOptions {
            no_ack,
            ..Default::default()
        };
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                tag.as_str().into(),
                options,
                FieldTable::default(),
            )
            .await?;
        let end = Instant::now() + secs(POLL_LIMIT);
        let mut got = Vec::new();
        while got.len() < n {
            match tokio::time::timeout_at(end, consumer.next()).await {
                Ok(Some(d)) => got.push(self.with_raw(ch, d?)),
                Ok(None) | Err(_) => break,
            }
        }
        Ok((got, consumer))
    }

    /// The ready count of a queue (passive declare on a throwaway channel), or the error.
    pub async fn count(&mut self, queue: &str) -> Value {
        let result = async {
            let ch = self.plain_channel().await?;
            let q = ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            ch.close(200, "done".into()).await?;
            Ok::<_, Failure>(q.message_count())
        }
        .await;
        match result {
            Ok(n) => json!(n),
            Err(e) => self.outcome(Err(e)),
        }
    }

    /// Polls the ready count (passive declare) until it is `n`; whether it was within `timeout`.
    pub async fn wait_count(&mut self, queue: &str, n: u32, timeout: f64) -> Result<bool, Failure> {
        let end = Instant::now() + secs(timeout);
        let ch = self.plain_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let reached = loop {
            let q = ch
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await?;
            if q.message_count() == n {
                break true;
            }
            if Instant::now() >= end {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if ch.status().connected() {
            ch.close(200, "done".into()).await?;
        }
        Ok(reached)
    }
}
