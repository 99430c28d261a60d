//! Compares an observation with the recording, the way the Python harness's `--compare` does:
//! objects key by key, arrays position by position, scalars by value (a bool never equals a
//! number, 1 equals 1.0). Each difference is one line naming its path, at most 60 per scenario.

use serde_json::Value;

const LIMIT: usize = 60;
const SHORT: usize = 300;

/// The differences between `expected` and `actual`, one line each (empty when they agree).
pub fn deep_diff(expected: &Value, actual: &Value) -> Vec<String> {
    let mut out = Vec::new();
    diff(expected, actual, "", &mut out);
    out
}

fn diff(exp: &Value, act: &Value, path: &str, out: &mut Vec<String>) {
    if out.len() >= LIMIT {
        return;
    }
    let at = |p: &str| {
        if p.is_empty() {
            "<root>".to_string()
        } else {
            p.to_string()
        }
    };
    match (exp, act) {
        (Value::Object(e), Value::Object(a)) => {
            let mut keys: Vec<&String> = e.keys().chain(a.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match (e.get(k), a.get(k)) {
                    (Some(ev), None) => out.push(format!("{p}: missing (expected {})", short(ev))),
                    (None, Some(av)) => out.push(format!("{p}: unexpected {}", short(av))),
                    (Some(ev), Some(av)) => diff(ev, av, &p, out),
                    (None, None) => {}
                }
            }
        }
        (Value::Array(e), Value::Array(a)) => {
            if e.len() != a.len() {
                out.push(format!(
                    "{}: length {}, expected {}",
                    at(path),
                    a.len(),
                    e.len()
                ));
            }
            for (i, (ev, av)) in e.iter().zip(a).enumerate() {
                diff(ev, av, &format!("{path}[{i}]"), out);
            }
            for (i, ev) in e.iter().enumerate().skip(a.len()) {
                out.push(format!("{path}[{i}]: missing (expected {})", short(ev)));
            }
            for (i, av) in a.iter().enumerate().skip(e.len()) {
                out.push(format!("{path}[{i}]: unexpected {}", short(av)));
            }
        }
        _ if same(exp, act) => {}
        _ => out.push(format!(
            "{}: expected {}, got {}",
            at(path),
            short(exp),
            short(act)
        )),
    }
}

fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        (Value::Object(_) | Value::Array(_), _) | (_, Value::Object(_) | Value::Array(_)) => false,
        _ => a == b,
    }
}

/// Compact JSON, cut at 300 characters.
pub fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() <= SHORT {
        s
    } else {
        let cut: String = s.chars().take(SHORT).collect();
        format!("{cut}...({} chars)", s.chars().count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reports_each_difference_with_its_path() {
        let exp = json!({"publish": "ack", "dl": [{"count": 1, "keys": ["a"]}], "gone": true});
        let act = json!({"publish": "nack", "dl": [{"count": 1.0, "keys": ["a", "b"]}], "new": 1});
        assert_eq!(
            deep_diff(&exp, &act),
            vec![
                "dl[0].keys: length 2, expected 1",
                "dl[0].keys[1]: unexpected \"b\"",
                "gone: missing (expected true)",
                "new: unexpected 1",
                "publish: expected \"ack\", got \"nack\"",
            ]
        );
    }

    #[test]
    fn a_bool_is_not_a_number_and_a_list_is_not_a_scalar() {
        assert_eq!(deep_diff(&json!(true), &json!(1)).len(), 1);
        assert_eq!(deep_diff(&json!([]), &json!("x")).len(), 1);
        assert!(
            deep_diff(
                &json!({"a": [1, {"b": null}]}),
                &json!({"a": [1, {"b": null}]})
            )
            .is_empty()
        );
    }
}
