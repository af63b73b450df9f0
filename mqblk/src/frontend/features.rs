//! What an export offers the frontend: virtio feature bits and vhost-user protocol features.

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// The virtio features an export offers: discard and write-zeroes where its storage has them.
pub fn device_features(readonly: bool, discard: bool, write_zeroes: bool) -> u64 {
    let mut f = 1u64 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | 1 << VIRTIO_BLK_F_SEG_MAX
        | 1 << VIRTIO_BLK_F_BLK_SIZE
        | 1 << VIRTIO_BLK_F_TOPOLOGY
        | 1 << VIRTIO_BLK_F_FLUSH
        | 1 << VIRTIO_BLK_F_CONFIG_WCE
        | 1 << VIRTIO_BLK_F_MQ
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        // Live migration: mqblk marks what it writes in the frontend's dirty log.
        | VhostUserVirtioFeatures::LOG_ALL.bits();
    if readonly {
        f |= 1 << VIRTIO_BLK_F_RO;
    }
    if discard {
        f |= 1 << VIRTIO_BLK_F_DISCARD;
    }
    if write_zeroes {
        f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
    }
    f
}

/// The vhost-user protocol features an export offers.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::LOG_SHMFD
}

/// Whether `features` (acked by the frontend) include virtio feature `bit`.
pub fn has(features: u64, bit: u32) -> bool {
    features & (1 << bit) != 0
}
