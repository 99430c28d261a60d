//! Unit tests of [`crate::deadletter`].

use super::*;

const T0: u64 = 1_700_000_000;

fn keys(list: &[&str]) -> Vec<String> {
    list.iter().map(|k| k.to_string()).collect()
}

fn array(items: &[&str]) -> AMQPValue {
    AMQPValue::FieldArray(FieldArray::from(
        items.iter().map(|k| long_string(k)).collect::<Vec<_>>(),
    ))
}

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(key(k), v);
    }
    t
}

fn with_headers(entries: Vec<(&str, AMQPValue)>) -> BasicProperties {
    BasicProperties::default().with_headers(table(entries))
}

fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref().and_then(|h| h.inner().get(name))
}

fn header_names(props: &BasicProperties) -> Vec<String> {
    props
        .headers()
        .as_ref()
        .map(|h| h.inner().keys().map(|k| k.as_str().to_string()).collect())
        .unwrap_or_default()
}

fn raw_x_death(props: &BasicProperties) -> Vec<AMQPValue> {
    match header(props, X_DEATH) {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        other => panic!("x-death is {other:?}"),
    }
}

/// (queue, reason, count) of each entry, newest first.
fn summary(props: &BasicProperties) -> Vec<(String, String, i64)> {
    x_death_entries(props)
        .into_iter()
        .map(|e| (e.queue, e.reason, e.count))
        .collect()
}

fn entry(queue: &str, reason: &str, count: i64) -> (String, String, i64) {
    (queue.to_string(), reason.to_string(), count)
}

struct Death<'a> {
    queue: &'a str,
    reason: DeadLetterReason,
    exchange: &'a str,
    routing_keys: Vec<String>,
    now: u64,
    dlx: &'a str,
    dlrk: Option<&'a str>,
}

fn die_with(
    props: &BasicProperties,
    d: &Death,
    opts: &DeadLetterOptions,
    trusted: bool,
) -> Result<DeadLetteredMessage, DeadLetterDrop> {
    dead_letter(
        props,
        &DeathEvent {
            queue: d.queue,
            reason: d.reason,
            exchange: d.exchange,
            routing_keys: &d.routing_keys,
            now_secs: d.now,
            trust_existing_history: trusted,
        },
        &DeadLetterTarget {
            exchange: d.dlx,
            routing_key: d.dlrk,
        },
        opts,
    )
}

fn die(props: &BasicProperties, d: &Death) -> DeadLetteredMessage {
    die_with(props, d, &DeadLetterOptions::default(), true).unwrap()
}

/// A death of a message that arrived at `queue` through `exchange` with key `rk`.
fn death<'a>(
    queue: &'a str,
    reason: DeadLetterReason,
    exchange: &'a str,
    rk: &str,
    dlx: &'a str,
    dlrk: Option<&'a str>,
) -> Death<'a> {
    Death {
        queue,
        reason,
        exchange,
        routing_keys: keys(&[rk]),
        now: T0,
        dlx,
        dlrk,
    }
}

/// Follow one dead-lettering into the next queue: the next death's exchange and keys are
/// the ones the dead-lettered message was routed with.
fn hop<'a>(
    prev: &'a DeadLetteredMessage,
    queue: &'a str,
    reason: DeadLetterReason,
    dlx: &'a str,
    dlrk: Option<&'a str>,
    now: u64,
) -> Death<'a> {
    Death {
        queue,
        reason,
        exchange: &prev.exchange,
        routing_keys: prev.routing_keys.clone(),
        now,
        dlx,
        dlrk,
    }
}

use DeadLetterReason::{Expired, MaxLen, Rejected};

#[test]
fn reasons_and_compat_parse() {
    let names: Vec<&str> = DeadLetterReason::all().iter().map(|r| r.as_str()).collect();
    assert_eq!(names, ["rejected", "expired", "maxlen", "delivery_limit"]);
    for r in DeadLetterReason::all() {
        assert_eq!(r.to_string().parse::<DeadLetterReason>(), Ok(r));
    }
    assert_eq!("3".parse::<Compat>(), Ok(Compat::V3));
    assert_eq!("4".parse::<Compat>(), Ok(Compat::V4));
    assert!("5".parse::<Compat>().is_err());
    assert_eq!(Compat::default(), Compat::V3);
}

#[test]
fn options_from_config() {
    let mut config = DeadLetterConfig::default();
    assert_eq!(
        DeadLetterOptions::from_config(&config),
        Ok(DeadLetterOptions::default())
    );
    config.compat = "4".into();
    config.max_hops = 16;
    config.x_death_total = true;
    assert_eq!(
        DeadLetterOptions::from_config(&config),
        Ok(DeadLetterOptions {
            compat: Compat::V4,
            x_death_total: true,
            max_hops: Some(16)
        })
    );
    config.compat = "3.10".into();
    assert!(DeadLetterOptions::from_config(&config).is_err());
}

#[test]
fn h1_first_death_writes_one_typed_entry() {
    let out = die(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "dlx", Some("dlq")),
    );
    assert_eq!(out.exchange, "dlx");
    assert_eq!(out.routing_keys, keys(&["dlq"]));
    let entries = raw_x_death(&out.properties);
    assert_eq!(entries.len(), 1);
    let expected = table(vec![
        ("count", AMQPValue::LongLongInt(1)),
        ("reason", long_string("rejected")),
        ("queue", long_string("q")),
        ("time", AMQPValue::Timestamp(T0)),
        ("exchange", long_string("")),
        ("routing-keys", array(&["q"])),
    ]);
    assert_eq!(entries[0], AMQPValue::FieldTable(expected));
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_REASON),
        Some(&long_string("rejected"))
    );
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_QUEUE),
        Some(&long_string("q"))
    );
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_EXCHANGE),
        Some(&long_string(""))
    );
    assert_eq!(
        header_names(&out.properties),
        [
            "x-death",
            "x-first-death-exchange",
            "x-first-death-queue",
            "x-first-death-reason"
        ]
    );
}

#[test]
fn h2_e3_self_loop_increments_one_entry_and_keeps_its_time() {
    let first = die(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "", None),
    );
    assert_eq!(first.routing_keys, keys(&["q"]));
    let second = die(
        &first.properties,
        &hop(&first, "q", Rejected, "", None, T0 + 30),
    );
    let entries = x_death_entries(&second.properties);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].count, 2);
    assert_eq!(entries[0].time, T0, "time is the first death's");
    let AMQPValue::FieldTable(raw) = &raw_x_death(&second.properties)[0] else {
        panic!("not a table");
    };
    assert_eq!(raw.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
    assert_eq!(raw.inner().get("time"), Some(&AMQPValue::Timestamp(T0)));
    assert_eq!(
        header(&second.properties, X_FIRST_DEATH_REASON),
        Some(&long_string("rejected"))
    );
}

#[test]
fn h3_new_entries_go_first() {
    let at_q = die(
        &BasicProperties::default(),
        &death("Q", Rejected, "", "Q", "", Some("Dlx1")),
    );
    let at_dlx1 = die(
        &at_q.properties,
        &hop(&at_q, "Dlx1", Rejected, "", Some("Dlx2"), T0 + 1),
    );
    assert_eq!(
        summary(&at_dlx1.properties),
        [entry("Dlx1", "rejected", 1), entry("Q", "rejected", 1)]
    );
    assert_eq!(
        header(&at_dlx1.properties, X_FIRST_DEATH_QUEUE),
        Some(&long_string("Q"))
    );
}

#[test]
fn e4_chain_of_rejections_stays_in_recency_order() {
    // 3.10.8 gives [c2, c0, c1] here; the spec (and 3.13.3+) gives [c2, c1, c0].
    let mut msg = die(
        &BasicProperties::default(),
        &death("c0", Rejected, "", "c0", "", Some("c1")),
    );
    msg = die(
        &msg.properties,
        &hop(&msg, "c1", Rejected, "", Some("c2"), T0),
    );
    msg = die(
        &msg.properties,
        &hop(&msg, "c2", Rejected, "", Some("c3"), T0),
    );
    assert_eq!(
        summary(&msg.properties),
        [
            entry("c2", "rejected", 1),
            entry("c1", "rejected", 1),
            entry("c0", "rejected", 1)
        ]
    );
}

#[test]
fn e5_c2_reject_expire_expire_loop_is_never_dropped() {
    // b (reject, DLRK a2) -> a2 (TTL, DLRK a3) -> a3 (TTL, DLRK b) -> b ...
    let mut msg = die(
        &BasicProperties::default(),
        &death("b", Rejected, "", "b", "", Some("a2")),
    );
    for round in 0..3u64 {
        let now = T0 + round * 10;
        assert!(!is_cycle(Rejected, &msg.properties, "a2"));
        msg = die(
            &msg.properties,
            &hop(&msg, "a2", Expired, "", Some("a3"), now + 1),
        );
        assert!(
            !is_cycle(Expired, &msg.properties, "a3"),
            "round {round}: a3 wrongly dropped"
        );
        msg = die(
            &msg.properties,
            &hop(&msg, "a3", Expired, "", Some("b"), now + 2),
        );
        assert!(
            !is_cycle(Expired, &msg.properties, "b"),
            "round {round}: b wrongly dropped"
        );
        if round == 0 {
            assert_eq!(
                summary(&msg.properties),
                [
                    entry("a3", "expired", 1),
                    entry("a2", "expired", 1),
                    entry("b", "rejected", 1)
                ]
            );
        }
        msg = die(
            &msg.properties,
            &hop(&msg, "b", Rejected, "", Some("a2"), now + 3),
        );
    }
    assert_eq!(
        summary(&msg.properties),
        [
            entry("b", "rejected", 4),
            entry("a3", "expired", 3),
            entry("a2", "expired", 3)
        ]
    );
}

#[test]
fn e1_dlrk_replaces_keys_removes_cc_and_keeps_other_properties() {
    let props = BasicProperties::default()
        .with_headers(table(vec![
            ("zz", AMQPValue::LongInt(1)),
            ("aa", long_string("x")),
            ("CC", array(&["k"])),
        ]))
        .with_message_id("mid".into())
        .with_priority(3)
        .with_timestamp(12345);
    let out = die(
        &props,
        &death("src", Rejected, "ex", "src", "dlx", Some("dlrk")),
    );
    assert_eq!(out.exchange, "dlx");
    assert_eq!(out.routing_keys, keys(&["dlrk"]));
    assert_eq!(
        header_names(&out.properties),
        [
            "aa",
            "x-death",
            "x-first-death-exchange",
            "x-first-death-queue",
            "x-first-death-reason",
            "zz"
        ]
    );
    assert_eq!(
        x_death_entries(&out.properties)[0].routing_keys,
        keys(&["src", "k"])
    );
    assert_eq!(
        out.properties.message_id().as_ref().map(|m| m.as_str()),
        Some("mid")
    );
    assert_eq!(*out.properties.priority(), Some(3));
    assert_eq!(*out.properties.timestamp(), Some(12345));
    assert_eq!(*out.properties.expiration(), None);
    assert_eq!(header(&out.properties, "zz"), Some(&AMQPValue::LongInt(1)));
}

#[test]
fn e2_x7_without_dlrk_all_keys_route_and_bcc_is_dropped() {
    let props = BasicProperties::default()
        .with_headers(table(vec![
            ("CC", array(&["cc1key"])),
            ("BCC", array(&["bcckey"])),
        ]))
        .with_expiration("50".into());
    let d = Death {
        queue: "src",
        reason: Expired,
        exchange: "ex",
        routing_keys: keys(&["src", "cc1key", "bcckey"]),
        now: T0,
        dlx: "dlx",
        dlrk: None,
    };
    let out = die(&props, &d);
    assert_eq!(
        out.routing_keys,
        keys(&["src", "cc1key", "bcckey"]),
        "BCC keys still route"
    );
    assert_eq!(
        header(&out.properties, "CC"),
        Some(&array(&["cc1key"])),
        "CC kept without a DLRK"
    );
    assert_eq!(header(&out.properties, "BCC"), None);
    let e = &x_death_entries(&out.properties)[0];
    assert_eq!(
        e.routing_keys,
        keys(&["src", "cc1key"]),
        "x-death excludes BCC"
    );
    assert_eq!(e.original_expiration.as_deref(), Some("50"));
    assert_eq!(*out.properties.expiration(), None);
}

#[test]
fn h8_routing_keys_are_publish_key_then_cc_in_header_order() {
    let props = with_headers(vec![
        ("CC", array(&["cc 2", "cc 1"])),
        ("BCC", array(&["bcc 1"])),
    ]);
    let d = Death {
        queue: "q1",
        reason: Expired,
        exchange: "",
        routing_keys: keys(&["q1", "cc 2", "cc 1", "bcc 1"]),
        now: T0,
        dlx: "",
        dlrk: Some("q2"),
    };
    let out = die(&props, &d);
    assert_eq!(
        x_death_entries(&out.properties)[0].routing_keys,
        keys(&["q1", "cc 2", "cc 1"])
    );
}

#[test]
fn x5_x6_cc_header_with_and_without_dlrk() {
    let props = with_headers(vec![("CC", array(&["dlq"]))]);
    let routed = keys(&["q", "dlq"]);
    let no_dlrk = Death {
        queue: "q",
        reason: Rejected,
        exchange: "",
        routing_keys: routed.clone(),
        now: T0,
        dlx: "dlx",
        dlrk: None,
    };
    let out = die(&props, &no_dlrk);
    assert_eq!(header(&out.properties, "CC"), Some(&array(&["dlq"])));
    assert_eq!(out.routing_keys, routed);

    let with_dlrk = Death {
        dlrk: Some("dlq"),
        ..no_dlrk
    };
    let v3 = die(&props, &with_dlrk);
    assert_eq!(
        header(&v3.properties, "CC"),
        None,
        "3.10 removes CC with a DLRK"
    );
    assert_eq!(
        x_death_entries(&v3.properties)[0].routing_keys,
        keys(&["q", "dlq"])
    );

    let v4_opts = DeadLetterOptions {
        compat: Compat::V4,
        ..DeadLetterOptions::default()
    };
    let v4 = die_with(&props, &with_dlrk, &v4_opts, true).unwrap();
    assert_eq!(
        header(&v4.properties, "CC"),
        Some(&array(&["dlq"])),
        "3.13+ keeps CC"
    );
    assert_eq!(v4.routing_keys, keys(&["dlq"]));
}

#[test]
fn expiration_is_removed_on_every_death_and_recorded_once() {
    for reason in DeadLetterReason::all() {
        let props = BasicProperties::default().with_expiration("60000".into());
        let out = die(&props, &death("q", reason, "", "q", "dlx", None));
        assert_eq!(*out.properties.expiration(), None, "{reason}");
        assert_eq!(
            x_death_entries(&out.properties)[0]
                .original_expiration
                .as_deref(),
            Some("60000"),
            "{reason}"
        );
    }
    let zero = BasicProperties::default().with_expiration("0".into());
    let out = die(&zero, &death("q", Rejected, "", "q", "dlx", None));
    assert_eq!(
        x_death_entries(&out.properties)[0]
            .original_expiration
            .as_deref(),
        Some("0")
    );
    // Queue TTL alone: no original-expiration.
    let out = die(
        &BasicProperties::default(),
        &death("q", Expired, "", "q", "dlx", None),
    );
    let AMQPValue::FieldTable(raw) = &raw_x_death(&out.properties)[0] else {
        panic!("not a table");
    };
    assert!(!raw.contains_key("original-expiration"));
}

#[test]
fn incremented_entry_keeps_its_fields_and_gets_no_new_expiration() {
    // conformance scenario client_xdeath_matching_entry
    let old = table(vec![
        ("count", AMQPValue::LongInt(5)),
        ("reason", long_string("rejected")),
        ("queue", long_string("src")),
        ("time", AMQPValue::Timestamp(1_577_836_800)),
        ("exchange", long_string("old-ex")),
        ("routing-keys", array(&["old-rk"])),
        ("original-expiration", long_string("999")),
    ]);
    let other = table(vec![
        ("count", AMQPValue::LongLongInt(2)),
        ("reason", long_string("expired")),
        ("queue", long_string("other")),
        ("time", AMQPValue::Timestamp(1_577_836_800)),
        ("exchange", long_string("e1")),
        ("routing-keys", array(&["k1"])),
    ]);
    let props = BasicProperties::default()
        .with_headers(table(vec![
            (
                X_DEATH,
                AMQPValue::FieldArray(FieldArray::from(vec![
                    AMQPValue::FieldTable(other.clone()),
                    AMQPValue::FieldTable(old.clone()),
                ])),
            ),
            (X_FIRST_DEATH_QUEUE, long_string("client-set")),
        ]))
        .with_expiration("123".into());
    let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
    let mut incremented = old.clone();
    incremented.insert(key("count"), AMQPValue::LongLongInt(6));
    assert_eq!(
        raw_x_death(&out.properties),
        [
            AMQPValue::FieldTable(incremented),
            AMQPValue::FieldTable(other)
        ]
    );
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_QUEUE),
        Some(&long_string("client-set"))
    );
    assert_eq!(header(&out.properties, X_FIRST_DEATH_REASON), None);
    assert_eq!(header(&out.properties, X_FIRST_DEATH_EXCHANGE), None);
    assert_eq!(*out.properties.expiration(), None);
}

#[test]
fn matching_ignores_the_exchange() {
    let first = die(
        &BasicProperties::default(),
        &death("q", Expired, "ex1", "q", "dlx", None),
    );
    let second = die(
        &first.properties,
        &death("q", Expired, "ex2", "other", "dlx", None),
    );
    let entries = x_death_entries(&second.properties);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].count, 2);
    assert_eq!(entries[0].exchange, "ex1");
    assert_eq!(entries[0].routing_keys, keys(&["q"]));
}

#[test]
fn same_queue_other_reason_is_a_new_entry() {
    let first = die(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "", None),
    );
    let second = die(&first.properties, &death("q", Expired, "", "q", "", None));
    assert_eq!(
        summary(&second.properties),
        [entry("q", "expired", 1), entry("q", "rejected", 1)]
    );
}

#[test]
fn client_history_for_another_queue_is_continued() {
    // conformance scenario client_xdeath_unrelated
    let client = table(vec![
        ("count", AMQPValue::LongLongInt(3)),
        ("reason", long_string("expired")),
        ("queue", long_string("elsewhere")),
        ("time", AMQPValue::Timestamp(1_577_836_800)),
        ("exchange", long_string("old-ex")),
        ("routing-keys", array(&["old-rk"])),
    ]);
    let props = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(
            client.clone(),
        )])),
    )]);
    let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
    let entries = raw_x_death(&out.properties);
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[1], AMQPValue::FieldTable(client));
    assert_eq!(summary(&out.properties)[0], entry("src", "rejected", 1));
    assert_eq!(
        header_names(&out.properties),
        ["x-death"],
        "no x-first-death-* when x-death existed"
    );
}

#[test]
fn client_x_first_death_without_x_death_is_overwritten() {
    let props = with_headers(vec![(X_FIRST_DEATH_REASON, long_string("client"))]);
    let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_REASON),
        Some(&long_string("rejected"))
    );
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_QUEUE),
        Some(&long_string("src"))
    );
    assert_eq!(
        header(&out.properties, X_FIRST_DEATH_EXCHANGE),
        Some(&long_string("x"))
    );
}

#[test]
fn e6_republished_history_is_continued_with_first_death_kept() {
    let at_r0 = die(
        &BasicProperties::default(),
        &death("r0", Rejected, "", "r0", "", Some("dlx")),
    );
    // The client republishes the received headers to r0, which now has a TTL.
    let republished =
        BasicProperties::default().with_headers(at_r0.properties.headers().clone().unwrap());
    let expired = die(
        &republished,
        &death("r0", Expired, "", "r0", "", Some("dlx")),
    );
    assert_eq!(
        summary(&expired.properties),
        [entry("r0", "expired", 1), entry("r0", "rejected", 1)]
    );
    assert_eq!(
        header(&expired.properties, X_FIRST_DEATH_REASON),
        Some(&long_string("rejected"))
    );
}

#[test]
fn e7_non_array_x_death_is_replaced_without_first_death() {
    let props = with_headers(vec![(X_DEATH, long_string("garbage"))]);
    let out = die(&props, &death("q", Rejected, "", "q", "dlx", None));
    assert_eq!(summary(&out.properties), [entry("q", "rejected", 1)]);
    assert_eq!(header_names(&out.properties), ["x-death"]);
}

#[test]
fn e8_two_hops_record_each_exchange_and_keys() {
    let at_q1 = die(
        &BasicProperties::default(),
        &death("q1", Rejected, "", "q1", "p4_d1", Some("k2")),
    );
    let at_q2 = die(
        &at_q1.properties,
        &hop(&at_q1, "q2", Rejected, "", Some("q3"), T0 + 1),
    );
    assert_eq!(at_q2.exchange, "");
    assert_eq!(at_q2.routing_keys, keys(&["q3"]));
    let entries = x_death_entries(&at_q2.properties);
    assert_eq!(entries.len(), 2);
    assert_eq!(
        (entries[0].queue.as_str(), entries[0].exchange.as_str()),
        ("q2", "p4_d1")
    );
    assert_eq!(entries[0].routing_keys, keys(&["k2"]));
    assert_eq!(
        (entries[1].queue.as_str(), entries[1].exchange.as_str()),
        ("q1", "")
    );
    assert_eq!(entries[1].routing_keys, keys(&["q1"]));
}

#[test]
fn legacy_duplicates_are_collapsed_in_order_and_missing_counts_filled() {
    let dup = |count: Option<i64>, exchange: &str| {
        let mut t = table(vec![
            ("reason", long_string("expired")),
            ("queue", long_string("other")),
            ("exchange", long_string(exchange)),
        ]);
        if let Some(c) = count {
            t.insert(key("count"), AMQPValue::LongLongInt(c));
        }
        AMQPValue::FieldTable(t)
    };
    let third = AMQPValue::FieldTable(table(vec![
        ("reason", long_string("maxlen")),
        ("queue", long_string("third")),
    ]));
    let props = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![
            dup(Some(2), "e1"),
            dup(Some(7), "e2"),
            third,
        ])),
    )]);
    let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
    assert_eq!(
        summary(&out.properties),
        [
            entry("src", "rejected", 1),
            entry("other", "expired", 2),
            entry("third", "maxlen", 1)
        ]
    );
    assert_eq!(
        x_death_entries(&out.properties)[1].exchange,
        "e1",
        "the first duplicate stays"
    );
    let AMQPValue::FieldTable(t) = &raw_x_death(&out.properties)[2] else {
        panic!("not a table");
    };
    assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(1)));
    // Two duplicates without counts group into one entry of count 2.
    let props = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![dup(None, "a"), dup(None, "b")])),
    )]);
    let out = die(&props, &death("src", Rejected, "x", "rk", "dlx", None));
    assert_eq!(summary(&out.properties)[1], entry("other", "expired", 2));
}

#[test]
fn matching_entry_without_count_counts_as_one() {
    let props = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
            ("reason", long_string("rejected")),
            ("queue", long_string("q")),
        ]))])),
    )]);
    let out = die(&props, &death("q", Rejected, "", "q", "dlx", None));
    let AMQPValue::FieldTable(t) = &raw_x_death(&out.properties)[0] else {
        panic!("not a table");
    };
    assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
}

#[test]
fn non_table_elements_are_kept_in_place() {
    let props = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![
            long_string("note"),
            AMQPValue::FieldTable(
                XDeathEntry {
                    queue: "q".into(),
                    reason: "expired".into(),
                    time: 1,
                    exchange: String::new(),
                    routing_keys: keys(&["q"]),
                    count: 1,
                    original_expiration: None,
                }
                .to_field_table(),
            ),
            AMQPValue::LongInt(7),
        ])),
    )]);
    let out = die(&props, &death("q", Expired, "", "q", "", None));
    let raw = raw_x_death(&out.properties);
    assert_eq!(raw.len(), 3);
    assert!(matches!(&raw[0], AMQPValue::FieldTable(_)));
    assert_eq!(raw[1], long_string("note"));
    assert_eq!(raw[2], AMQPValue::LongInt(7));
    assert_eq!(summary(&out.properties), [entry("q", "expired", 2)]);
}

#[test]
fn delivery_count_header_is_removed() {
    let props = with_headers(vec![
        (X_DELIVERY_COUNT, AMQPValue::LongLongInt(3)),
        ("keep", long_string("y")),
    ]);
    let out = die(
        &props,
        &death("q", DeadLetterReason::DeliveryLimit, "", "q", "dlx", None),
    );
    assert_eq!(header(&out.properties, X_DELIVERY_COUNT), None);
    assert_eq!(header(&out.properties, "keep"), Some(&long_string("y")));
    assert_eq!(summary(&out.properties), [entry("q", "delivery_limit", 1)]);
}

#[test]
fn every_property_but_expiration_survives() {
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_content_encoding("gzip".into())
        .with_headers(table(vec![("h", AMQPValue::Boolean(true))]))
        .with_delivery_mode(2)
        .with_priority(5)
        .with_correlation_id("cid".into())
        .with_reply_to("rt".into())
        .with_expiration("60000".into())
        .with_message_id("mid".into())
        .with_timestamp(1_700_000_000)
        .with_type("t1".into())
        .with_user_id("guest".into())
        .with_app_id("app".into())
        .with_cluster_id("cl".into());
    let out = die(&props, &death("q", Rejected, "", "q", "dlx", None));
    let expected = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_content_encoding("gzip".into())
        .with_headers(out.properties.headers().clone().unwrap())
        .with_delivery_mode(2)
        .with_priority(5)
        .with_correlation_id("cid".into())
        .with_reply_to("rt".into())
        .with_message_id("mid".into())
        .with_timestamp(1_700_000_000)
        .with_type("t1".into())
        .with_user_id("guest".into())
        .with_app_id("app".into())
        .with_cluster_id("cl".into());
    assert_eq!(out.properties, expected);
    assert_eq!(
        header(&out.properties, "h"),
        Some(&AMQPValue::Boolean(true))
    );
}

#[test]
fn v4_second_death_after_dlrk_records_only_the_keys_routed_with() {
    let opts = DeadLetterOptions {
        compat: Compat::V4,
        ..DeadLetterOptions::default()
    };
    let props = with_headers(vec![("CC", array(&["cc 1", "cc 2"]))]);
    let first_death = Death {
        queue: "q1",
        reason: Expired,
        exchange: "",
        routing_keys: keys(&["q1", "cc 1", "cc 2"]),
        now: T0,
        dlx: "",
        dlrk: Some("q2"),
    };
    let first = die_with(&props, &first_death, &opts, false).unwrap();
    assert_eq!(
        x_death_entries(&first.properties)[0].routing_keys,
        keys(&["q1", "cc 1", "cc 2"])
    );
    assert_eq!(
        header(&first.properties, "CC"),
        Some(&array(&["cc 1", "cc 2"]))
    );
    let second = die_with(
        &first.properties,
        &hop(&first, "q2", Expired, "", Some("q3"), T0 + 1),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        x_death_entries(&second.properties)[0].routing_keys,
        keys(&["q2"]),
        "the kept CC header is not among the keys the message was routed with"
    );
}

#[test]
fn v4_writes_last_death_on_every_death() {
    let opts = DeadLetterOptions {
        compat: Compat::V4,
        ..DeadLetterOptions::default()
    };
    let first = die_with(
        &BasicProperties::default(),
        &death("q1", Expired, "", "q1", "", Some("q2")),
        &opts,
        false,
    )
    .unwrap();
    for (name, value) in [
        (X_FIRST_DEATH_REASON, "expired"),
        (X_FIRST_DEATH_QUEUE, "q1"),
        (X_LAST_DEATH_REASON, "expired"),
        (X_LAST_DEATH_QUEUE, "q1"),
    ] {
        assert_eq!(
            header(&first.properties, name),
            Some(&long_string(value)),
            "{name}"
        );
    }
    let second = die_with(
        &first.properties,
        &hop(&first, "q2", Rejected, "", Some("q3"), T0 + 1),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        header(&second.properties, X_FIRST_DEATH_QUEUE),
        Some(&long_string("q1"))
    );
    assert_eq!(
        header(&second.properties, X_LAST_DEATH_QUEUE),
        Some(&long_string("q2"))
    );
    assert_eq!(
        header(&second.properties, X_LAST_DEATH_REASON),
        Some(&long_string("rejected"))
    );
    assert_eq!(
        header(&second.properties, X_LAST_DEATH_EXCHANGE),
        Some(&long_string(""))
    );
    assert_eq!(
        summary(&second.properties),
        [entry("q2", "rejected", 1), entry("q1", "expired", 1)]
    );
    // 3.10 has no x-last-death-*.
    let v3 = die(
        &BasicProperties::default(),
        &death("q1", Expired, "", "q1", "", None),
    );
    assert_eq!(header(&v3.properties, X_LAST_DEATH_QUEUE), None);
}

#[test]
fn h4b_v4_ignores_a_client_history() {
    let opts = DeadLetterOptions {
        compat: Compat::V4,
        ..DeadLetterOptions::default()
    };
    let at_r0 = die_with(
        &BasicProperties::default(),
        &death("r0", Rejected, "", "r0", "", Some("dlx")),
        &opts,
        false,
    )
    .unwrap();
    let republished =
        BasicProperties::default().with_headers(at_r0.properties.headers().clone().unwrap());
    let untrusted = die_with(
        &republished,
        &death("r0", Expired, "", "r0", "", Some("dlx")),
        &opts,
        false,
    )
    .unwrap();
    assert_eq!(summary(&untrusted.properties), [entry("r0", "expired", 1)]);
    assert_eq!(
        header(&untrusted.properties, X_FIRST_DEATH_REASON),
        Some(&long_string("expired"))
    );
    // The same message dead-lettered again by the broker itself is continued.
    let trusted = die_with(
        &republished,
        &death("r0", Expired, "", "r0", "", Some("dlx")),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        summary(&trusted.properties),
        [entry("r0", "expired", 1), entry("r0", "rejected", 1)]
    );
    assert_eq!(
        header(&trusted.properties, X_FIRST_DEATH_REASON),
        Some(&long_string("rejected"))
    );
    // V3 ignores the flag: the history is always continued.
    let v3 = die_with(
        &republished,
        &death("r0", Expired, "", "r0", "", Some("dlx")),
        &DeadLetterOptions::default(),
        false,
    )
    .unwrap();
    assert_eq!(summary(&v3.properties).len(), 2);
}

#[test]
fn x_death_total_counts_every_death() {
    let opts = DeadLetterOptions {
        x_death_total: true,
        ..DeadLetterOptions::default()
    };
    let first = die_with(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "", None),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        header(&first.properties, X_DEATH_TOTAL),
        Some(&AMQPValue::LongLongInt(1))
    );
    let second = die_with(
        &first.properties,
        &death("p", Expired, "", "p", "", None),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        header(&second.properties, X_DEATH_TOTAL),
        Some(&AMQPValue::LongLongInt(2))
    );
    let from_int32 = with_headers(vec![(X_DEATH_TOTAL, AMQPValue::LongInt(9))]);
    let out = die_with(
        &from_int32,
        &death("q", Rejected, "", "q", "", None),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        header(&out.properties, X_DEATH_TOTAL),
        Some(&AMQPValue::LongLongInt(10))
    );
    // Off by default.
    let off = die(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "", None),
    );
    assert_eq!(header(&off.properties, X_DEATH_TOTAL), None);
    // V4 with an untrusted history starts again.
    let v4 = DeadLetterOptions {
        compat: Compat::V4,
        x_death_total: true,
        max_hops: None,
    };
    let reset = die_with(
        &from_int32,
        &death("q", Rejected, "", "q", "", None),
        &v4,
        false,
    )
    .unwrap();
    assert_eq!(
        header(&reset.properties, X_DEATH_TOTAL),
        Some(&AMQPValue::LongLongInt(1))
    );
}

#[test]
fn hop_limit_drops_past_max_hops() {
    let opts = DeadLetterOptions {
        max_hops: Some(2),
        ..DeadLetterOptions::default()
    };
    let first = die_with(
        &BasicProperties::default(),
        &death("a", Rejected, "", "a", "", None),
        &opts,
        true,
    )
    .unwrap();
    let second = die_with(
        &first.properties,
        &death("b", Rejected, "", "b", "", None),
        &opts,
        true,
    )
    .unwrap();
    assert_eq!(
        die_with(
            &second.properties,
            &death("a", Rejected, "", "a", "", None),
            &opts,
            true
        ),
        Err(DeadLetterDrop::HopLimit)
    );
    assert_eq!(DeadLetterDrop::HopLimit.cause(), "hop_limit");
    // Counts of every entry add up, including a client's.
    let client = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
            ("reason", long_string("expired")),
            ("queue", long_string("x")),
            ("count", AMQPValue::LongInt(2)),
        ]))])),
    )]);
    assert!(
        die_with(
            &client,
            &death("q", Rejected, "", "q", "", None),
            &opts,
            true
        )
        .is_err()
    );
    // A negative count of a client's entry does not cancel the others.
    let negative = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::FieldTable(table(vec![
                ("reason", long_string("expired")),
                ("queue", long_string("x")),
                ("count", AMQPValue::LongLongInt(-1_000_000)),
            ])),
            AMQPValue::FieldTable(table(vec![
                ("reason", long_string("expired")),
                ("queue", long_string("y")),
                ("count", AMQPValue::LongInt(2)),
            ])),
        ])),
    )]);
    assert_eq!(
        die_with(
            &negative,
            &death("q", Rejected, "", "q", "", None),
            &opts,
            true
        ),
        Err(DeadLetterDrop::HopLimit)
    );
    // Nor does one for the queue the message dies in again and again.
    let mut looping = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
            ("reason", long_string("rejected")),
            ("queue", long_string("q")),
            ("count", AMQPValue::LongLongInt(-1_000_000)),
        ]))])),
    )]);
    let forged = looping.clone();
    let mut laps = 0;
    while let Ok(next) = die_with(
        &looping,
        &death("q", Rejected, "", "q", "", None),
        &opts,
        true,
    ) {
        looping = next.properties;
        laps += 1;
        assert!(laps <= 2, "the hop limit holds");
    }
    let no_limit = DeadLetterOptions::default();
    // Without a hop limit the count is counted up as RabbitMQ does.
    let counted = die_with(
        &forged,
        &death("q", Rejected, "", "q", "", None),
        &no_limit,
        true,
    )
    .unwrap();
    let entries = x_death_entries(&counted.properties);
    assert_eq!(entries[0].count, -999_999);
    assert!(
        die_with(
            &second.properties,
            &death("a", Rejected, "", "a", "", None),
            &no_limit,
            true
        )
        .is_ok()
    );
}

#[test]
fn empty_routing_keys_record_only_cc() {
    let props = with_headers(vec![("CC", array(&["c"]))]);
    let d = Death {
        queue: "q",
        reason: Expired,
        exchange: "",
        routing_keys: Vec::new(),
        now: T0,
        dlx: "dlx",
        dlrk: None,
    };
    let out = die(&props, &d);
    assert!(out.routing_keys.is_empty());
    assert_eq!(
        x_death_entries(&out.properties)[0].routing_keys,
        keys(&["c"])
    );
}

#[test]
fn t4_m4_self_loops_without_rejection_are_cycles() {
    for reason in [Expired, MaxLen] {
        let out = die(
            &BasicProperties::default(),
            &death("q", reason, "", "q", "", None),
        );
        assert_eq!(out.routing_keys, keys(&["q"]));
        assert!(is_cycle(reason, &out.properties, "q"), "{reason}");
    }
}

#[test]
fn c1_rejections_never_cycle() {
    let first = die(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "", None),
    );
    assert!(!is_cycle(Rejected, &first.properties, "q"));
    let second = die(&first.properties, &death("q", Rejected, "", "q", "", None));
    assert!(!is_cycle(Rejected, &second.properties, "q"));
}

#[test]
fn fanout_partial_cycle_is_decided_per_target() {
    let out = die(
        &BasicProperties::default(),
        &death("p4_self", Expired, "", "p4_self", "p4_fan", None),
    );
    assert!(is_cycle(Expired, &out.properties, "p4_self"));
    assert!(!is_cycle(Expired, &out.properties, "p4_other"));
}

#[test]
fn ttl_self_loop_is_dropped_despite_an_earlier_rejection() {
    let rejected = die(
        &BasicProperties::default(),
        &death("q", Rejected, "", "q", "", None),
    );
    let expired = die(
        &rejected.properties,
        &death("q", Expired, "", "q", "", None),
    );
    assert!(is_cycle(Expired, &expired.properties, "q"));
}

#[test]
fn reject_then_ttl_loop_between_two_queues_is_kept() {
    // a (reject) -> b (TTL) -> a: the walk from the newest entry to a's passes a rejection.
    let at_a = die(
        &BasicProperties::default(),
        &death("a", Rejected, "", "a", "", Some("b")),
    );
    let at_b = die(
        &at_a.properties,
        &hop(&at_a, "b", Expired, "", Some("a"), T0),
    );
    assert!(!is_cycle(Expired, &at_b.properties, "a"));
    // A two-queue TTL loop is cut where it closes.
    let ttl_a = die(
        &BasicProperties::default(),
        &death("a", Expired, "", "a", "", Some("b")),
    );
    assert!(!is_cycle(Expired, &ttl_a.properties, "b"));
    let ttl_b = die(
        &ttl_a.properties,
        &hop(&ttl_a, "b", Expired, "", Some("a"), T0),
    );
    assert!(is_cycle(Expired, &ttl_b.properties, "a"));
}

#[test]
fn cycle_edge_cases() {
    assert!(!is_cycle(Expired, &BasicProperties::default(), "q"));
    assert!(!is_cycle(
        Expired,
        &with_headers(vec![(X_DEATH, long_string("x"))]),
        "q"
    ));
    // A non-table element before the target's entry: not automatic.
    let entry_q = AMQPValue::FieldTable(table(vec![
        ("queue", long_string("q")),
        ("reason", long_string("expired")),
    ]));
    let odd_first = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            entry_q.clone(),
        ])),
    )]);
    assert!(!is_cycle(Expired, &odd_first, "q"));
    // A non-table element after the target's entry does not matter.
    let odd_last = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![entry_q, AMQPValue::LongInt(1)])),
    )]);
    assert!(is_cycle(Expired, &odd_last, "q"));
    // The target's own entry being a rejection: no cycle.
    let rejected_q = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
            ("queue", long_string("q")),
            ("reason", long_string("rejected")),
        ]))])),
    )]);
    assert!(!is_cycle(MaxLen, &rejected_q, "q"));
}

#[test]
fn x_death_entry_round_trip_and_decoding() {
    let e = XDeathEntry {
        queue: "q".into(),
        reason: "expired".into(),
        time: T0,
        exchange: "ex".into(),
        routing_keys: keys(&["a", "b"]),
        count: 3,
        original_expiration: Some("10".into()),
    };
    let t = e.to_field_table();
    assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(3)));
    assert_eq!(t.inner().get("time"), Some(&AMQPValue::Timestamp(T0)));
    assert_eq!(
        t.inner().get("original-expiration"),
        Some(&long_string("10"))
    );
    assert_eq!(XDeathEntry::from_field_table(&t), Some(e.clone()));
    let without = XDeathEntry {
        original_expiration: None,
        ..e
    };
    assert!(!without.to_field_table().contains_key("original-expiration"));
    // Lenient decoding of a client's table.
    let sparse = table(vec![
        ("queue", long_string("q")),
        ("reason", long_string("maxlen")),
        ("time", AMQPValue::LongLongInt(5)),
    ]);
    let decoded = XDeathEntry::from_field_table(&sparse).unwrap();
    assert_eq!(
        (decoded.count, decoded.time, decoded.exchange.as_str()),
        (1, 5, "")
    );
    assert_eq!(
        XDeathEntry::from_field_table(&table(vec![("queue", long_string("q"))])),
        None
    );
    // x_death_entries skips what it cannot decode.
    let props = with_headers(vec![(
        X_DEATH,
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            AMQPValue::FieldTable(sparse),
            AMQPValue::FieldTable(table(vec![])),
        ])),
    )]);
    assert_eq!(x_death_entries(&props).len(), 1);
    assert!(x_death_entries(&BasicProperties::default()).is_empty());
}
