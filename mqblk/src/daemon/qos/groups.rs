//! Throttle groups: exports that share one set of QoS buckets, by name, as QEMU's throttle
//! groups are.
//!
//! The export registry owns them ([`Exports`](crate::daemon::Exports) holds one
//! [`ThrottleGroups`]): the exports it runs share a group by naming it. A group lives while
//! one of its members runs.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::frontend::Device;
use crate::io::Throttle;

/// The throttle groups of one export registry.
#[derive(Default)]
pub struct ThrottleGroups {
    /// The groups with at least one running member. Held while an export joins, leaves or
    /// changes its limits, so that every member hears of every change.
    groups: Mutex<Vec<Group>>,
}

/// A throttle group: its buckets and the exports that share them.
struct Group {
    name: String,
    throttle: Arc<Throttle>,
    members: Vec<Weak<Device>>,
}

/// The groups, locked for one change.
pub(super) struct Locked<'a>(MutexGuard<'a, Vec<Group>>);

impl ThrottleGroups {
    /// Locks the groups for one change (a join, a leave, new limits).
    pub(super) fn lock(&self) -> Locked<'_> {
        Locked(self.groups.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Locked<'_> {
    /// The group called `name`, if any member still runs (groups whose members all stopped are
    /// dropped, so a group restarted later begins with its new first member's limits).
    fn live(&mut self, name: &str) -> Option<&mut Group> {
        self.0.retain_mut(|g| {
            g.members.retain(|m| m.strong_count() > 0);
            !g.members.is_empty()
        });
        self.0.iter_mut().find(|g| g.name == name)
    }

    /// The buckets of the group `name`, if it has a running member.
    pub(super) fn throttle(&mut self, name: &str) -> Option<Arc<Throttle>> {
        self.live(name).map(|g| g.throttle.clone())
    }

    /// The running members of the group `name`.
    pub(super) fn members(&mut self, name: &str) -> Vec<Arc<Device>> {
        self.live(name)
            .map(|g| g.members.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }

    /// Adds `device` to the group `name` (creating it with `throttle`).
    pub(super) fn join(&mut self, name: &str, throttle: &Arc<Throttle>, device: &Arc<Device>) {
        let member = Arc::downgrade(device);
        match self.live(name) {
            Some(g) => {
                if !g.members.iter().any(|m| m.ptr_eq(&member)) {
                    g.members.push(member);
                }
            }
            None => self.0.push(Group {
                name: name.to_string(),
                throttle: throttle.clone(),
                members: vec![member],
            }),
        }
    }

    /// Removes `device` from the group `name`.
    pub(super) fn leave(&mut self, name: &str, device: &Arc<Device>) {
        let me = Arc::downgrade(device);
        if let Some(g) = self.0.iter_mut().find(|g| g.name == name) {
            g.members.retain(|m| !m.ptr_eq(&me));
        }
        self.live(name);
    }
}
