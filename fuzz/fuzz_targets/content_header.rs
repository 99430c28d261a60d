//! A content header payload from a peer: parsed, its properties round-tripped, and handed to
//! what the embedded broker does with a publish (`server::publish::prepare`: user-id and
//! expiration checks, CC/BCC keys, BCC removal) and to the dead-letter readers.
//!
//! Checks: no panic; the raw properties are kept byte for byte; properties re-encode to
//! bytes that decode and re-encode identically; re-encoding with the opaque (too deep to
//! decode) header entries restored from the original gives a section that decodes and is a
//! fixed point of the same re-encoding; one header read from the raw section without decoding
//! it (`headers::header_value`) is the value the full decode has; a prepared message carries
//! no BCC header and an expiration only when `parse_expiration` accepted it.
#![no_main]

use bytes::Bytes;
use dlx_proxy::amqp::content::{decode_properties, encode_properties_from, parse_content_header};
use dlx_proxy::amqp::headers::header_value;
use dlx_proxy::deadletter::{HEADER_BCC, HEADER_CC, routing_key_list, x_death_entries};
use dlx_proxy::rabbit::args::{MAX_EXPIRY_MS, parse_expiration};
use dlx_proxy::server::publish::prepare;
use dlx_proxy_fuzz::assert_properties_round_trip;
use libfuzzer_sys::fuzz_target;

const READ_KEYS: [&str; 3] = ["x-delivery-count", HEADER_CC, "x-death"];

fuzz_target!(|data: &[u8]| {
    let payload = Bytes::copy_from_slice(data);
    let raw = data.get(12..).unwrap_or_default();
    let read: Vec<_> = READ_KEYS.iter().map(|k| header_value(raw, k)).collect();
    let Ok(header) = parse_content_header(&payload) else {
        return;
    };
    assert_eq!(&header.raw_properties[..], &data[12..]);
    let props = header.properties.clone();
    for (key, value) in READ_KEYS.iter().zip(read) {
        let decoded = props.headers().as_ref().and_then(|h| h.inner().get(*key));
        // Compared as printed: a NaN float inside is the same value but not equal to itself.
        assert_eq!(
            format!("{:?}", value.ok().flatten().as_ref()),
            format!("{decoded:?}"),
            "header {key}"
        );
    }
    assert_properties_round_trip(&props);
    let restored = encode_properties_from(&props, &data[12..]);
    let decoded = decode_properties(&restored).expect("restored properties must decode");
    assert_eq!(encode_properties_from(&decoded, &restored), restored);

    let _ = x_death_entries(&props);
    if let Some(headers) = props.headers() {
        let _ = routing_key_list(headers.inner().get(HEADER_CC));
        let _ = routing_key_list(headers.inner().get(HEADER_BCC));
    }
    let expiration = props
        .expiration()
        .as_ref()
        .map(|e| parse_expiration(e.as_str()));
    if let Some(Ok(ms)) = &expiration {
        assert!(*ms <= MAX_EXPIRY_MS);
    }

    let user = props
        .user_id()
        .as_ref()
        .map_or("guest".to_string(), |u| u.as_str().to_string());
    match prepare("x", "rk", header, Bytes::from_static(b"body"), &user) {
        Ok(prepared) => {
            assert!(!matches!(expiration, Some(Err(_))));
            if let Some(headers) = &prepared.headers {
                assert!(!headers.contains_key(HEADER_BCC));
            }
        }
        Err(_) => assert!(matches!(expiration, Some(Err(_)))),
    }
});
