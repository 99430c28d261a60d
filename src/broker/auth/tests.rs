//! Unit tests of [`crate::broker::auth`].

use super::*;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

fn permission(vhost: &str, configure: &str, write: &str, read: &str) -> PermissionConfig {
    PermissionConfig {
        vhost: vhost.into(),
        configure: configure.into(),
        write: write.into(),
        read: read.into(),
    }
}

fn user(name: &str, password: &str, permissions: Vec<PermissionConfig>) -> UserConfig {
    UserConfig {
        name: name.into(),
        password: password.into(),
        password_hash: Default::default(),
        password_file: String::new(),
        loopback_only: false,
        permissions,
    }
}

#[test]
fn hash_password_matches_rabbitmq() {
    // The example from RabbitMQ's password hashing documentation (salt 908DC60A).
    assert_eq!(
        hash_password([0x90, 0x8D, 0xC6, 0x0A], "test12"),
        "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"
    );
    // Computed independently: base64(salt + sha256(salt + utf8)).
    assert_eq!(
        hash_password([1, 2, 3, 4], "gu€st"),
        "AQIDBNB+K1Rc8RF9Zdws2f97OJ7OwwDNhKuwJ0V6jbX6r8RX"
    );
}

#[test]
fn authenticate_with_plain_and_hashed_passwords() {
    let mut hashed = user("hashed", "", vec![]);
    hashed.password_hash = "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR".into();
    let mut sha512 = user("sha512", "", vec![]);
    sha512.password_hash = "AQIDBPhTH2L5HGYB1LWOrn+YpvuQmVOXKGqgsuiJRIZTILRoEvblSJo/WAsym3IZTfuaIaK5KR2o5KwFfTv6KsxfMIE=".into();
    let mut guest = user("guest", "guest", vec![]);
    guest.loopback_only = true;
    let db =
        UserDb::from_config(&[user("plain", "s3cret", vec![]), hashed, sha512, guest]).unwrap();

    assert_eq!(db.authenticate("plain", "s3cret", false), Ok(()));
    assert_eq!(
        db.authenticate("plain", "s3cret ", false),
        Err(AuthError::BadPassword)
    );
    assert_eq!(
        db.authenticate("plain", "", false),
        Err(AuthError::BadPassword)
    );
    assert_eq!(db.authenticate("hashed", "test12", false), Ok(()));
    assert_eq!(
        db.authenticate("hashed", "test13", false),
        Err(AuthError::BadPassword)
    );
    assert_eq!(db.authenticate("sha512", "secret", false), Ok(()));
    assert_eq!(
        db.authenticate("sha512", "Secret", false),
        Err(AuthError::BadPassword)
    );
    assert_eq!(
        db.authenticate("nobody", "s3cret", true),
        Err(AuthError::UnknownUser)
    );
    assert_eq!(
        db.authenticate("Plain", "s3cret", true),
        Err(AuthError::UnknownUser)
    );
    // loopback rule, checked after the password
    assert_eq!(db.authenticate("guest", "guest", true), Ok(()));
    assert_eq!(
        db.authenticate("guest", "guest", false),
        Err(AuthError::LoopbackOnly)
    );
    assert_eq!(
        db.authenticate("guest", "wrong", false),
        Err(AuthError::BadPassword)
    );
    assert!(db.contains_user("guest"));
    assert!(!format!("{db:?}").contains("kI3G"));
}

#[test]
fn default_config_user_is_guest_on_loopback() {
    let db = UserDb::from_config(&[UserConfig::default()]).unwrap();
    assert_eq!(db.authenticate("guest", "guest", true), Ok(()));
    assert_eq!(
        db.authenticate("guest", "guest", false),
        Err(AuthError::LoopbackOnly)
    );
    assert!(db.has_vhost_access("guest", "/"));
    assert!(db.check("guest", "/", Access::Configure, "anything"));
    assert!(db.check("guest", "/", Access::Write, ""));
}

#[test]
fn from_config_errors_name_the_key() {
    let err = |users: &[UserConfig]| UserDb::from_config(users).err().unwrap();

    let bad_regex = vec![
        user("a", "p", vec![]),
        user(
            "b",
            "p",
            vec![
                permission("/", ".*", ".*", ".*"),
                permission("v2", ".*", ".*", "(unclosed"),
            ],
        ),
    ];
    let e = err(&bad_regex);
    assert!(
        e.starts_with("users[1].permissions[1].read: invalid regex '(unclosed'"),
        "{e}"
    );

    let lookaround = vec![user(
        "a",
        "p",
        vec![permission("/", "^(?!amq\\.).*", "", "")],
    )];
    assert!(err(&lookaround).starts_with("users[0].permissions[0].configure: invalid regex"));

    let bad_write = vec![user("a", "p", vec![permission("/", ".*", "[", ".*")])];
    assert!(err(&bad_write).starts_with("users[0].permissions[0].write: "));

    let dup_vhost = vec![user(
        "a",
        "p",
        vec![permission("/", "", "", ""), permission("/", "", "", "")],
    )];
    assert_eq!(
        err(&dup_vhost),
        "users[0].permissions[1].vhost: duplicate permissions for vhost '/'"
    );

    assert_eq!(
        err(&[user("a", "p", vec![]), user("a", "q", vec![])]),
        "users[1].name: duplicate user 'a'"
    );
    assert_eq!(
        err(&[user("", "p", vec![])]),
        "users[0].name: must not be empty"
    );

    assert_eq!(
        err(&[user("a", "", vec![])]),
        "key `users[0].password`: user \"a\" needs a password, a password_hash or a password_file"
    );
    let mut both = user("a", "p", vec![]);
    both.password_hash = hash_password([1, 2, 3, 4], "p").into();
    assert_eq!(
        err(&[both]),
        "key `users[0].password_hash`: user \"a\" has password and password_hash; set exactly \
         one (password defaults to \"guest\": write password = \"\" next to a password_hash \
         or password_file)"
    );

    let mut not_base64 = user("a", "", vec![]);
    not_base64.password_hash = "not base64!".into();
    assert!(err(&[not_base64]).starts_with("users[0].password_hash: invalid base64"));

    let mut too_short = user("a", "", vec![]);
    too_short.password_hash = BASE64.encode([1, 2, 3, 4]).into();
    assert!(err(&[too_short]).starts_with("users[0].password_hash: decodes to 4 bytes"));

    let mut odd_length = user("a", "", vec![]);
    odd_length.password_hash = BASE64.encode([7u8; 20]).into();
    assert!(err(&[odd_length]).starts_with("users[0].password_hash: decodes to 20 bytes"));
}

#[test]
fn vhost_access_needs_a_permission_entry() {
    let db = UserDb::from_config(&[
        user(
            "a",
            "p",
            vec![
                permission("/", "", "", ""),
                permission("prod", ".*", ".*", ".*"),
            ],
        ),
        user("b", "p", vec![]),
    ])
    .unwrap();
    assert!(db.has_vhost_access("a", "/"));
    assert!(db.has_vhost_access("a", "prod"));
    assert!(!db.has_vhost_access("a", "dev"));
    assert!(!db.has_vhost_access("b", "/"));
    assert!(!db.has_vhost_access("nobody", "/"));
    // An entry with empty patterns opens the vhost but grants nothing in it.
    assert!(!db.check("a", "/", Access::Read, "q"));
    assert!(!db.check("a", "/", Access::Write, ""));
    assert!(db.check("a", "prod", Access::Read, "q"));
    assert!(!db.check("a", "dev", Access::Read, "q"));
    assert!(!db.check("b", "/", Access::Read, "q"));
    assert!(!db.check("nobody", "/", Access::Read, "q"));
}

#[test]
fn permission_patterns_follow_rabbitmq() {
    let db = UserDb::from_config(&[user(
        "u",
        "p",
        vec![permission("/", "^(amq\\.gen.*|app-.*)$", "amq", "")],
    )])
    .unwrap();
    let check = |access, resource| db.check("u", "/", access, resource);
    // anchored by the pattern itself
    assert!(check(Access::Configure, "app-orders"));
    assert!(check(Access::Configure, "amq.gen-JzTY20BRgKO"));
    assert!(!check(Access::Configure, "my-app-orders"));
    assert!(!check(Access::Configure, "amq.direct"));
    // unanchored: a substring match is enough
    assert!(check(Access::Write, "amq.topic"));
    assert!(check(Access::Write, "my-amq-queue"));
    assert!(!check(Access::Write, "orders"));
    // the default exchange is checked as amq.default
    assert!(check(Access::Write, ""));
    // "" grants nothing
    assert!(!check(Access::Read, "q"));
    assert!(!check(Access::Read, ""));
    assert!(!check(Access::Read, "amq.default"));
}

#[test]
fn default_exchange_checked_as_amq_default() {
    let db = UserDb::from_config(&[user(
        "u",
        "p",
        vec![permission("/", "^$", "^amq\\.default$", "^$")],
    )])
    .unwrap();
    assert!(db.check("u", "/", Access::Write, ""));
    assert!(db.check("u", "/", Access::Write, "amq.default"));
    assert!(!db.check("u", "/", Access::Write, "amq.direct"));
    // `^$` written out is the same as "": no name is empty once mapped.
    assert!(!db.check("u", "/", Access::Configure, ""));
}

#[test]
fn permission_regexes_work_on_bytes_like_pcre() {
    let db = UserDb::from_config(&[user(
        "u",
        "p",
        vec![permission("/", "^.{2}$", "^\\w+$", "^é")],
    )])
    .unwrap();
    // `.` is one byte: "é" is two bytes in UTF-8.
    assert!(db.check("u", "/", Access::Configure, "é"));
    assert!(db.check("u", "/", Access::Configure, "ab"));
    assert!(!db.check("u", "/", Access::Configure, "éa"));
    // `\w` is ASCII only.
    assert!(db.check("u", "/", Access::Write, "abc_1"));
    assert!(!db.check("u", "/", Access::Write, "café"));
    // Non-ASCII literals still match their UTF-8 bytes.
    assert!(db.check("u", "/", Access::Read, "éclair"));
    assert!(!db.check("u", "/", Access::Read, "eclair"));
}

#[test]
fn non_ascii_classes_fall_back_to_unicode_mode() {
    let db = UserDb::from_config(&[user(
        "u",
        "p",
        vec![permission("/", "^[éè]t$", "^\\p{L}+$", "")],
    )])
    .unwrap();
    assert!(db.check("u", "/", Access::Configure, "ét"));
    assert!(!db.check("u", "/", Access::Configure, "et"));
    assert!(db.check("u", "/", Access::Write, "çava"));
    assert!(!db.check("u", "/", Access::Write, "ça-va"));
}

#[test]
fn sasl_user_names_for_both_mechanisms() {
    assert_eq!(sasl_user("PLAIN", b"\0guest\0pw").as_deref(), Some("guest"));
    let amqplain = amqplain_bytes(&[("LOGIN", long("bob")), ("PASSWORD", long("pw"))]);
    assert_eq!(sasl_user("AMQPLAIN", &amqplain).as_deref(), Some("bob"));
    assert_eq!(sasl_user("EXTERNAL", b"\0guest\0pw"), None);
    assert_eq!(sasl_user("PLAIN", b"guest"), None);
    assert_eq!(
        login_refused("PLAIN"),
        "Login was refused using authentication mechanism PLAIN. For details see the broker logfile."
    );
}

#[test]
fn sasl_plain() {
    assert_eq!(
        parse_sasl_plain(b"\0guest\0guest"),
        Some(("guest".into(), "guest".into()))
    );
    assert_eq!(
        parse_sasl_plain(b"admin\0bob\0pw"),
        Some(("bob".into(), "pw".into()))
    );
    assert_eq!(
        parse_sasl_plain(b"\0\0"),
        Some((String::new(), String::new()))
    );
    assert_eq!(
        parse_sasl_plain("\0ünï\0pässword".as_bytes()),
        Some(("ünï".into(), "pässword".into()))
    );
    assert_eq!(parse_sasl_plain(b""), None);
    assert_eq!(parse_sasl_plain(b"guest"), None);
    assert_eq!(parse_sasl_plain(b"\0guest"), None);
    assert_eq!(parse_sasl_plain(b"\0guest\0pa\0ss"), None);
    assert_eq!(parse_sasl_plain(b"\0gu\xffest\0guest"), None);
    assert_eq!(parse_sasl_plain(b"\0guest\0\xc3"), None);
}

/// Encodes a table the way a client does for AMQPLAIN: amq-protocol's encoder, size
/// prefix removed.
fn amqplain_bytes(entries: &[(&str, AMQPValue)]) -> Vec<u8> {
    let mut table = FieldTable::default();
    for (k, v) in entries {
        table.insert(ShortString::try_new(*k).unwrap(), v.clone());
    }
    let (buffer, _) = amq_protocol::types::generation::gen_field_table(&table)(Vec::new().into())
        .unwrap()
        .into_inner();
    buffer[4..].to_vec()
}

fn long(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v))
}

#[test]
fn amqplain() {
    let response = amqplain_bytes(&[("LOGIN", long("guest")), ("PASSWORD", long("pw"))]);
    assert_eq!(
        parse_amqplain(&response),
        Some(("guest".into(), "pw".into()))
    );
    // other entries of every kind are skipped
    let mut nested = FieldTable::default();
    nested.insert(ShortString::try_new("n").unwrap(), AMQPValue::LongInt(1));
    let response = amqplain_bytes(&[
        ("A", AMQPValue::Boolean(true)),
        ("B", AMQPValue::ShortShortUInt(1)),
        ("C", AMQPValue::ShortInt(-2)),
        ("D", AMQPValue::LongUInt(3)),
        ("E", AMQPValue::LongLongInt(4)),
        ("F", AMQPValue::Double(5.0)),
        ("G", AMQPValue::Timestamp(6)),
        ("H", AMQPValue::FieldTable(nested)),
        ("I", AMQPValue::Void),
        ("LOGIN", long("ü")),
        ("PASSWORD", long("")),
        ("ZZ", long("tail")),
    ]);
    assert_eq!(parse_amqplain(&response), Some(("ü".into(), String::new())));
    // missing or mistyped fields
    assert_eq!(
        parse_amqplain(&amqplain_bytes(&[("LOGIN", long("g"))])),
        None
    );
    assert_eq!(
        parse_amqplain(&amqplain_bytes(&[("PASSWORD", long("p"))])),
        None
    );
    assert_eq!(
        parse_amqplain(&amqplain_bytes(&[
            ("LOGIN", AMQPValue::LongInt(1)),
            ("PASSWORD", long("p"))
        ])),
        None
    );
    assert_eq!(parse_amqplain(b""), None);
}

#[test]
fn client_auth_strings_round_trip() {
    use amq_protocol::auth::{Credentials, SASLMechanism};
    let credentials = Credentials::new("bob".into(), "s€cret".into());
    let amqplain = credentials.sasl_auth_string(SASLMechanism::AMQPlain);
    assert_eq!(
        parse_amqplain(amqplain.as_bytes()),
        Some(("bob".into(), "s€cret".into()))
    );
    let plain = credentials.sasl_auth_string(SASLMechanism::Plain);
    assert_eq!(
        parse_sasl_plain(plain.as_bytes()),
        Some(("bob".into(), "s€cret".into()))
    );
}

#[test]
fn amqplain_by_hand_first_entry_wins() {
    let mut bytes = Vec::new();
    for (name, value) in [("LOGIN", "first"), ("PASSWORD", "pw"), ("LOGIN", "second")] {
        bytes.push(name.len() as u8);
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(b'S');
        bytes.extend_from_slice(&(value.len() as u32).to_be_bytes());
        bytes.extend_from_slice(value.as_bytes());
    }
    assert_eq!(parse_amqplain(&bytes), Some(("first".into(), "pw".into())));
}

#[test]
fn amqplain_garbage_never_panics() {
    let valid = amqplain_bytes(&[("LOGIN", long("guest")), ("PASSWORD", long("guest"))]);
    // every truncation of a valid response
    for end in 0..valid.len() {
        assert_eq!(parse_amqplain(&valid[..end]), None, "truncated at {end}");
    }
    // huge declared lengths, unknown tags, trailing bytes
    assert_eq!(parse_amqplain(b"\x05LOGINS\xff\xff\xff\xff"), None);
    assert_eq!(parse_amqplain(b"\x05LOGINF\xff\xff\xff\xffabc"), None);
    assert_eq!(parse_amqplain(b"\x01AQ"), None);
    assert_eq!(parse_amqplain(b"\xff"), None);
    let mut trailing = valid.clone();
    trailing.push(3);
    assert_eq!(parse_amqplain(&trailing), None);
    // pseudo-random bytes
    let mut seed: u32 = 12345;
    for len in 0..200 {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (seed >> 16) as u8
            })
            .collect();
        let _ = parse_amqplain(&bytes);
        let _ = parse_sasl_plain(&bytes);
    }
    // deep nesting is skipped, not recursed into
    let mut deep = Vec::new();
    deep.extend_from_slice(b"\x01N");
    deep.push(b'F');
    let inner = vec![b'F'; 100_000];
    deep.extend_from_slice(&(inner.len() as u32).to_be_bytes());
    deep.extend_from_slice(&inner);
    deep.extend_from_slice(&valid);
    assert_eq!(
        parse_amqplain(&deep),
        Some(("guest".into(), "guest".into()))
    );
}
