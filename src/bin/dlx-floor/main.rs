//! `dlx-floor`: the cheapest possible TCP forwarder, to measure what any user-space proxy
//! costs on a machine before it does anything useful. It accepts on `--listen`, opens one
//! upstream connection per client and copies bytes both ways without looking at them.
//!
//! scripts/bench-proxy.sh `--floor` runs it next to dlx-proxy, side by side with the client
//! connected to RabbitMQ directly, so the proxy's CPU and added latency can be read against
//! this floor (BENCHMARKS.md, "Proxy mode"). Three ways to move the bytes:
//! - `epoll`: tokio with one worker thread and `copy_bidirectional` (readiness + read/write,
//!   what dlx-proxy's connection loop does, minus the AMQP);
//! - `uring`: one thread driving an io_uring ring (completion-based recv/send, no readiness
//!   wake-ups, batched submissions);
//! - `threads`: blocking reads and writes, two threads per connection.
//!
//! Build: `cargo build --release --features bench --bin dlx-floor`.

#[cfg(target_os = "linux")]
mod uring;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};

/// Bytes each direction of a connection reads at a time (dlx-proxy's largest read, too).
const CHUNK: usize = 64 * 1024;

#[derive(Debug, Parser)]
#[command(
    name = "dlx-floor",
    about = "A TCP forwarder that does nothing but copy bytes: the floor under a proxy's cost"
)]
struct Cli {
    /// Address to accept clients on.
    #[arg(long, default_value = "127.0.0.1:5692")]
    listen: String,
    /// Address of the upstream (host:port).
    #[arg(long, default_value = "127.0.0.1:5672")]
    upstream: String,
    /// How the bytes are moved.
    #[arg(long, value_enum, default_value_t = Mode::Epoll)]
    mode: Mode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// tokio, one worker thread, copy_bidirectional.
    Epoll,
    /// One thread and an io_uring ring (Linux only).
    Uring,
    /// Two blocking threads per connection.
    Threads,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let listener = match TcpListener::bind(&cli.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("dlx-floor: cannot listen on {}: {e}", cli.listen);
            return ExitCode::from(2);
        }
    };
    match serve(cli.mode, listener, &cli.upstream) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dlx-floor: {e}");
            ExitCode::from(2)
        }
    }
}

/// Forwards every connection `listener` accepts to `upstream`, moving bytes the `mode` way.
/// Returns only when accepting fails.
fn serve(mode: Mode, listener: TcpListener, upstream: &str) -> std::io::Result<()> {
    match mode {
        Mode::Epoll => run_epoll(listener, upstream),
        Mode::Threads => run_threads(listener, upstream),
        #[cfg(target_os = "linux")]
        Mode::Uring => uring::run(listener, upstream),
        #[cfg(not(target_os = "linux"))]
        Mode::Uring => Err(std::io::Error::other("io_uring needs Linux")),
    }
}

/// Connects to the upstream for one accepted client; both sockets without Nagle's delay, as
/// dlx-proxy sets them.
fn connect_pair(client: &TcpStream, upstream: &str) -> std::io::Result<TcpStream> {
    client.set_nodelay(true)?;
    let up = TcpStream::connect(upstream)?;
    up.set_nodelay(true)?;
    Ok(up)
}

fn run_epoll(listener: TcpListener, upstream: &str) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let upstream = upstream.to_string();
    runtime.block_on(async move {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        loop {
            let (mut client, _) = listener.accept().await?;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if client.set_nodelay(true).is_err() {
                    return;
                }
                let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                if up.set_nodelay(true).is_err() {
                    return;
                }
                let _ =
                    tokio::io::copy_bidirectional_with_sizes(&mut client, &mut up, CHUNK, CHUNK)
                        .await;
            });
        }
    })
}

fn run_threads(listener: TcpListener, upstream: &str) -> std::io::Result<()> {
    for client in listener.incoming() {
        let client = client?;
        let Ok(up) = connect_pair(&client, upstream) else {
            continue;
        };
        let (client_reader, up_reader) = (client.try_clone()?, up.try_clone()?);
        std::thread::spawn(move || copy_until_eof(client_reader, up));
        std::thread::spawn(move || copy_until_eof(up_reader, client));
    }
    Ok(())
}

/// Copies `from` into `to` until `from` ends or either side fails, then half-closes `to`.
fn copy_until_eof(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that echoes each connection until the client half-closes it.
    fn echo_server() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind echo");
        let addr = listener.local_addr().expect("echo addr").to_string();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let reader = conn.try_clone().expect("clone");
                std::thread::spawn(move || copy_until_eof(reader, conn));
            }
        });
        addr
    }

    /// Starts a forwarder in `mode` in front of an echo server, sends more than a few
    /// buffers' worth through it and checks every byte comes back in order and that the
    /// half-close travels both ways (the client reads end of stream after its own).
    fn forwards_both_ways_and_half_closes(mode: Mode) {
        let upstream = echo_server();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind forwarder");
        let addr = listener.local_addr().expect("forwarder addr");
        std::thread::spawn(move || serve(mode, listener, &upstream));
        for round in 0..2u8 {
            let client = TcpStream::connect(addr).expect("connect");
            // A lost byte or a lost half-close fails the test instead of hanging it.
            client
                .set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .expect("timeout");
            let sent: Vec<u8> = (0..5 * CHUNK + 123)
                .map(|i| (i % 251) as u8 ^ round)
                .collect();
            let mut writer = client.try_clone().expect("clone");
            let to_send = sent.clone();
            let write = std::thread::spawn(move || {
                writer.write_all(&to_send).expect("write");
                writer.shutdown(Shutdown::Write).expect("half-close");
            });
            let mut received = Vec::new();
            let mut reader = client;
            reader.read_to_end(&mut received).expect("read to end");
            write.join().expect("writer");
            assert_eq!(received.len(), sent.len(), "{mode:?} round {round}");
            assert!(received == sent, "{mode:?} round {round}: bytes differ");
        }
    }

    #[test]
    fn epoll_forwards_both_ways_and_half_closes() {
        forwards_both_ways_and_half_closes(Mode::Epoll);
    }

    #[test]
    fn threads_forward_both_ways_and_half_close() {
        forwards_both_ways_and_half_closes(Mode::Threads);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn uring_forwards_both_ways_and_half_closes() {
        forwards_both_ways_and_half_closes(Mode::Uring);
    }
}
