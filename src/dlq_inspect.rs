//! Where a dead-letter queue inspection reads its messages: the embedded broker's queue in
//! place, or RabbitMQ's management API in proxy mode. The admin API
//! (`GET /api/queues/{vhost}/{queue}/messages` and `.../messages/summary`, [`crate::admin`])
//! calls [`Inspector::page`] and [`Inspector::summary`]; the rendering is
//! [`crate::dlq_view`]'s.
//!
//! - Embedded: the ready messages of the queue are read under the broker lock (their `Arc`s
//!   cloned, at most the page or [`SUMMARY_CAP`]) and rendered after it is released. Nothing
//!   is delivered: no redelivered flag, no delivery count, no consumer sees a change.
//!   Unacknowledged deliveries are not in the queue and are not shown.
//! - Proxy: the proxy holds no queue contents. `POST /api/queues/{vhost}/{name}/get` with
//!   `ackmode=reject_requeue_true` (the management UI's "Get messages") reads them through the
//!   client of [`crate::proxy::policy_sync::management`]: they are requeued, so they come back
//!   redelivered and, with consumers attached, possibly in another order. One call reads at
//!   most [`MAX_LIMIT`] messages, which is also the proxy summary's cap.
//! - Proxy without `upstream.management_url`: [`InspectError::Unavailable`] (501) naming it.

use crate::broker::Broker;
use crate::broker::message::Message;
use crate::dlq_view::{MAX_LIMIT, MessagePage, MessageView, PREVIEW_BYTES, SUMMARY_CAP, Summary};
use crate::proxy::policy_sync::management::ManagementClient;
use std::sync::Arc;

/// The source of queue contents for the admin API.
#[derive(Clone)]
pub enum Inspector {
    /// Embedded mode: the broker's queues.
    Broker(Arc<Broker>),
    /// Proxy mode with `upstream.management_url`.
    Management(ManagementClient),
    /// Proxy mode without it.
    Unavailable,
}

/// Why an inspection failed.
#[derive(Debug, PartialEq, Eq)]
pub enum InspectError {
    /// No such vhost or queue (404).
    NotFound(String),
    /// Inspection is not possible in this configuration (501).
    Unavailable(String),
    /// The upstream management API failed (502).
    Upstream(String),
}

impl std::fmt::Display for InspectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InspectError::NotFound(m)
            | InspectError::Unavailable(m)
            | InspectError::Upstream(m) => f.write_str(m),
        }
    }
}

const NO_MANAGEMENT: &str = "inspecting queues in proxy mode needs RabbitMQ's management API: \
                             set upstream.management_url";

/// A queue's ready messages from the head, at most `limit`, and its length.
type Snapshot = (u64, Vec<(Arc<Message>, bool)>);

impl Inspector {
    /// The first `limit` messages of the queue (1 ..= [`MAX_LIMIT`]).
    pub async fn page(
        &self,
        vhost: &str,
        queue: &str,
        limit: usize,
    ) -> Result<MessagePage, InspectError> {
        let limit = limit.clamp(1, MAX_LIMIT);
        let (queue_length, messages) = match self {
            Inspector::Broker(broker) => {
                let (length, messages) = snapshot(broker, vhost, queue, limit)?;
                let views = messages
                    .iter()
                    .enumerate()
                    .map(|(position, (message, redelivered))| {
                        render(position, message, *redelivered)
                    })
                    .collect();
                (length, views)
            }
            Inspector::Management(client) => {
                let got = get(client, vhost, queue, limit, PREVIEW_BYTES).await?;
                let length = remaining(&got);
                let views = got
                    .iter()
                    .enumerate()
                    .map(|(position, m)| MessageView::from_management(position, m))
                    .collect();
                (length, views)
            }
            Inspector::Unavailable => return Err(InspectError::Unavailable(NO_MANAGEMENT.into())),
        };
        Ok(MessagePage {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            queue_length,
            limit,
            messages,
        })
    }

    /// Counts by newest death reason and source queue, over at most [`SUMMARY_CAP`] messages
    /// (embedded) or [`MAX_LIMIT`] (proxy) from the head.
    pub async fn summary(&self, vhost: &str, queue: &str) -> Result<Summary, InspectError> {
        let mut summary = Summary {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            ..Summary::default()
        };
        match self {
            Inspector::Broker(broker) => {
                let (length, messages) = snapshot(broker, vhost, queue, SUMMARY_CAP)?;
                summary.queue_length = length;
                for (message, _) in &messages {
                    let properties = message.properties().unwrap_or_default();
                    summary.add(&crate::dlq_view::deaths_amqp(properties.headers().as_ref()));
                }
            }
            Inspector::Management(client) => {
                let got = get(client, vhost, queue, MAX_LIMIT, 1).await?;
                summary.queue_length = remaining(&got);
                for message in &got {
                    let headers = message.get("properties").and_then(|p| p.get("headers"));
                    summary.add(&crate::dlq_view::deaths_json(headers));
                }
            }
            Inspector::Unavailable => return Err(InspectError::Unavailable(NO_MANAGEMENT.into())),
        }
        summary.truncated = summary.inspected < summary.queue_length;
        Ok(summary)
    }
}

fn snapshot(
    broker: &Broker,
    vhost: &str,
    queue: &str,
    limit: usize,
) -> Result<Snapshot, InspectError> {
    let state = broker.lock();
    let found = state
        .vhosts
        .get(vhost)
        .ok_or_else(|| InspectError::NotFound(format!("no vhost {vhost:?}")))?
        .queues
        .get(queue)
        .ok_or_else(|| InspectError::NotFound(format!("no queue {queue:?} in vhost {vhost:?}")))?;
    let messages = found
        .state
        .iter()
        .take(limit)
        .map(|entry| (entry.message.clone(), entry.redelivered))
        .collect();
    Ok((found.state.len() as u64, messages))
}

fn render(position: usize, message: &Message, redelivered: bool) -> MessageView {
    let properties = message.properties().unwrap_or_default();
    MessageView::from_amqp(
        position,
        message.exchange(),
        message.routing_key(),
        redelivered,
        &properties,
        message.body(),
    )
}

async fn get(
    client: &ManagementClient,
    vhost: &str,
    queue: &str,
    count: usize,
    truncate: usize,
) -> Result<Vec<serde_json::Value>, InspectError> {
    let upstream = |e: crate::proxy::policy_sync::management::ManagementError| {
        if e.is_not_found() {
            InspectError::NotFound(format!("no queue {queue:?} in vhost {vhost:?} upstream"))
        } else {
            InspectError::Upstream(format!("upstream management API: {e}"))
        }
    };
    let mut session = client.session().await.map_err(upstream)?;
    session
        .get_messages(vhost, queue, count, truncate)
        .await
        .map_err(upstream)
}

/// The queue's length when the first message was got (its `message_count` counts those
/// after it).
fn remaining(got: &[serde_json::Value]) -> u64 {
    got.first()
        .and_then(|m| m.get("message_count"))
        .and_then(serde_json::Value::as_u64)
        .map_or(0, |after| after + 1)
}
