//! Runs scenarios against a target and judges them: each scenario in its own context behind
//! its own tap, within the harness's 10 s limit (time in the policy hook not counted), its
//! observation normalised (`$SFX`) and compared with the recording. Several workers take the
//! next scenario from one queue; a failure lists every failing scenario with its differences.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::scenarios::{self, Scenario};
use super::target::Target;
use super::{compare, ctx, expected, observe, tap};

/// The hard limit on one scenario, as in the harness.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(10);

/// What one scenario observed, and what went on around it.
struct Run {
    name: &'static str,
    desc: &'static str,
    observation: Value,
    info: Vec<String>,
    cleanup_errors: Vec<String>,
    duration: Duration,
}

async fn run_one(scenario: &Scenario, target: Arc<Target>) -> Run {
    let started = Instant::now();
    let tap = match tap::Tap::start(target.server).await {
        Ok(tap) => tap,
        Err(e) => panic!("the tap for {} could not listen: {e}", scenario.name),
    };
    let mut t = ctx::Ctx::new(target, tap);
    let hook = t.hook.clone();
    let outcome = {
        let steps = (scenario.run)(&mut t);
        tokio::pin!(steps);
        // The limit, plus the time spent in the policy hook.
        loop {
            let spent = Duration::from_millis(hook.spent_millis.load(Ordering::SeqCst));
            let deadline = tokio::time::Instant::from_std(started + SCENARIO_TIMEOUT + spent);
            tokio::select! {
                outcome = &mut steps => break Some(outcome),
                _ = tokio::time::sleep_until(deadline) => {
                    let more = hook.spent_millis.load(Ordering::SeqCst) > spent.as_millis() as u64;
                    if hook.busy.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    } else if !more {
                        break None;
                    }
                }
            }
        }
    };
    match outcome {
        Some(Ok(())) => {}
        Some(Err(failure)) => {
            t.info.push(format!("{failure:?}"));
            t.set("unexpected_error", failure.observation());
        }
        None => t.set(
            "harness_error",
            json!({"error": "scenario-timeout", "limit_s": SCENARIO_TIMEOUT.as_secs_f64()}),
        ),
    }
    let cleanup_errors = t.finish().await;
    let observation = Value::Object(std::mem::take(&mut t.obs));
    let rand = t.rand.clone();
    Run {
        name: scenario.name,
        desc: scenario.desc,
        observation: observe::replace_token(observation, &rand, observe::SUFFIX_TOKEN),
        info: t
            .info
            .iter()
            .map(|line| line.replace(&rand, observe::SUFFIX_TOKEN))
            .collect(),
        cleanup_errors,
        duration: started.elapsed(),
    }
}

/// Runs every scenario but `skip` and compares each with the recording; panics listing every
/// failing scenario with its differences. One worker per target in `targets` (the same
/// server, or one proxy each: see [`super::scenarios_through_the_proxy`]) takes the next scenario
/// until none is left.
pub async fn check(targets: Vec<Target>, skip: &[String]) {
    let doc = expected();
    let all = scenarios::all();
    let todo: std::sync::Mutex<VecDeque<&Scenario>> = std::sync::Mutex::new(
        all.iter()
            .filter(|s| !skip.iter().any(|k| k == s.name))
            .collect(),
    );
    let target_name = targets.first().map(|t| t.name).unwrap_or("no target");
    let started = Instant::now();
    let workers = targets.into_iter().map(Arc::new).map(|target| {
        let todo = &todo;
        async move {
            let mut runs = Vec::new();
            loop {
                let next = todo.lock().expect("scenario queue").pop_front();
                let Some(scenario) = next else { break runs };
                runs.push(run_one(scenario, target.clone()).await);
            }
        }
    });
    let runs: Vec<Run> = futures_util::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
        .collect();
    let mut failures = Vec::new();
    let mut cleanup = Vec::new();
    for run in &runs {
        let expected = &doc["scenarios"][run.name]["observation"];
        let diff = compare::deep_diff(expected, &run.observation);
        if !run.cleanup_errors.is_empty() {
            cleanup.push(format!("{}: {}", run.name, run.cleanup_errors.join("; ")));
        }
        if diff.is_empty() {
            continue;
        }
        let mut text = format!(
            "FAIL {} ({:.2}s) -- {}\n",
            run.name,
            run.duration.as_secs_f64(),
            run.desc
        );
        for line in &diff {
            text.push_str(&format!("    {line}\n"));
        }
        for note in run.info.iter().take(6) {
            text.push_str(&format!("    note: {}\n", compare::short(&json!(note))));
        }
        text.push_str(&format!("    actual: {}\n", run.observation));
        failures.push(text);
    }
    assert!(
        failures.is_empty(),
        "{} of {} conformance scenarios failed against the {} ({:.1}s):\n\n{}\n{}",
        failures.len(),
        runs.len(),
        target_name,
        started.elapsed().as_secs_f64(),
        failures.join("\n"),
        if cleanup.is_empty() {
            String::new()
        } else {
            format!("cleanup errors:\n{}", cleanup.join("\n"))
        }
    );
    // As in the harness, what cleanup could not remove is reported, not judged.
    if !cleanup.is_empty() {
        eprintln!(
            "conformance cleanup on the {target_name} left:\n{}",
            cleanup.join("\n")
        );
    }
}
