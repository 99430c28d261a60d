//! A network namespace joined to this host by a veth pair with addresses in a private /30,
//! so that a test can connect to a listener from an address that is not loopback (every
//! 127.0.0.0/8 address is). Needs root and `ip` (iproute2); CI runs as root.
//!
//! The namespace and the host's veth end get names unique to this process and call, and are
//! removed when the [`NetNs`] is dropped (also when the test panics). Only the /30 between the
//! two veth ends is reachable: nothing leaves the machine.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A namespace with one veth link to the host.
pub struct NetNs {
    name: String,
    host_link: String,
    /// The host's end of the link (listen here to be reached from the namespace).
    pub host_addr: Ipv4Addr,
    /// The namespace's end (the peer address a listener on the host sees).
    pub inner_addr: Ipv4Addr,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

impl NetNs {
    /// Creates the namespace and its link; panics when this machine cannot (not root, no
    /// iproute2). Tests that use it are ignored by a plain `cargo test` and run by `.ci/run`.
    pub fn create() -> NetNs {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let serial = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        // A /30 in 10.201.0.0/16 picked from the process id and the call's serial number.
        let slot = (pid.wrapping_mul(7).wrapping_add(serial)) % 16_384;
        let base = Ipv4Addr::new(10, 201, (slot / 64) as u8, ((slot % 64) * 4) as u8);
        let host_addr = Ipv4Addr::from(u32::from(base) + 1);
        let inner_addr = Ipv4Addr::from(u32::from(base) + 2);
        let tag = format!("{:x}{serial:x}", pid);
        let netns = NetNs {
            name: format!("dlxt-{tag}"),
            host_link: format!("dlxh{tag}"),
            host_addr,
            inner_addr,
        };
        let inner_link = format!("dlxn{tag}");
        let host_cidr = format!("{host_addr}/30");
        let inner_cidr = format!("{inner_addr}/30");
        let name = netns.name.as_str();
        let host_link = netns.host_link.as_str();
        let inside = |args: &[&str]| {
            let mut command = vec!["netns", "exec", name, "ip"];
            command.extend_from_slice(args);
            ip(&command)
        };
        let setup = ip(&["netns", "add", name])
            .and_then(|()| {
                ip(&[
                    "link",
                    "add",
                    host_link,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &inner_link,
                ])
            })
            .and_then(|()| ip(&["link", "set", &inner_link, "netns", name]))
            .and_then(|()| ip(&["addr", "add", &host_cidr, "dev", host_link]))
            .and_then(|()| ip(&["link", "set", host_link, "up"]))
            .and_then(|()| inside(&["addr", "add", &inner_cidr, "dev", &inner_link]))
            .and_then(|()| inside(&["link", "set", &inner_link, "up"]))
            .and_then(|()| inside(&["link", "set", "lo", "up"]));
        match setup {
            Ok(()) => netns,
            Err(err) => {
                drop(netns);
                panic!("cannot create a network namespace (root and iproute2 needed): {err}");
            }
        }
    }

    /// Connects to `addr` from inside the namespace (a thread joins it, opens the socket and
    /// ends; the socket stays in the namespace).
    pub fn connect(&self, addr: SocketAddr) -> tokio::net::TcpStream {
        let path = format!("/var/run/netns/{}", self.name);
        let stream = std::thread::spawn(move || {
            let namespace = std::fs::File::open(&path).expect("namespace handle");
            // SAFETY: setns on a valid namespace descriptor changes only this thread's network
            // namespace; the thread ends right after the connect below.
            let joined = unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(joined, 0, "setns: {}", std::io::Error::last_os_error());
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5))
                .expect("connect from the namespace")
        })
        .join()
        .expect("namespace thread");
        stream.set_nonblocking(true).expect("non-blocking");
        tokio::net::TcpStream::from_std(stream).expect("tokio stream")
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace removes its veth end, and with it the host's; the explicit
        // delete covers a setup that failed half-way.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_link]);
    }
}
