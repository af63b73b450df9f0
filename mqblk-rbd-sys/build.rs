//! Generates the bindings from the installed headers at build time, so that they always match
//! the librbd the daemon links against (Debian 12: Ceph 16, Pacific). The headers come from
//! `librbd-dev` and `librados-dev` (`.ci/setup` installs them); bindgen needs libclang
//! (`libclang-dev`).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rustc-link-lib=rbd");
    println!("cargo:rustc-link-lib=rados");
    let include = ["/usr/include/rbd/librbd.h", "/usr/include/rados/librados.h"];
    if include.iter().any(|h| !std::path::Path::new(h).exists()) {
        panic!(
            "the rbd feature needs librbd's and librados's headers: apt-get install librbd-dev \
             librados-dev libclang-dev (or run .ci/setup)"
        );
    }
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        // The C entry points the engine calls, and the types and constants they need.
        .allowlist_function("rados_(create2|conf_read_file|conf_set|conf_get|connect|shutdown|ioctx_create|ioctx_destroy|ioctx_set_namespace|pool_lookup)")
        .allowlist_function("rbd_(open|open_read_only|close|create4|get_size|get_features|resize|set_image_notification|poll_io_events)")
        .allowlist_function("rbd_image_options_(create|destroy|set_uint64)")
        .allowlist_function("rbd_aio_(readv|writev|flush|discard|write_zeroes|create_completion|release|get_return_value|get_arg)")
        .allowlist_type("rbd_image_option_t")
        .allowlist_var("EVENT_TYPE_EVENTFD|RBD_.*")
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .expect("bindgen could not generate the librbd bindings");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings
        .write_to_file(out)
        .expect("could not write the bindings");
}
