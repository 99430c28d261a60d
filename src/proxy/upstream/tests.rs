//! Unit tests of [`crate::proxy::upstream`].

use super::*;

fn config(url: &str) -> UpstreamConfig {
    UpstreamConfig {
        url: url.into(),
        ..UpstreamConfig::default()
    }
}

#[test]
fn parses_plain_urls() {
    let target = UpstreamTarget::from_config(&config("amqp://guest:pw@rabbit:5673/%2f")).unwrap();
    assert_eq!(target.host, "rabbit");
    assert_eq!(target.port, 5673);
    assert_eq!(target.address(), "rabbit:5673");
    let target = UpstreamTarget::from_config(&config("amqp://rabbit")).unwrap();
    assert_eq!(target.port, 5672);
}

#[test]
fn tls_needs_a_ca_file_unless_verification_is_off() {
    assert!(matches!(
        UpstreamTarget::from_config(&config("amqps://rabbit")),
        Err(UpstreamError::Tls(_))
    ));
    let mut cfg = config("amqps://rabbit");
    cfg.tls_verify = false;
    let target = UpstreamTarget::from_config(&cfg).unwrap();
    assert_eq!(target.port, 5671);
}

#[test]
fn bad_urls_are_errors_without_passwords() {
    let err = UpstreamTarget::from_config(&config("http://user:secret@x")).unwrap_err();
    assert!(!err.to_string().contains("secret"));
}

fn pool(urls: &[String]) -> (UpstreamPool, Arc<Metrics>) {
    let metrics = Metrics::new(10);
    let config = UpstreamConfig {
        urls: urls.to_vec(),
        connect_timeout_secs: 1,
        ..UpstreamConfig::default()
    };
    (
        UpstreamPool::from_config(&config, metrics.clone()).unwrap(),
        metrics,
    )
}

fn line(metrics: &Metrics, series: &str) -> Option<f64> {
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn attempts(metrics: &Metrics, address: &str, result: &str) -> Option<f64> {
    line(
        metrics,
        &format!(
            "dlx_proxy_upstream_connect_attempts_total{{result=\"{result}\",upstream=\"{address}\"}}"
        ),
    )
}

async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

#[test]
fn url_lists_parse_in_order_and_errors_name_the_entry() {
    let config = UpstreamConfig {
        urls: vec!["amqp://u:pw@a:1".into(), "amqp://b".into()],
        ..UpstreamConfig::default()
    };
    let targets = UpstreamTarget::all_from_config(&config).unwrap();
    let addresses: Vec<String> = targets.iter().map(UpstreamTarget::address).collect();
    assert_eq!(addresses, ["a:1", "b:5672"]);
    let config = UpstreamConfig {
        urls: vec!["amqp://a".into(), "amqp://u:hidden@".into()],
        ..UpstreamConfig::default()
    };
    let err = UpstreamTarget::all_from_config(&config).unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("upstream.urls[1] "), "{text}");
    assert!(!text.contains("hidden"), "{text}");
    let err = UpstreamTarget::all_from_config(&UpstreamConfig::default()).unwrap_err();
    assert!(matches!(err, UpstreamError::NoUrl), "{err}");
}

#[tokio::test]
async fn the_pool_fails_over_in_order_and_counts_each_attempt() {
    let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let second = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = first.local_addr().unwrap().to_string();
    let b = second.local_addr().unwrap().to_string();
    let (pool, metrics) = pool(&[format!("amqp://{a}"), format!("amqp://{b}")]);
    assert!(!pool.is_reachable(), "unknown until the first dial");
    assert_eq!(line(&metrics, "dlx_proxy_upstream_reachable"), Some(0.0));
    assert_eq!(attempts(&metrics, &a, "failure"), Some(0.0));
    assert_eq!(attempts(&metrics, &b, "success"), Some(0.0));

    let (_stream, target) = pool.connect().await.unwrap();
    assert_eq!(target.address(), a);
    assert!(pool.is_reachable());
    assert_eq!(line(&metrics, "dlx_proxy_upstream_reachable"), Some(1.0));

    drop(first);
    let (_stream, target) = pool.connect().await.unwrap();
    assert_eq!(target.address(), b);
    assert_eq!(attempts(&metrics, &a, "success"), Some(1.0));
    assert_eq!(attempts(&metrics, &a, "failure"), Some(1.0));
    assert_eq!(attempts(&metrics, &b, "success"), Some(1.0));
    // The next connect starts with the one that worked: the dead one is not dialled.
    let (_stream, target) = pool.connect().await.unwrap();
    assert_eq!(target.address(), b);
    assert_eq!(attempts(&metrics, &a, "failure"), Some(1.0));
    assert_eq!(attempts(&metrics, &b, "success"), Some(2.0));
    assert!(pool.is_reachable());
}

#[tokio::test]
async fn with_nothing_reachable_the_error_names_every_target() {
    let (p, q) = (closed_port().await, closed_port().await);
    let (pool, metrics) = pool(&[
        format!("amqp://127.0.0.1:{p}"),
        format!("amqp://127.0.0.1:{q}"),
    ]);
    let err = pool.connect().await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("upstream 127.0.0.1:{p} unreachable: ")),
        "{text}"
    );
    assert!(
        text.contains(&format!("; upstream 127.0.0.1:{q} unreachable: ")),
        "{text}"
    );
    assert!(!pool.is_reachable());
    assert_eq!(line(&metrics, "dlx_proxy_upstream_reachable"), Some(0.0));
    assert_eq!(
        attempts(&metrics, &format!("127.0.0.1:{p}"), "failure"),
        Some(1.0)
    );
    assert_eq!(
        attempts(&metrics, &format!("127.0.0.1:{q}"), "failure"),
        Some(1.0)
    );
    assert!(!pool.check_now().await);
}

#[tokio::test]
async fn the_watch_finds_a_reachable_upstream_and_stops_on_shutdown() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = closed_port().await;
    let (pool, metrics) = pool(&[
        format!("amqp://127.0.0.1:{dead}"),
        format!("amqp://{}", listener.local_addr().unwrap()),
    ]);
    let pool = Arc::new(pool);
    let trigger = crate::shutdown::ShutdownTrigger::new();
    let watch = tokio::spawn(pool.clone().watch(trigger.subscribe()));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !pool.is_reachable() {
        assert!(
            Instant::now() < deadline,
            "the check never found the listener"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(line(&metrics, "dlx_proxy_upstream_reachable"), Some(1.0));
    // Checks are not client connects.
    let live = listener.local_addr().unwrap().to_string();
    assert_eq!(attempts(&metrics, &live, "success"), Some(0.0));
    // A lost connection with the listener gone: the check finds nothing.
    drop(listener);
    pool.report_lost();
    let deadline = Instant::now() + Duration::from_secs(5);
    while pool.is_reachable() {
        assert!(
            Instant::now() < deadline,
            "the lost connection was not checked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(2), watch)
        .await
        .expect("the watch ends on shutdown")
        .unwrap();
}

/// The outbox hands several pieces to one vectored write; through the upstream stream (and
/// the write half the connection task uses) that must be one write of all of them, not the
/// first piece only, as a stream without vectored writes does.
#[tokio::test]
async fn an_upstream_stream_writes_several_pieces_in_one_vectored_write() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("amqp://{}", listener.local_addr().unwrap());
    let target = UpstreamTarget::from_config(&config(&url)).unwrap();
    let (stream, accepted) = tokio::join!(target.connect(), listener.accept());
    let (_read, mut write) = tokio::io::split(stream.unwrap());
    let (mut peer, _) = accepted.unwrap();
    assert!(write.is_write_vectored());
    let pieces = [io::IoSlice::new(b"first "), io::IoSlice::new(b"second")];
    let written = write.write_vectored(&pieces).await.unwrap();
    assert_eq!(written, 12, "both pieces in one write");
    let mut got = [0u8; 12];
    peer.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"first second");
}
