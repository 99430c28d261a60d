//! Unit tests of [`crate::broker::routing`].

use super::*;
use amq_protocol::types::{ByteArray, DecimalValue, FieldArray, LongString, ShortString};

fn queue(name: &str) -> Destination {
    Destination::Queue(name.to_string())
}

fn exchange(name: &str) -> Destination {
    Destination::Exchange(name.to_string())
}

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::try_new(*k).unwrap(), v.clone());
    }
    t
}

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v))
}

fn route(table: &BindingTable, keys: &[&str], headers: Option<&FieldTable>) -> Vec<Destination> {
    let mut out = Vec::new();
    table.route(keys, headers, &mut out);
    out
}

fn sorted(mut v: Vec<Destination>) -> Vec<Destination> {
    v.sort();
    v
}

#[test]
fn exchange_kind_parses_and_prints() {
    for kind in [
        ExchangeKind::Direct,
        ExchangeKind::Fanout,
        ExchangeKind::Topic,
        ExchangeKind::Headers,
    ] {
        assert_eq!(kind.as_str().parse::<ExchangeKind>(), Ok(kind));
        assert_eq!(kind.to_string(), kind.as_str());
    }
    let err = "x-delayed-message".parse::<ExchangeKind>().unwrap_err();
    assert_eq!(err.to_string(), "unknown exchange type 'x-delayed-message'");
    assert!("Direct".parse::<ExchangeKind>().is_err());
    assert!("".parse::<ExchangeKind>().is_err());
}

#[test]
fn split_topic_words_follows_rabbitmq() {
    fn split(k: &str) -> Vec<&str> {
        split_topic_words(k).collect()
    }
    assert_eq!(split(""), Vec::<&str>::new());
    assert_eq!(split("a"), vec!["a"]);
    assert_eq!(split("a.b"), vec!["a", "b"]);
    assert_eq!(split("a."), vec!["a", ""]);
    assert_eq!(split(".a"), vec!["", "a"]);
    assert_eq!(split("."), vec!["", ""]);
    assert_eq!(split("a..b"), vec!["a", "", "b"]);
}

/// (pattern, routing key, matches)
const TOPIC_CASES: &[(&str, &str, bool)] = &[
    // literal
    ("a.b.c", "a.b.c", true),
    ("a.b.c", "a.b", false),
    ("a.b", "a.b.c", false),
    ("a.b.c", "a.B.c", false),
    ("", "", true),
    ("", "a", false),
    ("a", "", false),
    // `#` alone matches everything, including the empty key
    ("#", "", true),
    ("#", "a", true),
    ("#", "a.b.c", true),
    ("#", ".", true),
    ("#", "..", true),
    ("#.#", "", true),
    ("#.#", "a.b", true),
    ("#.#.#", "a", true),
    // `#` at the ends
    ("a.#", "a", true),
    ("a.#", "a.b", true),
    ("a.#", "a.b.c", true),
    ("a.#", "b.a", false),
    ("a.#", "", false),
    ("a.#", "a.", true),
    ("#.a", "a", true),
    ("#.a", "x.y.a", true),
    ("#.a", "a.x", false),
    ("a.#.#", "a", true),
    // `#` in the middle
    ("a.#.b", "a.b", true),
    ("a.#.b", "a.x.b", true),
    ("a.#.b", "a.x.y.b", true),
    ("a.#.b", "a.b.b", true),
    ("a.#.b", "a.b.x", false),
    ("a.#.b", "a", false),
    ("a.#.b.#.c", "a.b.c", true),
    ("a.#.b.#.c", "a.x.b.y.z.c", true),
    ("a.#.b.#.c", "a.c.b", false),
    // `*` is exactly one word, possibly empty
    ("*", "a", true),
    ("*", "", false),
    ("*", "a.b", false),
    ("*", ".", false),
    ("*.*", "a", false),
    ("*.*", "a.b", true),
    ("*.*", ".", true),
    ("*.*", "a.", true),
    ("*.*", "a.b.c", false),
    ("a.*", "a.", true),
    ("a.*", "a", false),
    ("*.a", ".a", true),
    ("a.*.b", "a..b", true),
    ("a.*.b", "a.b", false),
    ("*.#", "", false),
    ("*.#", "a", true),
    ("#.*", "a.b.c", true),
    ("#.*", "", false),
    ("*.#.*", "a", false),
    ("*.#.*", "a.b", true),
    ("*.#.*", "a.b.c.d", true),
    // empty words must match literally
    ("a..b", "a..b", true),
    ("a..b", "a.b", false),
    ("a.", "a.", true),
    ("a.", "a", false),
    (".a", ".a", true),
    (".", ".", true),
    (".", "", false),
    // `*` and `#` in a routing key are ordinary words
    ("a.*", "a.*", true),
    ("a.b", "a.*", false),
    ("a.#", "a.#", true),
    ("a.b", "a.#", false),
    ("#", "#", true),
    ("*", "#", true),
    ("a.#.c", "a.#.c", true),
    ("a.#.c", "a.#", false),
    // words that merely contain wildcard characters are literals
    ("a*", "ab", false),
    ("a*", "a*", true),
    ("a#", "a", false),
    ("a#", "a#", true),
    ("a.b*", "a.bc", false),
];

#[test]
fn topic_matches_table() {
    for (pattern, key, expected) in TOPIC_CASES {
        assert_eq!(
            topic_matches(pattern, key),
            *expected,
            "pattern {pattern:?} key {key:?}"
        );
    }
}

#[test]
fn topic_trie_agrees_with_the_table() {
    for (pattern, key, expected) in TOPIC_CASES {
        let mut t = BindingTable::new(ExchangeKind::Topic);
        t.add(Binding::new(queue("q"), *pattern, FieldTable::default()));
        let routed = route(&t, &[key], None);
        assert_eq!(
            routed == vec![queue("q")],
            *expected,
            "pattern {pattern:?} key {key:?}"
        );
    }
}

/// The definition, written naively (exponential, fine for short inputs).
fn reference_topic_match(pattern: &[&str], key: &[&str]) -> bool {
    match (pattern.first(), key.first()) {
        (None, None) => true,
        (Some(&"#"), _) => {
            reference_topic_match(&pattern[1..], key)
                || (!key.is_empty() && reference_topic_match(pattern, &key[1..]))
        }
        (Some(&"*"), Some(_)) => reference_topic_match(&pattern[1..], &key[1..]),
        (Some(p), Some(k)) if p == k => reference_topic_match(&pattern[1..], &key[1..]),
        _ => false,
    }
}

#[test]
fn topic_trie_with_many_patterns_agrees_with_topic_matches() {
    // Deterministic pseudo-random patterns and keys over a small alphabet.
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let pattern_words = ["a", "b", "", "*", "#"];
    let key_words = ["a", "b", "", "*", "#", "c"];
    let mut random_string = |alphabet: &[&str], max_words: u64| {
        let n = next(max_words + 1);
        if n == 0 {
            return String::new();
        }
        (0..n)
            .map(|_| alphabet[next(alphabet.len() as u64) as usize])
            .collect::<Vec<_>>()
            .join(".")
    };
    let patterns: Vec<String> = (0..200).map(|_| random_string(&pattern_words, 5)).collect();
    let keys: Vec<String> = (0..300).map(|_| random_string(&key_words, 6)).collect();
    for pattern in &patterns {
        let pattern_words: Vec<&str> = split_topic_words(pattern).collect();
        for key in &keys {
            let key_words: Vec<&str> = split_topic_words(key).collect();
            assert_eq!(
                topic_matches(pattern, key),
                reference_topic_match(&pattern_words, &key_words),
                "pattern {pattern:?} key {key:?}"
            );
        }
    }
    let mut t = BindingTable::new(ExchangeKind::Topic);
    for (i, p) in patterns.iter().enumerate() {
        t.add(Binding::new(
            queue(&format!("q{i}")),
            p.clone(),
            FieldTable::default(),
        ));
    }
    for key in &keys {
        let expected: Vec<Destination> = patterns
            .iter()
            .enumerate()
            .filter(|(_, p)| topic_matches(p, key))
            .map(|(i, _)| queue(&format!("q{i}")))
            .collect();
        assert_eq!(
            sorted(route(&t, &[key], None)),
            sorted(expected),
            "key {key:?}"
        );
    }
    // Removing every binding leaves an empty trie (all nodes pruned).
    for (i, p) in patterns.iter().enumerate() {
        assert!(t.remove(&queue(&format!("q{i}")), p, &FieldTable::default()));
    }
    assert!(t.is_empty());
    let RouteIndex::Topic(trie) = &t.index else {
        panic!("topic index expected")
    };
    assert!(trie.nodes[TRIE_ROOT].children.is_empty());
    assert_eq!(trie.hash_edges, 0);
    assert_eq!(trie.free.len(), trie.nodes.len() - 1);
}

#[test]
fn topic_many_hashes_stays_fast() {
    let pattern = vec!["#"; 40].join(".") + ".x";
    let key = vec!["a"; 200].join(".");
    assert!(!topic_matches(&pattern, &key));
    let mut t = BindingTable::new(ExchangeKind::Topic);
    t.add(Binding::new(
        queue("q"),
        pattern.clone(),
        FieldTable::default(),
    ));
    assert!(route(&t, &[&key], None).is_empty());
    let matching = key.clone() + ".x";
    assert_eq!(route(&t, &[&matching], None), vec![queue("q")]);
}

#[test]
fn topic_routes_each_destination_once_across_keys_and_bindings() {
    let mut t = BindingTable::new(ExchangeKind::Topic);
    t.add(Binding::new(queue("q1"), "a.*", FieldTable::default()));
    t.add(Binding::new(queue("q1"), "#", FieldTable::default()));
    t.add(Binding::new(queue("q2"), "b.#", FieldTable::default()));
    t.add(Binding::new(exchange("x"), "a.b", FieldTable::default()));
    let routed = route(&t, &["a.b", "b.c", "a.z"], None);
    assert_eq!(
        sorted(routed),
        vec![queue("q1"), queue("q2"), exchange("x")]
    );
    assert_eq!(route(&t, &["zzz"], None), vec![queue("q1")]);
    assert!(route(&t, &[], None).is_empty());
}

#[test]
fn topic_remove_keeps_shared_trie_paths() {
    let mut t = BindingTable::new(ExchangeKind::Topic);
    t.add(Binding::new(queue("q1"), "a.b", FieldTable::default()));
    t.add(Binding::new(queue("q2"), "a.b.c", FieldTable::default()));
    t.add(Binding::new(queue("q3"), "a.#", FieldTable::default()));
    assert!(t.remove(&queue("q1"), "a.b", &FieldTable::default()));
    assert_eq!(route(&t, &["a.b.c"], None).len(), 2);
    assert_eq!(route(&t, &["a.b"], None), vec![queue("q3")]);
    assert!(!t.remove(&queue("q1"), "a.b", &FieldTable::default()));
    assert!(!t.remove(&queue("q2"), "a.x", &FieldTable::default()));
    assert_eq!(t.remove_destination(&queue("q3")), 1);
    assert!(route(&t, &["a"], None).is_empty());
    assert_eq!(route(&t, &["a.b.c"], None), vec![queue("q2")]);
    // Re-adding after pruning works (free nodes reused).
    t.add(Binding::new(queue("q4"), "a.#.z", FieldTable::default()));
    assert_eq!(route(&t, &["a.b.c.z"], None), vec![queue("q4")]);
}

#[test]
fn direct_routes_exact_keys_for_all_given_keys() {
    let mut t = BindingTable::new(ExchangeKind::Direct);
    assert!(t.add(Binding::new(queue("q1"), "k1", FieldTable::default())));
    assert!(t.add(Binding::new(queue("q2"), "k2", FieldTable::default())));
    assert!(t.add(Binding::new(queue("q3"), "", FieldTable::default())));
    assert!(t.add(Binding::new(exchange("e"), "k1", FieldTable::default())));
    assert_eq!(
        sorted(route(&t, &["k1"], None)),
        vec![queue("q1"), exchange("e")]
    );
    assert_eq!(route(&t, &[""], None), vec![queue("q3")]);
    assert!(route(&t, &["K1"], None).is_empty());
    assert!(route(&t, &["k"], None).is_empty());
    assert!(route(&t, &["#"], None).is_empty());
    // publish key + CC + BCC
    assert_eq!(
        sorted(route(&t, &["k1", "k2", "k1", "nope"], None)),
        vec![queue("q1"), queue("q2"), exchange("e")]
    );
}

#[test]
fn add_is_idempotent_and_arguments_are_part_of_identity() {
    let mut t = BindingTable::new(ExchangeKind::Direct);
    let args = table(&[("x-a", s("1"))]);
    assert!(t.add(Binding::new(queue("q"), "k", FieldTable::default())));
    assert!(!t.add(Binding::new(queue("q"), "k", FieldTable::default())));
    assert!(t.add(Binding::new(queue("q"), "k", args.clone())));
    assert!(!t.add(Binding::new(queue("q"), "k", args.clone())));
    assert!(t.add(Binding::new(exchange("q"), "k", FieldTable::default())));
    assert_eq!(t.len(), 3);
    assert!(t.contains(&queue("q"), "k", &args));
    assert!(t.contains(&queue("q"), "k", &FieldTable::default()));
    assert!(!t.contains(&queue("q"), "k2", &FieldTable::default()));
    // Same queue through two bindings: routed once.
    assert_eq!(
        sorted(route(&t, &["k"], None)),
        vec![queue("q"), exchange("q")]
    );
    // Removing one of the two keeps the other routing.
    assert!(t.remove(&queue("q"), "k", &FieldTable::default()));
    assert!(!t.remove(&queue("q"), "k", &FieldTable::default()));
    assert!(!t.contains(&queue("q"), "k", &FieldTable::default()));
    assert_eq!(
        sorted(route(&t, &["k"], None)),
        vec![queue("q"), exchange("q")]
    );
    assert!(t.remove(&queue("q"), "k", &args));
    assert_eq!(route(&t, &["k"], None), vec![exchange("q")]);
    assert_eq!(t.len(), 1);
    assert!(!t.has_destination(&queue("q")));
    assert!(t.has_destination(&exchange("q")));
}

#[test]
fn remove_destination_drops_all_its_bindings() {
    for kind in [
        ExchangeKind::Direct,
        ExchangeKind::Fanout,
        ExchangeKind::Topic,
        ExchangeKind::Headers,
    ] {
        let mut t = BindingTable::new(kind);
        t.add(Binding::new(queue("q1"), "a", FieldTable::default()));
        t.add(Binding::new(queue("q1"), "b", FieldTable::default()));
        t.add(Binding::new(queue("q1"), "a", table(&[("h", s("v"))])));
        t.add(Binding::new(queue("q2"), "a", FieldTable::default()));
        assert_eq!(t.len(), 4, "{kind}");
        assert_eq!(t.remove_destination(&queue("q1")), 3, "{kind}");
        assert_eq!(t.remove_destination(&queue("q1")), 0, "{kind}");
        assert_eq!(t.len(), 1, "{kind}");
        assert_eq!(route(&t, &["a", "b"], None), vec![queue("q2")], "{kind}");
        assert_eq!(t.bindings().count(), 1, "{kind}");
        assert_eq!(t.remove_destination(&queue("q2")), 1, "{kind}");
        assert!(t.is_empty(), "{kind}");
        assert!(route(&t, &["a", "b"], None).is_empty(), "{kind}");
    }
}

#[test]
fn bindings_lists_every_binding() {
    let mut t = BindingTable::new(ExchangeKind::Topic);
    t.add(Binding::new(queue("b"), "x.#", FieldTable::default()));
    t.add(Binding::new(queue("a"), "y", FieldTable::default()));
    t.add(Binding::new(queue("b"), "z", FieldTable::default()));
    let listed: Vec<(Destination, String)> = t
        .bindings()
        .map(|b| (b.destination.clone(), b.routing_key.clone()))
        .collect();
    assert_eq!(
        listed,
        vec![
            (queue("a"), "y".to_string()),
            (queue("b"), "x.#".to_string()),
            (queue("b"), "z".to_string()),
        ]
    );
    assert_eq!(t.kind(), ExchangeKind::Topic);
}

#[test]
fn fanout_routes_everything_once_ignoring_keys() {
    let mut t = BindingTable::new(ExchangeKind::Fanout);
    t.add(Binding::new(queue("q1"), "", FieldTable::default()));
    t.add(Binding::new(queue("q1"), "other", FieldTable::default()));
    t.add(Binding::new(queue("q2"), "k", FieldTable::default()));
    t.add(Binding::new(exchange("e"), "", FieldTable::default()));
    let expected = vec![queue("q1"), queue("q2"), exchange("e")];
    assert_eq!(sorted(route(&t, &["whatever"], None)), expected);
    assert_eq!(sorted(route(&t, &[], None)), expected);
    assert_eq!(sorted(route(&t, &["a", "b", "c"], None)), expected);
}

#[test]
fn route_appends_without_duplicating_what_out_holds() {
    let mut fanout = BindingTable::new(ExchangeKind::Fanout);
    fanout.add(Binding::new(queue("q1"), "", FieldTable::default()));
    fanout.add(Binding::new(queue("q2"), "", FieldTable::default()));
    let mut direct = BindingTable::new(ExchangeKind::Direct);
    direct.add(Binding::new(queue("q2"), "k", FieldTable::default()));
    direct.add(Binding::new(queue("q3"), "k", FieldTable::default()));

    let mut out = vec![queue("q2")];
    fanout.route(&["k"], None, &mut out);
    assert_eq!(out, vec![queue("q2"), queue("q1")]);
    direct.route(&["k"], None, &mut out);
    assert_eq!(out, vec![queue("q2"), queue("q1"), queue("q3")]);
}

#[test]
fn large_fanouts_and_duplicates_switch_to_hashed_dedup() {
    let mut fanout = BindingTable::new(ExchangeKind::Fanout);
    let mut direct = BindingTable::new(ExchangeKind::Direct);
    for i in 0..100 {
        fanout.add(Binding::new(
            queue(&format!("q{i}")),
            "",
            FieldTable::default(),
        ));
        // Every queue bound under two keys and twice under "k" (different arguments).
        direct.add(Binding::new(
            queue(&format!("q{i}")),
            "k",
            FieldTable::default(),
        ));
        direct.add(Binding::new(
            queue(&format!("q{i}")),
            "k",
            table(&[("n", AMQPValue::LongInt(i))]),
        ));
        direct.add(Binding::new(
            queue(&format!("q{i}")),
            "j",
            FieldTable::default(),
        ));
    }
    let mut out = Vec::new();
    direct.route(&["k", "j"], None, &mut out);
    assert_eq!(out.len(), 100);
    fanout.route(&[], None, &mut out);
    assert_eq!(out.len(), 100);
    let mut unique = out.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 100);
    // Prior contents above the linear limit.
    let mut out: Vec<Destination> = (0..50).map(|i| queue(&format!("q{i}"))).collect();
    fanout.route(&[], None, &mut out);
    assert_eq!(out.len(), 100);
}

// ---- headers ---------------------------------------------------------------------------

fn x_match(mode: &str) -> (&'static str, AMQPValue) {
    ("x-match", s(mode))
}

#[test]
fn headers_modes_table() {
    let headers = table(&[
        ("a", s("1")),
        ("b", AMQPValue::LongInt(2)),
        ("x-c", s("3")),
        ("v", AMQPValue::Void),
    ]);
    // (binding arguments, matches `headers`)
    let cases: Vec<(FieldTable, bool)> = vec![
        // all (default)
        (table(&[]), true),
        (table(&[("a", s("1"))]), true),
        (table(&[("a", s("1")), ("b", AMQPValue::LongInt(2))]), true),
        (table(&[("a", s("1")), ("b", AMQPValue::LongInt(3))]), false),
        (table(&[("a", s("1")), ("z", s("1"))]), false),
        (table(&[x_match("all"), ("a", s("1"))]), true),
        (table(&[x_match("all"), ("a", s("2"))]), false),
        (table(&[x_match("all")]), true),
        // x- arguments ignored in all/any
        (table(&[("a", s("1")), ("x-c", s("nope"))]), true),
        (table(&[("x-other", s("nope"))]), true),
        (table(&[x_match("any"), ("x-c", s("3"))]), false),
        // any
        (table(&[x_match("any")]), false),
        (
            table(&[x_match("any"), ("a", s("9")), ("b", AMQPValue::LongInt(2))]),
            true,
        ),
        (
            table(&[x_match("any"), ("a", s("9")), ("z", s("1"))]),
            false,
        ),
        (table(&[x_match("any"), ("z", s("1")), ("a", s("1"))]), true),
        // all-with-x / any-with-x: x- arguments take part, x-match does not
        (table(&[x_match("all-with-x"), ("x-c", s("3"))]), true),
        (table(&[x_match("all-with-x"), ("x-c", s("4"))]), false),
        (
            table(&[x_match("all-with-x"), ("a", s("1")), ("x-c", s("3"))]),
            true,
        ),
        (
            table(&[x_match("all-with-x"), ("a", s("1")), ("x-d", s("3"))]),
            false,
        ),
        (table(&[x_match("all-with-x")]), true),
        (table(&[x_match("any-with-x"), ("x-c", s("3"))]), true),
        (
            table(&[x_match("any-with-x"), ("x-c", s("4")), ("a", s("0"))]),
            false,
        ),
        (
            table(&[x_match("any-with-x"), ("x-c", s("4")), ("a", s("1"))]),
            true,
        ),
        (table(&[x_match("any-with-x")]), false),
        // void: presence only
        (table(&[("a", AMQPValue::Void)]), true),
        (table(&[("z", AMQPValue::Void)]), false),
        (table(&[("v", AMQPValue::Void)]), true),
        (
            table(&[
                x_match("any"),
                ("z", AMQPValue::Void),
                ("b", AMQPValue::Void),
            ]),
            true,
        ),
        (
            table(&[x_match("all-with-x"), ("x-c", AMQPValue::Void)]),
            true,
        ),
        // a void header only equals a void binding value (which matches on presence)
        (table(&[("v", s(""))]), false),
        // unknown x-match values route as `all` (RabbitMQ's legacy behaviour)
        (
            table(&[x_match("bogus"), ("a", s("1")), ("z", s("1"))]),
            false,
        ),
        (table(&[x_match("bogus"), ("a", s("1"))]), true),
        (
            table(&[("x-match", AMQPValue::LongInt(1)), ("a", s("1"))]),
            true,
        ),
    ];
    for (args, expected) in &cases {
        assert_eq!(headers_match(args, Some(&headers)), *expected, "{args:?}");
    }
}

#[test]
fn headers_without_message_headers() {
    assert!(headers_match(&table(&[]), None));
    assert!(headers_match(&table(&[x_match("all")]), None));
    assert!(headers_match(&table(&[("x-foo", s("1"))]), None));
    assert!(!headers_match(&table(&[("a", s("1"))]), None));
    assert!(!headers_match(&table(&[("a", AMQPValue::Void)]), None));
    assert!(!headers_match(&table(&[x_match("any")]), None));
    assert!(!headers_match(
        &table(&[x_match("any"), ("a", s("1"))]),
        None
    ));
    assert!(!headers_match(
        &table(&[x_match("all-with-x"), ("x-a", s("1"))]),
        None
    ));
    let empty = FieldTable::default();
    assert!(headers_match(&table(&[]), Some(&empty)));
    assert!(!headers_match(&table(&[("a", s("1"))]), Some(&empty)));
}

#[test]
fn header_values_compare_like_erlang_terms() {
    use AMQPValue as V;
    // (binding value, header value, equal)
    let cases: Vec<(AMQPValue, AMQPValue, bool)> = vec![
        (V::LongInt(1), V::LongLongInt(1), true),
        (V::LongInt(1), V::ShortShortInt(1), true),
        (V::ShortShortUInt(255), V::ShortInt(255), true),
        (V::LongUInt(u32::MAX), V::LongLongInt(u32::MAX as i64), true),
        (V::LongInt(-1), V::LongUInt(u32::MAX), false),
        (V::LongInt(-1), V::ShortShortInt(-1), true),
        (V::LongLongInt(5), V::Timestamp(5), true),
        (V::LongInt(1), V::LongInt(2), false),
        (V::LongInt(1), V::Double(1.0), true),
        (V::LongInt(1), V::Double(1.5), false),
        (V::Float(1.5), V::Double(1.5), true),
        (V::Float(0.1), V::Double(0.1), false),
        (V::Double(f64::NAN), V::Double(f64::NAN), false),
        (V::LongInt(1), s("1"), false),
        (V::LongInt(1), V::Boolean(true), false),
        (V::Boolean(true), V::Boolean(true), true),
        (V::Boolean(true), V::Boolean(false), false),
        (s("abc"), s("abc"), true),
        (s("abc"), s("ABC"), false),
        (
            s("abc"),
            V::ByteArray(ByteArray::from(b"abc".to_vec())),
            true,
        ),
        (
            V::DecimalValue(DecimalValue {
                scale: 1,
                value: 10,
            }),
            V::DecimalValue(DecimalValue {
                scale: 1,
                value: 10,
            }),
            true,
        ),
        (
            V::DecimalValue(DecimalValue {
                scale: 1,
                value: 10,
            }),
            V::DecimalValue(DecimalValue { scale: 0, value: 1 }),
            false,
        ),
        (
            V::FieldArray(FieldArray::from(vec![V::LongInt(1), s("a")])),
            V::FieldArray(FieldArray::from(vec![V::LongInt(1), s("a")])),
            true,
        ),
        // inside arrays the type is part of the value
        (
            V::FieldArray(FieldArray::from(vec![V::LongInt(1)])),
            V::FieldArray(FieldArray::from(vec![V::LongLongInt(1)])),
            false,
        ),
        (
            V::FieldTable(table(&[("k", s("v"))])),
            V::FieldTable(table(&[("k", s("v"))])),
            true,
        ),
        (
            V::FieldTable(table(&[("k", s("v"))])),
            V::FieldTable(table(&[("k", s("w"))])),
            false,
        ),
    ];
    for (binding_value, header_value, expected) in cases {
        let args = table(&[("h", binding_value.clone())]);
        let headers = table(&[("h", header_value.clone())]);
        assert_eq!(
            headers_match(&args, Some(&headers)),
            expected,
            "{binding_value:?} vs {header_value:?}"
        );
    }
}

#[test]
fn headers_table_routes_each_destination_once() {
    let mut t = BindingTable::new(ExchangeKind::Headers);
    t.add(Binding::new(queue("q1"), "", table(&[("a", s("1"))])));
    t.add(Binding::new(queue("q1"), "", table(&[("b", s("2"))])));
    t.add(Binding::new(
        queue("q2"),
        "",
        table(&[x_match("any"), ("a", s("0")), ("b", s("2"))]),
    ));
    t.add(Binding::new(queue("q3"), "", table(&[("c", s("3"))])));
    t.add(Binding::new(exchange("e"), "ignored", table(&[])));
    let headers = table(&[("a", s("1")), ("b", s("2"))]);
    assert_eq!(
        sorted(route(&t, &["k1", "k2"], Some(&headers))),
        vec![queue("q1"), queue("q2"), exchange("e")]
    );
    assert_eq!(route(&t, &[], None), vec![exchange("e")]);
}

#[test]
fn validate_headers_binding_accepts_the_four_modes() {
    for mode in ["all", "any", "all-with-x", "any-with-x"] {
        assert_eq!(validate_headers_binding(&table(&[x_match(mode)])), Ok(()));
    }
    assert_eq!(validate_headers_binding(&table(&[])), Ok(()));
    assert_eq!(
        validate_headers_binding(&table(&[("other", AMQPValue::LongInt(1))])),
        Ok(())
    );
    assert_eq!(
        validate_headers_binding(&table(&[x_match("ALL")])),
        Err(
            "Invalid x-match field value <<\"ALL\">>; expected all, any, all-with-x, or any-with-x"
                .to_string()
        )
    );
    assert_eq!(
        validate_headers_binding(&table(&[("x-match", AMQPValue::LongInt(1))])),
        Err("Invalid x-match field type signedint (value 1); expected longstr".to_string())
    );
    assert!(
        validate_headers_binding(&table(&[("x-match", AMQPValue::Boolean(true))]))
            .unwrap_err()
            .contains("type bool")
    );
}

#[test]
fn headers_match_mode_of_binding() {
    assert_eq!(
        HeadersMatchMode::of_binding(&table(&[])),
        HeadersMatchMode::All
    );
    assert_eq!(
        HeadersMatchMode::of_binding(&table(&[x_match("any-with-x")])),
        HeadersMatchMode::AnyWithX
    );
    assert_eq!(
        HeadersMatchMode::of_binding(&table(&[x_match("nonsense")])),
        HeadersMatchMode::All
    );
}
