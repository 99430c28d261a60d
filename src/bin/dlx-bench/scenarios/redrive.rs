//! `redrive`: the redrive rate of a full dead-letter queue (`--messages`, default 100 000),
//! side by side with a shovel-like baseline. The queue is filled with real dead letters (a
//! TTL-0 queue dead-letters every publish into it), then:
//!
//! (a) the baseline moves them to a second queue the way a shovel or a hand-written script
//!     does: one lapin connection consumes with `--prefetch`, publishes each message with its
//!     properties under publisher confirms (pipelined), and acks each delivery once its confirm
//!     is in;
//! (b) the embedded broker's redrive moves them back (`POST /api/redrive` on `--admin` with
//!     `--token`, `to` the first queue), timed by the job itself and by this driver.
//!
//! Both runs check the queue depths afterwards: every message moved, none left behind.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use tokio::sync::mpsc;

use super::{describe, message_total, name, publish_all, rate};
use crate::Common;
use crate::client::{self, QueueArgs, short};
use crate::report::Report;

const POLL: Duration = Duration::from_millis(20);

pub async fn run(c: &Common, admin: &str, token: Option<&str>) -> Result<Report> {
    let mut report = Report::new("redrive", &c.label);
    describe(&mut report, c, true);
    let (source, dlx, dlq, park) = (name("src"), name("dlx"), name("dlq"), name("park"));
    let setup = client::connect(&c.url, "setup").await?;
    client::fanout_with_queue(&setup, &dlx, &dlq).await?;
    let expiring = QueueArgs {
        message_ttl_ms: Some(0),
        dead_letter_exchange: Some(dlx.clone()),
        ..QueueArgs::default()
    };
    client::fresh_queue(&setup, &source, &expiring).await?;
    client::fresh_queue(&setup, &park, &QueueArgs::default()).await?;
    let ch = setup.create_channel().await?;
    let Some(total) = message_total(c, 100_000) else {
        bail!("redrive needs --messages, not --seconds");
    };
    publish_all(c, &source, Some(total), true).await?;
    wait_depth(&ch, &dlq, total).await?;
    report.set("messages", total);

    // (a) the shovel-like loop, dlq -> park.
    let secs = shovel(c, &dlq, &park, total).await?;
    let baseline = rate(total, secs);
    report.set("baseline_secs", secs);
    report.set("baseline_msg_s", baseline);
    wait_depth(&ch, &park, total).await?;
    check_empty(&ch, &dlq, &mut report).await?;

    // (b) the redrive, park -> dlq.
    let started = Instant::now();
    let body = serde_json::json!({"from": park, "to": dlq}).to_string();
    let answer = admin_call(admin, token, "POST", "/api/redrive", Some(&body)).await?;
    let id = answer["id"]
        .as_u64()
        .with_context(|| format!("no job id in {answer}"))?;
    let status = loop {
        let status = admin_call(admin, token, "GET", &format!("/api/redrive/{id}"), None).await?;
        if status["state"] != "running" {
            break status;
        }
        tokio::time::sleep(POLL).await;
    };
    let wall = started.elapsed().as_secs_f64();
    if status["state"] != "done" || status["moved"].as_u64() != Some(total) {
        report.fail(format!("the redrive job ended as {status}"));
    }
    let job_secs = status["elapsed_secs"].as_f64().unwrap_or(wall);
    let redrive = rate(total, job_secs);
    report.set("redrive_secs", job_secs);
    report.set("redrive_wall_secs", wall);
    report.set("redrive_msg_s", redrive);
    report.set(
        "speedup",
        if baseline > 0.0 {
            redrive / baseline
        } else {
            0.0
        },
    );
    wait_depth(&ch, &dlq, total).await?;
    check_empty(&ch, &park, &mut report).await?;
    for q in [&source, &dlq, &park] {
        client::delete_queue(&setup, q).await;
    }
    client::delete_exchange(&setup, &dlx).await;
    client::close(&setup).await;
    Ok(report)
}

/// Consume → publish with confirms → ack after the confirm, until `total` moved; seconds.
async fn shovel(c: &Common, from: &str, to: &str, total: u64) -> Result<f64> {
    let (conn, ch) = client::open_channel(&c.url, "shovel").await?;
    ch.basic_qos(c.prefetch, BasicQosOptions::default()).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            short(from)?,
            "shovel".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let started = Instant::now();
    // The confirms are awaited in order by a second task, which acks each delivery.
    let (tx, mut rx) =
        mpsc::channel::<(lapin::Acker, lapin::PublisherConfirm)>(usize::from(c.prefetch.max(1)));
    let acker = tokio::spawn(async move {
        let mut acked = 0u64;
        while let Some((acker, confirm)) = rx.recv().await {
            let confirmation = confirm.await?;
            if !confirmation.is_ack() {
                bail!("the shovel's publish was not acked: {confirmation:?}");
            }
            acker.ack(BasicAckOptions::default()).await?;
            acked += 1;
        }
        Ok(acked)
    });
    let target = short(to)?;
    for _ in 0..total {
        let delivery = consumer
            .next()
            .await
            .context("the shovel's consumer ended")??;
        let confirm = ch
            .basic_publish(
                "".into(),
                target.clone(),
                BasicPublishOptions::default(),
                &delivery.data,
                delivery.properties.clone(),
            )
            .await?;
        tx.send((delivery.acker, confirm))
            .await
            .context("the acking task ended")?;
    }
    drop(tx);
    let acked = acker.await??;
    let secs = started.elapsed().as_secs_f64();
    if acked != total {
        bail!("the shovel acked {acked} of {total}");
    }
    client::close(&conn).await;
    Ok(secs)
}

async fn wait_depth(ch: &lapin::Channel, queue: &str, n: u64) -> Result<()> {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let depth = client::queue_depth(ch, queue).await?;
        if depth == n {
            return Ok(());
        }
        if Instant::now() >= until {
            bail!("{queue} holds {depth}, not {n}");
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn check_empty(ch: &lapin::Channel, queue: &str, report: &mut Report) -> Result<()> {
    let left = client::queue_depth(ch, queue).await?;
    if left != 0 {
        report.fail(format!("{left} messages left in {queue}"));
    }
    Ok(())
}

/// One admin API call (the blocking client of `dlx_proxy::admin`); the JSON answer of a 2xx.
async fn admin_call(
    admin: &str,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<serde_json::Value> {
    let (admin, method, path) = (admin.to_string(), method.to_string(), path.to_string());
    let body = body.map(str::to_string);
    let token = token.map(dlx_proxy::secret::Secret::from);
    let (status, text) = tokio::task::spawn_blocking(move || {
        dlx_proxy::admin::request_with_token(
            &admin,
            &method,
            &path,
            body.as_deref(),
            token.as_ref(),
            Duration::from_secs(10),
        )
    })
    .await??;
    if !(200..300).contains(&status) {
        bail!("admin API: HTTP {status}: {text}");
    }
    Ok(serde_json::from_str(&text)?)
}
