//! Image formats, as far as mqblk reads them itself (headers, before anything is opened). The
//! formats are served by engines (`engine::qcow2`): a format owns its metadata, and the I/O
//! threads still move the data, on their own rings.

pub mod qcow2;
