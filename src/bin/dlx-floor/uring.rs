//! The `uring` mode of dlx-floor: one thread, one io_uring ring. Each direction of each
//! connection has one buffer and one operation in flight: a recv into the buffer, then sends
//! until it is all written, then the next recv. Accepts go through the ring too.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

use io_uring::{IoUring, opcode, squeue, types};

use crate::CHUNK;

/// user_data of the accept operation; the others carry a direction's index and a send bit.
const ACCEPT: u64 = u64::MAX;

/// One connection: the accepted client and its upstream, closed when both directions ended.
struct Pair {
    client: TcpStream,
    upstream: TcpStream,
    open_directions: u8,
}

/// One direction of a pair: bytes read from `from` wait in `buf[sent..filled]` for `to`.
struct Direction {
    pair: usize,
    from: RawFd,
    to: RawFd,
    /// The stream `to` belongs to, for the half-close when `from` ends.
    to_is_client: bool,
    buf: Box<[u8]>,
    filled: usize,
    sent: usize,
}

/// Slots reused after a connection ends, so the tables stay as large as the busiest moment.
struct Slots<T> {
    items: Vec<Option<T>>,
    free: Vec<usize>,
}

impl<T> Slots<T> {
    fn new() -> Self {
        Slots {
            items: Vec::new(),
            free: Vec::new(),
        }
    }

    fn insert(&mut self, item: T) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.items[i] = Some(item);
                i
            }
            None => {
                self.items.push(Some(item));
                self.items.len() - 1
            }
        }
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.items.get_mut(i).and_then(Option::as_mut)
    }

    fn remove(&mut self, i: usize) -> Option<T> {
        let item = self.items.get_mut(i).and_then(Option::take);
        if item.is_some() {
            self.free.push(i);
        }
        item
    }
}

pub fn run(listener: TcpListener, upstream: &str) -> io::Result<()> {
    let mut ring = IoUring::new(1024)?;
    let mut pairs: Slots<Pair> = Slots::new();
    let mut directions: Slots<Direction> = Slots::new();
    let listen_fd = listener.as_raw_fd();
    push(&mut ring, accept(listen_fd))?;
    let mut completions = Vec::new();
    loop {
        ring.submit_and_wait(1)?;
        completions.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for (user_data, result) in completions.drain(..) {
            if user_data == ACCEPT {
                if result >= 0 {
                    // SAFETY: a successful accept returns a new descriptor that nothing else owns.
                    let client = unsafe { TcpStream::from_raw_fd(result) };
                    if let Ok(up) = crate::connect_pair(&client, upstream) {
                        start_pair(&mut ring, &mut pairs, &mut directions, client, up)?;
                    }
                }
                push(&mut ring, accept(listen_fd))?;
                continue;
            }
            let index = (user_data >> 1) as usize;
            let Some(d) = directions.get_mut(index) else {
                continue;
            };
            if user_data & 1 == 0 {
                if result > 0 {
                    d.filled = result as usize;
                    d.sent = 0;
                }
            } else if result > 0 {
                d.sent += result as usize;
            }
            if result <= 0 {
                end_direction(&mut pairs, &mut directions, index);
            } else {
                let next = next_operation(d, index);
                push(&mut ring, next)?;
            }
        }
    }
}

fn start_pair(
    ring: &mut IoUring,
    pairs: &mut Slots<Pair>,
    directions: &mut Slots<Direction>,
    client: TcpStream,
    upstream: TcpStream,
) -> io::Result<()> {
    let (client_fd, up_fd) = (client.as_raw_fd(), upstream.as_raw_fd());
    let pair = pairs.insert(Pair {
        client,
        upstream,
        open_directions: 2,
    });
    for (from, to, to_is_client) in [(client_fd, up_fd, false), (up_fd, client_fd, true)] {
        let index = directions.insert(Direction {
            pair,
            from,
            to,
            to_is_client,
            buf: vec![0u8; CHUNK].into_boxed_slice(),
            filled: 0,
            sent: 0,
        });
        if let Some(d) = directions.get_mut(index) {
            let first = next_operation(d, index);
            push(ring, first)?;
        }
    }
    Ok(())
}

/// The operation a direction waits on next: the rest of its buffer to send, or a new recv.
fn next_operation(d: &mut Direction, index: usize) -> squeue::Entry {
    let tag = (index as u64) << 1;
    if d.sent < d.filled {
        let rest = &d.buf[d.sent..d.filled];
        opcode::Send::new(types::Fd(d.to), rest.as_ptr(), rest.len() as u32)
            .build()
            .user_data(tag | 1)
    } else {
        opcode::Recv::new(types::Fd(d.from), d.buf.as_mut_ptr(), d.buf.len() as u32)
            .build()
            .user_data(tag)
    }
}

/// A direction's source ended or a send failed: half-close its destination, and close the
/// pair once its other direction has ended too. No operation of this direction is in flight.
fn end_direction(pairs: &mut Slots<Pair>, directions: &mut Slots<Direction>, index: usize) {
    let Some(d) = directions.remove(index) else {
        return;
    };
    let Some(pair) = pairs.get_mut(d.pair) else {
        return;
    };
    let to = if d.to_is_client {
        &pair.client
    } else {
        &pair.upstream
    };
    let _ = to.shutdown(Shutdown::Write);
    pair.open_directions -= 1;
    if pair.open_directions == 0 {
        pairs.remove(d.pair);
    }
}

fn accept(listen_fd: RawFd) -> squeue::Entry {
    opcode::Accept::new(
        types::Fd(listen_fd),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    )
    .build()
    .user_data(ACCEPT)
}

/// Queues one operation, submitting what is queued first when the submission queue is full.
fn push(ring: &mut IoUring, entry: squeue::Entry) -> io::Result<()> {
    loop {
        // SAFETY: every buffer an entry points into is a direction's boxed slice, which is
        // dropped only after that direction's last operation completed (end_direction runs on
        // a completion, and each direction has one operation in flight at a time).
        if unsafe { ring.submission().push(&entry) }.is_ok() {
            return Ok(());
        }
        ring.submit()?;
    }
}
