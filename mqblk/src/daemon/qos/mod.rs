//! Which QoS buckets each export's I/O threads admit requests through.
//!
//! An export without QoS keys has no buckets. One with QoS keys and no group has its own. One
//! in a throttle group ([`groups`]) shares the group's: the first export of a group brings its
//! limits; later members give the same limits, or only `group=NAME`. Changing a member's
//! limits at runtime changes the group's (as QEMU's `block_set_io_throttle` does). The I/O
//! threads of an export are only given buckets that limit something: without a limit they
//! skip admission altogether.

pub mod groups;

use std::sync::{Arc, Mutex, MutexGuard};

use super::error::Error;
use crate::config::{ConfigError, QosConfig};
use crate::frontend::Device;
use crate::io::Throttle;
use groups::ThrottleGroups;

/// Gives the I/O threads of `device` the buckets, if they limit anything.
fn hand_over(device: &Device, throttle: &Arc<Throttle>) {
    device.set_throttle(throttle.is_limited().then(|| throttle.clone()));
}

/// One export's QoS: its settings and its buckets (its own or its group's).
pub struct ExportQos {
    state: Mutex<Binding>,
    /// The throttle groups of the registry the export runs in.
    groups: Arc<ThrottleGroups>,
}

struct Binding {
    /// The group, if the export is in one.
    group: Option<String>,
    /// The buckets; `None` for an export started without QoS keys and never given any.
    throttle: Option<Arc<Throttle>>,
}

impl ExportQos {
    /// Binds a starting export's QoS (`cfg`, already checked), in a group of `groups` if it
    /// names one, and starts its device with `start`, which is handed the buckets its threads
    /// admit through.
    pub fn start(
        groups: &Arc<ThrottleGroups>,
        cfg: Option<&QosConfig>,
        start: impl FnOnce(Option<Arc<Throttle>>) -> Result<Arc<Device>, Error>,
    ) -> Result<(Arc<Device>, ExportQos), Error> {
        let Some(cfg) = cfg else {
            let device = start(None)?;
            return Ok((device, ExportQos::bound(groups, None, None)));
        };
        let Some(name) = cfg.group.clone() else {
            let throttle = Arc::new(Throttle::new(cfg));
            let device = start(throttle.is_limited().then(|| throttle.clone()))?;
            return Ok((device, ExportQos::bound(groups, None, Some(throttle))));
        };
        let mut locked = groups.lock();
        let throttle = match locked.throttle(&name) {
            Some(theirs) => {
                let limits = theirs.config();
                if cfg.is_limited() && cfg.without_group() != limits {
                    let why = format!(
                        "the group's limits are {}, not {}: give the same ones, or only \
                         group={name} to share them",
                        limits.to_spec(),
                        cfg.without_group().to_spec()
                    );
                    return Err(Error::Qos(ConfigError::Conflict {
                        key: "group",
                        value: name,
                        why,
                    }));
                }
                theirs
            }
            None => Arc::new(Throttle::new(cfg)),
        };
        let device = start(throttle.is_limited().then(|| throttle.clone()))?;
        locked.join(&name, &throttle, &device);
        Ok((device, ExportQos::bound(groups, Some(name), Some(throttle))))
    }

    fn bound(
        groups: &Arc<ThrottleGroups>,
        group: Option<String>,
        throttle: Option<Arc<Throttle>>,
    ) -> ExportQos {
        ExportQos {
            state: Mutex::new(Binding { group, throttle }),
            groups: groups.clone(),
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
    /// once (waiting requests ask the new buckets within `io::qos::throttle::MAX_WAIT`). With a
    /// group, the export joins it; limits given with a group become the group's, for every
    /// member, while only `group=NAME` shares the group's limits. Without a group, the export
    /// leaves any group for buckets of its own.
    pub fn set(&self, device: &Arc<Device>, cfg: &QosConfig) -> Result<(), Error> {
        cfg.check().map_err(Error::Qos)?;
        let mut groups = self.groups.lock();
        let mut b = self.binding();
        if b.group.is_some() && b.group != cfg.group {
            let old = b.group.take().expect("checked");
            groups.leave(&old, device);
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
                let throttle = groups
                    .throttle(name)
                    .unwrap_or_else(|| Arc::new(Throttle::new(cfg)));
                groups.join(name, &throttle, device);
                if cfg.is_limited() {
                    throttle.set_config(cfg);
                }
                for member in groups.members(name) {
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
        let mut groups = self.groups.lock();
        if let Some(name) = self.binding().group.take() {
            groups.leave(&name, device);
        }
    }
}
