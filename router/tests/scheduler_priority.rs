//! Priority scheduling: admission order, preemption of less urgent requests (for a waiting
//! request and for pages), the threshold, the inverted order, overlap, and that without the
//! policy `priority` changes nothing. The long random simulations with priorities are in
//! scheduler_sim.rs and scheduler_data_parallel.rs.

mod scheduler_common;

use std::collections::HashMap;

use nsaserve_router::engine::GenerateRequest;
use nsaserve_router::protocol::BatchPlan;
use nsaserve_router::scheduler::{PriorityPolicy, Scheduler, SchedulerConfig};
use scheduler_common::*;

fn policy(low_values_first: bool) -> Option<PriorityPolicy> {
    Some(PriorityPolicy {
        low_values_first,
        preemption_threshold: 10,
    })
}

fn prioritised(base: i32, max_new: u32, priority: i32) -> GenerateRequest {
    let mut r = request((0..8).map(|k| base + k).collect(), max_new, vec![]);
    r.priority = priority;
    r
}

/// A scheduler (pages of 4 tokens) against the fake executor, stepped with overlap or not.
struct Run {
    s: Scheduler,
    exec: FakeExecutor,
    out: HashMap<u64, Outcome>,
    reqs: Vec<GenerateRequest>,
    overlap: bool,
    in_flight: Option<BatchPlan>,
    n: u64,
}

impl Run {
    fn new(
        max_running: usize,
        num_pages: u32,
        priority: Option<PriorityPolicy>,
        overlap: bool,
    ) -> Self {
        let cfg = SchedulerConfig {
            max_running_requests: max_running,
            priority,
            ..config(4, num_pages)
        };
        Run {
            s: Scheduler::new(cfg.clone()),
            exec: FakeExecutor::new(&cfg),
            out: HashMap::new(),
            reqs: Vec::new(),
            overlap,
            in_flight: None,
            n: 0,
        }
    }

    /// Submits the next request (ids count from 0).
    fn submit(&mut self, r: GenerateRequest) {
        self.s.submit(self.reqs.len() as u64, r.clone()).unwrap();
        self.reqs.push(r);
    }

    /// One step, every check on. The ids of the plan just made: run at once without overlap,
    /// in flight with it. Empty when nothing was planned (and, with overlap, nothing was left
    /// in flight either).
    fn step(&mut self) -> Option<Vec<u64>> {
        let n = self.n;
        self.n += 1;
        if self.overlap {
            let busy = step_overlap(
                &mut self.s,
                &mut self.exec,
                n,
                &mut self.out,
                &mut self.in_flight,
            );
            let ids = self
                .in_flight
                .iter()
                .flat_map(|p| &p.requests)
                .map(|r| r.id)
                .collect();
            return busy.then_some(ids);
        }
        let plan = self.s.schedule(n)?;
        check_plan(&plan, self.s.config().num_pages);
        self.s
            .check_invariants()
            .expect("invariants after schedule");
        let result = self.exec.run(&plan);
        record(&mut self.out, self.s.on_result(&plan, &result));
        self.s.check_invariants().expect("invariants after result");
        Some(plan.requests.iter().map(|r| r.id).collect())
    }

    fn steps(&mut self, count: usize) {
        for _ in 0..count {
            self.step();
        }
    }

    /// Steps until nothing runs; every request not in `aborted` gave the reference output and
    /// the pool is whole again.
    fn finish(&mut self, aborted: &[u64]) {
        while self.step().is_some() {
            assert!(self.n < 10_000, "no progress");
        }
        for (i, r) in self.reqs.iter().enumerate() {
            if !aborted.contains(&(i as u64)) {
                check_outcome(
                    i as u64,
                    r,
                    &self.out[&(i as u64)],
                    self.s.config().max_context,
                );
            }
        }
        let st = self.s.stats();
        assert_eq!(st.pages_free + st.pages_cached, st.pages_total);
    }

    fn preemptions(&self) -> u64 {
        self.s.stats().preemptions_total
    }
}

/// The order in which requests were first planned, one request running at a time.
fn first_planned_order(priority: Option<PriorityPolicy>, reqs: &[GenerateRequest]) -> Vec<u64> {
    let mut run = Run::new(1, 64, priority, false);
    for r in reqs {
        run.submit(r.clone());
    }
    let mut order = Vec::new();
    while let Some(ids) = run.step() {
        order.extend(
            ids.into_iter()
                .filter(|id| !order.contains(id))
                .collect::<Vec<_>>(),
        );
    }
    run.finish(&[]);
    order
}

#[test]
fn admission_takes_the_most_urgent_first_and_arrival_breaks_ties() {
    let reqs = [
        prioritised(100, 3, 0),
        prioritised(200, 3, 5),
        prioritised(300, 3, 5),
        prioritised(400, 3, 1),
    ];
    // Larger values first by default; 1 and 2 tie at 5 and keep their arrival order.
    assert_eq!(first_planned_order(policy(false), &reqs), [1, 2, 3, 0]);
    assert_eq!(first_planned_order(policy(true), &reqs), [0, 3, 1, 2]);
    // Without the policy `priority` is ignored: first come, first served.
    assert_eq!(first_planned_order(None, &reqs), [0, 1, 2, 3]);
}

/// Two long requests (priorities 0 and 5) decode in a batch of two; then `late` arrives.
fn full_batch_then(late: GenerateRequest, overlap: bool) -> Run {
    let mut run = Run::new(2, 64, policy(false), overlap);
    run.submit(prioritised(100, 30, 0));
    run.submit(prioritised(200, 30, 5));
    run.steps(4);
    run.submit(late);
    run
}

#[test]
fn a_much_more_urgent_request_preempts_the_least_urgent_running_one() {
    let mut run = full_batch_then(prioritised(300, 5, 20), false);
    // Request 0 (priority 0) makes room; request 1 (priority 5) keeps running.
    let mut ids = run.step().unwrap();
    ids.sort_unstable();
    assert_eq!(ids, [1, 2]);
    assert_eq!(run.preemptions(), 1);
    assert_eq!(run.s.stats().waiting, 1);
    // The victim comes back once there is room, and every output is the reference.
    run.finish(&[]);
}

#[test]
fn a_request_less_urgent_than_the_threshold_waits_for_a_free_row() {
    // 9 above the least urgent running request: under the threshold of 10.
    let mut run = full_batch_then(prioritised(300, 5, 9), false);
    let mut ids = run.step().unwrap();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1]);
    run.finish(&[]);
    assert_eq!(run.preemptions(), 0);
}

#[test]
fn with_overlap_an_in_flight_victim_is_preempted_once_its_step_is_back() {
    let mut run = full_batch_then(prioritised(300, 5, 20), true);
    let mut admitted_at = None;
    while let Some(ids) = run.step() {
        if ids.contains(&2) && admitted_at.is_none() {
            assert!(
                !ids.contains(&0),
                "the victim runs beside the request it made room for"
            );
            assert_eq!(run.preemptions(), 1);
            admitted_at = Some(run.n - 1);
        }
    }
    // Marked at step 4 (its step 3 still in flight), preempted and replaced at step 5.
    assert_eq!(admitted_at, Some(5));
    run.finish(&[]);
}

#[test]
fn running_out_of_pages_preempts_the_least_urgent_not_the_newest() {
    // 10 pages of 4 tokens; two requests of 8 prompt tokens growing to 38 tokens cannot both
    // finish without one being preempted.
    for (priority, victim) in [(policy(false), 0u64), (None, 1)] {
        let mut run = Run::new(64, 10, priority, false);
        // Request 0 is admitted first (alone, a step ahead) but is the less urgent.
        run.submit(prioritised(100, 30, 0));
        run.steps(1);
        run.submit(prioritised(200, 30, 5));
        let mut first_alone = None;
        while let Some(ids) = run.step() {
            if first_alone.is_none() && ids.len() == 1 && run.preemptions() > 0 {
                first_alone = Some(ids[0]);
            }
        }
        // The one left running is the one that was not preempted.
        assert_eq!(first_alone, Some(1 - victim), "policy {priority:?}");
        run.finish(&[]);
    }
}

#[test]
fn a_victim_does_not_come_straight_back_in_the_step_it_left() {
    // Room for three rows but pages for two: the urgent request preempts request 0 for pages,
    // and the row it frees must not readmit request 0 in the same step.
    let mut run = Run::new(3, 9, policy(false), false);
    run.submit(prioritised(100, 12, 0));
    run.submit(prioritised(200, 12, 5));
    run.steps(4);
    run.submit(prioritised(300, 4, 30));
    let mut admitted = false;
    while let Some(ids) = run.step() {
        if ids.contains(&2) && !admitted {
            admitted = true;
            assert_eq!(run.preemptions(), 1, "admitted by preempting");
            assert!(!ids.contains(&0), "{ids:?}");
        }
    }
    assert!(admitted);
    run.finish(&[]);
}

#[test]
fn a_victim_whose_urgent_request_left_is_readmitted_at_once() {
    // Overlap: request 0 is marked while its step is in flight, then the urgent request it was
    // chosen for is aborted. Preempted at the next step, it must be readmitted (nothing else
    // would ever plan it again).
    let mut run = Run::new(1, 64, policy(false), true);
    run.submit(prioritised(100, 20, 0));
    run.steps(4);
    run.submit(prioritised(300, 5, 20));
    run.steps(1);
    assert!(run.s.abort(1));
    run.finish(&[1]);
    assert_eq!(run.preemptions(), 1);
}
