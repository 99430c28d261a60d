//! TEMPORARY stub until the routing module lands.
use amq_protocol::types::FieldTable;
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}
impl std::str::FromStr for ExchangeKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "direct" => Ok(Self::Direct),
            "fanout" => Ok(Self::Fanout),
            "topic" => Ok(Self::Topic),
            "headers" => Ok(Self::Headers),
            _ => Err(s.into()),
        }
    }
}
impl ExchangeKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
        }
    }
}
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    Queue(String),
    Exchange(String),
}
#[derive(Clone, Debug, PartialEq)]
pub struct Binding {
    pub destination: Destination,
    pub routing_key: String,
    pub arguments: FieldTable,
}
pub struct BindingTable {
    kind: ExchangeKind,
    b: Vec<Binding>,
}
impl BindingTable {
    pub fn new(kind: ExchangeKind) -> Self {
        Self { kind, b: vec![] }
    }
    pub fn add(&mut self, binding: Binding) -> bool {
        if self.b.contains(&binding) {
            false
        } else {
            self.b.push(binding);
            true
        }
    }
    pub fn remove(&mut self, d: &Destination, k: &str, a: &FieldTable) -> bool {
        let n = self.b.len();
        self.b
            .retain(|x| !(&x.destination == d && x.routing_key == k && &x.arguments == a));
        n != self.b.len()
    }
    pub fn remove_destination(&mut self, d: &Destination) -> usize {
        let n = self.b.len();
        self.b.retain(|x| &x.destination != d);
        n - self.b.len()
    }
    pub fn contains(&self, d: &Destination, k: &str, a: &FieldTable) -> bool {
        self.b
            .iter()
            .any(|x| &x.destination == d && x.routing_key == k && &x.arguments == a)
    }
    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }
    pub fn len(&self) -> usize {
        self.b.len()
    }
    pub fn bindings(&self) -> impl Iterator<Item = &Binding> {
        self.b.iter()
    }
    pub fn route(&self, keys: &[&str], _headers: Option<&FieldTable>, out: &mut Vec<Destination>) {
        for x in &self.b {
            let m = match self.kind {
                ExchangeKind::Fanout => true,
                _ => keys.contains(&x.routing_key.as_str()),
            };
            if m && !out.contains(&x.destination) {
                out.push(x.destination.clone());
            }
        }
    }
}
pub fn validate_headers_binding(_args: &FieldTable) -> Result<(), String> {
    Ok(())
}
