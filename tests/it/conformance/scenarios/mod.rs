//! The scenarios, grouped by theme, each a port of the Python harness's scenario of the same
//! name (`../shared/conformance/dlx_conformance.py`): the same steps, the same observation
//! keys, the same waits. [`all`] lists them; the runner in `conformance/mod.rs` runs them.
//!
//! Every scenario builds its topology from [`standard`] or by hand with [`Ctx`]'s helpers,
//! names everything with the scenario's random suffix, and records what a client sees.

use amq_protocol::types::{AMQPValue, FieldTable};
use futures_util::future::BoxFuture;
use lapin::ExchangeKind;

use super::ctx::{Ch, Ctx, Failure, Outcome};

pub use super::ctx::Msg;
pub use crate::common::dl::{int, ls, ls_array, table};

mod chains;
mod content;
mod declare;
mod length;
mod lifecycle;
mod policy;
mod quorum;
mod routing;
mod settlement;
mod ttl;

/// One scenario: its name (the key in `expected.json`), what it checks, and its steps.
pub struct Scenario {
    pub name: &'static str,
    pub desc: &'static str,
    pub run: for<'a> fn(&'a mut Ctx) -> BoxFuture<'a, Outcome>,
}

/// Every scenario, in the harness's order of themes.
pub fn all() -> Vec<Scenario> {
    [
        settlement::all(),
        ttl::all(),
        length::all(),
        routing::all(),
        chains::all(),
        lifecycle::all(),
        content::all(),
        declare::all(),
        quorum::all(),
        policy::all(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Registers a module's scenario functions under their own names.
macro_rules! scenarios {
    ($($name:ident: $desc:literal),* $(,)?) => {
        pub fn all() -> Vec<super::Scenario> {
            vec![$({
                fn run(
                    t: &mut super::Ctx,
                ) -> futures_util::future::BoxFuture<'_, super::Outcome> {
                    Box::pin($name(t))
                }
                super::Scenario { name: stringify!($name), desc: $desc, run }
            }),*]
        }
    };
}
pub(crate) use scenarios;

/// A signed 64-bit integer value (field type `l`), what pika sends for `long`.
pub fn long(n: i64) -> AMQPValue {
    AMQPValue::LongLongInt(n)
}

/// No arguments.
pub fn none() -> FieldTable {
    FieldTable::default()
}

/// The names [`standard`] declared.
pub struct Std {
    pub x: String,
    pub dlx: String,
    pub dlq: String,
    pub src: String,
}

/// The harness's `std`: direct exchange `x` → queue `src` (key `rk`) dead-lettering to
/// direct exchange `dlx` → queue `dlq` (key `rk`); `src_args` are added to src's arguments.
pub async fn standard(t: &mut Ctx, ch: &Ch, src_args: FieldTable) -> Result<Std, Failure> {
    standard_with(t, ch, src_args, &["rk"], "rk", false).await
}

/// [`standard`] with the dlq's binding keys, src's binding key, and src as a quorum queue.
pub async fn standard_with(
    t: &mut Ctx,
    ch: &Ch,
    src_args: FieldTable,
    dlq_keys: &[&str],
    src_key: &str,
    quorum: bool,
) -> Result<Std, Failure> {
    let x = t.exchange(ch, "x", ExchangeKind::Direct).await?;
    let dlx = t.exchange(ch, "dlx", ExchangeKind::Direct).await?;
    let dlq = t.queue(ch, "dlq", none()).await?;
    for k in dlq_keys {
        t.bind(ch, &dlq, &dlx, k).await?;
    }
    let mut args = table(&[("x-dead-letter-exchange", ls(&dlx))]);
    for (k, v) in src_args.inner() {
        args.insert(k.clone(), v.clone());
    }
    let src = if quorum {
        t.qq(ch, "src", args).await?
    } else {
        t.queue(ch, "src", args).await?
    };
    t.bind(ch, &src, &x, src_key).await?;
    Ok(Std { x, dlx, dlq, src })
}

/// Queue `src` dead-lettering to `dlx`, bound to exchange `x` with `key`.
pub async fn source(
    t: &mut Ctx,
    ch: &Ch,
    x: &str,
    dlx: &str,
    key: &str,
) -> Result<String, Failure> {
    let args = table(&[("x-dead-letter-exchange", ls(dlx))]);
    let src = t.queue(ch, "src", args).await?;
    t.bind(ch, &src, x, key).await?;
    Ok(src)
}

/// `basic.get` one message from `queue` (polling) and reject it without requeue.
pub async fn get_and_reject(t: &mut Ctx, ch: &Ch, queue: &str) -> Outcome {
    if let Some(d) = t.get1(ch, queue).await? {
        reject(ch, d.delivery_tag).await?;
    }
    Ok(())
}

/// `basic.reject(requeue = false)`.
pub async fn reject(ch: &Ch, tag: u64) -> Outcome {
    ch.basic_reject(tag, lapin::options::BasicRejectOptions { requeue: false })
        .await?;
    Ok(())
}

/// A policy pattern matching exactly `name` (policy patterns are regexes; names only hold
/// `.` as a special character).
pub fn exactly(name: &str) -> String {
    format!("^{}$", re_escape(name))
}

pub fn re_escape(name: &str) -> String {
    name.replace('.', "\\.")
}
