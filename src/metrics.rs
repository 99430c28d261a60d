//! TEMPORARY stub until the metrics module lands.
use std::sync::Arc;
#[derive(Default)]
pub struct Metrics;
impl Metrics {
    pub fn new(_max: usize) -> Arc<Metrics> { Arc::new(Metrics) }
    pub fn dead_lettered(&self, _v: &str, _q: &str, _r: &str) {}
    pub fn dropped(&self, _v: &str, _q: &str, _c: &str) {}
}
