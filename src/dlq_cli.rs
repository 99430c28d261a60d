//! The client side of `dlx-proxy dlq list|summary`: a dead-letter queue of a running instance
//! inspected through its admin API (`GET /api/queues/{vhost}/{queue}/messages` and
//! `.../messages/summary`), with the token and address of [`crate::policy_cli::AdminClient`].
//!
//! [`page_text`] and [`summary_text`] (what the commands print) are pure and tested directly;
//! `--format json` prints the admin API's answer as it is.

use crate::admin::encode_path_segment;
use crate::dlq_view::{MessagePage, Summary};
use crate::policy_cli::AdminClient;

fn messages_path(vhost: &str, queue: &str) -> String {
    format!(
        "/api/queues/{}/{}/messages",
        encode_path_segment(vhost),
        encode_path_segment(queue)
    )
}

/// `GET .../messages?limit=N` (the server's default without `limit`).
pub fn list(
    client: &AdminClient,
    vhost: &str,
    queue: &str,
    limit: Option<usize>,
) -> Result<MessagePage, String> {
    let mut path = messages_path(vhost, queue);
    if let Some(limit) = limit {
        path.push_str(&format!("?limit={limit}"));
    }
    let text = client.call("GET", &path, None)?;
    serde_json::from_str(&text).map_err(|e| format!("GET {path}: unexpected answer: {e}"))
}

/// `GET .../messages/summary`.
pub fn summary(client: &AdminClient, vhost: &str, queue: &str) -> Result<Summary, String> {
    let path = format!("{}/summary", messages_path(vhost, queue));
    let text = client.call("GET", &path, None)?;
    serde_json::from_str(&text).map_err(|e| format!("GET {path}: unexpected answer: {e}"))
}

/// A page as `dlq list` prints it: a title line, then per message a line with its routing,
/// one line per x-death entry and the body preview.
pub fn page_text(page: &MessagePage) -> String {
    let mut out = format!(
        "queue {:?} in vhost {:?}: {} messages, showing {}\n",
        page.queue,
        page.vhost,
        page.queue_length,
        page.messages.len()
    );
    for m in &page.messages {
        out.push_str(&format!(
            "#{} exchange={:?} routing_key={:?} redelivered={} size={}\n",
            m.position, m.exchange, m.routing_key, m.redelivered, m.body_size
        ));
        for d in &m.x_death {
            out.push_str(&format!(
                "  x-death queue={} reason={} count={} exchange={} routing-keys={} time={}\n",
                d.queue.as_deref().unwrap_or("?"),
                d.reason.as_deref().unwrap_or("?"),
                d.count.map_or("?".into(), |n| n.to_string()),
                d.exchange
                    .as_deref()
                    .map_or("?".into(), |e| format!("{e:?}")),
                d.routing_keys.join(","),
                d.time.map_or("?".into(), |n| n.to_string()),
            ));
        }
        let cut = if m.body_truncated { " (truncated)" } else { "" };
        out.push_str(&format!(
            "  body ({}{cut}): {}\n",
            m.body_encoding,
            m.body_preview.escape_debug()
        ));
    }
    out
}

/// A summary as `dlq summary` prints it.
pub fn summary_text(summary: &Summary) -> String {
    let mut out = format!(
        "queue {:?} in vhost {:?}: {} messages, {} inspected{}\n",
        summary.queue,
        summary.vhost,
        summary.queue_length,
        summary.inspected,
        if summary.truncated { " (capped)" } else { "" }
    );
    for (title, counts) in [
        ("by reason", &summary.by_reason),
        ("by source queue", &summary.by_source_queue),
    ] {
        out.push_str(title);
        out.push_str(":\n");
        for (key, count) in counts {
            out.push_str(&format!("  {key}\t{count}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq_view::{DeathEntry, MessageView};
    use std::collections::BTreeMap;

    #[test]
    fn a_page_prints_deaths_and_the_preview() {
        let page = MessagePage {
            vhost: "/".into(),
            queue: "dlq".into(),
            queue_length: 4,
            limit: 1,
            messages: vec![MessageView {
                position: 0,
                exchange: "dlx".into(),
                routing_key: "work".into(),
                redelivered: false,
                properties: BTreeMap::new(),
                headers: BTreeMap::new(),
                x_death: vec![DeathEntry {
                    queue: Some("work".into()),
                    reason: Some("rejected".into()),
                    count: Some(1),
                    exchange: Some(String::new()),
                    routing_keys: vec!["work".into()],
                    time: Some(1_700_000_000),
                }],
                body_size: 7,
                body_preview: "a\nb".into(),
                body_encoding: "string".into(),
                body_truncated: true,
                headers_truncated: false,
            }],
        };
        assert_eq!(
            page_text(&page),
            "queue \"dlq\" in vhost \"/\": 4 messages, showing 1\n\
             #0 exchange=\"dlx\" routing_key=\"work\" redelivered=false size=7\n  \
             x-death queue=work reason=rejected count=1 exchange=\"\" routing-keys=work \
             time=1700000000\n  body (string (truncated)): a\\nb\n"
        );
    }

    #[test]
    fn a_summary_prints_both_counts() {
        let mut summary = Summary {
            vhost: "/".into(),
            queue: "dlq".into(),
            queue_length: 2,
            ..Summary::default()
        };
        summary.add(&[DeathEntry {
            queue: Some("work".into()),
            reason: Some("expired".into()),
            ..DeathEntry::default()
        }]);
        summary.add(&[]);
        assert_eq!(
            summary_text(&summary),
            "queue \"dlq\" in vhost \"/\": 2 messages, 2 inspected\nby reason:\n  \
             expired\t1\n  none\t1\nby source queue:\n  none\t1\n  work\t1\n"
        );
    }
}
