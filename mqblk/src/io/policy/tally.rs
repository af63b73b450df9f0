//! Outcomes counted an epoch at a time: the policies that adapt from a hit rate (the poll
//! window, the wait for the engine) decide once per epoch of a fixed number of outcomes, from
//! how many of them hit.

/// The outcomes, and the hits among them, of the epoch under way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HitTally {
    outcomes: u32,
    hits: u32,
}

impl HitTally {
    /// Counts one outcome. Once `epoch` of them are counted, returns how many hit and starts
    /// the next epoch.
    pub fn count(&mut self, hit: bool, epoch: u32) -> Option<u32> {
        self.outcomes += 1;
        self.hits += u32::from(hit);
        if self.outcomes < epoch {
            return None;
        }
        let hits = self.hits;
        self.restart();
        Some(hits)
    }

    /// Forgets the epoch under way: the next outcome is the first of a new one.
    pub fn restart(&mut self) {
        *self = HitTally::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_epoch_ends_at_its_length_with_its_hits_and_the_next_starts_empty() {
        let mut t = HitTally::default();
        assert_eq!(t.count(true, 4), None);
        assert_eq!(t.count(false, 4), None);
        assert_eq!(t.count(true, 4), None);
        assert_eq!(t.count(false, 4), Some(2));
        for _ in 0..3 {
            assert_eq!(t.count(false, 4), None);
        }
        assert_eq!(t.count(false, 4), Some(0));
        t.count(true, 4);
        t.restart();
        for _ in 0..3 {
            assert_eq!(t.count(true, 4), None);
        }
        assert_eq!(t.count(true, 4), Some(4));
    }
}
