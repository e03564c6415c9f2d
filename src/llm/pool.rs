//! The threads of one model instance: the caller and `threads - 1` workers that spin
//! between the parallel parts of a step instead of sleeping.
//!
//! A decode step is a few hundred short parallel sections (a layer's products, its
//! attention, its activations) with a little serial work between them. A worker that
//! goes to sleep between two sections costs a wake-up (a system call and a thread
//! switch, tens of microseconds on a virtual machine) at the next one; a step of a
//! single stream is about ten milliseconds. So a worker spins on the pool's sequence
//! number for a while after each section ([`SPIN`]), yielding now and then, and only
//! then sleeps on a condition variable.
//!
//! [`Pool::run`] publishes a job (a function of the part index and a part count), takes
//! parts itself, waits for every part to finish and for every worker to be out of the
//! job, and only then returns: the job borrows the caller's stack. A part that panics
//! does not stop the others; the panic is raised again in the caller once all are done.

use crate::status::{Error, Result};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a worker spins for the next job before it sleeps (not at all where the pool
/// has more threads than the machine has cores: spinners would take the cores from the
/// threads that work).
const SPIN: Duration = Duration::from_millis(2);

/// A job: part `i` of it is `f(i)`. The lifetime is erased: [`Pool::run`] keeps the
/// function alive until no worker can reach it.
type Job = *const (dyn Fn(usize) + Sync + 'static);

struct Shared {
    /// Bumped for each job; the workers watch it.
    seq: AtomicU64,
    /// The `seq` of the job whose parts may be taken; 0 once its parts are all done.
    open: AtomicU64,
    /// The open job, written by the caller of `run` before `open` and cleared after
    /// `active` fell to 0; read by a worker only while it counts in `active` and saw
    /// `open` equal to the job's `seq`.
    job: UnsafeCell<Option<Job>>,
    parts: AtomicUsize,
    next: AtomicUsize,
    done: AtomicUsize,
    /// Workers between their check of `open` and the end of their parts.
    active: AtomicUsize,
    /// A `run` is in progress (another one, nested or from another thread, runs its
    /// parts on its own thread).
    running: AtomicBool,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    stop: AtomicBool,
    /// How long a worker spins before it sleeps.
    spin: Duration,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is the only field that is not Sync; it is written only by the one `run`
// in progress (`running`), while no worker reads it (before `open` names the job, and
// after `active` fell to 0 with `open` cleared), and the function it points to is Sync.
unsafe impl Sync for Shared {}
// SAFETY: as above; the pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

impl Shared {
    /// Takes and runs parts of `f` until none is left.
    fn work(&self, f: &(dyn Fn(usize) + Sync), parts: usize) {
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            if i >= parts {
                return;
            }
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
            }
            self.done.fetch_add(1, Release);
        }
    }
}

/// See the module's documentation.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Pool {
    /// A pool of `threads` threads in all: the caller of [`Pool::run`] and `threads - 1`
    /// workers named `infer-{name}-{i}`. RESOURCE_EXHAUSTED when a thread cannot start.
    pub(crate) fn new(threads: usize, name: &str) -> Result<Pool> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let shared = Arc::new(Shared {
            seq: AtomicU64::new(0),
            open: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            parts: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            running: AtomicBool::new(false),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
            spin: if threads <= cores {
                SPIN
            } else {
                Duration::ZERO
            },
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = Pool {
            shared,
            workers: Vec::new(),
        };
        for i in 1..threads.max(1) {
            let shared = Arc::clone(&pool.shared);
            let worker = std::thread::Builder::new()
                .name(format!("infer-{name}-{i}"))
                .spawn(move || work_loop(&shared))
                .map_err(|e| {
                    Error::exhausted(format!("cannot start {threads} {name} threads: {e}"))
                })?;
            // Dropping `pool` on an error stops the workers started so far.
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    /// Threads in all, the caller's included.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0) .. f(parts - 1)`, each once, on the workers and the calling thread;
    /// returns when all have returned. Panics (after all have returned) with the first
    /// part's panic, if any.
    pub(crate) fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        let sh = &*self.shared;
        if parts <= 1 || self.workers.is_empty() || sh.running.swap(true, Acquire) {
            (0..parts).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is erased; the pointer is cleared below before `f`'s
        // borrow ends, once no worker can reach it (`open` is 0 and `active` is 0).
        let job: Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f as *const _)
        };
        // SAFETY: no worker reads `job` now (`open` is 0 and `active` is 0 since the
        // last run), and `running` keeps other callers out.
        unsafe { *sh.job.get() = Some(job) };
        sh.parts.store(parts, Relaxed);
        sh.next.store(0, Relaxed);
        sh.done.store(0, Relaxed);
        let seq = sh.seq.load(Relaxed) + 1;
        sh.open.store(seq, SeqCst);
        sh.seq.store(seq, SeqCst);
        if sh.sleepers.load(SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        sh.work(f, parts);
        let mut spins = 0u32;
        while sh.done.load(Acquire) < parts {
            spins = pause(sh, spins);
        }
        sh.open.store(0, SeqCst);
        while sh.active.load(SeqCst) > 0 {
            spins = pause(sh, spins);
        }
        // SAFETY: no worker is in the job or can enter it (`open` is 0).
        unsafe { *sh.job.get() = None };
        let panic = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        sh.running.store(false, Release);
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
    }

    /// Runs `f` on each item once, spread over the threads.
    pub(crate) fn for_each<T: Send>(&self, items: Vec<T>, f: impl Fn(T) + Sync) {
        let cells: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
        self.run(cells.len(), &|i| {
            let item = cells[i].lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(item) = item {
                f(item)
            }
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// One wait of a spin loop: a pause instruction, and a yield of the core every 256th
/// time (a preempted thread the loop waits for may need it), or every time where the
/// pool has more threads than cores (`spin` zero).
#[inline]
fn pause(sh: &Shared, spins: u32) -> u32 {
    if spins % 256 == 255 || sh.spin.is_zero() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
    spins.wrapping_add(1)
}

fn work_loop(sh: &Shared) {
    let mut seen = sh.seq.load(SeqCst);
    loop {
        // Wait for the next job: spin for a while, then sleep.
        let since = Instant::now();
        let mut spins = 0u32;
        loop {
            if sh.stop.load(Acquire) {
                return;
            }
            let s = sh.seq.load(Acquire);
            if s != seen {
                seen = s;
                break;
            }
            spins = pause(sh, spins);
            if spins.is_multiple_of(64) && since.elapsed() >= sh.spin {
                let mut g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleepers.fetch_add(1, SeqCst);
                while sh.seq.load(SeqCst) == seen && !sh.stop.load(SeqCst) {
                    g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleepers.fetch_sub(1, SeqCst);
                drop(g);
                spins = 0;
            }
        }
        sh.active.fetch_add(1, SeqCst);
        if sh.open.load(SeqCst) == seen {
            let parts = sh.parts.load(Relaxed);
            // SAFETY: `open` names this job and this worker counts in `active`, so the
            // caller of `run` keeps `job` set and its function alive until we leave.
            if let Some(job) = unsafe { *sh.job.get() } {
                // SAFETY: as above.
                sh.work(unsafe { &*job }, parts);
            }
        }
        sh.active.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_and_the_caller_waits_for_all() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads, "test").unwrap();
            assert_eq!(pool.threads(), threads);
            for round in 0..200usize {
                let parts = round % 9;
                let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
                pool.run(parts, &|i| {
                    if i % 3 == 0 {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                    hits[i].fetch_add(1, SeqCst);
                });
                assert!(
                    hits.iter().all(|h| h.load(SeqCst) == 1),
                    "{threads} threads"
                );
            }
            // After the workers went to sleep, a job wakes them.
            std::thread::sleep(SPIN * 3);
            let seen = Mutex::new(std::collections::HashSet::new());
            pool.for_each((0..64).collect(), |i: usize| {
                std::thread::sleep(Duration::from_micros(200));
                seen.lock()
                    .unwrap()
                    .insert((i, std::thread::current().id()));
            });
            let seen = seen.into_inner().unwrap();
            assert_eq!(seen.len(), 64);
            let ids: std::collections::HashSet<_> = seen.iter().map(|s| s.1).collect();
            assert!(ids.len() <= threads);
        }
    }

    #[test]
    fn a_panicking_part_is_raised_after_the_others_ran() {
        let pool = Pool::new(3, "test").unwrap();
        let ran = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(10, &|i| {
                ran.fetch_add(1, SeqCst);
                assert!(i != 4, "part four");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(SeqCst), 10);
        // The pool still works.
        let n = AtomicUsize::new(0);
        pool.run(7, &|_| {
            n.fetch_add(1, SeqCst);
        });
        assert_eq!(n.load(SeqCst), 7);
    }

    #[test]
    fn nested_and_concurrent_runs_run_inline() {
        let pool = Arc::new(Pool::new(2, "test").unwrap());
        let n = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                n.fetch_add(1, SeqCst);
            })
        });
        assert_eq!(n.load(SeqCst), 12);
        let total = Arc::new(AtomicUsize::new(0));
        let others: Vec<_> = (0..3)
            .map(|_| {
                let (pool, total) = (Arc::clone(&pool), Arc::clone(&total));
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        pool.run(5, &|_| {
                            total.fetch_add(1, SeqCst);
                        });
                    }
                })
            })
            .collect();
        for t in others {
            t.join().unwrap();
        }
        assert_eq!(total.load(SeqCst), 1500);
    }
}
