//! TLS on the amqps listener, with certificates generated at test time: a CA, a server
//! certificate for "localhost" and client certificates. lapin publishes and consumes over
//! amqps; client certificates are required when `tls.require_client_cert` is on; and the
//! upstream connector of `dlx_proxy::tls` completes a handshake against the same listener.
//!
//! Certificate rotation without a restart: a certificate and key rewritten in place, or
//! swapped in as a Kubernetes Secret update (`..data` symlink), are what the next handshake
//! presents while connections made before keep working; a broken or mismatched pair is
//! refused, counted in `tls_reloads_total{result="failure"}` (read over HTTP) and the previous
//! certificate stays in force; a rotated client CA decides the next client-certificate check.
//! SIGHUP re-reads the files of the real binary even when no watched directory changed.

use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::pki::{Pem, TestCa};
use common::{
    RawClient, ServiceProcess, TempDir, TestBroker, free_addresses, free_port, metric_value, poll,
    process_config, scrape, start_with, test_config, unique, wait_metric, wait_metric_at_least,
    wait_until,
};
use dlx_proxy::amqp::codec::PROTOCOL_HEADER;
use dlx_proxy::config::Config;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, DefaultConnectionBuilder};
use rcgen::ExtendedKeyUsagePurpose;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Everything a test needs, written to a scratch directory.
struct Pki {
    dir: TempDir,
    ca: TestCa,
    client: Pem,
    /// A client certificate from a CA the server does not trust.
    stranger: Pem,
}

impl Pki {
    fn new() -> Pki {
        let dir = TempDir::new("dlx-proxy-tls");
        let ca = TestCa::new("dlx-proxy test CA");
        let server = ca.localhost_server();
        let client = ca.leaf("client", &["client"], ExtendedKeyUsagePurpose::ClientAuth);
        let other_ca = TestCa::new("another CA");
        let stranger = other_ca.leaf(
            "stranger",
            &["stranger"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        std::fs::write(dir.join("ca.pem"), &ca.pem).unwrap();
        std::fs::write(dir.join("other-ca.pem"), &other_ca.pem).unwrap();
        std::fs::write(dir.join("server.pem"), &server.cert).unwrap();
        std::fs::write(dir.join("server.key"), &server.key).unwrap();
        Pki {
            dir,
            ca,
            client,
            stranger,
        }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_string()
    }

    /// An embedded broker with an amqps listener; `client_ca` asks for client certificates,
    /// `require` makes them mandatory.
    fn config(&self, client_ca: bool, require: bool) -> Config {
        let mut c = test_config();
        c.listen.amqps = "127.0.0.1:0".into();
        c.tls.cert_file = self.path("server.pem");
        c.tls.key_file = self.path("server.key");
        if client_ca {
            c.tls.client_ca_file = self.path("ca.pem");
        }
        c.tls.require_client_cert = require;
        c
    }

    /// lapin's TLS settings: trust the test CA, optionally present `identity`.
    fn client_tls(&self, identity: Option<&Pem>) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: identity.map(|pem| OwnedIdentity::PKCS8 {
                pem: pem.cert.clone().into_bytes(),
                key: pem.key.clone().into_bytes(),
            }),
            cert_chain: Some(self.ca.pem.clone()),
        }
    }
}

fn amqps_port(broker: &TestBroker) -> u16 {
    broker.service.amqps_addr.expect("amqps listener").port()
}

/// Connects lapin over amqps to `host`; fails after 10 s rather than hanging.
async fn connect_tls(host: &str, port: u16, tls: OwnedTLSConfig) -> Result<Connection, String> {
    let uri = format!("amqps://guest:guest@{host}:{port}/%2f");
    let connect = async {
        DefaultConnectionBuilder::new()?
            .with_uri_str(uri)
            .with_tls_config(tls)
            .connect()
            .await
    };
    match tokio::time::timeout(Duration::from_secs(10), connect).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err("TLS connect timed out".to_string()),
    }
}

/// Declares a queue, publishes with confirms, reads one message with basic.get and one
/// with a consumer; proves the TLS connection carries real traffic.
async fn round_trip(conn: &Connection) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("tls");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for body in [b"over-tls-1".as_slice(), b"over-tls-2".as_slice()] {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{confirm:?}");
    }
    let got = ch
        .basic_get(q.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(got.delivery.data, b"over-tls-1");
    got.delivery.ack(BasicAckOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "tls-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .expect("a delivery in time")
        .expect("consumer open")
        .unwrap();
    assert_eq!(delivery.data, b"over-tls-2");
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    // Closed here, not dropped: lapin closes a dropped channel in the background, and a
    // connection.close racing that close fails with "invalid channel state: Closing".
    ch.close(200, "done".into()).await.unwrap();
}

#[tokio::test]
async fn publish_and_consume_over_amqps() {
    let pki = Pki::new();
    let broker = start_with(pki.config(false, false)).await;
    let conn = connect_tls("localhost", amqps_port(&broker), pki.client_tls(None))
        .await
        .expect("amqps connection");
    round_trip(&conn).await;
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_server_ca_is_refused() {
    let pki = Pki::new();
    let broker = start_with(pki.config(false, false)).await;
    let other_ca = std::fs::read_to_string(pki.dir.join("other-ca.pem")).unwrap();
    let tls = OwnedTLSConfig {
        identity: None,
        cert_chain: Some(other_ca),
    };
    let result = connect_tls("localhost", amqps_port(&broker), tls).await;
    assert!(result.is_err(), "connected with an untrusted server CA");
}

#[tokio::test]
async fn plain_amqp_on_the_amqps_port_gets_no_amqp_answer() {
    let pki = Pki::new();
    let broker = start_with(pki.config(false, false)).await;
    let mut client = RawClient::connect_no_handshake(broker.service.amqps_addr.unwrap()).await;
    client.send_raw(&PROTOCOL_HEADER).await;
    let answer = client.read_to_end().await;
    // A TLS alert or nothing, but never connection.start (frame type 1 on channel 0).
    assert!(
        !answer.starts_with(&[1, 0, 0]),
        "plain AMQP answered on the TLS port: {answer:?}"
    );
    // The plain listener is unaffected.
    let (conn, _ch) = broker.channel().await;
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test]
async fn required_client_certificates_are_enforced() {
    let pki = Pki::new();
    let broker = start_with(pki.config(true, true)).await;
    let port = amqps_port(&broker);

    let without = connect_tls("localhost", port, pki.client_tls(None)).await;
    assert!(without.is_err(), "connected without a client certificate");

    let stranger = connect_tls("localhost", port, pki.client_tls(Some(&pki.stranger))).await;
    assert!(
        stranger.is_err(),
        "connected with a client certificate from an untrusted CA"
    );

    let conn = connect_tls("localhost", port, pki.client_tls(Some(&pki.client)))
        .await
        .expect("a client with a trusted certificate connects");
    round_trip(&conn).await;
    conn.close(200, "bye".into()).await.unwrap();

    // The broker is still healthy after the refused handshakes: each of the three held a
    // connection slot while it lasted (as a plain connection does from its accept), and none
    // is left open.
    let text = broker.metrics_text();
    assert_eq!(
        common::metric_value(&text, "dlx_proxy_connections_opened_total"),
        Some(3.0),
        "{text}"
    );
    wait_until("no connection left", Duration::from_secs(5), async || {
        metric_value(&broker.metrics_text(), "dlx_proxy_connections") == Some(0.0)
    })
    .await;
}

#[tokio::test]
async fn optional_client_certificates_accept_clients_with_and_without_one() {
    let pki = Pki::new();
    let broker = start_with(pki.config(true, false)).await;
    let port = amqps_port(&broker);
    let without = connect_tls("localhost", port, pki.client_tls(None))
        .await
        .expect("no certificate is fine when not required");
    round_trip(&without).await;
    let with = connect_tls("localhost", port, pki.client_tls(Some(&pki.client)))
        .await
        .expect("a trusted certificate is fine");
    round_trip(&with).await;
    let stranger = connect_tls("localhost", port, pki.client_tls(Some(&pki.stranger))).await;
    assert!(
        stranger.is_err(),
        "a certificate that is presented must still verify"
    );
}

/// Reads the first frame header after the protocol header: (type, channel, class, method).
async fn first_method<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
) -> (u8, u16, u16, u16) {
    stream.write_all(&PROTOCOL_HEADER).await.unwrap();
    let mut head = [0u8; 11];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut head))
        .await
        .expect("an answer in time")
        .unwrap();
    (
        head[0],
        u16::from_be_bytes([head[1], head[2]]),
        u16::from_be_bytes([head[7], head[8]]),
        u16::from_be_bytes([head[9], head[10]]),
    )
}

#[tokio::test]
async fn upstream_connector_handshakes_with_the_amqps_listener() {
    let pki = Pki::new();
    let broker = start_with(pki.config(false, false)).await;
    let addr = broker.service.amqps_addr.unwrap();

    // Verified with the right CA and name: the server answers connection.start (10, 10).
    let connector = dlx_proxy::tls::connector(&pki.path("ca.pem"), true).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut tls = dlx_proxy::tls::connect(&connector, tcp, "localhost")
        .await
        .expect("verified handshake");
    assert_eq!(first_method(&mut tls).await, (1, 0, 10, 10));

    // The certificate's IP address SAN works as a server name too.
    let tcp = TcpStream::connect(addr).await.unwrap();
    dlx_proxy::tls::connect(&connector, tcp, "127.0.0.1")
        .await
        .expect("IP address server name");

    // A name the certificate does not cover is refused.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let wrong_name = dlx_proxy::tls::connect(&connector, tcp, "not-this-host.example").await;
    assert!(wrong_name.is_err(), "a wrong server name was accepted");

    // A CA that did not sign the server certificate is refused.
    let untrusting = dlx_proxy::tls::connector(&pki.path("other-ca.pem"), true).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    assert!(
        dlx_proxy::tls::connect(&untrusting, tcp, "localhost")
            .await
            .is_err(),
        "an untrusted server certificate was accepted"
    );

    // tls_verify = false accepts any certificate.
    let unverified = dlx_proxy::tls::connector("", false).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut tls = dlx_proxy::tls::connect(&unverified, tcp, "whatever.example")
        .await
        .expect("unverified handshake");
    assert_eq!(first_method(&mut tls).await, (1, 0, 10, 10));
}

#[test]
fn connector_and_acceptor_refuse_incomplete_settings() {
    let error = dlx_proxy::tls::connector("", true).err().expect("an error");
    assert!(error.to_string().contains("tls_ca_file"), "{error}");
    let missing = PathBuf::from("/nonexistent/ca.pem");
    let error = dlx_proxy::tls::connector(missing.to_str().unwrap(), true)
        .err()
        .expect("an error");
    assert!(
        error.to_string().contains("/nonexistent/ca.pem"),
        "{error:#}"
    );

    let pki = Pki::new();
    let mut tls = pki.config(false, false).tls;
    tls.key_file = String::new();
    let error = dlx_proxy::tls::acceptor(&tls).err().expect("an error");
    assert!(error.to_string().contains("tls.key_file"), "{error}");
    let mut tls = pki.config(false, false).tls;
    tls.cert_file = pki.path("server.key");
    let error = dlx_proxy::tls::acceptor(&tls).err().expect("an error");
    assert!(format!("{error:#}").contains("tls.cert_file"), "{error:#}");
}

#[tokio::test]
async fn the_service_refuses_to_start_with_unusable_tls_files() {
    let pki = Pki::new();
    let mut config = pki.config(false, false);
    config.tls.cert_file = pki.path("missing.pem");
    let error = dlx_proxy::service::start(config)
        .await
        .err()
        .expect("start fails");
    let text = format!("{error:#}");
    assert!(
        text.contains("tls.cert_file") && text.contains("missing.pem"),
        "{text}"
    );
}

// ------------------------------------------------------------------------------------------
// Certificate rotation
// ------------------------------------------------------------------------------------------

const RELOADED: &str = r#"dlx_proxy_tls_reloads_total{result="success"}"#;
const REJECTED: &str = r#"dlx_proxy_tls_reloads_total{result="failure"}"#;

/// A server certificate for localhost from `ca`, with `common_name` telling it apart.
fn server_leaf(ca: &TestCa, common_name: &str) -> Pem {
    ca.leaf(
        common_name,
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    )
}

/// The DER of the first certificate of a PEM text.
fn der(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .expect("a PEM certificate")
        .to_vec()
}

/// The leaf certificate a new TLS connection to `addr` is shown (verified against `ca_file`
/// for the name localhost).
async fn presented(addr: SocketAddr, ca_file: &str) -> Vec<u8> {
    let connector = dlx_proxy::tls::connector(ca_file, true).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = dlx_proxy::tls::connect(&connector, tcp, "localhost")
        .await
        .expect("TLS handshake");
    tls.get_ref().1.peer_certificates().expect("a certificate")[0].to_vec()
}

/// Waits until new connections are shown `certificate` (10 s at most).
async fn wait_presented(addr: SocketAddr, ca_file: &str, certificate: &str) {
    let wanted = der(certificate);
    let shown = poll(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || (presented(addr, ca_file).await == wanted).then_some(()),
    )
    .await;
    assert!(
        shown.is_some(),
        "the listener never presented the new certificate"
    );
}

/// The value of `series` over HTTP, 0 when it does not exist yet.
async fn metric(admin: SocketAddr, series: &str) -> f64 {
    metric_value(&scrape(admin).await, series).unwrap_or(0.0)
}

/// An embedded broker with an amqps listener on `cert_file`/`key_file` and the admin HTTP
/// listener on.
async fn rotating_broker(cert_file: &Path, key_file: &Path) -> (TestBroker, SocketAddr) {
    let mut config = test_config();
    config.listen.amqps = "127.0.0.1:0".into();
    config.listen.admin = "127.0.0.1:0".into();
    config.tls.cert_file = cert_file.display().to_string();
    config.tls.key_file = key_file.display().to_string();
    let broker = start_with(config).await;
    let admin = broker.service.admin_addr.expect("admin listener");
    (broker, admin)
}

/// After a rejected reload: the failure was counted over HTTP, new connections are still
/// shown `in_force`, and `existing` still carries traffic.
async fn assert_rejected(
    broker: &TestBroker,
    admin: SocketAddr,
    failures_before: f64,
    pki: &Pki,
    in_force: &str,
    existing: &Connection,
) {
    let addr = broker.service.amqps_addr.unwrap();
    wait_metric_at_least(admin, REJECTED, failures_before + 1.0).await;
    assert_eq!(presented(addr, &pki.path("ca.pem")).await, der(in_force));
    round_trip(existing).await;
    let fresh = connect_tls("localhost", addr.port(), pki.client_tls(None))
        .await
        .expect("new connections still work with the certificate in force");
    round_trip(&fresh).await;
    fresh.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_rewritten_in_place_applies_to_new_connections() {
    let pki = Pki::new();
    let (cert_file, key_file) = (pki.dir.join("server.pem"), pki.dir.join("server.key"));
    let first = std::fs::read_to_string(&cert_file).unwrap();
    let (broker, admin) = rotating_broker(&cert_file, &key_file).await;
    let addr = broker.service.amqps_addr.unwrap();
    let ca_file = pki.path("ca.pem");
    assert_eq!(presented(addr, &ca_file).await, der(&first));
    let before = connect_tls("localhost", addr.port(), pki.client_tls(None))
        .await
        .expect("amqps connection with the first certificate");
    round_trip(&before).await;

    // An operator (or cert-manager without a Secret volume) overwrites both files.
    let second = server_leaf(&pki.ca, "rotated");
    std::fs::write(&cert_file, &second.cert).unwrap();
    std::fs::write(&key_file, &second.key).unwrap();
    wait_presented(addr, &ca_file, &second.cert).await;
    wait_metric_at_least(admin, RELOADED, 1.0).await;
    // The connection made before the rotation goes on; a new one uses the new certificate.
    round_trip(&before).await;
    let after = connect_tls("localhost", addr.port(), pki.client_tls(None))
        .await
        .expect("amqps connection with the rotated certificate");
    round_trip(&after).await;
    after.close(200, "bye".into()).await.unwrap();

    // A certificate file cut short is refused; the rotated certificate stays in force.
    let failures = metric(admin, REJECTED).await;
    std::fs::write(&cert_file, &second.cert[..second.cert.len() / 2]).unwrap();
    assert_rejected(&broker, admin, failures, &pki, &second.cert, &before).await;

    // So is a certificate that does not match the key in force.
    let failures = metric(admin, REJECTED).await;
    std::fs::write(&cert_file, &first).unwrap();
    assert_rejected(&broker, admin, failures, &pki, &second.cert, &before).await;
    before.close(200, "bye".into()).await.unwrap();
}

/// A Kubernetes Secret volume: `tls.crt` and `tls.key` are symlinks into `..data`, itself a
/// symlink to a timestamped directory that each update replaces atomically.
struct SecretVolume {
    dir: TempDir,
    generation: u32,
}

impl SecretVolume {
    fn new(cert: &str, key: &str) -> SecretVolume {
        let mut volume = SecretVolume {
            dir: TempDir::new("dlx-proxy-secret"),
            generation: 0,
        };
        volume.update(cert, key);
        for name in ["tls.crt", "tls.key"] {
            std::os::unix::fs::symlink(format!("..data/{name}"), volume.dir.join(name)).unwrap();
        }
        volume
    }

    /// What the kubelet does on a Secret update.
    fn update(&mut self, cert: &str, key: &str) {
        let old = format!("..2026_01_01_00_00_0{}", self.generation);
        self.generation += 1;
        let new = format!("..2026_01_01_00_00_0{}", self.generation);
        std::fs::create_dir(self.dir.join(&new)).unwrap();
        std::fs::write(self.dir.join(&new).join("tls.crt"), cert).unwrap();
        std::fs::write(self.dir.join(&new).join("tls.key"), key).unwrap();
        std::os::unix::fs::symlink(&new, self.dir.join("..data_tmp")).unwrap();
        std::fs::rename(self.dir.join("..data_tmp"), self.dir.join("..data")).unwrap();
        let _ = std::fs::remove_dir_all(self.dir.join(&old));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubernetes_secret_update_applies_to_new_connections() {
    let pki = Pki::new();
    let ca_file = pki.path("ca.pem");
    let first = server_leaf(&pki.ca, "first");
    let mut secret = SecretVolume::new(&first.cert, &first.key);
    let (broker, admin) =
        rotating_broker(&secret.dir.join("tls.crt"), &secret.dir.join("tls.key")).await;
    let addr = broker.service.amqps_addr.unwrap();
    assert_eq!(presented(addr, &ca_file).await, der(&first.cert));
    let before = connect_tls("localhost", addr.port(), pki.client_tls(None))
        .await
        .expect("amqps connection with the first certificate");

    let second = server_leaf(&pki.ca, "second");
    secret.update(&second.cert, &second.key);
    wait_presented(addr, &ca_file, &second.cert).await;
    wait_metric_at_least(admin, RELOADED, 1.0).await;
    round_trip(&before).await;

    // An update whose certificate and key do not belong together is refused.
    let failures = metric(admin, REJECTED).await;
    secret.update(&first.cert, &second.key);
    assert_rejected(&broker, admin, failures, &pki, &second.cert, &before).await;
    before.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_client_ca_decides_the_next_client_certificate_check() {
    let pki = Pki::new();
    let client_ca = pki.dir.join("client-ca.pem");
    std::fs::copy(pki.dir.join("other-ca.pem"), &client_ca).unwrap();
    let mut config = pki.config(true, true);
    config.tls.client_ca_file = client_ca.display().to_string();
    config.listen.admin = "127.0.0.1:0".into();
    let broker = start_with(config).await;
    let admin = broker.service.admin_addr.unwrap();
    let port = amqps_port(&broker);
    // The listener trusts the other CA: the stranger gets in, the test CA's client does not.
    let stranger = connect_tls("localhost", port, pki.client_tls(Some(&pki.stranger)))
        .await
        .expect("a client of the CA in force connects");
    let refused = connect_tls("localhost", port, pki.client_tls(Some(&pki.client))).await;
    assert!(refused.is_err(), "a client of another CA was accepted");

    std::fs::write(&client_ca, &pki.ca.pem).unwrap();
    let accepted = poll(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            connect_tls("localhost", port, pki.client_tls(Some(&pki.client)))
                .await
                .ok()
        },
    )
    .await
    .expect("the client of the rotated CA is accepted");
    round_trip(&accepted).await;
    assert_eq!(metric(admin, RELOADED).await, 1.0);
    let refused = connect_tls("localhost", port, pki.client_tls(Some(&pki.stranger))).await;
    assert!(refused.is_err(), "a client of the old CA was accepted");
    // The stranger's connection was made before the rotation and goes on.
    round_trip(&stranger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_certificates_the_watcher_cannot_see() {
    let pki = Pki::new();
    let ca_file = pki.path("ca.pem");
    // The configured files are symlinks into another directory: a change to their targets
    // makes no event in the watched directory, so only SIGHUP can pick it up.
    let (store, watched) = (pki.dir.join("store"), pki.dir.join("watched"));
    std::fs::create_dir(&store).unwrap();
    std::fs::create_dir(&watched).unwrap();
    let first = server_leaf(&pki.ca, "first");
    std::fs::write(store.join("cert.pem"), &first.cert).unwrap();
    std::fs::write(store.join("key.pem"), &first.key).unwrap();
    std::os::unix::fs::symlink(store.join("cert.pem"), watched.join("tls.crt")).unwrap();
    std::os::unix::fs::symlink(store.join("key.pem"), watched.join("tls.key")).unwrap();

    let (amqp, admin) = free_addresses();
    let amqps = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let config = process_config(amqp, admin, 1)
        .replace("[listen]\n", &format!("[listen]\namqps = \"{amqps}\"\n"))
        + &format!(
            "\n[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            watched.join("tls.crt").display(),
            watched.join("tls.key").display()
        );
    let config_file = pki.dir.join("config.toml");
    std::fs::write(&config_file, config).unwrap();
    let process = ServiceProcess::start(
        env!("CARGO_BIN_EXE_dlx-proxy"),
        pki.dir.path(),
        &config_file,
        amqp,
        admin,
    )
    .await;
    assert_eq!(presented(amqps, &ca_file).await, der(&first.cert));

    let second = server_leaf(&pki.ca, "second");
    std::fs::write(store.join("cert.pem"), &second.cert).unwrap();
    std::fs::write(store.join("key.pem"), &second.key).unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        presented(amqps, &ca_file).await,
        der(&first.cert),
        "reloaded without SIGHUP:\n{}",
        process.logs()
    );
    assert_eq!(metric(admin, RELOADED).await, 0.0);

    process.signal("HUP");
    wait_presented(amqps, &ca_file, &second.cert).await;
    wait_metric(admin, RELOADED, 1.0).await;
    assert_eq!(metric(admin, REJECTED).await, 0.0);
}

/// A TLS handshake in progress holds a connection slot: sockets that are opened on the amqps
/// port and never finish a handshake count against `limits.max_connections` (they grew the
/// tasks and sockets without a limit until the process ran out of descriptors), and a client
/// that arrives while they hold every slot is refused with 530 over TLS. Closing them frees
/// the slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_handshakes_in_progress_hold_connection_slots() {
    let pki = Pki::new();
    let mut config = pki.config(false, false);
    config.limits.max_connections = 2;
    let broker = start_with(config).await;
    let amqps = broker.service.amqps_addr.expect("amqps listener");
    let silent_a = TcpStream::connect(amqps).await.unwrap();
    let silent_b = TcpStream::connect(amqps).await.unwrap();
    wait_until("two slots taken", Duration::from_secs(5), async || {
        metric_value(&broker.metrics_text(), "dlx_proxy_connections") == Some(2.0)
    })
    .await;
    let err = connect_tls("localhost", amqps.port(), pki.client_tls(None))
        .await
        .expect_err("every slot is held by a handshake");
    assert!(
        err.contains("530") || err.contains("connection limit"),
        "{err}"
    );
    drop((silent_a, silent_b));
    wait_until("the slots freed", Duration::from_secs(5), async || {
        metric_value(&broker.metrics_text(), "dlx_proxy_connections") == Some(0.0)
    })
    .await;
    let conn = connect_tls("localhost", amqps.port(), pki.client_tls(None))
        .await
        .expect("a slot is free again");
    round_trip(&conn).await;
    conn.close(200, "bye".into()).await.unwrap();
}
