//! `InTurn` handing work to the workers, and `Fill` landing its bytes from any number of
//! threads.

use super::*;
use std::sync::Arc;

/// Deferred work that counts the times it was handed to workers.
struct Counted(Arc<AtomicUsize>);

impl Deferred for Counted {
    fn spawn(&self, _: &dyn Workers) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn busy(&self) -> bool {
        false
    }
    fn help(&self) -> bool {
        false
    }
}

/// One stream's work goes to the workers only after another stream's: its own earlier work
/// is finished before its next is handed over, so nothing would run beside it.
#[test]
fn work_goes_to_the_workers_only_after_another_owners() {
    let spawned = Arc::new(AtomicUsize::new(0));
    let count = || spawned.load(Ordering::Relaxed);
    let mut q = InTurn::default();
    // A stream alone, its work finished before the next: only its first is handed over.
    for i in 0..5 {
        q.push(7, i, Counted(spawned.clone()), Some(&Inline));
        assert!(q.pop_front().is_some());
    }
    assert_eq!(count(), 1);
    // Streams taking turns: every one's is.
    for i in 0..8 {
        q.push(i % 4, i as usize, Counted(spawned.clone()), Some(&Inline));
    }
    assert_eq!(count(), 9);
    assert_eq!(q.len(), 8);
    // Without workers, none is.
    q.push(1, 8, Counted(spawned.clone()), None);
    assert_eq!(count(), 9);
}

/// A fill copies its sources, in order and whole, however many threads complete it at once
/// and whichever of them takes each part; the bytes before and after its room are not
/// touched.
#[test]
fn a_fill_lands_its_bytes_exactly_from_any_number_of_threads() {
    let src: Vec<u8> = (0..8_000_003u32).map(|i| (i * 7 + i / 251) as u8).collect();
    // Sources of uneven sizes: parts split within and across them.
    let mut sources = Vec::new();
    let (mut at, mut k) = (0, 1usize);
    while at < src.len() {
        let n = (k * 37_501 % 150_000 + 1).min(src.len() - at);
        sources.push(bytes::Bytes::copy_from_slice(&src[at..at + n]));
        at += n;
        k += 1;
    }
    for threads in [1, 2, 4] {
        let mut buf: Vec<u8> = vec![0xAA; 16];
        buf.reserve(src.len() + 16);
        let held = buf.len();
        // SAFETY: the room past `held` is reserved, and nothing else touches `buf` until
        // the fill is complete.
        let fill = unsafe { Fill::new(buf.as_mut_ptr().add(held), sources.clone()) };
        assert_eq!(fill.len(), src.len());
        assert!(fill.parts.iter().all(|p| p.1.len() <= FILL_PART));
        let room = buf.as_ptr() as usize + held;
        let start = std::sync::Barrier::new(threads);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    start.wait();
                    fill.complete();
                    let copied = fill.copied.load(Ordering::Acquire);
                    assert_eq!(copied, fill.parts.len(), "complete with parts uncopied");
                    // SAFETY: once `complete` returns, every byte of the room is written
                    // and nobody writes it any more.
                    let got = unsafe { std::slice::from_raw_parts(room as *const u8, src.len()) };
                    assert!(got == src, "complete before every part was copied");
                });
            }
        });
        fill.complete();
        // SAFETY: complete: every byte of the room is written.
        unsafe { buf.set_len(held + fill.len()) };
        assert!(buf[..held].iter().all(|&b| b == 0xAA));
        assert!(buf[held..] == src[..], "{threads} threads");
    }
    // Nothing to copy: complete at once.
    let mut empty: Vec<u8> = Vec::new();
    // SAFETY: no bytes are written.
    let none = unsafe { Fill::new(empty.as_mut_ptr(), Vec::new()) };
    none.complete();
    assert_eq!(none.len(), 0);
}

/// A lock another thread holds is taken once it lets go, and the time spent spinning for it
/// is counted for the pool's judge (at most `SPIN_WAIT` a wait); a free one costs no spin.
#[test]
fn a_lock_waited_for_is_taken_and_its_spin_counted() {
    let m = Mutex::new(0u32);
    let before = spun();
    *lock_soon(&m) += 1;
    assert_eq!(spun(), before, "a free lock is taken without spinning");
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let m = &m;
        s.spawn(move || {
            let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
            tx.send(()).ok();
            // Held past the wait: the waiter spins, yields, then sleeps on the lock.
            std::thread::sleep(std::time::Duration::from_millis(5));
            *g += 1;
        });
        rx.recv().ok();
        assert_eq!(*lock_soon(m), 2, "taken once the holder let go");
    });
    let d = spun() - before;
    assert!(d > std::time::Duration::ZERO && d <= SPIN_WAIT, "{d:?}");
}
