//! Field tables, the recursive part of the wire format (queue and binding arguments, message
//! headers, connection properties), and the table walks of the headers exchange.
//!
//! Byte 0 selects the input: even = raw table bytes, odd = a structured table
//! (`dlx_proxy_fuzz::Value`). Checks: no panic; the non-recursive depth scanner
//! (`amqp::depth::skip_table`) accepts every table amq-protocol's parser accepts, ending at
//! the same offset (raw bytes reach amq-protocol only when the scanner has bounded their
//! depth, or when they are too short to nest deeply); a table re-encodes to bytes that parse
//! and re-encode identically; a headers binding validates or is refused with a text, and a
//! message whose headers equal an `all` binding's arguments matches it.
#![no_main]

use amq_protocol::types::FieldTable;
use amq_protocol::types::generation::gen_field_table;
use amq_protocol::types::parsing::parse_field_table;
use arbitrary::{Arbitrary, Unstructured};
use dlx_proxy::amqp::depth::{DEFAULT_MAX_TABLE_DEPTH, skip_table};
use dlx_proxy::broker::routing::{HeadersMatchMode, headers_match, validate_headers_binding};
use dlx_proxy_fuzz::{Key, Value, has_nan, table};
use libfuzzer_sys::fuzz_target;

fn encode(table: &FieldTable) -> Vec<u8> {
    let ctx = amq_protocol::frame::WriteContext::from(Vec::new());
    gen_field_table(table)(ctx)
        .expect("a table in memory must encode")
        .write
}

fn check(table: &FieldTable) {
    let once = encode(table);
    let (rest, parsed) = parse_field_table(&once[..]).expect("an encoded table must parse");
    assert!(rest.is_empty());
    assert_eq!(encode(&parsed), once, "table changed on a round trip");

    let _ = validate_headers_binding(table);
    let mode = HeadersMatchMode::of_binding(table);
    let nan = table.inner().values().any(has_nan);
    if matches!(mode, HeadersMatchMode::All | HeadersMatchMode::AllWithX) && !nan {
        assert!(
            headers_match(table, Some(table)),
            "{table:?} must match itself"
        );
    }
    let _ = headers_match(table, None);
}

fuzz_target!(|data: &[u8]| {
    let [selector, rest @ ..] = data else {
        return;
    };
    if selector % 2 == 0 {
        let scanned = skip_table(rest, 0, DEFAULT_MAX_TABLE_DEPTH);
        // A container takes at least 5 bytes: shorter input cannot nest past the limit.
        if scanned.is_err() && rest.len() > 5 * DEFAULT_MAX_TABLE_DEPTH {
            return;
        }
        if let Ok((left, parsed)) = parse_field_table(rest) {
            let end = scanned
                .expect("the depth scanner refused a table amq-protocol reads")
                .end;
            assert_eq!(
                end,
                rest.len() - left.len(),
                "the scanner and amq-protocol disagree"
            );
            check(&parsed);
        }
    } else if let Ok(fields) = Vec::<(Key, Value)>::arbitrary_take_rest(Unstructured::new(rest)) {
        check(&table(&fields));
    }
});
