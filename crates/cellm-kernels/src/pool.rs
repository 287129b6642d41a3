//! A persistent worker pool for the forward pass. Small models run hundreds of short parallel
//! loops per token, so a loop costs a few atomics: the caller publishes a job, workers claim
//! task indices from one packed counter, the caller works too and waits for the last task.
//! Idle workers spin briefly, then sleep on a condition variable.
//!
//! The claim counter packs (generation, task count, next index) in one u64, so a worker that
//! wakes late for a finished job can never claim a task of the next one with a stale closure.

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const INDEX_BITS: u32 = 24;
const COUNT_BITS: u32 = 24;
const MAX_TASKS: usize = (1 << INDEX_BITS) - 1;
/// How long an idle worker spins before it sleeps: long enough to bridge the gap between
/// the loops of one forward, short enough not to burn a core between requests.
const SPIN: Duration = Duration::from_micros(200);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

fn pack(gen: u64, count: usize, next: usize) -> u64 {
    (gen << (INDEX_BITS + COUNT_BITS)) | ((count as u64) << INDEX_BITS) | next as u64
}

fn unpack(s: u64) -> (u64, usize, usize) {
    let mask = |bits: u32| (1u64 << bits) - 1;
    (
        s >> (INDEX_BITS + COUNT_BITS),
        ((s >> INDEX_BITS) & mask(COUNT_BITS)) as usize,
        (s & mask(INDEX_BITS)) as usize,
    )
}

struct Shared {
    state: AtomicU64,
    /// The current job's closure, as a thin pointer to a fat `&Task` on the caller's stack.
    job: AtomicPtr<&'static Task<'static>>,
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Shared {
    /// Claims and runs tasks of generation `gen` until none are left.
    fn work(&self, gen: u64) {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (g, count, next) = unpack(s);
            if g != gen || next >= count {
                return;
            }
            match self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // SAFETY: task `next` of `gen` is claimed and not done, so the caller is
                    // still inside `run` and the closure it published is alive.
                    let task = unsafe { *self.job.load(Ordering::Acquire) };
                    if catch_unwind(AssertUnwindSafe(|| task(next))).is_err() {
                        self.panicked.store(true, Ordering::Relaxed);
                    }
                    self.done.fetch_add(1, Ordering::AcqRel);
                    s = self.state.load(Ordering::Acquire);
                }
                Err(current) => s = current,
            }
        }
    }
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    generation: AtomicU64,
    /// Set while a job runs: a second caller at the same time runs its loop inline.
    busy: AtomicBool,
}

thread_local! {
    static CURRENT: Cell<*const ThreadPool> = const { Cell::new(std::ptr::null()) };
}

impl ThreadPool {
    /// A pool of `threads` threads in all: the caller plus `threads - 1` workers.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("cellm-{i}")).spawn(move || worker(&s))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Self { shared, workers, generation: AtomicU64::new(0), busy: AtomicBool::new(false) })
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f` with this pool as the one [`parallel_for`] uses on this thread.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        let previous = CURRENT.with(|c| c.replace(self as *const _));
        struct Restore(*const ThreadPool);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(previous);
        f()
    }

    /// Calls `f(i)` for every `i < tasks`, spread over the pool; returns when all are done.
    pub fn run(&self, tasks: usize, f: &Task) {
        if tasks == 0 {
            return;
        }
        if self.workers.is_empty() || tasks == 1 || self.busy.swap(true, Ordering::Acquire) {
            (0..tasks).for_each(f);
            return;
        }
        struct Release<'a>(&'a AtomicBool);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _release = Release(&self.busy);
        assert!(tasks <= MAX_TASKS, "too many tasks in one parallel loop");
        let sh = &*self.shared;
        let gen_mask = (1 << (64 - INDEX_BITS - COUNT_BITS)) - 1;
        let gen = (self.generation.fetch_add(1, Ordering::Relaxed) + 1) & gen_mask;
        // SAFETY (lifetime erasure): workers dereference `job` only while holding a claimed,
        // unfinished task of this generation, and this function returns only after every task
        // is done, so `f` outlives every use.
        let erased: &&'static Task<'static> = unsafe { std::mem::transmute(&f) };
        sh.job.store(erased as *const _ as *mut _, Ordering::Release);
        sh.done.store(0, Ordering::Relaxed);
        sh.state.store(pack(gen, tasks, 0), Ordering::Release);
        if sh.sleepers.load(Ordering::Acquire) > 0 {
            let _g = sh.lock.lock().expect("pool lock");
            sh.wake.notify_all();
        }
        sh.work(gen);
        while sh.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        if sh.panicked.swap(false, Ordering::Relaxed) {
            resume_unwind(Box::new("a parallel task panicked"));
        }
    }
}

fn worker(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        let spin_until = Instant::now() + SPIN;
        let mut gen = unpack(sh.state.load(Ordering::Acquire)).0;
        let mut spins = 0u32;
        while gen == seen && !sh.shutdown.load(Ordering::Relaxed) {
            spins = spins.wrapping_add(1);
            // Reading the clock costs more than a spin: look at it once in a while.
            if !spins.is_multiple_of(256) || Instant::now() < spin_until {
                std::hint::spin_loop();
            } else {
                let mut guard = sh.lock.lock().expect("pool lock");
                sh.sleepers.fetch_add(1, Ordering::AcqRel);
                while unpack(sh.state.load(Ordering::Acquire)).0 == seen
                    && !sh.shutdown.load(Ordering::Relaxed)
                {
                    guard = sh.wake.wait(guard).expect("pool lock");
                }
                sh.sleepers.fetch_sub(1, Ordering::AcqRel);
            }
            gen = unpack(sh.state.load(Ordering::Acquire)).0;
        }
        if sh.shutdown.load(Ordering::Relaxed) {
            return;
        }
        seen = gen;
        sh.work(gen);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _g = self.shared.lock.lock().expect("pool lock");
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A raw output pointer that parallel tasks write disjoint parts of.
pub struct SharedOut<T = f32>(pub *mut T);
// SAFETY: users guarantee that tasks write disjoint elements.
unsafe impl<T> Send for SharedOut<T> {}
unsafe impl<T> Sync for SharedOut<T> {}

// Manual impls: derived ones would require `T: Copy`, needlessly.
impl<T> Clone for SharedOut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// Taking `self` whole makes closures capture the Send wrapper, not the raw field.
    pub fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

/// Calls `f(i)` for `i < tasks` on the installed pool, or inline when there is none.
pub fn parallel_for(tasks: usize, f: impl Fn(usize) + Sync) {
    let pool = CURRENT.with(Cell::get);
    if pool.is_null() {
        (0..tasks).for_each(f);
    } else {
        // SAFETY: `install` keeps the pool alive while it is current on this thread.
        unsafe { &*pool }.run(tasks, &f);
    }
}

/// Calls `f` on ranges that together cover `0..pieces` exactly once, over the installed
/// pool. Each thread owns a contiguous share and takes it one piece at a time from the
/// front; a thread whose share is done takes single pieces from the back of the share with
/// the most left. A thread's reads then stay one stream in memory (the hardware prefetcher
/// follows it), and the threads finish within a piece of each other: with fixed tasks the
/// last one left a thread idle for up to a whole task at the end of every loop.
pub fn parallel_ranges(pieces: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let threads = current_threads();
    if threads == 1 || pieces < 2 {
        if pieces > 0 {
            f(0..pieces);
        }
        return;
    }
    let shares: Vec<Share> = (0..threads)
        .map(|i| Share::new(i * pieces / threads, (i + 1) * pieces / threads))
        .collect();
    parallel_for(threads, |own| {
        while let Some(p) = shares[own].take(true) {
            f(p..p + 1);
        }
        loop {
            let Some(most) = shares.iter().max_by_key(|s| s.left()).filter(|s| s.left() > 0) else {
                return;
            };
            if let Some(p) = most.take(false) {
                f(p..p + 1);
            }
        }
    });
}

/// The pieces `front..back` of a thread's share, packed in one word so the owner (front)
/// and a thief (back) can never take the same piece. Alone on its cache line.
#[repr(align(64))]
struct Share(AtomicU64);

impl Share {
    fn new(front: usize, back: usize) -> Self {
        Self(AtomicU64::new(((front as u64) << 32) | back as u64))
    }

    fn left(&self) -> usize {
        let s = self.0.load(Ordering::Relaxed);
        ((s & 0xFFFF_FFFF) as usize).saturating_sub((s >> 32) as usize)
    }

    /// Takes the first piece left (`front`) or the last.
    fn take(&self, front: bool) -> Option<usize> {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            let (lo, hi) = (s >> 32, s & 0xFFFF_FFFF);
            if lo >= hi {
                return None;
            }
            let (next, piece) = if front { (s + (1 << 32), lo) } else { (s - 1, hi - 1) };
            match self.0.compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(piece as usize),
                Err(now) => s = now,
            }
        }
    }
}

/// Threads of the installed pool (1 when none).
pub fn current_threads() -> usize {
    let pool = CURRENT.with(Cell::get);
    if pool.is_null() {
        1
    } else {
        // SAFETY: as in `parallel_for`.
        unsafe { &*pool }.threads()
    }
}

/// Streams `buf` once on the installed pool and returns a checksum: a read-bandwidth probe
/// (the roofline of decode), measured with the same threads the engine uses.
pub fn stream_read(buf: &[u64]) -> u64 {
    let threads = current_threads();
    let chunk = buf.len().div_ceil(threads * 8).max(1);
    let sums: Vec<AtomicU64> = (0..buf.len().div_ceil(chunk)).map(|_| AtomicU64::new(0)).collect();
    parallel_for(sums.len(), |i| {
        let part = &buf[i * chunk..((i + 1) * chunk).min(buf.len())];
        // Four independent lanes so the sum is not one long dependency chain.
        let mut acc = [0u64; 4];
        for c in part.chunks_exact(4) {
            for (a, v) in acc.iter_mut().zip(c) {
                *a = a.wrapping_add(*v);
            }
        }
        sums[i].store(acc.iter().fold(0, |s, v| s.wrapping_add(*v)), Ordering::Relaxed);
    });
    sums.iter().fold(0, |s, v| s.wrapping_add(v.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let pool = ThreadPool::new(3).unwrap();
        for tasks in [1usize, 2, 3, 7, 64, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.install(|| {
                    parallel_for(tasks, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    })
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn ranges_cover_every_piece_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            for pieces in [0usize, 1, 2, 5, 64, 1001] {
                let hits: Vec<AtomicUsize> = (0..pieces).map(|_| AtomicUsize::new(0)).collect();
                pool.install(|| {
                    parallel_ranges(pieces, |r| {
                        r.for_each(|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        })
                    })
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{threads} {pieces}");
            }
        }
    }

    #[test]
    fn workers_sleep_and_wake() {
        let pool = ThreadPool::new(2).unwrap();
        std::thread::sleep(SPIN * 5);
        let sum = AtomicUsize::new(0);
        pool.run(100, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_not_the_pool() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(8, &|i| assert!(i != 5))));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}
