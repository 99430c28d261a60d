//! Exchange types and binding tables: which destinations (queues or exchanges) one exchange
//! routes a message to.
//!
//! A vhost keeps one [`BindingTable`] per exchange (all bindings whose source is that exchange),
//! indexed for the exchange's [`ExchangeKind`], and asks it for the destinations of every
//! published message with [`BindingTable::route`]. Pure data, no I/O.
//!
//! Semantics follow RabbitMQ:
//! - **direct**: exact routing-key match, one hash lookup per routing key;
//! - **fanout**: every bound destination, routing keys ignored;
//! - **topic** (`rabbit_exchange_type_topic`): keys and patterns are split on `.` into words
//!   (the empty key has *zero* words; `"a."` is `["a", ""]`, so empty words are ordinary words);
//!   `*` matches exactly one word (possibly empty), `#` matches zero or more words. `*` and `#`
//!   inside a routing key are plain words. Bindings sit in a word trie (as RabbitMQ's), walked
//!   without recursion and with a visited set, so no pattern can make matching exponential;
//! - **headers** (`rabbit_exchange_type_headers`): see [`headers_match`].
//!
//! [`BindingTable::route`] yields each destination once per message, whatever the number of
//! routing keys (publish key plus CC/BCC keys) or of bindings that matched it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use amq_protocol::types::{AMQPValue, FieldTable};

/// The exchange types this broker implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

/// An `exchange.declare` type that is not one of ours (the broker answers 503 COMMAND_INVALID).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown exchange type '{0}'")]
pub struct UnknownExchangeKind(pub String);

impl FromStr for ExchangeKind {
    type Err = UnknownExchangeKind;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "direct" => Ok(ExchangeKind::Direct),
            "fanout" => Ok(ExchangeKind::Fanout),
            "topic" => Ok(ExchangeKind::Topic),
            "headers" => Ok(ExchangeKind::Headers),
            other => Err(UnknownExchangeKind(other.to_string())),
        }
    }
}

impl ExchangeKind {
    /// The AMQP type name, as given in `exchange.declare`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

impl fmt::Display for ExchangeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a binding points at: a queue (`queue.bind`) or an exchange (`exchange.bind`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    Queue(String),
    Exchange(String),
}

/// One binding from the table's exchange to a destination.
#[derive(Clone, Debug, PartialEq)]
pub struct Binding {
    pub destination: Destination,
    pub routing_key: String,
    pub arguments: FieldTable,
}

impl Binding {
    pub fn new(
        destination: Destination,
        routing_key: impl Into<String>,
        arguments: FieldTable,
    ) -> Self {
        Binding {
            destination,
            routing_key: routing_key.into(),
            arguments,
        }
    }
}

/// All bindings whose source is one exchange, indexed for that exchange's kind.
///
/// The bindings themselves are kept per destination (identity, listing, removal on delete);
/// direct and topic tables keep a routing index beside them (a key map, a word trie), fanout
/// and headers tables route over the per-destination record directly.
#[derive(Clone, Debug)]
pub struct BindingTable {
    kind: ExchangeKind,
    by_destination: BTreeMap<Destination, Vec<Binding>>,
    len: usize,
    index: RouteIndex,
}

#[derive(Clone, Debug)]
enum RouteIndex {
    /// Routing key → one destination entry per binding with that key.
    Direct(HashMap<String, Vec<Destination>>),
    /// Fanout and headers route over `by_destination`.
    None,
    Topic(TopicTrie),
}

impl BindingTable {
    pub fn new(kind: ExchangeKind) -> Self {
        let index = match kind {
            ExchangeKind::Direct => RouteIndex::Direct(HashMap::new()),
            ExchangeKind::Topic => RouteIndex::Topic(TopicTrie::new()),
            ExchangeKind::Fanout | ExchangeKind::Headers => RouteIndex::None,
        };
        BindingTable {
            kind,
            by_destination: BTreeMap::new(),
            len: 0,
            index,
        }
    }

    pub fn kind(&self) -> ExchangeKind {
        self.kind
    }

    /// Adds a binding; false if an identical one (destination, key, arguments) exists already
    /// (binding twice is a no-op in AMQP).
    pub fn add(&mut self, binding: Binding) -> bool {
        let existing = self
            .by_destination
            .entry(binding.destination.clone())
            .or_default();
        if existing
            .iter()
            .any(|b| b.routing_key == binding.routing_key && b.arguments == binding.arguments)
        {
            return false;
        }
        match &mut self.index {
            RouteIndex::Direct(by_key) => by_key
                .entry(binding.routing_key.clone())
                .or_default()
                .push(binding.destination.clone()),
            RouteIndex::Topic(trie) => {
                trie.insert(&binding.routing_key, binding.destination.clone())
            }
            RouteIndex::None => {}
        }
        existing.push(binding);
        self.len += 1;
        true
    }

    /// Removes one binding; false if it did not exist.
    pub fn remove(
        &mut self,
        destination: &Destination,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> bool {
        let Some(existing) = self.by_destination.get_mut(destination) else {
            return false;
        };
        let Some(position) = existing
            .iter()
            .position(|b| b.routing_key == routing_key && &b.arguments == arguments)
        else {
            return false;
        };
        existing.remove(position);
        if existing.is_empty() {
            self.by_destination.remove(destination);
        }
        self.index.remove(routing_key, destination);
        self.len -= 1;
        true
    }

    /// Removes every binding to `destination` (the queue or exchange is being deleted);
    /// returns how many there were.
    pub fn remove_destination(&mut self, destination: &Destination) -> usize {
        let Some(removed) = self.by_destination.remove(destination) else {
            return 0;
        };
        for binding in &removed {
            self.index.remove(&binding.routing_key, destination);
        }
        self.len -= removed.len();
        removed.len()
    }

    pub fn contains(
        &self,
        destination: &Destination,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> bool {
        self.by_destination
            .get(destination)
            .is_some_and(|bindings| {
                bindings
                    .iter()
                    .any(|b| b.routing_key == routing_key && &b.arguments == arguments)
            })
    }

    /// True if some binding points at `destination`.
    pub fn has_destination(&self, destination: &Destination) -> bool {
        self.by_destination.contains_key(destination)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Every binding, grouped by destination (destinations in order), each group in the
    /// order the bindings were added.
    pub fn bindings(&self) -> impl Iterator<Item = &Binding> {
        self.by_destination.values().flatten()
    }

    /// Destinations for one message: each matched destination once (dedup), for ALL the given
    /// routing keys (publish key + CC + BCC keys are passed together). `headers` = the
    /// message's headers table for the headers exchange.
    ///
    /// Matches are appended to `out`; a destination already in `out` is not added again, so
    /// one vector can collect the destinations of several exchanges (exchange-to-exchange
    /// bindings). Fanout and headers tables ignore the routing keys.
    pub fn route(
        &self,
        routing_keys: &[&str],
        headers: Option<&FieldTable>,
        out: &mut Vec<Destination>,
    ) {
        match (&self.index, self.kind) {
            (RouteIndex::Direct(by_key), _) => {
                let mut collector = Collector::new(out, false);
                for key in routing_keys {
                    if let Some(destinations) = by_key.get(*key) {
                        for destination in destinations {
                            collector.push(destination);
                        }
                    }
                }
            }
            (RouteIndex::Topic(trie), _) => {
                let mut collector = Collector::new(out, false);
                let mut scratch = TopicScratch::default();
                for key in routing_keys {
                    trie.match_key(key, &mut scratch, &mut |d| collector.push(d));
                }
            }
            (RouteIndex::None, ExchangeKind::Headers) => {
                let mut collector = Collector::new(out, true);
                for (destination, bindings) in &self.by_destination {
                    if bindings
                        .iter()
                        .any(|b| headers_match(&b.arguments, headers))
                    {
                        collector.push(destination);
                    }
                }
            }
            (RouteIndex::None, _) => {
                let mut collector = Collector::new(out, true);
                for destination in self.by_destination.keys() {
                    collector.push(destination);
                }
            }
        }
    }
}

impl RouteIndex {
    /// Drops one index entry of a binding already removed from `by_destination`.
    fn remove(&mut self, routing_key: &str, destination: &Destination) {
        match self {
            RouteIndex::Direct(by_key) => {
                if let Some(destinations) = by_key.get_mut(routing_key) {
                    if let Some(position) = destinations.iter().position(|d| d == destination) {
                        destinations.swap_remove(position);
                    }
                    if destinations.is_empty() {
                        by_key.remove(routing_key);
                    }
                }
            }
            RouteIndex::Topic(trie) => {
                trie.remove(routing_key, destination);
            }
            RouteIndex::None => {}
        }
    }
}

/// Above this many destinations, duplicate checks switch from a linear scan to a hash set.
const LINEAR_DEDUP_LIMIT: usize = 32;

/// Appends destinations to the caller's vector, skipping those already there.
struct Collector<'a> {
    out: &'a mut Vec<Destination>,
    /// `out[..prior]` was there before this routing call.
    prior: usize,
    /// The source yields each destination at most once, so only `out[..prior]` needs checking.
    source_unique: bool,
    /// Hash-set form of the region that needs checking, once it has grown large.
    seen: Option<HashSet<Destination>>,
}

impl<'a> Collector<'a> {
    fn new(out: &'a mut Vec<Destination>, source_unique: bool) -> Self {
        let prior = out.len();
        let seen = if prior > LINEAR_DEDUP_LIMIT {
            Some(out.iter().cloned().collect())
        } else {
            None
        };
        Collector {
            out,
            prior,
            source_unique,
            seen,
        }
    }

    fn push(&mut self, destination: &Destination) {
        let checked_len = if self.source_unique {
            self.prior
        } else {
            self.out.len()
        };
        let duplicate = match &self.seen {
            Some(seen) => seen.contains(destination),
            None => self.out[..checked_len].contains(destination),
        };
        if duplicate {
            return;
        }
        self.out.push(destination.clone());
        if self.source_unique {
            return;
        }
        match &mut self.seen {
            Some(seen) => {
                seen.insert(destination.clone());
            }
            None if self.out.len() > LINEAR_DEDUP_LIMIT => {
                self.seen = Some(self.out.iter().cloned().collect());
            }
            None => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Topic
// ---------------------------------------------------------------------------------------------

/// Splits a topic routing key or binding pattern into words, as RabbitMQ's `split_topic_key`:
/// the empty string has no words, otherwise every `.` separates two (possibly empty) words.
fn split_topic_words(key: &str) -> impl Iterator<Item = &str> {
    let mut words = key.split('.');
    if key.is_empty() {
        // `"".split('.')` yields one empty word; RabbitMQ's empty key has none.
        words.next();
    }
    words
}

/// True if the topic binding `pattern` matches `routing_key` (see the module docs).
///
/// Runs in O(pattern words × key words) whatever the pattern, without recursion.
pub fn topic_matches(pattern: &str, routing_key: &str) -> bool {
    let pattern: Vec<&str> = split_topic_words(pattern).collect();
    // active[i]: the words seen so far can be matched by pattern[..i].
    let mut active = vec![false; pattern.len() + 1];
    active[0] = true;
    close_over_hashes(&pattern, &mut active);
    let mut next = vec![false; pattern.len() + 1];
    for word in split_topic_words(routing_key) {
        next.iter_mut().for_each(|slot| *slot = false);
        let mut any = false;
        for (i, pattern_word) in pattern.iter().enumerate() {
            if !active[i] {
                continue;
            }
            match *pattern_word {
                "#" => {
                    next[i] = true;
                    any = true;
                }
                "*" => {
                    next[i + 1] = true;
                    any = true;
                }
                literal if literal == word => {
                    next[i + 1] = true;
                    any = true;
                }
                _ => {}
            }
        }
        if !any {
            return false;
        }
        close_over_hashes(&pattern, &mut next);
        std::mem::swap(&mut active, &mut next);
    }
    active[pattern.len()]
}

/// A `#` may match zero words: being before a `#` also means being after it.
fn close_over_hashes(pattern: &[&str], active: &mut [bool]) {
    for (i, word) in pattern.iter().enumerate() {
        if active[i] && *word == "#" {
            active[i + 1] = true;
        }
    }
}

const TRIE_ROOT: usize = 0;

/// RabbitMQ's topic trie: one edge per pattern word, bindings at the node their pattern ends
/// on. Nodes live in an arena (freed nodes are reused) so that no operation recurses.
#[derive(Clone, Debug)]
struct TopicTrie {
    nodes: Vec<TrieNode>,
    free: Vec<usize>,
    /// Number of live `#` edges; without any, each match state is reached once at most.
    hash_edges: usize,
}

#[derive(Clone, Debug, Default)]
struct TrieNode {
    parent: usize,
    /// The word on the edge from the parent.
    word: String,
    is_hash: bool,
    children: HashMap<String, usize>,
    /// One entry per binding whose pattern ends here.
    destinations: Vec<Destination>,
}

/// Reusable buffers for trie matching.
#[derive(Default)]
struct TopicScratch {
    stack: Vec<(usize, usize)>,
    visited: HashSet<(usize, usize)>,
}

impl TopicTrie {
    fn new() -> Self {
        TopicTrie {
            nodes: vec![TrieNode::default()],
            free: Vec::new(),
            hash_edges: 0,
        }
    }

    fn insert(&mut self, pattern: &str, destination: Destination) {
        let mut node = TRIE_ROOT;
        for word in split_topic_words(pattern) {
            node = match self.nodes[node].children.get(word) {
                Some(&child) => child,
                None => self.add_child(node, word),
            };
        }
        self.nodes[node].destinations.push(destination);
    }

    fn add_child(&mut self, parent: usize, word: &str) -> usize {
        let is_hash = word == "#";
        if is_hash {
            self.hash_edges += 1;
        }
        let node = TrieNode {
            parent,
            word: word.to_string(),
            is_hash,
            children: HashMap::new(),
            destinations: Vec::new(),
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.nodes[index] = node;
                index
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.nodes[parent].children.insert(word.to_string(), index);
        index
    }

    /// Removes one binding entry, then the nodes left without bindings or children.
    fn remove(&mut self, pattern: &str, destination: &Destination) -> bool {
        let mut node = TRIE_ROOT;
        for word in split_topic_words(pattern) {
            match self.nodes[node].children.get(word) {
                Some(&child) => node = child,
                None => return false,
            }
        }
        let destinations = &mut self.nodes[node].destinations;
        let Some(position) = destinations.iter().position(|d| d == destination) else {
            return false;
        };
        destinations.swap_remove(position);
        self.prune_upwards(node);
        true
    }

    fn prune_upwards(&mut self, mut node: usize) {
        while node != TRIE_ROOT
            && self.nodes[node].destinations.is_empty()
            && self.nodes[node].children.is_empty()
        {
            let parent = self.nodes[node].parent;
            let word = std::mem::take(&mut self.nodes[node].word);
            if self.nodes[node].is_hash {
                self.hash_edges -= 1;
            }
            self.nodes[parent].children.remove(&word);
            self.nodes[node] = TrieNode::default();
            self.free.push(node);
            node = parent;
        }
    }

    /// Calls `found` for the destination of every binding whose pattern matches
    /// `routing_key` (a destination bound several times is reported several times).
    fn match_key(
        &self,
        routing_key: &str,
        scratch: &mut TopicScratch,
        found: &mut impl FnMut(&Destination),
    ) {
        let words: Vec<&str> = split_topic_words(routing_key).collect();
        let track_visits = self.hash_edges > 0;
        scratch.stack.clear();
        scratch.visited.clear();
        // State (node, position): the pattern path to `node` matches words[..position].
        scratch.stack.push((TRIE_ROOT, 0));
        while let Some((node_index, position)) = scratch.stack.pop() {
            if track_visits && !scratch.visited.insert((node_index, position)) {
                continue;
            }
            let node = &self.nodes[node_index];
            // A `#` edge may be taken without consuming a word...
            if let Some(&hash_child) = node.children.get("#") {
                scratch.stack.push((hash_child, position));
            }
            let Some(word) = words.get(position) else {
                for destination in &node.destinations {
                    found(destination);
                }
                continue;
            };
            // ...and, once taken, may swallow any number of further words.
            if node.is_hash {
                scratch.stack.push((node_index, position + 1));
            }
            if let Some(&star_child) = node.children.get("*") {
                scratch.stack.push((star_child, position + 1));
            }
            // A literal `*` or `#` in the key reaches no node the wildcard steps above miss.
            if *word != "*"
                && *word != "#"
                && let Some(&child) = node.children.get(*word)
            {
                scratch.stack.push((child, position + 1));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Headers
// ---------------------------------------------------------------------------------------------

/// How a headers binding combines its arguments (`x-match`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadersMatchMode {
    All,
    Any,
    AllWithX,
    AnyWithX,
}

impl HeadersMatchMode {
    /// The mode a binding routes with. A missing or unrecognised `x-match` means `all`, as
    /// RabbitMQ's `parse_x_match` (bindings are validated on creation anyway).
    pub fn of_binding(binding_arguments: &FieldTable) -> Self {
        match binding_arguments
            .inner()
            .get("x-match")
            .and_then(string_bytes)
        {
            Some(b"any") => HeadersMatchMode::Any,
            Some(b"all-with-x") => HeadersMatchMode::AllWithX,
            Some(b"any-with-x") => HeadersMatchMode::AnyWithX,
            _ => HeadersMatchMode::All,
        }
    }

    fn is_any(self) -> bool {
        matches!(self, HeadersMatchMode::Any | HeadersMatchMode::AnyWithX)
    }

    fn includes_x_arguments(self) -> bool {
        matches!(
            self,
            HeadersMatchMode::AllWithX | HeadersMatchMode::AnyWithX
        )
    }
}

/// Checks a headers-exchange binding's `x-match` on `queue.bind`/`exchange.bind`; the error
/// text is RabbitMQ's (the broker answers 406 PRECONDITION_FAILED with it).
pub fn validate_headers_binding(args: &FieldTable) -> Result<(), String> {
    let Some(value) = args.inner().get("x-match") else {
        return Ok(());
    };
    match value {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            let bytes = string_bytes(value).unwrap_or_default();
            match bytes {
                b"all" | b"any" | b"all-with-x" | b"any-with-x" => Ok(()),
                other => Err(format!(
                    "Invalid x-match field value <<\"{}\">>; expected all, any, all-with-x, or any-with-x",
                    String::from_utf8_lossy(other)
                )),
            }
        }
        other => Err(format!(
            "Invalid x-match field type {} (value {}); expected longstr",
            rabbit_type_name(other),
            describe_value(other)
        )),
    }
}

/// True if a message with `headers` matches a headers-exchange binding with
/// `binding_arguments`, as RabbitMQ's `rabbit_exchange_type_headers:headers_match/2`:
///
/// - `x-match` is `all` (default), `any`, `all-with-x` or `any-with-x`; `x-match` itself never
///   takes part, other `x-` arguments only in the `-with-x` modes;
/// - a binding value of type void matches on the presence of the header only;
/// - other values compare as RabbitMQ compares the decoded Erlang terms: numbers by numeric
///   value whatever their width or type (1 as int32 equals 1 as int64, timestamp 5 equals 5,
///   even int 1 equals double 1.0), long strings and byte arrays by their bytes, booleans,
///   decimals, arrays and tables exactly (elements inside arrays and tables keep their type);
/// - `all` with no arguments left matches everything (even a message without headers);
///   `any` with none matches nothing.
pub fn headers_match(binding_arguments: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = HeadersMatchMode::of_binding(binding_arguments);
    let any = mode.is_any();
    for (key, expected) in binding_arguments {
        let key = key.as_str();
        if key == "x-match" || (key.starts_with("x-") && !mode.includes_x_arguments()) {
            continue;
        }
        let matched = match headers.and_then(|h| h.inner().get(key)) {
            None => false,
            Some(_) if matches!(expected, AMQPValue::Void) => true,
            Some(actual) => header_values_equal(expected, actual),
        };
        match (any, matched) {
            (true, true) => return true,
            (false, false) => return false,
            _ => {}
        }
    }
    !any
}

/// Equality of two top-level header values as Erlang's `==` on RabbitMQ's decoded terms.
fn header_values_equal(expected: &AMQPValue, actual: &AMQPValue) -> bool {
    if let (Some(a), Some(b)) = (number_of(expected), number_of(actual)) {
        return a.equals(b);
    }
    if let (Some(a), Some(b)) = (string_bytes(expected), string_bytes(actual)) {
        return a == b;
    }
    match (expected, actual) {
        (AMQPValue::Boolean(a), AMQPValue::Boolean(b)) => a == b,
        (AMQPValue::DecimalValue(a), AMQPValue::DecimalValue(b)) => a == b,
        (AMQPValue::FieldArray(a), AMQPValue::FieldArray(b)) => a == b,
        (AMQPValue::FieldTable(a), AMQPValue::FieldTable(b)) => a == b,
        (AMQPValue::Void, AMQPValue::Void) => true,
        _ => false,
    }
}

#[derive(Clone, Copy, Debug)]
enum Number {
    Integer(i128),
    Float(f64),
}

impl Number {
    fn equals(self, other: Number) -> bool {
        match (self, other) {
            (Number::Integer(a), Number::Integer(b)) => a == b,
            (Number::Float(a), Number::Float(b)) => a == b,
            (Number::Integer(i), Number::Float(f)) | (Number::Float(f), Number::Integer(i)) => {
                // Every integer an AMQP value can hold fits in an i128; compare exactly.
                f.is_finite() && f.fract() == 0.0 && f.abs() < 1e38 && (f as i128) == i
            }
        }
    }
}

/// RabbitMQ decodes every integer type and timestamps to Erlang integers, `f` and `d` to floats.
fn number_of(value: &AMQPValue) -> Option<Number> {
    let integer = |v: i128| Some(Number::Integer(v));
    match value {
        AMQPValue::ShortShortInt(v) => integer((*v).into()),
        AMQPValue::ShortShortUInt(v) => integer((*v).into()),
        AMQPValue::ShortInt(v) => integer((*v).into()),
        AMQPValue::ShortUInt(v) => integer((*v).into()),
        AMQPValue::LongInt(v) => integer((*v).into()),
        AMQPValue::LongUInt(v) => integer((*v).into()),
        AMQPValue::LongLongInt(v) => integer((*v).into()),
        AMQPValue::Timestamp(v) => integer((*v).into()),
        AMQPValue::Float(v) => Some(Number::Float((*v).into())),
        AMQPValue::Double(v) => Some(Number::Float(*v)),
        _ => None,
    }
}

/// Strings and byte arrays are all Erlang binaries to RabbitMQ.
fn string_bytes(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        AMQPValue::ByteArray(b) => Some(b.as_slice()),
        _ => None,
    }
}

/// RabbitMQ's name of a field type, for error texts.
fn rabbit_type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) | AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

fn describe_value(value: &AMQPValue) -> String {
    match value {
        AMQPValue::Boolean(v) => v.to_string(),
        AMQPValue::ShortShortInt(v) => v.to_string(),
        AMQPValue::ShortShortUInt(v) => v.to_string(),
        AMQPValue::ShortInt(v) => v.to_string(),
        AMQPValue::ShortUInt(v) => v.to_string(),
        AMQPValue::LongInt(v) => v.to_string(),
        AMQPValue::LongUInt(v) => v.to_string(),
        AMQPValue::LongLongInt(v) => v.to_string(),
        AMQPValue::Timestamp(v) => v.to_string(),
        AMQPValue::Float(v) => v.to_string(),
        AMQPValue::Double(v) => v.to_string(),
        AMQPValue::DecimalValue(d) => format!("{{{},{}}}", d.scale, d.value),
        AMQPValue::ByteArray(b) => format!("<<\"{}\">>", String::from_utf8_lossy(b.as_slice())),
        AMQPValue::Void => "undefined".to_string(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests;
