//! Callbacks kept inline, with no allocation: a plain function and two words of context
//! that only that function interprets. The C API's function-and-user-data pairs (a
//! request's response callback, the release callback of a lent buffer) reach the core
//! this way, built in `ffi/`; the core calls them without knowing they are C. (A boxed
//! closure would cost one heap allocation per request on the response path.)

/// The two words of context an [`InlineFn`] hands to its function.
pub type Words = [*mut (); 2];

/// A function of `A` bound to two words of context.
pub struct InlineFn<A> {
    func: unsafe fn(Words, A),
    words: Words,
}

// SAFETY: `InlineFn::new`'s contract makes the function with its words callable from any
// thread; the words are only handed back to it.
unsafe impl<A> Send for InlineFn<A> {}
// SAFETY: as above; calling through a shared reference is what that contract allows.
unsafe impl<A> Sync for InlineFn<A> {}

impl<A> InlineFn<A> {
    /// # Safety
    /// `func(words, a)` must be sound to run, on any thread, every time the owner of the
    /// `InlineFn` calls it (its owner states how often: a response sink until its FINAL,
    /// a lent buffer once).
    pub unsafe fn new(func: unsafe fn(Words, A), words: Words) -> InlineFn<A> {
        InlineFn { func, words }
    }

    pub fn call(&self, a: A) {
        // SAFETY: `new`'s contract.
        unsafe { (self.func)(self.words, a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    unsafe fn add(w: Words, a: u32) {
        // SAFETY: the test passes a live AtomicU32 as the first word.
        let counter = unsafe { &*(w[0] as *const AtomicU32) };
        counter.fetch_add(a + w[1] as usize as u32, Ordering::Relaxed);
    }

    #[test]
    fn calls_its_function_with_its_words() {
        let counter = AtomicU32::new(0);
        let words = [&counter as *const AtomicU32 as *mut (), 10usize as *mut ()];
        // SAFETY: `counter` outlives `f`; `add` reads only it and the number.
        let f = unsafe { InlineFn::new(add, words) };
        f.call(1);
        f.call(2);
        assert_eq!(counter.load(Ordering::Relaxed), 23);
    }
}
