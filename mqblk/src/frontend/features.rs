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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discard_and_write_zeroes_are_offered_only_where_the_storage_has_them() {
        let all = device_features(false, true, true);
        assert!(has(all, VIRTIO_BLK_F_DISCARD) && has(all, VIRTIO_BLK_F_WRITE_ZEROES));
        assert!(!has(all, VIRTIO_BLK_F_RO));
        // An NVMe controller without Dataset Management and Write Zeroes (ONCS bits 2 and 3).
        let none = device_features(true, false, false);
        assert!(!has(none, VIRTIO_BLK_F_DISCARD) && !has(none, VIRTIO_BLK_F_WRITE_ZEROES));
        assert!(has(none, VIRTIO_BLK_F_RO) && has(none, VIRTIO_BLK_F_FLUSH));
        let zeroes_only = device_features(false, false, true);
        assert!(
            !has(zeroes_only, VIRTIO_BLK_F_DISCARD) && has(zeroes_only, VIRTIO_BLK_F_WRITE_ZEROES)
        );
    }
}
