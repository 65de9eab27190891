//! Radix prefix cache at page granularity.
//!
//! Each node below the root stands for one FULL page of tokens: the path from the root spells a
//! token prefix and each node names the page holding that page's KV (MLA latent and indexer
//! key share the slot, so sharing the page shares both). Only full pages are ever inserted, so
//! a page a request is still writing is never shared.
//!
//! The tree holds one reference to every page it indexes. A node can be evicted when it is a
//! leaf and the tree's reference is the page's only one; such leaves sit in an LRU set ordered
//! by a logical clock, kept exact as references and children change.
//!
//! The same token prefix can be computed twice (two requests admitted before either was
//! cached); the first insert wins and the second request keeps its own copy until it finishes.
//! A node's children are keyed by a hash of their page's tokens; the tokens are compared too,
//! and a hash collision simply stops matching or inserting (a cache miss, never a wrong hit).
//!
//! A request's `cache_salt` (vLLM's field) puts its pages under a root of their own: only
//! requests with the same salt share them, so one tenant cannot learn from cache timing
//! whether another sent a prompt. Unsalted requests share the main root. A salt's root exists
//! while it has children; eviction removes it with its last page.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::allocator::{PageAllocator, PageId};

type NodeId = u32;
const ROOT: NodeId = 0;
const NO_NODE: NodeId = u32::MAX;

#[derive(Debug)]
struct Node {
    parent: NodeId,
    /// The page's tokens (exactly `page_size` of them); empty for the root.
    tokens: Box<[i32]>,
    page: PageId,
    children: HashMap<u64, NodeId>,
    last_access: u64,
    /// The key under which this node sits in the LRU set, if it does.
    lru_key: Option<u64>,
    /// Set on a salt's root (no page) only.
    salt: Option<Arc<str>>,
}

#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    /// Which node indexes each page (`NO_NODE` if none).
    node_of_page: Vec<NodeId>,
    /// Evictable leaves, oldest first.
    lru: BTreeSet<(u64, NodeId)>,
    clock: u64,
    /// The root of each salt's pages.
    salt_roots: HashMap<Arc<str>, NodeId>,
}

/// FNV-1a over the tokens' bytes: cheap, and collisions are harmless (see module docs).
fn hash_tokens(tokens: &[i32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        for b in t.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl RadixCache {
    pub fn new(page_size: u32, num_pages: u32) -> Self {
        let root = Node {
            parent: NO_NODE,
            tokens: Box::new([]),
            page: -1,
            children: HashMap::new(),
            last_access: 0,
            lru_key: None,
            salt: None,
        };
        Self {
            page_size: page_size as usize,
            nodes: vec![root],
            free_nodes: Vec::new(),
            node_of_page: vec![NO_NODE; num_pages as usize],
            lru: BTreeSet::new(),
            clock: 0,
            salt_roots: HashMap::new(),
        }
    }

    /// The root a salt's pages hang from, if it has any (the main root without a salt).
    fn root(&self, salt: Option<&str>) -> Option<NodeId> {
        match salt {
            None => Some(ROOT),
            Some(s) => self.salt_roots.get(s).copied(),
        }
    }

    fn is_root(&self, node: NodeId) -> bool {
        node == ROOT || self.nodes[node as usize].salt.is_some()
    }

    /// Pages the tree indexes.
    #[cfg(test)]
    pub fn cached_pages(&self) -> usize {
        self.nodes.len() - 1 - self.free_nodes.len()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn child(&self, node: NodeId, tokens: &[i32]) -> Option<NodeId> {
        let c = *self.nodes[node as usize]
            .children
            .get(&hash_tokens(tokens))?;
        (*self.nodes[c as usize].tokens == *tokens).then_some(c)
    }

    /// Puts a node in the LRU set if it is an evictable leaf, or takes it out if not.
    fn refresh(&mut self, node: NodeId, alloc: &PageAllocator) {
        if self.is_root(node) {
            return;
        }
        let n = &mut self.nodes[node as usize];
        if let Some(k) = n.lru_key.take() {
            self.lru.remove(&(k, node));
        }
        if n.children.is_empty() && alloc.refs(n.page) == 1 {
            n.lru_key = Some(n.last_access);
            self.lru.insert((n.last_access, node));
        }
    }

    /// Longest cached prefix of `tokens`, at most `max_pages` pages. The matched pages gain a
    /// reference each (the caller owns them now) and count as recently used.
    pub fn match_prefix(
        &mut self,
        tokens: &[i32],
        salt: Option<&str>,
        max_pages: usize,
        alloc: &mut PageAllocator,
    ) -> Vec<PageId> {
        let now = self.tick();
        let mut pages = Vec::new();
        let Some(mut node) = self.root(salt) else {
            return pages;
        };
        for chunk in tokens.chunks_exact(self.page_size).take(max_pages) {
            let Some(c) = self.child(node, chunk) else {
                break;
            };
            let page = self.nodes[c as usize].page;
            alloc.retain(page);
            self.nodes[c as usize].last_access = now;
            self.refresh(c, alloc);
            pages.push(page);
            node = c;
        }
        pages
    }

    /// How many pages of `tokens` (at most `max_pages`) the tree holds, changing nothing: for
    /// choosing where a request goes, not for taking the pages.
    pub fn peek_prefix(&self, tokens: &[i32], salt: Option<&str>, max_pages: usize) -> usize {
        let Some(mut node) = self.root(salt) else {
            return 0;
        };
        let mut n = 0;
        for chunk in tokens.chunks_exact(self.page_size).take(max_pages) {
            let Some(c) = self.child(node, chunk) else {
                break;
            };
            n += 1;
            node = c;
        }
        n
    }

    /// Indexes the full pages of a sequence: `tokens` covers exactly `pages.len()` pages and
    /// `pages[k]` holds the KV of `tokens[k*page_size..(k+1)*page_size]`; the caller holds a
    /// reference to each. New pages gain the tree's reference. Where the tree already has
    /// the same prefix on another page (computed twice), the caller's entry is swapped for
    /// the tree's page and its own copy released: this frees the duplicate at once, and keeps
    /// the rule that whoever holds a node's page holds its ancestors' pages too, so a cached
    /// ancestor is never pinned by a request that does not hold it.
    pub fn insert(
        &mut self,
        tokens: &[i32],
        salt: Option<&str>,
        pages: &mut [PageId],
        alloc: &mut PageAllocator,
    ) {
        debug_assert_eq!(tokens.len(), pages.len() * self.page_size);
        if pages.is_empty() {
            return;
        }
        let root = match (salt, self.root(salt)) {
            (_, Some(root)) => root,
            (Some(s), None) => {
                let root = self.new_node(NO_NODE, &[], -1);
                let salt: Arc<str> = s.into();
                self.nodes[root as usize].salt = Some(salt.clone());
                self.salt_roots.insert(salt, root);
                root
            }
            (None, None) => unreachable!("the main root always exists"),
        };
        self.insert_below(root, tokens, pages, alloc);
        if self.nodes[root as usize].children.is_empty() && root != ROOT {
            // Nothing went in (the pages sit elsewhere already): no empty salt root stays.
            self.remove_salt_root(root);
        }
    }

    fn insert_below(
        &mut self,
        root: NodeId,
        tokens: &[i32],
        pages: &mut [PageId],
        alloc: &mut PageAllocator,
    ) {
        let now = self.tick();
        let mut node = root;
        for (chunk, page) in tokens.chunks_exact(self.page_size).zip(pages.iter_mut()) {
            let key = hash_tokens(chunk);
            let next = match self.nodes[node as usize].children.get(&key) {
                Some(&c) if *self.nodes[c as usize].tokens == *chunk => {
                    let cached = self.nodes[c as usize].page;
                    if cached != *page {
                        alloc.retain(cached);
                        let own = std::mem::replace(page, cached);
                        alloc.release(own);
                        self.page_released(own, alloc);
                    }
                    c
                }
                // A hash collision with other tokens: the path cannot go on.
                Some(_) => break,
                None => {
                    if self.node_of_page[*page as usize] != NO_NODE {
                        // The page already sits elsewhere in the tree; a page has one node.
                        break;
                    }
                    let c = self.new_node(node, chunk, *page);
                    self.nodes[node as usize].children.insert(key, c);
                    alloc.mark_cached(*page);
                    self.refresh(node, alloc);
                    c
                }
            };
            self.nodes[next as usize].last_access = now;
            self.refresh(next, alloc);
            node = next;
        }
    }

    /// A node for `page` below `parent` (no page and no parent: a salt's root).
    fn new_node(&mut self, parent: NodeId, tokens: &[i32], page: PageId) -> NodeId {
        let n = Node {
            parent,
            tokens: tokens.into(),
            page,
            children: HashMap::new(),
            last_access: 0,
            lru_key: None,
            salt: None,
        };
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = n;
                id
            }
            None => {
                self.nodes.push(n);
                (self.nodes.len() - 1) as NodeId
            }
        };
        if page >= 0 {
            self.node_of_page[page as usize] = id;
        }
        id
    }

    fn remove_salt_root(&mut self, root: NodeId) {
        let n = &mut self.nodes[root as usize];
        debug_assert!(n.children.is_empty());
        let salt = n.salt.take().expect("a salt root");
        self.salt_roots.remove(&salt);
        self.free_nodes.push(root);
    }

    /// A holder other than the tree dropped its reference to `page`: the page's node may have
    /// become evictable.
    pub fn page_released(&mut self, page: PageId, alloc: &PageAllocator) {
        let node = self.node_of_page[page as usize];
        if node != NO_NODE {
            self.refresh(node, alloc);
        }
    }

    /// Evicts least recently used unreferenced leaves until `want` pages were freed or none is
    /// left to evict. Returns the number of pages freed.
    pub fn evict(&mut self, want: usize, alloc: &mut PageAllocator) -> usize {
        let mut freed = 0;
        while freed < want {
            let Some((_, node)) = self.lru.pop_first() else {
                break;
            };
            self.nodes[node as usize].lru_key = None;
            self.remove_leaf(node, alloc);
            freed += 1;
        }
        freed
    }

    fn remove_leaf(&mut self, node: NodeId, alloc: &mut PageAllocator) {
        let n = &mut self.nodes[node as usize];
        debug_assert!(n.children.is_empty());
        let (parent, page) = (n.parent, n.page);
        let key = hash_tokens(&n.tokens);
        n.tokens = Box::new([]);
        n.children = HashMap::new();
        n.page = -1;
        self.nodes[parent as usize].children.remove(&key);
        self.node_of_page[page as usize] = NO_NODE;
        let freed = alloc.unmark_cached(page);
        debug_assert!(freed, "evicted page {page} was still referenced");
        self.free_nodes.push(node);
        if parent != ROOT && self.is_root(parent) {
            if self.nodes[parent as usize].children.is_empty() {
                self.remove_salt_root(parent);
            }
        } else {
            self.refresh(parent, alloc);
        }
    }

    /// Drops the whole tree (the workers lost their KV). Pages still referenced elsewhere stay
    /// allocated to their other holders.
    pub fn clear(&mut self, alloc: &mut PageAllocator) {
        // Freed node slots have page -1, so this visits exactly the live nodes.
        for n in self.nodes.iter().skip(1).filter(|n| n.page >= 0) {
            alloc.unmark_cached(n.page);
        }
        *self = Self::new(self.page_size as u32, self.node_of_page.len() as u32);
    }

    /// Structural check for tests: parent/child links, page index, LRU set exactly the
    /// evictable leaves, every indexed page carries the tree's reference.
    pub fn check(&self, alloc: &PageAllocator) -> Result<(), String> {
        let live: Vec<bool> = {
            let mut v = vec![true; self.nodes.len()];
            for &f in &self.free_nodes {
                v[f as usize] = false;
            }
            v
        };
        let mut cached_pages = 0;
        let mut live_salt_roots = 0;
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            if !live[i] {
                continue;
            }
            let id = i as NodeId;
            if let Some(salt) = &n.salt {
                live_salt_roots += 1;
                if self.salt_roots.get(salt) != Some(&id) || n.children.is_empty() || n.page != -1 {
                    return Err(format!(
                        "node {i}: salt root not indexed, empty, or with a page"
                    ));
                }
                continue;
            }
            cached_pages += 1;
            if !alloc.is_cached(n.page) || self.node_of_page[n.page as usize] != id {
                return Err(format!(
                    "node {i}: page {} not indexed consistently",
                    n.page
                ));
            }
            let p = &self.nodes[n.parent as usize];
            if !live[n.parent as usize] || p.children.get(&hash_tokens(&n.tokens)) != Some(&id) {
                return Err(format!("node {i}: parent link broken"));
            }
            let evictable = n.children.is_empty() && alloc.refs(n.page) == 1;
            if evictable != n.lru_key.is_some_and(|k| self.lru.contains(&(k, id))) {
                return Err(format!(
                    "node {i}: LRU membership wrong (evictable = {evictable})"
                ));
            }
        }
        if self.lru.len()
            != self
                .nodes
                .iter()
                .skip(1)
                .filter(|n| n.lru_key.is_some())
                .count()
        {
            return Err("LRU set has stale entries".into());
        }
        if live_salt_roots != self.salt_roots.len() {
            return Err("salt roots indexed that are not live".into());
        }
        let indexed = self.node_of_page.iter().filter(|&&n| n != NO_NODE).count();
        if indexed != cached_pages {
            return Err(format!(
                "{indexed} pages indexed but {cached_pages} nodes live"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, base: i32) -> Vec<i32> {
        (0..n as i32).map(|i| base + i).collect()
    }

    fn take(alloc: &mut PageAllocator, n: usize) -> Vec<PageId> {
        (0..n).map(|_| alloc.alloc().unwrap()).collect()
    }

    #[test]
    fn match_finds_inserted_full_pages_only() {
        let mut a = PageAllocator::new(8);
        let mut t = RadixCache::new(4, 8);
        let toks = seq(10, 100);
        let pages = take(&mut a, 3);
        t.insert(&toks[..8], None, &mut pages[..2].to_vec(), &mut a);
        for &p in &pages {
            a.release(p);
            t.page_released(p, &a);
        }
        assert_eq!(a.free_count(), 6);
        let m = t.match_prefix(&toks, None, 10, &mut a);
        assert_eq!(m, pages[..2].to_vec());
        assert_eq!(t.match_prefix(&toks, None, 1, &mut a), pages[..1].to_vec());
        let mut other = toks.clone();
        other[5] = -1;
        assert_eq!(
            t.match_prefix(&other, None, 10, &mut a),
            pages[..1].to_vec()
        );
        t.check(&a).unwrap();
        a.check().unwrap();
    }

    #[test]
    fn eviction_takes_lru_unreferenced_leaves() {
        let mut a = PageAllocator::new(4);
        let mut t = RadixCache::new(2, 4);
        let x = take(&mut a, 2);
        t.insert(&[1, 2, 3, 4], None, &mut x.clone(), &mut a);
        let y = take(&mut a, 1);
        t.insert(&[9, 9], None, &mut y.clone(), &mut a);
        for &p in x.iter().chain(&y) {
            a.release(p);
            t.page_released(p, &a);
        }
        // [1,2] has a child, so only [3,4] and [9,9] are leaves; [3,4] is older.
        t.check(&a).unwrap();
        let held = t.match_prefix(&[9, 9, 0], None, 1, &mut a);
        assert_eq!(t.evict(1, &mut a), 1);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4], None, 2, &mut a).len(), 1);
        // Only [1,2]'s page is evictable once released; [9,9] is referenced.
        a.release(x[0]);
        t.page_released(x[0], &a);
        assert_eq!(t.evict(5, &mut a), 1);
        assert_eq!(a.refs(held[0]), 2);
        t.check(&a).unwrap();
        a.check().unwrap();
    }

    #[test]
    fn duplicate_insert_swaps_in_the_cached_page() {
        let mut a = PageAllocator::new(4);
        let mut t = RadixCache::new(2, 4);
        let mut first = take(&mut a, 1);
        let mut second = take(&mut a, 1);
        t.insert(&[5, 6], None, &mut first, &mut a);
        let dup = second[0];
        t.insert(&[5, 6], None, &mut second, &mut a);
        assert_eq!(t.cached_pages(), 1);
        assert_eq!(second, first);
        assert_eq!((a.refs(dup), a.refs(first[0])), (0, 3));
        for p in first.iter().chain(&second) {
            a.release(*p);
            t.page_released(*p, &a);
        }
        t.check(&a).unwrap();
        t.clear(&mut a);
        assert_eq!(a.free_count(), 4);
        a.check().unwrap();
    }

    #[test]
    fn a_salt_shares_pages_only_with_the_same_salt_and_goes_with_its_last_page() {
        let mut a = PageAllocator::new(8);
        let mut t = RadixCache::new(2, 8);
        let toks = [1, 2, 3, 4];
        let plain = take(&mut a, 2);
        let salted = take(&mut a, 2);
        t.insert(&toks, None, &mut plain.clone(), &mut a);
        t.insert(&toks, Some("tenant-a"), &mut salted.clone(), &mut a);
        for &p in plain.iter().chain(&salted) {
            a.release(p);
            t.page_released(p, &a);
        }
        t.check(&a).unwrap();
        // The same tokens under three names: each sees only its own pages.
        assert_eq!(t.peek_prefix(&toks, None, 2), 2);
        assert_eq!(t.peek_prefix(&toks, Some("tenant-a"), 2), 2);
        assert_eq!(t.peek_prefix(&toks, Some("tenant-b"), 2), 0);
        let got = t.match_prefix(&toks, Some("tenant-a"), 2, &mut a);
        assert_eq!(got, salted);
        assert!(t
            .match_prefix(&toks, Some("tenant-b"), 2, &mut a)
            .is_empty());
        for &p in &got {
            a.release(p);
            t.page_released(p, &a);
        }
        // Evicting everything removes the salt's root with its last page; the main root stays.
        assert_eq!(t.evict(8, &mut a), 4);
        assert!(t.salt_roots.is_empty());
        t.check(&a).unwrap();
        assert_eq!(a.free_count(), 8);
        // A salt comes back as new, and an insert that adds nothing leaves no empty root.
        let again = take(&mut a, 1);
        t.insert(&[7, 7], Some("tenant-a"), &mut again.clone(), &mut a);
        t.insert(&[7, 7], Some("tenant-c"), &mut again.clone(), &mut a);
        assert_eq!(
            t.salt_roots.len(),
            1,
            "the page already sits under tenant-a"
        );
        t.check(&a).unwrap();
        t.clear(&mut a);
        a.release(again[0]);
        assert_eq!(a.free_count(), 8);
        a.check().unwrap();
    }
}
