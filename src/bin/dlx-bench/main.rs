//! `dlx-bench`: the benchmark driver. It speaks AMQP 0-9-1 to any broker (the embedded
//! dlx-proxy broker or RabbitMQ) through lapin or through its own lighter raw client
//! (`--client raw`), runs one scenario and reports rates, latencies and the broker's memory and
//! CPU (with `--pid`, read from /proc). Every scenario that moves messages
//! checks that each published message arrived exactly once and exits 1 otherwise.
//!
//! Build: `cargo build --release --features bench --bin dlx-bench`.
//! scripts/bench.sh runs every scenario against both brokers and prints the comparison.

mod client;
mod payload;
mod procfs;
mod raw;
mod report;
mod scenarios;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "dlx-bench",
    about = "Benchmark driver for dlx-proxy's embedded broker and RabbitMQ"
)]
pub struct Cli {
    #[command(flatten)]
    pub common: Common,
    #[command(subcommand)]
    pub scenario: Scenario,
}

/// Options every scenario understands (they may come before or after the scenario name).
#[derive(Clone, Debug, clap::Args)]
pub struct Common {
    /// Broker URL.
    #[arg(
        long,
        global = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub url: String,
    /// Producer connections (one channel each).
    #[arg(long, short = 'P', global = true, default_value_t = 1)]
    pub producers: u32,
    /// Consumer connections (one channel each).
    #[arg(long, short = 'C', global = true, default_value_t = 1)]
    pub consumers: u32,
    /// Body size in bytes (at least 20: the stamp).
    #[arg(long, global = true, default_value_t = 100)]
    pub size: usize,
    /// Publisher confirms.
    #[arg(long, global = true, value_enum, default_value_t = OnOff::On)]
    pub confirms: OnOff,
    /// Messages to publish in total (default depends on the scenario).
    #[arg(long, short = 'n', global = true, conflicts_with = "seconds")]
    pub messages: Option<u64>,
    /// Publish for this many seconds instead of a fixed count.
    #[arg(long, global = true)]
    pub seconds: Option<f64>,
    /// Kind of the queue the scenario declares: transient (non-durable classic), classic
    /// (durable classic) or quorum (durable quorum queue). throughput, fill, drain and deadletter
    /// (its source queue).
    #[arg(long, global = true, value_enum, default_value_t = QueueType::Transient)]
    pub queue_type: QueueType,
    /// Publish persistent messages (delivery_mode 2): stored on disk in a durable queue (the
    /// memory scenario then declares its queue durable).
    #[arg(long, global = true)]
    pub persistent: bool,
    /// basic.qos prefetch of each consumer.
    #[arg(long, global = true, default_value_t = 500)]
    pub prefetch: u16,
    /// Unconfirmed messages per producer before it waits for the oldest confirm.
    #[arg(long, global = true, default_value_t = 1000)]
    pub confirm_window: usize,
    /// basic.publish calls each producer keeps in flight inside the client (lapin only; the
    /// raw client writes up to 64 KiB of publishes at a time).
    #[arg(long, global = true, default_value_t = 64)]
    pub pipeline: usize,
    /// Acknowledge every N deliveries with multiple=true (1 = one ack per message).
    #[arg(long, global = true, default_value_t = 1)]
    pub ack_every: u64,
    /// AMQP client of producers and consumers: lapin, or raw (frames written and parsed by
    /// this program, much less CPU per message). Default: lapin, except for ping (raw).
    /// Topology setup always uses lapin.
    #[arg(long, global = true, value_enum)]
    pub client: Option<ClientKind>,
    /// PID of the broker process: report its RSS (VmRSS) and CPU time.
    #[arg(long, global = true)]
    pub pid: Option<u32>,
    /// Name of the broker in the report (e.g. embedded, rabbitmq).
    #[arg(long, global = true, default_value = "broker")]
    pub label: String,
    /// Also print the result as one JSON object on the last line.
    #[arg(long, global = true)]
    pub json: bool,
    /// Seconds without progress after which the run stops waiting (and counts losses).
    #[arg(long, global = true, default_value_t = 20.0)]
    pub idle_timeout: f64,
    /// Runtime worker threads of this benchmark. lapin blocks a worker now and then (for
    /// example while connections open), so keep a few more than there are cores.
    #[arg(long, global = true, default_value_t = 8)]
    pub worker_threads: usize,
}

impl Common {
    pub fn idle(&self) -> Duration {
        Duration::from_secs_f64(self.idle_timeout.max(0.1))
    }

    pub fn confirms_on(&self) -> bool {
        self.confirms == OnOff::On
    }

    /// The client given with --client, else `default`.
    pub fn client_or(&self, default: ClientKind) -> ClientKind {
        self.client.unwrap_or(default)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClientKind {
    /// The lapin crate.
    Lapin,
    /// This program's own frame-level client (src/bin/dlx-bench/raw).
    Raw,
}

impl ClientKind {
    pub fn name(self) -> &'static str {
        match self {
            ClientKind::Lapin => "lapin",
            ClientKind::Raw => "raw",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QueueType {
    /// A non-durable classic queue (memory only).
    Transient,
    /// A durable classic queue.
    Classic,
    /// A durable quorum queue (RabbitMQ; the embedded broker treats it as durable classic).
    Quorum,
}

impl QueueType {
    pub fn name(self) -> &'static str {
        match self {
            QueueType::Transient => "transient",
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeadLetterKind {
    /// Consumers reject with requeue=false.
    Reject,
    /// Consumers nack with requeue=false.
    Nack,
    /// Queue TTL (x-message-ttl) expires messages with no consumer.
    Expiry,
    /// x-max-length with drop-head pushes the oldest messages out.
    Overflow,
    /// A quorum queue with x-delivery-limit: consumers nack with requeue=true until the limit
    /// dead-letters the message.
    DeliveryLimit,
}

#[derive(Debug, Subcommand)]
pub enum Scenario {
    /// Publish and consume over TCP: msg/s, publish-to-consume latency, no loss.
    Throughput,
    /// One message in flight: publish, wait for its delivery (and its confirm with --confirms
    /// on), ack, repeat. Round-trip latency percentiles without pipelining; --messages round
    /// trips (default 10,000) after a warm-up.
    Ping {
        /// Round trips before the measured ones.
        #[arg(long, default_value_t = 500)]
        warmup: u64,
    },
    /// Dead-letter rate into a DLQ and the latency from each death's cause (the reject or
    /// nack, the expiry deadline, the overflowing publish) to its arrival in the DLQ; each
    /// message exactly once.
    Deadletter {
        #[arg(long, value_enum)]
        kind: DeadLetterKind,
        /// Queue TTL for --kind expiry, in milliseconds.
        #[arg(long, default_value_t = 1)]
        ttl_ms: u32,
        /// x-max-length for --kind overflow.
        #[arg(long, default_value_t = 100)]
        max_length: u32,
        /// x-delivery-limit for --kind delivery-limit (each message is delivered this many
        /// times plus one).
        #[arg(long, default_value_t = 1)]
        delivery_limit: u32,
        /// The source queue dead-letters at least once, RabbitMQ's own way (quorum queues:
        /// x-dead-letter-strategy at-least-once with x-overflow reject-publish); needs
        /// --queue-type quorum, not with --kind overflow (reject-publish drops nothing). The
        /// source queue is of --queue-type for every kind (delivery-limit: always quorum).
        #[arg(long)]
        at_least_once: bool,
    },
    /// Queue many messages with a queue TTL and no consumer; time until they all expired and
    /// the broker's RSS before, at the peak and after.
    ExpireBulk {
        /// Queue TTL in milliseconds (should exceed the time it takes to fill the queue).
        #[arg(long, default_value_t = 60_000)]
        ttl_ms: u32,
        /// Dead-letter the expired messages into a DLQ instead of dropping them.
        #[arg(long)]
        into_dlq: bool,
        /// Seconds to wait for the queue to drain after the last message is due.
        #[arg(long, default_value_t = 300.0)]
        drain_timeout: f64,
    },
    /// Hold N idle connections with one channel each; report the broker's RSS.
    IdleConnections {
        #[arg(long, default_value_t = 1000)]
        count: u32,
        /// Seconds to hold them before measuring.
        #[arg(long, default_value_t = 5.0)]
        hold_seconds: f64,
        /// frame_max the client asks for (added to the URL unless it names one). lapin keeps
        /// 64 frames of buffers per connection: 8 MiB of this process's memory per connection
        /// at 128 KiB frames.
        #[arg(long, default_value_t = 16_384)]
        client_frame_max: u32,
    },
    /// Fill a dead-letter queue (--messages, default 100,000) and move it twice: with a
    /// shovel-like consume/publish-with-confirms/ack loop, then with the embedded broker's
    /// redrive (admin API); msg/s of both and the speedup.
    Redrive {
        /// The broker's admin address (listen.admin).
        #[arg(long, default_value = "127.0.0.1:15692")]
        admin: String,
        /// The admin token (admin.token).
        #[arg(long)]
        token: Option<String>,
    },
    /// Fill the queue --queue with --messages (default 1,000,000) messages with confirms and
    /// leave it there (use with --queue-type classic --persistent to measure recovery: restart
    /// the broker, then `drain`).
    Fill {
        /// Queue name (declared, not deleted first: fill adds to it).
        #[arg(long, default_value = "dlxbench.fill")]
        queue: String,
    },
    /// Consume everything in --queue and check that each of the --messages messages `fill`
    /// published (with the same --producers) is there exactly once, then delete the queue.
    Drain {
        #[arg(long, default_value = "dlxbench.fill")]
        queue: String,
    },
    /// Queue K messages (--messages, default 1,000,000) and report the broker's RSS per
    /// queued message.
    Memory {
        /// Seconds to let the broker settle before each RSS reading.
        #[arg(long, default_value_t = 3.0)]
        settle_seconds: f64,
        /// Leave the queue and its messages in place (to restart the broker with the backlog).
        #[arg(long)]
        keep: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    client::now_nanos();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.common.worker_threads.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlx-bench: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let outcome = runtime.block_on(scenarios::run(&cli));
    match outcome {
        Ok(report) => {
            print!("{}", report.text());
            if cli.common.json {
                println!("{}", report.json());
            }
            if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("dlx-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}
