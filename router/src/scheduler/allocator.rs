//! Reference-counted KV pages.
//!
//! A page can be held by several owners at once: the radix cache (one reference while the page
//! is in the tree) and every running request whose page list contains it. A page returns to the
//! free list when its last reference goes. Releasing a page nobody holds is a scheduler bug, so
//! it panics instead of corrupting the pool silently.

/// Page ids are `i32` because that is what the plan carries; the pool is checked to fit.
pub type PageId = i32;

#[derive(Debug)]
pub struct PageAllocator {
    /// References per page; 0 means free.
    refs: Vec<u32>,
    /// Whether the radix cache holds the page (one of its references).
    cached: Vec<bool>,
    free: Vec<PageId>,
    /// Pages whose only reference is the radix cache's: reclaimable by eviction.
    idle_cached: usize,
}

impl PageAllocator {
    pub fn new(num_pages: u32) -> Self {
        // Pop order hands out low page ids first, which keeps small tests readable.
        let free = (0..num_pages as PageId).rev().collect();
        Self {
            refs: vec![0; num_pages as usize],
            cached: vec![false; num_pages as usize],
            free,
            idle_cached: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Pages held only by the radix cache.
    pub fn idle_cached_count(&self) -> usize {
        self.idle_cached
    }

    pub fn refs(&self, page: PageId) -> u32 {
        self.refs[page as usize]
    }

    pub fn is_cached(&self, page: PageId) -> bool {
        self.cached[page as usize]
    }

    /// A fresh page with one reference, or `None` when the free list is empty.
    pub fn alloc(&mut self) -> Option<PageId> {
        let page = self.free.pop()?;
        debug_assert_eq!(self.refs[page as usize], 0);
        self.refs[page as usize] = 1;
        Some(page)
    }

    /// Adds a reference to a page somebody already holds.
    pub fn retain(&mut self, page: PageId) {
        let i = page as usize;
        assert!(self.refs[i] > 0, "retain of free page {page}");
        if self.cached[i] && self.refs[i] == 1 {
            self.idle_cached -= 1;
        }
        self.refs[i] += 1;
    }

    /// Drops one reference; returns true when the page went back to the free list.
    pub fn release(&mut self, page: PageId) -> bool {
        let i = page as usize;
        assert!(self.refs[i] > 0, "double free of page {page}");
        self.refs[i] -= 1;
        match self.refs[i] {
            0 => {
                debug_assert!(
                    !self.cached[i],
                    "page {page} freed while the radix cache holds it"
                );
                self.free.push(page);
                true
            }
            1 if self.cached[i] => {
                self.idle_cached += 1;
                false
            }
            _ => false,
        }
    }

    /// The radix cache takes a reference to a page it now indexes.
    pub fn mark_cached(&mut self, page: PageId) {
        let i = page as usize;
        assert!(!self.cached[i], "page {page} cached twice");
        self.retain(page);
        self.cached[i] = true;
    }

    /// The radix cache drops a page it indexed; returns true when the page became free.
    pub fn unmark_cached(&mut self, page: PageId) -> bool {
        let i = page as usize;
        assert!(self.cached[i], "page {page} is not cached");
        if self.refs[i] == 1 {
            self.idle_cached -= 1;
        }
        self.cached[i] = false;
        self.release(page)
    }

    /// Full consistency check, for tests: every page is either free (no references) or
    /// referenced, the free list has no duplicates, and the idle-cached count is exact.
    pub fn check(&self) -> Result<(), String> {
        let mut on_free_list = vec![false; self.refs.len()];
        for &p in &self.free {
            let i = p as usize;
            if on_free_list[i] {
                return Err(format!("page {p} twice on the free list"));
            }
            on_free_list[i] = true;
            if self.refs[i] != 0 {
                return Err(format!(
                    "page {p} is free but has {} references",
                    self.refs[i]
                ));
            }
        }
        let mut idle = 0;
        for (i, &r) in self.refs.iter().enumerate() {
            if r == 0 && !on_free_list[i] {
                return Err(format!("page {i} has no references but is not free (leak)"));
            }
            if self.cached[i] && r == 0 {
                return Err(format!("page {i} is cached without a reference"));
            }
            if self.cached[i] && r == 1 {
                idle += 1;
            }
        }
        if idle != self.idle_cached {
            return Err(format!(
                "idle cached count {} but {idle} pages are idle in the cache",
                self.idle_cached
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_retain_release_returns_pages() {
        let mut a = PageAllocator::new(3);
        let p = a.alloc().unwrap();
        let q = a.alloc().unwrap();
        let r = a.alloc().unwrap();
        assert_eq!((p, q, r), (0, 1, 2));
        assert!(a.alloc().is_none());
        a.retain(q);
        assert!(!a.release(q));
        assert!(a.release(q));
        assert_eq!(a.free_count(), 1);
        a.check().unwrap();
    }

    #[test]
    fn idle_cached_tracks_cache_only_pages() {
        let mut a = PageAllocator::new(2);
        let p = a.alloc().unwrap();
        a.mark_cached(p);
        assert_eq!(a.idle_cached_count(), 0);
        a.release(p);
        assert_eq!(a.idle_cached_count(), 1);
        a.retain(p);
        assert_eq!(a.idle_cached_count(), 0);
        a.release(p);
        assert!(a.unmark_cached(p));
        assert_eq!((a.idle_cached_count(), a.free_count()), (0, 2));
        a.check().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = PageAllocator::new(1);
        let p = a.alloc().unwrap();
        a.release(p);
        a.release(p);
    }
}
