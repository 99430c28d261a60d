//! The durable definitions (exchanges, queues, bindings) as one snapshot file.
//!
//! Definitions change rarely and are few, so instead of a log of declare/delete records the
//! broker hands the storage thread the whole durable set after each change; it is written to
//! `definitions.tmp`, fsync'd and renamed over `definitions` (atomic on POSIX file systems),
//! so the file always holds one complete snapshot. Queues carry their id, which messages in
//! the log refer to: a queue deleted and declared again under the same name gets a new id, so
//! messages of the old one never come back into the new one. Runtime policies (set through
//! the admin API) are part of the snapshot too, each as its JSON text.

use std::io::Write;
use std::path::Path;

use amq_protocol::types::FieldTable;

use super::codec::{Reader, Short, Writer};
use super::record::{Frame, KIND_DEFINITIONS, decode_frame, frame};
use crate::config::PolicyConfig;

#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeDef {
    pub vhost: String,
    pub name: String,
    /// "direct", "fanout", "topic" or "headers".
    pub kind: String,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct QueueDef {
    pub vhost: String,
    pub name: String,
    pub id: u64,
    pub auto_delete: bool,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BindingDef {
    pub vhost: String,
    pub source: String,
    /// True when the destination is a queue, false for an exchange.
    pub to_queue: bool,
    pub destination: String,
    pub routing_key: String,
    pub arguments: FieldTable,
}

/// Every durable exchange, queue and binding, and the runtime policies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Definitions {
    pub exchanges: Vec<ExchangeDef>,
    pub queues: Vec<QueueDef>,
    pub bindings: Vec<BindingDef>,
    /// Policies set at run time (admin API, `dlx-proxy policy set`); TOML policies are not
    /// stored (the config file has them). A snapshot of the first format has none.
    pub policies: Vec<PolicyConfig>,
}

/// File name of the snapshot inside the storage directory.
pub const FILE: &str = "definitions";

fn put_table(w: &mut Writer<'_>, table: &FieldTable) {
    let bytes = amq_protocol::types::generation::gen_field_table(table)(Vec::new().into())
        .map(|ctx| ctx.into_inner().0)
        .unwrap_or_else(|_| 0u32.to_be_bytes().to_vec());
    w.bytes(&bytes);
}

fn get_table(r: &mut Reader<'_>) -> Result<FieldTable, Short> {
    let bytes = r.bytes()?;
    match amq_protocol::types::parsing::parse_field_table(bytes) {
        Ok((&[], table)) => Ok(table),
        _ => Err(Short),
    }
}

impl Definitions {
    /// The framed snapshot (same framing and CRC as log records).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        frame(&mut out, |payload| {
            let mut w = Writer(payload);
            w.u8(KIND_DEFINITIONS);
            w.u32(self.exchanges.len() as u32);
            for x in &self.exchanges {
                w.str(&x.vhost);
                w.str(&x.name);
                w.str(&x.kind);
                w.u8(x.auto_delete as u8);
                w.u8(x.internal as u8);
                put_table(&mut w, &x.arguments);
            }
            w.u32(self.queues.len() as u32);
            for q in &self.queues {
                w.str(&q.vhost);
                w.str(&q.name);
                w.u64(q.id);
                w.u8(q.auto_delete as u8);
                put_table(&mut w, &q.arguments);
            }
            w.u32(self.bindings.len() as u32);
            for b in &self.bindings {
                w.str(&b.vhost);
                w.str(&b.source);
                w.u8(b.to_queue as u8);
                w.str(&b.destination);
                w.str(&b.routing_key);
                put_table(&mut w, &b.arguments);
            }
            w.u32(self.policies.len() as u32);
            for p in &self.policies {
                w.str(&serde_json::to_string(p).unwrap_or_default());
            }
        });
        out
    }

    /// Reads a snapshot file's bytes; `None` when they are not one whole, valid snapshot.
    pub fn decode(bytes: &[u8]) -> Option<Definitions> {
        let Frame::Whole(payload, used) = decode_frame(bytes) else {
            return None;
        };
        if used != bytes.len() {
            return None;
        }
        Self::decode_payload(payload).ok()
    }

    fn decode_payload(payload: &[u8]) -> Result<Definitions, Short> {
        let mut r = Reader::new(payload);
        if r.u8()? != KIND_DEFINITIONS {
            return Err(Short);
        }
        let mut defs = Definitions::default();
        for _ in 0..r.count(14)? {
            defs.exchanges.push(ExchangeDef {
                vhost: r.str()?.to_string(),
                name: r.str()?.to_string(),
                kind: r.str()?.to_string(),
                auto_delete: r.bool()?,
                internal: r.bool()?,
                arguments: get_table(&mut r)?,
            });
        }
        for _ in 0..r.count(21)? {
            defs.queues.push(QueueDef {
                vhost: r.str()?.to_string(),
                name: r.str()?.to_string(),
                id: r.u64()?,
                auto_delete: r.bool()?,
                arguments: get_table(&mut r)?,
            });
        }
        for _ in 0..r.count(21)? {
            defs.bindings.push(BindingDef {
                vhost: r.str()?.to_string(),
                source: r.str()?.to_string(),
                to_queue: r.bool()?,
                destination: r.str()?.to_string(),
                routing_key: r.str()?.to_string(),
                arguments: get_table(&mut r)?,
            });
        }
        // Snapshots of the first format end here.
        if !r.is_empty() {
            for _ in 0..r.count(4)? {
                let policy = serde_json::from_str(r.str()?).map_err(|_| Short)?;
                defs.policies.push(policy);
            }
        }
        if !r.is_empty() {
            return Err(Short);
        }
        Ok(defs)
    }

    /// Replaces the snapshot in `dir` atomically (temporary file, fsync, rename, fsync of the
    /// directory).
    pub fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join("definitions.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&self.encode())?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(FILE))?;
        std::fs::File::open(dir)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::{AMQPValue, ShortString};

    use super::*;

    fn sample() -> Definitions {
        let mut args = FieldTable::default();
        args.insert(
            ShortString::from("x-dead-letter-exchange"),
            AMQPValue::LongString("dlx".into()),
        );
        args.insert(ShortString::from("x-max-length"), AMQPValue::LongLongInt(5));
        Definitions {
            exchanges: vec![ExchangeDef {
                vhost: "/".into(),
                name: "dlx".into(),
                kind: "topic".into(),
                auto_delete: false,
                internal: true,
                arguments: FieldTable::default(),
            }],
            queues: vec![QueueDef {
                vhost: "/".into(),
                name: "q".into(),
                id: 42,
                auto_delete: false,
                arguments: args.clone(),
            }],
            bindings: vec![BindingDef {
                vhost: "/".into(),
                source: "dlx".into(),
                to_queue: true,
                destination: "q".into(),
                routing_key: "#".into(),
                arguments: args,
            }],
            policies: vec![PolicyConfig {
                name: "ttl".into(),
                vhost: "/".into(),
                pattern: "^q$".into(),
                apply_to: "queues".into(),
                priority: 3,
                definition: [("message-ttl".to_string(), serde_json::json!(5000))].into(),
            }],
        }
    }

    #[test]
    fn snapshot_round_trips_and_refuses_damage() {
        let bytes = sample().encode();
        assert_eq!(Definitions::decode(&bytes), Some(sample()));
        assert_eq!(Definitions::decode(&bytes[..bytes.len() - 1]), None);
        let mut flipped = bytes.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 1;
        assert_eq!(Definitions::decode(&flipped), None);
    }

    #[test]
    fn a_snapshot_of_the_first_format_has_no_policies() {
        let old = Definitions {
            policies: Vec::new(),
            ..sample()
        };
        let mut bytes = old.encode();
        // The first format ended after the bindings: drop the policy count and re-frame.
        let payload = bytes.split_off(super::super::record::FRAME_HEADER);
        let mut first = Vec::new();
        frame(&mut first, |out| {
            out.extend_from_slice(&payload[..payload.len() - 4])
        });
        assert_eq!(Definitions::decode(&first), Some(old));
    }

    #[test]
    fn written_atomically_to_a_directory() {
        let dir = std::env::temp_dir().join(format!("dlx-defs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        sample().write_to(&dir).unwrap();
        let back = std::fs::read(dir.join(FILE)).unwrap();
        assert_eq!(Definitions::decode(&back), Some(sample()));
        assert!(!dir.join("definitions.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
