//! Where a dead-letter queue inspection reads its messages: the embedded broker's queue in
//! place, or RabbitMQ's management API in proxy mode. The admin API
//! (`GET /api/queues/{vhost}/{queue}/messages` and `.../messages/summary`, [`crate::admin`])
//! calls [`Inspector::page`] and [`Inspector::summary`]; the rendering is
//! [`crate::dlq_view`]'s.
//!
//! - Embedded: the ready messages of the queue are walked from the head (at most the page or
//!   [`SUMMARY_CAP`]), [`WALK_CHUNK`] at a time taken under the broker lock without reading
//!   any content back; the lock is released before the paged ones among them are read back
//!   from storage, so publishers and consumers go on. Each message is rendered (or counted)
//!   as it is reached and dropped, so paged messages are read back one at a time, never all
//!   together. The walk runs on a blocking thread. Nothing is delivered: no
//!   redelivered flag, no delivery count, no consumer sees a change. Unacknowledged
//!   deliveries are not in the queue and are not shown; a message consumed while the walk
//!   is between chunks is not shown either (positions count what was shown).
//! - Proxy: the proxy holds no queue contents. `POST /api/queues/{vhost}/{name}/get` with
//!   `ackmode=reject_requeue_true` (the management UI's "Get messages") reads them through the
//!   client of [`crate::proxy::policy_sync::management`]: they are requeued, so they come back
//!   redelivered and, with consumers attached, possibly in another order. One call reads at
//!   most [`MAX_LIMIT`] messages, which is also the proxy summary's cap.
//! - Proxy without `upstream.management_url`: [`InspectError::Unavailable`] (501) naming it.

use crate::broker::Broker;
use crate::broker::message::Message;
use crate::broker::queue::Peeked;
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

/// Ready messages an embedded inspection reaches per hold of the broker lock.
pub const WALK_CHUNK: usize = 256;

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
                on_blocking_thread(broker, vhost, queue, move |broker, vhost, queue| {
                    let mut views = Vec::new();
                    let walked = walk(broker, vhost, queue, limit, |message, redelivered| {
                        views.push(render(views.len(), message, redelivered));
                    })?;
                    Ok((walked.length, views))
                })
                .await?
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
                summary = on_blocking_thread(broker, vhost, queue, move |broker, vhost, queue| {
                    let walked = walk(broker, vhost, queue, SUMMARY_CAP, |message, _| {
                        let properties = message.properties().unwrap_or_default();
                        summary.add(&crate::dlq_view::deaths_amqp(properties.headers().as_ref()));
                    })?;
                    summary.queue_length = walked.length;
                    summary.truncated = !walked.reached_end;
                    Ok(summary)
                })
                .await?;
                return Ok(summary);
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

/// Runs `work` on the broker on a blocking thread (it takes the broker lock and may read
/// paged messages from disk).
async fn on_blocking_thread<T: Send + 'static>(
    broker: &Arc<Broker>,
    vhost: &str,
    queue: &str,
    work: impl FnOnce(&Broker, &str, &str) -> Result<T, InspectError> + Send + 'static,
) -> Result<T, InspectError> {
    let (broker, vhost, queue) = (broker.clone(), vhost.to_string(), queue.to_string());
    tokio::task::spawn_blocking(move || work(&broker, &vhost, &queue))
        .await
        .map_err(|err| InspectError::Unavailable(format!("the inspection stopped: {err}")))?
}

/// How a walk ended: its queue's length when it began, and whether it reached the end of
/// the queue (rather than its limit).
struct Walked {
    length: u64,
    reached_end: bool,
}

/// Visits the first `limit` ready messages of `queue` in order with their redelivered flag:
/// [`WALK_CHUNK`] at a time are taken under the broker lock without reading any content
/// back; the paged ones among them are read back from storage after the lock is released
/// (one whose record is gone meanwhile, acknowledged or dropped, or cannot be read is left
/// out; one delivered and not yet acknowledged is still shown). A queue deleted (or deleted
/// and declared again) during the walk ends it with what was visited, not at its end.
fn walk(
    broker: &Broker,
    vhost: &str,
    queue: &str,
    limit: usize,
    mut visit: impl FnMut(&Message, bool),
) -> Result<Walked, InspectError> {
    let mut after = None;
    let mut visited = 0;
    let mut first: Option<(u64, u64)> = None;
    loop {
        // At the limit, one more message is looked for (not read) to tell whether it was
        // the end.
        let want = if visited >= limit { 1 } else { WALK_CHUNK };
        let chunk: Vec<Peeked> = {
            let state = broker.lock();
            let found = state
                .vhosts
                .get(vhost)
                .ok_or_else(|| InspectError::NotFound(format!("no vhost {vhost:?}")))
                .and_then(|v| {
                    v.queues.get(queue).ok_or_else(|| {
                        InspectError::NotFound(format!("no queue {queue:?} in vhost {vhost:?}"))
                    })
                });
            match (found, first) {
                (Ok(found), None) => {
                    first = Some((found.id, found.state.len() as u64));
                    found.state.peek_after(after).take(want).collect()
                }
                (Ok(found), Some((id, _))) if found.id == id => {
                    found.state.peek_after(after).take(want).collect()
                }
                (Err(err), None) => return Err(err),
                // Gone, or another queue of that name now.
                _ => {
                    return Ok(Walked {
                        length: first.map_or(0, |(_, length)| length),
                        reached_end: false,
                    });
                }
            }
        };
        let length = first.map_or(0, |(_, length)| length);
        if chunk.is_empty() || visited >= limit {
            return Ok(Walked {
                length,
                reached_end: chunk.is_empty(),
            });
        }
        for peeked in chunk {
            if visited >= limit {
                break;
            }
            match peeked {
                Peeked::Resident(entry) => {
                    after = Some(entry.seq);
                    visit(&entry.message, entry.redelivered);
                    visited += 1;
                }
                Peeked::Paged {
                    seq,
                    store_id,
                    redelivered,
                } => {
                    after = Some(seq);
                    let back = broker.storage().map(|storage| storage.read(store_id));
                    if let Some(Ok(paged)) = back {
                        visit(&paged.message, redelivered);
                        visited += 1;
                    }
                }
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::methods::test_support::{broker, declare, publish_to};
    use amq_protocol::types::FieldTable;

    /// A page and a summary over more messages than one hold of the lock reaches: every
    /// message once, in order, and the queue unchanged.
    #[tokio::test]
    async fn a_walk_over_several_chunks_sees_every_message_once_in_order() {
        let broker = broker();
        let none = FieldTable::default();
        broker
            .queue_declare(0, "/", &declare("dlq", &none))
            .expect("declare");
        let count = WALK_CHUNK * 2 + 10;
        for i in 0..count {
            publish_to(&broker, "dlq", format!("m{i}").as_bytes());
        }
        let inspector = Inspector::Broker(broker.clone());
        let page = inspector.page("/", "dlq", MAX_LIMIT).await.unwrap();
        assert_eq!(page.queue_length, count as u64);
        let shown: Vec<(usize, String)> = page
            .messages
            .iter()
            .map(|m| (m.position, m.body_preview.clone()))
            .collect();
        let expected: Vec<(usize, String)> = (0..count).map(|i| (i, format!("m{i}"))).collect();
        assert_eq!(shown, expected);
        let page = inspector.page("/", "dlq", WALK_CHUNK + 1).await.unwrap();
        assert_eq!(page.messages.len(), WALK_CHUNK + 1);
        let summary = inspector.summary("/", "dlq").await.unwrap();
        assert_eq!(
            (summary.inspected, summary.queue_length),
            (count as u64, count as u64)
        );
        assert!(!summary.truncated);
        assert_eq!(
            inspector.page("/", "missing", 1).await.unwrap_err(),
            InspectError::NotFound("no queue \"missing\" in vhost \"/\"".into())
        );
    }
}
