//! TEMPORARY stub until the metrics module lands.
use std::sync::Arc;
#[derive(Default)]
pub struct Metrics;
impl Metrics {
    pub fn new(_max: usize) -> Arc<Metrics> {
        Arc::new(Metrics)
    }
    pub fn dead_lettered(&self, _v: &str, _q: &str, _r: &str) {}
    pub fn dropped(&self, _v: &str, _q: &str, _c: &str) {}
    pub fn observe_age(&self, _s: f64) {}
    pub fn observe_dead_letter_latency(&self, _s: f64) {}
    pub fn published(&self) {}
    pub fn delivered(&self) {}
    pub fn delivered_n(&self, _n: u64) {}
    pub fn acked(&self, _n: u64) {}
    pub fn set_queue_depth(&self, _v: &str, _q: &str, _m: i64, _b: i64) {}
    pub fn remove_queue(&self, _v: &str, _q: &str) {}
}
impl Metrics {
    pub fn connection_opened(&self) {}
    pub fn connection_closed(&self) {}
    pub fn channel_opened(&self) {}
    pub fn channel_closed(&self) {}
    pub fn bytes(&self, _d: &str, _n: u64) {}
    pub fn frame_in(&self, _n: u64) {}
}
impl Metrics { pub fn encode(&self) -> String { String::new() } }
