//! A RabbitMQ cluster the tests start themselves: [`RabbitNode`]s on free ports sharing one
//! Erlang cookie, booted side by side, the others joined to the first with `rabbitmqctl
//! join_cluster`, so that quorum queues have three members. The fleet tests run proxies in
//! front of it and kill nodes under them.
//!
//! [`cluster`] is the cluster of a test process (like [`super::reference`], started on first
//! use); [`RabbitCluster::start`] gives a test a cluster of its own. Each node has the same
//! watchdog as any [`RabbitNode`]: it stops when the test process ends, however it ends.
//!
//! Nodes are numbered from 0; node 0 is the one the others joined.
//!
//! ## Killing nodes of the shared cluster
//! A test that kills nodes of [`cluster`] first holds it with [`RabbitCluster::exclusive`]
//! (or [`RabbitCluster::outage`], which also kills one node) and kills through that
//! [`Outage`]; the nodes it killed are restarted (and waited for until they run in the
//! cluster again) when the guard is restored or dropped, also when the test panics. A test that needs every node up for its whole run holds
//! [`RabbitCluster::steady`]; the two never overlap. A test that wants to leave nodes down
//! starts a [`RabbitCluster`] of its own.
//!
//! `kill`, `restart` and `start` block (seconds); call them from `spawn_blocking` when the
//! test's runtime must keep serving something in-process meanwhile.
// Part of it serves the fleet suites only.
#![allow(dead_code)]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{RabbitNode, START_TIMEOUT};

/// Nodes in the shared cluster.
const SHARED_SIZE: usize = 3;

/// The shared cluster of this test process (three nodes), started on first use.
pub fn cluster() -> &'static RabbitCluster {
    static CLUSTER: OnceLock<RabbitCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| RabbitCluster::start("fleet", SHARED_SIZE))
}

/// Running RabbitMQ nodes joined into one cluster.
pub struct RabbitCluster {
    nodes: Vec<RabbitNode>,
    /// Read: a test needs every node up. Write: a test takes nodes down.
    availability: RwLock<()>,
}

impl RabbitCluster {
    /// Starts `size` nodes named `dlxit-<pid>-<tag>-n<i>@localhost` with one cookie, joins
    /// nodes 1.. to node 0 and waits until every node sees all of them running. Panics with
    /// the logs when a node does not start or join.
    pub fn start(tag: &str, size: usize) -> RabbitCluster {
        assert!(size >= 1, "a cluster has at least one node");
        let cookie = format!("DLXITCLUSTER{}{tag}", std::process::id());
        let nodes: Vec<RabbitNode> = (0..size)
            .map(|i| RabbitNode::launch(&format!("{tag}-n{i}"), &cookie))
            .collect();
        for node in &nodes {
            node.wait_started();
        }
        let (seed, others) = nodes.split_first().expect("one node at least");
        // Nodes join one at a time (concurrent schema changes on the seed can fail); stopping
        // and starting the application happens on all of them at once.
        std::thread::scope(|scope| {
            for node in others {
                scope.spawn(|| node.ctl_ok(&["stop_app"]));
            }
        });
        for node in others {
            node.ctl_ok(&["join_cluster", &seed.name]);
            let _ = node.seed.set(seed.name.clone());
        }
        std::thread::scope(|scope| {
            for node in others {
                scope.spawn(|| node.ctl_ok(&["start_app"]));
            }
        });
        let _ = seed.seed.set(seed.name.clone());
        let cluster = RabbitCluster {
            nodes,
            availability: RwLock::new(()),
        };
        for node in &cluster.nodes {
            node.wait_cluster_complete();
        }
        cluster
    }

    /// Node `i` (from 0).
    pub fn node(&self, i: usize) -> &RabbitNode {
        &self.nodes[i]
    }

    pub fn nodes(&self) -> &[RabbitNode] {
        &self.nodes
    }

    /// Every node's AMQP URI, node 0 first (for `upstream.urls`).
    pub fn uris(&self) -> Vec<String> {
        self.nodes.iter().map(RabbitNode::uri).collect()
    }

    /// The index of the node `name` (`dlxit-…@localhost`), if it is one of ours.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|node| node.name == name)
    }

    /// The index of the node hosting a classic queue, or a quorum queue's leader; `None` while
    /// the queue does not exist or has no leader (during an election).
    pub fn queue_home(&self, vhost: &str, queue: &str) -> Option<usize> {
        // Tab-separated rows (the JSON formatter prints pids without their node).
        let rows = self.ctl_any(&[
            "list_queues",
            "-p",
            vhost,
            "name",
            "pid",
            "leader",
            "type",
            "-q",
            "--no-table-headers",
        ])?;
        let row: Vec<&str> = rows
            .lines()
            .map(|line| line.split('\t').collect::<Vec<_>>())
            .find(|row| row.first() == Some(&queue))?;
        // A quorum queue names its leader node; a classic queue's pid is `<node.N.N.N>`.
        if let Some(leader) = row.get(2).filter(|l| !l.is_empty()) {
            return self.index_of(leader);
        }
        let pid = row.get(1)?.strip_prefix('<')?;
        self.nodes.iter().position(|node| {
            pid.strip_prefix(node.name.as_str())
                .is_some_and(|rest| rest.starts_with('.'))
        })
    }

    /// The output of `rabbitmqctl ARGS` from the first node that runs it successfully.
    pub fn ctl_any(&self, args: &[&str]) -> Option<String> {
        self.nodes.iter().find_map(|node| {
            let out = node.ctl(args);
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        })
    }

    /// Holds the cluster with every node up: no [`Outage`] starts while the guard lives.
    pub async fn steady(&self) -> RwLockReadGuard<'_, ()> {
        self.availability.read().await
    }

    /// Holds the cluster exclusively (no other test's node is down, no steady test runs) so
    /// that the test can kill nodes with [`Outage::kill`]; they are restarted when the guard
    /// is restored or dropped.
    pub async fn exclusive(&self) -> Outage<'_> {
        Outage {
            cluster: self,
            down: Vec::new(),
            _guard: self.availability.write().await,
        }
    }

    /// [`RabbitCluster::exclusive`], then node `i` killed.
    pub async fn outage(&self, i: usize) -> Outage<'_> {
        let mut outage = self.exclusive().await;
        outage.kill(i);
        outage
    }
}

/// Exclusive hold of a cluster whose nodes a test kills; the nodes still down are restarted
/// (and back in the cluster) when it is restored or dropped, also when the test panics.
pub struct Outage<'a> {
    cluster: &'a RabbitCluster,
    down: Vec<usize>,
    _guard: RwLockWriteGuard<'a, ()>,
}

impl Outage<'_> {
    /// Kills node `i` with SIGKILL ([`RabbitNode::kill`]).
    pub fn kill(&mut self, i: usize) {
        self.cluster.node(i).kill();
        self.down.push(i);
    }

    /// Restarts node `i` if this outage killed it, and waits until it runs in the cluster.
    pub fn restart(&mut self, i: usize) {
        if let Some(at) = self.down.iter().position(|&n| n == i) {
            self.down.remove(at);
            self.cluster.node(i).restart();
        }
    }

    /// The nodes this outage killed and has not restarted.
    pub fn down(&self) -> &[usize] {
        &self.down
    }

    /// Restarts every node still down.
    pub fn restore(mut self) {
        self.restart_all();
    }

    fn restart_all(&mut self) {
        for i in std::mem::take(&mut self.down) {
            self.cluster.node(i).restart();
        }
    }
}

impl Drop for Outage<'_> {
    fn drop(&mut self) {
        self.restart_all();
    }
}

impl RabbitNode {
    /// Runs `rabbitmqctl` and panics with its output and the node's logs when it fails.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "rabbitmqctl -n {} {args:?} failed: {}{}\n{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log_tail()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The nodes this node's `cluster_status` lists as (members, running).
    pub fn cluster_nodes(&self) -> Option<(Vec<String>, Vec<String>)> {
        let out = self.ctl(&["cluster_status", "--formatter", "json", "-q"]);
        if !out.status.success() {
            return None;
        }
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let names = |key: &str| -> Vec<String> {
            status[key]
                .as_array()
                .map(|list| {
                    list.iter()
                        .filter_map(|n| n.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        Some((names("disk_nodes"), names("running_nodes")))
    }

    /// Waits until this node sees every member of its cluster running (after a join or a
    /// restart); panics with its logs after [`START_TIMEOUT`].
    pub(crate) fn wait_cluster_complete(&self) {
        let started = Instant::now();
        loop {
            if let Some((mut members, mut running)) = self.cluster_nodes() {
                members.sort();
                running.sort();
                if members.contains(&self.name) && members == running {
                    return;
                }
            }
            if started.elapsed() > START_TIMEOUT {
                panic!(
                    "{} does not see its whole cluster running within {START_TIMEOUT:?}: \
                     {:?}\n{}",
                    self.name,
                    self.cluster_nodes(),
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}
