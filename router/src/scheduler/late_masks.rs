//! Late masks: the masks of a plan's `mask_late` rows, once the step before it is committed.
//!
//! Under overlap the scheduler plans step N+1 while N runs. A request under a grammar whose
//! input in N+1 is the token it samples in N cannot have its N+1 mask yet (the grammar has not
//! seen that token), yet leaving it out of N+1 would run it every other step. So it is planned
//! like any other request with its row marked `mask_late`, and once N's result is committed
//! (its grammar advanced by that token) the engine sends rank 0 the row's mask in a `masks`
//! message, which the worker waits for after queueing N+1's forward and before its sampling.

use crate::protocol::PlannedRequest;

use super::Scheduler;

impl Scheduler {
    /// `(request id, mask words)` for this scheduler's late rows among `requests`. A row whose
    /// request has ended (or is ending) meanwhile is left out: it samples unmasked and its token
    /// is dropped when the result comes back. So is one whose grammar has not started and that
    /// has no `allowed_token_ids`. A grammar that cannot go on refuses its request.
    pub fn late_masks<'p>(
        &mut self,
        requests: impl Iterator<Item = &'p PlannedRequest>,
    ) -> Vec<(u64, Vec<u32>)> {
        let mut wanted = Vec::new();
        let mut ids = Vec::new();
        for pr in requests.filter(|pr| pr.mask_late) {
            let Some(&slot) = self.index.get(&pr.id) else {
                continue;
            };
            if self.req(slot).retiring.is_none() {
                wanted.push((ids.len(), slot));
                ids.push(pr.id);
            }
        }
        self.masks_of(&wanted)
            .into_iter()
            .filter_map(|(k, mask)| Some((ids[k], mask?)))
            .collect()
    }
}
