//! Image formats: how guest offsets map to places in the storage, and the metadata that says
//! so. A format owns its metadata; the I/O threads still move the data, on their own rings.

pub mod qcow2;
