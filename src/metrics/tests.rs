//! Unit tests of [`crate::metrics`].

use super::*;

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[test]
fn every_metric_is_exported_with_its_prefix() {
    let metrics = Metrics::new(10);
    // Vectors only appear once they have a series.
    metrics.dead_lettered("/", "q", "expired");
    metrics.dropped("/", "q", "cycle");
    metrics.consumer_timed_out("/", "q");
    metrics.dead_letter_kept("/", "q");
    metrics.retried("/", "q", 1);
    metrics.add_retry_held("/", "q", 1);
    metrics.retry_exhausted("/", "q");
    metrics.dead_letter_publish_failed("nack");
    metrics.traffic(Direction::ClientIn, 1, 8);
    metrics.config_reloaded(true);
    metrics.tls_reloaded(true);
    metrics.set_queue_depth("/", "q", 1, 1);
    metrics.service_started("/");
    metrics.upstream_target("rabbit:5672");
    metrics.upstream_policy_sync_results(&["success"]);
    metrics.redrive_counted("/", "dlq", &["q".into()], 1, &["no_queue"]);
    let text = metrics.encode();
    for name in METRIC_NAMES {
        assert!(
            text.contains(&format!("# TYPE {PREFIX}{name} ")),
            "{name} missing:\n{text}"
        );
    }
    assert!(text.contains("# TYPE dlx_proxy_dead_lettered_total counter"));
    assert!(text.contains("# TYPE dlx_proxy_queue_messages gauge"));
    assert!(text.contains("# TYPE dlx_proxy_dead_letter_latency_seconds histogram"));
    assert_eq!(metrics.content_type(), "text/plain; version=0.0.4");
}

#[test]
fn build_info_and_process_metrics_are_exported() {
    let text = Metrics::new(10).encode();
    let line = format!(
        "dlx_proxy_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    for name in [
        "dlx_proxy_process_resident_memory_bytes",
        "dlx_proxy_process_open_fds",
    ] {
        let value: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
            .parse()
            .unwrap();
        assert!(value > 0.0, "{name} = {value}");
    }
    assert!(text.contains("# TYPE dlx_proxy_process_cpu_seconds_total counter"));
}

#[test]
fn counters_and_gauges_have_exact_values() {
    let metrics = Metrics::new(10);
    metrics.dead_lettered("/", "orders", "expired");
    metrics.dead_lettered("/", "orders", "expired");
    metrics.dead_lettered("/", "orders", "rejected");
    metrics.dropped("v", "orders", "no_dlx");
    metrics.published(5);
    metrics.delivered(3);
    metrics.acked(2);
    metrics.connection_opened();
    metrics.connection_opened();
    metrics.connection_closed();
    metrics.connection_refused(REFUSED_MAX_CONNECTIONS);
    metrics.channel_opened();
    metrics.channel_opened();
    metrics.channel_opened();
    metrics.channels_closed(2);
    metrics.traffic(Direction::ClientIn, 3, 120);
    metrics.traffic(Direction::UpstreamOut, 1, 0);
    metrics.set_queue_depth("/", "orders", 7, 700);
    metrics.add_inflight(4, 400);
    metrics.add_inflight(-1, -100);
    metrics.add_outbox_bytes(64);
    metrics.set_memory_alarm(true);
    metrics.set_memory(300, 1000, 400);
    metrics.connection_blocked();
    metrics.connection_blocked();
    metrics.connection_unblocked();
    metrics.memory_released();
    metrics.config_reloaded(false);
    metrics.tls_reloaded(false);
    metrics.tls_reloaded(false);
    metrics.tls_reloaded(true);
    metrics.observe_dead_letter_latency(Duration::from_micros(50));
    metrics.observe_message_age_at_dead_letter(Duration::from_secs(2));
    metrics.upstream_target("a:5672");
    metrics.upstream_connect_attempt("a:5672", false);
    metrics.upstream_connect_attempt("a:5672", false);
    metrics.upstream_connect_attempt("b:5672", true);
    metrics.set_upstream_reachable(true);
    metrics.dead_letter_retry("nacked");
    metrics.dead_letter_retry("nacked");
    metrics.dead_letter_retry("timeout");
    metrics.add_held_dead_letters(2);
    metrics.add_held_dead_letters(-1);
    metrics.upstream_policy_sync_results(&["success", "failure"]);
    metrics.upstream_policy_sync("success");
    metrics.upstream_policy_sync("success");
    metrics.set_upstream_policies_synced(3);
    let text = metrics.encode();
    for line in [
        r#"dlx_proxy_dead_lettered_total{queue="orders",reason="expired",vhost="/"} 2"#,
        r#"dlx_proxy_dead_lettered_total{queue="orders",reason="rejected",vhost="/"} 1"#,
        r#"dlx_proxy_dead_letter_dropped_total{cause="no_dlx",queue="orders",vhost="v"} 1"#,
        "dlx_proxy_messages_published_total 5",
        "dlx_proxy_messages_delivered_total 3",
        "dlx_proxy_messages_acked_total 2",
        "dlx_proxy_connections_opened_total 2",
        "dlx_proxy_connections 1",
        r#"dlx_proxy_connections_refused_total{reason="max_connections"} 1"#,
        r#"dlx_proxy_connections_refused_total{reason="loopback_only"} 0"#,
        "dlx_proxy_channels 1",
        r#"dlx_proxy_frames_total{direction="client_in"} 3"#,
        r#"dlx_proxy_bytes_total{direction="client_in"} 120"#,
        r#"dlx_proxy_frames_total{direction="upstream_out"} 1"#,
        r#"dlx_proxy_queue_messages{queue="orders",vhost="/"} 7"#,
        r#"dlx_proxy_queue_bytes{queue="orders",vhost="/"} 700"#,
        "dlx_proxy_inflight_deliveries 3",
        "dlx_proxy_inflight_bytes 300",
        "dlx_proxy_outbox_bytes 64",
        "dlx_proxy_memory_alarm 1",
        "dlx_proxy_memory_used_bytes 300",
        "dlx_proxy_memory_limit_bytes 1000",
        "dlx_proxy_memory_high_watermark_bytes 400",
        "dlx_proxy_blocked_connections 1",
        "dlx_proxy_connection_blocks_total 2",
        "dlx_proxy_memory_releases_total 1",
        r#"dlx_proxy_config_reloads_total{result="failure"} 1"#,
        r#"dlx_proxy_tls_reloads_total{result="failure"} 2"#,
        r#"dlx_proxy_tls_reloads_total{result="success"} 1"#,
        r#"dlx_proxy_dead_letter_latency_seconds_bucket{le="0.0001"} 1"#,
        "dlx_proxy_dead_letter_latency_seconds_count 1",
        r#"dlx_proxy_message_age_at_dead_letter_seconds_bucket{le="1"} 0"#,
        r#"dlx_proxy_message_age_at_dead_letter_seconds_bucket{le="5"} 1"#,
        r#"dlx_proxy_message_age_at_dead_letter_seconds_bucket{le="86400"} 1"#,
        "dlx_proxy_metric_labels_folded_total 0",
        r#"dlx_proxy_upstream_connect_attempts_total{result="failure",upstream="a:5672"} 2"#,
        r#"dlx_proxy_upstream_connect_attempts_total{result="success",upstream="a:5672"} 0"#,
        r#"dlx_proxy_upstream_connect_attempts_total{result="success",upstream="b:5672"} 1"#,
        "dlx_proxy_upstream_reachable 1",
        r#"dlx_proxy_dead_letter_retries_total{reason="nacked"} 2"#,
        r#"dlx_proxy_dead_letter_retries_total{reason="timeout"} 1"#,
        r#"dlx_proxy_dead_letter_retries_total{reason="channel_lost"} 0"#,
        r#"dlx_proxy_dead_letter_retries_total{reason="access_refused"} 0"#,
        "dlx_proxy_dead_letters_held 1",
        r#"dlx_proxy_upstream_policy_sync_total{result="success"} 2"#,
        r#"dlx_proxy_upstream_policy_sync_total{result="failure"} 0"#,
        "dlx_proxy_upstream_policies_synced 3",
    ] {
        assert!(has_line(&text, line), "missing {line:?} in:\n{text}");
    }
    assert!(!text.contains(r#"direction="upstream_out"} 0"#));
}

#[test]
fn queues_beyond_the_cap_fold_into_other() {
    let metrics = Metrics::new(2);
    metrics.dead_lettered("/", "a", "expired");
    metrics.set_queue_depth("/", "b", 1, 10);
    metrics.dead_lettered("/", "c", "expired");
    metrics.dead_lettered("/", "d", "expired");
    metrics.dropped("/", "d", "cycle");
    metrics.set_queue_depth("/", "d", 5, 50);
    // Admitted queues keep their own labels.
    metrics.dead_lettered("/", "b", "maxlen");
    let text = metrics.encode();
    for line in [
        r#"dlx_proxy_dead_lettered_total{queue="a",reason="expired",vhost="/"} 1"#,
        r#"dlx_proxy_dead_lettered_total{queue="b",reason="maxlen",vhost="/"} 1"#,
        r#"dlx_proxy_dead_lettered_total{queue="_other",reason="expired",vhost="/"} 2"#,
        r#"dlx_proxy_dead_letter_dropped_total{cause="cycle",queue="_other",vhost="/"} 1"#,
        r#"dlx_proxy_queue_messages{queue="b",vhost="/"} 1"#,
        "dlx_proxy_metric_labels_folded_total 4",
    ] {
        assert!(has_line(&text, line), "missing {line:?} in:\n{text}");
    }
    assert!(!text.contains(r#"queue="c""#));
    assert!(!text.contains(r#"queue="d""#));
    assert!(!text.contains(r#"dlx_proxy_queue_messages{queue="_other""#));
}

#[test]
fn removing_a_queue_drops_its_series_and_frees_its_slot() {
    let metrics = Metrics::new(1);
    metrics.dead_lettered("/", "a", "expired");
    metrics.dropped("/", "a", "no_dlx");
    metrics.set_queue_depth("/", "a", 3, 30);
    metrics.remove_queue("/", "a");
    let text = metrics.encode();
    assert!(!text.contains(r#"queue="a""#), "{text}");
    metrics.dead_lettered("/", "b", "rejected");
    let text = metrics.encode();
    assert!(has_line(
        &text,
        r#"dlx_proxy_dead_lettered_total{queue="b",reason="rejected",vhost="/"} 1"#
    ));
    assert!(has_line(&text, "dlx_proxy_metric_labels_folded_total 0"));
    // Removing an unknown or folded queue is harmless.
    metrics.remove_queue("/", "never");
}

#[test]
fn registries_are_independent() {
    let first = Metrics::new(10);
    let second = Metrics::new(10);
    first.published(1);
    assert!(has_line(
        &second.encode(),
        "dlx_proxy_messages_published_total 0"
    ));
}

/// A queue whose held retries were counted under `_other` keeps them there until they are
/// gone, though a label slot frees up meanwhile; deleting it takes them off `_other`.
#[test]
fn held_retries_of_a_folded_queue_come_off_the_label_they_went_on() {
    let metrics = Metrics::new(1);
    metrics.add_retry_held("/", "a", 1);
    metrics.add_retry_held("/", "b", 2);
    let other = "dlx_proxy_retry_held_messages{queue=\"_other\",vhost=\"/\"}";
    assert!(has_line(&metrics.encode(), &format!("{other} 2")));
    // Queue a is deleted: its slot is free, but b's messages are on `_other`.
    metrics.remove_queue("/", "a");
    metrics.add_retry_held("/", "b", -1);
    metrics.add_retry_held("/", "b", -1);
    let text = metrics.encode();
    assert!(has_line(&text, &format!("{other} 0")), "{text}");
    assert!(!text.contains("queue=\"b\""), "{text}");
    // Back to a first hold, b takes the free slot.
    metrics.add_retry_held("/", "b", 1);
    assert!(has_line(
        &metrics.encode(),
        "dlx_proxy_retry_held_messages{queue=\"b\",vhost=\"/\"} 1"
    ));
    // A folded queue deleted while holding messages.
    metrics.add_retry_held("/", "c", 3);
    assert!(has_line(&metrics.encode(), &format!("{other} 3")));
    metrics.remove_queue("/", "c");
    assert!(has_line(&metrics.encode(), &format!("{other} 0")));
}

#[test]
fn retry_series_are_labelled_by_tier_and_removed_with_their_queue() {
    let metrics = Metrics::new(10);
    metrics.retried("/", "work", 1);
    metrics.retried("/", "work", 2);
    metrics.retried("/", "work", 2);
    metrics.add_retry_held("/", "work", 3);
    metrics.add_retry_held("/", "work", -1);
    metrics.retry_exhausted("/", "work");
    let text = metrics.encode();
    for line in [
        "dlx_proxy_retries_total{queue=\"work\",tier=\"1\",vhost=\"/\"} 1",
        "dlx_proxy_retries_total{queue=\"work\",tier=\"2\",vhost=\"/\"} 2",
        "dlx_proxy_retry_held_messages{queue=\"work\",vhost=\"/\"} 2",
        "dlx_proxy_retry_exhausted_total{queue=\"work\",vhost=\"/\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    metrics.remove_queue("/", "work");
    assert!(!metrics.encode().contains("queue=\"work\""));
}

#[test]
fn redrive_counts_by_target_and_by_dead_letter_queue_and_go_with_the_queue() {
    let metrics = Metrics::new(2);
    let moved = ["a".to_string(), "b".to_string(), "a".to_string()];
    metrics.redrive_counted(
        "/",
        "dlq",
        &moved,
        4,
        &["no_queue", "no_queue", "target_full"],
    );
    metrics.set_redrive_jobs(3);
    let text = metrics.encode();
    for line in [
        r#"dlx_proxy_redriven_total{queue="a",vhost="/"} 2"#,
        r#"dlx_proxy_redriven_total{queue="b",vhost="/"} 1"#,
        // Over the cap of two queues: folded into the shared label.
        r#"dlx_proxy_redrive_skipped_total{queue="_other",vhost="/"} 4"#,
        r#"dlx_proxy_redrive_failed_total{cause="no_queue",queue="_other",vhost="/"} 2"#,
        r#"dlx_proxy_redrive_failed_total{cause="target_full",queue="_other",vhost="/"} 1"#,
        "dlx_proxy_redrive_jobs_running 3",
    ] {
        assert!(has_line(&text, line), "{line} missing:\n{text}");
    }
    metrics.remove_queue("/", "a");
    let text = metrics.encode();
    assert!(!text.contains(r#"queue="a""#), "{text}");
    assert!(text.contains(r#"queue="b""#), "{text}");
}

#[test]
fn the_drain_is_woken_when_releases_bring_the_deliveries_to_zero() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};
    let metrics = Metrics::new(10);
    metrics.add_inflight(3, 300);
    let mut settled = pin!(metrics.settled());
    settled.as_mut().enable();
    let mut cx = Context::from_waker(Waker::noop());
    metrics.add_inflight(-2, -200);
    assert!(
        settled.as_mut().poll(&mut cx).is_pending(),
        "woken at 1 left"
    );
    metrics.add_inflight(1, 100);
    metrics.add_inflight(-1, -100);
    assert!(
        settled.as_mut().poll(&mut cx).is_pending(),
        "woken at 1 left"
    );
    metrics.add_inflight(-1, -100);
    assert_eq!(settled.as_mut().poll(&mut cx), Poll::Ready(()));
    assert_eq!(metrics.inflight_deliveries(), 0);
}
