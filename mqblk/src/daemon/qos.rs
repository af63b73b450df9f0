//! Which QoS buckets each export's I/O threads admit requests through, and the throttle
//! groups: exports that share one set of buckets, by name, process-wide (as QEMU's throttle
//! groups are).
//!
//! An export without QoS keys has no buckets. One with QoS keys and no group has its own. The
//! first export of a group brings its limits; later members give the same limits, or only
//! `group=NAME`. Changing a member's limits at runtime changes the group's (as QEMU's
//! `block_set_io_throttle` does). The I/O threads of an export are only given buckets that
//! limit something: without a limit they skip admission altogether.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::error::Error;
use crate::config::{ConfigError, QosConfig};
use crate::frontend::Device;
use crate::io::Throttle;

/// A throttle group: its buckets and the exports that share them.
struct Group {
    name: String,
    throttle: Arc<Throttle>,
    members: Vec<Weak<Device>>,
}

/// The groups with at least one running member. Held while an export joins, leaves or
/// changes its limits, so that every member hears of every change.
static GROUPS: Mutex<Vec<Group>> = Mutex::new(Vec::new());

fn groups() -> MutexGuard<'static, Vec<Group>> {
    GROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Gives the I/O threads of `device` the buckets, if they limit anything.
fn hand_over(device: &Device, throttle: &Arc<Throttle>) {
    device.set_throttle(throttle.is_limited().then(|| throttle.clone()));
}

/// One export's QoS: its settings and its buckets (its own or its group's).
pub struct ExportQos {
    state: Mutex<Binding>,
}

struct Binding {
    /// The group, if the export is in one.
    group: Option<String>,
    /// The buckets; `None` for an export started without QoS keys and never given any.
    throttle: Option<Arc<Throttle>>,
}

impl ExportQos {
    /// Binds a starting export's QoS (`cfg`, already checked) and starts its device with
    /// `start`, which is handed the buckets its threads admit through.
    pub fn start(
        cfg: Option<&QosConfig>,
        start: impl FnOnce(Option<Arc<Throttle>>) -> Result<Arc<Device>, Error>,
    ) -> Result<(Arc<Device>, ExportQos), Error> {
        let Some(cfg) = cfg else {
            let device = start(None)?;
            return Ok((device, ExportQos::bound(None, None)));
        };
        let Some(name) = cfg.group.clone() else {
            let throttle = Arc::new(Throttle::new(cfg));
            let device = start(throttle.is_limited().then(|| throttle.clone()))?;
            return Ok((device, ExportQos::bound(None, Some(throttle))));
        };
        let mut groups = groups();
        let existing = live_group(&mut groups, &name);
        let throttle = match existing {
            Some(g) => {
                let theirs = g.throttle.config();
                if cfg.is_limited() && cfg.without_group() != theirs {
                    let why = format!(
                        "the group's limits are {}, not {}: give the same ones, or only \
                         group={name} to share them",
                        theirs.to_spec(),
                        cfg.without_group().to_spec()
                    );
                    return Err(Error::Qos(ConfigError::Conflict {
                        key: "group",
                        value: name,
                        why,
                    }));
                }
                g.throttle.clone()
            }
            None => Arc::new(Throttle::new(cfg)),
        };
        let device = start(throttle.is_limited().then(|| throttle.clone()))?;
        join(&mut groups, &name, &throttle, &device);
        Ok((device, ExportQos::bound(Some(name), Some(throttle))))
    }

    fn bound(group: Option<String>, throttle: Option<Arc<Throttle>>) -> ExportQos {
        ExportQos {
            state: Mutex::new(Binding { group, throttle }),
        }
    }

    fn binding(&self) -> MutexGuard<'_, Binding> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The export's QoS now, as `ExportConfig::qos` holds it: `None` for an export that has
    /// never had QoS settings.
    pub fn current(&self) -> Option<QosConfig> {
        let bound = {
            let b = self.binding();
            b.throttle.is_some() || b.group.is_some()
        };
        bound.then(|| self.config())
    }

    /// The export's QoS now: its limits (its group's, if in one) and its group.
    pub fn config(&self) -> QosConfig {
        let b = self.binding();
        let mut cfg = b.throttle.as_ref().map(|t| t.config()).unwrap_or_default();
        cfg.group = b.group.clone();
        cfg
    }

    /// Applies new QoS settings to a running export (`device`): new limits take effect at
    /// once (waiting requests ask the new buckets within `io::throttle::MAX_WAIT`). With a
    /// group, the export joins it; limits given with a group become the group's, for every
    /// member, while only `group=NAME` shares the group's limits. Without a group, the export
    /// leaves any group for buckets of its own.
    pub fn set(&self, device: &Arc<Device>, cfg: &QosConfig) -> Result<(), Error> {
        cfg.check().map_err(Error::Qos)?;
        let mut groups = groups();
        let mut b = self.binding();
        if b.group.is_some() && b.group != cfg.group {
            let old = b.group.take().expect("checked");
            leave(&mut groups, &old, device);
            b.throttle = None;
        }
        match &cfg.group {
            None => {
                let throttle = match &b.throttle {
                    Some(t) => {
                        t.set_config(cfg);
                        t.clone()
                    }
                    None => Arc::new(Throttle::new(cfg)),
                };
                hand_over(device, &throttle);
                b.throttle = Some(throttle);
            }
            Some(name) => {
                let throttle = match live_group(&mut groups, name) {
                    Some(g) => g.throttle.clone(),
                    None => Arc::new(Throttle::new(cfg)),
                };
                join(&mut groups, name, &throttle, device);
                if cfg.is_limited() {
                    throttle.set_config(cfg);
                }
                let g = live_group(&mut groups, name).expect("just joined");
                for member in g.members.iter().filter_map(Weak::upgrade) {
                    hand_over(&member, &throttle);
                }
                b.group = Some(name.clone());
                b.throttle = Some(throttle);
            }
        }
        Ok(())
    }

    /// Leaves the export's group (before its device stops): no group change reaches its
    /// threads any more.
    pub fn leave(&self, device: &Arc<Device>) {
        let mut groups = groups();
        if let Some(name) = self.binding().group.take() {
            leave(&mut groups, &name, device);
        }
    }
}

/// The group called `name`, if any member still runs (groups whose members all stopped are
/// dropped, so a group restarted later begins with its new first member's limits).
fn live_group<'a>(groups: &'a mut Vec<Group>, name: &str) -> Option<&'a mut Group> {
    groups.retain_mut(|g| {
        g.members.retain(|m| m.strong_count() > 0);
        !g.members.is_empty()
    });
    groups.iter_mut().find(|g| g.name == name)
}

/// Adds `device` to the group `name` (creating it with `throttle`).
fn join(groups: &mut Vec<Group>, name: &str, throttle: &Arc<Throttle>, device: &Arc<Device>) {
    let member = Arc::downgrade(device);
    match live_group(groups, name) {
        Some(g) => {
            if !g.members.iter().any(|m| m.ptr_eq(&member)) {
                g.members.push(member);
            }
        }
        None => groups.push(Group {
            name: name.to_string(),
            throttle: throttle.clone(),
            members: vec![member],
        }),
    }
}

/// Removes `device` from the group `name`.
fn leave(groups: &mut Vec<Group>, name: &str, device: &Arc<Device>) {
    let me = Arc::downgrade(device);
    if let Some(g) = groups.iter_mut().find(|g| g.name == name) {
        g.members.retain(|m| !m.ptr_eq(&me));
    }
    live_group(groups, name);
}
