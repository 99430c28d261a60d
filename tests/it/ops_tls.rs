//! TLS on the amqps listener, with certificates generated at test time: a CA, a server
//! certificate for "localhost" and client certificates. lapin publishes and consumes over
//! amqps; client certificates are required when `tls.require_client_cert` is on; and the
//! upstream connector of `dlx_proxy::tls` completes a handshake against the same listener.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::pki::{Pem, TestCa};
use common::{RawClient, TempDir, TestBroker, start_with, test_config, unique};
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

    // The broker is still healthy after the refused handshakes: exactly one connection was
    // ever accepted as AMQP.
    let text = broker.metrics_text();
    assert_eq!(
        common::metric_value(&text, "dlx_proxy_connections_opened_total"),
        Some(1.0),
        "{text}"
    );
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
