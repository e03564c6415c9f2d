//! Triton's rate limiter (its server's `--rate-limit=execution_count`): before a model
//! instance executes a batch it takes the resources its `instance_group.rate_limiter`
//! names, and gives them back when the batch is done, so instances that share a resource
//! (of any model) never run more at once than the resource has. Where several instances
//! wait, the one with the lowest priority value goes first in proportion: an instance of
//! priority 2 gets half the turns of one of priority 1 (stride scheduling: each turn
//! moves an instance's pass on by its priority, and the waiter with the lowest pass among
//! those whose resources are free goes next).
//!
//! A resource is per device unless `global`: instances on GPU d count against (name, d),
//! CPU instances against (name, -1). Its size is what the server options give for it, or
//! else the largest amount any one registered instance asks for (as in Triton), so each
//! instance can always run on its own.

use crate::status::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A resource: its name and device (None: global).
type Key = (Arc<str>, Option<i32>);

/// One `rate_limiter` resource of an instance group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Need {
    pub name: Arc<str>,
    pub global: bool,
    pub count: u32,
}

/// A resource and how much of it is taken.
struct Resource {
    key: Key,
    /// The size the server options give it.
    given: Option<u32>,
    /// `given`, or else the largest need of a registered instance.
    size: u32,
    in_use: u32,
}

#[derive(Default)]
struct State {
    /// Every resource an instance has named (indices stay valid).
    resources: Vec<Resource>,
    /// Every registered instance's needs (resource index, count), by slot id.
    needs: HashMap<u64, Vec<(usize, u32)>>,
    /// Instances waiting for their turn: (pass, ticket, slot id).
    waiting: Vec<(u64, u64, u64)>,
    /// The pass of the last turn given: a waiter's pass is at least this, so an instance
    /// that was idle does not take every turn until it catches up.
    vtime: u64,
    next_ticket: u64,
    next_id: u64,
}

impl State {
    fn fits(&self, needs: &[(usize, u32)]) -> bool {
        needs.iter().all(|&(i, c)| {
            let r = &self.resources[i];
            r.in_use + c <= r.size
        })
    }

    /// Recomputes the default sizes of resources `of` (after a register or a drop).
    fn resize(&mut self, of: &[(usize, u32)]) {
        for &(i, _) in of {
            let largest = (self.needs.values().flatten())
                .filter(|(j, _)| *j == i)
                .map(|(_, c)| *c)
                .max()
                .unwrap_or(0);
            let r = &mut self.resources[i];
            r.size = r.given.unwrap_or(largest);
        }
    }
}

pub struct RateLimiter {
    /// Sizes the server options give: (name, device or -1 for every device and the
    /// global resource, count).
    sizes: Vec<(String, i32, u32)>,
    st: Mutex<State>,
    cv: Condvar,
}

/// One instance's place in the rate limiter.
pub struct Slot {
    limiter: Arc<RateLimiter>,
    id: u64,
    needs: Vec<(usize, u32)>,
    /// The priority (at least 1): how far a turn moves the pass on.
    stride: u64,
    pass: AtomicU64,
}

/// Resources held while a batch executes; dropping it gives them back.
pub struct Grant {
    slot: Arc<Slot>,
}

impl RateLimiter {
    pub fn new(sizes: Vec<(String, i32, u32)>) -> Arc<RateLimiter> {
        Arc::new(RateLimiter {
            sizes,
            st: Mutex::new(State::default()),
            cv: Condvar::new(),
        })
    }

    /// The size the options give a resource, if they do.
    fn given(&self, key: &Key) -> Option<u32> {
        let named = |dev: i32| {
            (self.sizes.iter())
                .find(|(n, d, _)| **n == *key.0 && *d == dev)
                .map(|(_, _, c)| *c)
        };
        match key.1 {
            Some(d) if d >= 0 => named(d).or_else(|| named(-1)),
            _ => named(-1),
        }
    }

    /// Registers an instance on `device` (-1: the CPU). INVALID_ARGUMENT when the server
    /// options make a resource smaller than the instance needs (it could never run).
    pub fn register(
        self: &Arc<Self>,
        what: &str,
        needs: &[Need],
        device: i32,
        priority: u32,
    ) -> Result<Arc<Slot>> {
        for n in needs {
            let key: Key = (n.name.clone(), (!n.global).then_some(device));
            if let Some(size) = self.given(&key).filter(|s| *s < n.count) {
                return Err(Error::invalid(format!(
                    "{what}: rate_limiter resource '{}' needs {}, but the server gives it {size}{} (infer_server_options_add_rate_limit_resource)",
                    n.name,
                    n.count,
                    match key.1 {
                        None => " (global)".to_owned(),
                        Some(-1) => " on the CPU".to_owned(),
                        Some(d) => format!(" on GPU {d}"),
                    }
                )));
            }
        }
        let mut st = self.st.lock();
        let mut indexed = Vec::with_capacity(needs.len());
        for n in needs {
            let key: Key = (n.name.clone(), (!n.global).then_some(device));
            let i = match st.resources.iter().position(|r| r.key == key) {
                Some(i) => i,
                None => {
                    let given = self.given(&key);
                    st.resources.push(Resource {
                        key,
                        given,
                        size: 0,
                        in_use: 0,
                    });
                    st.resources.len() - 1
                }
            };
            indexed.push((i, n.count));
        }
        let id = st.next_id;
        st.next_id += 1;
        st.needs.insert(id, indexed.clone());
        st.resize(&indexed);
        let pass = st.vtime;
        drop(st);
        Ok(Arc::new(Slot {
            limiter: self.clone(),
            id,
            needs: indexed,
            stride: u64::from(priority.max(1)),
            pass: AtomicU64::new(pass),
        }))
    }
}

impl Slot {
    /// Waits for this instance's turn and resources.
    pub fn acquire(self: &Arc<Self>) -> Grant {
        let l = &self.limiter;
        let mut st = l.st.lock();
        let pass = self.pass.load(Ordering::Relaxed).max(st.vtime);
        // Alone and the resources free: no turn to wait for.
        if !(st.waiting.is_empty() && st.fits(&self.needs)) {
            let ticket = st.next_ticket;
            st.next_ticket += 1;
            st.waiting.push((pass, ticket, self.id));
            loop {
                let next = (st.waiting.iter())
                    .filter(|(_, _, id)| st.needs.get(id).is_some_and(|n| st.fits(n)))
                    .min()
                    .copied();
                if next.is_some_and(|(_, t, _)| t == ticket) {
                    break;
                }
                l.cv.wait(&mut st);
            }
            st.waiting.retain(|(_, t, _)| *t != ticket);
        }
        for &(i, c) in &self.needs {
            st.resources[i].in_use += c;
        }
        st.vtime = st.vtime.max(pass);
        self.pass.store(pass + self.stride, Ordering::Relaxed);
        let others = !st.waiting.is_empty();
        drop(st);
        if others {
            // The next waiter in line may fit too.
            l.cv.notify_all();
        }
        Grant { slot: self.clone() }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let l = &self.slot.limiter;
        let mut st = l.st.lock();
        for &(i, c) in &self.slot.needs {
            let r = &mut st.resources[i];
            r.in_use = r.in_use.saturating_sub(c);
        }
        let waiting = !st.waiting.is_empty();
        drop(st);
        if waiting {
            l.cv.notify_all();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.limiter.st.lock();
        st.needs.remove(&self.id);
        st.resize(&self.needs);
        drop(st);
        // Default sizes may have shrunk or waiters' order changed.
        self.limiter.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn need(name: &str, global: bool, count: u32) -> Need {
        Need {
            name: Arc::from(name),
            global,
            count,
        }
    }

    #[test]
    fn a_shared_resource_runs_one_at_a_time_and_priority_weights_turns() {
        // Two instances of priority 1 and two of priority 2 share R (room for one):
        // whenever R comes free, instances of both priorities wait for it.
        let l = RateLimiter::new(Vec::new());
        let slots: Vec<(Arc<Slot>, usize)> = [(1, -1), (1, 0), (2, -1), (2, 0)]
            .iter()
            .map(|&(p, dev)| {
                (
                    l.register("m", &[need("R", true, 1)], dev, p).unwrap(),
                    p as usize - 1,
                )
            })
            .collect();
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let turns: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::new(AtomicUsize::new(0))).collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads: Vec<_> = slots
            .into_iter()
            .map(|(slot, p)| (slot, turns[p].clone()))
            .map(|(slot, n)| {
                let (running, most, stop) = (running.clone(), most.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let g = slot.acquire();
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_micros(300));
                        running.fetch_sub(1, Ordering::SeqCst);
                        n.fetch_add(1, Ordering::SeqCst);
                        drop(g);
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "R has room for one");
        let (x, y) = (
            turns[0].load(Ordering::SeqCst),
            turns[1].load(Ordering::SeqCst),
        );
        let ratio = x as f64 / y.max(1) as f64;
        assert!(
            (1.6..=2.5).contains(&ratio),
            "priority 1 vs 2: {x} vs {y} turns"
        );
    }

    #[test]
    fn sizes_come_from_the_options_or_the_largest_need() {
        let l = RateLimiter::new(vec![("G".into(), 0, 2)]);
        // Per device: GPU 0 has 2 of G (given); GPU 1 the largest need.
        let err = l.register("m", &[need("G", false, 3)], 0, 1).err().unwrap();
        assert!(
            err.message
                .contains("needs 3, but the server gives it 2 on GPU 0"),
            "{err}"
        );
        let a = l.register("a", &[need("G", false, 1)], 0, 1).unwrap();
        let b = l.register("b", &[need("G", false, 1)], 0, 1).unwrap();
        let c = l.register("c", &[need("G", false, 3)], 1, 1).unwrap();
        let (ga, gb) = (a.acquire(), b.acquire()); // 2 on GPU 0: both at once
        let gc = c.acquire(); // GPU 1's G is 3
        let st = l.st.lock();
        let key: Key = (Arc::from("G"), Some(0));
        let g0 = st.resources.iter().find(|r| r.key == key).unwrap();
        assert_eq!((g0.in_use, g0.size), (2, 2));
        drop(st);
        drop((ga, gb, gc));
        let st = l.st.lock();
        assert!(st.resources.iter().all(|r| r.in_use == 0));
    }
}
