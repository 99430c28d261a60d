//! The result of one scenario run: named values printed for people (one per line) and, with
//! `--json`, as one JSON object on the last line for scripts/bench.sh. Failures (lost or
//! duplicated messages) are listed and make the process exit non-zero.

use serde_json::{Map, Value, json};

#[derive(Debug)]
pub struct Report {
    scenario: String,
    label: String,
    values: Map<String, Value>,
    order: Vec<String>,
    pub failures: Vec<String>,
    pub notes: Vec<String>,
}

impl Report {
    pub fn new(scenario: &str, label: &str) -> Report {
        Report {
            scenario: scenario.to_string(),
            label: label.to_string(),
            values: Map::new(),
            order: Vec::new(),
            failures: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Sets a value; floats are rounded to a readable precision.
    pub fn set(&mut self, key: &str, value: impl Into<Value>) {
        let mut value = value.into();
        if let Some(f) = value.as_f64().filter(|_| value.is_f64()) {
            let rounded = if f.abs() >= 100.0 {
                f.round()
            } else {
                (f * 100.0).round() / 100.0
            };
            value = json!(rounded);
        }
        if !self.values.contains_key(key) {
            self.order.push(key.to_string());
        }
        self.values.insert(key.to_string(), value);
    }

    pub fn fail(&mut self, why: impl Into<String>) {
        self.failures.push(why.into());
    }

    pub fn note(&mut self, text: impl Into<String>) {
        self.notes.push(text.into());
    }

    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }

    /// Human-readable lines.
    pub fn text(&self) -> String {
        let mut out = format!("== {} [{}]\n", self.scenario, self.label);
        let width = self.order.iter().map(String::len).max().unwrap_or(0);
        for key in &self.order {
            if let Some(v) = self.values.get(key) {
                let shown = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                out.push_str(&format!("  {key:<width$}  {shown}\n"));
            }
        }
        for n in &self.notes {
            out.push_str(&format!("  note: {n}\n"));
        }
        if self.failures.is_empty() {
            out.push_str("  verdict: OK\n");
        } else {
            for f in &self.failures {
                out.push_str(&format!("  FAILED: {f}\n"));
            }
        }
        out
    }

    /// One JSON object: scenario, label, ok, failures, notes and every value.
    pub fn json(&self) -> Value {
        let mut m = self.values.clone();
        m.insert("scenario".into(), json!(self.scenario));
        m.insert("label".into(), json!(self.label));
        m.insert("ok".into(), json!(self.ok()));
        m.insert("failures".into(), json!(self.failures));
        m.insert("notes".into(), json!(self.notes));
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_keep_their_order_and_floats_are_rounded() {
        let mut r = Report::new("throughput", "embedded");
        r.set("rate_msg_s", 12345.678);
        r.set("p50_us", 1.23456);
        r.set("published", 10u64);
        r.set("p50_us", 2.5);
        let t = r.text();
        assert!(t.find("rate_msg_s").unwrap() < t.find("p50_us").unwrap());
        assert!(t.contains("12346"));
        assert!(t.contains("2.5"));
        assert!(t.contains("verdict: OK"));
        let j = r.json();
        assert_eq!(j["published"], 10);
        assert_eq!(j["ok"], true);
    }

    #[test]
    fn failures_show_and_flip_ok() {
        let mut r = Report::new("deadletter", "rabbitmq");
        r.fail("3 messages lost");
        assert!(!r.ok());
        assert!(r.text().contains("FAILED: 3 messages lost"));
        assert_eq!(r.json()["ok"], false);
    }
}
