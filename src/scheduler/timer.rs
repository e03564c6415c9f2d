//! A server's timer: one thread, started on first use, that wakes schedulers at their
//! queue deadlines. A request whose queue timeout passes is answered then, even when every
//! instance is busy with a long batch or stuck in a backend (the workers only look at the
//! queue when they are free).
//!
//! Schedulers arm it with their earliest deadline; the thread calls [`Scheduler::expire`]
//! with no timer lock held, which answers what is due (on the timer thread) and arms the
//! next deadline. Entries hold the scheduler weakly: an unloaded model's entries lapse.

use super::Scheduler;
use parking_lot::{Condvar, Mutex};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

struct Entry {
    at: Instant,
    seq: u64,
    target: Weak<Scheduler>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Reverse<Entry>>,
    next_seq: u64,
    closed: bool,
    thread: Option<JoinHandle<()>>,
    /// Starting the thread failed once: the workers' own expiry is all there is.
    failed: bool,
}

#[derive(Default)]
struct Shared {
    st: Mutex<State>,
    cv: Condvar,
}

/// The timer of one server.
#[derive(Default)]
pub struct Timer {
    shared: Arc<Shared>,
}

impl Timer {
    pub fn new() -> Timer {
        Timer::default()
    }

    /// Wakes `target` at `at` (or soon after).
    pub(super) fn arm(&self, at: Instant, target: Weak<Scheduler>) {
        let mut st = self.shared.st.lock();
        if st.closed {
            return;
        }
        if st.thread.is_none() && !st.failed {
            let shared = self.shared.clone();
            match std::thread::Builder::new()
                .name("infer-timer".into())
                .spawn(move || run(&shared))
            {
                Ok(h) => st.thread = Some(h),
                // Queue timeouts still fire when a worker is free, as without a timer.
                Err(_) => st.failed = true,
            }
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let earliest = st.heap.peek().is_none_or(|Reverse(e)| at < e.at);
        st.heap.push(Reverse(Entry { at, seq, target }));
        drop(st);
        if earliest {
            self.shared.cv.notify_one();
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let handle = {
            let mut st = self.shared.st.lock();
            st.closed = true;
            st.heap.clear();
            st.thread.take()
        };
        self.shared.cv.notify_all();
        if let Some(h) = handle {
            // The timer thread itself may drop the last owner (through a scheduler it
            // woke): it exits on its own then.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

fn run(shared: &Shared) {
    super::SERVING.with(|c| c.set(super::TIMER_THREAD));
    let mut st = shared.st.lock();
    loop {
        if st.closed {
            return;
        }
        let now = Instant::now();
        match st.heap.peek() {
            None => shared.cv.wait(&mut st),
            Some(Reverse(e)) if e.at > now => {
                let at = e.at;
                shared.cv.wait_until(&mut st, at);
            }
            Some(_) => {
                let Some(Reverse(e)) = st.heap.pop() else {
                    continue;
                };
                drop(st);
                if let Some(s) = e.target.upgrade() {
                    s.expire(now);
                }
                st = shared.st.lock();
            }
        }
    }
}
